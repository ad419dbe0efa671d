/* `dsbatch prompts`: build an HDF5 prompt file from JSONL or token-id text, or check one.
 *
 *   dsbatch prompts --from P.jsonl|IDS.txt --out PROMPTS.h5 [--zstd-level N]
 *   dsbatch prompts --check PROMPTS.h5 [--vocab V] [--max-len L]
 *
 * JSONL lines are objects {"id", "tokens", "max_new_tokens", "temperature", "top_p", "top_k",
 * "seed", "text"} (only tokens required; other keys are ignored, as `generate` does); a text file
 * has one prompt per line, token ids separated by spaces. Blank lines are skipped. A field given on
 * some lines only is stored with the layout's "job default" value on the others, so a file can
 * override max_new_tokens for a few prompts. The file is written to PROMPTS.h5.tmp and renamed, so
 * a failed or killed run leaves no prompt file behind. --check reads a file through the same
 * reader the engine uses (validation included) and prints its shape. The library's prompt file
 * writer, h5_prompts_write, lives here too: this command is what it is for. */
#include <cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "cli_args.h"
#include "h5io.h"
#include "log.h"
#include "prompt_fields.h"

/* ------------------------------------------------------------------------------------------------
 * The prompt file writer (h5io.h) */

#define PROMPT_CHUNK 16384 /* elements per chunk: small enough that one replica's share of a */
                           /* strided read does not decompress much more than it needs */

static void write_fixed(hid_t g, const char *name, hid_t ftype, hid_t mtype, int64_t n, const void *buf) {
    hid_t d = h5io_create_1d(g, name, ftype, n, false, PROMPT_CHUNK);
    if (n > 0) h5io_write_range(d, mtype, 0, n, buf);
    CHECK_H5(H5Dclose(d));
}

/* Strings as CSR: NAME_chars (uint8, the bytes without NULs) + NAME_offsets (int64 [n+1]). */
static void write_csr_strings(hid_t g, const char *name, const char *const *s, int64_t n) {
    int64_t *off = ds_malloc(sizeof *off * (size_t)(n + 1));
    off[0] = 0;
    for (int64_t i = 0; i < n; i++) off[i + 1] = off[i] + (int64_t)strlen(s[i] ? s[i] : "");
    char *chars = ds_malloc((size_t)off[n] + 1);
    for (int64_t i = 0; i < n; i++) memcpy(chars + off[i], s[i] ? s[i] : "", (size_t)(off[i + 1] - off[i]));
    char dn[64];
    snprintf(dn, sizeof dn, "%s_chars", name);
    write_fixed(g, dn, H5T_STD_U8LE, H5T_NATIVE_UINT8, off[n], chars);
    snprintf(dn, sizeof dn, "%s_offsets", name);
    write_fixed(g, dn, H5T_STD_I64LE, H5T_NATIVE_INT64, n + 1, off);
    free(chars);
    free(off);
}

