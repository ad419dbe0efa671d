/* Row-local ops of the SM80 backend: RMSNorm, interleaved RoPE, the three activation QDQ steps,
 * the mHC mixes (statistics + Sinkhorn split), collapse, expand and init, the token embedding,
 * the Engram row gather and gate and the TP column interleave.
 *
 * All of them are memory-bound: a kernel reads its rows once, with 16-byte vectors where the
 * shape and the pointers allow it and a scalar path for the rest. They reproduce the CPU oracle
 * (kernels/cpu/cpu_elementwise.c) bit for bit, because the whole-model check amplifies a single
 * last-bit difference:
 *  - every rounding point is an explicit __f*_rn intrinsic, so nvcc cannot contract a product and
 *    a sum into an FMA (the CPU is built with -ffp-contract=off);
 *  - the row sums the CPU takes with torch's 16-lane cascade (cpu_reduce.c: RMSNorm, the mHC norm,
 *    the Engram statistics) run here in exactly that order, by a warp or a CTA per row
 *    (torch_sum_warp, torch_sum_block);
 *  - the mHC mix dot products, sequential sums on the CPU, stay sequential: one thread per output;
 *  - expf / sinf / cosf are ports of the glibc algorithms the CPU calls (double-precision
 *    polynomials, with the contractions of glibc's x86-64 FMA build), checked equal to glibc 2.36
 *    on every float input; CUDA's own expf/sinf/cosf differ from glibc in the last bit often.
 * Every kernel depends only on its row's data and the shapes, never on T or the grid: a row gives
 * the same bits whatever batch it is in. */
#include <math.h>
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

/* ---------------------------------------------------------------------------------------------
 * glibc's expf, sinf and cosf (sysdeps/ieee754/flt-32: e_expf.c, s_sinf.c, s_cosf.c, s_sincosf.h;
 * the algorithms of ARM's optimized-routines), re-expressed with explicit double roundings.
 * x86-64 glibc runs the variant compiled with -mfma, in which GCC fuses each a*b + c of the source
 * into an FMA; the __fma_rn calls below are those fusions. Checked against glibc 2.36 (x86-64,
 * FMA variant) over all 2^32 inputs: identical results. */

/* 4/pi to 192 bits, 8 new bits per entry (s_sincosf_data.c). */
__device__ const uint32_t ds_inv_pio4[24] = {
    0xa2,       0xa2f9,     0xa2f983,   0xa2f9836e, 0xf9836e4e, 0x836e4e44, 0x6e4e4415, 0x4e441529,
    0x441529fc, 0x1529fc27, 0x29fc2757, 0xfc2757d1, 0x2757d1f5, 0x57d1f534, 0xd1f534dd, 0xf534ddc0,
    0x34ddc0db, 0xddc0db62, 0xc0db6295, 0xdb629599, 0x6295993c, 0x95993c43, 0x993c4390, 0x3c439041};


/* sinf_poly: the sine polynomial for even n, the cosine one (signed by sg, the table that
 * returns -cos) for odd n. */
__device__ __forceinline__ float ds_sincos_poly(double x, double x2, double sg, int n) {
    if ((n & 1) == 0) {
        const double x3 = __dmul_rn(x, x2), s1 = __fma_rn(x2, -0x1.994eb3774cf24p-13, 0x1.1107605230bc4p-7);
        const double x7 = __dmul_rn(x3, x2), s = __fma_rn(x3, -0x1.555545995a603p-3, x);
        return __double2float_rn(__fma_rn(x7, s1, s));
    }
    const double x4 = __dmul_rn(x2, x2);
    const double c2 = __fma_rn(x2, sg * 0x1.99343027bf8c3p-16, sg * -0x1.6c087e89a359dp-10);
    const double c1 = __fma_rn(x2, sg * -0x1.ffffffd0c621cp-2, sg);
    const double x6 = __dmul_rn(x4, x2), c = __fma_rn(x4, sg * 0x1.55553e1068f19p-5, c1);
    return __double2float_rn(__fma_rn(x6, c2, c));
}

/* sinf(y) (want_cos = 0) or cosf(y) (want_cos = 1): range reduction to [-pi/4, pi/4] and quadrant
 * n, by one multiply-subtract below 120, by 4/pi in fixed point above. */
__device__ float ds_sinf_cosf(float y, int want_cos) {
    const uint32_t top = (__float_as_uint(y) >> 20) & 0x7ff;
    double x = (double)y;
    if (top < 0x3f4) { /* |y| < pi/4 */
        if (top < 0x398) return want_cos ? 1.0f : y; /* |y| < 2^-12 */
        return ds_sincos_poly(x, __dmul_rn(x, x), 1.0, want_cos);
    }
    int n, q;
    if (top < 0x42f) { /* |y| < 120 */
        const double r = __dmul_rn(x, 0x1.45F306DC9C883p+23);
        n = (__double2int_rz(r) + 0x800000) >> 24;
        x = __fma_rn(-(double)n, 0x1.921FB54442D18p0, x);
        q = n;
    } else if (top < 0x7f8) {
        uint32_t xi = __float_as_uint(y);
        const int sign = (int)(xi >> 31);
        const uint32_t *arr = &ds_inv_pio4[(xi >> 26) & 15];
        const int sh = (xi >> 23) & 7;
        xi = ((xi & 0xffffff) | 0x800000) << sh;
        uint64_t res0 = (uint32_t)(xi * arr[0]); /* 32-bit product, as in the source */
        const uint64_t res1 = (uint64_t)xi * arr[4], res2 = (uint64_t)xi * arr[8];
        res0 = (res2 >> 32) | (res0 << 32);
        res0 += res1;
        const uint64_t nn = (res0 + (1ull << 61)) >> 62;
        res0 -= nn << 62;
        x = __dmul_rn(__ll2double_rn((long long)res0), 0x1.921FB54442D18p-62);
        n = (int)nn;
        q = n + sign;
    } else {
        return __uint_as_float(0x7fc00000u); /* inf, nan: nan (becomes 0x7FC0 in bf16 either way) */
    }
    const double s = ((q + 1) & 2) ? -1.0 : 1.0; /* sign[q & 3] = {1, -1, -1, 1} */
    const double sg = (q & 2) ? -1.0 : 1.0;      /* the second table (negated cosine) */
    return ds_sincos_poly(__dmul_rn(x, s), __dmul_rn(x, x), sg, want_cos ? n ^ 1 : n);
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

/* ---------------------------------------------------------------------------------------------
 * RMSNorm: one CTA of RMS_WARPS warps per row, the sum of squares by torch_sum_block (a row of
 * 4096 is 4 independent level-0 runs: one warp per row spent ~23 µs on its serial loads). y may
 * alias x: every read of the sum pass comes before the barrier that publishes r, and in the output
 * pass each thread reads its elements before writing them. */

#define RMS_WARPS 4
/* output-pass iterations whose weights the 8-wide form loads before the sum (n <= 5120 whole):
 * the weight row then arrives while the sum runs, not after it (x is re-read from L1). With
 * hc_mix_finish's Sinkhorn parameters fetched first likewise, on the H200 (one eager batch-1 step,
 * Nsight Compute, clocks as they run) the first four rmsnorm calls 8.83 / 7.04 / 5.82 / 8.74 ->
 * 6.85 / 6.62 / 4.74 / 7.01 µs, the first two hc_mix_finish 17.47 / 15.68 -> 15.81 / 14.50 µs;
 * bench_step decode, old and new alternated three times: batch 1 5.73 / 5.73 / 5.65 -> 5.62 /
 * 5.57 / 5.56 ms, batch 8 8.82 / 8.81 / 8.70 -> 8.69 / 8.63 / 8.63 ms. (Holding x in registers
 * too spilled under the SM90 compiler.) */
#define RMS_PRE 5

template <int VEC>
__global__ void __launch_bounds__(RMS_WARPS * 32)
    rmsnorm_kernel(uint16_t *y, const uint16_t *x, const uint16_t *__restrict__ w, int64_t n, float eps) {
    constexpr int STEP = RMS_WARPS * 32 * VEC, PRE = VEC == 8 ? RMS_PRE : 0;
    __shared__ float l0[TSB_CAP * 64];
    __shared__ float r_s;
    const int64_t row = blockIdx.x;
    const uint16_t *xr = x + row * n; /* [n] bf16 */
    uint16_t *yr = y + row * n;       /* [n] bf16 */
    uint4 wp[PRE > 0 ? PRE : 1];
#pragma unroll
    for (int p = 0; p < PRE; p++) {
        const int64_t e = (int64_t)threadIdx.x * VEC + p * STEP;
        if (e < n) wp[p] = __ldg(reinterpret_cast<const uint4 *>(w + e));
    }
    const float r = row_rstd_block(xr, n, eps, l0, &r_s);
#pragma unroll
    for (int p = 0; p < PRE; p++) { /* each thread reads its elements before writing them */
        const int64_t e = (int64_t)threadIdx.x * VEC + p * STEP;
        if (e < n) {
            float xv[8], wv[8];
            unpack8(*reinterpret_cast<const uint4 *>(xr + e), xv);
            unpack8(wp[p], wv);
#pragma unroll
            for (int i = 0; i < 8; i++) xv[i] = __fmul_rn(wv[i], __fmul_rn(xv[i], r));
            *reinterpret_cast<uint4 *>(yr + e) = pack8(xv);
        }
    }
    for (int64_t e = (int64_t)threadIdx.x * VEC + PRE * STEP; e < n; e += STEP) {
        float xv[VEC], wv[VEC];
        load_bf<VEC>(xr + e, xv);
        load_bf<VEC>(w + e, wv);
#pragma unroll
        for (int i = 0; i < VEC; i++) xv[i] = __fmul_rn(wv[i], __fmul_rn(xv[i], r));
        store_bf<VEC>(yr + e, xv);
    }
}

static bool rmsnorm_post_launch(struct backend *be, bf16_t *y, const bf16_t *x, const bf16_t *w, int64_t T,
                                int64_t n, float eps, const struct norm_post *post);

void cuda_op_rmsnorm(struct backend *be, bf16_t *y, const bf16_t *x, const bf16_t *w, int64_t T, int64_t n,
                     float eps, const struct norm_post *post) {
    if (T <= 0 || n <= 0) return;
    if (post && rmsnorm_post_launch(be, y, x, w, T, n, eps, post)) return; /* one pass */
    if (n % 8 == 0 && al16(x) && al16(y) && al16(w))
        rmsnorm_kernel<8><<<(unsigned)T, RMS_WARPS * 32, 0, cuda_be_stream(be)>>>(y, x, w, n, eps);
    else
        rmsnorm_kernel<1><<<(unsigned)T, RMS_WARPS * 32, 0, cuda_be_stream(be)>>>(y, x, w, n, eps);
    KERNEL_CHECK();
    if (!post) return;
    if (post->rd > 0) cuda_op_rope(be, y, T, 1, n, n, post->off, post->rd, post->pos, post->freqs, false);
    if (post->qdq == NORM_QDQ_FP8_32) cuda_op_qdq_fp8_32(be, y, T * n);
    if (post->qdq == NORM_QDQ_FP4_32) cuda_op_qdq_fp4_32(be, y, T * n);
}

/* ---------------------------------------------------------------------------------------------
 * RoPE: thread (t, i, head slice) computes cos/sin of pos[t]·freqs[i] once and rotates pair i of
 * the heads h ≡ slice (mod hs); consecutive threads take consecutive pairs, so each head's rotary
 * part is one coalesced access. hs slices spread a row's heads over several threads for latency. */

/* The rope op's arithmetic (backend.h), shared by rope_kernel and rmsnorm_post_kernel: the angle
 * (float)pos · freq, its (cos, sin), and one pair's rotation to bf16 codes. */
__device__ __forceinline__ float2 rope_cs(int32_t pos, float freq) {
    const float ang = __fmul_rn(__int2float_rn(pos), freq);
    return make_float2(ds_sinf_cosf(ang, 1), ds_sinf_cosf(ang, 0));
}
__device__ __forceinline__ void rope_rotate(float a, float b, float c, float s, uint16_t &o0, uint16_t &o1) {
    o0 = ds_bf16_rne(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
    o1 = ds_bf16_rne(__fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c)));
}

