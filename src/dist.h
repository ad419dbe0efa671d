/* The engine as one MPI job: the topology (TP x PP x DP), each rank's slice of the model, and the
 * pipelined generation loop. Stage 0 runs the scheduler (continuous batching, identical on every TP
 * rank of the stage), keeps pp micro-batches in flight so every stage works while the others do,
 * and hands the stream down the pipeline; the last stage samples and returns the tokens (and the
 * index keys the stale-key quirk needs) to stage 0. DP replicas take prompts i with i % dp == their
 * replica. A run on one rank is the same code with TP = PP = DP = 1. */
#ifndef DS_DIST_H
#define DS_DIST_H

#include <stdint.h>

#include <mpi.h>

#include "engine_cli.h"
#include "model.h"
#include "sampler.h"
#include "topo.h"

struct dist_opts {
    int tp, pp;                /* 0 = defaults (topo_init) */
    int pp_counts[TOPO_MAX_PP]; /* --pp-layers, or all 0 */
    double deadline_s;         /* watchdog */
    int engram_per_rank;       /* --engram per-rank: TP row slices + sum instead of the node's service */
    int64_t max_batch_tokens;  /* --max-batch-tokens: tokens per step and micro-batch (0 = no limit) */
    int n_stop_ids, stop_ids[64]; /* --stop-ids a,b,...: end a sequence besides EOS */
    bool quiet;                /* --quiet: no progress line */
    bool logprobs;             /* the job records log-probabilities (else none is computed) */
    bool score;                /* score the prompts (dist_generate's score mode) instead of generating */
    bool whole_logits;         /* a rank keeps whole logits rows (--save-logits): no row-split draws */
    int64_t max_seq_len, min_len;
    int max_seqs;              /* sequence slots per DP replica */
};

/* One forward of one micro-batch on one rank, for the step trace. */
struct trace_event {
    int32_t rank, stage, tp, step, seqs, rows;
    double start, end; /* seconds since the job's common start: the forward (TP collectives included) */
    double tp_comm;    /* seconds of it in the TP collectives (struct comm.busy_s: NCCL's span on the stream) */
    double comm;       /* seconds handing the micro-batch (or the sampled tokens) on along the pipeline */
    double wait;       /* seconds blocked receiving this step's input (stream or tokens) before it */
};

struct gen_request;
/* Called on world rank 0 once per finished request: its own replica's as they finish, other
 * replicas' as their results arrive (each replica's stage 0 sends a request the moment it
 * finishes), so a writer can make each one durable at once. index: position in the request list. */
typedef void (*gen_done_fn)(void *ctx, int index, const struct gen_request *q);
/* Called on a last-stage rank for every sampled logits row ([vocab], whole rows), in the order a
 * request's tokens are sampled: row k is the one its k-th output token was drawn from. */
typedef void (*gen_logits_fn)(void *ctx, int index, const float *row, int vocab);

struct dist_engine {
    struct topo topo;
    struct loaded_model lm;
    struct backend be;
    struct engine_flags ef;   /* backend and engine switches this job runs with */
    struct comm *tp_dev;      /* the TP group for the model's (backend) buffers: NCCL, or MPI staging */
    struct model *m;
    bool mpi_owner;
    struct engram_service *engram; /* the node's Engram tables (NULL: per-rank slices) */
    double t0; /* common time origin (after a barrier) */
    int64_t max_batch_tokens;
    int n_stop_ids, stop_ids[64];
    bool quiet;
    bool logprobs; /* compute each drawn token's log-probability (dist_opts.logprobs) */
    bool score;    /* dist_opts.score */
    bool whole_logits; /* dist_opts.whole_logits */
    struct trace_event *trace;
    int n_trace, cap_trace;
    double pend_wait;         /* wait time of the step being prepared (goes into its trace event) */
    MPI_Comm results_comm;    /* finished requests, replica stage 0 -> world rank 0 (own context) */
    gen_done_fn on_done;      /* world rank 0; NULL: none */
    void *on_done_ctx;
    gen_logits_fn on_logits;  /* last-stage ranks that want the rows; NULL: none */
    void *on_logits_ctx;
};

/* Gather every rank's step trace to world rank 0 and write it as CSV (path on rank 0). */
int dist_trace_write(struct dist_engine *d, const char *path);
/* Collective: every rank's step trace, concatenated in world-rank order, on world rank 0 (*all,
 * *n; caller frees); other ranks get NULL and 0. */
void dist_trace_gather(struct dist_engine *d, struct trace_event **all, int64_t *n);

/* Parse --tp, --pp, --pp-layers a,b,..., --watchdog S; returns 1 when argv[*i] was one. */
int dist_flag_parse(int argc, char **argv, int *i, struct dist_opts *o);

/* MPI_Init (if needed), topology, this rank's slice, engine. Dies with one error line on every rank
 * on bad input. Rank 0 prints the rank table. */
void dist_open(struct dist_engine *d, const char *dir, const struct engine_flags *f, const struct dist_opts *o);
void dist_close(struct dist_engine *d);

enum gen_finish { GEN_FINISH_LENGTH = 0, GEN_FINISH_EOS = 1, GEN_FINISH_STOP_ID = 2 };

/* One prompt of a generation job and its result. */
struct gen_request {
    const int32_t *tokens;
    int64_t n, max_new;
    struct sample_params sp;
    int32_t *out; /* [max_new], filled on world rank 0 after dist_generate (score mode: unused) */
    double *lp;   /* [max_new] log-probability of each generated token under the model (temperature 1);
                   * score mode: [n - 1], lp[k] = log p(tokens[k + 1] | tokens[0..k]) */
    int64_t n_out;
    int finish;   /* enum gen_finish */
    bool skip;    /* already recorded by an earlier run (resume): neither generated nor reported */
    /* seconds since the common start, on the replica's stage-0 clock (world rank 0 gets them for
     * every request): admitted into a slot, first and last token back at stage 0 (NaN: none) */
    double admit_s, first_s, last_s;
};

/* Generate every request (all ranks pass the same list); results land on world rank 0. In score
 * mode (dist_opts.score) every prompt runs as prefill chunks only, each chunk's rows all give
 * logits, the last stage turns row k into the log-probability of the prompt's token k + 1, and a
 * request ends with its last chunk: n_out = n - 1 values in lp.
 * chunk: prefill chunk size. A request's sampling stream is keyed by its index in the list, so
 * pass every prompt of a job (skipped ones too) to keep its tokens whatever else runs.
 * Returns 0 or -1 (ds_err_set). */
int dist_generate(struct dist_engine *d, struct gen_request *reqs, int n, int64_t chunk);

/* One forward of the same batch on every rank, stage after stage (no micro-batch overlap): what
 * replay and verify use, since every rank knows the fixture's inputs. Only the last stage's
 * `logits` are written. Matches replay_fwd's signature (ctx = the dist_engine). */
int dist_forward_sync(void *ctx, const struct fwd_seq *seqs, int n, float *logits, const struct fwd_hooks *hooks);

#endif /* DS_DIST_H */
