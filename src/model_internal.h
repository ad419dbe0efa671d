/* Internals shared by the files of the forward pass (model.c, attention.c): the model object,
 * per-slot state and the per-forward batch description. Not part of the public model API. */
#ifndef DS_MODEL_INTERNAL_H
#define DS_MODEL_INTERNAL_H

#include "model.h"

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
};

/* Gather `bytes` per rank across the TP group into whole rows: src [T, n] on each rank becomes
 * dst [T, tp * n] (rank-major columns). With one rank a copy. `what` names it for the watchdog. */
void model_tp_gather_cols(struct model *m, void *dst, const void *src, int64_t T, size_t row_bytes,
                          const char *what);

/* One forward's batch, resolved: chunk i owns the contiguous rows [row0[i], row0[i] + len), and
 * row r sits at position pos_h[r]. */
struct batch {
    const struct fwd_seq *seqs;
    int n;
    int64_t T;
    int64_t *row0;     /* [n] host */
    int32_t *pos_h;    /* [T] host positions */
    int32_t *pos;      /* [T] backend positions */
    /* per-forward products shared between layers (owned by the forward) */
    int32_t **topk;    /* [n_layers] index sources: backend [T, topk_w[l]] compressed ids, -1 unused */
    int64_t *topk_w;   /* [n_layers] (host) */
    uint8_t *cand;     /* candidate source: backend [T, cand_w] mask */
    int64_t cand_w;
};

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

/* attention.c: x [T, D] normed input -> out [T, D] (before TP reduction). */
int attention_forward(struct model *m, int layer, struct batch *b, const bf16_t *x, bf16_t *out,
                      const struct fwd_hooks *hooks);

static inline int64_t i64min(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t i64max(int64_t a, int64_t b) { return a > b ? a : b; }

#endif /* DS_MODEL_INTERNAL_H */
