/* Shared pieces of the CPU reference backend: the prototypes of every op (the table in
 * cpu_backend.c points at them, and the MoE file calls the linears directly), the decode tables
 * for the stored weight encodings, and small numeric helpers. The helpers live here as static
 * inline functions so every file rounds the same way; nothing in this header may introduce a
 * different rounding point than the one backend.h states for the op that uses it. */
#ifndef DS_CPU_INTERNAL_H
#define DS_CPU_INTERNAL_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "formats.h"

/* Output lanes a dense kernel computes together. Each lane is one output with its own sequential
 * sum, so the grouping only lets the compiler use SIMD across outputs; it never changes an order. */
#define CPU_LANES 8

static inline float cpu_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* Width of the vectors torch's fp32 sum used where the golden fixtures were made (AVX-512). */
#define CPU_SUM_LANES 16
/* Σ x[0..n) in the order of the reference's torch sum (cpu_reduce.c). */
float cpu_sum_torch(const float *x, int64_t n);
/* The same order for another vector width (8 = torch on AVX2; used to test the algorithm). */
float cpu_sum_torch_lanes(const float *x, int64_t n, int lanes);

/* Decode tables, built once: e4m3 byte -> value, and one FP4 byte -> (even, odd) values. */
const float *cpu_e4m3_lut(void);
const float *cpu_fp4_pair_lut(void); /* [256][2]: low nibble first */

/* ---- cpu_linear.c ---- */
void cpu_op_linear(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, const struct qweight *W);
void cpu_op_linear_f32(struct backend *be, float *y, const bf16_t *x, int64_t T, const struct qweight *W);
void cpu_op_grouped_linear(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, int64_t G,
                           const struct qweight *W);
void cpu_op_head(struct backend *be, float *logits, const bf16_t *x, int64_t T, const struct qweight *W);
void cpu_op_argmax(struct backend *be, int32_t *out, const float *x, int64_t R, int64_t V);
void cpu_op_row_topk(struct backend *be, struct be_topk_entry *out, const float *x, int64_t R, int64_t V, int64_t k);
void cpu_op_row_lse(struct backend *be, struct be_lse_part *out, const float *x, int64_t R, int64_t V, int64_t ns,
                    const int32_t *target, const float *temp);

/* ---- cpu_elementwise.c ---- */
void cpu_op_rmsnorm(struct backend *be, bf16_t *y, const bf16_t *x, const bf16_t *w, int64_t T, int64_t n,
                    float eps, const struct norm_post *post);
void cpu_op_rope(struct backend *be, bf16_t *x, int64_t T, int64_t nh, int64_t ld_row, int64_t ld_head,
                 int64_t off, int64_t rd, const int32_t *pos, const float *freqs, bool inverse);
void cpu_op_qdq_fp8_32(struct backend *be, bf16_t *x, int64_t n);
void cpu_op_qdq_fp4_32(struct backend *be, bf16_t *x, int64_t n);
void cpu_op_qdq_fp4_16(struct backend *be, bf16_t *x, int64_t n);
void cpu_op_hc_mixes(struct backend *be, float *pre, float *post, float *comb, const bf16_t *X, int64_t T,
                     int64_t hc, int64_t D, const float *fn, const float *scale, const float *base, int iters,
                     float norm_eps, float hc_eps);
void cpu_op_hc_collapse(struct backend *be, bf16_t *y, const bf16_t *X, const float *p, int64_t T, int64_t hc,
                        int64_t D, const bf16_t *norm_w, float eps);
void cpu_op_hc_expand(struct backend *be, bf16_t *Xo, const bf16_t *y, const bf16_t *X, const float *post,
                      const float *comb, int64_t T, int64_t hc, int64_t D, int64_t y_blocks);
void cpu_op_hc_init(struct backend *be, bf16_t *X, float *pre, const bf16_t *e, int64_t T, int64_t hc,
                    int64_t D);
void cpu_op_embed(struct backend *be, bf16_t *e, const int32_t *ids, int64_t T, const bf16_t *table,
                  int64_t row0, int64_t nrows, int64_t D);