int h5_prompts_write(const char *path, const struct h5_prompts_in *in) {
    if (in->n < 0 || !in->offsets || (in->n > 0 && !in->tokens)) {
        ds_err_set("%s: no prompts given", path);
        return -1;
    }
    if (in->ids && in->int_ids) {
        ds_err_set("%s: both string and integer ids given", path);
        return -1;
    }
    if (in->offsets[0] != 0) {
        ds_err_set("%s: offsets[0] = %lld, must be 0", path, (long long)in->offsets[0]);
        return -1;
    }
    for (int64_t i = 0; i < in->n; i++) {
        if (in->offsets[i + 1] <= in->offsets[i]) {
            ds_err_set("%s: prompt %lld is empty or offsets decrease", path, (long long)i);
            return -1;
        }
        for (int64_t k = in->offsets[i]; k < in->offsets[i + 1]; k++)
            if (in->tokens[k] < 0) {
                ds_err_set("%s: prompt %lld: token id %d is negative", path, (long long)i, in->tokens[k]);
                return -1;
            }
    }
    char *tmp = ds_malloc(strlen(path) + 5);
    sprintf(tmp, "%s.tmp", path);
    if (h5io_check_writable(tmp)) {
        ds_err_set("%s: cannot write: %s", path, ds_errno_str());
        free(tmp);
        return -1;
    }
    h5zstd_register();
    hid_t f = H5Fcreate(tmp, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    CHECK_H5(f);
    hid_t g = H5Gcreate2(f, "prompts", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    CHECK_H5(g);
    h5io_attr_i32(g, "format_version", H5IO_FORMAT_VERSION);
    h5io_attr_str(g, "compression", h5io_compression_name());
    int64_t n = in->n;
    write_fixed(g, "tokens", H5T_STD_I32LE, H5T_NATIVE_INT32, in->offsets[n], in->tokens);
    write_fixed(g, "offsets", H5T_STD_I64LE, H5T_NATIVE_INT64, n + 1, in->offsets);
    if (in->max_new_tokens) write_fixed(g, "max_new_tokens", H5T_STD_I64LE, H5T_NATIVE_INT64, n, in->max_new_tokens);
    if (in->temperature) write_fixed(g, "temperature", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, n, in->temperature);
    if (in->top_p) write_fixed(g, "top_p", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, n, in->top_p);
    if (in->top_k) write_fixed(g, "top_k", H5T_STD_I32LE, H5T_NATIVE_INT32, n, in->top_k);
    if (in->seed) write_fixed(g, "seed", H5T_STD_I64LE, H5T_NATIVE_INT64, n, in->seed);
    if (in->int_ids) write_fixed(g, "id", H5T_STD_I64LE, H5T_NATIVE_INT64, n, in->int_ids);
    if (in->ids) write_csr_strings(g, "id", in->ids, n);
    if (in->texts) write_csr_strings(g, "text", in->texts, n);
    CHECK_H5(H5Gclose(g));
    CHECK_H5(H5Fclose(f));
    if (rename(tmp, path) != 0) {
        ds_err_set("%s: cannot write: %s", path, ds_errno_str());
        unlink(tmp);
        free(tmp);
        return -1;
    }
    free(tmp);
    return 0;
}

/* ------------------------------------------------------------------------------------------------
 * Building a prompt set from JSONL or token-id lines */

/* Growable arrays of one prompt set. */
struct builder {
    int64_t n, cap, ntok, tcap;
    int32_t *tokens;
    int64_t *offsets, *max_new, *seed, *int_id;
    float *temperature, *top_p;
    int32_t *top_k;
    char **id, **text;
    bool has_max_new, has_temperature, has_top_p, has_top_k, has_seed, has_text, has_id, string_ids;
};

static void grow(struct builder *b) {
    if (b->n + 1 < b->cap) return;
    b->cap = b->cap ? 2 * b->cap : 1024;
    size_t c = (size_t)b->cap + 1;
    b->offsets = ds_realloc(b->offsets, sizeof(int64_t) * c);
    b->max_new = ds_realloc(b->max_new, sizeof(int64_t) * c);
    b->seed = ds_realloc(b->seed, sizeof(int64_t) * c);
    b->int_id = ds_realloc(b->int_id, sizeof(int64_t) * c);
    b->temperature = ds_realloc(b->temperature, sizeof(float) * c);
    b->top_p = ds_realloc(b->top_p, sizeof(float) * c);
    b->top_k = ds_realloc(b->top_k, sizeof(int32_t) * c);
    b->id = ds_realloc(b->id, sizeof(char *) * c);
    b->text = ds_realloc(b->text, sizeof(char *) * c);
}

/* Start prompt b->n with every optional field at its "job default" value. */
static void begin_prompt(struct builder *b) {
    grow(b);
    int64_t i = b->n;
    if (i == 0) b->offsets[0] = 0;
    b->max_new[i] = -1;
    b->seed[i] = -1;
    b->int_id[i] = i;
    b->temperature[i] = NAN;
    b->top_p[i] = NAN;
    b->top_k[i] = -1;
    b->id[i] = NULL;
    b->text[i] = NULL;
}

static void add_token(struct builder *b, int32_t t) {
    if (b->ntok == b->tcap) {
        b->tcap = b->tcap ? 2 * b->tcap : 65536;
        b->tokens = ds_realloc(b->tokens, sizeof(int32_t) * (size_t)b->tcap);
    }
    b->tokens[b->ntok++] = t;
}

static void end_prompt(struct builder *b) {
    b->offsets[b->n + 1] = b->ntok;
    b->n++;
}

static int parse_jsonl_line(struct builder *b, const char *path, int line, const char *s) {
    cJSON *j = cJSON_Parse(s);
    int rc = -1;
    bool begun = false;
    if (!cJSON_IsObject(j)) {
        ds_err_set("%s:%d: not a JSON object", path, line);
        goto out;
    }
    const cJSON *tk = cJSON_GetObjectItem(j, "tokens");
    if (!cJSON_IsArray(tk) || cJSON_GetArraySize(tk) < 1) {
        ds_err_set("%s:%d: tokens: expected a non-empty array of token ids", path, line);
        goto out;
    }
    begin_prompt(b);
    begun = true;
    int64_t k = 0, v;
    const cJSON *t;
    cJSON_ArrayForEach(t, tk) {
        if (prompt_json_int(t, 0, INT32_MAX, &v)) {
            ds_err_set("%s:%d: tokens[%lld]: not a token id (an integer in [0, 2^31))", path, line, (long long)k);
            goto out;
        }
        add_token(b, (int32_t)v);
        k++;
    }
    const cJSON *f;
    int64_t i = b->n;
    struct prompt_fields pf;
    if (prompt_fields_json(j, path, line, &pf)) goto out;
    if (pf.has_max_new) b->max_new[i] = pf.max_new, b->has_max_new = true;
    if (pf.has_temperature) b->temperature[i] = pf.temperature, b->has_temperature = true;
    if (pf.has_top_p) b->top_p[i] = pf.top_p, b->has_top_p = true;
    if (pf.has_top_k) b->top_k[i] = pf.top_k, b->has_top_k = true;
    if (pf.has_seed) b->seed[i] = (int64_t)pf.seed, b->has_seed = true;
    if ((f = cJSON_GetObjectItem(j, "id"))) {
        if (cJSON_IsString(f)) {
            b->id[i] = ds_strdup(f->valuestring);
            b->string_ids = true;
        } else if (!prompt_json_int(f, -9.0e15, 9.0e15, &b->int_id[i])) {
            char s[32];
            snprintf(s, sizeof s, "%lld", (long long)b->int_id[i]);
            b->id[i] = ds_strdup(s);
        } else {
            ds_err_set("%s:%d: id: expected a string or an integer", path, line);
            goto out;
        }
        b->has_id = true;
    }
    if ((f = cJSON_GetObjectItem(j, "text"))) {
        if (!cJSON_IsString(f)) {
            ds_err_set("%s:%d: text: expected a string", path, line);
            goto out;
        }
        b->text[i] = ds_strdup(f->valuestring);
        b->has_text = true;
    }
    end_prompt(b);
    rc = 0;
out:
    if (rc && begun) { /* a prompt begun and abandoned: begin_prompt set these */
        free(b->id[b->n]);
        free(b->text[b->n]);
        b->id[b->n] = b->text[b->n] = NULL;
    }
    cJSON_Delete(j);
    return rc;
}

static int parse_ids_line(struct builder *b, const char *path, int line, char *s) {
    begin_prompt(b);
    int64_t k = 0;
    for (char *tok = strtok(s, " \t\r"); tok; tok = strtok(NULL, " \t\r"), k++) {
        char *end;
        long long v = strtoll(tok, &end, 10);
        if (*end || v < 0 || v > INT32_MAX) {
            ds_err_set("%s:%d: token %lld: '%s' is not a token id (an integer in [0, 2^31))", path, line, (long long)k,
                       tok);
            return -1;
        }
        add_token(b, (int32_t)v);
    }
    end_prompt(b);
    return 0;
}

static int build_from(const char *path, struct builder *b) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        ds_err_set("%s: cannot open: %s", path, ds_errno_str());
        return -1;
    }
    size_t pl = strlen(path);
    bool jsonl = (pl > 6 && !strcmp(path + pl - 6, ".jsonl")) || (pl > 5 && !strcmp(path + pl - 5, ".json"));
    bool decided = jsonl;
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int lineno = 0, rc = 0;
    while (!rc && (len = getline(&line, &cap, f)) >= 0) {
        lineno++;
        if (strspn(line, " \t\r\n") == (size_t)len) continue;
        line[strcspn(line, "\n")] = 0;
        if (!decided) {
            /* No telling extension: a JSON object line means JSONL. */
            jsonl = line[strspn(line, " \t")] == '{';
            decided = true;
        }
        rc = jsonl ? parse_jsonl_line(b, path, lineno, line) : parse_ids_line(b, path, lineno, line);
    }
    free(line);
    fclose(f);
    if (!rc && b->n == 0) {
        ds_err_set("%s: no prompts", path);
        rc = -1;
    }
    return rc;
}

