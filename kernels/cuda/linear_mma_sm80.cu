/* Tensor-core (mma.sync) linear layers on SM80, every T (a decode tiling up to 256 rows, a prefill
 * tiling above; the engine's default, --exact-linears aside): FP8 (32x32 tile
 * scales), FP4 (per-row per-32 scales) and BF16 weights, y[T, n] bf16 = x[T, k] bf16 · Wᵀ. SM80
 * instructions only (mma.sync.m16n8k16 bf16 -> fp32, ldmatrix, cp.async, prmt, fma.bf16x2): no
 * wgmma, TMA or FP8 mma, so the same code runs on SM80/SM86 and, JIT-compiled, on later parts.
 *
 * The kernels of a call:
 *  - mma_act_quant_kernel (FP8/FP4 only; its body, mma_act_quant_body, in mma_sm80.cuh with the
 *    other shared primitives): the reference's per-32 FP8 activation quantization with
 *    act_quant_kernel's arithmetic (linear_sm80.cu: amax as a max, power-of-two scale by the
 *    exponent bits, then ds_fp8_q: the quotient as an exact product, clamp, RNE e4m3), 4 threads
 *    per 32-group. It stores the
 *    dequantized value q·s_x as bf16 in the workspace ([T, k] bf16): q has at most 4 significant
 *    bits and s_x is a power of two >= 2^-22, so q·s_x is exact in bf16 and carries q and s_x.
 *    Within each 32-group the values are stored k-permuted (position 8c + 2t + e holds k =
 *    8t + 2c + e), so that ldmatrix hands lane (g, t) the k values 8t..8t+7 (see below).
 *  - mma_decode_kernel (the smaller calls: fp8_tile for FP8, T <= 128 for the others; up to 256
 *    when asked for): see its own comment below;
 *    FP8 calls of up to 8 rows take mma_decode_split_kernel, the same tile and bits with a
 *    chunk's block products spread over four warps per n8 tile;
 *  - mma_linear_kernel (the larger calls; which ones: fp8_tile for FP8, T > 128 for the others),
 *    one launch for the full k-chunks (grid z) and one for a shorter last chunk, two weights side
 *    by side for a pair call: CTA tile 128 (T) x 128 (n) x 32 (k = one scale block), 3-stage cp.async
 *    pipeline of the raw operand bytes (activations 64 B per row per block, weights 32 B FP8,
 *    16 B FP4, 64 B BF16 per row per block; zero-filled past T / n), one __syncthreads per block.
 *      BF16: 8 warps as 2 (T) x 4 (n), warp tile 64 x 32 (4 x 4 m16n8 fragments), 48 KB of
 *            shared memory, 122 registers, two CTAs per SM;
 *      FP8/FP4: 4 warps along n, warp tile 128 x 32 (8 x 4 fragments, 128 accumulators per
 *            thread): every weight is decoded once per CTA and shared by all 128 rows; 36 KB
 *            (FP8) / 31.5 KB (FP4) of shared memory, 255 registers (no spills), two CTAs per SM.
 *      FP8 also 128 x 64 and 64 x 64 (4 warps of 128 x 16 / 64 x 16, 168 / ~115 registers, three /
 *            four CTAs per SM), for calls whose 128 x 128 grid would leave SMs idle.
 *      BF16 also 64 x 64 (4 warps of 32 x 32, 5 stages) for 65-512 rows where 128 x 128 has too few CTAs.
 *    A fragments (x or the quantized workspace): ldmatrix.x4 from XOR-swizzled rows (chunk c of
 *    row r at c ^ (r/2 % 4): conflict-free). BF16 B: ldmatrix.x4 likewise. FP8/FP4 B: each lane
 *    (g, t) reads the raw bytes of k 8t..8t+7 of its n row (8 bytes FP8, 4 bytes FP4; conflict-free
 *    without padding; FP4 in the device layout of fp4_layout.h) and decodes them in registers to
 *    exact bf16 (prmt or shifts and masks, then one bf16x2 multiply by 2^120 / 2^126, which also
 *    places the e4m3/e2m1 subnormals exactly). So for FP8 /
 *    FP4 the block's first mma sums k = 8t + {0..3} over t, the second k = 8t + {4..7}: a fixed
 *    set of 16 products each, the same for A and B. Weight scales: FP8's one per warp per block
 *    sits in lane b's register for block b of the CTA's k-chunk (one load per lane before the
 *    loop) and is shuffled out per block; FP4's (one per n row) are read two blocks ahead by one
 *    thread per row and staged as fp32 in shared memory;
 *  - mma_chunk_sum_kernel, when k has more than one chunk: the chunks' fp32 partials folded in
 *    order into y (4 outputs a thread where T·n % 4 == 0).
 *
 * Order contract (what decides an output's bits; none of it depends on T, on the other rows of the
 * call, or on the grid/tile choice: the k split is fixed by k alone, one CTA owns an output over a
 * whole k-chunk, and the tensor core's per-element dot product does not depend on the fragment
 * position):
 *  - k is cut into chunks of KCH = 32 k-blocks (1024 values; the last one shorter). Within a
 *    chunk, for each k-block b in increasing order, P'_b = mma(mma(0, first 16), second 16) over
 *    the activations q·s_x and the weight codes q_w (all exact in bf16, every product exact in
 *    fp32), then acc = fma(P'_b, s_w[b], acc) in fp32 from acc = 0. One chunk: y = bf16_rn(acc);
 *    more: each chunk's acc is stored in fp32 and mma_chunk_sum_kernel forms
 *    y = bf16_rn(((acc_0 + acc_1) + acc_2) + ...). The chunks are what lets a decode-sized call
 *    spread one output's k over several CTAs: one CTA per output over all of k was latency bound
 *    (~0.3 µs per 8 k-blocks, 27 µs for k = 5120 whatever the tile).
 *    Versus the reference acc += (P_b · s_x) · s_w, P_b the k-order fp32 sum of q_x·q_w:
 *      · the tensor core's sum scales exactly with its inputs while everything stays in the fp32
 *        normal range (checked on the H200 over 8M random fragments: bit-identical to
 *        mma(q_x, q_w) · s_x for s_x up to 2^77), so P'_b = (mma-order P_b) · s_x: the one
 *        difference is the order / internal rounding in which the mma adds a block's 32 products;
 *      · fma(P'_b, s_w, acc) equals the separately rounded mul + add because s_w is a power of
 *        two (an exact product) unless P'_b · s_w leaves the fp32 normal range (e8m0 scales below
 *        about 2^-86, or overflow), which real checkpoints never reach.
 *    The scaled block partials are folded in block order within a chunk, the chunks in order (the
    CPU backend folds all blocks in one order; the difference is within the linear bound).
 *  - BF16: per chunk acc = mma(... mma(mma(0, k 0..15), k 16..31) ..., last 16), one fp32
 *    accumulation over the chunk in k order, whose order inside each group of 16 products (plus the
 *    running sum) is the tensor core's; the chunks folded as above.
 *  - e4m3 NaN codes (0x7F/0xFF) in the weights decode as ±480 here, not NaN (the checkpoint has
 *    none: the reference quantizer saturates at ±448). NaN scales propagate as in the reference.
 */
#include "backend.h"
#include "linear_mma.h"
#include "mma_sm80.cuh"

namespace {

/* x [rows, k] bf16 -> the k-permuted quantized activations (mma_act_quant_body), 8 values a thread */
__global__ void __launch_bounds__(256) mma_act_quant_kernel(const __nv_bfloat16 *__restrict__ x,
                                                            __nv_bfloat16 *__restrict__ xq, int64_t n8) {
    mma_act_quant_body(x, xq, n8, (int64_t)blockIdx.x * blockDim.x + threadIdx.x);
}

/* The same from x's column blocks: x [rows, k] is the row interleave of xb [nblk][rows][kb]
 * (kb = k / nblk, a multiple of 32, so each 32-group lies in one block; k8 = k / 8, kb8 = kb / 8),
 * and thread i quantizes x's word i where its block holds it. */
__global__ void __launch_bounds__(256) mma_act_quant_blocks_kernel(const __nv_bfloat16 *__restrict__ xb,
                                                                   __nv_bfloat16 *__restrict__ xq, int64_t n8,
                                                                   int64_t k8, int64_t kb8, int64_t rows) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, r = i / k8, c8 = i - r * k8, blk = c8 / kb8;
    mma_act_quant_at(xb, xq, i < n8, (blk * rows + r) * kb8 + (c8 - blk * kb8), i);
}

/* cp.async pipeline depth (k-blocks in flight) of the tiles that do not set their own (cfg's
 * STAGES_: the narrow FP8 tiles take 4, below). Four for the FP8 / FP4 tiles (48 KB at 128 x 128)
 * was tried after 0d2cb3e: H200, bench_linear_cuda graph µs a call at 2,048 rows within 1 % (wq_a
 * 149.3 -> 148.1, sh_w1 236.2 -> 233.2), bench_step batch 64 / 256 and the 2K prefill unchanged
 * (11.24 / 20.40 / 102.6 -> 11.16 / 20.37 / 101.6 ms); not kept. */
constexpr int STAGES = 3;
constexpr int A_ROW = 64;  /* bytes of one activation row per k-block (32 bf16) */

enum { K_BF16 = 0, K_FP8 = 1, K_FP4 = 2 };

/* A kernel configuration: WM x WN warps, warp tile (BM / WM) x 8 NJ, CTA tile BM x (8 NJ WN), MINB
 * CTAs per SM asked of the register allocator. Shared memory per stage: the activation tile, the
 * raw weight tile (B_ROW bytes per n row per block) and, for FP4, the BN weight scales as fp32
 * (FP8's one scale per warp per block lives in registers). */
template <int F, int WM_, int WN_, int NJ_, int MINB_, int BM_ = 128, int STAGES_ = STAGES> struct cfg {
    static constexpr int WM = WM_, WN = WN_, NJ = NJ_, MINB = MINB_, STAGES = STAGES_;
    static constexpr int BM = BM_;          /* rows of x (T) per CTA */
    static constexpr int MT = BM / 16 / WM; /* m16 tiles per warp */
    static constexpr int WNC = 8 * NJ;      /* n columns per warp (NJ n8 tiles) */
    static constexpr int BN = WNC * WN;
    static constexpr int THREADS = 32 * WM * WN;
    static constexpr int B_ROW = F == K_BF16 ? 64 : (F == K_FP8 ? 32 : 16);
    static constexpr int S_N = F == K_FP4 ? BN : 0;
    static constexpr int A_BYTES = BM * A_ROW;
    static constexpr int B_BYTES = BN * B_ROW;
    static constexpr int STAGE_BYTES = A_BYTES + B_BYTES + S_N * 4;
    static constexpr int SMEM = STAGES * STAGE_BYTES;
    static_assert(SMEM <= 48 * 1024, "tile exceeds 48 KB of shared memory (SM86)");
    static_assert(MT * 16 * WM == BM && THREADS >= S_N && 32 % WNC == 0, "tile shape");
};

/* A call of two weights on one x (cuda_linear_mma_pair): output columns n1 .. n - 1 are the
 * second weight's rows from 0; n1 is a multiple of the CTA's rows (16 or 32 in the decode
 * tiling, BN in the prefill tiling: linear_mma_call checks), so no CTA tile or FP8 scale group
 * straddles the seam. A single weight: n1 = n (w2, s2 unused). */
struct dpair {
    const uint8_t *w2, *s2;
    int64_t n1;
};
/* The weight and scale base of the CTA whose first row is n0, and that row within its weight. */
__device__ __forceinline__ int64_t pair_rows(const dpair &pr, int64_t n0, const uint8_t *w, const uint8_t *s,
                                             const uint8_t **wm, const uint8_t **sm) {
    const bool second = n0 >= pr.n1;
    *wm = second ? pr.w2 : w;
    *sm = second ? pr.s2 : s;
    return second ? n0 - pr.n1 : n0;
}

/* ---------------------------------------------------------------------------------------------
 * The GEMM. a: [T, k] bf16 (the k-permuted quantized activations for FP8/FP4, x itself for BF16);
 * w rows ld_b bytes apart; s: e8m0 scales (FP8 [ceil(n/32), s_ld], FP4 [n, s_ld]). Grid: x = n
 * tiles, y = T tiles. */
