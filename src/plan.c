/* `dsbatch plan --model DIR --tp N --pp N [--gpu-mem SIZE] ...`: what each rank of a TP x PP
 * layout will hold, before any GPU is asked for: weight bytes, the Engram tables' host bytes per
 * node, KV cache bytes per sequence and per token of context, a workspace estimate and, given the
 * memory of one GPU, how many tokens of KV cache are left.
 *
 * Nothing here is a second model of the checkpoint. The layout is validated by the topology's own
 * functions (topo_check_tp, topo_stage_split: the split the engine will use), the weight bytes come
 * from weights_bind on each rank's slice (the accounting `inspect --tp --pp` prints; binding reads
 * headers only, so the 96k-tensor release binds 16 times in well under a second), and the Engram
 * bytes from the Engram service's own layout function. The KV and workspace figures follow the
 * buffers model_new and the forward allocate today (CPU backend, bf16 caches), and say so: a
 * smaller cache format would change them, not the weights. Every number is computed before
 * anything is printed, so a layout that does not fit prints one error line and nothing else. */
#include <cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cli_args.h"
#include "config.h"
#include "cuda/moe_mma.h"
#include "engine_cli.h"
#include "engram_service.h"
#include "loader.h"
#include "log.h"
#include "model.h"
#include "topo.h"
#include "weights.h"

#define DEFAULT_MAX_SEQS 8           /* generate's --max-seqs default */
#define DEFAULT_MAX_BATCH_TOKENS 512 /* generate's --chunk default: rows of one prefill forward */

struct plan_opts {
    const char *dir;
    int tp, pp, ranks_per_node, max_seqs;
    int64_t max_seq_len, max_batch_tokens;
    uint64_t gpu_mem; /* 0: not given */
    const char *gpu_mem_text;
    bool json;
    struct engine_flags eng;
};

struct rank_plan {
    int rank, stage, tp_rank, node;
    uint64_t weights;        /* bytes mapped except the Engram tables (GPU resident) */
    uint64_t engram_slice;   /* the Engram row slice weights_bind maps (inspect's "engram" column) */
    uint64_t experts;        /* of weights: routed experts */
    uint64_t prepared;       /* copies the backend makes at load: bf16 wo_a, RoPE tables, Engram gate */
    uint64_t kv_per_seq;     /* window rings + open compressor groups of one sequence */
    uint64_t kv_fixed;       /* max_seqs x kv_per_seq + one guard row per compressed cache */
    double kv_per_token;     /* compressed KV + index keys (+ mirrors) per token of one sequence */
    uint64_t workspace;
    int64_t capacity;        /* tokens of KV left with --gpu-mem; -1 unbounded or not asked */
};

struct node_plan {
    int first_rank, last_rank;
    uint64_t mask;          /* Engram tables held (engram_service_layer_mask) */
    uint64_t table_bytes;   /* tables + scales */
    uint64_t host_bytes;    /* the service's allocation (page-aligned) */
};

/* ------------------------------------------------------------------------------------------------
 * KV cache and workspace of one rank, following model_new and the forward (model.c, attention.c) */

static bool stage_has(int b, int e, int l) { return l >= b && l < e; }

/* Caches per stage (every TP rank of the stage keeps whole caches: the KV latent is one MQA head). */
static void kv_of_stage(const struct model_config *c, int b, int e, bool first, bool stale_keys,
                        const struct plan_opts *o, struct rank_plan *rp) {
    int64_t hd = c->head_dim, id = c->index_head_dim, W = c->window;
    uint64_t per_seq = 0, guard = 0;
    double per_tok = 0;
    for (int l = 0; l < c->n_layers; l++) {
        const struct layer_role *r = &c->role[l];
        if (stage_has(b, e, l)) {
            per_seq += (uint64_t)(W * hd * 2); /* window K=V ring, bf16 */
            if (r->owns_compressor) {
                per_tok += (double)(hd * 2) / r->ratio; /* compressed KV, one entry per ratio tokens */
                guard += (uint64_t)(hd * 2);
                if (r->owns_index_keys) {
                    per_tok += (double)(id * 2) / r->ratio;
                    guard += (uint64_t)(id * 2);
                }
                if (r->ratio > 1) per_seq += (uint64_t)(2 * r->ratio * hd * 4); /* open group kv + score, fp32 */
            }
        } else if (first && stale_keys && r->owns_index_keys) {
            /* stage 0 mirrors later stages' index keys for the stale-key quirk (MODEL.md §3.12) */
            per_tok += (double)(id * 2) / r->ratio;
            guard += (uint64_t)(id * 2);
        }
    }
    rp->kv_per_seq = per_seq;
    rp->kv_fixed = (uint64_t)o->max_seqs * per_seq + guard;
    rp->kv_per_token = per_tok;
}

