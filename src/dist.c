/* The engine as one MPI job (see dist.h). Wire protocol along a PP pair (stage s -> s+1), one
 * micro-batch at a time: a header (sequences, rows, terminate flag, key-sync bytes), the per-sequence
 * descriptors, the token ids, the stream X and mix P, and the accumulated key sync. The last stage
 * answers stage 0 with one sampled token per sequence (-1 while its prompt is still being
 * prefilled) and the key sync. Everything here is driver code: it talks to other ranks through the
 * comm table, except for finished requests, which another replica's stage 0 sends to world rank 0
 * on a communicator of their own the moment they finish (MPI_Isend there, MPI_Iprobe between
 * steps on rank 0): the comm table has no probe, and rank 0 cannot know in advance which replica
 * finishes next. */
#include "dist.h"

#include <math.h>
#include <mpi.h>
#include <omp.h>
#include <time.h>
#include <unistd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_args.h"
#include "comm_mpi.h"
#include "engram_service.h"
#ifdef DS_HAVE_CUDA
#include "comm_nccl.h"
#include "cuda/cuda_linear.h"
#endif
#include "log.h"

enum { TAG_HDR = 11, TAG_SEQ, TAG_TOK, TAG_X, TAG_P, TAG_KEY, TAG_REPLY_HDR, TAG_REPLY_TOK, TAG_REPLY_LP,
       TAG_REPLY_KEY, TAG_RESULT, TAG_RESULT_TOK, TAG_RESULT_LP };

struct wire_seq {
    int32_t slot, len, req, top_k, all_logits, sample; /* sample: this chunk ends the prompt or decodes */
    int32_t next, pad; /* score mode: the prompt's token after the chunk (-1: the chunk ends it) */
    int64_t start;
    uint64_t seed;
    float temperature, top_p;
};

int dist_flag_parse(int argc, char **argv, int *i, struct dist_opts *o) {
    const char *a = argv[*i], *v = *i + 1 < argc ? argv[*i + 1] : NULL;
    if (!strcmp(a, "--quiet")) {
        o->quiet = true;
        return 1;
    }
    if (!v) return 0;
    if (!strcmp(a, "--tp")) o->tp = (int)cli_int(a, v, 1, 4096);
    else if (!strcmp(a, "--pp")) o->pp = (int)cli_int(a, v, 1, 4096);
    else if (!strcmp(a, "--watchdog")) o->deadline_s = cli_real(a, v, 0, 1e9, false);
    else if (!strcmp(a, "--max-batch-tokens")) o->max_batch_tokens = cli_int(a, v, 1, INT64_MAX / 2);
    else if (!strcmp(a, "--stop-ids")) {
        o->n_stop_ids = 0;
        for (const char *p = v; *p && o->n_stop_ids < 64;) {
            char *e;
            long id = strtol(p, &e, 10);
            if (e == p) ds_die("--stop-ids '%s': expected token ids like 1,7", v);
            o->stop_ids[o->n_stop_ids++] = (int)id;
            p = *e == ',' ? e + 1 : e;
        }
    }
    else if (!strcmp(a, "--engram")) {
        if (strcmp(v, "service") && strcmp(v, "per-rank")) ds_die("--engram: '%s' is not one of service, per-rank", v);
        o->engram_per_rank = !strcmp(v, "per-rank");
    }
    else if (!strcmp(a, "--pp-layers")) {
        memset(o->pp_counts, 0, sizeof o->pp_counts);
        int n = 0;
        for (const char *p = v; *p && n < TOPO_MAX_PP; n++) {
            char *e;
            long c = strtol(p, &e, 10);
            if (e == p || c <= 0) ds_die("--pp-layers '%s': expected positive layer counts like 20,20", v);
            o->pp_counts[n] = (int)c;
            p = *e == ',' ? e + 1 : e;
        }
        if (o->pp && o->pp != n) ds_die("--pp-layers '%s' has %d stages but --pp is %d", v, n, o->pp);
        o->pp = n;
    } else
        return 0;
    (*i)++;
    return 1;
}

/* The model's TP collectives move backend buffers. On the CUDA backend they go through NCCL when
 * every rank of the group has a GPU of its own; NCCL refuses two ranks on one GPU (16 ranks sharing
 * the one GPU of a test machine), and then the MPI group stages them through host memory. */
static void dist_tp_comm_for_backend(struct dist_engine *d) {
    struct topo *t = &d->topo;
    d->tp_dev = t->tp_comm;
    if (d->ef.backend != ENGINE_BACKEND_CUDA || t->tp <= 1) return;
#ifdef DS_HAVE_CUDA
    struct comm *nc = comm_nccl_new(comm_mpi_handle(t->tp_comm), "tp group (nccl)", backend_cuda_stream(&d->be));
    if (nc) {
        d->tp_dev = nc;
        return;
    }
    if (t->world_rank == 0) log_info("TP collectives through MPI with host staging: %s", ds_err_get());
    /* a comm of its own: t->tp_comm also carries host buffers */
    d->tp_dev = comm_mpi_new_named(comm_mpi_handle(t->tp_comm), "tp group (staged)");
    comm_mpi_set_staging(d->tp_dev, &d->be);
#endif
}

