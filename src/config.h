/* Model configuration: the release's config.json (HF nested `text_config` + `quantization_config`)
 * or the reference's flat inference form, parsed with cJSON into one struct, plus the per-layer
 * role table of MODEL.md §1.3 derived from the id lists. Nothing downstream assumes 40 layers:
 * every loop runs over n_layers (+ n_mtp DSpark blocks) and dispatches on role[]. */
#ifndef DS_CONFIG_H
#define DS_CONFIG_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#define CFG_MAX_LAYERS 256 /* backbone + DSpark blocks */
#define CFG_MAX_LIST 64    /* any id list (kv sources, engram layers, DSpark targets) */

struct cJSON;

enum cfg_score_func { CFG_SCORE_SQRTSOFTPLUS = 0, CFG_SCORE_SOFTMAX, CFG_SCORE_SIGMOID };

/* What one layer does; derived, never read from the file. */
struct layer_role {
    int ratio;                /* compress ratio: 0 window only, 1 or 2 compressed branch */
    int kv_src;               /* layer whose compressed KV this layer reads; -1 when ratio == 0 */
    int topk_src;             /* layer whose published top-k this layer uses; -1 when ratio == 0 */
    bool owns_compressor;     /* in kv_source_layer_ids (and ratio > 0) */
    bool is_index_source;     /* runs its own indexer (in index_source_layer_ids, ratio > 0) */
    bool owns_index_keys;     /* index source that is also a KV source: wk + k_norm */
    bool is_candidate_source; /* publishes candidate blocks */
    bool uses_candidates;     /* index source after the candidate source: scores inside candidates */
    int engram_idx;           /* index into engram_layer_ids, -1 if none */
    int dspark_tap;           /* index into dspark_target_layer_ids, -1 if not a tap */
    bool is_dspark;           /* mtp.M block (layer id >= n_layers) */
    double rope_theta;        /* θ for this layer's RoPE */
    bool yarn;                /* YaRN blend on (ratio > 0 layers) */
    int n_experts, n_active;  /* routed experts and top-k of this block's MoE */
};

struct model_config {
    /* shape */
    int vocab_size, dim, n_layers, n_heads, n_kv_heads, head_dim, rope_dim, q_lora_rank, o_lora_rank,
        o_groups;
    double norm_eps;
    int64_t max_pos; /* max_position_embeddings (flat form: max_seq_len) */
    /* rope */
    double rope_theta, compress_rope_theta, rope_factor;
    double beta_fast, beta_slow;
    int64_t original_seq_len; /* YaRN original_max_position_embeddings; 0 disables YaRN */
    /* moe */
    int n_routed_experts, n_active_experts, moe_inter_dim, n_shared_experts;
    enum cfg_score_func score_func;
    double route_scale, swiglu_limit, gate_temp;
    bool norm_topk_prob;
    /* attention schedule */
    int window;
    int n_compress_ratios;
    int compress_ratios[CFG_MAX_LAYERS];
    int n_kv_sources, kv_sources[CFG_MAX_LIST];
    int n_index_sources, index_sources[CFG_MAX_LIST];
    int candidate_source; /* -1 = off */
    int candidate_topk_blocks, candidate_block_size;
    int index_n_heads, index_head_dim, index_topk;
    /* mHC */
    int hc_mult, hc_sinkhorn_iters;
    double hc_eps;
    /* engram */
    int n_engram, engram_layer_ids[CFG_MAX_LIST];
    int64_t engram_num_embeddings[CFG_MAX_LIST];
    int engram_max_ngram, engram_n_heads, engram_head_dim;
    int64_t engram_vocab_size; /* prime search start */
    int64_t engram_compressed_vocab;
    int engram_pad_id; /* raw token id; the compressed pad is token_map[pad] */
    /* DSpark */
    int n_mtp, dspark_block_size, dspark_noise_id, n_dspark_targets, dspark_targets[CFG_MAX_LIST],
        dspark_markov_rank, dspark_n_routed, dspark_n_active;
    /* ids */
    int bos_id, eos_id, pad_id, image_token_id;
    /* quantization */
    int weight_block; /* 32 */
    bool expert_fp4;  /* expert_dtype == fp4 */
    bool dense_fp8;   /* dtype fp8 (false: bf16 dense weights) */

    /* derived */
    struct layer_role role[CFG_MAX_LAYERS]; /* n_layers + n_mtp entries */

    struct cJSON *json; /* the parsed file, kept whole so unknown keys survive into /meta */
    char source[512];   /* file the config came from, for error messages */
};

/* Parse a config.json (nested HF form or flat inference form; detected by `text_config`).
 * Returns 0, or -1 with ds_err_set("<file>: <key>: ...") naming the missing or bad key. */
int config_load(const char *path, struct model_config *cfg);
int config_parse(const char *json_text, const char *source_name, struct model_config *cfg);
void config_free(struct model_config *cfg);

/* Recompute role[] from the lists; also validates them (ids in range, sources ordered, a ratio>0
 * layer having a KV source at or below it, ...). Called by config_parse; exposed for mkmodel. */
int config_derive_roles(struct model_config *cfg);

/* Serialise the effective config back to JSON in the nested HF form (caller frees). */
char *config_to_json(const struct model_config *cfg);

/* Human-readable role table (one line per layer), as in MODEL.md §1.3. */
void config_print_roles(FILE *f, const struct model_config *cfg);

static inline int config_total_layers(const struct model_config *c) { return c->n_layers + c->n_mtp; }

/* Checkpoint name prefix of layer l: "layers.L" for the backbone, "mtp.M" for DSpark block M. */
static inline void config_layer_prefix(const struct model_config *c, int l, char *buf, size_t n) {
    if (l >= c->n_layers)
        snprintf(buf, n, "mtp.%d", l - c->n_layers);
    else
        snprintf(buf, n, "layers.%d", l);
}

#endif /* DS_CONFIG_H */
