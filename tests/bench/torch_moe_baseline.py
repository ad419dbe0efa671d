"""The baseline a user would otherwise write for the routed experts op (backend.h moe_experts): PyTorch
on the same GPU, the same shapes and routing as tests/bench/bench_moe.c (48 local experts of 384,
top-6 uniform, w1/w3 [2304, 5120] and w2 [5120, 2304], SwiGLU limit 10), with the FP4 weights
dequantized to bf16 once and the DeepSeek reference's loop over the experts: for each local expert
with pairs, gather its tokens, x·w1ᵀ and x·w3ᵀ by torch.matmul, the clamps, silu(g)·u times the
routing weight, ·w2ᵀ into the pairs' slots (torch_loop). The routing of each set is fixed, so the
calls of one pass over the sets are captured in a CUDA graph and replayed (the index tensors are
built once, outside the timing), ms per call; and issued eagerly (torch_loop_nograph). No
activation quantization (the reference quantizes x and h to FP8 per 32 before its FP4 GEMMs; a
user with bf16 weights would not). Bytes count the bf16 weights this path reads.

  python3 tests/bench/torch_moe_baseline.py OUT.csv [tokens list]
  python3 tests/bench/torch_moe_baseline.py --check DIR

Rows are appended to OUT.csv when it is bench_moe's (same header). --check DIR (numpy only, no
GPU): DIR from `bench_moe --tokens 8 --dump DIR`; recomputes every local pair in float64 with the
reference's roundings (x and h through act_quant's FP8 per 32, g, u, h and y rounded to bf16) and
requires bench_moe's output within 2^-6 of its largest magnitude, while the op without the routing
weight, or without the activation quantization, is outside that bound. Exit 1 otherwise."""
import sys

from torch_bench_util import bf16_load, open_csv, time_pass

E_TOTAL, TOPK, N_LOCAL, D, INTER, LIMIT = 384, 6, 48, 5120, 2304, 10.0
NSETS, DECODE_MAX_T = 16, 256
CHECK_REL = 2.0 ** -6
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def bf16_round(np, v):
    """float -> the nearest bf16 (ties to even), as float64."""
    b = np.asarray(v, np.float32).view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


def e4m3_rne(np, v):
    """|v| <= 448 -> the nearest e4m3 value (ties to even): 3 mantissa bits, subnormals below 2^-6."""
    a = np.abs(v)
    q = 2.0 ** (np.floor(np.log2(np.maximum(a, 2.0 ** -6))) - 3)
    return np.sign(v) * np.round(a / q) * q


def act_quant(np, x):
    """MODEL.md §3.0 act_quant(x, 32): the dequantized values, per 32 along the last axis."""
    g = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.maximum(np.abs(g).max(axis=-1, keepdims=True), 1e-4).astype(np.float32)
    t = (amax * np.float32(1.0 / 448.0)).astype(np.float32).view(np.uint32)
    s = 2.0 ** (((t >> 23) & 255).astype(np.int64) - 127 + ((t & 0x7FFFFF) != 0))
    return (e4m3_rne(np, np.clip(g / s, -448.0, 448.0)) * s).reshape(x.shape)


def fp4_dequant(np, w, s, n, k):
    """packed e2m1 [n, k/2] (low nibble = even k) + e8m0 [n, k/32] -> float64 [n, k]"""
    lut = np.array(E2M1 + [-v for v in E2M1])
    codes = np.stack([w & 15, w >> 4], axis=-1).reshape(n, k)
    return lut[codes] * np.repeat(2.0 ** (s.astype(np.float64) - 127), 32, axis=1)


