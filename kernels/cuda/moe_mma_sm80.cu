/* Routed FP4 experts on the tensor cores (SM80 mma.sync), the moe_experts op's default path on the
 * GPU (--exact-linears takes the exact FP4 GEMV kernels of cuda_moe.cu instead).
 *
 * What a pair (t, slot) routed to local expert e gets, bit for bit: the same as computing expert e
 * with the tensor-core linears (linear_mma_sm80.cu) on token t alone — g = linear(x_t, w1),
 * u = linear(x_t, w3), h = bf16(wt · silu(min(g, limit)) · clamp(u)), y = linear(h, w2) — which the
 * op test checks against the composition of the GPU's own ops, bit for bit. The kernels share the
 * linears' primitives (mma_sm80.cuh) and their order contract: activations quantized per 32 with
 * the reference's arithmetic and stored k-permuted, per k-block P'_b = mma(mma(0, first 16),
 * second 16) over exact bf16 operands, acc = fma(P'_b, s_w[b], acc) in block order within fixed
 * k-chunks of 1,024, the chunks' fp32 partials added in chunk order, then one bf16 rounding. None
 * of it depends on which other pairs share the step, so the path is batch invariant.
 *
 * Two paths, by the call's size (moe_mma.h): calls of more than MOE_MMA_DECODE_T tokens (prefill
 * chunks) take moe_wide_kernel (below: tiles of up to 64 pairs, each CTA over the whole of k,
 * the chunk partials added in registers, SwiGLU and h's quantization in the gate/up epilogue).
 * A decode-sized call, per pass of at most moe_mma_pass_tokens tokens (moe_mma.h bounds the
 * partials' memory):
 *  1. moe_begin_kernel: its CTA 0 buckets the pass's local pairs by expert, tiles of <= 8 pairs
 *     (one n8 mma tile; moe_plan_body), the other CTAs quantize x (mma_act_quant_body);
 *  2. moe_mma_kernel<2, W> (gate/up): CTA = (one tile) x (16 W rows of w1 or of w3) x (one
 *     k-chunk), W = MOE_MMA_CTA_WARPS = 4;
 *     the CTA finds its tile with one load of the plan's tile table (and takes tiles gridDim.z
 *     apart in turn where the grid's tile slots are capped: MOE_MMA_Z_WAVES), the tile's x rows
 *     are gathered by token into shared memory (rows past the tile's pairs are zeros, never
 *     loaded), the weight rows stream through a 3- or 4-stage cp.async pipeline (4 k-blocks a
 *     stage) and are decoded in registers, the chunk's weight scales sit decoded in shared memory;
 *     each warp is one m16 tile of weight rows (the mma's A operand) against the tile's pairs (B,
 *     n8), so a lane decodes 16 weights a k-block for one ldmatrix and two mma; fp32 partials
 *     [chunk][list position][2I];
 *  3. moe_gateup_finish_kernel: chunk sums, bf16 g and u, the SwiGLU with the routing weight, bf16
 *     h, its act quant in the k-permuted layout [list position][I];
 *  4. moe_mma_kernel<1> (down) over h the same way, partials [chunk][list position][Dout];
 *  5. moe_down_finish_kernel: chunk sums -> y[t, slot] bf16. Slots routed elsewhere stay untouched.
 * The grids cover an upper bound of the tile count (no host synchronization); CTAs past the plan's
 * tiles exit at once. They cost little: at batch 8 the gate/up grid is 72 x 5 x 48 CTAs for ~6
 * tiles, yet persistent CTAs (as many as the SMs hold, claiming (row tile, chunk, tile) units from
 * a counter the plan kernel zeroed, in grid order) took 64.3 -> 61.7 µs for it and 37.1 -> 41.4
 * µs for the down kernel (Nsight Compute, H200), the step unchanged (bench_step b1/8/64/256,
 * alternated: 5.84, 5.88 / 8.88, 8.89 / 18.70, 18.75 / 31.72, 31.80 -> 5.88, 5.88 / 8.85, 8.90
 * / 18.61, 18.79 / 31.18, 31.46 ms): not kept.
 *
 * Why tensor cores here: the exact kernels spend ~5 instructions per FP4 weight (the e2m1 decode
 * feeds one FMA per pair), so they were instruction bound at every batch; here a weight is decoded
 * once per tile of pairs (up to 8 now, 16 before 66a30d2) into bf16 pairs that feed mma.sync. A
 * decode step has 1-4 pairs per expert, though, and then this kernel is instruction bound as well
 * (Nsight Compute on the H200, batch 64 gate/up, before the branch-free fold: issue slots 71-82 %
 * busy, 290 M warp instructions, DRAM 16 %); the per-weight decode is 21 instructions per 8
 * weights, the stage body 165 SASS
 * instructions for 4 k-blocks (sm_90 JIT of this PTX). Later (Nsight Compute source counters, batch
 * 64 gate/up: 210 M warp instructions, 67 per k-block and warp of which the weight decode is 21 and
 * the mma 2): each thread's activation copy address is set once instead of a loop with divisions
 * per stage, and the fold has no select for blocks past nb (their table entries are 0 already):
 * 210.1 M -> 184.3 M instructions and 419 -> 368 µs for gate/up, 113.0 M -> 100.6 M and 230 -> 204
 * µs for down (the first layer's, clocks locked by Nsight); bench_step decode ms at batch 64, two
 * runs alternated, 16.67, 16.75 -> 15.81, 15.76 with this and the 17-64-row linear change of the
 * same commit range (that one alone, another run: 16.81, 16.87 -> 16.69, 16.63). Tried next and
 * not kept: 4 warps of two n8 tiles each (one A fragment load per block for both, the stage's
 * bookkeeping halved; 117 registers, so 16 warps an SM instead of 32): 17 % fewer instructions at
 * batch 64 (186.5 M -> 154.4 M) but the same time (367 -> 360 µs gate/up, 203 -> 209 down), and
 * slower at batch 8 (74.3 -> 83.7 µs, 44.3 -> 49.2), occupancy 47 -> 24 %; bench_step decode batch
 * 8 / 64, two runs alternated: 7.11, 7.10 / 15.84, 15.91 -> 7.39, 7.42 / 15.71, 15.78 ms.
 * Then the e2m1 decode by prmt table lookups (e2m1x8_to_bf16x2, mma_sm80.cuh; no HFMA2): gate/up
 * 184.3 M -> 179.6 M instructions, 368.6 -> 347.8 µs, down 100.6 M -> 97.9 M, 201.9 -> 192.4 µs.
 * Then the FP4 weights in the device layout (fp4_layout.h; shifts and masks, the multiply back):
 * on the H100 at batch 64 (Nsight, 66a30d2 -> 3812858) gate/up 297 -> 262 µs, down 165 -> 144 µs,
 * the integer pipe 75 -> 69 % busy, issue 0.70 -> 0.78 a scheduler: now close to issue-bound.
 * Measured per decode step of one rank (20 layers), before these: 10.0 ms at batch 64 (12.0 for
 * the exact kernels), 15.9 ms at batch 256 (29).
 * Not the limiter either: the order contract's fold. The prefill kernel below with each row's
 * scale multiplied into its decoded weights (exact: powers of two) and the mma chained through acc
 * took 5.5 % less at 2,048 tokens (bench_moe, H100: 0.98 -> 0.93 ms), 1 % at 512: not worth a new
 * k order in every expert and linear path (results/PERFORMANCE_HISTORY.md). */
#include "cuda_internal.h"
#include "moe_common.cuh"
#include "moe_mma.h"
#include "mma_sm80.cuh"

