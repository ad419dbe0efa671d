/* Attention of one layer over a batch of sequence chunks (MODEL.md §3.5–§3.9): low-rank q, the
 * window K=V of this layer, and on ratio>0 layers the compressed branch — the KV source's
 * compressor (pooled latents -> index keys and compressed KV), the indexer with candidate blocks
 * and top-k, or the top-k published by this layer's index source — then sparse attention with
 * sink, inverse RoPE and the grouped low-rank output. Host code only orchestrates: every number
 * is produced by the op table, the indexer's top-k too, so a forward never waits for the device.
 * The index lists are built on the backend (attn_index) from the batch's geometry, uploaded once a
 * forward: the window part in its order (part of the numerics: sparse_attn rounds P per block of
 * 64 entries), then the compressed part from the backend's top-k. Built on the host a layer and
 * uploaded, they stood in front of each layer's attention (H100 kernel timeline, 508787b:
 * 13-16 µs idle a layer at batch 64 and 256). sparse_attn reads every key row where it lives (the
 * model's kv arena holds the rings, the compressed caches and the chunk's own rows), so nothing is
 * gathered per step; rows that do move go in one call per batch, not one copy per sequence: the
 * ring updates by ring_store from the same geometry, compressor state and cache writes by
 * copy_segs. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "model_internal.h"

#define OPS (m->be->ops)

/* every buffer of this file is a temporary its op writes before anything reads it (entries past
 * what an op writes, e.g. index-score columns past a row's keys, are never read): model_tmp, no
 * zero fill */

/* Latents emitted by a KV source in this call. */
struct emitted {
    int64_t n;
    int *chunk;     /* [n] */
    int64_t *group; /* [n] group index j (position j*ratio) */
};

/* Compressor of a KV source: pooled (ratio > 1) or per-token (ratio 1) latents, normalized.
 * Returns the latents [n, hd] bf16 (backend) and which (chunk, group) each belongs to. */
static bf16_t *compress(struct model *m, int l, struct batch *b, const bf16_t *x, struct emitted *em) {
    const struct model_config *c = m->cfg;
    const struct attn_weights *aw = &m->w->layers[l].attn;
    struct layer_cache *lc = &m->lc[l];
    int ratio = c->role[l].ratio;
    int64_t hd = c->head_dim, T = b->T;
    em->n = 0;
    em->chunk = ds_malloc(sizeof(int) * (size_t)(T + 1));
    em->group = ds_malloc(sizeof(int64_t) * (size_t)(T + 1));
    bf16_t *lat;
    if (ratio == 1) {
        lat = model_tmp(m, (size_t)T * hd * 2);
        OPS->linear(m->be, lat, x, T, &aw->cmp_wkv);
        for (int i = 0; i < b->n; i++)
            for (int64_t t = 0; t < b->seqs[i].len; t++) {
                em->chunk[em->n] = i;
                em->group[em->n++] = b->seqs[i].start + t;
            }
    } else {
        float *kvf = model_tmp(m, (size_t)T * hd * 4), *scf = model_tmp(m, (size_t)T * hd * 4);
        OPS->linear_f32(m->be, kvf, x, T, &aw->cmp_wkv);
        OPS->linear_f32(m->be, scf, x, T, &aw->cmp_wgate);
        /* Every closing group pools its `ratio` fp32 rows: those of this call from kvf/scf, the
         * earlier ones from the slot's open-group state (written by previous calls). Then the
         * state takes this call's last row of each group slot, as a token-by-token walk leaves
         * it, so decode steps and prefill chunks pool the same rows. Two batches of copies: the
         * group reads see the state from before this call. */
        float *gkv = model_tmp(m, (size_t)(T / ratio + b->n) * ratio * hd * 4);
        float *gsc = model_tmp(m, (size_t)(T / ratio + b->n) * ratio * hd * 4);
        size_t rowb = (size_t)hd * 4;
        struct seg_list groups = {0}, state = {0};
        /* kv's rows first, then the gate's: consecutive rows merge into one copy (a prefill
         * chunk's groups are one range each), where interleaving them left one copy per row */
        for (int pass = 0; pass < 2; pass++) {
            float *gdst = pass ? gsc : gkv;
            const float *fsrc = pass ? scf : kvf;
            int64_t ng = 0;
            for (int i = 0; i < b->n; i++) {
                const struct fwd_seq *s = &b->seqs[i];
                float *sst = (pass ? lc->cmp_sc : lc->cmp_kv) + (size_t)s->slot * ratio * hd;
                for (int64_t t = 0; t < s->len; t++) {
                    int64_t p = s->start + t;
                    if ((p + 1) % ratio) continue;
                    for (int64_t k = 0; k < ratio; k++) {
                        int64_t q = p + 1 - ratio + k, row = b->row0[i] + (q - s->start);
                        seg_push(&groups, gdst + ((size_t)ng * ratio + k) * hd, q >= s->start ? fsrc + row * hd : sst + k * hd,
                                 rowb);
                    }
                    if (!pass) {
                        em->chunk[em->n] = i;
                        em->group[em->n++] = p / ratio;
                    }
                    ng++;
                }
                for (int64_t t = i64max(0, s->len - ratio); t < s->len; t++)
                    seg_push(&state, sst + ((s->start + t) % ratio) * hd, fsrc + (b->row0[i] + t) * hd, rowb);
            }
        }
        seg_flush(m, &groups);
        seg_flush(m, &state);
        seg_free(&groups);
        seg_free(&state);
        lat = model_tmp(m, (size_t)(em->n ? em->n : 1) * hd * 2);
        if (em->n) OPS->compress_pool(m->be, lat, gkv, gsc, em->n, ratio, hd);
        model_tfree(m, kvf);
        model_tfree(m, scf);
        model_tfree(m, gkv);
        model_tfree(m, gsc);
    }
    if (em->n) OPS->rmsnorm(m->be, lat, lat, aw->cmp_norm, em->n, hd, (float)c->norm_eps, NULL);
    return lat;
}

