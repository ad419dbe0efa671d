/* Mixture-of-experts ops of the SM80 backend (MODEL.md §3.10): the sqrt-softplus router, the
 * routed FP4 experts, the ascending-id combine and the FP8 shared expert.
 *
 * Everything here is bit-identical to the CPU backend (kernels/cpu/cpu_moe.c), including the
 * transcendental functions: expf and log1pf are ports of the exact glibc code the CPU oracle
 * calls (glibc 2.36 on CI, 2.39 on the GPU machine: expf is the 2017 double-precision table
 * algorithm, whose x86-64 FMA variant glibc selects on any AVX2 machine — its contractions are
 * reproduced one for one; log1pf is the fdlibm float code, no FMA). CUDA's own expf (2 ulp) or
 * a correctly rounded one would differ from glibc in about 1e-4 of the inputs. If the CPU ran on
 * another libm (or a glibc >= 2.41 with CORE-MATH log1pf), the router scores and the SwiGLU
 * could differ from it by 1 ulp of fp32 there; nothing else would.
 *
 * Routed experts: by default on the tensor cores (moe_mma_sm80.cu, the same bits as the
 * tensor-core linears); with --exact-linears the exact kernels here. Both without a host
 * synchronization: idx/wts stay on the device. A one-CTA plan kernel (moe_common.cuh) buckets
 * the (t, slot) pairs routed to this rank's experts by expert (counting sort) and cuts every
 * expert's bucket into tiles of at most 4 pairs; the expert kernels then run over
 * (tile slot x output-row tile), each CTA finding its expert and pairs in the plan, so a tile's
 * weights are read once for all its pairs. The experts' w/s pointers travel as kernel parameters
 * (64 experts per launch, 2 KB), so there is no table to upload or cache. The order of pairs
 * inside a bucket comes from shared-memory atomics and is not deterministic, but no output
 * depends on it: each (pair, output) is computed by the same arithmetic whichever tile it is in.
 *
 * FP4 GEMV (both expert kernels): lane j of a warp owns k-block j of a round of 32 blocks (its 16
 * bytes of a weight row are one coalesced warp load) and forms, per pair, the block partial
 * Σ_{i<32} qx·qw in k order; e4m3 x e2m1 products are exact in fp32, so the partial is formed
 * with FMAs without changing a bit (fma(a,b,c) = RN(a·b + c) = RN(RN(a·b) + c) when a·b is exact).
 * The partial is scaled ((p · s_x) · s_w, two roundings) and staged in shared memory, and after
 * the round one lane per (row, pair) folds the 32 scaled partials in block order into its
 * accumulator. That is the reference formula in the CPU's order (backend.h, linear). A warp
 * computes 4 dot products (gate/up: 2 rows of w1 and of w3; down: 4 rows of w2) for up to 4
 * pairs, 16 (row, pair) accumulators; a CTA is 16 warps (128 registers a thread, 48 KB of shared
 * memory), 32 rows of I for gate/up (one act-quant group of h) or 64 rows of D for down.
 * Measured on H200 at D = 4096, I = 2048, 32 local experts: T = 32 (17 experts hit) 232 us,
 * about 1 TB/s of expert weights; the kernels are instruction bound (~5 instructions per FP4
 * weight at one pair per expert, mostly the e2m1 decode, at 25% occupancy). */
#include "cuda_internal.h"
#include "cuda_libm.cuh"
#include "cuda_linear.h"
#include "cuda_router.h"
#include "linear_mma.h"
#include "mma_sm80.cuh"
#include "moe_common.cuh"
#include "moe_mma.h"

#include <cuda_fp16.h>

/* ---------------------------------------------------------------------------------------------
 * Exact conversions and quantization (src/formats.c) */

/* act_quant_fp8_32 / qdq of one 32-value group held one value per lane: the group amax (the CPU's
 * `if (a > m)` skips NaN, so a NaN lane counts as 0), floored at 1e-4, the power-of-two scale
 * 2^ceil(log2(amax/448)) from the bits, and the e4m3 code of clamp(v / scale). Returns the code's
 * value; *scale the scale. */
static __device__ __forceinline__ float mo_quant32(float v, float *scale) {
    float a = fabsf(v);
    a = a > 0.0f ? a : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    const float sc = ds_fp8_scale(a);
    *scale = sc;
    return ds_fp8_q(v, ds_pow2_inv(sc));
}

/* ---------------------------------------------------------------------------------------------
 * glibc's expf and log1pf (see the header) */

/* glibc sysdeps/ieee754/flt-32/s_log1pf.c (fdlibm), every float operation rounded as written. */
static __device__ float mo_log1pf(float x) {
    const float ln2_hi = __uint_as_float(0x3f317180u), ln2_lo = __uint_as_float(0x3717f7d1u);
    const float Lp1 = __uint_as_float(0x3f2aaaabu), Lp2 = __uint_as_float(0x3ecccccdu),
                Lp3 = __uint_as_float(0x3e924925u), Lp4 = __uint_as_float(0x3e638e29u),
                Lp5 = __uint_as_float(0x3e3a3325u), Lp6 = __uint_as_float(0x3e1cd04fu),
                Lp7 = __uint_as_float(0x3e178897u);
    float hfsq, f = 0.0f, c = 0.0f, s, z, R, u;
    int32_t k = 1, hu = 0;
    const int32_t hx = __float_as_int(x), ax = hx & 0x7fffffff;
    if (hx < 0x3ed413d7) { /* x < 0.41422 */
        if (ax >= 0x3f800000) { /* x <= -1 */
            if (x == -1.0f) return __int_as_float((int)0xff800000u);
            return __int_as_float((int)0xffc00000u); /* (x-x)/(x-x): x86's default NaN */
        }
        if (ax < 0x31000000) { /* |x| < 2^-29 */
            if (ax < 0x24800000) return x;
            return __fsub_rn(x, __fmul_rn(__fmul_rn(x, x), 0.5f));
        }
        if (hx > 0 || hx <= (int32_t)0xbe95f61fu) {
            k = 0;
            f = x;
            hu = 1;
        }
    }
    if (hx >= 0x7f800000) return __fadd_rn(x, x);
    if (k != 0) {
        if (hx < 0x5a000000) {
            u = __fadd_rn(1.0f, x);
            hu = __float_as_int(u);
            k = (hu >> 23) - 127;
            c = (k > 0) ? __fsub_rn(1.0f, __fsub_rn(u, x)) : __fsub_rn(x, __fsub_rn(u, 1.0f));
            c = __fdiv_rn(c, u);
        } else {
            u = x;
            hu = __float_as_int(u);
            k = (hu >> 23) - 127;
            c = 0.0f;
        }
        hu &= 0x007fffff;
        if (hu < 0x3504f7) {
            u = __int_as_float(hu | 0x3f800000);
        } else {
            k += 1;
            u = __int_as_float(hu | 0x3f000000);
            hu = (0x00800000 - hu) >> 2;
        }
        f = __fsub_rn(u, 1.0f);
    }
    const float kf = (float)k;
    hfsq = __fmul_rn(__fmul_rn(0.5f, f), f);
    if (hu == 0) { /* |f| < 2^-20 */
        if (f == 0.0f) {
            if (k == 0) return 0.0f;
            c = __fadd_rn(c, __fmul_rn(kf, ln2_lo));
            return __fadd_rn(__fmul_rn(kf, ln2_hi), c);
        }
        R = __fmul_rn(hfsq, __fsub_rn(1.0f, __fmul_rn(__uint_as_float(0x3f2aaaabu), f)));
        if (k == 0) return __fsub_rn(f, R);
        return __fsub_rn(__fmul_rn(kf, ln2_hi), __fsub_rn(__fsub_rn(R, __fadd_rn(__fmul_rn(kf, ln2_lo), c)), f));
    }
    s = __fdiv_rn(f, __fadd_rn(2.0f, f));
    z = __fmul_rn(s, s);
    R = __fadd_rn(Lp6, __fmul_rn(z, Lp7));
    R = __fadd_rn(Lp5, __fmul_rn(z, R));
    R = __fadd_rn(Lp4, __fmul_rn(z, R));
    R = __fadd_rn(Lp3, __fmul_rn(z, R));
    R = __fadd_rn(Lp2, __fmul_rn(z, R));
    R = __fadd_rn(Lp1, __fmul_rn(z, R));
    R = __fmul_rn(z, R);
    if (k == 0) return __fsub_rn(f, __fsub_rn(hfsq, __fmul_rn(s, __fadd_rn(hfsq, R))));
    return __fsub_rn(__fmul_rn(kf, ln2_hi),
                     __fsub_rn(__fsub_rn(hfsq, __fadd_rn(__fmul_rn(s, __fadd_rn(hfsq, R)),
                                                         __fadd_rn(__fmul_rn(kf, ln2_lo), c))),
                               f));
}

