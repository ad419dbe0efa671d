/* Dense projections of the SM80 backend: the op-table entries linear, linear_f32, grouped_linear
 * (wo_a) and head. FP8/FP4 weights go to the tensor-core kernels of linear_mma_sm80.cu (the
 * backend's mma switch, on in the engine) or, with --exact-linears, to the block-scaled kernels of
 * linear_sm80.cu in the CPU's order (through their C interface, in chunks of CUDA_LINEAR_MAX_T
 * rows); so do grouped_linear's BF16 groups (wo_a) under the mma switch, where the shapes allow.
 * The other BF16 (and F32) weights run here.
 *
 * Numerics of the kernels here: every output is the segmented fp32 sum of backend.h (segments of
 * BE_DOT_SEG consecutive k, each a sequential sum in k order from +0, the segment sums added in
 * order from +0), with a round-to-nearest product and a round-to-nearest add per term (no FMA:
 * __fmul_rn/__fadd_rn), then one rounding to bf16 (RNE, NaN -> 0x7FC0 as src/formats.c) or none for
 * fp32 outputs. That is the CPU backend's order (kernels/cpu/cpu_linear.c), so every op here is
 * bit-identical to it, and batch invariant: an output never depends on T, on the other rows of the
 * call or on the grid.
 *
 * Parallelism comes from outputs and from the segments of one output: up to 8 token rows a warp
 * walks one weight row's segments with its 32 lanes; 9..256 rows a lane owns a weight row and the
 * segments pass through a shared-memory ring; above, a CTA tiles 64 token rows x 32 weight rows and
 * runs each output's chain through its segments in turn. Shapes a 16-byte load cannot serve (row
 * strides not a multiple of 8 elements, F32 weights) take a plain one-thread-per-output kernel with
 * the same order. */
#include "cuda_internal.h"
#include "cuda_linear.h"
#include "linear_mma.h"

/* ---------------------------------------------------------------------------------------------
 * Exact conversions (src/formats.c) */


static __device__ __forceinline__ void lo_store(void *y, bool out_f32, int64_t i, float v) {
    if (out_f32)
        ((float *)y)[i] = v;
    else
        ((uint16_t *)y)[i] = ds_bf16_rne(v);
}

/* 8 bf16 (one 16-byte word) -> 8 fp32, exact widening. */
static __device__ __forceinline__ void lo_widen8r(float *f, uint4 v) {
    f[0] = __uint_as_float(v.x << 16), f[1] = __uint_as_float(v.x & 0xffff0000u);
    f[2] = __uint_as_float(v.y << 16), f[3] = __uint_as_float(v.y & 0xffff0000u);
    f[4] = __uint_as_float(v.z << 16), f[5] = __uint_as_float(v.z & 0xffff0000u);
    f[6] = __uint_as_float(v.w << 16), f[7] = __uint_as_float(v.w & 0xffff0000u);
}

/* 8 bf16 (16 bytes, shared memory) -> 8 fp32 (exact widening), two float4 stores. */
static __device__ __forceinline__ void lo_widen8(float *dst, const uint16_t *src) {
    float f[8];
    lo_widen8r(f, *reinterpret_cast<const uint4 *>(src));
    *reinterpret_cast<float4 *>(dst) = make_float4(f[0], f[1], f[2], f[3]);
    *reinterpret_cast<float4 *>(dst + 4) = make_float4(f[4], f[5], f[6], f[7]);
}

/* ---------------------------------------------------------------------------------------------
 * cp.async (SM80): 16-byte global -> shared copies, bytes beyond `src_bytes` zero-filled. */

static __device__ __forceinline__ void lo_cp16(void *dst, const void *src, int src_bytes) {
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(src_bytes));
}
static __device__ __forceinline__ void lo_cp_commit(void) { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> static __device__ __forceinline__ void lo_cp_wait(void) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* ---------------------------------------------------------------------------------------------
 * BF16 kernel for up to 8 token rows: a warp per weight row, a lane per BE_DOT_SEG segment of its
 * k (lane l takes segments l, l + 32, ...), the TT chains of a lane independent. A lane copies its
 * segment's 256 bytes of the row into shared memory with 16 cp.async at once (its memory
 * parallelism: with one warp per row, 4 rows a CTA, a [384, 5120] router gate is 96 CTAs, each
 * streaming 40 KB), and reads x through the read-only cache (the 4 warps of a CTA read the same
 * x). Each round of 32 segments is folded into the running total in segment order by shuffles,
 * every lane adding the same values in the same order, and lane t stores token t.
 * The k-order GEMV it replaces (a lane per weight row, kept below for 9..256 rows) spent 30.9 µs
 * per router gate at batch 1 on one 5,120-add chain per output in 12 CTAs; with this kernel the
 * router op (gate and selection, 20 calls) went from 0.92 to 0.56 ms per step at batch 1 and from
 * 1.29 to 0.86 at batch 8 (H200, bench_step --profile, ops serial).
 * Grid: x = token group of 8 rows (dense_launch sends one), y = 4-row weight tile, z = group g of a
 * grouped projection (element offsets y_gs, x_gs, w_gs per g). Needs k % 8 == 0 and 16-byte
 * aligned rows (dense_launch). */
