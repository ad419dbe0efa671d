/* Unit tests for src/config.c: the real V4.1-Flash config (data/presets/v41-flash.json) read back
 * field by field against MODEL.md §1.2 and its whole §1.3 role table; the two golden fixtures'
 * roles against the tables in golden/README.md; the flat inference_config.json of each fixture
 * giving the same struct as its nested config.json; the HF re-serialisation round trip; and the
 * bad-input paths, each of which must name the file and the offending key. The expected tables are
 * written out by hand from the documents, not recomputed with the rules the parser uses, so a
 * wrong rule in the parser cannot also be a wrong rule in the test.
 * Run from the repo root; GOLDEN points at shared/golden (default ../shared/golden). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "log.h"

#define PRESET "data/presets/v41-flash.json"

/* ------------------------------------------------------------------------------------------------
 * Helpers */

static const char *golden(const char *spec, const char *file) {
    static char buf[4][1024];
    static int slot;
    const char *g = getenv("GOLDEN");
    char *p = buf[slot++ & 3];
    snprintf(p, sizeof buf[0], "%s/%s/%s", g && g[0] ? g : "../shared/golden", spec, file);
    return p;
}

static struct model_config *load_ok(const char *path) {
    struct model_config *c = calloc(1, sizeof *c);
    assert_non_null(c);
    int rc = config_load(path, c);
    if (rc) print_error("config_load(%s): %s\n", path, ds_err_get());
    assert_int_equal(rc, 0);
    return c;
}

static void drop(struct model_config *c) {
    config_free(c);
    free(c);
}

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    assert_non_null(s);
    assert_int_equal(fread(s, 1, (size_t)n, f), (size_t)n);
    s[n] = '\0';
    fclose(f);
    return s;
}

/* Parse `path`, let `edit` change the JSON tree (root, and text_config or root again for a flat
 * file), then hand the printed text to config_parse under the name `as`. Returns its rc. */
typedef void (*edit_fn)(cJSON *root, cJSON *scope);
static int parse_edited(const char *path, edit_fn edit, const char *as, struct model_config *out) {
    char *text = slurp(path);
    cJSON *root = cJSON_Parse(text);
    free(text);
    assert_non_null(root);
    cJSON *scope = cJSON_GetObjectItemCaseSensitive(root, "text_config");
    if (!scope) scope = root;
    if (edit) edit(root, scope);
    char *edited = cJSON_Print(root);
    cJSON_Delete(root);
    int rc = config_parse(edited, as, out);
    free(edited);
    return rc;
}

/* Expect failure with a message naming the file and the key. */
static void expect_error(const char *path, edit_fn edit, const char *key, const char *also) {
    struct model_config *c = calloc(1, sizeof *c);
    assert_non_null(c);
    int rc = parse_edited(path, edit, "bad.json", c);
    const char *msg = ds_err_get();
    if (rc != -1 || !strstr(msg, "bad.json") || !strstr(msg, key) || (also && !strstr(msg, also)))
        print_error("rc %d, message \"%s\"; wanted key \"%s\"%s%s\n", rc, msg, key, also ? " and " : "",
                    also ? also : "");
    assert_int_equal(rc, -1);
    assert_non_null(strstr(msg, "bad.json:"));
    assert_non_null(strstr(msg, key));
    if (also) assert_non_null(strstr(msg, also));
    assert_null(c->json); /* nothing leaks from a failed parse */
    drop(c);
}

static void set_num(cJSON *o, const char *k, double v) {
    cJSON_DeleteItemFromObjectCaseSensitive(o, k);
    cJSON_AddNumberToObject(o, k, v);
}

static void set_ints(cJSON *o, const char *k, const int *v, int n) {
    cJSON_DeleteItemFromObjectCaseSensitive(o, k);
    cJSON_AddItemToObject(o, k, cJSON_CreateIntArray(v, n));
}