/* Positions j*ratio of the emitted latents, as a backend int32 array. */
static int32_t *latent_positions(struct model *m, const struct emitted *em, int ratio) {
    int32_t *h = ds_malloc(sizeof(int32_t) * (size_t)(em->n + 1));
    for (int64_t i = 0; i < em->n; i++) h[i] = (int32_t)(em->group[i] * ratio);
    int32_t *d = model_tmp(m, sizeof(int32_t) * (size_t)(em->n + 1));
    OPS->upload(m->be, d, h, sizeof(int32_t) * (size_t)em->n);
    free(h);
    return d;
}

/* Index keys from the (pre-RoPE) latents, written to this owner's key cache (§3.6). */
static void write_index_keys(struct model *m, int l, struct batch *b, const bf16_t *lat, const struct emitted *em,
                             const int32_t *lpos) {
    const struct model_config *c = m->cfg;
    const struct attn_weights *aw = &m->w->layers[l].attn;
    struct layer_cache *lc = &m->lc[l];
    int64_t id = c->index_head_dim, rd = c->rope_dim, n = em->n;
    bf16_t *k = model_tmp(m, (size_t)n * id * 2);
    /* the norm, then rope, qdq */
    const struct linear_post kpost = {aw->idx_k_norm, (float)c->norm_eps, id, {id - rd, rd, lpos, m->freqs[l], NORM_QDQ_FP4_32},
                                      NULL, NULL};
    be_linear_post(m->be, k, lat, n, &aw->idx_wk, &kpost);
    struct seg_list sl = {0};
    for (int64_t i = 0; i < n; i++) {
        int slot = b->seqs[em->chunk[i]].slot;
        seg_push(&sl, lc->kidx + ((size_t)slot * lc->cap + em->group[i]) * id, k + i * id, (size_t)id * 2);
        m->slots[slot].index_k_src = l;
    }
    seg_flush(m, &sl);
    seg_free(&sl);
    model_tfree(m, k);
}