void dist_open(struct dist_engine *d, const char *dir, const struct engine_flags *f, const struct dist_opts *o) {
    memset(d, 0, sizeof *d);
    d->results_comm = MPI_COMM_NULL;
    int up = 0;
    MPI_Initialized(&up);
    if (!up) {
        CHECK_MPI(MPI_Init(NULL, NULL));
        d->mpi_owner = true;
    }
    comm_set_deadline(o->deadline_s > 0 ? o->deadline_s : 300);
    d->max_batch_tokens = o->max_batch_tokens;
    d->n_stop_ids = o->n_stop_ids;
    memcpy(d->stop_ids, o->stop_ids, sizeof d->stop_ids);
    d->quiet = o->quiet;
    d->logprobs = o->logprobs;
    d->score = o->score;
    d->whole_logits = o->whole_logits;
    if (o->quiet) log_set_quiet(1);
    if (loader_open_config(&d->lm, dir)) ds_die_err();
    const int *counts = o->pp_counts[0] ? o->pp_counts : NULL;
    if (topo_init(&d->topo, &d->lm.cfg, o->tp, o->pp, counts)) ds_die_err();
    struct topo *t = &d->topo;
    d->ef = *f;
    if (f->backend == ENGINE_BACKEND_CPU) t->device = -1;
#ifdef DS_HAVE_CUDA
    /* one GPU per rank; more ranks than GPUs on a node share them round-robin */
    if (f->backend == ENGINE_BACKEND_CUDA && cuda_device_count() > 0) t->device = t->node_rank % cuda_device_count();
#endif
    /* The CPU backend's threads share the node's cores with the other ranks on it: more threads
     * than cores would leave collectives waiting on ranks that are not scheduled. */
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int threads = (int)(cores / t->node_size);
    omp_set_num_threads(threads > 0 ? threads : 1);
    const struct model_config *c = &d->lm.cfg;
    bool stale = !f->no_stale_keys;
    if (stale && t->pp > 1)
        for (int l = 0; l < c->n_layers; l++)
            if (c->role[l].is_index_source && c->role[l].ratio > 1 && l >= t->layer_end[0])
                ds_die("%s: layer %d scores stale index keys (MODEL.md 3.12) but sits on pipeline stage > 0; "
                       "choose a split that keeps it on stage 0 or pass --no-stale-index-keys",
                       c->source, l);
    struct bind_opts bo = {.tp_rank = t->tp_rank, .tp_size = t->tp, .layer_begin = t->layer_begin[t->pp_rank],
                           .layer_end = t->layer_end[t->pp_rank], .first_stage = t->pp_rank == 0,
                           .last_stage = t->pp_rank == t->pp - 1};
    if (loader_bind(&d->lm, &bo)) ds_die_err();
    /* Engram tables: held once per node by the node's service (every rank then reads whole rows,
     * no sum over the TP group); --engram per-rank keeps each rank's row slice of the mmap */
    if (c->n_engram > 0 && t->world_size > 1 && !o->engram_per_rank) {
        d->engram = engram_service_new(t, &d->lm);
        if (!d->engram) ds_die_err();
        for (int l = 0; l < c->n_layers; l++) {
            struct layer_weights *lw = &d->lm.w.layers[l];
            if (!lw->present || !lw->has_engram) continue;
            int64_t rows = 0;
            const uint8_t *scale = NULL, *table = engram_service_table(d->engram, l, &scale, &rows);
            if (!table) ds_die("layer %d: the node's Engram service holds no table for it", l);
            lw->engram.table = table;
            lw->engram.scale = scale;
            lw->engram.row0 = 0;
            lw->engram.rows_local = rows;
        }
    }
    engine_backend_init(&d->be, f, t->device);
    dist_tp_comm_for_backend(d);
    struct engine_opts eo = engine_opts_default(c);
    if (o->max_seq_len > 0) {
        if (o->max_seq_len > c->max_pos)
            ds_die("--max-seq-len %lld exceeds the model's max_position_embeddings %lld", (long long)o->max_seq_len,
                   (long long)c->max_pos);
        eo.max_seq_len = o->max_seq_len;
    } else if (eo.max_seq_len < o->min_len) {
        eo.max_seq_len = o->min_len;
    }
    eo.max_seqs = o->max_seqs > 0 ? o->max_seqs : 1;
    eo.stale_index_keys = stale;
    eo.graphs = !f->eager;
    eo.moe_exchange = f->moe_exchange;
    eo.window_layout = f->layout;
    eo.tp = t->tp > 1 ? d->tp_dev : NULL;
    d->m = model_new(c, &d->lm.w, &d->be, d->lm.have_token_map ? &d->lm.ec : NULL, &eo);
    CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &d->results_comm));
    t->world->ops->barrier(t->world, "start");
    d->t0 = MPI_Wtime();
    /* the layout, the rank table and every rank's mapped weight bytes of a multi-rank job (a
     * one-rank run has nothing to report) */
    if (t->world_size > 1) {
        char *table = topo_rank_table(t);
        uint64_t mine[2] = {d->lm.w.bytes_total, d->engram ? engram_service_bytes(d->engram) : 0};
        uint64_t *all = ds_malloc(sizeof mine * (size_t)t->world_size);
        t->world->ops->allgather(t->world, mine, all, sizeof mine, "weight bytes");
        if (table) {
            log_info("layout: tp %d x pp %d x dp %d", t->tp, t->pp, t->dp);
            for (int s = 0; s < t->pp; s++)
                log_info("stage %d: layers %d-%d", s, t->layer_begin[s], t->layer_end[s] - 1);
            fputs(table, stderr);
            fprintf(stderr, "rank  weight bytes (this rank's slices)  engram bytes (node service)\n");
            for (int r = 0; r < t->world_size; r++)
                fprintf(stderr, "%4d  %30llu  %28llu\n", r, (unsigned long long)all[2 * r],
                        (unsigned long long)all[2 * r + 1]);
        }
        free(table);
        free(all);
    }
}

void dist_trace_gather(struct dist_engine *d, struct trace_event **all, int64_t *n_all) {
    struct topo *t = &d->topo;
    struct comm *w = t->world;
    int64_t n = d->n_trace;
    int64_t *counts = ds_malloc(sizeof(int64_t) * (size_t)t->world_size);
    w->ops->allgather(w, &n, counts, sizeof n, "trace counts");
    *all = NULL;
    *n_all = 0;
    if (t->world_rank == 0) {
        int64_t total = 0;
        for (int r = 0; r < t->world_size; r++) total += counts[r];
        struct trace_event *ev = ds_malloc(sizeof *ev * (size_t)(total + 1));
        if (n) memcpy(ev, d->trace, sizeof *ev * (size_t)n);
        int64_t at = n;
        for (int r = 1; r < t->world_size; r++) {
            if (counts[r]) w->ops->recv(w, ev + at, sizeof *ev * (size_t)counts[r], r, 92, "trace");
            at += counts[r];
        }
        *all = ev;
        *n_all = total;
    } else if (n) {
        w->ops->send(w, d->trace, sizeof *d->trace * (size_t)n, 0, 92, "trace");
    }
    free(counts);
}

int dist_trace_write(struct dist_engine *d, const char *path) {
    struct trace_event *ev;
    int64_t n;
    dist_trace_gather(d, &ev, &n);
    if (d->topo.world_rank != 0) return 0;
    char tmp[1100];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) {
        ds_err_set("%s: cannot write: %s", path, ds_errno_str());
        free(ev);
        return -1;
    }
    fprintf(f, "rank,stage,tp,step,seqs,rows,start_s,end_s,compute_s,tp_comm_s\n");
    for (int64_t i = 0; i < n; i++)
        fprintf(f, "%d,%d,%d,%d,%d,%d,%.6f,%.6f,%.6f,%.6f\n", ev[i].rank, ev[i].stage, ev[i].tp, ev[i].step, ev[i].seqs,
                ev[i].rows, ev[i].start, ev[i].end, ev[i].end - ev[i].start, ev[i].tp_comm);
    free(ev);
    if (fclose(f) != 0 || rename(tmp, path) != 0) {
        ds_err_set("%s: cannot write: %s", path, ds_errno_str());
        return -1;
    }
    return 0;
}

