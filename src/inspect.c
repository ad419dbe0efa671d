/* `dsbatch inspect MODEL_DIR [--tp N --pp N]`: validate a model folder and account for its bytes.
 *
 * The folder goes through loader_open, the same path every engine command takes, so a folder that
 * inspects cleanly is one the engine will load: config parsed and cross-checked, every shard header
 * validated, every tensor's name, dtype and shape matched against the config, the Engram sidecar
 * checked against the primes. Then it prints what an operator needs to plan a deployment: the
 * config summary, the per-layer role table, parameters and bytes by role and by dtype (checked
 * against the index's total_size), and, with --tp/--pp, how many bytes each rank maps. The per-rank
 * numbers come from weights_bind itself, with the pipeline split computed here (an even split
 * moved to the nearest cut that no KV- or top-k-sharing group crosses), so the table shows exactly
 * the slices the engine would bind. Any load error is one line naming the file and the tensor or
 * key, exit status 1. */
#include <cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cli_args.h"
#include "config.h"
#include "h5io.h"
#include "loader.h"
#include "log.h"
#include "safetensors.h"
#include "weights.h"

/* ------------------------------------------------------------------------------------------------
 * Roles of tensors, by their official names (MODEL.md §2) */

enum role_id {
    R_ATTN,
    R_COMPRESSOR,
    R_INDEXER,
    R_MHC,
    R_ROUTER,
    R_EXPERTS,
    R_SHARED,
    R_ENGRAM_TABLE,
    R_ENGRAM_PROJ,
    R_EMBED,
    R_HEAD,
    R_NORMS,
    R_DSPARK,
    R_VISION,
    R_OTHER,
    R_N
};

static const char *const ROLE_NAMES[R_N] = {
    "attention",      "compressor",    "indexer",       "mHC",          "router",
    "routed experts", "shared expert", "engram tables", "engram proj.", "embed",
    "head",           "norms",         "DSpark",        "vision (ignored)", "other",
};

static bool starts(const char *s, const char *prefix) { return strncmp(s, prefix, strlen(prefix)) == 0; }

static enum role_id classify(const char *name) {
    if (!strcmp(name, "embed.weight")) return R_EMBED;
    if (!strcmp(name, "head.weight")) return R_HEAD;
    if (!strcmp(name, "norm.weight")) return R_NORMS;
    /* A DSpark block is one unit for planning: it always lives whole on the last stage. */
    if (starts(name, "mtp.")) return R_DSPARK;
    if (starts(name, "vision.") || starts(name, "aligner.") || starts(name, "image_")) return R_VISION;
    if (!starts(name, "layers.")) return R_OTHER;
    const char *p = strchr(name + 7, '.');
    if (!p) return R_OTHER;
    p++;
    if (starts(p, "attn.compressor.")) return R_COMPRESSOR;
    if (starts(p, "attn.indexer.")) return R_INDEXER;
    if (starts(p, "attn.")) return R_ATTN;
    if (starts(p, "hc_")) return R_MHC;
    if (starts(p, "ffn.gate.")) return R_ROUTER;
    if (starts(p, "ffn.experts.")) return R_EXPERTS;
    if (starts(p, "ffn.shared_experts.")) return R_SHARED;
    if (starts(p, "engram.embed.")) return R_ENGRAM_TABLE;
    if (starts(p, "engram.")) return R_ENGRAM_PROJ;
    if (starts(p, "attn_norm.") || starts(p, "ffn_norm.")) return R_NORMS;
    return R_OTHER;
}

/* Weights count as parameters; E8M0 scale tensors do not, and an I8 byte packs two FP4 values. */
static int64_t params_of(const struct st_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    if (t->dtype == ST_F8_E8M0) return 0;
    if (t->dtype == ST_I8) return 2 * n;
    return n;
}

/* ------------------------------------------------------------------------------------------------
 * Formatting */

static const char *human(double b, char *buf, size_t n) {
    static const char *const units[] = {"B", "KB", "MB", "GB", "TB"};
    int u = 0;
    while (b >= 1000.0 && u < 4) b /= 1000.0, u++;
    snprintf(buf, n, u ? "%.2f %s" : "%.0f %s", b, units[u]);
    return buf;
}

