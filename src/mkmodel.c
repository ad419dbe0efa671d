/* `dsbatch mkmodel`: write a synthetic checkpoint in the official DeepSeek-V4.1 format.
 *
 * The engine, the tests and the benchmarks need models of any geometry, from the 6-layer golden
 * shape up to slices of the real 40-layer model, without downloading 510 GB. This command takes a
 * preset config (data/presets/NAME.json), applies geometry overrides and an optional layer/expert
 * slice, re-validates the result through the one config parser, and writes a folder that the
 * loader cannot tell from a release: config.json, model-0000K-of-0000N.safetensors shards with
 * every tensor named, typed and shaped as in MODEL.md §2 (FP8 tiles, packed FP4 experts, Engram
 * rows, F32 mHC, BF16 norms, DSpark blocks), model.safetensors.index.json, and the Engram
 * sidecar (token map and hash constants). Weights are seeded random numbers from a counter-based
 * generator, so every element depends only on (seed, tensor name, index): output is byte-identical
 * across runs and thread counts, and generation parallelises freely. Magnitudes follow the golden
 * models' init (1/sqrt(fan_in) projections, unit norms with small noise) so a forward pass stays
 * in range. The folder appears atomically: it is built in DIR.tmp-XXXXXX and renamed at the end. */
#include <cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "cli_args.h"
#include "config.h"
#include "engram_hash.h"
#include "formats.h"
#include "log.h"
#include "safetensors.h"
#include "synth.h"
#include "tokenizer.h"

#define SHARD_LIMIT 2000000000ull /* bytes per shard before starting a new one (~2 GB) */

/* ------------------------------------------------------------------------------------------------
 * Inventory (synth.c: every tensor of the checkpoint with the rule that generates its data), split
 * into shards */

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

static int assign_shards(struct synth_inventory *inv) {
    int shard = 0;
    uint64_t used = 0;
    for (int i = 0; i < inv->n; i++) {
        uint64_t unit = inv->t[i].nbytes;
        bool pair_head = inv->t[i].partner == i + 1;
        if (pair_head) unit += inv->t[i + 1].nbytes;
        if (used > 0 && used + unit > SHARD_LIMIT) {
            shard++;
            used = 0;
        }
        inv->t[i].shard = shard;
        if (pair_head) inv->t[++i].shard = shard;
        used += unit;
    }
    return shard + 1;
}

/* ------------------------------------------------------------------------------------------------
 * Counter-based random numbers: value i of a tensor is a pure function of (seed, name, i). */

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Sum of four 16-bit uniforms (Irwin-Hall), centred and scaled to unit variance: one hash per
 * value, and tails bounded at ±3.46σ, which keeps random activations tame. */
static inline float gauss_at(uint64_t base, int64_t i) {
    uint64_t r = mix64(base + (uint64_t)(i + 1) * 0x9e3779b97f4a7c15ull);
    uint32_t s = (uint32_t)(r & 0xffff) + (uint32_t)((r >> 16) & 0xffff) + (uint32_t)((r >> 32) & 0xffff) +
                 (uint32_t)(r >> 48);
    return (((float)s + 2.0f) / 65536.0f - 2.0f) * 1.7320508f;
}

static uint64_t stream_base(uint64_t seed, uint64_t key) { return mix64(mix64(seed ^ 0x5eed5eed5eed5eedull) ^ key); }

/* ------------------------------------------------------------------------------------------------
 * Tensor data generation */

/* Threads only pay off on big tensors: a tiny model's hundreds of small parallel regions would
 * spend longer in OpenMP barriers than in generating numbers, badly so on a loaded machine. */
#define PAR_MIN ((int64_t)1 << 18)

static void gen_f32(float *out, int64_t n, uint64_t base, float mean, float std) {
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
    for (int64_t i = 0; i < n; i++) out[i] = mean + std * gauss_at(base, i);
}

static void gen_bf16(bf16_t *out, int64_t n, uint64_t base, float mean, float std) {
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
    for (int64_t i = 0; i < n; i++) out[i] = bf16_from_f32(mean + std * gauss_at(base, i));
}

/* Quantized pairs, generated in stripes of rows (32 for FP8 tiles) so only the output bytes are
 * held whole; each stripe uses the element's flat index, so the stripe size does not matter. */
static void gen_quant(enum synth_gen kind, int64_t n, int64_t k, uint64_t base, float std, uint8_t *q, uint8_t *s) {
    const int64_t rows = kind == SYNTH_FP8_W ? 32 : 64;
    const int64_t n_stripes = cdiv(n, rows), tk = cdiv(k, 32);
#pragma omp parallel if (n * k >= PAR_MIN)
    {
        float *buf = ds_malloc((size_t)(rows * k) * sizeof *buf);
#pragma omp for schedule(dynamic, 1)
        for (int64_t si = 0; si < n_stripes; si++) {
            int64_t r0 = si * rows, rn = n - r0 < rows ? n - r0 : rows;
            for (int64_t e = 0; e < rn * k; e++) buf[e] = std * gauss_at(base, r0 * k + e);
            if (kind == SYNTH_FP8_W) {
                quant_fp8_tiles(buf, rn, k, q + r0 * k, s + si * tk);
            } else if (kind == SYNTH_FP4_W) {
                quant_fp4_rows(buf, rn, k, q + r0 * (k / 2), s + r0 * (k / 32));
            } else {
                /* A one-row "tile" is exactly the Engram layout: a scale per 32 columns of a row. */
                for (int64_t r = 0; r < rn; r++)
                    quant_fp8_tiles(buf + r * k, 1, k, q + (r0 + r) * k, s + (r0 + r) * (k / 32));
            }
        }
        free(buf);
    }
}

/* The half of a quantized pair generated ahead of its turn (its partner was written first). */
struct pending {
    int idx;
    uint8_t *buf;
};

static int write_tensor(struct st_writer *w, int widx, const struct synth_inventory *inv, int i, struct pending *pend,
                        uint64_t seed) {
    const struct synth_tensor *t = &inv->t[i];
    uint64_t base = stream_base(seed, t->key);
    int64_t count = (int64_t)(t->nbytes / st_dtype_size(t->dt));
    int rc;
    if (t->kind == SYNTH_F32 || t->kind == SYNTH_BF16) {
        void *buf = ds_malloc(t->nbytes);
        if (t->kind == SYNTH_F32)
            gen_f32(buf, count, base, t->mean, t->std);
        else
            gen_bf16(buf, count, base, t->mean, t->std);
        rc = st_writer_write(w, widx, buf, t->nbytes);
        free(buf);
        return rc;
    }
    if (pend->idx == i) {
        rc = st_writer_write(w, widx, pend->buf, t->nbytes);
        free(pend->buf);
        pend->buf = NULL;
        pend->idx = -1;
        return rc;
    }
    if (pend->idx >= 0) {
        ds_err_set("mkmodel: internal error: %s is not next to %s in its shard", inv->t[pend->idx].name,
                   inv->t[inv->t[pend->idx].partner].name);
        return -1;
    }
    bool is_w = t->kind == SYNTH_FP8_W || t->kind == SYNTH_FP4_W || t->kind == SYNTH_ROWS_W;
    const struct synth_tensor *tw = is_w ? t : &inv->t[t->partner], *ts = is_w ? &inv->t[t->partner] : t;
    uint8_t *q = ds_malloc(tw->nbytes), *s = ds_malloc(ts->nbytes);
    gen_quant(tw->kind, tw->n, tw->k, base, tw->std, q, s);
    rc = st_writer_write(w, widx, is_w ? q : s, t->nbytes);
    pend->idx = t->partner;
    pend->buf = is_w ? s : q;
    free(is_w ? q : s);
    return rc;
}

