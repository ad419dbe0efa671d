/* The HDF5 output of a batch job as the commands drive it (see jobout.h): meta data and the job
 * fingerprint, opening (fresh or resumed) with the outcome agreed over the job, per-request
 * records, the step trace, and the parts written once every request is in.
 *
 * Why text and logits are written at the end and not per request: they are derived (text from
 * the recorded tokens) or debug-only (logits, refused with --resume), and the journal that makes
 * per-request records survive SIGKILL (h5io.c) knows only tokens, log-probabilities and timing.
 * Writing them last keeps the kill-and-resume contract whole: a kill before `complete` is set
 * leaves the journal, and the resumed run writes them again from the rebuilt file. */
#include "jobout.h"

#include <cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jobspec.h"
#include "log.h"

#ifndef DS_GIT_COMMIT
#define DS_GIT_COMMIT "unknown"
#endif

/* ------------------------------------------------------------------------------------------------
 * Formats */

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && !strcmp(s + n - k, suffix);
}

bool job_out_is_h5(const char *path) {
    return ends_with(path, ".h5") || ends_with(path, ".hdf5") || ends_with(path, ".he5");
}

bool job_prompts_is_h5(const char *path) {
    static const unsigned char sig[8] = {0x89, 'H', 'D', 'F', '\r', '\n', 0x1a, '\n'};
    FILE *f = fopen(path, "rb");
    if (!f) return job_out_is_h5(path);
    unsigned char head[8] = {0};
    size_t got = fread(head, 1, sizeof head, f);
    fclose(f);
    return got == sizeof head && !memcmp(head, sig, sizeof sig);
}

/* ------------------------------------------------------------------------------------------------
 * Meta data and fingerprint */

char *job_hosts(struct comm *world, const char *my_host) {
    enum { HOST_LEN = 64 };
    char me[HOST_LEN] = {0};
    snprintf(me, sizeof me, "%s", my_host);
    int size = world ? world->size : 1;
    char *all = ds_calloc((size_t)size, HOST_LEN);
    if (world) world->ops->allgather(world, me, all, HOST_LEN, "host names");
    else memcpy(all, me, HOST_LEN);
    if (world && world->rank != 0) {
        free(all);
        return NULL;
    }
    char *list = ds_calloc((size_t)size, HOST_LEN + 1);
    for (int r = 0; r < size; r++) {
        const char *h = all + (size_t)r * HOST_LEN;
        bool seen = false;
        for (int q = 0; q < r && !seen; q++) seen = !strcmp(h, all + (size_t)q * HOST_LEN);
        if (seen) continue;
        if (list[0]) strcat(list, ",");
        strncat(list, h, HOST_LEN - 1);
    }
    free(all);
    return list;
}

/* Options that cannot change a single output value, left out of the fingerprint so that a job
 * can be resumed with a longer watchdog, quietly, or on another layout (every layout gives
 * bit-identical tokens: tests/cli/test_distributed.sh). The second column says whether the
 * option takes a value. --resume itself is left out of the stored job spec too. */
static const struct {
    const char *name;
    bool value;
} not_in_fingerprint[] = {
    {"--resume", false}, {"--quiet", false},    {"--watchdog", true}, {"--trace", true},
    {"--out", true},     {"--zstd-level", true}, {"--tp", true},       {"--pp", true},
    {"--pp-layers", true}, {"--engram", true}, {"--eager", false}, {"--moe-exchange", true},
};

/* argv without the listed options (all of them, or only --resume). */
static char **filter_args(int argc, char **argv, bool only_resume, int *n_out) {
    char **out = ds_malloc(sizeof *out * (size_t)(argc + 1));
    int n = 0;
    for (int i = 0; i < argc; i++) {
        int drop = 0;
        for (size_t k = 0; k < sizeof not_in_fingerprint / sizeof *not_in_fingerprint && i > 0; k++) {
            if (strcmp(argv[i], not_in_fingerprint[k].name)) continue;
            if (only_resume && strcmp(argv[i], "--resume")) continue;
            drop = not_in_fingerprint[k].value && i + 1 < argc ? 2 : 1;
        }
        if (drop) {
            i += drop - 1;
            continue;
        }
        out[n++] = argv[i];
    }
    out[n] = NULL;
    *n_out = n;
    return out;
}

/* The versions of CUDA and NCCL this binary links, when it was built with them. Declared here
 * rather than through their headers: host files stay free of CUDA headers (log.h), and both are
 * plain C functions taking an int pointer. */