static uint64_t u64max(uint64_t a, uint64_t b) { return a > b ? a : b; }

/* What model_new adds to the mapped weights: wo_a dequantized to bf16 as the reference holds it
 * (MODEL.md §3.5), the fp32 RoPE table of every layer, q_weight * k_weight in fp32 per Engram
 * layer, and on the GPU's tensor cores (--backend cuda without --exact-linears) the two mHC mixes'
 * fn of each layer as three bf16 pieces (hc_prepare; where hc·D is a multiple of 32). */
static uint64_t prepared_of(const struct model_config *c, int b, int e, int tp, const struct engine_flags *f) {
    uint64_t bytes = (uint64_t)config_total_layers(c) * (uint64_t)(c->rope_dim / 2) * 4;
    const int64_t L = (int64_t)c->hc_mult * c->dim, nmix = (int64_t)(2 + c->hc_mult) * c->hc_mult;
    const bool pieces = f->backend == ENGINE_BACKEND_CUDA && !f->exact_linears && L % 32 == 0;
    for (int l = b; l < e; l++) {
        bytes += (uint64_t)(c->o_groups / tp) * (uint64_t)c->o_lora_rank *
                 (uint64_t)((int64_t)c->n_heads * c->head_dim / c->o_groups) * 2;
        if (c->role[l].engram_idx >= 0) bytes += (uint64_t)c->hc_mult * (uint64_t)c->dim * 4;
        if (pieces) bytes += (uint64_t)(2 * 3 * nmix * L * 2);
    }
    return bytes;
}

/* Peak activations of one forward of T rows: the residual stream lives through the whole forward;
 * each layer's temporaries are freed before the next, so the peak is the stream plus the largest
 * of (Engram step, block + attention, block + MoE) over the stage's layers, or the head. Sizes of
 * context-dependent buffers (index scores) take every sequence of the batch at max_seq_len; the
 * attention reads the rings and compressed caches in place (the kv arena), and the chunk's own
 * rows (the "window kv" term) sit in the arena's scratch rows. */
/* The temporaries of one FP8/FP4 linear call on the GPU's tensor-core path (linear_mma_sm80.cu):
 * the quantized activations [T, k] bf16 and, with more than one k-chunk of 1,024, the chunks'
 * fp32 partials [nch, T, n] (the engram projection's are the largest: 6 x T x 25,600 x 4 bytes). */
static uint64_t lin_tmp(int64_t T, int64_t n, int64_t k) {
    int64_t nch = moe_mma_chunks(k); /* the k-chunks of the tensor-core order contract */
    return (uint64_t)(T * k * 2) + (nch > 1 ? (uint64_t)(nch * T * n * 4) : 0);
}

