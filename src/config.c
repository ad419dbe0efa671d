/* Model configuration (MODEL.md §1): one parser for both spellings of the same model, the release's
 * HF config.json (shape keys under `text_config`, quantization under `quantization_config`) and the
 * reference's flat inference/config.json (ModelArgs field names). Every field is described once in
 * a table that lists its accepted key names (HF name first), its type, its default and when it is
 * required; parsing, error messages and the HF re-serialisation are all driven from that table, so
 * an alias or default cannot be accepted on one path and forgotten on another. After parsing, the
 * per-layer role table (§1.3) is derived from the id lists and checked for consistency: that table
 * is what the rest of the engine dispatches on, so a config that would make it ambiguous is
 * rejected here, with the file and key named, rather than surfacing as wrong attention later. */
#include "config.h"

#include <cJSON.h>
#include <limits.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

/* ------------------------------------------------------------------------------------------------
 * Field table */

enum fkind {
    FK_INT,    /* int */
    FK_I64,    /* int64_t */
    FK_DBL,    /* double */
    FK_BOOL,   /* bool */
    FK_LIST,   /* int list of at most CFG_MAX_LIST, count at count_off */
    FK_LIST64, /* engram_num_embeddings: int64 list whose length must match engram_layer_ids */
    FK_RATIOS, /* compress_ratios: int list of at most CFG_MAX_LAYERS */
    FK_SCORE,  /* scoring function name */
};

/* When a key without a usable default must be present. */
enum freq {
    RQ_NO,       /* default applies */
    RQ_ALWAYS,   /* every model needs it */
    RQ_COMPRESS, /* some compress ratio is nonzero: compressed KV and indexer exist */
    RQ_ENGRAM,   /* engram_layer_ids is non-empty */
    RQ_CAND,     /* candidate_source_layer_id >= 0 */
};

struct field {
    /* Accepted names, HF name first, then the flat ModelArgs spelling. "a.b" reaches into the
     * sub-object a (rope_scaling), so the HF nesting and the flat name are just two aliases. */
    const char *names[3];
    enum fkind kind;
    size_t off;       /* the value, or the list's array */
    size_t count_off; /* FK_LIST / FK_RATIOS: the element count */
    enum freq req;
    double def;  /* default when absent and not required (the reference ModelArgs value) */
    bool id_key; /* token id: HF puts these at the top level, beside text_config */
};

#define OFF(m) offsetof(struct model_config, m)
#define SCALAR(n0, n1, k, m, r, d) {{n0, n1, NULL}, k, OFF(m), 0, r, d, false}
#define LIST(n0, n1, m, cnt, r) {{n0, n1, NULL}, FK_LIST, OFF(m), OFF(cnt), r, 0, false}
#define TOKEN(n0, m, d) {{n0, NULL, NULL}, FK_INT, OFF(m), 0, RQ_NO, d, true}

/* Defaults follow the reference ModelArgs where it has the field; the shape fields it defaults to
 * a toy model are required instead, since a silently toy-sized hidden_size is worse than an error. */