#ifdef DS_HAVE_CUDA
int cudaRuntimeGetVersion(int *version);
int ncclGetVersion(int *version);
#endif

static void cuda_versions(char *cuda, size_t nc, char *nccl, size_t nn) {
    cuda[0] = nccl[0] = 0;
#ifdef DS_HAVE_CUDA
    int v = 0;
    if (cudaRuntimeGetVersion(&v) == 0) snprintf(cuda, nc, "%d.%d", v / 1000, (v % 1000) / 10);
    v = 0;
    if (ncclGetVersion(&v) == 0)
        snprintf(nccl, nn, "%d.%d.%d", v / 10000, (v % 10000) / 100, v % 100); /* NCCL >= 2.9 code */
#else
    (void)nc, (void)nn;
#endif
}

char *job_meta_json(const struct job_desc *j, char fp[H5IO_FINGERPRINT_LEN]) {
    int n;
    char **args = filter_args(j->argc, j->argv, true, &n);
    char *spec = jobspec_effective_json(n, args);
    free(args);
    args = filter_args(j->argc, j->argv, false, &n);
    char *fp_spec = jobspec_effective_json(n, args);
    free(args);
    char *config = config_to_json(j->cfg);
    size_t len = strlen(fp_spec) + strlen(config) + 2;
    char *fp_text = ds_malloc(len);
    snprintf(fp_text, len, "%s\n%s", fp_spec, config);
    h5_job_fingerprint(fp_text, fp);
    char cuda[32], nccl[32];
    cuda_versions(cuda, sizeof cuda, nccl, sizeof nccl);
    struct h5_meta m = {.job_spec_json = spec, .model_config_json = config, .rank_table = j->rank_table,
                        .git_commit = DS_GIT_COMMIT, .hosts = j->hosts, .cuda_version = cuda[0] ? cuda : NULL,
                        .nccl_version = nccl[0] ? nccl : NULL};
    char *meta = h5_meta_json(&m);
    /* the command and the fingerprint's own inputs, so a refused resume can be explained */
    cJSON *mj = cJSON_Parse(meta);
    if (cJSON_IsObject(mj)) {
        cJSON_AddStringToObject(mj, "command", j->argc > 0 ? j->argv[0] : "?");
        cJSON_AddStringToObject(mj, "fingerprint", fp);
        cJSON *fs = cJSON_Parse(fp_spec);
        cJSON_AddItemToObject(mj, "fingerprint_spec", fs ? fs : cJSON_CreateString(fp_spec));
        char *s = cJSON_PrintUnformatted(mj);
        free(meta);
        meta = ds_strdup(s);
        free(s);
    }
    cJSON_Delete(mj);
    free(fp_text);
    free(config);
    free(fp_spec);
    free(spec);
    return meta;
}

/* ------------------------------------------------------------------------------------------------
 * --save-logits rows */

void logit_rows_init(struct logit_rows *l, int64_t n_requests, int vocab) {
    l->vocab = vocab;
    l->n = n_requests;
    l->row = ds_calloc((size_t)n_requests + 1, sizeof *l->row);
    l->count = ds_calloc((size_t)n_requests + 1, sizeof *l->count);
    l->cap = ds_calloc((size_t)n_requests + 1, sizeof *l->cap);
}

void logit_rows_add(void *ctx, int index, const float *row, int vocab) {
    struct logit_rows *l = ctx;
    if (index < 0 || index >= l->n || vocab != l->vocab)
        ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "logit_rows_add", "a row of an unknown request or vocab");
    if (l->count[index] == l->cap[index]) {
        l->cap[index] = l->cap[index] ? 2 * l->cap[index] : 8;
        l->row[index] = ds_realloc(l->row[index], sizeof(float) * (size_t)(l->cap[index] * vocab));
    }
    memcpy(l->row[index] + (size_t)(l->count[index]++ * vocab), row, sizeof(float) * (size_t)vocab);
}

void logit_rows_free(struct logit_rows *l) {
    for (int64_t i = 0; i < l->n; i++) free(l->row[i]);
    free(l->row);
    free(l->count);
    free(l->cap);
    memset(l, 0, sizeof *l);
}

/* ------------------------------------------------------------------------------------------------
 * Opening */