/* ------------------------------------------------------------------------------------------------
 * Output folder: built under DIR.tmp-XXXXXX, removed again on any failure. */

static char g_tmpdir[4096];

static void remove_tmpdir(void) {
    if (!g_tmpdir[0]) return;
    DIR *d = opendir(g_tmpdir);
    if (d) {
        struct dirent *e;
        char p[8192];
        while ((e = readdir(d)) != NULL) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            snprintf(p, sizeof p, "%s/%s", g_tmpdir, e->d_name);
            unlink(p);
        }
        closedir(d);
    }
    rmdir(g_tmpdir);
    g_tmpdir[0] = '\0';
}

static void __attribute__((noreturn)) fail_out(void) {
    remove_tmpdir();
    ds_die_err();
}

static void write_text(const char *dir, const char *name, const char *text) {
    char p[8192];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "wb");
    if (!f) {
        ds_err_set("%s: cannot create: %s", p, ds_errno_str());
        fail_out();
    }
    size_t n = strlen(text);
    bool ok = fwrite(text, 1, n, f) == n && fputc('\n', f) != EOF;
    ok = (fflush(f) == 0) && ok && fsync(fileno(f)) == 0;
    if (fclose(f) != 0 || !ok) {
        ds_err_set("%s: write failed: %s", p, ds_errno_str());
        fail_out();
    }
}

/* Refuse a non-empty DIR; an empty one is replaced by the rename. Checked again just before the
 * rename, when the temporary folder exists and must go if DIR appeared meanwhile. */
static void check_out_dir(const char *dir) {
    struct stat sb;
    if (stat(dir, &sb) != 0) {
        if (errno == ENOENT) return;
        ds_err_set("%s: cannot stat: %s", dir, ds_errno_str());
        fail_out();
    }
    if (!S_ISDIR(sb.st_mode)) {
        ds_err_set("%s: exists and is not a directory; refusing to overwrite it", dir);
        fail_out();
    }
    DIR *d = opendir(dir);
    if (!d) {
        ds_err_set("%s: cannot open: %s", dir, ds_errno_str());
        fail_out();
    }
    struct dirent *e;
    bool empty = true;
    while ((e = readdir(d)) != NULL)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) empty = false;
    closedir(d);
    if (!empty) {
        ds_err_set("%s: exists and is not empty; refusing to overwrite it (choose another --out)", dir);
        fail_out();
    }
}

static void parent_of(const char *path, char *out, size_t n) {
    snprintf(out, n, "%s", path);
    size_t len = strlen(out);
    while (len > 1 && out[len - 1] == '/') out[--len] = '\0';
    char *slash = strrchr(out, '/');
    if (!slash)
        snprintf(out, n, ".");
    else if (slash == out)
        out[1] = '\0';
    else
        *slash = '\0';
}

static uint64_t mem_available(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    uint64_t kb = 0;
    char line[256];
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %" SCNu64 " kB", &kb) == 1) break;
    if (f) fclose(f);
    return kb ? kb * 1024 : UINT64_MAX;
}

/* ------------------------------------------------------------------------------------------------
 * Config: preset + overrides + slice, validated by the config parser at every step */

static void find_preset(const char *name, char *out, size_t n) {
    if (strchr(name, '/') || strstr(name, ".json")) {
        snprintf(out, n, "%s", name);
        return;
    }
    char exe[4096], dirs[3][4096];
    int nd = 0;
    const char *env = getenv("DSBATCH_PRESETS");
    if (env && env[0]) snprintf(dirs[nd++], sizeof dirs[0], "%s", env);
    ssize_t el = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (el > 0) {
        exe[el] = '\0';
        char bin[4096];
        parent_of(exe, bin, sizeof bin);
        snprintf(dirs[nd++], sizeof dirs[0], "%.4000s/../data/presets", bin);
    }
    snprintf(dirs[nd++], sizeof dirs[0], "data/presets");
    for (int i = 0; i < nd; i++) {
        snprintf(out, n, "%.4000s/%.60s.json", dirs[i], name);
        if (access(out, R_OK) == 0) return;
    }
    ds_die("--preset %s: no %s.json in $DSBATCH_PRESETS, <dsbatch>/../data/presets or ./data/presets "
           "(presets: tiny, tp8pp2, v41-flash, or a path to a config.json)",
           name, name);
}

static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) ds_die("%s: cannot open: %s", path, ds_errno_str());
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    if (len < 0) ds_die("%s: cannot read", path);
    char *buf = ds_malloc((size_t)len + 1);
    if (fread(buf, 1, (size_t)len, f) != (size_t)len) ds_die("%s: read failed", path);
    buf[len] = '\0';
    fclose(f);
    return buf;
}

/* "a.b" reaches into the sub-object a, so --rope_scaling.factor 8 works like any key. */
static cJSON *json_path(cJSON *obj, const char *path, cJSON **parent, const char **leaf) {
    char head[128];
    const char *dot = strchr(path, '.');
    if (!dot) {
        *parent = obj;
        *leaf = path;
        return cJSON_GetObjectItemCaseSensitive(obj, path);
    }
    size_t n = (size_t)(dot - path);
    if (n >= sizeof head) return NULL;
    memcpy(head, path, n);
    head[n] = '\0';
    cJSON *sub = cJSON_GetObjectItemCaseSensitive(obj, head);
    return cJSON_IsObject(sub) ? json_path(sub, dot + 1, parent, leaf) : NULL;
}

static void json_set_int(cJSON *obj, const char *key, double v) {
    if (cJSON_GetObjectItemCaseSensitive(obj, key))
        cJSON_ReplaceItemInObjectCaseSensitive(obj, key, cJSON_CreateNumber(v));
    else
        cJSON_AddNumberToObject(obj, key, v);
}

static int json_int(const cJSON *obj, const char *key, int def) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);
    return cJSON_IsNumber(it) ? it->valueint : def;
}

struct mk_args {
    const char *preset, *out;
    uint64_t seed; /* default 0 */
    int layer_a, layer_b; /* -1: all */
    int experts;          /* 0: as the preset */
    int64_t max_pos;      /* 0: as the preset */
    bool dry_run;         /* print the plan (sizes, shards) and write nothing */
    int n_over;
    const char *over_key[64], *over_val[64];
};

