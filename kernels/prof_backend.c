/* A profiling decorator for any backend: the same op table, each op timed by the host clock
 * from its call until the inner backend's sync returns. It answers "where does a step's time go"
 * without a GPU profiler on the machine: the per-op sums are kernel time plus one launch each, and
 * the step's unprofiled time minus their sum is what the host adds between ops (index-list
 * building, the model's own bookkeeping). Allocations and frees are counted and timed too. The
 * syncs serialize the ops, so a profiled step is slower than a real one; only the split is meant,
 * never the total. With a device clock (prof_backend_init_device) an op is instead charged the
 * device time between two marks recorded around it in stream order, nothing serialized: the
 * step minus the ops' sum is then the time the device sat idle between ops. */
#include "prof_backend.h"

#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <time.h>

struct prof_span {
    int op, a, b; /* an op between device marks a and b, read at the next report */
};

struct prof {
    struct backend *inner;
    bool sync; /* false: host time inside each call only (prof_backend_init_host) */
    struct prof_clock clk; /* mark != NULL: device clock (prof_backend_init_device) */
    struct prof_span *spans;
    int n_spans, cap_spans;
    struct backend_ops ops;
    double sec[PROF_N_OPS_PUBLIC];
    long calls[PROF_N_OPS_PUBLIC];
};

enum prof_op {
    PROF_LINEAR,
    PROF_LINEAR_POST,
    PROF_LINEAR_F32,
    PROF_GROUPED_LINEAR,
    PROF_HEAD,
    PROF_ARGMAX,
    PROF_ROW_LSE,
    PROF_ROW_TOPK,
    PROF_RMSNORM,
    PROF_ROPE,
    PROF_QDQ_FP8_32,
    PROF_QDQ_FP4_32,
    PROF_QDQ_FP4_16,
    PROF_HC_MIXES,
    PROF_HC_COLLAPSE,
    PROF_HC_EXPAND,
    PROF_HC_INIT,
    PROF_EMBED,
    PROF_ENGRAM_GATHER,
    PROF_ENGRAM_GATE,
    PROF_SPARSE_ATTN,
    PROF_SPARSE_ATTN_ROPE,
    PROF_COMPRESS_POOL,
    PROF_INDEX_SCORES,
    PROF_ROUTER,
    PROF_MOE_EXPERTS,
    PROF_MOE_COMBINE,
    PROF_SHARED_EXPERT,
    PROF_INTERLEAVE,
    PROF_LINEAR_COLS,
    PROF_COPY,
    PROF_UPLOAD,
    PROF_DOWNLOAD,
    PROF_COPY_SEGS,
    PROF_INDEX_TOPK,
    PROF_CAND_MASK,
    PROF_ATTN_INDEX,
    PROF_SPARSE_ATTN_INDEX,
    PROF_RING_STORE,
    PROF_ALLOC,
    PROF_FREE,
    PROF_SCRATCH,
    PROF_N_OPS
};

_Static_assert(PROF_N_OPS == PROF_N_OPS_PUBLIC, "prof_backend.h's op count is stale");
static const char *const prof_names[PROF_N_OPS] = {"linear", "linear_post", "linear_f32", "grouped_linear", "head", "argmax", "row_lse", "row_topk", "rmsnorm", "rope", "qdq_fp8_32", "qdq_fp4_32", "qdq_fp4_16", "hc_mixes", "hc_collapse", "hc_expand", "hc_init", "embed", "engram_gather", "engram_gate", "sparse_attn", "sparse_attn_rope", "compress_pool", "index_scores", "router", "moe_experts", "moe_combine", "shared_expert", "interleave", "linear_cols", "copy", "upload", "download", "copy_segs", "index_topk", "cand_mask", "attn_index", "sparse_attn_index", "ring_store", "alloc", "free", "scratch"};

static struct prof *PR(struct backend *be) { return (struct prof *)be->priv; }

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* the inner backend is drained first, so an op is charged only for itself (device clock: a mark,
 * whose index stands in for the start time) */