void dist_close(struct dist_engine *d) {
    int64_t full = 0, whole = 0;
    if (d->m) model_draw_stats(d->m, &full, &whole);
    if (full > 0 && d->topo.tp_rank == 0 && d->topo.pp_rank == d->topo.pp - 1)
        log_info("full-row temperature draws: %lld drawn where the logits are, %lld of them from the whole row "
                 "(a nucleus or drawn entry past the first %d)",
                 (long long)full, (long long)whole, BE_TOPK_MAX);
    free(d->trace);
    if (d->results_comm != MPI_COMM_NULL) CHECK_MPI(MPI_Comm_free(&d->results_comm));
    model_free(d->m);
    if (d->tp_dev && d->tp_dev != d->topo.tp_comm) d->tp_dev->ops->free(d->tp_dev);
    engine_backend_free(&d->be, &d->ef);
    loader_close(&d->lm);
    engram_service_free(d->engram); /* collective over the node, after the last read */
    topo_free(&d->topo);
    if (d->mpi_owner) MPI_Finalize();
}

/* ---- one micro-batch through this rank's stage ---- */

struct mb {
    int n;
    int64_t T;
    struct fwd_seq *seqs;
    struct wire_seq *ws;
    int32_t *tok;
    /* the stream's hand-off between stages: downloaded into on one side of a send, received into
     * on the other, every step, so page-locked where the backend has it (engine_host_alloc): a
     * pageable download of [T, hc, D] bf16 (10.5 MB at 256 rows) ran at a fraction of the link's
     * rate, the GPU idle meanwhile */
    bf16_t *X;
    float *P;
    size_t X_cap, P_cap;
    uint8_t *key;
    size_t key_len;
};

/* A host hand-off buffer of at least `need` bytes; its contents are not kept when it grows (every
 * use fills it afresh). A quarter of headroom, so micro-batches of slowly growing size do not
 * re-lock memory each time. */
static void *mb_host_grow(struct backend *be, void *p, size_t *cap, size_t need) {
    if (need <= *cap) return p;
    if (p) engine_host_free(be, p);
    *cap = need + need / 4;
    return engine_host_alloc(be, *cap);
}

static void mb_alloc_rows(struct backend *be, struct mb *b, const struct model_config *c) {
    b->tok = ds_realloc(b->tok, sizeof(int32_t) * (size_t)(b->T + 1));
    b->X = mb_host_grow(be, b->X, &b->X_cap, (size_t)(b->T * c->hc_mult * c->dim + 1) * 2);
    b->P = mb_host_grow(be, b->P, &b->P_cap, sizeof(float) * (size_t)(b->T * c->hc_mult + 1));
}

static void mb_bind_seqs(struct mb *b) {
    b->seqs = ds_realloc(b->seqs, sizeof *b->seqs * (size_t)(b->n + 1));
    int64_t r = 0;
    for (int i = 0; i < b->n; i++) {
        b->seqs[i] = (struct fwd_seq){.slot = b->ws[i].slot, .start = b->ws[i].start, .len = b->ws[i].len,
                                      .tokens = b->tok + r, .all_logits = b->ws[i].all_logits};
        r += b->ws[i].len;
    }
}

static void mb_send(struct comm *pp, int dst, struct mb *b, const struct model_config *c, bool terminate) {
    int64_t hdr[4] = {b->n, b->T, terminate, (int64_t)b->key_len};
    pp->ops->send(pp, hdr, sizeof hdr, dst, TAG_HDR, "pipeline header");
    if (terminate) return;
    pp->ops->send(pp, b->ws, sizeof *b->ws * (size_t)b->n, dst, TAG_SEQ, "pipeline sequences");
    pp->ops->send(pp, b->tok, sizeof(int32_t) * (size_t)b->T, dst, TAG_TOK, "pipeline tokens");
    pp->ops->send(pp, b->X, (size_t)(b->T * c->hc_mult * c->dim) * 2, dst, TAG_X, "pipeline stream X");
    pp->ops->send(pp, b->P, sizeof(float) * (size_t)(b->T * c->hc_mult), dst, TAG_P, "pipeline mix P");
    if (b->key_len) pp->ops->send(pp, b->key, b->key_len, dst, TAG_KEY, "pipeline key sync");
}

/* Returns false on the terminate message. */
static bool mb_recv(struct backend *be, struct comm *pp, int src, struct mb *b, const struct model_config *c) {
    int64_t hdr[4];
    pp->ops->recv(pp, hdr, sizeof hdr, src, TAG_HDR, "pipeline header");
    if (hdr[2]) return false;
    b->n = (int)hdr[0];
    b->T = hdr[1];
    b->ws = ds_realloc(b->ws, sizeof *b->ws * (size_t)(b->n + 1));
    mb_alloc_rows(be, b, c);
    pp->ops->recv(pp, b->ws, sizeof *b->ws * (size_t)b->n, src, TAG_SEQ, "pipeline sequences");
    pp->ops->recv(pp, b->tok, sizeof(int32_t) * (size_t)b->T, src, TAG_TOK, "pipeline tokens");
    pp->ops->recv(pp, b->X, (size_t)(b->T * c->hc_mult * c->dim) * 2, src, TAG_X, "pipeline stream X");
    pp->ops->recv(pp, b->P, sizeof(float) * (size_t)(b->T * c->hc_mult), src, TAG_P, "pipeline mix P");
    b->key_len = (size_t)hdr[3];
    free(b->key);
    b->key = NULL;
    if (b->key_len) {
        b->key = ds_malloc(b->key_len);
        pp->ops->recv(pp, b->key, b->key_len, src, TAG_KEY, "pipeline key sync");
    }
    mb_bind_seqs(b);
    return true;
}

static void mb_free(struct backend *be, struct mb *b) {
    free(b->seqs);
    free(b->ws);
    free(b->tok);
    engine_host_free(be, b->X);
    engine_host_free(be, b->P);
    free(b->key);
}

