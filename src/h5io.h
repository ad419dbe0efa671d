/* HDF5 prompt files (input) and output files (results, traces, metadata) of batch jobs.
 *
 * Prompt files are CSR (flat tokens + offsets) because parallel HDF5 cannot read or write
 * variable-length data in parallel but reads hyperslabs well: several ranks open one file with the
 * MPI-IO driver and each reads only its replica's share with one collective read per dataset.
 * Output files are written by one rank (world rank 0, where results are gathered) through the
 * serial driver: a finished request is a ragged append (its tokens, one offset, a few scalars) and
 * an extend-and-write of filtered datasets in parallel would have to be collective, pulling every
 * rank into every append for no gain.
 *
 * What survives a kill: each append first writes one self-checking record to OUT.h5.journal (one
 * write(), so page cache holds it the moment append returns), then updates OUT.h5 and H5Fflushes
 * it so readers see the request. HDF5 1.10 itself is not crash-consistent (a kill in the middle of
 * a flush can leave an older chunk unreadable), so resume rebuilds OUT.h5 from the journal: every
 * request whose append returned survives SIGKILL at any moment, a request whose append was cut
 * short is simply not recorded. With o->sync the journal and file are also fsynced per append
 * (node crashes). finish marks the file complete, fsyncs it and removes the journal, so until then
 * results take about twice their size on disk. An append costs about 1 ms of CPU (flush included).
 *
 * Layouts (format_version 1):
 *   /prompts            attrs format_version (1), compression ("zstd-32015 level L" | "none")
 *     tokens int32 [T]; offsets int64 [N+1] (0 .. T, non-decreasing, every prompt non-empty)
 *     optional, length N: max_new_tokens int64 (<0: job default), temperature f32 (NaN: default),
 *       top_p f32 (NaN: default), top_k int32 (<0: default), seed int64 (<0: default) or uint64,
 *       id int64 (integer ids) or id_chars uint8 + id_offsets int64 [N+1] (string ids, CSR),
 *       text_chars uint8 + text_offsets int64 [N+1] (UTF-8 text, CSR)
 *   / attrs format_version, kind ("generate"|"score"), complete (0|1), fingerprint, n_prompts,
 *     runs, compression
 *   /outputs (generate)  prompt_index int64 [n], offsets int64 [n+1], tokens int32, finish_reason
 *     int8 [n] (0 length, 1 stop/EOS, 2 stop id), logprobs f64 (optional, aligned with tokens)
 *   /scores (score)  prompt_index, offsets, logprobs f64 (log p of prompt token k+1 given 0..k),
 *     nll f64 [n], n_tokens int64 [n]
 *   /trace/requests  compound [n]: prompt_index, run, admit_s, first_token_s, last_token_s,
 *     prompt_tokens, generated_tokens (seconds since the start of run `run`)
 *   /trace/steps     compound: run, rank, stage, tp, step, seqs, rows, start_s, end_s, compute_s,
 *     comm_s, wait_s, tp_comm_s (the part of compute_s in TP collectives; absent in files written
 *     before it, whose appends drop it)
 *   /meta  dataset json (the meta JSON text); attrs: every short scalar of that JSON, hdf5_version,
 *     mpi_version, zstd_version, compression, run_start_unix f64 [runs], end_unix
 * Rows of /outputs, /scores and /trace/requests are in completion order; prompt_index maps a row
 * to the prompt. Everything is readable by h5py; zstd datasets need the filter plugin:
 *   mpicc -O2 -fPIC -shared -DH5ZSTD_PLUGIN $(pkg-config --cflags hdf5-openmpi) \
 *         -o plugins/libh5zstd.so src/h5zstd.c -lzstd;  export HDF5_PLUGIN_PATH=$PWD/plugins */
#ifndef DS_H5IO_H
#define DS_H5IO_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include <hdf5.h>
#include <mpi.h>

#include "sampler.h"

#define H5IO_FORMAT_VERSION 1
#define H5Z_FILTER_ZSTD_ID 32015
#define H5IO_FINGERPRINT_LEN 17 /* 16 hex digits + NUL */