/* Every scalar, list and role of two configs must agree (json/source excepted). */
static void assert_cfg_equal(const struct model_config *a, const struct model_config *b) {
#define EQ(f) assert_int_equal(a->f, b->f)
#define EQD(f)                                                                     \
    do {                                                                           \
        if (a->f != b->f) print_error(#f ": %.17g vs %.17g\n", a->f, b->f);        \
        assert_true(a->f == b->f);                                                 \
    } while (0)
#define EQL(n, arr)                                                                \
    do {                                                                           \
        EQ(n);                                                                     \
        for (int i_ = 0; i_ < a->n; i_++) assert_int_equal(a->arr[i_], b->arr[i_]); \
    } while (0)
    EQ(vocab_size); EQ(dim); EQ(n_layers); EQ(n_heads); EQ(n_kv_heads); EQ(head_dim); EQ(rope_dim);
    EQ(q_lora_rank); EQ(o_lora_rank); EQ(o_groups); EQD(norm_eps); EQ(max_pos);
    EQD(rope_theta); EQD(compress_rope_theta); EQD(rope_factor); EQD(beta_fast); EQD(beta_slow);
    EQ(original_seq_len);
    EQ(n_routed_experts); EQ(n_active_experts); EQ(moe_inter_dim); EQ(n_shared_experts); EQ(score_func);
    EQD(route_scale); EQD(swiglu_limit); EQD(gate_temp); EQ(norm_topk_prob);
    EQ(window);
    EQL(n_compress_ratios, compress_ratios);
    EQL(n_kv_sources, kv_sources);
    EQL(n_index_sources, index_sources);
    EQ(candidate_source); EQ(candidate_topk_blocks); EQ(candidate_block_size);
    EQ(index_n_heads); EQ(index_head_dim); EQ(index_topk);
    EQ(hc_mult); EQ(hc_sinkhorn_iters); EQD(hc_eps);
    EQL(n_engram, engram_layer_ids);
    for (int i = 0; i < a->n_engram; i++) assert_int_equal(a->engram_num_embeddings[i], b->engram_num_embeddings[i]);
    EQ(engram_max_ngram); EQ(engram_n_heads); EQ(engram_head_dim); EQ(engram_vocab_size);
    EQ(engram_compressed_vocab); EQ(engram_pad_id);
    EQ(n_mtp); EQ(dspark_block_size); EQ(dspark_noise_id);
    EQL(n_dspark_targets, dspark_targets);
    EQ(dspark_markov_rank); EQ(dspark_n_routed); EQ(dspark_n_active);
    EQ(bos_id); EQ(eos_id); EQ(pad_id); EQ(image_token_id);
    EQ(weight_block); EQ(expert_fp4); EQ(dense_fp8);
    for (int l = 0; l < config_total_layers(a); l++) {
        const struct layer_role *x = &a->role[l], *y = &b->role[l];
        assert_int_equal(x->ratio, y->ratio);
        assert_int_equal(x->kv_src, y->kv_src);
        assert_int_equal(x->topk_src, y->topk_src);
        assert_int_equal(x->owns_compressor, y->owns_compressor);
        assert_int_equal(x->is_index_source, y->is_index_source);
        assert_int_equal(x->owns_index_keys, y->owns_index_keys);
        assert_int_equal(x->is_candidate_source, y->is_candidate_source);
        assert_int_equal(x->uses_candidates, y->uses_candidates);
        assert_int_equal(x->engram_idx, y->engram_idx);
        assert_int_equal(x->dspark_tap, y->dspark_tap);
        assert_int_equal(x->is_dspark, y->is_dspark);
        assert_true(x->rope_theta == y->rope_theta);
        assert_int_equal(x->yarn, y->yarn);
        assert_int_equal(x->n_experts, y->n_experts);
        assert_int_equal(x->n_active, y->n_active);
    }
#undef EQ
#undef EQD
#undef EQL
}

/* One expected role row. own: C compressor, I index source, K index keys, S candidate source,
 * U uses candidates. */
struct exp_role {
    int ratio, kv, topk;
    const char *own;
    int engram, tap;
    bool dspark;
    double theta;
    bool yarn;
    int ne, na;
};

static void assert_roles(const struct model_config *c, const struct exp_role *e, int n) {
    assert_int_equal(config_total_layers(c), n);
    for (int l = 0; l < n; l++) {
        const struct layer_role *r = &c->role[l];
        const struct exp_role *x = &e[l];
        bool ok = r->ratio == x->ratio && r->kv_src == x->kv && r->topk_src == x->topk &&
                  r->owns_compressor == (strchr(x->own, 'C') != NULL) &&
                  r->is_index_source == (strchr(x->own, 'I') != NULL) &&
                  r->owns_index_keys == (strchr(x->own, 'K') != NULL) &&
                  r->is_candidate_source == (strchr(x->own, 'S') != NULL) &&
                  r->uses_candidates == (strchr(x->own, 'U') != NULL) && r->engram_idx == x->engram &&
                  r->dspark_tap == x->tap && r->is_dspark == x->dspark && r->rope_theta == x->theta &&
                  r->yarn == x->yarn && r->n_experts == x->ne && r->n_active == x->na;
        if (!ok) {
            print_error("layer %d: got ratio %d kv %d topk %d C%d I%d K%d S%d U%d engram %d tap %d dspark %d "
                        "theta %g yarn %d experts %d/%d\n",
                        l, r->ratio, r->kv_src, r->topk_src, r->owns_compressor, r->is_index_source,
                        r->owns_index_keys, r->is_candidate_source, r->uses_candidates, r->engram_idx,
                        r->dspark_tap, r->is_dspark, r->rope_theta, r->yarn, r->n_experts, r->n_active);
            fail_msg("role table mismatch at layer %d (expected own \"%s\")", l, x->own);
        }
    }
}

/* ------------------------------------------------------------------------------------------------
 * The real model */

static void test_real_fields(void **state) {
    (void)state;
    struct model_config *c = load_ok(PRESET);
    /* shape */
    assert_int_equal(c->vocab_size, 129280);
    assert_int_equal(c->dim, 5120);
    assert_int_equal(c->n_layers, 40);
    assert_int_equal(c->n_heads, 64);
    assert_int_equal(c->n_kv_heads, 1);
    assert_int_equal(c->head_dim, 512);
    assert_int_equal(c->rope_dim, 64);
    assert_int_equal(c->q_lora_rank, 1280);
    assert_int_equal(c->o_lora_rank, 1024);
    assert_int_equal(c->o_groups, 8);
    assert_true(c->norm_eps == 1e-20);
    assert_int_equal(c->max_pos, 1048576);
    /* rope */
    assert_true(c->rope_theta == 10000.0);
    assert_true(c->compress_rope_theta == 160000.0);
    assert_true(c->rope_factor == 16.0);
    assert_true(c->beta_fast == 32.0);
    assert_true(c->beta_slow == 1.0);
    assert_int_equal(c->original_seq_len, 65536);
    /* moe */
    assert_int_equal(c->n_routed_experts, 384);
    assert_int_equal(c->n_active_experts, 6);
    assert_int_equal(c->moe_inter_dim, 2304);
    assert_int_equal(c->n_shared_experts, 1);
    assert_int_equal(c->score_func, CFG_SCORE_SQRTSOFTPLUS);
    assert_true(c->norm_topk_prob);
    assert_true(c->route_scale == 1.5);
    assert_true(c->swiglu_limit == 10.0);
    assert_true(c->gate_temp == 1.0); /* not in the file: the reference default */
    /* attention schedule */
    assert_int_equal(c->window, 128);
    assert_int_equal(c->n_compress_ratios, 43);
    for (int l = 0; l < 43; l++) {
        int want = l < 2 ? 0 : l < 20 ? 2 : l < 40 ? 1 : 0;
        assert_int_equal(c->compress_ratios[l], want);
    }
    const int kv[] = {2, 8, 14, 20}, ix[] = {2, 8, 14, 20, 24, 28, 32, 36};
    assert_int_equal(c->n_kv_sources, 4);
    assert_memory_equal(c->kv_sources, kv, sizeof kv);
    assert_int_equal(c->n_index_sources, 8);
    assert_memory_equal(c->index_sources, ix, sizeof ix);
    assert_int_equal(c->candidate_source, 20);
    assert_int_equal(c->candidate_topk_blocks, 2048);
    assert_int_equal(c->candidate_block_size, 8);
    assert_int_equal(c->index_n_heads, 32);
    assert_int_equal(c->index_head_dim, 128);
    assert_int_equal(c->index_topk, 512);
    /* mHC */
    assert_int_equal(c->hc_mult, 4);
    assert_int_equal(c->hc_sinkhorn_iters, 20);
    assert_true(c->hc_eps == 1e-6);
    /* engram */
    assert_int_equal(c->n_engram, 2);
    assert_int_equal(c->engram_layer_ids[0], 1);
    assert_int_equal(c->engram_layer_ids[1], 14);
    assert_int_equal(c->engram_num_embeddings[0], 384006168);
    assert_int_equal(c->engram_num_embeddings[1], 384016682);
    assert_int_equal(c->engram_max_ngram, 4);
    assert_int_equal(c->engram_n_heads, 8);
    assert_int_equal(c->engram_head_dim, 256);
    assert_int_equal(c->engram_vocab_size, 16000000);
    assert_int_equal(c->engram_compressed_vocab, 99092);
    assert_int_equal(c->engram_pad_id, 2);
    /* DSpark */
    assert_int_equal(c->n_mtp, 3);
    assert_int_equal(c->dspark_block_size, 5);
    assert_int_equal(c->dspark_noise_id, 128799);
    assert_int_equal(c->n_dspark_targets, 3);
    assert_int_equal(c->dspark_targets[0], 37);
    assert_int_equal(c->dspark_targets[1], 38);
    assert_int_equal(c->dspark_targets[2], 39);
    assert_int_equal(c->dspark_markov_rank, 256);
    assert_int_equal(c->dspark_n_routed, 128);
    assert_int_equal(c->dspark_n_active, 3);
    /* ids and quantization (§1.1) */
    assert_int_equal(c->bos_id, 0);
    assert_int_equal(c->eos_id, 1);
    assert_int_equal(c->pad_id, 2);
    assert_int_equal(c->image_token_id, 129264);
    assert_int_equal(c->weight_block, 32);
    assert_true(c->expert_fp4);
    assert_true(c->dense_fp8);
    assert_string_equal(c->source, PRESET);
    assert_non_null(c->json);
    /* The preset carries the §1.1 top level too. */
    const cJSON *arch = cJSON_GetObjectItemCaseSensitive(c->json, "architectures");
    assert_true(cJSON_IsArray(arch));
    assert_string_equal(cJSON_GetArrayItem(arch, 0)->valuestring, "DeepseekV41ForCausalLM");
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(c->json, "model_type")->valuestring, "deepseek_v41");
    assert_null(cJSON_GetObjectItemCaseSensitive(c->json, "vision_config"));
    drop(c);
}