static double prof_begin(struct backend *be) {
    struct prof *p = PR(be);
    if (p->clk.mark) return (double)p->clk.mark(p->clk.ctx);
    if (p->sync) p->inner->ops->sync(p->inner);
    return now_s();
}

static void prof_end(struct backend *be, int op, double t0) {
    struct prof *p = PR(be);
    p->calls[op]++;
    if (p->clk.mark) {
        if (p->n_spans == p->cap_spans) {
            p->cap_spans = p->cap_spans ? 2 * p->cap_spans : 4096;
            p->spans = realloc(p->spans, sizeof *p->spans * (size_t)p->cap_spans);
            if (!p->spans) abort();
        }
        p->spans[p->n_spans++] = (struct prof_span){op, (int)t0, p->clk.mark(p->clk.ctx)};
        return;
    }
    if (p->sync) p->inner->ops->sync(p->inner);
    p->sec[op] += now_s() - t0;
}

/* allocations are counted and timed like ops: on a GPU each is host work (and a zero fill) */
static void *prof_alloc(struct backend *be, size_t b) {
    double t0 = prof_begin(be);
    void *p = PR(be)->inner->ops->alloc(PR(be)->inner, b);
    prof_end(be, PROF_ALLOC, t0);
    return p;
}
/* free and scratch enqueue nothing a device clock could time (on the GPU a free-list entry):
 * with one they are only counted, rather than charged the two marks' own ~1.5 us */
static void prof_free(struct backend *be, void *p) {
    if (PR(be)->clk.mark) {
        PR(be)->inner->ops->free(PR(be)->inner, p);
        PR(be)->calls[PROF_FREE]++;
        return;
    }
    double t0 = prof_begin(be);
    PR(be)->inner->ops->free(PR(be)->inner, p);
    prof_end(be, PROF_FREE, t0);
}
static void *prof_scratch(struct backend *be, size_t b) {
    if (PR(be)->clk.mark) {
        PR(be)->calls[PROF_SCRATCH]++;
        return PR(be)->inner->ops->scratch(PR(be)->inner, b);
    }
    double t0 = prof_begin(be);
    void *p = PR(be)->inner->ops->scratch(PR(be)->inner, b);
    prof_end(be, PROF_SCRATCH, t0);
    return p;
}
static void prof_copy_segs(struct backend *be, const struct copy_seg *segs, int64_t n) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->copy_segs(PR(be)->inner, segs, n);
    prof_end(be, PROF_COPY_SEGS, t0);
}
static void prof_upload(struct backend *be, void *d, const void *s, size_t b) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->upload(PR(be)->inner, d, s, b);
    prof_end(be, PROF_UPLOAD, t0);
}
static void prof_download(struct backend *be, void *d, const void *s, size_t b) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->download(PR(be)->inner, d, s, b);
    prof_end(be, PROF_DOWNLOAD, t0);
}
static void prof_copy(struct backend *be, void *d, const void *s, size_t b) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->copy(PR(be)->inner, d, s, b);
    prof_end(be, PROF_COPY, t0);
}
static void prof_sync(struct backend *be) { PR(be)->inner->ops->sync(PR(be)->inner); }
static int prof_weight_prepare(struct backend *be, struct qweight *w, bool dq) { return PR(be)->inner->ops->weight_prepare(PR(be)->inner, w, dq); }
static void prof_weight_release(struct backend *be, struct qweight *w) { PR(be)->inner->ops->weight_release(PR(be)->inner, w); }
static const void *prof_tensor_prepare(struct backend *be, const void *h, size_t b, bool r) { return PR(be)->inner->ops->tensor_prepare(PR(be)->inner, h, b, r); }
static void prof_tensor_release(struct backend *be, const void *p) { PR(be)->inner->ops->tensor_release(PR(be)->inner, p); }

static void prof_linear(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, const struct qweight *W) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->linear(PR(be)->inner, y, x, T, W);
    prof_end(be, PROF_LINEAR, t0);
}
/* the inner backend's fused op, or its ops in turn (be_linear_post), charged as one */
static void prof_linear_post(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, const struct qweight *W,
                             const struct linear_post *lp) {
    double t0 = prof_begin(be);
    be_linear_post(PR(be)->inner, y, x, T, W, lp);
    prof_end(be, PROF_LINEAR_POST, t0);
}
/* both linear_posts in one op where the inner backend has one (be_linear_post_pair), charged as
 * linear_post */
