/* C interface of the SM80 tensor-core linear (kernels/cuda/linear_mma_sm80.cu): the default path of
 * the FP8 / FP4 linears at every T (and a BF16 one), callable from host C (no CUDA headers needed).
 * Pointers are device pointers; shapes and semantics as kernels/backend.h states for `linear`:
 * y[T, n] bf16 = x[T, k] bf16 · Wᵀ, FP8/FP4 with the reference's per-32 FP8 activation
 * quantization and per-k-block scaled partials summed in block order within fixed k-chunks of
 * 1,024 values, the chunks in order (BF16: one fp32 sum per chunk).
 * Not bit-identical to the CPU backend: the two mma.sync of a 32-wide k-block sum their products
 * in the tensor core's order (BF16: the whole k sum goes through the mma accumulator), see the
 * top of the .cu file. Batch invariant: an output's roundings depend only on its row of x and
 * its row of W (never on T, on the other rows of the call, or on the grid). */
#ifndef DS_CUDA_LINEAR_MMA_H
#define DS_CUDA_LINEAR_MMA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Device workspace cuda_linear_mma needs for T rows of k: the quantized activations, T*k bf16
 * (FP8/FP4; BF16 needs none but the size is the same for every format). */
size_t cuda_linear_mma_workspace_bytes(int64_t T, int64_t n, int64_t k);
/* The same for a BF16 weight alone: the k-chunks' fp32 partials (0 for a single chunk; the
 * workspace pointer may then be NULL). */
size_t cuda_linear_mma_bf16_workspace_bytes(int64_t T, int64_t n, int64_t k);

/* fmt: enum wfmt of kernels/backend.h (WF_BF16, WF_FP8, WF_FP4; WF_F32 is refused).
 *  WF_FP8: w = e4m3 [n, ld bytes], s = e8m0 [ceil(n/32), s_ld] (one per 32x32 tile);
 *  WF_FP4: w = packed e2m1 [n, ld bytes] in the device layout (fp4_layout.h: weight_prepare's,
 *          or cuda_fp4_pack of the checkpoint's low-nibble-first words), s = e8m0 [n, s_ld];
 *  WF_BF16: w = bf16 [n, ld elements], s unused (may be NULL).
 * x [T, k] bf16 (contiguous), y [T, n] bf16. k a multiple of 32; x, w and workspace 16-byte
 * aligned and the weight row stride (ld bytes; ld * 2 for BF16) a multiple of 16 — true of every
 * weight weight_prepare lays out. Any T >= 1, any n >= 1 (T or n of 0: nothing is done).
 * Asynchronous on `stream` (a cudaStream_t; NULL = the legacy default stream). */
void cuda_linear_mma(int fmt, uint16_t *y, const uint16_t *x, int64_t T, const void *w, const uint8_t *s, int64_t n,
                     int64_t k, int64_t ld, int64_t s_ld, void *workspace, void *stream);

/* The same with the tiling chosen by the caller (benchmarks): CUDA_MMA_AUTO is cuda_linear_mma's
 * choice (BF16 and FP4: the decode tiling up to 128 rows, the 128 x 128 tiling above; FP8: by the
 * call's shape, the decode tiling or a 128 x 64 or 64 x 64 tile, fp8_tile in the .cu),
 * CUDA_MMA_DECODE the decode tiling (T <= 256), CUDA_MMA_PREFILL the 128 x 128 tiling at any T;
 * FP8 only, CUDA_MMA_DECODE_MT1 / _MT2 / _MT4 the decode tiling with one, two or four m16 tiles a
 * CTA whatever T (<= 256; at T <= 8 too, instead of the split kernel) and CUDA_MMA_PREFILL_128x64
 * / _64x64 those tiles at any T (_64x64 for BF16 too), for benchmarks that choose the forms' row
 * ranges. Every choice gives a row the same bits. */
enum {
    CUDA_MMA_AUTO = 0,
    CUDA_MMA_DECODE = 1,
    CUDA_MMA_PREFILL = 2,
    CUDA_MMA_DECODE_MT1 = 3,
    CUDA_MMA_DECODE_MT2 = 4,
    CUDA_MMA_DECODE_MT4 = 5,
    CUDA_MMA_PREFILL_128x64 = 6,
    CUDA_MMA_PREFILL_64x64 = 7
};
#define CUDA_MMA_DECODE_AUTO_T 128 /* CUDA_MMA_AUTO's decode tiling takes calls of up to this many rows */
/* FP8 calls of up to this many rows (a decode step's batch) take the tile CUDA_MMA_AUTO picks by
 * their shape, larger ones (prefill chunks) the 128 x 128 tile; the shared expert pairs w1 and w3
 * up to here (cuda_moe.cu) */
#define CUDA_MMA_NARROW_MAX_T 512
/* A pair call (below) whose first weight's rows are a multiple of this has its seam between the
 * CTA tiles of every prefill tile (128 x 128, 128 x 64, 64 x 64), so it may take them; any other
 * seam keeps the decode tiling (T <= 256) and is refused above. */
