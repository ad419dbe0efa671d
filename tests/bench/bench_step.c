/* Decode-step and prefill benchmark of ONE RANK's shard of DeepSeek-V4.1-Flash (issue #6).
 *
 * The production layout is TP8 x PP2; this program times what rank 0 of it (tp_rank 0, pipeline
 * stage 0: the embedding and the first ~20 layers, no head) computes per step, at the real
 * per-rank dimensions, through the real engine code: the real config (data/presets/v41-flash.json),
 * a checkpoint listing every tensor of the release (synth.c's inventory, the one mkmodel writes)
 * bound and sliced by weights_bind with this rank's bind options, model_new and
 * model_forward_stage over the chosen backend's op table. No 510 GB folder is needed: the
 * checkpoint lives in memory and every tensor points into a few shared random pools (synth.h), so
 * it costs the largest tensor per dtype (~2 GB) while the backend still uploads this rank's full
 * shard, as it would from a release.
 *
 * What differs from a real run, and why:
 *  - Engram tables: ~100 GB in the release. Their rows are shrunk in memory (engram_vocab_size
 *    overridden, --engram-vocab) — a lookup reads the same bytes per token from a smaller table.
 *    As in a multi-rank job, the stage reads whole rows from the node's table (the Engram
 *    service's layout), so no TP sum follows the gather.
 *  - TP communication: a local stand-in comm of the TP size (allgather = this rank's block copied
 *    into every slot with one be->ops->copy_segs call, allreduce = no-op), so every op sees the shapes it sees in
 *    a TP8 job. NVLink/NCCL time is excluded; the stand-in's device copies are inside the times
 *    and their volume is printed. --tp-standin picks how the collectives meet the host (what the
 *    model does around them is the engine's own code, model_tp_between): async (default) enqueues
 *    the copies and returns, between graph segments; sync also waits for the stream before it
 *    returns, as the NCCL backend's ops do (comm_nccl.c op_wait: the host's turn at each collective,
 *    without NCCL's own latency); graph marks the comm stream_ordered, so the model records the
 *    collectives inside its graph segments (what capturing NCCL in the segments would give).
 *  - Routing: random weights route badly (most tokens of a batch pick the same few experts), so
 *    by default (--routing balanced) each token's experts are drawn uniformly, as balanced as a
 *    trained router, and written over the router's output after the router op has run (its time
 *    counts; one small device copy per layer is added). --routing model keeps the router's choice.
 *  - Graph segments (model_graph_begin): each batch size's untimed warm-up step records them and
 *    the timed steps replay them, as in a job. A replay repeats the router wrapper's plan copy
 *    too, so the timed steps route by the warm-up step's entries of the plan (as balanced; the
 *    bytes count the plan's mean). --eager times the steps without graphs.
 *  - Tokens come from this rank's slice of the vocab-split embedding (the stand-in allreduce adds
 *    no other rank's rows); weight values repeat between tensors (shared pools). Neither changes
 *    what the ops compute, only the values.
 *
 * Procedure: model_new with max_seqs = the largest batch; every sequence prefilled to --ctx tokens
 * (chunked, several sequences per forward); then for each --batch B: one untimed warm-up step,
 * then --steps timed decode steps (one token per sequence, be->ops->sync before the clock stops;
 * sequences keep growing, so the ctx column is the batch's mean length when the timing starts).
 * Then for each --prefill N: one sequence of N tokens from empty in chunks of --chunk (0 = whole),
 * once untimed (warm-up), once timed.
 *
 * Bytes: the weight bytes the stage reads: per forward, every dense weight of the stage's layers
 * once (attention, compressor, indexer, router gate, shared expert, norms, mHC, Engram
 * projection; wo_a as the bf16 copy the ops read), plus per layer the distinct local experts the
 * forward routes to x one expert's bytes (counted from the plan, or with --routing model from the
 * router's selections on the warm-up forward), plus the embedding and Engram rows gathered per
 * token. KV caches and activations are not counted. GB/s = bytes / time.
 *
 * FLOPs: 2 x the multiply-adds per token of every linear a token row goes through (layer_dense_macs)
 * plus, per routed pair on this rank (k per token, n_local of E experts here: the balanced plan's
 * expectation), one expert's w1, w3 and w2; attention's scores and P·V are not counted. Prefill
 * rows print TFLOP/s (against the cuBLAS bf16 rate of tests/bench/torch_gemm_ceiling.py).
 *
 * Output: a table on stdout and a CSV (--csv) with kind,batch_or_tokens,ctx,ms,bytes,gbps,backend,flops. */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "comm.h"
#include "config.h"
#include "engine_cli.h"
#include "engram_hash.h"
#include "log.h"
#include "model.h"
#include "prof_backend.h"
#include "safetensors.h"
#include "synth.h"
#include "topo.h"
#include "weights.h"

#define MAX_LIST 32

struct args {
    const char *backend, *preset, *csv, *profile;
    int tp, pp, device;
    int layer_a, layer_b; /* -1: the whole stage; else stage-relative [a, b] */
    int64_t ctx, engram_vocab;
    int steps, chunk;
    int n_batch, batch[MAX_LIST];
    int n_prefill;
    int64_t prefill[MAX_LIST];
    uint64_t seed;
    bool balanced; /* --routing balanced (default) | model */
    bool exact;    /* --exact-linears: FP8/FP4 linears in the CPU's k order (default: tensor cores) */
    bool eager;    /* --eager: no graph segments (default: decode steps replay CUDA graphs) */
    bool range;    /* --profiler-range: the CUDA profiler collects the timed decode steps and prefills only */
    enum moe_exchange moe_x; /* --moe-exchange auto|gather|owner: the experts' TP exchange form (model.h) */
    int standin;             /* --tp-standin: enum standin */
};

enum standin { STANDIN_ASYNC, STANDIN_SYNC, STANDIN_GRAPH };
static const char *const standin_names[] = {"async", "sync", "graph"};