static void test_real_roles(void **state) {
    (void)state;
    /* MODEL.md §1.3, one row per layer. */
    static const struct exp_role E[43] = {
        {0, -1, -1, "", -1, -1, false, 10000, false, 384, 6},      /* 0 */
        {0, -1, -1, "", 0, -1, false, 10000, false, 384, 6},       /* 1: engram table 0 */
        {2, 2, 2, "CIK", -1, -1, false, 160000, true, 384, 6},     /* 2 */
        {2, 2, 2, "", -1, -1, false, 160000, true, 384, 6},        /* 3 */
        {2, 2, 2, "", -1, -1, false, 160000, true, 384, 6},        /* 4 */
        {2, 2, 2, "", -1, -1, false, 160000, true, 384, 6},        /* 5 */
        {2, 2, 2, "", -1, -1, false, 160000, true, 384, 6},        /* 6 */
        {2, 2, 2, "", -1, -1, false, 160000, true, 384, 6},        /* 7 */
        {2, 8, 8, "CIK", -1, -1, false, 160000, true, 384, 6},     /* 8 */
        {2, 8, 8, "", -1, -1, false, 160000, true, 384, 6},        /* 9 */
        {2, 8, 8, "", -1, -1, false, 160000, true, 384, 6},        /* 10 */
        {2, 8, 8, "", -1, -1, false, 160000, true, 384, 6},        /* 11 */
        {2, 8, 8, "", -1, -1, false, 160000, true, 384, 6},        /* 12 */
        {2, 8, 8, "", -1, -1, false, 160000, true, 384, 6},        /* 13 */
        {2, 14, 14, "CIK", 1, -1, false, 160000, true, 384, 6},    /* 14: engram table 1 */
        {2, 14, 14, "", -1, -1, false, 160000, true, 384, 6},      /* 15 */
        {2, 14, 14, "", -1, -1, false, 160000, true, 384, 6},      /* 16 */
        {2, 14, 14, "", -1, -1, false, 160000, true, 384, 6},      /* 17 */
        {2, 14, 14, "", -1, -1, false, 160000, true, 384, 6},      /* 18 */
        {2, 14, 14, "", -1, -1, false, 160000, true, 384, 6},      /* 19 */
        {1, 20, 20, "CIKS", -1, -1, false, 160000, true, 384, 6},  /* 20: candidate source */
        {1, 20, 20, "", -1, -1, false, 160000, true, 384, 6},      /* 21 */
        {1, 20, 20, "", -1, -1, false, 160000, true, 384, 6},      /* 22 */
        {1, 20, 20, "", -1, -1, false, 160000, true, 384, 6},      /* 23 */
        {1, 20, 24, "IU", -1, -1, false, 160000, true, 384, 6},    /* 24: re-index, no keys */
        {1, 20, 24, "", -1, -1, false, 160000, true, 384, 6},      /* 25 */
        {1, 20, 24, "", -1, -1, false, 160000, true, 384, 6},      /* 26 */
        {1, 20, 24, "", -1, -1, false, 160000, true, 384, 6},      /* 27 */
        {1, 20, 28, "IU", -1, -1, false, 160000, true, 384, 6},    /* 28 */
        {1, 20, 28, "", -1, -1, false, 160000, true, 384, 6},      /* 29 */
        {1, 20, 28, "", -1, -1, false, 160000, true, 384, 6},      /* 30 */
        {1, 20, 28, "", -1, -1, false, 160000, true, 384, 6},      /* 31 */
        {1, 20, 32, "IU", -1, -1, false, 160000, true, 384, 6},    /* 32 */
        {1, 20, 32, "", -1, -1, false, 160000, true, 384, 6},      /* 33 */
        {1, 20, 32, "", -1, -1, false, 160000, true, 384, 6},      /* 34 */
        {1, 20, 32, "", -1, -1, false, 160000, true, 384, 6},      /* 35 */
        {1, 20, 36, "IU", -1, -1, false, 160000, true, 384, 6},    /* 36 */
        {1, 20, 36, "", -1, 0, false, 160000, true, 384, 6},       /* 37: DSpark tap 0 */
        {1, 20, 36, "", -1, 1, false, 160000, true, 384, 6},       /* 38: tap 1 */
        {1, 20, 36, "", -1, 2, false, 160000, true, 384, 6},       /* 39: tap 2 */
        {0, -1, -1, "", -1, -1, true, 10000, false, 128, 3},       /* 40: mtp.0 */
        {0, -1, -1, "", -1, -1, true, 10000, false, 128, 3},       /* 41: mtp.1 */
        {0, -1, -1, "", -1, -1, true, 10000, false, 128, 3},       /* 42: mtp.2 */
    };
    struct model_config *c = load_ok(PRESET);
    assert_roles(c, E, 43);
    drop(c);
}