static void apply_overrides(cJSON *tc, const struct mk_args *a, const char *preset, bool *user_emb) {
    *user_emb = false;
    for (int i = 0; i < a->n_over; i++) {
        cJSON *parent;
        const char *leaf;
        cJSON *old = json_path(tc, a->over_key[i], &parent, &leaf);
        if (!old)
            ds_die("unknown option --%s (neither a mkmodel option nor a text_config key of preset %s)",
                   a->over_key[i], preset);
        /* Values are JSON (numbers, true/false, [lists]); anything else is taken as a string. */
        cJSON *v = cJSON_Parse(a->over_val[i]);
        if (!v) v = cJSON_CreateString(a->over_val[i]);
        cJSON_ReplaceItemInObjectCaseSensitive(parent, leaf, v);
        if (!strcmp(a->over_key[i], "engram_num_embeddings")) *user_emb = true;
    }
    if (a->max_pos > 0) json_set_int(tc, "max_position_embeddings", (double)a->max_pos);
    if (a->experts > 0) {
        int n = a->experts, k = json_int(tc, "num_experts_per_tok", n);
        json_set_int(tc, "n_routed_experts", n);
        json_set_int(tc, "num_experts_per_tok", k < n ? k : n);
        int dn = json_int(tc, "dspark_n_routed_experts", n), dk = json_int(tc, "dspark_num_experts_per_tok", 0);
        if (dn > n) dn = n;
        json_set_int(tc, "dspark_n_routed_experts", dn);
        if (dk > 0) json_set_int(tc, "dspark_num_experts_per_tok", dk < dn ? dk : dn);
    }
    /* Table rows follow from the primes (computed later); a placeholder of the right length lets
     * the parser accept a changed engram_layer_ids list. */
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(tc, "engram_layer_ids");
    if (!*user_emb && cJSON_IsArray(ids)) {
        cJSON *ph = cJSON_CreateArray();
        for (int i = 0; i < cJSON_GetArraySize(ids); i++) cJSON_AddItemToArray(ph, cJSON_CreateNumber(1));
        if (cJSON_GetObjectItemCaseSensitive(tc, "engram_num_embeddings"))
            cJSON_ReplaceItemInObjectCaseSensitive(tc, "engram_num_embeddings", ph);
        else
            cJSON_AddItemToObject(tc, "engram_num_embeddings", ph);
    }
}

/* Keep list entries inside [lo, hi], renumbered from lo. */
static void slice_list(int *a, int *n, int lo, int hi) {
    int m = 0;
    for (int i = 0; i < *n; i++)
        if (a[i] >= lo && a[i] <= hi) a[m++] = a[i] - lo;
    *n = m;
}

static void slice_layers(struct model_config *c, int A, int B) {
    int nl = c->n_layers;
    if (A < 0 || B < A || B >= nl) ds_die("--layers %d-%d: outside the backbone layers 0-%d", A, B, nl - 1);
    for (int l = A; l <= B; l++) {
        int src = c->role[l].kv_src;
        if (src >= 0 && src < A) {
            int end = src;
            for (int j = src; j < nl; j++)
                if (c->role[j].kv_src == src) end = j;
            ds_die("--layers: layer range %d-%d cuts KV-sharing group %d-%d (layer %d reads the compressed KV of "
                   "layer %d); start at %d or after %d",
                   A, B, src, end, l, src, src, end);
        }
        if (c->role[l].topk_src >= 0 && c->role[l].topk_src < A)
            ds_die("--layers: layer range %d-%d cuts the top-k group of index source %d (layer %d reuses it)", A, B,
                   c->role[l].topk_src, l);
    }
    bool keep_mtp = B == nl - 1;
    int ratios[CFG_MAX_LAYERS], nr = 0;
    for (int l = A; l <= B; l++) ratios[nr++] = c->compress_ratios[l];
    if (keep_mtp)
        for (int m = 0; m < c->n_mtp; m++) ratios[nr++] = c->compress_ratios[nl + m];
    memcpy(c->compress_ratios, ratios, sizeof ratios);
    c->n_compress_ratios = nr;
    slice_list(c->kv_sources, &c->n_kv_sources, A, B);
    slice_list(c->index_sources, &c->n_index_sources, A, B);
    c->candidate_source = c->candidate_source >= A && c->candidate_source <= B ? c->candidate_source - A : -1;
    int m = 0;
    for (int i = 0; i < c->n_engram; i++)
        if (c->engram_layer_ids[i] >= A && c->engram_layer_ids[i] <= B) {
            c->engram_layer_ids[m] = c->engram_layer_ids[i] - A;
            c->engram_num_embeddings[m++] = c->engram_num_embeddings[i];
        }
    c->n_engram = m;
    if (keep_mtp) {
        slice_list(c->dspark_targets, &c->n_dspark_targets, A, B);
        if (c->n_mtp > 0 && c->n_dspark_targets == 0)
            ds_die("--layers %d-%d keeps the DSpark blocks but none of their target layers", A, B);
    } else {
        c->n_mtp = 0;
        c->n_dspark_targets = 0;
    }
    c->n_layers = B - A + 1;
    if (config_derive_roles(c)) ds_die("--layers %d-%d: %s", A, B, ds_err_get());
}

/* engram_num_embeddings must be the sum of each table's primes; engram_consts_init reports the
 * sums it reached before a mismatch, so a few passes settle every table. */
static void fit_engram_rows(struct model_config *c, bool user_emb) {
    struct engram_consts *ec = ds_calloc(1, sizeof *ec);
    for (int pass = 0; pass <= c->n_engram; pass++) {
        if (engram_consts_init(ec, c) == 0) break;
        bool changed = false;
        for (int li = 0; li < c->n_engram; li++)
            if (ec->table_rows[li] > 0 && ec->table_rows[li] != c->engram_num_embeddings[li]) {
                if (user_emb)
                    ds_die("--engram_num_embeddings: entry %d is %lld but the primes of engram layer %d sum to %lld",
                           li, (long long)c->engram_num_embeddings[li], c->engram_layer_ids[li],
                           (long long)ec->table_rows[li]);
                c->engram_num_embeddings[li] = ec->table_rows[li];
                changed = true;
            }
        if (!changed) ds_die_err();
    }
    free(ec);
}