static void builder_free(struct builder *b) {
    for (int64_t i = 0; i < b->n; i++) {
        free(b->id[i]);
        free(b->text[i]);
    }
    free(b->tokens);
    free(b->offsets);
    free(b->max_new);
    free(b->seed);
    free(b->int_id);
    free(b->temperature);
    free(b->top_p);
    free(b->top_k);
    free(b->id);
    free(b->text);
}

static int do_build(const char *from, const char *out) {
    struct builder b = {0};
    if (build_from(from, &b)) {
        builder_free(&b);
        return -1;
    }
    /* Ids: strings as soon as one is a string (numbers printed), otherwise integers. */
    for (int64_t i = 0; i < b.n && b.string_ids; i++)
        if (!b.id[i]) {
            char s[32];
            snprintf(s, sizeof s, "%lld", (long long)i);
            b.id[i] = ds_strdup(s);
        }
    struct h5_prompts_in in = {
        .n = b.n,
        .tokens = b.tokens,
        .offsets = b.offsets,
        .max_new_tokens = b.has_max_new ? b.max_new : NULL,
        .temperature = b.has_temperature ? b.temperature : NULL,
        .top_p = b.has_top_p ? b.top_p : NULL,
        .top_k = b.has_top_k ? b.top_k : NULL,
        .seed = b.has_seed ? b.seed : NULL,
        .ids = b.has_id && b.string_ids ? (const char *const *)b.id : NULL,
        .int_ids = b.has_id && !b.string_ids ? b.int_id : NULL,
        .texts = b.has_text ? (const char *const *)b.text : NULL,
    };
    int rc = h5_prompts_write(out, &in);
    if (!rc)
        printf("wrote %s: %lld prompts, %lld tokens, ids %s, compression %s\n", out, (long long)b.n,
               (long long)b.ntok, !b.has_id ? "none (prompt index)" : b.string_ids ? "string" : "integer",
               h5io_compression_name());
    builder_free(&b);
    return rc;
}