namespace {

constexpr int XP = MOE_MMA_TILE;      /* pairs per tile: one n8 tile, the mma's B operand */
constexpr int XKB = 4;                /* k-blocks per cp.async stage */
constexpr int XB_LD = XKB * 16;       /* FP4 weight row of a stage, unpadded: its 16-byte k-block c sits at
                                       * position c ^ ((row >> 1) & 3), so the lanes' 4-byte reads of 8
                                       * rows hit distinct banks (xb_pos) */
constexpr int XA_LD = XKB * 64 + 16;  /* activation row of a stage, padded: ldmatrix rows on distinct banks */
constexpr int XA_BYTES = XP * XA_LD;

/* The CTA of W warps, each one m16 tile of weight rows (the A operand); the launches take
 * W = MOE_MMA_CTA_WARPS (moe_mma.h). */
template <int W> struct xtile {
    static constexpr int BN = 16 * W;     /* weight rows per CTA */
    static constexpr int THREADS = 32 * W;
    static constexpr int MINB = 32 / W;   /* CTAs per SM asked of the register allocator: 64 registers */
    static constexpr int STAGE = XA_BYTES + BN * XB_LD;
    static constexpr int S_LD = BN + 2;   /* the scale table's row in bf16 halfwords: the fill's stores (32
                                           * blocks of one row per warp) on distinct banks, a lane's pair
                                           * 4-byte aligned */
    static constexpr int S_BYTES = KCH * S_LD * 2; /* the chunk's weight scales as bf16 [KCH][S_LD] */
    static constexpr int R_BYTES = BN * KCH;       /* a chunk's raw scale bytes [BN][KCH] */
    static constexpr int FIT = (48 * 1024 - S_BYTES - R_BYTES - 256) / STAGE;
    static constexpr int STAGES = FIT > 4 ? 4 : FIT;
    static_assert(STAGES >= 3 && STAGE % 64 == 0 && XA_BYTES % 64 == 0 && BN * XKB == 2 * THREADS && XB_LD == 64 &&
                      R_BYTES / 4 == 4 * THREADS && XP * XKB * 4 <= THREADS && KCH == 32,
                  "expert tile: two weight chunks, four scale words, at most one activation chunk a thread per "
                  "stage; 64-byte swizzled weight rows");
};

/* Byte offset in a stage's weight rows of k-block c of CTA row r (the swizzle above). */
__device__ __forceinline__ int xb_pos(int r, int c) { return r * XB_LD + ((c ^ ((r >> 1) & 3)) << 4); }

/* Column of CTA row r in the scale table: the rows g and g + 8 of a warp's 16 side by side, so a
 * lane reads its two rows' scales as one 32-bit word. */
__device__ __forceinline__ int xs_col(int r) { return (r & ~15) | ((r & 7) << 1) | ((r >> 3) & 1); }

/* e8m0f's value as bf16 bits: its fp32 has no bits in the low half (2^(b-127), 2^-127, NaN, 0). */
__device__ __forceinline__ uint16_t e8m0h(uint32_t b) { return (uint16_t)(__float_as_uint(e8m0f(b)) >> 16); }

/* Activation rows r0 .. r1 - 1 of every stage's tile (stride LD bytes from the stage's start)
 * zeroed, in 16-byte words by the CTA's NT threads: the rows of a tile past its pairs, which no
 * stage loads. */
template <int NST, int STAGE, int LD, int NT>
__device__ __forceinline__ void zero_tile_rows(uint8_t *smem, int r0, int r1, int tid) {
    const int nz = r1 - r0;
    for (int q = tid; q < NST * nz * (LD / 16); q += NT) {
        const int st = q / (nz * (LD / 16)), rem = q % (nz * (LD / 16));
        const int r = r0 + rem / (LD / 16), c = rem % (LD / 16);
        *reinterpret_cast<uint4 *>(smem + st * STAGE + r * LD + c * 16) = make_uint4(0, 0, 0, 0);
    }
}

/* One CTA: tiles blockIdx.z, blockIdx.z + gridDim.z, ... of the experts [c0, c0 + cn) (past the
 * last: exit), weight rows n0 .. n0 + 16 W - 1 of matrix m (grid x = NM matrices x ceil(N / 16 W)
 * row tiles; gate/up: m = 0 w1, 1 w3), k-chunk blockIdx.y through one cp.async pipeline (its
 * sum from +0, its partial stored at its end). a: k-permuted quantized activations, K values per
 * row; the tile's pair j is a's row list[first + j] / a_div (gate/up: the pair's token) or
 * first + j (down, a_div = 0: h is stored by list position). part [nch][mcap][NM N] fp32, row = list position.
 * Warp w computes rows n0 + 16 w .. + 15 against the tile's pairs as mma(A = the 16 weight rows,
 * B = the 8 pair columns): a lane decodes 4 bytes (8 weights) of each of its rows g and g + 8 a
 * k-block, each FP4 weight once per tile, and one ldmatrix.x4 gives both mma their B fragments.
 * Output (row, pair) sees the products of the activations-as-A form in the same k order, and
 * the same fold, so the bits are those of the linears (the op test's composition).
 * The prologue is a chain of dependent loads (the chunk's tile range, the tile's entry, the list)
 * before the activations can be fetched, so the weights' first stages, which need only the
 * expert, are issued before the list is read. The chunk's raw scale bytes arrive in s_raw with
 * the loads of the first stage (by cp.async where the scale rows are 4-byte words, else by plain
 * loads) and are decoded into the table at that stage.
 * One chunk a CTA at every batch (moe_mma.h, MOE_MMA_CTA_WARPS: measured against CTAs that ran
 * all of k). */
template <int NM, int W>
__global__ void __launch_bounds__(xtile<W>::THREADS, xtile<W>::MINB)
    moe_mma_kernel(moe_wtab tab, int c0, int cn, const int32_t *__restrict__ plan, const int2 *__restrict__ tiles,
                   int n_local, const __nv_bfloat16 *__restrict__ a, int64_t a_div, int64_t N, int64_t K, int64_t ld,
                   int64_t s_ld, float *__restrict__ part, int64_t mcap) {
    constexpr int XBN = xtile<W>::BN, XTHREADS = xtile<W>::THREADS, XSTAGE = xtile<W>::STAGE;
    constexpr int XSTAGES = xtile<W>::STAGES, XS_LD = xtile<W>::S_LD, XR_BYTES = xtile<W>::R_BYTES;
    __shared__ __align__(128) uint8_t smem[XSTAGES * XSTAGE];
    __shared__ __align__(16) uint16_t s_sm[KCH][XS_LD]; /* decoded once per chunk, bf16 bits, columns xs_col */
    __shared__ __align__(16) uint8_t s_raw[XR_BYTES];   /* a chunk's raw scales [XBN][KCH] */
    __shared__ int64_t srow[XP]; /* byte offset of each tile pair's row in a */
    __shared__ const uint8_t *s_cta;
    const int64_t jfirst = plan[c0], jend = plan[c0 + cn];
    /* tiles blockIdx.z, + gridDim.z, ...: the grid's z is the tile bound capped (MOE_MMA_Z_WAVES,
     * moe_mma_launch), so the CTAs of slots the plan leaves empty, which only read the plan and
     * exit, do not outnumber the working ones */
    for (int64_t z = blockIdx.z;; z += gridDim.z) {
        const int64_t j = jfirst + z;
        if (j >= jend) return; /* uniform per CTA, before any barrier */
        if (z != blockIdx.z) __syncthreads(); /* the tile before is read out of shared memory by all */
        const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
        const int g = lane >> 2, t = lane & 3;
        const int2 te = tiles[j];
        const int le = te.x & 0xffff, np = te.x >> 16;
        const int64_t first = te.y;
        const int64_t ntm = (N + XBN - 1) / XBN;
        const int m = (int)(blockIdx.x / ntm);
        const int64_t n0 = (int64_t)(blockIdx.x % ntm) * XBN;
        const uint8_t *const w = tab.w[le - c0][m], *const s = tab.s[le - c0][m];
        const int ci0 = (int)blockIdx.y, kb0 = ci0 * KCH, nbt = (int)(K / 32);
        const int nb = nbt - kb0 < KCH ? nbt - kb0 : KCH, nst = (nb + XKB - 1) / XKB; /* blocks, stages */
        const uint8_t *const abase = reinterpret_cast<const uint8_t *>(a);
        const uint32_t sbase = smem_addr(smem);

        /* stage st <- k-blocks [XKB i, XKB i + XKB) of the chunk: the weights (16-byte k-block cb of
         * rows rb and rb + XBN / 2 per thread) and the tile's activation rows; blocks past nb and weight rows
         * past N are zero-filled */
        const int rb = tid / XKB, cb = tid % XKB;
        const bool ok0 = n0 + rb < N, ok1 = n0 + rb + XBN / 2 < N;
        const uint8_t *const wsrc0 = w + (ok0 ? (n0 + rb) * ld + (int64_t)(kb0 + cb) * 16 : 0);
        const uint8_t *const wsrc1 = w + (ok1 ? (n0 + rb + XBN / 2) * ld + (int64_t)(kb0 + cb) * 16 : 0);
        const uint32_t bdst = sbase + (uint32_t)(XA_BYTES + xb_pos(rb, cb)); /* row rb + XBN / 2: the same swizzle */
        auto load_b = [&](int st, int i) {
            const bool v = i * XKB + cb < nb;
            cp_async16(bdst + (uint32_t)(st * XSTAGE), v && ok0 ? wsrc0 + i * XKB * 16 : w, v && ok0);
            cp_async16(bdst + (uint32_t)(st * XSTAGE + XBN / 2 * XB_LD), v && ok1 ? wsrc1 + i * XKB * 16 : w, v && ok1);
        };
        /* the chunk's raw scale bytes, 4 per copy: thread tid takes word tid % 8 of rows
         * tid / 8 + q XTHREADS / 8, q = 0..3 (smem bytes 4 tid + 4 q XTHREADS); words past the CTA's
         * blocks or rows past N are not fetched (their scales decode as 0 below). The CTA's scale
         * base is read from shared memory when needed (kept in registers through the main loop it
         * spilled under the SM90 compiler). */
        const int sw = 4 * (tid % 8);
        const int nrows = N - n0 < XBN ? (int)(N - n0) : XBN; /* the CTA's weight rows inside N */
        if (tid == 0) s_cta = s + n0 * s_ld + kb0;
        /* where the scale rows are whole 4-byte words (the release's s_ld 160 / 72, an aligned base),
         * by cp.async with a stage's group; otherwise by plain byte loads into the same s_raw (the
         * stores are ordered before the decode by the stage's barrier). Either way the chunk's
         * first stage decodes s_raw into the table. */
        const bool s_cp = (s_ld & 3) == 0 && (reinterpret_cast<uintptr_t>(s) & 3u) == 0;
        auto load_s = [&]() {
            if (s_cp) {
                const uint8_t *const s_src = s_cta + (tid / 8) * s_ld + sw;
                const uint32_t s_dst = smem_addr(s_raw) + 4 * threadIdx.x;
                const bool vb = sw < nb;
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const bool v = vb && tid / 8 + q * (XTHREADS / 8) < nrows;
                    cp_async4(s_dst + 4 * XTHREADS * q, v ? s_src + q * (XTHREADS / 8) * s_ld : s_cta, v);
                }
            } else {
#pragma unroll 1
                for (int q = tid; q < KCH * XBN; q += XTHREADS) {
                    const int r = q / KCH, b = q % KCH;
                    if (r < nrows && b < nb) s_raw[q] = __ldg(s_cta + r * s_ld + b);
                }
            }
        };
        /* the tile's activation rows: thread tid < 128 copies 16-byte chunk ac of pair row ar of every
         * stage (a tile's np <= 8 rows of XKB blocks are at most one chunk a thread); a_src is set once
         * srow is */
        const int ar = tid / (XKB * 4), ac = tid % (XKB * 4);
        const bool a_live = ar < np;
        const uint8_t *a_src = abase;
        const uint32_t a_dst = sbase + (uint32_t)(ar * XA_LD + ac * 16);
        auto load_a = [&](int st, int i) {
            if (!a_live) return;
            const bool v = i * XKB + ac / 4 < nb;
            cp_async16(a_dst + (uint32_t)(st * XSTAGE), v ? a_src + (int64_t)i * (XKB * 64) : abase, v);
        };
#pragma unroll
        for (int st = 0; st < XSTAGES - 1; st++)
            if (st < nst) load_b(st, st); /* in the first commit group below */
        if (tid < np) {
            const int64_t row = a_div ? (int64_t)plan[2 * (n_local + 1) + first + tid] / a_div : first + tid;
            srow[tid] = row * K * 2 + (int64_t)kb0 * 64;
        }
        /* pair rows past np: zeros in every stage (they are never loaded; their outputs are not stored) */
        zero_tile_rows<XSTAGES, XSTAGE, XA_LD, XTHREADS>(smem, np, XP, tid);
        __syncthreads(); /* srow */
        if (a_live) a_src = abase + srow[ar] + ac * 16;
        /* B fragments by ldmatrix.x4: lane L gives row L % 8 (a pair) of matrix L / 8 (the k-block's
         * 16-byte quarter), so lane (g, t) receives words t, 4 + t, 8 + t, 12 + t of pair g: the
         * k-permuted k values 8t .. 8t + 7, in the order of its two rows' decoded weights */
        const uint32_t ldB = (uint32_t)((lane & 7) * XA_LD + (lane >> 3) * 16);
        const int wr = warp * 16 + g; /* the lane's rows wr and wr + 8, relative to n0 */
        const int rdB = XA_BYTES + wr * XB_LD + t * 4, swz = (g >> 1) & 3;
        const uint32_t *const srow_s = reinterpret_cast<const uint32_t *>(&s_sm[0][warp * 16 + 2 * g]);
        constexpr int FRS = XTHREADS / KCH; /* the scale fill's row step (below) */
        static_assert((FRS & (FRS - 1)) == 0 && XBN % FRS == 0, "scale fill: a power-of-two row step");

        /* the lane's partial of its first row and pair in the CTA's chunk */
        float *const pbase = part + ((int64_t)ci0 * mcap + first + 2 * t) * (NM * N) + (int64_t)m * N + n0 + wr;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}; /* (wr, 2t), (wr, 2t + 1), (wr + 8, 2t), (wr + 8, 2t + 1) */
        /* the chunk's raw scales come with the first group and decode at the first stage; plain
         * loads after the table were 16 dependent memory latencies in front of every CTA's first
         * stage (b3c985d) */
        if (s_cp) load_s();
#pragma unroll
        for (int st = 0; st < XSTAGES - 1; st++) {
            if (st < nst) load_a(st, st);
            cp_async_commit();
        }
        if (!s_cp) load_s(); /* while the first stages are in flight */
        for (int i = 0; i < nst; i++) {
            cp_async_wait<XSTAGES - 2>();
            __syncthreads();
            if (i + XSTAGES - 1 < nst) {
                const int in = i + XSTAGES - 1;
                load_b(in % XSTAGES, in);
                load_a(in % XSTAGES, in);
            }
            cp_async_commit();
            if (i == 0) {
                /* the first stage: the barrier above saw the chunk's raw scales (this stage's group,
                 * or plain stores before the barrier). Thread tid decodes block fb of rows fr0 + j·FRS:
                 * xs_col permutes the bits of a row index and fr0 < FRS, a power of two, so its column
                 * is xs_col(fr0) | xs_col(j·FRS), a constant offset per j (a loop over q = tid +
                 * j·XTHREADS with its divisions and xs_col per entry was ~20 % of the kernel's integer
                 * instructions) */
                const int fb = tid % KCH, fr0 = tid / KCH;
                uint16_t *const s_fill = &s_sm[fb][xs_col(fr0)];
                const bool bok = fb < nb;
#pragma unroll 8
                for (int j = 0; j < XBN / FRS; j++) {
                    const int r = fr0 + j * FRS;
                    s_fill[xs_col(j * FRS)] = e8m0h(bok && r < nrows ? (uint32_t)s_raw[r * KCH + fb] : 0x100u);
                }
                __syncthreads();
            }
            const int st = i % XSTAGES;
            const uint32_t so = sbase + (uint32_t)(st * XSTAGE);
            const uint8_t *const sb = smem + st * XSTAGE + rdB;
            float p[XKB][4]; /* the stage's block products first, then the ordered fold */
#pragma unroll
            for (int jb = 0; jb < XKB; jb++) {
                const int cpos = (jb ^ swz) << 4;
                uint32_t lo[4], hi[4], b[4];
                e2m1x8_to_bf16x2(*reinterpret_cast<const uint32_t *>(sb + cpos), lo);
                e2m1x8_to_bf16x2(*reinterpret_cast<const uint32_t *>(sb + 8 * XB_LD + cpos), hi);
                ldmatrix_x4(b, so + ldB + (uint32_t)(jb * 64));
                mma_bf16(p[jb], lo[0], hi[0], lo[1], hi[1], b[0], b[1], 0.0f, 0.0f, 0.0f, 0.0f);
                mma_bf16(p[jb], lo[2], hi[2], lo[3], hi[3], b[2], b[3], p[jb][0], p[jb][1], p[jb][2], p[jb][3]);
            }
            /* no branch or select for a block past nb: it multiplied zero-filled tiles (p = 0), its
             * table entry is 0 (the fills decode 0x100 there), and acc + 0·0 = acc exactly (acc is
             * never -0: it starts at +0 and a sum is -0 only if both terms are) */
            const uint32_t *const sq = srow_s + ((i * XKB) % KCH) * (XS_LD / 2);
#pragma unroll
            for (int jb = 0; jb < XKB; jb++) {
                const uint32_t q = sq[jb * (XS_LD / 2)];
                const float s0 = __uint_as_float(q << 16), s1 = __uint_as_float(q & 0xffff0000u);
                acc[0] = __fmaf_rn(p[jb][0], s0, acc[0]);
                acc[1] = __fmaf_rn(p[jb][1], s0, acc[1]);
                acc[2] = __fmaf_rn(p[jb][2], s1, acc[2]);
                acc[3] = __fmaf_rn(p[jb][3], s1, acc[3]);
            }
        }
#pragma unroll
        for (int h = 0; h < 2; h++) { /* the chunk's partial */
            if (2 * t + h >= np) continue;
            float *pr = pbase + (int64_t)h * (NM * N);
            if (wr < nrows) pr[0] = acc[h];
            if (wr + 8 < nrows) pr[8] = acc[2 + h];
        }
        cp_async_wait<0>();
    }
}

