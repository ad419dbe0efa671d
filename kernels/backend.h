/* The op table: everything the model computes goes through these entry points, so a backend
 * (the CPU reference in kernels/cpu, the SM80 suite in kernels/cuda) is one table, and an A/B
 * variant of a kernel is another table entry, never an #ifdef in model code.
 *
 * Conventions for every op:
 *  - Pointers are backend ("device") pointers from be->alloc, or weights prepared by
 *    be->weight_prepare. On the CPU backend they are plain host pointers.
 *  - bf16 values are uint16_t bit patterns; "bf16(x)" below means round-to-nearest-even.
 *  - Shapes are row-major; T = rows (tokens) of the call. Extents are int64_t.
 *  - Numerics are those of the official reference (MODEL.md §3); each op's comment says where the
 *    reference rounds and in what precision it accumulates. The CPU backend sums in the order
 *    stated (fixed, independent of thread count); GPU backends may reorder within an fp32 sum and
 *    are held to the tolerance table in tests/tolerances.h.
 * Ops are asynchronous on a GPU backend; be->sync waits. The CPU backend runs them inline. */
#ifndef DS_BACKEND_H
#define DS_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef uint16_t bf16_t;

/* Storage format of a weight matrix W [n, k] (logical; y = x · Wᵀ). */
enum wfmt {
    WF_BF16 = 0, /* bf16 [n, k]                                                     */
    WF_F32,      /* fp32 [n, k]                                                     */
    WF_FP8,      /* e4m3 [n, k] + e8m0 scales [ceil(n/32), ceil(k/32)], 32x32 tiles  */
    WF_FP4,      /* e2m1 packed [n, k/2] (low nibble = even k) + e8m0 [n, k/32]      */
};

/* A weight as the backend holds it. `ld`/`s_ld` are row strides (elements / scale bytes) so a
 * TP slice of the K dimension (row-parallel) can point into the full matrix without copying.
 * For WF_FP4, ld is in bytes of the packed row (k/2 for a whole row); the codes are in the
 * checkpoint's order until weight_prepare, after which a backend may hold them permuted within
 * each 32-bit word (the CUDA backend does: kernels/cuda/fp4_layout.h). */
struct qweight {
    enum wfmt fmt;
    int64_t n, k;
    int64_t ld, s_ld;
    const void *w;    /* data */
    const uint8_t *s; /* e8m0 scales (FP8, FP4), else NULL */
    void *be_priv;    /* backend-private (e.g. device copy), owned by the backend */
};

struct backend;

/* One slice of a logits row for the row_lse op (kernels/lse_core.h): 16 bytes. */
struct be_lse_part {
    double s; /* sum of expf(x - m) over the slice, in lse_core.h's order */
    float m;  /* the slice's maximum, NaN skipped, +0 for ±0; -inf where it has no other */
    float t;  /* the entry at the row's target when the slice holds it, else 0 */
};

/* One entry of a row_topk list: a logit and its column, (NaN, -1) past the row's numbers. */
struct be_topk_entry {
    float v;
    int32_t i;
};
#define BE_TOPK_MAX 1024 /* the longest row_topk list */

/* The most branches open at once between two joins (backend_ops.branch_begin): three lanes with
 * the main one. */
#define BE_MAX_BRANCHES 2

/* The most copies a copy_segs call inside a graph segment may hold (backend_ops.copy_segs). */
#define BE_COPY_SEGS_GRAPH 64

/* One device-to-device copy of a copy_segs batch. */
struct copy_seg {
    void *dst;
    const void *src;
    size_t bytes;
};

/* Per-row parameters of index_topk and cand_mask (host-computed from the batch, uploaded as
 * int32 [T, 4]). Entry j of score row r is read as -inf when j >= n_valid; only the first n
 * entries take part. */
enum { TOPK_P_N = 0, TOPK_P_VALID, TOPK_P_K, TOPK_P_VISIBLE, TOPK_P_COUNT };

/* hc_mixes: length of the dot products' summation segments (see hc_mixes). */
#define BE_HC_MIX_SEG 256
/* The dense fp32 sums (linear on BF16 weights, linear_f32, grouped_linear, head): a dot product over
 * k is cut into segments of BE_DOT_SEG consecutive k; each segment is summed in k order from +0,
 * then the segment sums are added in segment order from +0. The reference's fp32 GEMMs run in
 * MKL's order, which no backend reproduces; segments let a GPU walk one output's k with 32 lanes
 * at once, where a single k-order chain (4 cycles an add, 5,120 adds) was the floor of a decode
 * router gate. */
#define BE_DOT_SEG 128

/* What rmsnorm may apply to its output rows after the norm, each step with its own op's bits:
 * RoPE on [off, off + rd) of every row (the rope op with nh = 1, ld_row = ld_head = n, inverse
 * false; rd = 0: none), then the QDQ of the rows' groups (qdq_fp8_32 / qdq_fp4_32 over T·n values;
 * NORM_QDQ_NONE: none). The attention's key rows take all three: one pass on the GPU, not three. */
enum norm_qdq { NORM_QDQ_NONE = 0, NORM_QDQ_FP8_32 = 1, NORM_QDQ_FP4_32 = 2 };
struct norm_post {
    int64_t off, rd;    /* the rotary part of each row */
    const int32_t *pos; /* [T] positions, backend memory */
    const float *freqs; /* [rd / 2] fp32, backend memory */
    enum norm_qdq qdq;
};

/* What sparse_attn_rope applies to the attention's output o [T, H, hd]: the rope op on [off,
 * off + rd) of every head (nh = H, ld_row = H·hd, ld_head = hd) at positions pos, inverse or not —
 * the attention output's inverse RoPE (MODEL.md §3.9), which a backend can apply as it stores o. */