static const struct field FIELDS[] = {
    /* shape */
    SCALAR("vocab_size", NULL, FK_INT, vocab_size, RQ_ALWAYS, 0),
    SCALAR("hidden_size", "dim", FK_INT, dim, RQ_ALWAYS, 0),
    SCALAR("num_hidden_layers", "n_layers", FK_INT, n_layers, RQ_ALWAYS, 0),
    SCALAR("num_attention_heads", "n_heads", FK_INT, n_heads, RQ_ALWAYS, 0),
    SCALAR("num_key_value_heads", NULL, FK_INT, n_kv_heads, RQ_NO, 1),
    SCALAR("head_dim", NULL, FK_INT, head_dim, RQ_ALWAYS, 0),
    SCALAR("qk_rope_head_dim", "rope_head_dim", FK_INT, rope_dim, RQ_ALWAYS, 0),
    SCALAR("q_lora_rank", NULL, FK_INT, q_lora_rank, RQ_ALWAYS, 0),
    SCALAR("o_lora_rank", NULL, FK_INT, o_lora_rank, RQ_ALWAYS, 0),
    SCALAR("o_groups", NULL, FK_INT, o_groups, RQ_ALWAYS, 0),
    SCALAR("rms_norm_eps", "norm_eps", FK_DBL, norm_eps, RQ_NO, 1e-20),
    SCALAR("max_position_embeddings", "max_seq_len", FK_I64, max_pos, RQ_NO, 4096),
    /* rope */
    SCALAR("rope_theta", NULL, FK_DBL, rope_theta, RQ_NO, 10000),
    SCALAR("compress_rope_theta", NULL, FK_DBL, compress_rope_theta, RQ_NO, 40000),
    SCALAR("rope_scaling.factor", "rope_factor", FK_DBL, rope_factor, RQ_NO, 40),
    SCALAR("rope_scaling.beta_fast", "beta_fast", FK_DBL, beta_fast, RQ_NO, 32),
    SCALAR("rope_scaling.beta_slow", "beta_slow", FK_DBL, beta_slow, RQ_NO, 1),
    SCALAR("rope_scaling.original_max_position_embeddings", "original_seq_len", FK_I64, original_seq_len,
           RQ_NO, 0),
    /* moe */
    SCALAR("n_routed_experts", NULL, FK_INT, n_routed_experts, RQ_ALWAYS, 0),
    SCALAR("num_experts_per_tok", "n_activated_experts", FK_INT, n_active_experts, RQ_ALWAYS, 0),
    SCALAR("moe_intermediate_size", "moe_inter_dim", FK_INT, moe_inter_dim, RQ_ALWAYS, 0),
    SCALAR("n_shared_experts", NULL, FK_INT, n_shared_experts, RQ_NO, 1),
    {{"scoring_func", "score_func", NULL}, FK_SCORE, OFF(score_func), 0, RQ_NO, 0, false},
    SCALAR("routed_scaling_factor", "route_scale", FK_DBL, route_scale, RQ_NO, 1),
    SCALAR("swiglu_limit", NULL, FK_DBL, swiglu_limit, RQ_NO, 0),
    SCALAR("gate_temp", NULL, FK_DBL, gate_temp, RQ_NO, 1),
    SCALAR("norm_topk_prob", NULL, FK_BOOL, norm_topk_prob, RQ_NO, 1),
    /* attention schedule */
    SCALAR("sliding_window", "window_size", FK_INT, window, RQ_ALWAYS, 0),
    {{"compress_ratios", NULL, NULL}, FK_RATIOS, OFF(compress_ratios), OFF(n_compress_ratios), RQ_ALWAYS, 0,
     false},
    LIST("kv_source_layer_ids", "kv_source_layers", kv_sources, n_kv_sources, RQ_COMPRESS),
    LIST("index_source_layer_ids", "index_source_layers", index_sources, n_index_sources, RQ_COMPRESS),
    SCALAR("candidate_source_layer_id", "candidate_source_layer", FK_INT, candidate_source, RQ_NO, -1),
    SCALAR("candidate_topk_blocks", NULL, FK_INT, candidate_topk_blocks, RQ_CAND, 0),
    SCALAR("candidate_block_size", NULL, FK_INT, candidate_block_size, RQ_CAND, 0),
    SCALAR("index_n_heads", NULL, FK_INT, index_n_heads, RQ_COMPRESS, 0),
    SCALAR("index_head_dim", NULL, FK_INT, index_head_dim, RQ_COMPRESS, 0),
    SCALAR("index_topk", NULL, FK_INT, index_topk, RQ_COMPRESS, 0),
    /* mHC */
    SCALAR("hc_mult", NULL, FK_INT, hc_mult, RQ_ALWAYS, 0),
    SCALAR("hc_sinkhorn_iters", NULL, FK_INT, hc_sinkhorn_iters, RQ_NO, 20),
    SCALAR("hc_eps", NULL, FK_DBL, hc_eps, RQ_NO, 1e-6),
    /* engram */
    LIST("engram_layer_ids", NULL, engram_layer_ids, n_engram, RQ_NO),
    {{"engram_num_embeddings", NULL, NULL}, FK_LIST64, OFF(engram_num_embeddings), 0, RQ_ENGRAM, 0, false},
    SCALAR("engram_max_ngram_size", NULL, FK_INT, engram_max_ngram, RQ_ENGRAM, 1),
    SCALAR("engram_n_heads", NULL, FK_INT, engram_n_heads, RQ_ENGRAM, 0),
    SCALAR("engram_head_dim", NULL, FK_INT, engram_head_dim, RQ_ENGRAM, 0),
    SCALAR("engram_vocab_size", NULL, FK_I64, engram_vocab_size, RQ_ENGRAM, 0),
    SCALAR("engram_compressed_vocab_size", NULL, FK_I64, engram_compressed_vocab, RQ_ENGRAM, 0),
    SCALAR("engram_pad_token_id", "engram_pad_id", FK_INT, engram_pad_id, RQ_NO, 2),
    /* DSpark */
    SCALAR("num_nextn_predict_layers", "n_mtp_layers", FK_INT, n_mtp, RQ_NO, 0),
    SCALAR("dspark_block_size", NULL, FK_INT, dspark_block_size, RQ_NO, 0),
    SCALAR("dspark_noise_token_id", NULL, FK_INT, dspark_noise_id, RQ_NO, 0),
    LIST("dspark_target_layer_ids", NULL, dspark_targets, n_dspark_targets, RQ_NO),
    SCALAR("dspark_markov_rank", NULL, FK_INT, dspark_markov_rank, RQ_NO, 256),
    SCALAR("dspark_n_routed_experts", NULL, FK_INT, dspark_n_routed, RQ_NO, 0),
    SCALAR("dspark_num_experts_per_tok", "dspark_n_activated_experts", FK_INT, dspark_n_active, RQ_NO, 0),
    /* token ids */
    TOKEN("bos_token_id", bos_id, 0),
    TOKEN("eos_token_id", eos_id, 1),
    TOKEN("pad_token_id", pad_id, 2),
    TOKEN("image_token_id", image_token_id, 129264),
};
#define N_FIELDS ((int)(sizeof FIELDS / sizeof FIELDS[0]))

static const char *const SCORE_NAMES[] = {"sqrtsoftplus", "softmax", "sigmoid"};

/* ------------------------------------------------------------------------------------------------
 * Small helpers */

static const char *src_name(const struct model_config *cfg) { return cfg->source[0] ? cfg->source : "config"; }

/* Record "<file>: <key>: <what>" and return -1, so every error path is a one-liner. */
static int __attribute__((format(printf, 3, 4))) fail(const struct model_config *cfg, const char *key,
                                                      const char *fmt, ...) {
    char what[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    ds_err_set("%s: %s: %s", src_name(cfg), key, what);
    return -1;
}

static const char *json_kind(const cJSON *it) {
    if (cJSON_IsString(it)) return "a string";
    if (cJSON_IsBool(it)) return "a boolean";
    if (cJSON_IsArray(it)) return "an array";
    if (cJSON_IsObject(it)) return "an object";
    if (cJSON_IsNull(it)) return "null";
    if (cJSON_IsNumber(it)) return "a number";
    return "an invalid value";
}

static const cJSON *text_scope(const cJSON *root) {
    const cJSON *tc = cJSON_GetObjectItemCaseSensitive(root, "text_config");
    return cJSON_IsObject(tc) ? tc : root;
}

static bool is_nested(const cJSON *root) { return cJSON_IsObject(cJSON_GetObjectItemCaseSensitive(root, "text_config")); }

/* Resolve "key" or "obj.key"; JSON null counts as absent, as HF writes null for "not set". */
static const cJSON *path_get(const cJSON *obj, const char *path) {
    const char *dot = strchr(path, '.');
    if (!dot) {
        const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, path);
        return cJSON_IsNull(it) ? NULL : it;
    }
    char head[64];
    size_t n = (size_t)(dot - path);
    if (n >= sizeof head) return NULL;
    memcpy(head, path, n);
    head[n] = '\0';
    const cJSON *sub = cJSON_GetObjectItemCaseSensitive(obj, head);
    return cJSON_IsObject(sub) ? path_get(sub, dot + 1) : NULL;
}

static const struct field *field_by_name(const char *canon) {
    for (int i = 0; i < N_FIELDS; i++)
        if (!strcmp(FIELDS[i].names[0], canon)) return &FIELDS[i];
    return NULL;
}

/* The spelling to use for a field in a message: the one the file actually used, else the one
 * native to the file's form, so a flat-form user is told about "dim", not "hidden_size". */
static const char *key_name(const struct model_config *cfg, const char *canon) {
    const struct field *f = field_by_name(canon);
    if (!f) return canon;
    if (!cfg->json) return f->names[0];
    const cJSON *scope = text_scope(cfg->json);
    for (int k = 0; k < 3 && f->names[k]; k++)
        if (path_get(scope, f->names[k])) return f->names[k];
    if (!is_nested(cfg->json) && f->names[1]) return f->names[1];
    return f->names[0];
}