/* ---------------------------------------------------------------------------------------------
 * Router */

#define RT_WARPS 4
#define RT_MAX_E 2048 /* experts: a lane holds its taken flags in one 64-bit mask */
#define RT_MAX_K 64
#define RR_MAX_E 1024 /* router_rank_kernel: one thread an expert */
#define RR_MAX_K 32   /* ... and a warp's candidates are its lanes of local rank < k */

/* sqrt(softplus(z / temp)) of one gate logit (torch's softplus, threshold 20), the CPU's arithmetic */
static __device__ __forceinline__ float rt_score(float z, float temp) {
    const float zt = __fdiv_rn(z, temp);
    const float sp = zt > 20.0f ? zt : mo_log1pf(ds_expf(zt));
    return __fsqrt_rn(sp);
}

/* The CPU's selection for one token, by one warp: k rounds of an exact arg-max over s + bias (v).
 * The CPU scans ids upward keeping the first candidate and replacing it only on a strictly greater
 * value, i.e. the largest value with ties to the lower id, except that a NaN first candidate is
 * never replaced; the reduction does the same (NaN values only win as that first candidate), and
 * max involves no arithmetic, so the warp reduction's order cannot matter. Lane 0 writes the ids
 * (idx_row [k]) and the chosen scores (wsel [k], shared). */