/* The peak activations of one forward of T rows. */
static uint64_t workspace_rows(const struct model_config *c, int b, int e, bool first, bool last, int tp,
                               const struct plan_opts *o, int64_t T) {
    int64_t L = o->max_seq_len, Sb = o->max_seqs < T ? o->max_seqs : T;
    int64_t D = c->dim, hc = c->hc_mult, hd = c->head_dim, W = c->window, ql = c->q_lora_rank;
    int64_t Hl = c->n_heads / tp, Gl = c->o_groups / tp, R = c->o_lora_rank, G = c->o_groups, Dl = D / tp;
    int64_t ih = c->index_n_heads, id = c->index_head_dim;
    int64_t C = (int64_t)(c->engram_max_ngram - 1) * c->engram_n_heads, ehd = c->engram_head_dim;
    uint64_t stream = (uint64_t)(T * (2 * hc * D * 2 + hc * 4 + 4 + 4)); /* X, X1, P, positions, tokens */
    if (first) stream += (uint64_t)(T * D * 2);                         /* embedding rows */
    if (!first) stream += (uint64_t)(T * (hc * D * 2 + hc * 4));        /* stream received */
    if (!last) stream += (uint64_t)(T * (hc * D * 2 + hc * 4));         /* stream handed on */
    uint64_t block = (uint64_t)(T * (2 * D * 2 + (2 * hc + hc * hc) * 4));
    uint64_t peak = 0;
    for (int l = b; l < e; l++) {
        const struct layer_role *r = &c->role[l];
        int64_t nk = r->ratio > 0 ? L / r->ratio : 0, kc = r->ratio > 0 ? (c->index_topk < nk ? c->index_topk : nk) : 0;
        /* q_a, q, window kv, attention out, grouped out, gathered groups, wo_b rows; index lists */
        uint64_t attn = (uint64_t)(T * (ql + 2 * Hl * hd + hd + Gl * R + G * R + Dl) * 2 + T * (W + kc) * 4 * 2);
        attn += u64max(u64max(lin_tmp(T, ql, D), lin_tmp(T, Hl * hd, ql)), u64max(lin_tmp(T, hd, D), lin_tmp(T, D, Gl * R)));
        if (r->owns_compressor) {
            attn += (uint64_t)(T * hd * 2 + T * id * 2);
            if (r->ratio > 1) attn += (uint64_t)(T * hd * 4 * 2 + 2 * (T / r->ratio + Sb) * r->ratio * hd * 4);
        }
        if (r->is_index_source) /* replicated indexer: queries, weights, scores on device and host */
            attn += (uint64_t)(T * ih * id * 2 + T * ih * 2 + T * nk * 4 * 2 + T * kc * 4 +
                               (r->is_candidate_source ? T * nk : 0));
        int64_t k = r->n_active;
        /* slots [T, k, D] bf16, and across TP either the gather of tp of them or the owner
         * exchange's packed copy plus its [T, D / tp] sums and their [T, D] gather (model.c) */
        uint64_t slots = (uint64_t)(T * k * D * 2), xchg = 0;
        if (tp > 1) xchg = u64max((uint64_t)tp * slots, slots + (uint64_t)(T * (D / tp) * 2 + T * D * 2));
        uint64_t moe = (uint64_t)(T * k * 8 + T * D * 6) + slots + xchg;
        /* the shared expert's linears, or the routed experts' tensor-core passes (moe_mma.h) */
        moe += u64max(u64max(lin_tmp(T, c->moe_inter_dim, D), lin_tmp(T, D, c->moe_inter_dim)),
                      (uint64_t)moe_mma_workspace_max(T, k, (r->n_experts + tp - 1) / tp, D, c->moe_inter_dim, D));
        uint64_t engram = r->engram_idx >= 0 ? (uint64_t)(T * C * 8 * 2 + T * C * ehd * 2 + T * (hc + 1) * D * 2) +
                                                   lin_tmp(T, (hc + 1) * D, C * ehd)
                                             : 0;
        peak = u64max(peak, u64max(engram, block + u64max(attn, moe)));
    }
    if (last) { /* final hidden, selected rows, fp32 logits (own columns, gathered, host) for every row */
        int64_t V = c->vocab_size;
        peak = u64max(peak, (uint64_t)(T * D * 2 * 2 + T * (V / tp) * 4 + 2 * T * V * 4));
    }
    return stream + peak;
}

/* A forward of --max-batch-tokens rows, plus, with the CUDA graphs of decode steps (no --eager),
 * their own memory pool: the segment-edge buffers and the recordings' temporaries of a decode
 * step of min(max_seqs, MODEL_GRAPH_ROWS_MAX) rows, bounded by one such forward's peak (the pool
 * is separate from the stream-ordered one; the recordings share it, being launched in one stream). */
static uint64_t workspace_of(const struct model_config *c, int b, int e, bool first, bool last, int tp,
                             const struct plan_opts *o) {
    uint64_t w = workspace_rows(c, b, e, first, last, tp, o, o->max_batch_tokens);
    int64_t Td = o->max_seqs < MODEL_GRAPH_ROWS_MAX ? o->max_seqs : MODEL_GRAPH_ROWS_MAX;
    if (!o->eng.eager) w += workspace_rows(c, b, e, first, last, tp, o, Td);
    return w;
}