template <bool PAIR32>
__global__ void __launch_bounds__(EW_THREADS)
    rope_kernel(uint16_t *x, int64_t T, int64_t nh, int64_t ld_row, int64_t ld_head, int64_t off, int64_t half,
                const int32_t *__restrict__ pos, const float *__restrict__ freqs, int inverse, int hs) {
    const int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= T * hs * half) return;
    const int64_t i = g % half, rest = g / half, t = rest / hs;
    const int slice = (int)(rest % hs);
    const float2 cs = rope_cs(pos[t], freqs[i]);
    const float c = cs.x, s = inverse ? -cs.y : cs.y;
    for (int64_t h = slice; h < nh; h += hs) {
        uint16_t *v = x + t * ld_row + h * ld_head + off + 2 * i; /* pair (2i, 2i+1) of head h */
        float a, b;
        if (PAIR32) {
            const uint32_t u = *reinterpret_cast<const uint32_t *>(v);
            a = __uint_as_float(u << 16);
            b = __uint_as_float(u & 0xffff0000u);
        } else {
            a = ds_bf16f(v[0]);
            b = ds_bf16f(v[1]);
        }
        uint16_t o0, o1;
        rope_rotate(a, b, c, s, o0, o1);
        if (PAIR32) {
            *reinterpret_cast<uint32_t *>(v) = (uint32_t)o0 | ((uint32_t)o1 << 16);
        } else {
            v[0] = o0;
            v[1] = o1;
        }
    }
}

void cuda_op_rope(struct backend *be, bf16_t *x, int64_t T, int64_t nh, int64_t ld_row, int64_t ld_head,
                  int64_t off, int64_t rd, const int32_t *pos, const float *freqs, bool inverse) {
    const int64_t half = rd / 2;
    if (T <= 0 || nh <= 0 || half <= 0) return;
    const int hs = nh < 8 ? (int)nh : 8;
    const unsigned grid = ew_blocks(T * hs * half, EW_THREADS);
    const bool pair32 = ((uintptr_t)x & 3) == 0 && ld_row % 2 == 0 && ld_head % 2 == 0 && off % 2 == 0;
    if (pair32)
        rope_kernel<true><<<grid, EW_THREADS, 0, cuda_be_stream(be)>>>(x, T, nh, ld_row, ld_head, off, half, pos,
                                                                      freqs, inverse, hs);
    else
        rope_kernel<false><<<grid, EW_THREADS, 0, cuda_be_stream(be)>>>(x, T, nh, ld_row, ld_head, off, half, pos,
                                                                       freqs, inverse, hs);
    KERNEL_CHECK();
}

/* ---------------------------------------------------------------------------------------------
 * Activation QDQ (src/formats.c qdq_fp8_32, qdq_fp4_32_ue8m0, qdq_fp4_16_e4m3): EPT consecutive
 * elements per thread, a group's amax by shuffles over its G / EPT threads (max is exact in any
 * order), then each thread rounds its own values. */

enum { QDQ_FP8_32 = 0, QDQ_FP4_32 = 1, QDQ_FP4_16 = 2 };