/* The local pairs of the pass (off[n_local] of the plan). */
__device__ __forceinline__ int64_t moe_local_pairs(const int32_t *plan, int n_local) {
    return plan[n_local + 1 + n_local];
}

/* Gate/up -> quantized h: thread i2 takes 2 consecutive values of h of list position i2 / (I / 2)
 * (16 threads per 32-group, mma_quant2): g = bf16 of w1's chunk sum, u = bf16 of w3's,
 * h = bf16(wt · silu(min(g, limit)) · clamp(u)) (the exact kernels' and the CPU's formula), then
 * the act quant of h into qh [mcap, I] k-permuted. Positions past the local pairs compute on zeros
 * and store nothing (the 16 lanes of a group must all reach the shuffles). H200, Nsight at batch
 * 1, with 8 values per thread (4 threads per group): 9.9 µs a call, ~1,100 instructions a warp of
 * dependent chunk sums, SwiGLUs and quantizations. */
__global__ void __launch_bounds__(256)
    moe_gateup_finish_kernel(__nv_bfloat16 *__restrict__ qh, const float *__restrict__ part,
                             const int32_t *__restrict__ plan, int n_local, const float *__restrict__ wts, int64_t I,
                             int nch, int64_t mcap, float limit) {
    const int64_t i2 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, per = I / 2;
    const int64_t pos = i2 / per, i0 = (i2 % per) * 2;
    const bool ok = pos < moe_local_pairs(plan, n_local);
    float v0 = 0.0f, v1 = 0.0f;
    if (ok) {
        const float wt = __ldg(wts + plan[2 * (n_local + 1) + pos]);
        const float *pg = part + pos * 2 * I + i0; /* [nch][mcap][2][I] fp32 */
        const float2 h = mo_swiglu_parts(pg, pg + I, mcap * 2 * I, nch, limit, true, wt);
        v0 = h.x, v1 = h.y;
    }
    const uint32_t w = mma_quant2(v0, v1);
    if (ok) mma_store_perm2(reinterpret_cast<uint32_t *>(qh) + (i2 >> 4) * 16, (int)(i2 & 15), w);
}

