/* The forward pass of one pipeline stage over a batch of sequence chunks (see model.h):
 * embedding and 4-copy expansion, Engram injection before its layers, the delayed-mHC block
 * (attention in attention.c, MoE here), the final collapse, norm and fp32 head. Also the model
 * object: per-layer RoPE tables, prepared weights, and per-slot caches. */
#include "model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "formats.h"
#include "log.h"
#include "lse_core.h"
#include "model_internal.h"
#include "sampler.h"

#define OPS (m->be->ops)

void rope_freqs(float *out, int rd, double theta, bool yarn, double factor, int64_t original_seq_len,
                double beta_fast, double beta_slow) {
    /* fp32 exponent, fp32 pow, fp32 reciprocal: the reference's bits (MODEL.md §3.13) */
    for (int i = 0; i < rd / 2; i++) {
        float e = (float)(2 * i) / (float)rd;
        out[i] = 1.0f / powf((float)theta, e);
    }
    if (!yarn || original_seq_len <= 0) return;
    double lo_d = rd * log((double)original_seq_len / (beta_fast * 2 * M_PI)) / (2 * log(theta));
    double hi_d = rd * log((double)original_seq_len / (beta_slow * 2 * M_PI)) / (2 * log(theta));
    double low = floor(lo_d), high = ceil(hi_d);
    if (low < 0) low = 0;
    if (high > rd - 1) high = rd - 1;
    float den = (float)(high - low > 1e-3 ? high - low : 1e-3);
    for (int i = 0; i < rd / 2; i++) {
        float ramp = ((float)i - (float)low) / den;
        if (ramp < 0) ramp = 0;
        if (ramp > 1) ramp = 1;
        float smooth = 1.0f - ramp;
        float f = out[i];
        float a = f / (float)factor;
        float one_minus = 1.0f - smooth;
        out[i] = a * one_minus + f * smooth;
    }
}

struct engine_opts engine_opts_default(const struct model_config *cfg) {
    int64_t len = cfg->max_pos < 4096 ? cfg->max_pos : 4096;
    return (struct engine_opts){.max_seq_len = len, .max_seqs = 1, .stale_index_keys = true,
                                .window_layout = WINDOW_LAYOUT_REFERENCE, .graphs = true};
}

static void *balloc(struct model *m, size_t bytes) { return OPS->alloc(m->be, bytes); }

void *model_fbuf(struct model *m, const struct batch *b, enum fbuf_id id, size_t bytes, bool zero) {
    if (!b->graphs) return zero ? balloc(m, bytes) : model_tmp(m, bytes);
    struct fbuf *f = &m->fb[id];
    if (f->cap < bytes) {
        /* grown only: a recording that held the old address stops matching (its key has it) */
        model_tfree(m, f->p);
        f->p = balloc(m, bytes);
        f->cap = bytes;
    }
    return f->p;
}

void model_fbuf_free(struct model *m, const struct batch *b, void *p) {
    if (!b->graphs) model_tfree(m, p);
}

struct graph_key graph_key_new(const struct model *m, enum graph_seg seg, int layer, const struct batch *b) {
    struct graph_key k = {.n = 4};
    k.w[0] = (uint64_t)seg;
    k.w[1] = (uint64_t)layer;
    k.w[2] = (uint64_t)b->T;
    k.w[3] = m->serial;
    return k;
}

void graph_key_word(struct graph_key *k, uint64_t v) {
    if (k->n == GRAPH_KEY_MAX) ds_die("internal: graph segment key %llu holds more than %d words", (unsigned long long)k->w[0], GRAPH_KEY_MAX);
    k->w[k->n++] = v;
}

void graph_key_ptr(struct graph_key *k, const void *p) { graph_key_word(k, (uint64_t)(uintptr_t)p); }

/* k's words, then all of a's */
static void key_append(struct graph_key *k, const struct graph_key *a) {
    for (int i = 0; i < a->n; i++) graph_key_word(k, a->w[i]);
}

bool model_graph_begin(struct model *m, const struct batch *b, const struct graph_key *k) {
    if (!b->graphs || !OPS->graph_begin) return true;
    if (!OPS->graph_begin(m->be, k->w, k->n)) return false;
    m->graph_open = true;
    return true;
}

void model_graph_end(struct model *m) {
    if (!m->graph_open) return;
    m->graph_open = false;
    OPS->graph_end(m->be);
}

static void tp_issue(struct comm *tp, const struct tp_call *c) {
    if (c->op == TP_ALLGATHER) tp->ops->allgather(tp, c->send, c->recv, c->bytes, c->what);
    else tp->ops->alltoall(tp, c->send, c->recv, c->bytes, c->what);
}

/* Whether model_tp_between records the collectives inside the open segment (which then goes on). */
static bool tp_in_segment(const struct model *m, const struct batch *b) {
    return b->graphs && OPS->graph_begin && m->opt.tp->stream_ordered;
}

/* Inside a segment a collective saves the host's turn around it: the segment's end, the call, the
 * next segment's launch (with NCCL's op_wait, the whole queue drained first). */
bool model_tp_between(struct model *m, const struct batch *b, struct graph_key *k, bool issue, int next,
                      const struct tp_call *c) {
    struct comm *tp = m->opt.tp;
    if (tp_in_segment(m, b)) {
        if (issue) tp_issue(tp, c);
        return issue;
    }
    if (issue) model_graph_end(m);
    tp_issue(tp, c);
    if (!next) return true;
    k->w[0] = (uint64_t)next;
    return model_graph_begin(m, b, k);
}

/* A weight the backend cannot take is a bug or a resource limit, never a state to run on. */
static void prep_weight(struct backend *be, struct qweight *w, bool dequant_bf16) {
    if (be->ops->weight_prepare(be, w, dequant_bf16)) ds_die_err();
}

/* Hand one raw weight tensor of m->w to the backend: the field then holds the backend's pointer and
 * the host pointer is remembered for model_free. */
static void prep_tensor(struct model *m, const void *field_addr, size_t bytes, bool host_resident) {
    const void **f = (const void **)field_addr;
    if (!*f) return;
    if (m->n_prep == m->cap_prep) {
        m->cap_prep = m->cap_prep ? 2 * m->cap_prep : 64;
        m->prep_field = ds_realloc(m->prep_field, sizeof *m->prep_field * (size_t)m->cap_prep);
        m->prep_host = ds_realloc(m->prep_host, sizeof *m->prep_host * (size_t)m->cap_prep);
    }
    m->prep_field[m->n_prep] = f;
    m->prep_host[m->n_prep++] = *f;
    *f = m->be->ops->tensor_prepare(m->be, *f, bytes, host_resident);
}

/* Every weight the ops read that is not a struct qweight: norms, sinks, mHC parameters, router
 * bias, embedding, Engram tables (those stay in host memory: 100 GB in the release). */
static void prep_layer_tensors(struct model *m, int l) {
    const struct model_config *c = m->cfg;
    struct layer_weights *lw = &m->w->layers[l];
    const struct layer_role *r = &c->role[l];
    int64_t hd = c->head_dim, D = c->dim, hc = c->hc_mult, nmix = (2 + hc) * hc;
    prep_tensor(m, &lw->attn.q_norm, 2 * (size_t)c->q_lora_rank, false);
    prep_tensor(m, &lw->attn.kv_norm, 2 * (size_t)hd, false);
    prep_tensor(m, &lw->attn.attn_sink, 4 * (size_t)(lw->attn.wq_b.n / hd), false);
    if (r->owns_compressor) prep_tensor(m, &lw->attn.cmp_norm, 2 * (size_t)hd, false);
    if (r->is_index_source && r->owns_index_keys) prep_tensor(m, &lw->attn.idx_k_norm, 2 * (size_t)c->index_head_dim, false);
    prep_tensor(m, &lw->ffn.bias, 4 * (size_t)lw->ffn.n_experts, false);
    prep_tensor(m, &lw->attn_norm, 2 * (size_t)D, false);
    prep_tensor(m, &lw->ffn_norm, 2 * (size_t)D, false);
    prep_tensor(m, &lw->hc_attn_fn, 4 * (size_t)(nmix * hc * D), false);
    prep_tensor(m, &lw->hc_ffn_fn, 4 * (size_t)(nmix * hc * D), false);
    if (OPS->hc_prepare) {
        OPS->hc_prepare(m->be, lw->hc_attn_fn, hc, D);
        OPS->hc_prepare(m->be, lw->hc_ffn_fn, hc, D);
    }
    prep_tensor(m, &lw->hc_attn_base, 4 * (size_t)nmix, false);
    prep_tensor(m, &lw->hc_ffn_base, 4 * (size_t)nmix, false);
    prep_tensor(m, &lw->hc_attn_scale, 4 * 3, false);
    prep_tensor(m, &lw->hc_ffn_scale, 4 * 3, false);
    if (lw->has_engram) {
        int64_t ehd = c->engram_head_dim, rows = lw->engram.rows_local;
        prep_tensor(m, &lw->engram.table, (size_t)(rows * ehd), true);
        prep_tensor(m, &lw->engram.scale, (size_t)(rows * (ehd / 32)), true);
    }
}

/* Points every layer's ring and compressed cache at its rows of the arena. */
static void model_kv_place(struct model *m) {
    const struct model_config *c = m->cfg;
    for (int l = 0; l < c->n_layers; l++) {
        struct layer_cache *lc = &m->lc[l];
        if (!m->w->layers[l].present) continue;
        lc->ring = m->kv + lc->ring_row * c->head_dim;
        if (c->role[l].owns_compressor) lc->ckv = m->kv + lc->ckv_row * c->head_dim;
    }
}

/* Scratch rows for a forward of T rows: a larger forward than any before moves the caches into a
 * larger arena (one device copy; the arena only grows, by at least half). */
static int model_kv_reserve(struct model *m, int64_t T) {
    if (m->kv_cache_rows + T <= m->kv_rows) return 0;
    int64_t want = m->kv_cache_rows + i64max(T, (m->kv_rows - m->kv_cache_rows) * 3 / 2);
    if (want > INT32_MAX) want = m->kv_cache_rows + T;
    if (want > INT32_MAX) {
        ds_err_set("a forward of %lld rows on top of %lld kv cache rows exceeds the int32 row numbers of sparse "
                   "attention: lower --chunk or --max-batch-tokens",
                   (long long)T, (long long)m->kv_cache_rows);
        return -1;
    }
    size_t rb = (size_t)m->cfg->head_dim * 2;
    bf16_t *kv = balloc(m, (size_t)want * rb);
    OPS->copy(m->be, kv, m->kv, (size_t)m->kv_cache_rows * rb);
    model_tfree(m, m->kv);
    m->kv = kv;
    m->kv_rows = want;
    model_kv_place(m);
    return 0;
}