/* Compressed KV: RoPE at the group's first token, FP4 (16, e4m3) QDQ, into the source cache. */
static void write_compressed_kv(struct model *m, int l, struct batch *b, bf16_t *lat, const struct emitted *em,
                                const int32_t *lpos) {
    const struct model_config *c = m->cfg;
    struct layer_cache *lc = &m->lc[l];
    int64_t hd = c->head_dim, rd = c->rope_dim, n = em->n;
    OPS->rope(m->be, lat, n, 1, hd, hd, hd - rd, rd, lpos, m->freqs[l], false);
    OPS->qdq_fp4_16(m->be, lat, n * hd);
    struct seg_list sl = {0};
    for (int64_t i = 0; i < n; i++) {
        int slot = b->seqs[em->chunk[i]].slot;
        seg_push(&sl, lc->ckv + ((size_t)slot * lc->cap + em->group[i]) * hd, lat + i * hd, (size_t)hd * 2);
    }
    seg_flush(m, &sl);
    seg_free(&sl);
}

static int64_t round_up(int64_t v, int64_t step) { return (v + step - 1) / step * step; }

/* Where index source l's top-k rows [T, ld] go: a temporary of the forward, or with graphs rows of
 * the persistent FB_TOPK (one block of T x index_topk rounded up per index source, by its rank
 * among them), so that the attention in a later segment reads them at an address its key keeps. */
static int32_t *topk_rows(struct model *m, struct batch *b, int l, int64_t ld) {
    const struct model_config *c = m->cfg;
    int64_t T = b->T;
    if (!b->graphs) return model_tmp(m, sizeof(int32_t) * (size_t)(T * ld + 1));
    int64_t cap = round_up(c->index_topk, MODEL_GRAPH_WIDTH_STEP), nsrc = 0, j = 0;
    for (int i = 0; i < c->n_layers; i++) {
        if (!c->role[i].is_index_source) continue;
        if (i < l) j++;
        nsrc++;
    }
    int32_t *all = model_fbuf(m, b, FB_TOPK, sizeof(int32_t) * (size_t)(nsrc * T * cap), false);
    return all + j * T * cap;
}

/* Indexer of an index source (§3.7): scores every visible compressed row, applies candidate
 * blocks, publishes the top-k rows for this forward's batch in b->topk[l]. */