/* Down -> y: y[list[pos], :] = bf16 of the chunk sums, for the local pairs. */
__global__ void moe_down_finish_kernel(__nv_bfloat16 *__restrict__ y, const float *__restrict__ part,
                                       const int32_t *__restrict__ plan, int n_local, int64_t Dout, int nch,
                                       int64_t mcap) {
    const int64_t count = moe_local_pairs(plan, n_local), total = count * Dout;
    const int32_t *list = plan + 2 * (n_local + 1);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t pos = i / Dout, col = i % Dout;
        y[(int64_t)list[pos] * Dout + col] = __float2bfloat16_rn(mma_fold_chunks(part + i, mcap * Dout, nch));
    }
}


/* ---------------------------------------------------------------------------------------------
 * The prefill path (calls of more than MOE_MMA_DECODE_T tokens): tiles of up to 64 pairs of one
 * expert, each CTA over the whole of k. A prefill pass has tens of pairs per expert, and the
 * decode kernel above would decode each FP4 weight once per 16 pairs and stream k-chunk partials
 * through memory (whose bound cut a pass to ~290 tokens, 4–5 local pairs per expert); here a warp
 * decodes its weights once for up to four m16 tiles and reuses each A fragment for two n8 tiles,
 * the k-chunks' partials are added in registers in chunk order (the same fp32 additions as the
 * finish kernels), and the epilogues write the quantized h (gate/up, SwiGLU fused) or y (down)
 * directly. Same bits as the decode path: the order contract fixes every addition.
 * CTA: 4 warps along n, each 16 weight rows (two n8 tiles) x the tile's m16 tiles in use; gate/up:
 * 32 columns of h, warps 0-1 on w1's rows and 2-3 on w3's (the epilogue meets them in shared
 * memory); down: 64 columns of y. */
constexpr int WP = MOE_WIDE_TILE;      /* pairs per tile */
constexpr int WMT = WP / 16;           /* m16 tiles per tile */
constexpr int WW = 4;                  /* warps per CTA */
constexpr int WNJ = 2;                 /* n8 tiles per warp */
constexpr int WBN = 8 * WNJ * WW;      /* weight rows per CTA */
constexpr int WTHREADS = 32 * WW;
constexpr int WMINB = 3;
constexpr int WKB = 2;                 /* k-blocks per cp.async stage (divides KCH: no stage straddles a chunk) */
constexpr int WB_LD = WKB * 16 + 16;   /* weight row of a stage, padded: the lanes' 4-byte reads on distinct banks */
constexpr int WA_LD = WKB * 64 + 16;   /* activation row of a stage, padded: ldmatrix rows on distinct banks */
constexpr int WA_BYTES = WP * WA_LD, WB_BYTES = WBN * WB_LD, WSTAGE = WA_BYTES + WB_BYTES;
constexpr int WSTAGES = 3;
constexpr int WS_LD = WBN + 2;         /* the chunk's decoded scales [KCH][WS_LD] fp32, as XS_LD */
constexpr int WEX_LD = 36;             /* the gate/up epilogue's u / h rows [WP][WEX_LD] fp32, in the stages */
static_assert(KCH % WKB == 0 && WBN * WKB == WTHREADS && WTHREADS == 2 * WBN && KCH == 32 && WSTAGE % 16 == 0 &&
                  WSTAGES * WSTAGE + KCH * WS_LD * 4 + WP * 16 <= 48 * 1024 && WP * WEX_LD * 4 <= WSTAGES * WSTAGE &&
                  WP % 32 == 0,
              "prefill expert tile");