struct model *model_new(const struct model_config *cfg, struct model_weights *w, struct backend *be,
                        const struct engram_consts *ec, const struct engine_opts *opt) {
    static uint64_t serials;
    struct model *m = ds_calloc(1, sizeof *m);
    m->serial = ++serials;
    m->cfg = cfg;
    m->w = w;
    m->be = be;
    m->ec = ec;
    m->opt = *opt;
    m->tp_size = opt->tp ? opt->tp->size : 1;
    if (opt->moe_exchange == MOE_EXCHANGE_OWNER && m->tp_size > 1 && cfg->dim % m->tp_size)
        ds_die("--moe-exchange owner: the model's dim %lld does not split into %d equal column blocks (TP size)",
               (long long)cfg->dim, m->tp_size);
    int total = config_total_layers(cfg);
    int64_t hd = cfg->head_dim, D = cfg->dim, hc = cfg->hc_mult, W = cfg->window, S = opt->max_seqs;
    float *fr = ds_malloc(sizeof(float) * (size_t)cfg->rope_dim);
    for (int l = 0; l < total; l++) {
        const struct layer_role *r = &cfg->role[l];
        rope_freqs(fr, cfg->rope_dim, r->rope_theta, r->yarn, cfg->rope_factor, cfg->original_seq_len, cfg->beta_fast,
                   cfg->beta_slow);
        m->freqs[l] = balloc(m, sizeof(float) * (size_t)cfg->rope_dim / 2);
        OPS->upload(be, m->freqs[l], fr, sizeof(float) * (size_t)cfg->rope_dim / 2);
    }
    free(fr);
    m->lc = ds_calloc((size_t)total, sizeof *m->lc);
    for (int l = 0; l < cfg->n_layers; l++) {
        struct layer_weights *lw = &w->layers[l];
        if (!lw->present) continue;
        const struct layer_role *r = &cfg->role[l];
        struct layer_cache *lc = &m->lc[l];
        /* prepare every weight of the layer for the backend; wo_a goes to bf16 as in the reference */
        struct qweight *qs[] = {&lw->attn.wq_a, &lw->attn.wq_b, &lw->attn.wkv, &lw->attn.wo_b, &lw->ffn.gate,
                                &lw->ffn.sh_w1, &lw->ffn.sh_w3, &lw->ffn.sh_w2};
        for (size_t i = 0; i < sizeof qs / sizeof *qs; i++) prep_weight(be, qs[i], false);
        prep_weight(be, &lw->attn.wo_a, true);
        for (int e = 0; e < lw->ffn.n_local; e++) {
            prep_weight(be, &lw->ffn.w1[e], false);
            prep_weight(be, &lw->ffn.w3[e], false);
            prep_weight(be, &lw->ffn.w2[e], false);
        }
        if (r->owns_compressor) {
            prep_weight(be, &lw->attn.cmp_wkv, false);
            if (r->ratio > 1) prep_weight(be, &lw->attn.cmp_wgate, false);
        }
        if (r->is_index_source) {
            prep_weight(be, &lw->attn.idx_wq_b, false);
            prep_weight(be, &lw->attn.idx_weights_proj, false);
            if (r->owns_index_keys) prep_weight(be, &lw->attn.idx_wk, false);
        }
        if (lw->has_engram) {
            prep_weight(be, &lw->engram.wkv, false);
            float *ew = ds_malloc(sizeof(float) * (size_t)(hc * D));
            for (int64_t i = 0; i < hc * D; i++)
                ew[i] = bf16_to_f32(lw->engram.q_weight[i]) * bf16_to_f32(lw->engram.k_weight[i]);
            m->engram_w[l] = balloc(m, sizeof(float) * (size_t)(hc * D));
            OPS->upload(be, m->engram_w[l], ew, sizeof(float) * (size_t)(hc * D));
            free(ew);
        }
        prep_layer_tensors(m, l);
        /* ring and compressed cache: row ranges of the kv arena, placed below */
        lc->ring_row = m->kv_cache_rows;
        m->kv_cache_rows += S * W;
        if (r->owns_compressor) {
            lc->cap = opt->max_seq_len / r->ratio;
            lc->ckv_row = m->kv_cache_rows;
            m->kv_cache_rows += S * lc->cap + 1;
            if (r->owns_index_keys) lc->kidx = balloc(m, (size_t)(S * lc->cap + 1) * cfg->index_head_dim * 2);
            if (r->ratio > 1) {
                lc->cmp_kv = balloc(m, (size_t)S * r->ratio * hd * 4);
                lc->cmp_sc = balloc(m, (size_t)S * r->ratio * hd * 4);
            }
        }
    }
    /* the arena: caches zero-filled, then scratch for a forward of 4,096 rows (or max_seqs) — the
     * usual first prefill fits, so the caches seldom move (a move holds two arenas for a moment) */
    int64_t scratch = opt->kv_scratch_rows > 0 ? opt->kv_scratch_rows : 4096;
    if (scratch < S) scratch = S;
    if (m->kv_cache_rows + scratch > INT32_MAX)
        ds_die("kv caches of %lld rows (max_seqs %lld x max_seq_len %lld) exceed the int32 row numbers of "
               "sparse attention: lower --max-seqs or --max-seq-len, or use more pipeline stages",
               (long long)m->kv_cache_rows, (long long)S, (long long)opt->max_seq_len);
    m->kv_rows = m->kv_cache_rows + scratch;
    m->kv = balloc(m, (size_t)m->kv_rows * hd * 2);
    model_kv_place(m);
    /* stage 0 of a pipeline keeps mirrors of later stages' index keys for the stale-key quirk */
    for (int l = 0; l < cfg->n_layers && opt->stale_index_keys; l++) {
        const struct layer_role *r = &cfg->role[l];
        struct layer_cache *lc = &m->lc[l];
        if (w->layers[l].present || !r->owns_index_keys || !w->opt.first_stage) continue;
        lc->cap = opt->max_seq_len / r->ratio;
        lc->kidx = balloc(m, (size_t)(S * lc->cap + 1) * cfg->index_head_dim * 2);
    }
    if (w->opt.last_stage) {
        prep_weight(be, &w->head, false);
        prep_tensor(m, &w->norm, 2 * (size_t)D, false);
    }
    if (w->opt.first_stage) prep_tensor(m, &w->embed, 2 * (size_t)(w->vocab_rows * D), false);
    m->slots = ds_calloc((size_t)S, sizeof *m->slots);
    for (int s = 0; s < S; s++) {
        m->slots[s].hist = ds_calloc((size_t)opt->max_seq_len + 1, sizeof(int64_t));
        model_reset_slot(m, s);
    }
    return m;
}

void model_reset_slot(struct model *m, int slot) {
    struct slot_state *st = &m->slots[slot];
    st->len = 0;
    st->index_k_src = -1;
    const struct model_config *c = m->cfg;
    int64_t hd = c->head_dim;
    for (int l = 0; l < c->n_layers; l++) {
        struct layer_cache *lc = &m->lc[l];
        int ratio = c->role[l].ratio;
        if (!lc->cmp_sc) continue;
        /* an empty open group: scores -inf, so a half group never leaks an old token */
        size_t n = (size_t)ratio * hd;
        float *tmp = ds_malloc(n * sizeof(float));
        for (size_t i = 0; i < n; i++) tmp[i] = -INFINITY;
        OPS->upload(m->be, lc->cmp_sc + (size_t)slot * n, tmp, n * sizeof(float));
        memset(tmp, 0, n * sizeof(float));
        OPS->upload(m->be, lc->cmp_kv + (size_t)slot * n, tmp, n * sizeof(float));
        free(tmp);
    }
}

int64_t model_slot_len(const struct model *m, int slot) { return m->slots[slot].len; }

int64_t model_max_seq_len(const struct model *m) { return m->opt.max_seq_len; }

int model_max_seqs(const struct model *m) { return m->opt.max_seqs; }

void model_free(struct model *m) {
    if (!m) return;
    const struct model_config *c = m->cfg;
    int total = config_total_layers(c);
    for (int l = 0; l < total; l++) {
        model_tfree(m, m->freqs[l]);
        model_tfree(m, m->engram_w[l]);
    }
    for (int l = 0; l < c->n_layers; l++) {
        struct layer_cache *lc = &m->lc[l];
        model_tfree(m, lc->kidx);
        model_tfree(m, lc->cmp_kv);
        model_tfree(m, lc->cmp_sc);
        struct layer_weights *lw = &m->w->layers[l];
        if (!lw->present) continue;
        const struct layer_role *r = &c->role[l];
        struct qweight *qs[] = {&lw->attn.wq_a, &lw->attn.wq_b, &lw->attn.wkv, &lw->attn.wo_a, &lw->attn.wo_b,
                                &lw->ffn.gate, &lw->ffn.sh_w1, &lw->ffn.sh_w3, &lw->ffn.sh_w2};
        for (size_t i = 0; i < sizeof qs / sizeof *qs; i++) m->be->ops->weight_release(m->be, qs[i]);
        for (int e = 0; e < lw->ffn.n_local; e++) {
            m->be->ops->weight_release(m->be, &lw->ffn.w1[e]);
            m->be->ops->weight_release(m->be, &lw->ffn.w3[e]);
            m->be->ops->weight_release(m->be, &lw->ffn.w2[e]);
        }
        if (r->owns_compressor) {
            m->be->ops->weight_release(m->be, &lw->attn.cmp_wkv);
            if (r->ratio > 1) m->be->ops->weight_release(m->be, &lw->attn.cmp_wgate);
        }
        if (r->is_index_source) {
            m->be->ops->weight_release(m->be, &lw->attn.idx_wq_b);
            m->be->ops->weight_release(m->be, &lw->attn.idx_weights_proj);
            if (r->owns_index_keys) m->be->ops->weight_release(m->be, &lw->attn.idx_wk);
        }
        if (lw->has_engram) m->be->ops->weight_release(m->be, &lw->engram.wkv);
    }
    if (m->w->opt.last_stage) m->be->ops->weight_release(m->be, &m->w->head);
    for (int i = m->n_prep - 1; i >= 0; i--) {
        m->be->ops->tensor_release(m->be, *m->prep_field[i]);
        *m->prep_field[i] = m->prep_host[i];
    }
    model_tfree(m, m->kv);
    for (int i = 0; i < FB_N; i++) model_tfree(m, m->fb[i].p);
    free(m->prep_field);
    free(m->prep_host);
    for (int s = 0; s < m->opt.max_seqs; s++) free(m->slots[s].hist);
    free(m->slots);
    free(m->lc);
    free(m);
}

