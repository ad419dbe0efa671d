/* Row-local ops of the SM80 backend: RMSNorm, interleaved RoPE, the three activation QDQ steps,
 * the token embedding, the Engram row gather and gate and the TP column interleave (the mHC ops,
 * row-local too and under the same rules, are in cuda_mhc.cu; the row sums and launch shapes both
 * use, in cuda_rows.cuh).
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

#include "cuda_rows.cuh"
#include "rope_common.cuh"
#include "linear_mma.h"
#include "mma_sm80.cuh"

/* ---------------------------------------------------------------------------------------------
 * RMSNorm: one CTA of RMS_WARPS warps per row, the sum of squares by torch_sum_block (a row of
 * 4096 is 4 independent level-0 runs: one warp per row spent ~23 µs on its serial loads). y may
 * alias x: every read of the sum pass comes before the barrier that publishes r, and in the output
 * pass each thread reads its elements before writing them. */

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
    cuda_norm_qdq(be, y, T * n, post->qdq);
}

void cuda_norm_qdq(struct backend *be, bf16_t *y, int64_t n, enum norm_qdq q) {
    if (q == NORM_QDQ_FP8_32) cuda_op_qdq_fp8_32(be, y, n);
    if (q == NORM_QDQ_FP4_32) cuda_op_qdq_fp4_32(be, y, n);
}

/* ---------------------------------------------------------------------------------------------
 * RoPE: thread (t, i, head slice) computes cos/sin of pos[t]·freqs[i] once and rotates pair i of
 * the heads h ≡ slice (mod hs); consecutive threads take consecutive pairs, so each head's rotary
 * part is one coalesced access. hs slices spread a row's heads over several threads for latency. */

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
 * QDQ_* mode or -1 (none). PARTS: x is not given; the row is a tensor-core linear's output as it
 * left it unfolded (parts [nch][T][n] fp32, CUDA_MMA_OUT_PARTS), folded and rounded to bf16 as the
 * linear's chunk fold would (mma_fold_chunks, mma_fold_bf16) into shared memory first: linear_post's
 * projection + norm, the fold's launch and the bf16 row's round trip saved, the same bits. */
/* One row of rmsnorm_post_kernel (a CTA's), in shared memory the caller's kernel declares: l0
 * [TSB_CAP · 64], r_s [1], cs_s [RMS_WARPS · 32], xs [RMS_PRE · RMS_WARPS · 256] (PARTS), ws [the
 * same]. PARTS: the row's partials start at parts + row · ldp, one chunk's cs floats apart (the
 * pair form reads its half of a pair linear's [nch][T][n1 + n2] partials).
 * The output pass is a loop, not unrolled: with its RoPE, QDQ and act quant unrolled RMS_PRE times
 * the kernel was 72 KB of code a form (140 KB the pair's), run once a call, and at decode the
 * weights streaming through L2 between two calls leave none of it cached: the pair's norm took
 * 12.3 µs in a batch-1 step (H200, step_timeline.sh lanes; 4-5 µs a lone norm in a loop of its
 * own), 10.1 -> 17.3 µs alone with the SMs' instruction caches flushed by other code before it
 * (event time; the single forms, half the code, moved < 1 µs). As a loop (76 KB the pair, of which
 * the statistic's torch-order sum is most) it takes 7.1 µs in the step; batch 1 -2.4 %, batch 8
 * -1.7 % (bench_step, two runs alternated; results/PERFORMANCE_HISTORY.md). The row's weights are
 * prefetched into ws by cp.async (each thread its own 16-byte pieces, read back by the same
 * thread), as registers held them before: an array the loop cannot index. */