struct attn_rope {
    int64_t off, rd;    /* the rotary part of each head */
    const int32_t *pos; /* [T] positions, backend memory */
    const float *freqs; /* [rd / 2] fp32, backend memory */
    bool inverse;
};

/* The layer's part of attn_index: its window, where its ring and its compressed source live. */
struct attn_index_par {
    int64_t W;           /* window */
    int64_t ring0;       /* key row of slot 0's ring; slot s's ring is W rows from ring0 + s·W */
    const int32_t *src;  /* [T, ld_src] compressed ids (the top-k), -1 unused; backend memory */
    int64_t ld_src, k;   /* row stride, entries taken per row */
    int64_t src0, cap;   /* key row of slot 0's compressed cache, rows per slot */
};

/* What linear_post applies to the linear's bf16 output rows [T, n] (n = W->n), each step with its
 * own op's bits — a projection and the norm or RoPE after it as one op, so that a backend can run
 * the second in the pass that finishes the first (the CUDA backend folds the tensor-core linears'
 * k-chunks there, where the fold was a launch of its own):
 *  - norm_w given: the rmsnorm op over rows of n (norm_w, eps) with `post` (struct norm_post);
 *  - norm_w NULL: RoPE on [post.off, post.off + post.rd) of each of a row's n / head heads (the
 *    rope op with nh = n / head, ld_row = n, ld_head = head, forward; rd = 0: none), then the QDQ
 *    post.qdq of the T·n values. */
struct linear_post {
    const bf16_t *norm_w;
    float eps;
    int64_t head;
    struct norm_post post;
    const void *xa; /* x's activation form (backend_ops.act_bytes), or NULL */
    void *ya;       /* where y's activation form goes too, or NULL (a backend with act_bytes only) */
};

struct backend_ops {
    const char *name;

    /* ---- memory ---- */
    void *(*alloc)(struct backend *be, size_t bytes); /* zero-filled */
    void (*free)(struct backend *be, void *p);
    /* Like alloc without the zero fill (on a GPU one launch less per temporary): for temporaries
     * the forward writes before it reads. The CPU backend fills them with 0xFF bytes (NaN, -1), so
     * a read of an element nothing wrote shows up in every CPU test. Released with free. */
    void *(*scratch)(struct backend *be, size_t bytes);
    void (*upload)(struct backend *be, void *dst, const void *src_host, size_t bytes);
    void (*download)(struct backend *be, void *dst_host, const void *src, size_t bytes);
    void (*copy)(struct backend *be, void *dst, const void *src, size_t bytes);
    /* n copies in one call (the per-sequence rows a forward moves between caches and scratch):
     * segs is a HOST array; the segments are independent — no destination overlaps another
     * segment's source or destination — so a backend may run them in any order or at once. A call
     * of at most BE_COPY_SEGS_GRAPH copies may be recorded in a graph segment (its list then lives
     * in the recording: the bench's TP stand-in collectives); larger ones are host-side ops. */
    void (*copy_segs)(struct backend *be, const struct copy_seg *segs, int64_t n);
    void (*sync)(struct backend *be);
    /* Host memory that downloads land in at the link's full rate (page-locked on a GPU), for the
     * buffers a forward downloads into every step: the logits, [rows, vocab] fp32 (33 MB at 64
     * rows), the pipeline's stream hand-off [rows, hc, D] bf16. Always returns memory (pageable
     * when the system will not lock that much); host_free releases it. Optional: NULL where plain
     * malloc is as good (engine_host_alloc). */
    void *(*host_alloc)(struct backend *be, size_t bytes);
    void (*host_free)(struct backend *be, void *p);
    /* Make a host weight (pointing into the checkpoint mmap) usable by the backend; the CPU
     * backend keeps the host pointers. `dequant_bf16` asks for a bf16 copy of an FP8 weight
     * (wo_a: the reference dequantizes it to bf16 at load). */
    int (*weight_prepare)(struct backend *be, struct qweight *w, bool dequant_bf16);
    void (*weight_release)(struct backend *be, struct qweight *w);
    /* Make a small or host-resident tensor (norm weights, sinks, mHC parameters, router bias, the
     * embedding, Engram tables) readable by the ops: returns a backend pointer to the same bytes.
     * host_resident: the tensor stays in host memory and the device reads it there (pinned/mapped;
     * the Engram tables, which are too large for the GPU); otherwise the backend may copy it into
     * device memory. The CPU backend returns `host` itself. Released with tensor_release. */
    const void *(*tensor_prepare)(struct backend *be, const void *host, size_t bytes, bool host_resident);
    void (*tensor_release)(struct backend *be, const void *p);