void job_out_open(struct job_out *o, struct comm *world, bool writer, const char *path, enum h5_out_kind kind,
                  bool resume, bool logprobs, const struct job_desc *desc, int64_t n_prompts) {
    memset(o, 0, sizeof *o);
    o->writer = writer;
    o->kind = kind;
    o->n_prompts = n_prompts;
    o->done = ds_calloc((size_t)n_prompts + 1, 1);
    /* status[0]: 0 opened, -1 refused; the message travels with it */
    struct {
        int32_t rc;
        char msg[1500];
    } st = {0, ""};
    if (writer) {
        char fp[H5IO_FINGERPRINT_LEN];
        char *meta = job_meta_json(desc, fp);
        int rc = resume ? h5_out_open_resume(&o->h5, path, fp, n_prompts, o->done) : 1;
        if (rc == 1) {
            rc = kind == H5_OUT_SCORE ? h5_out_create_score(&o->h5, path, meta, fp, n_prompts)
                                      : h5_out_create(&o->h5, path, meta, fp, n_prompts, logprobs);
            memset(o->done, 0, (size_t)n_prompts);
        }
        free(meta);
        if (rc) {
            st.rc = -1;
            snprintf(st.msg, sizeof st.msg, "%s", ds_err_get());
        }
    }
    if (world) world->ops->bcast(world, &st, sizeof st, 0, "output open status");
    if (st.rc) ds_die("%s", st.msg);
    if (world) world->ops->bcast(world, o->done, (size_t)n_prompts, 0, "resumed prompts");
    for (int64_t i = 0; i < n_prompts; i++) o->n_resumed += o->done[i] != 0;
}

/* ------------------------------------------------------------------------------------------------
 * Records */

/* A record that h5io refuses is a bug here (an index out of range, a prompt recorded twice), not
 * bad input, and the other ranks are mid-generation: end the whole job at once. */
static void record_failed(const char *what) {
    ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", what, ds_err_get());
}

void job_out_on_done(void *ctx, int index, const struct gen_request *q) {
    struct job_out *o = ctx;
    struct h5_request_trace tr = {.admit_s = q->admit_s, .first_token_s = q->first_s, .last_token_s = q->last_s,
                                  .prompt_tokens = q->n, .generated_tokens = q->n_out};
    if (h5_out_append(&o->h5, index, q->out, q->lp, q->n_out, q->finish, &tr)) record_failed("h5_out_append");
    o->n_recorded++;
}

void job_out_scored(struct job_out *o, int64_t index, const double *logprobs, int64_t n, double nll,
                    const struct h5_request_trace *tr) {
    if (h5_out_append_score(&o->h5, index, logprobs, n, nll, tr)) record_failed("h5_out_append_score");
    o->n_recorded++;
}

void job_out_steps(struct job_out *o, const struct trace_event *ev, int64_t n) {
    struct h5_step_trace *st = ds_calloc((size_t)n + 1, sizeof *st);
    for (int64_t i = 0; i < n; i++)
        st[i] = (struct h5_step_trace){.rank = ev[i].rank, .stage = ev[i].stage, .tp = ev[i].tp, .step = ev[i].step,
                                       .seqs = ev[i].seqs, .rows = ev[i].rows, .start_s = ev[i].start,
                                       .end_s = ev[i].end, .compute_s = ev[i].end - ev[i].start,
                                       .comm_s = ev[i].comm, .wait_s = ev[i].wait, .tp_comm_s = ev[i].tp_comm};
    if (h5_out_write_steps(&o->h5, st, n)) record_failed("h5_out_write_steps");
    free(st);
}

/* ------------------------------------------------------------------------------------------------
 * The end of the job */

/* A whole 1-D dataset of the open output (its extent is exactly what was appended). */
static void read_whole(hid_t d, hid_t mtype, void *buf, int64_t n) {
    if (n <= 0) return;
    CHECK_H5(H5Dread(d, mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf));
}

static void write_1d(hid_t g, const char *name, hid_t ftype, hid_t mtype, int64_t n, const void *buf,
                     const char *meaning) {
    hid_t d = h5io_create_1d(g, name, ftype, n, false, 65536);
    if (n > 0) h5io_write_range(d, mtype, 0, n, buf);
    if (meaning) h5io_attr_str(d, "meaning", meaning);
    CHECK_H5(H5Dclose(d));
}