static void prof_linear_post_pair(struct backend *be, bf16_t *y1, bf16_t *y2, const bf16_t *x, int64_t T,
                                  const struct qweight *W1, const struct linear_post *lp1, const struct qweight *W2,
                                  const struct linear_post *lp2) {
    double t0 = prof_begin(be);
    be_linear_post_pair(PR(be)->inner, y1, y2, x, T, W1, lp1, W2, lp2);
    prof_end(be, PROF_LINEAR_POST, t0);
}
static void prof_linear_f32(struct backend *be, float *y, const bf16_t *x, int64_t T, const struct qweight *W) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->linear_f32(PR(be)->inner, y, x, T, W);
    prof_end(be, PROF_LINEAR_F32, t0);
}
static void prof_grouped_linear(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, int64_t G, const struct qweight *W) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->grouped_linear(PR(be)->inner, y, x, T, G, W);
    prof_end(be, PROF_GROUPED_LINEAR, t0);
}
static void prof_head(struct backend *be, float *logits, const bf16_t *x, int64_t T, const struct qweight *W) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->head(PR(be)->inner, logits, x, T, W);
    prof_end(be, PROF_HEAD, t0);
}
static void prof_rmsnorm(struct backend *be, bf16_t *y, const bf16_t *x, const bf16_t *w, int64_t T, int64_t n, float eps, const struct norm_post *post) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->rmsnorm(PR(be)->inner, y, x, w, T, n, eps, post);
    prof_end(be, PROF_RMSNORM, t0);
}
static void prof_argmax(struct backend *be, int32_t *out, const float *x, int64_t R, int64_t V) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->argmax(PR(be)->inner, out, x, R, V);
    prof_end(be, PROF_ARGMAX, t0);
}
static void prof_row_lse(struct backend *be, struct be_lse_part *out, const float *x, int64_t R, int64_t V, int64_t ns, const int32_t *target, const float *temp) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->row_lse(PR(be)->inner, out, x, R, V, ns, target, temp);
    prof_end(be, PROF_ROW_LSE, t0);
}
static void prof_row_topk(struct backend *be, struct be_topk_entry *out, const float *x, int64_t R, int64_t V, int64_t k) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->row_topk(PR(be)->inner, out, x, R, V, k);
    prof_end(be, PROF_ROW_TOPK, t0);
}
static void prof_rope(struct backend *be, bf16_t *x, int64_t T, int64_t nh, int64_t ld_row, int64_t ld_head, int64_t off, int64_t rd, const int32_t *pos, const float *freqs, bool inverse) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->rope(PR(be)->inner, x, T, nh, ld_row, ld_head, off, rd, pos, freqs, inverse);
    prof_end(be, PROF_ROPE, t0);
}
static void prof_qdq_fp8_32(struct backend *be, bf16_t *x, int64_t n) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->qdq_fp8_32(PR(be)->inner, x, n);
    prof_end(be, PROF_QDQ_FP8_32, t0);
}
static void prof_qdq_fp4_32(struct backend *be, bf16_t *x, int64_t n) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->qdq_fp4_32(PR(be)->inner, x, n);
    prof_end(be, PROF_QDQ_FP4_32, t0);
}
static void prof_qdq_fp4_16(struct backend *be, bf16_t *x, int64_t n) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->qdq_fp4_16(PR(be)->inner, x, n);
    prof_end(be, PROF_QDQ_FP4_16, t0);
}
static void prof_hc_mixes(struct backend *be, float *pre, float *post, float *comb, const bf16_t *X, int64_t T, int64_t hc, int64_t D, const float *fn, const float *scale, const float *base, int iters, float norm_eps, float hc_eps) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->hc_mixes(PR(be)->inner, pre, post, comb, X, T, hc, D, fn, scale, base, iters, norm_eps, hc_eps);
    prof_end(be, PROF_HC_MIXES, t0);
}
static void prof_hc_prepare(struct backend *be, const float *fn, int64_t hc, int64_t D) {
    if (PR(be)->inner->ops->hc_prepare) PR(be)->inner->ops->hc_prepare(PR(be)->inner, fn, hc, D);
}
static void prof_hc_collapse(struct backend *be, bf16_t *y, const bf16_t *X, const float *p, int64_t T, int64_t hc, int64_t D, const bf16_t *norm_w, float eps) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->hc_collapse(PR(be)->inner, y, X, p, T, hc, D, norm_w, eps);
    prof_end(be, PROF_HC_COLLAPSE, t0);
}
/* the activation forms as the inner backend has them (none: 0 bytes, so the model asks for none),
 * the collapse that writes one charged as hc_collapse */