#define DS_WARPS 4                 /* weight rows per CTA, one per warp */
#define DS_TMAX 8                  /* token rows per CTA */
#define DS_CH (BE_DOT_SEG / 8)     /* 16-byte chunks of a whole segment */
static_assert(BE_DOT_SEG % 8 == 0, "segments of whole 16-byte chunks");


/* acc[t] += x[t][kc + j] · w[j], j = 0..7 in order, each product and add rounded on its own; x
 * through the read-only cache (the CTA's warps read the same x) */
template <int TT>
static __device__ __forceinline__ void seg_chunk(float (&acc)[TT], uint4 wv, const uint16_t *xb, int64_t ldx,
                                                 int tcount, int64_t kc) {
    float wf[8];
    lo_widen8r(wf, wv);
#pragma unroll
    for (int t = 0; t < TT; t++) {
        float xf[8]; /* token rows past the call read row 0 of the group and are never stored */
        lo_widen8r(xf, __ldg(reinterpret_cast<const uint4 *>(xb + (t < tcount ? t : 0) * ldx + kc)));
#pragma unroll
        for (int j = 0; j < 8; j++) acc[t] = __fadd_rn(acc[t], __fmul_rn(xf[j], wf[j]));
    }
}

template <int TT, bool OUT_F32>
__global__ void __launch_bounds__(DS_WARPS * 32, 1)
    dense_seg_kernel(void *__restrict__ y, int64_t ldy, int64_t y_gs, const uint16_t *__restrict__ x, int64_t ldx,
                     int64_t x_gs, const uint16_t *__restrict__ w, int64_t ldw, int64_t w_gs, int64_t T, int64_t n,
                     int64_t k) {
    /* each lane's segment of its warp's row, chunk c at c ^ (lane % 16): the 8 lanes of a
     * quarter-warp phase hit distinct bank quads */
    __shared__ __align__(16) uint16_t w_s[DS_WARPS][32][BE_DOT_SEG];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t row = (int64_t)blockIdx.y * DS_WARPS + warp, t0 = (int64_t)blockIdx.x * DS_TMAX, g = blockIdx.z;
    if (row >= n) return; /* the whole warp; nothing below waits on another warp */
    const int tcount = (int)(T - t0 < TT ? T - t0 : TT);
    const uint16_t *wr = w + g * w_gs + row * ldw; /* [k] bf16 */
    const uint16_t *xb = x + g * x_gs + t0 * ldx;   /* [TT, k] bf16, row stride ldx */
    uint16_t *mine = &w_s[warp][lane][0];
    const int sw = lane & 15;
    const int64_t nseg = (k + BE_DOT_SEG - 1) / BE_DOT_SEG;
    float tot[TT];
#pragma unroll
    for (int t = 0; t < TT; t++) tot[t] = 0.0f;
    for (int64_t s0 = 0; s0 < nseg; s0 += 32) {
        const int64_t kb = (s0 + lane) * BE_DOT_SEG;
        const int nch = kb >= k ? 0 : (k - kb >= BE_DOT_SEG ? DS_CH : (int)((k - kb) / 8));
        /* the segment's weights, every copy in flight at once (plain loads were sunk next to their
         * uses by the compiler: two in flight, an L2 round trip per chunk); the lane reads only what
         * it copied, so its own wait is the only synchronisation */
        for (int c = 0; c < nch; c++) lo_cp16(mine + ((c ^ sw) * 8), wr + kb + 8 * c, 16);
        lo_cp_commit();
        lo_cp_wait<0>();
        float acc[TT];
#pragma unroll
        for (int t = 0; t < TT; t++) acc[t] = 0.0f;
        if (nch == DS_CH) {
#pragma unroll
            for (int c = 0; c < DS_CH; c++)
                seg_chunk<TT>(acc, *reinterpret_cast<const uint4 *>(mine + ((c ^ sw) * 8)), xb, ldx, tcount,
                              kb + 8 * c);
        } else {
            for (int c = 0; c < nch; c++)
                seg_chunk<TT>(acc, *reinterpret_cast<const uint4 *>(mine + ((c ^ sw) * 8)), xb, ldx, tcount,
                              kb + 8 * c);
        }
        const int live = nseg - s0 < 32 ? (int)(nseg - s0) : 32;
        for (int j = 0; j < live; j++)
#pragma unroll
            for (int t = 0; t < TT; t++) tot[t] = __fadd_rn(tot[t], __shfl_sync(0xffffffffu, acc[t], j));
    }
#pragma unroll
    for (int t = 0; t < TT; t++)
        if (lane == t && t < tcount) lo_store(y, OUT_F32, (t0 + t) * ldy + g * y_gs + row, tot[t]);
}