template <int MODE, bool PARTS, bool ACT>
__device__ __forceinline__ void rmsnorm_post_row(int64_t row, uint16_t *y, const uint16_t *x, const float *__restrict__ parts,
                                                 int64_t ldp, int64_t cs, int nch, const uint16_t *__restrict__ w,
                                                 int64_t n, float eps, int64_t off, int64_t rd,
                                                 const int32_t *__restrict__ pos, const float *__restrict__ freqs,
                                                 uint32_t *ya, float *l0, float *r_s, float2 *cs_s, uint16_t *xs, uint16_t *ws) {
    constexpr int STEP = RMS_WARPS * 32 * 8;
    const uint16_t *xr = PARTS ? xs : x + row * n; /* [n] bf16 */
    uint16_t *yr = y + row * n;                    /* [n] bf16 */
    auto prefetch_w = [&]() {
#pragma unroll
        for (int p = 0; p < RMS_PRE; p++) {
            const int64_t e = (int64_t)threadIdx.x * 8 + p * STEP;
            if (e < n) ds_cp16(ws + e, w + e);
        }
        ds_cp_commit();
    };
    if (!PARTS) prefetch_w();
    /* the angles a thread a pair, before the statistic (whose barriers publish them): one thread
     * computing the 4 pairs of its 8 values after the norm put 8 sincos in a row on a decode
     * step's path */
    if (threadIdx.x < rd / 2) cs_s[threadIdx.x] = rope_cs(pos[row], freqs[threadIdx.x]);
    if constexpr (PARTS) {
        /* 4 values a step, one 16-byte load a chunk; the weights are fetched after it, during the
         * statistic (held across the fold, the SM90 compiler spilled the QDQ forms) */
#pragma unroll 1
        for (int64_t e = (int64_t)threadIdx.x * 4; e < n; e += RMS_WARPS * 32 * 4) {
            const float4 v = mma_fold_chunks4(reinterpret_cast<const float4 *>(parts + row * ldp + e), cs / 4, nch);
            *reinterpret_cast<uint2 *>(xs + e) =
                make_uint2((uint32_t)mma_fold_bf16(v.x) | ((uint32_t)mma_fold_bf16(v.y) << 16),
                           (uint32_t)mma_fold_bf16(v.z) | ((uint32_t)mma_fold_bf16(v.w) << 16));
        }
        __syncthreads();
        prefetch_w();
    }
    const float r = row_rstd_block(xr, n, eps, l0, r_s);
    ds_cp_wait<0>();
#pragma unroll 1
    for (int p = 0; p < RMS_PRE; p++) {
        if ((int64_t)p * STEP >= n) break; /* CTA-uniform */
        const int64_t e = (int64_t)threadIdx.x * 8 + p * STEP;
        const bool on = e < n; /* a warp's lanes: all on or off for whole 32-groups (n % 32 == 0) */
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = 0.0f;
        if (on) { /* each thread reads its elements before writing them (y may alias x) */
            float wv[8];
            unpack8(*reinterpret_cast<const uint4 *>(xr + e), v);
            unpack8(*reinterpret_cast<const uint4 *>(ws + e), wv);
#pragma unroll
            for (int i = 0; i < 8; i++) v[i] = ds_bf16f(ds_bf16_rne(__fmul_rn(wv[i], __fmul_rn(v[i], r))));
#pragma unroll
            for (int i = 0; i < 8; i += 2) {
                const int64_t q = e + i - off; /* even */
                if (q < 0 || q >= rd) continue;
                const float2 c = cs_s[q / 2];
                uint16_t o0, o1;
                rope_rotate(v[i], v[i + 1], c.x, c.y, o0, o1);
                v[i] = ds_bf16f(o0), v[i + 1] = ds_bf16f(o1);
            }
        }
        if constexpr (MODE >= 0) qdq_group<MODE, 8>(v);
        if (on) *reinterpret_cast<uint4 *>(yr + e) = pack8(v);
        if constexpr (ACT) { /* y's act quant (linear_post's ya): v holds its bf16 values, every lane on */
            uint32_t o[4];
            mma_quant8(v, o);
            if (on) mma_store_perm8(ya + (row * n + e) / 32 * 16, (int)((e >> 3) & 3), o);
        }
    }
}

