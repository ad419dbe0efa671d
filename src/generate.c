/* `dsbatch generate` and `dsbatch score` (issues #3, #5): prompts from JSONL or an HDF5 prompt
 * file, results to JSONL or an HDF5 output file.
 * A JSONL prompt line gives token ids ("tokens") or text ("text", issue #8): text goes through the
 * model folder's tokenizer.json (or --tokenizer), framed by the tokenizer's BOS policy or, with
 * --chat / --think, by the DeepSeek-V4.1 chat format; every rank encodes the same file the same
 * way, so the ids agree without a broadcast. An HDF5 prompt file (src/h5io.h) is read by every
 * rank of the job in one collective read per dataset, each rank taking the whole prompt set
 * (dist_generate wants the same request list everywhere, and rank 0 every prompt's length and id).
 * Outputs carry the decoded text next to the tokens whenever a tokenizer is available.
 * generate: continuous batching over `--max-seqs` slots (src/dist.c). A JSONL output is written at
 * the end in input order; an HDF5 output (--out NAME.h5, src/jobout.c) gets each request the moment
 * it finishes, durably, so `--resume` after a kill skips what was recorded and produces the same
 * tokens as an uninterrupted run (a request's sampling stream is keyed by its prompt index).
 * score: per-token log-probabilities of each prompt's own tokens, computed chunk by chunk so no
 * logits buffer larger than a chunk is ever held; one rank. */
#include <cJSON.h>
#include <limits.h>
#include <mpi.h>
#include <math.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cli_args.h"
#include "dist.h"
#include "engine_cli.h"
#include "h5io.h"
#include "jobout.h"
#include "log.h"
#include "model.h"
#include "prompt_fields.h"
#include "sampler.h"
#include "tokenizer.h"

struct prompt {
    cJSON *id;
    int32_t *tokens;
    int64_t n;
    int64_t max_new;
    struct sample_params sp;
    /* results */
    int32_t *out;
    int64_t n_out;
    const char *finish;
};

struct gen_opts {
    const char *model, *prompts, *out;
    int64_t max_new, max_seq_len, chunk;
    int max_seqs;
    struct sample_params sp;
    struct engine_flags ef;
    bool logprobs;
    const char *trace;
    struct dist_opts dist;
    /* text */
    const char *tokenizer;       /* --tokenizer PATH (default: MODEL/tokenizer.json) */
    struct tok_prompt_opts chat; /* --chat, --think N, --system TEXT */
    bool keep_special;           /* --keep-special: special tokens stay in the output text */
    /* jobs (issue #5) */
    bool resume;                 /* --resume: continue an HDF5 output, skipping recorded prompts */
    bool save_logits;            /* --save-logits: every sampled logits row into the output (debug) */
    bool report_logits_rows;     /* score --report-logits-rows: the logits path's largest buffer */
};

/* --save-logits keeps every row in memory until the end: a debug option for small jobs. */
#define SAVE_LOGITS_MAX_BYTES (256.0 * 1024 * 1024)

/* The model's tokenizer, loaded on first need; NULL when there is none and `required` is false. */
static struct tokenizer *gen_tokenizer(struct tokenizer **tk, const struct gen_opts *o, int32_t bos_id, bool required,
                                       const char *why) {
    if (*tk) return *tk;
    bool missing;
    *tk = tok_open_model(o->model, o->tokenizer, bos_id, &missing);
    if (!*tk && !missing) ds_die_err();
    if (!*tk && o->tokenizer) ds_die("%s needs a tokenizer: --tokenizer %s does not exist", why, o->tokenizer);
    if (!*tk && required)
        ds_die("%s needs a tokenizer: %s/tokenizer.json does not exist (give one with --tokenizer PATH)", why, o->model);
    return *tk;
}

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) ds_die("%s: cannot open: %s", path, ds_errno_str());
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = ds_malloc((size_t)n + 1);
    if (fread(b, 1, (size_t)n, f) != (size_t)n) ds_die("%s: short read", path);
    b[n] = 0;
    fclose(f);
    *len = (size_t)n;
    return b;
}

