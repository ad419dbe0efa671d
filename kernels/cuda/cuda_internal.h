/* Shared pieces of the SM80 backend (kernels/cuda/*.cu): the prototypes of every op (the table in
 * cuda_backend.cu points at them; signatures and numerics exactly as kernels/backend.h states), and
 * the backend's stream and scratch memory. All pointers an op receives are device pointers (or
 * mapped host pointers for host-resident tensors); every op is asynchronous on the backend's
 * stream and must not synchronize the host (the model downloads when it needs a value).
 *
 * Weights after weight_prepare: the same struct qweight, with w/s pointing to device memory laid
 * out compactly (ld = k elements for BF16/F32/FP8 data, ld = k/2 bytes for FP4; s_ld = ceil(k/32)
 * scale bytes per scale row), so kernels may assume ld/s_ld as stored in the struct. */
#ifndef DS_CUDA_INTERNAL_H
#define DS_CUDA_INTERNAL_H

#include "backend.h"
#include "cuda_common.cuh"

extern "C" void ds_err_set(const char *fmt, ...);

/* The backend's stream: every kernel of an op launches on it (inside a branch, the side lane). */
cudaStream_t cuda_be_stream(struct backend *be);
/* Whether a branch has begun and is not yet joined (backend.h's branch ops). */
bool cuda_be_branch_open(struct backend *be);
/* Stream-ordered scratch (zero-filled; freed blocks are kept on a host free list by size and reused
 * by later requests on the stream) and its release; the same as be->ops->alloc / be->ops->free. */
void *cuda_be_scratch(struct backend *be, size_t bytes);
/* The same without the zero fill (the scratch op; for buffers a kernel writes before reading). */
void *cuda_be_scratch_raw(struct backend *be, size_t bytes);
void cuda_be_scratch_free(struct backend *be, void *p);
/* sparse_attn's per-call scratch (the logits, and the tensor-core path's P and rescales) holds at
 * most CUDA_ATTN_SCRATCH_CAP bytes: the rows of a call go through it in slices of this many rows
 * (at least one, at most T) of row_bytes each. */
#define CUDA_ATTN_SCRATCH_CAP ((int64_t)64 << 20)
static inline int64_t cuda_attn_slice_rows(int64_t T, int64_t row_bytes) {
    int64_t rs = CUDA_ATTN_SCRATCH_CAP / row_bytes;
    return rs < 1 ? 1 : (rs > T ? T : rs);
}
/* Multiprocessors of the backend's device (for grid sizing). */
int cuda_be_sms(struct backend *be);
/* Whether FP8/FP4 linears and sparse attention's q·k and P·V take the tensor-core path
 * (backend_cuda_set_mma; on unless --exact-linears). */
bool cuda_be_mma(struct backend *be);
/* A device form an op derived once from a tensor_prepare'd pointer (cudaMalloc'ed; freed with it by
 * tensor_release): set_derived stores it (false when dptr is not a prepared pointer or already has
 * one: the caller keeps and frees it), prep_derived finds it (NULL: none; a short list, walked on
 * every call of the op). */
bool cuda_be_prep_set_derived(struct backend *be, const void *dptr, void *derived);
const void *cuda_be_prep_derived(struct backend *be, const void *dptr);

/* ---- cuda_graph.cu: graph segments (backend.h's graph_begin / graph_end) ---- */
struct cuda_graphs;
bool cuda_graph_begin(struct backend *be, const uint64_t *key, int n_key);
void cuda_graph_end(struct backend *be);
void cuda_graphs_free(struct backend *be); /* every recorded graph (backend_cuda_free) */
/* The backend's graph cache slot, and the recording switch: while on, scratch comes from the
 * recordings' arena (or the graph's own allocations) and host-side ops refuse (cuda_backend.cu);
 * off checks that the recording freed everything it allocated. */
struct cuda_graphs **cuda_be_graphs(struct backend *be);
void cuda_be_set_capturing(struct backend *be, bool on);
/* The recordings' temporaries' arena: grown (true) where a recording wanted more than it holds, the
 * caller having dropped every recorded graph; its size; the most a recording has wanted of it. */
