/* Sizing of the tensor-core routed experts (kernels/cuda/moe_mma_sm80.cu), in plain C so that the
 * planner (src/plan.c) counts the same temporaries the GPU path allocates. The decode path works
 * through the call in passes of at most moe_mma_pass_tokens tokens: each pass keeps, per local pair, the
 * fp32 partial sums of its k-chunks (gate/up: 2I outputs x ceil(D / 1024) chunks; down: Dout
 * outputs x ceil(I / 1024) chunks, the same buffer reused) and the quantized h row, and the pass
 * is sized so that this stays under MOE_MMA_PASS_BYTES. Rows are independent, so the pass size
 * changes no bit of any output. */
#ifndef DS_MOE_MMA_H
#define DS_MOE_MMA_H

#include <stdint.h>

#define MOE_MMA_PASS_BYTES ((int64_t)160 << 20)
#define MOE_MMA_KCHUNK 1024 /* values per k-chunk: the tensor-core linears' order contract */

static inline int64_t moe_mma_chunks(int64_t k) { return (k + MOE_MMA_KCHUNK - 1) / MOE_MMA_KCHUNK; }

/* fp32 partial values per pair: the larger of the gate/up and the down projection's */
static inline int64_t moe_mma_part_per_pair(int64_t D, int64_t I, int64_t Dout) {
    int64_t a = moe_mma_chunks(D) * 2 * I, b = moe_mma_chunks(I) * Dout;
    return a > b ? a : b;
}

/* Tokens of one pass for a call of T tokens with k slots each (>= 1). */
static inline int64_t moe_mma_pass_tokens(int64_t T, int64_t k, int64_t D, int64_t I, int64_t Dout) {
    int64_t per_pair = moe_mma_part_per_pair(D, I, Dout) * 4 + I * 2;
    int64_t t = MOE_MMA_PASS_BYTES / (per_pair * (k > 0 ? k : 1));
    if (t < 1) t = 1;
    return t < T ? t : T;
}

static inline int64_t moe_mma_align(int64_t b) { return (b + 255) & ~(int64_t)255; }

#define MOE_MMA_TILE 8 /* pairs per tile: one n8 mma tile (moe_mma_sm80.cu) */

/* The most tiles of at most P pairs of one expert that M pairs over n_local experts can make:
 * sum over experts of ceil(cnt / P) <= (M + min(n_local, M) (P - 1)) / P. */
static inline int64_t moe_tiles_max(int64_t M, int64_t n_local, int64_t P) {
    int64_t busy = n_local < M ? n_local : M;
    return (M + busy * (P - 1) + P - 1) / P;
}

/* Calls of more than MOE_MMA_DECODE_T tokens (prefill chunks) take the prefill path: tiles of up
 * to MOE_WIDE_TILE pairs, each CTA over the whole of k, no partials in memory. It needs
 * I % 32 == 0 (a CTA's 32 columns of h are one quantization group). Same bits either way; at
 * decode sizes it was slower at every batch on the H200 (moe_experts b64 10.1 -> 17.2 ms a step),
 * and still is with its branch-free main loop (0d2cb3e): H100, bench_moe at 64 / 128 / 256 tokens
 * 0.343 / 0.442 / 0.535 ms a call here, 0.496 / 0.646 / 0.738 with the threshold at 32; bench_step
 * batch 64 / 128 / 256 12.9 / 17.7 / 23.1 -> 16.3 / 21.9 / 28.0 ms (a pass's 1-4 pairs an expert
 * leave one m16 tile a CTA mostly empty, where the decode path's n8 tiles of pairs fit them). Above
 * 256 the prefill path wins: the decode path up to 4,096 tokens took 0.956 / 1.053 / 2.073 / 4.006 ms
 * a call at 384 / 512 / 1,024 / 2,048 tokens against 0.757 / 0.756 / 0.837 / 0.967 (H100, bench_moe),
 * and a 2K prompt in 512-token chunks 187.1 187.4 against 165.7 165.4 ms (bench_step --chunk 512). */
#define MOE_MMA_DECODE_T 256
#define MOE_WIDE_TILE 64

static inline int moe_mma_is_wide(int64_t T, int64_t I) { return T > MOE_MMA_DECODE_T && I % 32 == 0; }