/* a compile-time int for the prefill kernel's generic main loop */
template <int N> struct moe_ic { static constexpr int value = N; };

/* f(mt, nj, h) for each half of a warp's output fragments in the prefill tile: rows mt·16 + g + 8h
 * of the tile, columns nj·8 + 2t and + 1 of the warp's 16 (the epilogues' one walk). */
template <class F> __device__ __forceinline__ void wide_frag_halves(F &&f) {
#pragma unroll
    for (int mt = 0; mt < WMT; mt++)
#pragma unroll
        for (int nj = 0; nj < WNJ; nj++)
#pragma unroll
            for (int h = 0; h < 2; h++) f(mt, nj, h);
}

/* One CTA: tile blockIdx.z of the experts [c0, c0 + cn) (none: exit), output columns blockIdx.x
 * (gate/up NM = 2: h columns n0 .. n0 + 31, n0 = 32 x; down NM = 1: y columns n0 .. n0 + 63, n0 =
 * 64 x). a: k-permuted quantized activations, K values per row, tile row r = a's row list[first +
 * r] / a_div (gate/up: the pair's token) or first + r (down). Gate/up writes the quantized h row
 * (list position) of qh [mcap, N] k-permuted (N % 32 == 0) with the routing weight wts[list entry];
 * down writes y[list entry, :] bf16 [., N]. */
template <int NM>
__global__ void __launch_bounds__(WTHREADS, WMINB)
    moe_wide_kernel(moe_wtab tab, int c0, int cn, const int32_t *__restrict__ plan, const int2 *__restrict__ tiles,
                    int n_local, const __nv_bfloat16 *__restrict__ a, int64_t a_div, int64_t N, int64_t K, int64_t ld,
                    int64_t s_ld, __nv_bfloat16 *__restrict__ out, const float *__restrict__ wts, float limit) {
    __shared__ __align__(16) uint8_t smem[WSTAGES * WSTAGE];
    __shared__ __align__(16) float s_sm[KCH][WS_LD];
    __shared__ int64_t srow[WP]; /* byte offset of each tile row in a */
    __shared__ int32_t sdst[WP]; /* each tile row's list entry (its slot in the pass) */
    const int64_t j = (int64_t)plan[c0] + blockIdx.z;
    if (j >= plan[c0 + cn]) return; /* uniform per CTA, before any barrier */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int2 te = tiles[j];
    const int le = te.x & 0xffff, np = te.x >> 16, nmt = (np + 15) / 16;
    const int64_t first = te.y;
    const int64_t n0 = (int64_t)blockIdx.x * (WBN / NM);
    const int32_t *const list = plan + 2 * (n_local + 1);
    const int nbt = (int)(K / 32), nst = (nbt + WKB - 1) / WKB, nch = (nbt + KCH - 1) / KCH;
    const uint8_t *const abase = reinterpret_cast<const uint8_t *>(a);
    const uint32_t sbase = smem_addr(smem);

    /* CTA weight row r: matrix r / 32 (gate/up) at row n0 + r % 32, or w2's row n0 + r */
    auto wsrc_of = [&](int r, const uint8_t *const *wm, int64_t *row) {
        const int m = NM == 2 ? r / 32 : 0;
        *row = NM == 2 ? n0 + r % 32 : n0 + r;
        return wm[m];
    };
    const int rb = tid / WKB, cb = tid % WKB;
    int64_t wrow;
    const uint8_t *const w = wsrc_of(rb, tab.w[le - c0], &wrow);
    const bool row_ok = wrow < N;
    const uint8_t *const wsrc = w + (row_ok ? wrow * ld + (int64_t)cb * 16 : 0);
    const uint32_t bdst = sbase + (uint32_t)(WA_BYTES + rb * WB_LD + cb * 16);
    auto load_b = [&](int st, int i) {
        const bool v = row_ok && i * WKB + cb < nbt;
        cp_async16(bdst + (uint32_t)(st * WSTAGE), v ? wsrc + (int64_t)i * WKB * 16 : w, v);
    };
    /* activation copies: thread tid owns 16-byte chunk ac = tid % (4 WKB) of the stage's rows
     * tid / (4 WKB) + AQ_RS q (q < na, the rows in the tile), one source pointer per row set once
     * after srow is known (a loop over the stage's chunks with the row lookups in it was ~25 integer
     * instructions a copy, a quarter of a stage's instructions at 32 pairs) */
    constexpr int AQ_RS = WTHREADS / (WKB * 4), AQ_N = WP / AQ_RS;
    static_assert(WTHREADS % (WKB * 4) == 0 && WP % AQ_RS == 0, "activation copy layout");
    const int ac = tid % (WKB * 4), ar = tid / (WKB * 4);
    const int na = ar < np ? (np - 1 - ar) / AQ_RS + 1 : 0;
    const uint8_t *asrc[AQ_N];
    auto load_a = [&](int st, int i) {
        const uint32_t so = sbase + (uint32_t)(st * WSTAGE + ar * WA_LD + ac * 16);
        const bool v = i * WKB + ac / 4 < nbt;
#pragma unroll
        for (int q = 0; q < AQ_N; q++)
            if (q < na) cp_async16(so + (uint32_t)(q * AQ_RS * WA_LD), v ? asrc[q] + (int64_t)i * WKB * 64 : abase, v);
    };
    /* the scales: thread tid owns CTA row tid / 2, blocks 16 (tid % 2) .. + 15 of each chunk, read
     * one chunk ahead into registers, four bytes a word (aligned words where the row allows;
     * rows past N and blocks past K are not read and decode as 0, never stored) */
    const int sr = tid / 2, sh = (tid % 2) * 16;
    int64_t srw;
    const uint8_t *const s = wsrc_of(sr, tab.s[le - c0], &srw);
    const bool s_ok = srw < N;
    const uint8_t *const ssrc = s + (s_ok ? srw * s_ld : 0);
    const bool s_word = (reinterpret_cast<uintptr_t>(ssrc) & 3u) == 0;
    uint32_t snext[4];
    auto load_s = [&](int ci) {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int b = ci * KCH + sh + 4 * q;
            if (s_ok && s_word && b + 3 < nbt) {
                snext[q] = __ldg(reinterpret_cast<const uint32_t *>(ssrc + b));
            } else {
                uint32_t v = 0;
                for (int e = 0; e < 4; e++)
                    if (s_ok && b + e < nbt) v |= (uint32_t)__ldg(ssrc + b + e) << (8 * e);
                snext[q] = v;
            }
        }
    };
    auto store_s = [&](int ci) {
#pragma unroll
        for (int q = 0; q < 16; q++) {
            const int b = ci * KCH + sh + q;
            const uint32_t byte = (snext[q / 4] >> (8 * (q % 4))) & 0xffu;
            s_sm[sh + q][sr] = e8m0f(s_ok && b < nbt ? byte : 0x100u);
        }
    };

#pragma unroll
    for (int st = 0; st < WSTAGES - 1; st++)
        if (st < nst) load_b(st, st); /* in the first commit group below */
    if (tid < np) {
        const int32_t e = list[first + tid];
        srow[tid] = (a_div ? (int64_t)e / a_div : first + tid) * K * 2;
        sdst[tid] = e;
    }
    /* rows np .. 16 nmt - 1 of the last m16 tile in use: zeros in every stage (never loaded) */
    zero_tile_rows<WSTAGES, WSTAGE, WA_LD, WTHREADS>(smem, np, 16 * nmt, tid);
    load_s(0);
    store_s(0);
    if (nch > 1) load_s(1);
    __syncthreads(); /* srow, sdst, the zeros, chunk 0's scales */
#pragma unroll
    for (int q = 0; q < AQ_N; q++) asrc[q] = abase + (q < na ? srow[ar + q * AQ_RS] : 0) + ac * 16;