/* e4m3_from_f32: RNE with saturation to ±448, NaN -> 0x7F, on the integer bits. */
__device__ __forceinline__ uint32_t ds_e4m3_from_f32(float f) {
    const uint32_t u = __float_as_uint(f), sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return 0x7f;
    if (a > 0x43e00000u) return sign | 0x7e;
    if (a >= 0x3c800000u) return sign | (((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3));
    const float xs = __fmul_rn(__uint_as_float(a), 0x1p9f); /* exact */
    uint32_t i = __float2uint_rz(xs);
    const float frac = __fsub_rn(xs, __uint2float_rn(i)); /* exact */
    if (frac > 0.5f || (frac == 0.5f && (i & 1u))) i++;
    return sign | i;
}

/* e2m1_from_f32: the count of rounding boundaries below |f|, sign bit kept (NaN -> ±0). */
__device__ __forceinline__ uint32_t ds_e2m1_from_f32(float f) {
    const float a = fabsf(f);
    const uint32_t code = (uint32_t)(a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                          (a >= 3.5f) + (a > 5.0f);
    return code | ((__float_as_uint(f) >> 31) << 3);
}

__device__ __forceinline__ float clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

/* The group's amax over its G / EPT consecutive lanes (every lane of the warp calls it; `a > m ?
 * a : m` as the CPU: a NaN, signaling ones too, never wins), then each lane's EPT values rounded
 * with the group's scale: the QDQ of qdq_kernel and of rmsnorm's post pass. */
template <int MODE, int EPT> __device__ __forceinline__ void qdq_group(float (&v)[EPT]) {
    constexpr int G = MODE == QDQ_FP4_16 ? 16 : 32, TPG = G / EPT;
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < EPT; i++) {
        const float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
    }
#pragma unroll
    for (int o = TPG / 2; o > 0; o >>= 1) {
        const float a = __shfl_xor_sync(0xffffffffu, amax, o);
        amax = a > amax ? a : amax;
    }
    if (MODE == QDQ_FP8_32) {
        const float sc = ds_fp8_scale(amax), rsc = ds_pow2_inv(sc);
#pragma unroll
        for (int i = 0; i < EPT; i++) v[i] = __fmul_rn(ds_fp8_q(v[i], rsc), sc);
    } else {
        float sc;
        if (MODE == QDQ_FP4_32) {
            amax = amax < 6.0f * 0x1p-126f ? 6.0f * 0x1p-126f : amax;
            sc = ds_scale_pow2(amax, (float)(1.0 / 6.0));
        } else { /* e4m3 scale, not a power of two: the reference divides by it */
            amax = amax < 6.0f * 0x1p-9f ? 6.0f * 0x1p-9f : amax;
            sc = ds_e4m3(ds_e4m3_from_f32(__fdiv_rn(amax, 6.0f)));
        }
        /* the power-of-two scale's quotient is a product (ds_pow2_inv); the e4m3 one is divided */
        const float rsc = MODE == QDQ_FP4_32 ? ds_pow2_inv(sc) : 0.0f;
#pragma unroll
        for (int i = 0; i < EPT; i++) {
            /* a NaN keeps its sign, as the quotient's would (e2m1 keeps the sign bit of a NaN) */
            const float r = MODE == QDQ_FP4_32 ? (v[i] != v[i] ? v[i] : __fmul_rn(v[i], rsc)) : __fdiv_rn(v[i], sc);
            v[i] = __fmul_rn(ds_e2m1(ds_e2m1_from_f32(clampf(r, -6.0f, 6.0f))), sc);
        }
    }
}

template <int MODE, int EPT>
__global__ void __launch_bounds__(EW_THREADS) qdq_kernel(uint16_t *x, int64_t n) { /* x [n] bf16 */
    const int64_t e0 = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * EPT;
    const bool active = e0 < n; /* n is a multiple of G: a group is wholly in or out */
    float v[EPT];
    if (active) {
        load_bf<EPT>(x + e0, v);
    } else {
#pragma unroll
        for (int i = 0; i < EPT; i++) v[i] = 0.0f;
    }
    qdq_group<MODE, EPT>(v);
    if (active) store_bf<EPT>(x + e0, v);
}

template <int MODE>
static void qdq_launch(struct backend *be, bf16_t *x, int64_t n, int64_t block, const char *name) {
    if (n % block != 0) ds_fatal(__FILE__, __LINE__, name, "dsbatch", name, "n is not a multiple of the block");
    if (n <= 0) return;
    if (al16(x)) {
        qdq_kernel<MODE, 8><<<ew_blocks(n / 8, EW_THREADS), EW_THREADS, 0, cuda_be_stream(be)>>>(x, n);
    } else {
        qdq_kernel<MODE, 1><<<ew_blocks(n, EW_THREADS), EW_THREADS, 0, cuda_be_stream(be)>>>(x, n);
    }
    KERNEL_CHECK();
}

/* rmsnorm with its post steps (struct norm_post) in the output pass: rmsnorm_kernel<8>'s norm, each
 * value rounded to bf16 as the op stores it, RoPE on the row's rotary pairs as rope_kernel computes
 * them (a pair never straddles a thread's 8 values: off is even), then the QDQ of each 32-group,
 * which is 4 consecutive lanes of 8 (qdq_group). One launch where the three ops took three, with
 * their bits; rows of up to RMS_PRE · 1024 values, n % 32 == 0, up to 256 rotary values. MODE: a
 * QDQ_* mode or -1 (none). */
template <int MODE>
__global__ void __launch_bounds__(RMS_WARPS * 32)
    rmsnorm_post_kernel(uint16_t *y, const uint16_t *x, const uint16_t *__restrict__ w, int64_t n, float eps,
                        int64_t off, int64_t rd, const int32_t *__restrict__ pos, const float *__restrict__ freqs) {
    constexpr int STEP = RMS_WARPS * 32 * 8;
    __shared__ float l0[TSB_CAP * 64];
    __shared__ float r_s;
    __shared__ float2 cs_s[RMS_WARPS * 32]; /* (cos, sin) of each rotary pair */
    const int64_t row = blockIdx.x;
    const uint16_t *xr = x + row * n; /* [n] bf16 */
    uint16_t *yr = y + row * n;       /* [n] bf16 */
    uint4 wp[RMS_PRE];
#pragma unroll
    for (int p = 0; p < RMS_PRE; p++) {
        const int64_t e = (int64_t)threadIdx.x * 8 + p * STEP;
        if (e < n) wp[p] = __ldg(reinterpret_cast<const uint4 *>(w + e));
    }
    /* the angles a thread a pair, before the statistic (whose barriers publish them): one thread
     * computing the 4 pairs of its 8 values after the norm put 8 sincos in a row on a decode
     * step's path */
    if (threadIdx.x < rd / 2) cs_s[threadIdx.x] = rope_cs(pos[row], freqs[threadIdx.x]);
    const float r = row_rstd_block(xr, n, eps, l0, &r_s);
#pragma unroll
    for (int p = 0; p < RMS_PRE; p++) {
        if ((int64_t)p * STEP >= n) continue; /* CTA-uniform */
        const int64_t e = (int64_t)threadIdx.x * 8 + p * STEP;
        const bool on = e < n; /* a warp's lanes: all on or off for whole 32-groups (n % 32 == 0) */
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = 0.0f;
        if (on) { /* each thread reads its elements before writing them (y may alias x) */
            float wv[8];
            unpack8(*reinterpret_cast<const uint4 *>(xr + e), v);
            unpack8(wp[p], wv);
#pragma unroll
            for (int i = 0; i < 8; i++) v[i] = ds_bf16f(ds_bf16_rne(__fmul_rn(wv[i], __fmul_rn(v[i], r))));
#pragma unroll
            for (int i = 0; i < 8; i += 2) {
                const int64_t q = e + i - off; /* even */
                if (q < 0 || q >= rd) continue;
                const float2 cs = cs_s[q / 2];
                uint16_t o0, o1;
                rope_rotate(v[i], v[i + 1], cs.x, cs.y, o0, o1);
                v[i] = ds_bf16f(o0), v[i + 1] = ds_bf16f(o1);
            }
        }
        if constexpr (MODE >= 0) qdq_group<MODE, 8>(v);
        if (on) *reinterpret_cast<uint4 *>(yr + e) = pack8(v);
    }
}

/* the one-pass form where the shapes allow it (false: the caller runs the ops in turn) */
static bool rmsnorm_post_launch(struct backend *be, bf16_t *y, const bf16_t *x, const bf16_t *w, int64_t T,
                                int64_t n, float eps, const struct norm_post *post) {
    if (n % 32 || n > RMS_PRE * RMS_WARPS * 32 * 8 || !al16(x) || !al16(y) || !al16(w) || T > 0x7fffffff ||
        post->off < 0 || post->off % 2 || post->rd < 0 || post->rd % 2 || post->off + post->rd > n ||
        post->rd > 2 * RMS_WARPS * 32 ||
        (post->rd > 0 && (!post->pos || !post->freqs)))
        return false;
    const dim3 grid((unsigned)T), block(RMS_WARPS * 32);
    cudaStream_t st = cuda_be_stream(be);
    switch (post->qdq) {
    case NORM_QDQ_NONE:
        rmsnorm_post_kernel<-1><<<grid, block, 0, st>>>(y, x, w, n, eps, post->off, post->rd, post->pos, post->freqs);
        break;
    case NORM_QDQ_FP8_32:
        rmsnorm_post_kernel<QDQ_FP8_32><<<grid, block, 0, st>>>(y, x, w, n, eps, post->off, post->rd, post->pos,
                                                                 post->freqs);
        break;
    case NORM_QDQ_FP4_32:
        rmsnorm_post_kernel<QDQ_FP4_32><<<grid, block, 0, st>>>(y, x, w, n, eps, post->off, post->rd, post->pos,
                                                                 post->freqs);
        break;
    default: ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "rmsnorm", "unknown QDQ mode after the norm");
    }
    KERNEL_CHECK();
    return true;
}

void cuda_op_qdq_fp8_32(struct backend *be, bf16_t *x, int64_t n) {
    qdq_launch<QDQ_FP8_32>(be, x, n, 32, "cuda_op_qdq_fp8_32");
}
void cuda_op_qdq_fp4_32(struct backend *be, bf16_t *x, int64_t n) {
    qdq_launch<QDQ_FP4_32>(be, x, n, 32, "cuda_op_qdq_fp4_32");
}
void cuda_op_qdq_fp4_16(struct backend *be, bf16_t *x, int64_t n) {
    qdq_launch<QDQ_FP4_16>(be, x, n, 16, "cuda_op_qdq_fp4_16");
}

/* ---------------------------------------------------------------------------------------------
 * mHC mixes: m[t, j] = (Σ_s Σ_{i in segment s} x_i · fn[j, i]) · r over the L = hc·D values of
 * row t (segments of BE_HC_MIX_SEG, as the CPU), then the Sinkhorn split. Two kernels:
 *
 * hc_mix_part: CTA (row block of R rows, segment s) computes the segment's sums for every
 * (row, j), a dependent chain of BE_HC_MIX_SEG fp32 adds each, one thread per pair in the small
 * row blocks and per row and JB mixes in the large ones (hc_jb); tiles of 64 values
 * of fn [nm, 64] and of the rows' x [R, 64] stream through a cp.async ring in shared memory, so
 * fn is read once per CTA for all its rows, and the chains read it conflict-free (row stride 68
 * floats). The segments run in parallel: one long chain per j over all of L (the CPU's order
 * before) kept a single CTA busy for ~370 µs at L = 16384. R = HC_R rows for small calls (decode:
 * more CTAs), hc_r_big (16 at hc <= 4) from HC_R_BIG_T rows on (prefill: fn's tiles, most of the
 * bytes a CTA moves, then serve 4x the rows; a 2K-token call took 0.43 ms at R = 4 on the H200).
 * R changes no bit: each chain's order is its own. (Tried and not kept: 4 segments per CTA in turn,
 * to spread the ring's fill over more tiles: hc_mixes 10.5 -> 10.8 ms per 2K-token prefill; and,
 * with JB = 4, R = 32 rows instead of 16: bench_step's 2K-token prefill 125.6 127.1 -> 127.3
 * 130.5 ms.)
 *
 * hc_mix_finish: CTA per row adds the segment sums in order, takes the row's sum of squares in
 * torch's order (torch_sum_block), and the Sinkhorn split runs on one warp, a lane per element of C
 * (hc_split_sinkhorn_warp; HC * HC > 32: thread 0 with C in registers; HC is a template parameter).
 * The row's segment sums (NM x nseg, 6 KB at hc = 4, D = 4096) are staged in shared memory by
 * every thread's cp.async at the start, in flight while the row statistic runs, and the NM threads
 * fold them from there (where they fit and align; otherwise each walks its own in global memory,
 * 16 dependent rounds of 4 loads at nseg = 64). H200 Nsight (kernel_times.sh): 11.85 -> 10.34 µs
 * a call at batch 1, 43.7 -> 39.4 µs at 2,048 rows. (Tried before, without the overlap: the
 * partials fetched by the whole CTA in one coalesced round after the statistic, or held in
 * registers across it; the step did not move then: 6.02 / 9.19 / 18.91 -> 6.03 / 9.22 / 18.98 ms
 * at batch 1 / 8 / 64.) */

#define HC_R 4     /* rows per CTA (small calls) */
#define HC_R_BIG_T 64
/* <= 1024 chains, >= 2 stages, and registers for them (hc = 8 at 8 rows spilled under the SM90 JIT) */
template <int HC> struct hc_r_big { static constexpr int R = HC <= 4 ? 16 : (HC <= 6 ? 8 : HC_R); };
#define HC_KT 64   /* values per tile */
#define HC_FN_LD (HC_KT + 4)
#define HC_X_LD (HC_KT + 8)
#define HC_SMEM_MAX (46 * 1024)
/* hc_mix_finish's CTA: 640 threads (20 warps: the row statistic's 20 level-0 runs at hc 4, D 5120
 * in one round) for calls of up to ROW_WIDE_T rows, 256 above (a prefill chunk's rows fill the GPU
 * anyway, and there the wide CTA cost more: 1.57 -> 2.51 ms a 2K-token prefill, kernel_times.sh) */
#define HC_FIN_THREADS 640
#define HC_FIN_THREADS_NARROW 256
#define HC_PS_MAX 2048 /* floats of hc_mix_finish's staged segment sums (hc = 4, D = 4096: 24 x 68) */
static_assert(BE_HC_MIX_SEG % HC_KT == 0, "segments must be whole tiles");