bool cuda_be_garena_grow(struct backend *be);
size_t cuda_be_garena_bytes(struct backend *be);
size_t cuda_be_garena_need(struct backend *be);

/* ---- cuda_linear_ops.cu (dense family; FP8/FP4 decode through linear_sm80.cu) ---- */
void cuda_op_linear(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, const struct qweight *W);
void cuda_op_linear_post(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, const struct qweight *W,
                         const struct linear_post *lp);
void cuda_op_linear_post_pair(struct backend *be, bf16_t *y1, bf16_t *y2, const bf16_t *x, int64_t T,
                              const struct qweight *W1, const struct linear_post *lp1, const struct qweight *W2,
                              const struct linear_post *lp2);
void cuda_op_linear_f32(struct backend *be, float *y, const bf16_t *x, int64_t T, const struct qweight *W);
/* linear_f32's sums as the tensor-core tilings leave them under the mma switch, unfolded
 * (CUDA_MMA_OUT_PARTS): parts [nch][T][n] fp32, whose fold in chunk order (mma_fold_chunks) is
 * linear_f32's y bit for bit. Returns nch, or 0 (nothing written) where linear_f32 would not take
 * the tensor cores (the switch off, F32 weights, shapes the tilings refuse); parts holds
 * cuda_linear_mma_chunks(k) · T · n floats. */
int64_t cuda_linear_f32_parts(struct backend *be, float *parts, const bf16_t *x, int64_t T, const struct qweight *W);
void cuda_op_grouped_linear(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, int64_t G,
                            const struct qweight *W);
void cuda_op_head(struct backend *be, float *logits, const bf16_t *x, int64_t T, const struct qweight *W);
void cuda_op_argmax(struct backend *be, int32_t *out, const float *x, int64_t R, int64_t V);
void cuda_op_row_topk(struct backend *be, struct be_topk_entry *out, const float *x, int64_t R, int64_t V, int64_t k);
void cuda_op_row_lse(struct backend *be, struct be_lse_part *out, const float *x, int64_t R, int64_t V, int64_t ns,
                     const int32_t *target, const float *temp);

/* ---- cuda_elementwise.cu ---- */
/* linear_post's second halves (cuda_op_linear_post): a tensor-core linear's unfolded partials
 * (parts [nch][T][n] fp32, 16-byte aligned) folded as its chunk fold would, then the rmsnorm op
 * with post (rmsnorm_post_kernel's one pass; shapes: cuda_rmsnorm_post_shape), or RoPE on each
 * head of `head` values (the rope op's arithmetic; shapes: cuda_rope_parts_shape). */
/* a norm_post's QDQ (none, FP8 or FP4 per 32) of n values in place, as its own launch */
void cuda_norm_qdq(struct backend *be, bf16_t *y, int64_t n, enum norm_qdq q);
bool cuda_rmsnorm_post_shape(int64_t T, int64_t n, const void *y, const void *w, const struct norm_post *post);
void cuda_rmsnorm_post_parts(struct backend *be, bf16_t *y, const float *parts, int nch, const bf16_t *w, int64_t T,
                             int64_t n, float eps, const struct norm_post *post, void *ya);
/* linear_post_pair's norms, both halves of a pair linear's partials (parts [nch][T][n1 + n2]) in
 * one launch: half 1 without QDQ (ya1: y1's act form, or NULL), half 2 with any */
bool cuda_rmsnorm_post_pair_shape(int64_t T, const float *parts, int64_t n1, const void *y1, const void *w1,
                                  const struct norm_post *p1, const void *ya1, int64_t n2, const void *y2, const void *w2,
                                  const struct norm_post *p2);
void cuda_rmsnorm_post_parts_pair(struct backend *be, const float *parts, int nch, int64_t T, bf16_t *y1,
                                  const bf16_t *w1, int64_t n1, float eps1, const struct norm_post *p1, void *ya1,
                                  bf16_t *y2, const bf16_t *w2, int64_t n2, float eps2, const struct norm_post *p2);
bool cuda_rope_parts_shape(int64_t n, int64_t head, const void *y, const struct norm_post *post);
void cuda_rope_parts(struct backend *be, bf16_t *y, const float *parts, int nch, int64_t T, int64_t n, int64_t head,
                     const struct norm_post *post);
