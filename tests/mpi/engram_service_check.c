/* MPI check of mpi/engram_service.c, run under mpirun by tests/cli/test_engram_service.sh.
 *
 *   engram_service_check MODEL_DIR TP PP               build the service and check it
 *   engram_service_check MODEL_DIR TP PP limit BYTES   cap the node memory at BYTES: the service
 *                                                      must refuse, naming the bytes, on every rank
 *
 * Each rank loads the model the engine's way (loader_open_config, topo_init, loader_bind for its
 * slice), builds the service and checks: every row of every Engram table its stage runs equals the
 * checkpoint's bytes (table and scale), and is a copy, not the checkpoint's own mmap; a rank asks
 * in vain for layers its stage does not run; the node's byte count is the documented layout and
 * the same on every rank of the node; every rank holding a table sees the same contents, through
 * the same physical memory (the mapping's device, inode and file offset in /proc/self/maps, so a
 * private copy per rank cannot pass). Rank 0 prints "N passed, N failed" summed with MPI_Reduce. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mpi.h>

#include "comm_mpi.h"
#include "engram_service.h"
#include "loader.h"
#include "log.h"
#include "topo.h"

#include "mpi/mpi_check.h"

static uint64_t fnv(uint64_t h, const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

/* Where the byte at p lives: the mapping's device and inode and the byte's offset in that file.
 * Ranks sharing the memory agree; a private anonymous copy has inode 0. */
struct backing {
    uint64_t present, dev_major, dev_minor, inode, file_off;
};

static struct backing backing_of(const void *p) {
    struct backing b = {0};
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f) return b;
    char line[1024];
    uintptr_t a = (uintptr_t)p;
    while (fgets(line, sizeof line, f)) {
        unsigned long long lo, hi, off, ino;
        unsigned maj, min;
        char perms[8];
        if (sscanf(line, "%llx-%llx %7s %llx %x:%x %llu", &lo, &hi, perms, &off, &maj, &min, &ino) != 7) continue;
        if (a < lo || a >= hi) continue;
        b = (struct backing){1, maj, min, ino, off + (a - lo)};
        break;
    }
    fclose(f);
    return b;
}

static int64_t expected_node_bytes(const struct model_config *c, uint64_t mask) {
    int64_t sum = 0;
    for (int i = 0; i < c->n_engram; i++) {
        if (!(mask >> i & 1)) continue;
        int64_t t = c->engram_num_embeddings[i] * c->engram_head_dim, s = t / 32;
        sum += (t + 4095) / 4096 * 4096 + (s + 4095) / 4096 * 4096;
    }
    return sum;
}