/* mixes per chain thread of hc_mix_part at R rows: JB chains share the thread's x values, unpacked
 * once, in the vector form of the large row blocks (prefill). The small ones (decode, R = HC_R)
 * keep one chain a thread: a decode step's few rows are bound by the chains' latency, and 4 a
 * thread made batch 1 slower (H200 bench_step, 4.60 4.64 -> 4.72 4.76 ms); the unaligned fallback
 * too (with more the SM90 compiler spilled it). */
template <int HC, bool VEC, int R> struct hc_jb {
    static constexpr int NM = (2 + HC) * HC;
    static constexpr int JB = !VEC || R == HC_R ? 1 : (NM % 4 == 0 ? 4 : (NM % 3 == 0 ? 3 : 1));
};
template <int HC, int R = HC_R, int JB_ = 1>
struct hc_cfg {
    static constexpr int NM = (2 + HC) * HC;
    static constexpr int JB = JB_;
    static_assert(NM % JB == 0, "whole mix groups");
    static constexpr int NG = NM / JB; /* mix groups */
    static constexpr int CHAIN = R * NG;
    static constexpr int CHAIN_WARPS = (CHAIN + 31) / 32;
    static constexpr int THREADS = CHAIN_WARPS * 32;
    static constexpr int STAGE_BYTES = NM * HC_FN_LD * 4 + R * HC_X_LD * 2;
    static constexpr int STAGES = HC_SMEM_MAX / STAGE_BYTES > 4 ? 4 : HC_SMEM_MAX / STAGE_BYTES;
    static_assert(STAGES >= 2, "hc too large for the shared-memory ring");
    static_assert(STAGE_BYTES % 16 == 0, "stages must stay 16-byte aligned");
    static_assert(THREADS <= 1024, "one CTA's chains");
};

/* One Sinkhorn half-step on C [HC][HC] in registers: each line a (rows: OUTER = HC, INNER = 1;
 * columns: OUTER = 1, INNER = HC) divided by (its sum in order from 0) + eps. */
template <int HC, int OUTER, int INNER>
__device__ __forceinline__ void hc_sinkhorn_lines(float (&C)[HC * HC], float eps) {
#pragma unroll
    for (int a = 0; a < HC; a++) {
        float sum = 0.0f;
#pragma unroll
        for (int b = 0; b < HC; b++) sum = __fadd_rn(sum, C[a * OUTER + b * INNER]);
        const float den = __fadd_rn(sum, eps);
#pragma unroll
        for (int b = 0; b < HC; b++) C[a * OUTER + b * INNER] = __fdiv_rn(C[a * OUTER + b * INNER], den);
    }
}

/* split_sinkhorn of cpu_elementwise.c for one row, C[j][k] in registers. */
template <int HC>
__device__ void hc_split_sinkhorn(const float *m, const float *__restrict__ scale, const float *__restrict__ base,
                                  int iters, float eps, float *pre, float *post, float *comb) {
    const float s0 = scale[0], s1 = scale[1], s2 = scale[2];
#pragma unroll
    for (int j = 0; j < HC; j++) {
        pre[j] = __fadd_rn(ds_sigmoid(__fadd_rn(__fmul_rn(m[j], s0), base[j])), eps);
        post[j] = __fmul_rn(2.0f, ds_sigmoid(__fadd_rn(__fmul_rn(m[HC + j], s1), base[HC + j])));
    }
    float C[HC * HC];
#pragma unroll
    for (int j = 0; j < HC; j++) { /* softmax over k of row j, + eps */
        float *row = C + j * HC;
#pragma unroll
        for (int k = 0; k < HC; k++)
            row[k] = __fadd_rn(__fmul_rn(m[2 * HC + j * HC + k], s2), base[2 * HC + j * HC + k]);
        float mx = row[0];
#pragma unroll
        for (int k = 1; k < HC; k++) mx = row[k] > mx ? row[k] : mx;
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < HC; k++) {
            row[k] = ds_expf(__fsub_rn(row[k], mx));
            sum = __fadd_rn(sum, row[k]);
        }
#pragma unroll
        for (int k = 0; k < HC; k++) row[k] = __fadd_rn(__fdiv_rn(row[k], sum), eps);
    }
    /* a column step always (the CPU's first one runs even for iters <= 0), then iters - 1 passes of
     * row then column; the softmax made the rows sum to one, so the first pass is a column step alone */
    const int passes = iters > 1 ? iters : 1;
    for (int it = 0; it < passes; it++) {
        if (it > 0) hc_sinkhorn_lines<HC, HC, 1>(C, eps); /* rows */
        hc_sinkhorn_lines<HC, 1, HC>(C, eps);             /* columns */
    }
#pragma unroll
    for (int e = 0; e < HC * HC; e++) comb[e] = C[e];
}

/* The same split with one lane per element of C (HC * HC <= 32; called by a whole warp, lanes
 * past HC * HC compute on a copy of element 0 and store nothing). Bit for bit the serial version:
 * each lane gathers its row's (or column's) HC values by shuffles and runs the serial code's loop
 * over them in its order (the max, the sums), and rows (columns) are independent within a step,
 * so only where the work runs changes. One step costs a few shuffles and one division per lane,
 * where thread 0 alone ran HC * HC dependent-latency divisions per step (~25 µs per call at HC = 4
 * and 20 iterations). */
template <int HC>
__device__ void hc_split_sinkhorn_warp(const float *m, const float *__restrict__ scale, const float *__restrict__ base,
                                       int iters, float eps, float *pre, float *post, float *comb) {
    static_assert(HC * HC <= 32, "one lane per element of C");
    const int lane = threadIdx.x & 31;
    const bool on = lane < HC * HC;
    const int e = on ? lane : 0, j = e / HC, k = e % HC;
    const float s0 = scale[0], s1 = scale[1], s2 = scale[2];
    if (lane < HC) {
        pre[lane] = __fadd_rn(ds_sigmoid(__fadd_rn(__fmul_rn(m[lane], s0), base[lane])), eps);
        post[lane] = __fmul_rn(2.0f, ds_sigmoid(__fadd_rn(__fmul_rn(m[HC + lane], s1), base[HC + lane])));
    }
    float c = __fadd_rn(__fmul_rn(m[2 * HC + e], s2), base[2 * HC + e]);
    float v[HC];
#pragma unroll
    for (int q = 0; q < HC; q++) v[q] = __shfl_sync(0xffffffffu, c, j * HC + q);
    float mx = v[0];
#pragma unroll
    for (int q = 1; q < HC; q++) mx = v[q] > mx ? v[q] : mx;
    c = ds_expf(__fsub_rn(c, mx)); /* softmax over k of row j, + eps */
    float sum = 0.0f;
#pragma unroll
    for (int q = 0; q < HC; q++) sum = __fadd_rn(sum, __shfl_sync(0xffffffffu, c, j * HC + q));
    c = __fadd_rn(__fdiv_rn(c, sum), eps);
    const int passes = iters > 1 ? iters : 1; /* as hc_split_sinkhorn */
    for (int it = 0; it < passes; it++) {
        if (it > 0) {
            sum = 0.0f;
#pragma unroll
            for (int q = 0; q < HC; q++) sum = __fadd_rn(sum, __shfl_sync(0xffffffffu, c, j * HC + q));
            c = __fdiv_rn(c, __fadd_rn(sum, eps));
        }
        sum = 0.0f;
#pragma unroll
        for (int q = 0; q < HC; q++) sum = __fadd_rn(sum, __shfl_sync(0xffffffffu, c, q * HC + k));
        c = __fdiv_rn(c, __fadd_rn(sum, eps));
    }
    if (on) comb[lane] = c;
}

/* VEC: L % 8 == 0 and X, fn 16-byte aligned, tiles by cp.async; otherwise plain loads.
 * part: [T, NM, nseg] f32, segment sums. Thread (row r = tid % R, mix group jg = tid / R) runs the
 * JB chains of mixes jg·JB .. jg·JB + JB - 1 for row r side by side: each x value is unpacked
 * once for JB chains, and 8 consecutive lanes share one group's fn row (a broadcast) while reading
 * 8 rows of x (conflict-free, row stride 36 words). One thread per chain issued ~5.6 instructions
 * per multiply-add where the multiply and the add are 2 (Nsight Compute on the H200: 176 M warp
 * instructions for a 2K-token call's 1.0 G multiply-adds, issue slots 79 % busy): the unpack, the
 * loads, and the tile copy's index divisions (full tiles now take compile-time strides). Measured
 * (tests/gpu/kernel_times.sh, 2K-token prefill and batch 1): 219.7 -> 163.0 µs a call at 16 rows,
 * and 6.31 -> 5.44 µs at batch 1 (the copy strides alone). */
