/* The node-local Engram service (see engram_service.h): one shared-memory copy of the Engram tables
 * per node, made with MPI_Win_allocate_shared over the node communicator.
 *
 * Node-local rank 0 owns the window (the other ranks contribute 0 bytes), so the tables form one
 * contiguous segment whose layout every rank derives from the config alone: no offsets travel.
 * The fill is split across the node's ranks by bytes, because reading ~200 GB out of the mmap'd
 * shards is bound by page faults and storage reads, which scale with readers; the result is still
 * one copy. Shared windows use MPI's unified memory model, so visibility needs only
 * MPI_Win_sync around a barrier (inside a lock_all epoch held for the service's lifetime). Every
 * wait goes through the comm table so the watchdog covers it; MPI_Win_allocate_shared itself is
 * entered only after an allgather under the watchdog has shown every node rank present. */
#include "engram_service.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <mpi.h>

#include "comm_mpi.h"
#include "loader.h"
#include "log.h"
#include "topo.h"

/* Each table and scale starts on a page: keeps the rows of a table together for the fill split and
 * for any later page-granular pinning (cudaHostRegister) of one table. */
#define SEG_ALIGN 4096u

struct engram_service {
    bool have_win;
    MPI_Win win;
    struct comm *node;          /* topo's node comm (not owned) */
    uint8_t *base;              /* node rank 0's segment, mapped in this rank */
    uint64_t bytes;             /* whole segment */
    uint64_t own_mask;          /* tables of the layers this rank's stage runs */
    int n_engram;
    int layer[CFG_MAX_LIST];    /* engram_layer_ids */
    int64_t rows[CFG_MAX_LIST];
    uint64_t table_off[CFG_MAX_LIST], scale_off[CFG_MAX_LIST]; /* valid for node-held tables */
};

static uint64_t g_mem_limit; /* 0 = physical memory */

void engram_service_set_memory_limit(uint64_t bytes) { g_mem_limit = bytes; }

static uint64_t align_up(uint64_t x) { return (x + SEG_ALIGN - 1) / SEG_ALIGN * SEG_ALIGN; }

uint64_t engram_service_layer_mask(const struct model_config *cfg, int layer_begin, int layer_end) {
    uint64_t m = 0;
    for (int i = 0; i < cfg->n_engram && i < 64; i++) {
        int l = cfg->engram_layer_ids[i];
        if (l >= layer_begin && l < layer_end) m |= (uint64_t)1 << i;
    }
    return m;
}

static uint64_t table_bytes(const struct model_config *cfg, int i) {
    return (uint64_t)cfg->engram_num_embeddings[i] * (uint64_t)cfg->engram_head_dim;
}

static uint64_t scale_bytes(const struct model_config *cfg, int i) {
    return (uint64_t)cfg->engram_num_embeddings[i] * (uint64_t)(cfg->engram_head_dim / 32);
}

/* Offsets of every table in `mask`, in engram_layer_ids order; returns the segment size. */
static uint64_t layout(const struct model_config *cfg, uint64_t mask, uint64_t *toff, uint64_t *soff) {
    uint64_t off = 0;
    for (int i = 0; i < cfg->n_engram && i < 64; i++) {
        if (!(mask >> i & 1)) continue;
        if (toff) toff[i] = off;
        off = align_up(off + table_bytes(cfg, i));
        if (soff) soff[i] = off;
        off = align_up(off + scale_bytes(cfg, i));
    }
    return off;
}

uint64_t engram_service_layout_bytes(const struct model_config *cfg, uint64_t mask) {
    return layout(cfg, mask, NULL, NULL);
}

static uint64_t node_memory(const char **what) {
    if (g_mem_limit) {
        *what = "the Engram service limit";
        return g_mem_limit;
    }
    long pages, page;
    CHECK_LIBC(pages = sysconf(_SC_PHYS_PAGES));
    CHECK_LIBC(page = sysconf(_SC_PAGESIZE));
    *what = "physical memory";
    return (uint64_t)pages * (uint64_t)page;
}

