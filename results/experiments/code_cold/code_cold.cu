// Experiment (diagnostic, not part of the build): does a one-CTA norm kernel whose code is cold run
// slower? rmsnorm_post_pair_kernel<QDQ_FP8_32, true> (grid (1, 2)) and two rmsnorm_post_kernel
// forms at decode shapes (wq_a's 1280 and wkv's 512 columns, 5 k-chunks of partials), each timed by
// CUDA events around its launch: hot (right after itself), after a 512 MB write (L2 flushed), after
// that and a kernel touching its data (code cold in L2, data warm), and after that and a 127 KB
// straight-line kernel on every SM (the SMs' instruction caches too); and the first and last of
// those with a 512 MB read running on every SM (one 256-thread CTA each) while the norm runs. The kernels' source is
// extracted from a checkout's kernels/cuda/cuda_elementwise.cu by build.sh (between the QDQ enum and
// qdq_group's end, and from rmsnorm_post_row's comment to cuda_rmsnorm_post_shape). Results:
// results/PERFORMANCE_HISTORY.md, "98886b5..HEAD" (run_efa1ca7_h200.txt: the first four conditions,
// before the read beside the norm was added; not run yet with it).
#include <math.h>
#include <stdint.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include "cuda_rows.cuh"
#include "rope_common.cuh"
#include "linear_mma.h"
#include "mma_sm80.cuh"
#define RMS_PRE 5
#include "code_cold_kernels.cuh"

__global__ void k_flush(uint4 *p, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = make_uint4(i, 0, 0, 0);
}
__global__ void k_touch(const float *a, size_t na, const uint16_t *w0, const uint16_t *w1, float *o) {
    float s = 0; for (size_t i = threadIdx.x; i < na; i += blockDim.x) s += a[i];
    for (int i = threadIdx.x; i < 1280; i += blockDim.x) s += w0[i]; for (int i = threadIdx.x; i < 512; i += blockDim.x) s += w1[i];
    if (s == 12345.f) o[0] = s;
}
__constant__ float c_k[8192];
#define EV1 x = __fmaf_rn(x, c_k[__COUNTER__], 0.5f);
#define EV16 EV1 EV1 EV1 EV1 EV1 EV1 EV1 EV1 EV1 EV1 EV1 EV1 EV1 EV1 EV1 EV1
#define EV256 EV16 EV16 EV16 EV16 EV16 EV16 EV16 EV16 EV16 EV16 EV16 EV16 EV16 EV16 EV16 EV16
__global__ void k_evict(float *o) { /* ~128 KB of straight-line code on every SM: the SMs' instruction caches */
    float x = threadIdx.x;
    EV256 EV256 EV256 EV256 EV256 EV256 EV256 EV256 EV256 EV256 EV256 EV256 EV256 EV256 EV256 EV256
    EV256 EV256 EV256 EV256 EV256 EV256 EV256 EV256 EV256 EV256 EV256 EV256 EV256 EV256 EV256
    if (x == 1.2345f) o[1] = x;
}
/* a 512 MB read by one 256-thread CTA an SM: the memory traffic of a big kernel beside the norm,
 * with room left on every SM for the norm's CTA */
