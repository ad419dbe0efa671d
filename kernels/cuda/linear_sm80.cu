/* FP8 / FP4 linear layers for decode-sized batches on SM80, bit-identical to the CPU reference.
 *
 * y[t, n] = bf16( Σ_b ((Σ_{i<32} qx[t, 32b+i] · qw[n, 32b+i]) · sx[t, b]) · sw[n, b] ), where the
 * inner sum runs over the 32 products of a k-block in k order and the outer sum over blocks in
 * block order: the reference's block-scaled GEMM (MODEL.md §3.0), in the CPU backend's order.
 *
 * Grid/CTA roles: act_quant_kernel — one thread per 32-value group of x (e4m3 value as float plus
 * its power-of-two scale). gemv kernels — one warp per output row n (grid-stride over rows); per
 * round of 32 k-blocks, lane j reduces block 32r+j sequentially (its 32 weight bytes, or 16 bytes
 * of packed FP4, are one coalesced warp-wide load), then lane 0 folds the 32 block partials in
 * block order through shuffles. Products of e4m3 and e4m3/e2m1 values are exact in fp32 and every
 * add/multiply is an explicit round-to-nearest intrinsic, so no reordering or FMA can change bits.
 * Weight-bandwidth bound at decode: each weight byte is read once per call for all T <= 16 rows. */
#include "cuda_common.cuh"
#include "cuda_linear.h"

#define WARPS_PER_CTA 8

__global__ void act_quant_kernel(const __nv_bfloat16 *__restrict__ x, float *__restrict__ q, float *__restrict__ s,
                                 int64_t groups) {
    int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= groups) return;
    const __nv_bfloat16 *xg = x + g * 32;
    float v[32], amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 32; i++) {
        v[i] = __bfloat162float(xg[i]);
        amax = fmaxf(amax, fabsf(v[i]));
    }
    amax = fmaxf(amax, 1e-4f);
    /* 2^ceil(log2(amax / 448)) by the exponent bits, as the reference's fast_round_scale */
    float t = __fmul_rn(amax, 1.0f / 448.0f);
    int bits = __float_as_int(t), e = ((bits >> 23) & 0xff) - 127 + ((bits & 0x7fffff) != 0);
    float sc = __int_as_float((e + 127) << 23);
    s[g] = sc;
#pragma unroll
    for (int i = 0; i < 32; i++) {
        float r = fminf(fmaxf(__fdiv_rn(v[i], sc), -448.0f), 448.0f);
        __nv_fp8_storage_t c = __nv_cvt_float_to_fp8(r, __NV_SATFINITE, __NV_E4M3);
        q[g * 32 + i] = ds_e4m3((uint8_t)c);
    }
}

