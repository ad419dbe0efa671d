/* MPI check of mpi/topo.c and mpi/comm_mpi.c, run under mpirun by tests/cli/test_mpi.sh.
 *
 *   mpi_comm_check TP PP [CONFIG] [DEADLINE]   layout, sub-communicators and every comm op
 *   mpi_comm_check kill SECONDS [CONFIG]       rank 3 dies (SIGKILL) while the others reduce
 *   mpi_comm_check hang SECONDS [CONFIG]       rank 3 stays alive but never joins: the watchdog
 *
 * CONFIG defaults to $GOLDEN/tp8pp2/config.json (GOLDEN defaults to ../shared/golden).
 * Each rank counts its own passed and failed checks and prints every failure with its rank; rank
 * 0 prints "N passed, N failed" summed over the world. The data of the reductions is chosen so
 * that summing in any other order than rank order gives different fp32 bits (checked too), so a
 * backend that reduced in tree order could not pass by luck. */
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <mpi.h>

#include "comm_mpi.h"
#include "config.h"
#include "formats.h"
#include "log.h"
#include "topo.h"

#include "mpi/mpi_check.h"

/* ------------------------------------------------------------------------------------------------
 * Groups: which world rank is member r of each sub-communicator (from the documented layout) */

enum group { G_WORLD, G_TP, G_PP, G_DP, G_COUNT };
static const char *const group_names[G_COUNT] = {"world", "tp", "pp", "dp"};

static struct comm *group_comm(const struct topo *t, enum group g) {
    switch (g) {
    case G_WORLD: return t->world;
    case G_TP: return t->tp_comm;
    case G_PP: return t->pp_comm;
    case G_DP: return t->dp_comm;
    default: return NULL;
    }
}

static int member(const struct topo *t, enum group g, int r) {
    switch (g) {
    case G_WORLD: return r;
    case G_TP: return (t->dp_rank * t->pp + t->pp_rank) * t->tp + r;
    case G_PP: return (t->dp_rank * t->pp + r) * t->tp + t->tp_rank;
    case G_DP: return (r * t->pp + t->pp_rank) * t->tp + t->tp_rank;
    default: return -1;
    }
}

/* ------------------------------------------------------------------------------------------------
 * Known per-rank data */


static bf16_t bf16_value(int world_rank, size_t i) { return bf16_from_f32(f32_value(world_rank + 1000, i)); }
static uint8_t u8_value(int world_rank, size_t i) { return (uint8_t)(world_rank * 37 + (int)i * 11 + 200); }
static uint8_t byte_value(int world_rank, size_t i) { return (uint8_t)mix32((uint32_t)world_rank * 7919u + (uint32_t)i); }

