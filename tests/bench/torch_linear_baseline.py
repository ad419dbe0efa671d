"""The baseline a user would otherwise write: PyTorch on the same GPU doing the same decode-shape
linear layers with the weights dequantized to bf16 (torch.matmul, cuBLAS). Same shapes and T as
tests/bench/bench_linear_cuda.c; weights rotate over enough copies to stream from HBM.
Writes a CSV (argv[1]). Run on the GPU machine: python3 tests/bench/torch_linear_baseline.py OUT.csv"""
import sys

import torch

SHAPES = [("wq_a", 1280, 5120), ("wkv", 512, 5120), ("wq_b", 4096, 1280), ("wo_b", 640, 8192),
          ("sh_w1", 2304, 5120), ("sh_w2", 5120, 2304), ("exp_w1", 2304, 5120), ("exp_w2", 5120, 2304)]


def main():
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    name = torch.cuda.get_device_name(0)
    out = open(sys.argv[1] if len(sys.argv) > 1 else "torch_linear_decode.csv", "w")
    out.write("device,op,n,k,T,us_per_call,bytes,gb_per_s,graph_us_per_call,graph_gb_per_s,torch_version\n")
    for op, n, k in SHAPES:
        copies = int(4 * l2 / (n * k * 2)) + 2
        ws = [torch.randn(k, n, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        for T in (1, 8, 16):
            x = torch.randn(T, k, device=dev, dtype=torch.bfloat16)
            for w in ws:
                torch.matmul(x, w)
            torch.cuda.synchronize()
            reps = copies * ((200 + copies - 1) // copies)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for i in range(reps):
                torch.matmul(x, ws[i % copies])
            e1.record()
            torch.cuda.synchronize()
            us = 1000.0 * e0.elapsed_time(e1) / reps
            nbytes = n * k * 2 + 2 * (T * k + T * n)
            # the same calls replayed from a CUDA graph (no launch overhead)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for w in ws:
                    torch.matmul(x, w)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for w in ws:
                    torch.matmul(x, w)
            g.replay()
            torch.cuda.synchronize()
            greps = (200 + copies - 1) // copies
            e0.record()
            for _ in range(greps):
                g.replay()
            e1.record()
            torch.cuda.synchronize()
            gus = 1000.0 * e0.elapsed_time(e1) / (greps * copies)
            out.write(f"{name},{op},{n},{k},{T},{us:.3f},{nbytes},{nbytes / us / 1e3:.1f},{gus:.3f},"
                      f"{nbytes / gus / 1e3:.1f},{torch.__version__}\n")
            print(f"  {op:7s} {n:6d} {k:6d} {T:3d} {us:9.2f} us {nbytes / us / 1e3:8.0f} GB/s  "
                  f"graph {gus:8.2f} us {nbytes / gus / 1e3:8.0f} GB/s")
        del ws
    out.close()


if __name__ == "__main__":
    main()