void seg_push(struct seg_list *l, void *dst, const void *src, size_t bytes) {
    if (!bytes) return;
    if (l->n) {
        struct copy_seg *t = &l->s[l->n - 1];
        if ((uint8_t *)t->dst + t->bytes == (uint8_t *)dst && (const uint8_t *)t->src + t->bytes == (const uint8_t *)src) {
            t->bytes += bytes;
            return;
        }
    }
    if (l->n == l->cap) l->s = ds_realloc(l->s, sizeof *l->s * (size_t)(l->cap = l->cap ? 2 * l->cap : 64));
    l->s[l->n++] = (struct copy_seg){dst, src, bytes};
}

void seg_flush(struct model *m, struct seg_list *l) {
    if (l->n) OPS->copy_segs(m->be, l->s, l->n);
    l->n = 0;
}

void seg_free(struct seg_list *l) {
    free(l->s);
    *l = (struct seg_list){0};
}

void model_tp_gather_cols(struct model *m, void *dst, const void *src, int64_t T, size_t row_bytes,
                          const char *what) {
    if (m->tp_size == 1) {
        OPS->copy(m->be, dst, src, row_bytes * (size_t)T);
        return;
    }
    void *all = model_tmp(m, row_bytes * (size_t)T * (size_t)m->tp_size);
    m->opt.tp->ops->allgather(m->opt.tp, src, all, row_bytes * (size_t)T, what);
    OPS->interleave(m->be, dst, all, m->tp_size, T, row_bytes);
    model_tfree(m, all);
}

/* key sync wire format: int32 n_seq, then per sequence (slot, publishing layer or -1); int32 n_rows,
 * then per row (layer, slot, j) and index_head_dim bf16 values. Appending merges: a later stage's
 * publisher replaces an earlier one. */
static void put32(uint8_t **b, size_t *len, size_t *cap, int32_t v) {
    if (*len + 4 > *cap) *b = ds_realloc(*b, *cap = (*cap + 4) * 2);
    memcpy(*b + *len, &v, 4);
    *len += 4;
}

void model_key_sync_append(struct model *m, const struct fwd_seq *seqs, int n, uint8_t **buf, size_t *len) {
    const struct model_config *c = m->cfg;
    int64_t id = c->index_head_dim;
    /* read what came from upstream */
    int32_t up_n = 0, *up = NULL, up_rows = 0;
    const uint8_t *rows_in = NULL;
    if (*buf && *len >= 4) {
        memcpy(&up_n, *buf, 4);
        up = ds_malloc(sizeof(int32_t) * (size_t)(2 * up_n + 1));
        memcpy(up, *buf + 4, sizeof(int32_t) * (size_t)(2 * up_n));
        memcpy(&up_rows, *buf + 4 + 8 * (size_t)up_n, 4);
        rows_in = *buf + 8 + 8 * (size_t)up_n;
    }
    uint8_t *out = NULL;
    size_t ol = 0, cap = 0;
    put32(&out, &ol, &cap, n);
    for (int i = 0; i < n; i++) {
        int slot = seqs[i].slot, src = -1;
        for (int u = 0; u < up_n; u++)
            if (up[2 * u] == slot) src = up[2 * u + 1];
        for (int l = 0; l < c->n_layers; l++) {
            const struct layer_role *r = &c->role[l];
            if (!m->w->layers[l].present || !r->owns_index_keys) continue;
            if ((seqs[i].start + seqs[i].len) / r->ratio > seqs[i].start / r->ratio) src = m->slots[slot].index_k_src;
        }
        put32(&out, &ol, &cap, slot);
        put32(&out, &ol, &cap, src);
    }
    int32_t nrows = up_rows;
    for (int i = 0; i < n; i++)
        for (int l = 0; l < c->n_layers; l++) {
            const struct layer_role *r = &c->role[l];
            if (m->w->layers[l].present && r->owns_index_keys)
                nrows += (int32_t)((seqs[i].start + seqs[i].len) / r->ratio - seqs[i].start / r->ratio);
        }
    put32(&out, &ol, &cap, nrows);
    size_t row_bytes = 12 + (size_t)id * 2, need = ol + (size_t)nrows * row_bytes;
    if (need > cap) out = ds_realloc(out, cap = need);
    if (up_rows) memcpy(out + ol, rows_in, (size_t)up_rows * row_bytes);
    ol += (size_t)up_rows * row_bytes;
    /* this stage's new key rows: gathered on the backend by one copy_segs, then one download (a
     * download waits for the device: once per forward, not once per row) */
    size_t rb = (size_t)id * 2, nnew = (size_t)(nrows - up_rows), first = ol;
    bf16_t *g = nnew ? model_tmp(m, nnew * rb) : NULL;
    struct seg_list sl = {0};
    for (int i = 0; i < n; i++)
        for (int l = 0; l < c->n_layers; l++) {
            const struct layer_role *r = &c->role[l];
            struct layer_cache *lc = &m->lc[l];
            if (!m->w->layers[l].present || !r->owns_index_keys) continue;
            for (int64_t j = seqs[i].start / r->ratio; j < (seqs[i].start + seqs[i].len) / r->ratio; j++) {
                int32_t hdr[3] = {l, seqs[i].slot, (int32_t)j};
                memcpy(out + ol, hdr, 12);
                seg_push(&sl, g + (ol - first) / row_bytes * id, lc->kidx + ((size_t)seqs[i].slot * lc->cap + j) * id, rb);
                ol += row_bytes;
            }
        }
    if (nnew) {
        seg_flush(m, &sl);
        uint8_t *h = ds_malloc(nnew * rb);
        OPS->download(m->be, h, g, nnew * rb);
        for (size_t q = 0; q < nnew; q++) memcpy(out + first + q * row_bytes + 12, h + q * rb, rb);
        free(h);
        model_tfree(m, g);
    }
    seg_free(&sl);
    free(up);
    free(*buf);
    *buf = out;
    *len = ol;
}

int model_key_sync_apply(struct model *m, const uint8_t *buf, size_t len) {
    const struct model_config *c = m->cfg;
    int64_t id = c->index_head_dim;
    int32_t ns, nrows;
    if (len < 8) return 0;
    memcpy(&ns, buf, 4);
    for (int i = 0; i < ns; i++) {
        int32_t sv[2];
        memcpy(sv, buf + 4 + 8 * (size_t)i, 8);
        if (sv[1] >= 0) m->slots[sv[0]].index_k_src = sv[1];
    }
    memcpy(&nrows, buf + 4 + 8 * (size_t)ns, 4);
    const uint8_t *p = buf + 8 + 8 * (size_t)ns;
    /* the mirrored rows: one upload of all of them, then one copy_segs into the caches */
    size_t rb = (size_t)id * 2;
    uint8_t *h = ds_malloc((size_t)nrows * rb + 1);
    bf16_t *g = nrows ? model_tmp(m, (size_t)nrows * rb) : NULL;
    struct seg_list sl = {0};
    int32_t kept = 0;
    int rc = 0;
    for (int32_t r = 0; r < nrows; r++, p += 12 + rb) {
        int32_t hdr[3];
        memcpy(hdr, p, 12);
        if (hdr[0] < 0 || hdr[0] >= c->n_layers || hdr[1] < 0 || hdr[1] >= m->opt.max_seqs) {
            ds_err_set("key sync: row %d names layer %d, slot %d (of %d layers, %d slots)", r, hdr[0], hdr[1],
                       c->n_layers, m->opt.max_seqs);
            rc = -1;
            break;
        }
        struct layer_cache *lc = &m->lc[hdr[0]];
        if (m->w->layers[hdr[0]].present || !lc->kidx) continue;
        if (hdr[2] < 0 || hdr[2] >= lc->cap) {
            ds_err_set("key sync: row %d of layer %d beyond the cache (%lld rows)", hdr[2], hdr[0], (long long)lc->cap);
            rc = -1;
            break;
        }
        memcpy(h + (size_t)kept * rb, p + 12, rb);
        seg_push(&sl, lc->kidx + ((size_t)hdr[1] * lc->cap + hdr[2]) * id, g + (size_t)kept * id, rb);
        kept++;
    }
    if (rc == 0 && kept) {
        OPS->upload(m->be, g, h, (size_t)kept * rb);
        seg_flush(m, &sl);
    }
    seg_free(&sl);
    model_tfree(m, g);
    free(h);
    return rc;
}

/* The largest logits buffer this process's head has produced, in rows (R x vocab floats): score's
 * promise that a long prompt never needs more than a chunk of rows is checked against it. */
static int64_t g_head_rows_max;

int64_t model_head_rows_max(void) { return g_head_rows_max; }

void model_set_split_logits(struct model *m, bool on) { m->split_logits = on; }

bool model_logits_split(const struct model *m, int64_t R, int64_t *r0, int64_t *r1) {
    int64_t P = m->tp_size;
    if (!m->split_logits || P < 2 || R < P) {
        *r0 = 0, *r1 = R;
        return false;
    }
    int64_t Rp = (R + P - 1) / P;
    *r0 = m->opt.tp->rank * Rp;
    *r1 = *r0 + Rp < R ? *r0 + Rp : R;
    return true;
}

int64_t model_logits_rows(const struct fwd_seq *seqs, int n) {
    int64_t r = 0;
    for (int i = 0; i < n; i++) r += seqs[i].all_logits ? seqs[i].len : 1;
    return r;
}