template <int F, class C, bool PART>
__global__ void __launch_bounds__(C::THREADS, C::MINB)
    mma_linear_kernel(__nv_bfloat16 *__restrict__ y, float *__restrict__ part, const __nv_bfloat16 *__restrict__ a,
                      const uint8_t *__restrict__ w, const uint8_t *__restrict__ s, int64_t T, int64_t n, int64_t k,
                      int64_t ld_b, int64_t s_ld, int pair_store, int chunk0, int nb, dpair pr) {
    constexpr int MT = C::MT, NJ = C::NJ, WNC = C::WNC, BN = C::BN, THREADS = C::THREADS, WM = C::WM,
                  B_ROW = C::B_ROW, BM = C::BM, STAGES = C::STAGES;
    __shared__ __align__(16) uint8_t smem[C::SMEM];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;      /* mma groupID, thread in group */
    const int wm = warp % WM, wn = warp / WM;   /* warp tile: rows wm*MT*16.., cols wn*WNC.. */
    const int64_t n0 = (int64_t)blockIdx.x * BN, m0 = (int64_t)blockIdx.y * BM;
    /* the CTA's weight (a pair call's second from column pr.n1 on), its first row there, and the
     * end of its columns: rows are checked against nlim in the call's columns */
    const uint8_t *wp, *sp;
    const int64_t nl0 = pair_rows(pr, n0, w, s, &wp, &sp), nlim = n0 >= pr.n1 ? n : pr.n1;
    /* the CTA's k-chunk chunk0 + blockIdx.z, blocks [b0, b0 + nb): one launch covers the chunks of
     * equal length (the full ones, then a shorter last one), so nb is a kernel parameter, which
     * lives in constant memory — derived in a register it made the FP8 tile (255 registers) spill */
    const int chunk = chunk0 + (int)blockIdx.z, b0 = chunk * KCH;

    /* Per-thread copy assignments, fixed for the whole k loop. Thread tid copies 16-byte chunk
     * tid % 4 of activation rows tid / 4 + c * A_RS (c < A_CH), and chunk tid % B_PER_ROW of
     * weight rows tid / B_PER_ROW + c * B_RS: one running source pointer per operand (advanced one
     * block per issued stage) plus a constant row stride. Chunks past T / n are zero-filled
     * (src-size 0, source clamped to the operand's base, which is not read). The shared-memory
     * offsets repeat per stage; activation (and BF16 weight) chunks are swizzled for ldmatrix. */
    constexpr int A_CH = BM * 4 / THREADS, A_RS = THREADS / 4;
    constexpr int B_PER_ROW = B_ROW / 16;
    constexpr int B_CH = (BN * B_PER_ROW + THREADS - 1) / THREADS, B_RS = THREADS / B_PER_ROW;
    static_assert(A_CH * THREADS == BM * 4 && A_RS % 8 == 0 && (B_CH == 1 || B_RS % 8 == 0), "copy layout");
    const uint8_t *const abase = reinterpret_cast<const uint8_t *>(a);
    const int ra = tid >> 2, qa = tid & 3;
    const uint8_t *gA = abase + (m0 + ra) * k * 2 + qa * 16 + (int64_t)b0 * A_ROW;
    const int64_t strideA = (int64_t)A_RS * k * 2;
    const int nvA = m0 + ra >= T ? 0 : (int)min((int64_t)A_CH, (T - 1 - m0 - ra) / A_RS + 1); /* valid chunks */
    const uint32_t oA = (uint32_t)(ra * A_ROW + ((qa ^ ((ra >> 1) & 3)) << 4));
    const int rb = tid / B_PER_ROW, qb = tid % B_PER_ROW;
    const uint8_t *gB = wp + (nl0 + rb) * ld_b + qb * 16 + (int64_t)b0 * B_ROW;
    const int64_t strideB = (int64_t)B_RS * ld_b;
    const int nvB = rb >= BN || n0 + rb >= nlim ? 0 : (int)min((int64_t)B_CH, (nlim - 1 - n0 - rb) / B_RS + 1);
    /* BF16 rows are read with ldmatrix: swizzled like A; FP8/FP4 rows are read whole */
    const uint32_t oB = (uint32_t)(C::A_BYTES + rb * B_ROW + ((F == K_BF16 ? qb ^ ((rb >> 1) & 3) : qb) << 4));
    const uint32_t sbase = smem_addr(smem);

    /* issue the cp.async of the next k-block into stage st (on == false: past the last block,
     * zero-fill instead); the source pointers advance one block */
    auto load_stage = [&](int st, bool on) {
        const uint32_t so = sbase + (uint32_t)(st * C::STAGE_BYTES);
#pragma unroll
        for (int c = 0; c < A_CH; c++) {
            const bool v = on && c < nvA;
            cp_async16(so + oA + (uint32_t)(c * A_RS * A_ROW), v ? gA + c * strideA : abase, v);
        }
        gA += A_ROW;
#pragma unroll
        for (int c = 0; c < B_CH; c++) {
            const bool v = on && c < nvB;
            if (B_CH > 1 || BN * B_PER_ROW >= THREADS || rb < BN)
                cp_async16(so + oB + (uint32_t)(c * B_RS * B_ROW), v ? gB + c * strideB : wp, v);
        }
        gB += B_ROW;
    };

    /* Weight scales:
     *  FP4: thread tid < BN stages row n0 + tid's byte of each block in shared memory as fp32
     *       (0 past n), read two blocks ahead with plain loads and written after the block's math
     *       so the load latency is hidden;
     *  FP8: the warp's columns lie in one 32-row scale group and the CTA walks one k-chunk (at
     *       most 32 blocks), so lane b loads the group's raw scale of block b once, before the
     *       loop, and block i takes lane i's by a shuffle (0x100, i.e. 0, past n or nb). */
    const uint8_t *const sC = sp + (F == K_FP8 ? nl0 / 32 : nl0) * s_ld; /* CTA-uniform */
    uint32_t offS = 0;
    bool okS = false;
    if (F == K_FP4 && tid < BN) {
        okS = n0 + tid < nlim;
        offS = (uint32_t)(tid * s_ld + b0);
    } else if (F == K_FP8) {
        okS = (n0 + wn * WNC) / 32 * 32 < nlim;
        offS = (uint32_t)(wn * WNC / 32 * s_ld + b0);
    }
    /* the raw scale byte of the next block (blocks are read in order; 0x100 = no scale, i.e. 0),
     * decoded by e8m0f only where it is used, so the load's latency is not waited on early */
    auto scale_next = [&](bool on) -> uint32_t {
        uint32_t v = 0x100u;
        if (okS && on) v = __ldg(sC + offS);
        offS++;
        return v;
    };
    static_assert(KCH == 32, "one FP8 scale per lane");
    const uint32_t s_lane = F == K_FP8 && okS && lane < nb ? (uint32_t)__ldg(sC + offS + lane) : 0x100u;
    auto sS = [&](int st) -> float * { return reinterpret_cast<float *>(smem + st * C::STAGE_BYTES + C::A_BYTES + C::B_BYTES); };

    /* Fragment read addresses (stage-relative). A: ldmatrix.x4 per m16 tile and half block, lane L
     * addresses row (L / 8 % 2) * 8 + L % 8 of the tile, chunk 2h + L / 16 (h = 0: the block's
     * first mma, chunks 0-1; h = 1: chunks 2-3). BF16 B: ldmatrix.x4 per n8 tile, lane L addresses
     * n row L % 8, chunk L / 8. Swizzle: chunk c of row r sits at c ^ ((r / 2) % 4), which puts the
     * 8 rows of one 8x8 matrix on 8 distinct 16-byte bank groups; r % 8 == L % 8 here.
     * FP8/FP4 B: thread (g, t) reads bytes [8t, 8t+8) (FP8) / [4t, 4t+4) (FP4) of n row g. */
    const int swz = (lane >> 1) & 3;
    const int arow = wm * MT * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
    const uint32_t ldA0 = (uint32_t)(arow * A_ROW + (((lane >> 4) ^ swz) << 4));
    const uint32_t ldA1 = (uint32_t)(arow * A_ROW + (((2 + (lane >> 4)) ^ swz) << 4));
    const uint32_t ldB = (uint32_t)(C::A_BYTES + (wn * WNC + (lane & 7)) * B_ROW + (((lane >> 3) ^ swz) << 4));
    const int rdB = C::A_BYTES + (wn * WNC + g) * B_ROW + t * (B_ROW / 4);

    float acc[MT][NJ][4];
#pragma unroll
    for (int mi = 0; mi < MT; mi++)
#pragma unroll
        for (int j = 0; j < NJ; j++)
#pragma unroll
            for (int r = 0; r < 4; r++) acc[mi][j][r] = 0.0f;

#pragma unroll
    for (int st = 0; st < STAGES - 1; st++) {
        load_stage(st, st < nb);
        if (F == K_FP4 && tid < BN) sS(st)[tid] = e8m0f(scale_next(st < nb));
        cp_async_commit();
    }

    int st = 0, st_pf = STAGES - 1; /* stage read this iteration, stage written by its prefetch */
    for (int i = 0; i < nb; i++) {
        cp_async_wait<STAGES - 2>(); /* this thread's copies of block i have landed */
        __syncthreads();             /* everyone's have, and block i-1's readers are done */
        const bool do_pf = i + STAGES - 1 < nb;
        uint32_t sv = 0x100u; /* FP4: raw scale of block i + STAGES - 1 */
        if (do_pf) {
            load_stage(st_pf, true);
            if (F == K_FP4 && tid < BN) sv = scale_next(true);
        }
        cp_async_commit();

        const uint32_t so = sbase + (uint32_t)(st * C::STAGE_BYTES);

        /* B fragments of the warp's NJ n8 tiles: b[j][0..1] feed the block's first mma,
         * b[j][2..3] the second */
        uint32_t b[NJ][4];
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            const uint8_t *raw = smem + st * C::STAGE_BYTES + rdB + j * 8 * B_ROW;
            if (F == K_BF16) {
                ldmatrix_x4(b[j], so + ldB + (uint32_t)(j * 8 * B_ROW));
            } else if (F == K_FP8) {
                e4m3x8_to_bf16x2(*reinterpret_cast<const uint2 *>(raw), b[j]);
            } else {
                e2m1x8_to_bf16x2(*reinterpret_cast<const uint32_t *>(raw), b[j]);
            }
        }
        const float sw8 = F == K_FP8 ? e8m0f(__shfl_sync(0xffffffffu, s_lane, i)) : 0.0f; /* FP8: block i's */

#pragma unroll
        for (int mi = 0; mi < MT; mi++) {
            uint32_t a0[4], a1[4]; /* A fragments of the block's first and second mma */
            ldmatrix_x4(a0, so + ldA0 + (uint32_t)(mi * 16 * A_ROW));
            ldmatrix_x4(a1, so + ldA1 + (uint32_t)(mi * 16 * A_ROW));
#pragma unroll
            for (int j = 0; j < NJ; j++) {
                float *c = acc[mi][j];
                if (F == K_BF16) {
                    float d[4];
                    mma_bf16(d, a0[0], a0[1], a0[2], a0[3], b[j][0], b[j][1], c[0], c[1], c[2], c[3]);
                    mma_bf16(d, a1[0], a1[1], a1[2], a1[3], b[j][2], b[j][3], d[0], d[1], d[2], d[3]);
                    c[0] = d[0], c[1] = d[1], c[2] = d[2], c[3] = d[3];
                } else {
                    float p[4];
                    mma_bf16(p, a0[0], a0[1], a0[2], a0[3], b[j][0], b[j][1], 0.0f, 0.0f, 0.0f, 0.0f);
                    mma_bf16(p, a1[0], a1[1], a1[2], a1[3], b[j][2], b[j][3], p[0], p[1], p[2], p[3]);
                    /* C layout: p[0] (row g, col 2t), p[1] (g, 2t+1), p[2] (g+8, 2t), p[3] (g+8, 2t+1) */
                    /* weight scales of the accumulator columns 2t, 2t+1; FP4's are re-read from
                     * shared memory at each use (volatile: not hoisted), which keeps 2 NJ
                     * registers free and the kernel spill-free */
                    float2 q = make_float2(sw8, sw8);
                    if (F == K_FP4) {
                        const volatile float *vp = sS(st) + wn * WNC + j * 8 + 2 * t;
                        q = make_float2(vp[0], vp[1]);
                    }
                    c[0] = __fmaf_rn(p[0], q.x, c[0]);
                    c[1] = __fmaf_rn(p[1], q.y, c[1]);
                    c[2] = __fmaf_rn(p[2], q.x, c[2]);
                    c[3] = __fmaf_rn(p[3], q.y, c[3]);
                }
            }
        }

        /* past the last block this fills a stage nobody reads again */
        if (F == K_FP4 && tid < BN) sS(st_pf)[tid] = e8m0f(sv);
        st = st == STAGES - 1 ? 0 : st + 1;
        st_pf = st_pf == STAGES - 1 ? 0 : st_pf + 1;
    }
    cp_async_wait<0>(); /* nothing may be in flight into shared memory when the CTA exits */