static __device__ void rt_select_serial(int32_t *idx_row, float *wsel, const float *s, const float *v, int E, int k,
                                        int lane) {
    const int J = (E + 31) / 32;
    uint64_t taken = 0;
    for (int slot = 0; slot < k; slot++) {
        int first = 0x7fffffff, best = 0x7fffffff;
        float bv = 0.0f;
        for (int j = 0; j < J; j++) {
            int e = lane + 32 * j;
            if (e >= E || ((taken >> j) & 1)) continue;
            if (first == 0x7fffffff) first = e;
            float ve = v[e];
            if (ve == ve && (best == 0x7fffffff || ve > bv)) {
                best = e;
                bv = ve;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            int ob = __shfl_xor_sync(0xffffffffu, best, o), of = __shfl_xor_sync(0xffffffffu, first, o);
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            if (ob != 0x7fffffff && (best == 0x7fffffff || ov > bv || (ov == bv && ob < best))) {
                best = ob;
                bv = ov;
            }
            first = of < first ? of : first;
        }
        const float vf = v[first];
        const int chosen = vf != vf ? first : best;
        if ((chosen & 31) == lane) taken |= 1ull << (chosen >> 5);
        if (lane == 0) {
            idx_row[slot] = chosen;
            wsel[slot] = s[chosen];
        }
    }
}

/* Slot `slot`'s routing weight from the chosen scores wsel [k] (shared): with norm, divided by
 * (their sum in slot order + 1e-20), then times route_scale, as the CPU. Every slot's thread sums
 * on its own in the one order, so the slots need no barrier between the sum and the divisions. */
static __device__ __forceinline__ float rt_weight(const float *wsel, int slot, int k, int norm, float route_scale) {
    float w = wsel[slot];
    if (norm && k > 1) {
        float sum = 0.0f;
        for (int j = 0; j < k; j++) sum = __fadd_rn(sum, wsel[j]);
        w = __fdiv_rn(w, __fadd_rn(sum, 1e-20f));
    }
    return __fmul_rn(w, route_scale);
}

/* The selection kernel of calls of more than 2 x SMs tokens (4 a CTA) and of more than RR_MAX_E
 * experts or RR_MAX_K slots (the test hook's reference too): one warp per token row. Shared memory per warp: s [E] and
 * s + bias [E] fp32, the chosen weights [k]. Scores by the whole CTA, then rt_select_serial.
 * Tried and not kept: without a NaN (a warp vote), a lane kept the best (value, lower id) key of
 * its untaken ids as one 64-bit word, a round was one 64-bit warp max and only the winner's lane
 * rescanned its ids — H200, Nsight at batch 1 (384 experts, top 6): 11.2 -> 14.2 µs a call.
 * Also not kept: the gate's fold (dense_fold_kernel, and at one row dense_seg_kernel) moved into
 * this kernel's score loop, the segment sums read where the scores are made (one launch fewer on
 * the routed chain, the same bits: router op test differ 0): each score's 40 dependent L2 reads
 * made the call 13.5 -> 28.5 µs (Nsight, batch 1, clocks locked), the step at batch 1 4.34 4.32
 * 4.35 -> 4.41 4.46 4.45 ms, batch 8 unchanged, batch 64 15.0 -> 14.9 ms (three runs alternated). */
__global__ void __launch_bounds__(RT_WARPS * 32)
    router_select_kernel(int32_t *__restrict__ idx, float *__restrict__ wts, const float *__restrict__ z,
                         const float *__restrict__ bias, int64_t T, int E, int k, float temp, int norm,
                         float route_scale, int tpc) {
    extern __shared__ float rt_sm[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float *s = rt_sm + (size_t)warp * (2 * E + RT_MAX_K), *v = s + E, *wsel = v + E;
    /* tpc tokens per CTA (1 or RT_WARPS), warp w selecting for token w; warps past tpc only score */
    const int64_t t = warp < tpc ? (int64_t)blockIdx.x * tpc + warp : T;
    /* the scores of the CTA's tokens by all its threads (at T = 1 a lone warp's 12 softplus per
     * lane were the kernel's latency), each element's arithmetic as before */
    const int64_t t0 = (int64_t)blockIdx.x * tpc;
    const int nt = (int)(T - t0 < tpc ? T - t0 : tpc);
    for (int q = threadIdx.x; q < nt * E; q += RT_WARPS * 32) {
        const int tw = q / E, e = q % E;
        float *sw = rt_sm + (size_t)tw * (2 * E + RT_MAX_K);
        const float sv = rt_score(z[(t0 + tw) * E + e], temp);
        sw[e] = sv;
        sw[E + e] = bias ? __fadd_rn(sv, bias[e]) : sv;
    }
    __syncthreads();
    if (t >= T) return; /* no block-wide barrier below */
    rt_select_serial(idx + t * k, wsel, s, v, E, k, lane);
    __syncwarp();
    for (int slot = lane; slot < k; slot += 32) wts[t * k + slot] = rt_weight(wsel, slot, k, norm, route_scale);
}

/* The selection as ranks (E <= RR_MAX_E, k <= RR_MAX_K): one CTA per token, one thread per expert.
 * Without a NaN among the token's v = s + bias, the CPU's scan picks the top k of one total order,
 * "a before b" = v_a > v_b or (v_a == v_b and a < b) (ties, -0 = +0 included, to the lower id), in
 * that order, so slot r holds the expert that exactly r others come before. Each warp's lanes of
 * local rank < k (rank among the warp's 32 experts, by shuffles) are the candidates: every expert
 * of the top k is one (whatever comes before it is in the top k as well, so fewer than k of its
 * warp do), every top-k expert comes before any other, so a candidate's rank among the candidates
 * is its rank among all experts where that is < k, and >= k otherwise. With a NaN anywhere (a CTA
 * vote), warp 0 runs rt_select_serial instead, the NaN rules and all. The same ids and weights as
 * router_select_kernel, bit for bit (test_router_select: crafted ties, signed zeros, infinities and
 * NaNs, every E and k form). What it replaces at one token a CTA: the 128 threads' 3 scores each and
 * warp 0's k rounds of 12 dependent shared reads and 5 shuffle steps — a ~20k-cycle chain on the
 * routed experts' critical path. H200, 384 experts top 6: Nsight (eager, clocks as they run) 13.7 ->
 * 9.5 µs a call at batch 1 and 64; in the step (graphs, tests/gpu/kernel_times.sh) 10.0 -> 7.0 µs;
 * bench_step decode ms, three runs alternated, batch 1 4.39 4.38 4.39 -> 4.28 4.35 4.35, batch 8
 * and 64 unchanged (6.81 6.81 6.84 -> 6.80 6.86 6.80, 14.85 14.84 14.91 -> 14.85 14.99 14.84). */
__global__ void __launch_bounds__(RR_MAX_E)
    router_rank_kernel(int32_t *__restrict__ idx, float *__restrict__ wts, const float *__restrict__ z, int nch,
                       int64_t cs, const float *__restrict__ bias, int E, int k, float temp, int norm, float route_scale) {
    __shared__ float s[RR_MAX_E], v[RR_MAX_E]; /* [E] the scores, s + bias */
    __shared__ float2 cand[RR_MAX_E];         /* [warps][k] (v, id as int bits); id -1: no candidate */
    __shared__ float wsel[RR_MAX_K];          /* [k] the chosen scores */
    const int64_t t = blockIdx.x;
    const int e = threadIdx.x, lane = e & 31, warp = e >> 5, nc = (int)(blockDim.x >> 5) * k;
    const bool live = e < E;
    float vv = 0.0f;
    if (live) {
        const float sv = rt_score(mma_fold_chunks(z + t * E + e, cs, nch), temp);
        vv = bias ? __fadd_rn(sv, bias[e]) : sv;
        s[e] = sv;
        v[e] = vv;
    }
    if (e < nc) cand[e] = make_float2(0.0f, __int_as_float(-1)); /* nc <= blockDim.x (k <= 32) */
    if (__syncthreads_or(live && vv != vv)) {
        if (warp == 0) {
            rt_select_serial(idx + t * k, wsel, s, v, E, k, lane);
            __syncwarp();
            for (int slot = lane; slot < k; slot += 32) wts[t * k + slot] = rt_weight(wsel, slot, k, norm, route_scale);
        }
        return;
    }
    const int nl = E - warp * 32 < 32 ? E - warp * 32 : 32; /* the warp's experts */
    int r = 0;
#pragma unroll
    for (int j = 0; j < 32; j++) {
        const float vj = __shfl_sync(0xffffffffu, vv, j);
        r += j < nl && (vj > vv || (vj == vv && j < lane));
    }
    if (live && r < k) cand[warp * k + r] = make_float2(vv, __int_as_float(e));
    __syncthreads();
    if (e < nc) {
        const float2 me = cand[e];
        const int ei = __float_as_int(me.y);
        if (ei >= 0) {
            int R = 0;
#pragma unroll 8
            for (int j = 0; j < nc; j++) {
                const float2 o = cand[j];
                const int ej = __float_as_int(o.y);
                R += ej >= 0 && (o.x > me.x || (o.x == me.x && ej < ei));
            }
            if (R < k) {
                idx[t * k + R] = ei;
                wsel[R] = s[ei];
            }
        }
    }
    __syncthreads();
    if (e < k) wts[t * k + e] = rt_weight(wsel, e, k, norm, route_scale);
}

/* Which form CUDA_ROUTER_AUTO takes: ranks while a token a CTA leaves the GPU CTAs to spare (a
 * decode step); above, the serial kernel's 4 tokens a CTA (a 2K-token prefill's 20 calls: 455 µs,
 * against 595 as ranks). */
static bool router_rank_ok(int64_t T, int64_t E, int64_t k) { return E <= RR_MAX_E && k <= RR_MAX_K && T <= 0x7fffffff; }
static int router_auto_form(int64_t T, int64_t E, int64_t k, int sms) {
    return router_rank_ok(T, E, k) && T <= 2 * (int64_t)sms ? CUDA_ROUTER_RANK : CUDA_ROUTER_SERIAL;
}

/* The selection from gate logits z [T, E] fp32 (device) by the given form (cuda_router.h); with
 * nch > 1 (the rank form only) z is the gate's unfolded k-chunks [nch][T][E] (CUDA_MMA_OUT_PARTS),
 * which the rank kernel folds as the gate's own chunk fold would: its logits, bit for bit. */
static void router_select_launch(int form, int32_t *idx, float *wts, const float *z, int nch, const float *bias,
                                 int64_t T, int64_t E, int64_t k, float temp, bool norm, float route_scale, int sms,
                                 cudaStream_t st) {
    if (k < 1 || k > E || k > RT_MAX_K || E > RT_MAX_E)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda router", "unsupported top-k / expert count");
    if (form == CUDA_ROUTER_AUTO) form = router_auto_form(T, E, k, sms);
    if (nch > 1 && form != CUDA_ROUTER_RANK)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda router", "unfolded gate sums go to the rank form only");
    if (form == CUDA_ROUTER_RANK) {
        if (!router_rank_ok(T, E, k))
            ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda router", "the rank form takes <= 1024 experts, top <= 32");
        router_rank_kernel<<<(unsigned)T, (unsigned)((E + 31) / 32 * 32), 0, st>>>(idx, wts, z, nch < 1 ? 1 : nch, T * E,
                                                                                 bias, (int)E, (int)k, temp, norm ? 1 : 0,
                                                                                 route_scale);
    } else {
        size_t smem = sizeof(float) * (size_t)RT_WARPS * (size_t)(2 * E + RT_MAX_K);
        if (smem > 48 * 1024)
            ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda router", "too many experts for shared memory");
        /* a token a CTA while that fills the GPU: its scores by all 128 threads, 3 a thread for 384
         * experts, where 4 tokens a CTA gave each thread 12 (H200, Nsight at batch 8: 17.6 -> 11.3 µs
         * a call; bench_step decode ms, two runs alternated, batch 8 8.37 8.32 -> 8.24 8.27, batch 64
         * 18.09 17.98 -> 17.60 17.70, batch 1 unchanged) */
        const int tpc = T <= 2 * (int64_t)sms ? 1 : RT_WARPS;
        router_select_kernel<<<(unsigned)((T + tpc - 1) / tpc), RT_WARPS * 32, smem, st>>>(
            idx, wts, z, bias, T, (int)E, (int)k, temp, norm ? 1 : 0, route_scale, tpc);
    }
    KERNEL_CHECK();
}

extern "C" void cuda_router_select(int form, int32_t *idx, float *wts, const float *z, const float *bias, int64_t T,
                                   int64_t E, int64_t k, float temp, int norm, float route_scale, void *stream) {
    if (T <= 0) return;
    int dev = 0, sms = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    router_select_launch(form, idx, wts, z, 1, bias, T, E, k, temp, norm != 0, route_scale, sms, (cudaStream_t)stream);
}

void cuda_op_router(struct backend *be, int32_t *idx, float *wts, const bf16_t *x, int64_t T,
                    const struct qweight *gate, const float *bias, int64_t k, float temp, bool norm,
                    float route_scale) {
    const int64_t E = gate->n;
    if (T <= 0) return;
    if (k < 1 || k > E || k > RT_MAX_K || E > RT_MAX_E)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda router", "unsupported top-k / expert count");
    const int form = router_auto_form(T, E, k, cuda_be_sms(be));
    /* the rank form folds the gate's tensor-core k-chunks itself: one launch (the chunk fold) fewer
     * on the routed experts' critical path of a decode step */
    const int64_t nch = form == CUDA_ROUTER_RANK && cuda_be_mma(be) ? cuda_linear_mma_chunks(gate->k) : 1;
    float *z = (float *)cuda_be_scratch_raw(be, sizeof(float) * (size_t)(nch * T * E)); /* [nch][T, E] gate logits */
    int64_t got = nch > 1 ? cuda_linear_f32_parts(be, z, x, T, gate) : 0;
    if (!got) {
        cuda_op_linear_f32(be, z, x, T, gate); /* fp32, BE_DOT_SEG segments: the CPU's linear_f32 */
        got = 1;
    }
    router_select_launch(form, idx, wts, z, (int)got, bias, T, E, k, temp, norm, route_scale, cuda_be_sms(be),
                         cuda_be_stream(be));
    cuda_be_scratch_free(be, z);
}

/* ---------------------------------------------------------------------------------------------
 * Routed experts */

#define MOE_P 4        /* pairs per tile */
#define MOE_WARPS 16   /* warps per CTA of the expert kernels */
#define MOE_DOTS 4     /* dot products (weight rows) per warp: 4 x 4 pairs = 16 accumulators per warp */

/* act_quant_fp8_32 of x rows: one warp per 32-group; q = the e4m3 value as fp16 (exact), s the
 * group's scale. x [rows, k] bf16 -> q [rows, k], s [rows, k/32]. */
__global__ void moe_quant_kernel(__half *__restrict__ q, float *__restrict__ s, const uint16_t *__restrict__ x,
                                 int64_t groups) {
    const int64_t g = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (g >= groups) return;
    float sc, v = mo_quant32(ds_bf16f(x[g * 32 + lane]), &sc);
    q[g * 32 + lane] = __float2half_rn(v);
    if (lane == 0) s[g] = sc;
}


/* Shared memory of both expert kernels (48 KB): x of the tile's pairs for two rounds (cp.async
 * double buffer; 2 x 4 pairs x 32 blocks x 32 fp16, the four 16-byte chunks of block j stored at
 * chunk ^ ((j >> 1) & 3) so lanes' 16-byte reads are conflict free) and each warp's block
 * partials [16 combos][32 blocks] (block j of combo c at j ^ c: conflict free both when lane j
 * stores and when lane c folds). The gate/up epilogue reuses part[] for g and u. */
struct moe_smem {
    __half x[2][MOE_P][32][32];
    float part[MOE_WARPS][MOE_DOTS * MOE_P][32];
};

/* The FP4 tile of one CTA (see the header): warp w computes 4 dot products for NP pairs over
 * k = 32 nb. Dot d of warp w: gate/up (GATEUP) row row0 + 2w + (d >> 1) of matrix d & 1 (w0/s0 =
 * w1, w1/s1 = w3); down row min(row0 + 4w + d, n_rows - 1) of w0/s0 (clamped rows are computed and
 * never stored). x of pair t: row xrow[t] of the q values xq [*, k] fp16 and scales xs [*, nb].
 * Round r (32 blocks): x of round r+1 goes into the other buffer by cp.async and the weights of
 * round r+1 into registers while round r is computed; lane j forms the 4 x NP partials of block
 * 32r + j, stores them scaled, and lane d·NP + t folds (d, t)'s 32 in block order.
 * The weights are decoded as w·2^-126 (fp4_raw_pairs_j4 of each word of the device layout: a
 * code's 3 magnitude bits at bits 8..6 of its half, which read 2^(e-127)(1 + m/2) as the top of an
 * fp32, or the subnormal m·2^-127 for e = 0, its sign at bit 15; pk[j] << 16 is element j and
 * pk[j] & 0xffff0000 element j + 4 of the checkpoint's word; no multiply), so the partial is
 * formed in that scaled domain: every product and running sum is a multiple of 2^-136 (e4m3 = multiples of 2^-9, e2m1
 * of 2^-1, over 2^-126), which fp32 holds exactly below 2^-126 as a subnormal, and above it the
 * rounding commutes with the power of two; so the scaled partial is exactly 2^-126 times the
 * CPU's, and one exact multiply by 2^126 restores it before the two scale multiplies.
 * Returns the accumulator of combo lane = d NP + t (other lanes: 0). Called by every thread of
 * the CTA with the same arguments (barriers inside). */
template <int NP, bool GATEUP>
static __device__ __forceinline__ float mo_fp4_tile(const uint8_t *w0, const uint8_t *s0, const uint8_t *w1,
                                                    const uint8_t *s1, int64_t ld, int64_t s_ld, int64_t row0,
                                                    int64_t n_rows, const __half *xq, const float *xs,
                                                    const int32_t xrow[MOE_P], int64_t nb, moe_smem &sm) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float(*part)[32] = sm.part[warp];
    const int64_t wrow0 = row0 + (GATEUP ? 2 : 4) * warp;
    const int64_t dmax = n_rows - 1 - wrow0; /* down: dots past the last row repeat it */
    int32_t roff[MOE_DOTS]; /* row of dot d relative to the warp's first row */
#pragma unroll
    for (int d = 0; d < MOE_DOTS; d++) roff[d] = GATEUP ? (d >> 1) : (int32_t)(d < dmax ? d : dmax);
    const uint8_t *wb0 = w0 + wrow0 * ld, *wb1 = w1 + wrow0 * ld, *sb0 = s0 + wrow0 * s_ld, *sb1 = s1 + wrow0 * s_ld;
    auto load_w = [&](int64_t r, uint4(&wv)[MOE_DOTS], float(&sw)[MOE_DOTS]) { /* block r + lane */
        if (r + lane < nb) {
            const int64_t b = r + lane;
#pragma unroll
            for (int d = 0; d < MOE_DOTS; d++) {
                const uint8_t *wm = (GATEUP && (d & 1)) ? wb1 : wb0, *smt = (GATEUP && (d & 1)) ? sb1 : sb0;
                wv[d] = __ldg(reinterpret_cast<const uint4 *>(wm + roff[d] * ld + b * 16));
                sw[d] = ds_e8m0(__ldg(smt + roff[d] * s_ld + b));
            }
        }
    };
    auto load_x = [&](int64_t r, int buf) { /* 16-byte piece tid of each pair's 32 values per block */
        const int nr = (int)(nb - r < 32 ? nb - r : 32);
        if (tid < nr * 4) {
            const int blk = tid >> 2, c = (tid & 3) ^ ((blk >> 1) & 3);
#pragma unroll
            for (int t = 0; t < NP; t++)
                ds_cp16z(&sm.x[buf][t][blk][c * 8], xq + (int64_t)xrow[t] * nb * 32 + r * 32 + tid * 8, 16);
        }
        ds_cp_commit();
    };
    uint4 wv[MOE_DOTS];
    float sw[MOE_DOTS];
    __syncthreads(); /* the previous tile's readers of sm.x / part[] are done */
    load_x(0, 0);
    load_w(0, wv, sw);
    float acc = 0.0f;
    for (int64_t r0 = 0, ri = 0; r0 < nb; r0 += 32, ri++) {
        const int nr = (int)(nb - r0 < 32 ? nb - r0 : 32), buf = (int)(ri & 1);
        ds_cp_wait<0>(); /* this round's x (the only group in flight) */
        __syncthreads(); /* ... visible to all; the other buffer's and part[]'s readers are done */
        uint4 wn[MOE_DOTS];
        float sn[MOE_DOTS];
        if (r0 + 32 < nb) { /* the next round is in flight while this one is computed */
            load_x(r0 + 32, buf ^ 1);
            load_w(r0 + 32, wn, sn);
        }
        if (lane < nr) {
            const int64_t b = r0 + lane;
            float sx[NP];
#pragma unroll
            for (int t = 0; t < NP; t++) sx[t] = __ldg(xs + (int64_t)xrow[t] * nb + b);
            float p[MOE_DOTS][NP];
#pragma unroll
            for (int d = 0; d < MOE_DOTS; d++)
#pragma unroll
                for (int t = 0; t < NP; t++) p[d][t] = 0.0f;
#pragma unroll
            for (int qw = 0; qw < 4; qw++) { /* 32-bit word qw of the block: k = 8 qw .. 8 qw + 7 */
                uint32_t pk[MOE_DOTS][4]; /* weights j | j+4 of each dot (fp4_raw_pairs_j4) */
#pragma unroll
                for (int d = 0; d < MOE_DOTS; d++)
                    fp4_raw_pairs_j4(qw == 0 ? wv[d].x : qw == 1 ? wv[d].y : qw == 2 ? wv[d].z : wv[d].w, pk[d]);
#pragma unroll
                for (int hf = 0; hf < 2; hf++) { /* k = 8 qw + 4 hf .. + 3 */
                    float xv[NP][4];
#pragma unroll
                    for (int t = 0; t < NP; t++) {
                        const uint2 h = *reinterpret_cast<const uint2 *>(
                            &sm.x[buf][t][lane][(qw ^ ((lane >> 1) & 3)) * 8 + 4 * hf]);
                        const float2 f0 = __half22float2(*reinterpret_cast<const __half2 *>(&h.x));
                        const float2 f1 = __half22float2(*reinterpret_cast<const __half2 *>(&h.y));
                        xv[t][0] = f0.x;
                        xv[t][1] = f0.y;
                        xv[t][2] = f1.x;
                        xv[t][3] = f1.y;
                    }
#pragma unroll
                    for (int e = 0; e < 4; e++) /* k order; products exact, so FMA = mul + add */
#pragma unroll
                        for (int d = 0; d < MOE_DOTS; d++) {
                            const float wf = __uint_as_float(hf ? pk[d][e] & 0xffff0000u : pk[d][e] << 16);
#pragma unroll
                            for (int t = 0; t < NP; t++) p[d][t] = __fmaf_rn(xv[t][e], wf, p[d][t]);
                        }
                }
            }
#pragma unroll
            for (int d = 0; d < MOE_DOTS; d++)
#pragma unroll
                for (int t = 0; t < NP; t++) {
                    const int c = d * NP + t;
                    part[c][lane ^ c] = __fmul_rn(__fmul_rn(__fmul_rn(p[d][t], 0x1p126f), sx[t]), sw[d]);
                }
        }
        if (r0 + 32 < nb) {
#pragma unroll
            for (int d = 0; d < MOE_DOTS; d++) {
                wv[d] = wn[d];
                sw[d] = sn[d];
            }
        }
        __syncwarp();
        if (lane < MOE_DOTS * NP)
            for (int j = 0; j < nr; j++) acc = __fadd_rn(acc, part[lane][j ^ lane]); /* block order */
    }
    return acc;
}

/* pairs[i] for a runtime i without a local-memory array (i < MOE_P) */
static __device__ __forceinline__ int32_t mo_sel(const int32_t pairs[MOE_P], int i) {
    int32_t p = pairs[0];
#pragma unroll
    for (int t = 1; t < MOE_P; t++) p = i == t ? pairs[t] : p;
    return p;
}

/* The tile j of the plan this CTA takes: expert (le, from a binary search of tstart) and its
 * pairs (entries past np repeat the first). Returns np (>= 1 for j < tstart[c0 + cn]). */
static __device__ int mo_tile(const int32_t *plan, int n_local, int64_t j, int c0, int cn, int *le_out,
                              int32_t pairs[MOE_P]) {
    int64_t first;
    const int np = moe_tile_span(plan, n_local, j, c0, cn, MOE_P, le_out, &first);
    const int32_t *list = plan + 2 * (n_local + 1);
#pragma unroll
    for (int t = 0; t < MOE_P; t++) pairs[t] = list[first + (t < np ? t : 0)];
    return np;
}

/* Gate/up + SwiGLU + act_quant of h. Grid: x = tile slot (strides over the chunk's tiles), y =
 * 32-row tile of I (blockIdx.y * 32). 512 threads; warp w owns rows 2w, 2w+1 of w1 and of w3.
 * After the tile the CTA holds g and u for 32 consecutive rows, exactly one 32-group of h per
 * pair: warp t (< np) forms h = bf16(wts · silu(min(g, limit)) · clamp(u)) and quantizes the
 * group into qh/sh. qx [T, D] fp16, sx [T, D/32]; qh [M, I] fp16, sh [M, I/32] (rows = flat pair
 * ids t·k + slot). */
__global__ void __launch_bounds__(MOE_WARPS * 32, 1)
    moe_gateup_kernel(moe_wtab tab, int c0, int cn, const int32_t *__restrict__ plan, int n_local,
                      const __half *__restrict__ qx, const float *__restrict__ sx, const float *__restrict__ wts,
                      int64_t kslots, int64_t D, int64_t I, int64_t ld, int64_t s_ld, float limit,
                      __half *__restrict__ qh, float *__restrict__ sh) {
    __shared__ __align__(16) moe_smem sm;
    float(*gu)[MOE_P][32] = reinterpret_cast<float(*)[MOE_P][32]>(&sm.part[0][0][0]); /* [2][P][32] */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t i0 = (int64_t)blockIdx.y * 32;
    const int64_t tend = plan[c0 + cn];
    for (int64_t j = plan[c0] + blockIdx.x; j < tend; j += gridDim.x) {
        int le;
        int32_t pairs[MOE_P];
        const int np = mo_tile(plan, n_local, j, c0, cn, &le, pairs);
        int32_t xrow[MOE_P]; /* token rows of qx */
#pragma unroll
        for (int t = 0; t < MOE_P; t++) xrow[t] = (int32_t)(pairs[t] / kslots);
        const uint8_t *w0 = tab.w[le - c0][0], *s0 = tab.s[le - c0][0], *w1 = tab.w[le - c0][1],
                      *s1 = tab.s[le - c0][1];
        float acc;
        switch (np) {
        case 1: acc = mo_fp4_tile<1, true>(w0, s0, w1, s1, ld, s_ld, i0, I, qx, sx, xrow, D / 32, sm); break;
        case 2: acc = mo_fp4_tile<2, true>(w0, s0, w1, s1, ld, s_ld, i0, I, qx, sx, xrow, D / 32, sm); break;
        case 3: acc = mo_fp4_tile<3, true>(w0, s0, w1, s1, ld, s_ld, i0, I, qx, sx, xrow, D / 32, sm); break;
        default: acc = mo_fp4_tile<4, true>(w0, s0, w1, s1, ld, s_ld, i0, I, qx, sx, xrow, D / 32, sm); break;
        }
        __syncthreads(); /* every fold is done: part[] becomes gu[] */
        if (lane < MOE_DOTS * np) { /* combo lane = d np + t: row 2 warp + (d >> 1) of matrix d & 1 */
            int d = lane / np, t = lane % np;
            gu[d & 1][t][2 * warp + (d >> 1)] = ds_bf16f(ds_bf16_rne(acc));
        }
        __syncthreads();
        if (warp < np) {
            const int64_t p = mo_sel(pairs, warp);
            float h = mo_swiglu(gu[0][warp][lane], gu[1][warp][lane], limit, true, __ldg(wts + p));
            float sc, q = mo_quant32(ds_bf16f(ds_bf16_rne(h)), &sc);
            qh[p * I + i0 + lane] = __float2half_rn(q);
            if (lane == 0) sh[p * (I / 32) + i0 / 32] = sc;
        }
        __syncthreads(); /* gu (part) is rewritten by the next tile */
    }
}

/* Down projection: y[p, :] = bf16(h_p · w2ᵀ) for the tile's pairs. Grid: x = tile slot, y = 64-row
 * tile of Dout (4 rows per warp). qh [M, I] fp16, sh [M, I/32]; y [M, Dout] bf16 (M = T·k). */
__global__ void __launch_bounds__(MOE_WARPS * 32, 1)
    moe_down_kernel(moe_wtab tab, int c0, int cn, const int32_t *__restrict__ plan, int n_local,
                    const __half *__restrict__ qh, const float *__restrict__ sh, int64_t I, int64_t Dout, int64_t ld,
                    int64_t s_ld, uint16_t *__restrict__ y) {
    __shared__ __align__(16) moe_smem sm;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t row0 = (int64_t)blockIdx.y * 64;
    const int64_t tend = plan[c0 + cn];
    for (int64_t j = plan[c0] + blockIdx.x; j < tend; j += gridDim.x) {
        int le;
        int32_t pairs[MOE_P];
        const int np = mo_tile(plan, n_local, j, c0, cn, &le, pairs);
        const uint8_t *w0 = tab.w[le - c0][0], *s0 = tab.s[le - c0][0];
        float acc;
        switch (np) {
        case 1: acc = mo_fp4_tile<1, false>(w0, s0, w0, s0, ld, s_ld, row0, Dout, qh, sh, pairs, I / 32, sm); break;
        case 2: acc = mo_fp4_tile<2, false>(w0, s0, w0, s0, ld, s_ld, row0, Dout, qh, sh, pairs, I / 32, sm); break;
        case 3: acc = mo_fp4_tile<3, false>(w0, s0, w0, s0, ld, s_ld, row0, Dout, qh, sh, pairs, I / 32, sm); break;
        default: acc = mo_fp4_tile<4, false>(w0, s0, w0, s0, ld, s_ld, row0, Dout, qh, sh, pairs, I / 32, sm); break;
        }
        if (lane < MOE_DOTS * np) {
            int d = lane / np, t = lane % np;
            int64_t row = row0 + 4 * warp + d;
            if (row < Dout) y[(int64_t)mo_sel(pairs, t) * Dout + row] = ds_bf16_rne(acc);
        }
    }
}

static void check_expert(const struct qweight *w, int64_t n, int64_t k, int64_t ld, int64_t s_ld) {
    if (w->fmt != WF_FP4 || w->n != n || w->k != k || w->ld != ld || w->s_ld != s_ld || ((uintptr_t)w->w % 16) != 0)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda moe_experts",
                 "experts must be FP4 of one shape and stride, 16-byte aligned");
}

