/* Decode-shape benchmark of the SM80 FP8/FP4 linear kernels (make bench, GPU machine).
 * First the ceiling: device-to-device copy bandwidth (cudaMemcpyDeviceToDevice of 1 GiB, bytes
 * read + written / time). Then each TP8 per-rank V4.1-Flash decode shape at T = 1, 8, 16, 64, 256, on
 * both paths — exact (linear_sm80.cu, the CPU's k order, 16 rows per launch as cuda_op_linear
 * chunks them), mma (linear_mma_sm80.cu: the decode tiling up to 256 rows, the prefill tiling
 * above) and mma128 (the prefill tiling forced at T >= 16: which tiling a T should take): the kernel's weight+scale+activation bytes / time, as a fraction of the copy bandwidth. Weights
 * rotate over enough copies (> 4x the L2) that every call streams from HBM. Writes a CSV (argv[1])
 * with the device name, and prints a table. Timings: cudaEvent over >= 200 calls after warmup,
 * both as plain launches (host launch overhead included) and replayed from a CUDA graph of one
 * pass over all copies (how decode steps run: the kernels' own time).
 * With a list of token counts after the CSV path (`bench_linear_cuda out.csv 2048,8192`): the mma
 * path alone at those T (prefill sizes), where the rate that matters is the tensor-core work,
 * printed and stored (column tflops) as TFLOP/s of 2·T·n·k per call. With `--forms` after the list
 * (`bench_linear_cuda out.csv 33,48,64,96,128 --forms`): at those T the FP8 shapes also on each
 * forced decode form (paths mma_mt1 / mma_mt2 / mma_mt4: one, two or four m16 tiles a CTA,
 * CUDA_MMA_DECODE_MT*) and the 128 x 128 tiling (mma128), to choose the forms' row ranges. With
 * `--tiles` instead: every FP8 tiling forced at those T (mma128, the decode forms up to 256 rows,
 * mma128x64, mma64x64: CUDA_MMA_PREFILL_*), the data behind CUDA_MMA_AUTO's choice. Runs with a T
 * list also time the shared expert's w1 | w3 as one pair call (sh_w13) and the Engram projection
 * [25600, 6144] (engram_wkv, whole on the stage that holds it). With `--mma-peak` instead of the
 * list (`bench_linear_cuda out.csv --mma-peak`): the roof of the tensor-core paths, mma.sync
 * m16n8k16 bf16 issued back to back (2, 4 and 8 chains a warp, 1 to 8 CTAs of 8 warps an SM), in
 * TFLOP/s, the CSV's rows then device,ilp,ctas_per_sm,ms,tflops. */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "bench/bench_util.h"
#include "cuda/cuda_linear.h"
#include "cuda/linear_mma.h"

#define CK(x) BENCH_CK(x)

/* One linear call as the CUDA backend makes it on each path; pair: the shape is two FP8 weights of
 * n / 2 rows each, one cuda_linear_mma_pair call (mma paths only). */
static void call_linear(int mma, int fmt, int pair, uint16_t *y, const uint16_t *x, int64_t T, const uint8_t *w, const uint8_t *s,
                        int64_t n, int64_t k, int64_t ld, int64_t s_ld, void *ws, void *st) {
    if (mma) { /* 1: the default tiling for T, 2: the 128 x 128 tiling at any T, 3-5: a forced FP8 decode form,
                * 6-7: the 128 x 64 and 64 x 64 tiles at any T */
        const int tiling = mma == 2   ? CUDA_MMA_PREFILL
                           : mma >= 6 ? CUDA_MMA_PREFILL_128x64 + (mma - 6)
                           : mma >= 3 ? CUDA_MMA_DECODE_MT1 + (mma - 3)
                                      : CUDA_MMA_AUTO;
        if (pair) {
            const int64_t h = n / 2;
            cuda_linear_mma_pair(tiling, WF_FP8, y, x, T, w, s, h, w + h * ld, s + h / 32 * s_ld, h, k, ld, s_ld, ws, st);
            return;
        }
        cuda_linear_mma_tiling(tiling, fmt, y, x, T, w, s, n, k, ld, s_ld, ws, st);
        return;
    }
    for (int64_t t0 = 0; t0 < T; t0 += CUDA_LINEAR_MAX_T) {
        int64_t nt = T - t0 < CUDA_LINEAR_MAX_T ? T - t0 : CUDA_LINEAR_MAX_T;
        (fmt == WF_FP4 ? cuda_linear_fp4 : cuda_linear_fp8)(y + t0 * n, x + t0 * k, nt, w, s, n, k, ld, s_ld, ws, st);
    }
}