#pragma unroll
    for (int mi = 0; mi < MT; mi++) {
#pragma unroll
        for (int j = 0; j < NJ; j++) {
            const int64_t col = n0 + wn * WNC + j * 8 + 2 * t;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int64_t row = m0 + wm * MT * 16 + mi * 16 + g + 8 * h;
                if (row >= T) continue;
                const float v0 = acc[mi][j][2 * h], v1 = acc[mi][j][2 * h + 1];
                if (PART) { /* the chunk's fp32 partial; mma_chunk_sum_kernel folds the chunks */
                    float *pr = part + ((int64_t)chunk * T + row) * n;
                    if (col < n) pr[col] = v0;
                    if (col + 1 < n) pr[col + 1] = v1;
                    continue;
                }
                __nv_bfloat16 *yr = y + row * n;
                if (pair_store) { /* n even, y 4-byte aligned: col < n implies col + 1 < n */
                    if (col < n) *reinterpret_cast<__nv_bfloat162 *>(yr + col) = __floats2bfloat162_rn(v0, v1);
                } else {
                    if (col < n) yr[col] = __float2bfloat16_rn(v0);
                    if (col + 1 < n) yr[col + 1] = __float2bfloat16_rn(v1);
                }
            }
        }
    }
}

template <int F, class C>
void launch(cudaStream_t st, __nv_bfloat16 *y, float *part, const __nv_bfloat16 *a, const uint8_t *w, const uint8_t *s,
            int64_t T, int64_t n, int64_t k, int64_t ld_b, int64_t s_ld, int pair, dpair pr) {
    const int64_t mt = (T + C::BM - 1) / C::BM, nt = (n + C::BN - 1) / C::BN, nch = (k / 32 + KCH - 1) / KCH;
    if (mt > 65535 || nt > 0x7fffffff || nch > 65535)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda_linear_mma", "T, n or k too large for the grid");
    /* the full chunks in one launch (their CTAs run side by side: one launch per chunk left a
     * call of few tiles, e.g. n = 1280 at T = 2048, with a part-filled wave per chunk), then the
     * shorter last one */
    const int nbt = (int)(k / 32), nfull = nbt / KCH, rest = nbt % KCH;
    for (int pass = 0; pass < 2; pass++) {
        const int c0 = pass ? nfull : 0, cn = pass ? (rest > 0) : (nbt ? nfull : 1), nb = pass ? rest : (nbt ? KCH : 0);
        if (!cn) continue;
        const dim3 grid((unsigned)nt, (unsigned)mt, (unsigned)cn);
        if (part)
            mma_linear_kernel<F, C, true><<<grid, C::THREADS, 0, st>>>(y, part, a, w, s, T, n, k, ld_b, s_ld, pair, c0, nb, pr);
        else
            mma_linear_kernel<F, C, false><<<grid, C::THREADS, 0, st>>>(y, part, a, w, s, T, n, k, ld_b, s_ld, pair, c0, nb, pr);
    }
}

/* y[t, i] = bf16(((part[0] + part[1]) + part[2]) + ...) over the k-chunks, [nch][T][n] fp32, or
 * with F32 (CUDA_MMA_OUT_F32) the sum itself, unrounded. V4 folds 4 outputs a thread (tn % 4 == 0,
 * part 16-byte and y 8-byte (bf16) / 16-byte (fp32) aligned): 16-byte streaming loads of every
 * chunk's partials, issued together, and one store; each output's adds as in the scalar form,
 * which moved a 2K-token prefill's partials at ~2 TB/s (27.5 µs a call on average, Nsight).
 * Tried and not kept: the decode kernel folding its tile's chunks in the last of its k-chunk CTAs
 * (a counter per tile), which saves this launch: the serial fold at the tail of each tile made the
 * step slower (H200, bench_step: batch 1 7.04 -> 7.17 ms, batch 64 21.9 -> 23.1 ms). */
template <bool F32, bool V4>
__global__ void mma_chunk_sum_kernel(void *__restrict__ y, const float *__restrict__ part, int64_t tn, int nch) {
    const int64_t m = V4 ? tn / 4 : tn;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < m; i += (int64_t)gridDim.x * blockDim.x) {
        if (V4) {
            const float4 v = mma_fold_chunks4(reinterpret_cast<const float4 *>(part) + i, m, nch);
            if (F32) {
                reinterpret_cast<float4 *>(y)[i] = v;
            } else {
                const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
                uint2 o;
                o.x = *reinterpret_cast<const uint32_t *>(&lo), o.y = *reinterpret_cast<const uint32_t *>(&hi);
                reinterpret_cast<uint2 *>(y)[i] = o;
            }
        } else {
            const float v = mma_fold_chunks(part + i, tn, nch);
            if (F32) reinterpret_cast<float *>(y)[i] = v;
            else reinterpret_cast<__nv_bfloat16 *>(y)[i] = __float2bfloat16_rn(v);
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * Decode kernel (T <= 256): the same per-output arithmetic as mma_linear_kernel — the same
 * k-permuted activations, the same weight decode into the same fragment registers, per k-block
 * P'_b = mma(mma(0, first 16), second 16) then acc = fma(P'_b, s_w[b], acc) in block order, the
 * same k-chunks (BF16: x as it is, the weights by ldmatrix, one mma accumulation per chunk, as
 * there) — so a row's bits do not depend on which of the two kernels ran it
 * (test_cuda_ops, test_linear_mma_kernels_agree). What changes is the tiling, for weight bandwidth
 * at a handful of rows: one m16 tile (MR = 8: rows 8..15 are zero registers, not shared memory), a
 * CTA of DW warps of one n8 tile each and one k-chunk (grid: n / 16 x chunks, so a [1280, 5120]
 * weight spreads over 400 CTAs), and DKB k-blocks per cp.async stage (8 KB to 13 KB) with up to 4
 * stages; above 16 rows a CTA takes 4 m16 tiles (dcfg). Measured on the H200 before the chunks: 1,
 * 2 or 4 warps per CTA and 4, 8 or 16 blocks per stage all took ~27 µs for [1280, 5120], the time of
 * one CTA's walk over k. Rows are padded (no swizzle): 32 B for FP8 (the lanes' 8-byte reads fall
 * on distinct banks per half warp), 16 B for FP4 and for the activations (ldmatrix rows 16 B apart
 * mod 128). */
constexpr int DW = 2;       /* warps per CTA, one m16 tile */
/* warps per CTA, four m16 tiles (17..64 rows), FP8 and BF16: each stage's 64 activation rows serve
 * 32 weight rows instead of 16 (an FP8 CTA's rows still lie in one 32-row scale group). H200, bench_step decode
 * ms at batch 32 / 64, two runs each: 2 warps 15.55 15.53 / 19.85 19.91, 4 warps 15.08 15.16 /
 * 19.29 19.14 (batch 1 unchanged). Tried at c212148's session and not kept (H100, graph µs a call
 * at T = 64 / 128, base in the same call; results/PERFORMANCE_HISTORY.md): 8 warps (64 weight
 * rows) for FP8 — wkv 11.05 -> 14.80 and shared w1 19.69 -> 21.44 at 64 rows (half the CTAs),
 * shared w1 37.65 -> 27.98 at 128 (the activation re-reads halved), the step ~2 % faster at batch
 * 128 only; and two warps per n8 tile splitting a stage's two k-blocks (the products of the other
 * warp's m16 tiles handed over in shared memory, the same bits) — wq_a 15.45 -> 18.18, a stage's
 * copies, waits and barriers then paid per block. */
constexpr int DW_MT = 4;
/* the decode tiling takes up to MMA_DECODE_MAX_T rows (one or four m16 tiles per CTA, grid z over
 * them: the weights are re-read from L2 per row tile); cuda_linear_mma gives it BF16 and FP4 calls
 * of up to CUDA_MMA_DECODE_AUTO_T (linear_mma.h) rows and the 128 x 128 prefill tile the larger
 * ones, FP8 calls by their shape (fp8_tile, after the tile configurations). The history of that
 * switch, measured on the H200
 * (bench_step, graphs): with the switch at 64 rather than 256, the step at batch 128 29.3 -> 27.0 ms
 * and at batch 256 40.9 -> 34.6 ms (linears 7.4 -> 4.3 ms, shared expert 6.3 -> 3.3 ms), batch 8-64
 * unchanged; at 16, batch 32's linears got slower (2.85 -> 3.12 ms). Once the decode kernel's
 * copies were set up once per chunk (ac0f786) the switch moved to 128: H100, bench_step decode ms
 * at batch 128, three runs alternated, 19.82 19.89 19.89 with the switch at 64, 19.44 19.44 19.67
 * at 128, 19.53 19.51 19.52 at 256 (but batch 256 then 30.8 32.5 28.2 against 26.3 26.2 26.2);
 * bench_linear_cuda at T = 128 (graph µs, prefill tile -> decode tiling) wq_a 28.2 -> 21.6, wkv
 * 27.1 -> 15.0, wq_b 37.1 -> 20.9, wo_b 28.2 -> 19.0, shared w2 41.3 -> 35.8 but w1 30.4 -> 37.7
 * (its 72 row tiles re-read the 128 activation rows from L2, 8x its weight bytes). */
constexpr int64_t MMA_DECODE_MAX_T = 256;
/* FP8 rows per call for each decode form: up to MMA_MT1_T one m16 tile a CTA (8 k-blocks a stage),
 * up to MMA_MT2_T two (4 a stage), above four (2 a stage). A CTA walks its 32-block chunk in
 * stages of one memory latency each, so fewer, larger stages won while the activation rows (64 B a
 * row per block, 4x the FP8 weight rows' 32 B at 64 rows) let them fit: H200, bench_linear_cuda
 * out.csv 16,24,32,48,64 (graph µs a call, wq_a / wkv / wq_b / wo_b / sh_w1 / sh_w2), at T = 32
 * four tiles 18.5 / 15.7 / 16.9 / 19.0 / 22.6 / 24.2, one tile (grid z 2) 16.9 / 10.3 / 14.7 /
 * 13.9 / 23.9 / 25.5, two tiles 12.4 / 10.2 / 11.3 / 12.7 / 15.3 / 17.3; at T = 64 two tiles
 * (grid z 2) 17.0 / 12.3 / 15.8 / 15.3 / 25.2 / 27.1 against four 18.7 / 15.2 / 16.6 / 19.3 /
 * 24.1 / 26.5, but bench_step at batch 64 16.9 against 16.7 ms (sh_w1 and sh_w2, the largest,
 * are slower with two, and they run beside the routed experts), so four stay from 33 rows.
 * bench_step decode ms at batch 32, two runs alternated: 12.15, 12.15 -> 11.13, 11.04. */
constexpr int64_t MMA_MT1_T = 16, MMA_MT2_T = 32;
/* Tried and not kept, twice (at T <= 8 in e0a6b66's session: wq_a T = 8 10.9 -> 35.1 µs; and at
 * the thresholds below): each decode CTA quantizing its own k-chunk's activations into shared
 * memory (mma_quant8, the same bits) instead of the mma_act_quant_kernel launch. Every CTA along n
 * redoes the chunk's quantization (its divisions), and that cost more than the launch it saved:
 * H200 bench_step decode ms at batch 1 / 2 / 4 / 8, separate launch
 * 5.86 / 6.66 / 7.29 / 9.09; fused up to 1 row 5.99 at batch 1, up to 2 rows 5.87 / 6.99, up to
 * 4 rows 5.96 / 7.07 / 8.26, up to 8 rows 5.96 / 7.03 / 8.20 / 11.33. */
/* A decode configuration: MR rows of the one m16 tile (8: rows 8..15 are zero registers) or MT m16
 * tiles per CTA (MT = 4, 64 rows, so a weight is decoded once per 64 rows instead of once per 16 —
 * at T = 256 the one-tile form decoded every weight 16 times and was instruction bound — with 2
 * k-blocks per stage to keep the 64 activation rows of a stage in shared memory; MT = 2, FP8 at 17
 * to 32 rows, 4 blocks a stage). FP8 at MT = 4 has four stages (three before its scales left
 * shared memory): bench_linear_cuda at T = 64, 19.4 / 16.2 / 17.7 / 19.8 µs -> 18.7 / 15.2 / 16.6 /
 * 19.3 for wq_a / wkv / wq_b / wo_b. */
template <int F, int MR, int MT = 1> struct dcfg {
    static constexpr int DKB = MT == 1 ? 8 : (MT == 2 ? 4 : 2); /* k-blocks per stage */
    static constexpr int RM = MT == 1 ? MR : 16 * MT; /* activation rows per CTA */
    static constexpr int WARPS = MT == 1 || F == K_FP4 ? DW : DW_MT; /* one n8 tile each (FP4 at 4: spills at sm_90) */
    static constexpr int BN = 8 * WARPS, THREADS = 32 * WARPS;
    static constexpr int MINB = MT == 2 ? 3 : 0; /* MT = 2: 12 bytes spilled under the SM90 compiler without it */
    static constexpr int B_ROW = F == K_FP8 ? 32 : (F == K_FP4 ? 16 : 64);
    static constexpr int B_LD = DKB * B_ROW + (F == K_FP8 ? 32 : 16); /* BF16: ldmatrix rows 16 B apart mod 128 */
    static constexpr int A_LD = DKB * 64 + 16;
    static constexpr int A_BYTES = RM * A_LD, B_BYTES = BN * B_LD, STAGE_BYTES = A_BYTES + B_BYTES;
    static constexpr int S_ROWS = F == K_FP8 ? 1 : (F == K_FP4 ? BN : 0);
    /* FP4's raw scales sit in shared memory after the stages; FP8's 32 of a chunk are one per lane
     * in a register (shuffled out per block), which leaves four m16 tiles room for a fourth stage */
    static constexpr int S_BYTES = F == K_FP4 ? S_ROWS * KCH : 0;
    static constexpr int ROOM = 48 * 1024 - S_BYTES;
    static constexpr int STAGES = ROOM / STAGE_BYTES > 4 ? 4 : ROOM / STAGE_BYTES;
    static constexpr int A_CHUNKS = RM * DKB * 4, B_CHUNKS = BN * DKB * B_ROW / 16;
    static_assert(STAGES >= 2 && STAGE_BYTES % 16 == 0 && (MR == 8 || MR == 16) &&
                      (MT == 1 || MR == 16),
                  "decode tile");
};


