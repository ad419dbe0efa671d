// Experiment (diagnostic, not part of the build): the row statistic alone (row_rstd_block of
// cuda_rows.cuh, the torch-order sum of squares, 35 KB of code at sm_80, mostly loops) in a one-CTA
// kernel over 1,280 values, against a plain block reduction, hot and with L2 flushed or other
// instances' code run in between: in-kernel cycles by clock64, thread 0's, the CTAs' largest.
// Build: nvcc -O3 -std=c++17 -gencode 'arch=compute_80,code=[sm_80,compute_80]' -Ikernels/cuda
// -Ikernels -Isrc -o rstd_cold results/experiments/code_cold/rstd_cold.cu (from the repository
// root). Results: run_98886b5_h100.txt, results/PERFORMANCE_HISTORY.md "98886b5..HEAD".
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include "cuda_rows.cuh"

__device__ unsigned long long g_cyc[4096]; /* slots: c*100+r (c<=9), 1000+(c-10)*100+r */

template <int V>
__global__ void __launch_bounds__(128) k_big(const uint16_t *x, int64_t n, float *o, int slot) {
    long long c0 = clock64();
    __shared__ float l0[TSB_CAP * 64]; __shared__ float r_s;
    float r = row_rstd_block(x, n, 1e-6f + V * 1e-9f, l0, &r_s);
    __syncthreads();
    if (threadIdx.x == 0) { o[V] = r; atomicMax(&g_cyc[slot], (unsigned long long)(clock64() - c0)); }
}
__global__ void __launch_bounds__(128) k_lean(const uint16_t *x, int64_t n, float *o, int slot) {
    long long c0 = clock64();
    __shared__ float ws[4];
    float s = 0.f;
#pragma unroll 1
    for (int64_t e = threadIdx.x * 2; e < n; e += 256) { float a, b; load_bf_pair(x, e, true, a, b); s += a * a + b * b; }
    for (int m = 16; m; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
    if ((threadIdx.x & 31) == 0) ws[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) { o[9] = rsqrtf((ws[0] + ws[1] + ws[2] + ws[3]) / n + 1e-6f); atomicMax(&g_cyc[slot], (unsigned long long)(clock64() - c0)); }
}
__global__ void k_flush(uint4 *p, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = make_uint4(i, 0, 0, 0);
}
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e_)); exit(1); } } while (0)

int main() {
    const int64_t n = 1280; const int R = 40;
    uint16_t *x; float *o; uint4 *fb; size_t fn = (512u << 20) / 16;
    CK(cudaMalloc(&x, n * 2)); CK(cudaMalloc(&o, 64)); CK(cudaMalloc(&fb, fn * 16));
    std::vector<uint16_t> h(n); for (int i = 0; i < n; i++) h[i] = 0x3f80 + (i % 7);
    CK(cudaMemcpy(x, h.data(), n * 2, cudaMemcpyHostToDevice));
    int clk; CK(cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0));
    auto big = [&](int slot) { k_big<0><<<1, 128>>>(x, n, o, slot); };
    auto lean = [&](int slot) { k_lean<<<1, 128>>>(x, n, o, slot); };
    auto other = [&]() { k_big<1><<<1, 128>>>(x, n, o, 4095); k_big<2><<<1, 128>>>(x, n, o, 4095); k_big<3><<<1, 128>>>(x, n, o, 4095); };
    auto flush = [&]() { k_flush<<<1024, 256>>>(fb, fn); };
    auto touch = [&]() { k_lean<<<1, 128>>>(x, n, o, 4094); }; /* x back into L2, not big's code */
    const char *names[] = {"big hot", "big after flush", "big after flush+touch x", "big after 3 other big kernels",
                           "lean hot", "lean after flush", "lean after flush+touch x",
                           "big, 2 CTAs, hot", "big, 2 CTAs, after flush", "big + big<1> 2 streams, hot (big's)",
                           "big + big<1> 2 streams, flush (big's)", "big<1> of that pair, flush"};
    cudaStream_t s1, s2; CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking)); CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    for (int c = 0; c < 12; c++) {
        std::vector<unsigned long long> cy(R);
        for (int r = 0; r < R + 3; r++) {
            int slot = c * 100 + (r < R ? r : 99); if (c > 9) slot = (c - 10) * 100 + 1000 + (r < R ? r : 99);
            switch (c) {
            case 0: big(4093); CK(cudaDeviceSynchronize()); big(slot); break;
            case 1: flush(); CK(cudaDeviceSynchronize()); big(slot); break;
            case 2: flush(); touch(); CK(cudaDeviceSynchronize()); big(slot); break;
            case 3: big(4093); other(); CK(cudaDeviceSynchronize()); big(slot); break;
            case 4: lean(4093); CK(cudaDeviceSynchronize()); lean(slot); break;
            case 5: flush(); CK(cudaDeviceSynchronize()); lean(slot); break;
            case 6: flush(); touch(); CK(cudaDeviceSynchronize()); lean(slot); break;
            case 7: big(4093); CK(cudaDeviceSynchronize()); k_big<0><<<2, 128>>>(x, n, o, slot); break;
            case 8: flush(); CK(cudaDeviceSynchronize()); k_big<0><<<2, 128>>>(x, n, o, slot); break;
            case 9: case 10: case 11:
                if (c == 9) { big(4093); k_big<1><<<1, 128>>>(x, n, o, 4095); } else flush();
                CK(cudaDeviceSynchronize());
                k_big<0><<<1, 128, 0, s1>>>(x, n, o, c == 11 ? 4092 : slot);
                k_big<1><<<1, 128, 0, s2>>>(x, n, o, c == 11 ? slot : 4092);
                break;
            }
            CK(cudaDeviceSynchronize());
        }
        unsigned long long all[4096]; CK(cudaMemcpyFromSymbol(all, g_cyc, sizeof all));
        for (int r = 0; r < R; r++) cy[r] = all[(c > 9 ? (c - 10) * 100 + 1000 : c * 100) + r];
        std::sort(cy.begin(), cy.end());
        printf("%-32s median %7.2f us  min %7.2f  max %7.2f  (cycles %llu, clock %d kHz)\n", names[c], cy[R / 2] * 1e3 / clk,
               cy[0] * 1e3 / clk, cy[R - 1] * 1e3 / clk, cy[R / 2], clk);
    }
    return 0;
}
