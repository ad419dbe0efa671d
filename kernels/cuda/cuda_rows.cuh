/* Shared by the SM80 backend's row-local kernels (cuda_elementwise.cu: RMSNorm, RoPE, QDQ, the
 * embedding, the Engram rows; cuda_mhc.cu: the mHC ops): their launch shapes, bf16 vector access,
 * torch's fp32 row sum in its exact order (by a warp or a CTA), the row RMS statistic and the
 * logistic function, each reproducing the CPU oracle bit for bit (see cuda_elementwise.cu's top). */
#ifndef DS_CUDA_ROWS_CUH
#define DS_CUDA_ROWS_CUH

#include <stdint.h>

#include "cuda_internal.h"
#include "cuda_libm.cuh"


#define EW_THREADS 256     /* elementwise kernels: one item per thread              */
#define ROW_WARPS 4        /* warp-per-row kernels: rows per CTA                    */

/* Row kernels whose CTA is one row take more warps per row for calls of up to this many rows (a
 * decode step's: each row is a latency chain, and the GPU has CTAs to spare) than for larger ones
 * (prefill chunks, which fill the GPU with rows). The bits do not depend on the choice. */
#define ROW_WIDE_T 256

static inline unsigned ew_blocks(int64_t items, int threads) { return (unsigned)((items + threads - 1) / threads); }
static inline bool al16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* ---------------------------------------------------------------------------------------------
 * Vectors of bf16 (unpack8 / pack8 of 16 bytes: cuda_common.cuh) */

/* VEC elements starting at p: one 16-byte access for VEC == 8 (p 16-byte aligned), else scalar. */
template <int VEC>
__device__ __forceinline__ void load_bf(const uint16_t *p, float f[VEC]) {
    if (VEC == 8) {
        unpack8(*reinterpret_cast<const uint4 *>(p), f);
    } else {
#pragma unroll
        for (int i = 0; i < VEC; i++) f[i] = ds_bf16f(p[i]);
    }
}

template <int VEC>
__device__ __forceinline__ void store_bf(uint16_t *p, const float f[VEC]) {
    if (VEC == 8) {
        *reinterpret_cast<uint4 *>(p) = pack8(f);
    } else {
#pragma unroll
        for (int i = 0; i < VEC; i++) p[i] = ds_bf16_rne(f[i]);
    }
}

/* cpu_sigmoid: 1 / (1 + expf(-x)). */
__device__ __forceinline__ float ds_sigmoid(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, ds_expf(-x))); }

/* 1 / sqrtf(ss / n + eps), two roundings as the CPU writes it. */
__device__ __forceinline__ float ds_rstd(float ss, float n, float eps) {
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, n), eps)));
}

/* ---------------------------------------------------------------------------------------------
 * torch's fp32 row sum (cpu_reduce.c) in its exact order, by one warp.
 *
 * The row is groups of 64 = 4 ILP vectors × 16 lanes; column (k, l) of group i is element
 * 64i + 16k + l. Each column runs its own 4-level cascade over the groups, which needs nothing
 * from the other columns, so lane = 8k + l/2 owns columns (k, l) and (k, l+1) with l even: the
 * elements 64i + 2·lane and 64i + 2·lane + 1, a coalesced 128-byte warp read of bf16 per group.
 * Then, as cpu_sum_torch_lanes: the leftover whole vectors go into ILP slot 0 (lanes 0..7), the
 * slots are added 0+1+2+3, the scalar tail is summed from 0, and the 16 lanes are added in order. */

struct torch_levels {
    float a0, a1, a2, a3;
};

__device__ __forceinline__ void tl_zero(torch_levels &s) { s.a0 = s.a1 = s.a2 = s.a3 = 0.0f; }

/* The cascade after `cnt` groups (cnt a multiple of the level step); a set bit in the next level's
 * field stops it, as the CPU's break. */
__device__ __forceinline__ void tl_cascade(torch_levels &s, int64_t cnt, int lpow) {
    const int64_t mask = ((int64_t)1 << lpow) - 1;
    s.a1 = __fadd_rn(s.a1, s.a0);
    s.a0 = 0.0f;
    if (cnt & (mask << lpow)) return;
    s.a2 = __fadd_rn(s.a2, s.a1);
    s.a1 = 0.0f;
    if (cnt & (mask << (2 * lpow))) return;
    s.a3 = __fadd_rn(s.a3, s.a2);
    s.a2 = 0.0f;
}

__device__ __forceinline__ float tl_final(const torch_levels &s) {
    return __fadd_rn(__fadd_rn(__fadd_rn(s.a0, s.a1), s.a2), s.a3);
}

/* level_power of multi_row_sum: max(ceil_log2(size) / 4, 4), size = groups of 64. */
__device__ __forceinline__ int tl_level_power(int64_t size) {
    int r = 0;
    while (((int64_t)1 << r) < size) r++;
    return r / 4 > 4 ? r / 4 : 4;
}

