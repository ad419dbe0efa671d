/* Binding and validation of the checkpoint into struct model_weights (see weights.h).
 * Every expected tensor is looked up by its official name, checked for dtype and exact shape, and
 * marked bound; afterwards any unbound tensor that is not part of the vision tower is an error.
 * TP slices are pointer offsets into the mmap (row slices) or strided views (K slices), so binding
 * copies nothing and the 510 GB release costs only its headers to validate. */
#include "weights.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

struct binder {
    struct st_model *st;
    const struct model_config *cfg;
    const struct bind_opts *opt;
    struct model_weights *mw;
    bool keep; /* this layer belongs to the stage: record pointers and bytes */
};

static const char *shard_of(const struct binder *b, const struct st_tensor *t) {
    return t ? b->st->shard_paths[t->shard] : b->st->dir;
}

static void shape_str(char *buf, size_t n, int ndim, const int64_t *shape) {
    size_t off = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < ndim && off < n; i++)
        off += (size_t)snprintf(buf + off, n - off, "%s%lld", i ? "," : "", (long long)shape[i]);
    if (off < n) snprintf(buf + off, n - off, "]");
}

/* Look up `name`, require dtype and shape; returns NULL with the error set. */
static const struct st_tensor *expect(struct binder *b, const char *name, enum st_dtype dt, int ndim, ...) {
    int64_t shape[ST_MAX_DIMS];
    va_list ap;
    va_start(ap, ndim);
    for (int i = 0; i < ndim; i++) shape[i] = va_arg(ap, int64_t);
    va_end(ap);
    char want[128], got[128];
    shape_str(want, sizeof want, ndim, shape);
    struct st_tensor *t = st_find(b->st, name);
    if (!t) {
        ds_err_set("%s: missing tensor %s (expected %s %s)", b->st->dir, name, st_dtype_name(dt), want);
        return NULL;
    }
    bool ok = t->dtype == dt && t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++) ok = t->shape[i] == shape[i];
    if (!ok) {
        shape_str(got, sizeof got, t->ndim, t->shape);
        ds_err_set("%s: tensor %s: expected %s %s, found %s %s", shard_of(b, t), name, st_dtype_name(dt), want,
                   st_dtype_name(t->dtype), got);
        return NULL;
    }
    t->bound = true;
    b->mw->n_tensors_checked++;
    return t;
}

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

static void account(struct binder *b, uint64_t bytes) {
    if (b->keep) b->mw->bytes_total += bytes;
}

/* FP8 [n, k] + scale, sliced to rows [r0, r0+rn) and columns [c0, c0+ck). */
static int bind_fp8(struct binder *b, struct qweight *q, const char *prefix, int64_t n, int64_t k, int64_t r0,
                    int64_t rn, int64_t c0, int64_t ck) {
    char nw[320], ns[320];
    snprintf(nw, sizeof nw, "%s.weight", prefix);
    snprintf(ns, sizeof ns, "%s.scale", prefix);
    const struct st_tensor *w = expect(b, nw, ST_F8_E4M3, 2, n, k);
    if (!w) return -1;
    const struct st_tensor *s = expect(b, ns, ST_F8_E8M0, 2, cdiv(n, 32), cdiv(k, 32));
    if (!s) return -1;
    if ((r0 % 32) || (c0 % 32) || ((r0 + rn) % 32 && r0 + rn != n) || ((c0 + ck) % 32 && c0 + ck != k)) {
        ds_err_set("%s: tensor %s: TP slice rows %lld+%lld cols %lld+%lld does not fall on 32x32 scale tiles",
                   shard_of(b, w), nw, (long long)r0, (long long)rn, (long long)c0, (long long)ck);
        return -1;
    }
    if (!b->keep) return 0;
    const uint8_t *wd = w->data, *sd = s->data;
    *q = (struct qweight){.fmt = WF_FP8, .n = rn, .k = ck, .ld = k, .s_ld = cdiv(k, 32),
                          .w = wd + r0 * k + c0, .s = sd + (r0 / 32) * cdiv(k, 32) + c0 / 32};
    account(b, (uint64_t)rn * (uint64_t)ck + (uint64_t)cdiv(rn, 32) * (uint64_t)cdiv(ck, 32));
    return 0;
}

