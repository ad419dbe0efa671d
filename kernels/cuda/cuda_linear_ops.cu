/* Dense projections of the SM80 backend: the op-table entries linear, linear_f32, grouped_linear
 * (wo_a) and head, and the head's row reductions: the greedy draw (argmax) and the log-sum-exp parts
 * of the log-probabilities (row_lse, in kernels/lse_core.h's order) and the top-k lists of the
 * draws (row_topk, in kernels/draw_order.h's order). FP8/FP4 weights go to the tensor-core kernels of linear_mma_sm80.cu (the
 * backend's mma switch, on in the engine) or, with --exact-linears, to the block-scaled kernels of
 * linear_sm80.cu in the CPU's order (through their C interface, in chunks of CUDA_LINEAR_MAX_T
 * rows); so do grouped_linear's BF16 groups (wo_a) under the mma switch, where the shapes allow,
 * and the other BF16 weights (linear, linear_f32, head: dense_mma). F32 weights, and BF16 ones with
 * the switch off or shapes the tiles cannot take, run on the exact kernels here.
 *
 * Numerics of the exact kernels here: every output is the segmented fp32 sum of backend.h (segments of
 * BE_DOT_SEG consecutive k, each a sequential sum in k order from +0, the segment sums added in
 * order from +0), with a round-to-nearest product and a round-to-nearest add per term
 * (__fmul_rn/__fadd_rn, or one FMA where it rounds the same value: lo_madd), then one rounding
 * to bf16 (RNE, NaN -> 0x7FC0 as src/formats.c) or none for fp32 outputs. That is the CPU
 * backend's order (kernels/cpu/cpu_linear.c), so every op here is bit-identical to it, and batch
 * invariant: an output never depends on T, on the other rows of the call or on the grid.
 *
 * Parallelism comes from outputs and from the segments of one output: at one token row a warp
 * walks one weight row's segments with its 32 lanes; 2..256 rows every segment of every output is
 * a warp's work and a second launch adds the segment sums in order; above, a CTA tiles 64 (small
 * grids: 32) token rows x 64 weight rows and runs each output's chain through its segments in
 * turn. Where both factors of every product are in range the kernels of 2 rows and up fuse the
 * product and the add (lo_madd: the same bits). Shapes a 16-byte load cannot serve (row strides
 * not a multiple of 8 elements, F32 weights) take a plain one-thread-per-output kernel with the
 * same order. */
#include "cuda_internal.h"
#include "cuda_linear.h"
#include "cuda_libm.cuh"
#include "draw_order.h"
#include "linear_mma.h"
#include "lse_core.h"

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

/* 8 bf16 (one loaded 16-byte word) -> 8 fp32 at dst (exact widening), two float4 stores. */
static __device__ __forceinline__ void lo_widen8(float *dst, uint4 v) {
    float f[8];
    lo_widen8r(f, v);
    *reinterpret_cast<float4 *>(dst) = make_float4(f[0], f[1], f[2], f[3]);
    *reinterpret_cast<float4 *>(dst + 4) = make_float4(f[4], f[5], f[6], f[7]);
}

/* ---------------------------------------------------------------------------------------------
 * One multiply-add of the segmented sum. bf16 x bf16 has at most 16 significant bits, so while the
 * product is a normal fp32 number it is exact and fma(x, w, acc) rounds the same value as
 * fadd(acc, fmul(x, w)): the same bits in one instruction. That holds when every nonzero factor
 * lies in [2^-63, 2^64) (a product of two of them is >= 2^-126 and < 2^128); zeros are exact
 * anyway. lo_bad8 flags 8 bf16 values of which one is outside (subnormals, large values, Inf,
 * NaN), and a tile that holds one runs the separately rounded form. */
template <bool FMA> static __device__ __forceinline__ float lo_madd(float acc, float x, float w) {
    return FMA ? __fmaf_rn(x, w, acc) : __fadd_rn(acc, __fmul_rn(x, w));
}

/* Nonzero in the sign bits 0x80008000 when one of the 8 bf16 values of v is nonzero with a biased
 * exponent outside [64, 190]: per 16-bit half h = |value| bits, h + 0x2080 reaches bit 15 when
 * h >= 0x5f80 (exponent 191 and up), h + 0x6000 stays below it when h < 0x2000 (exponent 63 and
 * below), h + 0x7fff reaches it when h != 0; no half carries into the next. */
static __device__ __forceinline__ uint32_t lo_bad8(uint4 v) {
    uint32_t bad = 0;
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint32_t a = u[i] & 0x7fff7fffu;
        bad |= (a + 0x20802080u) | (~(a + 0x60006000u) & (a + 0x7fff7fffu));
    }
    return bad & 0x80008000u;
}

/* ---------------------------------------------------------------------------------------------
 * BF16 kernel for one token row (the segment-parallel kernel below takes 2..256): a warp per
 * weight row, a lane per BE_DOT_SEG segment of its k (lane l takes segments l, l + 32, ...). A
 * lane copies its segment's 256 bytes of the row into shared memory with 16 cp.async at once
 * (its memory parallelism: with one warp per row, 4 rows a CTA, a [384, 5120] router gate is 96
 * CTAs, each streaming 40 KB), and reads x through the read-only cache (the 4 warps of a CTA read
 * the same x). Each round of 32 segments is folded into the running total in segment order by
 * shuffles, every lane adding the same values in the same order, and lane 0 stores it.
 * The k-order GEMV it replaces (a lane per weight row over all of k) spent 30.9 µs
 * per router gate at batch 1 on one 5,120-add chain per output in 12 CTAs; with this kernel the
 * router op (gate and selection, 20 calls) went from 0.92 to 0.56 ms per step at batch 1 and from
 * 1.29 to 0.86 at batch 8 (H200, bench_step --profile, ops serial).
 * Grid: y = 4-row weight tile, z = group g of a grouped projection (element offsets y_gs, x_gs,
 * w_gs per g). Needs k % 8 == 0 and 16-byte
 * aligned rows (dense_launch). */
#define DS_WARPS 4                 /* weight rows per CTA, one per warp */
#define DS_CH (BE_DOT_SEG / 8)     /* 16-byte chunks of a whole segment */
static_assert(BE_DOT_SEG % 8 == 0, "segments of whole 16-byte chunks");


/* acc += x[kc + j] · w[j], j = 0..7 in order, each product and add rounded on its own; x through
 * the read-only cache (the CTA's warps read the same x) */
static __device__ __forceinline__ void seg_chunk(float &acc, uint4 wv, const uint16_t *xb, int64_t kc) {
    float wf[8], xf[8];
    lo_widen8r(wf, wv);
    lo_widen8r(xf, __ldg(reinterpret_cast<const uint4 *>(xb + kc)));
#pragma unroll
    for (int j = 0; j < 8; j++) acc = __fadd_rn(acc, __fmul_rn(xf[j], wf[j]));
}

