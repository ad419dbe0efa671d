"""The baseline a user would otherwise write for the sparse attention op (MODEL.md §3.9): PyTorch on
the same GPU, the same shapes and access patterns as tests/bench/bench_attn.c (8 heads x 512
channels, MQA with K = V, 640 index entries a query row, the sink, scale 512^-0.5):

  torch_eager: gather the rows (kv[idx]), scores by torch.matmul in bf16, the -1 entries masked,
      the sink as one more logit per head, softmax in fp32, P in bf16 times the rows (the op, sink
      included, written plainly);
  torch_sdpa: the same gather, then F.scaled_dot_product_attention with the mask: the fused kernel
      torch picks at head dim 512 (no sink: SDPA has no sink term, so this is a lower bound on what
      a fused torch op would take).

Both timed as bench_attn times ours: the calls of one pass over the index sets (16 at decode rows,
one at prefill rows) captured in a CUDA graph and replayed, ms per call; and issued eagerly.
Writes CSV rows in bench_attn's columns (argv: OUT.csv [rows list]), appended when OUT.csv is
bench_attn's (same header), so one file holds both sides of the run.

  python3 tests/bench/torch_attn_baseline.py OUT.csv [1,8,64,256,2048]
  python3 tests/bench/torch_attn_baseline.py --check DIR

--check DIR (numpy only, no GPU): DIR from `bench_attn --rows 8 --dump DIR`; recomputes the op
in float64 from the dumped inputs and checks that bench_attn's output is it within bf16 rounding
(and that the same check fails for the op without the sink or without the mask, so it could tell
them apart). Exit 1 when it does not hold."""
import sys

from torch_bench_util import bf16_load, open_csv, time_pass

HEADS, HD, WIN, TOPK = 8, 512, 128, 512
N_IDX = WIN + TOPK
NSETS, DECODE_MAX_T, PREFILL_CMP, POOL = 16, 256, 1024, 262144
# bench_attn's output against the float64 op: bf16 inputs are exact, so the differences are P's
# bf16 rounding per entry (2^-9 relative), the MMA's sum order and o's bf16 rounding (2^-9 of |o|):
# 2^-7 of the output's largest magnitude holds those with room; leaving out the sink (heads with
# sink up to 4.5 against 640 entries of weight ~1) moves o by several percent, the mask more
CHECK_REL = 2.0 ** -7