    /* ---- dense ---- */
    /* y[T,n] bf16 = x[T,k] bf16 · Wᵀ.
     * FP8/FP4 W: x is act_quant'ed per 32 along k (e4m3 + pow2 scale, MODEL.md §3.0); for each
     * 32-wide k block b the partial Σ q_x·q_w is accumulated in fp32 (over the 32 in k order), then
     * acc += (partial · s_x[b]) · s_w[b] in k-block order; y = bf16(acc).
     * BF16 W: y = bf16(Σ_k x·w) accumulated in fp32 in BE_DOT_SEG segments, no activation
     * quantization.
     * F32 W: not allowed here (use linear_f32). */
    void (*linear)(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, const struct qweight *W);
    /* Optional (NULL: be_linear_post runs linear, then the steps' ops): y = linear(x, W), then lp's
     * steps (struct linear_post), with the bits of those ops in turn. y must not alias x. */
    void (*linear_post)(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, const struct qweight *W,
                        const struct linear_post *lp);
    /* Optional (NULL: be_linear_post_pair runs the two linear_posts in turn): two linear_posts of
     * one x, y1 = lp1(x · W1ᵀ) [T, W1->n] and y2 = lp2(x · W2ᵀ) [T, W2->n], each with the bits of
     * its own linear_post (the attention's wq_a + q_norm beside wkv + kv_norm: one linear and one
     * norm launch for both where the backend can, else the two in turn). lp2->ya must be NULL. */
    void (*linear_post_pair)(struct backend *be, bf16_t *y1, bf16_t *y2, const bf16_t *x, int64_t T,
                             const struct qweight *W1, const struct linear_post *lp1, const struct qweight *W2,
                             const struct linear_post *lp2);
    /* y[T,n] fp32 = x[T,k] · Wᵀ in fp32 (x given as bf16 and widened exactly, W BF16 widened or F32):
     * the gate (router) and the ratio-2 compressor, which the reference runs in fp32. The sum in
     * BE_DOT_SEG segments. */
    void (*linear_f32)(struct backend *be, float *y, const bf16_t *x, int64_t T, const struct qweight *W);
    /* Grouped bf16 projection (wo_a): x [T, G, kg] bf16, W [G*r, kg] (dequantized, no act quant),
     * y [T, G, r] bf16 with y[t,g,:] = bf16(x[t,g,:] · W[g*r:(g+1)*r, :]ᵀ), fp32 accumulation. */
    void (*grouped_linear)(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, int64_t G,
                           const struct qweight *W);
    /* logits[T,n] fp32 = x[T,k] bf16 widened · W (BF16 widened to fp32)ᵀ, fp32, BE_DOT_SEG segments. */
    void (*head)(struct backend *be, float *logits, const bf16_t *x, int64_t T, const struct qweight *W);
    /* The greedy draw of each row (sampler_pick at temperature 0) where the logits are: out[2r] =
     * the bits of row r's largest non-NaN value (-inf counts), out[2r + 1] its lowest index; NaN
     * bits and -1 where every entry is NaN. x [R, V] fp32, out [R][2] int32, backend memory. A
     * maximum and a position, exact in any order, so a vocab-split head's ranks each take their
     * columns' and the host keeps the first best (model_forward_draws): 8 bytes a row leave the
     * device instead of the row's V floats. */
    void (*argmax)(struct backend *be, int32_t *out, const float *x, int64_t R, int64_t V);
    /* The log-sum-exp parts of each row where the logits are (kernels/lse_core.h defines the order
     * and the terms): x [R, V] fp32 cut into ns slices of V / ns consecutive columns (ns divides V),
     * out [R][ns] = each slice's maximum, its sum of expf(x - m) and, where target[r] (a column of
     * x, or -1; [R] int32, backend memory; NULL = none) falls in the slice, x at it. The host merges
     * a row's slices in column order (sampler_lse_merge): 16 bytes a slice leave the device instead
     * of the row, and a vocab-split head's ranks each take their own slices. temp ([R] fp32, backend
     * memory) or NULL: with it each row's slice sums are of expf((x - m) / temp[r]) with NaN entries
     * adding 0 (lse_core.h: the full-row temperature draw's total, sampler_wsum_merge); rows with
     * temp[r] <= 0 get the plain sums. */
    void (*row_lse)(struct backend *be, struct be_lse_part *out, const float *x, int64_t R, int64_t V, int64_t ns,
                    const int32_t *target, const float *temp);
    /* The k (1..BE_TOPK_MAX) first entries of each row in the draw order of kernels/draw_order.h (a
     * larger value first, equal values — ±0 too — by the lower column, NaN never), sorted, the
     * value's bits as in x; (NaN, -1) past a row's last number. x [R, V] fp32, out [R][k]. Exact
     * (comparisons and moves). A vocab-split head's ranks each take their columns' lists and the
     * host merges them (sampler_topk_merge): sampler_pick's top-k draws from 8·k bytes a row. */
    void (*row_topk)(struct backend *be, struct be_topk_entry *out, const float *x, int64_t R, int64_t V, int64_t k);

    /* ---- elementwise / norms ---- */
    /* y[T,n] = bf16( w_f32 · (x_f32 · 1/sqrtf(mean(x_f32²) + eps)) ); mean = (Σ x² in order)/n.
     * y may alias x. post: NULL, or the RoPE / QDQ then applied to y (struct norm_post). */
    void (*rmsnorm)(struct backend *be, bf16_t *y, const bf16_t *x, const bf16_t *w, int64_t T, int64_t n,
                    float eps, const struct norm_post *post);
    /* In-place interleaved RoPE on x[t, h, off : off+rd] for t < T, h < nh (row stride ld_row,
     * head stride ld_head, elements). Angle = (float)pos[t] · freqs[i] (fp32), c = cosf, s = sinf;
     * (a, b) -> (bf16(a·c − b·s), bf16(a·s + b·c)) computed in fp32 with separate roundings;
     * inverse uses s -> −s. freqs: fp32 [rd/2] backend pointer. */
    void (*rope)(struct backend *be, bf16_t *x, int64_t T, int64_t nh, int64_t ld_row, int64_t ld_head,
                 int64_t off, int64_t rd, const int32_t *pos, const float *freqs, bool inverse);
    /* In-place quantize-dequantize of n values (n a multiple of the block), MODEL.md §3.0. */
    void (*qdq_fp8_32)(struct backend *be, bf16_t *x, int64_t n);
    void (*qdq_fp4_32)(struct backend *be, bf16_t *x, int64_t n);
    void (*qdq_fp4_16)(struct backend *be, bf16_t *x, int64_t n);