/* Engram (§3.3): the stage's lookups for the whole batch. The hash ids depend on the tokens alone,
 * so every Engram layer's are computed and uploaded (one upload) before the first layer runs; the
 * rows come from this rank's slice of the table (zeros elsewhere, summed over the TP group just
 * before use) or from the whole table when the node's Engram service holds it. The gathers read
 * host memory over the bus (mapped pinned tables), so they are issued first on the branch of the
 * stage's first layer's FFN segment (b->eg_at), beside the router and the routed experts' HBM-bound
 * kernels, or where the stage's first layer is an Engram layer itself, before it.
 * H100, bench_step (results/PERFORMANCE_HISTORY.md, "d1dc353..HEAD"): as one launch each before
 * layer 0 they were 0.21 ms of a step exposed at batch 256 (0.06 at 64); on the branch's start
 * 1.5 µs (3 at 64), the step within the runs' spread of its base (three binaries alternated twice in
 * one call: 17.69 17.75 -> 17.71 17.73 ms at batch 256, 10.30 10.31 -> 10.27 10.30 at 64, 3.75 3.73
 * -> 3.71 3.78 at 1): the shared expert behind them on the branch comes out later by about as much.
 * At the branch's end they waited behind the routed experts' grids (still exposed); with four
 * 16-byte reads a thread (a quarter of the CTAs) a gather took longer (213 -> 233 µs at 256 rows);
 * issued after the first layer's work instead (the host hashing while the GPU runs it) the GPU's
 * wait at the step's start stayed (30 / 46 / 50 µs at batch 1 / 64 / 256: the forward's own setup).
 * None of those kept. */
static void engram_plan(struct model *m, struct batch *b, const struct fwd_hooks *hooks) {
    const struct model_config *c = m->cfg;
    int64_t T = b->T, C = m->ec->n_cols, hd = c->engram_head_dim;
    int first = -1;
    b->eg_n = 0, b->eg_at = -1;
    for (int l = 0; l < c->n_layers; l++) {
        if (!m->w->layers[l].present) continue;
        if (first < 0) first = l;
        if (c->role[l].engram_idx >= 0) b->eg_n++;
    }
    if (!b->eg_n) return;
    b->eg_layer = ds_malloc(sizeof(int) * (size_t)b->eg_n);
    int64_t *ids = ds_malloc(sizeof(int64_t) * (size_t)(b->eg_n * T * C));
    for (int l = 0, i = 0; l < c->n_layers; l++) {
        if (!m->w->layers[l].present || c->role[l].engram_idx < 0) continue;
        int64_t *il = ids + (size_t)i * (size_t)(T * C);
        for (int q = 0; q < b->n; q++) {
            const struct fwd_seq *s = &b->seqs[q];
            for (int64_t t = 0; t < s->len; t++)
                engram_hash_position(m->ec, c->role[l].engram_idx, m->slots[s->slot].hist, s->start + t,
                                     il + (b->row0[q] + t) * C);
        }
        if (hooks && hooks->engram_ids) hooks->engram_ids(hooks->ctx, l, il, T, C);
        b->eg_layer[i++] = l;
    }
    b->eg_ids = model_fbuf(m, b, FB_EG_IDS, sizeof(int64_t) * (size_t)(b->eg_n * T * C), false);
    b->eg_rows = model_fbuf(m, b, FB_EG_ROWS, (size_t)(b->eg_n * T * C * hd) * 2, false);
    OPS->upload(m->be, b->eg_ids, ids, sizeof(int64_t) * (size_t)(b->eg_n * T * C));
    free(ids);
    if (c->role[first].engram_idx < 0) b->eg_at = first;
}

/* The gathers of engram_plan's lookups (device ops only: a branch and a graph segment may hold
 * them). */
static void engram_gathers(struct model *m, const struct batch *b) {
    const struct model_config *c = m->cfg;
    int64_t T = b->T, C = m->ec->n_cols, hd = c->engram_head_dim;
    for (int i = 0; i < b->eg_n; i++) {
        const struct engram_weights *ew = &m->w->layers[b->eg_layer[i]].engram;
        bf16_t *rows = b->eg_rows + (size_t)i * (size_t)(T * C * hd);
        const int64_t *ids = b->eg_ids + (size_t)i * (size_t)(T * C);
        OPS->engram_gather(m->be, rows, ids, T, C, ew->table, ew->scale, ew->row0, ew->rows_local, hd);
    }
}

/* Layer l's gathered rows, summed over the TP group where the table is row-split (exactly one rank
 * holds each row, the others add zeros: exact). */
static const bf16_t *engram_rows(struct model *m, int l, const struct batch *b) {
    const struct engram_weights *ew = &m->w->layers[l].engram;
    int64_t T = b->T, C = m->ec->n_cols, hd = m->cfg->engram_head_dim;
    int i = 0;
    while (b->eg_layer[i] != l) i++;
    bf16_t *rows = b->eg_rows + (size_t)i * (size_t)(T * C * hd);
    if (m->tp_size > 1 && ew->rows_local < ew->rows)
        m->opt.tp->ops->allreduce_sum(m->opt.tp, rows, (size_t)(T * C * hd), COMM_BF16, "engram rows");
    return rows;
}

/* Engram (§3.3) before block l: project the prefetched rows, gate and inject into X. */
static void engram_forward(struct model *m, int l, struct batch *b, bf16_t *X, const bf16_t *rows) {
    const struct model_config *c = m->cfg;
    const struct engram_weights *ew = &m->w->layers[l].engram;
    int64_t T = b->T, D = c->dim, hc = c->hc_mult;
    bf16_t *kv = model_tmp(m, (size_t)(T * (hc + 1) * D) * 2);
    OPS->linear(m->be, kv, rows, T, &ew->wkv);
    OPS->engram_gate(m->be, X, kv, m->engram_w[l], T, hc, D, (float)c->norm_eps);
    model_tfree(m, kv);
}

/* MoE (§3.10), first part: the shared expert into sh [T, D] bf16, and the router and this rank's
 * routed experts into their slots of ye [T, k, D] bf16 (idx [T, k] int32, wts [T, k] fp32). The
 * two chains only read x; block_forward runs the shared expert on a branch beside the routed path,
 * where at decode sizes each leaves most SMs idle (its own three linears cost as much as the
 * router). */
static void moe_shared(struct model *m, int l, struct batch *b, const bf16_t *x, const void *xa, bf16_t *sh) {
    const struct ffn_weights *fw = &m->w->layers[l].ffn;
    if (xa && OPS->shared_expert_act)
        OPS->shared_expert_act(m->be, sh, x, xa, b->T, &fw->sh_w1, &fw->sh_w3, &fw->sh_w2, (float)m->cfg->swiglu_limit);
    else
        OPS->shared_expert(m->be, sh, x, b->T, &fw->sh_w1, &fw->sh_w3, &fw->sh_w2, (float)m->cfg->swiglu_limit);
}

static void moe_router(struct model *m, int l, struct batch *b, const bf16_t *x, int32_t *idx, float *wts) {
    const struct model_config *c = m->cfg;
    const struct ffn_weights *fw = &m->w->layers[l].ffn;
    OPS->router(m->be, idx, wts, x, b->T, &fw->gate, fw->bias, c->role[l].n_active, (float)c->gate_temp,
                c->norm_topk_prob, (float)c->route_scale);
}

static void moe_routed(struct model *m, int l, struct batch *b, const bf16_t *x, const int32_t *idx, const float *wts,
                       bf16_t *ye) {
    const struct model_config *c = m->cfg;
    const struct ffn_weights *fw = &m->w->layers[l].ffn;
    OPS->moe_experts(m->be, ye, x, idx, wts, b->T, c->role[l].n_active, fw->e0, fw->n_local, fw->w1, fw->w3, fw->w2,
                     (float)c->swiglu_limit);
}

/* MoE, second part: every rank's slot outputs of D columns (all [P, T, k, D], P = TP size) summed
 * per token in ascending expert id into fp32 (the single-rank order), plus the shared expert's sh
 * (rows ld_sh apart), bf16 -> out [T, D]. */
static void moe_finish(struct model *m, int l, struct batch *b, const int32_t *idx, const bf16_t *all,
                       const bf16_t *sh, int64_t ld_sh, int64_t D, bf16_t *out) {
    const struct model_config *c = m->cfg;
    const struct ffn_weights *fw = &m->w->layers[l].ffn;
    OPS->moe_combine(m->be, out, all, idx, sh, ld_sh, b->T, c->role[l].n_active, D, fw->n_local, m->tp_size);
}

int64_t model_window_width(const struct model *m, const struct fwd_seq *s) {
    const int64_t W = m->cfg->window;
    return m->opt.window_layout == WINDOW_LAYOUT_REFERENCE && s->start == 0 ? (s->len < W ? s->len : W) : W;
}

/* Whether this step's experts cross the TP group by column owner (enum moe_exchange). */
static bool moe_by_owner(const struct model *m, int64_t T, int64_t k) {
    int64_t P = m->tp_size, D = m->cfg->dim;
    if (P == 1 || D % P) return false;
    if (m->opt.moe_exchange != MOE_EXCHANGE_AUTO) return m->opt.moe_exchange == MOE_EXCHANGE_OWNER;
    return (size_t)((P - 1) * T * k * D) * 2 >= MOE_OWNER_MIN_BYTES;
}

/* The residual update in front of a collapse (block_collapse's ex): X = hc_expand(yin, Xin, post,
 * comb), yin in y_blocks column blocks (hc_expand's). */
struct block_expand {
    const bf16_t *yin, *Xin; /* [y_blocks, T, D / y_blocks], [T, hc, D] bf16 */
    const float *post, *comb;
    int64_t y_blocks;
};

/* A sublayer's input: y [T, D] = rmsnorm(collapse(X, p), norm_w), and where ya is given (block_act)
 * y's activation form for the FP8 linears that read it, written in the same pass. With ex, X is
 * first made by that expand, in one op (be_hc_expand_collapse: a backend may form both in one pass
 * over the row, one launch fewer on the critical path, twice a block). */
static void block_collapse(struct model *m, const struct batch *b, bf16_t *y, void *ya, bf16_t *X, const float *p,
                           const bf16_t *norm_w, const struct block_expand *ex) {
    const struct model_config *c = m->cfg;
    const int64_t T = b->T, hc = c->hc_mult, D = c->dim;
    const float eps = (float)c->norm_eps;
    if (ex)
        be_hc_expand_collapse(m->be, X, ex->yin, ex->Xin, ex->post, ex->comb, ex->y_blocks, y, ya, p, norm_w, eps, T,
                              hc, D);
    else if (ya)
        OPS->hc_collapse_act(m->be, y, ya, X, p, T, hc, D, norm_w, eps);
    else
        OPS->hc_collapse(m->be, y, X, p, T, hc, D, norm_w, eps);
}