static int list_find(const int *a, int n, int v) {
    for (int i = 0; i < n; i++)
        if (a[i] == v) return i;
    return -1;
}

/* ------------------------------------------------------------------------------------------------
 * Typed reads. Each names the key it was given and what it found, since "bad type" alone does not
 * tell the user which of ~60 keys to fix. */

static int read_i64(const struct model_config *cfg, const char *key, const cJSON *it, int64_t lo, int64_t hi,
                    int64_t *out) {
    if (!cJSON_IsNumber(it)) return fail(cfg, key, "expected an integer, got %s", json_kind(it));
    double v = it->valuedouble;
    /* Range first: converting an out-of-range double to int64 is undefined. */
    if (!(v >= (double)lo && v <= (double)hi))
        return fail(cfg, key, "%.17g is out of range [%lld, %lld]", v, (long long)lo, (long long)hi);
    if ((double)(int64_t)v != v) return fail(cfg, key, "expected an integer, got %.17g", v);
    *out = (int64_t)v;
    return 0;
}

static int read_int(const struct model_config *cfg, const char *key, const cJSON *it, int *out) {
    int64_t v;
    if (read_i64(cfg, key, it, INT_MIN, INT_MAX, &v)) return -1;
    *out = (int)v;
    return 0;
}

static int read_int_array(const struct model_config *cfg, const char *key, const cJSON *it, int max, int *out,
                          int *count) {
    if (!cJSON_IsArray(it)) return fail(cfg, key, "expected an array of integers, got %s", json_kind(it));
    int n = cJSON_GetArraySize(it);
    if (n > max) return fail(cfg, key, "%d entries, at most %d supported", n, max);
    int i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, it) {
        char sub[160];
        snprintf(sub, sizeof sub, "%s[%d]", key, i);
        if (read_int(cfg, sub, e, &out[i])) return -1;
        i++;
    }
    *count = n;
    return 0;
}

/* Find the field's value among its aliases. Two aliases giving different values is an error: the
 * reader of the file could not tell which one wins. */
static int field_lookup(const struct model_config *cfg, const struct field *f, const cJSON **out,
                        const char **used) {
    const cJSON *scope = text_scope(cfg->json);
    *out = NULL;
    *used = f->names[0];
    for (int k = 0; k < 3 && f->names[k]; k++) {
        const cJSON *it = path_get(scope, f->names[k]);
        if (!it) continue;
        if (!*out) {
            *out = it;
            *used = f->names[k];
        } else if (!cJSON_Compare(*out, it, true)) {
            return fail(cfg, f->names[k], "conflicts with %s", *used);
        }
    }
    /* HF keeps the special token ids at the top level; text_config copies win when both exist. */
    if (!*out && f->id_key && scope != cfg->json) *out = path_get(cfg->json, f->names[0]);
    return 0;
}

static int parse_field(struct model_config *cfg, const struct field *f, const cJSON *it, const char *key,
                       int *n_emb) {
    char *base = (char *)cfg;
    switch (f->kind) {
    case FK_INT: {
        int *p = (int *)(base + f->off);
        *p = (int)f->def;
        return it ? read_int(cfg, key, it, p) : 0;
    }
    case FK_I64: {
        int64_t *p = (int64_t *)(base + f->off);
        *p = (int64_t)f->def;
        return it ? read_i64(cfg, key, it, INT64_MIN / 2, INT64_MAX / 2, p) : 0;
    }
    case FK_DBL: {
        double *p = (double *)(base + f->off);
        *p = f->def;
        if (!it) return 0;
        if (!cJSON_IsNumber(it)) return fail(cfg, key, "expected a number, got %s", json_kind(it));
        *p = it->valuedouble;
        return 0;
    }
    case FK_BOOL: {
        bool *p = (bool *)(base + f->off);
        *p = f->def != 0;
        if (!it) return 0;
        if (!cJSON_IsBool(it)) return fail(cfg, key, "expected true or false, got %s", json_kind(it));
        *p = cJSON_IsTrue(it);
        return 0;
    }
    case FK_LIST:
    case FK_RATIOS: {
        int *count = (int *)(base + f->count_off);
        *count = 0;
        if (!it) return 0;
        int max = f->kind == FK_RATIOS ? CFG_MAX_LAYERS : CFG_MAX_LIST;
        return read_int_array(cfg, key, it, max, (int *)(base + f->off), count);
    }
    case FK_LIST64: {
        int64_t *arr = (int64_t *)(base + f->off);
        *n_emb = 0;
        if (!it) return 0;
        if (!cJSON_IsArray(it)) return fail(cfg, key, "expected an array of integers, got %s", json_kind(it));
        int n = cJSON_GetArraySize(it);
        if (n > CFG_MAX_LIST) return fail(cfg, key, "%d entries, at most %d supported", n, CFG_MAX_LIST);
        int i = 0;
        const cJSON *e;
        cJSON_ArrayForEach(e, it) {
            char sub[160];
            snprintf(sub, sizeof sub, "%s[%d]", key, i);
            if (read_i64(cfg, sub, e, 1, INT64_MAX / 2, &arr[i])) return -1;
            i++;
        }
        *n_emb = n;
        return 0;
    }
    case FK_SCORE: {
        cfg->score_func = CFG_SCORE_SQRTSOFTPLUS;
        if (!it) return 0;
        if (!cJSON_IsString(it)) return fail(cfg, key, "expected a string, got %s", json_kind(it));
        for (int s = 0; s < (int)(sizeof SCORE_NAMES / sizeof SCORE_NAMES[0]); s++)
            if (!strcmp(it->valuestring, SCORE_NAMES[s])) {
                cfg->score_func = (enum cfg_score_func)s;
                return 0;
            }
        return fail(cfg, key, "\"%s\" is not one of sqrtsoftplus, softmax, sigmoid", it->valuestring);
    }
    }
    return 0;
}

/* Weight storage. HF: quantization_config (quant_method fp8 -> fp8 dense weights, expert_dtype fp4
 * -> fp4 experts, weight_block_size the scale tile); its absence means an unquantized bf16 model.
 * Flat: dtype fp8|bf16 and expert_dtype fp4|null, defaulting to fp8/fp4 as ModelArgs does; the
 * reference hard-codes 32x32 scale tiles there. */