static void run_indexer(struct model *m, int l, struct batch *b, const bf16_t *x, const bf16_t *qr, const void *qra) {
    const struct model_config *c = m->cfg;
    const struct layer_role *r = &c->role[l];
    const struct attn_weights *aw = &m->w->layers[l].attn;
    int64_t T = b->T, id = c->index_head_dim, rd = c->rope_dim, ihl = aw->idx_weights_proj.n;
    int ratio = r->ratio;

    int64_t kmax = 0, nk_max = 0;
    for (int i = 0; i < b->n; i++) {
        int64_t nk = (b->seqs[i].start + b->seqs[i].len) / ratio;
        nk_max = i64max(nk_max, nk);
        kmax = i64max(kmax, i64min(c->index_topk, nk));
    }
    /* a forward with nothing to select still publishes its (empty) rows for the layers reading them;
     * with graphs the stride is rounded up (MODEL_GRAPH_WIDTH_STEP; index_topk fills -1 past k) */
    int64_t ld = b->graphs && kmax > 0 ? round_up(kmax, MODEL_GRAPH_WIDTH_STEP) : kmax;
    int32_t *top = topk_rows(m, b, l, ld);
    b->topk[l] = top;
    b->topk_w[l] = ld;
    b->topk_k[l] = kmax;
    if (kmax == 0) return;

    bf16_t *iq = model_tmp(m, (size_t)T * ihl * id * 2);
    bf16_t *wr = model_tmp(m, (size_t)T * ihl * 2);
    const struct linear_post qpost = {NULL, 0.0f, id, {id - rd, rd, b->pos, m->freqs[l], NORM_QDQ_FP4_32}, qra, NULL}; /* rope, qdq */
    be_linear_post(m->be, iq, qr, T, &aw->idx_wq_b, &qpost);
    OPS->linear(m->be, wr, x, T, &aw->idx_weights_proj);
    /* the reference scales the projected weights by index_head_dim^-0.5 · n_heads^-0.5 (all heads) */
    float w_scale = (float)(pow((double)id, -0.5) * pow((double)c->index_n_heads, -0.5));

    /* every sequence's rows scored into one [T, nk_max] buffer; the selection runs on the backend
     * from per-row parameters, so nothing comes back to the host mid-forward. The per-row tables go
     * up as one upload (each upload is a copy the stream waits for: four a layer left the GPU idle
     * ~17 µs before index_scores at batch 256, H100 timeline of e378f8d): [T] key-cache pointers,
     * then [T] visible counts, [T] key counts, [T, TOPK_P_COUNT] selection parameters. */
    float *S_d = model_tmp(m, (size_t)(T * nk_max + 1) * 4);
    const size_t tb_ptr = sizeof(const bf16_t *) * (size_t)T, tb_i32 = sizeof(int32_t) * (size_t)T;
    const size_t tb_bytes = tb_ptr + 2 * tb_i32 + tb_i32 * TOPK_P_COUNT;
    uint8_t *tb = ds_calloc(1, tb_bytes);
    const bf16_t **krow = (const bf16_t **)tb;           /* [T] */
    int32_t *vis_h = (int32_t *)(tb + tb_ptr);           /* [T] */
    int32_t *nkrow = vis_h + T;                          /* [T] */
    int32_t *prm = nkrow + T;                            /* [T, TOPK_P_COUNT] */
    for (int i = 0; i < b->n; i++)
        for (int64_t t = 0; t < b->seqs[i].len; t++)
            vis_h[b->row0[i] + t] = (int32_t)((b->seqs[i].start + t + 1) / ratio);
    /* one index_scores call for the batch: each row names its sequence's key cache and count */
    for (int i = 0; i < b->n; i++) {
        const struct fwd_seq *s = &b->seqs[i];
        int64_t nk = (s->start + s->len) / ratio, r0 = b->row0[i];
        if (nk == 0) continue;
        /* Which keys: the owner's own, or (quirk) whatever key owner published last for this
         * sequence — on an open-group decode step that is a later layer's cache from the step before. */
        int ks = r->kv_src;
        if (m->opt.stale_index_keys && m->slots[s->slot].index_k_src >= 0) ks = m->slots[s->slot].index_k_src;
        struct layer_cache *klc = &m->lc[ks];
        int64_t nkk = i64min(nk, klc->cap);
        for (int64_t t = 0; t < s->len; t++) {
            krow[r0 + t] = klc->kidx + (size_t)s->slot * klc->cap * id;
            nkrow[r0 + t] = (int32_t)nkk;
            int32_t *pr = prm + (r0 + t) * TOPK_P_COUNT;
            int64_t vis = vis_h[r0 + t];
            /* A decode step scores exactly its visible rows; the reference's single-shot prefill
             * scores the chunk's whole width. The width decides how exact ties break, so the
             * chunk-invariant layout scores every row like a decode step. */
            int64_t n_row = m->opt.window_layout == WINDOW_LAYOUT_DECODE ? vis : nk;
            pr[TOPK_P_N] = (int32_t)n_row;
            pr[TOPK_P_VALID] = (int32_t)nkk;
            pr[TOPK_P_K] = (int32_t)i64min(c->index_topk, n_row);
            pr[TOPK_P_VISIBLE] = (int32_t)vis;
        }
    }
    uint8_t *tb_d = model_tmp(m, tb_bytes);
    OPS->upload(m->be, tb_d, tb, tb_bytes);
    free(tb);
    const bf16_t **krow_d = (const bf16_t **)tb_d;
    int32_t *vis_d = (int32_t *)(tb_d + tb_ptr), *nkrow_d = vis_d + T, *prm_d = nkrow_d + T;
    OPS->index_scores(m->be, S_d, nk_max, iq, ihl * id, NULL, krow_d, nkrow_d, wr, w_scale, vis_d, T, ihl, id, nk_max);
    const uint8_t *mask = NULL;
    int64_t ld_m = 0;
    if (r->is_candidate_source) {
        model_tfree(m, b->cand);
        b->cand = model_tmp(m, (size_t)(T * nk_max + 1));
        b->cand_w = nk_max;
        OPS->cand_mask(m->be, b->cand, nk_max, S_d, nk_max, prm_d, T, c->candidate_topk_blocks,
                       c->candidate_block_size);
    } else if (r->uses_candidates && b->cand) {
        mask = b->cand;
        ld_m = b->cand_w;
    }
    OPS->index_topk(m->be, top, ld, S_d, nk_max, prm_d, mask, ld_m, T);
    model_tfree(m, tb_d);
    model_tfree(m, S_d);
    model_tfree(m, iq);
    model_tfree(m, wr);
}