static size_t prof_act_bytes(struct backend *be, int64_t T, int64_t k) {
    const struct backend_ops *o = PR(be)->inner->ops;
    return o->act_bytes && o->hc_collapse_act ? o->act_bytes(PR(be)->inner, T, k) : 0;
}
static void prof_hc_collapse_act(struct backend *be, bf16_t *y, void *ya, const bf16_t *X, const float *p, int64_t T,
                                 int64_t hc, int64_t D, const bf16_t *norm_w, float eps) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->hc_collapse_act(PR(be)->inner, y, ya, X, p, T, hc, D, norm_w, eps);
    prof_end(be, PROF_HC_COLLAPSE, t0);
}
static void prof_hc_expand(struct backend *be, bf16_t *Xo, const bf16_t *y, const bf16_t *X, const float *post, const float *comb, int64_t T, int64_t hc, int64_t D, int64_t y_blocks) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->hc_expand(PR(be)->inner, Xo, y, X, post, comb, T, hc, D, y_blocks);
    prof_end(be, PROF_HC_EXPAND, t0);
}
/* the expand and the collapse in one op where the inner backend has one (be_hc_expand_collapse),
 * charged as hc_expand */
static void prof_hc_expand_collapse(struct backend *be, bf16_t *Xo, const bf16_t *yin, const bf16_t *X,
                                    const float *post, const float *comb, int64_t y_blocks, bf16_t *y, void *ya,
                                    const float *p, const bf16_t *norm_w, float eps, int64_t T, int64_t hc, int64_t D) {
    double t0 = prof_begin(be);
    be_hc_expand_collapse(PR(be)->inner, Xo, yin, X, post, comb, y_blocks, y, ya, p, norm_w, eps, T, hc, D);
    prof_end(be, PROF_HC_EXPAND, t0);
}
static void prof_hc_init(struct backend *be, bf16_t *X, float *pre, const bf16_t *e, int64_t T, int64_t hc, int64_t D) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->hc_init(PR(be)->inner, X, pre, e, T, hc, D);
    prof_end(be, PROF_HC_INIT, t0);
}
static void prof_embed(struct backend *be, bf16_t *e, const int32_t *ids, int64_t T, const bf16_t *table, int64_t row0, int64_t nrows, int64_t D) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->embed(PR(be)->inner, e, ids, T, table, row0, nrows, D);
    prof_end(be, PROF_EMBED, t0);
}
static void prof_engram_gather(struct backend *be, bf16_t *rows, const int64_t *ids, int64_t T, int64_t C, const uint8_t *table, const uint8_t *scale, int64_t row0, int64_t nrows, int64_t hd) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->engram_gather(PR(be)->inner, rows, ids, T, C, table, scale, row0, nrows, hd);
    prof_end(be, PROF_ENGRAM_GATHER, t0);
}
static void prof_engram_gate(struct backend *be, bf16_t *X, const bf16_t *kv, const float *w, int64_t T, int64_t hc, int64_t D, float eps) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->engram_gate(PR(be)->inner, X, kv, w, T, hc, D, eps);
    prof_end(be, PROF_ENGRAM_GATE, t0);
}
static void prof_sparse_attn(struct backend *be, bf16_t *o, const bf16_t *q, const bf16_t *kv, const int32_t *idx, int64_t T, int64_t H, int64_t hd, int64_t n_idx, const float *sink, float scale) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->sparse_attn(PR(be)->inner, o, q, kv, idx, T, H, hd, n_idx, sink, scale);
    prof_end(be, PROF_SPARSE_ATTN, t0);
}
/* the inner backend's fused op, or its ops in turn (be_sparse_attn_rope), charged as one */
static void prof_sparse_attn_rope(struct backend *be, bf16_t *o, const bf16_t *q, const bf16_t *kv, const int32_t *idx,
                                  int64_t T, int64_t H, int64_t hd, int64_t n_idx, const float *sink, float scale,
                                  const struct attn_rope *r) {
    double t0 = prof_begin(be);
    be_sparse_attn_rope(PR(be)->inner, o, q, kv, idx, T, H, hd, n_idx, sink, scale, r);
    prof_end(be, PROF_SPARSE_ATTN_ROPE, t0);
}
static void prof_compress_pool(struct backend *be, bf16_t *lat, const float *kv, const float *score, int64_t G, int64_t r, int64_t n) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->compress_pool(PR(be)->inner, lat, kv, score, G, r, n);
    prof_end(be, PROF_COMPRESS_POOL, t0);
}
static void prof_index_scores(struct backend *be, float *S, int64_t ld_s, const bf16_t *q, int64_t ld_q, const bf16_t *K, const bf16_t *const *K_rows, const int32_t *nk_rows, const bf16_t *w, float w_scale, const int32_t *visible, int64_t T, int64_t nh, int64_t d, int64_t nk) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->index_scores(PR(be)->inner, S, ld_s, q, ld_q, K, K_rows, nk_rows, w, w_scale, visible, T, nh, d, nk);
    prof_end(be, PROF_INDEX_SCORES, t0);
}
static void prof_router(struct backend *be, int32_t *idx, float *wts, const bf16_t *x, int64_t T, const struct qweight *gate, const float *bias, int64_t k, float temp, bool norm, float route_scale) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->router(PR(be)->inner, idx, wts, x, T, gate, bias, k, temp, norm, route_scale);
    prof_end(be, PROF_ROUTER, t0);
}
static void prof_moe_experts(struct backend *be, bf16_t *y, const bf16_t *x, const int32_t *idx, const float *wts, int64_t T, int64_t k, int64_t e0, int64_t n_local, const struct qweight *w1, const struct qweight *w3, const struct qweight *w2, float limit) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->moe_experts(PR(be)->inner, y, x, idx, wts, T, k, e0, n_local, w1, w3, w2, limit);
    prof_end(be, PROF_MOE_EXPERTS, t0);
}
static void prof_moe_combine(struct backend *be, bf16_t *out, const bf16_t *y, const int32_t *idx, const bf16_t *sh, int64_t ld_sh, int64_t T, int64_t k, int64_t D, int64_t per_part, int64_t P) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->moe_combine(PR(be)->inner, out, y, idx, sh, ld_sh, T, k, D, per_part, P);
    prof_end(be, PROF_MOE_COMBINE, t0);
}
static void prof_shared_expert(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, const struct qweight *w1, const struct qweight *w3, const struct qweight *w2, float limit) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->shared_expert(PR(be)->inner, y, x, T, w1, w3, w2, limit);
    prof_end(be, PROF_SHARED_EXPERT, t0);
}
/* xa is optional to shared_expert_act: an inner backend without the op quantizes x itself */
static void prof_shared_expert_act(struct backend *be, bf16_t *y, const bf16_t *x, const void *xa, int64_t T,
                                   const struct qweight *w1, const struct qweight *w3, const struct qweight *w2,
                                   float limit) {
    double t0 = prof_begin(be);
    struct backend *in = PR(be)->inner;
    if (in->ops->shared_expert_act)
        in->ops->shared_expert_act(in, y, x, xa, T, w1, w3, w2, limit);
    else
        in->ops->shared_expert(in, y, x, T, w1, w3, w2, limit);
    prof_end(be, PROF_SHARED_EXPERT, t0);
}
static void prof_interleave(struct backend *be, void *dst, const void *src, int64_t S, int64_t T, size_t bytes) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->interleave(PR(be)->inner, dst, src, S, T, bytes);
    prof_end(be, PROF_INTERLEAVE, t0);
}