static void usage(FILE *f) {
    fprintf(f, "usage: dsbatch prompts --from P.jsonl|IDS.txt --out PROMPTS.h5 [--zstd-level N]\n"
               "       dsbatch prompts --check PROMPTS.h5 [--vocab V] [--max-len L]\n"
               "  JSONL: {\"id\":..., \"tokens\":[...], \"max_new_tokens\":..., \"temperature\":..., \"top_p\":...,\n"
               "          \"top_k\":..., \"seed\":..., \"text\":...} per line; text: token ids separated by spaces.\n"
               "  --zstd-level N  compression of the datasets (0 = none; default 3)\n"
               "  --check         validate a prompt file as the engine reads it: token ids < V, prompt tokens +\n"
               "                  its max_new_tokens <= L\n");
}

int cmd_prompts(int argc, char **argv) {
    const char *from = NULL, *out = NULL, *check = NULL;
    int64_t vocab = 0, max_len = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!v) ds_die("prompts: %s needs a value (see --help)", a);
        if (!strcmp(a, "--from")) from = v;
        else if (!strcmp(a, "--out")) out = v;
        else if (!strcmp(a, "--check")) check = v;
        else if (!strcmp(a, "--vocab")) vocab = cli_int(a, v, 0, INT32_MAX);
        else if (!strcmp(a, "--max-len")) max_len = cli_int(a, v, 0, INT64_MAX);
        else if (!strcmp(a, "--zstd-level")) h5io_set_zstd_level((int)cli_int(a, v, 0, 22));
        else ds_die("prompts: unknown option '%s' (see --help)", a);
        i++;
    }
    if (check && !from && !out) {
        if (h5_prompts_summary(check, vocab, max_len, stdout)) ds_die_err();
        return 0;
    }
    if (!from || !out || check) {
        usage(stderr);
        return 2;
    }
    if (do_build(from, out)) ds_die_err();
    return 0;
}