/* [T, hd]: the arena's scratch rows (model_kv_reserve) */
bf16_t *attention_kv_rows(struct model *m) { return m->kv + m->kv_cache_rows * m->cfg->head_dim; }

/* wkv's linear_post: the norm, then rope, qdq (the window K=V rows) */
static struct linear_post kv_post(const struct model *m, int l, const struct batch *b, const void *xa) {
    const struct model_config *c = m->cfg;
    int64_t hd = c->head_dim, rd = c->rope_dim;
    const struct linear_post lp = {m->w->layers[l].attn.kv_norm, (float)c->norm_eps, hd,
                                   {hd - rd, rd, b->pos, m->freqs[l], NORM_QDQ_FP8_32}, xa, NULL};
    return lp;
}

/* wq_a's linear_post: q_norm (and qr's activation form, qra) */
static struct linear_post q_a_post(const struct model *m, int l, const void *xa, void *qra) {
    const struct model_config *c = m->cfg;
    const struct linear_post lp = {m->w->layers[l].attn.q_norm, (float)c->norm_eps, c->q_lora_rank,
                                   {0, 0, NULL, NULL, NORM_QDQ_NONE}, xa, qra};
    return lp;
}

/* wq_b's linear_post: RoPE on each head's rotary part */
static void project_q_b(struct model *m, int l, struct batch *b, const bf16_t *qr, const void *qra, bf16_t *q) {
    const struct model_config *c = m->cfg;
    int64_t hd = c->head_dim, rd = c->rope_dim;
    const struct linear_post qrope = {NULL, 0.0f, hd, {hd - rd, rd, b->pos, m->freqs[l], NORM_QDQ_NONE}, qra, NULL};
    be_linear_post(m->be, q, qr, b->T, &m->w->layers[l].attn.wq_b, &qrope);
}

void attention_project_kv(struct model *m, int l, struct batch *b, const bf16_t *x, const void *xa) {
    const struct linear_post kvpost = kv_post(m, l, b, xa);
    be_linear_post(m->be, attention_kv_rows(m), x, b->T, &m->w->layers[l].attn.wkv, &kvpost);
}

void attention_project_q(struct model *m, int l, struct batch *b, const bf16_t *x, const void *xa, bf16_t *qr,
                         void *qra, bf16_t *q) {
    const struct linear_post qnorm = q_a_post(m, l, xa, qra);
    be_linear_post(m->be, qr, x, b->T, &m->w->layers[l].attn.wq_a, &qnorm);
    project_q_b(m, l, b, qr, qra, q);
}

void attention_project_qkv(struct model *m, int l, struct batch *b, const bf16_t *x, const void *xa, bf16_t *qr,
                           void *qra, bf16_t *q) {
    const struct attn_weights *aw = &m->w->layers[l].attn;
    const struct linear_post qnorm = q_a_post(m, l, xa, qra), kvpost = kv_post(m, l, b, xa);
    be_linear_post_pair(m->be, qr, attention_kv_rows(m), x, b->T, &aw->wq_a, &qnorm, &aw->wkv, &kvpost);
    project_q_b(m, l, b, qr, qra, q);
}