    /* ---- mHC (MODEL.md §3.2) ---- */
    /* For each row: x = X[t] as fp32 over hc*D; r = 1/sqrtf(Σx²/(hc·D) + eps), the sum in torch's
     * order (cpu_sum_torch); m[j] = (Σ_s Σ_{i in segment s} x_i · fn[j,i]) · r, j < (2+hc)·hc, with
     * segments of BE_HC_MIX_SEG consecutive i, each summed in order from 0, then the segment sums in
     * order from 0 (the reference's fp32 GEMM order is MKL's, not reproducible; segments let the GPU
     * run the dot products in parallel); then split_sinkhorn with scale[3], base[..]: pre[hc],
     * post[hc], comb[hc,hc] (row j, column k), all fp32, exactly as §3.2. */
    void (*hc_mixes)(struct backend *be, float *pre, float *post, float *comb, const bf16_t *X, int64_t T,
                     int64_t hc, int64_t D, const float *fn, const float *scale, const float *base,
                     int iters, float norm_eps, float hc_eps);
    /* Optional (NULL: none): fn [(2+hc)·hc, hc·D] f32, a pointer tensor_prepare returned, will be
     * hc_mixes' fn; the backend may keep a form of it prepared once (the CUDA backend's three bf16
     * pieces for the tensor cores), released with fn by tensor_release. hc_mixes gives the same
     * bits with or without it. */
    void (*hc_prepare)(struct backend *be, const float *fn, int64_t hc, int64_t D);
    /* y[t,:] = bf16( ((p0·X0 + p1·X1) + p2·X2) + ... ) in fp32, X [T, hc, D], p [T, hc]; then, with
     * norm_w [D] given, y = rmsnorm(y, norm_w, eps) with the rmsnorm op's bits (the collapse's bf16
     * y is what the norm reads): the block input's collapse and norm as one op, which a backend may
     * run as one pass over the row. norm_w NULL: the collapse alone (eps unused). */
    void (*hc_collapse)(struct backend *be, bf16_t *y, const bf16_t *X, const float *p, int64_t T, int64_t hc,
                        int64_t D, const bf16_t *norm_w, float eps);
    /* ---- activation forms (optional: NULL where a backend's linears quantize their own input) ----
     * A tensor-core backend's FP8/FP4 linears read x [T, k] in a form of their own (the reference's
     * per-32 act quant with its scales, in the backend's layout): act_bytes(T, k) bytes of it, 0
     * when its linears take none now. The norm that makes x can write that form too, in the same
     * pass (hc_collapse_act: hc_collapse with norm_w, and ya = y's form), and the linears that
     * read x take it (linear_post's xa, shared_expert_act's xa): one launch and one pass over x
     * fewer for each, the same bits as the ops without it. */
    size_t (*act_bytes)(struct backend *be, int64_t T, int64_t k);
    void (*hc_collapse_act)(struct backend *be, bf16_t *y, void *ya, const bf16_t *X, const float *p, int64_t T,
                            int64_t hc, int64_t D, const bf16_t *norm_w, float eps);
    /* Xo[t,k,:] = bf16( post[t,k]·y[t,:] + (((c[0][k]·X0 + c[1][k]·X1) + c[2][k]·X2) + ...) ), fp32.
     * Xo must not alias X. y_blocks >= 1 divides D: y is [y_blocks, T, D / y_blocks], column block j
     * of every row together (what a TP all-gather of row-split outputs leaves, read in place of an
     * interleave into [T, D]); 1 is the plain [T, D]. */
    void (*hc_expand)(struct backend *be, bf16_t *Xo, const bf16_t *y, const bf16_t *X, const float *post,
                      const float *comb, int64_t T, int64_t hc, int64_t D, int64_t y_blocks);
    /* Optional (NULL: be_hc_expand_collapse runs the ops in turn): Xo = hc_expand(yin, X, post,
     * comb, y_blocks), then y = rmsnorm(collapse(Xo, p), norm_w) with ya, y's activation form, as
     * hc_collapse_act writes it (ya NULL: hc_collapse with the norm): a block's residual update and
     * the next sublayer's input, which a backend may form in one pass over the row (the collapse
     * then never reads Xo back). Both outputs have the ops' bits. */
    void (*hc_expand_collapse)(struct backend *be, bf16_t *Xo, const bf16_t *yin, const bf16_t *X, const float *post,
                               const float *comb, int64_t y_blocks, bf16_t *y, void *ya, const float *p,
                               const bf16_t *norm_w, float eps, int64_t T, int64_t hc, int64_t D);
    /* X[t,c,:] = e[t,:] for c < hc; pre[t] = one-hot(0). */
    void (*hc_init)(struct backend *be, bf16_t *X, float *pre, const bf16_t *e, int64_t T, int64_t hc,
                    int64_t D);