/* From the per-lane column sums c0/c1 (cascade done) to the row sum, returned in every lane.
 * pair(e, a, b) gives the NS values of elements e and e+1 (e even), one(e, v) of element e. */
template <int NS, class Pair, class One>
__device__ __forceinline__ void torch_finish(int64_t n, float c0[NS], float c1[NS], Pair pair, One one,
                                             float out[NS]) {
    const int lane = threadIdx.x & 31;
    const int64_t nvec = n / 16, size = nvec / 4;
    float a[NS], b[NS];
    for (int64_t v = size * 4; v < nvec; v++) /* vectors left over by the ILP-4 loop: slot 0 */
        if (lane < 8) {
            pair(v * 16 + 2 * lane, a, b);
#pragma unroll
            for (int q = 0; q < NS; q++) {
                c0[q] = __fadd_rn(c0[q], a[q]);
                c1[q] = __fadd_rn(c1[q], b[q]);
            }
        }
#pragma unroll
    for (int q = 0; q < NS; q++) { /* ps[0] += ps[1]; += ps[2]; += ps[3] (lanes 0..7 hold slot 0) */
        const float u1 = __shfl_down_sync(0xffffffffu, c0[q], 8), u2 = __shfl_down_sync(0xffffffffu, c0[q], 16),
                    u3 = __shfl_down_sync(0xffffffffu, c0[q], 24);
        const float w1 = __shfl_down_sync(0xffffffffu, c1[q], 8), w2 = __shfl_down_sync(0xffffffffu, c1[q], 16),
                    w3 = __shfl_down_sync(0xffffffffu, c1[q], 24);
        c0[q] = __fadd_rn(__fadd_rn(__fadd_rn(c0[q], u1), u2), u3);
        c1[q] = __fadd_rn(__fadd_rn(__fadd_rn(c1[q], w1), w2), w3);
        out[q] = 0.0f;
    }
    for (int64_t e = nvec * 16; e < n; e++) { /* scalar tail, every lane the same */
        one(e, a);
#pragma unroll
        for (int q = 0; q < NS; q++) out[q] = __fadd_rn(out[q], a[q]);
    }
#pragma unroll
    for (int l = 0; l < 8; l++) /* lane l/2 holds columns l (even) and l + 1 */
#pragma unroll
        for (int q = 0; q < NS; q++) {
            out[q] = __fadd_rn(out[q], __shfl_sync(0xffffffffu, c0[q], l));
            out[q] = __fadd_rn(out[q], __shfl_sync(0xffffffffu, c1[q], l));
        }
}

/* NS row sums at once (the Engram gate needs three over the same elements), by one warp. */
template <int NS, class Pair, class One>
__device__ __forceinline__ void torch_sum_warp(int64_t n, Pair pair, One one, float out[NS]) {
    const int lane = threadIdx.x & 31;
    const int64_t size = (n / 16) / 4;
    float c0[NS], c1[NS], a[NS], b[NS];
    torch_levels s0[NS], s1[NS];
#pragma unroll
    for (int q = 0; q < NS; q++) {
        tl_zero(s0[q]);
        tl_zero(s1[q]);
    }
    if (size > 0) {
        const int lpow = tl_level_power(size);
        const int64_t step = (int64_t)1 << lpow;
        int64_t i = 0;
        while (i + step <= size) {
#pragma unroll(NS > 1 ? 4 : 8)
            for (int64_t j = 0; j < step; j++) {
                pair((i + j) * 64 + 2 * lane, a, b);
#pragma unroll
                for (int q = 0; q < NS; q++) {
                    s0[q].a0 = __fadd_rn(s0[q].a0, a[q]);
                    s1[q].a0 = __fadd_rn(s1[q].a0, b[q]);
                }
            }
            i += step;
#pragma unroll
            for (int q = 0; q < NS; q++) {
                tl_cascade(s0[q], i, lpow);
                tl_cascade(s1[q], i, lpow);
            }
        }
#pragma unroll 4
        for (; i < size; i++) {
            pair(i * 64 + 2 * lane, a, b);
#pragma unroll
            for (int q = 0; q < NS; q++) {
                s0[q].a0 = __fadd_rn(s0[q].a0, a[q]);
                s1[q].a0 = __fadd_rn(s1[q].a0, b[q]);
            }
        }
    }
#pragma unroll
    for (int q = 0; q < NS; q++) { /* size == 0: ps stays zero, as the CPU's memset */
        c0[q] = tl_final(s0[q]);
        c1[q] = tl_final(s1[q]);
    }
    torch_finish<NS>(n, c0, c1, pair, one, out);
}

