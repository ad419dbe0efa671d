/* Synthetic checkpoints without files (see synth.h): the tensor inventory of a config, shared with
 * mkmodel (which moved it here), and an in-memory st_model over shared random pools, for
 * benchmarks that must bind the real geometry through the real weights_bind without a 510 GB
 * folder. */
#include "synth.h"

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engram_hash.h"
#include "formats.h"
#include "log.h"

/* ------------------------------------------------------------------------------------------------
 * Inventory: every tensor of the checkpoint with the rule mkmodel generates its data by */

static uint64_t fnv1a(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

static struct synth_tensor *inv_add(struct synth_inventory *inv, const char *name, enum st_dtype dt, int64_t d0,
                                    int64_t d1, enum synth_gen kind, float mean, float std) {
    if (inv->n == inv->cap) {
        inv->cap = inv->cap ? 2 * inv->cap : 1024;
        inv->t = ds_realloc(inv->t, (size_t)inv->cap * sizeof *inv->t);
    }
    struct synth_tensor *t = &inv->t[inv->n++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->dt = dt;
    t->ndim = d1 > 0 ? 2 : 1;
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->kind = kind;
    t->mean = mean;
    t->std = std;
    t->key = fnv1a(name);
    t->partner = -1;
    t->nbytes = st_dtype_size(dt) * (size_t)d0 * (size_t)(d1 > 0 ? d1 : 1);
    inv->total += t->nbytes;
    return t;
}

static void add_f32(struct synth_inventory *inv, const char *name, int64_t d0, int64_t d1, float mean, float std) {
    inv_add(inv, name, ST_F32, d0, d1, SYNTH_F32, mean, std);
}

static void add_bf16(struct synth_inventory *inv, const char *name, int64_t d0, int64_t d1, float mean, float std) {
    inv_add(inv, name, ST_BF16, d0, d1, SYNTH_BF16, mean, std);
}

/* RMSNorm weights: 1 plus small noise, so a wrong norm is visible but nothing is rescaled much. */
static void add_norm(struct synth_inventory *inv, const char *name, int64_t d) {
    add_bf16(inv, name, d, 0, 1.0f, 0.1f);
}

/* A quantized matrix [n, k] as `prefix.weight` + `prefix.scale`; both draw from the stream of
 * `prefix`, since the scale is a by-product of quantizing the same numbers. */
static void add_pair(struct synth_inventory *inv, const char *prefix, enum synth_gen wk, enum st_dtype wdt,
                     int64_t w0, int64_t w1, int64_t s0, int64_t s1, int64_t n, int64_t k, float std) {
    char nw[160], ns[160];
    snprintf(nw, sizeof nw, "%s.weight", prefix);
    snprintf(ns, sizeof ns, "%s.scale", prefix);
    uint64_t key = fnv1a(prefix);
    struct synth_tensor *w = inv_add(inv, nw, wdt, w0, w1, wk, 0.0f, std);
    w->n = n, w->k = k, w->key = key, w->partner = inv->n;
    struct synth_tensor *s = inv_add(inv, ns, ST_F8_E8M0, s0, s1, (enum synth_gen)(wk + 1), 0.0f, std);
    s->n = n, s->k = k, s->key = key, s->partner = inv->n - 2;
}

static void add_fp8(struct synth_inventory *inv, const char *prefix, int64_t n, int64_t k) {
    add_pair(inv, prefix, SYNTH_FP8_W, ST_F8_E4M3, n, k, cdiv(n, 32), cdiv(k, 32), n, k, 1.0f / sqrtf((float)k));
}

static void add_fp4(struct synth_inventory *inv, const char *prefix, int64_t n, int64_t k) {
    add_pair(inv, prefix, SYNTH_FP4_W, ST_I8, n, k / 2, n, k / 32, n, k, 1.0f / sqrtf((float)k));
}

/* Engram rows are looked up, not multiplied: unit variance like an embedding. */
static void add_rows(struct synth_inventory *inv, const char *prefix, int64_t rows, int64_t hd) {
    add_pair(inv, prefix, SYNTH_ROWS_W, ST_F8_E4M3, rows, hd, rows, hd / 32, rows, hd, 1.0f);
}

/* One block (backbone layer or DSpark block), mirroring weights.c's expectations. */
static void add_block(struct synth_inventory *inv, const struct model_config *c, int l) {
    const struct layer_role *r = &c->role[l];
    char p[64], n[160];
    config_layer_prefix(c, l, p, sizeof p);
    int64_t D = c->dim, hd = c->head_dim, H = c->n_heads, G = c->o_groups, R = c->o_lora_rank, q = c->q_lora_rank;
    int64_t hc = c->hc_mult, mix = (2 + hc) * hc, I = c->moe_inter_dim, E = r->n_experts;
#define N(...) (snprintf(n, sizeof n, __VA_ARGS__), n)
    add_fp8(inv, N("%s.attn.wq_a", p), q, D);
    add_norm(inv, N("%s.attn.q_norm.weight", p), q);
    add_fp8(inv, N("%s.attn.wq_b", p), H * hd, q);
    add_fp8(inv, N("%s.attn.wkv", p), hd, D);
    add_norm(inv, N("%s.attn.kv_norm.weight", p), hd);
    add_fp8(inv, N("%s.attn.wo_a", p), G * R, H * hd / G);
    add_fp8(inv, N("%s.attn.wo_b", p), D, G * R);
    add_f32(inv, N("%s.attn.attn_sink", p), H, 0, 0.0f, 1.0f);
    if (r->owns_compressor) {
        add_bf16(inv, N("%s.attn.compressor.wkv.weight", p), hd, D, 0.0f, 1.0f / sqrtf((float)D));
        if (r->ratio > 1) add_bf16(inv, N("%s.attn.compressor.wgate.weight", p), hd, D, 0.0f, 1.0f / sqrtf((float)D));
        add_norm(inv, N("%s.attn.compressor.norm.weight", p), hd);
    }
    if (r->is_index_source) {
        int64_t ih = c->index_n_heads, id = c->index_head_dim;
        add_fp8(inv, N("%s.attn.indexer.wq_b", p), ih * id, q);
        add_bf16(inv, N("%s.attn.indexer.weights_proj.weight", p), ih, D, 0.0f, 1.0f / sqrtf((float)D));
        if (r->owns_index_keys) {
            add_bf16(inv, N("%s.attn.indexer.wk.weight", p), id, hd, 0.0f, 1.0f / sqrtf((float)hd));
            add_norm(inv, N("%s.attn.indexer.k_norm.weight", p), id);
        }
    }
    add_bf16(inv, N("%s.ffn.gate.weight", p), E, D, 0.0f, 1.0f / sqrtf((float)D));
    add_f32(inv, N("%s.ffn.gate.bias", p), E, 0, 0.0f, 0.1f);
    /* Different numbers than gate.bias, so routing text with the image bias shows up. */
    add_f32(inv, N("%s.ffn.gate.bias_vl", p), E, 0, 0.0f, 0.5f);
    for (int64_t e = 0; e < E; e++) {
        add_fp4(inv, N("%s.ffn.experts.%lld.w1", p, (long long)e), I, D);
        add_fp4(inv, N("%s.ffn.experts.%lld.w3", p, (long long)e), I, D);
        add_fp4(inv, N("%s.ffn.experts.%lld.w2", p, (long long)e), D, I);
    }
    add_fp8(inv, N("%s.ffn.shared_experts.w1", p), I, D);
    add_fp8(inv, N("%s.ffn.shared_experts.w3", p), I, D);
    add_fp8(inv, N("%s.ffn.shared_experts.w2", p), D, I);
    add_norm(inv, N("%s.attn_norm.weight", p), D);
    add_norm(inv, N("%s.ffn_norm.weight", p), D);
    /* mHC: fn scaled so the mix logits are O(1) for a unit-RMS stream, as in the golden models. */
    float fn_std = 1.0f / sqrtf((float)(hc * D));
    add_f32(inv, N("%s.hc_attn_fn", p), mix, hc * D, 0.0f, fn_std);
    add_f32(inv, N("%s.hc_ffn_fn", p), mix, hc * D, 0.0f, fn_std);
    add_f32(inv, N("%s.hc_attn_base", p), mix, 0, 0.0f, 0.5f);
    add_f32(inv, N("%s.hc_ffn_base", p), mix, 0, 0.0f, 0.5f);
    add_f32(inv, N("%s.hc_attn_scale", p), 3, 0, 0.0f, 0.5f);
    add_f32(inv, N("%s.hc_ffn_scale", p), 3, 0, 0.0f, 0.5f);
    if (r->engram_idx >= 0) {
        int64_t ehd = c->engram_head_dim, C = (int64_t)(c->engram_max_ngram - 1) * c->engram_n_heads;
        add_rows(inv, N("%s.engram.embed", p), c->engram_num_embeddings[r->engram_idx], ehd);
        add_fp8(inv, N("%s.engram.wkv", p), (hc + 1) * D, C * ehd);
        add_bf16(inv, N("%s.engram.q_weight", p), hc, D, 0.0f, 1.0f / sqrtf((float)D));
        add_bf16(inv, N("%s.engram.k_weight", p), hc, D, 0.0f, 1.0f / sqrtf((float)D));
    }
    if (r->is_dspark) {
        int m = l - c->n_layers;
        if (m == 0) {
            add_fp8(inv, N("%s.main_proj", p), D, D * c->n_dspark_targets);
            add_norm(inv, N("%s.main_norm.weight", p), D);
        }
        if (m == c->n_mtp - 1) {
            int64_t V = c->vocab_size, rk = c->dspark_markov_rank;
            add_norm(inv, N("%s.norm.weight", p), D);
            add_bf16(inv, N("%s.markov_head.embed.weight", p), V, rk, 0.0f, 1.0f / sqrtf((float)rk));
            add_bf16(inv, N("%s.markov_head.head.weight", p), V, rk, 0.0f, 1.0f / sqrtf((float)rk));
            add_bf16(inv, N("%s.confidence_head.proj.weight", p), 1, D + rk, 0.0f, 1.0f / sqrtf((float)(D + rk)));
        }
    }
#undef N
}

/* Natural order (embed, layers, DSpark, norm, head), so each shard holds whole neighbouring
 * layers; a quantized pair never straddles two shards. */
void synth_inventory_build(struct synth_inventory *inv, const struct model_config *c) {
    int64_t V = c->vocab_size, D = c->dim;
    add_bf16(inv, "embed.weight", V, D, 0.0f, 1.0f);
    for (int l = 0; l < config_total_layers(c); l++) add_block(inv, c, l);
    add_norm(inv, "norm.weight", D);
    add_bf16(inv, "head.weight", V, D, 0.0f, 1.0f / sqrtf((float)D));
}

void synth_inventory_free(struct synth_inventory *inv) {
    free(inv->t);
    memset(inv, 0, sizeof *inv);
}

/* ------------------------------------------------------------------------------------------------
 * In-memory checkpoint over shared pools */

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Irwin-Hall sum of four 16-bit uniforms scaled to unit variance: one hash per value and bounded
 * tails (±3.5σ), so no pool value is an outlier that could saturate a kernel. */
static float gauss(uint64_t r) {
    uint32_t s = (uint32_t)(r & 0xffff) + (uint32_t)((r >> 16) & 0xffff) + (uint32_t)((r >> 32) & 0xffff) +
                 (uint32_t)(r >> 48);
    return (((float)s + 2.0f) / 65536.0f - 2.0f) * 1.7320508f;
}

/* Slack after a pool's largest tensor: the range of per-tensor start offsets. */
#define POOL_SLACK ((size_t)1 << 20)
#define POOL_ALIGN 64

/* One element per hash (counter-based, so the parallel fill is the same for any thread count). */
static void fill_pool(enum st_dtype dt, void *p, size_t bytes, uint64_t seed) {
    uint64_t base = mix64(seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)(dt + 1)));
    switch (dt) {
    case ST_BF16: {
        bf16_t *v = p;
        int64_t n = (int64_t)(bytes / 2);
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) v[i] = bf16_from_f32(0.02f * gauss(mix64(base + (uint64_t)i)));
        break;
    }
    case ST_F32: {
        float *v = p;
        int64_t n = (int64_t)(bytes / 4);
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) v[i] = 0.01f * gauss(mix64(base + (uint64_t)i));
        break;
    }
    case ST_F8_E4M3: {
        uint8_t *v = p;
        int64_t n = (int64_t)bytes;
        /* codes of N(0, 1) values: never a NaN code (0x7f/0xff), and magnitudes like a quantized
         * weight's. Uniform bytes (values to ±448 in every block) stay finite but blow the residual
         * stream up to ~1e5 within four layers (measured); these keep it O(1-10) as in a real model */
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) v[i] = e4m3_from_f32(gauss(mix64(base + (uint64_t)i)));
        break;
    }
    case ST_F8_E8M0: {
        uint8_t *v = p;
        int64_t n = (int64_t)bytes;
        /* 2^-9 .. 2^-1: the range real block scales of ~unit weights fall in */
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) v[i] = (uint8_t)(0x76 + mix64(base + (uint64_t)i) % 9);
        break;
    }
    default: { /* I8 (packed e2m1: every byte is two valid values) and anything else: any byte */
        uint8_t *v = p;
        int64_t n = (int64_t)bytes;
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) v[i] = (uint8_t)mix64(base + (uint64_t)i);
        break;
    }
    }
}