/* A buffer (id) for the activation form of a [T, k] input of FP8 linears, or NULL where the
 * backend's linears take none. */
static void *block_act(struct model *m, const struct batch *b, enum fbuf_id id, int64_t k) {
    if (!OPS->act_bytes || !OPS->hc_collapse_act) return NULL;
    size_t bytes = OPS->act_bytes(m->be, b->T, k);
    return bytes ? model_fbuf(m, b, id, bytes, false) : NULL;
}

/* The attention's input of block l (its first segment's ops): the collapse with attn_norm (and
 * y's activation form, ya, for the FP8 linears after it where the backend takes one), then two
 * lanes: the mixes on a branch, and on the main lane the query chain with the window K=V rows
 * (wq_a + q_norm and wkv + kv_norm as one pair linear and one launch of both norms, then wq_b).
 * Delayed mHC: the collapse takes the previous block's pre, so this block's mixes (read by the
 * FFN's collapse and by the expands) are off the critical path. A backend without
 * linear_post_pair runs three lanes: the mixes, the K=V rows, the query chain (the longest, so it
 * keeps the main lane's priority). History (results/PERFORMANCE_HISTORY.md): H200, bench_step
 * decode ms at batch 1 / 8 / 64, three runs alternated: mixes before the collapse (no overlap)
 * 5.68, 5.70, 5.70 / 8.96, 8.94, 8.99 / 18.8, 18.9, 18.8; mixes and K=V rows on the branch 5.51,
 * 5.43, 5.37 / 8.79, 8.67, 8.59 / 18.4, 18.3, 18.3; the query chain on the branch 5.31, 5.37,
 * 5.29 / 8.54, 8.59, 8.53 / 18.0, 18.2, 18.0. Three lanes (H100, bench_step --ctx 64 --batch
 * 1,8,64,256 --steps 5 --prefill "", two runs alternated with two lanes): 3.745 3.833 / 4.929
 * 5.018 / 10.24 10.42 / 17.67 18.01 -> 3.675 3.757 / 4.795 4.862 / 10.12 10.26 / 17.50 17.74 ms;
 * but there the q_norm and the kv_norm ran side by side and one of them took 12-15 µs instead of
 * 4.5-5.5, and the activation forms made that worse. The pair (H200, same command, two runs
 * alternated with three lanes): 3.607 3.609 / 4.636 4.602 / 9.833 9.851 / 16.58 16.59 -> 3.443
 * 3.455 / 4.645 4.666 / 9.776 9.820 / 16.62 16.59 ms. */
static void block_attn_in(struct model *m, int l, struct batch *b, bf16_t *X, float *apre, float *post, float *comb,
                          bf16_t *y, void *ya, bf16_t *qr, void *qra, bf16_t *q, const float *P,
                          const struct block_expand *ex) {
    const struct model_config *c = m->cfg;
    const struct layer_weights *lw = &m->w->layers[l];
    block_collapse(m, b, y, ya, X, P, lw->attn_norm, ex); /* with ex, X is made here (the block before's last expand) */
    model_branch_begin(m);
    OPS->hc_mixes(m->be, apre, post, comb, X, b->T, c->hc_mult, c->dim, lw->hc_attn_fn, lw->hc_attn_scale,
                  lw->hc_attn_base, c->hc_sinkhorn_iters, (float)c->norm_eps, (float)c->hc_eps);
    model_branch_end(m);
    if (OPS->linear_post_pair) { /* the query chain and the K=V rows as one chain: wq_a and wkv in one pair */
        attention_project_qkv(m, l, b, y, ya, qr, qra, q);
    } else {
        model_branch_begin(m);
        attention_project_kv(m, l, b, y, ya);
        model_branch_end(m);
        attention_project_q(m, l, b, y, ya, qr, qra, q);
    }
    model_branch_join(m);
}

/* The layer whose attention input (block_attn_in) joins block l's last segment, or -1: with
 * graphs, no hooks (a hook may read or force the stream between blocks) and a next layer on this
 * stage without Engram (its gate changes the stream before the block). Two graphs launched back
 * to back left the GPU idle ~1.3 µs between them, before 37 of a step's 40 blocks' collapses at
 * batch 1 (H100 timeline of 63e839c). */
static int next_attn_in(const struct model *m, int l, const struct batch *b, const struct fwd_hooks *hooks) {
    const struct model_config *c = m->cfg;
    if (!b->graphs || hooks) return -1;
    for (int n = l + 1; n < c->n_layers; n++)
        if (m->w->layers[n].present) return c->role[n].engram_idx >= 0 ? -1 : n;
    return -1;
}

/* One block (§3.2 delayed mHC, attention, MoE). The runs between the host's own work (attention's
 * index lists and cache copies, the TP collectives unless model_tp_between may record them) are
 * graph segments: replayed as one launch in a decode step (model_graph_begin), their keys naming
 * every buffer their ops touch. The last one also holds the next block's attention input where
 * next_attn_in allows (b->attn_in_next). */