static int parse_quant(struct model_config *cfg) {
    const cJSON *root = cfg->json;
    cfg->weight_block = 32;
    if (!is_nested(root)) {
        const cJSON *dt = path_get(root, "dtype"), *et = path_get(root, "expert_dtype");
        cfg->dense_fp8 = true;
        if (dt) {
            if (!cJSON_IsString(dt)) return fail(cfg, "dtype", "expected \"fp8\" or \"bf16\", got %s", json_kind(dt));
            if (!strcmp(dt->valuestring, "fp8"))
                cfg->dense_fp8 = true;
            else if (!strcmp(dt->valuestring, "bf16"))
                cfg->dense_fp8 = false;
            else
                return fail(cfg, "dtype", "\"%s\" is not fp8 or bf16", dt->valuestring);
        }
        /* An explicit null means "experts in the dense dtype"; absent keeps the ModelArgs fp4. */
        const cJSON *et_raw = cJSON_GetObjectItemCaseSensitive(root, "expert_dtype");
        cfg->expert_fp4 = et_raw == NULL;
        if (et) {
            if (!cJSON_IsString(et)) return fail(cfg, "expert_dtype", "expected \"fp4\" or null, got %s", json_kind(et));
            if (strcmp(et->valuestring, "fp4")) return fail(cfg, "expert_dtype", "\"%s\" is not fp4", et->valuestring);
            cfg->expert_fp4 = true;
        }
        return 0;
    }
    cfg->dense_fp8 = cfg->expert_fp4 = false;
    const cJSON *qc = path_get(root, "quantization_config");
    if (!qc) return 0;
    if (!cJSON_IsObject(qc)) return fail(cfg, "quantization_config", "expected an object, got %s", json_kind(qc));
    const cJSON *qm = path_get(qc, "quant_method"), *et = path_get(qc, "expert_dtype"),
                *wb = path_get(qc, "weight_block_size");
    if (qm) {
        if (!cJSON_IsString(qm))
            return fail(cfg, "quantization_config.quant_method", "expected a string, got %s", json_kind(qm));
        if (strcmp(qm->valuestring, "fp8"))
            return fail(cfg, "quantization_config.quant_method", "\"%s\" is not supported (only fp8)",
                        qm->valuestring);
        cfg->dense_fp8 = true;
    }
    if (et) {
        if (!cJSON_IsString(et))
            return fail(cfg, "quantization_config.expert_dtype", "expected a string, got %s", json_kind(et));
        if (strcmp(et->valuestring, "fp4"))
            return fail(cfg, "quantization_config.expert_dtype", "\"%s\" is not supported (only fp4)",
                        et->valuestring);
        cfg->expert_fp4 = true;
    }
    if (wb) {
        int b[2], n = 0;
        if (!cJSON_IsArray(wb) || cJSON_GetArraySize(wb) != 2)
            return fail(cfg, "quantization_config.weight_block_size", "expected [N, N], got %s", json_kind(wb));
        if (read_int_array(cfg, "quantization_config.weight_block_size", wb, 2, b, &n)) return -1;
        /* One scale per square tile is all the engine implements. */
        if (b[0] != b[1] || b[0] < 1)
            return fail(cfg, "quantization_config.weight_block_size", "[%d, %d] is not a square positive tile",
                        b[0], b[1]);
        cfg->weight_block = b[0];
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------
 * Scalar validation: shapes the kernels rely on, checked once here with the key named. */

#define NEED(cond, canon, ...)                                                                 \
    do {                                                                                       \
        if (!(cond)) return fail(cfg, key_name(cfg, canon), __VA_ARGS__);                      \
    } while (0)

static int validate_scalars(const struct model_config *cfg, bool compressed, int n_emb) {
    const struct model_config *c = cfg;
    NEED(c->vocab_size > 0, "vocab_size", "%d (must be > 0)", c->vocab_size);
    NEED(c->dim > 0, "hidden_size", "%d (must be > 0)", c->dim);
    NEED(c->n_layers > 0, "num_hidden_layers", "%d (must be > 0)", c->n_layers);
    NEED(c->n_mtp >= 0, "num_nextn_predict_layers", "%d (must be >= 0)", c->n_mtp);
    NEED(c->n_layers <= CFG_MAX_LAYERS - c->n_mtp, "num_hidden_layers",
         "%d backbone + %d DSpark layers exceed the supported %d", c->n_layers, c->n_mtp, CFG_MAX_LAYERS);
    NEED(c->n_heads > 0, "num_attention_heads", "%d (must be > 0)", c->n_heads);
    /* MQA: one shared K=V latent per token is what the caches and kernels store (§1.2). */
    NEED(c->n_kv_heads == 1, "num_key_value_heads", "%d (only 1 is supported: one shared K=V latent)",
         c->n_kv_heads);
    NEED(c->rope_dim > 0 && c->rope_dim % 2 == 0, "qk_rope_head_dim", "%d (must be even and > 0)", c->rope_dim);
    NEED(c->head_dim > c->rope_dim, "head_dim", "%d must exceed qk_rope_head_dim %d (RoPE is the tail)",
         c->head_dim, c->rope_dim);
    NEED(c->q_lora_rank > 0, "q_lora_rank", "%d (must be > 0)", c->q_lora_rank);
    NEED(c->o_lora_rank > 0, "o_lora_rank", "%d (must be > 0)", c->o_lora_rank);
    NEED(c->o_groups > 0, "o_groups", "%d (must be > 0)", c->o_groups);
    NEED(c->n_heads % c->o_groups == 0, "o_groups", "%d does not divide num_attention_heads %d", c->o_groups,
         c->n_heads);
    NEED(c->norm_eps >= 0, "rms_norm_eps", "%g (must be >= 0)", c->norm_eps);
    NEED(c->max_pos > 0, "max_position_embeddings", "%lld (must be > 0)", (long long)c->max_pos);
    NEED(c->rope_theta > 0, "rope_theta", "%g (must be > 0)", c->rope_theta);
    NEED(c->compress_rope_theta > 0, "compress_rope_theta", "%g (must be > 0)", c->compress_rope_theta);
    NEED(c->original_seq_len >= 0, "rope_scaling.original_max_position_embeddings", "%lld (must be >= 0)",
         (long long)c->original_seq_len);
    if (c->original_seq_len > 0) {
        NEED(c->rope_factor > 0, "rope_scaling.factor", "%g (must be > 0)", c->rope_factor);
        NEED(c->beta_fast > c->beta_slow, "rope_scaling.beta_fast", "%g must exceed beta_slow %g", c->beta_fast,
             c->beta_slow);
    }
    NEED(c->n_routed_experts > 0, "n_routed_experts", "%d (must be > 0)", c->n_routed_experts);
    NEED(c->n_active_experts > 0 && c->n_active_experts <= c->n_routed_experts, "num_experts_per_tok",
         "%d (must be in [1, n_routed_experts %d])", c->n_active_experts, c->n_routed_experts);
    NEED(c->moe_inter_dim > 0, "moe_intermediate_size", "%d (must be > 0)", c->moe_inter_dim);
    NEED(c->n_shared_experts >= 0, "n_shared_experts", "%d (must be >= 0)", c->n_shared_experts);
    NEED(c->route_scale > 0, "routed_scaling_factor", "%g (must be > 0)", c->route_scale);
    NEED(c->swiglu_limit >= 0, "swiglu_limit", "%g (must be >= 0; 0 = no clamp)", c->swiglu_limit);
    NEED(c->gate_temp > 0, "gate_temp", "%g (must be > 0)", c->gate_temp);
    NEED(c->window > 0, "sliding_window", "%d (must be > 0)", c->window);
    if (compressed) {
        NEED(c->index_n_heads > 0, "index_n_heads", "%d (must be > 0)", c->index_n_heads);
        NEED(c->index_head_dim > c->rope_dim, "index_head_dim",
             "%d must exceed qk_rope_head_dim %d (its RoPE dims are the tail)", c->index_head_dim, c->rope_dim);
        NEED(c->index_topk > 0, "index_topk", "%d (must be > 0)", c->index_topk);
    }
    if (c->candidate_source >= 0) {
        NEED(c->candidate_topk_blocks > 0, "candidate_topk_blocks", "%d (must be > 0)", c->candidate_topk_blocks);
        NEED(c->candidate_block_size > 0, "candidate_block_size", "%d (must be > 0)", c->candidate_block_size);
    }
    NEED(c->hc_mult > 0, "hc_mult", "%d (must be > 0)", c->hc_mult);
    NEED(c->hc_sinkhorn_iters > 0, "hc_sinkhorn_iters", "%d (must be > 0)", c->hc_sinkhorn_iters);
    NEED(c->hc_eps >= 0, "hc_eps", "%g (must be >= 0)", c->hc_eps);
    if (c->n_engram > 0) {
        NEED(n_emb == c->n_engram, "engram_num_embeddings", "%d entries for %d engram_layer_ids", n_emb,
             c->n_engram);
        /* n-grams run 2..max, so 1 would mean no hash columns at all. */
        NEED(c->engram_max_ngram >= 2, "engram_max_ngram_size", "%d (must be >= 2)", c->engram_max_ngram);
        NEED(c->engram_n_heads > 0, "engram_n_heads", "%d (must be > 0)", c->engram_n_heads);
        NEED(c->engram_head_dim > 0, "engram_head_dim", "%d (must be > 0)", c->engram_head_dim);
        NEED(c->engram_vocab_size > 0, "engram_vocab_size", "%lld (must be > 0)", (long long)c->engram_vocab_size);
        NEED(c->engram_compressed_vocab > 0, "engram_compressed_vocab_size", "%lld (must be > 0)",
             (long long)c->engram_compressed_vocab);
        NEED(c->engram_pad_id >= 0 && c->engram_pad_id < c->vocab_size, "engram_pad_token_id",
             "%d outside the vocabulary [0, %d)", c->engram_pad_id, c->vocab_size);
    }
    NEED(c->dspark_block_size >= 0, "dspark_block_size", "%d (must be >= 0)", c->dspark_block_size);
    NEED(c->dspark_noise_id >= 0 && c->dspark_noise_id < c->vocab_size, "dspark_noise_token_id",
         "%d outside the vocabulary [0, %d)", c->dspark_noise_id, c->vocab_size);
    NEED(c->dspark_markov_rank >= 0, "dspark_markov_rank", "%d (must be >= 0)", c->dspark_markov_rank);
    NEED(c->dspark_n_routed > 0, "dspark_n_routed_experts", "%d (must be > 0)", c->dspark_n_routed);
    NEED(c->dspark_n_active > 0 && c->dspark_n_active <= c->dspark_n_routed, "dspark_num_experts_per_tok",
         "%d (must be in [1, dspark_n_routed_experts %d])", c->dspark_n_active, c->dspark_n_routed);
    NEED(c->bos_id >= 0, "bos_token_id", "%d (must be >= 0)", c->bos_id);
    NEED(c->eos_id >= 0, "eos_token_id", "%d (must be >= 0)", c->eos_id);
    NEED(c->pad_id >= 0, "pad_token_id", "%d (must be >= 0)", c->pad_id);
    return 0;
}

/* ------------------------------------------------------------------------------------------------
 * Parse */

int config_parse(const char *json_text, const char *source_name, struct model_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    snprintf(cfg->source, sizeof cfg->source, "%s", source_name && source_name[0] ? source_name : "config");
    if (!json_text) return fail(cfg, "JSON", "no text");

    const char *end = NULL;
    cJSON *root = cJSON_ParseWithOpts(json_text, &end, true);
    if (!root) {
        /* Point at the line and column where cJSON gave up: config files are edited by hand. */
        const char *at = end ? end : json_text;
        int line = 1, col = 1;
        for (const char *p = json_text; p < at && *p; p++) {
            if (*p == '\n') {
                line++;
                col = 1;
            } else {
                col++;
            }
        }
        return fail(cfg, "JSON", "syntax error at line %d, column %d", line, col);
    }
    cfg->json = root;
    if (!cJSON_IsObject(root)) {
        fail(cfg, "JSON", "top level is %s, expected an object", json_kind(root));
        goto bad;
    }
    const cJSON *tc = cJSON_GetObjectItemCaseSensitive(root, "text_config");
    if (tc && !cJSON_IsObject(tc)) {
        fail(cfg, "text_config", "expected an object, got %s", json_kind(tc));
        goto bad;
    }
    const cJSON *rs = cJSON_GetObjectItemCaseSensitive(text_scope(root), "rope_scaling");
    if (rs && !cJSON_IsObject(rs) && !cJSON_IsNull(rs)) {
        fail(cfg, "rope_scaling", "expected an object, got %s", json_kind(rs));
        goto bad;
    }

    bool present[N_FIELDS];
    int n_emb = 0;
    for (int i = 0; i < N_FIELDS; i++) {
        const cJSON *it;
        const char *used;
        if (field_lookup(cfg, &FIELDS[i], &it, &used)) goto bad;
        present[i] = it != NULL;
        if (parse_field(cfg, &FIELDS[i], it, used, &n_emb)) goto bad;
    }
    if (parse_quant(cfg)) goto bad;

    /* Which conditional groups the model uses decides which keys must be present. Only the backbone
     * entries matter: DSpark entries must be 0, which derive_roles reports on its own. */
    bool compressed = false;
    for (int l = 0; l < cfg->n_compress_ratios && l < cfg->n_layers; l++)
        if (cfg->compress_ratios[l] > 0) compressed = true;
    for (int i = 0; i < N_FIELDS; i++) {
        const struct field *f = &FIELDS[i];
        const char *why = NULL;
        if (present[i]) continue;
        if (f->req == RQ_ALWAYS) why = "missing";
        if (f->req == RQ_COMPRESS && compressed) why = "missing (required when compress_ratios has a nonzero entry)";
        if (f->req == RQ_ENGRAM && cfg->n_engram > 0) why = "missing (required when engram_layer_ids is non-empty)";
        if (f->req == RQ_CAND && cfg->candidate_source >= 0)
            why = "missing (required when candidate_source_layer_id >= 0)";
        if (!why) continue;
        const char *name = key_name(cfg, f->names[0]);
        const char *other = name == f->names[0] ? f->names[1] : f->names[0];
        if (other)
            fail(cfg, name, "%s; also accepted as %s", why, other);
        else
            fail(cfg, name, "%s", why);
        goto bad;
    }

    /* The reference reads DSpark's expert counts as `dspark_n_* or backbone` (get_moe_config), so 0
     * and absent both mean "as the backbone". Resolve that here so both file forms give one struct
     * and downstream code never has to remember the rule. */
    if (cfg->dspark_n_routed == 0) cfg->dspark_n_routed = cfg->n_routed_experts;
    if (cfg->dspark_n_active == 0) cfg->dspark_n_active = cfg->n_active_experts;

    if (validate_scalars(cfg, compressed, n_emb)) goto bad;
    if (config_derive_roles(cfg)) goto bad;
    return 0;

bad:
    cJSON_Delete(cfg->json);
    cfg->json = NULL;
    return -1;
}

int config_load(const char *path, struct model_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    snprintf(cfg->source, sizeof cfg->source, "%s", path);
    FILE *f = fopen(path, "rb");
    if (!f) return fail(cfg, "file", "cannot open: %s", ds_errno_str());
    char *buf = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 4096 + 1 > cap) {
            cap = cap ? cap * 2 : 65536;
            buf = ds_realloc(buf, cap);
        }
        size_t got = fread(buf + len, 1, cap - len - 1, f);
        len += got;
        if (got == 0) break;
    }
    int err = ferror(f);
    fclose(f);
    if (err) {
        free(buf);
        return fail(cfg, "file", "read error");
    }
    buf[len] = '\0';
    if (strlen(buf) != len) {
        free(buf);
        return fail(cfg, "JSON", "file contains a NUL byte");
    }
    int rc = config_parse(buf, path, cfg);
    free(buf);
    return rc;
}