static void test_real_print_roles(void **state) {
    (void)state;
    struct model_config *c = load_ok(PRESET);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    assert_non_null(f);
    config_print_roles(f, c);
    fclose(f);
    int lines = 0;
    for (size_t i = 0; i < len; i++) lines += buf[i] == '\n';
    assert_int_equal(lines, 43);
    assert_non_null(strstr(buf, "layer 20  ratio 1  kv self  topk self  compressor indexer keys candidate-source  "
                                "rope 160000+yarn  experts 384/6\n"));
    assert_non_null(strstr(buf, "layer 0  ratio 0  kv -  topk -  rope 10000  experts 384/6\n"));
    assert_non_null(strstr(buf, "layer 25  ratio 1  kv 20  topk 24  rope 160000+yarn  experts 384/6\n"));
    assert_non_null(strstr(buf, "layer 28  ratio 1  kv 20  topk self  indexer uses-candidates  rope 160000+yarn"));
    assert_non_null(strstr(buf, "layer 14  ratio 2  kv self  topk self  compressor indexer keys engram 1  rope"));
    assert_non_null(strstr(buf, "layer 38  ratio 1  kv 20  topk 36  tap 1  rope"));
    assert_non_null(strstr(buf, "layer 42  ratio 0  kv -  topk -  dspark mtp.2  rope 10000  experts 128/3\n"));
    free(buf);
    drop(c);
}

/* ------------------------------------------------------------------------------------------------
 * Golden fixtures */

static void test_small6_roles(void **state) {
    (void)state;
    /* golden/README.md, small6 role table. */
    static const struct exp_role E[7] = {
        {0, -1, -1, "", 0, -1, false, 10000, false, 4, 2},    /* window only, engram */
        {2, 1, 1, "CIK", 1, -1, false, 160000, true, 4, 2},  /* KV + index source, engram */
        {2, 1, 1, "", -1, -1, false, 160000, true, 4, 2},    /* ratio-2 consumer */
        {1, 3, 3, "CIKS", -1, -1, false, 160000, true, 4, 2}, /* candidate source */
        {1, 3, 3, "", -1, 0, false, 160000, true, 4, 2},     /* consumer, tap */
        {1, 3, 5, "IU", -1, 1, false, 160000, true, 4, 2},   /* candidate index source, tap */
        {0, -1, -1, "", -1, -1, true, 10000, false, 4, 2},   /* mtp.0, experts = backbone */
    };
    struct model_config *c = load_ok(golden("small6", "config.json"));
    assert_roles(c, E, 7);
    assert_true(c->rope_factor == 4.0);
    assert_int_equal(c->original_seq_len, 32);
    assert_int_equal(c->max_pos, 128);
    drop(c);
}