static const char *count_str(double v, char *buf, size_t n) {
    if (v >= 1e9)
        snprintf(buf, n, "%.2fB", v / 1e9);
    else if (v >= 1e6)
        snprintf(buf, n, "%.2fM", v / 1e6);
    else if (v >= 1e3)
        snprintf(buf, n, "%.1fK", v / 1e3);
    else
        snprintf(buf, n, "%.0f", v);
    return buf;
}

static void int_list(char *out, size_t n, const int *a, int cnt) {
    size_t off = 0;
    out[0] = '\0';
    for (int i = 0; i < cnt && off < n; i++) off += (size_t)snprintf(out + off, n - off, i ? ",%d" : "%d", a[i]);
    if (cnt == 0) snprintf(out, n, "none");
}

static void print_config(const struct loaded_model *lm) {
    const struct model_config *c = &lm->cfg;
    char a[512], b[512];
    printf("config   %s\n", c->source);
    printf("  backbone %d layers + %d DSpark block%s; hidden %d; vocab %d; max positions %lld\n", c->n_layers,
           c->n_mtp, c->n_mtp == 1 ? "" : "s", c->dim, c->vocab_size, (long long)c->max_pos);
    printf("  attention %d heads x %d (RoPE %d); q_lora %d; output %d groups x %d; window %d\n", c->n_heads,
           c->head_dim, c->rope_dim, c->q_lora_rank, c->o_groups, c->o_lora_rank, c->window);
    int_list(a, sizeof a, c->kv_sources, c->n_kv_sources);
    int_list(b, sizeof b, c->index_sources, c->n_index_sources);
    printf("  compressed KV sources %s; index sources %s; candidate source %d; indexer %d x %d, top-%d\n", a, b,
           c->candidate_source, c->index_n_heads, c->index_head_dim, c->index_topk);
    printf("  RoPE theta %g / %g (compressed)", c->rope_theta, c->compress_rope_theta);
    if (c->original_seq_len > 0)
        printf(", YaRN factor %g over %lld\n", c->rope_factor, (long long)c->original_seq_len);
    else
        printf(", no YaRN\n");
    printf("  MoE %d routed experts (top %d), inter %d, %d shared; DSpark %d experts (top %d)\n", c->n_routed_experts,
           c->n_active_experts, c->moe_inter_dim, c->n_shared_experts, c->dspark_n_routed, c->dspark_n_active);
    printf("  mHC %d copies, %d Sinkhorn iterations\n", c->hc_mult, c->hc_sinkhorn_iters);
    if (c->n_engram > 0) {
        int_list(a, sizeof a, c->engram_layer_ids, c->n_engram);
        size_t off = 0;
        for (int i = 0; i < c->n_engram && off < sizeof b; i++)
            off += (size_t)snprintf(b + off, sizeof b - off, i ? ", %lld" : "%lld", (long long)c->engram_num_embeddings[i]);
        printf("  Engram layers %s: %d heads x %d, n-grams 2..%d, rows %s; compressed vocab %lld%s\n", a,
               c->engram_n_heads, c->engram_head_dim, c->engram_max_ngram, b, (long long)c->engram_compressed_vocab,
               lm->have_token_map ? " (token map from engram.safetensors)" : "");
    } else {
        printf("  Engram: none\n");
    }
    if (c->n_mtp > 0) {
        int_list(a, sizeof a, c->dspark_targets, c->n_dspark_targets);
        printf("  DSpark block size %d, taps %s, Markov rank %d\n", c->dspark_block_size, a, c->dspark_markov_rank);
    }
}

/* ------------------------------------------------------------------------------------------------
 * Accounting */

struct tally {
    int64_t tensors, params;
    uint64_t bytes;
};

/* metadata.total_size of the index, or -1 when the folder has no index. */
static int64_t index_total(const char *dir) {
    char path[1024];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = ds_malloc(len > 0 ? (size_t)len + 1 : 1);
    size_t got = len > 0 ? fread(buf, 1, (size_t)len, f) : 0;
    buf[got] = '\0';
    fclose(f);
    cJSON *root = cJSON_Parse(buf);
    free(buf);
    const cJSON *ts = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(root, "metadata"), "total_size");
    int64_t v = cJSON_IsNumber(ts) ? (int64_t)ts->valuedouble : -2;
    cJSON_Delete(root);
    if (v == -2) ds_die("%s: metadata.total_size: missing or not a number", path);
    return v;
}

