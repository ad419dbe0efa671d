/* The per-stage forward pass of DeepSeek-V4.1-Flash over a batch of sequence chunks, written
 * against the op table (kernels/backend.h) only. Holds the per-sequence state the reference keeps
 * in its module buffers: window KV rings, compressed KV and index-key caches of the KV sources,
 * open compressor groups, Engram token history, and which index keys were published last (for the
 * stale-key quirk of MODEL.md §3.12). One forward can mix sequences at different positions, each
 * contributing a chunk of any length (prefill chunk or one decode token). */
#ifndef DS_MODEL_H
#define DS_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "comm.h"
#include "config.h"
#include "engram_hash.h"
#include "weights.h"

enum window_layout {
    /* Chunks that start at position 0 list each row's window as the reference's single-shot
     * prefill does (min(T, W) entries, trailing -1); every other row as a decode step does. */
    WINDOW_LAYOUT_REFERENCE = 0,
    /* Every row as a decode step (W window entries, oldest first, leading -1; the indexer scores
     * and selects over exactly the visible rows): results then do not depend on how a prompt is
     * chunked. */
    WINDOW_LAYOUT_DECODE,
};

/* How the routed experts' per-slot outputs [T, k, D] cross the TP group (each rank computes the
 * slots of its own experts). Both keep the single-rank sum, in ascending expert id per token, so
 * both give the same bits. */
enum moe_exchange {
    /* OWNER when the gather would receive at least MOE_OWNER_MIN_BYTES a rank and D splits evenly
     * over the ranks, else GATHER */
    MOE_EXCHANGE_AUTO = 0,
    /* every rank gathers every rank's [T, k, D] and sums all of D: (P - 1) T k D bf16 received a
     * rank, one collective */
    MOE_EXCHANGE_GATHER,
    /* rank r owns columns [r D/P, (r+1) D/P): an all-to-all hands it every rank's slots of those
     * columns, it sums them, and an all-gather of the [T, D/P] sums rebuilds [T, D]: (P - 1)/P
     * (k + 1) T D bf16 received a rank (6.9x less at TP8, k = 6), two collectives */
    MOE_EXCHANGE_OWNER,
};

/* AUTO's switch point. The owner exchange costs one more collective's fixed latency (an NCCL
 * collective between NVLink GPUs: ~10 µs) and saves (P - 1) T k D - (P - 1)/P (k + 1) T D bf16;
 * at ~400 GB/s of all-gather bandwidth the saving pays for the latency from ~4 MB gathered, at
 * V4.1-Flash's TP8 dimensions from 10 rows a step. An estimate until the 8-GPU run (issue #7)
 * measures both forms (bench_nccl --ops moe); --moe-exchange gather|owner chooses by hand. */
#define MOE_OWNER_MIN_BYTES ((size_t)4 << 20)

/* Decode steps (every sequence one row) of at most this many rows run their segments as graphs
 * (engine_opts.graphs); prefill chunks and mixed batches, whose row counts seldom repeat, run
 * eagerly. */
#define MODEL_GRAPH_ROWS_MAX 256

struct engine_opts {
    int64_t max_seq_len;       /* positions per sequence slot */
    int max_seqs;              /* sequence slots */
    bool stale_index_keys;     /* reproduce the reference's stale index-key slot (§3.12) */
    enum window_layout window_layout;
    /* Scratch rows of the kv arena at start (0: 4,096); a larger forward grows it, moving the caches. */
    int64_t kv_scratch_rows;
    /* Tensor-parallel group (NULL = one rank). Every TP collective gathers whole values (never sums
     * partials), so any TP size computes bit-identical numbers to one rank. */
    struct comm *tp;
    /* Run the runs of ops between the host's own work as CUDA graphs in decode steps (every
     * sequence one row) of up to MODEL_GRAPH_ROWS_MAX rows: recorded once per layer and batch
     * size, replayed with one launch each. Same bits as without (--eager turns it off). */
    bool graphs;
    enum moe_exchange moe_exchange; /* --moe-exchange auto|gather|owner (same bits) */
};

struct engine_opts engine_opts_default(const struct model_config *cfg);

/* One sequence's part of a forward call. */
struct fwd_seq {
    int slot;              /* sequence slot (state) */
    int64_t start;         /* absolute position of tokens[0]; must equal the slot's current length */
    int64_t len;           /* tokens in this chunk */
    const int32_t *tokens; /* [len] host */
    bool all_logits;       /* logits for every row (else only the last row) */
};

/* Observation/forcing points used by replay (stream forcing) and tests. X/P are backend pointers
 * to the whole batch ([T, hc, D] bf16, [T, hc] fp32); rows follow the order of the fwd_seq list. */
struct fwd_hooks {
    void *ctx;
    void (*pre_engram)(void *ctx, int layer, bf16_t *X, float *P, int64_t T);  /* before engram/block */
    void (*pre_block)(void *ctx, int layer, bf16_t *X, float *P, int64_t T);   /* after engram */
    void (*post_block)(void *ctx, int layer, const bf16_t *X, const float *P, int64_t T);
    void (*engram_ids)(void *ctx, int layer, const int64_t *ids, int64_t T, int64_t C); /* host */
    /* top-k rows of an index source, host int32 [T, k] (compressed row ids, −1 unused) */
    void (*topk)(void *ctx, int layer, const int32_t *idx, int64_t T, int64_t k);
    void (*final_hidden)(void *ctx, const bf16_t *h, int64_t T); /* normed hidden before the head */
};

struct model;

struct model *model_new(const struct model_config *cfg, struct model_weights *w, struct backend *be,
                        const struct engram_consts *ec, const struct engine_opts *opt);
void model_free(struct model *m);