/* ------------------------------------------------------------------------------------------------
 * zstd filter (src/h5zstd.c) */

/* Register filter 32015 with this process's HDF5 (idempotent; a failing H5Zregister is fatal). */
void h5zstd_register(void);
/* Compression level for datasets created from now on: 1..22, 0 = uncompressed. Default 3. */
void h5io_set_zstd_level(int level);
int h5io_zstd_level(void);
/* "zstd-32015 level 3" or "none": what the datasets created now carry (also stored in files). */
const char *h5io_compression_name(void);

/* ------------------------------------------------------------------------------------------------
 * Prompt files: writing (one process, serial driver) */

/* A prompt set in memory. Every optional array is [n] or NULL (dataset absent); the "job default"
 * sentinels of the layout above apply. ids and int_ids are exclusive. */
struct h5_prompts_in {
    int64_t n;
    const int32_t *tokens;   /* [offsets[n]] */
    const int64_t *offsets;  /* [n+1] */
    const int64_t *max_new_tokens;
    const float *temperature, *top_p;
    const int32_t *top_k;
    const int64_t *seed;
    const char *const *ids;  /* string ids */
    const int64_t *int_ids;  /* integer ids */
    const char *const *texts;
};

/* Write a prompt file atomically (PATH.tmp, then rename), zstd-compressed at the current level.
 * Returns 0 or -1 (ds_err_set: bad input such as inconsistent offsets, or an unwritable path).
 * (src/cmd_prompts.c) */
int h5_prompts_write(const char *path, const struct h5_prompts_in *in);

/* ------------------------------------------------------------------------------------------------
 * Prompt files: reading (collective over a communicator) */

struct h5_prompts {
    char *path;
    MPI_Comm comm;          /* MPI_COMM_SELF, or the ranks that open and read together */
    hid_t file, dxpl;
    int64_t n_prompts, n_tokens;
    int64_t *offsets;       /* [n_prompts+1], read whole at open (8 bytes per prompt) */
    int64_t *id_offsets, *text_offsets; /* [n_prompts+1] or NULL */
    bool has_max_new, has_temperature, has_top_p, has_top_k, has_seed, has_text;
    int id_kind;            /* 0 none, 1 integer (/prompts/id), 2 string (id_chars + id_offsets) */
    bool seed_signed;       /* int seed dataset: negative = job default */
};

/* What a job accepts and what it uses for fields a prompt leaves unset (the same on every rank of
 * the communicator: want_text decides which collective reads happen). */
struct h5_prompt_limits {
    int64_t vocab;          /* token ids must be in [0, vocab); 0 = no upper bound */
    int64_t max_len;        /* prompt tokens + max_new_tokens must be <= max_len; 0 = no bound */
    int64_t default_max_new;
    struct sample_params default_sp;
    bool want_text;         /* also read /prompts/text_* (when present) */
};

/* One replica's share of a window of prompts, with every field resolved. */
struct h5_prompt_batch {
    int64_t n;              /* prompts in the share */
    int64_t *index;         /* [n] prompt index in the file */
    int64_t *offsets;       /* [n+1] into tokens, offsets[0] = 0 */
    int32_t *tokens;
    int64_t *max_new;       /* [n] */
    struct sample_params *sp; /* [n] */
    int id_kind;            /* as in struct h5_prompts */
    char **id;              /* [n] string ids, integer ids printed, or the index when the file has none */
    int64_t *int_id;        /* [n] when id_kind == 1, else NULL */
    char **text;            /* [n] when want_text and the file has text, else NULL */
};

/* Open a prompt file on every rank of comm (collective; MPI-IO driver with collective metadata
 * reads; without MPI initialised, comm must be MPI_COMM_SELF and the serial driver is used) and
 * validate its structure: format_version, tokens / offsets present and 1-D integer datasets,
 * offsets starting at 0, non-decreasing, each prompt non-empty, ending at len(tokens), optional
 * datasets of length N, CSR ids and text consistent. Returns 0, or -1 with one ds_err_set line
 * "PATH: /prompts/DATASET: what" (identical on every rank; nothing is left open). */
int h5_prompts_open(struct h5_prompts *p, const char *path, MPI_Comm comm);