    /* ---- embedding / engram ---- */
    /* e[t,:] = table[ids[t] - row0] if row0 <= ids[t] < row0 + nrows, else zeros. */
    void (*embed)(struct backend *be, bf16_t *e, const int32_t *ids, int64_t T, const bf16_t *table,
                  int64_t row0, int64_t nrows, int64_t D);
    /* rows[t,c,:] = bf16(e4m3(table[id]) · e8m0(scale[id][j/32])) for ids[t,c] inside
     * [row0, row0+nrows) (id - row0 local), zeros otherwise. ids int64 [T, C]; table [nrows, hd]. */
    void (*engram_gather)(struct backend *be, bf16_t *rows, const int64_t *ids, int64_t T, int64_t C,
                          const uint8_t *table, const uint8_t *scale, int64_t row0, int64_t nrows, int64_t hd);
    /* Gate and inject (MODEL.md §3.3), in place on X [T, hc, D]:
     * kv [T, (hc+1)·D] bf16 (hc keys then the value); w = q_weight·k_weight fp32 [hc, D] (backend ptr).
     * rstd = 1/sqrtf(mean(h²)+eps) · 1/sqrtf(mean(key²)+eps); dot = (Σ_d (h·w)·key) · rstd · D^-0.5;
     * g = sigmoid(copysign(sqrtf(max(|dot|, 1e-6)), dot)); X = bf16(h + g·value). */
    void (*engram_gate)(struct backend *be, bf16_t *X, const bf16_t *kv, const float *w, int64_t T,
                        int64_t hc, int64_t D, float eps);

    /* ---- attention ---- */
    /* Sparse attention with sink (MODEL.md §3.9) for T query rows:
     * q [T, H, hd] bf16; kv rows addressed by idx [T, n_idx] int32 into kv [*, hd] bf16 (−1 = unused,
     * still occupying its slot); online softmax over blocks of 64 idx entries in order, running max
     * from −1e30, P = expf(s − m) with s = (q·k)·scale in fp32, denominator in fp32, P rounded to bf16
     * before P·V, rescale on max change; after all blocks denominator += expf(sink[h] − m) (sink not
     * scaled); o = bf16(acc / denominator); a row with no valid index gives zeros. */
    void (*sparse_attn)(struct backend *be, bf16_t *o, const bf16_t *q, const bf16_t *kv, const int32_t *idx,
                        int64_t T, int64_t H, int64_t hd, int64_t n_idx, const float *sink, float scale);
    /* Optional (NULL: be_sparse_attn_rope runs sparse_attn, then rope): sparse_attn, then the rope
     * op on its output as struct attn_rope says, with the bits of the two ops in turn. */
    void (*sparse_attn_rope)(struct backend *be, bf16_t *o, const bf16_t *q, const bf16_t *kv, const int32_t *idx,
                             int64_t T, int64_t H, int64_t hd, int64_t n_idx, const float *sink, float scale,
                             const struct attn_rope *r);
    /* Ratio-2 compressor pooling in fp32: kv, score [T/2... groups] given as fp32 [G, r, n];
     * lat[g,:] = bf16( Σ_j kv[g,j,:] · softmax_j(score[g,:,:]) ) with softmax over the r tokens per
     * channel: e = expf(s − max), e / Σe; products summed in j order. */
    void (*compress_pool)(struct backend *be, bf16_t *lat, const float *kv, const float *score, int64_t G,
                          int64_t r, int64_t n);
    /* Index scores for T query rows against keys K [nk, d] bf16:
     * d_h = bf16(Σ_d q[t,h,d]·K[j,d]) (fp32 accumulation), p_h = bf16(relu(d_h) · w[t,h]) (fp32 product),
     * S[t,j] = bf16(Σ_h p_h) (fp32 accumulation in h order), stored as fp32 in S [T, nk] (row stride
     * ld_s). Positions j >= visible[t] are set to −inf. The head weights are first scaled as the
     * reference does: w[t,h] = bf16(w_raw[t,h] · w_scale) (w_raw bf16 [T, nh]).
     * q [T, nh, d] has row stride ld_q (elements). Rows of several sequences score their own key
     * caches in one call: with K_rows (backend array [T] of key-matrix pointers, else NULL: every row
     * reads K) and nk_rows (int32 [T], <= nk, else NULL: nk for every row), row t scores
     * K_rows[t][0..nk_rows[t]) and leaves S[t, nk_rows[t]..) as it is. */
    void (*index_scores)(struct backend *be, float *S, int64_t ld_s, const bf16_t *q, int64_t ld_q,
                         const bf16_t *K, const bf16_t *const *K_rows, const int32_t *nk_rows, const bf16_t *w,
                         float w_scale, const int32_t *visible, int64_t T, int64_t nh, int64_t d, int64_t nk);
    /* Top-k rows of the indexer (MODEL.md §3.7–§3.8) for T score rows S [T, ld_s] fp32; p int32
     * [T, TOPK_P_COUNT] per row: n entries scored, n_valid (entries at or past it read as -inf: a
     * key cache shorter than the row), k selected, visible. With mask (uint8 [T, ld_m], NULL: none)
     * entry j also reads as -inf when j >= ld_m or mask[j] == 0. The k selected are those of
     * torch.topk on CPU (tie order of kernels/topk_core.h: libstdc++ introselect / heap select), then sorted
     * ascending, and positions >= visible become -1; top[r, k..ld_top) = -1. Bit-exact everywhere:
     * the selection is an algorithm, not arithmetic (kernels/topk_core.h, shared by both backends).
     * Caller's bounds: n <= ld_s and k <= ld_top on every row (a backend sizes its work by ld_s). */
    void (*index_topk)(struct backend *be, int32_t *top, int64_t ld_top, const float *S, int64_t ld_s,
                       const int32_t *p, const uint8_t *mask, int64_t ld_m, int64_t T);
    /* Candidate blocks of the candidate source (§3.8) per row, entries read as index_topk reads
     * them without a mask: block maxima over `bs` entries of the first n, the block of the last
     * visible entry forced to +inf (when it lies in one of the blocks), the top min(topk_blocks,
     * blocks) blocks by torch.topk's order; mask[r, j] = 1 for j < n in a selected block whose
     * maximum is > -inf, else 0 (up to ld_m). Maxima by '>' from -inf, so a NaN entry never wins
     * (the reference's host order, kept from the first CPU engine). n <= ld_s. */
    void (*cand_mask)(struct backend *be, uint8_t *mask, int64_t ld_m, const float *S, int64_t ld_s,
                      const int32_t *p, int64_t T, int64_t topk_blocks, int64_t bs);
    /* Index lists of sparse_attn (MODEL.md §3.6, attention.c): row r < T of dst [T, n_idx] from
     * its geometry geo int32 [T, AIX_COLS] (backend memory; kernels/attn_index_core.h) = (p, start,
     * chunk_row, slot, nw, end) — the row's position, its chunk's first position and first key
     * row, its sequence slot, its window width, its chunk's end —
     * and the layer's par:
     *   j < nw: window position qp = (nw < W ? max(0, p - W + 1) : p - W + 1) + j: -1 where qp < 0
     *           or qp > p, else qp >= start ? chunk_row + qp - start : ring0 + slot·W + qp mod W;
     *   nw <= j < nw + k: c = src[r·ld_src + j - nw]: c < 0 ? -1 : c + src0 + slot·cap;
     *   the rest -1. nw + k <= n_idx; src may be NULL when k = 0. */
    void (*attn_index)(struct backend *be, int32_t *dst, int64_t n_idx, const int32_t *geo, int64_t T,
                       const struct attn_index_par *par);
    /* Optional (NULL, or false with nothing run: be_sparse_attn_index runs attn_index, then
     * sparse_attn_rope over its lists): sparse_attn_rope over the lists attn_index would build from
     * geo and par, each entry formed where the attention reads it (no list in memory, no launch to
     * build it), with the bits of those two ops in turn. */
    bool (*sparse_attn_index)(struct backend *be, bf16_t *o, const bf16_t *q, const bf16_t *kv, const int32_t *geo,
                              const struct attn_index_par *par, int64_t T, int64_t H, int64_t hd, int64_t n_idx,
                              const float *sink, float scale, const struct attn_rope *r);
    /* The window ring's update after a layer's attention: row r < T of kv [T, hd] bf16 goes to
     * ring row slot·W + p mod W (ring [slots·W, hd]) where p >= end - W (the chunk's last W
     * positions; geo as attn_index's, AIX_END its chunk's end); other ring rows are untouched. */
    void (*ring_store)(struct backend *be, bf16_t *ring, const bf16_t *kv, const int32_t *geo, int64_t T, int64_t W,
                       int64_t hd);