template <int MODE, bool PARTS, bool ACT = false>
__global__ void __launch_bounds__(RMS_WARPS * 32)
    rmsnorm_post_kernel(uint16_t *y, const uint16_t *x, const float *__restrict__ parts, int nch,
                        const uint16_t *__restrict__ w, int64_t n, float eps, int64_t off, int64_t rd,
                        const int32_t *__restrict__ pos, const float *__restrict__ freqs, uint32_t *ya = nullptr) {
    __shared__ float l0[TSB_CAP * 64];
    __shared__ float r_s;
    __shared__ float2 cs_s[RMS_WARPS * 32]; /* (cos, sin) of each rotary pair */
    __shared__ __align__(16) uint16_t xs[PARTS ? RMS_PRE * RMS_WARPS * 32 * 8 : 8]; /* PARTS: the folded row [n] bf16 */
    __shared__ __align__(16) uint16_t ws[RMS_PRE * RMS_WARPS * 32 * 8];
    /* T·n between chunks (a CTA a row) */
    rmsnorm_post_row<MODE, PARTS, ACT>(blockIdx.x, y, x, parts, n, (int64_t)gridDim.x * n, nch, w, n, eps, off, rd, pos,
                                       freqs, ya, l0, &r_s, cs_s, xs, ws);
}

/* linear_post_pair's norms in one launch (cuda_op_linear_post_pair): CTA (row, half) folds and
 * normalizes its half of a pair linear's partials (parts [nch][T][n1 + n2] fp32): half 0 columns
 * 0 .. n1 - 1 with no QDQ (and y's act form where ya0 is given), half 1 the rest with QDQ MODE1;
 * each with its own weights, eps and RoPE. The two norms' bits, one launch and no two one-CTA
 * norms side by side on two lanes. */
struct rms_pair_half {
    uint16_t *y;
    const uint16_t *w;
    int64_t n, col, off, rd;
    float eps;
    const int32_t *pos;
    const float *freqs;
};
template <int MODE1, bool ACT0>
__global__ void __launch_bounds__(RMS_WARPS * 32)
    rmsnorm_post_pair_kernel(const float *__restrict__ parts, int64_t ldp, int nch, rms_pair_half h0, rms_pair_half h1,
                             uint32_t *ya0) {
    __shared__ float l0[TSB_CAP * 64];
    __shared__ float r_s;
    __shared__ float2 cs_s[RMS_WARPS * 32];
    __shared__ __align__(16) uint16_t xs[RMS_PRE * RMS_WARPS * 32 * 8];
    __shared__ __align__(16) uint16_t ws[RMS_PRE * RMS_WARPS * 32 * 8];
    const int64_t cs = (int64_t)gridDim.x * ldp;
    const bool second = blockIdx.y != 0;
    /* the half's parameters picked first, so the two bodies share their registers' setup */
    uint16_t *y = second ? h1.y : h0.y;
    const uint16_t *w = second ? h1.w : h0.w;
    const int64_t n = second ? h1.n : h0.n, col = second ? h1.col : h0.col, off = second ? h1.off : h0.off,
                  rd = second ? h1.rd : h0.rd;
    const float eps = second ? h1.eps : h0.eps;
    const int32_t *pos = second ? h1.pos : h0.pos;
    const float *freqs = second ? h1.freqs : h0.freqs;
    if (!second)
        rmsnorm_post_row<-1, true, ACT0>(blockIdx.x, y, NULL, parts + col, ldp, cs, nch, w, n, eps, off, rd, pos, freqs,
                                          ya0, l0, &r_s, cs_s, xs, ws);
    else
        rmsnorm_post_row<MODE1, true, false>(blockIdx.x, y, NULL, parts + col, ldp, cs, nch, w, n, eps, off, rd, pos,
                                             freqs, NULL, l0, &r_s, cs_s, xs, ws);
}

bool cuda_rmsnorm_post_shape(int64_t T, int64_t n, const void *y, const void *w, const struct norm_post *post) {
    return n % 32 == 0 && n <= RMS_PRE * RMS_WARPS * 32 * 8 && al16(y) && al16(w) && T <= 0x7fffffff && post->off >= 0 &&
           post->off % 2 == 0 && post->rd >= 0 && post->rd % 2 == 0 && post->off + post->rd <= n &&
           post->rd <= 2 * RMS_WARPS * 32 && (post->rd == 0 || (post->pos && post->freqs));
}