void config_free(struct model_config *cfg) {
    if (!cfg) return;
    cJSON_Delete(cfg->json);
    cfg->json = NULL;
}

/* ------------------------------------------------------------------------------------------------
 * Roles (MODEL.md §1.3) */

/* Ids in [0, n_layers); source lists strictly increasing because "the most recent source at or
 * below l" is looked up by scanning them, and a repeat or a reversal would hide a typo. */
static int check_ids(const struct model_config *cfg, const char *canon, const int *a, int n, bool increasing) {
    const char *key = key_name(cfg, canon);
    if (n < 0 || n > CFG_MAX_LIST) return fail(cfg, key, "%d entries (at most %d)", n, CFG_MAX_LIST);
    for (int i = 0; i < n; i++) {
        if (a[i] < 0 || a[i] >= cfg->n_layers)
            return fail(cfg, key, "entry %d is layer %d, outside the backbone [0, %d)", i, a[i], cfg->n_layers);
        if (increasing && i > 0 && a[i] <= a[i - 1])
            return fail(cfg, key, "not strictly increasing (%d after %d)", a[i], a[i - 1]);
        if (!increasing && list_find(a, i, a[i]) >= 0) return fail(cfg, key, "layer %d listed twice", a[i]);
    }
    return 0;
}

/* Most recent list entry at or below l, or -1 (lists are increasing). */
static int latest_at_or_below(const int *a, int n, int l) {
    int best = -1;
    for (int i = 0; i < n && a[i] <= l; i++) best = a[i];
    return best;
}