template <int HC, bool VEC, int R>
__global__ void __launch_bounds__(hc_cfg<HC, R, hc_jb<HC, VEC, R>::JB>::THREADS)
    hc_mix_part_kernel(float *__restrict__ part, const uint16_t *__restrict__ X, int64_t T, int64_t D,
                       const float *__restrict__ fn, int nseg) {
    using cfg = hc_cfg<HC, R, hc_jb<HC, VEC, R>::JB>;
    constexpr int NM = cfg::NM, JB = cfg::JB, STAGES = cfg::STAGES, SEG_TILES = BE_HC_MIX_SEG / HC_KT;
    extern __shared__ __align__(16) unsigned char hc_smem[]; /* STAGES × { fn [NM][68] f32, x [R][72] bf16 } */

    const int64_t L = HC * D;
    const int64_t t0 = (int64_t)blockIdx.x * R;
    const int seg = blockIdx.y;
    const int nrows = T - t0 < R ? (int)(T - t0) : R;
    const int all_tiles = (int)((L + HC_KT - 1) / HC_KT);
    const int tile0 = seg * SEG_TILES;
    const int ntiles = all_tiles - tile0 < SEG_TILES ? all_tiles - tile0 : SEG_TILES;
    const int tid = threadIdx.x;
    /* chain thread: row r, mixes jg·JB ..; JB = 1 (the fallback): consecutive lanes on one row */
    const int r = JB == 1 ? tid / NM : tid % R, jg = JB == 1 ? tid % NM : tid / R;
    const bool chain_live = tid < cfg::CHAIN && r < nrows;

    auto fn_tile = [&](int st) { return reinterpret_cast<float *>(hc_smem + (size_t)st * cfg::STAGE_BYTES); };
    auto x_tile = [&](int st) {
        return reinterpret_cast<uint16_t *>(hc_smem + (size_t)st * cfg::STAGE_BYTES + NM * HC_FN_LD * 4);
    };
    /* the copies of one tile: 16-byte chunks q < nf of fn (fch per row), then of x (xch per row) */
    auto copy_chunks = [&](float *fs, uint16_t *xs, int64_t e0, int fch, int xch) {
        const int nf = NM * fch, nx = R * xch;
        for (int q = tid; q < nf + nx; q += cfg::THREADS) {
            if (q < nf) {
                const int jj = q / fch, c = q % fch;
                ds_cp16(fs + jj * HC_FN_LD + c * 4, fn + jj * L + e0 + c * 4);
            } else {
                const int rr = (q - nf) / xch, c = (q - nf) % xch;
                if (rr < nrows) ds_cp16(xs + rr * HC_X_LD + c * 8, X + (t0 + rr) * L + e0 + c * 8);
            }
        }
    };
    auto load_tile = [&](int lt) {
        float *fs = fn_tile(lt % STAGES);
        uint16_t *xs = x_tile(lt % STAGES);
        const int64_t e0 = (int64_t)(tile0 + lt) * HC_KT;
        const int len = L - e0 < HC_KT ? (int)(L - e0) : HC_KT;
        if constexpr (VEC) { /* len % 8 == 0: whole 16-byte chunks; a full tile's strides are constants */
            if (len == HC_KT)
                copy_chunks(fs, xs, e0, HC_KT / 4, HC_KT / 8);
            else
                copy_chunks(fs, xs, e0, len / 4, len / 8);
        } else { /* the unaligned fallback */
            for (int q = tid; q < NM * HC_KT; q += cfg::THREADS)
                if (q % HC_KT < len) fs[(q / HC_KT) * HC_FN_LD + q % HC_KT] = fn[(q / HC_KT) * L + e0 + q % HC_KT];
            for (int q = tid; q < nrows * HC_KT; q += cfg::THREADS)
                if (q % HC_KT < len) xs[(q / HC_KT) * HC_X_LD + q % HC_KT] = X[(t0 + q / HC_KT) * L + e0 + q % HC_KT];
        }
    };

    float acc[JB];
#pragma unroll
    for (int jj = 0; jj < JB; jj++) acc[jj] = 0.0f;
#pragma unroll 1
    for (int st = 0; st < STAGES - 1; st++) {
        if (st < ntiles) load_tile(st);
        ds_cp_commit(); /* empty groups keep the wait count uniform */
    }
    for (int lt = 0; lt < ntiles; lt++) {
        ds_cp_wait<STAGES - 2>();
        __syncthreads(); /* tile's data visible; everyone is done with tile - 1's stage */
        if (lt + STAGES - 1 < ntiles) load_tile(lt + STAGES - 1);
        ds_cp_commit();
        const float *fs = fn_tile(lt % STAGES);
        const uint16_t *xs = x_tile(lt % STAGES);
        const int64_t e0 = (int64_t)(tile0 + lt) * HC_KT;
        const int len = L - e0 < HC_KT ? (int)(L - e0) : HC_KT;
        if (chain_live) {
            const float *fr = fs + jg * JB * HC_FN_LD;
            const uint16_t *xr = xs + r * HC_X_LD;
            if (len == HC_KT) {
#pragma unroll
                for (int ii = 0; ii < HC_KT; ii += 8) {
                    float xv[8];
                    unpack8(*reinterpret_cast<const uint4 *>(xr + ii), xv);
#pragma unroll
                    for (int jj = 0; jj < JB; jj++) {
                        const float4 f0 = *reinterpret_cast<const float4 *>(fr + jj * HC_FN_LD + ii);
                        const float4 f1 = *reinterpret_cast<const float4 *>(fr + jj * HC_FN_LD + ii + 4);
                        float a = acc[jj];
                        a = __fadd_rn(a, __fmul_rn(xv[0], f0.x));
                        a = __fadd_rn(a, __fmul_rn(xv[1], f0.y));
                        a = __fadd_rn(a, __fmul_rn(xv[2], f0.z));
                        a = __fadd_rn(a, __fmul_rn(xv[3], f0.w));
                        a = __fadd_rn(a, __fmul_rn(xv[4], f1.x));
                        a = __fadd_rn(a, __fmul_rn(xv[5], f1.y));
                        a = __fadd_rn(a, __fmul_rn(xv[6], f1.z));
                        a = __fadd_rn(a, __fmul_rn(xv[7], f1.w));
                        acc[jj] = a;
                    }
                }
            } else {
                for (int ii = 0; ii < len; ii++) {
                    const float xv = ds_bf16f(xr[ii]);
#pragma unroll
                    for (int jj = 0; jj < JB; jj++)
                        acc[jj] = __fadd_rn(acc[jj], __fmul_rn(xv, fr[jj * HC_FN_LD + ii]));
                }
            }
        }
    }
    ds_cp_wait<0>();
    if (chain_live)
#pragma unroll
        for (int jj = 0; jj < JB; jj++) part[((t0 + r) * NM + jg * JB + jj) * nseg + seg] = acc[jj];
}

template <int HC, int THREADS>
__global__ void __launch_bounds__(THREADS)
    hc_mix_finish_kernel(float *__restrict__ pre, float *__restrict__ post, float *__restrict__ comb,
                         const float *__restrict__ part, const uint16_t *__restrict__ X, int64_t D, int nseg,
                         const float *__restrict__ scale, const float *__restrict__ base, int iters,
                         float norm_eps, float hc_eps, bool staged) {
    constexpr int NM = hc_cfg<HC>::NM;
    static_assert(3 + NM <= THREADS, "one thread per mix (and per Sinkhorn parameter)");
    __shared__ float l0[TSB_CAP * 64];
    __shared__ float m_s[NM];
    __shared__ float prm_s[3 + NM]; /* scale [3], base [NM]: fetched first, so their latency hides under the row's */
    __shared__ float rn_s;
    __shared__ __align__(16) float ps[HC_PS_MAX]; /* the row's segment sums [NM][nseg + 4] (staged form) */
    const int64_t t = blockIdx.x, L = HC * D;
    const int tid = threadIdx.x;
    const int pld = nseg + 4; /* padded: the NM folding threads' reads spread over the banks */
    if (staged) { /* every thread's cp.async, in flight while the row statistic runs */
        const float *pr = part + t * NM * nseg; /* [NM][nseg] */
        const int nc = nseg / 4;
        for (int q = tid; q < NM * nc; q += THREADS) ds_cp16(ps + (q / nc) * pld + (q % nc) * 4, pr + q * 4);
        ds_cp_commit();
    }
    if (tid < 3 + NM) prm_s[tid] = tid < 3 ? scale[tid] : base[tid - 3];
    if (!staged && tid < NM) {
        const float *pr = part + (t * NM + tid) * nseg; /* [nseg] */
        float acc = 0.0f;
        for (int sg = 0; sg < nseg; sg++) acc = __fadd_rn(acc, pr[sg]);
        m_s[tid] = acc;
    }
    const float rn = row_rstd_block(X + t * L, L, norm_eps, l0, &rn_s); /* X row [L] bf16 */
    if (staged) {
        ds_cp_wait<0>();
        __syncthreads();
        if (tid < NM) {
            float acc = 0.0f;
            for (int sg = 0; sg < nseg; sg++) acc = __fadd_rn(acc, ps[tid * pld + sg]);
            m_s[tid] = acc;
        }
    }
    if (tid < NM) m_s[tid] = __fmul_rn(m_s[tid], rn);
    __syncthreads();
    if (HC * HC <= 32) {
        if (tid < 32)
            hc_split_sinkhorn_warp<(HC * HC <= 32 ? HC : 1)>(m_s, prm_s, prm_s + 3, iters, hc_eps, pre + t * HC,
                                                             post + t * HC, comb + t * HC * HC);
    } else if (tid == 0) {
        hc_split_sinkhorn<HC>(m_s, prm_s, prm_s + 3, iters, hc_eps, pre + t * HC, post + t * HC, comb + t * HC * HC);
    }
}

template <int HC, int R>
static void hc_mix_part_launch(struct backend *be, float *part, const bf16_t *X, int64_t T, int64_t D, const float *fn,
                               int nseg) {
    using cv = hc_cfg<HC, R, hc_jb<HC, true, R>::JB>;
    using cs = hc_cfg<HC, R, hc_jb<HC, false, R>::JB>; /* the same stage layout, more threads */
    const dim3 grid(ew_blocks(T, R), (unsigned)nseg);
    const size_t smem = (size_t)cv::STAGES * cv::STAGE_BYTES;
    if ((HC * D) % 8 == 0 && al16(X) && al16(fn))
        hc_mix_part_kernel<HC, true, R><<<grid, cv::THREADS, smem, cuda_be_stream(be)>>>(part, X, T, D, fn, nseg);
    else
        hc_mix_part_kernel<HC, false, R><<<grid, cs::THREADS, smem, cuda_be_stream(be)>>>(part, X, T, D, fn, nseg);
    KERNEL_CHECK();
}