    /* ---- MoE (MODEL.md §3.10) ---- */
    /* Router: z = x_f32 · gate_f32ᵀ / temp; s = sqrtf(softplus(z)) (z > 20 → z); selection =
     * top-k of s + bias (ties: lower expert id first), weights = s[sel] in top-k order,
     * w /= (Σw + 1e-20) when norm and k > 1, w *= route_scale. idx [T, k] int32, wts [T, k] fp32.
     * bias fp32 [E] backend pointer. */
    void (*router)(struct backend *be, int32_t *idx, float *wts, const bf16_t *x, int64_t T,
                   const struct qweight *gate, const float *bias, int64_t k, float temp, bool norm,
                   float route_scale);
    /* Routed experts e in [e0, e0+n_local): for every (t, slot) with idx[t,slot] == e:
     * g = bf16(x·w1ᵀ) → fp32, u = bf16(x·w3ᵀ) → fp32 (FP4 linears with act quant);
     * u = clamp(u, −limit, limit), g = min(g, limit) (limit > 0); h = silu(g)·u (fp32, silu(g) =
     * g / (1 + expf(−g))); h = wts[t,slot]·h; y[t,slot,:] = bf16(bf16(h)·w2ᵀ).
     * y [T, k, D] bf16; slots routed elsewhere are left untouched. w1/w3/w2: arrays indexed e − e0. */
    void (*moe_experts)(struct backend *be, bf16_t *y, const bf16_t *x, const int32_t *idx, const float *wts,
                        int64_t T, int64_t k, int64_t e0, int64_t n_local, const struct qweight *w1,
                        const struct qweight *w3, const struct qweight *w2, float limit);
    /* The reference's MoE output: out[t,:] = bf16(acc + sh[t,:]) (sh bf16 widened; NULL: bf16(acc)),
     * acc the fp32 expert sum from +0, += y_e in ascending expert id e over the token's slots. y
     * [P, T, k, D] bf16 holds P parts (one per TP rank after an exchange); expert e's output is in
     * part e / per_part. Slots whose part is >= P are skipped. out [T, D] bf16; sh rows ld_sh
     * elements apart (>= D), so a TP rank that combines a block of D columns reads them in place.
     * One op, so a decode step has no fp32 [T, D] sum to zero, write and read back between the
     * expert sum and the shared expert's add. */
    void (*moe_combine)(struct backend *be, bf16_t *out, const bf16_t *y, const int32_t *idx, const bf16_t *sh,
                        int64_t ld_sh, int64_t T, int64_t k, int64_t D, int64_t per_part, int64_t P);
    /* Shared expert, same SwiGLU without routing weight: y[T,D] bf16 = bf16(bf16(h)·w2ᵀ) (FP8). */
    void (*shared_expert)(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, const struct qweight *w1,
                          const struct qweight *w3, const struct qweight *w2, float limit);
    /* shared_expert with xa, x's activation form (act_bytes; optional with it) */
    void (*shared_expert_act)(struct backend *be, bf16_t *y, const bf16_t *x, const void *xa, int64_t T,
                              const struct qweight *w1, const struct qweight *w3, const struct qweight *w2, float limit);
    /* dst[t, s, :] = src[s, t, :] for S blocks of T rows of `bytes` each: turns a gather of
     * per-rank column blocks into whole rows. */
    void (*interleave)(struct backend *be, void *dst, const void *src, int64_t S, int64_t T, size_t bytes);
    /* Optional (NULL, or false with nothing run: be_linear_cols interleaves, then runs linear):
     * linear of x [T, W->k], the interleave of its S column blocks xb [S, T, W->k / S] (a TP
     * gather's blocks), read where they lie; the bits of interleave, then linear. */
    bool (*linear_cols)(struct backend *be, bf16_t *y, const bf16_t *xb, int64_t S, int64_t T, const struct qweight *W);