/* Reset a slot to an empty sequence. */
void model_reset_slot(struct model *m, int slot);
int64_t model_slot_len(const struct model *m, int slot);
/* Positions per sequence slot this engine was built for. */
int64_t model_max_seq_len(const struct model *m);
int model_max_seqs(const struct model *m);

/* Run one forward over n chunks. logits (host, fp32) receives, in chunk order, either every row
 * (all_logits) or the last row of each chunk: [n_rows_out, vocab]. Returns 0 or -1 (ds_err_set:
 * token out of range, sequence too long, ...). */
int model_forward(struct model *m, const struct fwd_seq *seqs, int n, float *logits,
                  const struct fwd_hooks *hooks);

/* Pipeline stages: a stage that does not embed takes the stream X [T, hc, D] bf16 and mix
 * P [T, hc] fp32 from the previous stage (host buffers, rows in chunk order); a stage that does not
 * own the head hands them on. model_forward is model_forward_stage with io NULL on a whole model. */
struct stage_io {
    const bf16_t *X_in;
    const float *P_in;
    bf16_t *X_out;
    float *P_out;
};
int model_forward_stage(struct model *m, const struct fwd_seq *seqs, int n, const struct stage_io *io,
                        float *logits, const struct fwd_hooks *hooks);

/* What the last stage takes from the head's logits where they are, instead of the rows. */
struct sample_params;
struct head_draws {
    int32_t *tokens;                    /* [n] the draws of each sequence's last position, or NULL */
    const struct sample_params *params; /* [n] each row's draw (model_draw_ready), or NULL: greedy */
    const uint64_t *request, *position; /* [n] the draws' keys (sampler_pick's), with params */
    const int32_t *targets;             /* [R] (model_logits_rows) ids to score, -1 = none (lp 0), or NULL */
    double *lp;                         /* [R] targets' log-probabilities, or [n] the tokens'; NULL = none */
};
/* model_forward_stage that returns hd's draws: tokens (greedy, top-k or full-row temperature
 * draws; one row a sequence, no all_logits) and/or log-probabilities, the bits of sampler_pick and
 * sampler_logprob over the rows model_forward_stage would write. The logits stay in backend memory:
 * each TP rank takes its vocab columns' argmax (all rows greedy, 8 bytes a row) or row_topk lists
 * (k = the largest top_k of the step, BE_TOPK_MAX with a full-row draw) and row_lse parts (16 bytes
 * a slice of kernels/lse_core.h; a second call with the temperatures for full-row draws) and the
 * group all-gathers them, instead of the rows' V floats moved between the ranks and downloaded; a
 * full-row draw the list does not decide takes the step's whole rows (model_draw_stats counts
 * them). Log-probabilities and full-row draws need model_lse_ready. hd is unused on other stages. */
int model_forward_draws(struct model *m, const struct fwd_seq *seqs, int n, const struct stage_io *io,
                        const struct head_draws *hd, const struct fwd_hooks *hooks);
/* Whether each TP rank's head columns are whole slices of kernels/lse_core.h (TP 1, 2, 4, 8 with
 * the vocabulary a multiple of 8), which model_forward_draws' log-probabilities need. */
bool model_lse_ready(const struct model *m);
/* Whether model_forward_draws can draw a row with these parameters: greedy, a top-k draw (0 < top_k
 * < V) with top_k <= BE_TOPK_MAX, or a temperature draw over every entry (top-p or not) where
 * model_lse_ready: its row_topk list of BE_TOPK_MAX entries and row_lse's weight total decide the
 * draw (sampler_pick_cand), else, rarely on a trained model (a nucleus longer than the list), that
 * step gathers the whole rows for those draws. */
bool model_draw_ready(const struct model *m, const struct sample_params *p);
/* How many full-row temperature draws model_forward_draws made so far, and how many of them needed
 * the whole row (the list did not decide them). */
void model_draw_stats(const struct model *m, int64_t *full, int64_t *whole_rows);

/* Stale index keys across stages (MODEL.md §3.12): an open-group decode step on stage 0 scores
 * against the keys a later stage published last. After a forward, a later stage appends the index
 * key rows its layers wrote and which layer published last per sequence (key_sync_append); stage 0
 * applies them to its mirror caches before the sequences' next step (key_sync_apply). */
void model_key_sync_append(struct model *m, const struct fwd_seq *seqs, int n, uint8_t **buf, size_t *len);
int model_key_sync_apply(struct model *m, const uint8_t *buf, size_t len);

/* Number of logits rows model_forward writes for this batch. */
int64_t model_logits_rows(const struct fwd_seq *seqs, int n);

/* Row-split logits (off by default): with TP and at least as many logits rows R as TP ranks, the
 * last stage hands each TP rank only its block of rows, [r0, r1) with r0 = rank * ceil(R / tp),
 * as whole rows (an all-to-all of the vocab-split head's columns instead of gathering every row
 * on every rank: 1/tp of the bytes, and 1/tp of the download), so the ranks can draw a step's
 * rows between them. Every rank of the TP group must set the same. */
void model_set_split_logits(struct model *m, bool on);
/* Whether a forward of R logits rows is split, and this rank's rows [*r0, *r1) (r0 may be >= R:
 * none). Not split: false, and [0, R). */
bool model_logits_split(const struct model *m, int64_t R, int64_t *r0, int64_t *r1);
/* The most rows any forward of this process has passed to the head (its logits buffers are that
 * many rows x vocab): a debugging and test counter of the logits path's largest allocation. */
int64_t model_head_rows_max(void);

/* RoPE frequency table of the reference (fp32 pow, fp32 reciprocal, YaRN blend), rd/2 entries. */
void rope_freqs(float *out, int rd, double theta, bool yarn, double factor, int64_t original_seq_len,
                double beta_fast, double beta_slow);

#endif /* DS_MODEL_H */