void cpu_op_engram_gather(struct backend *be, bf16_t *rows, const int64_t *ids, int64_t T, int64_t C,
                          const uint8_t *table, const uint8_t *scale, int64_t row0, int64_t nrows, int64_t hd);
void cpu_op_engram_gate(struct backend *be, bf16_t *X, const bf16_t *kv, const float *w, int64_t T,
                        int64_t hc, int64_t D, float eps);

/* ---- cpu_attention.c ---- */
void cpu_op_sparse_attn(struct backend *be, bf16_t *o, const bf16_t *q, const bf16_t *kv, const int32_t *idx,
                        int64_t T, int64_t H, int64_t hd, int64_t n_idx, const float *sink, float scale);
void cpu_op_compress_pool(struct backend *be, bf16_t *lat, const float *kv, const float *score, int64_t G,
                          int64_t r, int64_t n);
void cpu_op_index_scores(struct backend *be, float *S, int64_t ld_s, const bf16_t *q, int64_t ld_q,
                         const bf16_t *K, const bf16_t *const *K_rows, const int32_t *nk_rows, const bf16_t *w,
                         float w_scale, const int32_t *visible, int64_t T, int64_t nh, int64_t d, int64_t nk);

/* ---- cpu_index.c ---- */
void cpu_op_index_topk(struct backend *be, int32_t *top, int64_t ld_top, const float *S, int64_t ld_s,
                       const int32_t *p, const uint8_t *mask, int64_t ld_m, int64_t T);
void cpu_op_cand_mask(struct backend *be, uint8_t *mask, int64_t ld_m, const float *S, int64_t ld_s,
                      const int32_t *p, int64_t T, int64_t topk_blocks, int64_t bs);
void cpu_op_attn_index(struct backend *be, int32_t *dst, int64_t n_idx, const int32_t *geo, int64_t T,
                       const struct attn_index_par *par);
void cpu_op_ring_store(struct backend *be, bf16_t *ring, const bf16_t *kv, const int32_t *geo, int64_t T, int64_t W,
                       int64_t hd);

/* ---- cpu_moe.c ---- */
/* The router's selection for one token from its gate logits z [E] (cpu_op_router's per-row step,
 * also the oracle of the GPU selection kernels' test): s [E] = sqrt(softplus(z / temp)) (s may be
 * z itself), the top k of s + bias scanning ids upward with a strictly-greater replace (ties keep
 * the lower id; a NaN first candidate is kept), ir [k] the ids, wr [k] the weights (s, divided by
 * their sum + 1e-20 when norm and k > 1, times route_scale); taken: [E] bytes of scratch. */
void cpu_router_select_row(int32_t *ir, float *wr, float *s, unsigned char *taken, const float *z, const float *bias,
                           int64_t E, int64_t k, float temp, bool norm, float route_scale);
void cpu_op_router(struct backend *be, int32_t *idx, float *wts, const bf16_t *x, int64_t T,
                   const struct qweight *gate, const float *bias, int64_t k, float temp, bool norm,
                   float route_scale);
void cpu_op_moe_experts(struct backend *be, bf16_t *y, const bf16_t *x, const int32_t *idx, const float *wts,
                        int64_t T, int64_t k, int64_t e0, int64_t n_local, const struct qweight *w1,
                        const struct qweight *w3, const struct qweight *w2, float limit);
void cpu_op_moe_combine(struct backend *be, bf16_t *out, const bf16_t *y, const int32_t *idx, const bf16_t *sh,
                        int64_t ld_sh, int64_t T, int64_t k, int64_t D, int64_t per_part, int64_t P);
void cpu_op_interleave(struct backend *be, void *dst, const void *src, int64_t S, int64_t T, size_t bytes);
void cpu_op_shared_expert(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, const struct qweight *w1,
                          const struct qweight *w3, const struct qweight *w2, float limit);

#endif /* DS_CPU_INTERNAL_H */