/* The decode path's CTA: MOE_MMA_CTA_WARPS warps of 16 weight rows each over one k-chunk, at every
 * batch (same bits with any split: per-chunk partials; a row's sums do not depend on the CTA that
 * computes them). Until now calls of 16 tokens and more took CTAs of 8 warps that ran every chunk
 * of their rows in turn (each CTA's prologue, ~3 dependent loads before the activations, paid once
 * per row tile; an older kernel's decode step on the H200 at batch 1 / 8 / 64 / 256: one chunk
 * 6.62 / 9.54 / 20.61 / 34.10 ms, all chunks 6.77 / 9.51 / 19.36 / 31.12). With today's kernel on
 * the H100 those CTAs were too few and too long: at batch 64 the gate/up grid has ~32 tiles x 36
 * row tiles = ~1,150 working CTAs for 528 slots, 2.2 waves of whole-k CTAs, and Nsight showed 54 %
 * of DRAM bandwidth with 26 % of the warps' stall samples at the stage's cp.async wait (long
 * scoreboard) and barrier. bench_moe (ms a call at 16 / 64 / 128 / 256 tokens, two runs each in
 * one device call, H100): all chunks, 8 warps 0.140 / 0.342 / 0.438 / 0.535; one chunk, 8 warps
 * 0.113 / 0.284 / 0.383 / 0.467; one chunk, 4 warps 0.112 / 0.282 / 0.372 / 0.454; two chunks, 8
 * warps 0.128 / 0.309 / 0.412 / 0.495; three 0.136 / 0.325 / 0.420 / 0.504. bench_step decode ms
 * at batch 16 / 64 / 128 / 256: 7.30 7.31 / 12.62 12.61 / 17.36 17.32 / 22.76 22.63 -> (one chunk,
 * 4 warps) 7.18 7.03 / 11.84 11.69 / 16.03 15.97 / 21.53 21.38. */
#define MOE_MMA_CTA_WARPS 4

/* Tokens of one prefill-path pass: its quantized x, plan entries and quantized h under
 * MOE_MMA_PASS_BYTES. */
static inline int64_t moe_wide_pass_tokens(int64_t T, int64_t k, int64_t D, int64_t I) {
    int64_t per_token = D * 2 + k * (I * 2 + 4 + 8);
    int64_t t = MOE_MMA_PASS_BYTES / per_token;
    if (t < 1) t = 1;
    return t < T ? t : T;
}

/* Device scratch of one call of T tokens. Decode path: the plan (int32 [2 (n_local + 1) + Tp k])
 * and its tile table (int2 per tile), the quantized x of a pass [Tp, D] bf16, the quantized h
 * [Tp k, I] bf16 and the partials [Tp k, part_per_pair] fp32. Prefill path: the same less the
 * partials, with its own pass size. */
static inline int64_t moe_mma_workspace_bytes(int64_t T, int64_t k, int64_t n_local, int64_t D, int64_t I,
                                              int64_t Dout) {
    const int wide = moe_mma_is_wide(T, I);
    int64_t tp = wide ? moe_wide_pass_tokens(T, k, D, I) : moe_mma_pass_tokens(T, k, D, I, Dout), m = tp * k;
    int64_t b = moe_mma_align(4 * (2 * (n_local + 1) + m)) +
                moe_mma_align(8 * moe_tiles_max(m, n_local, wide ? MOE_WIDE_TILE : MOE_MMA_TILE)) +
                moe_mma_align(tp * D * 2) + moe_mma_align(m * I * 2);
    return wide ? b : b + moe_mma_align(m * moe_mma_part_per_pair(D, I, Dout) * 4);
}

/* The most any call of at most T tokens needs (the planner's bound: decode steps and prefill
 * chunks take different paths). */
static inline int64_t moe_mma_workspace_max(int64_t T, int64_t k, int64_t n_local, int64_t D, int64_t I, int64_t Dout) {
    int64_t a = moe_mma_workspace_bytes(T, k, n_local, D, I, Dout);
    if (T > MOE_MMA_DECODE_T) {
        int64_t b = moe_mma_workspace_bytes(MOE_MMA_DECODE_T, k, n_local, D, I, Dout);
        if (b > a) a = b;
    }
    return a;
}

#endif /* DS_MOE_MMA_H */