/* A decode kernel's outputs (row, col) and (row, col + 1): the k-chunk blockIdx.y's fp32 partials
 * when part is given (mma_chunk_sum_kernel folds them), else bf16 into y; columns past n skipped. */
__device__ __forceinline__ void decode_store(__nv_bfloat16 *__restrict__ y, float *__restrict__ part, int64_t T,
                                             int64_t n, int64_t row, int64_t col, float v0, float v1, int pair_store) {
    if (part) {
        float *pr = part + ((int64_t)blockIdx.y * T + row) * n;
        if (col < n) pr[col] = v0;
        if (col + 1 < n) pr[col + 1] = v1;
        return;
    }
    __nv_bfloat16 *yr = y + row * n;
    if (pair_store) {
        if (col < n) *reinterpret_cast<__nv_bfloat162 *>(yr + col) = __floats2bfloat162_rn(v0, v1);
    } else {
        if (col < n) yr[col] = __float2bfloat16_rn(v0);
        if (col + 1 < n) yr[col + 1] = __float2bfloat16_rn(v1);
    }
}

template <int F, int MR, int MT>
__global__ void __launch_bounds__(dcfg<F, MR, MT>::THREADS, dcfg<F, MR, MT>::MINB)
    mma_decode_kernel(__nv_bfloat16 *__restrict__ y, float *__restrict__ part, const __nv_bfloat16 *__restrict__ a,
                      const uint8_t *__restrict__ w, const uint8_t *__restrict__ s, int64_t T, int64_t n, int64_t k,
                      int64_t ld_b, int64_t s_ld, int pair_store, dpair pr) {
    using C = dcfg<F, MR, MT>;
    constexpr int STAGES = C::STAGES, B_ROW = C::B_ROW, DKB = C::DKB;
    __shared__ __align__(16) uint8_t smem[STAGES * C::STAGE_BYTES + C::S_BYTES];
    uint8_t *const s_sm = smem + STAGES * C::STAGE_BYTES; /* FP4: raw e8m0 weight scales of the chunk [S_ROWS][KCH] */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int64_t n0 = (int64_t)blockIdx.x * C::BN, m0 = (int64_t)blockIdx.z * (MT * 16); /* grid z: row tiles */
    const int64_t nw0 = n0 + warp * 8; /* the warp's n8 tile */
    const uint8_t *wm, *sm;
    const int64_t nl0 = pair_rows(pr, n0, w, s, &wm, &sm);
    /* this CTA's k-chunk (grid y): blocks [kb0, kb0 + nb); the A and B sources start there */
    const int kb0 = (int)blockIdx.y * KCH, nbt = (int)(k / 32);
    const int nb = nbt - kb0 < KCH ? nbt - kb0 : KCH, nst = (nb + DKB - 1) / DKB;
    const uint8_t *const abase = reinterpret_cast<const uint8_t *>(a);
    const uint32_t sbase = smem_addr(smem);

    /* Per-thread copy assignments, fixed for the chunk (as mma_linear_kernel's): thread tid copies
     * 16-byte chunk ca of activation rows ra0 + u A_RS (u < NA) and chunk cb of weight rows
     * rb0 + u B_RS (u < NBC) into every stage, from offsets set once plus the stage's blocks. Rows
     * past T or n and blocks past nb are zero-filled (src-size 0, the source clamped to the
     * operand's base, which is not read). That is a few instructions a copy; the loop over
     * q = tid, tid + THREADS, .. with its row / chunk divisions per stage, which the compiler did
     * not unroll, was ~30, and this kernel's time is its warps' instruction streams (Nsight on the
     * H100, batch 64, four m16 tiles: 4.25 cycles an instruction, one or two warps a scheduler,
     * DRAM 6-16 %, L2 15-43 %). The stage loop went from ~550 SASS instructions (two k-blocks) to
     * ~200; bench_linear_cuda at T = 64 (H100, graph µs a call) wq_a 18.7 -> 14.4, wkv 15.2 -> 10.8,
     * wq_b 16.9 -> 14.3, wo_b 18.9 -> 14.4, shared w1 23.5 -> 19.5, w2 25.1 -> 22.6.
     * Tried next and not kept: the rows split over more warps (MT / MW warps along the rows of
     * MW m16 tiles each, 48-74 registers): at T = 64 MW = 1 took wq_a 19.6, wo_b 20.0, shared w1
     * 27.6 µs, MW = 2 15.8 / 16.0 / 20.9, against 14.2 / 14.2 / 19.9 for MW = 4 (the fold and the
     * fragment loads per warp do not shrink with the rows); bench_step batch 64 13.65 13.67 ms ->
     * 14.56 14.63 (MW = 1), 13.87 13.84 (MW = 2). */
    constexpr int A_CPR = DKB * 4, BCH = DKB * B_ROW / 16; /* 16-byte chunks per row per stage */
    constexpr int NA = C::A_CHUNKS / C::THREADS, NBC = (C::B_CHUNKS + C::THREADS - 1) / C::THREADS;
    constexpr int A_RS = C::THREADS / A_CPR, B_RS = C::THREADS / BCH;
    static_assert(C::A_CHUNKS % C::THREADS == 0 && (C::B_CHUNKS % C::THREADS == 0 || NBC == 1) &&
                      C::THREADS % A_CPR == 0 && C::THREADS % BCH == 0 && NA <= 32 && NBC <= 32,
                  "decode copy layout: fixed columns a thread, whole chunks (FP4 at four m16 tiles: one or none)");
    const int ca = tid % A_CPR, ra0 = tid / A_CPR, cb = tid % BCH, rb0 = tid / BCH;
    const int ablk = ca / 4, bblk = cb * 16 / B_ROW; /* the chunks' block within a stage */
    const int64_t aoff = (m0 + ra0) * k * 2 + (int64_t)kb0 * 64 + ca * 16, astep = (int64_t)A_RS * k * 2;
    const int64_t boff = (nl0 + rb0) * ld_b + (int64_t)kb0 * B_ROW + cb * 16, bstep = (int64_t)B_RS * ld_b;
    const uint32_t adst = (uint32_t)(ra0 * C::A_LD + ca * 16), bdst = (uint32_t)(C::A_BYTES + rb0 * C::B_LD + cb * 16);
    uint32_t arows = 0, brows = 0; /* bit u: the thread's row u lies inside T (activations), n (weights) */
#pragma unroll
    for (int u = 0; u < NA; u++) arows |= (m0 + ra0 + u * A_RS < T ? 1u : 0u) << u;
#pragma unroll
    for (int u = 0; u < NBC; u++) brows |= (rb0 + u * B_RS < C::BN && n0 + rb0 + u * B_RS < n ? 1u : 0u) << u;

    /* stage st <- k-blocks [DKB·i, DKB·i + DKB) */
    auto load_stage = [&](int st, int i) {
        const uint32_t so = sbase + (uint32_t)(st * C::STAGE_BYTES);
        const int b0 = i * DKB;
        const bool va = b0 + ablk < nb, vb = b0 + bblk < nb;
#pragma unroll
        for (int u = 0; u < NA; u++) {
            const bool v = va && ((arows >> u) & 1u);
            cp_async16(so + adst + (uint32_t)(u * A_RS * C::A_LD), v ? abase + aoff + u * astep + (int64_t)b0 * 64 : abase, v);
        }
#pragma unroll
        for (int u = 0; u < NBC; u++) {
            if (C::B_CHUNKS % C::THREADS != 0 && rb0 >= C::BN) break; /* no chunk for this thread */
            const bool v = vb && ((brows >> u) & 1u);
            cp_async16(so + bdst + (uint32_t)(u * B_RS * C::B_LD), v ? wm + boff + u * bstep + (int64_t)b0 * B_ROW : wm, v);
        }
    };

    /* the CTA's weight scales for its chunk, read once with plain loads while the first stages
     * are in flight: a scale loaded per stage into registers put its latency on every stage.
     * FP8: the CTA's rows lie in one 32-row group, lane b holds block b's (s_lane); FP4: one row
     * each, in shared memory. Rows past n read as scale 0 (never stored). */
    static_assert(KCH == 32, "one FP8 scale per lane");
    float s_lane = 0.0f; /* decoded once here: e8m0f per block and lane cost ~7 instructions a block */
    auto load_scales = [&]() {
        if constexpr (F == K_FP8) {
            s_lane = e8m0f(n0 < n && lane < nb ? (uint32_t)__ldg(sm + (nl0 / 32) * s_ld + kb0 + lane) : 0u);
        } else {
            for (int q = tid; q < C::S_ROWS * KCH; q += C::THREADS) {
                const int r = q / KCH, b = q % KCH;
                const bool ok = n0 + r < n && b < nb;
                s_sm[r * KCH + b] = ok ? __ldg(sm + (nl0 + r) * s_ld + kb0 + b) : (uint8_t)0;
            }
        }
    };
    const int sr0 = warp * 8 + 2 * t, sr1 = sr0 + 1; /* FP4: the lane's scale rows (columns 2t, 2t+1) */

    /* fragment addresses (stage-relative) */
    const uint32_t ldA = MR == 16 ? (uint32_t)((((lane >> 3) & 1) * 8 + (lane & 7)) * C::A_LD + (lane >> 4) * 16)
                                  : (uint32_t)((lane & 7) * C::A_LD + ((lane >> 3) & 1) * 16);
    const int rdB = C::A_BYTES + (warp * 8 + g) * C::B_LD + t * (B_ROW / 4);
    /* BF16 B: ldmatrix.x4 of the warp's n8 rows, lane L addressing row L % 8, 16-byte chunk L / 8
     * (k 8 (L / 8) ..): registers 0-1 feed a block's first mma, 2-3 its second */
    const uint32_t ldBb = (uint32_t)(C::A_BYTES + (warp * 8 + (lane & 7)) * C::B_LD + (lane >> 3) * 16);

    float acc[MT][4];
#pragma unroll
    for (int mi = 0; mi < MT; mi++) acc[mi][0] = acc[mi][1] = acc[mi][2] = acc[mi][3] = 0.0f;
#pragma unroll
    for (int st = 0; st < STAGES - 1; st++) {
        if (st < nst) load_stage(st, st);
        cp_async_commit();
    }
    if (F != K_BF16) load_scales(); /* published by the loop's first __syncthreads */
    for (int i = 0; i < nst; i++) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (i + STAGES - 1 < nst) load_stage((i + STAGES - 1) % STAGES, i + STAGES - 1);
        cp_async_commit();
        const int st = i % STAGES;
        const uint32_t so = sbase + (uint32_t)(st * C::STAGE_BYTES);
        const uint8_t *const sb = smem + st * C::STAGE_BYTES + rdB;
        const int nblk = nb - i * DKB < DKB ? nb - i * DKB : DKB;
        if constexpr (F == K_BF16) {
            /* BF16: the chunk's one accumulation, acc = mma(mma(acc, k 0..15), k 16..31) block by
             * block, as mma_linear_kernel (blocks past nb are not run: a warp-uniform branch) */
#pragma unroll
            for (int j = 0; j < DKB; j++) {
                if (j >= nblk) continue;
                uint32_t b[4];
                ldmatrix_x4(b, so + ldBb + (uint32_t)(j * B_ROW));
#pragma unroll
                for (int mi = 0; mi < MT; mi++) {
                    uint32_t a0[4], a1[4];
                    decode_a_frags<MR>(so + ldA + (uint32_t)(mi * 16 * C::A_LD + j * 64), a0, a1);
                    float *c = acc[mi], d[4];
                    mma_bf16(d, a0[0], a0[1], a0[2], a0[3], b[0], b[1], c[0], c[1], c[2], c[3]);
                    mma_bf16(d, a1[0], a1[1], a1[2], a1[3], b[2], b[3], d[0], d[1], d[2], d[3]);
                    c[0] = d[0], c[1] = d[1], c[2] = d[2], c[3] = d[3];
                }
            }
        } else {
            /* all the stage's block products first (independent mma pairs the warp can keep in
             * flight; blocks past nb multiply zero-filled tiles and are not folded), then the
             * ordered fold: with the fold inside the block loop, in-order issue stalled every block
             * on its mma latency (~260 cycles per block at 1-2 warps per SM) */
            float p[DKB][MT][4];
    #pragma unroll
            for (int j = 0; j < DKB; j++) {
                uint32_t b[4]; /* decoded once, used by every m16 tile of the CTA */
                if (F == K_FP8) {
                    e4m3x8_to_bf16x2(*reinterpret_cast<const uint2 *>(sb + j * B_ROW), b);
                } else {
                    e2m1x8_to_bf16x2(*reinterpret_cast<const uint32_t *>(sb + j * B_ROW), b);
                }
    #pragma unroll
                for (int mi = 0; mi < MT; mi++) {
                    uint32_t a0[4], a1[4];
                    decode_a_frags<MR>(so + ldA + (uint32_t)(mi * 16 * C::A_LD + j * 64), a0, a1);
                    float *pj = p[j][mi];
                    mma_bf16(p[j][mi], a0[0], a0[1], a0[2], a0[3], b[0], b[1], 0.0f, 0.0f, 0.0f, 0.0f);
                    mma_bf16(p[j][mi], a1[0], a1[1], a1[2], a1[3], b[2], b[3], pj[0], pj[1], pj[2], pj[3]);
                }
            }
            /* branch-free: a block past nb multiplied zero-filled tiles (p = 0) and takes scale 0, and
             * acc + 0·0 = acc exactly (acc is never -0: it starts at +0 and a sum is -0 only if both
             * terms are); with a branch per block the compiler rebuilt the scales' address each time */
    #pragma unroll
            for (int j = 0; j < DKB; j++) {
                const int kb = i * DKB + j;
                float q0, q1;
                if constexpr (F == K_FP8) q0 = q1 = __shfl_sync(0xffffffffu, s_lane, kb);
                else q0 = e8m0f(s_sm[sr0 * KCH + kb]), q1 = e8m0f(s_sm[sr1 * KCH + kb]);
                if (j >= nblk) q0 = q1 = 0.0f;
    #pragma unroll
                for (int mi = 0; mi < MT; mi++) {
                    acc[mi][0] = __fmaf_rn(p[j][mi][0], q0, acc[mi][0]);
                    acc[mi][1] = __fmaf_rn(p[j][mi][1], q1, acc[mi][1]);
                    acc[mi][2] = __fmaf_rn(p[j][mi][2], q0, acc[mi][2]);
                    acc[mi][3] = __fmaf_rn(p[j][mi][3], q1, acc[mi][3]);
                }
            }
        }
    }
    cp_async_wait<0>();

    const int64_t col = nw0 + 2 * t;