static void test_tp8pp2_roles(void **state) {
    (void)state;
    /* golden/README.md, tp8pp2 role table. */
    static const struct exp_role E[10] = {
        {0, -1, -1, "", -1, -1, false, 10000, false, 16, 4},   /* window only */
        {0, -1, -1, "", 0, -1, false, 10000, false, 16, 4},    /* window only, engram */
        {2, 2, 2, "CIK", -1, -1, false, 160000, true, 16, 4},  /* KV + index source */
        {2, 2, 2, "", 1, -1, false, 160000, true, 16, 4},      /* ratio-2 consumer, engram */
        {1, 4, 4, "CIKS", -1, -1, false, 160000, true, 16, 4}, /* candidate source */
        {1, 4, 4, "", -1, 0, false, 160000, true, 16, 4},      /* consumer, tap */
        {1, 4, 6, "IU", -1, 1, false, 160000, true, 16, 4},    /* candidate index source, tap */
        {1, 4, 6, "", -1, 2, false, 160000, true, 16, 4},      /* consumer of 6's top-k, tap */
        {0, -1, -1, "", -1, -1, true, 10000, false, 8, 2},     /* mtp.0 */
        {0, -1, -1, "", -1, -1, true, 10000, false, 8, 2},     /* mtp.1 */
    };
    struct model_config *c = load_ok(golden("tp8pp2", "config.json"));
    assert_roles(c, E, 10);
    assert_true(c->rope_factor == 8.0);
    assert_int_equal(c->original_seq_len, 64);
    assert_int_equal(c->max_pos, 256);
    drop(c);
}

static void flat_equals_nested(const char *spec) {
    struct model_config *n = load_ok(golden(spec, "config.json"));
    struct model_config *f = load_ok(golden(spec, "inference_config.json"));
    assert_non_null(cJSON_GetObjectItemCaseSensitive(n->json, "text_config"));
    assert_null(cJSON_GetObjectItemCaseSensitive(f->json, "text_config"));
    assert_cfg_equal(n, f);
    drop(n);
    drop(f);
}

static void test_flat_equals_nested_small6(void **state) {
    (void)state;
    flat_equals_nested("small6");
    /* small6's flat file says 0/0 for the DSpark experts: "as the backbone". */
    struct model_config *f = load_ok(golden("small6", "inference_config.json"));
    assert_int_equal(f->dspark_n_routed, 4);
    assert_int_equal(f->dspark_n_active, 2);
    assert_int_equal(f->role[6].n_experts, 4);
    assert_int_equal(f->role[6].n_active, 2);
    drop(f);
}

static void test_flat_equals_nested_tp8pp2(void **state) {
    (void)state;
    flat_equals_nested("tp8pp2");
}

/* config_to_json -> config_parse gives the same struct, and keys the parser ignores survive. */
static void roundtrip(const char *path, const char *survivor) {
    struct model_config *a = load_ok(path);
    char *s = config_to_json(a);
    assert_non_null(s);
    struct model_config *b = calloc(1, sizeof *b);
    assert_non_null(b);
    int rc = config_parse(s, "roundtrip.json", b);
    if (rc) print_error("%s\n", ds_err_get());
    assert_int_equal(rc, 0);
    assert_cfg_equal(a, b);
    /* Always the nested HF form. */
    const cJSON *tc = cJSON_GetObjectItemCaseSensitive(b->json, "text_config");
    assert_true(cJSON_IsObject(tc));
    assert_non_null(cJSON_GetObjectItemCaseSensitive(tc, "hidden_size"));
    assert_null(cJSON_GetObjectItemCaseSensitive(tc, "dim"));
    assert_non_null(cJSON_GetObjectItemCaseSensitive(b->json, "quantization_config"));
    assert_non_null(cJSON_GetObjectItemCaseSensitive(b->json, "architectures"));
    if (survivor) assert_non_null(strstr(s, survivor));
    free(s);
    drop(a);
    drop(b);
}

static void test_roundtrip(void **state) {
    (void)state;
    roundtrip(PRESET, "\"topk_method\"");
    roundtrip(golden("small6", "config.json"), "\"hidden_act\"");
    roundtrip(golden("tp8pp2", "config.json"), "\"first_k_dense_replace\"");
    roundtrip(golden("small6", "inference_config.json"), "\"vision_dim\"");
    roundtrip(golden("tp8pp2", "inference_config.json"), "\"max_batch_size\"");
}

/* An edited struct serialises its effective values, not the file's. */
static void test_to_json_uses_struct(void **state) {
    (void)state;
    struct model_config *a = load_ok(golden("small6", "config.json"));
    a->window = 24;
    a->rope_factor = 2.5;
    a->eos_id = 7;
    char *s = config_to_json(a);
    struct model_config *b = calloc(1, sizeof *b);
    assert_int_equal(config_parse(s, "edited.json", b), 0);
    assert_int_equal(b->window, 24);
    assert_true(b->rope_factor == 2.5);
    assert_int_equal(b->eos_id, 7);
    free(s);
    drop(a);
    drop(b);
}

/* ------------------------------------------------------------------------------------------------
 * Aliases, defaults, quantization */

static void edit_use_flat_aliases(cJSON *root, cJSON *tc) {
    (void)root;
    /* The same values under the §1.2 inference-config names, inside text_config. */
    cJSON_AddItemToObject(tc, "dim", cJSON_DetachItemFromObject(tc, "hidden_size"));
    cJSON_AddItemToObject(tc, "window_size", cJSON_DetachItemFromObject(tc, "sliding_window"));
    cJSON_AddItemToObject(tc, "kv_source_layers", cJSON_DetachItemFromObject(tc, "kv_source_layer_ids"));
    cJSON_AddItemToObject(tc, "route_scale", cJSON_DetachItemFromObject(tc, "routed_scaling_factor"));
    cJSON_AddItemToObject(tc, "engram_pad_id", cJSON_DetachItemFromObject(tc, "engram_pad_token_id"));
    cJSON_AddItemToObject(tc, "n_mtp_layers", cJSON_DetachItemFromObject(tc, "num_nextn_predict_layers"));
    cJSON_DeleteItemFromObject(tc, "rope_scaling");
    set_num(tc, "rope_factor", 16);
    set_num(tc, "original_seq_len", 65536);
    set_num(tc, "beta_fast", 32);
    set_num(tc, "beta_slow", 1);
}