/* ------------------------------------------------------------------------------------------------
 * Formatting */

static const char *human(double b, char *buf, size_t n) {
    static const char *const units[] = {"B", "KB", "MB", "GB", "TB"};
    int u = 0;
    while (fabs(b) >= 1000.0 && u < 4) b /= 1000.0, u++;
    snprintf(buf, n, u ? "%.2f %s" : "%.0f %s", b, units[u]);
    return buf;
}

/* "40G" = 40 GiB (as nvidia-smi counts GPU memory), "40GB" = 40e9, "40GiB" = 40 GiB, plain bytes. */
static uint64_t parse_size(const char *opt, const char *v) {
    char *end;
    double x = strtod(v, &end);
    if (end == v || !(x > 0)) ds_die("plan: %s '%s': expected a size like 40G, 40GiB, 42949672960 or 40GB", opt, v);
    static const struct {
        const char *suffix;
        double mult;
    } units[] = {{"", 1}, {"B", 1}, {"K", 0x1p10}, {"KiB", 0x1p10}, {"KB", 1e3}, {"M", 0x1p20}, {"MiB", 0x1p20},
                 {"MB", 1e6}, {"G", 0x1p30}, {"GiB", 0x1p30}, {"GB", 1e9}, {"T", 0x1p40}, {"TiB", 0x1p40},
                 {"TB", 1e12}};
    for (size_t i = 0; i < sizeof units / sizeof *units; i++) {
        if (strcmp(end, units[i].suffix)) continue;
        double bytes = floor(x * units[i].mult);
        if (bytes < 1 || bytes > 0x1p62) break;
        return (uint64_t)bytes;
    }
    ds_die("plan: %s '%s': expected a size like 40G, 40GiB, 42949672960 or 40GB", opt, v);
}

static void layer_ids(const struct model_config *c, uint64_t mask, char *buf, size_t n) {
    size_t off = 0;
    buf[0] = 0;
    for (int i = 0; i < c->n_engram && off < n; i++)
        if (mask >> i & 1) off += (size_t)snprintf(buf + off, n - off, "%s%d", off ? "," : "", c->engram_layer_ids[i]);
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: dsbatch plan --model DIR --tp N --pp N [--gpu-mem SIZE] [--max-seqs N] [--max-seq-len N]\n"
            "                    [--max-batch-tokens N] [--ranks-per-node N] [--no-stale-index-keys] [--eager] [--json]\n"
            "  Per rank of a TP x PP layout: weight bytes (without the Engram tables), the Engram tables' host\n"
            "  bytes on its node (held once per node by the Engram service), KV cache bytes per sequence and per\n"
            "  token of context, a workspace estimate; with --gpu-mem the KV capacity left in tokens.\n"
            "  --gpu-mem SIZE        memory of one GPU: 40G or 40GiB = 40 x 2^30 bytes, 40GB = 40e9, or bytes\n"
            "  --max-seqs N          sequence slots per engine (default %d)\n"
            "  --max-seq-len N       positions per sequence (default min(max_position_embeddings, 4096))\n"
            "  --max-batch-tokens N  rows of one forward, for the workspace estimate (default %d)\n"
            "  --ranks-per-node N    ranks per node (default: the TP size, one stage per node)\n"
            "  --no-stale-index-keys the engine switch: stage 0 then keeps no mirror of later index keys\n"
            "  --json                exact bytes as JSON on stdout\n",
            DEFAULT_MAX_SEQS, DEFAULT_MAX_BATCH_TOKENS);
}