template <bool OUT_F32>
__global__ void __launch_bounds__(DS_WARPS * 32, 1)
    dense_seg_kernel(void *__restrict__ y, int64_t y_gs, const uint16_t *__restrict__ x, int64_t x_gs,
                     const uint16_t *__restrict__ w, int64_t ldw, int64_t w_gs, int64_t n, int64_t k) {
    /* each lane's segment of its warp's row, chunk c at c ^ (lane % 16): the 8 lanes of a
     * quarter-warp phase hit distinct bank quads */
    __shared__ __align__(16) uint16_t w_s[DS_WARPS][32][BE_DOT_SEG];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t row = (int64_t)blockIdx.y * DS_WARPS + warp, g = blockIdx.z;
    if (row >= n) return; /* the whole warp; nothing below waits on another warp */
    const uint16_t *wr = w + g * w_gs + row * ldw; /* [k] bf16 */
    const uint16_t *xb = x + g * x_gs;              /* [k] bf16 */
    uint16_t *mine = &w_s[warp][lane][0];
    const int sw = lane & 15;
    const int64_t nseg = (k + BE_DOT_SEG - 1) / BE_DOT_SEG;
    float tot = 0.0f;
    for (int64_t s0 = 0; s0 < nseg; s0 += 32) {
        const int64_t kb = (s0 + lane) * BE_DOT_SEG;
        const int nch = kb >= k ? 0 : (k - kb >= BE_DOT_SEG ? DS_CH : (int)((k - kb) / 8));
        /* the segment's weights, every copy in flight at once (plain loads were sunk next to their
         * uses by the compiler: two in flight, an L2 round trip per chunk); the lane reads only what
         * it copied, so its own wait is the only synchronisation */
        for (int c = 0; c < nch; c++) ds_cp16z(mine + ((c ^ sw) * 8), wr + kb + 8 * c, 16);
        ds_cp_commit();
        ds_cp_wait<0>();
        float acc = 0.0f;
        if (nch == DS_CH) {
#pragma unroll
            for (int c = 0; c < DS_CH; c++)
                seg_chunk(acc, *reinterpret_cast<const uint4 *>(mine + ((c ^ sw) * 8)), xb, kb + 8 * c);
        } else {
            for (int c = 0; c < nch; c++)
                seg_chunk(acc, *reinterpret_cast<const uint4 *>(mine + ((c ^ sw) * 8)), xb, kb + 8 * c);
        }
        const int live = nseg - s0 < 32 ? (int)(nseg - s0) : 32;
        for (int j = 0; j < live; j++) tot = __fadd_rn(tot, __shfl_sync(0xffffffffu, acc, j));
    }
    if (lane == 0) lo_store(y, OUT_F32, g * y_gs + row, tot);
}

/* ---------------------------------------------------------------------------------------------
 * BF16 kernel for 2..31 token rows (dense_seg_kernel takes one, dense_tile_kernel more: by segment
 * up to 256, DTP_MIN_T), parallel over the segments of the outputs: a warp sums one segment
 * (BE_DOT_SEG k) of 32 weight rows (lane = row) x TT token rows, each chain from +0 in k order,
 * and stores the segment sums; dense_fold_kernel then adds an output's segment sums in order from
 * the first. So the bits are
 * dense_seg_kernel's and the CPU's, an output's dependent chain is one segment plus the fold, and
 * every warp of the grid is busy at once (a [384, 5120] router gate at 64 rows: 16 x 12 x 10 CTAs of
 * 4 warps). The warp stages its 32 x 128 weights in shared memory with coalesced cp.async (two
 * rows a copy instruction, chunk c of row r at c ^ (r % 16): each lane then reads its row
 * conflict-free) and widens its TT token rows to fp32 there (broadcast reads). Measured on the H200
 * (Nsight, kernel_times.sh): the k-order kernel it replaced at 9..256 rows (a lane per weight row
 * over all 40 segments of k one after another, 8 token rows a CTA) took 43 µs a router gate at 64
 * rows, and dense_seg_kernel, then templated for up to 8 token rows, at 8 rows (each lane reading
 * its own segment and the x rows with 16-byte loads, 32 cache lines an instruction) 20.5 µs; this
 * one takes 22.6 µs and a 4.5 µs fold at 64 rows, 6.4 + 4.2 at 8. Grid: x = token group of TT
 * rows, y = 32-row weight tile, z = group g x segment group of DF_WARPS. Needs 16-byte aligned
 * rows (dense_launch); a k tail short of 8 values is read element by element. Tried and not kept:
 * a CTA staging its segment once for 4 groups of token rows (16 rows a CTA from 32 rows on, a
 * quarter of the weights' L2 reads): the router gate at 64 rows stayed at 23 µs a call (22.6 ->
 * 23.0, Nsight), so the L2 traffic is not what it waits on. */
#define DF_WARPS 4 /* warps per CTA, a segment each */

/* 8 bf16 of row p from k0 (k0 % 8 == 0, p 16-byte aligned at k0), zeros at and past k */
static __device__ __forceinline__ uint4 df_load8(const uint16_t *p, int64_t k0, int64_t k) {
    if (k0 + 8 <= k) return __ldg(reinterpret_cast<const uint4 *>(p + k0));
    uint32_t u[8]; /* constant indices only: registers, not a stack array */
#pragma unroll
    for (int j = 0; j < 8; j++) u[j] = k0 + j < k ? (uint32_t)__ldg(p + k0 + j) : 0u;
    return make_uint4(u[0] | u[1] << 16, u[2] | u[3] << 16, u[4] | u[5] << 16, u[6] | u[7] << 16);
}

/* a lane's TT chains over one segment: wr its row's 16 chunks, xf [TT][128] fp32 */
template <int TT, bool FMA>
static __device__ __forceinline__ void df_segment(float (&acc)[TT], const uint4 (&wr)[BE_DOT_SEG / 8],
                                                  const float *xf) {
#pragma unroll
    for (int c = 0; c < BE_DOT_SEG / 8; c++) {
        float wf[8];
        lo_widen8r(wf, wr[c]);
#pragma unroll
        for (int t = 0; t < TT; t++) {
            const float4 xa = *reinterpret_cast<const float4 *>(xf + t * BE_DOT_SEG + c * 8);
            const float4 xb = *reinterpret_cast<const float4 *>(xf + t * BE_DOT_SEG + c * 8 + 4);
            acc[t] = lo_madd<FMA>(acc[t], xa.x, wf[0]);
            acc[t] = lo_madd<FMA>(acc[t], xa.y, wf[1]);
            acc[t] = lo_madd<FMA>(acc[t], xa.z, wf[2]);
            acc[t] = lo_madd<FMA>(acc[t], xa.w, wf[3]);
            acc[t] = lo_madd<FMA>(acc[t], xb.x, wf[4]);
            acc[t] = lo_madd<FMA>(acc[t], xb.y, wf[5]);
            acc[t] = lo_madd<FMA>(acc[t], xb.z, wf[6]);
            acc[t] = lo_madd<FMA>(acc[t], xb.w, wf[7]);
        }
    }
}

/* part: [G][nseg][T][n] fp32 segment sums */
template <int TT>
__global__ void __launch_bounds__(DF_WARPS * 32)
    dense_segsum_kernel(float *__restrict__ part, const uint16_t *__restrict__ x, int64_t ldx, int64_t x_gs,
                        const uint16_t *__restrict__ w, int64_t ldw, int64_t w_gs, int64_t T, int64_t n, int64_t k,
                        int nsg) {
    constexpr int SEG = BE_DOT_SEG, CH = SEG / 8;
    static_assert(CH == 16 && (TT * CH) % 32 == 0, "copy assignments");
    __shared__ __align__(16) uint16_t w_s[DF_WARPS][32][SEG]; /* the warp's segment of 32 rows */
    __shared__ __align__(16) float xf_s[DF_WARPS][TT * SEG];  /* its TT token rows, widened */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t g = blockIdx.z / nsg, t0 = (int64_t)blockIdx.x * TT, r0 = (int64_t)blockIdx.y * 32;
    const int nseg = (int)((k + SEG - 1) / SEG), seg = (int)(blockIdx.z % nsg) * DF_WARPS + warp;
    if (seg >= nseg) return; /* the whole warp; no CTA barrier below */
    const int tcount = (int)(T - t0 < TT ? T - t0 : TT);
    const int64_t kb = (int64_t)seg * SEG;
    const uint16_t *wg = w + g * w_gs, *xg = x + g * x_gs + t0 * ldx;
    uint16_t(*ws)[SEG] = w_s[warp];
#pragma unroll
    for (int i = 0; i < 16; i++) { /* rows 2i, 2i + 1: lane / 16 picks the row, lane % 16 the chunk */
        const int r = 2 * i + (lane >> 4), c = lane & 15;
        const int64_t gk = kb + 8 * c;
        const int bytes = r0 + r < n && gk < k ? (int)(k - gk < 8 ? (k - gk) * 2 : 16) : 0;
        ds_cp16z(&ws[r][(c ^ (r & 15)) * 8], bytes ? wg + (r0 + r) * ldw + gk : wg, bytes);
    }
    ds_cp_commit();
    float *xf = xf_s[warp];
    uint32_t bad = 0;
#pragma unroll
    for (int i = 0; i < TT * CH / 32; i++) { /* x chunk q: token q / 16, chunk q % 16 */
        const int q = lane + 32 * i, t = q >> 4, c = q & 15;
        const uint4 v = t < tcount ? df_load8(xg + t * ldx, kb + 8 * c, k) : make_uint4(0, 0, 0, 0);
        bad |= lo_bad8(v);
        lo_widen8(xf + t * SEG + c * 8, v);
    }
    ds_cp_wait<0>();
    __syncwarp();
    uint4 wr[CH];
#pragma unroll
    for (int c = 0; c < CH; c++) {
        wr[c] = *reinterpret_cast<const uint4 *>(&ws[lane][(c ^ (lane & 15)) * 8]);
        bad |= lo_bad8(wr[c]);
    }
    float acc[TT];
#pragma unroll
    for (int t = 0; t < TT; t++) acc[t] = 0.0f;
    if (__any_sync(0xffffffffu, bad != 0)) df_segment<TT, false>(acc, wr, xf);
    else df_segment<TT, true>(acc, wr, xf);
    if (r0 + lane < n) {
        float *pp = part + ((g * nseg + seg) * T + t0) * n + r0 + lane;
#pragma unroll
        for (int t = 0; t < TT; t++)
            if (t < tcount) pp[t * n] = acc[t];
    }
}