template <int HC>
static void hc_mixes_launch(struct backend *be, float *pre, float *post, float *comb, const bf16_t *X, int64_t T,
                            int64_t D, const float *fn, const float *scale, const float *base, int iters,
                            float norm_eps, float hc_eps) {
    const int64_t L = HC * D;
    const int nseg = (int)((L + BE_HC_MIX_SEG - 1) / BE_HC_MIX_SEG);
    float *part = (float *)cuda_be_scratch_raw(be, (size_t)(T * hc_cfg<HC>::NM * nseg) * sizeof(float)); /* [T, NM, nseg] */
    if (T >= HC_R_BIG_T)
        hc_mix_part_launch<HC, hc_r_big<HC>::R>(be, part, X, T, D, fn, nseg);
    else
        hc_mix_part_launch<HC, HC_R>(be, part, X, T, D, fn, nseg);
    /* the segment sums staged in shared memory by 16-byte copies where they fit and align */
    const bool staged = nseg % 4 == 0 && hc_cfg<HC>::NM * (nseg + 4) <= HC_PS_MAX && al16(part);
    /* the wide CTA where the Sinkhorn runs on a warp (hc² <= 32); thread 0's C in registers (hc 6, 8)
     * spills under the wide CTA's register cap */
    constexpr int WIDE = HC * HC <= 32 ? HC_FIN_THREADS : HC_FIN_THREADS_NARROW;
    if (T <= ROW_WIDE_T)
        hc_mix_finish_kernel<HC, WIDE><<<(unsigned)T, WIDE, 0, cuda_be_stream(be)>>>(
            pre, post, comb, part, X, D, nseg, scale, base, iters, norm_eps, hc_eps, staged);
    else
        hc_mix_finish_kernel<HC, HC_FIN_THREADS_NARROW><<<(unsigned)T, HC_FIN_THREADS_NARROW, 0, cuda_be_stream(be)>>>(
            pre, post, comb, part, X, D, nseg, scale, base, iters, norm_eps, hc_eps, staged);
    KERNEL_CHECK();
    cuda_be_scratch_free(be, part);
}

void cuda_op_hc_mixes(struct backend *be, float *pre, float *post, float *comb, const bf16_t *X, int64_t T,
                      int64_t hc, int64_t D, const float *fn, const float *scale, const float *base, int iters,
                      float norm_eps, float hc_eps) {
    if (T <= 0) return;
    switch (hc) {
#define HC_CASE(H)                                                                                         \
    case H:                                                                                                \
        hc_mixes_launch<H>(be, pre, post, comb, X, T, D, fn, scale, base, iters, norm_eps, hc_eps);        \
        break;
        HC_CASE(1)
        HC_CASE(2)
        HC_CASE(3)
        HC_CASE(4)
        HC_CASE(6)
        HC_CASE(8)
#undef HC_CASE
    default:
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "hc_mixes", "hc_mult not instantiated (1, 2, 3, 4, 6, 8)");
    }
}

/* ---------------------------------------------------------------------------------------------
 * mHC collapse / expand / init: one thread per VEC consecutive d of a row, sums over the copies
 * j in order, as the CPU. */

template <int VEC>
__global__ void __launch_bounds__(EW_THREADS)
    hc_collapse_kernel(uint16_t *__restrict__ y, const uint16_t *__restrict__ X, const float *__restrict__ p,
                       int64_t T, int64_t hc, int64_t D) {
    const int64_t nv = D / VEC, g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= T * nv) return;
    const int64_t t = g / nv, d = (g % nv) * VEC;
    const uint16_t *xr = X + t * hc * D + d; /* X [T, hc, D] bf16 */
    const float *pr = p + t * hc;            /* p [T, hc] */
    float acc[VEC], xv[VEC];
    load_bf<VEC>(xr, xv);
    const float p0 = pr[0];
#pragma unroll
    for (int i = 0; i < VEC; i++) acc[i] = __fmul_rn(p0, xv[i]);
    for (int64_t jj = 1; jj < hc; jj++) {
        const float pj = pr[jj];
        load_bf<VEC>(xr + jj * D, xv);
#pragma unroll
        for (int i = 0; i < VEC; i++) acc[i] = __fadd_rn(acc[i], __fmul_rn(pj, xv[i]));
    }
    store_bf<VEC>(y + t * D + d, acc); /* y [T, D] bf16 */
}

/* hc_collapse with norm_w: the collapse and the rmsnorm after it in one pass per row (a CTA of
 * HCN_WARPS warps, HCN_WARPS_NARROW above ROW_WIDE_T rows): each thread collapses its 8-wide
 * chunks of the row with every copy's load issued at once (HC is a template parameter, as for
 * hc_mixes), rounds y to bf16 in shared memory, and the norm runs there — row_rstd_block's
 * torch-order sum of squares, then w · (y · r) — with the collapse's and rmsnorm_kernel's
 * arithmetic, so the bits are the two ops'.
 * It saves the norm's launch and its read of y; the norm weights are loaded before the sum, as
 * rmsnorm_kernel's. D up to HCN_MAX_D (y's row in shared memory); other shapes run the two
 * kernels. */
#define HCN_MAX_D 8192
/* 20 warps: at D = 5120 one 8-wide chunk a thread (every load of the collapse in one round) and the
 * norm's 5 level-0 runs in one round; with RMS_WARPS (4) a thread walked 5 chunks and warp 0 two
 * rounds of runs. H200, Nsight, batch 1 / 64: 8.7 / 9.5 -> 7.1 / 7.6 µs a call, with
 * HC_FIN_THREADS 256 -> 640 hc_mix_finish 15.2 / 15.4 -> 13.3 / 13.5 µs; bench_step decode ms, three
 * runs alternated (both changes over the router's rank kernel): b1 4.28 4.35 4.35 -> 4.28 4.29 4.31,
 * b8 6.80 6.86 6.80 -> 6.77 6.76 6.76, b64 14.85 14.99 14.84 -> 14.59 14.60 14.68. */
#define HCN_WARPS 20
#define HCN_WARPS_NARROW RMS_WARPS /* above ROW_WIDE_T rows: 1.54 -> 2.05 ms a 2K-token prefill with 20 */

template <int HC, int WARPS>
__global__ void __launch_bounds__(WARPS * 32)
    hc_collapse_norm_kernel(uint16_t *__restrict__ y, const uint16_t *__restrict__ X, const float *__restrict__ p,
                            const uint16_t *__restrict__ w, int64_t D, float eps) {
    constexpr int STEP = WARPS * 32 * 8, NP = (HCN_MAX_D + STEP - 1) / STEP;
    __shared__ __align__(16) uint16_t ys[HCN_MAX_D]; /* the row's collapsed y [D] bf16 */
    __shared__ float l0[TSB_CAP * 64];
    __shared__ float r_s;
    const int64_t t = blockIdx.x;
    const uint16_t *xr = X + t * HC * D; /* X [T, HC, D] bf16 */
    float pj[HC];
#pragma unroll
    for (int j = 0; j < HC; j++) pj[j] = p[t * HC + j];
    uint4 wp[NP];
#pragma unroll
    for (int q = 0; q < NP; q++) {
        const int64_t e = (int64_t)threadIdx.x * 8 + q * STEP;
        if (e >= D) break;
        uint4 xv[HC];
#pragma unroll
        for (int j = 0; j < HC; j++) xv[j] = *reinterpret_cast<const uint4 *>(xr + j * D + e);
        wp[q] = __ldg(reinterpret_cast<const uint4 *>(w + e));
        float acc[8], f[8];
        unpack8(xv[0], f);
#pragma unroll
        for (int i = 0; i < 8; i++) acc[i] = __fmul_rn(pj[0], f[i]);
#pragma unroll
        for (int j = 1; j < HC; j++) {
            unpack8(xv[j], f);
#pragma unroll
            for (int i = 0; i < 8; i++) acc[i] = __fadd_rn(acc[i], __fmul_rn(pj[j], f[i]));
        }
        *reinterpret_cast<uint4 *>(ys + e) = pack8(acc);
    }
    __syncthreads();
    const float r = row_rstd_block(ys, D, eps, l0, &r_s);
#pragma unroll
    for (int q = 0; q < NP; q++) {
        const int64_t e = (int64_t)threadIdx.x * 8 + q * STEP;
        if (e >= D) break;
        float xv[8], wv[8];
        unpack8(*reinterpret_cast<const uint4 *>(ys + e), xv);
        unpack8(wp[q], wv);
#pragma unroll
        for (int i = 0; i < 8; i++) xv[i] = __fmul_rn(wv[i], __fmul_rn(xv[i], r));
        *reinterpret_cast<uint4 *>(y + t * D + e) = pack8(xv);
    }
}

void cuda_op_hc_collapse(struct backend *be, bf16_t *y, const bf16_t *X, const float *p, int64_t T, int64_t hc,
                         int64_t D, const bf16_t *norm_w, float eps) {
    if (T <= 0 || D <= 0 || hc <= 0) return;
    cudaStream_t st = cuda_be_stream(be);
    if (norm_w && D % 8 == 0 && D <= HCN_MAX_D && al16(y) && al16(X) && al16(norm_w) && T <= 0x7fffffff) {
        bool done = true;
        switch (hc) {
#define HCN_CASE(H)                                                                                                    \
    case H:                                                                                                            \
        if (T <= ROW_WIDE_T)                                                                                           \
            hc_collapse_norm_kernel<H, HCN_WARPS><<<(unsigned)T, HCN_WARPS * 32, 0, st>>>(y, X, p, norm_w, D, eps);    \
        else                                                                                                           \
            hc_collapse_norm_kernel<H, HCN_WARPS_NARROW>                                                               \
                <<<(unsigned)T, HCN_WARPS_NARROW * 32, 0, st>>>(y, X, p, norm_w, D, eps);                              \
        break;
            HCN_CASE(1)
            HCN_CASE(2)
            HCN_CASE(3)
            HCN_CASE(4)
            HCN_CASE(6)
            HCN_CASE(8)
#undef HCN_CASE
        default: done = false;
        }
        if (done) {
            KERNEL_CHECK();
            return;
        }
    }
    if (D % 8 == 0 && al16(y) && al16(X))
        hc_collapse_kernel<8><<<ew_blocks(T * D / 8, EW_THREADS), EW_THREADS, 0, st>>>(y, X, p, T, hc, D);
    else
        hc_collapse_kernel<1><<<ew_blocks(T * D, EW_THREADS), EW_THREADS, 0, st>>>(y, X, p, T, hc, D);
    KERNEL_CHECK();
    if (norm_w) cuda_op_rmsnorm(be, y, y, norm_w, T, D, eps, NULL);
}

/* Thread (t, k, VEC d's): output copy k reads column k of C over the input copies (L1 serves the
 * other k's reads of the same X). */