    /* ---- graph segments (optional: NULL where a backend has none; the caller then issues the ops) ----
     * A segment is a run of ops the caller promises is fixed by its key (n words): the same key means
     * the same ops in the same order with the same arguments and buffer addresses, reading the same
     * host-side state. Inside one: only ops, alloc/scratch and free of buffers allocated inside it
     * (all freed before its end), copy, copy_segs of at most BE_COPY_SEGS_GRAPH copies; no upload,
     * download, larger copy_segs or sync, and nothing allocated before it is freed in it.
     * graph_begin returns true when the caller must issue the ops (the backend records them) and
     * then call graph_end, which runs what was recorded; false when the backend ran its recording
     * of that key instead, and the caller skips the ops. A backend may fold its own switches into
     * the key (the CUDA backend's mma switch). */
    bool (*graph_begin)(struct backend *be, const uint64_t *key, int n_key);
    void (*graph_end)(struct backend *be);

    /* ---- branches (optional: NULL where a backend runs every op in issue order; the caller
     * issues the same ops either way, so a NULL branch is a valid schedule of the same work) ----
     * A decode step's ops are mostly latency bound and leave SMs idle; two independent chains (the
     * shared expert beside the router and the routed experts) can run side by side. branch_begin:
     * the ops issued after it run on a second lane, after everything issued before it.
     * branch_end: the ops issued after it run on the main lane again, concurrently with the
     * branch's. A second branch_begin after a branch_end (before the join) opens another lane,
     * after everything the main lane issued before it, up to BE_MAX_BRANCHES open at once.
     * branch_join: the main lane waits for every op of every branch opened since the last join.
     * The chains must not touch each other's outputs; a buffer any chain uses is freed only after
     * the join (the backend defers every free between the first begin and the join to the join).
     * Branches are joined inside the graph segment they began in; no host-side op (upload,
     * download, copy_segs, sync, preparation) between begin and join. An op computes the same bits
     * on any lane. */
    void (*branch_begin)(struct backend *be);
    void (*branch_end)(struct backend *be);
    void (*branch_join)(struct backend *be);
};

struct backend {
    const struct backend_ops *ops;
    void *priv;
};

/* linear_post as its ops in turn: linear, then rmsnorm (with lp->post where it asks for anything),
 * or rope and the QDQ. What a backend without the fused op runs, and the bits one with it must give. */
static inline void be_linear_post_composed(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T,
                                           const struct qweight *W, const struct linear_post *lp) {
    const struct backend_ops *o = be->ops;
    const struct norm_post *p = &lp->post;
    const int64_t n = W->n;
    o->linear(be, y, x, T, W);
    if (lp->norm_w) {
        o->rmsnorm(be, y, y, lp->norm_w, T, n, lp->eps, p->rd > 0 || p->qdq != NORM_QDQ_NONE ? p : NULL);
        return;
    }
    if (p->rd > 0) o->rope(be, y, T, n / lp->head, n, lp->head, p->off, p->rd, p->pos, p->freqs, false);
    if (p->qdq == NORM_QDQ_FP8_32) o->qdq_fp8_32(be, y, T * n);
    if (p->qdq == NORM_QDQ_FP4_32) o->qdq_fp4_32(be, y, T * n);
}

/* sparse_attn_rope as its ops in turn: what a backend without the fused op runs, and the bits one
 * with it must give. */
static inline void be_sparse_attn_rope_composed(struct backend *be, bf16_t *o, const bf16_t *q, const bf16_t *kv,
                                                const int32_t *idx, int64_t T, int64_t H, int64_t hd, int64_t n_idx,
                                                const float *sink, float scale, const struct attn_rope *r) {
    be->ops->sparse_attn(be, o, q, kv, idx, T, H, hd, n_idx, sink, scale);
    if (r->rd > 0) be->ops->rope(be, o, T, H, H * hd, hd, r->off, r->rd, r->pos, r->freqs, r->inverse);
}

/* The sparse_attn_rope op where the backend has one, else its ops in turn (the model's entry point). */
static inline void be_sparse_attn_rope(struct backend *be, bf16_t *o, const bf16_t *q, const bf16_t *kv,
                                       const int32_t *idx, int64_t T, int64_t H, int64_t hd, int64_t n_idx,
                                       const float *sink, float scale, const struct attn_rope *r) {
    if (be->ops->sparse_attn_rope)
        be->ops->sparse_attn_rope(be, o, q, kv, idx, T, H, hd, n_idx, sink, scale, r);
    else
        be_sparse_attn_rope_composed(be, o, q, kv, idx, T, H, hd, n_idx, sink, scale, r);
}

/* The linear_cols op where the backend has one and takes the call, else interleave of xb's S blocks
 * into x ([T, W->k] bf16, backend memory; unwritten when the op takes the call), then linear (the
 * model's entry point). */