static void prof_index_topk(struct backend *be, int32_t *top, int64_t ld_top, const float *S, int64_t ld_s, const int32_t *p, const uint8_t *mask, int64_t ld_m, int64_t T) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->index_topk(PR(be)->inner, top, ld_top, S, ld_s, p, mask, ld_m, T);
    prof_end(be, PROF_INDEX_TOPK, t0);
}
static void prof_cand_mask(struct backend *be, uint8_t *mask, int64_t ld_m, const float *S, int64_t ld_s, const int32_t *p, int64_t T, int64_t topk_blocks, int64_t bs) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->cand_mask(PR(be)->inner, mask, ld_m, S, ld_s, p, T, topk_blocks, bs);
    prof_end(be, PROF_CAND_MASK, t0);
}
/* the inner backend's op where it takes the call; false otherwise, and be_linear_cols then runs
 * interleave and linear through this backend */
static bool prof_linear_cols(struct backend *be, bf16_t *y, const bf16_t *xb, int64_t S, int64_t T,
                             const struct qweight *W) {
    struct backend *in = PR(be)->inner;
    if (!in->ops->linear_cols) return false;
    double t0 = prof_begin(be);
    const bool ok = in->ops->linear_cols(in, y, xb, S, T, W);
    if (ok) prof_end(be, PROF_LINEAR_COLS, t0);
    return ok;
}
/* the inner backend's op where it takes the call (charged as one); false otherwise, and
 * be_sparse_attn_index then runs attn_index and sparse_attn_rope through this backend */