/* ---------------------------------------------------------------------------------------------
 * BF16 kernel for 9..256 token rows (dense_seg_kernel above takes up to 8: at 64 rows its 8-row
 * groups re-read every weight row from L2 in 8x the CTAs, and the router op, gate and selection,
 * took 106 µs a call against 66 µs with this kernel; H200, bench_step --profile). A CTA owns 32
 * weight rows (lane = row) and 8 token rows (its 4 warps split them), and walks k in stages of 128 = BE_DOT_SEG (one segment a stage, folded
 * into the total at the stage's end) through a 4-deep cp.async ring in shared memory (weights
 * coalesced from global, chunk-swizzled so each lane's 16-byte row reads are bank-conflict free;
 * the 8 token rows are widened to fp32 once per stage so the inner loop is a broadcast read). More
 * rows go through more token groups in the same launch, neighbouring in the grid so the re-reads
 * hit L2. */

#define DN_ROWS 32   /* weight rows per CTA: lane = row */
#define DN_WARPS 4   /* warps per CTA; they share the rows and split the token rows */
#define DN_TMAX 8    /* token rows per CTA */
#define DN_KB 128    /* k values per pipeline stage (16 chunks of 8 bf16 per row) */
#define DN_STAGES 4  /* ring depth: 3 stages in flight while one is computed */
static_assert(DN_KB == BE_DOT_SEG, "a stage is one segment");

/* Grid: x = token group (8 rows; fastest, so the groups of one weight tile run together and
 * share it through L2), y = 32-row weight tile, z = group g of a grouped projection (element
 * offsets y_gs, x_gs, w_gs per g); the last token group is masked. It serves 9..256 rows (fewer go
 * to dense_seg_kernel). Shared memory: weights 4 x 32 x 128 bf16 = 32 KB, raw x 4 x 8 x 128 bf16
 * = 8 KB, widened x 8 x 128 fp32 = 4 KB.
 * Stage s: wait until its copies landed (group s), barrier (also: everyone finished stage s-1,
 * whose slot and the widened-x buffer are now free), issue stage s+3 into s-1's slot, widen x,
 * barrier, then lane r of warp w runs row r over the 128 k of the stage for tokens 2w, 2w + 1. */