/* The same sums by a whole CTA (every thread calls it; the result is in warp 0's lanes). The
 * cascade's level-0 accumulator restarts from zero every `step` groups, so each run of `step`
 * groups (the last one possibly short) is an independent sum from 0: the warps compute those runs'
 * column sums in parallel into l0, then warp 0 feeds them through the cascade in order, exactly
 * as torch_sum_warp would have accumulated them. l0: shared [TSB_CAP · 64 · NS] floats. */
#define TSB_CAP 32 /* level-0 runs per round */

template <int NS, class Pair, class One>
__device__ __forceinline__ void torch_sum_block(int64_t n, Pair pair, One one, float out[NS], float *l0) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int64_t size = (n / 16) / 4;
    torch_levels s0[NS], s1[NS];
#pragma unroll
    for (int q = 0; q < NS; q++) {
        tl_zero(s0[q]);
        tl_zero(s1[q]);
    }
    if (size > 0) {
        const int lpow = tl_level_power(size);
        const int64_t step = (int64_t)1 << lpow, nruns = (size + step - 1) / step;
        for (int64_t g0 = 0; g0 < nruns; g0 += TSB_CAP) {
            const int gn = nruns - g0 < TSB_CAP ? (int)(nruns - g0) : TSB_CAP;
            for (int g = warp; g < gn; g += nw) {
                const int64_t i0 = (g0 + g) * step, i1 = i0 + step < size ? i0 + step : size;
                float u[NS], v[NS], a[NS], b[NS];
#pragma unroll
                for (int q = 0; q < NS; q++) u[q] = v[q] = 0.0f;
#pragma unroll 16
                for (int64_t i = i0; i < i1; i++) {
                    pair(i * 64 + 2 * lane, a, b);
#pragma unroll
                    for (int q = 0; q < NS; q++) {
                        u[q] = __fadd_rn(u[q], a[q]);
                        v[q] = __fadd_rn(v[q], b[q]);
                    }
                }
#pragma unroll
                for (int q = 0; q < NS; q++) {
                    l0[(g * 64 + 2 * lane) * NS + q] = u[q];
                    l0[(g * 64 + 2 * lane + 1) * NS + q] = v[q];
                }
            }
            __syncthreads();
            if (warp == 0)
                for (int g = 0; g < gn; g++) {
                    const int64_t end = (g0 + g + 1) * step;
#pragma unroll
                    for (int q = 0; q < NS; q++) {
                        s0[q].a0 = l0[(g * 64 + 2 * lane) * NS + q];
                        s1[q].a0 = l0[(g * 64 + 2 * lane + 1) * NS + q];
                        if (end <= size) { /* a whole run: the cascade; a short last run stays in a0 */
                            tl_cascade(s0[q], end, lpow);
                            tl_cascade(s1[q], end, lpow);
                        }
                    }
                }
            __syncthreads(); /* l0 is reused by the next round */
        }
    }
    if (warp == 0) {
        float c0[NS], c1[NS];
#pragma unroll
        for (int q = 0; q < NS; q++) {
            c0[q] = tl_final(s0[q]);
            c1[q] = tl_final(s1[q]);
        }
        torch_finish<NS>(n, c0, c1, pair, one, out);
    }
}

/* Two adjacent bf16 (e even); one 32-bit access when the row start is 4-byte aligned. */
__device__ __forceinline__ void load_bf_pair(const uint16_t *p, int64_t e, bool al4, float &a, float &b) {
    if (al4) {
        const uint32_t u = *reinterpret_cast<const uint32_t *>(p + e);
        a = __uint_as_float(u << 16);
        b = __uint_as_float(u & 0xffff0000u);
    } else {
        a = ds_bf16f(p[e]);
        b = ds_bf16f(p[e + 1]);
    }
}

/* 1 / sqrtf(mean(x²) + eps) of a bf16 row [n] (the rmsnorm / mHC statistic), summed by the whole CTA
 * in torch's order and returned to every thread. Every thread of the CTA calls it (barriers inside);
 * l0: shared [TSB_CAP · 64], r_s: one shared float. */
__device__ __forceinline__ float row_rstd_block(const uint16_t *xr, int64_t n, float eps, float *l0, float *r_s) {
    const bool al4 = ((uintptr_t)xr & 3) == 0;
    float ss[1];
    torch_sum_block<1>(
        n,
        [&](int64_t e, float *a, float *b) {
            float u, v;
            load_bf_pair(xr, e, al4, u, v);
            a[0] = __fmul_rn(u, u);
            b[0] = __fmul_rn(v, v);
        },
        [&](int64_t e, float *a) {
            const float u = ds_bf16f(xr[e]);
            a[0] = __fmul_rn(u, u);
        },
        ss, l0);
    if (threadIdx.x == 0) *r_s = ds_rstd(ss[0], (float)n, eps);
    __syncthreads();
    return *r_s;
}

#define RMS_WARPS 4 /* warps of the row-per-CTA kernels (RMSNorm, the mHC collapse at prefill) */

#endif /* DS_CUDA_ROWS_CUH */