#define CUDA_MMA_PAIR_SEAM 128
/* OR'ed into `tiling` (FP8/FP4 only): x is the quantized form cuda_linear_mma_act_quant made, so
 * the call skips its own act quant (callers that feed one x to several weights quantize it once);
 * the workspace then only holds the k-chunks' partials. The same bits. */
#define CUDA_MMA_PREQUANT 0x100
/* OR'ed into `tiling` (BF16 only, not the pair call): y is fp32 [T, n], the chunks' sum unrounded
 * (the head's logits): one chunk's accumulator is stored as it is, more are folded in chunk order
 * as for bf16 outputs, without the final rounding to bf16. */
#define CUDA_MMA_OUT_F32 0x200
/* OR'ed into `tiling` (any format, the pair call too): y is fp32 [nch][T][n], each k-chunk's
 * accumulator as it is, unfolded (nch = cuda_linear_mma_chunks(k)), for a caller that folds them
 * into its own pass (the mHC mixes, the router's selection, the shared expert's SwiGLU: one launch
 * fewer each); the fold y = ((y_0 + y_1) + y_2) + ... in fp32, then bf16_rn for a bf16 output,
 * gives the bits of the call without the flag. The workspace then holds only FP8/FP4's quantized
 * activations (none with CUDA_MMA_PREQUANT or BF16: it may be NULL). */
#define CUDA_MMA_OUT_PARTS 0x400
/* the number of k-chunks (1,024 values each, the last one shorter) a call of this k sums */
int64_t cuda_linear_mma_chunks(int64_t k);
void cuda_linear_mma_tiling(int tiling, int fmt, uint16_t *y, const uint16_t *x, int64_t T, const void *w,
                            const uint8_t *s, int64_t n, int64_t k, int64_t ld, int64_t s_ld, void *workspace,
                            void *stream);

/* Two weights on one x in one launch (the shared expert's w1 and w3: at a handful of rows each
 * call is one memory latency and a launch, whatever its size; at more, one grid of twice the
 * CTAs): y [T, n1 + n2], row t = (x_t · W1ᵀ, x_t · W2ᵀ), each output with the bits
 * cuda_linear_mma_tiling gives it. W1 [n1, k] and W2 [n2, k] of one format, row stride (ld) and
 * scale stride (s_ld); n1 a multiple of 32, and of CUDA_MMA_PAIR_SEAM for the prefill tiling
 * (CUDA_MMA_AUTO keeps other seams on the decode tiling, T <= 256); the workspace is
 * cuda_linear_mma_workspace_bytes(T, n1 + n2, k). */
void cuda_linear_mma_pair(int tiling, int fmt, uint16_t *y, const uint16_t *x, int64_t T, const void *w1,
                          const uint8_t *s1, int64_t n1, const void *w2, const uint8_t *s2, int64_t n2, int64_t k,
                          int64_t ld, int64_t s_ld, void *workspace, void *stream);

/* The FP8/FP4 tilings' activation form of x [T, k] bf16 (the reference's per-32 act quant,
 * dequantized exactly into bf16 and k-permuted within each group of 32): xq [T, k], 16-byte
 * aligned, cuda_linear_mma_act_bytes(T, k) bytes. */
size_t cuda_linear_mma_act_bytes(int64_t T, int64_t k);
void cuda_linear_mma_act_quant(uint16_t *xq, const uint16_t *x, int64_t T, int64_t k, void *stream);
/* The same xq from x's nblk column blocks xb [nblk, T, k / nblk] (k / nblk a multiple of 32; x is
 * their row interleave, as the interleave op forms it), each value read where its block holds it:
 * the same bits as interleaving, then cuda_linear_mma_act_quant, one launch fewer. */
void cuda_linear_mma_act_quant_blocks(uint16_t *xq, const uint16_t *xb, int64_t nblk, int64_t T, int64_t k,
                                      void *stream);

/* Test hook: the FP4 and FP8 weight decodes of the tensor-core kernels over every 32-bit word of
 * codes, against t2 [16] (bf16 of each e2m1 code) and t8 [256] (bf16 of each e4m3 byte, 0x7F /
 * 0xFF as +-480): the number of words decoded differently (0 expected), the lowest in *first
 * (NULL: not wanted). Synchronous, on the legacy default stream. */
int64_t cuda_linear_mma_decode_check(const uint16_t *t2, const uint16_t *t8, uint32_t *first);

/* The mma.sync m16n8k16 bf16 rate (bench_linear_cuda --mma-peak): `blocks` CTAs of 8 warps, each
 * warp `iters` rounds of ilp (2, 4 or 8) independent mma chains, timed by events (*ms, the second of
 * two launches). Returns the FLOPs of that launch (2 x 16 x 8 x 16 a mma). */
double cuda_linear_mma_peak_flops(int ilp, int blocks, int iters, float *ms);

#ifdef __cplusplus
}
#endif

#endif /* DS_CUDA_LINEAR_MMA_H */