/* Seconds this rank has spent in TP collectives so far (0 without TP). */
static double tp_busy(const struct dist_engine *d) { return d->topo.tp > 1 && d->tp_dev ? d->tp_dev->busy_s : 0; }

static void trace_add(struct dist_engine *d, int step, const struct mb *b, double start, double end, double tp0) {
    if (d->n_trace == d->cap_trace) {
        d->cap_trace = d->cap_trace ? 2 * d->cap_trace : 256;
        d->trace = ds_realloc(d->trace, sizeof *d->trace * (size_t)d->cap_trace);
    }
    struct topo *t = &d->topo;
    d->trace[d->n_trace++] = (struct trace_event){.rank = t->world_rank, .stage = t->pp_rank, .tp = t->tp_rank,
                                                  .step = step, .seqs = b->n, .rows = (int32_t)b->T,
                                                  .start = start - d->t0, .end = end - d->t0,
                                                  .tp_comm = tp_busy(d) - tp0, .wait = d->pend_wait};
    d->pend_wait = 0;
}

/* Time spent handing the last traced step on (sends) belongs to that step. */
static void trace_comm(struct dist_engine *d, double seconds) {
    if (d->n_trace > 0) d->trace[d->n_trace - 1].comm += seconds;
}

/* Row-split draws: rank j of the TP group drew rows [j Rp, j Rp + Rp) (fewer at the end); one
 * all-gather over the group's host comm gives every rank every row's token and log-probability,
 * in row order (rank-major blocks are row order). */
struct drawn {
    int32_t tok, pad;
    double lp;
};
static void draws_share(struct dist_engine *d, int64_t n, int64_t r0, int64_t r1, int32_t *out, double *lp) {
    struct comm *tc = d->topo.tp_comm;
    int64_t Rp = (n + tc->size - 1) / tc->size;
    struct drawn *mine = ds_calloc((size_t)Rp, sizeof *mine), *all = ds_malloc(sizeof *all * (size_t)(Rp * tc->size));
    for (int64_t i = r0; i < r1; i++) mine[i - r0] = (struct drawn){.tok = out ? out[i] : -1, .lp = lp[i]};
    tc->ops->allgather(tc, mine, all, sizeof *mine * (size_t)Rp, "drawn tokens");
    for (int64_t i = 0; i < n; i++) {
        if (out) out[i] = all[i].tok;
        lp[i] = all[i].lp;
    }
    free(mine);
    free(all);
}

/* Run this rank's layers on the micro-batch; on the last stage also sample (out[i] = token or -1,
 * lp[i] its log-probability when the job records them, else 0). */
static int mb_forward(struct dist_engine *d, struct mb *b, int32_t *out, double *lp, float *logits) {
    struct topo *t = &d->topo;
    double start = MPI_Wtime(), tp0 = tp_busy(d);
    const struct model_config *c = &d->lm.cfg;
    bool first = t->pp_rank == 0, last = t->pp_rank == t->pp - 1;
    for (int i = 0; i < b->n; i++)
        if (b->seqs[i].start == 0) model_reset_slot(d->m, b->seqs[i].slot);
    struct stage_io io = {.X_in = b->X, .P_in = b->P, .X_out = b->X, .P_out = b->P};
    /* a step that keeps no logits rows and scores, or draws (greedy, top-k, or a temperature over
     * every entry where the TP layout cuts whole lse slices: model_draw_ready), draws where the
     * logits are (model_forward_draws: the tokens of sampler_pick and the log-probability bits of
     * sampler_logprob on the downloaded rows); every rank of the step sees the same rows, so the TP
     * group agrees on the path */
    bool draws = !d->whole_logits && (!(d->score || d->logprobs) || model_lse_ready(d->m));
    struct sample_params *sp = NULL; /* [n] the rows' draws (unsampled rows: greedy, not kept) */
    uint64_t *key = NULL;            /* [2n] request, then position */
    if (draws && !d->score && last) {
        sp = ds_malloc(sizeof *sp * (size_t)b->n);
        key = ds_malloc(sizeof *key * (size_t)(2 * b->n));
    }
    for (int i = 0; i < b->n && draws && !d->score; i++) {
        const struct wire_seq *w = &b->ws[i];
        const struct sample_params p = {.temperature = w->sample ? w->temperature : 0.0f, .top_k = w->top_k,
                                        .top_p = w->top_p, .seed = w->seed};
        if (!model_draw_ready(d->m, &p)) draws = false;
        if (sp) sp[i] = p, key[i] = (uint64_t)w->req, key[b->n + i] = (uint64_t)(w->start + w->len);
    }
    int32_t *drawn = NULL, *target = NULL; /* [n] drawn tokens; [T + 1] score: each row's next token */
    double *dlp = NULL;                    /* [n] the drawn tokens' log-probabilities */
    if (last && d->score) {
        target = ds_malloc(sizeof(int32_t) * (size_t)(b->T + 1));
        for (int i = 0, row = 0; i < b->n; i++) { /* the chunk's last row scores w->next */
            const struct wire_seq *w = &b->ws[i];
            for (int64_t k = 0; k < w->len; k++, row++) target[row] = k + 1 < w->len ? b->tok[row + 1] : w->next;
        }
    }
    if (last && draws && !d->score) {
        drawn = ds_malloc(sizeof(int32_t) * (size_t)b->n);
        if (d->logprobs) dlp = ds_malloc(sizeof(double) * (size_t)b->n);
    }
    struct head_draws hd = {.tokens = drawn, .params = sp, .request = key, .position = key ? key + b->n : NULL,
                            .targets = d->score ? target : NULL, .lp = d->score ? lp : dlp};
    int rc = draws ? model_forward_draws(d->m, b->seqs, b->n, first && last ? NULL : &io, &hd, NULL)
                   : model_forward_stage(d->m, b->seqs, b->n, first && last ? NULL : &io, last ? logits : NULL, NULL);
    free(sp), free(key);
    if (rc) {
        free(drawn), free(dlp), free(target);
        return -1;
    }
    if (!first) model_key_sync_append(d->m, b->seqs, b->n, &b->key, &b->key_len);
    if (!last) {
        trace_add(d, d->n_trace, b, start, MPI_Wtime(), tp0);
        return 0;
    }
    if (draws) { /* tokens and log-probabilities (score: lp of every row) came with the forward */
        for (int i = 0; i < b->n; i++) {
            out[i] = !d->score && b->ws[i].sample ? drawn[i] : -1;
            if (!d->score) lp[i] = dlp && out[i] >= 0 ? dlp[i] : 0.0;
        }
        free(drawn), free(dlp), free(target);
        trace_add(d, d->n_trace, b, start, MPI_Wtime(), tp0);
        return 0;
    }
    int V = c->vocab_size;
    if (d->score) { /* every row scores the prompt's token after it (the chunk's last row: w->next) */
        int64_t T = b->T, r0, r1;
        bool split = model_logits_split(d->m, T, &r0, &r1);
        for (int i = 0; i < b->n; i++) out[i] = -1;
#pragma omp parallel for schedule(static) if (r1 - r0 > 1)
        for (int64_t r = r0; r < r1; r++)
            lp[r] = target[r] >= 0 ? sampler_logprob(logits + (size_t)(r - r0) * V, V, target[r]) : 0.0;
        if (split) draws_share(d, T, r0, r1, NULL, lp);
        free(target);
        trace_add(d, d->n_trace, b, start, MPI_Wtime(), tp0);
        return 0;
    }
    /* the rows are independent (each draw is keyed by its request and position), so they are
     * drawn by the rank's threads, the same bits as one by one: a row over the whole vocabulary
     * costs ~1 ms on the host (sampler.c), 64 of them more than a GPU decode step. With row-split
     * logits (model_logits_split) this rank holds rows [r0, r1) only and the TP group shares the
     * draws out: each draws its rows, an all-gather hands everyone every row's token. */
    int64_t r0, r1;
    bool split = model_logits_split(d->m, b->n, &r0, &r1);
#pragma omp parallel for schedule(dynamic, 1) if (r1 - r0 > 1)
    for (int64_t i = r0; i < r1; i++) {
        const struct wire_seq *w = &b->ws[i];
        struct sample_params sp = {.temperature = w->temperature, .top_k = w->top_k, .top_p = w->top_p, .seed = w->seed};
        const float *row = logits + (size_t)(i - r0) * V;
        out[i] = w->sample ? sampler_pick(row, V, &sp, (uint64_t)w->req, (uint64_t)(w->start + w->len)) : -1;
        lp[i] = out[i] >= 0 && d->logprobs ? sampler_logprob(row, V, out[i]) : 0.0;
    }
    if (split) draws_share(d, b->n, r0, r1, out, lp);
    for (int i = 0; i < b->n && d->on_logits; i++)
        if (out[i] >= 0) d->on_logits(d->on_logits_ctx, b->ws[i].req, logits + (size_t)i * V, V);
    trace_add(d, d->n_trace, b, start, MPI_Wtime(), tp0);
    return 0;
}