template <bool PARTS>
static void rmsnorm_post_run(struct backend *be, bf16_t *y, const bf16_t *x, const float *parts, int nch,
                             const bf16_t *w, int64_t T, int64_t n, float eps, const struct norm_post *post) {
    const dim3 grid((unsigned)T), block(RMS_WARPS * 32);
    cudaStream_t st = cuda_be_stream(be);
    const int64_t off = post->off, rd = post->rd;
    switch (post->qdq) {
    case NORM_QDQ_NONE:
        rmsnorm_post_kernel<-1, PARTS><<<grid, block, 0, st>>>(y, x, parts, nch, w, n, eps, off, rd, post->pos, post->freqs);
        break;
    case NORM_QDQ_FP8_32:
        rmsnorm_post_kernel<QDQ_FP8_32, PARTS>
            <<<grid, block, 0, st>>>(y, x, parts, nch, w, n, eps, off, rd, post->pos, post->freqs);
        break;
    case NORM_QDQ_FP4_32:
        rmsnorm_post_kernel<QDQ_FP4_32, PARTS>
            <<<grid, block, 0, st>>>(y, x, parts, nch, w, n, eps, off, rd, post->pos, post->freqs);
        break;
    default: ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "rmsnorm", "unknown QDQ mode after the norm");
    }
    KERNEL_CHECK();
}

/* the one-pass form where the shapes allow it (false: the caller runs the ops in turn) */
static bool rmsnorm_post_launch(struct backend *be, bf16_t *y, const bf16_t *x, const bf16_t *w, int64_t T,
                                int64_t n, float eps, const struct norm_post *post) {
    if (!al16(x) || !cuda_rmsnorm_post_shape(T, n, y, w, post)) return false;
    rmsnorm_post_run<false>(be, y, x, NULL, 1, w, T, n, eps, post);
    return true;
}

void cuda_rmsnorm_post_parts(struct backend *be, bf16_t *y, const float *parts, int nch, const bf16_t *w, int64_t T,
                             int64_t n, float eps, const struct norm_post *post, void *ya) {
    if (T <= 0) return;
    if (!cuda_rmsnorm_post_shape(T, n, y, w, post) || !al16(parts) || nch < 1)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda rmsnorm (linear_post)", "a shape the one-pass norm refuses");
    if (ya && post->qdq == NORM_QDQ_NONE && al16(ya)) { /* y's act form in the same pass (the query chain's qr) */
        rmsnorm_post_kernel<-1, true, true><<<dim3((unsigned)T), dim3(RMS_WARPS * 32), 0, cuda_be_stream(be)>>>(
            y, NULL, parts, nch, w, n, eps, post->off, post->rd, post->pos, post->freqs, (uint32_t *)ya);
        KERNEL_CHECK();
        return;
    }
    rmsnorm_post_run<true>(be, y, NULL, parts, nch, w, T, n, eps, post);
    if (ya) cuda_linear_mma_act_quant((uint16_t *)ya, (const uint16_t *)y, T, n, (void *)cuda_be_stream(be));
}

bool cuda_rmsnorm_post_pair_shape(int64_t T, const float *parts, int64_t n1, const void *y1, const void *w1,
                                  const struct norm_post *p1, const void *ya1, int64_t n2, const void *y2, const void *w2,
                                  const struct norm_post *p2) {
    return cuda_rmsnorm_post_shape(T, n1, y1, w1, p1) && cuda_rmsnorm_post_shape(T, n2, y2, w2, p2) &&
           p1->qdq == NORM_QDQ_NONE && al16(parts) && n1 % 4 == 0 && n2 % 4 == 0 && (!ya1 || al16(ya1));
}