def check(d):
    import numpy as np
    T, k, Dd, I, nd, limit = open(f"{d}/meta.txt").read().split()
    T, k, Dd, I, nd, limit = int(T), int(k), int(Dd), int(I), int(nd), float(limit)
    x = bf16_load(np, f"{d}/x.bin", (T, Dd))
    idx = np.fromfile(f"{d}/idx.bin", np.int32).reshape(T, k)
    wts = np.fromfile(f"{d}/wts.bin", np.float32).astype(np.float64).reshape(T, k)
    ours = bf16_load(np, f"{d}/y.bin", (T, k, Dd))
    w1 = np.fromfile(f"{d}/w1.bin", np.uint8).reshape(nd, I, Dd // 2)
    w3 = np.fromfile(f"{d}/w3.bin", np.uint8).reshape(nd, I, Dd // 2)
    w2 = np.fromfile(f"{d}/w2.bin", np.uint8).reshape(nd, Dd, I // 2)
    s1 = np.fromfile(f"{d}/s1.bin", np.uint8).reshape(nd, I, Dd // 32)
    s3 = np.fromfile(f"{d}/s3.bin", np.uint8).reshape(nd, I, Dd // 32)
    s2 = np.fromfile(f"{d}/s2.bin", np.uint8).reshape(nd, Dd, I // 32)
    W1 = [fp4_dequant(np, w1[e], s1[e], I, Dd) for e in range(nd)]
    W3 = [fp4_dequant(np, w3[e], s3[e], I, Dd) for e in range(nd)]
    W2 = [fp4_dequant(np, w2[e], s2[e], Dd, I) for e in range(nd)]

    def op(quant, weight):
        y = np.zeros((T, k, Dd))
        for t in range(T):
            xq = act_quant(np, x[t]) if quant else x[t]
            for j in range(k):
                e = idx[t, j]
                if e < 0:
                    continue
                g = np.minimum(bf16_round(np, W1[e] @ xq), limit)
                u = np.clip(bf16_round(np, W3[e] @ xq), -limit, limit)
                h = g / (1.0 + np.exp(-g)) * u * (wts[t, j] if weight else 1.0)
                hb = bf16_round(np, h)
                y[t, j] = bf16_round(np, W2[e] @ (act_quant(np, hb) if quant else hb))
        return y

    ref = op(True, True)
    mag = np.abs(ref).max()
    live = (idx >= 0).sum()
    err = np.abs(ours - ref).max() / mag
    err_now = np.abs(ours - op(True, False)).max() / mag
    err_noq = np.abs(ours - op(False, True)).max() / mag
    ok = live > 0 and err <= CHECK_REL < min(err_now, err_noq)
    print(f"check {d}: {live} local pairs, max |ours - op| / max |op| = {err:.3e} (bound {CHECK_REL:.3e}); against "
          f"the op without the routing weight {err_now:.3e}, without the activation quantization {err_noq:.3e}: "
          f"{'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--check":
        return check(sys.argv[2])
    import torch
    import torch.nn.functional as F
    path = sys.argv[1] if len(sys.argv) > 1 else "cuda_moe.csv"
    toks = [int(v) for v in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 8, 64, 256, 2048]
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(0)
    gen = torch.Generator(device=dev).manual_seed(11)
    lut = torch.tensor(E2M1 + [-v for v in E2M1], device=dev)

    def fp4_like(n, k):  # random e2m1 codes times 2^-8 .. 2^-6 per 32, as bf16 (bench_moe's values)
        w = lut[torch.randint(0, 16, (n, k), generator=gen, device=dev)]
        s = 2.0 ** (torch.randint(-8, -5, (n, k // 32, 1), generator=gen, device=dev).float())
        return (w.view(n, k // 32, 32) * s).view(n, k).to(torch.bfloat16)

    W1 = torch.stack([fp4_like(INTER, D) for _ in range(N_LOCAL)])
    W3 = torch.stack([fp4_like(INTER, D) for _ in range(N_LOCAL)])
    W2 = torch.stack([fp4_like(D, INTER) for _ in range(N_LOCAL)])
    out = open_csv(path, "backend,device,tokens,d,inter,n_local,pairs,experts,path,ms_per_call,bytes,gb_per_s,"
                         "fraction_of_copy_bw,copy_gb_per_s,tflops\n")

    def moe_op(x, plan, y):
        for e, ti, si, w in plan:
            xe = x[ti]
            g = torch.matmul(xe, W1[e].t()).clamp(max=LIMIT)
            u = torch.matmul(xe, W3[e].t()).clamp(-LIMIT, LIMIT)
            h = (F.silu(g.float()) * u.float() * w[:, None]).to(torch.bfloat16)
            y[ti, si] = torch.matmul(h, W2[e].t())

    for T in toks:
        ns = NSETS if T <= DECODE_MAX_T else 1
        sets, pairs, experts = [], 0, 0
        for _ in range(ns):
            idx = torch.stack([torch.randperm(E_TOTAL, device=dev, generator=gen)[:TOPK] for _ in range(T)])
            wts = torch.rand(T, TOPK, device=dev, generator=gen)
            x = (torch.rand(T, D, device=dev, generator=gen) * 2 - 1).to(torch.bfloat16)
            plan = []
            for e in range(N_LOCAL):
                ti, si = (idx == e).nonzero(as_tuple=True)
                if ti.numel():
                    plan.append((e, ti, si, wts[ti, si]))
            pairs += sum(p[1].numel() for p in plan)
            experts += len(plan)
            sets.append((x, plan, torch.zeros(T, TOPK, D, device=dev, dtype=torch.bfloat16)))
        pairs, experts = pairs / ns, experts / ns
        nbytes = experts * 3 * INTER * D * 2 + 2 * T * D + 2 * pairs * D
        flops = pairs * 6.0 * INTER * D
        def run():
            for x, plan, y in sets:
                moe_op(x, plan, y)
        ms_graph, ms_eager = time_pass(torch, run, ns, 10)
        for p, ms in (("torch_loop", ms_graph), ("torch_loop_nograph", ms_eager)):
            gbs = nbytes / (ms * 1e-3) / 1e9
            tf = flops / (ms * 1e-3) / 1e12
            out.write(f"torch {torch.__version__},{name},{T},{D},{INTER},{N_LOCAL},{pairs:.2f},{experts:.2f},{p},"
                      f"{ms:.5f},{nbytes:.0f},{gbs:.1f},0,0,{tf:.3f}\n")
            print(f"  {T:6d} {pairs:7.1f} {experts:7.1f} {p:20s} {ms:10.4f} ms {gbs:8.0f} GB/s {tf:8.2f} TFLOP/s")
        out.flush()
        del sets
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