static void build_config(const struct mk_args *a, struct model_config *cfg, char **json_out) {
    char path[4200];
    find_preset(a->preset, path, sizeof path);
    char *text = read_file(path);
    cJSON *root = cJSON_Parse(text);
    free(text);
    if (!root) ds_die("%s: not valid JSON", path);
    cJSON *tc = cJSON_GetObjectItemCaseSensitive(root, "text_config");
    if (!cJSON_IsObject(tc)) ds_die("%s: text_config: missing (a preset is an HF nested config.json)", path);
    bool user_emb;
    apply_overrides(tc, a, a->preset, &user_emb);
    char *eff = cJSON_Print(root);
    cJSON_Delete(root);
    char src[4300];
    snprintf(src, sizeof src, "%s (with the command-line overrides)", path);
    struct model_config c0;
    if (config_parse(eff, src, &c0)) ds_die_err();
    free(eff);
    if (a->layer_a >= 0) slice_layers(&c0, a->layer_a, a->layer_b);
    fit_engram_rows(&c0, user_emb && a->layer_a < 0);
    char *json = config_to_json(&c0);
    config_free(&c0);
    /* Re-parse what will be written: the folder's config.json is exactly what gets validated. */
    if (config_parse(json, src, cfg)) ds_die_err();
    *json_out = json;
}

/* Checks the writer cannot make later: every quantized K dimension splits into 32-blocks. */
static void check_geometry(const struct model_config *c) {
    if (!c->dense_fp8 || !c->expert_fp4)
        ds_die("mkmodel writes the release format only: quantization_config needs quant_method fp8 and "
               "expert_dtype fp4");
    if (c->weight_block != 32) ds_die("quantization_config.weight_block_size: only [32, 32] is written");
    if (c->dim % 32) ds_die("hidden_size %d: must be a multiple of 32 (FP4 expert scales per 32 columns)", c->dim);
    if (c->moe_inter_dim % 32)
        ds_die("moe_intermediate_size %d: must be a multiple of 32 (FP4 expert scales per 32 columns)",
               c->moe_inter_dim);
    if (c->n_engram > 0 && c->engram_head_dim % 32)
        ds_die("engram_head_dim %d: must be a multiple of 32 (one scale per 32 columns of a row)", c->engram_head_dim);
    if (c->n_engram > 0 && c->engram_compressed_vocab > c->vocab_size)
        ds_die("engram_compressed_vocab_size %lld exceeds vocab_size %d: the synthetic token map needs at least one "
               "token per class",
               (long long)c->engram_compressed_vocab, c->vocab_size);
}

/* ------------------------------------------------------------------------------------------------
 * Writers */

static const struct synth_inventory *g_sort_inv; /* qsort has no context argument */

/* Within a shard: widest dtype first (keeps F32 data 4-aligned), then by name, as the golden
 * files are laid out; a weight and its scale then sit next to each other. */
static int cmp_in_shard(const void *pa, const void *pb) {
    const struct synth_tensor *a = &g_sort_inv->t[*(const int *)pa], *b = &g_sort_inv->t[*(const int *)pb];
    size_t sa = st_dtype_size(a->dt), sb = st_dtype_size(b->dt);
    if (sa != sb) return sa > sb ? -1 : 1;
    return strcmp(a->name, b->name);
}

static int cmp_by_name(const void *pa, const void *pb) {
    return strcmp(g_sort_inv->t[*(const int *)pa].name, g_sort_inv->t[*(const int *)pb].name);
}

static void shard_name(char *out, size_t n, int k, int n_shards) {
    snprintf(out, n, "model-%05d-of-%05d.safetensors", k + 1, n_shards);
}

static void write_shard(const char *dir, const struct synth_inventory *inv, int shard, int n_shards, uint64_t seed) {
    int *idx = ds_malloc((size_t)inv->n * sizeof *idx), m = 0;
    for (int i = 0; i < inv->n; i++)
        if (inv->t[i].shard == shard) idx[m++] = i;
    g_sort_inv = inv;
    qsort(idx, (size_t)m, sizeof *idx, cmp_in_shard);
    struct st_writer *w = st_writer_new();
    st_writer_set_metadata(w, "format", "pt");
    for (int j = 0; j < m; j++) {
        const struct synth_tensor *t = &inv->t[idx[j]];
        if (st_writer_declare(w, t->name, t->dt, t->ndim, t->shape) != j) {
            st_writer_abort(w);
            fail_out();
        }
    }
    char name[64], path[8192];
    shard_name(name, sizeof name, shard, n_shards);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    struct pending pend = {.idx = -1, .buf = NULL};
    int rc = st_writer_begin(w, path);
    for (int j = 0; j < m && rc == 0; j++) rc = write_tensor(w, j, inv, idx[j], &pend, seed);
    free(pend.buf);
    free(idx);
    if (rc != 0) {
        st_writer_abort(w);
        fail_out();
    }
    if (st_writer_finish(w) != 0) fail_out();
}

static void write_index(const char *dir, const struct synth_inventory *inv, int n_shards) {
    int *idx = ds_malloc((size_t)inv->n * sizeof *idx);
    for (int i = 0; i < inv->n; i++) idx[i] = i;
    g_sort_inv = inv;
    qsort(idx, (size_t)inv->n, sizeof *idx, cmp_by_name);
    cJSON *root = cJSON_CreateObject(), *meta = cJSON_AddObjectToObject(root, "metadata");
    cJSON_AddNumberToObject(meta, "total_size", (double)inv->total);
    cJSON *wm = cJSON_AddObjectToObject(root, "weight_map");
    char name[64];
    for (int i = 0; i < inv->n; i++) {
        shard_name(name, sizeof name, inv->t[idx[i]].shard, n_shards);
        cJSON_AddStringToObject(wm, inv->t[idx[i]].name, name);
    }
    char *text = cJSON_Print(root);
    write_text(dir, "model.safetensors.index.json", text);
    free(text);
    cJSON_Delete(root);
    free(idx);
}