int synth_st_model(struct st_model *st, const struct synth_inventory *inv, struct synth_pools *pools,
                   uint64_t seed, const char *label) {
    memset(pools, 0, sizeof *pools);
    size_t biggest[ST_NDTYPES] = {0};
    for (int i = 0; i < inv->n; i++)
        if (inv->t[i].nbytes > biggest[inv->t[i].dt]) biggest[inv->t[i].dt] = inv->t[i].nbytes;
    for (int d = 0; d < ST_NDTYPES; d++) {
        if (!biggest[d]) continue;
        pools->size[d] = biggest[d] + POOL_SLACK;
        /* aligned like a device allocation, so vectorised loads behave as on a real checkpoint */
        if (posix_memalign(&pools->pool[d], 4096, pools->size[d])) {
            ds_err_set("%s: cannot allocate a %zu-byte %s pool", label, pools->size[d],
                       st_dtype_name((enum st_dtype)d));
            synth_pools_free(pools);
            return -1;
        }
        fill_pool((enum st_dtype)d, pools->pool[d], pools->size[d], seed);
    }
    struct st_tensor *ts = ds_calloc((size_t)(inv->n ? inv->n : 1), sizeof *ts);
    for (int i = 0; i < inv->n; i++) {
        const struct synth_tensor *t = &inv->t[i];
        struct st_tensor *o = &ts[i];
        o->name = ds_strdup(t->name);
        o->dtype = t->dt;
        o->ndim = t->ndim;
        for (int j = 0; j < t->ndim; j++) o->shape[j] = t->shape[j];
        o->nbytes = t->nbytes;
        size_t off = (size_t)(mix64(t->key ^ seed) % (POOL_SLACK / POOL_ALIGN)) * POOL_ALIGN;
        o->data = (const uint8_t *)pools->pool[t->dt] + off;
    }
    if (st_model_from_tensors(st, label, ts, inv->n)) {
        synth_pools_free(pools);
        return -1;
    }
    return 0;
}