static void check_service(const struct topo *t, struct loaded_model *lm, const struct engram_service *s) {
    const struct model_config *c = &lm->cfg;
    struct comm *nc = t->node_comm;
    int b = t->layer_begin[t->pp_rank], e = t->layer_end[t->pp_rank];
    int64_t hd = c->engram_head_dim;

    /* node bytes: same everywhere on the node, and the documented layout of the stages present */
    int *stages = malloc((size_t)nc->size * sizeof *stages);
    nc->ops->allgather(nc, &t->pp_rank, stages, sizeof(int), "stages on the node");
    uint64_t mask = 0;
    for (int r = 0; r < nc->size; r++)
        mask |= engram_service_layer_mask(c, t->layer_begin[stages[r]], t->layer_end[stages[r]]);
    free(stages);
    uint64_t bytes = engram_service_bytes(s), *all = malloc((size_t)nc->size * sizeof *all);
    nc->ops->allgather(nc, &bytes, all, sizeof bytes, "service bytes");
    int same = 1;
    for (int r = 0; r < nc->size; r++) same &= all[r] == bytes;
    free(all);
    CHECK(same, "engram_service_bytes differs between the ranks of node %s", t->host);
    CHECK((int64_t)bytes == expected_node_bytes(c, mask), "node holds %" PRIu64 " bytes, layout says %" PRId64, bytes,
          expected_node_bytes(c, mask));

    /* Per Engram layer: rows equal to the checkpoint on the stage that runs it, nothing elsewhere. */
    uint64_t h = 1469598103934665603ull;
    struct backing mine = {0};
    for (int i = 0; i < c->n_engram; i++) {
        int l = c->engram_layer_ids[i];
        const uint8_t *scale = (const uint8_t *)1;
        int64_t rows = -1;
        const uint8_t *tbl = engram_service_table(s, l, &scale, &rows);
        if (l < b || l >= e) {
            CHECK(!tbl && !scale && rows == 0, "layer %d is not on stage %d but the service returned %p rows %" PRId64,
                  l, t->pp_rank, (const void *)tbl, rows);
            continue;
        }
        CHECK(tbl && scale, "layer %d: no table on stage %d", l, t->pp_rank);
        if (!tbl || !scale) continue;
        CHECK(rows == c->engram_num_embeddings[i], "layer %d: %" PRId64 " rows, config says %" PRId64, l, rows,
              c->engram_num_embeddings[i]);
        char name[128];
        snprintf(name, sizeof name, "layers.%d.engram.embed.weight", l);
        const struct st_tensor *w = st_find(&lm->st, name);
        snprintf(name, sizeof name, "layers.%d.engram.embed.scale", l);
        const struct st_tensor *sc = st_find(&lm->st, name);
        CHECK(w && sc, "layer %d: checkpoint tensors missing", l);
        if (!w || !sc) continue;
        CHECK((const void *)tbl != w->data && (const void *)scale != sc->data,
              "layer %d: the service hands out the checkpoint's mmap, not its own copy", l);
        int64_t bad = 0, first = -1, n = rows < c->engram_num_embeddings[i] ? rows : c->engram_num_embeddings[i];
        const uint8_t *wd = w->data, *sd = sc->data;
        for (int64_t r = 0; r < n; r++) {
            if (memcmp(tbl + r * hd, wd + r * hd, (size_t)hd) || memcmp(scale + r * (hd / 32), sd + r * (hd / 32), (size_t)(hd / 32))) {
                bad++;
                if (first < 0) first = r;
            }
        }
        CHECK(bad == 0, "layer %d: %" PRId64 " of %" PRId64 " rows differ from the checkpoint (first: row %" PRId64 ")", l,
              bad, n, first);
        h = fnv(fnv(h, tbl, (size_t)(rows * hd)), scale, (size_t)(rows * (hd / 32)));
        if (!mine.present) mine = backing_of(tbl);
    }
    const uint8_t *none = engram_service_table(s, -1, NULL, NULL);
    CHECK(!none, "layer -1 has a table");
    if (c->n_layers > 0 && c->role[0].engram_idx < 0)
        CHECK(!engram_service_table(s, 0, NULL, NULL), "layer 0 (no Engram) has a table");

    /* Contents and physical memory: the same on every rank of the node that holds tables. */
    struct rec {
        uint64_t has, hash;
        struct backing where;
    } me = {mine.present, h, mine}, *recs = malloc((size_t)nc->size * sizeof *recs);
    nc->ops->allgather(nc, &me, recs, sizeof me, "contents");
    int holders = 0, same_bytes = 1, same_mem = 1;
    const struct rec *ref = NULL;
    for (int r = 0; r < nc->size; r++) {
        if (!recs[r].has) continue;
        holders++;
        if (!ref) ref = &recs[r];
        same_bytes &= recs[r].hash == ref->hash;
        same_mem &= recs[r].where.present && recs[r].where.inode != 0 && recs[r].where.dev_major == ref->where.dev_major &&
                    recs[r].where.dev_minor == ref->where.dev_minor && recs[r].where.inode == ref->where.inode &&
                    recs[r].where.file_off == ref->where.file_off;
    }
    if (me.has) {
        CHECK(same_bytes, "node %s: the %d ranks holding tables see different contents", t->host, holders);
        /* one holder alone may get private memory (Open MPI does): nothing to share with */
        if (holders > 1)
            CHECK(same_mem, "node %s: the %d ranks holding tables do not map the same memory (inode %" PRIu64 ")",
                  t->host, holders, me.where.inode);
    }
    free(recs);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    if (argc != 4 && !(argc == 6 && !strcmp(argv[4], "limit"))) {
        if (g_rank == 0) fprintf(stderr, "usage: engram_service_check MODEL_DIR TP PP [limit BYTES]\n");
        MPI_Finalize();
        return 2;
    }
    double t_start = MPI_Wtime();
    struct loaded_model *lm = calloc(1, sizeof *lm);
    if (loader_open_config(lm, argv[1])) ds_die_err();
    struct topo t;
    if (topo_init(&t, &lm->cfg, atoi(argv[2]), atoi(argv[3]), NULL)) ds_die_err();
    struct bind_opts o = {.tp_rank = t.tp_rank, .tp_size = t.tp, .layer_begin = t.layer_begin[t.pp_rank],
                          .layer_end = t.layer_end[t.pp_rank], .first_stage = t.pp_rank == 0,
                          .last_stage = t.pp_rank == t.pp - 1};
    if (loader_bind(lm, &o)) ds_die_err();
    double t_loaded = MPI_Wtime();

    bool limit_mode = argc == 6;
    if (limit_mode) engram_service_set_memory_limit(strtoull(argv[5], NULL, 10));
    struct engram_service *s = engram_service_new(&t, lm);
    double t_service = MPI_Wtime();
    double dt = t_service - t_loaded, dt_max = 0;
    CHECK_MPI(MPI_Reduce(&dt, &dt_max, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD));

    uint64_t node_bytes = engram_service_bytes(s);
    if (limit_mode) {
        /* the refusal must come before any allocation, on every rank of a node that has tables */
        uint64_t mask = engram_service_layer_mask(&lm->cfg, t.layer_begin[0], t.layer_end[0]);
        uint64_t need = engram_service_layout_bytes(&lm->cfg, mask);
        char want[64];
        snprintf(want, sizeof want, "need %" PRIu64 " bytes", need);
        CHECK(!s, "the service was built although the limit is %s bytes", argv[5]);
        CHECK(s || strstr(ds_err_get(), want), "error '%s' does not say '%s'", ds_err_get(), want);
        if (g_rank == 0) printf("refused: %s\n", s ? "(not refused)" : ds_err_get());
    } else {
        CHECK(s != NULL, "engram_service_new failed: %s", ds_err_get());
        if (s) check_service(&t, lm, s);
    }

    int mine[2] = {g_pass, g_fail}, sum[2] = {0, 0};
    CHECK_MPI(MPI_Reduce(mine, sum, 2, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD));
    if (g_rank == 0) {
        if (!limit_mode)
            printf("node %s: engram service holds %" PRIu64 " bytes; load %.2f s, service %.3f s (slowest rank)\n",
                   t.host, node_bytes, t_loaded - t_start, dt_max);
        printf("%d passed, %d failed\n", sum[0], sum[1]);
        fflush(stdout);
    }
    int failed = sum[1] > 0;
    CHECK_MPI(MPI_Bcast(&failed, 1, MPI_INT, 0, MPI_COMM_WORLD));
    engram_service_free(s);
    loader_close(lm);
    free(lm);
    topo_free(&t);
    MPI_Finalize();
    return failed ? 1 : 0;
}