static void usage(FILE *f) {
    fprintf(f,
            "usage: bench_step [--backend cpu|cuda] [--device N] [--preset PATH] [--tp 8] [--pp 2]\n"
            "                  [--layers N | --layers A-B] [--ctx 512] [--steps 8] [--batch 1,8,64,256]\n"
            "                  [--prefill 2048,8192] [--chunk 2048] [--engram-vocab 100000] [--seed 1]\n"
            "                  [--routing balanced|model] [--csv PATH] [--profile PATH] [--exact-linears]\n"
            "                  [--eager] [--profiler-range] [--moe-exchange auto|gather|owner]\n"
            "                  [--tp-standin async|sync|graph]\n"
            "  Times decode steps and prefill of TP rank 0 of pipeline stage 0 (the embedding stage) at the\n"
            "  preset's real dimensions, with synthetic weights, through model_forward_stage.\n"
            "  --layers N      run only the first N layers of the stage (A-B: stage layers A..B, counted\n"
            "                  from the stage's first layer); the smoke-test knob, real runs omit it\n"
            "  --batch LIST    decode batch sizes to time (empty string: none)\n"
            "  --prefill LIST  prompt lengths to time (one sequence each; empty string: none)\n"
            "  --chunk N       prefill chunk in tokens (0 = whole prompt; the context prefill then packs 2048)\n"
            "  --engram-vocab  start of the Engram prime search (sets the tables' rows; the release's is 16M)\n"
            "  --routing       balanced: each token's experts drawn uniformly (a trained router's balance; default);\n"
            "                  model: the synthetic router's own, skewed choice\n"
            "  --moe-exchange  the experts' TP exchange (auto: owner from 4 MiB gathered); the stand-in comm's\n"
            "                  copies are inside the step, the collectives' own time is not\n"
            "  --tp-standin    async: the stand-in's copies enqueued between graph segments (default); sync:\n"
            "                  the host also waits for the stream at each collective (the NCCL backend's\n"
            "                  blocking ops); graph: the collectives recorded inside the segments\n");
}

static long long parse_ll(const char *opt, const char *v, long long lo, long long hi) {
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi)
        ds_die("%s: '%s' is not an integer in [%lld, %lld]", opt, v, lo, hi);
    return x;
}

/* "1,8,64" into out[]; returns the count (an empty string gives 0). */
static int parse_list(const char *opt, const char *v, int64_t *out, long long lo, long long hi) {
    int n = 0;
    char buf[512];
    snprintf(buf, sizeof buf, "%s", v);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (n == MAX_LIST) ds_die("%s: more than %d entries", opt, MAX_LIST);
        out[n++] = parse_ll(opt, tok, lo, hi);
    }
    return n;
}

static void parse_args(int argc, char **argv, struct args *a) {
    *a = (struct args){.backend = "cpu", .preset = NULL, .tp = 8, .pp = 2, .layer_a = -1, .layer_b = -1,
                       .ctx = 512, .engram_vocab = 100000, .steps = 8, .chunk = 2048, .seed = 1, .balanced = true};
    int64_t tmp[MAX_LIST];
    a->n_batch = parse_list("--batch", "1,8,64,256", tmp, 1, 1 << 20);
    for (int i = 0; i < a->n_batch; i++) a->batch[i] = (int)tmp[i];
    a->n_prefill = parse_list("--prefill", "2048,8192", a->prefill, 1, 1 << 30);
    for (int i = 1; i < argc; i++) {
        const char *k = argv[i];
        if (!strcmp(k, "--help") || !strcmp(k, "-h")) {
            usage(stdout);
            exit(0);
        }
        if (!strcmp(k, "--exact-linears")) {
            a->exact = true;
            continue;
        }
        if (!strcmp(k, "--eager")) {
            a->eager = true;
            continue;
        }
        if (!strcmp(k, "--profiler-range")) { /* for tests/gpu/kernel_times.sh (Nsight Compute) */
            a->range = true;
            continue;
        }
        if (i + 1 >= argc) ds_die("%s: needs a value (see --help)", k);
        const char *v = argv[++i];
        if (!strcmp(k, "--backend")) a->backend = v;
        else if (!strcmp(k, "--moe-exchange")) a->moe_x = engine_moe_exchange_parse(v);
        else if (!strcmp(k, "--tp-standin")) {
            int f = -1;
            for (int j = 0; j < 3; j++)
                if (!strcmp(v, standin_names[j])) f = j;
            if (f < 0) ds_die("--tp-standin: async, sync or graph, not '%s'", v);
            a->standin = f;
        }
        else if (!strcmp(k, "--device")) a->device = (int)parse_ll(k, v, 0, 1023);
        else if (!strcmp(k, "--preset")) a->preset = v;
        else if (!strcmp(k, "--csv")) a->csv = v;
        else if (!strcmp(k, "--profile")) a->profile = v;
        else if (!strcmp(k, "--tp")) a->tp = (int)parse_ll(k, v, 1, 1024);
        else if (!strcmp(k, "--pp")) a->pp = (int)parse_ll(k, v, 2, TOPO_MAX_PP);
        else if (!strcmp(k, "--ctx")) a->ctx = parse_ll(k, v, 0, 1 << 24);
        else if (!strcmp(k, "--steps")) a->steps = (int)parse_ll(k, v, 1, 1 << 20);
        else if (!strcmp(k, "--chunk")) a->chunk = (int)parse_ll(k, v, 0, 1 << 24);
        else if (!strcmp(k, "--engram-vocab")) a->engram_vocab = parse_ll(k, v, 1, (long long)1 << 40);
        else if (!strcmp(k, "--seed")) a->seed = (uint64_t)parse_ll(k, v, 0, INT64_MAX);
        else if (!strcmp(k, "--routing")) {
            if (strcmp(v, "balanced") && strcmp(v, "model")) ds_die("--routing: balanced or model, not '%s'", v);
            a->balanced = !strcmp(v, "balanced");
        } else if (!strcmp(k, "--batch")) {
            a->n_batch = parse_list(k, v, tmp, 1, 1 << 20);
            for (int j = 0; j < a->n_batch; j++) a->batch[j] = (int)tmp[j];
        } else if (!strcmp(k, "--prefill")) {
            a->n_prefill = parse_list(k, v, a->prefill, 1, 1 << 30);
        } else if (!strcmp(k, "--layers")) {
            int x, y, n = 0;
            if (sscanf(v, "%d-%d%n", &x, &y, &n) == 2 && !v[n] && x >= 0 && y >= x) {
                a->layer_a = x, a->layer_b = y;
            } else {
                a->layer_a = 0;
                a->layer_b = (int)parse_ll(k, v, 1, CFG_MAX_LAYERS) - 1;
            }
        } else {
            ds_die("unknown option %s (see --help)", k);
        }
    }
    if (strcmp(a->backend, "cpu") && strcmp(a->backend, "cuda"))
        ds_die("--backend: cpu or cuda, not '%s'", a->backend);
    if (a->n_batch == 0 && a->n_prefill == 0) ds_die("--batch and --prefill are both empty: nothing to time");
}

/* The preset as given, else relative to the binary (build/bench/ -> ../../data/presets), so the
 * default works from the repository root and from anywhere else. */
static void find_preset(const char *given, char *out, size_t n) {
    const char *name = given ? given : "data/presets/v41-flash.json";
    snprintf(out, n, "%s", name);
    if (access(out, R_OK) == 0 || given) return;
    char exe[4096];
    ssize_t el = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (el <= 0) return;
    exe[el] = '\0';
    char *slash = strrchr(exe, '/');
    if (slash) *slash = '\0';
    snprintf(out, n, "%.3000s/../../%s", exe, name);
}