static int block_forward(struct model *m, int l, struct batch *b, bf16_t *X, bf16_t *X1, float *P,
                         const struct fwd_hooks *hooks) {
    const struct model_config *c = m->cfg;
    const struct layer_weights *lw = &m->w->layers[l];
    const struct attn_weights *aw = &lw->attn;
    int64_t T = b->T, D = c->dim, hc = c->hc_mult, k = c->role[l].n_active;
    float eps = (float)c->norm_eps, hc_eps = (float)c->hc_eps;
    float *apre = model_fbuf(m, b, FB_APRE, sizeof(float) * (size_t)(T * hc), false);
    float *post = model_fbuf(m, b, FB_POST, sizeof(float) * (size_t)(T * hc), false);
    float *comb = model_fbuf(m, b, FB_COMB, sizeof(float) * (size_t)(T * hc * hc), false);
    bf16_t *y = model_fbuf(m, b, FB_Y, (size_t)(T * D) * 2, false);
    void *ya = block_act(m, b, FB_YA, D);                 /* y's activation form, or NULL */
    void *qra = block_act(m, b, FB_QRA, c->q_lora_rank); /* qr's */
    bf16_t *o = model_fbuf(m, b, FB_O, (size_t)(T * D) * 2, false);
    bf16_t *qr = model_fbuf(m, b, FB_QR, (size_t)(T * c->q_lora_rank) * 2, false);
    bf16_t *q = model_fbuf(m, b, FB_Q, (size_t)(T * aw->wq_b.n) * 2, false);
    bf16_t *kvr = attention_kv_rows(m);

    struct graph_key ka = graph_key_new(m, GSEG_ATTN_IN, l, b);
    const void *ka_p[] = {X, P, apre, post, comb, y, ya, qr, qra, q, kvr, b->pos};
    for (size_t i = 0; i < sizeof ka_p / sizeof *ka_p; i++) graph_key_ptr(&ka, ka_p[i]);
    if (b->attn_in_next != l && model_graph_begin(m, b, &ka)) { /* else the block before issued it */
        block_attn_in(m, l, b, X, apre, post, comb, y, ya, qr, qra, q, P, NULL);
        model_graph_end(m);
    }
    const int nx = next_attn_in(m, l, b, hooks);
    b->attn_in_next = -1;
    int rc;
    if (b->out_next && b->out_plan.layer == l) { /* the block before's last segment issued the attention's first ops; still open */
        b->out_next = false;
        attention_out_rest(m, l, b, &b->out_plan, b->out_issue);
        rc = 0;
    } else {
        rc = attention_forward(m, l, b, y, qr, qra, q, o, hooks);
    }
    if (rc == 0) {
        /* FFN: its own mixes from X1; collapses with the attention's pre; hands its pre onwards.
         * The experts are split by id over the TP group: each rank's slot outputs cross the group
         * between segments (with one rank there is nothing between them: one segment). By gather:
         * every rank sums all of D from everyone's [T, k, D]. By owner (moe_by_owner): the slots
         * are packed into np column blocks (snd [np, T, k, Dc]), an all-to-all hands rank r block
         * r of every rank (into ye, free by then), rank r sums its Dc columns (oc [T, Dc]), and an
         * all-gather (og [np, T, Dc]) hands every rank all columns, which the expand reads as they
         * lie (y_blocks; an interleave into [T, D] was one more launch a layer). */
        const int64_t np = m->tp_size, Dc = D / np;
        const bool one = np == 1, owner = moe_by_owner(m, T, k);
        int32_t *idx = model_fbuf(m, b, FB_MOE_IDX, sizeof(int32_t) * (size_t)(T * k), false);
        float *wts = model_fbuf(m, b, FB_MOE_WTS, sizeof(float) * (size_t)(T * k), false);
        /* slots of other ranks' experts are left untouched by moe_experts (and never read) */
        bf16_t *ye = model_fbuf(m, b, FB_MOE_Y, (size_t)(T * k * D) * 2, true), *all = ye, *oc = NULL, *og = NULL;
        if (owner) {
            all = model_fbuf(m, b, FB_MOE_ALL, (size_t)(T * k * D) * 2, false); /* snd */
            oc = model_fbuf(m, b, FB_MOE_OC, (size_t)(T * Dc) * 2, false);
            og = model_fbuf(m, b, FB_MOE_OG, (size_t)(T * D) * 2, false);
        } else if (!one) {
            all = model_fbuf(m, b, FB_MOE_ALL, (size_t)(T * k * D) * 2 * (size_t)np, false);
        }
        bf16_t *sh = model_fbuf(m, b, FB_MOE_SH, (size_t)(T * D) * 2, false);
        struct graph_key kf = graph_key_new(m, one ? GSEG_FFN : GSEG_FFN_IN, l, b);
        const void *kf_p[] = {X, X1, P, apre, post, comb, y, ya, o, idx, wts, ye, all, sh, oc, og};
        for (size_t i = 0; i < sizeof kf_p / sizeof *kf_p; i++) graph_key_ptr(&kf, kf_p[i]);
        if (b->eg_at == l) { /* the stage's Engram gathers on this segment's branch (engram_plan) */
            graph_key_ptr(&kf, b->eg_ids);
            graph_key_ptr(&kf, b->eg_rows);
        }
        if (nx >= 0) { /* the next block's attention input in the last segment: its layer and buffers */
            const void *kn_p[] = {qr, qra, q, kvr, b->pos};
            graph_key_word(&kf, (uint64_t)nx);
            for (size_t i = 0; i < sizeof kn_p / sizeof *kn_p; i++) graph_key_ptr(&kf, kn_p[i]);
        }
        /* and, where that layer's attention has nothing before its output part, the attention's
         * first ops too (its index lists, sparse_attn, the ring's update, wo_a): the segment then
         * stays open into that block's attention_out_rest, which ends it at the first TP
         * gather. Between the two segments the GPU idled ~3.3 µs a layer at batch 1 (H200
         * records of fb5cbc4: the attention-output segment's first kernel 3.28 µs, median of 100,
         * after the input's last), with nothing on the host between them. o is the next block's
         * out as well (one buffer a batch, model_fbuf). Its key words (they change with the
         * attention's width, every 64 entries of context) go into the last segment's key only:
         * in the earlier segments' they would have them recorded anew as often. */
        struct attn_out_plan *np_out = &b->out_plan; /* its attention_out_rest takes it from there */
        const bool out_nx = nx >= 0 && attention_plain(m, nx) && attention_out_prepare(m, nx, b, q, o, np_out) == 0;
        const bool out_now = out_nx && (one || tp_in_segment(m, b)); /* the last segment is the first */
        if (out_now) key_append(&kf, &np_out->k);
        bool issue = model_graph_begin(m, b, &kf);
        if (issue) {
            const struct block_expand ex = {o, X, post, comb, attention_out_blocks(m)};
            block_collapse(m, b, y, ya, X1, apre, lw->ffn_norm, &ex);
            /* three lanes: the FFN's mixes (P for the next block, post and comb for the expand
             * below) and the Engram gathers on one branch, the shared expert on another, the
             * router and the routed experts on the main lane. The shared expert's lane opens after
             * the router: beside it, its split linears' weight stream took the memory system while
             * the router's latency-bound chain (the gate, the rank kernel), the critical lane's
             * start, ran (at batch 1 the rank kernel 15 µs beside it, 8 alone; H200 lanes of
             * fb5cbc4), and it has ~25 µs to spare beside the routed experts. Measured only with
             * the other changes of 2f6ec69 (H100: batch 8 -3.6 %, batch 256 +1.0 %; beside the
             * routed experts its w1 | w3 takes 20.7 µs at batch 1, so it may not pay alone:
             * results/experiments/early_shared_2f6ec69.patch is the A/B's other side) */
            model_branch_begin(m);
            if (b->eg_at == l) engram_gathers(m, b); /* first: its CTAs wait on the bus beside the experts' */
            OPS->hc_mixes(m->be, P, post, comb, X1, T, hc, D, lw->hc_ffn_fn, lw->hc_ffn_scale, lw->hc_ffn_base,
                          c->hc_sinkhorn_iters, eps, hc_eps);
            model_branch_end(m);
            moe_router(m, l, b, y, idx, wts);
            model_branch_begin(m);
            moe_shared(m, l, b, y, ya, sh);
            model_branch_end(m);
            moe_routed(m, l, b, y, idx, wts, ye);
            model_branch_join(m);
            if (owner) OPS->interleave(m->be, all, ye, T * k, np, (size_t)Dc * 2);
        }
        if (owner) {
            const struct tp_call x = {TP_ALLTOALL, all, ye, (size_t)(T * k * Dc) * 2, "moe experts (column blocks)"};
            issue = model_tp_between(m, b, &kf, issue, GSEG_FFN_MID, &x);
            if (issue) moe_finish(m, l, b, idx, ye, sh + m->opt.tp->rank * Dc, D, Dc, oc);
            const struct tp_call g = {TP_ALLGATHER, oc, og, (size_t)(T * Dc) * 2, "moe output (column blocks)"};
            if (out_nx && !out_now) key_append(&kf, &np_out->k);
            issue = model_tp_between(m, b, &kf, issue, GSEG_FFN_OUT, &g); /* the expand reads og's blocks as they are */
        } else if (!one) {
            const struct tp_call g = {TP_ALLGATHER, ye, all, (size_t)(T * k * D) * 2, "moe experts"};
            if (out_nx && !out_now) key_append(&kf, &np_out->k);
            issue = model_tp_between(m, b, &kf, issue, GSEG_FFN_OUT, &g);
            if (issue) moe_finish(m, l, b, idx, all, sh, D, D, o);
        } else if (issue) {
            moe_finish(m, l, b, idx, all, sh, D, D, o);
        }
        if (issue) {
            const struct block_expand ex = {owner ? og : o, X1, post, comb, owner ? np : 1};
            if (nx >= 0) /* the next block's collapse reads the expand's output: one op */
                block_attn_in(m, nx, b, X, apre, post, comb, y, ya, qr, qra, q, P, &ex);
            else
                OPS->hc_expand(m->be, X, ex.yin, ex.Xin, post, comb, T, hc, D, ex.y_blocks);
            if (out_nx) attention_out_ops(m, nx, b, np_out);
            else model_graph_end(m);
        }
        b->attn_in_next = nx;
        b->out_next = out_nx;
        b->out_issue = issue;
        void *mb[] = {all != ye ? all : NULL, ye, sh, idx, wts, oc, og};
        for (size_t i = 0; i < sizeof mb / sizeof *mb; i++)
            if (mb[i]) model_fbuf_free(m, b, mb[i]);
    }
    void *bufs[] = {apre, post, comb, y, ya, o, qr, qra, q};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) model_fbuf_free(m, b, bufs[i]);
    return rc;
}

static int check_batch(struct model *m, const struct fwd_seq *seqs, int n) {
    const struct model_config *c = m->cfg;
    for (int i = 0; i < n; i++) {
        const struct fwd_seq *s = &seqs[i];
        if (s->slot < 0 || s->slot >= m->opt.max_seqs) {
            ds_err_set("sequence slot %d out of range (max_seqs %d)", s->slot, m->opt.max_seqs);
            return -1;
        }
        for (int j = 0; j < i; j++)
            if (seqs[j].slot == s->slot) {
                ds_err_set("sequence slot %d appears twice in one forward", s->slot);
                return -1;
            }
        if (s->start != m->slots[s->slot].len) {
            ds_err_set("sequence slot %d: chunk starts at %lld but the sequence holds %lld tokens", s->slot,
                       (long long)s->start, (long long)m->slots[s->slot].len);
            return -1;
        }
        if (s->len < 1 || s->start + s->len > m->opt.max_seq_len) {
            ds_err_set("sequence of %lld tokens exceeds max_seq_len %lld", (long long)(s->start + s->len),
                       (long long)m->opt.max_seq_len);
            return -1;
        }
        for (int64_t t = 0; t < s->len; t++)
            if (s->tokens[t] < 0 || s->tokens[t] >= c->vocab_size) {
                ds_err_set("token id %d at position %lld is outside the vocabulary [0, %d)", s->tokens[t],
                           (long long)(s->start + t), c->vocab_size);
                return -1;
            }
    }
    return 0;
}

static int forward_impl(struct model *m, const struct fwd_seq *seqs, int n, const struct stage_io *io,
                        float *logits, const struct head_draws *hd, const struct fwd_hooks *hooks);

int model_forward(struct model *m, const struct fwd_seq *seqs, int n, float *logits, const struct fwd_hooks *hooks) {
    return model_forward_stage(m, seqs, n, NULL, logits, hooks);
}

int model_forward_stage(struct model *m, const struct fwd_seq *seqs, int n, const struct stage_io *io,
                        float *logits, const struct fwd_hooks *hooks) {
    return forward_impl(m, seqs, n, io, logits, NULL, hooks);
}

bool model_lse_ready(const struct model *m) { return lse_slices(m->cfg->vocab_size) % m->tp_size == 0; }

/* a temperature draw over every entry (top_k off): sampler_pick_cand's, from row_topk lists and
 * row_lse's temperature sums */
static bool draw_full_row(const struct model *m, const struct sample_params *p) {
    return p->temperature > 0 && !(p->top_k > 0 && p->top_k < m->cfg->vocab_size);
}

void model_draw_stats(const struct model *m, int64_t *full, int64_t *whole_rows) {
    *full = m->draws_full;
    *whole_rows = m->draws_whole_rows;
}

bool model_draw_ready(const struct model *m, const struct sample_params *p) {
    if (draw_full_row(m, p)) return model_lse_ready(m);
    return p->temperature <= 0 || p->top_k <= BE_TOPK_MAX;
}

int model_forward_draws(struct model *m, const struct fwd_seq *seqs, int n, const struct stage_io *io,
                        const struct head_draws *hd, const struct fwd_hooks *hooks) {
    if (!m->w->opt.last_stage) return forward_impl(m, seqs, n, io, NULL, NULL, hooks);
    if (!hd || (!hd->tokens && !hd->lp) || (hd->lp && !hd->tokens && !hd->targets) ||
        (hd->params && (!hd->tokens || !hd->request || !hd->position))) {
        ds_err_set("model_forward_draws: the last stage needs tokens, or log-probabilities with their targets");
        return -1;
    }
    for (int i = 0; hd->params && i < n; i++)
        if (!model_draw_ready(m, &hd->params[i])) {
            ds_err_set("model_forward_draws: sequence %d's draw (temperature %g, top-k %d) needs the whole row "
                       "(top-k above %d, or TP %d not splitting the vocabulary into whole lse slices)",
                       i, (double)hd->params[i].temperature, hd->params[i].top_k, BE_TOPK_MAX, m->tp_size);
            return -1;
        }
    if (hd->lp && !model_lse_ready(m)) {
        ds_err_set("model_forward_draws: TP %d does not split the vocabulary (%d) into whole log-sum-exp slices",
                   m->tp_size, m->cfg->vocab_size);
        return -1;
    }
    for (int64_t r = 0, R = model_logits_rows(seqs, n); hd->lp && hd->targets && r < R; r++)
        if (hd->targets[r] < -1 || hd->targets[r] >= m->cfg->vocab_size) {
            ds_err_set("model_forward_draws: target %d of row %lld is outside the vocabulary [0, %d)", hd->targets[r],
                       (long long)r, m->cfg->vocab_size);
            return -1;
        }
    return forward_impl(m, seqs, n, io, NULL, hd, hooks);
}