/* y (+ g*y_gs) [T, ldy] = the segment sums of part [G][nseg][T][n] added in order (from the first:
 * a chain from +0 is never -0, so +0 + s_0 = s_0) */
template <bool OUT_F32>
__global__ void dense_fold_kernel(void *__restrict__ y, int64_t ldy, int64_t y_gs, const float *__restrict__ part,
                                  int64_t T, int64_t n, int nseg, int64_t total) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t g = i / (T * n), tr = i % (T * n), t = tr / n, r = tr % n;
        const float *pp = part + g * nseg * T * n + tr;
        float v = pp[0];
        for (int s = 1; s < nseg; s++) v = __fadd_rn(v, pp[(int64_t)s * T * n]);
        lo_store(y, OUT_F32, t * ldy + g * y_gs + r, v);
    }
}

/* ---------------------------------------------------------------------------------------------
 * BF16 kernel for prefill-sized calls (T > DT_MIN_T): the same segmented sum per output, tiled for
 * reuse. The segment-parallel kernel above reads each weight once per 8 token rows, so at T = 2048 a
 * [384, 5120] router gate streamed its weights 256 times through L2 and spent a CTA's issue slots
 * on widening them; here a CTA owns 64 token rows (32 for small grids: DT_WIDE_CTAS) x 64 weight
 * rows, both widened to fp32 in shared memory once per stage of 32 k, and each thread runs 32
 * chains (token rows ty + 16i x weight rows tx + 8j; 16 at 32 rows), loading 4 k of each operand
 * per float4: 12 shared loads per 128 multiply-adds. The
 * tile of 64 x 32 with 8 chains a thread it replaces was bound by those loads (6 per 32), not by
 * its arithmetic: fusing its multiply-adds took the 26 calls of a 2,048-token prefill from 457 to
 * 448 µs on average (H200, Nsight). Bits: within a segment (BE_DOT_SEG / DT_KB stages) every
 * chain is acc = fadd(acc, fmul(x_k, w_k)) (or its lo_madd equal) in k order from +0, and at the
 * segment's end tot = fadd(tot, acc), as
 * dense_seg_kernel and the CPU; zero-filled tails (rows, tokens, k) are never stored or add 0·0
 * (acc is never -0, so + 0 leaves it). Stage s: wait for own copies, barrier (everyone is past
 * stage s-1's compute), issue stage s + 2, widen own chunks, barrier, compute. */
#define DT_MIN_T 256 /* calls of more rows take the tiled kernel */
#define DT_BR 64     /* weight rows per CTA */
#define DT_KB 32     /* k per stage */
#define DT_LD (DT_KB + 4) /* widened rows, padded: the 8 weight rows a phase reads sit on distinct banks */
#define DT_STAGES 3
#define DT_THREADS 128
#define DT_TJ 8 /* weight rows per thread: tx + 8j */
/* Token rows per CTA: 16 TI (TI rows a thread, ty + 16i): TI = 4 (64 rows) where the grid of
 * 64-row tiles has at least DT_WIDE_CTAS CTAs, else TI = 2 (32 rows, twice the CTAs for a grid
 * that leaves most SMs idle). H200, Nsight, a 2,048-token prefill (tests/gpu: ncu -k dense_tile):
 * 32-CTA grids (n <= 64 at 2,048 rows, n <= 128 at 1,024) 243 -> 174 and 29 -> 21 µs a call at
 * TI = 2; the router gate's 192 CTAs 366 -> 374 µs and the 256 of n = 512 368 -> 474 µs, so those
 * keep 64 rows (the per-stage widening and shared loads per multiply-add double at 32 rows). */
#define DT_WIDE_CTAS 128
/* From DTP_MIN_T to DT_MIN_T rows (decode batches of 32-256) the tile kernel runs with a CTA per
 * segment (PART: the segment sums go to memory and dense_fold_kernel adds them, as after
 * dense_segsum_kernel), 64-row tiles where that grid has DTP_WIDE_CTAS CTAs, else 32: the router
 * gate [384, 5120] at 64 rows is 2 x 6 x 40 CTAs of 32 x 64 outputs. dense_segsum_kernel, which
 * it replaces there, gives each warp one segment of 32 weight rows against 4 or 8 token rows, so
 * every weight row is staged and widened once per 4-8 token rows and each multiply-add costs a
 * shared load; the tile widens a weight once per 32-64 token rows and loads 10-12 operands per
 * 64-128 multiply-adds. Same bits (each segment from +0 in k order, the fold in order).
 * H200, bench_step decode ms, the old and the new binary alternated twice in one device call:
 * batch 32 9.22 9.19 -> 9.17 9.16, 64 12.48 12.52 -> 12.23 12.28, 128 17.69 17.67 -> 17.57 17.40,
 * 256 24.34 24.37 -> 23.57 23.62; a router gate call (Nsight, clocks as they run) 21.2 µs + a
 * 7.5 µs fold at 64 rows, 56 µs + 9.4 µs at 256. Tried and not kept: the same above 256 rows where
 * the whole-k grid has fewer than 256 CTAs (the prefill's router gate, 192 at 2,048 rows): the
 * 2,048- and 8,192-token prefills unchanged (results/PERFORMANCE_HISTORY.md). */
#define DTP_MIN_T 32
#define DTP_WIDE_CTAS 512
static_assert(BE_DOT_SEG % DT_KB == 0, "segments of whole stages");
static_assert(DT_TJ * 8 == DT_BR && DT_THREADS == 128, "thread tile");

/* One stage of a dense_tile_kernel thread's TI x DT_TJ chains over DT_KB k in order. */
template <int TI, bool FMA>
static __device__ __forceinline__ void dt_stage(float (&acc)[TI][DT_TJ], const float (*xf)[DT_LD],
                                                const float (*wf)[DT_LD], int tx, int ty) {
#pragma unroll
    for (int kk = 0; kk < DT_KB; kk += 4) {
        float4 xv[TI], wv[DT_TJ];
#pragma unroll
        for (int i = 0; i < TI; i++) xv[i] = *reinterpret_cast<const float4 *>(&xf[ty + 16 * i][kk]);
#pragma unroll
        for (int j = 0; j < DT_TJ; j++) wv[j] = *reinterpret_cast<const float4 *>(&wf[tx + 8 * j][kk]);
#pragma unroll
        for (int i = 0; i < TI; i++)
#pragma unroll
            for (int j = 0; j < DT_TJ; j++) {
                acc[i][j] = lo_madd<FMA>(acc[i][j], xv[i].x, wv[j].x);
                acc[i][j] = lo_madd<FMA>(acc[i][j], xv[i].y, wv[j].y);
                acc[i][j] = lo_madd<FMA>(acc[i][j], xv[i].z, wv[j].z);
                acc[i][j] = lo_madd<FMA>(acc[i][j], xv[i].w, wv[j].w);
            }
    }
}