/* engram.safetensors, as the golden sidecar: token map and the reference's hash constants. */
static void write_engram(const char *dir, const struct model_config *c) {
    struct engram_consts *ec = ds_calloc(1, sizeof *ec);
    if (engram_consts_init(ec, c)) fail_out();
    int V = c->vocab_size, nl = ec->n_layers, ng = ec->max_ngram, nh = ec->n_heads;
    int64_t C = c->engram_compressed_vocab;
    /* The golden stub tokenizer folds pairs of ids (t -> t/2); any other class count uses t mod C,
     * which still gives exactly C classes because C <= vocab. */
    bool halve = 2 * C == V;
    int32_t *map = ds_malloc((size_t)V * sizeof *map);
    for (int t = 0; t < V; t++) map[t] = (int32_t)(halve ? t / 2 : t % C);
    if (engram_set_token_map(ec, c, map, V)) fail_out();
    int64_t *mult = ds_malloc((size_t)(nl * ng) * sizeof *mult);
    int64_t *offs = ds_malloc((size_t)(nl * (ng - 1) * nh) * sizeof *offs);
    int64_t *primes = ds_malloc((size_t)(nl * (ng - 1) * nh) * sizeof *primes);
    int32_t *ids = ds_malloc((size_t)nl * sizeof *ids);
    for (int li = 0; li < nl; li++) {
        ids[li] = ec->layer_ids[li];
        for (int s = 0; s < ng; s++) mult[li * ng + s] = ec->mult[li][s];
        for (int n = 0; n < ng - 1; n++)
            for (int h = 0; h < nh; h++) {
                primes[(li * (ng - 1) + n) * nh + h] = ec->primes[li][n][h];
                offs[(li * (ng - 1) + n) * nh + h] = ec->offsets[li][n * nh + h];
            }
    }
    char pad[32], pad_tok[32], cv[32], note[400];
    snprintf(pad, sizeof pad, "%lld", (long long)ec->pad);
    snprintf(pad_tok, sizeof pad_tok, "%d", c->engram_pad_id);
    snprintf(cv, sizeof cv, "%lld", (long long)C);
    snprintf(note, sizeof note,
             "token_map[token] -> compressed id (synthetic: %s); primes [n_engram_layers, max_ngram-1, n_heads]; "
             "offsets [n_engram_layers, (max_ngram-1)*n_heads]; multipliers [n_engram_layers, max_ngram] int64 "
             "(keep as int64, never via double); pad_id = token_map[engram_pad_token_id]",
             halve ? "t//2" : "t % engram_compressed_vocab_size");
    struct st_writer *w = st_writer_new();
    st_writer_set_metadata(w, "pad_id", pad);
    st_writer_set_metadata(w, "engram_pad_token_id", pad_tok);
    st_writer_set_metadata(w, "compressed_vocab_size", cv);
    st_writer_set_metadata(w, "note", note);
    int64_t s_mult[2] = {nl, ng}, s_offs[2] = {nl, (int64_t)(ng - 1) * nh}, s_pr[3] = {nl, ng - 1, nh},
            s_ids[1] = {nl}, s_map[1] = {V};
    int rc = st_writer_add(w, "multipliers", ST_I64, 2, s_mult, mult);
    if (rc == 0) rc = st_writer_add(w, "offsets", ST_I64, 2, s_offs, offs);
    if (rc == 0) rc = st_writer_add(w, "primes", ST_I64, 3, s_pr, primes);
    if (rc == 0) rc = st_writer_add(w, "layer_ids", ST_I32, 1, s_ids, ids);
    if (rc == 0) rc = st_writer_add(w, "token_map", ST_I32, 1, s_map, map);
    char path[8192];
    snprintf(path, sizeof path, "%s/engram.safetensors", dir);
    if (rc != 0) {
        st_writer_abort(w);
        fail_out();
    }
    if (st_writer_save(w, path) != 0) fail_out();
    free(mult), free(offs), free(primes), free(ids), free(map);
    engram_consts_free(ec);
    free(ec);
}

/* ------------------------------------------------------------------------------------------------
 * tokenizer.json: a small byte-level BPE in the release's layout, so text prompts run on every
 * preset. Ids: the special tokens the config names (bos, eos, pad, image when inside the vocab)
 * at their ids, the chat-format tokens at the lowest free ids, then the 256 byte symbols, then
 * merges up to vocab_size. The merges are chosen so that the Engram map built from this file
 * (MODEL.md §3.4) has exactly engram_compressed_vocab_size classes, as the loader demands when
 * no sidecar overrides it: lowercase words each add a class (common English pieces first, then
 * every 2-, 3-, 4-letter word in order), and whitespace-prefixed spellings of a word (" the",
 * "\n the") share that word's class because the map's normalizer collapses and strips blanks. When
 * no such choice exists (a class count below the byte symbols' own or above what the vocab can
 * hold) no tokenizer.json is written and mkmodel says why. */

#define MK_TOK_SPECIALS 9

struct mk_tok {
    int V;
    char **raw;      /* [V] raw bytes of each token (NULL = free id) */
    size_t *raw_len;
    bool *special;
    int n_merges;
    int *merge_l, *merge_r; /* ids of each merge's halves (merged id = the next free id) */
};

static const char *const mk_common_words[] = {
    "th", "he", "in", "er", "an", "re", "on", "at", "en", "nd", "ti", "es", "or", "te", "of", "ed", "is", "it", "al", "ar",
    "st", "to", "nt", "ng", "se", "ha", "as", "ou", "io", "le", "ve", "co", "me", "de", "hi", "ri", "ro", "ic", "ne", "ea",
    "ra", "ce", "the", "and", "ing", "ion", "tio", "ent", "ati", "her", "ter", "hat", "tha", "ere", "ate", "his", "con",
    "res", "ver", "all", "ons", "nce", "men", "ith", "ted", "ers", "pro", "thi", "wit", "are", "ess", "not", "ive", "was",
    "ect", "rea", "com", "eve", "per", "int", "est", "sta", "cti", "ica", "ist", "ear", "ain", "one", "our", "iti", "rat"};

static int mk_tok_add(struct mk_tok *k, int *next_free, const char *s, size_t n) {
    while (*next_free < k->V && k->raw[*next_free]) (*next_free)++;
    if (*next_free >= k->V) return -1;
    k->raw[*next_free] = ds_malloc(n + 1);
    memcpy(k->raw[*next_free], s, n);
    k->raw[*next_free][n] = 0;
    k->raw_len[*next_free] = n;
    return (*next_free)++;
}

/* Index of a lowercase word of up to 4 letters (base 27), to find a word's prefix token. */
static int mk_word_code(const char *w, size_t n) {
    int c = 0;
    for (size_t i = 0; i < n; i++) c = 27 * c + (w[i] - 'a' + 1);
    return c;
}