/* ---- stage 0: the scheduler ---- */

struct slot_run {
    int req; /* -1 free */
    int64_t fed;
};

/* Rank 0's progress: prompts done of its replica's share, tokens/s, ETA; one updating line on a
 * terminal, a plain line every 10 s otherwise. */
static void progress(struct dist_engine *d, int done, int total, int64_t generated, bool final) {
    static double last;
    if (d->quiet) return;
    double now = MPI_Wtime(), el = now - d->t0;
    bool tty = isatty(2);
    if (!final && now - last < (tty ? 0.5 : 10.0)) return;
    last = now;
    double rate = el > 0 ? (double)generated / el : 0, eta = done > 0 ? el * (total - done) / done : 0;
    fprintf(stderr, "%sdsbatch: %d/%d prompts%s, %lld tokens, %.1f tok/s, ETA %.0f s%s", tty ? "\r" : "", done, total,
            d->topo.dp > 1 ? " (replica 0)" : "", (long long)generated, rate, eta, tty && !final ? "" : "\n");
    fflush(stderr);
}

/* ---- finished requests: replica stage 0 -> world rank 0 ---- */

struct result_hdr {
    int64_t index, n_out, finish;
    double admit_s, first_s, last_s;
};

/* What one rank does with finished requests: world rank 0 reports them (on_done); the TP-0 rank of
 * another replica's stage 0 sends them to rank 0 (buffers live until dist_generate returns). */
struct results {
    bool report, send;
    struct result_hdr *hdr; /* [n] send side: one per request, alive until its sends complete */
    MPI_Request *rq;
    int n_rq, cap_rq;
    int expected, received; /* rank 0: results due from other replicas */
};

static void results_init(struct dist_engine *d, struct results *rs, const struct gen_request *reqs, int n) {
    struct topo *t = &d->topo;
    memset(rs, 0, sizeof *rs);
    rs->report = t->world_rank == 0;
    rs->send = t->dp_rank != 0 && t->pp_rank == 0 && t->tp_rank == 0;
    if (rs->send) rs->hdr = ds_calloc((size_t)n + 1, sizeof *rs->hdr);
    if (rs->report)
        for (int i = 0; i < n; i++)
            if (i % t->dp != 0 && !reqs[i].skip) rs->expected++;
}

static void results_isend(struct dist_engine *d, struct results *rs, const void *buf, size_t bytes, int tag) {
    if (rs->n_rq == rs->cap_rq) {
        rs->cap_rq = rs->cap_rq ? 2 * rs->cap_rq : 64;
        rs->rq = ds_realloc(rs->rq, sizeof *rs->rq * (size_t)rs->cap_rq);
    }
    CHECK_MPI(MPI_Isend(buf, (int)bytes, MPI_BYTE, 0, tag, d->results_comm, &rs->rq[rs->n_rq++]));
}

/* Request i has finished on this replica's stage 0. */
static void request_finished(struct dist_engine *d, struct results *rs, struct gen_request *reqs, int i) {
    struct gen_request *q = &reqs[i];
    if (rs->report && d->on_done) d->on_done(d->on_done_ctx, i, q);
    if (!rs->send) return;
    struct result_hdr *h = &rs->hdr[i];
    *h = (struct result_hdr){.index = i, .n_out = q->n_out, .finish = q->finish, .admit_s = q->admit_s,
                             .first_s = q->first_s, .last_s = q->last_s};
    results_isend(d, rs, h, sizeof *h, TAG_RESULT);
    if (!d->score) results_isend(d, rs, q->out, sizeof(int32_t) * (size_t)q->n_out, TAG_RESULT_TOK);
    results_isend(d, rs, q->lp, sizeof(double) * (size_t)q->n_out, TAG_RESULT_LP);
}

/* Rank 0: take in the results other replicas have sent; with `all`, wait for every one still due.
 * Waiting polls with short sleeps, so rank 0 leaves the cores it shares to the ranks still working. */