/* 3 CTAs an SM: up to 170 registers (the sm_90 JIT otherwise capped the PART form at 128 and spilled) */
template <int TI, bool OUT_F32, bool PART = false>
__global__ void __launch_bounds__(DT_THREADS, 3)
    dense_tile_kernel(void *__restrict__ y, int64_t ldy, int64_t y_gs, const uint16_t *__restrict__ x, int64_t ldx,
                      int64_t x_gs, const uint16_t *__restrict__ w, int64_t ldw, int64_t w_gs, int64_t T, int64_t n,
                      int64_t k, float *__restrict__ part = nullptr) {
    constexpr int BT = 16 * TI, XCH = BT * DT_KB / 8 / DT_THREADS; /* token rows; x chunks a thread a stage */
    static_assert(XCH * DT_THREADS * 8 == BT * DT_KB && DT_BR * DT_KB / 8 == 2 * DT_THREADS, "copy assignments");
    __shared__ __align__(16) uint16_t sx[DT_STAGES][BT][DT_KB]; /* raw stages */
    __shared__ __align__(16) uint16_t sw[DT_STAGES][DT_BR][DT_KB];
    __shared__ __align__(16) float xf[BT][DT_LD]; /* the stage's widened rows */
    __shared__ __align__(16) float wf[DT_BR][DT_LD];
    const int tid = threadIdx.x, tx = tid & 7, ty = tid >> 3;
    /* PART: grid z = group x segment; the CTA sums its one segment and stores the sums in part
     * [G][nseg][T][n], which dense_fold_kernel adds in order */
    constexpr int SST = BE_DOT_SEG / DT_KB; /* stages a segment */
    const int nseg = (int)((k + BE_DOT_SEG - 1) / BE_DOT_SEG);
    const int64_t t0 = (int64_t)blockIdx.x * BT, r0 = (int64_t)blockIdx.y * DT_BR;
    const int64_t g = PART ? blockIdx.z / nseg : blockIdx.z;
    const int seg = PART ? (int)(blockIdx.z % nseg) : 0, st0 = seg * SST; /* the first stage */
    const uint16_t *xg = x + g * x_gs, *wg = w + g * w_gs;
    const int nst_all = (int)((k + DT_KB - 1) / DT_KB);
    const int nst = PART ? (nst_all - st0 < SST ? nst_all - st0 : SST) : nst_all;
    /* copy assignment: chunk q = tid + 128u of each operand (u < XCH for x, u < 2 for w): row q / 4,
     * chunk q % 4 (8 values) */
    auto load_stage = [&](int slot, int s) {
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int q = tid + DT_THREADS * u, cr = q >> 2, cc = q & 3;
            const int64_t gk = (int64_t)(st0 + s) * DT_KB + cc * 8;
            int bytes;
            if (u < XCH) {
                bytes = (t0 + cr < T && gk < k) ? (int)(k - gk < 8 ? (k - gk) * 2 : 16) : 0;
                ds_cp16z(&sx[slot][cr][cc * 8], bytes ? xg + (t0 + cr) * ldx + gk : xg, bytes);
            }
            bytes = (r0 + cr < n && gk < k) ? (int)(k - gk < 8 ? (k - gk) * 2 : 16) : 0;
            ds_cp16z(&sw[slot][cr][cc * 8], bytes ? wg + (r0 + cr) * ldw + gk : wg, bytes);
        }
    };
#pragma unroll
    for (int s = 0; s < DT_STAGES - 1; s++) {
        if (s < nst) load_stage(s, s);
        ds_cp_commit();
    }
    float acc[TI][DT_TJ], tot[TI][DT_TJ]; /* the segment's chains, the totals of the segments before */
#pragma unroll
    for (int i = 0; i < TI; i++)
#pragma unroll
        for (int j = 0; j < DT_TJ; j++) acc[i][j] = tot[i][j] = 0.0f;
    for (int s = 0; s < nst; s++) {
        const int slot = s % DT_STAGES;
        ds_cp_wait<DT_STAGES - 2>();
        __syncthreads();
        if (s + DT_STAGES - 1 < nst) load_stage((s + DT_STAGES - 1) % DT_STAGES, s + DT_STAGES - 1);
        ds_cp_commit();
        uint32_t bad = 0;
#pragma unroll
        for (int u = 0; u < 2; u++) {
            const int q = tid + DT_THREADS * u, cr = q >> 2, cc = q & 3;
            if (u < XCH) {
                const uint4 vx = *reinterpret_cast<const uint4 *>(&sx[slot][cr][cc * 8]);
                bad |= lo_bad8(vx);
                lo_widen8(&xf[cr][cc * 8], vx);
            }
            const uint4 vw = *reinterpret_cast<const uint4 *>(&sw[slot][cr][cc * 8]);
            bad |= lo_bad8(vw);
            lo_widen8(&wf[cr][cc * 8], vw);
        }
        /* the barrier that publishes the widened stage also tells every thread whether it may fuse */
        if (__syncthreads_or(bad != 0)) dt_stage<TI, false>(acc, xf, wf, tx, ty);
        else dt_stage<TI, true>(acc, xf, wf, tx, ty);
        if ((s + 1) % SST == 0 || s + 1 == nst) { /* a segment ends: fold it in order, or store it */
            if constexpr (PART) {
#pragma unroll
                for (int i = 0; i < TI; i++) {
                    const int64_t t = t0 + ty + 16 * i;
                    float *const pp = part + ((g * nseg + seg) * T + t) * n + r0 + tx;
#pragma unroll
                    for (int j = 0; j < DT_TJ; j++) {
                        if (t < T && r0 + tx + 8 * j < n) pp[8 * j] = acc[i][j];
                        acc[i][j] = 0.0f;
                    }
                }
            } else {
#pragma unroll
                for (int i = 0; i < TI; i++)
#pragma unroll
                    for (int j = 0; j < DT_TJ; j++) tot[i][j] = __fadd_rn(tot[i][j], acc[i][j]), acc[i][j] = 0.0f;
            }
        }
    }
    ds_cp_wait<0>();
    if constexpr (PART) return;