template <bool OUT_F32>
__global__ void __launch_bounds__(DN_WARPS * 32)
    dense_bf16_kernel(void *__restrict__ y, int64_t ldy, int64_t y_gs, const uint16_t *__restrict__ x, int64_t ldx,
                      int64_t x_gs, const uint16_t *__restrict__ w, int64_t ldw, int64_t w_gs, int64_t T, int64_t n,
                      int64_t k, int prefetch) {
    constexpr int TT = DN_TMAX, TPW = TT / DN_WARPS; /* token rows per CTA, per warp */
    static_assert(TPW * DN_WARPS == TT, "every warp takes token rows");
    __shared__ __align__(16) uint16_t sm_w[DN_STAGES][DN_ROWS][DN_KB];
    __shared__ __align__(16) uint16_t sm_x[DN_STAGES][TT][DN_KB];
    __shared__ __align__(16) float sm_xf[TT][DN_KB]; /* widened x */

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t t0 = (int64_t)blockIdx.x * DN_TMAX, r0 = (int64_t)blockIdx.y * DN_ROWS, g = blockIdx.z;
    const int tcount = (int)(T - t0 < TT ? T - t0 : TT);
    const uint16_t *xg = x + g * x_gs, *wg = w + g * w_gs;
    const int nst = (int)((k + DN_KB - 1) / DN_KB);

    /* one stage: 32 rows x 16 chunks of weights (4 per thread, 16 consecutive threads per row:
     * coalesced) stored at chunk c ^ (row & 7), and TT x 16 chunks of x; rows past n, token rows
     * past the call and k past the end are zero-filled, and zeros add exactly nothing */
    auto load_stage = [&](int slot, int s) {
        const int64_t kb = (int64_t)s * DN_KB;
#pragma unroll
        for (int j = 0; j < (DN_ROWS * DN_KB / 8) / (DN_WARPS * 32); j++) {
            int q = tid + j * DN_WARPS * 32, row = q >> 4, c = q & 15;
            int64_t gk = kb + c * 8, gr = r0 + row;
            int bytes = (gr < n && gk < k) ? (int)(k - gk < 8 ? (k - gk) * 2 : 16) : 0;
            const uint16_t *src = bytes ? wg + gr * ldw + gk : wg;
            lo_cp16(&sm_w[slot][row][(c ^ (row & 7)) * 8], src, bytes);
        }
        if (tid < TT * (DN_KB / 8)) {
            int t = tid >> 4, c = tid & 15;
            int64_t gk = kb + c * 8;
            int bytes = (t < tcount && gk < k) ? (int)(k - gk < 8 ? (k - gk) * 2 : 16) : 0;
            const uint16_t *src = bytes ? xg + (t0 + t) * ldx + gk : xg;
            lo_cp16(&sm_x[slot][t][c * 8], src, bytes);
        }
    };

    /* small weights: the whole 32-row slab is requested into L2 up front, so the ring below waits
     * for L2, not for DRAM, and the sum chain (latency bound at these sizes) is what remains */
    if (prefetch) {
        const int64_t lpr = (k + 63) / 64; /* 128-byte lines per row */
        for (int64_t i = tid; i < DN_ROWS * lpr; i += DN_WARPS * 32) {
            int64_t row = r0 + i / lpr;
            if (row < n) asm volatile("prefetch.global.L2 [%0];" ::"l"(wg + row * ldw + (i % lpr) * 64));
        }
    }
#pragma unroll
    for (int s = 0; s < DN_STAGES - 1; s++) {
        if (s < nst) load_stage(s, s);
        lo_cp_commit(); /* empty groups keep the group count uniform */
    }

    float acc[TPW], tot[TPW]; /* the stage's segment (DN_KB = BE_DOT_SEG), the segments before */
#pragma unroll
    for (int i = 0; i < TPW; i++) acc[i] = tot[i] = 0.0f;

    for (int s = 0; s < nst; s++) {
        const int slot = s % DN_STAGES;
        lo_cp_wait<DN_STAGES - 2>();
        __syncthreads();
        if (s + DN_STAGES - 1 < nst) load_stage((s + DN_STAGES - 1) % DN_STAGES, s + DN_STAGES - 1);
        lo_cp_commit();
        for (int i = tid; i < TT * (DN_KB / 8); i += DN_WARPS * 32) { /* x widened once per stage */
            int t = i >> 4, c = i & 15;
            lo_widen8(&sm_xf[t][c * 8], &sm_x[slot][t][c * 8]);
        }
        __syncthreads();
        /* warp * TPW < TT always (4 warps of 2 rows), and t below never needs its clamp; both stay:
         * without them the compiler, which cannot bound warp, allocates the kernel differently
         * (98 -> 96 registers, other SASS), which is not measured */
        if (warp * TPW < TT) {
            /* Software-pipelined: the 8 products of chunk c+1 (independent roundings) are formed
             * while chunk c's 8 adds run, so the one dependent add chain per output (4 cycles an
             * add; the whole cost at small n, where a CTA has a single busy warp) never waits for
             * a load or a multiply. The adds themselves stay in k order. */
            const uint16_t *wrow = &sm_w[slot][lane][0];
            auto products = [&](int c, float(&pr)[TPW][8]) {
                float wf[8];
                lo_widen8r(wf, *reinterpret_cast<const uint4 *>(wrow + (c ^ (lane & 7)) * 8));
#pragma unroll
                for (int i = 0; i < TPW; i++) {
                    const int t = warp * TPW + i < TT ? warp * TPW + i : TT - 1;
                    const float4 xa = *reinterpret_cast<const float4 *>(&sm_xf[t][c * 8]);
                    const float4 xb = *reinterpret_cast<const float4 *>(&sm_xf[t][c * 8 + 4]);
                    float xv[8];
                    xv[0] = xa.x, xv[1] = xa.y, xv[2] = xa.z, xv[3] = xa.w;
                    xv[4] = xb.x, xv[5] = xb.y, xv[6] = xb.z, xv[7] = xb.w;
#pragma unroll
                    for (int j = 0; j < 8; j++) pr[i][j] = __fmul_rn(xv[j], wf[j]);
                }
            };
            float pr[TPW][8];
            products(0, pr);
#pragma unroll
            for (int c = 0; c < DN_KB / 8; c++) {
                float pn[TPW][8];
                if (c + 1 < DN_KB / 8) products(c + 1, pn);
#pragma unroll
                for (int i = 0; i < TPW; i++)
#pragma unroll
                    for (int j = 0; j < 8; j++) acc[i] = __fadd_rn(acc[i], pr[i][j]);
                if (c + 1 < DN_KB / 8) {
#pragma unroll
                    for (int i = 0; i < TPW; i++)
#pragma unroll
                        for (int j = 0; j < 8; j++) pr[i][j] = pn[i][j];
                }
            }
#pragma unroll
            for (int i = 0; i < TPW; i++) tot[i] = __fadd_rn(tot[i], acc[i]), acc[i] = 0.0f; /* the segment ends */
        }
    }
    lo_cp_wait<0>(); /* nothing may be in flight into shared memory when the CTA exits */

    const int64_t row = r0 + lane;
    if (row < n) {
#pragma unroll
        for (int i = 0; i < TPW; i++) {
            const int t = warp * TPW + i;
            if (t < tcount) lo_store(y, OUT_F32, (t0 + t) * ldy + g * y_gs + row, tot[i]);
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * BF16 kernel for prefill-sized calls (T > DT_MIN_T): the same segmented sum per output, tiled for
 * reuse. The GEMV kernel above reads each weight once per 8 token rows, so at T = 2048 a
 * [384, 5120] router gate streamed its weights 256 times through L2 and spent a CTA's issue slots
 * on widening them; here a CTA owns 64 token rows x 32 weight rows, both widened to fp32 in shared
 * memory once per stage of 32 k, and each thread runs 8 chains (token rows ty, ty + 32 x weight
 * rows tx + 8j), loading 4 k of each operand per float4, so a multiply-add pair costs ~2.2
 * instructions. Bits: within a segment (BE_DOT_SEG / DT_KB stages) every chain is acc = fadd(acc,
 * fmul(x_k, w_k)) in k order from +0, and at the segment's end tot = fadd(tot, acc), as
 * dense_seg_kernel and the CPU; zero-filled tails (rows, tokens, k) are never stored or add 0·0
 * (acc is never -0, so + 0 leaves it). Stage s: wait for own copies, barrier (everyone is past
 * stage s-1's compute), issue stage s + 2, widen own chunks, barrier, compute. */
#define DT_MIN_T 256 /* calls of more rows take the tiled kernel */
#define DT_BT 64     /* token rows per CTA */
#define DT_BR 32     /* weight rows per CTA */
#define DT_KB 32     /* k per stage */
#define DT_LD (DT_KB + 4) /* widened rows, padded: the 8 weight rows a phase reads sit on distinct banks */
#define DT_STAGES 3
#define DT_THREADS 256
static_assert(BE_DOT_SEG % DT_KB == 0, "segments of whole stages");

template <bool OUT_F32>
__global__ void __launch_bounds__(DT_THREADS)
    dense_tile_kernel(void *__restrict__ y, int64_t ldy, int64_t y_gs, const uint16_t *__restrict__ x, int64_t ldx,
                      int64_t x_gs, const uint16_t *__restrict__ w, int64_t ldw, int64_t w_gs, int64_t T, int64_t n,
                      int64_t k) {
    __shared__ __align__(16) uint16_t sx[DT_STAGES][DT_BT][DT_KB]; /* raw stages */
    __shared__ __align__(16) uint16_t sw[DT_STAGES][DT_BR][DT_KB];
    __shared__ __align__(16) float xf[DT_BT][DT_LD]; /* the stage's widened rows */
    __shared__ __align__(16) float wf[DT_BR][DT_LD];
    const int tid = threadIdx.x, tx = tid & 7, ty = tid >> 3;
    const int64_t t0 = (int64_t)blockIdx.x * DT_BT, r0 = (int64_t)blockIdx.y * DT_BR, g = blockIdx.z;
    const uint16_t *xg = x + g * x_gs, *wg = w + g * w_gs;
    const int nst = (int)((k + DT_KB - 1) / DT_KB);
    /* copy assignment: x row tid / 4 chunk tid % 4 (8 values); w row tid / 4 chunk tid % 4 for tid < 128 */
    const int cr = tid >> 2, cc = tid & 3;
    auto load_stage = [&](int slot, int s) {
        const int64_t gk = (int64_t)s * DT_KB + cc * 8;
        int bytes = (t0 + cr < T && gk < k) ? (int)(k - gk < 8 ? (k - gk) * 2 : 16) : 0;
        lo_cp16(&sx[slot][cr][cc * 8], bytes ? xg + (t0 + cr) * ldx + gk : xg, bytes);
        if (tid < DT_BR * 4) {
            bytes = (r0 + cr < n && gk < k) ? (int)(k - gk < 8 ? (k - gk) * 2 : 16) : 0;
            lo_cp16(&sw[slot][cr][cc * 8], bytes ? wg + (r0 + cr) * ldw + gk : wg, bytes);
        }
    };
#pragma unroll
    for (int s = 0; s < DT_STAGES - 1; s++) {
        if (s < nst) load_stage(s, s);
        lo_cp_commit();
    }
    float acc[2][4], tot[2][4]; /* the segment's chains, the totals of the segments before */
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = tot[i][j] = 0.0f;
    for (int s = 0; s < nst; s++) {
        const int slot = s % DT_STAGES;
        lo_cp_wait<DT_STAGES - 2>();
        __syncthreads();
        if (s + DT_STAGES - 1 < nst) load_stage((s + DT_STAGES - 1) % DT_STAGES, s + DT_STAGES - 1);
        lo_cp_commit();
        lo_widen8(&xf[cr][cc * 8], &sx[slot][cr][cc * 8]);
        if (tid < DT_BR * 4) lo_widen8(&wf[cr][cc * 8], &sw[slot][cr][cc * 8]);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < DT_KB; kk += 4) {
            const float4 xa = *reinterpret_cast<const float4 *>(&xf[ty][kk]);
            const float4 xb = *reinterpret_cast<const float4 *>(&xf[ty + 32][kk]);
            float4 wv[4];
#pragma unroll
            for (int j = 0; j < 4; j++) wv[j] = *reinterpret_cast<const float4 *>(&wf[tx + 8 * j][kk]);
            const float xs[2][4] = {{xa.x, xa.y, xa.z, xa.w}, {xb.x, xb.y, xb.z, xb.w}};
#pragma unroll
            for (int e = 0; e < 4; e++)
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const float we = e == 0 ? wv[j].x : e == 1 ? wv[j].y : e == 2 ? wv[j].z : wv[j].w;
#pragma unroll
                    for (int i = 0; i < 2; i++) acc[i][j] = __fadd_rn(acc[i][j], __fmul_rn(xs[i][e], we));
                }
        }
        if ((s + 1) % (BE_DOT_SEG / DT_KB) == 0 || s + 1 == nst) { /* a segment ends: fold it in order */
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) tot[i][j] = __fadd_rn(tot[i][j], acc[i][j]), acc[i][j] = 0.0f;
        }
    }
    lo_cp_wait<0>();
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int64_t t = t0 + ty + 32 * i;
        if (t >= T) continue;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int64_t row = r0 + tx + 8 * j;
            if (row < n) lo_store(y, OUT_F32, t * ldy + g * y_gs + row, tot[i][j]);
        }
    }
}