void cuda_op_rmsnorm(struct backend *be, bf16_t *y, const bf16_t *x, const bf16_t *w, int64_t T, int64_t n,
                     float eps, const struct norm_post *post);
void cuda_op_rope(struct backend *be, bf16_t *x, int64_t T, int64_t nh, int64_t ld_row, int64_t ld_head,
                  int64_t off, int64_t rd, const int32_t *pos, const float *freqs, bool inverse);
void cuda_op_qdq_fp8_32(struct backend *be, bf16_t *x, int64_t n);
void cuda_op_qdq_fp4_32(struct backend *be, bf16_t *x, int64_t n);
void cuda_op_qdq_fp4_16(struct backend *be, bf16_t *x, int64_t n);
void cuda_op_embed(struct backend *be, bf16_t *e, const int32_t *ids, int64_t T, const bf16_t *table,
                   int64_t row0, int64_t nrows, int64_t D);
void cuda_op_engram_gather(struct backend *be, bf16_t *rows, const int64_t *ids, int64_t T, int64_t C,
                           const uint8_t *table, const uint8_t *scale, int64_t row0, int64_t nrows, int64_t hd);
void cuda_op_engram_gate(struct backend *be, bf16_t *X, const bf16_t *kv, const float *w, int64_t T,
                         int64_t hc, int64_t D, float eps);
void cuda_op_interleave(struct backend *be, void *dst, const void *src, int64_t S, int64_t T, size_t bytes);

/* ---- cuda_mhc.cu ---- */
void cuda_op_hc_mixes(struct backend *be, float *pre, float *post, float *comb, const bf16_t *X, int64_t T,
                      int64_t hc, int64_t D, const float *fn, const float *scale, const float *base, int iters,
                      float norm_eps, float hc_eps);
void cuda_op_hc_prepare(struct backend *be, const float *fn, int64_t hc, int64_t D);
void cuda_op_hc_collapse(struct backend *be, bf16_t *y, const bf16_t *X, const float *p, int64_t T, int64_t hc,
                         int64_t D, const bf16_t *norm_w, float eps);
void cuda_op_hc_collapse_act(struct backend *be, bf16_t *y, void *ya, const bf16_t *X, const float *p, int64_t T,
                             int64_t hc, int64_t D, const bf16_t *norm_w, float eps);
void cuda_op_hc_expand(struct backend *be, bf16_t *Xo, const bf16_t *y, const bf16_t *X, const float *post,
                       const float *comb, int64_t T, int64_t hc, int64_t D, int64_t y_blocks);
void cuda_op_hc_expand_collapse(struct backend *be, bf16_t *Xo, const bf16_t *yin, const bf16_t *X, const float *post,
                                const float *comb, int64_t y_blocks, bf16_t *y, void *ya, const float *p,
                                const bf16_t *norm_w, float eps, int64_t T, int64_t hc, int64_t D);
void cuda_op_hc_init(struct backend *be, bf16_t *X, float *pre, const bf16_t *e, int64_t T, int64_t hc,
                     int64_t D);

/* ---- cuda_attention.cu ---- */
void cuda_op_sparse_attn(struct backend *be, bf16_t *o, const bf16_t *q, const bf16_t *kv, const int32_t *idx,
                         int64_t T, int64_t H, int64_t hd, int64_t n_idx, const float *sink, float scale);
void cuda_op_sparse_attn_rope(struct backend *be, bf16_t *o, const bf16_t *q, const bf16_t *kv, const int32_t *idx,
                              int64_t T, int64_t H, int64_t hd, int64_t n_idx, const float *sink, float scale,
                              const struct attn_rope *r);
void cuda_op_compress_pool(struct backend *be, bf16_t *lat, const float *kv, const float *score, int64_t G,
                           int64_t r, int64_t n);
void cuda_op_index_scores(struct backend *be, float *S, int64_t ld_s, const bf16_t *q, int64_t ld_q,
                          const bf16_t *K, const bf16_t *const *K_rows, const int32_t *nk_rows, const bf16_t *w,
                          float w_scale, const int32_t *visible, int64_t T, int64_t nh, int64_t d, int64_t nk);