static void test_aliases_in_nested(void **state) {
    (void)state;
    struct model_config *a = load_ok(PRESET);
    struct model_config *b = calloc(1, sizeof *b);
    int rc = parse_edited(PRESET, edit_use_flat_aliases, "alias.json", b);
    if (rc) print_error("%s\n", ds_err_get());
    assert_int_equal(rc, 0);
    assert_cfg_equal(a, b);
    /* And the re-serialisation renames them back to the HF spelling. */
    char *s = config_to_json(b);
    assert_null(strstr(s, "\"window_size\""));
    assert_null(strstr(s, "\"rope_factor\""));
    assert_non_null(strstr(s, "\"sliding_window\""));
    assert_non_null(strstr(s, "\"original_max_position_embeddings\""));
    free(s);
    drop(a);
    drop(b);
}

static void edit_ids_and_betas(cJSON *root, cJSON *tc) {
    /* HF's usual layout: token ids only at the top level, next to text_config. */
    cJSON_DeleteItemFromObject(tc, "bos_token_id");
    cJSON_DeleteItemFromObject(tc, "eos_token_id");
    cJSON_DeleteItemFromObject(tc, "pad_token_id");
    set_num(root, "bos_token_id", 5);
    set_num(root, "eos_token_id", 6);
    set_num(root, "pad_token_id", 7);
    set_num(root, "image_token_id", 500);
    cJSON *rs = cJSON_GetObjectItem(tc, "rope_scaling");
    set_num(rs, "beta_fast", 24);
    set_num(rs, "beta_slow", 2);
}

static void test_ids_top_level_and_rope_betas(void **state) {
    (void)state;
    struct model_config *c = calloc(1, sizeof *c);
    int rc = parse_edited(golden("tp8pp2", "config.json"), edit_ids_and_betas, "ids.json", c);
    if (rc) print_error("%s\n", ds_err_get());
    assert_int_equal(rc, 0);
    assert_int_equal(c->bos_id, 5);
    assert_int_equal(c->eos_id, 6);
    assert_int_equal(c->pad_id, 7);
    assert_int_equal(c->image_token_id, 500);
    assert_true(c->beta_fast == 24.0);
    assert_true(c->beta_slow == 2.0);
    /* ...and they survive the HF re-serialisation. */
    char *s = config_to_json(c);
    struct model_config *b = calloc(1, sizeof *b);
    assert_int_equal(config_parse(s, "ids2.json", b), 0);
    assert_cfg_equal(c, b);
    free(s);
    drop(b);
    drop(c);
}

static void edit_strip_optional(cJSON *root, cJSON *tc) {
    static const char *const drop_keys[] = {
        "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "rope_theta", "compress_rope_theta",
        "rope_scaling", "n_shared_experts", "scoring_func", "norm_topk_prob", "routed_scaling_factor",
        "swiglu_limit", "candidate_source_layer_id", "candidate_topk_blocks", "candidate_block_size",
        "hc_sinkhorn_iters", "hc_eps", "engram_layer_ids", "engram_num_embeddings", "engram_max_ngram_size",
        "engram_n_heads", "engram_head_dim", "engram_vocab_size", "engram_compressed_vocab_size",
        "engram_pad_token_id", "num_nextn_predict_layers", "dspark_block_size", "dspark_noise_token_id",
        "dspark_target_layer_ids", "dspark_markov_rank", "dspark_n_routed_experts",
        "dspark_num_experts_per_tok", "bos_token_id", "eos_token_id", "pad_token_id"};
    for (size_t i = 0; i < sizeof drop_keys / sizeof drop_keys[0]; i++) {
        cJSON_DeleteItemFromObject(tc, drop_keys[i]);
        cJSON_DeleteItemFromObject(root, drop_keys[i]);
    }
    const int ratios[] = {0, 2, 2, 1, 1, 1}; /* no DSpark blocks now */
    set_ints(tc, "compress_ratios", ratios, 6);
}

static void test_defaults(void **state) {
    (void)state;
    struct model_config *c = calloc(1, sizeof *c);
    int rc = parse_edited(golden("small6", "config.json"), edit_strip_optional, "min.json", c);
    if (rc) print_error("%s\n", ds_err_get());
    assert_int_equal(rc, 0);
    assert_int_equal(c->n_kv_heads, 1);
    assert_true(c->norm_eps == 1e-20);
    assert_true(c->rope_theta == 10000.0);
    assert_int_equal(c->original_seq_len, 0);
    assert_int_equal(c->n_shared_experts, 1);
    assert_int_equal(c->score_func, CFG_SCORE_SQRTSOFTPLUS);
    assert_true(c->norm_topk_prob);
    assert_true(c->route_scale == 1.0);
    assert_true(c->swiglu_limit == 0.0);
    assert_true(c->gate_temp == 1.0);
    assert_int_equal(c->candidate_source, -1);
    assert_int_equal(c->hc_sinkhorn_iters, 20);
    assert_true(c->hc_eps == 1e-6);
    assert_int_equal(c->n_engram, 0);
    assert_int_equal(c->engram_pad_id, 2);
    assert_int_equal(c->n_mtp, 0);
    assert_int_equal(c->n_dspark_targets, 0);
    assert_int_equal(c->bos_id, 0);
    assert_int_equal(c->eos_id, 1);
    assert_int_equal(c->pad_id, 2);
    assert_int_equal(c->image_token_id, 129264);
    /* Without YaRN every layer's rope is plain; no candidate flags anywhere. */
    for (int l = 0; l < 6; l++) {
        assert_false(c->role[l].yarn);
        assert_false(c->role[l].uses_candidates);
        assert_false(c->role[l].is_candidate_source);
        assert_int_equal(c->role[l].engram_idx, -1);
    }
    assert_true(c->role[1].rope_theta == c->compress_rope_theta);
    assert_true(c->role[0].rope_theta == 10000.0);
    drop(c);
}