static struct prompt *read_prompts(const char *path, const struct gen_opts *o, const struct model_config *cfg,
                                   struct tokenizer **tkz, int *count) {
    int vocab = cfg->vocab_size;
    size_t len;
    char *text = read_file(path, &len);
    struct prompt *ps = NULL;
    int n = 0, line = 0;
    for (char *s = text, *e; s && *s; s = e ? e + 1 : NULL) {
        e = strchr(s, '\n');
        if (e) *e = 0;
        line++;
        if (strspn(s, " \t\r") == strlen(s)) continue;
        cJSON *j = cJSON_Parse(s);
        if (!j || !cJSON_IsObject(j)) ds_die("%s:%d: not a JSON object", path, line);
        cJSON *tk = cJSON_GetObjectItem(j, "tokens"), *tx = cJSON_GetObjectItem(j, "text");
        if (tk && tx) ds_die("%s:%d: give either tokens or text, not both", path, line);
        if (tx && !cJSON_IsString(tx)) ds_die("%s:%d: text: expected a string", path, line);
        if (!tx && (!cJSON_IsArray(tk) || cJSON_GetArraySize(tk) < 1))
            ds_die("%s:%d: tokens: expected a non-empty array of token ids (or a \"text\" string)", path, line);
        ps = ds_realloc(ps, sizeof *ps * (size_t)(n + 1));
        struct prompt *p = &ps[n];
        memset(p, 0, sizeof *p);
        cJSON *id = cJSON_GetObjectItem(j, "id");
        p->id = id ? cJSON_Duplicate(id, 1) : cJSON_CreateNumber(n);
        if (tx) {
            char why[600];
            snprintf(why, sizeof why, "%s:%d: a text prompt", path, line);
            struct tokenizer *t = gen_tokenizer(tkz, o, cfg->bos_id, true, why);
            struct tok_prompt_opts po = o->chat;
            cJSON *sys = cJSON_GetObjectItem(j, "system");
            if (cJSON_IsString(sys)) po.system = sys->valuestring;
            if (po.system && !po.chat) ds_die("%s:%d: system: needs --chat or --think", path, line);
            struct tok_ids ids = {0};
            if (tok_encode_prompt(t, tx->valuestring, strlen(tx->valuestring), &po, &ids))
                ds_die("%s:%d: text: %s", path, line, ds_err_get());
            if (!ids.n) ds_die("%s:%d: text: encodes to no tokens", path, line);
            for (size_t k = 0; k < ids.n; k++)
                if (ids.ids[k] >= vocab)
                    ds_die("%s:%d: text: token %d (%s) is outside the model's vocabulary [0, %d)", path, line, ids.ids[k],
                           tok_id_to_token(t, ids.ids[k]), vocab);
            p->tokens = ids.ids, p->n = (int64_t)ids.n;
        } else {
            p->n = cJSON_GetArraySize(tk);
            p->tokens = ds_malloc(sizeof(int32_t) * (size_t)p->n);
            int64_t i = 0;
            cJSON *v;
            cJSON_ArrayForEach(v, tk) {
                int64_t id;
                if (prompt_json_int(v, 0, vocab - 1, &id))
                    ds_die("%s:%d: tokens[%lld]: token id outside the vocabulary [0, %d)", path, line, (long long)i, vocab);
                p->tokens[i++] = (int32_t)id;
            }
        }
        struct prompt_fields pf; /* checked as `dsbatch prompts` and the HDF5 reader check them */
        if (prompt_fields_json(j, path, line, &pf)) ds_die_err();
        p->max_new = pf.has_max_new ? pf.max_new : o->max_new;
        p->sp = o->sp;
        if (pf.has_temperature) p->sp.temperature = pf.temperature;
        if (pf.has_top_k) p->sp.top_k = pf.top_k;
        if (pf.has_top_p) p->sp.top_p = pf.top_p;
        if (pf.has_seed) p->sp.seed = pf.seed;
        if (p->n + p->max_new > o->max_seq_len)
            ds_die("%s:%d: prompt of %lld tokens + max_new_tokens %lld exceeds the maximum sequence length %lld",
                   path, line, (long long)p->n, (long long)p->max_new, (long long)o->max_seq_len);
        cJSON_Delete(j);
        n++;
    }
    free(text);
    *count = n;
    return ps;
}

/* An HDF5 prompt file: every rank of comm reads the whole prompt set (dp_rank 0 of 1), with one
 * collective read per dataset; 4 bytes per prompt token per rank. Validation (token ids below the
 * vocabulary, prompt + max_new_tokens within the maximum sequence length, sampling fields) is the
 * reader's, agreed over comm, so every rank dies with the same line naming file and dataset. */
