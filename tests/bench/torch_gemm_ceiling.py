"""The compute ceiling of the GPU for the prefill target: the cuBLAS bf16 GEMM rate, through
torch.matmul (which calls cuBLAS), on square problems large enough to saturate the tensor cores.
Writes a CSV (argv[1]): device,m,n,k,ms,tflops,torch_version, and prints the best rate.
Run on the GPU machine: python3 tests/bench/torch_gemm_ceiling.py OUT.csv"""
import sys

import torch


def main():
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(0)
    out = open(sys.argv[1] if len(sys.argv) > 1 else "cuda_gemm_ceiling.csv", "w")
    out.write("device,m,n,k,ms,tflops,torch_version\n")
    best = 0.0
    for m in (4096, 8192, 16384):
        a = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
        b = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
        for _ in range(3):
            torch.matmul(a, b)
        torch.cuda.synchronize()
        reps = 20
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            torch.matmul(a, b)
        e1.record()
        torch.cuda.synchronize()
        ms = e0.elapsed_time(e1) / reps
        tflops = 2.0 * m * m * m / (ms * 1e-3) / 1e12
        best = max(best, tflops)
        out.write("%s,%d,%d,%d,%.4f,%.1f,%s\n" % (name, m, m, m, ms, tflops, torch.__version__))
        del a, b
    out.close()
    print("# cuBLAS bf16 GEMM (torch.matmul): %.0f TFLOP/s at best on %s" % (best, name))


if __name__ == "__main__":
    main()