#pragma unroll
    for (int i = 0; i < TI; i++) {
        const int64_t t = t0 + ty + 16 * i;
        if (t >= T) continue;
#pragma unroll
        for (int j = 0; j < DT_TJ; j++) {
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
    const int64_t nseg = (k + BE_DOT_SEG - 1) / BE_DOT_SEG, nsg = (nseg + DF_WARPS - 1) / DF_WARPS;
    const bool part_tile = T >= DTP_MIN_T && T <= DT_MIN_T && nseg > 0 && G * nseg <= 65535 && (n + 63) / 64 <= 65535;
    const bool segsum = T > 1 && T < DTP_MIN_T && nseg > 0 && G * nsg <= 65535 && (n + 31) / 32 <= 65535;
    const bool tiled = T > 1 && !segsum && !part_tile && (T + 31) / 32 <= 0x7fffffff;
    /* one row dense_seg_kernel (k % 8 == 0), 2..31 dense_segsum_kernel + dense_fold_kernel, 32..256
     * dense_tile_kernel by segment + dense_fold_kernel, more dense_tile_kernel */
    const bool aligned = fmt == WF_BF16 && ((uintptr_t)w % 16) == 0 && ((uintptr_t)x % 16) == 0 && ldw % 8 == 0 &&
                         w_gs % 8 == 0 && ldx % 8 == 0 && x_gs % 8 == 0 && (T > 1 || k % 8 == 0) &&
                         (n + DS_WARPS - 1) / DS_WARPS <= 65535;
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
        const int64_t rt = (n + DT_BR - 1) / DT_BR;
        const bool wide = (T + 63) / 64 * rt * G >= DT_WIDE_CTAS;
        const dim3 grid((unsigned)(wide ? (T + 63) / 64 : (T + 31) / 32), (unsigned)rt, (unsigned)G);
        const uint16_t *wb = (const uint16_t *)w;
        if (wide && out_f32)
            dense_tile_kernel<4, true><<<grid, DT_THREADS, 0, st>>>(y, ldy, y_gs, x, ldx, x_gs, wb, ldw, w_gs, T, n, k);
        else if (wide)
            dense_tile_kernel<4, false><<<grid, DT_THREADS, 0, st>>>(y, ldy, y_gs, x, ldx, x_gs, wb, ldw, w_gs, T, n, k);
        else if (out_f32)
            dense_tile_kernel<2, true><<<grid, DT_THREADS, 0, st>>>(y, ldy, y_gs, x, ldx, x_gs, wb, ldw, w_gs, T, n, k);
        else
            dense_tile_kernel<2, false><<<grid, DT_THREADS, 0, st>>>(y, ldy, y_gs, x, ldx, x_gs, wb, ldw, w_gs, T, n, k);
        KERNEL_CHECK();
        return;
    }
    if (segsum || part_tile) { /* 2..256 rows: segments in parallel */
        float *part = (float *)cuda_be_scratch_raw(be, (size_t)(G * nseg * T * n) * sizeof(float)); /* [G][nseg][T][n] */
        const uint16_t *wb = (const uint16_t *)w;
        if (part_tile) {
            const int64_t rt = (n + DT_BR - 1) / DT_BR;
            const bool wide = (T + 63) / 64 * rt * G * nseg >= DTP_WIDE_CTAS;
            const dim3 grid((unsigned)(wide ? (T + 63) / 64 : (T + 31) / 32), (unsigned)rt, (unsigned)(G * nseg));
            if (wide)
                dense_tile_kernel<4, true, true>
                    <<<grid, DT_THREADS, 0, st>>>(nullptr, 0, 0, x, ldx, x_gs, wb, ldw, w_gs, T, n, k, part);
            else
                dense_tile_kernel<2, true, true>
                    <<<grid, DT_THREADS, 0, st>>>(nullptr, 0, 0, x, ldx, x_gs, wb, ldw, w_gs, T, n, k, part);
        } else {
            dense_segsum_kernel<4><<<dim3((unsigned)((T + 3) / 4), (unsigned)((n + 31) / 32), (unsigned)(G * nsg)),
                                     DF_WARPS * 32, 0, st>>>(part, x, ldx, x_gs, wb, ldw, w_gs, T, n, k, (int)nsg);
        }
        KERNEL_CHECK();
        const int64_t total = G * T * n, blocks = (total + 255) / 256;
        if (out_f32)
            dense_fold_kernel<true><<<(unsigned)(blocks < 4096 ? blocks : 4096), 256, 0, st>>>(y, ldy, y_gs, part, T, n, (int)nseg, total);
        else
            dense_fold_kernel<false><<<(unsigned)(blocks < 4096 ? blocks : 4096), 256, 0, st>>>(y, ldy, y_gs, part, T, n, (int)nseg, total);
        KERNEL_CHECK();
        cuda_be_scratch_free(be, part);
        return;
    }
    /* one row */
    if (T != 1) ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "dense", "more rows than the grids take");
    dim3 grid(1u, (unsigned)((n + DS_WARPS - 1) / DS_WARPS), (unsigned)G);
    const uint16_t *wb = (const uint16_t *)w;
    if (out_f32) dense_seg_kernel<true><<<grid, DS_WARPS * 32, 0, st>>>(y, y_gs, x, x_gs, wb, ldw, w_gs, n, k);
    else dense_seg_kernel<false><<<grid, DS_WARPS * 32, 0, st>>>(y, y_gs, x, x_gs, wb, ldw, w_gs, n, k);
    KERNEL_CHECK();
}

/* ---------------------------------------------------------------------------------------------
 * Ops */

/* The dense BF16 sums under the tensor-core switch (the engine's default): linear on BF16 weights
 * (bf16 out), linear_f32 (the router gate, the compressor's kv and gate; fp32 out) and the head run
 * on the BF16 mma tilings of linear_mma_sm80.cu. An output's k-chunks of 1,024 are summed by the mma
 * accumulator in its own order and added in chunk order (CUDA_MMA_OUT_F32: without a final
 * rounding), at every T, so the rows stay batch invariant. Every product of two bf16 is exact in
 * fp32, so both backends are within their sum bounds of the exact sum (tolerances.h,
 * TOL_GPU_DENSE_MMA_U_PER_TERM; the router's selection may then differ from the CPU's only in near
 * ties, TOL_GPU_ROUTER_NEAR_TIE_SWAPS). Rows go in blocks whose chunk partials fit DENSE_MMA_WS
 * bytes (rows are independent: the blocks change no bit). The exact kernels (the CPU's order,
 * dense_launch) were compute bound from a few dozen rows: H100, bench_head_draw, ms for [16160,
 * 5120] at 1 / 8 / 64 / 256 rows exact 0.102 / 0.134 / 0.435 / 1.665, here 0.073 / 0.092 / 0.159 /
 * 0.239 ([129280, 5120] at 256 rows 12.7 -> 5.6); the router gates and compressors took 10.1 ms of a
 * 2K-token prefill's 97 (Nsight, 0d2cb3e). --exact-linears (the switch off) and shapes the tiles
 * cannot take (F32 weights, k % 32, unaligned rows) keep the exact kernels; that choice depends on
 * the weight and the buffers, never on T. Returns whether it ran. */
#define DENSE_MMA_WS ((size_t)128 << 20)

/* whether the tensor-core tilings take x · Wᵀ (BF16, FP8 or FP4 W): the mma switch, k a multiple of
 * 32 (and at most 2 Mi), x and W 16-byte aligned, W's rows (ld elements BF16, ld bytes FP8/FP4) a
 * multiple of 16 bytes apart */
static bool linear_mma_ok(struct backend *be, const bf16_t *x, const struct qweight *W) {
    const int64_t row_bytes = W->fmt == WF_BF16 ? W->ld * 2 : W->ld;
    return cuda_be_mma(be) && (W->fmt == WF_BF16 || W->fmt == WF_FP8 || W->fmt == WF_FP4) && W->k % 32 == 0 &&
           row_bytes % 16 == 0 && ((uintptr_t)W->w & 15) == 0 && ((uintptr_t)x & 15) == 0 && W->k <= ((int64_t)1 << 21);
}
static bool dense_mma_ok(struct backend *be, const bf16_t *x, const struct qweight *W) {
    return W->fmt == WF_BF16 && linear_mma_ok(be, x, W);
}

static bool dense_mma(struct backend *be, void *y, bool out_f32, const bf16_t *x, int64_t T, const struct qweight *W) {
    const int64_t n = W->n, k = W->k;
    if (!dense_mma_ok(be, x, W)) return false;
    const size_t per_row = cuda_linear_mma_bf16_workspace_bytes(1, n, k);
    int64_t rb = per_row ? (int64_t)(DENSE_MMA_WS / per_row) : T;
    rb = rb < 1 ? 1 : rb > T ? T : rb;
    const size_t wsb = cuda_linear_mma_bf16_workspace_bytes(rb, n, k);
    void *ws = wsb ? cuda_be_scratch_raw(be, wsb) : NULL;
    const size_t esz = out_f32 ? 4 : 2;
    for (int64_t t0 = 0; t0 < T; t0 += rb) {
        const int64_t nt = T - t0 < rb ? T - t0 : rb;
        cuda_linear_mma_tiling(CUDA_MMA_AUTO | (out_f32 ? CUDA_MMA_OUT_F32 : 0), WF_BF16,
                               (uint16_t *)((char *)y + (size_t)(t0 * n) * esz), x + t0 * k, nt, W->w, NULL, n, k,
                               W->ld, 0, ws, (void *)cuda_be_stream(be));
    }
    if (ws) cuda_be_scratch_free(be, ws);
    return true;
}

int64_t cuda_linear_f32_parts(struct backend *be, float *parts, const bf16_t *x, int64_t T, const struct qweight *W) {
    if (T <= 0 || W->n <= 0 || !dense_mma_ok(be, x, W)) return 0;
    cuda_linear_mma_tiling(CUDA_MMA_AUTO | CUDA_MMA_OUT_PARTS, WF_BF16, (uint16_t *)parts, x, T, W->w, NULL, W->n, W->k,
                           W->ld, 0, NULL, (void *)cuda_be_stream(be));
    return cuda_linear_mma_chunks(W->k);
}

/* linear_cols (backend.h): FP8/FP4 weights on the tensor cores quantize x straight from its column
 * blocks (cuda_linear_mma_act_quant_blocks), then run the tilings on that (CUDA_MMA_PREQUANT): the
 * bits of interleave, then linear, without the interleave's launch and its copy of x. Other formats,
 * the exact kernels and blocks not a multiple of 32 wide: false (the caller interleaves). */