static void print_accounting(const struct loaded_model *lm) {
    struct tally role[R_N] = {{0}}, dt[ST_NDTYPES] = {{0}}, all = {0};
    const struct st_model *st = &lm->st;
    for (int i = 0; i < st->n_tensors; i++) {
        const struct st_tensor *t = &st->tensors[i];
        struct tally *tl[3] = {&role[classify(t->name)], &dt[t->dtype], &all};
        int64_t p = params_of(t);
        for (int k = 0; k < 3; k++) tl[k]->tensors++, tl[k]->params += p, tl[k]->bytes += t->nbytes;
    }
    char h1[32], h2[32];
    printf("by role            tensors       params            bytes\n");
    for (int r = 0; r < R_N; r++) {
        if (!role[r].tensors) continue;
        printf("  %-16s %7lld %12s %16llu  (%s, %.2f%%)\n", ROLE_NAMES[r], (long long)role[r].tensors,
               count_str((double)role[r].params, h1, sizeof h1), (unsigned long long)role[r].bytes,
               human((double)role[r].bytes, h2, sizeof h2), 100.0 * (double)role[r].bytes / (double)(all.bytes ? all.bytes : 1));
    }
    printf("by dtype           tensors       params            bytes\n");
    for (int d = 0; d < ST_NDTYPES; d++) {
        if (!dt[d].tensors) continue;
        printf("  %-16s %7lld %12s %16llu  (%s)\n", st_dtype_name((enum st_dtype)d), (long long)dt[d].tensors,
               count_str((double)dt[d].params, h1, sizeof h1), (unsigned long long)dt[d].bytes,
               human((double)dt[d].bytes, h2, sizeof h2));
    }
    int64_t idx = index_total(lm->dir);
    printf("total    %lld tensors in %d shard%s, %s parameters, %llu bytes (%s)", (long long)all.tensors, st->n_shards,
           st->n_shards == 1 ? "" : "s", count_str((double)all.params, h1, sizeof h1), (unsigned long long)all.bytes,
           human((double)all.bytes, h2, sizeof h2));
    if (idx < 0) {
        printf("; no index\n");
    } else if ((uint64_t)idx == all.bytes) {
        printf("; index total_size %lld matches\n", (long long)idx);
    } else {
        printf("\n");
        fflush(stdout);
        ds_die("%s/model.safetensors.index.json: metadata.total_size is %lld but the shards hold %llu tensor bytes",
               lm->dir, (long long)idx, (unsigned long long)all.bytes);
    }
}

/* ------------------------------------------------------------------------------------------------
 * Pipeline split */

/* A cut before layer `cut` is valid when no later layer reads state (compressed KV, published
 * top-k, candidate blocks) produced before it: those live on one stage and are never sent. */
static bool valid_cut(const struct model_config *c, int cut) {
    for (int l = cut; l < c->n_layers; l++) {
        const struct layer_role *r = &c->role[l];
        if (r->kv_src >= 0 && r->kv_src < cut) return false;
        if (r->topk_src >= 0 && r->topk_src < cut) return false;
        if (r->uses_candidates && c->candidate_source >= 0 && c->candidate_source < cut) return false;
    }
    return true;
}

/* begin[0..pp]: stage s runs layers [begin[s], begin[s+1]). Even split, each cut moved to the
 * nearest valid boundary (ties to the earlier one) that leaves every stage at least one layer. */
static void plan_stages(const struct model_config *c, int pp, int *begin) {
    int n = c->n_layers;
    if (pp > n) ds_die("--pp %d: more pipeline stages than the %d backbone layers", pp, n);
    begin[0] = 0;
    begin[pp] = n;
    for (int s = 1; s < pp; s++) {
        int ideal = (int)(((int64_t)s * n + pp / 2) / pp), lo = begin[s - 1] + 1, hi = n - (pp - s), found = -1;
        for (int d = 0; d <= n && found < 0; d++) {
            if (ideal - d >= lo && ideal - d <= hi && valid_cut(c, ideal - d))
                found = ideal - d;
            else if (ideal + d >= lo && ideal + d <= hi && valid_cut(c, ideal + d))
                found = ideal + d;
        }
        if (found < 0)
            ds_die("%s: cannot split %d layers into %d pipeline stages without cutting a KV-sharing group", c->source, n,
                   pp);
        begin[s] = found;
    }
}