static int bind_fp8_full(struct binder *b, struct qweight *q, const char *prefix, int64_t n, int64_t k) {
    return bind_fp8(b, q, prefix, n, k, 0, n, 0, k);
}

/* FP4 expert matrix [n, k] stored as I8 [n, k/2] + E8M0 [n, k/32]. */
static int bind_fp4(struct binder *b, struct qweight *q, const char *prefix, int64_t n, int64_t k, bool keep) {
    char nw[320], ns[320];
    snprintf(nw, sizeof nw, "%s.weight", prefix);
    snprintf(ns, sizeof ns, "%s.scale", prefix);
    const struct st_tensor *w = expect(b, nw, ST_I8, 2, n, k / 2);
    if (!w) return -1;
    const struct st_tensor *s = expect(b, ns, ST_F8_E8M0, 2, n, k / 32);
    if (!s) return -1;
    if (!keep) return 0;
    *q = (struct qweight){.fmt = WF_FP4, .n = n, .k = k, .ld = k / 2, .s_ld = k / 32, .w = w->data, .s = s->data};
    b->mw->bytes_experts += (uint64_t)(w->nbytes + s->nbytes);
    account(b, (uint64_t)(w->nbytes + s->nbytes));
    return 0;
}

/* BF16 matrix [n, k] sliced to rows [r0, r0+rn). */
static int bind_bf16(struct binder *b, struct qweight *q, const char *name, int64_t n, int64_t k, int64_t r0,
                     int64_t rn) {
    const struct st_tensor *t = expect(b, name, ST_BF16, 2, n, k);
    if (!t) return -1;
    if (!b->keep) return 0;
    *q = (struct qweight){.fmt = WF_BF16, .n = rn, .k = k, .ld = k, .w = (const bf16_t *)t->data + r0 * k};
    account(b, (uint64_t)rn * (uint64_t)k * 2);
    return 0;
}

static int bind_vec(struct binder *b, const void **out, const char *name, enum st_dtype dt, int ndim, int64_t d0,
                    int64_t d1, int64_t off, int64_t count) {
    const struct st_tensor *t = ndim == 1 ? expect(b, name, dt, 1, d0) : expect(b, name, dt, 2, d0, d1);
    if (!t) return -1;
    if (!b->keep) return 0;
    size_t es = st_dtype_size(dt);
    *out = (const uint8_t *)t->data + (size_t)off * es;
    account(b, (uint64_t)count * es);
    return 0;
}

#define BIND_VEC(b, field, name, dt, n) bind_vec((b), (const void **)&(field), (name), (dt), 1, (n), 0, 0, (n))

static int tp_split(const struct binder *b, const char *what, int64_t total, int64_t *part) {
    int tp = b->opt->tp_size;
    if (total % tp) {
        ds_err_set("%s: %s = %lld is not divisible by the tensor-parallel size %d", b->cfg->source, what,
                   (long long)total, tp);
        return -1;
    }
    *part = total / tp;
    return 0;
}