static void parse_args(int argc, char **argv, struct plan_opts *o) {
    *o = (struct plan_opts){.tp = 1, .pp = 1, .max_seqs = DEFAULT_MAX_SEQS, .max_batch_tokens = DEFAULT_MAX_BATCH_TOKENS};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            exit(0);
        }
        if (!strcmp(a, "--json")) {
            o->json = true;
            continue;
        }
        if (engine_flag_parse(argc, argv, &i, &o->eng)) continue;
        if (a[0] != '-' || i + 1 >= argc) ds_die("plan: unexpected argument '%s' (see --help)", a);
        const char *v = argv[++i];
        if (!strcmp(a, "--model"))
            o->dir = v;
        else if (!strcmp(a, "--tp"))
            o->tp = (int)cli_int(a, v, 1, 4096);
        else if (!strcmp(a, "--pp"))
            o->pp = (int)cli_int(a, v, 1, TOPO_MAX_PP);
        else if (!strcmp(a, "--ranks-per-node"))
            o->ranks_per_node = (int)cli_int(a, v, 1, 1 << 20);
        else if (!strcmp(a, "--max-seqs"))
            o->max_seqs = (int)cli_int(a, v, 1, 1 << 20);
        else if (!strcmp(a, "--max-seq-len"))
            o->max_seq_len = cli_int(a, v, 1, (int64_t)1 << 40);
        else if (!strcmp(a, "--max-batch-tokens"))
            o->max_batch_tokens = cli_int(a, v, 1, (int64_t)1 << 30);
        else if (!strcmp(a, "--gpu-mem"))
            o->gpu_mem = parse_size(a, v), o->gpu_mem_text = v;
        else
            ds_die("plan: unknown option '%s' (see --help)", a);
    }
    if (!o->dir) {
        usage(stderr);
        exit(2);
    }
    if (!o->ranks_per_node) o->ranks_per_node = o->tp;
}

/* ------------------------------------------------------------------------------------------------
 * Output */

static void print_text(const struct loaded_model *lm, const struct plan_opts *o, const int *begin, const int *end,
                       const struct rank_plan *rp, const struct node_plan *np, int n_nodes) {
    const struct model_config *c = &lm->cfg;
    int n = o->tp * o->pp;
    char h[8][32], ids[256];
    printf("plan     %s: TP %d x PP %d = %d ranks, %d per node (%d node%s); rank = stage * %d + tp rank\n", o->dir, o->tp,
           o->pp, n, o->ranks_per_node, n_nodes, n_nodes == 1 ? "" : "s", o->tp);
    for (int s = 0; s < o->pp; s++)
        printf("  stage %d: layers %d-%d%s%s\n", s, begin[s], end[s] - 1, s == 0 ? " + embed" : "",
               s == o->pp - 1 ? (c->n_mtp ? " + norm, head, DSpark" : " + norm, head") : "");
    printf("weights  bytes each rank maps (weights_bind, as inspect --tp --pp) without the Engram tables;\n"
           "         prepared: what the backend adds at load (wo_a in bf16 as the reference holds it, RoPE tables,\n"
           "         fp32 Engram gate weights; with --backend cuda the mHC mixes' weights as three bf16 pieces)\n");
    printf("engram   tables held once per node in host memory by the Engram service, not per rank:\n");
    for (int k = 0; k < n_nodes; k++) {
        layer_ids(c, np[k].mask, ids, sizeof ids);
        if (np[k].mask)
            printf("  node %d (ranks %d-%d): layers %s, %s (%llu bytes)\n", k, np[k].first_rank, np[k].last_rank, ids,
                   human((double)np[k].host_bytes, h[0], sizeof h[0]), (unsigned long long)np[k].host_bytes);
        else
            printf("  node %d (ranks %d-%d): no Engram layer\n", k, np[k].first_rank, np[k].last_rank);
    }
    printf("kv       KV cache in the CPU/bf16 layout the engine uses today (model_new); every TP rank holds whole\n"
           "         caches. KV/seq: %lld-slot window rings x head_dim x 2 B per layer, + fp32 open compressor groups.\n"
           "         KV/token: compressed KV (head_dim x 2 B) and index keys (index_head_dim x 2 B), one entry per\n"
           "         `ratio` tokens, on KV sources / key owners%s.\n"
           "         %d sequences (--max-seqs) of %lld positions (--max-seq-len)\n",
           (long long)c->window, o->eng.no_stale_keys ? "" : " (+ stage 0's mirrors of later stages' index keys)",
           o->max_seqs, (long long)o->max_seq_len);
    printf("work     workspace = peak activations of one forward of %lld rows (--max-batch-tokens): residual stream +\n"
           "         the largest per-layer temporaries (attention (keys read in place) and index scores, MoE\n"
           "         expert gather, Engram rows) or the head's fp32 logits for every row%s\n",
           (long long)o->max_batch_tokens,
           o->eng.eager ? "" : ";\n         + the decode steps' CUDA graph pool: the same for a step of min(max-seqs, 256) rows (--eager: none)");
    if (o->gpu_mem)
        printf("gpu      --gpu-mem %s = %llu bytes; KV capacity = (gpu-mem - weights - prepared - workspace\n"
               "         - %d x KV/seq) / KV/token\n",
               o->gpu_mem_text, (unsigned long long)o->gpu_mem, o->max_seqs);
    printf("  %4s  %2s  %2s  %4s  %-9s %11s %10s %12s %10s %10s %11s", "rank", "pp", "tp", "node", "layers", "weights",
           "prepared", "engram/node", "KV/seq", "KV/token", "workspace");
    printf(o->gpu_mem ? "  %s\n" : "\n", "KV capacity");
    uint64_t wsum = 0;
    for (int i = 0; i < n; i++) {
        const struct rank_plan *r = &rp[i];
        char layers[32];
        snprintf(layers, sizeof layers, "%d-%d", begin[r->stage], end[r->stage] - 1);
        char tok[32];
        snprintf(tok, sizeof tok, r->kv_per_token == floor(r->kv_per_token) ? "%.0f B" : "%.1f B", r->kv_per_token);
        printf("  %4d  %2d  %2d  %4d  %-9s %11s %10s %12s %10s %10s %11s", r->rank, r->stage, r->tp_rank, r->node,
               layers, human((double)r->weights, h[0], sizeof h[0]), human((double)r->prepared, h[4], sizeof h[4]),
               human((double)np[r->node].host_bytes, h[1], sizeof h[1]),
               human((double)r->kv_per_seq, h[2], sizeof h[2]), tok, human((double)r->workspace, h[3], sizeof h[3]));
        if (o->gpu_mem && r->capacity < 0)
            printf("  unbounded (no per-token KV)");
        else if (o->gpu_mem)
            printf("  %lld tokens (%lld x %lld)", (long long)r->capacity, (long long)(r->capacity / o->max_seq_len),
                   (long long)o->max_seq_len);
        printf("\n");
        wsum += r->weights;
    }
    uint64_t esum = 0;
    for (int k = 0; k < n_nodes; k++) esum += np[k].host_bytes;
    printf("  all ranks: weights %s (%llu bytes); Engram host memory %s (%llu bytes) over %d node%s\n",
           human((double)wsum, h[0], sizeof h[0]), (unsigned long long)wsum, human((double)esum, h[1], sizeof h[1]),
           (unsigned long long)esum, n_nodes, n_nodes == 1 ? "" : "s");
}