/* The attention (ac) into the heads' output o [T, Hl·hd] (after its inverse RoPE), the window
 * ring's update from this forward's rows, then o to the sublayer's out: wo_a by group, the groups
 * gathered over the TP group, this rank's rows of wo_b, gathered. Its shapes are fixed at a given T
 * and the rounded widths (MODEL_GRAPH_WIDTH_STEP), so in a decode step it replays as graph
 * segments: one, or two around the first gather where the TP group's collectives come between
 * (one again where the TP comm is stream_ordered: model_tp_between). In three parts, so that the
 * first segment's ops can join the segment before it (attention_out_ops under a key holding
 * attention_out_prepare's words, then attention_out_rest).
 * Each was 3 launches from the host (then the inverse RoPE, wo_a and its chunk fold; wo_b's act
 * quant, the GEMM and its fold). H100, bench_step decode ms at batch 1 / 8 / 64 / 256, two runs
 * alternated with 3d8b3cb: 4.069 4.134 / 5.451 5.525 / 11.02 11.06 / 19.64 20.38 -> 4.042 4.105 /
 * 5.448 5.502 / 11.00 11.03 / 19.61 19.67: the host runs ahead of the GPU, so a launch from it
 * costs the step little more than one from a graph. With one rank there is nothing to gather:
 * wo_b reads wo_a's output and writes the sublayer's (two device copies a layer fewer). out is
 * [attention_out_blocks(m), T, D / that] (model_internal.h). */
int attention_out_prepare(struct model *m, int l, struct batch *b, const bf16_t *q, bf16_t *out,
                          struct attn_out_plan *p) {
    const struct model_config *c = m->cfg;
    const struct layer_role *r = &c->role[l];
    const struct attn_weights *aw = &m->w->layers[l].attn;
    int64_t T = b->T, hd = c->head_dim, W = c->window;
    int64_t Hl = aw->wq_b.n / hd;
    int src = r->ratio > 0 ? r->kv_src : -1;
    const int32_t *ctop = src >= 0 ? b->topk[r->topk_src] : NULL;
    int64_t kc = src >= 0 ? b->topk_w[r->topk_src] : 0; /* the top-k rows' stride, all of it taken */
    if (src >= 0 && !ctop) {
        ds_err_set("layer %d: top-k source layer %d did not run in this forward", l, r->topk_src);
        return -1;
    }
    /* sparse_attn reads every row where it lives, in the model's kv arena (model_internal.h): the
     * chunk's own rows (scratch rows after the caches), older window positions in this layer's
     * ring, compressed rows in the KV source's cache. Per row the index list is [window |
     * compressed | -1 padding]; padding at the end of a row changes nothing. */
    int64_t n_idx = 0;
    for (int i = 0; i < b->n; i++) n_idx = i64max(n_idx, model_window_width(m, &b->seqs[i]) + kc);
    if (b->graphs) n_idx = round_up(n_idx, MODEL_GRAPH_WIDTH_STEP);
    /* the lists on the backend from the batch's geometry (uploaded once a forward, b->geo) */
    const struct layer_cache *lc = &m->lc[l], *sc = src >= 0 ? &m->lc[src] : NULL;
    /* the heads' output with its inverse RoPE (MODEL.md §3.9): on the GPU in the attention's stores */
    const struct attn_core ac = {q,
                                 Hl,
                                 n_idx,
                                 {W, lc->ring_row, ctop, kc, kc, sc ? sc->ckv_row : 0, sc ? sc->cap : 0},
                                 aw->attn_sink,
                                 (float)pow((double)hd, -0.5),
                                 {hd - c->rope_dim, c->rope_dim, b->pos, m->freqs[l], true}};
    p->ac = ac;
    p->layer = l;
    int64_t K = c->o_groups * c->o_lora_rank, Dl = aw->wo_b.n;
    const bool one = m->tp_size == 1; /* no gathers: one segment, wo_b from u into out */
    p->out = out;
    p->o = model_fbuf(m, b, FB_ATTN_O, (size_t)T * Hl * hd * 2, false);             /* [T, Hl·hd] */
    p->u = model_fbuf(m, b, FB_ATTN_U, (size_t)T * aw->wo_a.n * 2, false);          /* [T, Gl·o_lora] */
    p->uf = one ? p->u : model_fbuf(m, b, FB_ATTN_UF, (size_t)(T * K) * 2, false); /* [T, K] all ranks' */
    p->ol = one ? out : model_fbuf(m, b, FB_ATTN_OL, (size_t)(T * Dl) * 2, false); /* [T, Dl] */
    p->ug = one ? p->u : model_fbuf(m, b, FB_ATTN_UG, (size_t)(T * K) * 2, false); /* [tp, T, Gl·o_lora] */
    const bf16_t *kv = attention_kv_rows(m);
    p->k = graph_key_new(m, GSEG_ATTN_OUT, l, b);
    const void *k_p[] = {p->o, p->u, p->uf, p->ol, out, p->ug, lc->ring, kv, b->geo, ac.q, m->kv, ac.ip.src, ac.sink};
    for (size_t i = 0; i < sizeof k_p / sizeof *k_p; i++) graph_key_ptr(&p->k, k_p[i]);
    const int64_t k_w[] = {ac.n_idx, ac.ip.ld_src, ac.ip.k, ac.ip.ring0, ac.ip.src0, ac.ip.cap};
    for (size_t i = 0; i < sizeof k_w / sizeof *k_w; i++) graph_key_word(&p->k, (uint64_t)k_w[i]);
    return 0;
}