static struct prompt *read_prompts_h5(const char *path, MPI_Comm comm, const struct gen_opts *o,
                                      const struct model_config *cfg, bool score, int *count) {
    struct h5_prompts hp;
    if (h5_prompts_open(&hp, path, comm)) ds_die_err();
    /* score needs no room for new tokens: its own length check follows */
    struct h5_prompt_limits lim = {.vocab = cfg->vocab_size, .max_len = score ? 0 : o->max_seq_len,
                                   .default_max_new = score ? 0 : o->max_new, .default_sp = o->sp};
    struct h5_prompt_batch b;
    bool too_many = hp.n_prompts > INT_MAX / 2;
    int rc = too_many ? -1 : h5_prompts_read(&hp, 0, hp.n_prompts, 0, 1, &lim, &b);
    char why[1200];
    if (too_many)
        snprintf(why, sizeof why, "%s: /prompts/offsets: %lld prompts, more than one job takes (%d)", path,
                 (long long)hp.n_prompts, INT_MAX / 2);
    else
        snprintf(why, sizeof why, "%s", ds_err_get());
    h5_prompts_close(&hp);
    if (rc) ds_die("%s", why);
    struct prompt *ps = ds_calloc((size_t)b.n + 1, sizeof *ps);
    for (int64_t j = 0; j < b.n; j++) {
        struct prompt *p = &ps[j];
        p->n = b.offsets[j + 1] - b.offsets[j];
        if (score && p->n > o->max_seq_len)
            ds_die("%s: /prompts/offsets: prompt %lld has %lld tokens, above the maximum sequence length %lld", path,
                   (long long)b.index[j], (long long)p->n, (long long)o->max_seq_len);
        p->tokens = ds_malloc(sizeof(int32_t) * (size_t)p->n);
        memcpy(p->tokens, b.tokens + b.offsets[j], sizeof(int32_t) * (size_t)p->n);
        p->id = b.id_kind == 1   ? cJSON_CreateNumber((double)b.int_id[j])
                : b.id_kind == 2 ? cJSON_CreateString(b.id[j])
                                 : cJSON_CreateNumber((double)b.index[j]);
        p->max_new = score ? 0 : b.max_new[j];
        p->sp = b.sp[j];
    }
    *count = (int)b.n;
    h5_prompt_batch_free(&b);
    return ps;
}

static struct prompt *load_prompts(const struct gen_opts *o, MPI_Comm comm, const struct model_config *cfg,
                                   struct tokenizer **tk, bool score, int *count) {
    if (job_prompts_is_h5(o->prompts)) return read_prompts_h5(o->prompts, comm, o, cfg, score, count);
    return read_prompts(o->prompts, o, cfg, tk, count);
}