static size_t align256(size_t b) { return (b + 255) & ~(size_t)255; }

void cuda_op_moe_experts(struct backend *be, bf16_t *y, const bf16_t *x, const int32_t *idx, const float *wts,
                         int64_t T, int64_t k, int64_t e0, int64_t n_local, const struct qweight *w1,
                         const struct qweight *w3, const struct qweight *w2, float limit) {
    if (T <= 0 || k <= 0 || n_local <= 0) return;
    const int64_t D = w1[0].k, I = w1[0].n, Dout = w2[0].n, M = T * k;
    if (n_local > MOE_MAX_LOCAL || D % 32 || I % 32 || w2[0].k != I || M > 0x7fffffff)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda moe_experts",
                 "unsupported shape (D, I multiples of 32; w2 [Dout, I]; <= 1024 local experts)");
    for (int64_t le = 0; le < n_local; le++) { /* host structs: shapes only, no device read */
        check_expert(&w1[le], I, D, w1[0].ld, w1[0].s_ld);
        check_expert(&w3[le], I, D, w1[0].ld, w1[0].s_ld);
        check_expert(&w2[le], Dout, I, w2[0].ld, w2[0].s_ld);
    }
    if (w1[0].ld % 16 || w2[0].ld % 16)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda moe_experts", "FP4 row stride not 16-byte aligned");
    if (cuda_be_mma(be)) { /* tensor cores (moe_mma_sm80.cu); --exact-linears: the exact kernels below */
        cuda_moe_mma_experts(be, y, x, idx, wts, T, k, e0, n_local, w1, w3, w2, limit);
        return;
    }
    cudaStream_t st = cuda_be_stream(be);

    /* scratch: plan int32 [2 (n_local + 1) + M] | qx fp16 [T, D] | sx [T, D/32] | qh fp16 [M, I] |
     * sh [M, I/32] */
    size_t b_plan = align256(sizeof(int32_t) * (size_t)(2 * (n_local + 1) + M));
    size_t b_qx = align256(sizeof(__half) * (size_t)(T * D)), b_sx = align256(sizeof(float) * (size_t)(T * D / 32));
    size_t b_qh = align256(sizeof(__half) * (size_t)(M * I));
    size_t b_sh = align256(sizeof(float) * (size_t)(M * I / 32));
    uint8_t *scr = (uint8_t *)cuda_be_scratch_raw(be, b_plan + b_qx + b_sx + b_qh + b_sh);
    int32_t *plan = (int32_t *)scr;
    __half *qx = (__half *)(scr + b_plan);
    float *sx = (float *)(scr + b_plan + b_qx);
    __half *qh = (__half *)(scr + b_plan + b_qx + b_sx);
    float *sh = (float *)(scr + b_plan + b_qx + b_sx + b_qh);

    moe_plan_kernel<<<1, 1024, 0, st>>>(plan, NULL, idx, M, e0, (int)n_local, MOE_P);
    KERNEL_CHECK();
    int64_t groups = T * D / 32;
    moe_quant_kernel<<<(unsigned)((groups * 32 + 255) / 256), 256, 0, st>>>(qx, sx, (const uint16_t *)x, groups);
    KERNEL_CHECK();

    const int sms = cuda_be_sms(be);
    for (int64_t c0 = 0; c0 < n_local; c0 += MOE_CHUNK) {
        const int cn = (int)(n_local - c0 < MOE_CHUNK ? n_local - c0 : MOE_CHUNK);
        /* tiles of this chunk <= (M + min(cn, M)(P - 1)) / P; the grid is capped near 4 CTAs per
         * SM per kernel and each CTA strides over the tiles that exist */
        const int64_t tiles = moe_tiles_max(M, cn, MOE_P);
        moe_wtab ta, tb;
        for (int i = 0; i < cn; i++) {
            ta.w[i][0] = (const uint8_t *)w1[c0 + i].w;
            ta.s[i][0] = w1[c0 + i].s;
            ta.w[i][1] = (const uint8_t *)w3[c0 + i].w;
            ta.s[i][1] = w3[c0 + i].s;
            tb.w[i][0] = tb.w[i][1] = (const uint8_t *)w2[c0 + i].w;
            tb.s[i][0] = tb.s[i][1] = w2[c0 + i].s;
        }
        const int64_t ya = I / 32, yb = (Dout + 63) / 64;
        if (ya > 65535 || yb > 65535)
            ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda moe_experts", "too many row tiles");
        int64_t xa = (4 * (int64_t)sms + ya - 1) / ya, xb = (4 * (int64_t)sms + yb - 1) / yb;
        xa = xa < tiles ? xa : tiles;
        xb = xb < tiles ? xb : tiles;
        moe_gateup_kernel<<<dim3((unsigned)xa, (unsigned)ya), MOE_WARPS * 32, 0, st>>>(
            ta, (int)c0, cn, plan, (int)n_local, qx, sx, wts, k, D, I, w1[0].ld, w1[0].s_ld, limit, qh, sh);
        KERNEL_CHECK();
        moe_down_kernel<<<dim3((unsigned)xb, (unsigned)yb), MOE_WARPS * 32, 0, st>>>(
            tb, (int)c0, cn, plan, (int)n_local, qh, sh, I, Dout, w2[0].ld, w2[0].s_ld, y);
        KERNEL_CHECK();
    }
    cuda_be_scratch_free(be, scr);
}

