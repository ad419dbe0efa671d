/* Parallel topology: the stage split, the TP fit check, the world factorisation into DP x PP x TP
 * with its sub-communicators, and the rank table.
 *
 * Everything that can reject a layout (tp not dividing the heads, a stage boundary inside a
 * KV-sharing group, a world size that does not factor) is decided from the config and the world
 * size alone, before any communicator exists: every rank then reaches the same verdict with the
 * same message without talking to the others, and the CLI can print it once per rank and exit.
 *
 * A pipeline boundary may not fall inside a KV-sharing group because a layer reads the compressed
 * KV, the published top-k or the candidate blocks of an earlier layer from that layer's own state,
 * which lives on the stage that ran it; only the residual stream crosses stages. */
#include "topo.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <mpi.h>

#include "comm_mpi.h"
#include "log.h"

/* Row slices of quantized weights must cover whole 32-wide scale blocks (the FP8/FP4 block and the
 * GPU GEMM tile), or a rank would own part of a block whose scale it shares with a neighbour. */
#define TOPO_SLICE_ALIGN 32

/* ------------------------------------------------------------------------------------------------
 * Stage split */

/* The earlier layers whose state layer l reads (ratio > 0 layers only): up to three edges. */
struct dep {
    int src;
    const char *kind;
};

static int layer_deps(const struct model_config *cfg, int l, struct dep out[3]) {
    const struct layer_role *r = &cfg->role[l];
    int n = 0;
    if (r->ratio <= 0) return 0;
    if (r->kv_src >= 0 && r->kv_src != l) out[n++] = (struct dep){r->kv_src, "compressed KV"};
    if (r->topk_src >= 0 && r->topk_src != l) out[n++] = (struct dep){r->topk_src, "top-k"};
    if (r->uses_candidates && cfg->candidate_source >= 0 && cfg->candidate_source != l)
        out[n++] = (struct dep){cfg->candidate_source, "candidate blocks"};
    return n;
}

/* Is boundary b (stage starts at layer b) cut-free? If not, report the first reader at or after b
 * of state made before b. */
static bool boundary_valid(const struct model_config *cfg, int b, int *reader, struct dep *why) {
    for (int l = b; l < cfg->n_layers; l++) {
        struct dep d[3];
        int n = layer_deps(cfg, l, d);
        for (int i = 0; i < n; i++) {
            if (d[i].src < b) {
                if (reader) *reader = l;
                if (why) *why = d[i];
                return false;
            }
        }
    }
    return true;
}

/* The KV-sharing group around the edge src -> reader: the union of every dependency edge whose cut
 * range (src, reader] overlaps the group's, grown until it stops changing. For the real model
 * this gives {2-7}, {8-13}, {14-19}, {20-39}. */
static void edge_group(const struct model_config *cfg, int src, int reader, int *lo, int *hi) {
    *lo = src;
    *hi = reader;
    for (bool grew = true; grew;) {
        grew = false;
        for (int l = 0; l < cfg->n_layers; l++) {
            struct dep d[3];
            int n = layer_deps(cfg, l, d);
            for (int i = 0; i < n; i++) {
                if (d[i].src < *hi && l > *lo && (d[i].src < *lo || l > *hi)) {
                    if (d[i].src < *lo) *lo = d[i].src;
                    if (l > *hi) *hi = l;
                    grew = true;
                }
            }
        }
    }
}

/* "boundary at layer 10 cuts the KV-sharing group 8-13 (layer 10 reads layer 8's compressed KV)" */
static void explain_cut(const struct model_config *cfg, int b, char *buf, size_t n) {
    int reader = b, lo, hi;
    struct dep why = {b - 1, "state"};
    boundary_valid(cfg, b, &reader, &why);
    edge_group(cfg, why.src, reader, &lo, &hi);
    snprintf(buf, n, "boundary at layer %d cuts the KV-sharing group %d-%d (layer %d reads layer %d's %s)", b, lo, hi,
             reader, why.src, why.kind);
}

static void fmt_counts(const int *counts, int pp, char *buf, size_t n) {
    size_t len = 0;
    buf[0] = 0;
    for (int s = 0; s < pp && len < n; s++) len += (size_t)snprintf(buf + len, n - len, "%s%d", s ? "," : "", counts[s]);
}

static void fmt_valid_boundaries(const struct model_config *cfg, char *buf, size_t n) {
    size_t len = 0;
    buf[0] = 0;
    for (int b = 1; b < cfg->n_layers && len < n; b++)
        if (boundary_valid(cfg, b, NULL, NULL)) len += (size_t)snprintf(buf + len, n - len, "%s%d", len ? ", " : "", b);
    if (!buf[0]) snprintf(buf, n, "none");
}