#pragma unroll
    for (int st = 0; st < WSTAGES - 1; st++) {
        if (st < nst) load_a(st, st);
        cp_async_commit();
    }

    const uint32_t ldA = (uint32_t)((((lane >> 3) & 1) * 8 + (lane & 7)) * WA_LD + (lane >> 4) * 16);
    const int rdB = WA_BYTES + (warp * 16 + g) * WB_LD + t * 4;
    const int scol = warp * 16 + 2 * t; /* the lane's scale columns: scol + 8 nj + {0, 1} */
    float acc[WMT][WNJ][4], sum[WMT][WNJ][4];
#pragma unroll
    for (int mt = 0; mt < WMT; mt++)
#pragma unroll
        for (int nj = 0; nj < WNJ; nj++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[mt][nj][e] = sum[mt][nj][e] = 0.0f;

    /* chunk by chunk, its stages in an inner loop: with one loop over all stages and the chunk's
     * fold behind a condition inside it, the compiler copied the 32 accumulators every stage (64
     * moves of a 328-instruction body, Nsight Compute source counters). With this and no select
     * for blocks past K (below): gate/up of a 2K-token prefill 558.8 M -> 435.0 M warp
     * instructions, 1.43 -> 1.23 ms (the first layer's, clocks locked by Nsight); per call as the
     * prefill runs (tests/gpu/kernel_times.sh) 1.10 -> 0.93 ms gate/up, 0.53 -> 0.47 ms down */
    constexpr int SPC = KCH / WKB; /* stages a chunk */
    auto main_loop = [&](auto nmt_c) {
        constexpr int NMT = decltype(nmt_c)::value;
        for (int ci = 0; ci < nch; ci++) {
            const int i_end = (ci + 1) * SPC < nst ? (ci + 1) * SPC : nst;
            for (int i = ci * SPC; i < i_end; i++) {
                cp_async_wait<WSTAGES - 2>();
                __syncthreads(); /* stage i landed; every warp is past stage i - 1 (and the scale table's reads) */
                if (ci > 0 && i == ci * SPC) { /* chunk ci starts: its scales replace the last chunk's */
                    store_s(ci);
                    __syncthreads();
                    if (ci + 1 < nch) load_s(ci + 1);
                }
                if (i + WSTAGES - 1 < nst) {
                    load_b((i + WSTAGES - 1) % WSTAGES, i + WSTAGES - 1);
                    load_a((i + WSTAGES - 1) % WSTAGES, i + WSTAGES - 1);
                }
                cp_async_commit();
                const int st = i % WSTAGES;
                const uint32_t so = sbase + (uint32_t)(st * WSTAGE);
                const uint8_t *const sb = smem + st * WSTAGE + rdB;
                /* a full tile's stage one k-block at a time: its four m16 tiles give chains enough,
                 * and both blocks at once spilled at the 168 registers of 3 CTAs an SM */
                constexpr int JB_UNROLL = NMT == WMT ? 1 : WKB;
#pragma unroll JB_UNROLL
                for (int jb = 0; jb < WKB; jb++) {
                    uint32_t b[WNJ][4];
#pragma unroll
                    for (int nj = 0; nj < WNJ; nj++)
                        e2m1x8_to_bf16x2(*reinterpret_cast<const uint32_t *>(sb + nj * 8 * WB_LD + jb * 16), b[nj]);
                    /* a block past K multiplied zero-filled tiles and its table entry is 0 (store_s
                     * decodes 0x100 there): acc + 0·0 = acc, as above, with no select */
                    const float *const sq = &s_sm[(i * WKB + jb) % KCH][scol];
                    float2 q[WNJ];
#pragma unroll
                    for (int nj = 0; nj < WNJ; nj++) q[nj] = *reinterpret_cast<const float2 *>(sq + 8 * nj);
#pragma unroll
                    for (int mt = 0; mt < WMT; mt++) {
                        if (mt >= NMT) continue; /* the tile's m16 tiles in use: known at compile time */
                        uint32_t a0[4], a1[4];
                        decode_a_frags<16>(so + ldA + (uint32_t)(mt * 16 * WA_LD + jb * 64), a0, a1);
#pragma unroll
                        for (int nj = 0; nj < WNJ; nj++) {
                            float p[4];
                            mma_bf16(p, a0[0], a0[1], a0[2], a0[3], b[nj][0], b[nj][1], 0.0f, 0.0f, 0.0f, 0.0f);
                            mma_bf16(p, a1[0], a1[1], a1[2], a1[3], b[nj][2], b[nj][3], p[0], p[1], p[2], p[3]);
                            float *const c = acc[mt][nj];
                            c[0] = __fmaf_rn(p[0], q[nj].x, c[0]);
                            c[1] = __fmaf_rn(p[1], q[nj].y, c[1]);
                            c[2] = __fmaf_rn(p[2], q[nj].x, c[2]);
                            c[3] = __fmaf_rn(p[3], q[nj].y, c[3]);
                        }
                    }
                }
            }
            /* chunk ci ends: its sum joins the chunks before, in order */
#pragma unroll
            for (int mt = 0; mt < WMT; mt++)
#pragma unroll
                for (int nj = 0; nj < WNJ; nj++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        if (mt >= NMT) continue;
                        sum[mt][nj][e] = ci ? __fadd_rn(sum[mt][nj][e], acc[mt][nj][e]) : acc[mt][nj][e];
                        acc[mt][nj][e] = 0.0f;
                    }
        }
    };
    /* The tile's m16 count as a compile-time constant in each copy of the loop: with a run-time
     * test per m16 tile the body fell into blocks of one m16 tile's two n8 chains (mma, mma, scale
     * fma), too few independent chains to cover the mma latency (Nsight: top stall a fixed-latency
     * dependency, 0.5 instructions issued a scheduler); one branch-free body interleaves them all.
     * With the copy addresses set once (load_a), H100 bench_moe at 2,048 / 8,192 tokens: 1.34 /
     * 4.46 -> 0.98 / 3.18 ms a call, the copies alone 1.20 / 3.84. Tried after it and not kept:
     * stages sized by the tile's m16 count (the NMT·16 activation rows in use, up to 6 stages
     * in the same pool for one m16 tile): bench_moe at 512 / 2,048 / 8,192 tokens 0.762 / 0.993
     * / 3.128 -> 0.748 / 0.968 / 3.152 ms, a 2K prompt in 512-token chunks 171.8 165.4 -> 165.3
     * 165.8 ms (H100): a tile of 8 pairs does not wait on its weight bytes in flight. */
    static_assert(WMT == 4, "the cases below cover 1..4 m16 tiles");
    switch (nmt) {
    case 1: main_loop(moe_ic<1>{}); break;
    case 2: main_loop(moe_ic<2>{}); break;
    case 3: main_loop(moe_ic<3>{}); break;
    default: main_loop(moe_ic<WMT>{}); break;
    }
    cp_async_wait<0>();

    if (NM == 1) { /* down: y[list entry, col] = bf16 of the chunk sums */
        wide_frag_halves([&](int mt, int nj, int h) {
            const int r = mt * 16 + g + 8 * h;
            const int64_t col = n0 + warp * 16 + nj * 8 + 2 * t;
            if (r >= np) return;
            __nv_bfloat16 *yr = out + (int64_t)sdst[r] * N;
            if (col < N) yr[col] = __float2bfloat16_rn(sum[mt][nj][2 * h]);
            if (col + 1 < N) yr[col + 1] = __float2bfloat16_rn(sum[mt][nj][2 * h + 1]);
        });
        return;
    }
    /* gate/up: warps 2-3 hand bf16(u) to warps 0-1 through shared memory (the stages are free),
     * which form h = bf16(wt · silu(min(g, limit)) · clamp(u)) in place; then the CTA quantizes
     * each row's 32 values of h, 4 threads per row, into the k-permuted qh */
    __syncthreads(); /* every warp is done with the stages */
    float *const ex = reinterpret_cast<float *>(smem); /* [WP][WEX_LD] */
    if (warp >= 2)
        wide_frag_halves([&](int mt, int nj, int h) {
            float *e = ex + (mt * 16 + g + 8 * h) * WEX_LD + (warp - 2) * 16 + nj * 8 + 2 * t;
            e[0] = __bfloat162float(__float2bfloat16_rn(sum[mt][nj][2 * h]));
            e[1] = __bfloat162float(__float2bfloat16_rn(sum[mt][nj][2 * h + 1]));
        });
    __syncthreads();
    if (warp < 2)
        wide_frag_halves([&](int mt, int nj, int h) {
            const int r = mt * 16 + g + 8 * h;
            const float wt = r < np ? __ldg(wts + sdst[r]) : 0.0f;
            float *e = ex + r * WEX_LD + warp * 16 + nj * 8 + 2 * t;
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const float gb = __bfloat162float(__float2bfloat16_rn(sum[mt][nj][2 * h + c]));
                e[c] = ds_bf16f(ds_bf16_rne(mo_swiglu(gb, e[c], limit, true, wt)));
            }
        });
    __syncthreads();
    const int tq = tid & 3;