/* ---------------------------------------------------------------------------------------------
 * Combine and shared expert */

/* The CTA's order of a token's slots `it` (k <= RT_MAX_K <= the CTA's threads) into its shared
 * order / part_of: ascending expert id (ties: the lower slot), with the part that computed each —
 * the order moe_combine adds them in. Every thread waits until the token before is done with them;
 * thread s < k counts the slots that go before its own (a smaller id, or the same id in a lower
 * slot) and writes its slot at that rank. Was thread 0's selection sort over the ids in global
 * memory, k^2 dependent loads and k 64-bit divisions while the CTA waited, at the head of the FFN's
 * last kernel on the critical path (~6 µs a call at batch 1, H100 timeline of 63e839c). */
__device__ __forceinline__ void combine_order_cta(const int32_t *it, int k, int64_t per_part, int *order,
                                                  int64_t *part_of) {
    __shared__ int32_t ids[RT_MAX_K];
    __syncthreads();
    const int s = (int)threadIdx.x;
    if (s < k) ids[s] = __ldg(it + s);
    __syncthreads();
    if (s < k) {
        const int32_t v = ids[s];
        int rank = 0;
        for (int j = 0; j < k; j++) rank += ids[j] < v || (ids[j] == v && j < s);
        order[rank] = s;
        part_of[rank] = (int64_t)v / per_part;
    }
    __syncthreads();
}

