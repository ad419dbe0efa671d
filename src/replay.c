/* Replay of golden fixtures (see replay.h). The hooks of model_forward do the forcing: before a
 * block's Engram the stream and mix of the block before are loaded from the fixture, after Engram
 * a stored x_in overrides, and after the block the engine's stream is recorded. The caches the
 * forced run builds are kept, so consumer layers read sources computed from golden inputs. */
#include "replay.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats.h"
#include "log.h"
#include "model_internal.h"

#define REPLAY_MAX_TENSORS 4096

struct rctx {
    struct model *m;
    struct st_model *fx;
    struct replay_result *res;
    bool decode;     /* phase */
    int64_t step;    /* decode step */
    bool force;      /* stream forcing in this phase */
    int64_t S, N;
};

static struct replay_tensor *res_get(struct replay_result *r, const char *name, enum st_dtype dt, int ndim,
                                     int64_t d0, int64_t d1, int64_t d2) {
    struct replay_tensor *t = replay_find(r, name);
    if (t) return t;
    /* fixed capacity: callers hold pointers to earlier entries while adding new ones */
    if (!r->t) r->t = ds_calloc(REPLAY_MAX_TENSORS, sizeof *r->t);
    if (r->n == REPLAY_MAX_TENSORS) ds_die("replay: more than %d result tensors", REPLAY_MAX_TENSORS);
    t = &r->t[r->n++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->dtype = dt;
    t->ndim = ndim;
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->shape[2] = d2;
    int64_t cnt = d0 * (ndim > 1 ? d1 : 1) * (ndim > 2 ? d2 : 1);
    t->data = ds_calloc((size_t)cnt, st_dtype_size(dt));
    if (dt == ST_I32)
        for (int64_t i = 0; i < cnt; i++) ((int32_t *)t->data)[i] = -1;
    return t;
}

struct replay_tensor *replay_find(struct replay_result *res, const char *name) {
    for (int i = 0; i < res->n; i++)
        if (!strcmp(res->t[i].name, name)) return &res->t[i];
    return NULL;
}

static const struct st_tensor *fx_get(struct rctx *c, const char *fmt, int layer) {
    char n[96];
    snprintf(n, sizeof n, fmt, layer);
    return st_find(c->fx, n);
}

/* Copy rows of a fixture tensor (row = one prefill position or one decode step) into X or P. */
static void load_rows(struct rctx *c, const struct st_tensor *t, void *dst, int64_t row0, int64_t rows) {
    size_t row_bytes = t->nbytes / (size_t)t->shape[0];
    c->m->be->ops->upload(c->m->be, dst, (const uint8_t *)t->data + (size_t)row0 * row_bytes, row_bytes * (size_t)rows);
}

static void h_pre_engram(void *ctx, int l, bf16_t *X, float *P, int64_t T) {
    struct rctx *c = ctx;
    if (!c->force || l == 0) return;
    const struct st_tensor *x = fx_get(c, c->decode ? "layers.%d.decode_x_out" : "layers.%d.x_out", l - 1);
    const struct st_tensor *p = fx_get(c, c->decode ? "layers.%d.decode_pre_out" : "layers.%d.pre_out", l - 1);
    if (!x || !p) return;
    load_rows(c, x, X, c->decode ? c->step : 0, T);
    load_rows(c, p, P, c->decode ? c->step : 0, T);
}

static void h_pre_block(void *ctx, int l, bf16_t *X, float *P, int64_t T) {
    struct rctx *c = ctx;
    if (!c->force || c->decode) return;
    const struct st_tensor *x = fx_get(c, "layers.%d.x_in", l), *p = fx_get(c, "layers.%d.pre_in", l);
    if (x) load_rows(c, x, X, 0, T);
    if (p) load_rows(c, p, P, 0, T);
}

static void h_post_block(void *ctx, int l, const bf16_t *X, const float *P, int64_t T) {
    struct rctx *c = ctx;
    const struct model_config *cfg = c->m->cfg;
    int64_t hc = cfg->hc_mult, D = cfg->dim;
    char nx[96], np[96];
    snprintf(nx, sizeof nx, c->decode ? "layers.%d.decode_x_out" : "layers.%d.x_out", l);
    snprintf(np, sizeof np, c->decode ? "layers.%d.decode_pre_out" : "layers.%d.pre_out", l);
    int64_t rows = c->decode ? c->N : c->S, r0 = c->decode ? c->step : 0;
    struct replay_tensor *tx = res_get(c->res, nx, ST_BF16, 3, rows, hc, D);
    struct replay_tensor *tp = res_get(c->res, np, ST_F32, 2, rows, hc, 0);
    c->m->be->ops->download(c->m->be, (bf16_t *)tx->data + r0 * hc * D, X, (size_t)(T * hc * D) * 2);
    c->m->be->ops->download(c->m->be, (float *)tp->data + r0 * hc, P, (size_t)(T * hc) * 4);
}

static void h_engram_ids(void *ctx, int l, const int64_t *ids, int64_t T, int64_t C) {
    struct rctx *c = ctx;
    char n[96];
    snprintf(n, sizeof n, c->decode ? "engram.%d.decode_hash_ids" : "engram.%d.hash_ids", l);
    struct replay_tensor *t = res_get(c->res, n, ST_I32, 2, c->decode ? c->N : c->S, C, 0);
    int32_t *d = (int32_t *)t->data + (c->decode ? c->step : 0) * C;
    for (int64_t i = 0; i < T * C; i++) d[i] = (int32_t)ids[i];
}

static void h_topk(void *ctx, int l, const int32_t *idx, int64_t T, int64_t k) {
    struct rctx *c = ctx;
    int64_t K = c->m->cfg->index_topk;
    char n[96];
    snprintf(n, sizeof n, c->decode ? "index.%d.decode_topk" : "index.%d.topk", l);
    struct replay_tensor *t = res_get(c->res, n, ST_I32, 2, c->decode ? c->N : c->S, K, 0);
    int32_t *d = (int32_t *)t->data + (c->decode ? c->step : 0) * K;
    for (int64_t r = 0; r < T; r++)
        for (int64_t j = 0; j < K; j++) d[r * K + j] = j < k ? idx[r * k + j] : -1;
}

static void h_final_hidden(void *ctx, const bf16_t *h, int64_t T) {
    struct rctx *c = ctx;
    if (c->decode) return;
    struct replay_tensor *t = res_get(c->res, "final_hidden", ST_BF16, 2, c->S, c->m->cfg->dim, 0);
    c->m->be->ops->download(c->m->be, t->data, h, (size_t)(T * c->m->cfg->dim) * 2);
}

static int argmax_row(const float *x, int64_t n) {
    int64_t b = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return (int)b;
}

static int forward(struct model *m, const struct replay_fwd *fwd, const struct fwd_seq *s, float *logits,
                   const struct fwd_hooks *hk) {
    return fwd ? fwd->fn(fwd->ctx, s, 1, logits, hk) : model_forward(m, s, 1, logits, hk);
}

int replay_run(struct model *m, struct st_model *fx, enum replay_force force, const struct replay_fwd *fwd,
               struct replay_result *res) {
    memset(res, 0, sizeof *res);
    const struct st_tensor *ids = st_find(fx, "prompt_ids"), *greedy = st_find(fx, "greedy_tokens");
    if (!ids || ids->dtype != ST_I32 || ids->ndim != 1 || !greedy || greedy->dtype != ST_I32) {
        ds_err_set("%s: fixture needs I32 prompt_ids and greedy_tokens", fx->shard_paths[0]);
        return -1;
    }
    const struct model_config *cfg = m->cfg;
    int64_t V = cfg->vocab_size;
    struct rctx c = {.m = m, .fx = fx, .res = res, .S = ids->shape[0], .N = greedy->shape[0] - 1};
    struct fwd_hooks hk = {.ctx = &c, .pre_engram = h_pre_engram, .pre_block = h_pre_block,
                           .post_block = h_post_block, .engram_ids = h_engram_ids, .topk = h_topk,
                           .final_hidden = h_final_hidden};
    bool has_prefill_states = st_find(fx, "layers.0.x_out") != NULL;
    bool has_decode_states = st_find(fx, "layers.0.decode_x_out") != NULL;
    res->prefill_forced = force == REPLAY_FORCE_STREAM && has_prefill_states;
    res->decode_forced = force == REPLAY_FORCE_STREAM && has_decode_states;

    model_reset_slot(m, 0);
    const int32_t *prompt = ids->data, *gt = greedy->data;
    struct replay_tensor *pl = res_get(res, "prefill_logits", ST_F32, 2, c.S, V, 0);
    struct replay_tensor *gr = res_get(res, "greedy_tokens", ST_I32, 1, c.N + 1, 0, 0);
    c.force = res->prefill_forced;
    struct fwd_seq s = {.slot = 0, .start = 0, .len = c.S, .tokens = prompt, .all_logits = true};
    if (forward(m, fwd, &s, pl->data, &hk)) return -1;
    ((int32_t *)gr->data)[0] = argmax_row((float *)pl->data + (c.S - 1) * V, V);
    struct replay_tensor *dl = res_get(res, "decode_logits", ST_F32, 2, c.N, V, 0);
    c.decode = true;
    c.force = res->decode_forced;
    for (int64_t k = 0; k < c.N; k++) {
        c.step = k;
        /* the fixture's greedy token is fed whatever our argmax said (teacher forcing) */
        struct fwd_seq d = {.slot = 0, .start = c.S + k, .len = 1, .tokens = gt + k, .all_logits = false};
        float *row = (float *)dl->data + k * V;
        if (forward(m, fwd, &d, row, &hk)) return -1;
        ((int32_t *)gr->data)[k + 1] = argmax_row(row, V);
    }
    return 0;
}

int replay_write(const struct replay_result *res, const char *path) {
    struct st_writer *w = st_writer_new();
    st_writer_set_metadata(w, "format", "dsbatch-replay/1");
    for (int i = 0; i < res->n; i++) {
        const struct replay_tensor *t = &res->t[i];
        if (st_writer_add(w, t->name, t->dtype, t->ndim, t->shape, t->data)) {
            st_writer_abort(w);
            return -1;
        }
    }
    return st_writer_save(w, path);
}

void replay_free(struct replay_result *res) {
    for (int i = 0; i < res->n; i++) free(res->t[i].data);
    free(res->t);
    memset(res, 0, sizeof *res);
}