def check(d):
    import numpy as np
    T, H, hd, n, scale = open(f"{d}/meta.txt").read().split()
    T, H, hd, n, scale = int(T), int(H), int(hd), int(n), float(scale)
    q = bf16_load(np, f"{d}/q.bin", (T, H, hd))
    k = bf16_load(np, f"{d}/k.bin", (T, n, hd))
    idx = np.fromfile(f"{d}/idx.bin", np.int32).reshape(T, n)
    sink = np.fromfile(f"{d}/sink.bin", np.float32).astype(np.float64)
    ours = bf16_load(np, f"{d}/o.bin", (T, H, hd))

    def op(with_sink, with_mask):
        s = np.einsum("thd,tnd->thn", q, k) * scale
        if with_mask:
            s = np.where(idx[:, None, :] >= 0, s, -np.inf)
        m = s.max(axis=-1, keepdims=True)
        if with_sink:
            m = np.maximum(m, sink[None, :, None])
        p = np.exp(s - m)
        den = p.sum(axis=-1, keepdims=True)
        if with_sink:
            den = den + np.exp(sink[None, :, None] - m)
        return np.einsum("thn,tnd->thd", p / den, k)

    ref = op(True, True)
    mag = np.abs(ref).max()
    err = np.abs(ours - ref).max() / mag
    err_nosink = np.abs(ours - op(False, True)).max() / mag
    err_nomask = np.abs(ours - op(True, False)).max() / mag
    ok = err <= CHECK_REL < min(err_nosink, err_nomask)
    print(f"check {d}: max |ours - op| / max |op| = {err:.3e} (bound {CHECK_REL:.3e}); "
          f"against the op without the sink {err_nosink:.3e}, without the mask {err_nomask:.3e}: "
          f"{'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


def make_index(torch, T, gen):
    """One index set [T][N_IDX] int32, as bench_attn's make_index (its own random draws)."""
    idx = torch.empty(T, N_IDX, dtype=torch.int32)
    for t in range(T):
        if T <= DECODE_MAX_T:
            w0 = int(torch.randint(0, POOL - WIN, (1,), generator=gen))
            young = int(torch.randint(0, WIN, (1,), generator=gen)) if t % 4 == 3 else 0
            win = torch.arange(w0, w0 + WIN, dtype=torch.int32)
            win[:young] = -1
            cmp = torch.randperm(POOL, generator=gen)[:TOPK].sort().values.to(torch.int32)
        else:
            win = torch.arange(t - WIN + 1, t + 1, dtype=torch.int32)
            win[win < 0] = -1
            cmp = (T + torch.randperm(PREFILL_CMP, generator=gen)[:TOPK].sort().values).to(torch.int32)
        idx[t, :WIN] = win
        idx[t, WIN:] = cmp
    return idx


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--check":
        return check(sys.argv[2])
    import torch
    import torch.nn.functional as F
    path = sys.argv[1] if len(sys.argv) > 1 else "cuda_attn.csv"
    rows = [int(v) for v in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 8, 64, 256, 2048]
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(0)
    gen = torch.Generator().manual_seed(7)
    scale = HD ** -0.5
    kv = (torch.rand(POOL, HD, generator=gen) * 2 - 1).to(torch.bfloat16).to(dev)
    sink = torch.tensor([1.5 * (h - 4) for h in range(HEADS)], dtype=torch.float32, device=dev)

    def eager_op(q, idx):
        k = kv[idx.clamp(min=0).long()]                                  # [T, n, hd]
        s = torch.matmul(q, k.transpose(1, 2)).float() * scale           # [T, H, n]
        s = s.masked_fill((idx < 0)[:, None, :], float("-inf"))
        s = torch.cat([s, sink[None, :, None].expand(s.shape[0], HEADS, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :-1].to(torch.bfloat16)
        return torch.matmul(p, k)                                        # [T, H, hd]

    def sdpa_op(q, idx):
        k = kv[idx.clamp(min=0).long()][:, None].expand(-1, HEADS, -1, -1)  # [T, H, n, hd]
        mask = (idx >= 0)[:, None, None, :]
        return F.scaled_dot_product_attention(q[:, :, None, :], k, k, attn_mask=mask, scale=scale)

    out = open_csv(path, "backend,device,pattern,rows,heads,hd,n_idx,path,ms_per_call,bytes,gb_per_s,"
                         "fraction_of_copy_bw,copy_gb_per_s,tflops\n")
    for T in rows:
        decode = T <= DECODE_MAX_T
        ns = NSETS if decode else 1
        sets = [(make_index(torch, T, gen).to(dev),
                 (torch.rand(T, HEADS, HD, generator=gen) * 2 - 1).to(torch.bfloat16).to(dev)) for _ in range(ns)]
        valid = sum(int((i >= 0).sum()) for i, _ in sets) / ns
        nbytes = valid * HD * 2 + 2 * T * HEADS * HD * 2 + T * N_IDX * 4 if decode else 0
        flops = 4.0 * T * HEADS * N_IDX * HD
        for pname, fn in (("torch_eager", eager_op), ("torch_sdpa", sdpa_op)):
            def run(fn=fn):
                for idx, q in sets:
                    fn(q, idx)
            ms_graph, ms_eager = time_pass(torch, run, ns, 20)
            for path, ms in ((pname, ms_graph), (pname + "_nograph", ms_eager)):
                gbs = nbytes / (ms * 1e-3) / 1e9
                tf = flops / (ms * 1e-3) / 1e12
                out.write(f"torch {torch.__version__},{name},{'decode' if decode else 'prefill'},{T},{HEADS},{HD},"
                          f"{N_IDX},{path},{ms:.5f},{nbytes:.0f},{gbs:.1f},0,0,{tf:.3f}\n")
                print(f"  {'decode' if decode else 'prefill':7s} {T:5d} {path:20s} {ms:10.4f} ms {gbs:8.0f} GB/s "
                      f"{tf:8.2f} TFLOP/s")
        out.flush()
        del sets
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