#pragma unroll
    for (int it = 0; it < WP / (WTHREADS / 4); it++) {
        const int r = it * (WTHREADS / 4) + tid / 4;
        float v[8];
#pragma unroll
        for (int e = 0; e < 8; e++) v[e] = r < np ? ex[r * WEX_LD + 8 * tq + e] : 0.0f;
        uint32_t o[4];
        mma_quant8(v, o); /* every lane: the group's shuffles */
        if (r < np) mma_store_perm8(reinterpret_cast<uint32_t *>(out) + ((first + r) * (N / 32) + n0 / 32) * 16, tq, o);
    }
}

} /* namespace */

/* The expert pointers of experts [c0, c0 + cn) for one launch: gate/up (w1, w3) or down (w2). */
static moe_wtab moe_mma_tab(const struct qweight *w1, const struct qweight *w3, const struct qweight *w2, int down,
                            int64_t c0, int cn) {
    moe_wtab tab;
    for (int i = 0; i < cn; i++) {
        const struct qweight *a = down ? &w2[c0 + i] : &w1[c0 + i], *b = down ? &w2[c0 + i] : &w3[c0 + i];
        tab.w[i][0] = (const uint8_t *)a->w;
        tab.s[i][0] = a->s;
        tab.w[i][1] = (const uint8_t *)b->w;
        tab.s[i][1] = b->s;
    }
    return tab;
}

#define MOE_MMA_FAIL(msg) ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda moe_experts (tensor cores)", msg)

/* One call's scratch, in moe_mma_workspace_bytes's layout for passes of tp tokens and tiles of P
 * pairs: plan | tiles | qx [tp, D] | qh [tp k, I] | part [tp k, per pair] (the decode path's; the
 * prefill path has none: NULL). */
struct moe_scr {
    uint8_t *base;
    int32_t *plan;
    int2 *tiles;
    __nv_bfloat16 *qx, *qh;
    float *part;
};

static moe_scr moe_scr_take(struct backend *be, int64_t T, int64_t tp, int64_t k, int64_t n_local, int64_t D,
                            int64_t I, int64_t Dout, int P) {
    const int64_t mcap = tp * k;
    const size_t b_plan = (size_t)moe_mma_align(4 * (2 * (n_local + 1) + mcap)),
                 b_tiles = (size_t)moe_mma_align(8 * moe_tiles_max(mcap, n_local, P)),
                 b_qx = (size_t)moe_mma_align(tp * D * 2), b_qh = (size_t)moe_mma_align(mcap * I * 2);
    moe_scr r;
    r.base = (uint8_t *)cuda_be_scratch_raw(be, (size_t)moe_mma_workspace_bytes(T, k, n_local, D, I, Dout));
    r.plan = (int32_t *)r.base;
    r.tiles = (int2 *)(r.base + b_plan);
    r.qx = (__nv_bfloat16 *)(r.base + b_plan + b_tiles);
    r.qh = (__nv_bfloat16 *)(r.base + b_plan + b_tiles + b_qx);
    r.part = moe_mma_is_wide(T, I) ? nullptr : (float *)(r.base + b_plan + b_tiles + b_qx + b_qh);
    return r;
}

/* A pass's first work, the same on both paths, in one launch (they do not depend on each other):
 * CTA 0 buckets its pairs by expert into tiles of P (the plan), the others quantize its tokens' x
 * into qx (n8 = tn·D / 8 groups of 8, one a thread). Two launches cost a launch more on the step's
 * critical path (at batch 1 the plan 6.0 µs, then the act quant 2.9 µs, H200 Nsight).
 * The CTA's size: a decode pass's launch runs on the routed experts' lane while the shared
 * expert's split linears fill every SM beside it (4 CTAs of 16K registers each: the whole
 * register file), and a 1024-thread CTA (32K registers) only found room when that grid drained,
 * ~3 µs after the router ended at batch 1 (H200 lanes, results/PERFORMANCE_HISTORY.md); one
 * CTA of 256 threads fits where one of theirs ends, and the high-priority lane's CTAs go first.
 * The prefill path keeps 1024 (its plan's loops over ~12K pairs). */
#define MOE_BEGIN_THREADS_DECODE 256
__global__ void __launch_bounds__(1024, 1)
    moe_begin_kernel(int32_t *__restrict__ plan, int2 *__restrict__ tiles, const int32_t *__restrict__ idx, int64_t M,
                     int64_t e0, int n_local, int P, const __nv_bfloat16 *__restrict__ x, __nv_bfloat16 *__restrict__ qx,
                     int64_t n8) {
    if (blockIdx.x == 0)
        moe_plan_body(plan, tiles, idx, M, e0, n_local, P);
    else
        mma_act_quant_body(x, qx, n8, (int64_t)(blockIdx.x - 1) * blockDim.x + threadIdx.x);
}

static void moe_pass_begin(cudaStream_t st, const moe_scr &r, const int32_t *idx, const bf16_t *x, int64_t tn,
                           int64_t k, int64_t D, int64_t e0, int64_t n_local, int P) {
    const int64_t n8 = tn * D / 8, nt = tn <= MOE_MMA_DECODE_T ? MOE_BEGIN_THREADS_DECODE : 1024;
    moe_begin_kernel<<<(unsigned)(1 + (n8 + nt - 1) / nt), (unsigned)nt, 0, st>>>(
        r.plan, r.tiles, idx, tn * k, e0, (int)n_local, P, (const __nv_bfloat16 *)x, r.qx, n8);
    KERNEL_CHECK();
}

/* The grid's tile slots (z) of a decode-path launch are capped at MOE_MMA_Z_WAVES times the CTAs
 * the GPU holds at once, over the CTAs of one tile (x · y); a CTA then runs tiles z, z + gridDim.z,
 * ... The bound on the tiles (moe_tiles_max) counts every pair of the pass as local, so at batch 8
 * it asked for 48 tile slots where about 6 tiles exist: some 15,000 of the gate/up launch's 17,280
 * CTAs only read the plan and exited, after the working ones. At 4 the cap leaves batch 1 as it
 * was and loops only where a rank's experts draw many more tiles than the balanced share. */
#define MOE_MMA_Z_WAVES 4

template <int NM, int W> static int moe_mma_ctas_per_sm() {
    static int n = 0; /* one device per process */
    if (!n) CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, moe_mma_kernel<NM, W>, xtile<W>::THREADS, 0));
    return n > 0 ? n : 1;
}

/* One decode-path launch of moe_mma_kernel<NM, W> (its CTA's threads from xtile<W>) over nt tile
 * slots. */