#pragma unroll
    for (int mh = 0; mh < 2 * MT; mh++) {
        const int mi = mh >> 1, h = mh & 1;
        const int64_t row = m0 + mi * 16 + g + 8 * h;
        if (row < T) decode_store(y, part, T, n, row, col, acc[mi][2 * h], acc[mi][2 * h + 1], pair_store);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Up to 8 rows, FP8 (the linears of a decode step at batch <= 8): the decode kernel's arithmetic and tile
 * (16 weight rows x one k-chunk per CTA, the MR = 8 fragments), with the chunk's blocks spread
 * over four warps per n8 tile. The fold acc = fma(P'_b, s_w[b], acc) must run in block order,
 * but the block products P'_b do not depend on each other: warp (tile j, quarter q) computes
 * P'_b for the chunk's blocks 8q .. 8q + 7 from its own quarter of shared memory, leaves them
 * in shared memory, and one warp per tile folds the 32 in order — the same P'_b, the same fold,
 * so the same bits as mma_decode_kernel (test_linear_mma_kernels_agree). Every quarter's copies
 * are issued before the first wait (one memory latency per CTA). Nsight Compute put the
 * 2-warp form's time in each warp's own instruction stream — ~2,700 issued instructions per warp
 * for wq_a at 3.3 cycles each, not the memory (DRAM 13 %): here a warp issues about a quarter
 * of the block work. H200, bench_step decode ms at batch 1 / 8 / 64, the old and the new binary
 * alternated in one run: 5.94, 5.88 / 9.19, 9.07 / 18.94, 18.89 -> 5.81, 5.82 / 9.10, 9.06 /
 * 19.06, 18.89; wq_a's kernel 8.0 µs (Nsight Compute, clocks as they run). FP4 keeps the 2-warp
 * form: split, bench_linear_cuda's FP4 [2304, 5120] took 12.8 -> 13.2 µs a call (graph, T = 1).
 * (Tried and not kept, before: the 2-warp form issuing its fourth stage with the first three
 * — a whole chunk fits its ring — instead of after the first landed: step unchanged, 6.02 / 9.19
 * / 18.91 -> 6.03 / 9.22 / 18.98 ms. And this kernel quantizing its own A tile from x — each
 * thread loading its 8 values into registers and running mma_quant8 before the shared store, so
 * no mma_act_quant_kernel launch ahead of it (and none in the shared expert): the same bits
 * (test_linear_mma_kernels_agree, GPU golden verify), but bench_step decode ms at batch 1 / 8 /
 * 64, three runs alternated on the H200, 4.79 4.78 4.79 / 7.68 7.70 7.70 / 17.08 17.13 17.13
 * without it -> 5.26 5.31 5.33 / 8.02 8.06 8.06 / 17.04 17.06 17.13 with it.) */
constexpr int SP_TILES = 2;                  /* n8 tiles per CTA (16 weight rows: one FP8 scale group) */
constexpr int SP_Q = 4;                      /* warps per tile, a quarter of the chunk's blocks each */
constexpr int SP_QB = KCH / SP_Q;            /* blocks per quarter */
constexpr int SP_THREADS = 32 * SP_TILES * SP_Q;
struct spcfg { /* FP8 only: the FP4 linears are the routed experts', which have their own kernels */
    static constexpr int B_ROW = 32;                          /* weight bytes per row per block */
    static constexpr int BN = 8 * SP_TILES;
    static constexpr int B_LD = SP_QB * B_ROW + 32;           /* padded as dcfg */
    static constexpr int A_LD = SP_QB * 64 + 16;
    static constexpr int A_BYTES = 8 * A_LD, B_BYTES = BN * B_LD, Q_BYTES = A_BYTES + B_BYTES;
    static constexpr int P_BYTES = SP_TILES * KCH * 32 * 16;  /* P'_b [tile][block][lane] float4 */
    static constexpr int SMEM = SP_Q * Q_BYTES > P_BYTES ? SP_Q * Q_BYTES : P_BYTES;
    static constexpr int A_CHUNKS = 8 * SP_QB * 4, B_CHUNKS = BN * SP_QB * B_ROW / 16; /* per quarter */
    static_assert(A_CHUNKS == SP_THREADS && B_CHUNKS == SP_THREADS && SMEM + 4 * KCH <= 48 * 1024 &&
                      Q_BYTES % 16 == 0 && KCH % SP_Q == 0,
                  "split decode tile");
};

__global__ void __launch_bounds__(SP_THREADS)
    mma_decode_split_kernel(__nv_bfloat16 *__restrict__ y, float *__restrict__ part, const __nv_bfloat16 *__restrict__ a,
                            const uint8_t *__restrict__ w, const uint8_t *__restrict__ s, int64_t T, int64_t n,
                            int64_t k, int64_t ld_b, int64_t s_ld, int pair_store, dpair pr) {
    using C = spcfg;
    constexpr int B_ROW = C::B_ROW;
    __shared__ __align__(16) uint8_t smem[C::SMEM]; /* quarters { A [8][A_LD], B [16][B_LD] }, then P'_b */
    __shared__ float s_sm[KCH]; /* the chunk's weight scales, decoded (its 16 rows: one 32-row group) */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int tile = warp % SP_TILES, quarter = warp / SP_TILES;
    const int64_t n0 = (int64_t)blockIdx.x * C::BN;
    const uint8_t *wm, *sm;
    const int64_t nl0 = pair_rows(pr, n0, w, s, &wm, &sm);
    const int kb0 = (int)blockIdx.y * KCH, nbt = (int)(k / 32);
    const int nb = nbt - kb0 < KCH ? nbt - kb0 : KCH;
    const uint8_t *const abase = reinterpret_cast<const uint8_t *>(a);
    const uint32_t sbase = smem_addr(smem);

    /* every quarter's copies, one 16-byte chunk of A and one of B per thread per quarter; rows
     * past T or n and blocks past nb are zero-filled */
    {
        const int ra = tid / (SP_QB * 4), ca = tid % (SP_QB * 4);
        constexpr int BCH = SP_QB * B_ROW / 16; /* chunks per weight row per quarter */
        const int rb = tid / BCH, cbk = tid % BCH;
#pragma unroll
        for (int qd = 0; qd < SP_Q; qd++) {
            const uint32_t so = sbase + (uint32_t)(qd * C::Q_BYTES);
            const int b0 = qd * SP_QB;
            if (b0 >= nb) break; /* CTA-uniform */
            const bool va = ra < T && b0 + ca / 4 < nb;
            cp_async16(so + (uint32_t)(ra * C::A_LD + ca * 16),
                       va ? abase + ra * k * 2 + (int64_t)(kb0 + b0) * 64 + ca * 16 : abase, va);
            const bool vb = n0 + rb < n && b0 + cbk * 16 / B_ROW < nb;
            cp_async16(so + (uint32_t)(C::A_BYTES + rb * C::B_LD + cbk * 16),
                       vb ? wm + (nl0 + rb) * ld_b + (int64_t)(kb0 + b0) * B_ROW + cbk * 16 : wm, vb);
        }
        cp_async_commit();
    }
    if (tid < KCH) /* as mma_decode_kernel's load_scales; decoded here, off the serial fold below */
        s_sm[tid] = e8m0f(n0 < n && tid < nb ? (uint32_t)__ldg(sm + (nl0 / 32) * s_ld + kb0 + tid) : 0u);
    cp_async_wait<0>();
    __syncthreads();

    /* the quarter's block products (blocks past nb multiply zeros and are never folded) */
    float p[SP_QB][4];
    const bool live = quarter * SP_QB < nb; /* warp-uniform */
    if (live) {
        const uint32_t so = sbase + (uint32_t)(quarter * C::Q_BYTES);
        const uint32_t ldA = (uint32_t)((lane & 7) * C::A_LD + ((lane >> 3) & 1) * 16);
        const uint8_t *const sb = smem + quarter * C::Q_BYTES + C::A_BYTES + (tile * 8 + g) * C::B_LD + t * (B_ROW / 4);
#pragma unroll
        for (int j = 0; j < SP_QB; j++) {
            uint32_t b[4];
            e4m3x8_to_bf16x2(*reinterpret_cast<const uint2 *>(sb + j * B_ROW), b);
            uint32_t a0[4], a1[4];
            decode_a_frags<8>(so + ldA + (uint32_t)(j * 64), a0, a1);
            mma_bf16(p[j], a0[0], a0[1], a0[2], a0[3], b[0], b[1], 0.0f, 0.0f, 0.0f, 0.0f);
            mma_bf16(p[j], a1[0], a1[1], a1[2], a1[3], b[2], b[3], p[j][0], p[j][1], p[j][2], p[j][3]);
        }
    }
    __syncthreads(); /* every quarter read: P'_b goes over them */
    float4 *const P = reinterpret_cast<float4 *>(smem); /* [SP_TILES][KCH][32] */
    if (live)
#pragma unroll
        for (int j = 0; j < SP_QB; j++)
            P[(tile * KCH + quarter * SP_QB + j) * 32 + lane] = make_float4(p[j][0], p[j][1], p[j][2], p[j][3]);
    __syncthreads();
    if (quarter != 0) return;

    /* warp `tile` folds the chunk's blocks in order (the lane's columns 2t, 2t+1; rows g, g + 8) */
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 8
    for (int b = 0; b < nb; b++) {
        const float4 v = P[(tile * KCH + b) * 32 + lane];
        const float q = s_sm[b];
        acc[0] = __fmaf_rn(v.x, q, acc[0]);
        acc[1] = __fmaf_rn(v.y, q, acc[1]);
        acc[2] = __fmaf_rn(v.z, q, acc[2]);
        acc[3] = __fmaf_rn(v.w, q, acc[3]);
    }

    const int64_t col = n0 + tile * 8 + 2 * t;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int64_t row = g + 8 * h;
        if (row < T) decode_store(y, part, T, n, row, col, acc[2 * h], acc[2 * h + 1], pair_store);
    }
}

void launch_decode_split(cudaStream_t st, __nv_bfloat16 *y, float *part, const __nv_bfloat16 *a, const uint8_t *w,
                         const uint8_t *s, int64_t T, int64_t n, int64_t k, int64_t ld_b, int64_t s_ld, int pair,
                         dpair pr) {
    const int64_t nt = (n + spcfg::BN - 1) / spcfg::BN, nch = (k / 32 + KCH - 1) / KCH;
    if (nt > 0x7fffffff || nch > 65535 || T > 8)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda_linear_mma", "n, k or T too large for the grid");
    mma_decode_split_kernel<<<dim3((unsigned)nt, (unsigned)(nch > 0 ? nch : 1)), SP_THREADS, 0, st>>>(
        y, part, a, w, s, T, n, k, ld_b, s_ld, pair, pr);
}

template <int F, int MR, int MT = 1>
void launch_decode(cudaStream_t st, __nv_bfloat16 *y, float *part, const __nv_bfloat16 *a, const uint8_t *w,
                   const uint8_t *s, int64_t T, int64_t n, int64_t k, int64_t ld_b, int64_t s_ld, int pair, dpair pr) {
    using C = dcfg<F, MR, MT>;
    const int64_t nt = (n + C::BN - 1) / C::BN, nch = (k / 32 + KCH - 1) / KCH, mt = (T + C::RM - 1) / C::RM;
    if (nt > 0x7fffffff || nch > 65535 || mt > 65535 || (MR == 8 && T > 8))
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda_linear_mma", "n, k or T too large for the grid");
    mma_decode_kernel<F, MR, MT>
        <<<dim3((unsigned)nt, (unsigned)(nch > 0 ? nch : 1), (unsigned)mt), C::THREADS, 0, st>>>(y, part, a, w, s, T, n,
                                                                                             k, ld_b, s_ld, pair, pr);
}

/* Every 32-bit word of weight codes through the in-register decodes, against tables of the
 * expected bf16 (t2: the 16 e2m1 codes, t8: the 256 e4m3 bytes): FP4, the word's eight e2m1
 * codes (packed into the device layout first, so the layout is checked with the decode); FP8,
 * the word as both halves of a lane's 8 bytes, so every pair of e4m3 bytes at every output
 * position. Counts the words whose decode differs anywhere; the lowest in *first. */
__global__ void mma_decode_check_kernel(unsigned long long *bad, unsigned int *first, const uint16_t *__restrict__ t2,
                                        const uint16_t *__restrict__ t8) {
    __shared__ uint16_t s2[16], s8[256];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        s8[i] = t8[i];
        if (i < 16) s2[i] = t2[i];
    }
    __syncthreads();
    const uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
    for (uint64_t wd = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; wd < (1ull << 32); wd += stride) {
        const uint32_t u = (uint32_t)wd;
        uint32_t o[4], p[4];
        e2m1x8_to_bf16x2(fp4_pack_word(u), o); /* u: the checkpoint's word; the decode reads the device layout */
        e4m3x8_to_bf16x2(make_uint2(u, u), p);
        bool ok = true;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            ok &= (o[i] & 0xffffu) == s2[(u >> (8 * i)) & 15u] && (o[i] >> 16) == s2[(u >> (8 * i + 4)) & 15u];
            const int b = 16 * (i % 2);
            ok &= (p[i] & 0xffffu) == s8[(u >> b) & 255u] && (p[i] >> 16) == s8[(u >> (b + 8)) & 255u];
        }
        if (!ok) {
            atomicAdd(bad, 1ull);
            atomicMin(first, u);
        }
    }
}

} /* namespace */