static void print_ranks(struct loaded_model *lm, int tp, int pp) {
    int begin[CFG_MAX_LAYERS + 1];
    plan_stages(&lm->cfg, pp, begin);
    printf("ranks (TP %d x PP %d; rank = stage * %d + tp rank)\n", tp, pp, tp);
    printf("  %4s  %5s  %2s  %-10s %16s %-12s %12s %14s\n", "rank", "stage", "tp", "layers", "bytes mapped", "",
           "engram", "experts");
    uint64_t sum = 0;
    char h[32];
    for (int s = 0; s < pp; s++) {
        for (int r = 0; r < tp; r++) {
            struct bind_opts o = {.tp_rank = r, .tp_size = tp, .layer_begin = begin[s], .layer_end = begin[s + 1],
                                  .first_stage = s == 0, .last_stage = s == pp - 1};
            struct model_weights mw;
            if (weights_bind(&mw, &lm->cfg, &lm->st, &o)) ds_die_err();
            char layers[64];
            int n = snprintf(layers, sizeof layers, "%d-%d", begin[s], begin[s + 1] - 1);
            if (o.last_stage && lm->cfg.n_mtp > 0) snprintf(layers + n, sizeof layers - (size_t)n, "+mtp");
            char hb[40];
            snprintf(hb, sizeof hb, "(%s)", human((double)mw.bytes_total, h, sizeof h));
            printf("  %4d  %5d  %2d  %-10s %16llu %-12s %12llu %14llu\n", s * tp + r, s, r, layers,
                   (unsigned long long)mw.bytes_total, hb,
                   (unsigned long long)mw.bytes_engram, (unsigned long long)mw.bytes_experts);
            sum += mw.bytes_total;
            weights_free(&mw);
        }
    }
    printf("  all ranks map %llu bytes (%s)\n", (unsigned long long)sum, human((double)sum, h, sizeof h));
}

/* ------------------------------------------------------------------------------------------------
 * Command */

static void usage(FILE *f) {
    fprintf(f, "usage: dsbatch inspect MODEL_DIR [--tp N] [--pp N]\n"
               "  Validate every tensor of a model folder against its config and print the config, the role\n"
               "  table, parameters and bytes by role and dtype; with --tp/--pp also the bytes each rank maps.\n");
}

int cmd_inspect(int argc, char **argv) {
    const char *dir = NULL;
    int tp = 0, pp = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--tp") || !strcmp(a, "--pp")) {
            if (i + 1 >= argc) ds_die("inspect: %s needs a value", a);
            *(a[2] == 't' ? &tp : &pp) = (int)cli_int(a, argv[++i], 1, 4096);
        } else if (!strncmp(a, "--tp=", 5) || !strncmp(a, "--pp=", 5)) {
            *(a[2] == 't' ? &tp : &pp) = (int)cli_int(a, a + 5, 1, 4096);
        } else if (a[0] == '-' && a[1]) {
            ds_die("inspect: unknown option '%s' (see --help)", a);
        } else if (dir) {
            ds_die("inspect: more than one path given ('%s' and '%s')", dir, a);
        } else {
            dir = a;
        }
    }
    if (!dir) {
        usage(stderr);
        return 2;
    }
    size_t dl = strlen(dir);
    if (dl >= 3 && !strcmp(dir + dl - 3, ".h5")) { /* output or prompt file: src/h5inspect.c */
        if (h5_inspect(dir, stdout)) ds_die_err();
        return 0;
    }

    struct loaded_model *lm = ds_calloc(1, sizeof *lm);
    if (loader_open(lm, dir, NULL)) ds_die_err();
    printf("model    %s: %d tensors validated\n", dir, (int)lm->w.n_tensors_checked);
    print_config(lm);
    printf("roles\n");
    config_print_roles(stdout, &lm->cfg);
    print_accounting(lm);
    if (tp > 0 || pp > 0) print_ranks(lm, tp > 0 ? tp : 1, pp > 0 ? pp : 1);
    loader_close(lm);
    free(lm);
    return 0;
}