void synth_pools_free(struct synth_pools *pools) {
    for (int d = 0; d < ST_NDTYPES; d++) free(pools->pool[d]);
    memset(pools, 0, sizeof *pools);
}

/* ------------------------------------------------------------------------------------------------
 * Engram table size */

int synth_shrink_engram(struct model_config *cfg, int64_t vocab_start) {
    if (cfg->n_engram == 0) return 0;
    cfg->engram_vocab_size = vocab_start;
    /* engram_consts_init reports the prime sum of the first table that disagrees; each pass fixes
     * one more table, as mkmodel settles them */
    struct engram_consts *ec = ds_calloc(1, sizeof *ec);
    int rc = -1;
    for (int pass = 0; pass <= cfg->n_engram; pass++) {
        if (engram_consts_init(ec, cfg) == 0) {
            rc = 0;
            break;
        }
        bool changed = false;
        for (int li = 0; li < cfg->n_engram; li++)
            if (ec->table_rows[li] > 0 && ec->table_rows[li] != cfg->engram_num_embeddings[li]) {
                cfg->engram_num_embeddings[li] = ec->table_rows[li];
                changed = true;
            }
        engram_consts_free(ec);
        if (!changed) break;
    }
    engram_consts_free(ec);
    free(ec);
    return rc;
}