static void print_json(const struct loaded_model *lm, const struct plan_opts *o, const int *begin, const int *end,
                       const struct rank_plan *rp, const struct node_plan *np, int n_nodes) {
    const struct model_config *c = &lm->cfg;
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "model", o->dir);
    cJSON_AddNumberToObject(root, "tp", o->tp);
    cJSON_AddNumberToObject(root, "pp", o->pp);
    cJSON_AddNumberToObject(root, "ranks_per_node", o->ranks_per_node);
    cJSON_AddNumberToObject(root, "n_nodes", n_nodes);
    cJSON_AddNumberToObject(root, "max_seqs", o->max_seqs);
    cJSON_AddNumberToObject(root, "max_seq_len", (double)o->max_seq_len);
    cJSON_AddNumberToObject(root, "max_batch_tokens", (double)o->max_batch_tokens);
    cJSON_AddBoolToObject(root, "stale_index_keys", !o->eng.no_stale_keys);
    cJSON_AddBoolToObject(root, "cuda_graphs", !o->eng.eager);
    cJSON_AddStringToObject(root, "kv_layout", "cpu-bf16");
    if (o->gpu_mem)
        cJSON_AddNumberToObject(root, "gpu_mem_bytes", (double)o->gpu_mem);
    else
        cJSON_AddNullToObject(root, "gpu_mem_bytes");
    cJSON *st = cJSON_AddArrayToObject(root, "stages");
    for (int s = 0; s < o->pp; s++) {
        cJSON *x = cJSON_CreateObject();
        cJSON_AddNumberToObject(x, "stage", s);
        cJSON_AddNumberToObject(x, "layer_begin", begin[s]);
        cJSON_AddNumberToObject(x, "layer_end", end[s]);
        cJSON_AddItemToArray(st, x);
    }
    cJSON *nodes = cJSON_AddArrayToObject(root, "nodes");
    for (int k = 0; k < n_nodes; k++) {
        cJSON *x = cJSON_CreateObject(), *ls = cJSON_CreateArray();
        cJSON_AddNumberToObject(x, "node", k);
        cJSON_AddNumberToObject(x, "first_rank", np[k].first_rank);
        cJSON_AddNumberToObject(x, "last_rank", np[k].last_rank);
        for (int i = 0; i < c->n_engram; i++)
            if (np[k].mask >> i & 1) cJSON_AddItemToArray(ls, cJSON_CreateNumber(c->engram_layer_ids[i]));
        cJSON_AddItemToObject(x, "engram_layers", ls);
        cJSON_AddNumberToObject(x, "engram_table_bytes", (double)np[k].table_bytes);
        cJSON_AddNumberToObject(x, "engram_host_bytes", (double)np[k].host_bytes);
        cJSON_AddItemToArray(nodes, x);
    }
    cJSON *ranks = cJSON_AddArrayToObject(root, "ranks");
    for (int i = 0; i < o->tp * o->pp; i++) {
        const struct rank_plan *r = &rp[i];
        cJSON *x = cJSON_CreateObject();
        cJSON_AddNumberToObject(x, "rank", r->rank);
        cJSON_AddNumberToObject(x, "pp", r->stage);
        cJSON_AddNumberToObject(x, "tp", r->tp_rank);
        cJSON_AddNumberToObject(x, "node", r->node);
        cJSON_AddNumberToObject(x, "weight_bytes", (double)r->weights);
        cJSON_AddNumberToObject(x, "expert_bytes", (double)r->experts);
        cJSON_AddNumberToObject(x, "prepared_bytes", (double)r->prepared);
        cJSON_AddNumberToObject(x, "engram_row_slice_bytes", (double)r->engram_slice);
        cJSON_AddNumberToObject(x, "engram_host_bytes_node", (double)np[r->node].host_bytes);
        cJSON_AddNumberToObject(x, "kv_bytes_per_seq", (double)r->kv_per_seq);
        cJSON_AddNumberToObject(x, "kv_fixed_bytes", (double)r->kv_fixed);
        cJSON_AddNumberToObject(x, "kv_bytes_per_token", r->kv_per_token);
        cJSON_AddNumberToObject(x, "workspace_bytes", (double)r->workspace);
        if (o->gpu_mem && r->capacity >= 0)
            cJSON_AddNumberToObject(x, "kv_capacity_tokens", (double)r->capacity);
        else
            cJSON_AddNullToObject(x, "kv_capacity_tokens");
        cJSON_AddItemToArray(ranks, x);
    }
    char *text = cJSON_Print(root);
    printf("%s\n", text);
    free(text);
    cJSON_Delete(root);
}