/* Collective over p->comm: read prompts first .. first+count-1, keeping those with
 * index % dp_size == dp_rank (the engine's DP assignment: replica r serves prompts i with
 * i % dp == r, so a window's shares are disjoint and cover it, and sorted-by-length files still
 * spread evenly). Ranks of one replica (TP x PP) pass the same dp_rank and receive the same share.
 * Each dataset is one collective H5Dread of a hyperslab union. Values are validated against lim
 * (token ids, lengths, sampling fields); a failure on any rank is agreed over comm, so every rank
 * returns -1 with the same message, naming the file, the dataset and the prompt. */
int h5_prompts_read(struct h5_prompts *p, int64_t first, int64_t count, int dp_rank, int dp_size,
                    const struct h5_prompt_limits *lim, struct h5_prompt_batch *out);
void h5_prompt_batch_free(struct h5_prompt_batch *b);
void h5_prompts_close(struct h5_prompts *p); /* collective */

/* ------------------------------------------------------------------------------------------------
 * Output files (one writer: world rank 0; serial driver, no MPI calls) */

enum h5_finish { H5_FINISH_LENGTH = 0, H5_FINISH_EOS = 1, H5_FINISH_STOP_ID = 2 };
enum h5_out_kind { H5_OUT_GENERATE = 0, H5_OUT_SCORE = 1 };

/* Timing of one request, seconds since the run's common start (struct dist_engine.t0). */
struct h5_request_trace {
    double admit_s, first_token_s, last_token_s;
    int64_t prompt_tokens, generated_tokens;
};

/* One forward of one micro-batch on one rank (struct trace_event of dist.h, plus time split). */
struct h5_step_trace {
    int32_t rank, stage, tp, step, seqs, rows;
    double start_s, end_s, compute_s, comm_s, wait_s, tp_comm_s;
};

struct h5_out {
    char *path;
    hid_t file;
    enum h5_out_kind kind;
    bool logprobs;          /* generate: /outputs/logprobs present */
    bool sync;              /* also fsync journal and file per append (node crashes); default off */
    int64_t n_prompts;
    int64_t n_done;         /* requests recorded */
    int64_t n_values;       /* tokens (generate) or logprobs (score) recorded */
    int64_t n_steps;
    int32_t run;            /* 0 for the first run, +1 per resume */
    uint8_t *done;          /* [n_prompts] */
    hid_t d_index, d_offsets, d_tokens, d_logprobs, d_finish, d_nll, d_ntok, d_req, d_steps;
    hid_t t_req, t_step;
    int jfd;                /* the journal, append-only */
    bool defer_flush;       /* while rebuilding: one flush at the end */
};

/* Meta JSON for /meta: the given parts plus the versions of MPI, HDF5 and zstd linked here, the
 * host name, the compression and the start time. Any field may be NULL. Caller frees. */
struct h5_meta {
    const char *job_spec_json;     /* effective job spec (JSON object text) */
    const char *model_config_json; /* config_to_json() */
    const char *rank_table;        /* topo_rank_table() */
    const char *git_commit;
    const char *hosts;             /* host list, e.g. comma-separated */
    const char *cuda_version, *nccl_version;
};
char *h5_meta_json(const struct h5_meta *m);

/* Fingerprint of a job: 16 hex digits of a 64-bit FNV-1a hash of `text` (e.g. the effective job
 * spec followed by the model config JSON). */
void h5_job_fingerprint(const char *text, char out[H5IO_FINGERPRINT_LEN]);

/* Create an output file (PATH.tmp, flushed, renamed to PATH, reopened), complete = 0.
 * Refuses (-1, ds_err_set) when PATH holds a complete dsbatch output or anything that is not a
 * dsbatch output; a partial output of a killed job is replaced. meta_json: a JSON object (see
 * h5_meta_json). An unwritable path is one error line with the system's reason. */
int h5_out_create(struct h5_out *o, const char *path, const char *meta_json, const char *job_fingerprint,
                  int64_t n_prompts, bool save_logprobs);
int h5_out_create_score(struct h5_out *o, const char *path, const char *meta_json, const char *job_fingerprint,
                        int64_t n_prompts);