template <int NM, int W>
static void moe_mma_launch(dim3 grid, int64_t nt, int sms, cudaStream_t st, const moe_wtab &tab, int c0, int cn,
                           const moe_scr &r, int n_local, const __nv_bfloat16 *a, int64_t a_div, int64_t N, int64_t K,
                           int64_t ld, int64_t s_ld, int64_t mcap) {
    const int64_t per_tile = (int64_t)grid.x * grid.y;
    const int64_t zcap = (MOE_MMA_Z_WAVES * (int64_t)sms * moe_mma_ctas_per_sm<NM, W>() + per_tile - 1) / per_tile;
    grid.z = (unsigned)(nt < zcap ? nt : zcap); /* zcap >= 1: sms and the occupancy are >= 1 */
    moe_mma_kernel<NM, W><<<grid, xtile<W>::THREADS, 0, st>>>(tab, c0, cn, r.plan, r.tiles, n_local, a, a_div, N, K, ld,
                                                              s_ld, r.part, mcap);
}

/* Calls of at most MOE_MMA_DECODE_T tokens: k-chunks spread over CTAs, partials in memory. */
static void moe_mma_chunked(struct backend *be, bf16_t *y, const bf16_t *x, const int32_t *idx, const float *wts,
                            int64_t T, int64_t k, int64_t e0, int64_t n_local, const struct qweight *w1,
                            const struct qweight *w3, const struct qweight *w2, float limit) {
    const int64_t D = w1[0].k, I = w1[0].n, Dout = w2[0].n;
    const int64_t ldg = w1[0].ld, sg = w1[0].s_ld, ldd = w2[0].ld, sd = w2[0].s_ld;
    const int64_t tp = moe_mma_pass_tokens(T, k, D, I, Dout), mcap = tp * k;
    const int nchD = (int)moe_mma_chunks(D), nchI = (int)moe_mma_chunks(I);
    cudaStream_t st = cuda_be_stream(be);
    const moe_scr r = moe_scr_take(be, T, tp, k, n_local, D, I, Dout, XP);

    const int sms = cuda_be_sms(be);
    const int64_t rows = 16 * MOE_MMA_CTA_WARPS, ntg = (I + rows - 1) / rows, ntd = (Dout + rows - 1) / rows;
    if (2 * ntg > 0x7fffffff || ntd > 0x7fffffff || nchD > 65535 || nchI > 65535) MOE_MMA_FAIL("expert too large for the grid");
    for (int64_t t0 = 0; t0 < T; t0 += tp) {
        const int64_t tn = T - t0 < tp ? T - t0 : tp, mn = tn * k;
        moe_pass_begin(st, r, idx + t0 * k, x + t0 * D, tn, k, D, e0, n_local, XP);
        for (int pass = 0; pass < 2; pass++) { /* 0: gate/up, 1: down */
            for (int64_t c0 = 0; c0 < n_local; c0 += MOE_CHUNK) {
                const int cn = (int)(n_local - c0 < MOE_CHUNK ? n_local - c0 : MOE_CHUNK);
                const int64_t nt = moe_tiles_max(mn, cn, XP); /* the grid's tile slots */
                if (nt > 65535) MOE_MMA_FAIL("too many tiles");
                const moe_wtab tab = moe_mma_tab(w1, w3, w2, pass, c0, cn);
                const dim3 grid((unsigned)(pass ? ntd : 2 * ntg), (unsigned)(pass ? nchI : nchD), 1);
                const __nv_bfloat16 *const act = pass ? r.qh : r.qx;
                const int64_t a_div = pass ? 0 : k, N = pass ? Dout : I, K = pass ? I : D;
                const int64_t ld = pass ? ldd : ldg, s_ld = pass ? sd : sg;
                const auto launch = pass ? moe_mma_launch<1, MOE_MMA_CTA_WARPS> : moe_mma_launch<2, MOE_MMA_CTA_WARPS>;
                launch(grid, nt, sms, st, tab, (int)c0, cn, r, (int)n_local, act, a_div, N, K, ld, s_ld, mcap);
                KERNEL_CHECK();
            }
            if (pass == 0) {
                const int64_t th = mn * I / 2;
                moe_gateup_finish_kernel<<<(unsigned)((th + 255) / 256), 256, 0, st>>>(
                    r.qh, r.part, r.plan, (int)n_local, wts + t0 * k, I, nchD, mcap, limit);
            } else {
                const int64_t blocks = (mn * Dout + 255) / 256;
                moe_down_finish_kernel<<<(unsigned)(blocks < 4096 ? blocks : 4096), 256, 0, st>>>(
                    (__nv_bfloat16 *)y + t0 * k * Dout, r.part, r.plan, (int)n_local, Dout, nchI, mcap);
            }
            KERNEL_CHECK();
        }
    }
    cuda_be_scratch_free(be, r.base);
}

/* Calls of more than MOE_MMA_DECODE_T tokens: moe_wide_kernel, each CTA over the whole of k. */
static void moe_mma_wide(struct backend *be, bf16_t *y, const bf16_t *x, const int32_t *idx, const float *wts,
                         int64_t T, int64_t k, int64_t e0, int64_t n_local, const struct qweight *w1,
                         const struct qweight *w3, const struct qweight *w2, float limit) {
    const int64_t D = w1[0].k, I = w1[0].n, Dout = w2[0].n;
    const int64_t tp = moe_wide_pass_tokens(T, k, D, I);
    cudaStream_t st = cuda_be_stream(be);
    const moe_scr r = moe_scr_take(be, T, tp, k, n_local, D, I, Dout, WP);
    const int64_t ng = I / 32, nd = (Dout + WBN - 1) / WBN;
    if (ng > 0x7fffffff || nd > 0x7fffffff) MOE_MMA_FAIL("expert too large for the grid");
    for (int64_t t0 = 0; t0 < T; t0 += tp) {
        const int64_t tn = T - t0 < tp ? T - t0 : tp, mn = tn * k;
        moe_pass_begin(st, r, idx + t0 * k, x + t0 * D, tn, k, D, e0, n_local, WP);
        for (int pass = 0; pass < 2; pass++) /* 0: gate/up (all of h first), 1: down */
            for (int64_t c0 = 0; c0 < n_local; c0 += MOE_CHUNK) {
                const int cn = (int)(n_local - c0 < MOE_CHUNK ? n_local - c0 : MOE_CHUNK);
                const int64_t nt = moe_tiles_max(mn, cn, WP);
                if (nt > 65535) MOE_MMA_FAIL("too many tiles");
                const moe_wtab tab = moe_mma_tab(w1, w3, w2, pass, c0, cn);
                if (pass == 0)
                    moe_wide_kernel<2><<<dim3((unsigned)ng, 1, (unsigned)nt), WTHREADS, 0, st>>>(
                        tab, (int)c0, cn, r.plan, r.tiles, (int)n_local, r.qx, k, I, D, w1[0].ld, w1[0].s_ld, r.qh,
                        wts + t0 * k, limit);
                else
                    moe_wide_kernel<1><<<dim3((unsigned)nd, 1, (unsigned)nt), WTHREADS, 0, st>>>(
                        tab, (int)c0, cn, r.plan, r.tiles, (int)n_local, r.qh, 0, Dout, I, w2[0].ld, w2[0].s_ld,
                        (__nv_bfloat16 *)y + t0 * k * Dout, nullptr, 0.0f);
                KERNEL_CHECK();
            }
    }
    cuda_be_scratch_free(be, r.base);
}

void cuda_moe_mma_experts(struct backend *be, bf16_t *y, const bf16_t *x, const int32_t *idx, const float *wts,
                          int64_t T, int64_t k, int64_t e0, int64_t n_local, const struct qweight *w1,
                          const struct qweight *w3, const struct qweight *w2, float limit) {
    if ((uintptr_t)x % 16 || w1[0].ld % 16 || w2[0].ld % 16) MOE_MMA_FAIL("x and the FP4 row strides must be 16-byte aligned");
    if (moe_mma_is_wide(T, w1[0].n))
        moe_mma_wide(be, y, x, idx, wts, T, k, e0, n_local, w1, w3, w2, limit);
    else
        moe_mma_chunked(be, y, x, idx, wts, T, k, e0, n_local, w1, w3, w2, limit);
}