/* The first segment's ops: the index lists and the attention (with graphs their widths are rounded
 * up, so the key changes every 64 entries of context, not every step: MODEL_GRAPH_WIDTH_STEP; as
 * eager launches between segments each left the GPU idle 1.3-2.0 µs before it at batch 1, H100
 * timeline of 2ca5d88), the ring's update, wo_a (and wo_b with one rank). */
void attention_out_ops(struct model *m, int l, struct batch *b, const struct attn_out_plan *p) {
    const struct model_config *c = m->cfg;
    const struct attn_weights *aw = &m->w->layers[l].attn;
    const struct attn_core *ac = &p->ac;
    int64_t T = b->T, Gl = aw->wo_a.n / c->o_lora_rank;
    int32_t *idx_d = model_tmp(m, sizeof(int32_t) * (size_t)(T * ac->n_idx));
    /* the lists built by attn_index, or formed inside the attention's kernels (sparse_attn_index:
     * one launch fewer on a decode step's attention chain) */
    be_sparse_attn_index(m->be, p->o, ac->q, m->kv, idx_d, b->geo, &ac->ip, T, ac->Hl, c->head_dim, ac->n_idx, ac->sink,
                         ac->scale, &ac->inv);
    model_tfree(m, idx_d);
    /* the ring keeps the last W positions for later steps: written after the attention, which
     * reads the older positions in place (a host list of T copies uploaded a layer left the GPU
     * idle ~11 µs before it at batch 256 on the H200 timeline of 65418ff); on a branch beside
     * the output's linears, which do not read it (on the main lane it was a ~1.3 µs kernel and
     * a ~0.5 µs gap a layer on the critical path at batch 1, H200 timeline of fb5cbc4) */
    model_branch_begin(m);
    OPS->ring_store(m->be, m->lc[l].ring, attention_kv_rows(m), b->geo, T, c->window, c->head_dim);
    model_branch_end(m);
    OPS->grouped_linear(m->be, p->u, p->o, T, Gl, &aw->wo_a);
    if (m->tp_size == 1) OPS->linear(m->be, p->out, p->u, T, &aw->wo_b);
    model_branch_join(m);
}

/* What follows attention_out_ops, under `issue` (model_graph_begin's answer for the segment that
 * holds them): the TP gathers and wo_b between them, the segments' ends. */
