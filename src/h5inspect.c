/* `dsbatch inspect FILE.h5`: what an operator wants to know about a batch job's HDF5 files.
 *
 * For an output file: whether the job completed, its job spec, how many requests and tokens it
 * recorded, throughput, and TTFT / inter-token latency percentiles from /trace/requests (ITL per
 * request is (last token - first token) / (generated - 1); TTFT is first token - admit). Wall time
 * is summed over runs, since a resumed job's times restart at each run's origin. For a prompt file:
 * the whole file goes through the engine's reader, so a file that inspects cleanly is one a job
 * will accept (bar the vocabulary and length limits that only the model knows). The file is opened
 * without HDF5 file locking so that a running job's output can be looked at. */
#include <cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "h5io.h"
#include "log.h"

/* The memory layout we read /trace/requests into; HDF5 matches compound fields by name. */
struct req_rec {
    int64_t prompt_index;
    int32_t run;
    double admit_s, first_token_s, last_token_s;
    int64_t prompt_tokens, generated_tokens;
};

/* A variable-length string attribute or scalar dataset (as dsbatch writes them); caller frees. */
static char *get_vlen_str(hid_t obj, const char *name, bool dataset) {
    htri_t e = dataset ? H5Lexists(obj, name, H5P_DEFAULT) : H5Aexists(obj, name);
    CHECK_H5(e);
    if (!e) return NULL;
    hid_t h = dataset ? H5Dopen2(obj, name, H5P_DEFAULT) : H5Aopen(obj, name, H5P_DEFAULT);
    CHECK_H5(h);
    hid_t ft = dataset ? H5Dget_type(h) : H5Aget_type(h);
    CHECK_H5(ft);
    char *r = NULL;
    htri_t var = H5Tget_class(ft) == H5T_STRING ? H5Tis_variable_str(ft) : 0;
    CHECK_H5(var);
    if (var) {
        hid_t t = H5Tcopy(H5T_C_S1);
        CHECK_H5(t);
        CHECK_H5(H5Tset_size(t, H5T_VARIABLE));
        CHECK_H5(H5Tset_cset(t, H5Tget_cset(ft))); /* no ASCII <-> UTF-8 conversion in HDF5 */
        char *s = NULL;
        if (dataset)
            CHECK_H5(H5Dread(h, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, &s));
        else
            CHECK_H5(H5Aread(h, t, &s));
        r = ds_strdup(s ? s : "");
        if (s) CHECK_H5(H5free_memory(s));
        CHECK_H5(H5Tclose(t));
    }
    CHECK_H5(H5Tclose(ft));
    CHECK_H5(dataset ? H5Dclose(h) : H5Aclose(h));
    return r;
}

static int64_t dataset_len(hid_t f, const char *path) {
    htri_t e = H5Lexists(f, path, H5P_DEFAULT);
    CHECK_H5(e);
    if (!e) return -1;
    hid_t d = H5Dopen2(f, path, H5P_DEFAULT);
    CHECK_H5(d);
    hid_t s = H5Dget_space(d);
    CHECK_H5(s);
    hssize_t n = H5Sget_simple_extent_npoints(s);
    CHECK_H5(n);
    CHECK_H5(H5Sclose(s));
    CHECK_H5(H5Dclose(d));
    return (int64_t)n;
}