/* out[t, :] = bf16(acc + sh[t, :]), acc = +0 then += y_e in ascending expert id over the token's
 * slots (ties: lower slot, as the CPU's selection), parts past P skipped. Grid: x over D in
 * 256-wide pieces, y over tokens (strided); thread 0 orders the slots once per token. y [P, T, k, D]
 * bf16, sh [T, ld_sh] bf16 (its first D columns) or NULL, out [T, D] bf16. The shared expert's add is this kernel's epilogue:
 * as its own op (an fp32 [T, D] sum zero-filled, written, then read by an add kernel) it was two more
 * launches a layer on the FFN's critical path (~2.2 µs each, and the memset, at batch 1). Tried and
 * not kept: eight slots' loads issued before their in-order adds (H200, Nsight at batch 1: 6.61 ->
 * 6.81 µs a call). */
__global__ void moe_combine_kernel(uint16_t *__restrict__ out, const uint16_t *__restrict__ y,
                                   const int32_t *__restrict__ idx, const uint16_t *__restrict__ sh, int64_t ld_sh,
                                   int64_t T, int k, int64_t D, int64_t per_part, int64_t P) {
    __shared__ int order[RT_MAX_K];
    __shared__ int64_t part_of[RT_MAX_K];
    for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
        combine_order_cta(idx + t * k, k, per_part, order, part_of);
        for (int64_t d = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; d < D; d += (int64_t)gridDim.x * blockDim.x) {
            float a = 0.0f;
            for (int r = 0; r < k; r++) {
                int64_t part = part_of[r];
                if (part >= P) continue;
                a = __fadd_rn(a, ds_bf16f(y[((part * T + t) * k + order[r]) * D + d]));
            }
            if (sh) a = __fadd_rn(a, ds_bf16f(sh[t * ld_sh + d]));
            out[t * D + d] = ds_bf16_rne(a);
        }
    }
}