static bool prof_sparse_attn_index(struct backend *be, bf16_t *o, const bf16_t *q, const bf16_t *kv, const int32_t *geo,
                                   const struct attn_index_par *par, int64_t T, int64_t H, int64_t hd, int64_t n_idx,
                                   const float *sink, float scale, const struct attn_rope *r) {
    struct backend *in = PR(be)->inner;
    if (!in->ops->sparse_attn_index) return false;
    double t0 = prof_begin(be);
    const bool ok = in->ops->sparse_attn_index(in, o, q, kv, geo, par, T, H, hd, n_idx, sink, scale, r);
    if (ok) prof_end(be, PROF_SPARSE_ATTN_INDEX, t0);
    return ok;
}
static void prof_attn_index(struct backend *be, int32_t *dst, int64_t n_idx, const int32_t *geo, int64_t T, const struct attn_index_par *par) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->attn_index(PR(be)->inner, dst, n_idx, geo, T, par);
    prof_end(be, PROF_ATTN_INDEX, t0);
}
static void prof_ring_store(struct backend *be, bf16_t *ring, const bf16_t *kv, const int32_t *geo, int64_t T, int64_t W, int64_t hd) {
    double t0 = prof_begin(be);
    PR(be)->inner->ops->ring_store(PR(be)->inner, ring, kv, geo, T, W, hd);
    prof_end(be, PROF_RING_STORE, t0);
}