static void read_all(hid_t f, const char *path, hid_t mtype, void *buf) {
    hid_t d = H5Dopen2(f, path, H5P_DEFAULT);
    CHECK_H5(d);
    CHECK_H5(H5Dread(d, mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf));
    CHECK_H5(H5Dclose(d));
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* p50 / p90 / p99 by nearest rank over the finite values. */
static void print_percentiles(FILE *out, const char *label, double *v, int64_t n) {
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (isfinite(v[i])) v[m++] = v[i];
    if (m == 0) {
        fprintf(out, "%-12s no data\n", label);
        return;
    }
    qsort(v, (size_t)m, sizeof *v, cmp_double);
    const double ps[] = {50, 90, 99};
    fprintf(out, "%-12s", label);
    for (int k = 0; k < 3; k++) {
        int64_t r = (int64_t)ceil(ps[k] / 100.0 * (double)m) - 1;
        if (r < 0) r = 0;
        fprintf(out, " p%.0f %.4f s ", ps[k], v[r]);
    }
    fprintf(out, "(%lld requests)\n", (long long)m);
}

static void print_job(FILE *out, hid_t f) {
    htri_t e = H5Lexists(f, "/meta", H5P_DEFAULT);
    CHECK_H5(e);
    char *json = e ? get_vlen_str(f, "/meta/json", true) : NULL;
    cJSON *meta = json ? cJSON_Parse(json) : NULL;
    const cJSON *job = cJSON_GetObjectItem(meta, "job_spec");
    char *line = job ? (cJSON_IsString(job) ? ds_strdup(job->valuestring) : cJSON_PrintUnformatted(job)) : NULL;
    fprintf(out, "%-12s %s\n", "job", line ? line : "(no job spec recorded)");
    const cJSON *c = cJSON_GetObjectItem(meta, "git_commit"), *st = cJSON_GetObjectItem(meta, "start_time");
    const cJSON *v = cJSON_GetObjectItem(meta, "versions");
    if (cJSON_IsString(st) || cJSON_IsString(c))
        fprintf(out, "%-12s started %s, commit %s\n", "run", cJSON_IsString(st) ? st->valuestring : "?",
                cJSON_IsString(c) ? c->valuestring : "?");
    if (v) {
        const cJSON *h = cJSON_GetObjectItem(v, "hdf5"), *z = cJSON_GetObjectItem(v, "zstd");
        fprintf(out, "%-12s hdf5 %s, zstd %s\n", "versions", cJSON_IsString(h) ? h->valuestring : "?",
                cJSON_IsString(z) ? z->valuestring : "?");
    }
    free(line);
    cJSON_Delete(meta);
    free(json);
}

static int inspect_output(const char *path, hid_t f, const char *kind, FILE *out) {
    bool score = !strcmp(kind, "score");
    const char *g = score ? "/scores" : "/outputs";
    int64_t complete = 0, n_prompts = 0, runs = 1;
    h5io_attr_get_i64(f, "complete", &complete);
    h5io_attr_get_i64(f, "n_prompts", &n_prompts);
    h5io_attr_get_i64(f, "runs", &runs);
    char *comp = get_vlen_str(f, "compression", false);
    char p[64];
    snprintf(p, sizeof p, "%s/prompt_index", g);
    int64_t n = dataset_len(f, p), nreq = dataset_len(f, "/trace/requests");
    if (n < 0 || nreq < 0) {
        free(comp);
        ds_err_set("%s: %s: missing dataset (damaged dsbatch output)", path, n < 0 ? p : "/trace/requests");
        return -1;
    }
    if (nreq > n) nreq = n; /* rows past the last index belong to an unfinished append */
    fprintf(out, "%-12s %s: dsbatch %s output, complete %lld%s, %lld run%s\n", "file", path, kind,
            (long long)complete, complete ? "" : " (unfinished or killed: resumable)", (long long)runs,
            runs == 1 ? "" : "s");
    print_job(out, f);
    fprintf(out, "%-12s %lld of %lld prompts recorded\n", "requests", (long long)n, (long long)n_prompts);

    struct req_rec *rq = ds_malloc(sizeof *rq * (size_t)(nreq + 1));
    hid_t t = H5Tcreate(H5T_COMPOUND, sizeof(struct req_rec));
    CHECK_H5(t);
    CHECK_H5(H5Tinsert(t, "prompt_index", HOFFSET(struct req_rec, prompt_index), H5T_NATIVE_INT64));
    CHECK_H5(H5Tinsert(t, "run", HOFFSET(struct req_rec, run), H5T_NATIVE_INT32));
    CHECK_H5(H5Tinsert(t, "admit_s", HOFFSET(struct req_rec, admit_s), H5T_NATIVE_DOUBLE));
    CHECK_H5(H5Tinsert(t, "first_token_s", HOFFSET(struct req_rec, first_token_s), H5T_NATIVE_DOUBLE));
    CHECK_H5(H5Tinsert(t, "last_token_s", HOFFSET(struct req_rec, last_token_s), H5T_NATIVE_DOUBLE));
    CHECK_H5(H5Tinsert(t, "prompt_tokens", HOFFSET(struct req_rec, prompt_tokens), H5T_NATIVE_INT64));
    CHECK_H5(H5Tinsert(t, "generated_tokens", HOFFSET(struct req_rec, generated_tokens), H5T_NATIVE_INT64));
    if (nreq > 0) {
        hid_t d = H5Dopen2(f, "/trace/requests", H5P_DEFAULT);
        CHECK_H5(d);
        hid_t fs = H5Dget_space(d);
        CHECK_H5(fs);
        hsize_t st = 0, cnt = (hsize_t)nreq;
        CHECK_H5(H5Sselect_hyperslab(fs, H5S_SELECT_SET, &st, NULL, &cnt, NULL));
        hid_t ms = H5Screate_simple(1, &cnt, NULL);
        CHECK_H5(ms);
        CHECK_H5(H5Dread(d, t, ms, fs, H5P_DEFAULT, rq));
        CHECK_H5(H5Sclose(ms));
        CHECK_H5(H5Sclose(fs));
        CHECK_H5(H5Dclose(d));
    }
    CHECK_H5(H5Tclose(t));

    int64_t ptok = 0, gtok = 0;
    for (int64_t i = 0; i < nreq; i++) {
        if (rq[i].prompt_tokens > 0) ptok += rq[i].prompt_tokens;
        if (rq[i].generated_tokens > 0) gtok += rq[i].generated_tokens;
    }
    snprintf(p, sizeof p, "%s/offsets", g);
    int64_t n_off = dataset_len(f, p), values = 0;
    if (n_off > n && n_off > 0) {
        int64_t *off = ds_malloc(sizeof *off * (size_t)n_off);
        read_all(f, p, H5T_NATIVE_INT64, off);
        values = off[n];
        free(off);
    }
    if (score) {
        double sum = 0;
        snprintf(p, sizeof p, "%s/nll", g);
        if (n > 0 && dataset_len(f, p) >= n) {
            int64_t len = dataset_len(f, p);
            double *all = ds_malloc(sizeof *all * (size_t)len);
            read_all(f, p, H5T_NATIVE_DOUBLE, all);
            for (int64_t i = 0; i < n; i++) sum += all[i];
            free(all);
        }
        fprintf(out, "%-12s %lld prompt tokens, %lld scored; NLL %.4f per token, perplexity %.3f\n", "tokens",
                (long long)ptok, (long long)values, values ? sum / (double)values : 0.0,
                values ? exp(sum / (double)values) : 0.0);
    } else {
        int64_t fin[3] = {0, 0, 0};
        if (n > 0 && dataset_len(f, "/outputs/finish_reason") >= n) {
            int64_t len = dataset_len(f, "/outputs/finish_reason");
            int8_t *fr = ds_malloc((size_t)len);
            read_all(f, "/outputs/finish_reason", H5T_NATIVE_INT8, fr);
            for (int64_t i = 0; i < n; i++)
                if (fr[i] >= 0 && fr[i] <= 2) fin[fr[i]]++;
            free(fr);
        }
        fprintf(out, "%-12s %lld prompt, %lld generated (%.1f per request)\n", "tokens", (long long)ptok,
                (long long)values, n ? (double)values / (double)n : 0.0);
        fprintf(out, "%-12s length %lld, stop (EOS) %lld, stop id %lld\n", "finish", (long long)fin[0],
                (long long)fin[1], (long long)fin[2]);
    }

    /* Wall time: per run, first admit to last token. */
    double wall = 0;
    for (int64_t r = 0; r < runs; r++) {
        double lo = INFINITY, hi = -INFINITY;
        for (int64_t i = 0; i < nreq; i++) {
            if (rq[i].run != r) continue;
            if (isfinite(rq[i].admit_s) && rq[i].admit_s < lo) lo = rq[i].admit_s;
            if (isfinite(rq[i].last_token_s) && rq[i].last_token_s > hi) hi = rq[i].last_token_s;
        }
        if (hi > lo) wall += hi - lo;
    }
    int64_t counted = score ? values : gtok;
    if (wall > 0)
        fprintf(out, "%-12s %.3f s of requests in flight; %.1f %s tok/s, %.1f tok/s with prompts\n", "throughput",
                wall, (double)counted / wall, score ? "scored" : "generated", (double)(counted + ptok) / wall);
    else
        fprintf(out, "%-12s no timing recorded\n", "throughput");
    double *v = ds_malloc(sizeof *v * (size_t)(nreq + 1));
    for (int64_t i = 0; i < nreq; i++) v[i] = rq[i].first_token_s - rq[i].admit_s;
    print_percentiles(out, "TTFT", v, nreq);
    if (!score) {
        for (int64_t i = 0; i < nreq; i++)
            v[i] = rq[i].generated_tokens >= 2
                       ? (rq[i].last_token_s - rq[i].first_token_s) / (double)(rq[i].generated_tokens - 1)
                       : NAN;
        print_percentiles(out, "ITL", v, nreq);
    }
    free(v);
    free(rq);
    int64_t steps = dataset_len(f, "/trace/steps");
    fprintf(out, "%-12s %lld step records\n", "steps", (long long)(steps > 0 ? steps : 0));
    fprintf(out, "%-12s %s\n", "compression", comp ? comp : "?");
    free(comp);
    return 0;
}

int h5_prompts_summary(const char *path, int64_t vocab, int64_t max_len, FILE *out) {
    struct h5_prompts p;
    if (h5_prompts_open(&p, path, MPI_COMM_SELF)) return -1;
    struct h5_prompt_limits lim = {.vocab = vocab, .max_len = max_len, .default_sp = {.top_p = 1}};
    int64_t min_len = INT64_MAX, max_seen = 0;
    int32_t max_tok = -1;
    const int64_t window = 65536; /* bounded memory for big files */
    for (int64_t first = 0; first < p.n_prompts; first += window) {
        int64_t count = p.n_prompts - first < window ? p.n_prompts - first : window;
        struct h5_prompt_batch b;
        if (h5_prompts_read(&p, first, count, 0, 1, &lim, &b)) {
            h5_prompts_close(&p);
            return -1;
        }
        for (int64_t j = 0; j < b.n; j++) {
            int64_t l = b.offsets[j + 1] - b.offsets[j];
            if (l < min_len) min_len = l;
            if (l > max_seen) max_seen = l;
        }
        for (int64_t k = 0; k < b.offsets[b.n]; k++)
            if (b.tokens[k] > max_tok) max_tok = b.tokens[k];
        h5_prompt_batch_free(&b);
    }
    fprintf(out, "%s: prompt file, %lld prompts, %lld tokens, lengths %lld..%lld, largest token id %d, ids %s, "
                 "fields:%s%s%s%s%s%s\n",
            path, (long long)p.n_prompts, (long long)p.n_tokens, (long long)(p.n_prompts ? min_len : 0),
            (long long)max_seen, max_tok, p.id_kind == 2 ? "string" : p.id_kind == 1 ? "integer" : "none",
            p.has_max_new ? " max_new_tokens" : "", p.has_temperature ? " temperature" : "",
            p.has_top_p ? " top_p" : "", p.has_top_k ? " top_k" : "", p.has_seed ? " seed" : "",
            p.has_text ? " text" : "");
    h5_prompts_close(&p);
    return 0;
}

int h5_inspect(const char *path, FILE *out) {
    FILE *probe = fopen(path, "rb");
    if (!probe) {
        ds_err_set("%s: cannot open HDF5 file: %s", path, ds_errno_str());
        return -1;
    }
    fclose(probe);
    h5zstd_register();
    htri_t is = -1;
    H5E_BEGIN_TRY { is = H5Fis_hdf5(path); }
    H5E_END_TRY;
    if (is <= 0) {
        ds_err_set("%s: not an HDF5 file", path);
        return -1;
    }
    hid_t fapl = H5Pcreate(H5P_FILE_ACCESS);
    CHECK_H5(fapl);
    CHECK_H5(H5Pset_file_locking(fapl, 0, 1)); /* a running job holds its output's lock */
    hid_t f = -1;
    H5E_BEGIN_TRY { f = H5Fopen(path, H5F_ACC_RDONLY, fapl); }
    H5E_END_TRY;
    CHECK_H5(H5Pclose(fapl));
    if (f < 0) {
        ds_err_set("%s: cannot be opened as HDF5 (damaged or truncated)", path);
        return -1;
    }
    char *kind = get_vlen_str(f, "kind", false);
    htri_t prompts = H5Lexists(f, "/prompts", H5P_DEFAULT);
    CHECK_H5(prompts);
    int rc;
    if (kind && (!strcmp(kind, "generate") || !strcmp(kind, "score"))) {
        rc = inspect_output(path, f, kind, out);
        CHECK_H5(H5Fclose(f));
    } else {
        CHECK_H5(H5Fclose(f));
        if (prompts) {
            rc = h5_prompts_summary(path, 0, 0, out);
        } else {
            ds_err_set("%s: neither a dsbatch output (no root attribute 'kind') nor a prompt file (no /prompts)", path);
            rc = -1;
        }
    }
    free(kind);
    return rc;
}