static void results_poll(struct dist_engine *d, struct results *rs, struct gen_request *reqs, int n, bool all) {
    struct topo *t = &d->topo;
    while (rs->received < rs->expected) {
        int flag = 0;
        MPI_Status st;
        CHECK_MPI(MPI_Iprobe(MPI_ANY_SOURCE, TAG_RESULT, d->results_comm, &flag, &st));
        if (!flag) {
            if (!all) return;
            struct timespec ts = {0, 200000};
            nanosleep(&ts, NULL);
            continue;
        }
        int src = st.MPI_SOURCE;
        struct result_hdr h;
        CHECK_MPI(MPI_Recv(&h, (int)sizeof h, MPI_BYTE, src, TAG_RESULT, d->results_comm, MPI_STATUS_IGNORE));
        int replica = src / (t->pp * t->tp);
        if (h.index < 0 || h.index >= n || h.index % t->dp != replica || reqs[h.index].skip || h.n_out < 0 ||
            h.n_out > (d->score ? reqs[h.index].n - 1 : reqs[h.index].max_new))
            ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "result from another replica",
                     "a result that replica does not own (index, size or duplicate)");
        struct gen_request *q = &reqs[h.index];
        if (!d->score)
            CHECK_MPI(MPI_Recv(q->out, (int)(sizeof(int32_t) * (size_t)h.n_out), MPI_BYTE, src, TAG_RESULT_TOK,
                               d->results_comm, MPI_STATUS_IGNORE));
        CHECK_MPI(MPI_Recv(q->lp, (int)(sizeof(double) * (size_t)h.n_out), MPI_BYTE, src, TAG_RESULT_LP,
                           d->results_comm, MPI_STATUS_IGNORE));
        q->n_out = h.n_out;
        q->finish = (int)h.finish;
        q->admit_s = h.admit_s, q->first_s = h.first_s, q->last_s = h.last_s;
        rs->received++;
        if (d->on_done) d->on_done(d->on_done_ctx, (int)h.index, q);
    }
}

static void results_free(struct results *rs) {
    if (rs->n_rq) CHECK_MPI(MPI_Waitall(rs->n_rq, rs->rq, MPI_STATUSES_IGNORE));
    free(rs->rq);
    free(rs->hdr);
}

/* The host logits buffer for a step of `rows` rows, grown as needed (*cap rows now). */
static float *logits_room(struct dist_engine *d, float *buf, int64_t *cap, int64_t rows) {
    if (rows <= *cap) return buf;
    if (buf) engine_host_free(&d->be, buf);
    *cap = rows;
    return engine_host_alloc(&d->be, sizeof(float) * (size_t)rows * (size_t)d->lm.cfg.vocab_size);
}

/* Score mode: the rows of a micro-batch's reply go to their prompts' positions; a prompt whose
 * last chunk this was is finished. */
static void scored_rows(struct dist_engine *d, struct results *rs, struct gen_request *reqs, struct slot_run *sr,
                        const struct mb *b, const double *lp, double now, int *done, int64_t *scored) {
    int64_t row = 0;
    for (int i = 0; i < b->n; i++) {
        const struct wire_seq *w = &b->ws[i];
        struct gen_request *q = &reqs[w->req];
        for (int64_t k = 0; k < w->len; k++)
            if (w->start + k + 1 < q->n) q->lp[w->start + k] = lp[row + k], (*scored)++;
        row += w->len;
        if (isnan(q->first_s)) q->first_s = now;
        q->last_s = now;
        if (w->start + w->len >= q->n) {
            q->n_out = q->n - 1;
            q->finish = GEN_FINISH_LENGTH;
            sr[w->slot].req = -1;
            (*done)++;
            request_finished(d, rs, reqs, w->req);
        }
    }
}