__global__ void k_stream(const uint4 *p, size_t n, float *o) {
    uint32_t a = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) a ^= __ldcs(p + i).x;
    if (a == 0x12345678u) o[2] = (float)a;
}
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e_)); exit(1); } } while (0)
int main() {
    const int nch = 5, n1 = 1280, n2 = 512, ldp = n1 + n2, R = 60;
    float *parts, *freqs, *o; uint16_t *w0, *w1, *y0, *y1; int32_t *pos; uint32_t *ya; uint4 *fb; size_t fn = (512u << 20) / 16;
    CK(cudaMalloc(&parts, nch * ldp * 4)); CK(cudaMalloc(&freqs, 64 * 4)); CK(cudaMalloc(&o, 64)); CK(cudaMalloc(&w0, n1 * 2));
    CK(cudaMalloc(&w1, n2 * 2)); CK(cudaMalloc(&y0, n1 * 2)); CK(cudaMalloc(&y1, n2 * 2)); CK(cudaMalloc(&pos, 4)); CK(cudaMalloc(&ya, n1 * 2));
    CK(cudaMalloc(&fb, fn * 16));
    std::vector<float> hp(nch * ldp); for (size_t i = 0; i < hp.size(); i++) hp[i] = 0.01f * (float)((i * 37) % 101) - 0.5f;
    CK(cudaMemcpy(parts, hp.data(), hp.size() * 4, cudaMemcpyHostToDevice));
    std::vector<uint16_t> hw(n1, 0x3f80); CK(cudaMemcpy(w0, hw.data(), n1 * 2, cudaMemcpyHostToDevice)); CK(cudaMemcpy(w1, hw.data(), n2 * 2, cudaMemcpyHostToDevice));
    std::vector<float> hf(64); for (int i = 0; i < 64; i++) hf[i] = powf(10000.f, -i / 32.f); CK(cudaMemcpy(freqs, hf.data(), 256, cudaMemcpyHostToDevice));
    CK(cudaMemset(pos, 0, 4));
    rms_pair_half h0 = {y0, w0, n1, 0, 0, 0, 1e-6f, pos, freqs}, h1 = {y1, w1, n2, n1, n2 - 64, 64, 1e-6f, pos, freqs};
    cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    cudaStream_t s1, s2; /* the norm's and the streaming kernel's (non-blocking: no implicit order between them) */
    CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    auto pair = [&]() { rmsnorm_post_pair_kernel<QDQ_FP8_32, true><<<dim3(1, 2), RMS_WARPS * 32, 0, s1>>>(parts, ldp, nch, h0, h1, ya); };
    auto single = [&]() { rmsnorm_post_kernel<-1, true, true><<<1, RMS_WARPS * 32, 0, s1>>>(y0, NULL, parts, nch, w0, n1, 1e-6f, 0, 0, pos, freqs, ya); };
    auto single8 = [&]() { rmsnorm_post_kernel<QDQ_FP8_32, true, false><<<1, RMS_WARPS * 32, 0, s1>>>(y1, NULL, parts, nch, w1, n2, 1e-6f, n2 - 64, 64, pos, freqs, nullptr); };
    auto flush = [&]() { k_flush<<<1024, 256>>>(fb, fn); };
    auto touch = [&]() { k_touch<<<1, 256>>>(parts, nch * ldp, w0, w1, o); };
    const char *kn[] = {"pair<FP8, act>", "single<-1, parts, act> (q_norm)", "single<FP8, parts> (kv_norm)"};
    const char *cn[] = {"hot", "after flush", "after flush + data touched", "after flush + code evict + data",
                        "hot, beside a 512 MB read", "code evict + data, beside a 512 MB read"};
    int nsm; CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
    for (int k = 0; k < 3; k++)
        for (int c = 0; c < 6; c++) {
            std::vector<float> ms;
            for (int r = 0; r < R; r++) {
                auto run = [&]() { if (k == 0) pair(); else if (k == 1) single(); else single8(); };
                if (c == 0 || c == 4) run(); else { flush(); if (c == 3 || c == 5) k_evict<<<nsm * 4, 128>>>(o); if (c >= 2) touch(); }
                CK(cudaDeviceSynchronize());
                /* the read (~150 µs) launched first, so it runs on every SM when the norm starts */
                if (c >= 4) k_stream<<<nsm, 256, 0, s2>>>(fb, fn, o);
                CK(cudaEventRecord(e0, s1)); run(); CK(cudaEventRecord(e1, s1)); CK(cudaEventSynchronize(e1));
                CK(cudaDeviceSynchronize());
                float t; CK(cudaEventElapsedTime(&t, e0, e1)); ms.push_back(t * 1e3f);
            }
            std::sort(ms.begin(), ms.end());
            printf("%-34s %-28s event us: median %6.2f  min %6.2f  max %6.2f\n", kn[k], cn[c], ms[R / 2], ms[0], ms[R - 1]);
        }
    return 0;
}