/* Any shape, BF16 or F32 weights: one thread per output (grid x over rows, y over token rows,
 * z over groups), the same segmented sum. Used where 16-byte loads are not possible. */
template <bool W_F32, bool OUT_F32>
__global__ void dense_generic_kernel(void *__restrict__ y, int64_t ldy, int64_t y_gs, const uint16_t *__restrict__ x,
                                     int64_t ldx, int64_t x_gs, const void *__restrict__ w, int64_t ldw, int64_t w_gs,
                                     int64_t T, int64_t n, int64_t k) {
    const int64_t row = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, g = blockIdx.z;
    if (row >= n) return;
    for (int64_t t = blockIdx.y; t < T; t += gridDim.y) {
        const uint16_t *xr = x + g * x_gs + t * ldx;
        float tot = 0.0f;
        for (int64_t s0 = 0; s0 < k; s0 += BE_DOT_SEG) {
            const int64_t s1 = k - s0 < BE_DOT_SEG ? k : s0 + BE_DOT_SEG;
            float acc = 0.0f;
            for (int64_t i = s0; i < s1; i++) {
                float wv;
                if constexpr (W_F32) wv = ((const float *)w)[g * w_gs + row * ldw + i];
                else wv = __uint_as_float((uint32_t)((const uint16_t *)w)[g * w_gs + row * ldw + i] << 16);
                acc = __fadd_rn(acc, __fmul_rn(__uint_as_float((uint32_t)xr[i] << 16), wv));
            }
            tot = __fadd_rn(tot, acc);
        }
        lo_store(y, OUT_F32, t * ldy + g * y_gs + row, tot);
    }
}