/* The tokenizer.json text of k (byte-level spelling of every token; specials as they are). */
static char *mk_tok_json(const struct mk_tok *k, const struct model_config *c) {
    cJSON *root = cJSON_CreateObject(), *added = NULL, *model, *vocab, *merges, *pre, *seq, *x;
    char *bl = ds_malloc(64), *bl2 = ds_malloc(64);
    size_t bl_cap = 64;
    cJSON_AddStringToObject(root, "version", "1.0");
    cJSON_AddNullToObject(root, "truncation");
    cJSON_AddNullToObject(root, "padding");
    added = cJSON_AddArrayToObject(root, "added_tokens");
    for (int i = 0; i < k->V; i++)
        if (k->special[i]) {
            x = cJSON_CreateObject();
            cJSON_AddNumberToObject(x, "id", i);
            cJSON_AddStringToObject(x, "content", k->raw[i]);
            cJSON_AddBoolToObject(x, "single_word", false);
            cJSON_AddBoolToObject(x, "lstrip", false);
            cJSON_AddBoolToObject(x, "rstrip", false);
            cJSON_AddBoolToObject(x, "normalized", false);
            cJSON_AddBoolToObject(x, "special", true);
            cJSON_AddItemToArray(added, x);
        }
    cJSON_AddNullToObject(root, "normalizer");
    /* the DeepSeek-V3/V4 pre-tokenizer: digit runs of up to 3, CJK/kana runs, the word/punctuation
     * pattern (all isolated), then ByteLevel without its own regex */
    static const char *splits[3] = {
        "\\p{N}{1,3}", "[\xe4\xb8\x80-\xe9\xbe\xa5\xe3\x81\x80-\xe3\x82\x9f\xe3\x82\xa0-\xe3\x83\xbf]+",
        "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|"
        "\\s*[\r\n]+|\\s+(?!\\S)|\\s+"};
    pre = cJSON_AddObjectToObject(root, "pre_tokenizer");
    cJSON_AddStringToObject(pre, "type", "Sequence");
    seq = cJSON_AddArrayToObject(pre, "pretokenizers");
    for (int s = 0; s < 3; s++) {
        x = cJSON_CreateObject();
        cJSON_AddStringToObject(x, "type", "Split");
        cJSON_AddStringToObject(cJSON_AddObjectToObject(x, "pattern"), "Regex", splits[s]);
        cJSON_AddStringToObject(x, "behavior", "Isolated");
        cJSON_AddBoolToObject(x, "invert", false);
        cJSON_AddItemToArray(seq, x);
    }
    x = cJSON_CreateObject();
    cJSON_AddStringToObject(x, "type", "ByteLevel");
    cJSON_AddBoolToObject(x, "add_prefix_space", false);
    cJSON_AddBoolToObject(x, "trim_offsets", true);
    cJSON_AddBoolToObject(x, "use_regex", false);
    cJSON_AddItemToArray(seq, x);
    /* BOS in front of every plain prompt, as a TemplateProcessing post-processor */
    cJSON *pp = cJSON_AddObjectToObject(root, "post_processor"), *one, *st;
    cJSON_AddStringToObject(pp, "type", "TemplateProcessing");
    cJSON *single = cJSON_AddArrayToObject(pp, "single");
    one = cJSON_CreateObject();
    st = cJSON_AddObjectToObject(one, "SpecialToken");
    cJSON_AddStringToObject(st, "id", k->raw[c->bos_id]);
    cJSON_AddNumberToObject(st, "type_id", 0);
    cJSON_AddItemToArray(single, one);
    one = cJSON_CreateObject();
    st = cJSON_AddObjectToObject(one, "Sequence");
    cJSON_AddStringToObject(st, "id", "A");
    cJSON_AddNumberToObject(st, "type_id", 0);
    cJSON_AddItemToArray(single, one);
    cJSON_AddItemToObject(pp, "pair", cJSON_Duplicate(single, 1));
    cJSON *spt = cJSON_AddObjectToObject(cJSON_AddObjectToObject(pp, "special_tokens"), k->raw[c->bos_id]);
    cJSON_AddStringToObject(spt, "id", k->raw[c->bos_id]);
    cJSON_AddItemToObject(spt, "ids", cJSON_CreateIntArray(&c->bos_id, 1));
    const char *bos_s = k->raw[c->bos_id];
    cJSON_AddItemToObject(spt, "tokens", cJSON_CreateStringArray(&bos_s, 1));
    x = cJSON_AddObjectToObject(root, "decoder");
    cJSON_AddStringToObject(x, "type", "ByteLevel");
    cJSON_AddBoolToObject(x, "add_prefix_space", true);
    cJSON_AddBoolToObject(x, "trim_offsets", true);
    cJSON_AddBoolToObject(x, "use_regex", true);
    model = cJSON_AddObjectToObject(root, "model");
    cJSON_AddStringToObject(model, "type", "BPE");
    cJSON_AddNullToObject(model, "dropout");
    cJSON_AddNullToObject(model, "unk_token");
    cJSON_AddNullToObject(model, "continuing_subword_prefix");
    cJSON_AddNullToObject(model, "end_of_word_suffix");
    cJSON_AddBoolToObject(model, "fuse_unk", false);
    cJSON_AddBoolToObject(model, "byte_fallback", false);
    cJSON_AddBoolToObject(model, "ignore_merges", false);
    vocab = cJSON_AddObjectToObject(model, "vocab");
    for (int i = 0; i < k->V; i++) {
        if (!k->raw[i]) continue;
        if (2 * k->raw_len[i] + 1 > bl_cap) bl_cap = 2 * k->raw_len[i] + 1, bl = ds_realloc(bl, bl_cap), bl2 = ds_realloc(bl2, bl_cap);
        if (k->special[i]) snprintf(bl, bl_cap, "%s", k->raw[i]);
        else tok_byte_level_encode(k->raw[i], k->raw_len[i], bl);
        cJSON_AddNumberToObject(vocab, bl, i);
    }
    merges = cJSON_AddArrayToObject(model, "merges");
    for (int m = 0; m < k->n_merges; m++) {
        size_t la = k->raw_len[k->merge_l[m]], lb = k->raw_len[k->merge_r[m]];
        if (2 * (la > lb ? la : lb) + 1 > bl_cap) bl_cap = 2 * (la + lb) + 1, bl = ds_realloc(bl, bl_cap), bl2 = ds_realloc(bl2, bl_cap);
        tok_byte_level_encode(k->raw[k->merge_l[m]], la, bl);
        tok_byte_level_encode(k->raw[k->merge_r[m]], lb, bl2);
        const char *pair[2] = {bl, bl2};
        cJSON_AddItemToArray(merges, cJSON_CreateStringArray(pair, 2));
    }
    char *json = cJSON_Print(root);
    cJSON_Delete(root);
    free(bl), free(bl2);
    return json;
}