/* The configurations in use (warps along T, warps along n, n8 tiles per warp, CTAs per SM), tuned
 * on the lent H200 (SM80 code): BF16 8 warps of 64 x 32 (122 registers, two CTAs per SM); FP8 and
 * FP4 4 warps of 128 x 32 (weights decoded once per 128 rows, 255 registers, two CTAs per SM).
 * Nsight Compute on the first FP8 call of a 2K-token prefill ([1280, 5120], tests/gpu/ncu_probe.sh
 * STALLS=1, clocks locked at 1.49 GHz): 161.9 µs, tensor pipe 39.8 % busy, issue slots 42 %, one
 * to two warps a scheduler, the top stall a fixed-latency dependency ("wait", 1.06 cycles an issue).
 * Tried and not kept: the weight scale folded into the B decode (w·s_w is exact in bf16, so the
 * per-block fp32 FMA and the P'_b registers go) with the block sums inside the MMA, (a) over
 * groups of 8 blocks then added in fp32 (two accumulator sets: 8 warps of 128 x 16, 226.6 µs,
 * tensor 28 %, the A fragments' shared-memory reads doubled; or 8 warps of 64 x 32, 230.6 µs) and
 * (b) over the whole 1,024-k chunk in this tile: 150.2 µs (tensor 43 %), the prefill unchanged
 * (127.7 132.6 -> 128.8 127.9 ms), for a new order contract that would make every FP8/FP4 kernel
 * (the decode ones too: no 4-warp spread of a chunk's blocks) sum a chunk as one serial MMA chain.
 * Again at 5319c9e with every FP8 kernel on that contract (the decode tilings too, up to 8 rows the
 * MR = 8 form instead of the split kernel), H100, bench_linear_cuda graph µs a call: 2,048 rows
 * within -5 / +9 % (wq_a 148.8 -> 148.2, sh_w1|w3 464 -> 442, wq_b 134 -> 145), up to 8 rows 15-30 %
 * slower (wq_a T = 1 8.9 -> 10.5, the chain), 64-256 rows within 3 %; bench_step decode ms at batch
 * 1 / 8 / 64 / 256 and the 2K prefill, two runs alternated: 4.20 4.14 / 5.72 5.63 / 11.68 11.67 /
 * 21.43 21.32 / 105.1 104.5 -> 4.35 4.37 / 5.78 5.77 / 11.63 11.62 / 21.35 21.27 / 104.3 103.6
 * (results/cuda_linear_fp8_foldfree_h100.csv, cuda_step_alternated.csv; test_cuda_ops 23/23 on it).
 * Also tried, other FP8 tiles at T = 2,048 (bench_linear_cuda out.csv 2048, graph µs a call for
 * wq_a / wkv / wq_b / wo_b / sh_w1 / sh_w2; this one 147.9 / 74.6 / 127.8 / 124.3 / 234.4 / 264.7,
 * 144–206 TFLOP/s): 4 warps of 64 x 32 (2 x 2, 168 registers, 3 CTAs an SM) 158.9 / 71.4 / 143.3 /
 * 136.7 / 260.7 / 298.2; 4 warps of 128 x 16 (1 x 4, 168 registers, 3 CTAs) 145.2 / 65.5 / 126.0 /
 * 125.7 / 237.9 / 268.5; 8 warps of 64 x 16 (2 x 4, 114 registers) 177.0 / 78.2 / 149.4 / 150.5 /
 * 293.4 / 329.4; the 2K prefill (bench_step, one run each in one device call; this tile 129.2 and
 * 134.5 ms in two runs) 134.8, 132.8 and 140.3 ms, and 138.9 ms for 8 warps of 32 x 32 (4 x 2,
 * 106 registers). The smaller tiles win only on the few-tile wkv and lose on the rest. And this
 * CTA tile as 8 warps of 64 x 32 (2 x 4, 128 registers, each weight decoded by two warps; 16 warps
 * an SM to hide the mma latency), H100, two runs each alternated in one device call: 149.7 / 76.8 /
 * 134.2 / 130.3 / 242.8 / 283.9 -> 175.2 / 90.6 / 159.9 / 151.2 / 288.9 / 337.1 µs, the 2K prefill
 * (bench_step, three runs) 109.5 108.1 109.2 -> 114.9 111.2 114.2 ms. */
typedef cfg<K_BF16, 2, 4, 4, 2> cfg_bf16;
typedef cfg<K_FP8, 1, 4, 4, 2> cfg_fp8;
typedef cfg<K_FP4, 1, 4, 4, 2> cfg_fp4;
/* FP8 tiles narrower than 128 x 128 (the same kernel and order contract, so the same bits: only
 * the grid changes), which CUDA_MMA_AUTO takes by the call's shape (fp8_tile below). Four stages
 * each (40 and 24 KB): their grids of a decode step's 64-512 rows hold one or two CTAs an SM,
 * whose block's math is too short to hide a memory latency behind two blocks in flight. Measured
 * with the FP8 scales moved from a per-block load two blocks ahead (sc_cur / sc_nxt, which tied
 * the depth to 3) to one load per lane and a shuffle a block: H100, bench_linear_cuda out.csv
 * 64,128,256,512,2048, graph µs a call, 5319c9e -> the shuffle -> the shuffle and 4 stages here:
 * the Engram projection [25600, 6144] at 64 rows 148.3 -> 145.6 -> 136.3, 256 rows 425.1 -> 424.4
 * -> 415.8; shared w1 | w3 at 64 rows 24.5 -> 24.1 -> 23.2; the other shapes at 64-512 rows
 * within 2 % either way (6 stages for the 64 x 64 tile: no better); at 2,048 rows (128 x 128, 3
 * stages) the shuffle alone: sh_w1 243.0 -> 232.7, sh_w1 | w3 460.2 -> 438.7, wq_a 149.7 -> 145.0,
 * the Engram projection 2,907 -> 2,793 (results/cuda_linear_stages_h100.csv). bench_step --ctx
 * 64 --batch 64,128,256 --steps 5 --prefill 2048, two runs alternated: 11.83 11.87 / 16.05 16.02
 * / 21.51 21.45 / 104.9 104.2 -> 11.78 11.60 / 15.97 15.95 / 21.32 21.43 / 103.7 104.0 ms. */
typedef cfg<K_FP8, 1, 4, 2, 3, 128, 4> cfg_fp8_n64;         /* 128 x 64: 4 warps of 128 x 16, 168 registers, 3 CTAs an SM */
typedef cfg<K_FP8, 1, 4, 2, 4, 64, 4> cfg_fp8_m64n64;       /* 64 x 64: 4 warps of 64 x 16, ~115 registers, 4 CTAs an SM */
/* BF16 64 x 64 (4 warps of 32 x 32, 5 stages: 40 KB), for a decode step's mHC mixes ([72, 20480],
 * 20 k-chunks), router gate and compressor at 65-512 rows, where the 128 x 128 tile's 30-80 CTAs
 * each walk a k-chunk of 16 KB stages three deep, ~20 µs a call whatever its bytes (Nsight at batch
 * 256: 89 calls, 22.8 µs on average). The same kernel and order contract as every tiling: the same
 * bits (test_linear_mma_forms). CUDA_MMA_AUTO takes it for calls above BF16_NARROW_MIN_T up to
 * CUDA_MMA_NARROW_MAX_T rows whose 128 x 128 grid, counted over full k-chunks, is short of
 * FT_MIN_CTAS (bf16_narrow; above CUDA_MMA_DECODE_AUTO_T = 128 rows when the numbers here were
 * taken). H100, bench_linear_cuda out.csv 256,512 --tiles (graph µs a call,
 * 128 x 128 -> 64 x 64): hc_mix [72, 20480] at 256 rows 23.6 -> 16.9, at 512 23.9 -> 20.9; gate
 * [384, 5120] 26.2 -> 14.1, 27.0 -> 17.8. bench_step --ctx 64 --batch 1,64,128,256 --steps 5
 * --prefill 512, two runs alternated (ab_run.sh): batch 256 19.84 19.98 -> 19.51 19.44 ms, batch
 * 1 / 64 / 128 and the 512-token prefill unchanged (4.01 4.04 / 11.10 10.99 / 15.11 15.18 / 35.1
 * 35.0 -> 4.04 4.01 / 11.19 10.99 / 15.13 15.12 / 35.1 34.4). */
typedef cfg<K_BF16, 2, 2, 4, 4, 64, 5> cfg_bf16_m64n64;