/* /outputs/text_chars + text_offsets: each row's tokens decoded, CSR like the prompt file's text. */
static void write_text(struct job_out *o, hid_t g, const struct tokenizer *tk, bool keep_special) {
    int64_t n = o->h5.n_done, nv = o->h5.n_values;
    int64_t *off = ds_malloc(sizeof *off * (size_t)(n + 1));
    int32_t *tok = ds_malloc(sizeof *tok * (size_t)(nv + 1));
    read_whole(o->h5.d_offsets, H5T_NATIVE_INT64, off, n + 1);
    read_whole(o->h5.d_tokens, H5T_NATIVE_INT32, tok, nv);
    int64_t *toff = ds_malloc(sizeof *toff * (size_t)(n + 1));
    char *chars = NULL;
    size_t len = 0, cap = 0;
    toff[0] = 0;
    for (int64_t r = 0; r < n; r++) {
        size_t tl = 0;
        char *t = tok_decode(tk, tok + off[r], (size_t)(off[r + 1] - off[r]), !keep_special, &tl);
        if (len + tl + 1 > cap) {
            cap = 2 * (len + tl) + 4096;
            chars = ds_realloc(chars, cap);
        }
        memcpy(chars + len, t, tl);
        len += tl;
        toff[r + 1] = (int64_t)len;
        free(t);
    }
    write_1d(g, "text_chars", H5T_STD_U8LE, H5T_NATIVE_UINT8, (int64_t)len, chars,
             keep_special ? "UTF-8 text of each row's tokens (special tokens kept); CSR with text_offsets"
                          : "UTF-8 text of each row's tokens (special tokens skipped); CSR with text_offsets");
    write_1d(g, "text_offsets", H5T_STD_I64LE, H5T_NATIVE_INT64, n + 1, toff, NULL);
    free(chars);
    free(toff);
    free(tok);
    free(off);
}

/* /outputs/logits [rows, vocab] fp32 + logits_offsets [n+1]: row k of output row r is the
 * distribution its k-th token was sampled from (the first one: the prompt's last prefill row). */
static void write_logits(struct job_out *o, hid_t g, const struct logit_rows *lr) {
    int64_t n = o->h5.n_done, V = lr->vocab;
    int64_t *idx = ds_malloc(sizeof *idx * (size_t)(n + 1)), *loff = ds_malloc(sizeof *loff * (size_t)(n + 1));
    read_whole(o->h5.d_index, H5T_NATIVE_INT64, idx, n);
    loff[0] = 0;
    for (int64_t r = 0; r < n; r++) {
        if (idx[r] < 0 || idx[r] >= lr->n) record_failed("write_logits: prompt index out of range");
        loff[r + 1] = loff[r] + lr->count[idx[r]];
    }
    hsize_t dims[2] = {(hsize_t)loff[n], (hsize_t)V};
    hid_t fs = H5Screate_simple(2, dims, NULL);
    CHECK_H5(fs);
    hid_t d = H5Dcreate2(g, "logits", H5T_IEEE_F32LE, fs, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    CHECK_H5(d);
    for (int64_t r = 0; r < n; r++) {
        hsize_t start[2] = {(hsize_t)loff[r], 0}, count[2] = {(hsize_t)(loff[r + 1] - loff[r]), (hsize_t)V};
        if (!count[0]) continue;
        CHECK_H5(H5Sselect_hyperslab(fs, H5S_SELECT_SET, start, NULL, count, NULL));
        hid_t ms = H5Screate_simple(2, count, NULL);
        CHECK_H5(ms);
        CHECK_H5(H5Dwrite(d, H5T_NATIVE_FLOAT, ms, fs, H5P_DEFAULT, lr->row[idx[r]]));
        CHECK_H5(H5Sclose(ms));
    }
    h5io_attr_str(d, "meaning", "fp32 logits rows; row k of output row r (logits_offsets[r] + k) is the "
                                "distribution its k-th token was sampled from");
    CHECK_H5(H5Dclose(d));
    CHECK_H5(H5Sclose(fs));
    write_1d(g, "logits_offsets", H5T_STD_I64LE, H5T_NATIVE_INT64, n + 1, loff, NULL);
    free(idx);
    free(loff);
}

void job_out_finish(struct job_out *o, const struct tokenizer *tk, bool keep_special, const struct logit_rows *lr) {
    if (o->writer && o->kind == H5_OUT_GENERATE && (tk || lr)) {
        hid_t g = H5Gopen2(o->h5.file, "/outputs", H5P_DEFAULT);
        CHECK_H5(g);
        /* a complete output reopened by --resume already has them */
        htri_t has_text = H5Lexists(g, "text_chars", H5P_DEFAULT), has_logits = H5Lexists(g, "logits", H5P_DEFAULT);
        CHECK_H5(has_text);
        CHECK_H5(has_logits);
        if (tk && !has_text) write_text(o, g, tk, keep_special);
        if (lr && !has_logits) write_logits(o, g, lr);
        CHECK_H5(H5Gclose(g));
    }
    if (o->writer && h5_out_finish(&o->h5)) ds_die_err();
    free(o->done);
    memset(o, 0, sizeof *o);
}
