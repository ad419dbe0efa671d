/* Internals shared by the files of the forward pass (model.c, attention.c): the model object,
 * per-slot state and the per-forward batch description. Not part of the public model API. */
#ifndef DS_MODEL_INTERNAL_H
#define DS_MODEL_INTERNAL_H

#include "attn_index_core.h"
#include "model.h"

/* Buffers that cross the edge of a graph segment (model_graph_begin). In a forward that runs its
 * segments as graphs they persist between forwards, so a recording's addresses stay valid and the
 * next step's keys match; in other forwards they are the forward's temporaries. */
enum fbuf_id {
    FB_X, FB_X1, FB_P, FB_POS,              /* the stream, its mix, positions (model_forward_stage) */
    FB_APRE, FB_POST, FB_COMB, FB_Y, FB_O,  /* the block's mixes and its sublayers' input and output */
    FB_YA,                                  /* y's activation form (backend_ops.act_bytes), where there is one */
    FB_QR, FB_QRA, FB_Q,                    /* attention's low-rank query (and its activation form), heads */
    FB_ATTN_O, FB_ATTN_U, FB_ATTN_UF, FB_ATTN_OL, /* attention's heads out, wo_a's out (own, gathered), wo_b's */
    FB_ATTN_UG,                             /* wo_a's out as the all-gather leaves it, [tp, T, Gl·o_lora] */
    FB_MOE_IDX, FB_MOE_WTS, FB_MOE_Y, FB_MOE_ALL, /* routing and the routed experts' slots */
    FB_MOE_SH,                              /* the shared expert's output */
    FB_MOE_OC, FB_MOE_OG,                   /* the owner exchange's column-block sums, gathered */
    FB_TOPK,                                /* the index sources' top-k rows (attention.c's topk_rows) */
    FB_EG_IDS, FB_EG_ROWS,                  /* the stage's Engram ids and rows, every Engram layer's */
    FB_N
};

/* In a forward that runs its segments as graphs, the attention (index lists, sparse_attn) is part
 * of its output's segment, so the widths it takes are rounded up to a multiple of this: the top-k
 * rows' stride and the index lists' width grow with the context a few entries at a time, and a
 * width in a segment's key that changed every step would record the segment again every step.
 * The extra entries are -1 at the end of a row, which changes no bit (sparse_attn: the blocks of 64
 * entries the kernels walk hold the same valid entries in the same places; test_sparse_attn_padding
 * on the GPU, test_graph_segments against graphs off on the CPU). */
#define MODEL_GRAPH_WIDTH_STEP 64
struct fbuf {
    void *p;
    size_t cap;
};

/* Per layer, per slot caches (backend memory). */
struct layer_cache {
    bf16_t *ring;   /* [slots, W, hd] window K=V ring, post-RoPE, FP8-QDQ'd: rows of m->kv */
    bf16_t *ckv;    /* KV sources: [slots, cap, hd] compressed KV, post-RoPE, FP4-QDQ'd: rows of m->kv */
    int64_t ring_row, ckv_row; /* their first rows in m->kv (sparse_attn's row numbers) */
    bf16_t *kidx;   /* index-key owners: [slots, cap, id] index keys */
    float *cmp_kv;  /* ratio>1 sources: [slots, ratio, hd] open group (fp32) */
    float *cmp_sc;  /* same, scores; -inf when empty */
    int64_t cap;    /* compressed rows per slot = max_seq_len / ratio */
};

struct slot_state {
    int64_t len;            /* positions consumed */
    int64_t *hist;          /* [max_seq_len] host: compressed token ids (Engram history) */
    int index_k_src;        /* layer whose index keys were published last (-1 none) */
};

struct model {
    const struct model_config *cfg;
    struct model_weights *w;
    struct backend *be;
    const struct engram_consts *ec;
    struct engine_opts opt;
    float *freqs[CFG_MAX_LAYERS];  /* backend [rd/2] per layer */
    float *engram_w[CFG_MAX_LAYERS]; /* backend [hc, D] fp32 q_weight*k_weight, engram layers */
    struct layer_cache *lc;        /* [n_layers] */
    /* The kv arena, [kv_rows, hd] bf16, one allocation so sparse_attn can read every key row in
     * place by int32 row number: every layer's ring and every KV source's compressed cache in rows
     * [0, kv_cache_rows), then kv_rows - kv_cache_rows scratch rows for the chunk rows of a
     * forward (one layer at a time). model_kv_reserve grows the scratch, moving the caches. */
    bf16_t *kv;
    int64_t kv_cache_rows, kv_rows;
    struct slot_state *slots;      /* [max_seqs] */
    int tp_size;
    /* weight pointers swapped for backend copies by tensor_prepare (restored by model_free) */
    const void ***prep_field;      /* [n_prep] address of the field in m->w */
    const void **prep_host;        /* [n_prep] its original host pointer */
    int n_prep, cap_prep;
    struct fbuf fb[FB_N];          /* persistent segment-edge buffers (enum fbuf_id) */
    bool graph_open;               /* a graph segment is recording (model_graph_begin) */
    uint64_t serial;               /* this model's number among those of the process (graph keys) */
    bool split_logits;             /* model_set_split_logits */
    int64_t draws_full, draws_whole_rows; /* full-row draws; those their row_topk lists did not decide */
};