/* Every TP rank's `bytes` of part (backend memory, this rank's result of a head row op) on the
 * host in rank order, [np][bytes] (ds_malloc'd; the caller frees it); part is freed. */
static void *head_gather(struct model *m, void *part, size_t bytes, const char *what) {
    const int64_t np = m->tp_size;
    void *all = part;
    if (np > 1) {
        all = model_tmp(m, bytes * (size_t)np);
        m->opt.tp->ops->allgather(m->opt.tp, part, all, bytes, what);
    }
    void *h = ds_malloc(bytes * (size_t)np);
    OPS->download(m->be, h, all, bytes * (size_t)np);
    if (all != part) model_tfree(m, all);
    model_tfree(m, part);
    return h;
}

/* The greedy draws of R rows from the vocab-split head's logits lg [R, Vl] (backend memory): each
 * rank's best of its columns (the argmax op), all-gathered, merged on the host in rank order
 * (sampler_greedy_merge: the ranks' columns are consecutive id ranges). */
static void head_greedy(struct model *m, int32_t *tokens, const float *lg, int64_t R, int64_t Vl) {
    const size_t bytes = sizeof(int32_t) * (size_t)(2 * R);
    int32_t *am = model_tmp(m, bytes); /* [R][2] */
    OPS->argmax(m->be, am, lg, R, Vl);
    int32_t *h = head_gather(m, am, bytes, "greedy draws"); /* [np][R][2] */
    sampler_greedy_merge(tokens, h, R, m->tp_size, Vl);
    free(h);
}

/* Each rank's row_lse parts of its lse_core.h slices of lg [R, Vl] (tg: target columns, td:
 * temperatures, backend memory or NULL), all-gathered, on the host as [R][ns] in slice order
 * (ds_malloc'd). */
static struct be_lse_part *head_lse_rows(struct model *m, const float *lg, int64_t R, int64_t Vl, const int32_t *tg,
                                         const float *td, const char *what) {
    const int64_t np = m->tp_size, ns = lse_slices(m->cfg->vocab_size), nsl = ns / np;
    const size_t bytes = sizeof(struct be_lse_part) * (size_t)(R * nsl);
    struct be_lse_part *pt = model_tmp(m, bytes); /* [R][nsl] */
    OPS->row_lse(m->be, pt, lg, R, Vl, nsl, tg, td);
    struct be_lse_part *h = head_gather(m, pt, bytes, what), *rows = ds_malloc(sizeof *rows * (size_t)(R * ns)); /* [np][R][nsl] */
    for (int64_t r = 0; r < R; r++)
        for (int64_t j = 0; j < ns; j++) rows[r * ns + j] = h[((j / nsl) * R + r) * nsl + j % nsl];
    free(h);
    return rows;
}

/* The weight totals Z[r] of hd's full-row draws (draw_full_row; other rows: 0) from the vocab-split
 * head's logits lg [R, Vl]: row_lse with each row's temperature on each rank's slices, merged per
 * row in slice order (sampler_wsum_merge). */
static void head_wsum(struct model *m, const struct head_draws *hd, const float *lg, int64_t R, int64_t Vl, double *Z) {
    const int64_t ns = lse_slices(m->cfg->vocab_size);
    float *th = ds_malloc(sizeof(float) * (size_t)R);
    for (int64_t r = 0; r < R; r++) th[r] = draw_full_row(m, &hd->params[r]) ? hd->params[r].temperature : 0.0f;
    float *td = model_tmp(m, sizeof(float) * (size_t)R); /* [R] */
    OPS->upload(m->be, td, th, sizeof(float) * (size_t)R);
    struct be_lse_part *rows = head_lse_rows(m, lg, R, Vl, NULL, td, "draw weight sums"); /* [R][ns] */
    for (int64_t r = 0; r < R; r++) {
        float mx;
        Z[r] = th[r] > 0 ? sampler_wsum_merge(rows + r * ns, ns, th[r], &mx) : 0.0;
    }
    free(rows), free(th);
    model_tfree(m, td);
}

/* The draws of hd's rows, some top-k or full-row, from the vocab-split head's logits lg [R, Vl]:
 * each rank's row_topk lists of its columns (k = the step's largest top_k, BE_TOPK_MAX with a
 * full-row draw), all-gathered, merged per row on the host (sampler_topk_merge) and drawn
 * (sampler_pick_topk; full rows sampler_pick_cand with head_wsum's totals); tv[r] = the drawn
 * entry's logit. The full-row draws the lists do not decide (a nucleus longer than k: flat rows)
 * take their whole rows (every rank agrees which: each has merged the same lists) and sampler_pick. */
static void head_topk(struct model *m, const struct head_draws *hd, const float *lg, int64_t R, int64_t Vl, int64_t k,
                      bool full, float *tv) {
    const int64_t V = m->cfg->vocab_size;
    const size_t bytes = sizeof(struct be_topk_entry) * (size_t)(R * k);
    double *Z = full ? ds_malloc(sizeof(double) * (size_t)R) : NULL;
    if (full) head_wsum(m, hd, lg, R, Vl, Z);
    struct be_topk_entry *pt = model_tmp(m, bytes); /* [R][k] */
    OPS->row_topk(m->be, pt, lg, R, Vl, k);
    struct be_topk_entry *h = head_gather(m, pt, bytes, "top-k lists"), *top = ds_malloc(bytes); /* [np][R][k]; [R][k] */
    sampler_topk_merge(top, h, R, m->tp_size, k, Vl);
    int64_t undecided = 0, n_full = 0;
    /* the rows are independent draws (each keyed by its request and position): the rank's threads
     * share them, the same bits as one by one (a full row's list: ~1,024 expf and sums) */
#pragma omp parallel for schedule(static) reduction(+ : undecided, n_full) if (R > 8)
    for (int64_t r = 0; r < R; r++) {
        const struct be_topk_entry *e = top + r * k;
        const struct sample_params *p = &hd->params[r];
        hd->tokens[r] = draw_full_row(m, p) ? sampler_pick_cand(e, k, V, Z[r], p, hd->request[r], hd->position[r])
                                            : sampler_pick_topk(e, k, p, hd->request[r], hd->position[r]);
        undecided += hd->tokens[r] < 0;
        n_full += draw_full_row(m, p);
        tv[r] = NAN; /* a row of NaN: token 0, no entry */
        for (int64_t j = 0; j < k && e[j].i >= 0; j++)
            if (e[j].i == hd->tokens[r]) {
                tv[r] = e[j].v;
                break;
            }
    }
    m->draws_full += n_full;
    if (undecided) { /* those rows only: each rank packs its columns of them, one gather, one download */
        const int64_t U = undecided;
        m->draws_whole_rows += U;
        int64_t *which = ds_malloc(sizeof(int64_t) * (size_t)U), u = 0;
        float *sub = model_tmp(m, sizeof(float) * (size_t)(U * Vl)); /* [U, Vl] */
        for (int64_t r = 0; r < R; r++)
            if (hd->tokens[r] < 0) {
                OPS->copy(m->be, sub + u * Vl, lg + r * Vl, sizeof(float) * (size_t)Vl);
                which[u++] = r;
            }
        float *rows = model_tmp(m, sizeof(float) * (size_t)(U * V)), *host = ds_malloc(sizeof(float) * (size_t)(U * V)); /* [U, V] */
        model_tp_gather_cols(m, rows, sub, U, sizeof(float) * (size_t)Vl, "logits (undecided draws)");
        OPS->download(m->be, host, rows, sizeof(float) * (size_t)(U * V));
#pragma omp parallel for schedule(dynamic, 1) if (U > 1)
        for (int64_t i = 0; i < U; i++) {
            const int64_t r = which[i];
            const float *row = host + i * V;
            hd->tokens[r] = sampler_pick(row, (int)V, &hd->params[r], hd->request[r], hd->position[r]);
            tv[r] = row[hd->tokens[r]];
        }
        free(which), free(host);
        model_tfree(m, rows);
        model_tfree(m, sub);
    }
    free(h), free(top), free(Z);
}

/* The log-probabilities of hd's targets (or of its drawn tokens) from the vocab-split head's
 * logits lg [R, Vl]: each rank's row_lse parts of its lse_core.h slices, all-gathered, merged per
 * row on the host in slice order (sampler_lse_merge); the target's entry comes from the slice that
 * holds it, a drawn token's from tv (top-k draws) or, greedy, the row's maximum. */
static void head_logprobs(struct model *m, const struct head_draws *hd, const float *lg, int64_t R, int64_t Vl,
                          const float *tv_drawn) {
    const int64_t V = m->cfg->vocab_size, ns = lse_slices(V), n = V / ns;
    int32_t *tg = NULL; /* [R] target columns of this rank's, -1 elsewhere (backend memory) */
    if (hd->targets) {
        int32_t *h = ds_malloc(sizeof(int32_t) * (size_t)R);
        for (int64_t r = 0; r < R; r++) {
            const int64_t c = (int64_t)hd->targets[r] - m->w->vocab_row0;
            h[r] = hd->targets[r] >= 0 && c >= 0 && c < Vl ? (int32_t)c : -1;
        }
        tg = model_tmp(m, sizeof(int32_t) * (size_t)R);
        OPS->upload(m->be, tg, h, sizeof(int32_t) * (size_t)R);
        free(h);
    }
    struct be_lse_part *rows = head_lse_rows(m, lg, R, Vl, tg, NULL, "log-sum-exp parts"); /* [R][ns] */
    for (int64_t r = 0; r < R; r++) {
        const struct be_lse_part *row = rows + r * ns;
        float mx;
        const double ls = sampler_lse_merge(row, ns, &mx);
        const int64_t t = hd->targets ? hd->targets[r] : hd->tokens[r];
        const float tv = hd->targets ? (t >= 0 ? row[t / n].t : 0.0f) : tv_drawn ? tv_drawn[r] : mx;
        hd->lp[r] = hd->targets && t < 0 ? 0.0 : (double)tv - (double)mx - ls;
    }
    free(rows);
    if (tg) model_tfree(m, tg);
}