/* The same, 8 consecutive d per thread (D % 8 == 0, 16-byte aligned rows) and one CTA per token,
 * which orders its slots once for all of D: the kernel above moved 2 bytes of y per thread per
 * slot and re-ordered the slots in each of its D / 256 CTAs of a token (which a call of a few rows
 * still wants, for the CTAs). */
__global__ void __launch_bounds__(256)
    moe_combine8_kernel(uint16_t *__restrict__ out, const uint16_t *__restrict__ y, const int32_t *__restrict__ idx,
                        const uint16_t *__restrict__ sh, int64_t ld_sh, int64_t T, int k, int64_t D, int64_t per_part,
                        int64_t P) {
    __shared__ int order[RT_MAX_K];
    __shared__ int64_t part_of[RT_MAX_K];
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        combine_order_cta(idx + t * k, k, per_part, order, part_of);
        for (int64_t d = (int64_t)threadIdx.x * 8; d < D; d += (int64_t)blockDim.x * 8) {
            float a[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            auto add8 = [&](const uint16_t *src) { /* a += 8 bf16 of src, each add rounded */
                float v[8];
                unpack8(__ldg(reinterpret_cast<const uint4 *>(src)), v);
#pragma unroll
                for (int e = 0; e < 8; e++) a[e] = __fadd_rn(a[e], v[e]);
            };
            for (int r = 0; r < k; r++) {
                const int64_t part = part_of[r];
                if (part >= P) continue;
                add8(y + ((part * T + t) * k + order[r]) * D + d);
            }
            if (sh) add8(sh + t * ld_sh + d);
            *reinterpret_cast<uint4 *>(out + t * D + d) = pack8(a);
        }
    }
}

void cuda_op_moe_combine(struct backend *be, bf16_t *out, const bf16_t *y, const int32_t *idx, const bf16_t *sh,
                         int64_t ld_sh, int64_t T, int64_t k, int64_t D, int64_t per_part, int64_t P) {
    if (T <= 0 || D <= 0) return;
    if (k > RT_MAX_K) ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda moe_combine", "top-k exceeds 64");
    if (sh && ld_sh < D) ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda moe_combine", "shared rows narrower than D");
    if (T >= 32 && D % 8 == 0 && (!sh || ld_sh % 8 == 0) && ((uintptr_t)out & 15) == 0 && ((uintptr_t)y & 15) == 0 &&
        ((uintptr_t)sh & 15) == 0) { /* few rows: more CTAs per row */
        moe_combine8_kernel<<<(unsigned)(T < 65535 ? T : 65535), 256, 0, cuda_be_stream(be)>>>(
            (uint16_t *)out, (const uint16_t *)y, idx, (const uint16_t *)sh, ld_sh, T, (int)k, D, per_part, P);
        KERNEL_CHECK();
        return;
    }
    int64_t gx = (D + 255) / 256;
    dim3 grid((unsigned)(gx < 65535 ? gx : 65535), (unsigned)(T < 65535 ? T : 65535));
    moe_combine_kernel<<<grid, 256, 0, cuda_be_stream(be)>>>((uint16_t *)out, (const uint16_t *)y, idx,
                                                            (const uint16_t *)sh, ld_sh, T, (int)k, D, per_part, P);
    KERNEL_CHECK();
}

/* h = bf16(silu(min(g, limit)) · clamp(u)) elementwise, in place over g [n]. */
__global__ void moe_swiglu_kernel(uint16_t *__restrict__ g, const uint16_t *__restrict__ u, int64_t n, float limit) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        g[i] = ds_bf16_rne(mo_swiglu(ds_bf16f(g[i]), ds_bf16f(u[i]), limit, false, 0.0f));
}

/* The same h, quantized for the down projection in the k-permuted FP8 form of the tensor-core
 * linears (cuda_linear_mma_act_quant of bf16 h): the bits of moe_swiglu_kernel followed by w2's own
 * act quant, one pass instead of two; 2 values per thread (mma_quant2: a quarter of the chain of 8,
 * whose SwiGLUs made the call 7.24 µs at batch 1 on the H200, Nsight; 3.50 with 2). I a multiple
 * of 32; hq [T, I]. g and u are w1's and w3's outputs as their linears leave them unfolded
 * (CUDA_MMA_OUT_PARTS: fp32, nch k-chunks cs pairs apart), each folded and rounded to bf16 as their
 * chunk fold would (mo_swiglu_parts, as the routed experts' moe_gateup_finish_kernel): the g and u
 * the folded calls give, without the fold's launch and its bf16 [T, 2I] round trip. */
__global__ void __launch_bounds__(256) moe_swiglu_quant_kernel(const float2 *__restrict__ g, const float2 *__restrict__ u,
                                                               __nv_bfloat16 *__restrict__ hq, int64_t T, int64_t I2,
                                                               int64_t ld2, int nch, int64_t cs, float limit) {
    /* grid y strides over the T token rows; g and u rows ld2 pairs apart (I2 = I / 2 pairs a row) */
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const bool ok = j < I2; /* a 32-group is all in or all out: every lane takes part in the shuffles */
    const float *const gf = reinterpret_cast<const float *>(g), *const uf = reinterpret_cast<const float *>(u);
    for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
        const int64_t i = t * I2 + j, o = 2 * (t * ld2 + j);
        /* lanes past the row's pairs take zeros (the shuffles of their 32-group need them) */
        const float2 h = ok ? mo_swiglu_parts(gf + o, uf + o, 2 * cs, nch, limit, false, 0.0f) : make_float2(0.0f, 0.0f);
        const uint32_t w = mma_quant2(h.x, h.y);
        if (ok) mma_store_perm2(reinterpret_cast<uint32_t *>(hq) + (i >> 4) * 16, (int)(i & 15), w);
    }
}