/* Gather `bytes` per rank across the TP group into whole rows: src [T, n] on each rank becomes
 * dst [T, tp * n] (rank-major columns). With one rank a copy. `what` names it for the watchdog. */
void model_tp_gather_cols(struct model *m, void *dst, const void *src, int64_t T, size_t row_bytes,
                          const char *what);

/* A graph segment's key: the segment, layer, rows and model (its serial number: a model built
 * later on the same backend, whose buffers may take a freed model's addresses, has other
 * weights), then every buffer address its ops touch that the layer's weights do not fix (the
 * caller's promise of backend.h's graph_begin). */
enum graph_seg { GSEG_ATTN_IN = 1, GSEG_FFN_IN, GSEG_FFN_OUT, GSEG_FFN, GSEG_FFN_MID, GSEG_ATTN_OUT, GSEG_ATTN_WOB };
#define GRAPH_KEY_MAX 64 /* the CUDA backend keeps up to 64 words (cuda_graph.cu KEY_MAX) */
struct graph_key {
    uint64_t w[GRAPH_KEY_MAX];
    int n;
};

/* The attention's output part, whose first ops may join the segment before it where the layer is
 * attention_plain (no compressor, no indexer before it): attention_out_prepare (host-side only: the
 * core's parameters from the batch, the buffers, the first segment's key k), attention_out_ops (the
 * first segment's ops: index lists, sparse_attn, the ring's update, wo_a, wo_b with one rank) under
 * a key that holds k's words, then attention_out_rest (the TP gathers and wo_b; `issue`: that
 * segment's model_graph_begin answer; it ends the segment). attention_forward runs all three; a
 * block whose last segment issued the next layer's first ops keeps that layer's plan in the batch
 * (out_plan) for its attention_out_rest. */
struct attn_core {
    const bf16_t *q; /* [T, Hl, hd] */
    int64_t Hl, n_idx;
    struct attn_index_par ip;
    const float *sink;
    float scale;
    struct attn_rope inv;
};
struct attn_out_plan {
    struct attn_core ac;
    bf16_t *o, *u, *uf, *ol, *ug, *out; /* [T, Hl·hd], [T, Gl·o_lora], [T, K], [T, Dl], [tp, T, Gl·o_lora], out */
    struct graph_key k;
    int layer; /* the layer it was prepared for */
};

/* One forward's batch, resolved: chunk i owns the contiguous rows [row0[i], row0[i] + len), and
 * row r sits at position pos_h[r]. */
struct batch {
    const struct fwd_seq *seqs;
    int n;
    int64_t T;
    int64_t *row0;     /* [n] host */
    int32_t *pos_h;    /* [T] host positions */
    int32_t *pos;      /* [T] backend positions */
    int32_t *geo;      /* [T, AIX_COLS] backend: each row's geometry for attn_index, ring_store
                        * (kernels/attn_index_core.h) */
    /* per-forward products shared between layers (owned by the forward) */
    int32_t **topk;    /* [n_layers] index sources: backend [T, topk_w[l]] compressed ids, -1 unused */
    int64_t *topk_w;   /* [n_layers] (host) row stride of topk[l] */
    int64_t *topk_k;   /* [n_layers] (host) entries a row may hold (<= topk_w; the rest -1) */
    uint8_t *cand;     /* candidate source: backend [T, cand_w] mask */
    int64_t cand_w;
    bool graphs;       /* the forward runs its segments as graphs (model_graph_begin) */
    int attn_in_next;  /* the layer whose attention input the last block's last segment issued, or -1 */
    /* ... and whose attention_out_ops too (out_plan.layer), that segment left open (out_issue) */
    bool out_next, out_issue;
    struct attn_out_plan out_plan;
    /* The stage's Engram lookups (model.c, engram_plan): eg_n layers eg_layer[i], their ids
     * [eg_n, T, C] int64 and rows [eg_n, T, C, hd] bf16 on the backend; the FFN of layer eg_at
     * gathers them on its branch (-1: gathered before the first layer) */
    int eg_n, eg_at;
    int *eg_layer;
    int64_t *eg_ids;
    bf16_t *eg_rows;
};

/* The window width of a sequence chunk's index lists: W, or in the reference layout's prefill
 * (from position 0) min(len, W). */
int64_t model_window_width(const struct model *m, const struct fwd_seq *s);

/* A segment-edge buffer of at least `bytes` (zero-filled when `zero`, else unwritten), and its
 * release, which leaves a persistent one in place. */
void *model_fbuf(struct model *m, const struct batch *b, enum fbuf_id id, size_t bytes, bool zero);
void model_fbuf_free(struct model *m, const struct batch *b, void *p);