static int bind_attention(struct binder *b, int l, struct attn_weights *a) {
    const struct model_config *c = b->cfg;
    const struct layer_role *r = &c->role[l];
    char base[64], n[320];
    config_layer_prefix(c, l, base, sizeof base);
    strcat(base, ".attn");
    int tr = b->opt->tp_rank;
    int64_t D = c->dim, hd = c->head_dim, H = c->n_heads, G = c->o_groups, R = c->o_lora_rank, q = c->q_lora_rank;
    int64_t Hl, Gl;
    if (tp_split(b, "num_attention_heads", H, &Hl) || tp_split(b, "o_groups", G, &Gl)) return -1;

#define SUB(suffix) (snprintf(n, sizeof n, "%s.%s", base, suffix), n)
    if (bind_fp8_full(b, &a->wq_a, SUB("wq_a"), q, D)) return -1;
    if (BIND_VEC(b, a->q_norm, SUB("q_norm.weight"), ST_BF16, q)) return -1;
    if (bind_fp8(b, &a->wq_b, SUB("wq_b"), H * hd, q, tr * Hl * hd, Hl * hd, 0, q)) return -1;
    if (bind_fp8_full(b, &a->wkv, SUB("wkv"), hd, D)) return -1;
    if (BIND_VEC(b, a->kv_norm, SUB("kv_norm.weight"), ST_BF16, hd)) return -1;
    if (bind_fp8(b, &a->wo_a, SUB("wo_a"), G * R, H * hd / G, tr * Gl * R, Gl * R, 0, H * hd / G)) return -1;
    /* wo_b is split by output rows (whole K on every rank), not by K as the reference's row-parallel
     * layer is: each output is then summed over all of K in the reference's order on one rank, so
     * a TP layout computes exactly what one rank does (layout invariance with reference numerics) */
    int64_t Dl;
    if (tp_split(b, "hidden_size", D, &Dl)) return -1;
    if (bind_fp8(b, &a->wo_b, SUB("wo_b"), D, G * R, tr * Dl, Dl, 0, G * R)) return -1;
    if (bind_vec(b, (const void **)&a->attn_sink, SUB("attn_sink"), ST_F32, 1, H, 0, tr * Hl, Hl)) return -1;

    if (r->owns_compressor) {
        if (bind_bf16(b, &a->cmp_wkv, SUB("compressor.wkv.weight"), hd, D, 0, hd)) return -1;
        if (r->ratio > 1 && bind_bf16(b, &a->cmp_wgate, SUB("compressor.wgate.weight"), hd, D, 0, hd)) return -1;
        if (BIND_VEC(b, a->cmp_norm, SUB("compressor.norm.weight"), ST_BF16, hd)) return -1;
    }
    if (r->is_index_source) {
        /* the indexer is replicated (as vLLM does): the scores sum every head in the reference's
         * order on each rank, no collective, and the top-k is the same everywhere */
        int64_t ih = c->index_n_heads, id = c->index_head_dim;
        if (bind_fp8_full(b, &a->idx_wq_b, SUB("indexer.wq_b"), ih * id, q)) return -1;
        if (bind_bf16(b, &a->idx_weights_proj, SUB("indexer.weights_proj.weight"), ih, D, 0, ih)) return -1;
        if (r->owns_index_keys) {
            if (bind_bf16(b, &a->idx_wk, SUB("indexer.wk.weight"), id, hd, 0, id)) return -1;
            if (BIND_VEC(b, a->idx_k_norm, SUB("indexer.k_norm.weight"), ST_BF16, id)) return -1;
        }
    }
#undef SUB
    return 0;
}

static int bind_ffn(struct binder *b, int l, struct ffn_weights *f) {
    const struct model_config *c = b->cfg;
    const struct layer_role *r = &c->role[l];
    char base[64], n[320];
    config_layer_prefix(c, l, base, sizeof base);
    strcat(base, ".ffn");
    int64_t D = c->dim, I = c->moe_inter_dim, E = r->n_experts, El;
    if (tp_split(b, r->is_dspark ? "dspark_n_routed_experts" : "n_routed_experts", E, &El)) return -1;
    if (!c->expert_fp4) {
        ds_err_set("%s: quantization_config.expert_dtype: only fp4 experts are supported", c->source);
        return -1;
    }
#define SUB(suffix) (snprintf(n, sizeof n, "%s.%s", base, suffix), n)
    if (bind_bf16(b, &f->gate, SUB("gate.weight"), E, D, 0, E)) return -1;
    if (BIND_VEC(b, f->bias, SUB("gate.bias"), ST_F32, E)) return -1;
    if (BIND_VEC(b, f->bias_vl, SUB("gate.bias_vl"), ST_F32, E)) return -1;
    f->n_experts = (int)E;
    f->n_local = (int)El;
    f->e0 = (int)(b->opt->tp_rank * El);
    if (b->keep) {
        f->w1 = ds_calloc((size_t)El, sizeof *f->w1);
        f->w3 = ds_calloc((size_t)El, sizeof *f->w3);
        f->w2 = ds_calloc((size_t)El, sizeof *f->w2);
    }
    for (int64_t e = 0; e < E; e++) {
        bool mine = b->keep && e >= f->e0 && e < f->e0 + El;
        int64_t li = e - f->e0;
        char ex[128];
        snprintf(ex, sizeof ex, "experts.%lld.w1", (long long)e);
        if (bind_fp4(b, mine ? &f->w1[li] : NULL, SUB(ex), I, D, mine)) return -1;
        snprintf(ex, sizeof ex, "experts.%lld.w3", (long long)e);
        if (bind_fp4(b, mine ? &f->w3[li] : NULL, SUB(ex), I, D, mine)) return -1;
        snprintf(ex, sizeof ex, "experts.%lld.w2", (long long)e);
        if (bind_fp4(b, mine ? &f->w2[li] : NULL, SUB(ex), D, I, mine)) return -1;
    }
    if (bind_fp8_full(b, &f->sh_w1, SUB("shared_experts.w1"), I, D)) return -1;
    if (bind_fp8_full(b, &f->sh_w3, SUB("shared_experts.w3"), I, D)) return -1;
    if (bind_fp8_full(b, &f->sh_w2, SUB("shared_experts.w2"), D, I)) return -1;
#undef SUB
    return 0;
}