bool cuda_op_linear_cols(struct backend *be, bf16_t *y, const bf16_t *xb, int64_t nblk, int64_t T,
                         const struct qweight *W) {
    if (T <= 0 || W->n <= 0) return true;
    if (!cuda_be_mma(be) || (W->fmt != WF_FP8 && W->fmt != WF_FP4) || nblk < 1 || W->k % nblk ||
        (W->k / nblk) % 32 || ((uintptr_t)xb & 15))
        return false;
    const size_t ab = cuda_linear_mma_act_bytes(T, W->k); /* a multiple of 16 */
    uint8_t *ws = (uint8_t *)cuda_be_scratch_raw(be, cuda_linear_mma_workspace_bytes(T, W->n, W->k));
    void *st = (void *)cuda_be_stream(be);
    cuda_linear_mma_act_quant_blocks((uint16_t *)ws, xb, nblk, T, W->k, st);
    cuda_linear_mma_tiling(CUDA_MMA_AUTO | CUDA_MMA_PREQUANT, (int)W->fmt, y, (const uint16_t *)ws, T, W->w, W->s, W->n,
                           W->k, W->ld, W->s_ld, ws + ab, st);
    cuda_be_scratch_free(be, ws);
    return true;
}

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
    case WF_BF16:
        if (!dense_mma(be, y, false, x, T, W))
            dense_launch(be, y, false, W->n, 0, x, W->k, 0, W->w, WF_BF16, W->ld, 0, T, W->n, W->k, 1);
        break;
    default:
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda linear",
                 "weight format not allowed (F32 goes through linear_f32)");
    }
}

/* One scratch block for a linear_post call under the mma switch: the linear's unfolded partials
 * [nch][T][n] fp32 (returned; free it with cuda_be_scratch_free), then, where the linear quantizes
 * x itself (quant_x), x's act form [T, k] (*xq; NULL otherwise). */
static float *linear_post_scratch(struct backend *be, int64_t nch, int64_t T, int64_t n, int64_t k, bool quant_x,
                                  void **xq) {
    const size_t pb = ((size_t)nch * (size_t)(T * n) * sizeof(float) + 15) & ~(size_t)15;
    uint8_t *buf = (uint8_t *)cuda_be_scratch_raw(be, pb + (quant_x ? cuda_linear_mma_act_bytes(T, k) : 0));
    *xq = quant_x ? buf + pb : NULL;
    return (float *)buf;
}

/* linear_post under the mma switch: the tensor-core linear leaves its k-chunks unfolded
 * (CUDA_MMA_OUT_PARTS) and the norm's or the RoPE's pass folds them (cuda_rmsnorm_post_parts,
 * cuda_rope_parts): one launch, the chunk fold's, fewer than the ops in turn, and their bits (the
 * fold and its bf16 rounding as mma_chunk_sum_kernel's; test_linear_post holds the two bit for
 * bit). On a decode step's query chain (wq_a + q_norm, wq_b + RoPE) and beside it (wkv + kv_norm
 * with RoPE and QDQ). Elsewhere — the switch off, one k-chunk (no fold to save), a QDQ after the
 * RoPE alone (the indexer's queries: the qdq op follows), shapes the passes refuse — the ops in
 * turn. */
void cuda_op_linear_post(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, const struct qweight *W,
                         const struct linear_post *lp) {
    const int64_t n = W->n, k = W->k;
    if (T <= 0 || n <= 0) return;
    const struct norm_post *p = &lp->post;
    const bool quant = W->fmt == WF_FP8 || W->fmt == WF_FP4;
    const bool lin_ok = linear_mma_ok(be, x, W) && cuda_linear_mma_chunks(k) > 1;
    const bool post_ok = lp->norm_w ? cuda_rmsnorm_post_shape(T, n, y, lp->norm_w, p) : cuda_rope_parts_shape(n, lp->head, y, p);
    if (!lin_ok || !post_ok) {
        be_linear_post_composed(be, y, x, T, W, lp);
        if (lp->ya) /* y's act form, which the ops in turn do not make */
            cuda_linear_mma_act_quant((uint16_t *)lp->ya, (const uint16_t *)y, T, n, (void *)cuda_be_stream(be));
        return;
    }
    const int64_t nch = cuda_linear_mma_chunks(k);
    const bool pre = quant && lp->xa; /* x's act form from the norm that made it (cuda_op_hc_collapse_act) */
    void *xq;
    float *parts = linear_post_scratch(be, nch, T, n, k, quant && !pre, &xq); /* [nch][T][n] fp32 */
    cuda_linear_mma_tiling(CUDA_MMA_AUTO | CUDA_MMA_OUT_PARTS | (pre ? CUDA_MMA_PREQUANT : 0), (int)W->fmt,
                           (uint16_t *)parts, pre ? (const uint16_t *)lp->xa : x, T, W->w, W->s, n, k, W->ld, W->s_ld,
                           xq, (void *)cuda_be_stream(be));
    if (lp->norm_w) {
        cuda_rmsnorm_post_parts(be, y, parts, (int)nch, lp->norm_w, T, n, lp->eps, p, lp->ya);
    } else {
        cuda_rope_parts(be, y, parts, (int)nch, T, n, lp->head, p);
        cuda_norm_qdq(be, y, T * n, p->qdq);
        if (lp->ya) cuda_linear_mma_act_quant((uint16_t *)lp->ya, (const uint16_t *)y, T, n, (void *)cuda_be_stream(be));
    }
    cuda_be_scratch_free(be, parts);
}

/* linear_post_pair under the mma switch: one pair linear (cuda_linear_mma_pair: W1's and W2's
 * outputs side by side, [nch][T][n1 + n2] partials) and one launch of both norms
 * (cuda_rmsnorm_post_parts_pair), each output with its own linear_post's bits (the linear's per-row
 * order does not depend on the other weight; the norm's fold and arithmetic are linear_post's).
 * For the attention's wq_a + q_norm beside wkv + kv_norm: two launches where the two chains took
 * four or six, on one lane. Where the two do not fit one call (formats, k, strides, one k-chunk, a
 * QDQ after the first norm, shapes): the two linear_posts in turn. */
void cuda_op_linear_post_pair(struct backend *be, bf16_t *y1, bf16_t *y2, const bf16_t *x, int64_t T,
                              const struct qweight *W1, const struct linear_post *lp1, const struct qweight *W2,
                              const struct linear_post *lp2) {
    if (T <= 0) return;
    const int64_t n1 = W1->n, n2 = W2->n, k = W1->k;
    const bool quant = W1->fmt == WF_FP8 || W1->fmt == WF_FP4;
    const int64_t nch = cuda_linear_mma_chunks(k);
    const bool same = W1->fmt == W2->fmt && W2->k == k && W1->ld == W2->ld && W1->s_ld == W2->s_ld &&
                      lp1->xa == lp2->xa && !lp2->ya && lp1->norm_w && lp2->norm_w && n1 % 32 == 0 &&
                      ((uintptr_t)W2->w & 15) == 0 && (!quant || W2->s) &&
                      /* the prefill tilings take a pair only with its seam between CTA tiles */
                      (n1 % CUDA_MMA_PAIR_SEAM == 0 || T <= CUDA_MMA_DECODE_AUTO_T);
    if (!same || !linear_mma_ok(be, x, W1) || !linear_mma_ok(be, x, W2) || nch < 2 ||
        !cuda_rmsnorm_post_pair_shape(T, NULL, n1, y1, lp1->norm_w, &lp1->post, lp1->ya, n2, y2, lp2->norm_w,
                                      &lp2->post)) {
        cuda_op_linear_post(be, y1, x, T, W1, lp1);
        cuda_op_linear_post(be, y2, x, T, W2, lp2);
        return;
    }
    const bool pre = quant && lp1->xa; /* x's act form from the norm that made it */
    void *xq;
    float *parts = linear_post_scratch(be, nch, T, n1 + n2, k, quant && !pre, &xq); /* [nch][T][n1 + n2] fp32 */
    cuda_linear_mma_pair(CUDA_MMA_AUTO | CUDA_MMA_OUT_PARTS | (pre ? CUDA_MMA_PREQUANT : 0), (int)W1->fmt,
                         (uint16_t *)parts, pre ? (const uint16_t *)lp1->xa : x, T, W1->w, W1->s, n1, W2->w, W2->s, n2,
                         k, W1->ld, W1->s_ld, xq, (void *)cuda_be_stream(be));
    cuda_rmsnorm_post_parts_pair(be, parts, (int)nch, T, y1, lp1->norm_w, n1, lp1->eps, &lp1->post, lp1->ya, y2,
                                 lp2->norm_w, n2, lp2->eps, &lp2->post);
    cuda_be_scratch_free(be, parts);
}