static const struct backend_ops prof_ops = {
    .name = "profiled",
    .alloc = prof_alloc,
    .free = prof_free,
    .scratch = prof_scratch,
    .upload = prof_upload,
    .download = prof_download,
    .copy = prof_copy,
    .copy_segs = prof_copy_segs,
    .sync = prof_sync,
    .weight_prepare = prof_weight_prepare,
    .weight_release = prof_weight_release,
    .tensor_prepare = prof_tensor_prepare,
    .tensor_release = prof_tensor_release,
    .linear = prof_linear,
    .linear_post = prof_linear_post,
    .linear_post_pair = prof_linear_post_pair,
    .linear_f32 = prof_linear_f32,
    .grouped_linear = prof_grouped_linear,
    .head = prof_head,
    .argmax = prof_argmax,
    .row_lse = prof_row_lse,
    .row_topk = prof_row_topk,
    .rmsnorm = prof_rmsnorm,
    .rope = prof_rope,
    .qdq_fp8_32 = prof_qdq_fp8_32,
    .qdq_fp4_32 = prof_qdq_fp4_32,
    .qdq_fp4_16 = prof_qdq_fp4_16,
    .hc_mixes = prof_hc_mixes,
    .hc_prepare = prof_hc_prepare,
    .hc_collapse = prof_hc_collapse,
    .act_bytes = prof_act_bytes,
    .hc_collapse_act = prof_hc_collapse_act,
    .hc_expand = prof_hc_expand,
    .hc_expand_collapse = prof_hc_expand_collapse,
    .hc_init = prof_hc_init,
    .embed = prof_embed,
    .engram_gather = prof_engram_gather,
    .engram_gate = prof_engram_gate,
    .sparse_attn = prof_sparse_attn,
    .sparse_attn_rope = prof_sparse_attn_rope,
    .compress_pool = prof_compress_pool,
    .index_scores = prof_index_scores,
    .index_topk = prof_index_topk,
    .cand_mask = prof_cand_mask,
    .attn_index = prof_attn_index,
    .sparse_attn_index = prof_sparse_attn_index,
    .linear_cols = prof_linear_cols,
    .ring_store = prof_ring_store,
    .router = prof_router,
    .moe_experts = prof_moe_experts,
    .moe_combine = prof_moe_combine,
    .shared_expert = prof_shared_expert,
    .shared_expert_act = prof_shared_expert_act,
    .interleave = prof_interleave,
};

void prof_backend_init(struct backend *be, struct backend *inner) {
    struct prof *p = calloc(1, sizeof *p);
    p->inner = inner;
    p->sync = true;
    be->ops = &prof_ops;
    be->priv = p;
}

void prof_backend_init_host(struct backend *be, struct backend *inner) {
    prof_backend_init(be, inner);
    PR(be)->sync = false;
}

void prof_backend_init_device(struct backend *be, struct backend *inner, const struct prof_clock *clk) {
    prof_backend_init(be, inner);
    PR(be)->sync = false;
    PR(be)->clk = *clk;
    clk->reset(clk->ctx);
}

/* device clock: the marks are read once the device has passed them */
static void resolve_spans(struct prof *p) {
    if (!p->clk.mark || !p->n_spans) return;
    p->inner->ops->sync(p->inner);
    for (int i = 0; i < p->n_spans; i++)
        p->sec[p->spans[i].op] += 1e-3 * p->clk.ms(p->clk.ctx, p->spans[i].a, p->spans[i].b);
    p->n_spans = 0;
    p->clk.reset(p->clk.ctx);
}

void prof_backend_reset(struct backend *be) {
    resolve_spans(PR(be));
    memset(PR(be)->sec, 0, sizeof PR(be)->sec);
    memset(PR(be)->calls, 0, sizeof PR(be)->calls);
}

long prof_backend_calls(struct backend *be, const char *op) {
    for (int i = 0; i < PROF_N_OPS; i++)
        if (!strcmp(prof_names[i], op)) return PR(be)->calls[i];
    return -1;
}

const char *prof_backend_op_name(int i) { return i >= 0 && i < PROF_N_OPS ? prof_names[i] : NULL; }

double prof_backend_report(struct backend *be, FILE *f, const char *label, int per) {
    resolve_spans(PR(be));
    double total = 0;
    for (int i = 0; i < PROF_N_OPS; i++) total += PR(be)->sec[i];
    if (per < 1) per = 1;
    for (int i = 0; i < PROF_N_OPS; i++)
        if (PR(be)->calls[i])
            fprintf(f, "%s,%s,%.1f,%.3f,%.1f\n", label, prof_names[i], (double)PR(be)->calls[i] / per,
                    1e3 * PR(be)->sec[i] / per, total > 0 ? 100.0 * PR(be)->sec[i] / total : 0.0);
    return total / per;
}

void prof_backend_free(struct backend *be) {
    free(PR(be)->spans);
    free(be->priv);
    be->ops = NULL;
    be->priv = NULL;
}