static int parse_gen_opts(int argc, char **argv, struct gen_opts *o, bool score) {
    *o = (struct gen_opts){.max_new = 16, .max_seqs = 8, .chunk = 512, .sp = {.temperature = 0, .top_p = 1}};
    if (score) o->max_seqs = 1; /* a step of one prompt's chunk: the logits never exceed --chunk rows */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
#define OPT(name) (!strcmp(a, name) && v && (i++, 1))
        if (OPT("--model")) o->model = v;
        else if (OPT("--prompts")) o->prompts = v;
        else if (OPT("--out")) o->out = v;
        else if (OPT("--max-new-tokens")) o->max_new = cli_int(a, v, 0, INT64_MAX / 2);
        else if (OPT("--max-seqs")) o->max_seqs = (int)cli_int(a, v, 1, INT32_MAX);
        else if (OPT("--max-seq-len")) o->max_seq_len = cli_int(a, v, 0, INT64_MAX / 2);
        else if (OPT("--chunk")) o->chunk = cli_int(a, v, 1, INT32_MAX);
        else if (OPT("--temperature")) o->sp.temperature = (float)cli_real(a, v, 0, INFINITY, false);
        else if (OPT("--top-k")) o->sp.top_k = (int)cli_int(a, v, 0, INT32_MAX);
        else if (OPT("--top-p")) o->sp.top_p = (float)cli_real(a, v, 0, 1, true);
        else if (OPT("--seed")) o->sp.seed = cli_u64(a, v);
        else if (!strcmp(a, "--logprobs")) o->logprobs = true;
        else if (OPT("--trace")) o->trace = v;
        else if (OPT("--tokenizer")) o->tokenizer = v;
        else if (!strcmp(a, "--chat")) o->chat.chat = o->chat.chat ? o->chat.chat : TOK_CHAT_PLAIN;
        else if (OPT("--think")) o->chat.chat = TOK_CHAT_THINKING, o->chat.reasoning_effort = (int)cli_int(a, v, 1, 100);
        else if (OPT("--system")) o->chat.system = v;
        else if (!strcmp(a, "--keep-special")) o->keep_special = true;
        else if (!strcmp(a, "--resume")) o->resume = true;
        else if (!score && !strcmp(a, "--save-logits")) o->save_logits = true;
        else if (score && !strcmp(a, "--report-logits-rows")) o->report_logits_rows = true;
        else if (OPT("--zstd-level")) h5io_set_zstd_level((int)cli_int(a, v, 0, 22)); /* 0: none */
        else if (engine_flag_parse(argc, argv, &i, &o->ef)) continue;
        else if (dist_flag_parse(argc, argv, &i, &o->dist)) continue;
        else if (!strcmp(a, "--help")) {
            printf("usage: dsbatch %s --model DIR --prompts P.jsonl|P.h5 --out R.jsonl|R.h5 [--max-new-tokens N]\n"
                   "       [--max-seqs N] [--max-seq-len N] [--chunk N] [--temperature T] [--top-k K] [--top-p P]\n"
                   "       [--seed S] [--logprobs] [--trace STEPS.csv]\n"
                   "       [--resume] [--zstd-level N] [--save-logits (generate)] [--report-logits-rows (score)]\n"
                   "       (--out NAME.h5: HDF5 output, each request recorded as it finishes; --resume continues one,\n"
                   "        skipping recorded prompts; P.h5: an HDF5 prompt file from `dsbatch prompts`)\n"
                   "       [--tokenizer PATH] [--chat | --think EFFORT] [--system TEXT] [--keep-special]\n"
                   "       (prompt lines: {\"tokens\": [ids]} or {\"text\": \"...\"}; text uses MODEL/tokenizer.json;\n"
                   "        --chat: DeepSeek-V4.1 chat format, --think EFFORT (1-100): its thinking mode)\n"
                   "       [--no-stale-index-keys] [--window-layout reference|decode] [--backend cpu|cuda] [--exact-linears] [--eager]\n"
                   "       [--tp N] [--pp N] [--pp-layers A,B,..] [--watchdog SECONDS] [--engram service|per-rank]\n"
                   "       [--moe-exchange auto|gather|owner]   (the last two lines: under mpirun)\n",
                   score ? "score" : "generate");
            exit(0);
        } else
            ds_die("%s: unknown option '%s'", score ? "score" : "generate", a);
#undef OPT
    }
    if (!o->model || !o->prompts || !o->out) ds_die("--model, --prompts and --out are required");
    if (o->chat.system && !o->chat.chat) ds_die("--system needs --chat or --think");
    return 0;
}

/* Write to path.tmp and rename, so a killed run never leaves a file that looks complete. */
static FILE *open_out(const char *path, char *tmp, size_t n) {
    snprintf(tmp, n, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) ds_die("%s: cannot write: %s", path, ds_errno_str());
    return f;
}

static void close_out(FILE *f, const char *tmp, const char *path) {
    if (fclose(f) != 0 || rename(tmp, path) != 0) ds_die("%s: cannot write: %s", path, ds_errno_str());
}

