/* Single-rank `dsbatch generate` and `dsbatch score` over JSONL prompt files (issue #3).
 * A prompt line gives token ids ("tokens") or text ("text", issue #8): text goes through the model
 * folder's tokenizer.json (or --tokenizer), framed by the tokenizer's BOS policy or, with --chat /
 * --think, by the DeepSeek-V4.1 chat format; every rank encodes the same file the same way, so the
 * ids agree without a broadcast. Outputs carry the decoded text next to the tokens whenever a
 * tokenizer is available.
 * generate: continuous batching over `--max-seqs` slots — each step prefills newly admitted
 * prompts and decodes one token for every running sequence in one forward; a finished sequence's
 * slot is reused at once. score: per-token log-probabilities of each prompt's own tokens, computed
 * chunk by chunk so no logits buffer larger than a chunk is ever held. Output lines keep the
 * order of the input. */
#include <cJSON.h>
#include <mpi.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "dist.h"
#include "engine_cli.h"
#include "log.h"
#include "model.h"
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
};

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
                if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < 0 ||
                    v->valuedouble >= vocab)
                    ds_die("%s:%d: tokens[%lld]: token id outside the vocabulary [0, %d)", path, line, (long long)i, vocab);
                p->tokens[i++] = (int32_t)v->valuedouble;
            }
        }
        cJSON *mn = cJSON_GetObjectItem(j, "max_new_tokens"), *t = cJSON_GetObjectItem(j, "temperature");
        cJSON *tkk = cJSON_GetObjectItem(j, "top_k"), *tp = cJSON_GetObjectItem(j, "top_p"), *sd = cJSON_GetObjectItem(j, "seed");
        p->max_new = cJSON_IsNumber(mn) ? (int64_t)mn->valuedouble : o->max_new;
        p->sp = o->sp;
        if (cJSON_IsNumber(t)) p->sp.temperature = (float)t->valuedouble;
        if (cJSON_IsNumber(tkk)) p->sp.top_k = tkk->valueint;
        if (cJSON_IsNumber(tp)) p->sp.top_p = (float)tp->valuedouble;
        if (cJSON_IsNumber(sd)) p->sp.seed = (uint64_t)sd->valuedouble;
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