/* Which FP8 tiling CUDA_MMA_AUTO gives a call. A CTA's time is one walk over its k-chunk whatever
 * the tile (a dependent chain at one or two warps a scheduler), so a call's time is the number of
 * waves its grid takes, and a grid of fewer CTAs than the SMs hold leaves them idle. The 128 x 128
 * tile gave a rank's linears at 256 rows grids of 40-180 CTAs (the step's second-largest item at
 * batch 256, 5.7 of 25 ms, ~100 TFLOP/s); the decode tiling's CTAs take 32 weight rows against up
 * to 64 activation rows, so from a few dozen rows its activation traffic from L2 is a multiple of
 * the weights'. So, counting a grid's CTAs over one launch's full k-chunks, up to
 * CUDA_MMA_NARROW_MAX_T rows (a decode step's batch):
 *  - the 128 x 64 tile above 64 rows where its grid has FT_MIN_CTAS;
 *  - else the 64 x 64 tile above 128 rows, and from 32 to 128 rows where its grid has FT_MIN_CTAS
 *    (the shared expert's w1 | w3 pair; the dense [5120, 2304] w2 above 64 rows);
 *  - else the decode tiling;
 * and above it (prefill chunks) the 128 x 128 tile, as before.
 * H100, bench_linear_cuda out.csv T,... --tiles (graph µs a call; 128 x 128 / decode (MT2 or MT4) /
 * 128 x 64 / 64 x 64):
 *   T =  64: w1 | w3 38.9 / 38.1 / 31.7 / 24.2, wq_a 23.6 / 14.2 / 17.8 / 16.6, w2 32.8 / 22.8 / 28.0 / 23.6
 *   T = 128: w1 | w3 43.0 / 65.7 / 35.5 / 41.1, wq_a 27.5 / 21.3 / 19.3 / 18.2, wkv 26.1 / 12.5 / 18.3 / 16.1
 *   T = 256: w1 | w3 70.1 / 121.5 / 66.6 / 75.6, wq_a 30.7 / 38.7 / 25.7 / 27.7, wkv 27.4 / 19.1 / 19.2 / 17.8,
 *            wo_b 31.1 / 34.3 / 26.0 / 24.1, wq_b 37.3 / 34.5 / 25.4 / 24.6, w2 56.3 / 62.0 / 46.2 / 47.0
 *   T = 2,048: wq_a 149.0 / - / 145.7 / 161.0, wkv 76.9 / - / 66.9 / 74.3, w1 240.2 / - / 242.1 / 278.4,
 *            w2 281.2 / - / 278.3 / 303.1, wo_b 129.0 / - / 128.6 / 141.3, wq_b 134.0 / - / 131.0 / 143.0,
 *            w1 | w3 459.0 / - / 474.0 / 551.5, Engram wkv [25600, 6144] 2,910 / - / 3,306 / 4,039.
 * bench_step (binaries alternated twice in one device call, ms at batch 64 / 128 / 256): the 128 x 128
 * tile above 128 rows 12.74 12.85 / 18.30 18.33 / 23.70 23.78 -> these tiles at every T 12.61 12.53
 * / 17.34 17.29 / 22.81 22.82; the decode tiling's two m16 tiles a CTA up to 64 rows instead of 32
 * (MT2 in the table above) as well: 12.51 12.58 / 17.24 17.35 / 22.89 22.86, no better, not kept.
 * Tried and not kept: these tiles in prefill chunks too, with the 128 x 128 one where its grid has
 * 1,400 CTAs (the Engram projection, the w1 | w3 pair): faster a call alone (table), but the
 * 2,048-token prefill 111.3 114.6 -> 116.4 120.1 ms and 8,192 tokens 485 481 -> 507 507 ms (in the
 * prefill the shared expert runs beside the routed experts' kernels); 64 x 128 (4 warps of 64 x 32)
 * and 128 x 64 as 2 x 2 warps of 64 x 32, never the fastest.
 * Tried and not kept, wider: 128 x 256 (8 warps of this 128 x 32 warp tile, one CTA an SM, 48 KB of
 * stages, 255 registers, branch fp8-n256 at f1989f9), which moves a third fewer L2 bytes per FLOP:
 * H100, T = 2,048, graph µs a call 128 x 128 -> 128 x 256: w1 | w3 441 -> 639, wq_a 144 -> 218,
 * wo_b 126 -> 182, Engram wkv 2,776 -> 3,892 (results/cuda_linear_tiles_2048_128x256_h100.csv),
 * the 2K prefill 99.7 100.6 -> 114.6 113.2 ms. With 8 warps an SM and a barrier a stage nothing
 * hides the chain of loads, decodes and mma: the prefill GEMM is latency bound, not L2 bound.
 * Nor is it bound by shared memory: 128 x 128 as 2 x 2 warps of 64 x 64 (two scale groups a warp,
 * branch fp8-w64 at f3290ce / ebd84a1), whose CTA reads 24 KB of shared memory a k-block instead of
 * 36 KB, was 10-30 % slower a call with 3 or 4 stages (w1 | w3 443 -> 519 / 500, wq_a 146 -> 167 /
 * 166, wkv 75 -> 96 / 94 graph µs; results/cuda_linear_tiles_2048_w64_h100.csv), the 2K prefill
 * 95.1 94.6 -> 99.5 98.7 / 98.5 100.2 ms. Nsight Compute on this tile (w1 | w3 at 2,048 rows, H100,
 * clocks locked): tensor pipe 42 % of peak, issue slots 43 %, L2 60 %, shared memory 33 %, 7.8 warps
 * an SM (registers: 255); stalls per issued instruction: fixed-latency wait 1.04, dispatch 0.55,
 * long scoreboard 0.50, not selected 0.36, math pipe 0.35, short scoreboard 0.34.
 * Nor is it the fold's FMA after each block's mma pair: with the block's e8m0 scale multiplied
 * into the decoded weights (2^120 · s_w as the decode's bf16 factor, exact) and the mma chained
 * through acc as BF16's, the tile at 2,048 rows took 3-7 % less (w1 | w3 441 -> 408, wq_a 145 ->
 * 136, w1 231 -> 220 graph µs; results/cuda_linear_tiles_256_2048_{fold,nofold}_h100.csv) and
 * the narrower tiles 0-8 % more or less: not worth a new k order in every tiling (batch
 * invariance), and not kept. */
#define FT_MIN_CTAS 200
enum { FT_DECODE, FT_128x128, FT_128x64, FT_64x64 };
/* a call's full k-chunks (at least 1): the CTAs a grid has per output tile */
static int64_t full_chunks(int64_t k) { return k / 32 / KCH > 0 ? k / 32 / KCH : 1; }
static int fp8_tile(int64_t T, int64_t n, int64_t k) {
    const int64_t full = full_chunks(k);
    if (T > CUDA_MMA_NARROW_MAX_T) return FT_128x128;
    if (T > 64 && (T + 127) / 128 * ((n + 63) / 64) * full >= FT_MIN_CTAS) return FT_128x64;
    if (T > CUDA_MMA_DECODE_AUTO_T) return FT_64x64;
    if (T >= 32 && (T + 63) / 64 * ((n + 63) / 64) * full >= FT_MIN_CTAS) return FT_64x64;
    return FT_DECODE;
}

/* Whether CUDA_MMA_AUTO gives a BF16 call the 64 x 64 tile (cfg_bf16_m64n64): above
 * BF16_NARROW_MIN_T, up to CUDA_MMA_NARROW_MAX_T rows, where the 128 x 128 grid over full k-chunks is
 * short of FT_MIN_CTAS; up to it the decode tiling. H100, graph µs a call (bench_linear_cuda
 * out.csv T,.. and --tiles; results/cuda_linear_auto_32_64_h100.csv, cuda_linear_tiles_32_64_h100.csv,
 * cuda_linear_tiles_64_128_h100.csv), decode / 64 x 64: hc_mix [72, 20480] at 32, 48, 64 rows 10.6 /
 * 11.3, 11.0 / 11.6, 11.4 / 12.3, the gate [384, 5120] 9.3 / 9.9, 9.6 / 10.4, 10.0 / 10.9; at 128
 * rows 64 x 64 takes 12.2 and 11.0 (128 x 128: 20.9 and 22.4). From 129 rows before 65529e5; with
 * 65-128 and two other changes, bench_step at batch 128 14.19 14.28 -> 14.05 14.13 ms (two runs
 * alternated with 5335d12, results/cuda_step_alternated.csv). */
#define BF16_NARROW_MIN_T 64
static bool bf16_narrow(int64_t T, int64_t n, int64_t k) {
    return T > BF16_NARROW_MIN_T && T <= CUDA_MMA_NARROW_MAX_T &&
           (T + 127) / 128 * ((n + 127) / 128) * full_chunks(k) < FT_MIN_CTAS;
}

/* Workspace: the quantized activations [T, k] bf16 (FP8/FP4), then, when k has more than one
 * chunk, the chunks' fp32 partials [nch][T][n]. */
static size_t act_bytes(int64_t T, int64_t k) { return ((size_t)T * (size_t)k * sizeof(uint16_t) + 15) & ~(size_t)15; }
static int64_t n_chunks(int64_t k) { return k > 0 ? (k / 32 + KCH - 1) / KCH : 1; }

extern "C" size_t cuda_linear_mma_act_bytes(int64_t T, int64_t k) { return act_bytes(T, k); }

extern "C" void cuda_linear_mma_act_quant(uint16_t *xq, const uint16_t *x, int64_t T, int64_t k, void *stream) {
    if (k % 32 || ((uintptr_t)x & 15) || ((uintptr_t)xq & 15))
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda_linear_mma_act_quant",
                 "k must be a multiple of 32 and x, xq 16-byte aligned");
    const int64_t n8 = T * k / 8;
    if (n8 <= 0) return;
    mma_act_quant_kernel<<<(unsigned)((n8 + 255) / 256), 256, 0, (cudaStream_t)stream>>>(
        (const __nv_bfloat16 *)x, (__nv_bfloat16 *)xq, n8);
    KERNEL_CHECK();
}

extern "C" void cuda_linear_mma_act_quant_blocks(uint16_t *xq, const uint16_t *xb, int64_t nblk, int64_t T, int64_t k,
                                                 void *stream) {
    if (nblk < 1 || k % nblk || (k / nblk) % 32 || ((uintptr_t)xb & 15) || ((uintptr_t)xq & 15))
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda_linear_mma_act_quant_blocks",
                 "blocks of a multiple of 32 columns and xb, xq 16-byte aligned");
    const int64_t n8 = T * k / 8;
    if (n8 <= 0) return;
    mma_act_quant_blocks_kernel<<<(unsigned)((n8 + 255) / 256), 256, 0, (cudaStream_t)stream>>>(
        (const __nv_bfloat16 *)xb, (__nv_bfloat16 *)xq, n8, k / 8, k / nblk / 8, T);
    KERNEL_CHECK();
}

extern "C" size_t cuda_linear_mma_workspace_bytes(int64_t T, int64_t n, int64_t k) {
    if (T <= 0 || n <= 0 || k <= 0) return 0;
    return act_bytes(T, k) + cuda_linear_mma_bf16_workspace_bytes(T, n, k);
}

extern "C" int64_t cuda_linear_mma_chunks(int64_t k) { return n_chunks(k); }

extern "C" size_t cuda_linear_mma_bf16_workspace_bytes(int64_t T, int64_t n, int64_t k) {
    if (T <= 0 || n <= 0 || k <= 0) return 0;
    const int64_t nch = n_chunks(k);
    return nch > 1 ? (size_t)nch * (size_t)T * (size_t)n * sizeof(float) : 0;
}

extern "C" void cuda_linear_mma(int fmt, uint16_t *y, const uint16_t *x, int64_t T, const void *w, const uint8_t *s,
                                int64_t n, int64_t k, int64_t ld, int64_t s_ld, void *workspace, void *stream) {
    cuda_linear_mma_tiling(CUDA_MMA_AUTO, fmt, y, x, T, w, s, n, k, ld, s_ld, workspace, stream);
}