static int run_stage0(struct dist_engine *d, struct gen_request *reqs, int n, int64_t chunk, struct results *rs) {
    struct topo *t = &d->topo;
    const struct model_config *c = &d->lm.cfg;
    struct comm *pp = t->pp_comm;
    int S = model_max_seqs(d->m), G = t->pp < S ? t->pp : S;
    struct slot_run *sr = ds_calloc((size_t)S, sizeof *sr);
    for (int s = 0; s < S; s++) sr[s].req = -1;
    struct mb *mbs = ds_calloc((size_t)G, sizeof *mbs);
    bool *inflight = ds_calloc((size_t)G, sizeof(bool));
    /* rows of a step's reply: one a sequence, or in score mode every row of its chunks */
    int64_t rows_max = S, logits_cap = 0;
    if (d->score) {
        rows_max = (int64_t)S * chunk;
        if (d->max_batch_tokens > 0 && d->max_batch_tokens < rows_max) rows_max = d->max_batch_tokens;
    }
    int32_t *tok_out = ds_malloc(sizeof(int32_t) * (size_t)(S + 1));
    double *lp_out = ds_malloc(sizeof(double) * (size_t)(rows_max + 1));
    float *logits = t->pp == 1 ? logits_room(d, NULL, &logits_cap, rows_max) : NULL;
    int next = t->dp_rank, done = 0, mine = 0;
    int64_t generated = 0;
    for (int i = t->dp_rank; i < n; i += t->dp)
        if (!reqs[i].skip) mine++;
    for (int i = 0; i < n; i++) reqs[i].n_out = 0;
    int rc = 0;
    for (int g = 0; done < mine && rc == 0; g = (g + 1) % G) {
        struct mb *b = &mbs[g];
        if (inflight[g]) { /* the tokens of this micro-batch's previous step */
            double w0 = MPI_Wtime();
            int64_t h[2];
            pp->ops->recv(pp, h, sizeof h, t->pp - 1, TAG_REPLY_HDR, "pipeline reply");
            pp->ops->recv(pp, tok_out, sizeof(int32_t) * (size_t)h[0], t->pp - 1, TAG_REPLY_TOK, "pipeline reply");
            pp->ops->recv(pp, lp_out, sizeof(double) * (size_t)(d->score ? b->T : h[0]), t->pp - 1, TAG_REPLY_LP,
                          "pipeline reply");
            if (h[1]) {
                uint8_t *key = ds_malloc((size_t)h[1]);
                pp->ops->recv(pp, key, (size_t)h[1], t->pp - 1, TAG_REPLY_KEY, "pipeline key sync");
                if (model_key_sync_apply(d->m, key, (size_t)h[1])) rc = -1;
                free(key);
            }
            inflight[g] = false;
            d->pend_wait += MPI_Wtime() - w0;
        }
        /* tok_out holds this group's tokens: received just now, or sampled inline (pp == 1) */
        double now = MPI_Wtime() - d->t0;
        if (d->score) scored_rows(d, rs, reqs, sr, b, lp_out, now, &done, &generated);
        for (int i = 0; i < b->n; i++) {
            if (tok_out[i] < 0) continue;
            struct gen_request *q = &reqs[b->ws[i].req];
            q->lp[q->n_out] = lp_out[i];
            q->out[q->n_out++] = tok_out[i];
            if (q->n_out == 1) q->first_s = now;
            q->last_s = now;
            int fin = tok_out[i] == c->eos_id ? GEN_FINISH_EOS : -1;
            for (int k = 0; k < d->n_stop_ids && fin < 0; k++)
                if (tok_out[i] == d->stop_ids[k]) fin = GEN_FINISH_STOP_ID;
            if (fin < 0 && q->n_out >= q->max_new) fin = GEN_FINISH_LENGTH;
            if (fin >= 0) {
                q->finish = fin;
                sr[b->ws[i].slot].req = -1;
                done++;
                request_finished(d, rs, reqs, b->ws[i].req);
            }
            generated++;
        }
        if (rs->report && t->dp > 1) results_poll(d, rs, reqs, n, false);
        if (t->world_rank == 0) progress(d, done, mine, generated, false);
        b->n = 0;
        b->T = 0;
        /* build this group's next step under the token budget: first one decode token for every
         * running sequence, then prefill chunks (admitting new prompts into free slots) while
         * tokens are left; a prompt longer than what is left continues next step */
        b->ws = ds_realloc(b->ws, sizeof *b->ws * (size_t)(S + 1));
        int64_t left = d->max_batch_tokens > 0 ? d->max_batch_tokens : INT64_MAX;
        for (int pass = 0; pass < 2; pass++)
            for (int s = g; s < S; s += G) {
                if (pass == 1 && sr[s].req < 0 && left > 0) {
                    /* skipped (recorded by an earlier run) and zero-length requests take no slot */
                    while (next < n && (reqs[next].skip || (d->score ? reqs[next].n < 2 : reqs[next].max_new == 0))) {
                        struct gen_request *z = &reqs[next];
                        if (!z->skip) {
                            z->finish = GEN_FINISH_LENGTH;
                            z->admit_s = MPI_Wtime() - d->t0;
                            z->first_s = z->last_s = NAN;
                            done++;
                            request_finished(d, rs, reqs, next);
                        }
                        next += t->dp;
                    }
                    if (next >= n) continue;
                    sr[s].req = next;
                    sr[s].fed = 0;
                    reqs[next].admit_s = MPI_Wtime() - d->t0;
                    reqs[next].first_s = reqs[next].last_s = NAN;
                    next += t->dp;
                }
                if (sr[s].req < 0) continue;
                struct gen_request *q = &reqs[sr[s].req];
                bool decoding = sr[s].fed >= q->n;
                if (d->score && decoding) continue; /* its last chunk's reply is on the way */
                if (decoding != (pass == 0) || (decoding && left < 1)) continue;
                int64_t len = 1, start = q->n + q->n_out - 1;
                if (!decoding) {
                    len = q->n - sr[s].fed;
                    if (len > chunk) len = chunk;
                    if (len > left) len = left;
                    if (len < 1) continue;
                    start = sr[s].fed;
                    sr[s].fed += len;
                }
                struct wire_seq *w = &b->ws[b->n++];
                *w = (struct wire_seq){.slot = s, .req = sr[s].req, .top_k = q->sp.top_k, .seed = q->sp.seed,
                                       .temperature = q->sp.temperature, .top_p = q->sp.top_p, .start = start,
                                       .len = (int32_t)len, .sample = !d->score && start + len >= q->n,
                                       .all_logits = d->score,
                                       .next = d->score && start + len < q->n ? q->tokens[start + len] : -1};
                b->T += len;
                left -= len;
            }
        if (!b->n) continue;
        mb_alloc_rows(&d->be, b, c);
        int64_t r = 0;
        for (int i = 0; i < b->n; i++) {
            const struct wire_seq *w = &b->ws[i];
            const struct gen_request *q = &reqs[w->req];
            for (int64_t k = 0; k < w->len; k++) {
                int64_t p = w->start + k;
                b->tok[r++] = p < q->n ? q->tokens[p] : q->out[p - q->n];
            }
        }
        mb_bind_seqs(b);
        free(b->key);
        b->key = NULL;
        b->key_len = 0;
        comm_set_context(0, g);
        if (mb_forward(d, b, tok_out, lp_out, logits)) rc = -1;
        else if (t->pp > 1) {
            double c0 = MPI_Wtime();
            mb_send(pp, 1, b, c, false);
            trace_comm(d, MPI_Wtime() - c0);
            inflight[g] = true;
        }
    }
    if (t->pp > 1) {
        struct mb end = {0};
        mb_send(pp, 1, &end, c, true);
    }
    if (t->world_rank == 0) progress(d, done, mine, generated, true);
    for (int g = 0; g < G; g++) mb_free(&d->be, &mbs[g]);
    free(mbs);
    free(inflight);
    free(tok_out);
    free(lp_out);
    if (logits) engine_host_free(&d->be, logits);
    free(sr);
    return rc;
}