static int bind_engram(struct binder *b, int l, struct engram_weights *e) {
    const struct model_config *c = b->cfg;
    int ei = c->role[l].engram_idx;
    char n[320];
    int64_t rows = c->engram_num_embeddings[ei], hd = c->engram_head_dim, D = c->dim, hc = c->hc_mult;
    int64_t C = (int64_t)(c->engram_max_ngram - 1) * c->engram_n_heads;
    int64_t part = cdiv(rows, b->opt->tp_size);
    int64_t row0 = b->opt->tp_rank * part;
    int64_t nl = rows - row0 < part ? rows - row0 : part;
    if (nl < 0) nl = 0;
    snprintf(n, sizeof n, "layers.%d.engram.embed.weight", l);
    const struct st_tensor *t = expect(b, n, ST_F8_E4M3, 2, rows, hd);
    if (!t) return -1;
    snprintf(n, sizeof n, "layers.%d.engram.embed.scale", l);
    const struct st_tensor *s = expect(b, n, ST_F8_E8M0, 2, rows, hd / 32);
    if (!s) return -1;
    snprintf(n, sizeof n, "layers.%d.engram.wkv", l);
    if (bind_fp8_full(b, &e->wkv, n, (hc + 1) * D, C * hd)) return -1;
    snprintf(n, sizeof n, "layers.%d.engram.q_weight", l);
    if (bind_vec(b, (const void **)&e->q_weight, n, ST_BF16, 2, hc, D, 0, hc * D)) return -1;
    snprintf(n, sizeof n, "layers.%d.engram.k_weight", l);
    if (bind_vec(b, (const void **)&e->k_weight, n, ST_BF16, 2, hc, D, 0, hc * D)) return -1;
    if (b->keep) {
        e->rows = rows;
        e->row0 = row0;
        e->rows_local = nl;
        e->table = (const uint8_t *)t->data + row0 * hd;
        e->scale = (const uint8_t *)s->data + row0 * (hd / 32);
        uint64_t bytes = (uint64_t)nl * (uint64_t)(hd + hd / 32);
        b->mw->bytes_engram += bytes;
        account(b, bytes);
    }
    return 0;
}

static int bind_layer(struct binder *b, int l) {
    const struct model_config *c = b->cfg;
    const struct layer_role *r = &c->role[l];
    struct layer_weights *lw = &b->mw->layers[l];
    char base[64], n[320];
    config_layer_prefix(c, l, base, sizeof base);
    int64_t D = c->dim, hc = c->hc_mult, mix = (2 + hc) * hc;
    b->keep = r->is_dspark ? b->opt->last_stage : (l >= b->opt->layer_begin && l < b->opt->layer_end);
    lw->present = b->keep;
#define SUB(suffix) (snprintf(n, sizeof n, "%s.%s", base, suffix), n)
    if (bind_attention(b, l, &lw->attn) || bind_ffn(b, l, &lw->ffn)) return -1;
    if (BIND_VEC(b, lw->attn_norm, SUB("attn_norm.weight"), ST_BF16, D)) return -1;
    if (BIND_VEC(b, lw->ffn_norm, SUB("ffn_norm.weight"), ST_BF16, D)) return -1;
    if (bind_vec(b, (const void **)&lw->hc_attn_fn, SUB("hc_attn_fn"), ST_F32, 2, mix, hc * D, 0, mix * hc * D) ||
        bind_vec(b, (const void **)&lw->hc_ffn_fn, SUB("hc_ffn_fn"), ST_F32, 2, mix, hc * D, 0, mix * hc * D) ||
        BIND_VEC(b, lw->hc_attn_base, SUB("hc_attn_base"), ST_F32, mix) ||
        BIND_VEC(b, lw->hc_ffn_base, SUB("hc_ffn_base"), ST_F32, mix) ||
        BIND_VEC(b, lw->hc_attn_scale, SUB("hc_attn_scale"), ST_F32, 3) ||
        BIND_VEC(b, lw->hc_ffn_scale, SUB("hc_ffn_scale"), ST_F32, 3))
        return -1;
    if (r->engram_idx >= 0) {
        lw->has_engram = true;
        /* engram tables belong to the stage that runs the layer */
        if (bind_engram(b, l, &lw->engram)) return -1;
    }
    if (r->is_dspark) {
        int m = l - c->n_layers;
        if (m == 0) {
            if (bind_fp8_full(b, &lw->main_proj, SUB("main_proj"), D, D * c->n_dspark_targets)) return -1;
            if (BIND_VEC(b, lw->main_norm, SUB("main_norm.weight"), ST_BF16, D)) return -1;
        }
        if (m == c->n_mtp - 1) {
            int64_t V = c->vocab_size, rk = c->dspark_markov_rank;
            if (BIND_VEC(b, lw->mtp_norm, SUB("norm.weight"), ST_BF16, D)) return -1;
            if (bind_bf16(b, &lw->markov_embed, SUB("markov_head.embed.weight"), V, rk, 0, V)) return -1;
            if (bind_bf16(b, &lw->markov_head, SUB("markov_head.head.weight"), V, rk, 0, V)) return -1;
            if (bind_bf16(b, &lw->confidence, SUB("confidence_head.proj.weight"), 1, D + rk, 0, 1)) return -1;
        }
    }
#undef SUB
    return 0;
}