int topo_stage_split(const struct model_config *cfg, int pp, const int *counts, int *begin, int *end) {
    int n = cfg->n_layers;
    if (pp < 1 || pp > TOPO_MAX_PP) {
        ds_err_set("--pp %d: must be between 1 and %d", pp, TOPO_MAX_PP);
        return -1;
    }
    if (pp > n) {
        ds_err_set("--pp %d: more pipeline stages than the %d backbone layers", pp, n);
        return -1;
    }
    int first[TOPO_MAX_PP + 1]; /* first[s] = first layer of stage s; first[pp] = n */
    first[0] = 0;
    first[pp] = n;
    if (counts) {
        char spec[TOPO_MAX_PP * 12];
        fmt_counts(counts, pp, spec, sizeof spec);
        int64_t sum = 0;
        for (int s = 0; s < pp; s++) {
            if (counts[s] < 1) {
                ds_err_set("--pp-layers %s: stage %d gets %d layers (every stage needs at least 1)", spec, s, counts[s]);
                return -1;
            }
            sum += counts[s];
        }
        if (sum != n) {
            ds_err_set("--pp-layers %s: the counts sum to %lld but the model has %d backbone layers", spec,
                       (long long)sum, n);
            return -1;
        }
        for (int s = 1; s < pp; s++) first[s] = first[s - 1] + counts[s - 1];
        for (int s = 1; s < pp; s++) {
            if (!boundary_valid(cfg, first[s], NULL, NULL)) {
                char why[256];
                explain_cut(cfg, first[s], why, sizeof why);
                ds_err_set("--pp-layers %s: %s", spec, why);
                return -1;
            }
        }
    } else {
        /* Even split (boundary s at ceil(s * n / pp)), each boundary then moved to the nearest valid
         * one above the previous boundary that still leaves a layer for every later stage; ties go
         * to the lower boundary (the earlier stage, which also holds the embedding, gets less). */
        for (int s = 1; s < pp; s++) {
            int ideal = (int)(((int64_t)s * n + pp - 1) / pp);
            int lo = first[s - 1] + 1, hi = n - (pp - s), found = -1;
            for (int d = 0; d <= n && found < 0; d++) {
                if (ideal - d >= lo && ideal - d <= hi && boundary_valid(cfg, ideal - d, NULL, NULL))
                    found = ideal - d;
                else if (ideal + d >= lo && ideal + d <= hi && boundary_valid(cfg, ideal + d, NULL, NULL))
                    found = ideal + d;
            }
            if (found < 0) {
                char why[256], valid[512];
                explain_cut(cfg, lo, why, sizeof why);
                fmt_valid_boundaries(cfg, valid, sizeof valid);
                ds_err_set("--pp %d: no valid boundary for stage %d in layers %d-%d: %s; valid boundaries: %s; "
                           "give the split with --pp-layers",
                           pp, s, lo, hi, why, valid);
                return -1;
            }
            first[s] = found;
        }
    }
    for (int s = 0; s < pp; s++) {
        begin[s] = first[s];
        end[s] = first[s + 1];
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------
 * TP fit */

int topo_check_tp(const struct model_config *cfg, int tp) {
    if (tp < 1) {
        ds_err_set("--tp %d: must be at least 1", tp);
        return -1;
    }
    /* Every split of spec/MODEL.md §5: output groups, heads and index heads per rank, experts by
     * id, vocab rows of the embedding and the head. o_groups first: it is the usual cap (8). */
    struct divisor {
        const char *key;
        int value;
        int mtp; /* DSpark block the value belongs to, -1 for the backbone */
    } divisors[8 + CFG_MAX_LAYERS];
    int nd = 0;
    divisors[nd++] = (struct divisor){"o_groups", cfg->o_groups, -1};
    divisors[nd++] = (struct divisor){"num_attention_heads", cfg->n_heads, -1};
    if (cfg->index_n_heads > 0) divisors[nd++] = (struct divisor){"index_n_heads", cfg->index_n_heads, -1};
    divisors[nd++] = (struct divisor){"n_routed_experts", cfg->n_routed_experts, -1};
    for (int m = 0; m < cfg->n_mtp; m++)
        divisors[nd++] = (struct divisor){cfg->dspark_n_routed > 0 ? "dspark_n_routed_experts" : "n_routed_experts",
                                          cfg->role[cfg->n_layers + m].n_experts, m};
    divisors[nd++] = (struct divisor){"vocab_size", cfg->vocab_size, -1};
    for (int i = 0; i < nd; i++) {
        if (divisors[i].value % tp == 0) continue;
        if (divisors[i].mtp >= 0)
            ds_err_set("--tp %d does not divide %s = %d (DSpark block mtp.%d)", tp, divisors[i].key, divisors[i].value,
                       divisors[i].mtp);
        else
            ds_err_set("--tp %d does not divide %s = %d", tp, divisors[i].key, divisors[i].value);
        return -1;
    }
    struct {
        const char *tensor, *expr;
        int64_t rows;
    } slices[3] = {
        {"attn.wq_b", "num_attention_heads x head_dim", (int64_t)cfg->n_heads * cfg->head_dim},
        {"attn.wo_a (and the wo_b K slice)", "o_groups x o_lora_rank", (int64_t)cfg->o_groups * cfg->o_lora_rank},
        {"indexer.wq_b", "index_n_heads x index_head_dim", (int64_t)cfg->index_n_heads * cfg->index_head_dim},
    };
    for (int i = 0; i < 3; i++) {
        int64_t per_rank = slices[i].rows / tp;
        if (slices[i].rows > 0 && per_rank % TOPO_SLICE_ALIGN) {
            ds_err_set("--tp %d: the %s slice per rank (%s / tp = %lld / %d = %lld) is not a multiple of %d", tp,
                       slices[i].tensor, slices[i].expr, (long long)slices[i].rows, tp, (long long)per_rank,
                       TOPO_SLICE_ALIGN);
            return -1;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------
 * World layout */

/* Pick tp and pp when the job spec leaves them at 0, then check that the world factors.
 * Deterministic on every rank: depends only on the config and the world size. */
static int choose_layout(const struct model_config *cfg, int world, int *tp, int *pp, const int *pp_counts) {
    if (*tp < 0 || *pp < 0) {
        ds_err_set("--tp %d --pp %d: must be >= 0 (0 = default)", *tp, *pp);
        return -1;
    }
    if (*pp == 0 && pp_counts) {
        ds_err_set("--pp-layers needs --pp (the number of stages)");
        return -1;
    }
    int tb[TOPO_MAX_PP], te[TOPO_MAX_PP];
    if (*tp == 0 && *pp == 0 && world == 16 && topo_check_tp(cfg, 8) == 0 && topo_stage_split(cfg, 2, NULL, tb, te) == 0) {
        *tp = 8; /* the production layout: one node per stage, TP within the node */
        *pp = 2;
        return 0;
    }
    if (*pp == 0) *pp = 1;
    /* A tp the model cannot take is the more useful message than the arithmetic of the world. */
    if (*tp > 0 && topo_check_tp(cfg, *tp)) return -1;
    if (topo_stage_split(cfg, *pp, pp_counts, tb, te)) return -1;
    if (*tp == 0) {
        if (world % *pp) {
            ds_err_set("world size %d is not divisible by pp %d", world, *pp);
            return -1;
        }
        int per_stage = world / *pp, t;
        for (t = per_stage; t >= 1; t--)
            if (per_stage % t == 0 && topo_check_tp(cfg, t) == 0) break;
        if (t < 1) return -1; /* even tp 1 does not fit; topo_check_tp said why */
        *tp = t;
    }
    if (world % (*tp * *pp)) {
        ds_err_set("world size %d is not divisible by tp %d x pp %d", world, *tp, *pp);
        return -1;
    }
    return 0;
}

/* Split MPI_COMM_WORLD by color and wrap the result as a named comm (the wrapper keeps its own
 * duplicate, so the split handle is freed here). */
static struct comm *split_comm(int color, int key, const char *fmt, int id) {
    MPI_Comm part;
    char name[64];
    CHECK_MPI(MPI_Comm_split(MPI_COMM_WORLD, color, key, &part));
    snprintf(name, sizeof name, fmt, id);
    struct comm *c = comm_mpi_new_named(part, name);
    CHECK_MPI(MPI_Comm_free(&part));
    return c;
}

int topo_init(struct topo *t, const struct model_config *cfg, int tp, int pp, const int *pp_counts) {
    memset(t, 0, sizeof *t);
    t->device = -1;
    int world, rank;
    CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &world));
    CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
    /* Validate everything before creating anything: no rank may be left inside a collective that
     * another rank skipped because its validation failed. */
    if (choose_layout(cfg, world, &tp, &pp, pp_counts)) return -1;
    if (topo_check_tp(cfg, tp)) return -1;
    if (topo_stage_split(cfg, pp, pp_counts, t->layer_begin, t->layer_end)) return -1;

    /* From here on MPI failures reach CHECK_MPI instead of MPI's default abort. */
    CHECK_MPI(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
    t->world_size = world;
    t->world_rank = rank;
    t->tp = tp;
    t->pp = pp;
    t->dp = world / (tp * pp);
    t->tp_rank = rank % tp;
    t->pp_rank = (rank / tp) % pp;
    t->dp_rank = rank / (tp * pp);
    if (gethostname(t->host, sizeof t->host - 1)) snprintf(t->host, sizeof t->host, "?");
    t->host[sizeof t->host - 1] = 0;
    log_set_identity(rank, t->pp_rank, t->tp_rank);
    comm_mpi_set_identity(rank, t->pp_rank, t->tp_rank);

    t->world = comm_mpi_new_named(MPI_COMM_WORLD, "world");
    /* A missing rank shows up here under the watchdog, not inside MPI_Comm_split (which blocks). */
    t->world->ops->barrier(t->world, "topo_init");
    int tp_color = t->dp_rank * pp + t->pp_rank, pp_color = t->dp_rank * tp + t->tp_rank,
        dp_color = t->pp_rank * tp + t->tp_rank;
    t->tp_comm = split_comm(tp_color, t->tp_rank, "tp group %d", tp_color);
    t->pp_comm = split_comm(pp_color, t->pp_rank, "pp pair %d", pp_color);
    t->dp_comm = split_comm(dp_color, t->dp_rank, "dp group %d", dp_color);

    MPI_Comm node;
    CHECK_MPI(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node));
    char node_name[96];
    snprintf(node_name, sizeof node_name, "node %s", t->host);
    t->node_comm = comm_mpi_new_named(node, node_name);
    CHECK_MPI(MPI_Comm_free(&node));
    t->node_rank = t->node_comm->rank;
    t->node_size = t->node_comm->size;
    /* One GPU per rank on a node; a CPU-only run sets device = -1 after this. */
    t->device = t->node_rank;
    return 0;
}

void topo_free(struct topo *t) {
    struct comm **all[] = {&t->node_comm, &t->dp_comm, &t->pp_comm, &t->tp_comm, &t->world};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
        if (*all[i]) (*all[i])->ops->free(*all[i]);
        *all[i] = NULL;
    }
}

/* ------------------------------------------------------------------------------------------------
 * Rank table */

struct rank_rec {
    int32_t rank, dp, pp, tp, pid, device;
    char host[64];
};

char *topo_rank_table(const struct topo *t) {
    struct rank_rec me;
    memset(&me, 0, sizeof me);
    me.rank = t->world_rank;
    me.dp = t->dp_rank;
    me.pp = t->pp_rank;
    me.tp = t->tp_rank;
    me.pid = (int32_t)getpid();
    me.device = t->device;
    snprintf(me.host, sizeof me.host, "%s", t->host);
    size_t nr = (size_t)t->world->size;
    struct rank_rec *all = ds_malloc(nr * sizeof *all);
    /* An allgather rather than a gather: the comm table has no gather, and the table is tiny. */
    t->world->ops->allgather(t->world, &me, all, sizeof me, "rank table");
    if (t->world_rank != 0) {
        free(all);
        return NULL;
    }

    enum { NCOL = 7 };
    static const char *const head[NCOL] = {"rank", "dp", "pp", "tp", "host", "pid", "device"};
    char(*cell)[NCOL][72] = ds_malloc(nr * sizeof *cell);
    size_t width[NCOL];
    for (int k = 0; k < NCOL; k++) width[k] = strlen(head[k]);
    for (size_t i = 0; i < nr; i++) {
        const struct rank_rec *r = &all[i]; /* allgather puts rank i's record at i */
        snprintf(cell[i][0], 72, "%d", (int)r->rank);
        snprintf(cell[i][1], 72, "%d", (int)r->dp);
        snprintf(cell[i][2], 72, "%d", (int)r->pp);
        snprintf(cell[i][3], 72, "%d", (int)r->tp);
        snprintf(cell[i][4], 72, "%.63s", r->host);
        snprintf(cell[i][5], 72, "%d", (int)r->pid);
        if (r->device < 0)
            snprintf(cell[i][6], 72, "cpu");
        else
            snprintf(cell[i][6], 72, "%d", (int)r->device);
        for (int k = 0; k < NCOL; k++) {
            size_t w = strlen(cell[i][k]);
            if (w > width[k]) width[k] = w;
        }
    }
    size_t line = 0;
    for (int k = 0; k < NCOL; k++) line += width[k] + 2;
    size_t cap = (nr + 1) * (line + 1) + 1, len = 0;
    char *out = ds_malloc(cap);
    /* Numbers right-aligned, the host left-aligned; two spaces between columns; no trailing blanks. */
    for (size_t i = 0; i <= nr; i++) {
        for (int k = 0; k < NCOL; k++) {
            const char *v = i == 0 ? head[k] : cell[i - 1][k];
            const char *sep = k ? "  " : "";
            if (k == 4)
                len += (size_t)snprintf(out + len, cap - len, "%s%-*s", sep, (int)width[k], v);
            else
                len += (size_t)snprintf(out + len, cap - len, "%s%*s", sep, (int)width[k], v);
        }
        len += (size_t)snprintf(out + len, cap - len, "\n");
    }
    free(cell);
    free(all);
    /* Not printed here: the caller decides where it goes (stderr, the output file's /meta). */
    return out;
}