int config_derive_roles(struct model_config *cfg) {
    const int nl = cfg->n_layers, total = cfg->n_layers + cfg->n_mtp;
    const char *kr = key_name(cfg, "compress_ratios");
    if (nl <= 0 || cfg->n_mtp < 0 || total > CFG_MAX_LAYERS)
        return fail(cfg, key_name(cfg, "num_hidden_layers"), "%d backbone + %d DSpark layers (1..%d in all)", nl,
                    cfg->n_mtp, CFG_MAX_LAYERS);
    if (cfg->n_compress_ratios != total)
        return fail(cfg, kr, "%d entries, expected %d (%s %d + %s %d)", cfg->n_compress_ratios, total,
                    key_name(cfg, "num_hidden_layers"), nl, key_name(cfg, "num_nextn_predict_layers"), cfg->n_mtp);
    for (int l = 0; l < total; l++) {
        if (cfg->compress_ratios[l] < 0) return fail(cfg, kr, "layer %d: ratio %d is negative", l, cfg->compress_ratios[l]);
        if (l >= nl && cfg->compress_ratios[l] != 0)
            return fail(cfg, kr, "DSpark block %d (layer %d) has ratio %d; DSpark attention is window-only (0)",
                        l - nl, l, cfg->compress_ratios[l]);
    }
    if (check_ids(cfg, "kv_source_layer_ids", cfg->kv_sources, cfg->n_kv_sources, true) ||
        check_ids(cfg, "index_source_layer_ids", cfg->index_sources, cfg->n_index_sources, true) ||
        check_ids(cfg, "engram_layer_ids", cfg->engram_layer_ids, cfg->n_engram, true) ||
        check_ids(cfg, "dspark_target_layer_ids", cfg->dspark_targets, cfg->n_dspark_targets, false))
        return -1;
    const char *kc = key_name(cfg, "candidate_source_layer_id");
    if (cfg->candidate_source < -1 || cfg->candidate_source >= nl)
        return fail(cfg, kc, "%d is neither -1 nor a backbone layer [0, %d)", cfg->candidate_source, nl);
    if (cfg->candidate_source >= 0 &&
        (cfg->compress_ratios[cfg->candidate_source] == 0 ||
         list_find(cfg->index_sources, cfg->n_index_sources, cfg->candidate_source) < 0))
        return fail(cfg, kc, "layer %d is not an index source with ratio > 0; only an indexer can publish candidates",
                    cfg->candidate_source);

    const int *ratio = cfg->compress_ratios;
    const char *kkv = key_name(cfg, "kv_source_layer_ids"), *kix = key_name(cfg, "index_source_layer_ids");
    for (int l = 0; l < total; l++) {
        struct layer_role *r = &cfg->role[l];
        memset(r, 0, sizeof *r);
        r->ratio = ratio[l];
        r->kv_src = r->topk_src = -1;
        r->engram_idx = l < nl ? list_find(cfg->engram_layer_ids, cfg->n_engram, l) : -1;
        r->dspark_tap = l < nl ? list_find(cfg->dspark_targets, cfg->n_dspark_targets, l) : -1;
        r->rope_theta = cfg->rope_theta;
        r->yarn = false;
        if (l >= nl) {
            /* DSpark block: window attention only, its own (possibly smaller) MoE. */
            r->is_dspark = true;
            r->n_experts = cfg->dspark_n_routed ? cfg->dspark_n_routed : cfg->n_routed_experts;
            r->n_active = cfg->dspark_n_active ? cfg->dspark_n_active : cfg->n_active_experts;
            continue;
        }
        r->n_experts = cfg->n_routed_experts;
        r->n_active = cfg->n_active_experts;
        bool in_kv = list_find(cfg->kv_sources, cfg->n_kv_sources, l) >= 0;
        bool in_ix = list_find(cfg->index_sources, cfg->n_index_sources, l) >= 0;
        if (ratio[l] == 0) {
            /* A source with no compressed branch would publish nothing its consumers could read. */
            if (in_kv) return fail(cfg, kkv, "layer %d has compress ratio 0 and cannot be a KV source", l);
            if (in_ix) return fail(cfg, kix, "layer %d has compress ratio 0 and cannot be an index source", l);
            continue;
        }
        r->kv_src = latest_at_or_below(cfg->kv_sources, cfg->n_kv_sources, l);
        if (r->kv_src < 0)
            return fail(cfg, kkv, "layer %d has compress ratio %d but no KV source at or below it", l, ratio[l]);
        /* The shared compressed cache is indexed by position // ratio, so every reader must use the
         * ratio its source compressed with. */
        if (ratio[r->kv_src] != ratio[l])
            return fail(cfg, kr, "layer %d (ratio %d) reads the compressed KV of layer %d (ratio %d)", l, ratio[l],
                        r->kv_src, ratio[r->kv_src]);
        r->topk_src = latest_at_or_below(cfg->index_sources, cfg->n_index_sources, l);
        if (r->topk_src < 0)
            return fail(cfg, kix, "layer %d has compress ratio %d but no index source at or below it", l, ratio[l]);
        /* Published top-k rows are positions in the current KV source's cache; indices chosen
         * before that source would address a different cache. Applied at the KV source itself this
         * also makes every KV source an index source, so a re-index layer (index source without a
         * compressor) always finds index keys at its kv_src to score against. */
        if (r->topk_src < r->kv_src)
            return fail(cfg, kix, "layer %d would reuse top-k from layer %d, older than its KV source %d", l,
                        r->topk_src, r->kv_src);
        r->owns_compressor = in_kv;
        r->is_index_source = in_ix;
        r->owns_index_keys = in_ix && in_kv;
        r->is_candidate_source = l == cfg->candidate_source;
        r->uses_candidates = in_ix && cfg->candidate_source >= 0 && cfg->candidate_source < l;
        /* The candidate mask is over the candidate source's compressed positions. */
        if (r->uses_candidates && ratio[cfg->candidate_source] != ratio[l])
            return fail(cfg, kc, "index source %d (ratio %d) would filter by candidates of layer %d (ratio %d)", l,
                        ratio[l], cfg->candidate_source, ratio[cfg->candidate_source]);
        r->rope_theta = cfg->compress_rope_theta;
        r->yarn = cfg->original_seq_len > 0;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------
 * Serialisation back to the HF nested form */

static cJSON *ensure_object(cJSON *parent, const char *key) {
    cJSON *o = cJSON_GetObjectItemCaseSensitive(parent, key);
    if (cJSON_IsObject(o)) return o;
    cJSON *fresh = cJSON_CreateObject();
    if (!strcmp(key, "rope_scaling")) cJSON_AddStringToObject(fresh, "rope_type", "yarn");
    if (o)
        cJSON_ReplaceItemInObjectCaseSensitive(parent, key, fresh);
    else
        cJSON_AddItemToObject(parent, key, fresh);
    return fresh;
}

/* Set key (in place when present, so the file's key order survives) or "obj.key". */
static void set_path(cJSON *obj, const char *path, cJSON *val) {
    const char *dot = strchr(path, '.');
    if (dot) {
        char head[64];
        size_t n = (size_t)(dot - path);
        if (n >= sizeof head) n = sizeof head - 1;
        memcpy(head, path, n);
        head[n] = '\0';
        set_path(ensure_object(obj, head), dot + 1, val);
        return;
    }
    if (cJSON_GetObjectItemCaseSensitive(obj, path))
        cJSON_ReplaceItemInObjectCaseSensitive(obj, path, val);
    else
        cJSON_AddItemToObject(obj, path, val);
}

static void delete_path(cJSON *obj, const char *path) {
    const char *dot = strchr(path, '.');
    if (!dot) {
        cJSON_DeleteItemFromObjectCaseSensitive(obj, path);
        return;
    }
    char head[64];
    size_t n = (size_t)(dot - path);
    if (n >= sizeof head) return;
    memcpy(head, path, n);
    head[n] = '\0';
    cJSON *sub = cJSON_GetObjectItemCaseSensitive(obj, head);
    if (cJSON_IsObject(sub)) delete_path(sub, dot + 1);
}

static cJSON *field_value(const struct model_config *cfg, const struct field *f) {
    const char *base = (const char *)cfg;
    switch (f->kind) {
    case FK_INT: return cJSON_CreateNumber(*(const int *)(base + f->off));
    case FK_I64: return cJSON_CreateNumber((double)*(const int64_t *)(base + f->off));
    case FK_DBL: return cJSON_CreateNumber(*(const double *)(base + f->off));
    case FK_BOOL: return cJSON_CreateBool(*(const bool *)(base + f->off));
    case FK_LIST:
    case FK_RATIOS:
        return cJSON_CreateIntArray((const int *)(base + f->off), *(const int *)(base + f->count_off));
    case FK_LIST64: {
        cJSON *a = cJSON_CreateArray();
        for (int i = 0; i < cfg->n_engram; i++)
            cJSON_AddItemToArray(a, cJSON_CreateNumber((double)cfg->engram_num_embeddings[i]));
        return a;
    }
    case FK_SCORE: {
        int s = (int)cfg->score_func;
        return cJSON_CreateString(s >= 0 && s < 3 ? SCORE_NAMES[s] : SCORE_NAMES[0]);
    }
    }
    return cJSON_CreateNull();
}

static bool known_flat_key(const char *k) {
    if (!strcmp(k, "dtype") || !strcmp(k, "expert_dtype")) return true;
    for (int i = 0; i < N_FIELDS; i++)
        for (int j = 0; j < 3 && FIELDS[i].names[j]; j++)
            if (!strcmp(FIELDS[i].names[j], k)) return true;
    return false;
}

char *config_to_json(const struct model_config *cfg) {
    cJSON *out, *tc;
    bool from_nested = cfg->json && cJSON_IsObject(cfg->json) && is_nested(cfg->json);
    if (from_nested) {
        /* Start from the file itself so keys this parser does not model (vision_config,
         * hidden_act, topk_method, ...) reach /meta unchanged. */
        out = cJSON_Duplicate(cfg->json, true);
        tc = cJSON_GetObjectItemCaseSensitive(out, "text_config");
    } else {
        out = cJSON_CreateObject();
        const char *arch[] = {"DeepseekV41ForCausalLM"};
        cJSON_AddItemToObject(out, "architectures", cJSON_CreateStringArray(arch, 1));
        cJSON_AddStringToObject(out, "model_type", "deepseek_v41");
        cJSON_AddStringToObject(out, "dtype", "bfloat16");
        tc = cJSON_CreateObject();
        cJSON_AddStringToObject(tc, "model_type", "deepseek_v41_text");
        /* Flat-form extras (vision_*, runtime limits) ride along inside text_config. */
        if (cJSON_IsObject(cfg->json)) {
            const cJSON *it;
            cJSON_ArrayForEach(it, cfg->json) {
                if (it->string && !known_flat_key(it->string))
                    cJSON_AddItemToObject(tc, it->string, cJSON_Duplicate(it, true));
            }
        }
    }

    for (int i = 0; i < N_FIELDS; i++) {
        const struct field *f = &FIELDS[i];
        for (int k = 1; k < 3 && f->names[k]; k++) delete_path(tc, f->names[k]);
        if (f->id_key) {
            /* HF's home for token ids is the top level; keep any text_config copy in step. */
            set_path(out, f->names[0], field_value(cfg, f));
            if (cJSON_GetObjectItemCaseSensitive(tc, f->names[0])) set_path(tc, f->names[0], field_value(cfg, f));
        } else {
            set_path(tc, f->names[0], field_value(cfg, f));
        }
    }

    if (cfg->dense_fp8 || cfg->expert_fp4) {
        cJSON *qc = ensure_object(out, "quantization_config");
        if (cfg->dense_fp8)
            set_path(qc, "quant_method", cJSON_CreateString("fp8"));
        else
            delete_path(qc, "quant_method");
        if (!cJSON_GetObjectItemCaseSensitive(qc, "activation_scheme"))
            cJSON_AddStringToObject(qc, "activation_scheme", "dynamic");
        int wb[2] = {cfg->weight_block, cfg->weight_block};
        set_path(qc, "weight_block_size", cJSON_CreateIntArray(wb, 2));
        if (!cJSON_GetObjectItemCaseSensitive(qc, "scale_fmt")) cJSON_AddStringToObject(qc, "scale_fmt", "ue8m0");
        if (cfg->expert_fp4)
            set_path(qc, "expert_dtype", cJSON_CreateString("fp4"));
        else
            delete_path(qc, "expert_dtype");
    } else {
        cJSON_DeleteItemFromObjectCaseSensitive(out, "quantization_config");
    }
    if (!from_nested) cJSON_AddItemToObject(out, "text_config", tc);

    char *s = cJSON_Print(out);
    cJSON_Delete(out);
    return s;
}

/* ------------------------------------------------------------------------------------------------
 * Role table print */

void config_print_roles(FILE *f, const struct model_config *cfg) {
    for (int l = 0; l < config_total_layers(cfg); l++) {
        const struct layer_role *r = &cfg->role[l];
        char kv[16], tk[16], owns[160] = "";
        size_t n = 0;
        if (r->kv_src < 0)
            snprintf(kv, sizeof kv, "-");
        else if (r->kv_src == l)
            snprintf(kv, sizeof kv, "self");
        else
            snprintf(kv, sizeof kv, "%d", r->kv_src);
        if (r->topk_src < 0)
            snprintf(tk, sizeof tk, "-");
        else if (r->topk_src == l)
            snprintf(tk, sizeof tk, "self");
        else
            snprintf(tk, sizeof tk, "%d", r->topk_src);
#define OWN(...) n += (size_t)snprintf(owns + n, n < sizeof owns ? sizeof owns - n : 0, __VA_ARGS__)
        if (r->owns_compressor) OWN("%scompressor", n ? " " : "");
        if (r->is_index_source) OWN("%s%s", n ? " " : "", r->owns_index_keys ? "indexer keys" : "indexer");
        if (r->is_candidate_source) OWN("%scandidate-source", n ? " " : "");
        if (r->uses_candidates) OWN("%suses-candidates", n ? " " : "");
        if (r->engram_idx >= 0) OWN("%sengram %d", n ? " " : "", r->engram_idx);
        if (r->dspark_tap >= 0) OWN("%stap %d", n ? " " : "", r->dspark_tap);
        if (r->is_dspark) OWN("%sdspark mtp.%d", n ? " " : "", l - cfg->n_layers);
#undef OWN
        fprintf(f, "layer %d  ratio %d  kv %s  topk %s%s%s  rope %g%s  experts %d/%d\n", l, r->ratio, kv, tk,
                owns[0] ? "  " : "", owns, r->rope_theta, r->yarn ? "+yarn" : "", r->n_experts, r->n_active);
    }
}