static int64_t i64min(int64_t a, int64_t b) { return a < b ? a : b; }

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rng_state;
static uint64_t rng_next(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Token ids drawn from this rank's embedding rows [0, V/tp), above the three fixed specials: the
 * embedding is vocab-split and a TP job sums every rank's rows (zeros from the others), which
 * the stand-in allreduce leaves as they are, so only this rank's ids give the rows a real job
 * would. The range also stays clear of the image and chat tokens at the top of the vocabulary. */
static int64_t g_vocab_rows;
static int32_t rand_token(const struct model_config *c) {
    int64_t lo = 3, hi = g_vocab_rows > lo + 1 ? g_vocab_rows : c->vocab_size;
    return (int32_t)(lo + (int64_t)(rng_next() % (uint64_t)(hi - lo)));
}

/* ------------------------------------------------------------------------------------------------
 * The TP stand-in: a communicator of the TP size whose collectives move data locally, so the
 * model's buffers have the shapes of a TP job; the time of real collectives is excluded. */

static uint64_t g_comm_bytes; /* bytes the stand-in copied (device copies, inside the step times) */
static bool g_standin_sync;   /* --tp-standin sync */

static void lc_allgather(struct comm *c, const void *send, void *recv, size_t bytes, const char *what) {
    struct backend *be = c->priv;
    /* one call, as a real collective is one call */
    struct copy_seg *segs = ds_malloc(sizeof *segs * (size_t)c->size);
    for (int r = 0; r < c->size; r++) segs[r] = (struct copy_seg){(uint8_t *)recv + (size_t)r * bytes, send, bytes};
    be->ops->copy_segs(be, segs, c->size);
    free(segs);
    if (g_standin_sync) be->ops->sync(be); /* as comm_nccl.c's op_wait: the op returns once the stream is done */
    g_comm_bytes += (uint64_t)bytes * (uint64_t)c->size;
}
/* As if every rank held this rank's slots: the same bytes as a real all-to-all moves. */
static void lc_alltoall(struct comm *c, const void *send, void *recv, size_t bytes, const char *what) {
    lc_allgather(c, send, recv, bytes, what);
}
/* Sums of row-split tables where the other ranks contribute zeros: leaving the buffer is the
 * rank-0 share of the exact result. */
static void lc_allreduce(struct comm *c, void *buf, size_t count, enum comm_dtype dt, const char *what) {}
static void lc_bcast(struct comm *c, void *buf, size_t bytes, int root, const char *what) {}
static void lc_p2p(struct comm *c, void *buf, size_t bytes, int peer, int tag, const char *what) {
    ds_die("bench: the TP stand-in got a point-to-point transfer (%s): a stage's forward never sends", what);
}
static void lc_send(struct comm *c, const void *buf, size_t bytes, int dst, int tag, const char *what) {
    lc_p2p(c, (void *)buf, bytes, dst, tag, what);
}
static void lc_barrier(struct comm *c, const char *what) {}
static struct comm_req *lc_isend(struct comm *c, const void *buf, size_t bytes, int dst, int tag, const char *what) {
    lc_p2p(c, (void *)buf, bytes, dst, tag, what);
    return NULL;
}
static void lc_wait(struct comm *c, struct comm_req *r) {}
static void lc_free(struct comm *c) {}

static const struct comm_ops local_comm_ops = {.name = "local-standin", .allgather = lc_allgather,
                                               .alltoall = lc_alltoall,
                                               .allreduce_sum = lc_allreduce, .bcast = lc_bcast,
                                               .send = lc_send, .recv = lc_p2p, .barrier = lc_barrier,
                                               .isend = lc_isend, .wait = lc_wait, .free = lc_free};

/* ------------------------------------------------------------------------------------------------
 * Routing. Synthetic weights route badly: the tokens' hidden states are strongly correlated and
 * the random router bias is as large as the score spread, so a batch of 64 picks ~9 of this
 * rank's 48 experts (measured) where a trained, load-balanced router picks ~30, and the MoE would
 * read a fraction of the weights it reads in a real run. So by default (--routing balanced) the router's selection is
 * replaced by a plan drawn uniformly at random (each token: k distinct experts of all E), as
 * balanced as a trained router: the backend's router op is wrapped (the op table is swapped, the
 * model code untouched), the real router still runs (its time counts), then one device copy puts
 * the planned ids over its output. The plans are uploaded before the clock starts. --routing
 * model keeps the router's own choice; its experts are then counted on the untimed warm-up
 * forward by downloading the selections. */

static const struct backend_ops *g_real_ops;
static struct backend_ops g_wrap_ops;
static int64_t g_e0, g_nlocal;     /* this rank's experts */
static const int32_t *g_plan;      /* backend pointer: planned ids of the forwards to come, or NULL */
static int64_t g_plan_pos;         /* next entry of g_plan */
static int64_t g_plan_len;         /* entries of g_plan */
static bool g_count;               /* count the router's own selections */
static int64_t g_router_calls, g_distinct_sum;

static int64_t distinct_local(const int32_t *ids, size_t n, uint8_t *seen) {
    memset(seen, 0, (size_t)g_nlocal);
    int64_t d = 0;
    for (size_t i = 0; i < n; i++) {
        int64_t e = (int64_t)ids[i] - g_e0;
        if (e >= 0 && e < g_nlocal && !seen[e]) seen[e] = 1, d++;
    }
    return d;
}

static void wrap_router(struct backend *be, int32_t *idx, float *wts, const bf16_t *x, int64_t T,
                        const struct qweight *gate, const float *bias, int64_t k, float temp, bool norm,
                        float route_scale) {
    g_real_ops->router(be, idx, wts, x, T, gate, bias, k, temp, norm, route_scale);
    size_t n = (size_t)(T * k);
    if (g_plan) {
        if (g_plan_pos + (int64_t)n > g_plan_len)
            ds_die("bench_step: more routed forwards than the routing plan holds (%lld entries)", (long long)g_plan_len);
        g_real_ops->copy(be, idx, g_plan + g_plan_pos, n * sizeof(int32_t));
        g_plan_pos += (int64_t)n;
    }
    if (g_count) {
        int32_t *h = ds_malloc(n * sizeof *h);
        uint8_t *seen = ds_malloc((size_t)g_nlocal);
        g_real_ops->download(be, h, idx, n * sizeof *h);
        g_distinct_sum += distinct_local(h, n, seen);
        g_router_calls++;
        free(seen);
        free(h);
    }
}

/* Route the next forwards by `plan` (backend pointer, NULL: the router's own choice), counting the
 * router's selections when asked; with neither the backend's own table runs, untouched. */
static void routing(struct backend *be, const int32_t *plan, bool count) {
    g_plan = plan;
    g_plan_pos = 0;
    g_count = count;
    g_router_calls = g_distinct_sum = 0;
    /* counting downloads the router's output: no graph segment nor branch may hold it (the
     * counted forwards run their branches' ops in issue order) */
    g_wrap_ops.graph_begin = count ? NULL : g_real_ops->graph_begin;
    g_wrap_ops.graph_end = count ? NULL : g_real_ops->graph_end;
    g_wrap_ops.branch_begin = count ? NULL : g_real_ops->branch_begin;
    g_wrap_ops.branch_end = count ? NULL : g_real_ops->branch_end;
    g_wrap_ops.branch_join = count ? NULL : g_real_ops->branch_join;
    be->ops = plan || count ? &g_wrap_ops : g_real_ops;
}

/* A balanced plan for `nf` forwards of rows[f] tokens each over `layers` layers: per token k
 * distinct experts uniform over E, in forward, layer, token order (the order the router is called
 * in). Uploaded to the backend; *distinct gets, per forward, the sum over layers of the distinct
 * local experts the plan selects. */
static int32_t *make_plan(struct backend *be, const int64_t *rows, int nf, int layers, int64_t k, int64_t E,
                          int64_t *distinct) {
    int64_t total = 0;
    for (int f = 0; f < nf; f++) total += rows[f] * layers * k;
    int32_t *h = ds_malloc(sizeof(int32_t) * (size_t)total);
    uint8_t *seen = ds_malloc((size_t)(g_nlocal > E ? g_nlocal : E));
    int64_t at = 0;
    for (int f = 0; f < nf; f++) {
        distinct[f] = 0;
        for (int l = 0; l < layers; l++) {
            int32_t *blk = h + at;
            for (int64_t t = 0; t < rows[f]; t++) {
                memset(seen, 0, (size_t)E);
                for (int64_t j = 0; j < k; j++) {
                    int64_t e;
                    do e = (int64_t)(rng_next() % (uint64_t)E);
                    while (seen[e]);
                    seen[e] = 1;
                    h[at++] = (int32_t)e;
                }
            }
            distinct[f] += distinct_local(blk, (size_t)(rows[f] * k), seen);
        }
    }
    g_plan_len = total; /* one plan is live at a time: the router wrapper checks its reads against it */
    int32_t *d = be->ops->alloc(be, sizeof(int32_t) * (size_t)total);
    be->ops->upload(be, d, h, sizeof(int32_t) * (size_t)total);
    be->ops->sync(be);
    free(seen);
    free(h);
    return d;
}

/* ------------------------------------------------------------------------------------------------
 * Weight bytes */

static uint64_t cdiv64(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

/* Bytes an op reads of a weight as bound (a TP slice counts its own rows/columns). */
static uint64_t qbytes(const struct qweight *q) {
    uint64_t n = (uint64_t)q->n, k = (uint64_t)q->k;
    switch (q->fmt) {
    case WF_FP8: return n * k + cdiv64(n, 32) * cdiv64(k, 32);
    case WF_FP4: return n * (k / 2) + n * (k / 32);
    case WF_BF16: return n * k * 2;
    case WF_F32: return n * k * 4;
    }
    return 0;
}

/* Every weight of layer l a forward reads once, whatever its row count; routed experts apart. */
static uint64_t layer_dense_bytes(const struct model_config *c, const struct layer_weights *lw, int l) {
    const struct layer_role *r = &c->role[l];
    const struct attn_weights *a = &lw->attn;
    const struct ffn_weights *f = &lw->ffn;
    uint64_t D = (uint64_t)c->dim, hd = (uint64_t)c->head_dim, hc = (uint64_t)c->hc_mult, mix = (2 + hc) * hc;
    uint64_t b = qbytes(&a->wq_a) + qbytes(&a->wq_b) + qbytes(&a->wkv) + qbytes(&a->wo_b);
    b += (uint64_t)a->wo_a.n * (uint64_t)a->wo_a.k * 2; /* read as the bf16 copy weight_prepare makes */
    b += (uint64_t)c->q_lora_rank * 2 + hd * 2 + (uint64_t)(a->wq_b.n / c->head_dim) * 4;
    if (r->owns_compressor) b += qbytes(&a->cmp_wkv) + (r->ratio > 1 ? qbytes(&a->cmp_wgate) : 0) + hd * 2;
    if (r->is_index_source) {
        b += qbytes(&a->idx_wq_b) + qbytes(&a->idx_weights_proj);
        if (r->owns_index_keys) b += qbytes(&a->idx_wk) + (uint64_t)c->index_head_dim * 2;
    }
    b += qbytes(&f->gate) + (uint64_t)f->n_experts * 4 + qbytes(&f->sh_w1) + qbytes(&f->sh_w3) + qbytes(&f->sh_w2);
    b += 2 * D * 2;                             /* attn_norm, ffn_norm */
    b += 2 * (mix * hc * D * 4 + mix * 4 + 3 * 4); /* hc fn, base, scale for attention and FFN */
    if (lw->has_engram) b += qbytes(&lw->engram.wkv) + hc * D * 4; /* projection + q·k weight */
    return b;
}

/* Multiply-adds per token of layer l's linears, routed experts apart: every projection a token row
 * goes through (attention, compressor, indexer queries, router gate, shared expert, the mHC mixes'
 * dot products, the Engram projection), the index keys per emitted latent (1 / ratio of the rows).
 * Attention's scores and P·V over the selected rows are not counted. */
static uint64_t qmacs(const struct qweight *q) { return (uint64_t)q->n * (uint64_t)q->k; }

static uint64_t layer_dense_macs(const struct model_config *c, const struct layer_weights *lw, int l) {
    const struct layer_role *r = &c->role[l];
    const struct attn_weights *a = &lw->attn;
    const struct ffn_weights *f = &lw->ffn;
    uint64_t hc = (uint64_t)c->hc_mult, mix = (2 + hc) * hc;
    uint64_t m = qmacs(&a->wq_a) + qmacs(&a->wq_b) + qmacs(&a->wkv) + qmacs(&a->wo_a) + qmacs(&a->wo_b);
    if (r->owns_compressor) m += qmacs(&a->cmp_wkv) + (r->ratio > 1 ? qmacs(&a->cmp_wgate) : 0);
    if (r->is_index_source) {
        m += qmacs(&a->idx_wq_b) + qmacs(&a->idx_weights_proj);
        if (r->owns_index_keys) m += qmacs(&a->idx_wk) / (uint64_t)(r->ratio > 0 ? r->ratio : 1);
    }
    m += qmacs(&f->gate) + qmacs(&f->sh_w1) + qmacs(&f->sh_w3) + qmacs(&f->sh_w2);
    m += 2 * mix * hc * (uint64_t)c->dim;
    if (lw->has_engram) m += qmacs(&lw->engram.wkv);
    return m;
}

/* Per token: its embedding row and, per Engram layer, its hashed table rows with their scales. */
static uint64_t token_bytes(const struct model_config *c, int n_engram_layers) {
    uint64_t ehd = (uint64_t)c->engram_head_dim, C = (uint64_t)(c->engram_max_ngram - 1) * c->engram_n_heads;
    return (uint64_t)c->dim * 2 + (uint64_t)n_engram_layers * C * (ehd + ehd / 32);
}

/* ------------------------------------------------------------------------------------------------ */

struct bench {
    const struct model_config *cfg;
    struct model *m;
    struct backend *be;
    bf16_t *X_out; /* host stream hand-off buffers of the largest forward (this stage is not last) */
    float *P_out;
    uint64_t dense_bytes, expert_bytes, tok_bytes;
    uint64_t dense_macs, expert_macs; /* per token; per (token, expert) pair */
    int n_layers_run;
};

static void forward(struct bench *B, const struct fwd_seq *seqs, int n) {
    struct stage_io io = {.X_out = B->X_out, .P_out = B->P_out};
    if (model_forward_stage(B->m, seqs, n, &io, NULL, NULL)) ds_die_err();
}

/* Prefill slots [0, S) to ctx tokens each, packing sequences into forwards of up to `chunk` tokens. */
static void prefill_context(struct bench *B, int S, int64_t ctx, int64_t chunk) {
    struct fwd_seq *seqs = ds_calloc((size_t)S, sizeof *seqs);
    int32_t *tok = ds_malloc(sizeof(int32_t) * (size_t)chunk);
    int slot = 0;
    while (slot < S) {
        int n = 0;
        int64_t used = 0;
        while (slot < S && used < chunk) {
            int64_t have = model_slot_len(B->m, slot), len = ctx - have < chunk - used ? ctx - have : chunk - used;
            for (int64_t t = 0; t < len; t++) tok[used + t] = rand_token(B->cfg);
            seqs[n++] = (struct fwd_seq){.slot = slot, .start = have, .len = len, .tokens = tok + used};
            used += len;
            if (have + len == ctx) slot++;
        }
        forward(B, seqs, n);
    }
    B->be->ops->sync(B->be);
    free(tok);
    free(seqs);
}

/* One decode step of slots [0, batch). */
static void decode_step(struct bench *B, int batch, int32_t *tok, struct fwd_seq *seqs) {
    for (int i = 0; i < batch; i++) {
        tok[i] = rand_token(B->cfg);
        seqs[i] = (struct fwd_seq){.slot = i, .start = model_slot_len(B->m, i), .len = 1, .tokens = tok + i};
    }
    forward(B, seqs, batch);
}

/* One sequence of n tokens in slot 0 from empty, in chunks of `chunk`. */
static void prefill_one(struct bench *B, int64_t n, int64_t chunk, const int32_t *tok) {
    model_reset_slot(B->m, 0);
    for (int64_t at = 0; at < n; at += chunk) {
        struct fwd_seq s = {.slot = 0, .start = at, .len = n - at < chunk ? n - at : chunk, .tokens = tok + at};
        forward(B, &s, 1);
    }
}

/* The profiler of --profile: on the GPU each op's device time between two stream marks (nothing
 * synchronized, so the split is that of the step as it runs eagerly); on the CPU, where ops run
 * inline, its host time. */
#ifdef DS_HAVE_CUDA
static int clk_mark(void *ctx) { return backend_cuda_mark(ctx); }
static double clk_ms(void *ctx, int a, int b) { return backend_cuda_mark_ms(ctx, a, b); }
static void clk_reset(void *ctx) { backend_cuda_marks_reset(ctx); }
#endif
/* --profiler-range: the CUDA profiler collects only what lies between on and off (the timed steps
 * and prefills). */
static void profiler_range(const struct args *a, struct backend *be, bool on) {
#ifdef DS_HAVE_CUDA
    if (a->range && !strcmp(a->backend, "cuda")) backend_cuda_profiler_range(be, on);
#else
    (void)a, (void)be, (void)on;
#endif
}

static void profiler_init(struct backend *be, struct backend *inner, const char *backend) {
#ifdef DS_HAVE_CUDA
    if (!strcmp(backend, "cuda")) {
        const struct prof_clock clk = {inner, clk_mark, clk_ms, clk_reset};
        prof_backend_init_device(be, inner, &clk);
        return;
    }
#endif
    prof_backend_init(be, inner);
}

struct row {
    const char *kind;
    int64_t n, ctx;
    double ms;
    uint64_t bytes;
    double flops; /* 2 x the multiply-adds of the linears and routed experts (layer_dense_macs) */
};

/* FLOPs of `tokens` token rows: their linears, and the routed pairs on this rank (the plan's k
 * per token spread uniformly: n_local of the E experts are here). */
static double row_flops(const struct bench *B, int64_t tokens, int64_t k, int64_t E) {
    double pairs = (double)tokens * (double)k * (double)g_nlocal / (double)E;
    return 2.0 * ((double)tokens * (double)B->dense_macs + pairs * (double)B->expert_macs);
}

/* The CSV's backend column: the backend and the switches that change its code path. */
static const char *run_label(const struct args *a) {
    static char buf[64];
    static const char *const moe[] = {"", "-moe-gather", "-moe-owner"};
    static const char *const st[] = {"", "-tp-sync", "-tp-graph"};
    snprintf(buf, sizeof buf, "%s%s%s%s%s", a->backend, a->exact ? "-exact-linears" : "",
             a->eager && !strcmp(a->backend, "cuda") ? "-eager" : "", moe[a->moe_x], st[a->standin]);
    return buf;
}

static void emit(FILE *csv, const struct row *r, const char *backend) {
    double gbps = r->ms > 0 ? (double)r->bytes / (r->ms * 1e-3) / 1e9 : 0;
    if (csv) {
        fprintf(csv, "%s,%lld,%lld,%.4f,%llu,%.2f,%s,%.4e\n", r->kind, (long long)r->n, (long long)r->ctx, r->ms,
                (unsigned long long)r->bytes, gbps, backend, r->flops);
        fflush(csv);
    }
}

int main(int argc, char **argv) {
    struct args a;
    parse_args(argc, argv, &a);
    rng_state = a.seed * 0x2545f4914f6cdd1dull + 1;

    /* ---- config: the real one, Engram tables shrunk in memory ---- */
    char preset[4200];
    find_preset(a.preset, preset, sizeof preset);
    struct model_config cfg;
    if (config_load(preset, &cfg)) ds_die_err();
    int64_t release_rows[CFG_MAX_LIST];
    for (int i = 0; i < cfg.n_engram; i++) release_rows[i] = cfg.engram_num_embeddings[i];
    if (synth_shrink_engram(&cfg, a.engram_vocab)) ds_die_err();
    if (topo_check_tp(&cfg, a.tp)) ds_die_err();
    int sb[TOPO_MAX_PP], se[TOPO_MAX_PP];
    if (topo_stage_split(&cfg, a.pp, NULL, sb, se)) ds_die_err();
    /* as dist.c: stage 0 scores stale index keys (MODEL.md 3.12) only for its own layers */
    for (int l = se[0]; l < cfg.n_layers; l++)
        if (cfg.role[l].is_index_source && cfg.role[l].ratio > 1)
            ds_die("layer %d scores stale index keys but is not on stage 0 of this split", l);
    int lb = sb[0], le = se[0];
    if (a.layer_a >= 0) {
        if (sb[0] + a.layer_b >= se[0])
            ds_die("--layers: the stage has %d layers (%d-%d)", se[0] - sb[0], sb[0], se[0] - 1);
        lb = sb[0] + a.layer_a, le = sb[0] + a.layer_b + 1;
        /* a sub-range must hold the compressed KV and top-k sources its layers read */
        for (int l = lb; l < le; l++)
            if ((cfg.role[l].kv_src >= 0 && cfg.role[l].kv_src < lb) ||
                (cfg.role[l].topk_src >= 0 && cfg.role[l].topk_src < lb))
                ds_die("--layers: layer %d reads layer %d's cache, which the range %d-%d leaves out", l,
                       cfg.role[l].kv_src < lb ? cfg.role[l].kv_src : cfg.role[l].topk_src, lb, le - 1);
    }

    /* ---- checkpoint in memory, bound as rank 0 of stage 0 ---- */
    double t0 = now_s();
    struct synth_inventory inv = {0};
    synth_inventory_build(&inv, &cfg);
    struct st_model st;
    struct synth_pools pools;
    if (synth_st_model(&st, &inv, &pools, a.seed, "synthetic-v41-flash")) ds_die_err();
    uint64_t pool_bytes = 0;
    for (int d = 0; d < ST_NDTYPES; d++) pool_bytes += pools.size[d];
    struct bind_opts bo = {.tp_rank = 0, .tp_size = a.tp, .layer_begin = lb, .layer_end = le, .first_stage = true,
                           .last_stage = false};
    struct model_weights mw;
    if (weights_bind(&mw, &cfg, &st, &bo)) ds_die_err();
    double t_bind = now_s() - t0;
    /* Engram rows as the node's Engram service serves them in a multi-rank job (dist.c): the
     * whole table, so the gather needs no TP sum */
    int n_engram_run = 0;
    for (int l = lb; l < le; l++) {
        struct layer_weights *lw = &mw.layers[l];
        if (!lw->has_engram) continue;
        char name[128];
        snprintf(name, sizeof name, "layers.%d.engram.embed.weight", l);
        lw->engram.table = st_find(&st, name)->data;
        snprintf(name, sizeof name, "layers.%d.engram.embed.scale", l);
        lw->engram.scale = st_find(&st, name)->data;
        lw->engram.row0 = 0;
        lw->engram.rows_local = lw->engram.rows;
        n_engram_run++;
    }
    struct engram_consts ec;
    if (engram_consts_init(&ec, &cfg)) ds_die_err();
    if (cfg.n_engram > 0) {
        /* a synthetic map with exactly engram_compressed_vocab_size classes, as mkmodel's sidecar */
        int32_t *map = ds_malloc(sizeof(int32_t) * (size_t)cfg.vocab_size);
        for (int t = 0; t < cfg.vocab_size; t++) map[t] = (int32_t)(t % cfg.engram_compressed_vocab);
        if (engram_set_token_map(&ec, &cfg, map, cfg.vocab_size)) ds_die_err();
        free(map);
    }

    /* ---- what a forward reads ---- */
    struct bench B = {.cfg = &cfg};
    for (int l = lb; l < le; l++) B.dense_bytes += layer_dense_bytes(&cfg, &mw.layers[l], l);
    for (int l = lb; l < le; l++) B.dense_macs += layer_dense_macs(&cfg, &mw.layers[l], l);
    const struct ffn_weights *f0 = &mw.layers[lb].ffn;
    B.expert_bytes = qbytes(&f0->w1[0]) + qbytes(&f0->w3[0]) + qbytes(&f0->w2[0]);
    B.expert_macs = qmacs(&f0->w1[0]) + qmacs(&f0->w3[0]) + qmacs(&f0->w2[0]);
    B.tok_bytes = token_bytes(&cfg, n_engram_run);
    B.n_layers_run = le - lb;
    g_e0 = f0->e0, g_nlocal = f0->n_local;
    g_vocab_rows = mw.vocab_rows;

    /* ---- backend, engine ---- */
    struct backend be;
    const struct engine_flags ef = {.backend = strcmp(a.backend, "cuda") ? ENGINE_BACKEND_CPU : ENGINE_BACKEND_CUDA,
                                    .exact_linears = a.exact};
    engine_backend_init(&be, &ef, a.device);
    g_real_ops = be.ops;
    g_wrap_ops = *be.ops;
    g_wrap_ops.router = wrap_router;
    struct comm tp = {.ops = &local_comm_ops, .rank = 0, .size = a.tp, .priv = &be,
                      .stream_ordered = a.standin == STANDIN_GRAPH};
    g_standin_sync = a.standin == STANDIN_SYNC;
    int max_batch = 1;
    for (int i = 0; i < a.n_batch; i++) max_batch = a.batch[i] > max_batch ? a.batch[i] : max_batch;
    int64_t ctx_chunk = a.chunk > 0 ? a.chunk : 2048, max_pre = 0;
    int64_t T_max = max_batch > ctx_chunk ? max_batch : ctx_chunk;
    for (int i = 0; i < a.n_prefill; i++) {
        int64_t c = a.chunk > 0 && a.chunk < a.prefill[i] ? a.chunk : a.prefill[i];
        if (a.prefill[i] > max_pre) max_pre = a.prefill[i];
        if (c > T_max) T_max = c;
    }
    struct engine_opts eo = engine_opts_default(&cfg);
    eo.max_seqs = max_batch;
    /* every decode run adds its warm-up and timed steps to slots 0..B-1 */
    eo.max_seq_len = a.ctx + (int64_t)a.n_batch * ((a.profile ? 3 : 1) * a.steps + 1);
    if (max_pre > eo.max_seq_len) eo.max_seq_len = max_pre;
    eo.tp = a.tp > 1 ? &tp : NULL;
    eo.graphs = !a.eager;
    eo.moe_exchange = a.moe_x;
    t0 = now_s();
    B.m = model_new(&cfg, &mw, &be, &ec, &eo);
    be.ops->sync(&be);
    double t_new = now_s() - t0;
    B.be = &be;
    /* page-locked where the backend has it, as the engine's pipeline hand-off (dist.c, struct mb) */
    B.X_out = engine_host_alloc(&be, (size_t)(T_max * cfg.hc_mult * cfg.dim) * sizeof(bf16_t));
    B.P_out = engine_host_alloc(&be, (size_t)(T_max * cfg.hc_mult) * sizeof(float));

    printf("# bench_step: %s, TP%d x PP%d rank 0 (tp_rank 0, stage 0: layers %d-%d, embedding, no head), "
           "backend %s\n",
           preset, a.tp, a.pp, sb[0], se[0] - 1, a.backend);
    if (lb != sb[0] || le != se[0])
        printf("# --layers: running stage layers %d-%d only (%d of %d)\n", lb, le - 1, le - lb, se[0] - sb[0]);
    for (int i = 0; i < cfg.n_engram; i++)
        printf("# Engram table of layer %d: %lld rows instead of the release's %lld (engram_vocab_size overridden to "
               "%lld in memory; same bytes per lookup)\n",
               cfg.engram_layer_ids[i], (long long)cfg.engram_num_embeddings[i], (long long)release_rows[i],
               (long long)a.engram_vocab);
    printf("# checkpoint: %d tensors, %.1f GB as listed, in-memory pools %.2f GB; bound in %.1f s; this rank maps "
           "%.2f GB (%.2f GB routed experts); model_new %.1f s\n",
           inv.n, (double)inv.total / 1e9, (double)pool_bytes / 1e9, t_bind, (double)mw.bytes_total / 1e9,
           (double)mw.bytes_experts / 1e9, t_new);
    printf("# per forward: dense weights %.1f MB over %d layers; one routed expert %.2f MB (%lld local experts "
           "%lld-%lld of %d, top-%d); per token %.1f KB (embedding + Engram rows)\n",
           (double)B.dense_bytes / 1e6, B.n_layers_run, (double)B.expert_bytes / 1e6, (long long)g_nlocal,
           (long long)g_e0, (long long)(g_e0 + g_nlocal - 1), f0->n_experts, cfg.n_active_experts,
           (double)B.tok_bytes / 1e3);
    if (a.balanced)
        printf("# routing: balanced plan (each token: %d distinct experts uniform over %d, copied over the router's "
               "output after it runs); bytes = dense + per layer (distinct local experts the plan selects) x expert "
               "+ tokens x per-token; KV caches not counted\n",
               cfg.n_active_experts, f0->n_experts);
    else
        printf("# routing: the synthetic router's own choice (skewed: see --routing); bytes = dense + per layer "
               "(distinct local experts it selected on the untimed warm-up forward) x expert + tokens x per-token; "
               "KV caches not counted\n");
    printf("# TP comm: local stand-in of size %d (allgather = device copies of this rank's block, allreduce = "
           "no-op): collective time excluded; --tp-standin %s\n",
           a.tp, standin_names[a.standin]);

    FILE *csv = NULL;
    if (a.csv) {
        csv = fopen(a.csv, "w");
        if (!csv) ds_die("%s: cannot create: %s", a.csv, ds_errno_str());
        fprintf(csv, "kind,batch_or_tokens,ctx,ms,bytes,gbps,backend,flops\n");
    }

    /* ---- context ---- */
    t0 = now_s();
    if (a.ctx > 0) prefill_context(&B, max_batch, a.ctx, ctx_chunk);
    double t_ctx = now_s() - t0;
    if (a.ctx > 0)
        printf("# context: %d sequences x %lld tokens prefilled in %.2f s (%.0f tokens/s, chunks of %lld tokens)\n",
               max_batch, (long long)a.ctx, t_ctx, (double)max_batch * (double)a.ctx / t_ctx, (long long)ctx_chunk);

    /* ---- decode ---- */
    printf("%-8s %8s %6s %10s %10s %11s %8s %16s %14s %10s\n", "kind", "batch", "ctx", "ms/step", "min ms",
           "weight MB", "GB/s", "experts/layer", "(uniform est.)", "comm MB");
    int32_t *tok = ds_malloc(sizeof(int32_t) * (size_t)(max_batch > max_pre ? max_batch : max_pre));
    struct fwd_seq *seqs = ds_calloc((size_t)max_batch, sizeof *seqs);
    /* with --profile every batch runs its timed steps three times: plain, then through the
     * profiler twice (device time per op, host time per op) */
    int n_fwd = (a.profile ? 3 : 1) * a.steps + 1; /* warm-up, timed, and the two profiled passes */
    int64_t *rows = ds_malloc(sizeof(int64_t) * (size_t)n_fwd);
    int64_t *dist = ds_malloc(sizeof(int64_t) * (size_t)n_fwd);
    FILE *prof = NULL;
    if (a.profile) {
        prof = fopen(a.profile, "w");
        if (!prof) ds_die("%s: cannot create: %s", a.profile, ds_errno_str());
        fprintf(prof, "run,op,calls_per_step,ms_per_step,share_of_op_time_pct\n");
    }
    const int64_t k_act = cfg.n_active_experts, E = f0->n_experts;
    for (int bi = 0; bi < a.n_batch; bi++) {
        int bs = a.batch[bi];
        /* untimed warm-up step, then the timed ones: one plan for all, uploaded before the clock */
        int32_t *plan = NULL;
        double distinct;
        g_comm_bytes = 0; /* a step's, from the warm-up: a replayed segment's copies do not come by the host */
        if (a.balanced) {
            for (int s = 0; s < n_fwd; s++) rows[s] = bs;
            plan = make_plan(&be, rows, n_fwd, B.n_layers_run, k_act, E, dist);
            int64_t sum = 0;
            for (int s = 1; s <= a.steps; s++) sum += dist[s];
            distinct = (double)sum / a.steps / B.n_layers_run;
            routing(&be, plan, false);
            decode_step(&B, bs, tok, seqs);
            be.ops->sync(&be);
        } else {
            routing(&be, NULL, true);
            decode_step(&B, bs, tok, seqs);
            be.ops->sync(&be);
            distinct = g_router_calls ? (double)g_distinct_sum / (double)g_router_calls : 0;
            routing(&be, NULL, false);
        }
        const uint64_t comm_step = g_comm_bytes;
        uint64_t expert_read = (uint64_t)llround(distinct * B.n_layers_run * (double)B.expert_bytes);
        double ctx_mean = 0;
        for (int i = 0; i < bs; i++) ctx_mean += (double)model_slot_len(B.m, i);
        ctx_mean /= bs;
        double best = 1e30, total = 0;
        profiler_range(&a, &be, true);
        for (int s = 0; s < a.steps; s++) {
            double ts = now_s();
            decode_step(&B, bs, tok, seqs);
            be.ops->sync(&be);
            double dt = now_s() - ts;
            total += dt;
            if (dt < best) best = dt;
        }
        profiler_range(&a, &be, false);
        double ms = 1e3 * total / a.steps;
        if (prof) {
            /* the same steps again, eager, each op timed on the device (profiler_init): the split of
             * the step; the plain step minus the ops' sum is device time between ops */
            struct backend inner = be;
            profiler_init(&be, &inner, a.backend);
            for (int s = 0; s < a.steps; s++) decode_step(&B, bs, tok, seqs);
            be.ops->sync(&be);
            char label[32];
            snprintf(label, sizeof label, "decode_b%d", bs);
            double op_ms = 1e3 * prof_backend_report(&be, prof, label, a.steps);
            fprintf(prof, "%s,_ops_total,0,%.3f,100\n%s,_step_plain,0,%.3f,0\n", label, op_ms, label, ms);
            fflush(prof);
            prof_backend_free(&be);
            /* and once more unsynchronized: the host time inside the ops (launches, host work);
             * a step whose plain time is near this plus the model's own host code is launch bound */
            prof_backend_init_host(&be, &inner);
            double th = now_s();
            for (int s = 0; s < a.steps; s++) decode_step(&B, bs, tok, seqs);
            be.ops->sync(&be);
            double wall_ms = 1e3 * (now_s() - th) / a.steps;
            snprintf(label, sizeof label, "decode_b%d_host", bs);
            double host_ms = 1e3 * prof_backend_report(&be, prof, label, a.steps);
            fprintf(prof, "%s,_ops_total,0,%.3f,100\n%s,_step_plain,0,%.3f,0\n", label, host_ms, label, wall_ms);
            fflush(prof);
            prof_backend_free(&be);
            be = inner;
        }
        routing(&be, NULL, false);
        if (plan) be.ops->free(&be, plan);
        double uniform = (double)g_nlocal * (1.0 - pow(1.0 - (double)k_act / (double)E, bs));
        struct row r = {"decode", bs, (int64_t)llround(ctx_mean), ms,
                        B.dense_bytes + expert_read + (uint64_t)bs * B.tok_bytes, row_flops(&B, bs, k_act, E)};
        printf("%-8s %8d %6lld %10.3f %10.3f %11.1f %8.1f %16.2f %14.2f %10.2f\n", r.kind, bs, (long long)r.ctx, ms,
               1e3 * best, (double)r.bytes / 1e6, (double)r.bytes / (ms * 1e-3) / 1e9, distinct, uniform,
               (double)comm_step / 1e6);
        emit(csv, &r, run_label(&a));
    }

    /* ---- prefill ---- */
    for (int pi = 0; pi < a.n_prefill; pi++) {
        int64_t n = a.prefill[pi], chunk = a.chunk > 0 && a.chunk < n ? a.chunk : n;
        for (int64_t t = 0; t < n; t++) tok[t] = rand_token(&cfg);
        /* untimed warm-up run, then the same prompt timed; a balanced plan serves both */
        int forwards = (int)((n + chunk - 1) / chunk);
        int32_t *plan = NULL;
        int64_t dsum = 0;
        g_comm_bytes = 0; /* the warm-up run's (the timed one moves the same) */
        if (a.balanced) {
            int64_t *prow = ds_malloc(sizeof(int64_t) * (size_t)forwards);
            int64_t *pd = ds_malloc(sizeof(int64_t) * (size_t)forwards);
            for (int f = 0; f < forwards; f++) prow[f] = i64min(n - (int64_t)f * chunk, chunk);
            plan = make_plan(&be, prow, forwards, B.n_layers_run, k_act, E, pd);
            for (int f = 0; f < forwards; f++) dsum += pd[f];
            free(prow), free(pd);
            routing(&be, plan, false);
            prefill_one(&B, n, chunk, tok);
        } else {
            routing(&be, NULL, true);
            prefill_one(&B, n, chunk, tok);
            dsum = g_distinct_sum;
        }
        be.ops->sync(&be);
        uint64_t expert_read = (uint64_t)dsum * B.expert_bytes;
        double distinct = (double)dsum / forwards / B.n_layers_run;
        routing(&be, plan, false);
        const double comm_mb = (double)g_comm_bytes / 1e6;
        profiler_range(&a, &be, true);
        double ts = now_s();
        prefill_one(&B, n, chunk, tok);
        be.ops->sync(&be);
        double ms = 1e3 * (now_s() - ts);
        profiler_range(&a, &be, false);
        if (prof) { /* the same prompt again through the profiler: where a prefill's time goes */
            if (plan) routing(&be, plan, false); /* the plan from its start again */
            struct backend inner = be;
            profiler_init(&be, &inner, a.backend);
            prefill_one(&B, n, chunk, tok);
            be.ops->sync(&be);
            char label[32];
            snprintf(label, sizeof label, "prefill_%lld", (long long)n);
            double op_ms = 1e3 * prof_backend_report(&be, prof, label, 1);
            fprintf(prof, "%s,_ops_total,0,%.3f,100\n%s,_step_plain,0,%.3f,0\n", label, op_ms, label, ms);
            fflush(prof);
            prof_backend_free(&be);
            be = inner;
        }
        routing(&be, NULL, false);
        if (plan) be.ops->free(&be, plan);
        struct row r = {"prefill", n, 0, ms,
                        (uint64_t)forwards * B.dense_bytes + expert_read + (uint64_t)n * B.tok_bytes,
                        row_flops(&B, n, k_act, E)};
        printf("%-8s %8lld %6d %10.3f %10s %11.1f %8.1f %16.2f %14s %10.2f  %.0f tokens/s, %d chunk%s of %lld, "
               "%.1f TFLOP/s\n",
               r.kind, (long long)n, 0, ms, "-", (double)r.bytes / 1e6, (double)r.bytes / (ms * 1e-3) / 1e9, distinct,
               "-", comm_mb, (double)n / (ms * 1e-3), forwards, forwards == 1 ? "" : "s",
               (long long)chunk, r.flops / (ms * 1e-3) / 1e12);
        emit(csv, &r, run_label(&a));
    }
    if (csv) fclose(csv);
    if (prof) fclose(prof);

    free(tok);
    free(seqs);
    free(rows);
    free(dist);
    engine_host_free(&be, B.X_out);
    engine_host_free(&be, B.P_out);
    model_free(B.m);
    engine_backend_free(&be, &ef);
    engram_consts_free(&ec);
    weights_free(&mw);
    st_close(&st);
    synth_pools_free(&pools);
    synth_inventory_free(&inv);
    config_free(&cfg);
    return 0;
}