static void edit_no_quant(cJSON *root, cJSON *tc) {
    (void)tc;
    cJSON_DeleteItemFromObject(root, "quantization_config");
}
static void edit_flat_bf16(cJSON *root, cJSON *tc) {
    (void)tc;
    cJSON_ReplaceItemInObject(root, "dtype", cJSON_CreateString("bf16"));
    cJSON_ReplaceItemInObject(root, "expert_dtype", cJSON_CreateNull());
}
static void edit_flat_no_dtype(cJSON *root, cJSON *tc) {
    (void)tc;
    cJSON_DeleteItemFromObject(root, "dtype");
    cJSON_DeleteItemFromObject(root, "expert_dtype");
}
static void edit_block64(cJSON *root, cJSON *tc) {
    (void)tc;
    const int b[] = {64, 64};
    set_ints(cJSON_GetObjectItem(root, "quantization_config"), "weight_block_size", b, 2);
}

static void test_quantization(void **state) {
    (void)state;
    struct model_config *c = calloc(1, sizeof *c);
    assert_int_equal(parse_edited(golden("small6", "config.json"), edit_no_quant, "q.json", c), 0);
    assert_false(c->dense_fp8);
    assert_false(c->expert_fp4);
    char *s = config_to_json(c);
    assert_null(strstr(s, "quantization_config"));
    free(s);
    config_free(c);
    assert_int_equal(parse_edited(golden("small6", "inference_config.json"), edit_flat_bf16, "q.json", c), 0);
    assert_false(c->dense_fp8);
    assert_false(c->expert_fp4);
    config_free(c);
    /* ModelArgs defaults: dtype fp8, expert_dtype fp4. */
    assert_int_equal(parse_edited(golden("small6", "inference_config.json"), edit_flat_no_dtype, "q.json", c), 0);
    assert_true(c->dense_fp8);
    assert_true(c->expert_fp4);
    config_free(c);
    assert_int_equal(parse_edited(golden("small6", "config.json"), edit_block64, "q.json", c), 0);
    assert_int_equal(c->weight_block, 64);
    drop(c);
}

/* ------------------------------------------------------------------------------------------------
 * Errors */

static void edit_drop_hidden(cJSON *root, cJSON *tc) {
    (void)root;
    cJSON_DeleteItemFromObject(tc, "hidden_size");
}
static void edit_drop_dim(cJSON *root, cJSON *tc) {
    (void)tc;
    cJSON_DeleteItemFromObject(root, "dim");
}
static void edit_heads_string(cJSON *root, cJSON *tc) {
    (void)root;
    cJSON_ReplaceItemInObject(tc, "num_attention_heads", cJSON_CreateString("4"));
}
static void edit_vocab_fraction(cJSON *root, cJSON *tc) {
    (void)root;
    set_num(tc, "vocab_size", 512.5);
}
static void edit_topk_prob_int(cJSON *root, cJSON *tc) {
    (void)root;
    set_num(tc, "norm_topk_prob", 1);
}
static void edit_ratios_object(cJSON *root, cJSON *tc) {
    (void)root;
    cJSON_ReplaceItemInObject(tc, "compress_ratios", cJSON_CreateObject());
}
static void edit_ratios_short(cJSON *root, cJSON *tc) {
    (void)root;
    const int r[] = {0, 2, 2, 1, 1, 1}; /* 6 entries for 6 + 1 layers */
    set_ints(tc, "compress_ratios", r, 6);
}
static void edit_no_kv_below(cJSON *root, cJSON *tc) {
    (void)root;
    const int kv[] = {3}; /* layer 1 (ratio 2) has nothing at or below it */
    set_ints(tc, "kv_source_layer_ids", kv, 1);
}
static void edit_ratio_mismatch(cJSON *root, cJSON *tc) {
    (void)root;
    const int r[] = {0, 2, 1, 1, 1, 1, 0}; /* layer 2 (ratio 1) would read layer 1's ratio-2 cache */
    set_ints(tc, "compress_ratios", r, 7);
}
static void edit_dspark_ratio(cJSON *root, cJSON *tc) {
    (void)root;
    const int r[] = {0, 2, 2, 1, 1, 1, 1};
    set_ints(tc, "compress_ratios", r, 7);
}
static void edit_drop_index_topk(cJSON *root, cJSON *tc) {
    (void)root;
    cJSON_DeleteItemFromObject(tc, "index_topk");
}
static void edit_drop_engram_dim(cJSON *root, cJSON *tc) {
    (void)root;
    cJSON_DeleteItemFromObject(tc, "engram_head_dim");
}
static void edit_engram_out_of_range(cJSON *root, cJSON *tc) {
    (void)root;
    const int e[] = {0, 6};
    set_ints(tc, "engram_layer_ids", e, 2);
}
static void edit_groups(cJSON *root, cJSON *tc) {
    (void)root;
    set_num(tc, "o_groups", 3);
}
static void edit_rope_ge_head(cJSON *root, cJSON *tc) {
    (void)root;
    set_num(tc, "qk_rope_head_dim", 64);
}
static void edit_alias_conflict(cJSON *root, cJSON *tc) {
    (void)root;
    set_num(tc, "dim", 128);
}
static void edit_index_src_ratio0(cJSON *root, cJSON *tc) {
    (void)root;
    const int ix[] = {0, 1, 3, 5};
    set_ints(tc, "index_source_layer_ids", ix, 4);
}
static void edit_reindex_without_keys(cJSON *root, cJSON *tc) {
    (void)root;
    /* 3 stays a KV source but loses its indexer (and so cannot be the candidate source): it would
     * reuse layer 1's top-k over its own cache, and layer 5 would have no keys to score against. */
    const int ix[] = {1, 5};
    set_ints(tc, "index_source_layer_ids", ix, 2);
    set_num(tc, "candidate_source_layer_id", -1);
}
static void edit_score_name(cJSON *root, cJSON *tc) {
    (void)root;
    cJSON_ReplaceItemInObject(tc, "scoring_func", cJSON_CreateString("softplus"));
}