static uint64_t fnv(const void *p, size_t n) {
    const uint8_t *b = p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* Every rank of the group holds the same bytes. */
static void check_same_everywhere(struct comm *c, const void *buf, size_t n, const char *label) {
    uint64_t h = fnv(buf, n), *all = malloc((size_t)c->size * sizeof *all);
    c->ops->allgather(c, &h, all, sizeof h, "checksum");
    int same = 1;
    for (int r = 0; r < c->size; r++) same &= all[r] == h;
    CHECK(same, "%s: result differs between the ranks of the group", label);
    free(all);
}

/* ------------------------------------------------------------------------------------------------
 * Checks */

static void check_layout(const struct topo *t, int want_tp, int want_pp, const struct model_config *cfg) {
    int world, rank;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    CHECK(t->world_size == world && t->world_rank == rank, "world %d/%d, MPI says %d/%d", t->world_rank,
          t->world_size, rank, world);
    if (want_tp) CHECK(t->tp == want_tp, "tp %d, asked %d", t->tp, want_tp);
    if (want_pp) CHECK(t->pp == want_pp, "pp %d, asked %d", t->pp, want_pp);
    if (!want_tp && !want_pp && world == 16) CHECK(t->tp == 8 && t->pp == 2, "default layout %dx%d, want 8x2", t->tp, t->pp);
    CHECK(t->tp * t->pp * t->dp == world, "tp %d x pp %d x dp %d != world %d", t->tp, t->pp, t->dp, world);
    CHECK(rank == (t->dp_rank * t->pp + t->pp_rank) * t->tp + t->tp_rank, "rank %d != (dp %d * pp %d + stage %d) * tp %d + %d",
          rank, t->dp_rank, t->pp, t->pp_rank, t->tp, t->tp_rank);
    CHECK(t->tp_rank == rank % t->tp && t->pp_rank == rank / t->tp % t->pp && t->dp_rank == rank / (t->tp * t->pp),
          "coordinates (dp %d, pp %d, tp %d)", t->dp_rank, t->pp_rank, t->tp_rank);
    /* stage layers: contiguous, covering the backbone; the golden tp8pp2 model splits at 4 */
    CHECK(t->layer_begin[0] == 0 && t->layer_end[t->pp - 1] == cfg->n_layers, "stages cover %d..%d of %d",
          t->layer_begin[0], t->layer_end[t->pp - 1], cfg->n_layers);
    for (int s = 1; s < t->pp; s++)
        CHECK(t->layer_begin[s] == t->layer_end[s - 1], "stage %d begins at %d, stage %d ends at %d", s,
              t->layer_begin[s], s - 1, t->layer_end[s - 1]);
    if (t->pp == 2 && cfg->n_layers == 8) CHECK(t->layer_begin[1] == 4, "tp8pp2 split at %d, want 4", t->layer_begin[1]);

    int sizes[G_COUNT] = {world, t->tp, t->pp, t->dp}, ranks[G_COUNT] = {rank, t->tp_rank, t->pp_rank, t->dp_rank};
    for (int g = 0; g < G_COUNT; g++) {
        struct comm *c = group_comm(t, (enum group)g);
        CHECK(c->size == sizes[g] && c->rank == ranks[g], "%s comm: rank %d of %d, want %d of %d", group_names[g],
              c->rank, c->size, ranks[g], sizes[g]);
        /* membership: gather the world ranks and compare with the formula */
        int *who = malloc((size_t)c->size * sizeof *who);
        c->ops->allgather(c, &rank, who, sizeof rank, "membership");
        int ok = 1;
        for (int r = 0; r < c->size; r++) ok &= who[r] == member(t, (enum group)g, r);
        CHECK(ok, "%s comm: members are not the ranks the layout formula gives", group_names[g]);
        free(who);
    }

    /* node: every rank with our host name, ordered by world rank; device = node-local rank */
    char(*hosts)[64] = malloc((size_t)world * sizeof *hosts);
    char mine[64];
    snprintf(mine, sizeof mine, "%s", t->host);
    t->world->ops->allgather(t->world, mine, hosts, sizeof mine, "hosts");
    int same_host = 0, before = 0;
    for (int r = 0; r < world; r++) {
        if (strcmp(hosts[r], mine) == 0) {
            same_host++;
            if (r < rank) before++;
        }
    }
    CHECK(t->node_size == same_host && t->node_comm->size == same_host, "node size %d, %d ranks share host %s",
          t->node_size, same_host, mine);
    CHECK(t->node_rank == before, "node rank %d, want %d", t->node_rank, before);
    CHECK(t->device == t->node_rank, "device %d, node rank %d", t->device, t->node_rank);
    free(hosts);
}

static void check_allgather(const struct topo *t, enum group g, size_t bytes, int in_place) {
    struct comm *c = group_comm(t, g);
    uint8_t *send = malloc(bytes), *recv = malloc(bytes * (size_t)c->size);
    for (size_t i = 0; i < bytes; i++) send[i] = byte_value(t->world_rank, i);
    memset(recv, 0xee, bytes * (size_t)c->size);
    if (in_place) {
        memcpy(recv + (size_t)c->rank * bytes, send, bytes);
        c->ops->allgather(c, recv + (size_t)c->rank * bytes, recv, bytes, "allgather in place");
    } else {
        c->ops->allgather(c, send, recv, bytes, "allgather");
    }
    size_t bad = 0;
    for (int r = 0; r < c->size; r++)
        for (size_t i = 0; i < bytes; i++) bad += recv[(size_t)r * bytes + i] != byte_value(member(t, g, r), i);
    CHECK(bad == 0, "%s allgather%s of %zu bytes: %zu wrong bytes", group_names[g], in_place ? " (in place)" : "",
          bytes, bad);
    free(send);
    free(recv);
}

/* Block d of rank s's send is marked (s, d): member d must receive (s, d) in its block s. */
static void check_alltoall(const struct topo *t, enum group g, size_t bytes) {
    struct comm *c = group_comm(t, g);
    size_t all = bytes * (size_t)c->size;
    uint8_t *send = malloc(all + 1), *recv = malloc(all + 1);
    for (int r = 0; r < c->size; r++)
        for (size_t i = 0; i < bytes; i++) send[(size_t)r * bytes + i] = byte_value(t->world_rank * 1009 + r, i);
    memset(recv, 0xee, all);
    c->ops->alltoall(c, send, recv, bytes, "alltoall");
    size_t bad = 0;
    for (int r = 0; r < c->size; r++)
        for (size_t i = 0; i < bytes; i++)
            bad += recv[(size_t)r * bytes + i] != byte_value(member(t, g, r) * 1009 + c->rank, i);
    CHECK(bad == 0, "%s alltoall of %zu bytes a pair: %zu wrong bytes", group_names[g], bytes, bad);
    free(send);
    free(recv);
}

static void check_allreduce(const struct topo *t, enum group g, size_t n) {
    struct comm *c = group_comm(t, g);
    int size = c->size;
    char label[64];

    /* F32: rank-order fp32 sum; and that the data tells orders apart (needs 3+ ranks, since
     * a + b == b + a exactly) */
    float *f = malloc(n * sizeof *f);
    for (size_t i = 0; i < n; i++) f[i] = f32_value(t->world_rank, i);
    c->ops->allreduce_sum(c, f, n, COMM_F32, "check f32");
    size_t bad = 0, order_differs = 0;
    for (size_t i = 0; i < n; i++) {
        float fwd = f32_value(member(t, g, 0), i), rev = f32_value(member(t, g, size - 1), i);
        for (int r = 1; r < size; r++) fwd += f32_value(member(t, g, r), i);
        for (int r = size - 2; r >= 0; r--) rev += f32_value(member(t, g, r), i);
        bad += memcmp(&fwd, &f[i], sizeof fwd) != 0;
        order_differs += memcmp(&fwd, &rev, sizeof fwd) != 0;
    }
    CHECK(bad == 0, "%s allreduce f32 (%zu): %zu elements differ from the rank-order fp32 sum", group_names[g], n, bad);
    if (size >= 3 && n > 0)
        CHECK(order_differs > 0, "%s f32 test data does not distinguish rank order from reverse order", group_names[g]);
    snprintf(label, sizeof label, "%s allreduce f32", group_names[g]);
    check_same_everywhere(c, f, n * sizeof *f, label);
    free(f);

    /* BF16: widened, summed in fp32 in rank order, rounded once; rounding after every add differs */
    bf16_t *h = malloc(n * sizeof *h);
    for (size_t i = 0; i < n; i++) h[i] = bf16_value(t->world_rank, i);
    c->ops->allreduce_sum(c, h, n, COMM_BF16, "check bf16");
    size_t rounding_differs = 0;
    bad = 0;
    for (size_t i = 0; i < n; i++) {
        float acc = bf16_to_f32(bf16_value(member(t, g, 0), i)), stepwise = acc;
        for (int r = 1; r < size; r++) {
            acc += bf16_to_f32(bf16_value(member(t, g, r), i));
            stepwise = bf16_round(stepwise + bf16_to_f32(bf16_value(member(t, g, r), i)));
        }
        bad += h[i] != bf16_from_f32(acc);
        rounding_differs += bf16_from_f32(acc) != bf16_from_f32(stepwise);
    }
    CHECK(bad == 0, "%s allreduce bf16 (%zu): %zu elements differ from fp32-sum-then-round", group_names[g], n, bad);
    if (size >= 3 && n > 0)
        CHECK(rounding_differs > 0, "%s bf16 test data does not distinguish one rounding from per-step rounding",
              group_names[g]);
    snprintf(label, sizeof label, "%s allreduce bf16", group_names[g]);
    check_same_everywhere(c, h, n * sizeof *h, label);
    free(h);

    /* integers: exact (u8 wraps modulo 256) */
    int64_t *q = malloc(n * sizeof *q);
    int32_t *w = malloc(n * sizeof *w);
    uint8_t *u = malloc(n);
    for (size_t i = 0; i < n; i++) {
        q[i] = i64_value(t->world_rank, i);
        w[i] = i32_value(t->world_rank, i);
        u[i] = u8_value(t->world_rank, i);
    }
    c->ops->allreduce_sum(c, q, n, COMM_I64, "check i64");
    c->ops->allreduce_sum(c, w, n, COMM_I32, "check i32");
    c->ops->allreduce_sum(c, u, n, COMM_U8, "check u8");
    size_t bq = 0, bw = 0, bu = 0;
    for (size_t i = 0; i < n; i++) {
        int64_t eq = 0, ew = 0;
        unsigned eu = 0;
        for (int r = 0; r < size; r++) {
            eq += i64_value(member(t, g, r), i);
            ew += i32_value(member(t, g, r), i);
            eu += u8_value(member(t, g, r), i);
        }
        bq += q[i] != eq;
        bw += w[i] != (int32_t)ew;
        bu += u[i] != (uint8_t)eu;
    }
    CHECK(bq == 0, "%s allreduce i64: %zu wrong", group_names[g], bq);
    CHECK(bw == 0, "%s allreduce i32: %zu wrong", group_names[g], bw);
    CHECK(bu == 0, "%s allreduce u8: %zu wrong", group_names[g], bu);
    free(q);
    free(w);
    free(u);
}

static void check_bcast(const struct topo *t, enum group g, size_t bytes) {
    struct comm *c = group_comm(t, g);
    int root = c->size - 1, root_world = member(t, g, root);
    uint8_t *b = malloc(bytes);
    for (size_t i = 0; i < bytes; i++) b[i] = c->rank == root ? byte_value(root_world, i) : 0;
    c->ops->bcast(c, b, bytes, root, "check bcast");
    size_t bad = 0;
    for (size_t i = 0; i < bytes; i++) bad += b[i] != byte_value(root_world, i);
    CHECK(bad == 0, "%s bcast of %zu bytes from %d: %zu wrong bytes", group_names[g], bytes, root, bad);
    free(b);
}

/* Along the pp pair: stage s receives from s-1 and sends to s+1, then the same backwards. */
static void check_sendrecv(const struct topo *t, size_t bytes) {
    struct comm *c = t->pp_comm;
    uint8_t *b = malloc(bytes);
    for (int dir = 0; dir < 2; dir++) {
        int prev = dir == 0 ? c->rank - 1 : c->rank + 1, next = dir == 0 ? c->rank + 1 : c->rank - 1, tag = 7 + dir;
        if (prev >= 0 && prev < c->size) {
            memset(b, 0, bytes);
            c->ops->recv(c, b, bytes, prev, tag, "check recv");
            int from = member(t, G_PP, prev);
            size_t bad = 0;
            for (size_t i = 0; i < bytes; i++) bad += b[i] != byte_value(from + 100 * tag, i);
            CHECK(bad == 0, "recv %zu bytes from pp stage %d (%s): %zu wrong bytes", bytes, prev,
                  dir ? "backward" : "forward", bad);
        }
        if (next >= 0 && next < c->size) {
            for (size_t i = 0; i < bytes; i++) b[i] = byte_value(t->world_rank + 100 * tag, i);
            c->ops->send(c, b, bytes, next, tag, "check send");
        }
    }
    free(b);
}

static void check_ops(const struct topo *t) {
    /* the unnamed constructor: a duplicate of the world under MPI's own name for it */
    struct comm *w = comm_mpi_new(MPI_COMM_WORLD);
    CHECK(w->size == t->world_size && w->rank == t->world_rank, "comm_mpi_new(world): rank %d of %d", w->rank,
          w->size);
    CHECK(comm_mpi_handle(w) != MPI_COMM_WORLD, "comm_mpi_new did not duplicate the communicator");
    int64_t one = 1;
    w->ops->allreduce_sum(w, &one, 1, COMM_I64, "count ranks");
    CHECK(one == t->world_size, "i64 sum of ones over the world: %lld", (long long)one);
    w->ops->free(w);

    for (int g = 0; g < G_COUNT; g++) {
        check_allgather(t, (enum group)g, 37, 0);
        check_allgather(t, (enum group)g, 37, 1);
        check_alltoall(t, (enum group)g, 37);
        check_allreduce(t, (enum group)g, 1000);
        check_bcast(t, (enum group)g, 4099);
        group_comm(t, (enum group)g)->ops->barrier(group_comm(t, (enum group)g), "check barrier");
    }
    check_sendrecv(t, 40960 + 16); /* the PP message of one token of the real model */
    check_sendrecv(t, 0);
    check_allreduce(t, G_WORLD, 0);

    /* The pieced paths (> INT_MAX bytes, > 64 MiB temporaries) on small buffers: lower the limits
     * so every transfer goes in several pieces, then check the same results. */
    comm_mpi_set_chunk_limits(1000, 4096);
    check_allgather(t, G_TP, 2500, 0);
    check_allgather(t, G_WORLD, 2500, 1);
    check_alltoall(t, G_TP, 2500);
    check_alltoall(t, G_WORLD, 2500);
    check_allreduce(t, G_WORLD, 3001);
    check_allreduce(t, G_TP, 777);
    check_bcast(t, G_WORLD, 2500);
    check_sendrecv(t, 2500);
    comm_mpi_set_chunk_limits(0, 0);
}

static void check_rank_table(struct topo *t) {
    /* odd ranks pretend to be CPU ranks so the "cpu" spelling is exercised */
    int device = t->device;
    if (t->world_rank % 2) t->device = -1;
    char *table = topo_rank_table(t);
    t->device = device;
    if (t->world_rank != 0) {
        CHECK(table == NULL, "rank table returned on rank %d", t->world_rank);
        free(table);
        return;
    }
    CHECK(table != NULL, "no rank table on rank 0");
    if (!table) return;
    fputs(table, stdout); /* for the log: who ran where */
    int lines = 0;
    for (const char *p = table; *p; p++) lines += *p == '\n';
    CHECK(lines == t->world_size + 1, "rank table has %d lines, want header + %d", lines, t->world_size);
    CHECK(strncmp(table, "rank  dp  pp  tp  host", 22) == 0, "rank table header: %.40s", table);
    const char *nl = strchr(table, '\n');
    CHECK(nl && (size_t)(nl - table) >= 6 && strncmp(nl - 6, "device", 6) == 0, "header does not end with device");
    if (t->world_size > 1) CHECK(strstr(table, "cpu") != NULL, "no 'cpu' device in the table");
    free(table);
}

/* ------------------------------------------------------------------------------------------------ */

static const char *default_config(void) {
    static char buf[1024];
    const char *g = getenv("GOLDEN");
    snprintf(buf, sizeof buf, "%s/tp8pp2/config.json", g && g[0] ? g : "../shared/golden");
    return buf;
}

/* kill / hang: rank 3 leaves the others waiting in an allreduce; the job must end, by mpirun
 * noticing the dead process or by the watchdog. Never returns normally on the waiting ranks. */
static int run_fault(struct topo *t, int kill_mode, double seconds) {
    comm_set_deadline(seconds);
    comm_set_context(t->pp_rank, 0);
    t->world->ops->barrier(t->world, "before fault");
    if (t->world_rank == 3 % t->world_size) {
        if (kill_mode) raise(SIGKILL);
        sleep(600); /* alive but absent; MPI_Abort from a watchdog ends us */
        return 1;
    }
    float x[16] = {0};
    t->world->ops->allreduce_sum(t->world, x, 16, COMM_F32, "fault test");
    fprintf(stderr, "rank %d: allreduce returned although rank 3 is gone\n", t->world_rank);
    return 1;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    if (argc < 3) {
        if (g_rank == 0)
            fprintf(stderr, "usage: mpi_comm_check TP PP [CONFIG] [DEADLINE] | kill|hang SECONDS [CONFIG]\n");
        MPI_Finalize();
        return 2;
    }
    int fault = strcmp(argv[1], "kill") == 0 ? 1 : strcmp(argv[1], "hang") == 0 ? 2 : 0;
    const char *path = argc > 3 ? argv[3] : default_config();
    static struct model_config cfg;
    if (config_load(path, &cfg)) {
        fprintf(stderr, "rank %d: error: %s\n", g_rank, ds_err_get());
        MPI_Finalize();
        return 1;
    }
    int tp = fault ? 0 : atoi(argv[1]), pp = fault ? 0 : atoi(argv[2]);
    if (!fault && argc > 4) comm_set_deadline(atof(argv[4]));

    struct topo t;
    if (topo_init(&t, &cfg, tp, pp, NULL)) {
        /* every rank must get here with the same message, and no communicator was created */
        fprintf(stderr, "rank %d: error: %s\n", g_rank, ds_err_get());
        config_free(&cfg);
        MPI_Finalize();
        return 1;
    }
    if (fault) return run_fault(&t, fault == 1, atof(argv[2]));

    double t0 = MPI_Wtime();
    check_layout(&t, tp, pp, &cfg);
    check_ops(&t);
    check_rank_table(&t);
    double dt = MPI_Wtime() - t0;

    int mine[2] = {g_pass, g_fail}, sum[2] = {0, 0};
    t.world->ops->barrier(t.world, "done");
    MPI_Reduce(mine, sum, 2, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD);
    if (g_rank == 0) {
        printf("world %d = dp %d x pp %d x tp %d; checks took %.2f s on rank 0\n", t.world_size, t.dp, t.pp, t.tp, dt);
        printf("%d passed, %d failed\n", sum[0], sum[1]);
        fflush(stdout);
    }
    topo_free(&t);
    config_free(&cfg);
    MPI_Finalize();
    return g_fail || (g_rank == 0 && sum[1]) ? 1 : 0;
}