static void layer_list(const struct model_config *cfg, uint64_t mask, char *buf, size_t n) {
    size_t off = 0;
    buf[0] = 0;
    for (int i = 0; i < cfg->n_engram && i < 64 && off < n; i++)
        if (mask >> i & 1) off += (size_t)snprintf(buf + off, n - off, "%s%d", off ? "," : "", cfg->engram_layer_ids[i]);
}

/* The checkpoint tensor `name`, required to be F8 dtype [rows, cols]; NULL with the error set. */
static const struct st_tensor *find_table(const struct loaded_model *lm, const char *name, enum st_dtype dt,
                                          int64_t rows, int64_t cols) {
    const struct st_tensor *t = st_find(&lm->st, name);
    if (!t) {
        ds_err_set("%s: engram service: missing tensor %s", lm->dir, name);
        return NULL;
    }
    if (t->dtype != dt || t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols) {
        ds_err_set("%s: engram service: tensor %s is not %s [%lld, %lld]", lm->st.shard_paths[t->shard], name,
                   st_dtype_name(dt), (long long)rows, (long long)cols);
        return NULL;
    }
    return t;
}

/* One piece of the fill: checkpoint bytes to a segment offset. */
struct piece {
    const uint8_t *src;
    uint64_t off, len;
};

/* Copy this rank's share of the pieces: the part of them inside segment bytes
 * [bytes*r/n, bytes*(r+1)/n), both ends cut down to a page, so no two ranks write the same page. */
static void fill_share(uint8_t *base, uint64_t bytes, const struct piece *p, int np, int r, int n) {
    uint64_t lo = bytes / (uint64_t)n * (uint64_t)r / SEG_ALIGN * SEG_ALIGN;
    uint64_t hi = r == n - 1 ? bytes : bytes / (uint64_t)n * (uint64_t)(r + 1) / SEG_ALIGN * SEG_ALIGN;
    for (int i = 0; i < np; i++) {
        uint64_t a = p[i].off > lo ? p[i].off : lo, b = p[i].off + p[i].len < hi ? p[i].off + p[i].len : hi;
        if (a < b) memcpy(base + a, p[i].src + (a - p[i].off), (size_t)(b - a));
    }
}

struct engram_service *engram_service_new(const struct topo *t, struct loaded_model *lm) {
    const struct model_config *cfg = &lm->cfg;
    struct comm *nc = t->node_comm;
    if (cfg->n_engram > 64) {
        ds_err_set("%s: engram service: %d Engram layers (at most 64 supported)", cfg->source, cfg->n_engram);
        return NULL;
    }
    struct engram_service *s = ds_calloc(1, sizeof *s);
    s->node = nc;
    s->n_engram = cfg->n_engram;
    for (int i = 0; i < cfg->n_engram; i++) {
        s->layer[i] = cfg->engram_layer_ids[i];
        s->rows[i] = cfg->engram_num_embeddings[i];
    }
    s->own_mask = engram_service_layer_mask(cfg, t->layer_begin[t->pp_rank], t->layer_end[t->pp_rank]);

    /* The node holds the union of its ranks' stages (stages may share a node). This allgather is
     * also the presence check: a missing rank ends here under the watchdog, before the window. */
    uint64_t *masks = ds_malloc((size_t)nc->size * sizeof *masks), node_mask = 0;
    nc->ops->allgather(nc, &s->own_mask, masks, sizeof *masks, "engram service: layers per rank");
    for (int r = 0; r < nc->size; r++) node_mask |= masks[r];
    free(masks);
    s->bytes = layout(cfg, node_mask, s->table_off, s->scale_off);
    if (!node_mask) return s; /* nothing to hold on this node: no window, nothing collective left */