template <int VEC>
__global__ void __launch_bounds__(EW_THREADS)
    hc_expand_kernel(uint16_t *__restrict__ Xo, const uint16_t *__restrict__ y, const uint16_t *__restrict__ X,
                     const float *__restrict__ post, const float *__restrict__ comb, int64_t T, int64_t hc,
                     int64_t D) {
    const int64_t nv = D / VEC, g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= T * hc * nv) return;
    const int64_t d = (g % nv) * VEC, tk = g / nv, k = tk % hc, t = tk / hc;
    const uint16_t *xr = X + t * hc * D + d; /* X [T, hc, D] bf16 */
    const float *c = comb + t * hc * hc;     /* comb [T, hc, hc]: c[j*hc + k] */
    float mix[VEC], xv[VEC];
    load_bf<VEC>(xr, xv);
    const float c0 = c[k];
#pragma unroll
    for (int i = 0; i < VEC; i++) mix[i] = __fmul_rn(c0, xv[i]);
    for (int64_t jj = 1; jj < hc; jj++) {
        const float cj = c[jj * hc + k];
        load_bf<VEC>(xr + jj * D, xv);
#pragma unroll
        for (int i = 0; i < VEC; i++) mix[i] = __fadd_rn(mix[i], __fmul_rn(cj, xv[i]));
    }
    const float pk = post[t * hc + k]; /* post [T, hc] */
    load_bf<VEC>(y + t * D + d, xv);   /* y [T, D] bf16 */
#pragma unroll
    for (int i = 0; i < VEC; i++) mix[i] = __fadd_rn(__fmul_rn(pk, xv[i]), mix[i]);
    store_bf<VEC>(Xo + tk * D + d, mix); /* Xo [T, hc, D] bf16 */
}

/* The same outputs with hc a template parameter: thread (t, VEC d's) reads the hc input copies
 * once and forms all hc output copies (the kernel above reads each input 16 bytes hc times, through
 * L1), in the same order per output. */
template <int HC>
__global__ void __launch_bounds__(EW_THREADS)
    hc_expand_all_kernel(uint16_t *__restrict__ Xo, const uint16_t *__restrict__ y, const uint16_t *__restrict__ X,
                         const float *__restrict__ post, const float *__restrict__ comb, int64_t T, int64_t D) {
    const int64_t nv = D / 8, g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= T * nv) return;
    const int64_t d = (g % nv) * 8, t = g / nv;
    const uint16_t *xr = X + t * HC * D + d; /* X [T, hc, D] bf16 */
    const float *c = comb + t * HC * HC;     /* comb [T, hc, hc]: c[j*hc + k] */
    float xv[HC][8], yv[8];
#pragma unroll
    for (int j = 0; j < HC; j++) load_bf<8>(xr + j * D, xv[j]);
    load_bf<8>(y + t * D + d, yv); /* y [T, D] bf16 */
#pragma unroll
    for (int k = 0; k < HC; k++) {
        float mix[8];
        const float c0 = c[k], pk = post[t * HC + k]; /* post [T, hc] */
#pragma unroll
        for (int i = 0; i < 8; i++) mix[i] = __fmul_rn(c0, xv[0][i]);
#pragma unroll
        for (int jj = 1; jj < HC; jj++) {
            const float cj = c[jj * HC + k];
#pragma unroll
            for (int i = 0; i < 8; i++) mix[i] = __fadd_rn(mix[i], __fmul_rn(cj, xv[jj][i]));
        }
#pragma unroll
        for (int i = 0; i < 8; i++) mix[i] = __fadd_rn(__fmul_rn(pk, yv[i]), mix[i]);
        store_bf<8>(Xo + (t * HC + k) * D + d, mix); /* Xo [T, hc, D] bf16 */
    }
}

void cuda_op_hc_expand(struct backend *be, bf16_t *Xo, const bf16_t *y, const bf16_t *X, const float *post,
                       const float *comb, int64_t T, int64_t hc, int64_t D) {
    if (T <= 0 || D <= 0 || hc <= 0) return;
    if (hc == 4 && D % 8 == 0 && al16(Xo) && al16(y) && al16(X))
        hc_expand_all_kernel<4><<<ew_blocks(T * D / 8, EW_THREADS), EW_THREADS, 0, cuda_be_stream(be)>>>(
            Xo, y, X, post, comb, T, D);
    else if (D % 8 == 0 && al16(Xo) && al16(y) && al16(X))
        hc_expand_kernel<8><<<ew_blocks(T * hc * D / 8, EW_THREADS), EW_THREADS, 0, cuda_be_stream(be)>>>(
            Xo, y, X, post, comb, T, hc, D);
    else
        hc_expand_kernel<1><<<ew_blocks(T * hc * D, EW_THREADS), EW_THREADS, 0, cuda_be_stream(be)>>>(
            Xo, y, X, post, comb, T, hc, D);
    KERNEL_CHECK();
}

/* X[t, c, :] = e[t, :]; pre[t] = one-hot(0). Thread g copies VEC values to every copy and, for
 * g < T·hc, also writes pre[g]. */
template <int VEC>
__global__ void __launch_bounds__(EW_THREADS)
    hc_init_kernel(uint16_t *__restrict__ X, float *__restrict__ pre, const uint16_t *__restrict__ e, int64_t T,
                   int64_t hc, int64_t D) {
    const int64_t nv = D / VEC, g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g < T * hc) pre[g] = g % hc == 0 ? 1.0f : 0.0f; /* pre [T, hc] */
    if (g >= T * nv) return;
    const int64_t t = g / nv, d = (g % nv) * VEC;
    if (VEC == 8) {
        const uint4 v = *reinterpret_cast<const uint4 *>(e + t * D + d); /* e [T, D] bf16 */
        for (int64_t c = 0; c < hc; c++) *reinterpret_cast<uint4 *>(X + (t * hc + c) * D + d) = v;
    } else {
        const uint16_t v = e[t * D + d];
        for (int64_t c = 0; c < hc; c++) X[(t * hc + c) * D + d] = v;
    }
}

void cuda_op_hc_init(struct backend *be, bf16_t *X, float *pre, const bf16_t *e, int64_t T, int64_t hc,
                     int64_t D) {
    if (T <= 0 || hc <= 0) return;
    const bool vec = D % 8 == 0 && al16(X) && al16(e);
    const int64_t items = T * (vec ? D / 8 : D), n = items > T * hc ? items : T * hc;
    if (vec)
        hc_init_kernel<8><<<ew_blocks(n, EW_THREADS), EW_THREADS, 0, cuda_be_stream(be)>>>(X, pre, e, T, hc, D);
    else
        hc_init_kernel<1><<<ew_blocks(n, EW_THREADS), EW_THREADS, 0, cuda_be_stream(be)>>>(X, pre, e, T, hc, D);
    KERNEL_CHECK();
}

/* ---------------------------------------------------------------------------------------------
 * Embedding and Engram rows */

template <int VEC>
__global__ void __launch_bounds__(EW_THREADS)
    embed_kernel(uint16_t *__restrict__ e, const int32_t *__restrict__ ids, int64_t T,
                 const uint16_t *__restrict__ table, int64_t row0, int64_t nrows, int64_t D) {
    const int64_t nv = D / VEC, g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= T * nv) return;
    const int64_t t = g / nv, d = (g % nv) * VEC, id = ids[t];
    const bool own = id >= row0 && id < row0 + nrows; /* rows of other vocab shards: zeros */
    const uint16_t *src = table + (own ? id - row0 : 0) * D + d; /* table [nrows, D] bf16 */
    if (VEC == 8) {
        const uint4 v = own ? *reinterpret_cast<const uint4 *>(src) : make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4 *>(e + t * D + d) = v; /* e [T, D] bf16 */
    } else {
        e[t * D + d] = own ? *src : (uint16_t)0;
    }
}

void cuda_op_embed(struct backend *be, bf16_t *e, const int32_t *ids, int64_t T, const bf16_t *table,
                   int64_t row0, int64_t nrows, int64_t D) {
    if (T <= 0 || D <= 0) return;
    if (D % 8 == 0 && al16(e) && al16(table))
        embed_kernel<8><<<ew_blocks(T * D / 8, EW_THREADS), EW_THREADS, 0, cuda_be_stream(be)>>>(e, ids, T, table,
                                                                                                  row0, nrows, D);
    else
        embed_kernel<1><<<ew_blocks(T * D, EW_THREADS), EW_THREADS, 0, cuda_be_stream(be)>>>(e, ids, T, table, row0,
                                                                                              nrows, D);
    KERNEL_CHECK();
}

/* Thread per VEC table bytes of one (t, c) row: the table is host-resident (mapped pinned memory)
 * in the release, so 16-byte reads keep the bus requests few. A 16-value chunk lies inside one
 * 32-value scale block. */
template <int VEC>
__global__ void __launch_bounds__(EW_THREADS)
    engram_gather_kernel(uint16_t *__restrict__ rows, const int64_t *__restrict__ ids, int64_t TC,
                         const uint8_t *__restrict__ table, const uint8_t *__restrict__ scale, int64_t row0,
                         int64_t nrows, int64_t hd) {
    const int64_t nv = hd / VEC, g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= TC * nv) return;
    const int64_t tc = g / nv, jv = (g % nv) * VEC, id = ids[tc]; /* ids [T, C] int64 */
    uint16_t *out = rows + tc * hd + jv;                           /* rows [T, C, hd] bf16 */
    const bool own = id >= row0 && id < row0 + nrows;
    if (VEC == 16) {
        uint4 o0 = make_uint4(0, 0, 0, 0), o1 = o0;
        if (own) {
            const int64_t l = id - row0;
            const uint4 q = *reinterpret_cast<const uint4 *>(table + l * hd + jv); /* table [nrows, hd] e4m3 */
            const float s = ds_e8m0(scale[l * (hd / 32) + jv / 32]);              /* scale [nrows, hd/32] e8m0 */
            const uint32_t w[4] = {q.x, q.y, q.z, q.w};
            uint32_t o[8];
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const uint32_t b0 = (w[i / 2] >> (16 * (i & 1))) & 0xff, b1 = (w[i / 2] >> (16 * (i & 1) + 8)) & 0xff;
                o[i] = (uint32_t)ds_bf16_rne(__fmul_rn(ds_e4m3(b0), s)) | ((uint32_t)ds_bf16_rne(__fmul_rn(ds_e4m3(b1), s)) << 16);
            }
            o0 = make_uint4(o[0], o[1], o[2], o[3]);
            o1 = make_uint4(o[4], o[5], o[6], o[7]);
        }
        reinterpret_cast<uint4 *>(out)[0] = o0;
        reinterpret_cast<uint4 *>(out)[1] = o1;
    } else {
        uint16_t o = 0;
        if (own) {
            const int64_t l = id - row0;
            o = ds_bf16_rne(__fmul_rn(ds_e4m3(table[l * hd + jv]), ds_e8m0(scale[l * (hd / 32) + jv / 32])));
        }
        out[0] = o;
    }
}