static int run_later_stage(struct dist_engine *d) {
    struct topo *t = &d->topo;
    const struct model_config *c = &d->lm.cfg;
    struct comm *pp = t->pp_comm;
    bool last = t->pp_rank == t->pp - 1;
    struct mb b = {0};
    int S = model_max_seqs(d->m);
    /* log-probabilities a reply carries: one a sequence, or in score mode one a row (grown) */
    int64_t cap_lp = S, cap_rlp = S, logits_cap = 0;
    int32_t *tok = ds_malloc(sizeof(int32_t) * (size_t)(S + 1));
    double *lp = ds_malloc(sizeof(double) * (size_t)(S + 1));
    float *logits = last ? logits_room(d, NULL, &logits_cap, S) : NULL;
    /* the previous answer to stage 0, in flight while the next micro-batch is received */
    int64_t rh[2];
    int32_t *rtok = ds_malloc(sizeof(int32_t) * (size_t)(S + 1));
    double *rlp = ds_malloc(sizeof(double) * (size_t)(S + 1));
    uint8_t *rkey = NULL;
    struct comm_req *rq[4] = {NULL, NULL, NULL, NULL};
    int rc = 0, step = 0;
    for (double w0 = MPI_Wtime(); rc == 0 && mb_recv(&d->be, pp, t->pp_rank - 1, &b, c); w0 = MPI_Wtime()) {
        d->pend_wait += MPI_Wtime() - w0;
        comm_set_context(t->pp_rank, step++);
        int64_t nlp = d->score ? b.T : b.n;
        if (last && nlp > cap_lp) lp = ds_realloc(lp, sizeof(double) * (size_t)((cap_lp = nlp) + 1));
        if (last) logits = logits_room(d, logits, &logits_cap, d->score ? b.T : S);
        if (mb_forward(d, &b, tok, lp, logits)) {
            rc = -1;
            break;
        }
        double c0 = MPI_Wtime();
        if (!last) {
            mb_send(pp, t->pp_rank + 1, &b, c, false);
            trace_comm(d, MPI_Wtime() - c0);
            continue;
        }
        for (int k = 0; k < 4; k++) pp->ops->wait(pp, rq[k]), rq[k] = NULL;
        rh[0] = b.n;
        rh[1] = (int64_t)b.key_len;
        memcpy(rtok, tok, sizeof(int32_t) * (size_t)b.n);
        if (nlp > cap_rlp) rlp = ds_realloc(rlp, sizeof(double) * (size_t)((cap_rlp = nlp) + 1)); /* not in flight now */
        memcpy(rlp, lp, sizeof(double) * (size_t)nlp);
        free(rkey);
        rkey = b.key; /* handed over: mb_recv allocates a fresh one */
        b.key = NULL;
        rq[0] = pp->ops->isend(pp, rh, sizeof rh, 0, TAG_REPLY_HDR, "pipeline reply");
        rq[1] = pp->ops->isend(pp, rtok, sizeof(int32_t) * (size_t)b.n, 0, TAG_REPLY_TOK, "pipeline reply");
        rq[2] = pp->ops->isend(pp, rlp, sizeof(double) * (size_t)nlp, 0, TAG_REPLY_LP, "pipeline reply");
        if (rh[1]) rq[3] = pp->ops->isend(pp, rkey, (size_t)rh[1], 0, TAG_REPLY_KEY, "pipeline key sync");
        trace_comm(d, MPI_Wtime() - c0);
    }
    for (int k = 0; k < 4; k++) pp->ops->wait(pp, rq[k]);
    free(rtok);
    free(rlp);
    free(rkey);
    if (rc == 0 && !last) {
        struct mb end = {0};
        mb_send(pp, t->pp_rank + 1, &end, c, true);
    }
    mb_free(&d->be, &b);
    free(tok);
    free(lp);
    if (logits) engine_host_free(&d->be, logits);
    return rc;
}

int dist_forward_sync(void *ctx, const struct fwd_seq *seqs, int n, float *logits, const struct fwd_hooks *hooks) {
    struct dist_engine *d = ctx;
    struct topo *t = &d->topo;
    const struct model_config *c = &d->lm.cfg;
    struct comm *pp = t->pp_comm;
    if (t->pp == 1) return model_forward(d->m, seqs, n, logits, hooks);
    int64_t T = 0;
    for (int i = 0; i < n; i++) T += seqs[i].len;
    size_t xb = (size_t)(T * c->hc_mult * c->dim) * 2, pb = sizeof(float) * (size_t)(T * c->hc_mult);
    bf16_t *X = ds_malloc(xb);
    float *P = ds_malloc(pb);
    int s = t->pp_rank, rc;
    bool last = s == t->pp - 1;
    if (s > 0) {
        pp->ops->recv(pp, X, xb, s - 1, TAG_X, "stage stream X");
        pp->ops->recv(pp, P, pb, s - 1, TAG_P, "stage mix P");
    }
    struct stage_io io = {.X_in = X, .P_in = P, .X_out = X, .P_out = P};
    rc = model_forward_stage(d->m, seqs, n, &io, last ? logits : NULL, hooks);
    /* the stale-key sync travels down with the stream and back from the last stage to stage 0 */
    uint8_t *key = NULL;
    size_t key_len = 0;
    int64_t kl = 0;
    if (s > 0) {
        pp->ops->recv(pp, &kl, sizeof kl, s - 1, TAG_KEY, "stage key sync");
        key_len = (size_t)kl;
        key = ds_malloc(key_len + 1);
        if (kl) pp->ops->recv(pp, key, key_len, s - 1, TAG_KEY, "stage key sync");
        if (rc == 0) model_key_sync_append(d->m, seqs, n, &key, &key_len);
    }
    int dst = last ? 0 : s + 1;
    if (!last) {
        pp->ops->send(pp, X, xb, dst, TAG_X, "stage stream X");
        pp->ops->send(pp, P, pb, dst, TAG_P, "stage mix P");
    }
    if (s > 0) {
        kl = (int64_t)key_len;
        pp->ops->send(pp, &kl, sizeof kl, dst, TAG_KEY, "stage key sync");
        if (kl) pp->ops->send(pp, key, key_len, dst, TAG_KEY, "stage key sync");
    } else {
        kl = 0; /* stage 0 starts an empty sync and receives the accumulated one from the last stage */
        pp->ops->send(pp, &kl, sizeof kl, 1, TAG_KEY, "stage key sync");
        pp->ops->recv(pp, &kl, sizeof kl, t->pp - 1, TAG_KEY, "stage key sync");
        key = ds_malloc((size_t)kl + 1);
        if (kl) pp->ops->recv(pp, key, (size_t)kl, t->pp - 1, TAG_KEY, "stage key sync");
        if (rc == 0 && model_key_sync_apply(d->m, key, (size_t)kl)) rc = -1;
    }
    free(key);
    free(X);
    free(P);
    return rc;
}

int dist_generate(struct dist_engine *d, struct gen_request *reqs, int n, int64_t chunk) {
    /* the last stage's TP ranks share a step's draws (model_set_split_logits) unless a rank keeps
     * whole logits rows (--save-logits; the option is every rank's, so all choose alike) */
    model_set_split_logits(d->m, !d->whole_logits);
    struct results rs;
    results_init(d, &rs, reqs, n);
    int rc = d->topo.pp_rank == 0 ? run_stage0(d, reqs, n, chunk, &rs) : run_later_stage(d);
    if (rc == 0 && rs.report) results_poll(d, &rs, reqs, n, true);
    results_free(&rs);
    return rc;
}
