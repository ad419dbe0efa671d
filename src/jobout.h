/* The HDF5 output of a batch job (generate, score), as the commands drive it: the job's meta data
 * and fingerprint, opening the output on world rank 0 (fresh, or resumed with the done set handed
 * to every rank), recording each finished request the moment it finishes, the step trace at the
 * end, and the parts written when the job completes (decoded text, --save-logits rows). The file
 * format and its durability (the journal) are src/h5io.h's; this module only decides what goes
 * in and when, and turns every failure into one error line that all ranks print alike.
 *
 * Only world rank 0 touches the file. Opening is collective over the job's world communicator
 * (NULL for a one-process job such as score): rank 0 opens or refuses, then broadcasts the outcome
 * and the done set, so a refusal (another job's output, a complete output without --resume, an
 * unwritable path) is the same line on every rank and no rank starts generating. */
#ifndef DS_JOBOUT_H
#define DS_JOBOUT_H

#include <stdbool.h>
#include <stdint.h>

#include "comm.h"
#include "config.h"
#include "dist.h"
#include "h5io.h"
#include "tokenizer.h"

/* Output format by name: .h5 / .hdf5 / .he5 are HDF5, anything else JSONL. */
bool job_out_is_h5(const char *path);
/* Prompt format: HDF5 when the file starts with the HDF5 signature, or (so that a missing file
 * gets the HDF5 reader's error) when it does not exist and is named like an HDF5 file. */
bool job_prompts_is_h5(const char *path);

/* What /meta and the fingerprint are made of (only world rank 0's copy is used). */
struct job_desc {
    int argc;
    char **argv;                    /* the command's effective options (argv[0] = command name) */
    const struct model_config *cfg;
    const char *rank_table;         /* topo_rank_table(); NULL on one process */
    const char *hosts;              /* job_hosts(); NULL: this host */
};

/* Collective over world (NULL: just this process): the distinct host names of the job's ranks,
 * comma-separated, on rank 0 (caller frees); NULL on the other ranks. */
char *job_hosts(struct comm *world, const char *my_host);

/* The meta JSON (h5_meta_json: effective job spec without --resume, model config, rank table,
 * versions of MPI / HDF5 / zstd (and CUDA / NCCL when built with them), git commit, hosts, start
 * time) and the job's fingerprint: h5_job_fingerprint of the effective spec without the options
 * that cannot change a single output value (see jobout.c) followed by the model config JSON.
 * Caller frees. */
char *job_meta_json(const struct job_desc *j, char fp[H5IO_FINGERPRINT_LEN]);

/* --save-logits: the sampled logits rows of every request, kept in memory until the job ends
 * (a debug option, bounded by the command). */
struct logit_rows {
    int vocab;
    int64_t n;             /* requests */
    float **row;           /* [n] -> [count * vocab] */
    int64_t *count, *cap;  /* [n] */
};
void logit_rows_init(struct logit_rows *l, int64_t n_requests, int vocab);
void logit_rows_add(void *ctx, int index, const float *row, int vocab); /* a gen_logits_fn */
void logit_rows_free(struct logit_rows *l);

struct job_out {
    bool writer;            /* world rank 0: holds the open file */
    struct h5_out h5;
    enum h5_out_kind kind;
    int64_t n_prompts;
    uint8_t *done;          /* [n_prompts], every rank: recorded by an earlier run */
    int64_t n_resumed;      /* how many */
    int64_t n_recorded;     /* appended by this run (writer) */
};

/* Collective over world (NULL: one process). The writer creates `path` (h5_out_create /
 * h5_out_create_score; an existing complete output is refused), or with `resume` reopens it after
 * checking the fingerprint (h5_out_open_resume; created when absent). On any refusal every rank
 * dies with the writer's one error line, and the file is left as it was. `desc` and `logprobs`
 * matter on the writer only. */
void job_out_open(struct job_out *o, struct comm *world, bool writer, const char *path, enum h5_out_kind kind,
                  bool resume, bool logprobs, const struct job_desc *desc, int64_t n_prompts);

/* Record a finished generation request (a gen_done_fn for dist_engine.on_done; ctx = job_out). */
void job_out_on_done(void *ctx, int index, const struct gen_request *q);
/* Record a scored prompt. */
void job_out_scored(struct job_out *o, int64_t index, const double *logprobs, int64_t n, double nll,
                    const struct h5_request_trace *tr);
/* Append the job's gathered step trace (writer). */
void job_out_steps(struct job_out *o, const struct trace_event *ev, int64_t n);
/* Writer: add what is written once every request is in (generate: /outputs/text_chars +
 * text_offsets when tk is given, /outputs/logits + logits_offsets when lr is given), then mark the
 * output complete. Other ranks: just free. Dies with one error line when the file cannot be
 * finished (it then stays resumable). */
void job_out_finish(struct job_out *o, const struct tokenizer *tk, bool keep_special, const struct logit_rows *lr);

#endif /* DS_JOBOUT_H */