static void mk_tok_free(struct mk_tok *k) {
    for (int i = 0; i < k->V; i++) free(k->raw[i]);
    free(k->raw), free(k->raw_len), free(k->special), free(k->merge_l), free(k->merge_r);
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Engram classes of the tokens placed so far (free ids ignored). */
static int mk_tok_classes(const struct mk_tok *k, const struct model_config *c) {
    char *json = mk_tok_json(k, c);
    struct tokenizer *t = tok_load_text(json, strlen(json), "mkmodel tokenizer.json");
    free(json);
    if (!t) fail_out();
    char **keys = ds_malloc(sizeof *keys * (size_t)k->V);
    int n = 0, classes = 0;
    for (int i = 0; i < k->V; i++)
        if (k->raw[i]) keys[n++] = tok_engram_key(t, i, NULL);
    qsort(keys, (size_t)n, sizeof *keys, cmp_str);
    for (int i = 0; i < n; i++) classes += !i || strcmp(keys[i], keys[i - 1]);
    for (int i = 0; i < n; i++) free(keys[i]);
    free(keys);
    tok_free(t);
    return classes;
}

/* Next lowercase word in the order: the common pieces, then every word of length 2, 3, 4, 5. */
static bool mk_next_word(int *state, char *w) {
    for (;;) {
        int s = (*state)++;
        int nc = (int)(sizeof mk_common_words / sizeof *mk_common_words);
        if (s < nc) {
            strcpy(w, mk_common_words[s]);
            return true;
        }
        s -= nc;
        int len = 2, count = 26 * 26;
        while (s >= count && len < 5) s -= count, len++, count *= 26;
        if (s >= count) return false;
        for (int i = len - 1; i >= 0; i--) w[i] = (char)('a' + s % 26), s /= 26;
        w[len] = 0;
        bool common = false;
        for (int i = 0; i < nc && !common; i++) common = !strcmp(w, mk_common_words[i]);
        if (!common) return true;
    }
}

static void write_tokenizer(const char *dir, const struct model_config *c) {
    struct mk_tok k = {.V = c->vocab_size};
    const char *why = NULL;
    k.raw = ds_calloc((size_t)k.V, sizeof *k.raw);
    k.raw_len = ds_calloc((size_t)k.V, sizeof *k.raw_len);
    k.special = ds_calloc((size_t)k.V, sizeof *k.special);
    k.merge_l = ds_malloc(sizeof(int) * (size_t)k.V);
    k.merge_r = ds_malloc(sizeof(int) * (size_t)k.V);
    const struct { int id; const char *s; } fixed[4] = {
        {c->bos_id, "<｜begin▁of▁sentence｜>"}, {c->eos_id, "<｜end▁of▁sentence｜>"}, {c->pad_id, "<｜▁pad▁｜>"},
        {c->image_token_id < c->vocab_size ? c->image_token_id : -1, "<｜deepseek_image｜>"}};
    static const char *chat[5] = {"<｜User｜>", "<｜Assistant｜>", "<｜System｜>", "<think>", "</think>"};
    int nf = 0;
    for (int i = 0; i < 4 && !why; i++) {
        if (fixed[i].id < 0 && i == 3) continue;
        if (fixed[i].id < 0 || fixed[i].id >= k.V) why = "a special token id of the config is outside the vocabulary";
        else if (!k.raw[fixed[i].id]) mk_tok_add(&k, &(int){fixed[i].id}, fixed[i].s, strlen(fixed[i].s)), k.special[fixed[i].id] = true;
    }
    for (int i = 0; i < 5 && !why; i++) {
        int id = mk_tok_add(&k, &nf, chat[i], strlen(chat[i]));
        if (id < 0) why = "the vocabulary is too small";
        else k.special[id] = true;
    }
    int byte_tok[256];
    for (int b = 0; b < 256 && !why; b++)
        if ((byte_tok[b] = mk_tok_add(&k, &nf, (const char *)&(unsigned char){(unsigned char)b}, 1)) < 0)
            why = "the vocabulary is too small";
    int need = why ? 0 : (int)c->engram_compressed_vocab - mk_tok_classes(&k, c), free_ids = 0;
    for (int i = 0; i < k.V; i++) free_ids += !k.raw[i];
    if (!why && need < 0) why = "engram_compressed_vocab_size is below the class count of the byte and special tokens alone";
    if (!why && need > free_ids) why = "engram_compressed_vocab_size needs more tokens than the vocabulary has left";
    /* words that add a class each, then whitespace-prefixed spellings of words and letters */
    int state = 0, n_words = 0, *base = ds_malloc(sizeof(int) * (size_t)(k.V + 26));
    int *word_id = ds_malloc(sizeof(int) * 27 * 27 * 27 * 27);
    memset(word_id, 0xFF, sizeof(int) * 27 * 27 * 27 * 27);
    char w[8];
    while (!why && n_words < need && mk_next_word(&state, w)) {
        size_t l = strlen(w);
        int left = l == 2 ? byte_tok[(unsigned char)w[0]] : word_id[mk_word_code(w, l - 1)];
        if (left < 0) continue; /* its prefix is not a token yet: later */
        int id = mk_tok_add(&k, &nf, w, l);
        k.merge_l[k.n_merges] = left, k.merge_r[k.n_merges++] = byte_tok[(unsigned char)w[l - 1]];
        if (l <= 4) word_id[mk_word_code(w, l)] = id;
        base[n_words++] = id;
    }
    free(word_id);
    if (!why && n_words < need) why = "not enough distinct words";
    int n_base = n_words;
    for (int ch = 'a'; ch <= 'z' && !why; ch++) base[n_base++] = byte_tok[ch];
    static const char ws[4] = {' ', '\n', '\t', '\r'};
    int lo = 0, hi = n_base; /* variants of base[lo..hi) get one more blank in front */
    while (!why && k.n_merges < free_ids) {
        int before = k.n_merges;
        for (int p = 0; p < 4 && k.n_merges < free_ids; p++)
            for (int i = lo; i < hi && k.n_merges < free_ids; i++) {
                int b = base[i];
                char *s = ds_malloc(k.raw_len[b] + 2);
                s[0] = ws[p];
                memcpy(s + 1, k.raw[b], k.raw_len[b]);
                int id = mk_tok_add(&k, &nf, s, k.raw_len[b] + 1);
                free(s);
                k.merge_l[k.n_merges] = byte_tok[(unsigned char)ws[p]], k.merge_r[k.n_merges++] = b;
                base[n_base++] = id;
            }
        lo = hi, hi = n_base;
        if (k.n_merges == before) why = "no variant left";
    }
    free(base);
    if (why) {
        printf("mkmodel: no tokenizer.json: %s (vocab %d, engram_compressed_vocab_size %lld)\n", why, c->vocab_size,
               (long long)c->engram_compressed_vocab);
        mk_tok_free(&k);
        return;
    }
    char *json = mk_tok_json(&k, c);
    struct tokenizer *t = tok_load_text(json, strlen(json), "mkmodel tokenizer.json");
    if (!t) fail_out();
    int32_t n, classes;
    free(tok_engram_map(t, c->vocab_size, c->engram_pad_id, &n, &classes));
    tok_free(t);
    if (classes != c->engram_compressed_vocab) {
        ds_err_set("mkmodel: internal error: the tokenizer.json written has %d Engram classes, not %lld", classes,
                   (long long)c->engram_compressed_vocab);
        fail_out();
    }
    write_text(dir, "tokenizer.json", json);
    free(json);
    mk_tok_free(&k);
}

/* ------------------------------------------------------------------------------------------------
 * Command */

static void usage(FILE *f) {
    fprintf(f,
            "usage: dsbatch mkmodel --preset NAME --out DIR [--seed S] [--layers A-B] [--experts N] [--max-pos N]\n"
            "                       [--KEY VALUE ...]\n"
            "  Write a seeded random checkpoint in the official format (config.json, sharded safetensors,\n"
            "  index, engram.safetensors).\n"
            "  --preset NAME   tiny (golden small6 geometry), tp8pp2, v41-flash (real dimensions), or a config path\n"
            "  --seed S        random seed (default 0); the same seed gives byte-identical files\n"
            "  --out DIR       output folder; must not exist or be empty\n"
            "  --layers A-B    only backbone layers A..B (renumbered 0..B-A; DSpark kept if B is the last layer)\n"
            "  --experts N     routed experts per layer (DSpark: min(N, preset)); top-k capped at N\n"
            "  --max-pos N     max_position_embeddings\n"
            "  --KEY VALUE     override any text_config key (JSON value), e.g. --hidden_size 512\n"
            "  --dry-run       print the size and shard count, write nothing\n");
}

static void parse_args(int argc, char **argv, struct mk_args *a) {
    memset(a, 0, sizeof *a);
    a->layer_a = a->layer_b = -1;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
            usage(stdout);
            exit(0);
        }
        if (!strcmp(arg, "--dry-run")) {
            a->dry_run = true;
            continue;
        }
        if (strncmp(arg, "--", 2) || !arg[2]) ds_die("mkmodel: unexpected argument '%s' (see --help)", arg);
        char key[128];
        const char *eq = strchr(arg, '='), *val;
        size_t kl = eq ? (size_t)(eq - arg - 2) : strlen(arg + 2);
        if (kl >= sizeof key) ds_die("mkmodel: option '%s' is too long", arg);
        memcpy(key, arg + 2, kl);
        key[kl] = '\0';
        if (eq) {
            val = eq + 1;
        } else {
            if (i + 1 >= argc) ds_die("mkmodel: --%s needs a value", key);
            val = argv[++i];
        }
        if (!strcmp(key, "preset")) {
            a->preset = val;
        } else if (!strcmp(key, "out")) {
            a->out = val;
        } else if (!strcmp(key, "seed")) {
            a->seed = cli_u64("--seed", val);
        } else if (!strcmp(key, "layers")) {
            int x, y, n = 0;
            if (sscanf(val, "%d-%d%n", &x, &y, &n) != 2 || val[n] || x < 0 || y < x)
                ds_die("--layers: '%s' is not a range A-B with 0 <= A <= B", val);
            a->layer_a = x;
            a->layer_b = y;
        } else if (!strcmp(key, "experts")) {
            a->experts = (int)cli_int("--experts", val, 1, 1 << 20);
        } else if (!strcmp(key, "max-pos") || !strcmp(key, "max_pos")) {
            a->max_pos = cli_int("--max-pos", val, 1, INT64_MAX / 4);
        } else {
            if (a->n_over == (int)(sizeof a->over_key / sizeof a->over_key[0]))
                ds_die("mkmodel: too many overrides");
            char *k = ds_strdup(key);
            a->over_key[a->n_over] = k;
            a->over_val[a->n_over++] = val;
        }
    }
    if (!a->preset) ds_die("mkmodel: --preset is required (tiny, tp8pp2, v41-flash); see --help");
    if (!a->out || !a->out[0]) ds_die("mkmodel: --out DIR is required; see --help");
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int cmd_mkmodel(int argc, char **argv) {
    double t0 = now_s();
    struct mk_args a;
    parse_args(argc, argv, &a);
    check_out_dir(a.out);

    struct model_config cfg;
    char *cfg_json;
    build_config(&a, &cfg, &cfg_json);
    check_geometry(&cfg);

    struct synth_inventory inv = {0};
    synth_inventory_build(&inv, &cfg);
    int n_shards = assign_shards(&inv);

    if (a.dry_run) {
        printf("mkmodel: would write %s (preset %s): %d layers + %d DSpark, %d experts, %d tensors in %d shard%s, "
               "%llu bytes\n",
               a.out, a.preset, cfg.n_layers, cfg.n_mtp, cfg.n_routed_experts, inv.n, n_shards, n_shards == 1 ? "" : "s",
               (unsigned long long)inv.total);
        synth_inventory_free(&inv);
        free(cfg_json);
        config_free(&cfg);
        return 0;
    }

    /* Refuse up front what cannot finish: the disk space, and the largest tensor, which the
     * streaming writer still takes whole. */
    char parent[4096];
    parent_of(a.out, parent, sizeof parent);
    struct statvfs vfs;
    if (statvfs(parent, &vfs) != 0) ds_die("%s: cannot stat the output filesystem: %s", parent, ds_errno_str());
    uint64_t need = inv.total + (uint64_t)inv.n * 160 + (uint64_t)cfg.vocab_size * 4 + (1u << 20);
    uint64_t avail = (uint64_t)vfs.f_bavail * (uint64_t)vfs.f_frsize;
    if (need > avail)
        ds_die("%s: the checkpoint needs %llu bytes (%.1f GB) but the filesystem has %llu bytes free (%.1f GB); "
               "use --layers/--experts for a smaller model",
               a.out, (unsigned long long)need, (double)need / 1e9, (unsigned long long)avail, (double)avail / 1e9);
    uint64_t biggest = 0;
    const char *big_name = "";
    for (int i = 0; i < inv.n; i++) {
        uint64_t b = inv.t[i].nbytes + (inv.t[i].partner >= 0 ? inv.t[inv.t[i].partner].nbytes : 0);
        if (b > biggest) biggest = b, big_name = inv.t[i].name;
    }
    uint64_t mem = mem_available();
    if (biggest > mem)
        ds_die("%s: tensor %s needs %llu bytes of memory to generate but only %llu are available", a.out, big_name,
               (unsigned long long)biggest, (unsigned long long)mem);

    size_t ol = strlen(a.out);
    while (ol > 1 && a.out[ol - 1] == '/') ol--;
    if (ol + 12 >= sizeof g_tmpdir) ds_die("%s: path too long", a.out);
    snprintf(g_tmpdir, sizeof g_tmpdir, "%.*s.tmp-XXXXXX", (int)ol, a.out);
    if (!mkdtemp(g_tmpdir)) {
        ds_err_set("%s: cannot create a temporary folder: %s", g_tmpdir, ds_errno_str());
        g_tmpdir[0] = '\0';
        ds_die_err();
    }

    for (int s = 0; s < n_shards; s++) write_shard(g_tmpdir, &inv, s, n_shards, a.seed);
    write_index(g_tmpdir, &inv, n_shards);
    if (cfg.n_engram > 0) write_engram(g_tmpdir, &cfg);
    write_tokenizer(g_tmpdir, &cfg);
    write_text(g_tmpdir, "config.json", cfg_json);
    chmod(g_tmpdir, 0755); /* mkdtemp makes it 0700; a model folder is ordinary shared data */

    check_out_dir(a.out);
    if (rename(g_tmpdir, a.out) != 0) {
        ds_err_set("%s: cannot rename %s to it: %s", a.out, g_tmpdir, ds_errno_str());
        fail_out();
    }
    g_tmpdir[0] = '\0';

    printf("mkmodel: wrote %s (preset %s, seed %llu): %d layers + %d DSpark, %d experts, %d tensors in %d shard%s, "
           "%llu bytes, %.2f s\n",
           a.out, a.preset, (unsigned long long)a.seed, cfg.n_layers, cfg.n_mtp, cfg.n_routed_experts, inv.n, n_shards,
           n_shards == 1 ? "" : "s", (unsigned long long)inv.total, now_s() - t0);
    synth_inventory_free(&inv);
    free(cfg_json);
    config_free(&cfg);
    for (int i = 0; i < a.n_over; i++) free((char *)a.over_key[i]);
    return 0;
}