static int parse_gen_opts(int argc, char **argv, struct gen_opts *o, bool score) {
    *o = (struct gen_opts){.max_new = 16, .max_seqs = 8, .chunk = 512, .sp = {.temperature = 0, .top_p = 1}};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
#define OPT(name) (!strcmp(a, name) && v && (i++, 1))
        if (OPT("--model")) o->model = v;
        else if (OPT("--prompts")) o->prompts = v;
        else if (OPT("--out")) o->out = v;
        else if (OPT("--max-new-tokens")) o->max_new = atoll(v);
        else if (OPT("--max-seqs")) o->max_seqs = atoi(v);
        else if (OPT("--max-seq-len")) o->max_seq_len = atoll(v);
        else if (OPT("--chunk")) o->chunk = atoll(v);
        else if (OPT("--temperature")) o->sp.temperature = (float)atof(v);
        else if (OPT("--top-k")) o->sp.top_k = atoi(v);
        else if (OPT("--top-p")) o->sp.top_p = (float)atof(v);
        else if (OPT("--seed")) o->sp.seed = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--logprobs")) o->logprobs = true;
        else if (OPT("--trace")) o->trace = v;
        else if (OPT("--tokenizer")) o->tokenizer = v;
        else if (!strcmp(a, "--chat")) o->chat.chat = o->chat.chat ? o->chat.chat : TOK_CHAT_PLAIN;
        else if (OPT("--think")) o->chat.chat = TOK_CHAT_THINKING, o->chat.reasoning_effort = atoi(v);
        else if (OPT("--system")) o->chat.system = v;
        else if (!strcmp(a, "--keep-special")) o->keep_special = true;
        else if (engine_flag_parse(argc, argv, &i, &o->ef)) continue;
        else if (!score && dist_flag_parse(argc, argv, &i, &o->dist)) continue;
        else if (!strcmp(a, "--help")) {
            printf("usage: dsbatch %s --model DIR --prompts P.jsonl --out R.jsonl [--max-new-tokens N] [--max-seqs N]\n"
                   "       [--max-seq-len N] [--chunk N] [--temperature T] [--top-k K] [--top-p P] [--seed S] [--logprobs]\n"
                   "       [--trace STEPS.csv]\n"
                   "       [--tokenizer PATH] [--chat | --think EFFORT] [--system TEXT] [--keep-special]\n"
                   "       (prompt lines: {\"tokens\": [ids]} or {\"text\": \"...\"}; text uses MODEL/tokenizer.json;\n"
                   "        --chat: DeepSeek-V4.1 chat format, --think EFFORT (1-100): its thinking mode)\n"
                   "       [--no-stale-index-keys] [--window-layout reference|decode]\n"
                   "       [--tp N] [--pp N] [--pp-layers A,B,..] [--watchdog SECONDS] [--engram service|per-rank]\n"
                   "       (the last line: under mpirun)\n",
                   score ? "score" : "generate");
            exit(0);
        } else
            ds_die("%s: unknown option '%s'", score ? "score" : "generate", a);
#undef OPT
    }
    if (!o->model || !o->prompts || !o->out) ds_die("--model, --prompts and --out are required");
    if (o->max_seqs < 1 || o->chunk < 1) ds_die("--max-seqs and --chunk must be positive");
    if (o->chat.chat == TOK_CHAT_THINKING && (o->chat.reasoning_effort < 1 || o->chat.reasoning_effort > 100))
        ds_die("--think: the reasoning effort must be an integer 1..100");
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

int cmd_generate(int argc, char **argv) {
    struct gen_opts o;
    parse_gen_opts(argc, argv, &o, false);
    struct dist_engine d;
    struct dist_opts dopt = o.dist;
    dopt.max_seq_len = o.max_seq_len;
    dopt.max_seqs = o.max_seqs;
    dist_open(&d, o.model, &o.ef, &dopt);
    o.max_seq_len = model_max_seq_len(d.m);
    int np;
    struct tokenizer *tk = NULL;
    struct prompt *ps = read_prompts(o.prompts, &o, &d.lm.cfg, &tk, &np);
    if (d.topo.world_rank == 0) gen_tokenizer(&tk, &o, d.lm.cfg.bos_id, false, "generate");
    struct gen_request *rq = ds_calloc((size_t)np + 1, sizeof *rq);
    for (int i = 0; i < np; i++) {
        rq[i] = (struct gen_request){.tokens = ps[i].tokens, .n = ps[i].n, .max_new = ps[i].max_new, .sp = ps[i].sp};
        rq[i].out = ds_malloc(sizeof(int32_t) * (size_t)(ps[i].max_new + 1));
        rq[i].lp = ds_malloc(sizeof(double) * (size_t)(ps[i].max_new + 1));
    }
    double t_start = MPI_Wtime();
    if (dist_generate(&d, rq, np, o.chunk)) ds_die_err();
    double t_gen = MPI_Wtime() - t_start;
    if (o.trace && dist_trace_write(&d, o.trace)) ds_die_err();
    if (d.topo.world_rank == 0) {
        int64_t gen = 0, pin = 0;
        for (int i = 0; i < np; i++) gen += rq[i].n_out, pin += rq[i].n;
        log_info("generated %lld tokens for %d prompts (%lld prompt tokens) in %.2f s: %.1f tok/s", (long long)gen, np,
                 (long long)pin, t_gen, (double)gen / t_gen);
    }
    if (d.topo.world_rank == 0) {
        char tmp[1100];
        FILE *f = open_out(o.out, tmp, sizeof tmp);
        for (int i = 0; i < np; i++) {
            cJSON *j = cJSON_CreateObject();
            cJSON_AddItemToObject(j, "id", ps[i].id);
            ps[i].id = NULL;
            cJSON *a = cJSON_AddArrayToObject(j, "output_tokens");
            for (int64_t k = 0; k < rq[i].n_out; k++) cJSON_AddItemToArray(a, cJSON_CreateNumber(rq[i].out[k]));
            if (tk) {
                char *txt = tok_decode(tk, rq[i].out, (size_t)rq[i].n_out, !o.keep_special, NULL);
                cJSON_AddStringToObject(j, "text", txt);
                free(txt);
            }
            cJSON_AddStringToObject(j, "finish_reason", rq[i].finish ? "stop" : "length");
            if (o.logprobs) {
                cJSON *l = cJSON_AddArrayToObject(j, "logprobs");
                for (int64_t k = 0; k < rq[i].n_out; k++) cJSON_AddItemToArray(l, cJSON_CreateNumber(rq[i].lp[k]));
            }
            char *s = cJSON_PrintUnformatted(j);
            fprintf(f, "%s\n", s);
            free(s);
            cJSON_Delete(j);
        }
        close_out(f, tmp, o.out);
    }
    for (int i = 0; i < np; i++) {
        cJSON_Delete(ps[i].id);
        free(ps[i].tokens);
        free(rq[i].out);
        free(rq[i].lp);
    }
    free(ps);
    free(rq);
    tok_free(tk);
    dist_close(&d);
    return 0;
}