/* ------------------------------------------------------------------------------------------------
 * Command */

int cmd_plan(int argc, char **argv) {
    struct plan_opts o;
    parse_args(argc, argv, &o);
    struct loaded_model *lm = ds_calloc(1, sizeof *lm);
    if (loader_open_config(lm, o.dir)) ds_die_err();
    const struct model_config *c = &lm->cfg;
    /* the layout first: it needs only the config, and is the engine's own verdict */
    int begin[TOPO_MAX_PP], end[TOPO_MAX_PP];
    if (topo_check_tp(c, o.tp) || topo_stage_split(c, o.pp, NULL, begin, end)) ds_die_err();
    if (!o.max_seq_len) o.max_seq_len = engine_opts_default(c).max_seq_len;
    if (o.max_seq_len > c->max_pos)
        ds_die("plan: --max-seq-len %lld exceeds the model's max_position_embeddings %lld", (long long)o.max_seq_len,
               (long long)c->max_pos);
    /* the checkpoint once (validated and bound as rank 0 would bind it), then every slice on it */
    struct bind_opts o0 = {.tp_rank = 0, .tp_size = o.tp, .layer_begin = begin[0], .layer_end = end[0],
                           .first_stage = true, .last_stage = o.pp == 1};
    if (loader_bind(lm, &o0)) ds_die_err();

    int n = o.tp * o.pp, n_nodes = (n + o.ranks_per_node - 1) / o.ranks_per_node;
    struct rank_plan *rp = ds_calloc((size_t)n, sizeof *rp);
    struct node_plan *np = ds_calloc((size_t)n_nodes, sizeof *np);
    for (int s = 0; s < o.pp; s++) {
        for (int t = 0; t < o.tp; t++) {
            struct rank_plan *r = &rp[s * o.tp + t];
            struct bind_opts bo = {.tp_rank = t, .tp_size = o.tp, .layer_begin = begin[s], .layer_end = end[s],
                                   .first_stage = s == 0, .last_stage = s == o.pp - 1};
            struct model_weights mw;
            if (weights_bind(&mw, c, &lm->st, &bo)) ds_die_err();
            *r = (struct rank_plan){.rank = s * o.tp + t, .stage = s, .tp_rank = t,
                                    .node = (s * o.tp + t) / o.ranks_per_node,
                                    .weights = mw.bytes_total - mw.bytes_engram, .engram_slice = mw.bytes_engram,
                                    .experts = mw.bytes_experts, .capacity = -1};
            weights_free(&mw);
            kv_of_stage(c, begin[s], end[s], s == 0, !o.eng.no_stale_keys, &o, r);
            r->prepared = prepared_of(c, begin[s], end[s], o.tp, &o.eng);
            r->workspace = workspace_of(c, begin[s], end[s], s == 0, s == o.pp - 1, o.tp, &o);
            np[r->node].mask |= engram_service_layer_mask(c, begin[s], end[s]);
        }
    }
    for (int k = 0; k < n_nodes; k++) {
        np[k].first_rank = k * o.ranks_per_node;
        np[k].last_rank = (k + 1) * o.ranks_per_node < n ? (k + 1) * o.ranks_per_node - 1 : n - 1;
        np[k].host_bytes = engram_service_layout_bytes(c, np[k].mask);
        for (int i = 0; i < c->n_engram; i++)
            if (np[k].mask >> i & 1)
                np[k].table_bytes += (uint64_t)c->engram_num_embeddings[i] *
                                     (uint64_t)(c->engram_head_dim + c->engram_head_dim / 32);
    }
    if (o.gpu_mem) {
        for (int i = 0; i < n; i++) {
            struct rank_plan *r = &rp[i];
            if (r->weights > o.gpu_mem)
                ds_die("plan: rank %d (pp %d, tp %d): its weights alone are %llu bytes (%.2f GB), more than --gpu-mem "
                       "%s = %llu bytes",
                       r->rank, r->stage, r->tp_rank, (unsigned long long)r->weights, (double)r->weights / 1e9,
                       o.gpu_mem_text, (unsigned long long)o.gpu_mem);
            uint64_t need = r->weights + r->prepared + r->workspace + r->kv_fixed;
            if (need > o.gpu_mem)
                ds_die("plan: rank %d (pp %d, tp %d): weights %llu + prepared %llu + workspace %llu + per-sequence KV %llu "
                       "= %llu bytes exceed --gpu-mem %s = %llu bytes",
                       r->rank, r->stage, r->tp_rank, (unsigned long long)r->weights, (unsigned long long)r->prepared,
                       (unsigned long long)r->workspace,
                       (unsigned long long)r->kv_fixed, (unsigned long long)need, o.gpu_mem_text,
                       (unsigned long long)o.gpu_mem);
            /* whole bytes per token (every ratio divides its entry size here) divide exactly */
            uint64_t left = o.gpu_mem - need;
            if (r->kv_per_token > 0)
                r->capacity = r->kv_per_token == floor(r->kv_per_token)
                                  ? (int64_t)(left / (uint64_t)r->kv_per_token)
                                  : (int64_t)floor((double)left / r->kv_per_token);
        }
    }
    if (o.json)
        print_json(lm, &o, begin, end, rp, np, n_nodes);
    else
        print_text(lm, &o, begin, end, rp, np, n_nodes);
    free(rp);
    free(np);
    loader_close(lm);
    free(lm);
    return 0;
}