/* The JSONL output of generate, in input order (world rank 0, at the end). */
static void write_generate_jsonl(const struct gen_opts *o, struct prompt *ps, const struct gen_request *rq, int np,
                                 const struct tokenizer *tk, const struct logit_rows *lr) {
    char tmp[1100];
    FILE *f = open_out(o->out, tmp, sizeof tmp);
    for (int i = 0; i < np; i++) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddItemToObject(j, "id", ps[i].id);
        ps[i].id = NULL;
        cJSON *a = cJSON_AddArrayToObject(j, "output_tokens");
        for (int64_t k = 0; k < rq[i].n_out; k++) cJSON_AddItemToArray(a, cJSON_CreateNumber(rq[i].out[k]));
        if (tk) {
            char *txt = tok_decode(tk, rq[i].out, (size_t)rq[i].n_out, !o->keep_special, NULL);
            cJSON_AddStringToObject(j, "text", txt);
            free(txt);
        }
        cJSON_AddStringToObject(j, "finish_reason", rq[i].finish ? "stop" : "length");
        if (o->logprobs) {
            cJSON *l = cJSON_AddArrayToObject(j, "logprobs");
            for (int64_t k = 0; k < rq[i].n_out; k++) cJSON_AddItemToArray(l, cJSON_CreateNumber(rq[i].lp[k]));
        }
        if (lr) { /* row k: the distribution output token k was drawn from */
            cJSON *rows = cJSON_AddArrayToObject(j, "logits");
            for (int64_t k = 0; k < lr->count[i]; k++) {
                cJSON *r = cJSON_CreateArray();
                for (int v = 0; v < lr->vocab; v++)
                    cJSON_AddItemToArray(r, cJSON_CreateNumber(lr->row[i][(size_t)k * (size_t)lr->vocab + (size_t)v]));
                cJSON_AddItemToArray(rows, r);
            }
        }
        char *s = cJSON_PrintUnformatted(j);
        fprintf(f, "%s\n", s);
        free(s);
        cJSON_Delete(j);
    }
    close_out(f, tmp, o->out);
}

/* Options that only make sense with some outputs or layouts; the same verdict on every rank. */
static void check_job_opts(const struct gen_opts *o, bool h5_out) {
    if (o->resume && !h5_out)
        ds_die("--resume needs an HDF5 output (--out NAME.h5); a JSONL output is written whole at the end");
    if (o->resume && o->save_logits)
        ds_die("--save-logits is a debug option whose rows live in memory until the job ends; it cannot be resumed");
}

/* The engine of a generate or score job (dist_open with the job's options); o->max_seq_len then
 * holds the engine's positions per sequence. */
static void job_engine_open(struct dist_engine *d, struct gen_opts *o, bool score) {
    struct dist_opts dopt = o->dist;
    dopt.score = score;
    dopt.logprobs = score || o->logprobs;
    dopt.whole_logits = o->save_logits;
    dopt.max_seq_len = o->max_seq_len;
    dopt.max_seqs = o->max_seqs;
    dist_open(d, o->model, &o->ef, &dopt);
    o->max_seq_len = model_max_seq_len(d->m);
}

/* The HDF5 output of a generate or score job (collective: the rank table and host list for
 * /meta, then rank 0 opens it): prompts recorded by an earlier run are skipped, and rank 0 records
 * each request as it finishes (on_done). */
static void h5_job_open(struct job_out *jo, struct dist_engine *d, const struct gen_opts *o, int argc, char **argv,
                        enum h5_out_kind kind, bool logprobs, struct gen_request *rq, int np, gen_done_fn on_done) {
    struct topo *t = &d->topo;
    bool rank0 = t->world_rank == 0;
    char *table = topo_rank_table(t), *hosts = job_hosts(t->world, t->host);
    struct job_desc jd = {.argc = argc, .argv = argv, .cfg = &d->lm.cfg, .rank_table = table, .hosts = hosts};
    job_out_open(jo, t->world, rank0, o->out, kind, o->resume, logprobs, &jd, np);
    free(table);
    free(hosts);
    for (int i = 0; i < np; i++) rq[i].skip = jo->done[i] != 0;
    if (rank0) {
        d->on_done = on_done;
        d->on_done_ctx = jo;
        if (o->resume && jo->n_resumed)
            log_info("resuming %s: %lld of %d prompts recorded by earlier runs are skipped", o->out,
                     (long long)jo->n_resumed, np);
    }
}

/* The step traces after the run (collective): --trace's CSV, and the HDF5 output's /trace/steps. */
static void job_traces(struct dist_engine *d, const struct gen_opts *o, struct job_out *jo) {
    if (o->trace && dist_trace_write(d, o->trace)) ds_die_err();
    if (!jo) return;
    struct trace_event *ev;
    int64_t nev;
    dist_trace_gather(d, &ev, &nev);
    if (d->topo.world_rank == 0) job_out_steps(jo, ev, nev);
    free(ev);
}