int cmd_score(int argc, char **argv) {
    struct gen_opts o;
    parse_gen_opts(argc, argv, &o, true);
    o.max_new = 0;
    o.max_seqs = 1;
    struct loaded_model lm;
    struct backend be;
    struct model *m = engine_open(&lm, &be, o.model, &o.ef, o.max_seq_len, 0, o.max_seqs);
    o.max_seq_len = model_max_seq_len(m);
    int np;
    struct tokenizer *tk = NULL;
    struct prompt *ps = read_prompts(o.prompts, &o, &lm.cfg, &tk, &np);
    tok_free(tk);
    int V = lm.cfg.vocab_size;
    float *logits = ds_malloc(sizeof(float) * (size_t)o.chunk * V);
    char tmp[1100];
    FILE *f = open_out(o.out, tmp, sizeof tmp);
    for (int i = 0; i < np; i++) {
        struct prompt *p = &ps[i];
        model_reset_slot(m, 0);
        cJSON *j = cJSON_CreateObject();
        cJSON_AddItemToObject(j, "id", p->id);
        cJSON *a = cJSON_AddArrayToObject(j, "token_logprobs");
        double nll = 0;
        /* row r of a chunk predicts token start+r+1: the chunk's logits are consumed at once */
        for (int64_t start = 0; start < p->n; start += o.chunk) {
            int64_t len = p->n - start < o.chunk ? p->n - start : o.chunk;
            struct fwd_seq s = {.slot = 0, .start = start, .len = len, .tokens = p->tokens + start, .all_logits = true};
            if (model_forward(m, &s, 1, logits, NULL)) ds_die_err();
            for (int64_t r = 0; r < len && start + r + 1 < p->n; r++) {
                double lp = sampler_logprob(logits + (size_t)r * V, V, p->tokens[start + r + 1]);
                nll -= lp;
                cJSON_AddItemToArray(a, cJSON_CreateNumber(lp));
            }
        }
        cJSON_AddNumberToObject(j, "nll", nll);
        cJSON_AddNumberToObject(j, "n_tokens", (double)(p->n - 1));
        char *s = cJSON_PrintUnformatted(j);
        fprintf(f, "%s\n", s);
        free(s);
        cJSON_Delete(j);
        free(p->tokens);
    }
    close_out(f, tmp, o.out);
    free(ps);
    free(logits);
    engine_close(m, &lm, &be);
    return 0;
}
