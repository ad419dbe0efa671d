/* C interface of the tensor-core sparse attention's forms (kernels/cuda/attention_mma_sm80.cu), for
 * the benchmarks and tests that compare them; the engine reaches them through the backend's
 * sparse_attn op (mma switch on), which takes CUDA_ATTN_AUTO. Every form computes every output
 * with the same operations in the same order (the block-64 online softmax of backend.h with q·k
 * and P·V on mma.sync), so they give the same bits; they differ in how the work is spread and how
 * often the kv rows are read:
 *  CUDA_ATTN_TWO_PASS: the scores of every (row, entry) first (attn_qk_mma_kernel), then the
 *      softmax and P·V (one launch up to 127 rows, two from 128): the rows are read twice;
 *  CUDA_ATTN_ONE_PASS: a CTA per (row, 8 heads) takes the blocks of 64 entries in order, scores,
 *      softmax and P·V of a block before the next, so a row's kv rows are read from memory once
 *      (the P·V re-read comes from the cache) — needs hd <= 512;
 *  CUDA_ATTN_AUTO: one pass from 80 rows (decode batches, whose rows are each their own sequence,
 *      and prefill chunks alike), two passes below (a handful of rows: a row's blocks one after the
 *      other in one CTA take longer than the two passes spread over many CTAs) and where the one
 *      pass does not fit. */
#ifndef DS_CUDA_ATTN_MMA_H
#define DS_CUDA_ATTN_MMA_H

#include <stdbool.h>
#include <stdint.h>

#include "backend.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { CUDA_ATTN_AUTO = 0, CUDA_ATTN_TWO_PASS = 1, CUDA_ATTN_ONE_PASS = 2 };

/* backend.h's sparse_attn on the tensor cores in the given form, on the backend's stream, and with
 * rope (NULL or rd 0: none) sparse_attn_rope's RoPE applied as o is stored; false, with nothing
 * launched, where the shape or alignment does not fit the form (hd % 64, hd > 4096 or, one pass,
 * > 512; q, kv and o 16-byte aligned; rope's off and rd even, within hd). */
bool cuda_sparse_attn_mma_path(struct backend *be, int path, bf16_t *o, const bf16_t *q, const bf16_t *kv,
                               const int32_t *idx, int64_t T, int64_t H, int64_t hd, int64_t n_idx, const float *sink,
                               float scale, const struct attn_rope *rope);

/* The same over the entries attn_index would build from geo and par (backend.h's
 * sparse_attn_index: each formed as the kernels read it, no list in memory), with the same bits as
 * attn_index's lists through the form above; false, with nothing launched, where that form refuses
 * the call or par has no window (W <= 0) or a k without its src. */
bool cuda_sparse_attn_index_path(struct backend *be, int path, bf16_t *o, const bf16_t *q, const bf16_t *kv,
                                 const int32_t *geo, const struct attn_index_par *par, int64_t T, int64_t H, int64_t hd,
                                 int64_t n_idx, const float *sink, float scale, const struct attn_rope *rope);

#ifdef __cplusplus
}
#endif

#endif