/* y (+ g*y_gs) [T, ldy] = x (+ g*x_gs) [T, ldx] · W (+ g*w_gs) [n, ldw]ᵀ over k, for g < G. Strides
 * and offsets in elements. */
static void dense_launch(struct backend *be, void *y, bool out_f32, int64_t ldy, int64_t y_gs, const bf16_t *x,
                         int64_t ldx, int64_t x_gs, const void *w, enum wfmt fmt, int64_t ldw, int64_t w_gs, int64_t T,
                         int64_t n, int64_t k, int64_t G) {
    if (T <= 0 || n <= 0 || G <= 0) return;
    if (G > 65535) ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "dense", "more than 65535 groups");
    cudaStream_t st = cuda_be_stream(be);
    const bool tiled = T > DT_MIN_T && (T + DT_BT - 1) / DT_BT <= 0x7fffffff;
    /* up to 8 rows dense_seg_kernel (k % 8 == 0), 9..256 dense_bf16_kernel, more dense_tile_kernel */
    const bool aligned = fmt == WF_BF16 && ((uintptr_t)w % 16) == 0 && ((uintptr_t)x % 16) == 0 && ldw % 8 == 0 &&
                         w_gs % 8 == 0 && ldx % 8 == 0 && x_gs % 8 == 0 && (T > DS_TMAX || k % 8 == 0) &&
                         (n + DN_ROWS - 1) / DN_ROWS <= 65535 && (n + DS_WARPS - 1) / DS_WARPS <= 65535;
    if (!aligned) {
        dim3 grid((unsigned)((n + 127) / 128), (unsigned)(T < 65535 ? T : 65535), (unsigned)G);
        if (fmt == WF_F32) {
            if (out_f32)
                dense_generic_kernel<true, true><<<grid, 128, 0, st>>>(y, ldy, y_gs, x, ldx, x_gs, w, ldw, w_gs, T, n, k);
            else
                dense_generic_kernel<true, false><<<grid, 128, 0, st>>>(y, ldy, y_gs, x, ldx, x_gs, w, ldw, w_gs, T, n, k);
        } else {
            if (out_f32)
                dense_generic_kernel<false, true><<<grid, 128, 0, st>>>(y, ldy, y_gs, x, ldx, x_gs, w, ldw, w_gs, T, n, k);
            else
                dense_generic_kernel<false, false><<<grid, 128, 0, st>>>(y, ldy, y_gs, x, ldx, x_gs, w, ldw, w_gs, T, n,
                                                                          k);
        }
        KERNEL_CHECK();
        return;
    }
    if (tiled) {
        dim3 grid((unsigned)((T + DT_BT - 1) / DT_BT), (unsigned)((n + DT_BR - 1) / DT_BR), (unsigned)G);
        if (out_f32)
            dense_tile_kernel<true><<<grid, DT_THREADS, 0, st>>>(y, ldy, y_gs, x, ldx, x_gs, (const uint16_t *)w, ldw,
                                                                 w_gs, T, n, k);
        else
            dense_tile_kernel<false><<<grid, DT_THREADS, 0, st>>>(y, ldy, y_gs, x, ldx, x_gs, (const uint16_t *)w, ldw,
                                                                  w_gs, T, n, k);
        KERNEL_CHECK();
        return;
    }
    if (T > DS_TMAX) { /* 9..256 rows: a lane per weight row, 8 token rows a CTA */
        const int pf = (double)G * n * k * 2 <= 16.0 * 1024 * 1024; /* fits L2 (40 MB on A100) many times */
        dim3 grid((unsigned)((T + DN_TMAX - 1) / DN_TMAX), (unsigned)((n + DN_ROWS - 1) / DN_ROWS), (unsigned)G);
        if (out_f32)
            dense_bf16_kernel<true><<<grid, DN_WARPS * 32, 0, st>>>(y, ldy, y_gs, x, ldx, x_gs,
                                                                            (const uint16_t *)w, ldw, w_gs, T, n, k, pf);
        else
            dense_bf16_kernel<false><<<grid, DN_WARPS * 32, 0, st>>>(y, ldy, y_gs, x, ldx, x_gs,
                                                                             (const uint16_t *)w, ldw, w_gs, T, n, k, pf);
        KERNEL_CHECK();
        return;
    }
    dim3 grid(1u, (unsigned)((n + DS_WARPS - 1) / DS_WARPS), (unsigned)G);
    const uint16_t *wb = (const uint16_t *)w;