/* model_forward_stage with the head's output as logits or, hd != NULL, as hd's draws. */
static int forward_impl(struct model *m, const struct fwd_seq *seqs, int n, const struct stage_io *io,
                        float *logits, const struct head_draws *hd, const struct fwd_hooks *hooks) {
    const struct model_config *c = m->cfg;
    bool first = m->w->opt.first_stage, last = m->w->opt.last_stage;
    if ((!first && (!io || !io->X_in || !io->P_in)) || (!last && (!io || !io->X_out || !io->P_out))) {
        ds_err_set("model_forward_stage: a middle pipeline stage needs its input and output stream");
        return -1;
    }
    if (check_batch(m, seqs, n)) return -1;
    if (hd && hd->tokens && model_logits_rows(seqs, n) != n) {
        ds_err_set("model_forward_draws: a sequence asks for the logits of every position");
        return -1;
    }
    struct batch b = {.seqs = seqs, .n = n, .attn_in_next = -1};
    b.row0 = ds_malloc(sizeof(int64_t) * (size_t)n);
    for (int i = 0; i < n; i++) {
        b.row0[i] = b.T;
        b.T += seqs[i].len;
    }
    if (model_kv_reserve(m, b.T)) {
        free(b.row0);
        return -1;
    }
    int64_t T = b.T, D = c->dim, hc = c->hc_mult;
    /* positions [T], then the rows' geometry for attn_index and ring_store [T, AIX_COLS]: one upload */
    b.pos_h = ds_malloc(sizeof(int32_t) * (size_t)(T * (1 + AIX_COLS)));
    int32_t *tok = ds_malloc(sizeof(int32_t) * (size_t)T);
    for (int i = 0; i < n; i++)
        for (int64_t t = 0; t < seqs[i].len; t++) {
            int64_t r = b.row0[i] + t;
            b.pos_h[r] = (int32_t)(seqs[i].start + t);
            int32_t *g = b.pos_h + T + r * AIX_COLS;
            g[AIX_P] = b.pos_h[r];
            g[AIX_START] = (int32_t)seqs[i].start;
            g[AIX_CHUNK_ROW] = (int32_t)(m->kv_cache_rows + b.row0[i]);
            g[AIX_SLOT] = seqs[i].slot;
            g[AIX_NW] = (int32_t)model_window_width(m, &seqs[i]);
            g[AIX_END] = (int32_t)(seqs[i].start + seqs[i].len);
            tok[r] = seqs[i].tokens[t];
            if (m->ec && m->ec->token_map)
                m->slots[seqs[i].slot].hist[seqs[i].start + t] = m->ec->token_map[seqs[i].tokens[t]];
        }
    /* decode steps only: their batch sizes repeat, so each records once; a prefill chunk's row
     * count (or a batch mixing chunks with decode rows) seldom comes twice */
    b.graphs = m->opt.graphs && OPS->graph_begin && T <= MODEL_GRAPH_ROWS_MAX && T == n;
    b.pos = model_fbuf(m, &b, FB_POS, sizeof(int32_t) * (size_t)(T * (1 + AIX_COLS)), false);
    OPS->upload(m->be, b.pos, b.pos_h, sizeof(int32_t) * (size_t)(T * (1 + AIX_COLS)));
    b.geo = b.pos + T;
    b.topk = ds_calloc((size_t)c->n_layers, sizeof *b.topk);
    b.topk_w = ds_calloc((size_t)c->n_layers, sizeof *b.topk_w);
    b.topk_k = ds_calloc((size_t)c->n_layers, sizeof *b.topk_k);

    int32_t *tok_d = model_tmp(m, sizeof(int32_t) * (size_t)T);
    OPS->upload(m->be, tok_d, tok, sizeof(int32_t) * (size_t)T);
    bf16_t *e = model_tmp(m, (size_t)(T * D) * 2);
    bf16_t *X = model_fbuf(m, &b, FB_X, (size_t)(T * hc * D) * 2, false);
    bf16_t *X1 = model_fbuf(m, &b, FB_X1, (size_t)(T * hc * D) * 2, false);
    float *P = model_fbuf(m, &b, FB_P, sizeof(float) * (size_t)(T * hc), false);
    if (first) {
        OPS->embed(m->be, e, tok_d, T, m->w->embed, m->w->vocab_row0, m->w->vocab_rows, D);
        /* vocab-split table: exactly one rank holds each row, the others add zeros (exact) */
        if (m->tp_size > 1) m->opt.tp->ops->allreduce_sum(m->opt.tp, e, (size_t)(T * D), COMM_BF16, "embed");
        OPS->hc_init(m->be, X, P, e, T, hc, D);
    } else {
        OPS->upload(m->be, X, io->X_in, (size_t)(T * hc * D) * 2);
        OPS->upload(m->be, P, io->P_in, sizeof(float) * (size_t)(T * hc));
    }

    engram_plan(m, &b, hooks);
    if (b.eg_n && b.eg_at < 0) engram_gathers(m, &b);
    int rc = 0;
    for (int l = 0; l < c->n_layers && rc == 0; l++) {
        if (!m->w->layers[l].present) continue;
        if (hooks && hooks->pre_engram) hooks->pre_engram(hooks->ctx, l, X, P, T);
        if (c->role[l].engram_idx >= 0) engram_forward(m, l, &b, X, engram_rows(m, l, &b));
        if (hooks && hooks->pre_block) hooks->pre_block(hooks->ctx, l, X, P, T);
        rc = block_forward(m, l, &b, X, X1, P, hooks);
        if (rc == 0 && hooks && hooks->post_block) hooks->post_block(hooks->ctx, l, X, P, T);
    }
    if (rc == 0 && !last) {
        OPS->download(m->be, io->X_out, X, (size_t)(T * hc * D) * 2);
        OPS->download(m->be, io->P_out, P, sizeof(float) * (size_t)(T * hc));
    }
    if (rc == 0 && last) {
        /* final collapse with the last FFN pre, norm, fp32 head over the rows asked for */
        int64_t R = model_logits_rows(seqs, n);
        bf16_t *h = model_tmp(m, (size_t)(T * D) * 2), *hr = model_tmp(m, (size_t)(R * D) * 2);
        OPS->hc_collapse(m->be, h, X, P, T, hc, D, m->w->norm, (float)c->norm_eps); /* and the final norm */
        if (hooks && hooks->final_hidden) hooks->final_hidden(hooks->ctx, h, T);
        int64_t o = 0;
        struct seg_list sl = {0};
        for (int i = 0; i < n; i++) {
            int64_t cnt = seqs[i].all_logits ? seqs[i].len : 1;
            int64_t from = b.row0[i] + seqs[i].len - cnt;
            seg_push(&sl, hr + o * D, h + from * D, (size_t)(cnt * D) * 2);
            o += cnt;
        }
        seg_flush(m, &sl);
        seg_free(&sl);
        /* vocab-split head: each rank's [R, V/tp] columns gathered into whole rows; split
         * (model_logits_split): rows padded to np * Rp, an all-to-all hands rank j every rank's
         * columns of rows [j Rp, j Rp + Rp) (the padding rows are sent, never read) */
        int64_t V = c->vocab_size, Vl = m->w->vocab_rows, r0, r1;
        if (R > g_head_rows_max) g_head_rows_max = R;
        bool split = !hd && model_logits_split(m, R, &r0, &r1);
        if (!split) r0 = 0, r1 = R;
        int64_t np = m->tp_size, Rp = split ? (R + np - 1) / np : R; /* whole rows this rank gets */
        float *lg = model_tmp(m, sizeof(float) * (size_t)((split ? np * Rp : R) * Vl)); /* [R or np Rp, Vl] */
        float *rows = hd ? NULL : model_tmp(m, sizeof(float) * (size_t)(Rp * V));      /* [Rp, V] */
        OPS->head(m->be, lg, hr, R, &m->w->head);
        if (hd) {
            int64_t k = 0; /* the step's longest list: its largest top-k, BE_TOPK_MAX with a full-row draw */
            bool full = false;
            for (int64_t r = 0; hd->params && r < R; r++) {
                const struct sample_params *p = &hd->params[r];
                if (draw_full_row(m, p)) full = true;
                else if (p->temperature > 0 && p->top_k > k) k = p->top_k;
            }
            const int64_t k_full = sampler_full_list_len(V);
            if (full && k < k_full) k = k_full;
            float *tv = k ? ds_malloc(sizeof(float) * (size_t)R) : NULL;
            if (hd->tokens && !k) head_greedy(m, hd->tokens, lg, R, Vl);
            if (k) head_topk(m, hd, lg, R, Vl, k, full, tv);
            if (hd->lp) head_logprobs(m, hd, lg, R, Vl, tv);
            free(tv);
        } else if (split) {
            float *blk = model_tmp(m, sizeof(float) * (size_t)(np * Rp * Vl)); /* [np][Rp, Vl] */
            m->opt.tp->ops->alltoall(m->opt.tp, lg, blk, sizeof(float) * (size_t)(Rp * Vl), "logits (row blocks)");
            OPS->interleave(m->be, rows, blk, np, Rp, sizeof(float) * (size_t)Vl);
            model_tfree(m, blk);
        } else {
            model_tp_gather_cols(m, rows, lg, R, sizeof(float) * (size_t)Vl, "logits");
        }
        if (!hd && r1 > r0) OPS->download(m->be, logits, rows, sizeof(float) * (size_t)((r1 - r0) * V));
        model_tfree(m, lg);
        if (rows) model_tfree(m, rows);
        model_tfree(m, h);
        model_tfree(m, hr);
    }
    if (rc == 0)
        for (int i = 0; i < n; i++) m->slots[seqs[i].slot].len += seqs[i].len;
    for (int l = 0; l < c->n_layers; l++)
        if (!b.graphs) model_tfree(m, b.topk[l]); /* with graphs: rows of FB_TOPK */
    if (b.eg_n) {
        model_fbuf_free(m, &b, b.eg_ids);
        model_fbuf_free(m, &b, b.eg_rows);
        free(b.eg_layer);
    }
    free(b.topk);
    free(b.topk_w);
    free(b.topk_k);
    model_tfree(m, b.cand);
    free(b.row0);
    free(b.pos_h);
    free(tok);
    model_fbuf_free(m, &b, b.pos);
    model_tfree(m, tok_d);
    model_tfree(m, e);
    model_fbuf_free(m, &b, X);
    model_fbuf_free(m, &b, X1);
    model_fbuf_free(m, &b, P);
    return rc;
}