void cuda_op_linear_f32(struct backend *be, float *y, const bf16_t *x, int64_t T, const struct qweight *W) {
    if (T <= 0 || W->n <= 0) return;
    if (W->fmt != WF_BF16 && W->fmt != WF_F32)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda linear_f32", "weight format is not BF16 or F32");
    if (dense_mma(be, y, true, x, T, W)) return;
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

/* The head: logits fp32 = x · Wᵀ, linear_f32's sum (dense_mma under the switch, above). */
void cuda_op_head(struct backend *be, float *logits, const bf16_t *x, int64_t T, const struct qweight *W) {
    cuda_op_linear_f32(be, logits, x, T, W);
}

/* ---------------------------------------------------------------------------------------------
 * argmax: a CTA per row, each thread walks its strided entries keeping the first best, then the
 * warps and the CTA reduce (value, index) pairs under the order of backend.h: a larger value wins,
 * an equal one with the lower index, NaN never, an index of -1 (nothing yet) always loses. That
 * order is total on the pairs a row can give, so any reduction tree keeps the same winner. */
#define AM_THREADS 512

__device__ __forceinline__ bool am_better(float v, int32_t i, float bv, int32_t bi) {
    return i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi));
}

/* the warp's best pair, in every lane */
__device__ __forceinline__ void am_warp_best(float &bv, int32_t &bi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(0xffffffffu, bv, o);
        const int32_t i = __shfl_xor_sync(0xffffffffu, bi, o);
        if (am_better(v, i, bv, bi)) bv = v, bi = i;
    }
}

__global__ void __launch_bounds__(AM_THREADS) argmax_kernel(int32_t *__restrict__ out, const float *__restrict__ x,
                                                            int64_t V) {
    __shared__ float sv[AM_THREADS / 32];
    __shared__ int32_t si[AM_THREADS / 32];
    const float *row = x + (int64_t)blockIdx.x * V;
    float bv = __int_as_float(0x7fc00000);
    int32_t bi = -1;
    /* 16-byte loads where the row allows (a thread's entries then come in index order, 4 apart
     * groups; the comparison keeps the first of equal values whatever the order) */
    const bool v4 = V % 4 == 0 && ((uintptr_t)x & 15) == 0;
    if (v4) {
        const float4 *r4 = reinterpret_cast<const float4 *>(row);
        for (int64_t q = threadIdx.x; q < V / 4; q += AM_THREADS) {
            const float4 f = __ldcs(r4 + q);
            const int32_t i = (int32_t)(4 * q);
            if (am_better(f.x, f.x == f.x ? i : -1, bv, bi)) bv = f.x, bi = i;
            if (am_better(f.y, f.y == f.y ? i + 1 : -1, bv, bi)) bv = f.y, bi = i + 1;
            if (am_better(f.z, f.z == f.z ? i + 2 : -1, bv, bi)) bv = f.z, bi = i + 2;
            if (am_better(f.w, f.w == f.w ? i + 3 : -1, bv, bi)) bv = f.w, bi = i + 3;
        }
    } else {
        for (int64_t i = threadIdx.x; i < V; i += AM_THREADS) {
            const float f = __ldcs(row + i);
            if (am_better(f, f == f ? (int32_t)i : -1, bv, bi)) bv = f, bi = (int32_t)i;
        }
    }
    am_warp_best(bv, bi);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) sv[warp] = bv, si[warp] = bi;
    __syncthreads();
    if (warp == 0) {
        bv = lane < AM_THREADS / 32 ? sv[lane] : __int_as_float(0x7fc00000);
        bi = lane < AM_THREADS / 32 ? si[lane] : -1;
        am_warp_best(bv, bi);
        if (lane == 0) {
            out[2 * (int64_t)blockIdx.x] = __float_as_int(bi >= 0 ? bv : __int_as_float(0x7fc00000));
            out[2 * (int64_t)blockIdx.x + 1] = bi;
        }
    }
}

void cuda_op_argmax(struct backend *be, int32_t *out, const float *x, int64_t R, int64_t V) {
    if (R <= 0) return;
    if (V <= 0 || V > INT32_MAX || R > INT32_MAX)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "argmax", "V must be in 1 .. INT32_MAX and R a grid");
    argmax_kernel<<<(unsigned)R, AM_THREADS, 0, cuda_be_stream(be)>>>(out, x, V);
    KERNEL_CHECK();
}

/* ---------------------------------------------------------------------------------------------
 * row_lse: a CTA of LSE_LANES threads per (row, slice), thread l being lse_core.h's lane l: the
 * slice's maximum (any tree: a maximum of non-NaN values, +0 for ±0 after it), then each lane's
 * groups of 4 in id order, its terms summed in double, and the lanes folded by the same tree as
 * lse_slice_host (h = 128, 64, 32 through shared memory, then 16 .. 1 by shuffles: lane l adds lane
 * l + h each time). Every add, the float difference and (WT: the temperature sums, T = temp[r] > 0)
 * the quotient by T are explicitly rounded (no contraction). */
__device__ __forceinline__ double lse_term(float v, float m) {
    return v == __int_as_float((int)0xff800000u) ? 0.0 : (double)ds_expf(__fsub_rn(v, m));
}

/* lse_wterm_host's term: NaN and -inf add 0 */
__device__ __forceinline__ double lse_wterm(float v, float m, float T) {
    return v > __int_as_float((int)0xff800000u) ? (double)ds_expf(__fdiv_rn(__fsub_rn(v, m), T)) : 0.0;
}

/* Lane l's sum of its groups of the slice s[0..n) (ng groups), in id order: the log-probability's
 * terms, or (W) the temperature sum's at T. */
template <bool W>
__device__ __forceinline__ double lse_lane_sum(const float *__restrict__ s, int64_t n, int64_t ng, int l, bool v4, float m,
                                               float T) {
    double acc = 0.0;
    for (int64_t g = l; g < ng; g += LSE_LANES) {
        const int64_t i = g * LSE_GROUP;
        if (v4 && i + 4 <= n) {
            const float4 f = __ldcs(reinterpret_cast<const float4 *>(s + i));
            const float e[4] = {f.x, f.y, f.z, f.w};
#pragma unroll
            for (int u = 0; u < 4; u++) acc = __dadd_rn(acc, W ? lse_wterm(e[u], m, T) : lse_term(e[u], m));
        } else {
            for (int64_t k = i; k < n && k < i + LSE_GROUP; k++)
                acc = __dadd_rn(acc, W ? lse_wterm(s[k], m, T) : lse_term(s[k], m));
        }
    }
    return acc;
}