int main(int argc, char **argv) {
    if (cuda_device_count() < 1) {
        fprintf(stderr, "bench: no GPU\n");
        return 2;
    }
    struct cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    double bw = bench_copy_bandwidth();
    FILE *f = fopen(argc > 1 ? argv[1] : "cuda_linear_decode.csv", "w");
    if (!f) return 2;
    if (argc > 2 && strcmp(argv[2], "--mma-peak") == 0) {
        fprintf(f, "device,ilp,ctas_per_sm,ms,tflops\n");
        printf("# %s, %d SMs: mma.sync m16n8k16 bf16 -> fp32, back to back\n", prop.name, prop.multiProcessorCount);
        static const int ilps[] = {2, 4, 8}, per_sm[] = {1, 2, 4, 8};
        for (size_t i = 0; i < sizeof ilps / sizeof *ilps; i++)
            for (size_t j = 0; j < sizeof per_sm / sizeof *per_sm; j++) {
                float ms = 0.0f;
                const double flops =
                    cuda_linear_mma_peak_flops(ilps[i], per_sm[j] * prop.multiProcessorCount, 5000, &ms);
                const double tf = flops / (ms * 1e-3) / 1e12;
                printf("  ilp %d, %d CTAs of 8 warps an SM: %.3f ms, %.1f TFLOP/s\n", ilps[i], per_sm[j], ms, tf);
                fprintf(f, "%s,%d,%d,%.4f,%.1f\n", prop.name, ilps[i], per_sm[j], ms, tf);
            }
        fclose(f);
        return 0;
    }
    /* the T list: the decode sizes on all three paths, or the ones given (mma only) */
    int64_t Ts[16] = {1, 8, 16, 64, 256};
    int nT = 5, path0 = 0, path1 = 3;
    const int forms = argc > 3 && strcmp(argv[3], "--forms") == 0, tiles = argc > 3 && strcmp(argv[3], "--tiles") == 0;
    if (argc > 3 && !forms && !tiles) {
        fprintf(stderr, "bench: usage: bench_linear_cuda [out.csv [T,T,... [--forms | --tiles]]]\n");
        return 2;
    }
    if (argc > 2) {
        path0 = 1, path1 = 2;
        nT = bench_parse_list(argv[2], Ts, 16);
        if (nT < 1) {
            fprintf(stderr, "bench: token counts '%s': a comma-separated list of up to 16 of 1 .. 1048576\n", argv[2]);
            return 2;
        }
        if (forms) path1 = 6; /* mma, mma128, mma_mt1, mma_mt2, mma_mt4 */
        if (tiles) path0 = 2, path1 = 8; /* mma128, the decode forms, mma128x64, mma64x64 */
    }
    fprintf(f, "device,path,op,n,k,T,us_per_call,bytes,gb_per_s,fraction_of_copy_bw,copy_gb_per_s,graph_us_per_call,"
               "graph_gb_per_s,graph_fraction_of_copy_bw,tflops\n");
    printf("# %s, L2 %d MiB, device-to-device copy %.0f GB/s\n", prop.name, prop.l2CacheSize >> 20, bw / 1e9);
    printf("# %-5s %-6s %6s %6s %4s %10s %10s %8s %10s %10s %8s %8s\n", "path", "op", "n", "k", "T", "us/call", "GB/s",
           "of copy", "graph us", "GB/s", "of copy", "TFLOP/s");
    const struct {
        const char *name;
        int fp4;
        int64_t n, k;
        int pair, listed; /* pair: one cuda_linear_mma_pair call of two [n / 2, k]; listed: with a T list only */
        int bf16;         /* a BF16 weight (listed ones: the mHC mixes' three pieces, the router gate) */
    } shapes[] = {{"sh_w13", 0, 4608, 5120, 1, 1, 0},   {"wq_a", 0, 1280, 5120, 0, 0, 0},   {"wkv", 0, 512, 5120, 0, 0, 0},
                  {"wq_b", 0, 4096, 1280, 0, 0, 0},     {"wo_b", 0, 640, 8192, 0, 0, 0},    {"sh_w1", 0, 2304, 5120, 0, 0, 0},
                  {"sh_w2", 0, 5120, 2304, 0, 0, 0},    {"exp_w1", 1, 2304, 5120, 0, 0, 0}, {"exp_w2", 1, 5120, 2304, 0, 0, 0},
                  {"engram_wkv", 0, 25600, 6144, 0, 1, 0}, {"hc_mix", 0, 72, 20480, 0, 1, 1},
                  {"gate", 0, 384, 5120, 0, 1, 1}};
    for (int mma = path0; mma < path1; mma++)
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++)
        for (int ti = 0; ti < nT; ti++) {
            static const char *const pnames[] = {"exact", "mma", "mma128", "mma_mt1", "mma_mt2", "mma_mt4", "mma128x64", "mma64x64"};
            const char *pname = pnames[mma];
            int fp4 = shapes[si].fp4, bf16 = shapes[si].bf16;
            const int fmt = bf16 ? WF_BF16 : fp4 ? WF_FP4 : WF_FP8;
            const int pair = shapes[si].pair;
            if ((pair && !mma) || (shapes[si].listed && argc <= 2)) continue;
            if (bf16 && (!mma || (mma >= 3 && mma < 7))) continue; /* BF16: auto, 128 x 128 and 64 x 64 */
            int64_t n = shapes[si].n, k = shapes[si].k, T = Ts[ti];
            if (mma == 2 && T < 16) continue; /* the prefill tiling at decode sizes: T = 16, 64, 256 */
            if (mma >= 3 && mma < 6 && (fp4 || T > 256)) continue; /* the forced forms: FP8, the decode tiling's rows */
            if (mma >= 6 && fp4) continue;
            int64_t ld = fp4 ? k / 2 : k, s_ld = fp4 ? k / 32 : (k + 31) / 32, s_rows = fp4 ? n : (n + 31) / 32;
            size_t wb = (size_t)(n * ld) * (bf16 ? 2 : 1), sb = bf16 ? 0 : (size_t)(s_rows * s_ld);
            int copies = (int)(4.0 * prop.l2CacheSize / (double)(wb + sb)) + 2;
            uint8_t *w, *s;
            uint16_t *x, *y;
            void *ws;
            CK(cudaMalloc((void **)&w, wb * copies));
            CK(cudaMalloc((void **)&s, sb * copies + 16)); /* + 16: BF16 has no scales, and a call still takes a pointer */
            CK(cudaMemset(w, 0x38, wb * copies)); /* e4m3 1.0 / e2m1 pairs: finite values */
            if (fp4) cuda_fp4_pack(w, (int64_t)(wb * copies), NULL); /* the kernels' layout, as weight_prepare's */
            CK(cudaMemset(s, 127, sb * copies));
            CK(cudaMalloc((void **)&x, sizeof(uint16_t) * T * k));
            CK(cudaMemset(x, 0x3f, sizeof(uint16_t) * T * k));
            CK(cudaMalloc((void **)&y, sizeof(uint16_t) * T * n));
            size_t wsb = mma ? cuda_linear_mma_workspace_bytes(T, n, k)
                             : cuda_linear_workspace_bytes(T < CUDA_LINEAR_MAX_T ? T : CUDA_LINEAR_MAX_T, k);
            CK(cudaMalloc(&ws, wsb));
            for (int i = 0; i < copies; i++) call_linear(mma, fmt, pair, y, x, T, w + wb * i, s + sb * i, n, k, ld, s_ld, ws, NULL);
            CK(cudaDeviceSynchronize());
            int reps = copies * ((200 + copies - 1) / copies);
            cudaEvent_t e0, e1;
            CK(cudaEventCreate(&e0));
            CK(cudaEventCreate(&e1));
            CK(cudaEventRecord(e0, 0));
            for (int i = 0; i < reps; i++) {
                int c = i % copies;
                call_linear(mma, fmt, pair, y, x, T, w + wb * c, s + sb * c, n, k, ld, s_ld, ws, NULL);
            }
            CK(cudaEventRecord(e1, 0));
            CK(cudaEventSynchronize(e1));
            float ms;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            double us = 1000.0 * ms / reps, bytes = (double)(wb + sb) + 2.0 * (double)(T * k + T * n);
            double gbs = bytes / (us * 1e-6) / 1e9;
            /* the same calls replayed from a graph */
            cudaStream_t st;
            cudaGraph_t graph;
            cudaGraphExec_t exec;
            CK(cudaStreamCreate(&st));
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
            for (int c = 0; c < copies; c++) call_linear(mma, fmt, pair, y, x, T, w + wb * c, s + sb * c, n, k, ld, s_ld, ws, st);
            CK(cudaStreamEndCapture(st, &graph));
            CK(cudaGraphInstantiate(&exec, graph, 0));
            CK(cudaGraphLaunch(exec, st));
            CK(cudaStreamSynchronize(st));
            int greps = (200 + copies - 1) / copies;
            CK(cudaEventRecord(e0, st));
            for (int i = 0; i < greps; i++) CK(cudaGraphLaunch(exec, st));
            CK(cudaEventRecord(e1, st));
            CK(cudaEventSynchronize(e1));
            CK(cudaEventElapsedTime(&ms, e0, e1));
            double gus = 1000.0 * ms / (greps * copies), ggbs = bytes / (gus * 1e-6) / 1e9;
            double tflops = 2.0 * (double)T * (double)n * (double)k / (gus * 1e-6) / 1e12; /* graph timing */
            CK(cudaGraphExecDestroy(exec));
            CK(cudaGraphDestroy(graph));
            CK(cudaStreamDestroy(st));
            printf("  %-5s %-6s %6lld %6lld %4lld %10.2f %10.0f %7.1f%% %10.2f %10.0f %7.1f%% %8.1f\n", pname,
                   shapes[si].name, (long long)n, (long long)k, (long long)T, us, gbs, 100.0 * gbs * 1e9 / bw, gus, ggbs,
                   100.0 * ggbs * 1e9 / bw, tflops);
            fprintf(f, "%s,%s,%s,%lld,%lld,%lld,%.3f,%.0f,%.1f,%.4f,%.1f,%.3f,%.1f,%.4f,%.2f\n", prop.name, pname,
                    shapes[si].name, (long long)n, (long long)k, (long long)T, us, bytes, gbs, gbs * 1e9 / bw, bw / 1e9,
                    gus, ggbs, ggbs * 1e9 / bw, tflops);
            CK(cudaFree(w));
            CK(cudaFree(s));
            CK(cudaFree(x));
            CK(cudaFree(y));
            CK(cudaFree(ws));
        }
    fclose(f);
    return 0;
}