#define DS_CASE(TTV)                                                                                               \
    case TTV:                                                                                                      \
        if (out_f32)                                                                                               \
            dense_seg_kernel<TTV, true><<<grid, DS_WARPS * 32, 0, st>>>(y, ldy, y_gs, x, ldx, x_gs, wb, ldw, w_gs, T, \
                                                                        n, k);                                         \
        else                                                                                                       \
            dense_seg_kernel<TTV, false><<<grid, DS_WARPS * 32, 0, st>>>(y, ldy, y_gs, x, ldx, x_gs, wb, ldw, w_gs,   \
                                                                         T, n, k);                                     \
        break;
    switch (T) { DS_CASE(1) DS_CASE(2) DS_CASE(3) DS_CASE(4) DS_CASE(5) DS_CASE(6) DS_CASE(7) DS_CASE(8) }
#undef DS_CASE
    KERNEL_CHECK();
}

/* ---------------------------------------------------------------------------------------------
 * Ops */

void cuda_op_linear(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, const struct qweight *W) {
    if (T <= 0 || W->n <= 0) return;
    switch (W->fmt) {
    case WF_FP8:
    case WF_FP4: {
        if (cuda_be_mma(be)) {
            /* tensor-core path, every T (decode and prefill tilings give a row the same bits):
             * a block's 32 products are added by the mma unit, not in the CPU's k order */
            void *ws = cuda_be_scratch_raw(be, cuda_linear_mma_workspace_bytes(T, W->n, W->k));
            cuda_linear_mma((int)W->fmt, y, x, T, W->w, W->s, W->n, W->k, W->ld, W->s_ld, ws,
                            (void *)cuda_be_stream(be));
            cuda_be_scratch_free(be, ws);
            break;
        }
        /* linear_sm80 takes at most CUDA_LINEAR_MAX_T rows per call; rows are independent, so
         * the chunking changes no bit. One workspace serves every chunk (stream order). */
        int64_t tc = T < CUDA_LINEAR_MAX_T ? T : CUDA_LINEAR_MAX_T;
        void *ws = cuda_be_scratch_raw(be, cuda_linear_workspace_bytes(tc, W->k));
        void *st = (void *)cuda_be_stream(be);
        for (int64_t t0 = 0; t0 < T; t0 += CUDA_LINEAR_MAX_T) {
            int64_t n_t = T - t0 < CUDA_LINEAR_MAX_T ? T - t0 : CUDA_LINEAR_MAX_T;
            if (W->fmt == WF_FP8)
                cuda_linear_fp8(y + t0 * W->n, x + t0 * W->k, n_t, (const uint8_t *)W->w, W->s, W->n, W->k, W->ld,
                                W->s_ld, ws, st);
            else
                cuda_linear_fp4(y + t0 * W->n, x + t0 * W->k, n_t, (const uint8_t *)W->w, W->s, W->n, W->k, W->ld,
                                W->s_ld, ws, st);
        }
        cuda_be_scratch_free(be, ws);
        break;
    }
    case WF_BF16: dense_launch(be, y, false, W->n, 0, x, W->k, 0, W->w, WF_BF16, W->ld, 0, T, W->n, W->k, 1); break;
    default:
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda linear",
                 "weight format not allowed (F32 goes through linear_f32)");
    }
}