template <bool WT>
__global__ void __launch_bounds__(LSE_LANES) row_lse_kernel(struct be_lse_part *__restrict__ out,
                                                           const float *__restrict__ x, int64_t V, int64_t ns,
                                                           int64_t n, const int32_t *__restrict__ target,
                                                           const float *__restrict__ temp) {
    __shared__ double sacc[LSE_LANES];
    __shared__ float smax[LSE_LANES / 32];
    const int64_t q = blockIdx.x, r = q / ns, j = q % ns;
    const float *s = x + r * V + j * n;
    const int l = threadIdx.x, lane = l & 31, warp = l >> 5;
    const int64_t ng = (n + LSE_GROUP - 1) / LSE_GROUP; /* groups; the last may be short */
    const bool v4 = ((uintptr_t)s & 15) == 0;
    float m = __int_as_float((int)0xff800000u);
    for (int64_t g = l; g < ng; g += LSE_LANES) {
        const int64_t i = g * LSE_GROUP;
        if (v4 && i + 4 <= n) {
            const float4 f = *reinterpret_cast<const float4 *>(s + i);
            m = f.x > m ? f.x : m, m = f.y > m ? f.y : m, m = f.z > m ? f.z : m, m = f.w > m ? f.w : m;
        } else {
            for (int64_t k = i; k < n && k < i + LSE_GROUP; k++) m = s[k] > m ? s[k] : m;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) smax[warp] = m;
    __syncthreads();
    m = smax[0];
#pragma unroll
    for (int w = 1; w < LSE_LANES / 32; w++) m = fmaxf(m, smax[w]);
    m = __fadd_rn(m, 0.0f);
    const float T = WT ? temp[r] : 0.0f;
    double acc = WT && T > 0.0f ? lse_lane_sum<true>(s, n, ng, l, v4, m, T) /* CTA-uniform */
                                : lse_lane_sum<false>(s, n, ng, l, v4, m, T);
    sacc[l] = acc;
    __syncthreads();
#pragma unroll
    for (int h = LSE_LANES / 2; h >= 32; h >>= 1) {
        if (l < h) sacc[l] = __dadd_rn(sacc[l], sacc[l + h]);
        __syncthreads();
    }
    if (warp == 0) {
        acc = sacc[l];
#pragma unroll
        for (int h = 16; h > 0; h >>= 1) acc = __dadd_rn(acc, __shfl_down_sync(0xffffffffu, acc, h));
        if (l == 0) {
            const int64_t c = target ? target[r] : -1;
            if (acc != acc) acc = __longlong_as_double((long long)LSE_NAN_BITS);
            out[q] = (struct be_lse_part){.s = acc, .m = m, .t = c >= j * n && c < (j + 1) * n ? x[r * V + c] : 0.0f};
        }
    }
}

void cuda_op_row_lse(struct backend *be, struct be_lse_part *out, const float *x, int64_t R, int64_t V, int64_t ns,
                     const int32_t *target, const float *temp) {
    if (R <= 0) return;
    if (ns < 1 || V < 1 || V % ns || R * ns > INT32_MAX)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "row_lse", "ns must divide V and R * ns fit a grid");
    if (temp)
        row_lse_kernel<true><<<(unsigned)(R * ns), LSE_LANES, 0, cuda_be_stream(be)>>>(out, x, V, ns, V / ns, target, temp);
    else
        row_lse_kernel<false><<<(unsigned)(R * ns), LSE_LANES, 0, cuda_be_stream(be)>>>(out, x, V, ns, V / ns, target, temp);
    KERNEL_CHECK();
}

/* ---------------------------------------------------------------------------------------------
 * row_topk: a CTA per row. Every entry but NaN has a unique 64-bit key, draw_key(v) above its
 * column, whose unsigned order is the draw order (kernels/draw_order.h); the k-th smallest key is
 * found by a radix select (8-bit digits: the four of draw_key, then the column's bits 23..0, each
 * a shared histogram of the entries that match the digits found so far and a warp's scan of it),
 * the entries at or below it gathered (k of them, or every number where the row has fewer) and
 * sorted by a bitonic sort in shared memory. Comparisons, counts and moves only: the CPU's list
 * exactly, whatever the order the threads meet the entries in. */
#define TK_THREADS 512

__device__ __forceinline__ unsigned long long tk_key(float v, int64_t i) {
    return (unsigned long long)draw_key(v) << 32 | (unsigned long long)i;
}

__global__ void __launch_bounds__(TK_THREADS) row_topk_kernel(struct be_topk_entry *__restrict__ out,
                                                             const float *__restrict__ x, int64_t V, int k) {
    __shared__ unsigned int hist[256];
    __shared__ unsigned long long sel[BE_TOPK_MAX];
    __shared__ unsigned long long s_prefix;
    __shared__ unsigned int s_rank, s_n, s_sel; /* s_n: the row's numbers; s_sel: entries gathered */
    const float *row = x + (int64_t)blockIdx.x * V;
    const int tid = threadIdx.x, lane = tid & 31;
    unsigned int cnt = 0; /* the row's numbers */
    for (int64_t i = tid; i < V; i += TK_THREADS) cnt += row[i] == row[i];
    if (tid == 0) s_n = 0, s_sel = 0;
    __syncthreads(); /* s_n, s_sel */
    atomicAdd(&s_n, cnt);
    __syncthreads();
    const unsigned int n_num = s_n;
    unsigned long long kth = ~0ull; /* every number when the row has no more than k */
    if (n_num > (unsigned int)k) {
        unsigned long long prefix = 0, hmask = 0;
        unsigned int rank = (unsigned int)k; /* the rank-th smallest key among those matching prefix */
        for (int d = 0; d < 7; d++) {
            const int sh = d < 4 ? 56 - 8 * d : 48 - 8 * d; /* 56, 48, 40, 32, then 16, 8, 0 */
            for (int b = tid; b < 256; b += TK_THREADS) hist[b] = 0;
            __syncthreads();
            for (int64_t i = tid; i < V; i += TK_THREADS) {
                const float v = row[i];
                if (v != v) continue;
                const unsigned long long key = tk_key(v, i);
                if ((key & hmask) == prefix) atomicAdd(&hist[(key >> sh) & 255u], 1u);
            }
            __syncthreads();
            if (tid < 32) { /* lane l holds bins 8l..8l+7; the first bin where the running count reaches rank */
                unsigned int c[8], s = 0;
#pragma unroll
                for (int j = 0; j < 8; j++) c[j] = hist[8 * lane + j], s += c[j];
                unsigned int inc = s;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const unsigned int t = __shfl_up_sync(0xffffffffu, inc, o);
                    if (lane >= o) inc += t;
                }
                const unsigned int before = inc - s;
                const unsigned int hit = __ballot_sync(0xffffffffu, before < rank && rank <= inc);
                if (lane == __ffs(hit) - 1) {
                    unsigned int cum = before;
                    int b = 0;
                    while (cum + c[b] < rank) cum += c[b++];
                    s_prefix = prefix | (unsigned long long)(8 * lane + b) << sh;
                    s_rank = rank - cum;
                }
            }
            __syncthreads();
            prefix = s_prefix, rank = s_rank;
            hmask |= 255ull << sh;
            __syncthreads(); /* hist and s_prefix reused */
        }
        kth = prefix;
    }
    for (int64_t i = tid; i < V; i += TK_THREADS) {
        const float v = row[i];
        if (v != v) continue;
        const unsigned long long key = tk_key(v, i);
        if (key <= kth) sel[atomicAdd(&s_sel, 1u)] = key;
    }
    __syncthreads();
    const int n = (int)s_sel; /* min(k, n_num) */
    int P = 1;
    while (P < n) P <<= 1;
    for (int i = n + tid; i < P; i += TK_THREADS) sel[i] = ~0ull;
    __syncthreads();
    for (int size = 2; size <= P; size <<= 1)
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int i = tid; i < P / 2; i += TK_THREADS) { /* pair (a, b), a < b, ascending in blocks of size with a's bit clear */
                const int a = 2 * i - (i & (stride - 1)), b = a + stride;
                const bool up = (a & size) == 0;
                const unsigned long long ka = sel[a], kb = sel[b];
                if ((ka > kb) == up) sel[a] = kb, sel[b] = ka;
            }
            __syncthreads();
        }
    struct be_topk_entry *o = out + (int64_t)blockIdx.x * k;
    for (int j = tid; j < k; j += TK_THREADS) {
        if (j < n) {
            const int32_t c = (int32_t)(sel[j] & 0xffffffffu);
            o[j] = (struct be_topk_entry){row[c], c};
        } else {
            o[j] = (struct be_topk_entry){__int_as_float(0x7fc00000), -1};
        }
    }
}

void cuda_op_row_topk(struct backend *be, struct be_topk_entry *out, const float *x, int64_t R, int64_t V, int64_t k) {
    if (R <= 0) return;
    if (k < 1 || k > BE_TOPK_MAX || V < 1 || V >= (1 << 24) || R > INT32_MAX)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "row_topk", "k must be in 1..BE_TOPK_MAX, V below 2^24 and R a grid");
    row_topk_kernel<<<(unsigned)R, TK_THREADS, 0, cuda_be_stream(be)>>>(out, x, V, (int)k);
    KERNEL_CHECK();
}