/* Reopen a partial (or complete) output to continue it. Returns 1 when PATH does not exist
 * (nothing to resume: create it), 0 when reopened, -1 (ds_err_set) when it is not a dsbatch
 * output, is in use, was written for another job (fingerprint or n_prompts differ: refused, never
 * modified), or is unfinished without its journal. A partial file is rebuilt from its journal
 * (PATH.rebuild, renamed over PATH). On 0, done[i] = 1 for every prompt already recorded (done has
 * n_prompts entries) and appends continue. */
int h5_out_open_resume(struct h5_out *o, const char *path, const char *job_fingerprint, int64_t n_prompts,
                       uint8_t *done);

/* Record one finished request (generate files): tokens [n], logprobs [n] (NULL: NaN when the file
 * keeps logprobs), finish reason, timing (NULL: unknown). Durable on return (H5Fflush; fsync too
 * when o->sync). Returns -1 (ds_err_set) for a bad index, a prompt already recorded or a wrong
 * finish code; HDF5 failures are fatal. */
int h5_out_append(struct h5_out *o, int64_t prompt_index, const int32_t *tokens, const double *logprobs, int64_t n,
                  int finish, const struct h5_request_trace *tr);
/* Record one scored prompt (score files): logprobs [n] of its tokens 1..n, nll, timing. */
int h5_out_append_score(struct h5_out *o, int64_t prompt_index, const double *logprobs, int64_t n, double nll,
                        const struct h5_request_trace *tr);
/* Append step records (all ranks', gathered on the writer) to /trace/steps; flushed. */
int h5_out_write_steps(struct h5_out *o, const struct h5_step_trace *ev, int64_t n);
/* Mark the job finished: complete = 1, end time, flush, fsync, close. */
int h5_out_finish(struct h5_out *o);
/* Close without marking complete (error paths); the file stays resumable. */
void h5_out_close(struct h5_out *o);

/* ------------------------------------------------------------------------------------------------
 * Helpers shared by src/h5*.c and src/cmd_prompts.c (HDF5 failures abort through CHECK_H5) */

/* A 1-D dataset of len elements, chunked with the current zstd level; extendible: unlimited. */
hid_t h5io_create_1d(hid_t loc, const char *name, hid_t ftype, int64_t len, bool extendible, int64_t chunk);
void h5io_write_range(hid_t d, hid_t mtype, int64_t start, int64_t n, const void *buf);
/* (Re)write attribute NAME: n < 0 scalar, else 1-D of n. (src/h5zstd.c, like the attr helpers) */
void h5io_attr_write(hid_t obj, const char *name, hid_t ftype, hid_t mtype, int64_t n, const void *v);
void h5io_attr_i32(hid_t obj, const char *name, int32_t v);
void h5io_attr_i64(hid_t obj, const char *name, int64_t v);
void h5io_attr_f64(hid_t obj, const char *name, double v);
void h5io_attr_str(hid_t obj, const char *name, const char *v); /* variable-length UTF-8 */
hid_t h5io_vlen_str_type(void);
int h5io_attr_get_i64(hid_t obj, const char *name, int64_t *v); /* -1: absent or not an integer */
int h5io_attr_get_str(hid_t obj, const char *name, char *buf, size_t cap); /* -1: absent */
int h5io_check_writable(const char *path); /* create/truncate PATH; -1 with the system's reason */

/* ------------------------------------------------------------------------------------------------
 * `dsbatch inspect FILE.h5` (src/h5inspect.c): summary of an output file (requests, tokens,
 * throughput, TTFT / ITL percentiles, complete flag, job spec) or of a prompt file (validated).
 * Returns 0 or -1 (ds_err_set). */
int h5_inspect(const char *path, FILE *out);
/* Validate a whole prompt file through h5_prompts_read (token ids < vocab when vocab > 0, prompt
 * length <= max_len when max_len > 0) and print one line describing it. Returns 0 or -1. */
int h5_prompts_summary(const char *path, int64_t vocab, int64_t max_len, FILE *out);

#endif /* DS_H5IO_H */