int cmd_generate(int argc, char **argv) {
    struct gen_opts o;
    parse_gen_opts(argc, argv, &o, false);
    bool h5_out = job_out_is_h5(o.out);
    check_job_opts(&o, h5_out);
    struct dist_engine d;
    job_engine_open(&d, &o, false);
    struct topo *t = &d.topo;
    bool rank0 = t->world_rank == 0;
    int np, V = d.lm.cfg.vocab_size;
    struct tokenizer *tk = NULL;
    struct prompt *ps = load_prompts(&o, MPI_COMM_WORLD, &d.lm.cfg, &tk, false, &np);
    if (rank0) gen_tokenizer(&tk, &o, d.lm.cfg.bos_id, false, "generate");
    if (o.save_logits) {
        /* the rows exist whole only on a replica's last stage: all of them on rank 0 needs one
         * stage and one replica (TP gathers whole rows) */
        if (t->pp != 1 || t->dp != 1)
            ds_die("--save-logits needs every logits row on rank 0: run it with --pp 1 and one replica "
                   "(this job: tp %d x pp %d x dp %d)",
                   t->tp, t->pp, t->dp);
        double steps = 0;
        for (int i = 0; i < np; i++) steps += (double)ps[i].max_new;
        double bytes = steps * V * 4;
        if (bytes > SAVE_LOGITS_MAX_BYTES)
            ds_die("--save-logits: %d prompts with up to %.0f generated steps x vocab %d x 4 bytes = %.1f MiB, above "
                   "the %.0f MiB this debug option keeps in memory; use fewer prompts or a smaller --max-new-tokens",
                   np, steps, V, bytes / 1048576.0, SAVE_LOGITS_MAX_BYTES / 1048576.0);
    }
    struct gen_request *rq = ds_calloc((size_t)np + 1, sizeof *rq);
    for (int i = 0; i < np; i++) {
        rq[i] = (struct gen_request){.tokens = ps[i].tokens, .n = ps[i].n, .max_new = ps[i].max_new, .sp = ps[i].sp};
        rq[i].out = ds_malloc(sizeof(int32_t) * (size_t)(ps[i].max_new + 1));
        rq[i].lp = ds_malloc(sizeof(double) * (size_t)(ps[i].max_new + 1));
    }
    struct job_out jo = {0};
    if (h5_out) h5_job_open(&jo, &d, &o, argc, argv, H5_OUT_GENERATE, o.logprobs, rq, np, job_out_on_done);
    struct logit_rows lr = {0};
    if (o.save_logits && rank0) {
        logit_rows_init(&lr, np, V);
        d.on_logits = logit_rows_add;
        d.on_logits_ctx = &lr;
    }
    double t_start = MPI_Wtime();
    if (dist_generate(&d, rq, np, o.chunk)) ds_die_err();
    double t_gen = MPI_Wtime() - t_start;
    job_traces(&d, &o, h5_out ? &jo : NULL);
    if (rank0) {
        int64_t gen = 0, pin = 0;
        int ran = 0;
        for (int i = 0; i < np; i++)
            if (!rq[i].skip) gen += rq[i].n_out, pin += rq[i].n, ran++;
        log_info("generated %lld tokens for %d prompts (%lld prompt tokens) in %.2f s: %.1f tok/s", (long long)gen, ran,
                 (long long)pin, t_gen, (double)gen / t_gen);
    }
    if (h5_out) job_out_finish(&jo, rank0 ? tk : NULL, o.keep_special, o.save_logits ? &lr : NULL);
    else if (rank0) write_generate_jsonl(&o, ps, rq, np, tk, o.save_logits ? &lr : NULL);
    for (int i = 0; i < np; i++) {
        cJSON_Delete(ps[i].id);
        free(ps[i].tokens);
        free(rq[i].out);
        free(rq[i].lp);
    }
    if (o.save_logits && rank0) logit_rows_free(&lr);
    free(ps);
    free(rq);
    tok_free(tk);
    dist_close(&d);
    return 0;
}

/* A scored prompt, on world rank 0 as it finishes: into the HDF5 output at once (the NLL summed
 * in position order, as one rank always did). */
static void score_done(void *ctx, int index, const struct gen_request *q) {
    double nll = 0;
    for (int64_t k = 0; k < q->n_out; k++) nll -= q->lp[k];
    struct h5_request_trace tr = {.admit_s = q->admit_s, .first_token_s = q->first_s, .last_token_s = q->last_s,
                                  .prompt_tokens = q->n};
    job_out_scored(ctx, index, q->lp, q->n_out, nll, &tr);
}