    /* Every check below depends only on the config, the checkpoint and the node, so every rank of
     * the node fails the same way, and before anything is allocated. */
    char layers[256];
    layer_list(cfg, node_mask, layers, sizeof layers);
    const char *mem_what;
    uint64_t mem = node_memory(&mem_what);
    if (s->bytes > mem) {
        ds_err_set("engram service: node %s: the Engram tables of layer%s %s need %llu bytes (%.2f GB) but %s is "
                   "%llu bytes (%.2f GB)",
                   t->host, strchr(layers, ',') ? "s" : "", layers, (unsigned long long)s->bytes, (double)s->bytes / 1e9,
                   mem_what, (unsigned long long)mem, (double)mem / 1e9);
        free(s);
        return NULL;
    }
    struct piece pieces[2 * CFG_MAX_LIST];
    int np = 0;
    for (int i = 0; i < cfg->n_engram; i++) {
        if (!(node_mask >> i & 1)) continue;
        int64_t hd = cfg->engram_head_dim;
        char name[128];
        snprintf(name, sizeof name, "layers.%d.engram.embed.weight", s->layer[i]);
        const struct st_tensor *w = find_table(lm, name, ST_F8_E4M3, s->rows[i], hd);
        snprintf(name, sizeof name, "layers.%d.engram.embed.scale", s->layer[i]);
        const struct st_tensor *sc = w ? find_table(lm, name, ST_F8_E8M0, s->rows[i], hd / 32) : NULL;
        if (!sc) {
            free(s);
            return NULL;
        }
        pieces[np++] = (struct piece){w->data, s->table_off[i], table_bytes(cfg, i)};
        pieces[np++] = (struct piece){sc->data, s->scale_off[i], scale_bytes(cfg, i)};
    }

    double t0 = MPI_Wtime();
    MPI_Comm mc = comm_mpi_handle(nc);
    void *mine = NULL;
    /* disp_unit 1: offsets are bytes. Only node rank 0 contributes, so the segment is contiguous. */
    CHECK_MPI(MPI_Win_allocate_shared(nc->rank == 0 ? (MPI_Aint)s->bytes : 0, 1, MPI_INFO_NULL, mc, &mine, &s->win));
    s->have_win = true;
    CHECK_MPI(MPI_Win_set_errhandler(s->win, MPI_ERRORS_RETURN));
    MPI_Aint qsize = 0;
    int qdisp = 0;
    void *q = NULL;
    CHECK_MPI(MPI_Win_shared_query(s->win, 0, &qsize, &qdisp, &q));
    if ((uint64_t)qsize < s->bytes || !q)
        ds_fatal(__FILE__, __LINE__, __func__, "MPI", "MPI_Win_shared_query(win, 0, ...)",
                 "node rank 0's segment is smaller than requested");
    s->base = q;
    /* One passive epoch for the service's lifetime: MPI_Win_sync is only defined inside one. */
    CHECK_MPI(MPI_Win_lock_all(MPI_MODE_NOCHECK, s->win));
    fill_share(s->base, s->bytes, pieces, np, nc->rank, nc->size);
    CHECK_MPI(MPI_Win_sync(s->win));
    nc->ops->barrier(nc, "engram service: tables filled");
    CHECK_MPI(MPI_Win_sync(s->win));
    if (nc->rank == 0)
        log_info("engram service: node %s holds the tables of layer%s %s: %llu bytes (%.2f GB), filled by %d rank%s "
                 "in %.2f s",
                 t->host, strchr(layers, ',') ? "s" : "", layers, (unsigned long long)s->bytes, (double)s->bytes / 1e9,
                 nc->size, nc->size == 1 ? "" : "s", MPI_Wtime() - t0);
    return s;
}

const uint8_t *engram_service_table(const struct engram_service *s, int layer, const uint8_t **scale, int64_t *rows) {
    if (scale) *scale = NULL;
    if (rows) *rows = 0;
    if (!s || !s->have_win) return NULL;
    for (int i = 0; i < s->n_engram; i++) {
        if (s->layer[i] != layer || !(s->own_mask >> i & 1)) continue;
        if (scale) *scale = s->base + s->scale_off[i];
        if (rows) *rows = s->rows[i];
        return s->base + s->table_off[i];
    }
    return NULL;
}

uint64_t engram_service_bytes(const struct engram_service *s) { return s ? s->bytes : 0; }

void engram_service_free(struct engram_service *s) {
    if (!s) return;
    if (s->have_win) {
        /* no rank may still be reading when node rank 0's segment goes away */
        s->node->ops->barrier(s->node, "engram service: free");
        CHECK_MPI(MPI_Win_unlock_all(s->win));
        CHECK_MPI(MPI_Win_free(&s->win));
    }
    free(s);
}