static inline void be_linear_cols(struct backend *be, bf16_t *y, bf16_t *x, const bf16_t *xb, int64_t S, int64_t T,
                                  const struct qweight *W) {
    if (be->ops->linear_cols && be->ops->linear_cols(be, y, xb, S, T, W)) return;
    be->ops->interleave(be, x, xb, S, T, (size_t)(W->k / S) * 2);
    be->ops->linear(be, y, x, T, W);
}

/* The sparse_attn_index op where the backend has one and takes the call, else attn_index into idx
 * ([T, n_idx] int32, backend memory; unread when the op takes the call), then sparse_attn_rope (the
 * model's entry point). */
static inline void be_sparse_attn_index(struct backend *be, bf16_t *o, const bf16_t *q, const bf16_t *kv, int32_t *idx,
                                        const int32_t *geo, const struct attn_index_par *par, int64_t T, int64_t H,
                                        int64_t hd, int64_t n_idx, const float *sink, float scale,
                                        const struct attn_rope *r) {
    if (be->ops->sparse_attn_index && be->ops->sparse_attn_index(be, o, q, kv, geo, par, T, H, hd, n_idx, sink, scale, r))
        return;
    be->ops->attn_index(be, idx, n_idx, geo, T, par);
    be_sparse_attn_rope(be, o, q, kv, idx, T, H, hd, n_idx, sink, scale, r);
}

/* The linear_post op where the backend has one, else its ops in turn (the model's entry point). */
static inline void be_linear_post(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, const struct qweight *W,
                                  const struct linear_post *lp) {
    if (be->ops->linear_post)
        be->ops->linear_post(be, y, x, T, W, lp);
    else
        be_linear_post_composed(be, y, x, T, W, lp);
}

/* The linear_post_pair op where the backend has one, else the two linear_posts in turn. */
static inline void be_linear_post_pair(struct backend *be, bf16_t *y1, bf16_t *y2, const bf16_t *x, int64_t T,
                                       const struct qweight *W1, const struct linear_post *lp1, const struct qweight *W2,
                                       const struct linear_post *lp2) {
    if (be->ops->linear_post_pair) {
        be->ops->linear_post_pair(be, y1, y2, x, T, W1, lp1, W2, lp2);
    } else {
        be_linear_post(be, y1, x, T, W1, lp1);
        be_linear_post(be, y2, x, T, W2, lp2);
    }
}

/* The hc_expand_collapse op where the backend has one, else hc_expand, then hc_collapse_act (ya
 * given) or hc_collapse of its output. */
static inline void be_hc_expand_collapse(struct backend *be, bf16_t *Xo, const bf16_t *yin, const bf16_t *X,
                                         const float *post, const float *comb, int64_t y_blocks, bf16_t *y, void *ya,
                                         const float *p, const bf16_t *norm_w, float eps, int64_t T, int64_t hc,
                                         int64_t D) {
    const struct backend_ops *o = be->ops;
    if (o->hc_expand_collapse) {
        o->hc_expand_collapse(be, Xo, yin, X, post, comb, y_blocks, y, ya, p, norm_w, eps, T, hc, D);
        return;
    }
    o->hc_expand(be, Xo, yin, X, post, comb, T, hc, D, y_blocks);
    if (ya)
        o->hc_collapse_act(be, y, ya, Xo, p, T, hc, D, norm_w, eps);
    else
        o->hc_collapse(be, y, Xo, p, T, hc, D, norm_w, eps);
}

/* The CPU reference backend (always built). */
int backend_cpu_init(struct backend *be);
void backend_cpu_free(struct backend *be);

#ifdef DS_HAVE_CUDA
/* The SM80 suite (kernels/cuda) on CUDA device `device`: one stream (and a second one for
 * branches), stream-ordered allocations, weights copied to device memory by
 * weight_prepare/tensor_prepare. Returns 0, or -1 with ds_err_set when there is no usable device. */
int backend_cuda_init(struct backend *be, int device);
void backend_cuda_free(struct backend *be);
/* FP8/FP4 linears on the tensor cores (linear_mma_sm80.cu; on) or in the CPU backend's k order
 * (linear_sm80.cu; off). Both are batch invariant: the tensor-core decode (<= 16 rows) and prefill
 * tilings give a row the same bits. The tensor cores add a block's 32 products in their own order,
 * so with them the linears match the CPU backend within the linear bound of src/tolerances.h, not
 * bit for bit; a decode step is 1.6x (8 rows) to 3.4x (64 rows) faster with them. Off after backend_cuda_init; the
 * engine turns it on unless --exact-linears. */
void backend_cuda_set_mma(struct backend *be, bool on);
/* The backend's main cudaStream_t (as void *), for the NCCL comm backend to enqueue on. */
void *backend_cuda_stream(struct backend *be);
/* Graph segments since init: replays (a recorded graph launched) and recordings (captures), and
 * the device memory the recordings' temporaries have held at most (the graph memory pool). */
void backend_cuda_graph_stats(struct backend *be, long *replays, long *recordings, size_t *mem_high);
/* Profiling marks (prof_backend's device clock): a timing event recorded on the stream, its index;
 * the device ms between two marks once passed; reset forgets them all (the events are reused). */
int backend_cuda_mark(struct backend *be);
double backend_cuda_mark_ms(struct backend *be, int a, int b);
void backend_cuda_marks_reset(struct backend *be);
/* Start / stop the CUDA profiler's collection (cudaProfilerStart / Stop): a profiler started with
 * collection off (Nsight Compute's --profile-from-start off) sees only what runs in between. */
void backend_cuda_profiler_range(struct backend *be, bool on);
#endif

#ifdef __cplusplus
}
#endif

#endif /* DS_BACKEND_H */