void cuda_op_engram_gather(struct backend *be, bf16_t *rows, const int64_t *ids, int64_t T, int64_t C,
                           const uint8_t *table, const uint8_t *scale, int64_t row0, int64_t nrows, int64_t hd) {
    const int64_t TC = T * C;
    if (TC <= 0 || hd <= 0) return;
    if (hd % 16 == 0 && al16(table) && al16(rows))
        engram_gather_kernel<16><<<ew_blocks(TC * hd / 16, EW_THREADS), EW_THREADS, 0, cuda_be_stream(be)>>>(
            rows, ids, TC, table, scale, row0, nrows, hd);
    else
        engram_gather_kernel<1><<<ew_blocks(TC * hd, EW_THREADS), EW_THREADS, 0, cuda_be_stream(be)>>>(
            rows, ids, TC, table, scale, row0, nrows, hd);
    KERNEL_CHECK();
}

/* Engram gate, per (t, copy c): the three statistics (Σh², Σkey², Σ(h·w)·key) share one pass in
 * torch's order, then the row is rewritten in place: every read of the sum pass comes before the
 * gate is known (WIDE: the barrier that publishes it; a warp: the final shuffles of the sums), and
 * each thread reads its elements before writing them. WIDE, for up to EG_WIDE_ROWS rows: a CTA of
 * EG_WARPS warps per row (torch_sum_block: the warps sum the cascade's level-0 runs side by side,
 * warp 0 folds them in order); otherwise a warp per row, ROW_WARPS rows a CTA (torch_sum_warp),
 * the same bits. A warp walked the 80 groups of a 5,120-wide row alone: 20.5 µs a call at
 * decode batches, 9.5 µs with 8 warps (H200, in the step: tests/gpu/kernel_times.sh); a prefill
 * chunk's 8,192 rows took 200 -> 309 µs with them. */
#define EG_WARPS 8
template <int VEC, bool WIDE>
__global__ void __launch_bounds__(WIDE ? EG_WARPS * 32 : ROW_WARPS * 32)
    engram_gate_kernel(uint16_t *X, const uint16_t *__restrict__ kv, const float *__restrict__ w, int64_t T,
                       int64_t hc, int64_t D, float eps, float inv_sqrt_d, int al_pairs) {
    __shared__ float l0[WIDE ? TSB_CAP * 64 * 3 : 1];
    __shared__ float g_s;
    const int64_t row = WIDE ? (int64_t)blockIdx.x : (int64_t)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (!WIDE && row >= T * hc) return; /* whole warps; a warp needs no other */
    const int64_t t = row / hc, c = row % hc;
    uint16_t *h = X + row * D;                         /* X [T, hc, D] bf16 */
    const uint16_t *key = kv + t * (hc + 1) * D + c * D; /* kv [T, hc + 1, D] bf16: keys, then the value */
    const uint16_t *value = kv + t * (hc + 1) * D + hc * D;
    const float *wc = w + c * D; /* w [hc, D] f32 */
    const bool al = al_pairs != 0;
    auto pair = [&](int64_t e, float *a, float *b) {
        float h0, h1, k0, k1, w0, w1;
        load_bf_pair(h, e, al, h0, h1);
        load_bf_pair(key, e, al, k0, k1);
        if (al) {
            const float2 ww = *reinterpret_cast<const float2 *>(wc + e);
            w0 = ww.x;
            w1 = ww.y;
        } else {
            w0 = wc[e];
            w1 = wc[e + 1];
        }
        a[0] = __fmul_rn(h0, h0);
        b[0] = __fmul_rn(h1, h1);
        a[1] = __fmul_rn(k0, k0);
        b[1] = __fmul_rn(k1, k1);
        a[2] = __fmul_rn(__fmul_rn(h0, w0), k0);
        b[2] = __fmul_rn(__fmul_rn(h1, w1), k1);
    };
    auto one = [&](int64_t e, float *a) {
        const float h0 = ds_bf16f(h[e]), k0 = ds_bf16f(key[e]);
        a[0] = __fmul_rn(h0, h0);
        a[1] = __fmul_rn(k0, k0);
        a[2] = __fmul_rn(__fmul_rn(h0, wc[e]), k0);
    };
    float st[3];
    if constexpr (WIDE) torch_sum_block<3>(D, pair, one, st, l0);
    else torch_sum_warp<3>(D, pair, one, st);
    auto gate = [&]() {
        const float fd = (float)D;
        const float rstd = __fmul_rn(ds_rstd(st[0], fd, eps), ds_rstd(st[1], fd, eps));
        const float dot = __fmul_rn(__fmul_rn(st[2], rstd), inv_sqrt_d);
        return ds_sigmoid(copysignf(__fsqrt_rn(fmaxf(fabsf(dot), 1e-6f)), dot));
    };
    float g;
    if constexpr (WIDE) {
        if (threadIdx.x == 0) g_s = gate(); /* warp 0 holds the sums */
        __syncthreads();
        g = g_s;
    } else {
        g = gate(); /* every lane holds them */
    }
    const int64_t e0 = (int64_t)(WIDE ? threadIdx.x : lane) * VEC, step = (WIDE ? EG_WARPS * 32 : 32) * VEC;
    for (int64_t e = e0; e < D; e += step) {
        float hv[VEC], vv[VEC];
        load_bf<VEC>(h + e, hv);
        load_bf<VEC>(value + e, vv);
#pragma unroll
        for (int i = 0; i < VEC; i++) hv[i] = __fadd_rn(hv[i], __fmul_rn(g, vv[i]));
        store_bf<VEC>(h + e, hv);
    }
}

/* rows (T·hc) up to which the gate takes a CTA per row: a decode step's */
#define EG_WIDE_ROWS (4 * ROW_WIDE_T)

void cuda_op_engram_gate(struct backend *be, bf16_t *X, const bf16_t *kv, const float *w, int64_t T,
                         int64_t hc, int64_t D, float eps) {
    if (T <= 0 || hc <= 0 || D <= 0) return;
    const float inv_sqrt_d = (float)(1.0 / sqrt((double)D)); /* as the CPU: in double, then rounded */
    /* pairs (e even) are 4-byte (bf16) / 8-byte (w) aligned when D is even and the bases are */
    const int al_pairs = D % 2 == 0 && ((uintptr_t)X & 3) == 0 && ((uintptr_t)kv & 3) == 0 && ((uintptr_t)w & 7) == 0;
    const int64_t rows = T * hc;
    const bool v8 = D % 8 == 0 && al16(X) && al16(kv), wide = rows <= EG_WIDE_ROWS;
    cudaStream_t st = cuda_be_stream(be);
    const unsigned grid = wide ? (unsigned)rows : ew_blocks(rows, ROW_WARPS);
    const int threads = (wide ? EG_WARPS : ROW_WARPS) * 32;
#define EG_LAUNCH(V, W) \
    engram_gate_kernel<V, W><<<grid, threads, 0, st>>>(X, kv, w, T, hc, D, eps, inv_sqrt_d, al_pairs)
    if (wide) {
        if (v8) EG_LAUNCH(8, true);
        else EG_LAUNCH(1, true);
    } else {
        if (v8) EG_LAUNCH(8, false);
        else EG_LAUNCH(1, false);
    }
#undef EG_LAUNCH
    KERNEL_CHECK();
}

/* ---------------------------------------------------------------------------------------------
 * The TP interleave */

/* dst[t, s, :] = src[s, t, :]; V is the widest unit that divides `bytes` and both pointers. */
template <typename V>
__global__ void __launch_bounds__(EW_THREADS)
    interleave_kernel(V *__restrict__ dst, const V *__restrict__ src, int64_t S, int64_t T, int64_t nv) {
    const int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= S * T * nv) return;
    const int64_t c = g % nv, ts = g / nv, s = ts % S, t = ts / S;
    dst[g] = src[(s * T + t) * nv + c];
}

template <typename V>
static void interleave_launch(struct backend *be, void *dst, const void *src, int64_t S, int64_t T, size_t bytes) {
    const int64_t nv = (int64_t)(bytes / sizeof(V));
    interleave_kernel<V><<<ew_blocks(S * T * nv, EW_THREADS), EW_THREADS, 0, cuda_be_stream(be)>>>(
        (V *)dst, (const V *)src, S, T, nv);
    KERNEL_CHECK();
}

void cuda_op_interleave(struct backend *be, void *dst, const void *src, int64_t S, int64_t T, size_t bytes) {
    if (S <= 0 || T <= 0 || bytes == 0) return;
    const uintptr_t a = (uintptr_t)dst | (uintptr_t)src | (uintptr_t)bytes;
    if ((a & 15) == 0)
        interleave_launch<uint4>(be, dst, src, S, T, bytes);
    else if ((a & 7) == 0)
        interleave_launch<uint2>(be, dst, src, S, T, bytes);
    else if ((a & 3) == 0)
        interleave_launch<uint32_t>(be, dst, src, S, T, bytes);
    else if ((a & 1) == 0)
        interleave_launch<uint16_t>(be, dst, src, S, T, bytes);
    else
        interleave_launch<uint8_t>(be, dst, src, S, T, bytes);
}