void cuda_rmsnorm_post_parts_pair(struct backend *be, const float *parts, int nch, int64_t T, bf16_t *y1,
                                  const bf16_t *w1, int64_t n1, float eps1, const struct norm_post *p1, void *ya1,
                                  bf16_t *y2, const bf16_t *w2, int64_t n2, float eps2, const struct norm_post *p2) {
    if (T <= 0) return;
    if (!cuda_rmsnorm_post_pair_shape(T, parts, n1, y1, w1, p1, ya1, n2, y2, w2, p2) || nch < 1)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda rmsnorm (linear_post_pair)", "a shape the pair norm refuses");
    const rms_pair_half h0 = {(uint16_t *)y1, (const uint16_t *)w1, n1, 0, p1->off, p1->rd, eps1, p1->pos, p1->freqs};
    const rms_pair_half h1 = {(uint16_t *)y2, (const uint16_t *)w2, n2, n1, p2->off, p2->rd, eps2, p2->pos, p2->freqs};
    const dim3 grid((unsigned)T, 2), block(RMS_WARPS * 32);
    cudaStream_t st = cuda_be_stream(be);
    const int64_t ldp = n1 + n2;
    uint32_t *ya = (uint32_t *)ya1;
#define PAIR_LAUNCH(M)                                                                                                 \
    do {                                                                                                               \
        if (ya) rmsnorm_post_pair_kernel<M, true><<<grid, block, 0, st>>>(parts, ldp, nch, h0, h1, ya);                \
        else rmsnorm_post_pair_kernel<M, false><<<grid, block, 0, st>>>(parts, ldp, nch, h0, h1, NULL);                \
    } while (0)
    switch (p2->qdq) {
    case NORM_QDQ_NONE: PAIR_LAUNCH(-1); break;
    case NORM_QDQ_FP8_32: PAIR_LAUNCH(QDQ_FP8_32); break;
    case NORM_QDQ_FP4_32: PAIR_LAUNCH(QDQ_FP4_32); break;
    default: ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "rmsnorm", "unknown QDQ mode after the norm");
    }
#undef PAIR_LAUNCH
    KERNEL_CHECK();
}

/* y [T, n] bf16 = a tensor-core linear's unfolded partials (parts [nch][T][n] fp32) folded and
 * rounded as its chunk fold would, then RoPE (rope_kernel's arithmetic, forward) on [off, off + rd)
 * of each head of `head` values: linear_post's projection + RoPE in one pass. A thread per pair of
 * outputs (n and head even, off even: a pair never straddles a head or the rotary part). */
__global__ void __launch_bounds__(EW_THREADS)
    rope_parts_kernel(uint16_t *__restrict__ y, const float *__restrict__ parts, int nch, int64_t T, int64_t n,
                      int64_t head, int64_t off, int64_t rd, const int32_t *__restrict__ pos,
                      const float *__restrict__ freqs) {
    const int64_t np = n / 2, g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= T * np) return;
    const int64_t t = g / np, col = 2 * (g - t * np), q = col % head - off;
    const float *pr = parts + t * n + col;
    uint16_t o0 = mma_fold_bf16(mma_fold_chunks(pr, T * n, nch)), o1 = mma_fold_bf16(mma_fold_chunks(pr + 1, T * n, nch));
    if (q >= 0 && q < rd) {
        const float2 cs = rope_cs(pos[t], freqs[q / 2]);
        rope_rotate(ds_bf16f(o0), ds_bf16f(o1), cs.x, cs.y, o0, o1);
    }
    *reinterpret_cast<uint32_t *>(y + t * n + col) = (uint32_t)o0 | ((uint32_t)o1 << 16);
}

bool cuda_rope_parts_shape(int64_t n, int64_t head, const void *y, const struct norm_post *post) {
    return head > 0 && head % 2 == 0 && n % head == 0 && ((uintptr_t)y & 3) == 0 && post->off >= 0 && post->off % 2 == 0 &&
           post->rd >= 0 && post->rd % 2 == 0 && post->off + post->rd <= head && (post->rd == 0 || (post->pos && post->freqs));
}

void cuda_rope_parts(struct backend *be, bf16_t *y, const float *parts, int nch, int64_t T, int64_t n, int64_t head,
                     const struct norm_post *post) {
    if (T <= 0 || n <= 0) return;
    if (!cuda_rope_parts_shape(n, head, y, post) || nch < 1)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda rope (linear_post)", "a shape the fused RoPE refuses");
    rope_parts_kernel<<<ew_blocks(T * (n / 2), EW_THREADS), EW_THREADS, 0, cuda_be_stream(be)>>>(
        y, parts, nch, T, n, head, post->off, post->rd, post->pos, post->freqs);
    KERNEL_CHECK();
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