static void test_err_missing(void **state) {
    (void)state;
    expect_error(golden("small6", "config.json"), edit_drop_hidden, "hidden_size", "missing");
    expect_error(golden("small6", "inference_config.json"), edit_drop_dim, "dim", "missing");
    expect_error(golden("small6", "config.json"), edit_drop_index_topk, "index_topk", "missing");
    expect_error(golden("small6", "config.json"), edit_drop_engram_dim, "engram_head_dim", "missing");
}

static void test_err_type(void **state) {
    (void)state;
    expect_error(golden("small6", "config.json"), edit_heads_string, "num_attention_heads", "string");
    expect_error(golden("small6", "config.json"), edit_vocab_fraction, "vocab_size", "integer");
    expect_error(golden("small6", "config.json"), edit_topk_prob_int, "norm_topk_prob", NULL);
    expect_error(golden("small6", "config.json"), edit_ratios_object, "compress_ratios", "object");
    expect_error(golden("small6", "config.json"), edit_score_name, "scoring_func", "softplus");
}

static void test_err_schedule(void **state) {
    (void)state;
    expect_error(golden("small6", "config.json"), edit_ratios_short, "compress_ratios", "expected 7");
    expect_error(golden("small6", "config.json"), edit_no_kv_below, "kv_source_layer_ids", "layer 1");
    expect_error(golden("small6", "config.json"), edit_ratio_mismatch, "compress_ratios", "layer 2");
    expect_error(golden("small6", "config.json"), edit_dspark_ratio, "compress_ratios", "DSpark");
    expect_error(golden("small6", "config.json"), edit_engram_out_of_range, "engram_layer_ids", "6");
    expect_error(golden("small6", "config.json"), edit_index_src_ratio0, "index_source_layer_ids", "layer 0");
    expect_error(golden("small6", "config.json"), edit_reindex_without_keys, "index_source_layer_ids", "older than its KV source 3");
}

static void test_err_shape(void **state) {
    (void)state;
    expect_error(golden("small6", "config.json"), edit_groups, "o_groups", NULL);
    expect_error(golden("small6", "config.json"), edit_rope_ge_head, "head_dim", NULL);
    expect_error(golden("small6", "config.json"), edit_alias_conflict, "dim", "hidden_size");
}

static void test_err_bad_json(void **state) {
    (void)state;
    struct model_config *c = calloc(1, sizeof *c);
    assert_int_equal(config_parse("{\n  \"text_config\": {\"vocab_size\": 512,,}\n}", "broken.json", c), -1);
    assert_non_null(strstr(ds_err_get(), "broken.json"));
    assert_non_null(strstr(ds_err_get(), "line 2"));
    assert_null(c->json);
    assert_int_equal(config_parse("[1, 2]", "array.json", c), -1);
    assert_non_null(strstr(ds_err_get(), "array.json"));
    assert_int_equal(config_parse("{\"text_config\": 3}", "tc.json", c), -1);
    assert_non_null(strstr(ds_err_get(), "tc.json: text_config"));
    assert_int_equal(config_load("/nonexistent/dir/config.json", c), -1);
    assert_non_null(strstr(ds_err_get(), "/nonexistent/dir/config.json"));
    drop(c);
}

/* config_derive_roles is also called on hand-built structs (mkmodel): it must validate by itself. */
static void test_derive_roles_direct(void **state) {
    (void)state;
    struct model_config *c = load_ok(golden("tp8pp2", "config.json"));
    c->kv_sources[0] = 3; /* list {3, 4}: layer 2 (ratio 2) now has no KV source at or below it */
    assert_int_equal(config_derive_roles(c), -1);
    assert_non_null(strstr(ds_err_get(), "kv_source_layer_ids"));
    c->kv_sources[0] = 2;
    c->candidate_source = 5; /* not an index source */
    assert_int_equal(config_derive_roles(c), -1);
    assert_non_null(strstr(ds_err_get(), "candidate_source_layer_id"));
    c->candidate_source = -1; /* candidates off: 6 becomes a plain re-index layer */
    assert_int_equal(config_derive_roles(c), 0);
    assert_false(c->role[6].uses_candidates);
    assert_true(c->role[6].is_index_source);
    assert_false(c->role[4].is_candidate_source);
    c->candidate_source = 4;
    assert_int_equal(config_derive_roles(c), 0);
    assert_true(c->role[6].uses_candidates);
    drop(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_real_fields),
        cmocka_unit_test(test_real_roles),
        cmocka_unit_test(test_real_print_roles),
        cmocka_unit_test(test_small6_roles),
        cmocka_unit_test(test_tp8pp2_roles),
        cmocka_unit_test(test_flat_equals_nested_small6),
        cmocka_unit_test(test_flat_equals_nested_tp8pp2),
        cmocka_unit_test(test_roundtrip),
        cmocka_unit_test(test_to_json_uses_struct),
        cmocka_unit_test(test_aliases_in_nested),
        cmocka_unit_test(test_ids_top_level_and_rope_betas),
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_quantization),
        cmocka_unit_test(test_err_missing),
        cmocka_unit_test(test_err_type),
        cmocka_unit_test(test_err_schedule),
        cmocka_unit_test(test_err_shape),
        cmocka_unit_test(test_err_bad_json),
        cmocka_unit_test(test_derive_roles_direct),
    };
    return cmocka_run_group_tests_name("config", tests, NULL, NULL);
}