static bool quantized(enum wfmt f) { return f == WF_FP8 || f == WF_FP4; }

/* Tensor-core shared expert: x quantized once for w1 and w3, their chunk fold and SwiGLU fused
 * with w2's act quant (moe_swiglu_quant_kernel reads their unfolded partials): five launches (x's
 * act quant, w1 | w3, the SwiGLU, w2 and its fold) where three cuda_op_linear calls and
 * moe_swiglu_kernel take ten, with their bits. Up to
 * CUDA_MMA_DECODE_AUTO_T rows, and up to CUDA_MMA_NARROW_MAX_T where I % CUDA_MMA_PAIR_SEAM == 0
 * (the seam the prefill tiles need; V4.1's I = 2,304), w1 and w3 go in one launch (cuda_linear_mma_pair: g and u
 * side by side in a [T, 2I] row; from 32 rows one grid of 64 x 64 or 128 x 64
 * tiles; in prefill chunks, two calls measured faster: linear_mma_sm80.cu's fp8_tile), where at a
 * handful of rows each was a memory latency and a launch of its own on the step's branch beside
 * the routed experts (at batch 1 the longer of the two: mixes + shared expert 52.9 µs of kernel time
 * a layer, router + routed experts 50.1). H200 bench_step decode ms, three runs alternated with
 * the two calls: batch 1 4.48 4.48 4.65 -> 4.38 4.36 4.39, batch 8 7.08 7.10 7.16 -> 7.02 6.93
 * 6.99, batch 64 15.52 15.54 15.58 -> 15.34 15.23 15.41, batch 32 10.73 10.78 10.83 -> 10.82
 * 10.66 10.81. */
static void shared_expert_mma(struct backend *be, bf16_t *y, const bf16_t *x, const void *xa, int64_t T,
                              const struct qweight *w1, const struct qweight *w3, const struct qweight *w2, float limit) {
    const int64_t I = w1->n, D = w1->k, Do = w2->n, nch = cuda_linear_mma_chunks(D);
    cudaStream_t st = cuda_be_stream(be);
    const size_t xqb = cuda_linear_mma_act_bytes(T, D), hqb = cuda_linear_mma_act_bytes(T, I);
    /* g's and u's partials [nch][T][2I] fp32 (two calls: g's [nch][T][I], then u's), then w2's
     * workspace in the same bytes (stream order: the SwiGLU has read the partials by then) */
    const size_t pb = (size_t)nch * (size_t)(T * 2 * I) * sizeof(float), w2b = cuda_linear_mma_workspace_bytes(T, Do, I);
    uint8_t *buf = (uint8_t *)cuda_be_scratch_raw(be, xqb + hqb + (pb > w2b ? pb : w2b));
    uint16_t *xq = (uint16_t *)buf, *hq = (uint16_t *)(buf + xqb);
    float *gp = (float *)(buf + xqb + hqb), *up; /* [nch][T][*] fp32 */
    void *ws = gp;
    if (xa) /* x's act form from the norm that made x (cuda_op_hc_collapse_act) */
        xq = (uint16_t *)xa;
    else
        cuda_linear_mma_act_quant(xq, x, T, D, st);
    const int tl = CUDA_MMA_AUTO | CUDA_MMA_PREQUANT;
    /* (I % 32 == 0, which the pair's seam needs, is this path's own condition) */
    const bool pair = (T <= CUDA_MMA_DECODE_AUTO_T || (T <= CUDA_MMA_NARROW_MAX_T && I % CUDA_MMA_PAIR_SEAM == 0)) &&
                      w1->fmt == w3->fmt && w1->ld == w3->ld && w1->s_ld == w3->s_ld;
    int64_t ld2 = I / 2; /* g and u rows, in pairs of outputs */
    if (pair) { /* g [nch][T][2I] with u the second half of each row */
        cuda_linear_mma_pair(tl | CUDA_MMA_OUT_PARTS, (int)w1->fmt, (uint16_t *)gp, xq, T, w1->w, w1->s, I, w3->w, w3->s, I,
                             D, w1->ld, w1->s_ld, NULL, st);
        up = gp + I;
        ld2 = I;
    } else {
        up = gp + nch * T * I;
        cuda_linear_mma_tiling(tl | CUDA_MMA_OUT_PARTS, (int)w1->fmt, (uint16_t *)gp, xq, T, w1->w, w1->s, I, D, w1->ld,
                               w1->s_ld, NULL, st);
        cuda_linear_mma_tiling(tl | CUDA_MMA_OUT_PARTS, (int)w3->fmt, (uint16_t *)up, xq, T, w3->w, w3->s, I, D, w3->ld,
                               w3->s_ld, NULL, st);
    }
    const int64_t I2 = I / 2;
    moe_swiglu_quant_kernel<<<dim3((unsigned)((I2 + 255) / 256), (unsigned)(T < 65535 ? T : 65535)), 256, 0, st>>>(
        (const float2 *)gp, (const float2 *)up, (__nv_bfloat16 *)hq, T, I2, ld2, (int)nch, T * ld2, limit);
    KERNEL_CHECK();
    cuda_linear_mma_tiling(tl, (int)w2->fmt, y, hq, T, w2->w, w2->s, Do, I, w2->ld, w2->s_ld, ws, st);
    cuda_be_scratch_free(be, buf);
}

/* The shared expert, with x's activation form xa where the norm before it made one (backend.h's
 * act_bytes; NULL: the tensor-core path quantizes x itself, and the exact path needs none). */
static void shared_expert_run(struct backend *be, bf16_t *y, const bf16_t *x, const void *xa, int64_t T,
                              const struct qweight *w1, const struct qweight *w3, const struct qweight *w2, float limit) {
    if (T <= 0) return;
    if (w3->n != w1->n || w3->k != w1->k || w2->k != w1->n)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda shared_expert", "inconsistent w1/w3/w2 shapes");
    const int64_t I = w1->n;
    if (cuda_be_mma(be) && quantized(w1->fmt) && quantized(w3->fmt) && quantized(w2->fmt) && I % 32 == 0 &&
        w1->k % 32 == 0) {
        shared_expert_mma(be, y, x, xa, T, w1, w3, w2, limit);
        return;
    }
    bf16_t *g = (bf16_t *)cuda_be_scratch_raw(be, sizeof(bf16_t) * (size_t)(2 * T * I)), *u = g + T * I; /* [T, I] x2 */
    cuda_op_linear(be, g, x, T, w1);
    cuda_op_linear(be, u, x, T, w3);
    int64_t n = T * I, blocks = (n + 255) / 256;
    moe_swiglu_kernel<<<(unsigned)(blocks < 8192 ? blocks : 8192), 256, 0, cuda_be_stream(be)>>>(g, u, n, limit);
    KERNEL_CHECK();
    cuda_op_linear(be, y, g, T, w2);
    cuda_be_scratch_free(be, g);
}

void cuda_op_shared_expert(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, const struct qweight *w1,
                           const struct qweight *w3, const struct qweight *w2, float limit) {
    shared_expert_run(be, y, x, NULL, T, w1, w3, w2, limit);
}

/* shared_expert with x's activation form xa: the same work less x's act quant */
void cuda_op_shared_expert_act(struct backend *be, bf16_t *y, const bf16_t *x, const void *xa, int64_t T,
                               const struct qweight *w1, const struct qweight *w3, const struct qweight *w2, float limit) {
    shared_expert_run(be, y, x, xa, T, w1, w3, w2, limit);
}