static bool ignored_tensor(const char *name) {
    return !strncmp(name, "vision.", 7) || !strncmp(name, "aligner.", 8) || !strncmp(name, "image_", 6);
}

struct bind_opts bind_opts_single(const struct model_config *cfg) {
    return (struct bind_opts){.tp_rank = 0, .tp_size = 1, .layer_begin = 0, .layer_end = cfg->n_layers,
                              .first_stage = true, .last_stage = true};
}

int weights_bind(struct model_weights *mw, const struct model_config *cfg, struct st_model *st,
                 const struct bind_opts *opt) {
    memset(mw, 0, sizeof *mw);
    mw->cfg = cfg;
    mw->opt = *opt;
    int total = config_total_layers(cfg);
    mw->layers = ds_calloc((size_t)total, sizeof *mw->layers);
    for (int i = 0; i < st->n_tensors; i++) st->tensors[i].bound = false;
    struct binder b = {.st = st, .cfg = cfg, .opt = opt, .mw = mw};

    int64_t V = cfg->vocab_size, D = cfg->dim, Vl;
    if (tp_split(&b, "vocab_size", V, &Vl)) goto fail;
    mw->vocab_row0 = opt->tp_rank * Vl;
    mw->vocab_rows = Vl;
    b.keep = opt->first_stage;
    if (bind_vec(&b, (const void **)&mw->embed, "embed.weight", ST_BF16, 2, V, D, mw->vocab_row0 * D, Vl * D))
        goto fail;
    b.keep = opt->last_stage;
    if (bind_bf16(&b, &mw->head, "head.weight", V, D, mw->vocab_row0, Vl)) goto fail;
    if (BIND_VEC(&b, mw->norm, "norm.weight", ST_BF16, D)) goto fail;
    for (int l = 0; l < total; l++)
        if (bind_layer(&b, l)) goto fail;
    for (int i = 0; i < st->n_tensors; i++) {
        const struct st_tensor *t = &st->tensors[i];
        if (!t->bound && !ignored_tensor(t->name)) {
            char got[128];
            shape_str(got, sizeof got, t->ndim, t->shape);
            ds_err_set("%s: unexpected tensor %s (%s %s) for this config (%s)", st->shard_paths[t->shard], t->name,
                       st_dtype_name(t->dtype), got, cfg->source);
            goto fail;
        }
    }
    return 0;
fail:
    weights_free(mw);
    return -1;
}

void weights_free(struct model_weights *mw) {
    if (mw->layers && mw->cfg) {
        int total = config_total_layers(mw->cfg);
        for (int l = 0; l < total; l++) {
            free(mw->layers[l].ffn.w1);
            free(mw->layers[l].ffn.w3);
            free(mw->layers[l].ffn.w2);
        }
    }
    free(mw->layers);
    mw->layers = NULL;
}