/* One call: a weight of n rows, or (pr.n1 < n) two weights' rows side by side. */
static void linear_mma_call(int tiling, int fmt, uint16_t *y, const uint16_t *x, int64_t T, const void *w,
                            const uint8_t *s, int64_t n, int64_t k, int64_t ld, int64_t s_ld, void *workspace,
                            void *stream, dpair pr) {
    if (fmt != WF_BF16 && fmt != WF_FP8 && fmt != WF_FP4)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda_linear_mma", "weight format is not BF16, FP8 or FP4");
    const bool prequant = (tiling & CUDA_MMA_PREQUANT) != 0, parts = (tiling & CUDA_MMA_OUT_PARTS) != 0;
    const bool out_f32 = parts || (tiling & CUDA_MMA_OUT_F32) != 0;
    tiling &= ~(CUDA_MMA_PREQUANT | CUDA_MMA_OUT_F32 | CUDA_MMA_OUT_PARTS);
    if (out_f32 && !parts && (fmt != WF_BF16 || pr.n1 < n))
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda_linear_mma", "CUDA_MMA_OUT_F32 is for one BF16 weight");
    /* a forced FP8 decode form: 1, 2 or 4 m16 tiles a CTA (0: the call's own choice) */
    const int form =
        tiling >= CUDA_MMA_DECODE_MT1 && tiling <= CUDA_MMA_DECODE_MT4 ? 1 << (tiling - CUDA_MMA_DECODE_MT1) : 0;
    if (form && fmt != WF_FP8)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda_linear_mma", "a forced decode form is for FP8 weights");
    if (form) tiling = CUDA_MMA_DECODE;
    /* the FP8 prefill tile: forced, or fp8_tile's below (CUDA_MMA_PREFILL: 128 x 128) */
    int ptile = tiling == CUDA_MMA_PREFILL_128x64 ? FT_128x64 : tiling == CUDA_MMA_PREFILL_64x64 ? FT_64x64 : FT_128x128;
    if ((ptile == FT_128x64 && fmt != WF_FP8) || (ptile == FT_64x64 && fmt == WF_FP4))
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda_linear_mma",
                 "a forced 128 x 64 tile is for FP8 weights, a 64 x 64 one for FP8 and BF16");
    if (ptile != FT_128x128) tiling = CUDA_MMA_PREFILL;
    if (tiling < CUDA_MMA_AUTO || tiling > CUDA_MMA_PREFILL)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda_linear_mma", "unknown tiling");
    if (prequant && fmt == WF_BF16)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda_linear_mma", "CUDA_MMA_PREQUANT is for FP8/FP4 weights");
    if (T <= 0 || n <= 0) return;
    if (k < 0 || k % 32 || k / 32 > 0x7fffffff)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda_linear_mma", "k is not a multiple of 32");
    const int64_t ld_b = fmt == WF_BF16 ? ld * 2 : ld;
    const bool quant = fmt != WF_BF16;
    if (((uintptr_t)x & 15) || ((uintptr_t)w & 15) || (ld_b & 15) || (quant && ((uintptr_t)workspace & 15)))
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda_linear_mma",
                 "x, w and workspace must be 16-byte aligned and the weight row stride a multiple of 16 bytes");
    if (k > (1 << 22) || ld_b > (1 << 22) || (quant && s_ld > (1 << 22)))
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda_linear_mma", "k or a row stride above 4 Mi");
    const int64_t nch = n_chunks(k);
    if (quant && !s)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda_linear_mma", "FP8/FP4 need scales");
    if (((quant && !prequant) || (nch > 1 && !parts)) && !workspace)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda_linear_mma",
                 "a workspace of cuda_linear_mma_workspace_bytes is needed (quantized activations, chunk partials)");
    if (nch > 1 && (size_t)nch * (size_t)T * (size_t)n > ((size_t)1 << 40))
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda_linear_mma", "T x n x chunks too large");
    cudaStream_t st = (cudaStream_t)stream;
    const __nv_bfloat16 *a = (const __nv_bfloat16 *)x;
    if (quant && k > 0 && !prequant) {
        cuda_linear_mma_act_quant((uint16_t *)workspace, x, T, k, stream);
        a = (const __nv_bfloat16 *)workspace;
    }
    const int pair = (n % 2 == 0) && (((uintptr_t)y & 3) == 0);
    __nv_bfloat16 *yb = (__nv_bfloat16 *)y;
    const uint8_t *wb = (const uint8_t *)w;
    /* more than one k-chunk: the kernels store each chunk's fp32 partial, then one pass folds them
     * (CUDA_MMA_OUT_PARTS: the caller does) */
    float *part =
        nch > 1 && !parts ? (float *)((uint8_t *)workspace + (quant && !prequant ? act_bytes(T, k) : 0)) : NULL;
    /* fp32 out of one chunk, or the partials wanted as they are: the kernels' partial store is the output */
    float *direct = out_f32 && (nch == 1 || parts) ? (float *)y : NULL;
    /* a pair call takes the prefill tiling only where its seam falls between CTA tiles (any BN) */
    const bool seam_ok = pr.n1 == n || pr.n1 % CUDA_MMA_PAIR_SEAM == 0;
    if (tiling == CUDA_MMA_AUTO && fmt == WF_FP8) {
        ptile = fp8_tile(T, n, k);
        if (!seam_ok && T <= MMA_DECODE_MAX_T) ptile = FT_DECODE;
        tiling = ptile == FT_DECODE ? CUDA_MMA_DECODE : CUDA_MMA_PREFILL;
    }
    if (tiling == CUDA_MMA_AUTO && fmt == WF_BF16 && seam_ok && bf16_narrow(T, n, k)) {
        ptile = FT_64x64;
        tiling = CUDA_MMA_PREFILL;
    }
    const bool decode = tiling == CUDA_MMA_DECODE || (tiling == CUDA_MMA_AUTO && T <= CUDA_MMA_DECODE_AUTO_T);
    if (tiling == CUDA_MMA_DECODE && T > MMA_DECODE_MAX_T)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda_linear_mma", "the decode tiling takes T <= 256");
    if (!decode && !seam_ok)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda_linear_mma_pair",
                 "a pair call of the prefill tiling needs the first weight's rows a multiple of 128");
    float *kpart = part ? part : direct;
    if (decode) { /* decode tiling, the same bits per row (see mma_decode_kernel) */
        if (fmt == WF_BF16) {
            if (T <= 8) launch_decode<K_BF16, 8>(st, yb, kpart, a, wb, s, T, n, k, ld_b, s_ld, pair, pr);
            else if (T <= 16) launch_decode<K_BF16, 16>(st, yb, kpart, a, wb, s, T, n, k, ld_b, s_ld, pair, pr);
            else launch_decode<K_BF16, 16, 4>(st, yb, kpart, a, wb, s, T, n, k, ld_b, s_ld, pair, pr);
        } else if (fmt == WF_FP8) {
            /* m16 tiles a CTA: the forced form, else by T (up to 8 rows the split kernel) */
            const int mt = form ? form : T <= MMA_MT1_T ? 1 : T <= MMA_MT2_T ? 2 : 4;
            if (!form && T <= 8) launch_decode_split(st, yb, kpart, a, wb, s, T, n, k, ld_b, s_ld, pair, pr);
            else if (mt == 1) launch_decode<K_FP8, 16>(st, yb, kpart, a, wb, s, T, n, k, ld_b, s_ld, pair, pr);
            else if (mt == 2) launch_decode<K_FP8, 16, 2>(st, yb, kpart, a, wb, s, T, n, k, ld_b, s_ld, pair, pr);
            else launch_decode<K_FP8, 16, 4>(st, yb, kpart, a, wb, s, T, n, k, ld_b, s_ld, pair, pr);
        } else {
            if (T <= 8) launch_decode<K_FP4, 8>(st, yb, kpart, a, wb, s, T, n, k, ld_b, s_ld, pair, pr);
            else if (T <= 16) launch_decode<K_FP4, 16>(st, yb, kpart, a, wb, s, T, n, k, ld_b, s_ld, pair, pr);
            else launch_decode<K_FP4, 16, 4>(st, yb, kpart, a, wb, s, T, n, k, ld_b, s_ld, pair, pr);
        }
    } else {
        switch (fmt) {
        case WF_BF16:
            if (ptile == FT_64x64) launch<K_BF16, cfg_bf16_m64n64>(st, yb, kpart, a, wb, s, T, n, k, ld_b, s_ld, pair, pr);
            else launch<K_BF16, cfg_bf16>(st, yb, kpart, a, wb, s, T, n, k, ld_b, s_ld, pair, pr);
            break;
        case WF_FP8:
            if (ptile == FT_128x64) launch<K_FP8, cfg_fp8_n64>(st, yb, kpart, a, wb, s, T, n, k, ld_b, s_ld, pair, pr);
            else if (ptile == FT_64x64) launch<K_FP8, cfg_fp8_m64n64>(st, yb, kpart, a, wb, s, T, n, k, ld_b, s_ld, pair, pr);
            else launch<K_FP8, cfg_fp8>(st, yb, kpart, a, wb, s, T, n, k, ld_b, s_ld, pair, pr);
            break;
        default: launch<K_FP4, cfg_fp4>(st, yb, kpart, a, wb, s, T, n, k, ld_b, s_ld, pair, pr); break;
        }
    }
    KERNEL_CHECK();
    if (part) {
        const int64_t tn = T * n;
        const bool v4 = tn % 4 == 0 && ((uintptr_t)part % 16) == 0 && ((uintptr_t)y % (out_f32 ? 16 : 8)) == 0;
        const int64_t blocks = ((v4 ? tn / 4 : tn) + 255) / 256;
        const unsigned grid = (unsigned)(blocks < 4096 ? blocks : 4096);
        if (out_f32 && v4) mma_chunk_sum_kernel<true, true><<<grid, 256, 0, st>>>(y, part, tn, (int)nch);
        else if (out_f32) mma_chunk_sum_kernel<true, false><<<grid, 256, 0, st>>>(y, part, tn, (int)nch);
        else if (v4) mma_chunk_sum_kernel<false, true><<<grid, 256, 0, st>>>(y, part, tn, (int)nch);
        else mma_chunk_sum_kernel<false, false><<<grid, 256, 0, st>>>(y, part, tn, (int)nch);
        KERNEL_CHECK();
    }
}

extern "C" void cuda_linear_mma_tiling(int tiling, int fmt, uint16_t *y, const uint16_t *x, int64_t T, const void *w,
                                       const uint8_t *s, int64_t n, int64_t k, int64_t ld, int64_t s_ld, void *workspace,
                                       void *stream) {
    linear_mma_call(tiling, fmt, y, x, T, w, s, n, k, ld, s_ld, workspace, stream, dpair{nullptr, nullptr, n});
}

extern "C" void cuda_linear_mma_pair(int tiling, int fmt, uint16_t *y, const uint16_t *x, int64_t T, const void *w1,
                                     const uint8_t *s1, int64_t n1, const void *w2, const uint8_t *s2, int64_t n2, int64_t k,
                                     int64_t ld, int64_t s_ld, void *workspace, void *stream) {
    if (n1 <= 0 || n2 <= 0 || n1 % 32 || ((uintptr_t)w2 & 15) || (fmt != WF_BF16 && !s2))
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda_linear_mma_pair",
                 "the first weight's rows must be a positive multiple of 32, the second weight 16-byte aligned with scales");
    linear_mma_call(tiling, fmt, y, x, T, w1, s1, n1 + n2, k, ld, s_ld, workspace, stream,
                    dpair{(const uint8_t *)w2, s2, n1});
}

/* The roof of this file's arithmetic (bench_linear_cuda --mma-peak): mma.sync m16n8k16 bf16 -> fp32
 * issued back to back, ILP independent accumulator chains a warp (the mma's latency hidden by the
 * other chains and warps), operands from the lane id so nothing folds away; one store a thread
 * that a result of exactly 12345 would make (never: the sums are sums of positive products), so
 * the chains stay. On a Hopper card this is the SM80 instruction's rate, not wgmma's (cuBLAS). */
template <int ILP>
__global__ void __launch_bounds__(256) mma_peak_kernel(float *out, int iters) {
    const uint32_t a = 0x3c003c00u + (threadIdx.x & 31), b = 0x3c003c00u + (threadIdx.x >> 5);
    float acc[ILP][4];
#pragma unroll
    for (int j = 0; j < ILP; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    for (int i = 0; i < iters; i++)
#pragma unroll
        for (int j = 0; j < ILP; j++)
            mma_bf16(acc[j], a, a + j, a, a, b, b, acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < ILP; j++) sum += acc[j][0] + acc[j][1] + acc[j][2] + acc[j][3];
    if (sum == 12345.0f) out[threadIdx.x] = sum;
}

extern "C" double cuda_linear_mma_peak_flops(int ilp, int blocks, int iters, float *ms) {
    if (ilp != 2 && ilp != 4 && ilp != 8)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "cuda_linear_mma_peak_flops", "ilp must be 2, 4 or 8");
    float *d_out;
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaMalloc((void **)&d_out, 256 * sizeof(float)));
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    for (int rep = 0; rep < 2; rep++) { /* the first launch warms the clocks and the module */
        CUDA_CHECK(cudaEventRecord(e0, 0));
        if (ilp == 4) mma_peak_kernel<4><<<blocks, 256>>>(d_out, iters);
        else if (ilp == 8) mma_peak_kernel<8><<<blocks, 256>>>(d_out, iters);
        else mma_peak_kernel<2><<<blocks, 256>>>(d_out, iters);
        KERNEL_CHECK();
        CUDA_CHECK(cudaEventRecord(e1, 0));
        CUDA_CHECK(cudaEventSynchronize(e1));
    }
    CUDA_CHECK(cudaEventElapsedTime(ms, e0, e1));
    CUDA_CHECK(cudaEventDestroy(e0));
    CUDA_CHECK(cudaEventDestroy(e1));
    CUDA_CHECK(cudaFree(d_out));
    return 2.0 * 16 * 8 * 16 * (double)ilp * iters * 8.0 * blocks; /* 8 warps a CTA */
}

extern "C" int64_t cuda_linear_mma_decode_check(const uint16_t *t2, const uint16_t *t8, uint32_t *first) {
    unsigned long long *d_bad;
    unsigned int *d_first;
    uint16_t *d_t;
    const unsigned int none = 0xffffffffu;
    CUDA_CHECK(cudaMalloc((void **)&d_bad, sizeof *d_bad));
    CUDA_CHECK(cudaMalloc((void **)&d_first, sizeof *d_first));
    CUDA_CHECK(cudaMalloc((void **)&d_t, (16 + 256) * sizeof(uint16_t)));
    CUDA_CHECK(cudaMemset(d_bad, 0, sizeof *d_bad));
    CUDA_CHECK(cudaMemcpy(d_first, &none, sizeof none, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_t, t2, 16 * sizeof(uint16_t), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(d_t + 16, t8, 256 * sizeof(uint16_t), cudaMemcpyHostToDevice));
    mma_decode_check_kernel<<<2048, 256>>>(d_bad, d_first, d_t, d_t + 16);
    KERNEL_CHECK();
    unsigned long long bad = 0;
    unsigned int f = none;
    CUDA_CHECK(cudaMemcpy(&bad, d_bad, sizeof bad, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(&f, d_first, sizeof f, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaFree(d_bad));
    CUDA_CHECK(cudaFree(d_first));
    CUDA_CHECK(cudaFree(d_t));
    if (first) *first = f;
    return (int64_t)bad;
}