void cuda_op_linear_f32(struct backend *be, float *y, const bf16_t *x, int64_t T, const struct qweight *W) {
    if (T <= 0 || W->n <= 0) return;
    if (W->fmt != WF_BF16 && W->fmt != WF_F32)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda linear_f32", "weight format is not BF16 or F32");
    dense_launch(be, y, true, W->n, 0, x, W->k, 0, W->w, W->fmt, W->ld, 0, T, W->n, W->k, 1);
}

/* wo_a: x [T, G, kg], W [G*r, kg], y [T, G, r]; group g reads x columns g*kg.., weight rows g*r..
 * and writes y columns g*r..: one launch, grid z = g. */
void cuda_op_grouped_linear(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, int64_t G,
                            const struct qweight *W) {
    if (T <= 0 || G <= 0) return;
    if (W->fmt != WF_BF16 && W->fmt != WF_F32)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda grouped_linear",
                 "weight format is not BF16/F32 (prepare it with dequant_bf16)");
    if (W->n % G != 0)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda grouped_linear", "n is not divisible by G");
    int64_t r = W->n / G, kg = W->k;
    /* the mma switch: BF16 groups on the tensor cores (linear_mma_sm80.cu, both tilings with the
     * same bits per row) where the shapes allow (kg a multiple of 32, 16-byte rows); G > 1 (fewer
     * than 8 ranks) goes through compact copies of each group's x columns and y columns */
    if (cuda_be_mma(be) && W->fmt == WF_BF16 && kg % 32 == 0 && (W->ld * 2) % 16 == 0 && ((uintptr_t)W->w & 15) == 0 &&
        (G > 1 || ((uintptr_t)x & 15) == 0)) {
        cudaStream_t st = cuda_be_stream(be);
        void *ws = cuda_be_scratch_raw(be, cuda_linear_mma_workspace_bytes(T, r, kg));
        bf16_t *xg = G > 1 ? (bf16_t *)cuda_be_scratch_raw(be, (size_t)(T * kg) * 2) : NULL; /* [T, kg] */
        bf16_t *yg = G > 1 ? (bf16_t *)cuda_be_scratch_raw(be, (size_t)(T * r) * 2) : NULL;  /* [T, r] */
        for (int64_t g = 0; g < G; g++) {
            const bf16_t *wg = (const bf16_t *)W->w + g * r * W->ld;
            if (G == 1) {
                cuda_linear_mma(WF_BF16, y, x, T, wg, NULL, r, kg, W->ld, 0, ws, (void *)st);
                continue;
            }
            CUDA_CHECK(cudaMemcpy2DAsync(xg, (size_t)kg * 2, x + g * kg, (size_t)(G * kg) * 2, (size_t)kg * 2, (size_t)T,
                                         cudaMemcpyDeviceToDevice, st));
            cuda_linear_mma(WF_BF16, yg, xg, T, wg, NULL, r, kg, W->ld, 0, ws, (void *)st);
            CUDA_CHECK(cudaMemcpy2DAsync(y + g * r, (size_t)(G * r) * 2, yg, (size_t)r * 2, (size_t)r * 2, (size_t)T,
                                         cudaMemcpyDeviceToDevice, st));
        }
        if (G > 1) {
            cuda_be_scratch_free(be, yg);
            cuda_be_scratch_free(be, xg);
        }
        cuda_be_scratch_free(be, ws);
        return;
    }
    dense_launch(be, y, false, G * r, r, x, G * kg, kg, W->w, W->fmt, W->ld, r * W->ld, T, r, kg, G);
}

/* The head: logits fp32 = x · Wᵀ, the same kernel as linear_f32 (one weight read per call for up
 * to 8 rows; V_local / 32 CTAs, 505 at V = 129280 / 8). */
void cuda_op_head(struct backend *be, float *logits, const bf16_t *x, int64_t T, const struct qweight *W) {
    cuda_op_linear_f32(be, logits, x, T, W);
}