template <int FP4>
__global__ void __launch_bounds__(WARPS_PER_CTA * 32)
    gemv_kernel(__nv_bfloat16 *__restrict__ y, const float *__restrict__ qx, const float *__restrict__ sx, int T,
                const uint8_t *__restrict__ w, const uint8_t *__restrict__ s, int64_t n, int64_t k, int64_t ld,
                int64_t s_ld) {
    const int lane = threadIdx.x & 31;
    const int64_t nb = k / 32;
    const int64_t warp0 = (int64_t)blockIdx.x * WARPS_PER_CTA + (threadIdx.x >> 5);
    const int64_t wstride = (int64_t)gridDim.x * WARPS_PER_CTA;
    for (int64_t row = warp0; row < n; row += wstride) {
        float acc[CUDA_LINEAR_MAX_T];
#pragma unroll
        for (int t = 0; t < CUDA_LINEAR_MAX_T; t++) acc[t] = 0.0f;
        const uint8_t *wr = w + row * ld;
        for (int64_t r0 = 0; r0 < nb; r0 += 32) {
            const int64_t b = r0 + lane;
            float part[CUDA_LINEAR_MAX_T];
            float sw = 0.0f;
            if (b < nb) {
                float wv[32];
                if (FP4) {
                    uint4 raw = *reinterpret_cast<const uint4 *>(wr + b * 16);
                    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                    for (int i = 0; i < 16; i++) {
                        uint32_t byte = (words[i / 4] >> (8 * (i % 4))) & 0xff;
                        wv[2 * i] = ds_e2m1(byte & 0xf); /* low nibble = even element */
                        wv[2 * i + 1] = ds_e2m1(byte >> 4);
                    }
                    sw = ds_e8m0(s[row * s_ld + b]);
                } else {
                    uint4 r0w = *reinterpret_cast<const uint4 *>(wr + b * 32);
                    uint4 r1w = *reinterpret_cast<const uint4 *>(wr + b * 32 + 16);
                    const uint32_t words[8] = {r0w.x, r0w.y, r0w.z, r0w.w, r1w.x, r1w.y, r1w.z, r1w.w};
#pragma unroll
                    for (int i = 0; i < 32; i++) wv[i] = ds_e4m3((words[i / 4] >> (8 * (i % 4))) & 0xff);
                    sw = ds_e8m0(s[(row / 32) * s_ld + b]);
                }
                for (int t = 0; t < T; t++) {
                    const float *xq = qx + (int64_t)t * k + b * 32;
                    float p = __fmul_rn(xq[0], wv[0]);
#pragma unroll
                    for (int i = 1; i < 32; i++) p = __fadd_rn(p, __fmul_rn(xq[i], wv[i]));
                    part[t] = p;
                }
            }
            /* fold this round's blocks in block order */
            const int64_t nr = nb - r0 < 32 ? nb - r0 : 32;
            for (int j = 0; j < nr; j++) {
                float swj = __shfl_sync(0xffffffffu, sw, j);
                for (int t = 0; t < T; t++) {
                    float pj = __shfl_sync(0xffffffffu, part[t], j);
                    float sxj = sx[(int64_t)t * nb + r0 + j];
                    acc[t] = __fadd_rn(acc[t], __fmul_rn(__fmul_rn(pj, sxj), swj));
                }
            }
        }
        if (lane == 0)
            for (int t = 0; t < T; t++) y[(int64_t)t * n + row] = __float2bfloat16_rn(acc[t]);
    }
}

extern "C" int cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError(); /* no driver / no GPU: clear the sticky error, report none */
        return 0;
    }
    return n;
}

extern "C" size_t cuda_linear_workspace_bytes(int64_t T, int64_t k) {
    return sizeof(float) * (size_t)(T * k + T * (k / 32));
}

static void linear(int fp4, uint16_t *y, const uint16_t *x, int64_t T, const uint8_t *w, const uint8_t *s, int64_t n,
                   int64_t k, int64_t ld, int64_t s_ld, void *workspace, void *stream) {
    if (T < 1 || T > CUDA_LINEAR_MAX_T || k % 32 || n < 1)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda linear", "unsupported shape (T <= 16, k % 32 == 0)");
    cudaStream_t st = (cudaStream_t)stream;
    float *qx = (float *)workspace, *sx = qx + T * k;
    int64_t groups = T * (k / 32);
    act_quant_kernel<<<(unsigned)((groups + 127) / 128), 128, 0, st>>>((const __nv_bfloat16 *)x, qx, sx, groups);
    KERNEL_CHECK();
    int dev = 0, sms = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    int64_t ctas = (n + WARPS_PER_CTA - 1) / WARPS_PER_CTA;
    if (ctas > (int64_t)sms * 16) ctas = (int64_t)sms * 16;
    if (fp4)
        gemv_kernel<1><<<(unsigned)ctas, WARPS_PER_CTA * 32, 0, st>>>((__nv_bfloat16 *)y, qx, sx, (int)T, w, s, n, k,
                                                                       ld, s_ld);
    else
        gemv_kernel<0><<<(unsigned)ctas, WARPS_PER_CTA * 32, 0, st>>>((__nv_bfloat16 *)y, qx, sx, (int)T, w, s, n, k,
                                                                       ld, s_ld);
    KERNEL_CHECK();
}

extern "C" void cuda_linear_fp8(uint16_t *y, const uint16_t *x, int64_t T, const uint8_t *w, const uint8_t *s,
                                int64_t n, int64_t k, int64_t ld, int64_t s_ld, void *workspace, void *stream) {
    linear(0, y, x, T, w, s, n, k, ld, s_ld, workspace, stream);
}

extern "C" void cuda_linear_fp4(uint16_t *y, const uint16_t *x, int64_t T, const uint8_t *w, const uint8_t *s,
                                int64_t n, int64_t k, int64_t ld, int64_t s_ld, void *workspace, void *stream) {
    linear(1, y, x, T, w, s, n, k, ld, s_ld, workspace, stream);
}