/* ---- cuda_index.cu ---- */
void cuda_op_index_topk(struct backend *be, int32_t *top, int64_t ld_top, const float *S, int64_t ld_s,
                        const int32_t *p, const uint8_t *mask, int64_t ld_m, int64_t T);
void cuda_op_cand_mask(struct backend *be, uint8_t *mask, int64_t ld_m, const float *S, int64_t ld_s,
                       const int32_t *p, int64_t T, int64_t topk_blocks, int64_t bs);
void cuda_op_attn_index(struct backend *be, int32_t *dst, int64_t n_idx, const int32_t *geo, int64_t T,
                        const struct attn_index_par *par);
void cuda_op_ring_store(struct backend *be, bf16_t *ring, const bf16_t *kv, const int32_t *geo, int64_t T, int64_t W,
                        int64_t hd);

/* ---- cuda_moe.cu ---- */
void cuda_op_router(struct backend *be, int32_t *idx, float *wts, const bf16_t *x, int64_t T,
                    const struct qweight *gate, const float *bias, int64_t k, float temp, bool norm,
                    float route_scale);
void cuda_op_moe_experts(struct backend *be, bf16_t *y, const bf16_t *x, const int32_t *idx, const float *wts,
                         int64_t T, int64_t k, int64_t e0, int64_t n_local, const struct qweight *w1,
                         const struct qweight *w3, const struct qweight *w2, float limit);
void cuda_op_moe_combine(struct backend *be, bf16_t *out, const bf16_t *y, const int32_t *idx, const bf16_t *sh,
                         int64_t ld_sh, int64_t T, int64_t k, int64_t D, int64_t per_part, int64_t P);
void cuda_op_shared_expert(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, const struct qweight *w1,
                           const struct qweight *w3, const struct qweight *w2, float limit);
void cuda_op_shared_expert_act(struct backend *be, bf16_t *y, const bf16_t *x, const void *xa, int64_t T,
                               const struct qweight *w1, const struct qweight *w3, const struct qweight *w2, float limit);

/* ---- moe_mma_sm80.cu: moe_experts on the tensor cores (cuda_op_moe_experts calls it when the mma
 * switch is on, after checking the shapes) ---- */
void cuda_moe_mma_experts(struct backend *be, bf16_t *y, const bf16_t *x, const int32_t *idx, const float *wts,
                          int64_t T, int64_t k, int64_t e0, int64_t n_local, const struct qweight *w1,
                          const struct qweight *w3, const struct qweight *w2, float limit);

/* ---- attention_mma_sm80.cu: sparse_attn on the tensor cores (cuda_op_sparse_attn calls it when the
 * mma switch is on), with rope (NULL: none) sparse_attn_rope's RoPE in its stores; false, with
 * nothing launched, where the shape or alignment does not fit it (hd % 64, 16-byte aligned q, kv
 * and o; rope's pairs): the exact kernels then run ---- */
bool cuda_sparse_attn_mma(struct backend *be, bf16_t *o, const bf16_t *q, const bf16_t *kv, const int32_t *idx,
                          int64_t T, int64_t H, int64_t hd, int64_t n_idx, const float *sink, float scale,
                          const struct attn_rope *rope);

/* backend.h's linear_cols (cuda_linear_ops.cu); false, with nothing launched, where it does not
 * take the call (the caller interleaves, then runs linear) */
bool cuda_op_linear_cols(struct backend *be, bf16_t *y, const bf16_t *xb, int64_t nblk, int64_t T,
                         const struct qweight *W);

/* backend.h's sparse_attn_index (attention_mma_sm80.cu): the tensor-core forms with their entries
 * formed from the rows' geometry; false, with nothing launched, where they do not take the call */
bool cuda_op_sparse_attn_index(struct backend *be, bf16_t *o, const bf16_t *q, const bf16_t *kv, const int32_t *geo,
                               const struct attn_index_par *par, int64_t T, int64_t H, int64_t hd, int64_t n_idx,
                               const float *sink, float scale, const struct attn_rope *r);

#endif /* DS_CUDA_INTERNAL_H */