void attention_out_rest(struct model *m, int l, struct batch *b, struct attn_out_plan *p, bool issue) {
    const struct attn_weights *aw = &m->w->layers[l].attn;
    int64_t T = b->T, Dl = aw->wo_b.n;
    const bool one = m->tp_size == 1;
    if (!one) {
        /* whole rows of the grouped output on every rank, then this rank's output rows of wo_b,
         * the next segment's first op (as an eager launch between the gather and the segment the
         * interleave left the GPU idle ~1.3 µs more a layer at batch 1, H100 timeline of 63e839c);
         * wo_b reads the gathered blocks in place where the backend can (linear_cols: on the GPU
         * its act quant does, one launch fewer), else they are interleaved into rows first */
        const struct tp_call groups = {TP_ALLGATHER, p->u, p->ug, (size_t)T * aw->wo_a.n * 2, "attention groups"};
        issue = model_tp_between(m, b, &p->k, issue, GSEG_ATTN_WOB, &groups);
        if (issue) be_linear_cols(m->be, p->ol, p->uf, p->ug, m->tp_size, T, &aw->wo_b);
        /* out as the all-gather leaves it, [tp, T, Dl] (attention_out_blocks): the expand after the
         * block reads the column blocks in place, no interleave into [T, D] (a launch a layer) */
        const struct tp_call outs = {TP_ALLGATHER, p->ol, p->out, (size_t)(T * Dl) * 2, "attention out"};
        issue = model_tp_between(m, b, &p->k, issue, 0, &outs);
    }
    if (issue) model_graph_end(m);
    model_fbuf_free(m, b, p->u);
    if (!one) {
        model_fbuf_free(m, b, p->uf);
        model_fbuf_free(m, b, p->ol);
        model_fbuf_free(m, b, p->ug);
    }
    model_fbuf_free(m, b, p->o);
}

/* Whether layer l's attention has nothing before its output part (no compressor, no indexer):
 * its first segment's ops may then join the segment before it (model.c, block_forward). */
bool attention_plain(const struct model *m, int l) {
    const struct layer_role *r = &m->cfg->role[l];
    return !r->owns_compressor && !r->is_index_source;
}

int attention_forward(struct model *m, int l, struct batch *b, const bf16_t *x, const bf16_t *qr, const void *qra,
                      const bf16_t *q, bf16_t *out, const struct fwd_hooks *hooks) {
    const struct model_config *c = m->cfg;
    const struct layer_role *r = &c->role[l];
    int64_t T = b->T;

    /* compressed branch: sources write their caches first, then index sources choose rows */
    if (r->owns_compressor) {
        struct emitted em;
        bf16_t *lat = compress(m, l, b, x, &em);
        if (em.n) {
            int32_t *lpos = latent_positions(m, &em, r->ratio);
            if (r->owns_index_keys) write_index_keys(m, l, b, lat, &em, lpos);
            write_compressed_kv(m, l, b, lat, &em, lpos);
            model_tfree(m, lpos);
        }
        model_tfree(m, lat);
        free(em.chunk);
        free(em.group);
    }
    if (r->is_index_source) {
        run_indexer(m, l, b, x, qr, qra);
        if (hooks && hooks->topk) {
            /* replay/verify look at the sets on the host: the one download this path adds; rows of
             * topk_k entries (a wider stride's -1 tail dropped) */
            int64_t ld = b->topk_w[l], kk = b->topk_k[l];
            int32_t *h = ds_malloc(sizeof(int32_t) * (size_t)(T * ld) + 4);
            OPS->download(m->be, h, b->topk[l], sizeof(int32_t) * (size_t)(T * ld));
            for (int64_t t = 0; t < T && kk < ld; t++) memmove(h + t * kk, h + t * ld, sizeof(int32_t) * (size_t)kk);
            hooks->topk(hooks->ctx, l, h, T, kk);
            free(h);
        }
    }
    struct attn_out_plan p;
    if (attention_out_prepare(m, l, b, q, out, &p)) return -1;
    const bool issue = model_graph_begin(m, b, &p.k);
    if (issue) attention_out_ops(m, l, b, &p); /* the attention, the window ring's update, wo_a */
    attention_out_rest(m, l, b, &p, issue);
    return 0;
}