/* A segment's key (struct graph_key above): its first words, then its buffers and scalars. */
struct graph_key graph_key_new(const struct model *m, enum graph_seg seg, int layer, const struct batch *b);
void graph_key_ptr(struct graph_key *k, const void *p);
void graph_key_word(struct graph_key *k, uint64_t v); /* a scalar the segment's ops take */
/* true: issue the segment's ops, then call model_graph_end; false: the backend ran its recording.
 * Forwards that do not run graphs (b->graphs false, or a backend without them) always get true. */
bool model_graph_begin(struct model *m, const struct batch *b, const struct graph_key *k);
void model_graph_end(struct model *m);
/* A TP collective between two runs of a block's device ops. */
enum tp_op { TP_ALLGATHER, TP_ALLTOALL };
struct tp_call {
    enum tp_op op;
    const void *send;
    void *recv;
    size_t bytes; /* per rank (comm.h) */
    const char *what;
};
/* The collective c after a run of ops issued under `issue` (model_graph_begin's answer, or the
 * previous call's): where the TP comm is stream_ordered and the forward runs graphs, c is part of
 * the open segment (issued only when it records; k must already name c's buffers) and the
 * segment goes on; otherwise the segment ends, c runs on the host's turn, and the next segment
 * begins under k with word 0 = next (0: none begins; the ops after c, if any, run eagerly).
 * Returns whether the host issues the ops that follow. */
bool model_tp_between(struct model *m, const struct batch *b, struct graph_key *k, bool issue, int next,
                      const struct tp_call *c);
/* Two independent chains side by side (backend.h's branch ops; a backend without them runs the
 * branch's ops in issue order): the ops between model_branch_begin and model_branch_end run
 * beside those between model_branch_end and model_branch_join. */
static inline void model_branch_begin(struct model *m) {
    if (m->be->ops->branch_begin) m->be->ops->branch_begin(m->be);
}
static inline void model_branch_end(struct model *m) {
    if (m->be->ops->branch_end) m->be->ops->branch_end(m->be);
}
static inline void model_branch_join(struct model *m) {
    if (m->be->ops->branch_join) m->be->ops->branch_join(m->be);
}

/* A forward's temporary that its producer writes whole before anything reads it: backend scratch,
 * no zero fill (the CPU backend poisons it, so a read of anything unwritten fails the tests). */
static inline void *model_tmp(struct model *m, size_t bytes) { return m->be->ops->scratch(m->be, bytes); }
/* Frees a temporary or an alloc'ed buffer; NULL is allowed. */
static inline void model_tfree(struct model *m, void *p) {
    if (p) m->be->ops->free(m->be, p);
}

/* A batch of independent device copies for be->ops->copy_segs: a forward moves rows between
 * caches and scratch per sequence, and one call per batch (not per row) keeps the host's work per
 * step independent of the batch size. Adjacent rows merge into one segment. */
struct seg_list {
    struct copy_seg *s;
    int64_t n, cap;
};
void seg_push(struct seg_list *l, void *dst, const void *src, size_t bytes);
/* Runs the pending copies (one backend call) and empties the list. */
void seg_flush(struct model *m, struct seg_list *l);
void seg_free(struct seg_list *l);

/* attention.c, in parts so the projections can join the block's graph segment: the chunk's K=V
 * rows (x [T, D] normed input -> [T, hd] at attention_kv_rows) and the query chain (x -> qr
 * [T, q_lora] normed, q [T, Hl, hd] post-RoPE), two independent chains that only read x (the block
 * runs them on a branch), then the rest -> out [T, D] (after the TP gathers), in column blocks as the
 * last gather leaves it: out is [attention_out_blocks(m), T, D / that], which hc_expand reads. */
bf16_t *attention_kv_rows(struct model *m);
void attention_project_kv(struct model *m, int layer, struct batch *b, const bf16_t *x, const void *xa);
/* attention_project_q and _kv as one chain: wq_a + q_norm and wkv + kv_norm in one linear_post_pair,
 * then wq_b */
void attention_project_qkv(struct model *m, int layer, struct batch *b, const bf16_t *x, const void *xa, bf16_t *qr,
                           void *qra, bf16_t *q);
void attention_project_q(struct model *m, int layer, struct batch *b, const bf16_t *x, const void *xa, bf16_t *qr,
                         void *qra, bf16_t *q);
int attention_forward(struct model *m, int layer, struct batch *b, const bf16_t *x, const bf16_t *qr, const void *qra,
                      const bf16_t *q, bf16_t *out, const struct fwd_hooks *hooks);
bool attention_plain(const struct model *m, int layer);
int attention_out_prepare(struct model *m, int layer, struct batch *b, const bf16_t *q, bf16_t *out,
                          struct attn_out_plan *p);
void attention_out_ops(struct model *m, int layer, struct batch *b, const struct attn_out_plan *p);
void attention_out_rest(struct model *m, int layer, struct batch *b, struct attn_out_plan *p, bool issue);
static inline int64_t attention_out_blocks(const struct model *m) { return m->tp_size; }

static inline int64_t i64min(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t i64max(int64_t a, int64_t b) { return a > b ? a : b; }

#endif /* DS_MODEL_INTERNAL_H */