/* The JSONL output of score, in input order (world rank 0, at the end). */
static void write_score_jsonl(const struct gen_opts *o, struct prompt *ps, const struct gen_request *rq, int np) {
    char tmp[1100];
    FILE *f = open_out(o->out, tmp, sizeof tmp);
    for (int i = 0; i < np; i++) {
        double nll = 0;
        cJSON *j = cJSON_CreateObject();
        cJSON_AddItemToObject(j, "id", ps[i].id);
        ps[i].id = NULL;
        cJSON *a = cJSON_AddArrayToObject(j, "token_logprobs");
        for (int64_t k = 0; k < rq[i].n_out; k++) {
            nll -= rq[i].lp[k];
            cJSON_AddItemToArray(a, cJSON_CreateNumber(rq[i].lp[k]));
        }
        cJSON_AddNumberToObject(j, "nll", nll);
        cJSON_AddNumberToObject(j, "n_tokens", (double)(ps[i].n - 1));
        char *txt = cJSON_PrintUnformatted(j);
        fprintf(f, "%s\n", txt);
        free(txt);
        cJSON_Delete(j);
    }
    close_out(f, tmp, o->out);
}

/* Scoring runs on the distributed engine like generate (dist_generate's score mode), so a model
 * that needs 16 GPUs scores on 16 ranks: each prompt goes through as prefill chunks of every row's
 * logits, and the last stage turns row k into log p(token k + 1 | tokens 0..k). By default one
 * sequence slot a replica (--max-seqs 1), so a step holds at most one chunk of rows: the logits
 * never take more than --chunk rows x vocab, whatever the prompt's length; --max-seqs N puts the
 * chunks of N prompts in a step (up to N x --chunk rows, or --max-batch-tokens), for sets of short
 * prompts. The engine is batch-invariant, so the values do not depend on N. */
int cmd_score(int argc, char **argv) {
    struct gen_opts o;
    parse_gen_opts(argc, argv, &o, true);
    o.max_new = 0;
    bool h5_out = job_out_is_h5(o.out);
    check_job_opts(&o, h5_out);
    struct dist_engine d;
    job_engine_open(&d, &o, true);
    struct topo *t = &d.topo;
    bool rank0 = t->world_rank == 0;
    int np;
    struct tokenizer *tk = NULL;
    struct prompt *ps = load_prompts(&o, MPI_COMM_WORLD, &d.lm.cfg, &tk, true, &np);
    tok_free(tk);
    struct gen_request *rq = ds_calloc((size_t)np + 1, sizeof *rq);
    for (int i = 0; i < np; i++) {
        rq[i] = (struct gen_request){.tokens = ps[i].tokens, .n = ps[i].n, .max_new = 0, .sp = ps[i].sp};
        rq[i].lp = ds_malloc(sizeof(double) * (size_t)(ps[i].n + 1));
    }
    struct job_out jo = {0};
    if (h5_out) h5_job_open(&jo, &d, &o, argc, argv, H5_OUT_SCORE, true, rq, np, score_done);
    double t_start = MPI_Wtime();
    if (dist_generate(&d, rq, np, o.chunk)) ds_die_err();
    double t_run = MPI_Wtime() - t_start;
    job_traces(&d, &o, h5_out ? &jo : NULL);
    /* the head's largest forward over every rank (it runs on the last stage) */
    long long head_rows = model_head_rows_max(), head_max = 0;
    CHECK_MPI(MPI_Allreduce(&head_rows, &head_max, 1, MPI_LONG_LONG, MPI_MAX, MPI_COMM_WORLD));
    if (rank0) {
        int64_t scored = 0;
        int ran = 0;
        for (int i = 0; i < np; i++)
            if (!rq[i].skip) scored += rq[i].n_out, ran++;
        log_info("scored %lld tokens of %d prompts in %.2f s: %.1f tok/s", (long long)scored, ran, t_run,
                 (double)scored / t_run);
    }
    if (h5_out) job_out_finish(&jo, NULL, false, NULL);
    else if (rank0) write_score_jsonl(&o, ps, rq, np);
    if (o.report_logits_rows && rank0)
        printf("logits rows: at most %lld per forward (chunk %lld, max-seqs %d)\n", head_max, (long long)o.chunk,
               o.max_seqs);
    for (int i = 0; i < np; i++) {
        cJSON_Delete(ps[i].id);
        free(ps[i].tokens);
        free(rq[i].lp);
    }
    free(ps);
    free(rq);
    dist_close(&d);
    return 0;
}
