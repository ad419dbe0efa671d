/* MPI check of mpi/comm_nccl.c and of device staging in mpi/comm_mpi.c, run under mpirun by
 * tests/cli/test_nccl.sh.
 *
 *   nccl_comm_check gpus            prints the number of visible CUDA devices (0 without CUDA)
 *   nccl_comm_check cpu             the MPI comm staged through the CPU backend: the staging code
 *                                   paths without a GPU (what CI runs)
 *   nccl_comm_check nccl            one GPU per rank (device = node-local rank): the NCCL comm,
 *                                   every op on device buffers, and the rank-order sum kernel
 *                                   for 1..16 simulated ranks against the host's arithmetic
 *   nccl_comm_check shared          every rank on device 0: comm_nccl_new must refuse with its
 *                                   message on every rank, then the MPI comm staged through the
 *                                   CUDA backend must give the right results on device buffers
 *   nccl_comm_check hostptr         a host buffer handed to the NCCL comm: must abort naming it
 *   nccl_comm_check hang SECONDS    an allreduce behind a stream stalled by a host function (a
 *                                   peer that never comes, as seen from one GPU): the watchdog
 *                                   must fire after SECONDS with the MPI backend's line
 *
 * The GPU modes print one TAP line "ok - nccl comm # SKIP ..." on rank 0 and exit 0 when the
 * build has no CUDA or no device is visible. Otherwise each rank counts its passed and failed
 * checks, prints every failure with its rank, and rank 0 prints "N passed, N failed" summed over
 * the world; the exit code is non-zero on any failure. Expected values are computed on the host
 * from per-rank generators every rank can evaluate; the fp32 data is chosen so that adding in any
 * order other than rank order changes bits (checked on the host for 3+ ranks), so a backend that
 * reduced in ring or tree order could not pass by luck. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <mpi.h>

#include "backend.h"
#include "comm_mpi.h"
#include "formats.h"
#include "log.h"

#ifdef DS_HAVE_CUDA
#include <cuda_runtime.h>

#include "comm_nccl.h"
#endif

#include "mpi/mpi_check.h"

/* ------------------------------------------------------------------------------------------------
 * Known per-rank data (the generators of mpi_comm_check) */

/* element 7 is a NaN with a payload: the sum must give bf16_from_f32's canonical 0x7FC0 */
static bf16_t bf16_value(int rank, size_t i) { return i == 7 ? (bf16_t)0x7F81u : bf16_from_f32(f32_value(rank + 1000, i)); }
static uint8_t u8_value(int rank, size_t i) { return (uint8_t)(rank * 37 + (int)i * 11 + 200); }
static uint8_t byte_value(int rank, size_t i) { return (uint8_t)mix32((uint32_t)rank * 7919u + (uint32_t)i); }

static const size_t dt_size[] = {4, 2, 4, 8, 1};
static const char *const dt_name[] = {"f32", "bf16", "i32", "i64", "u8"};

/* Element i of rank r's input for dtype dt, written at dst. */
static void put_value(void *dst, enum comm_dtype dt, int r, size_t i) {
    switch (dt) {
    case COMM_F32: ((float *)dst)[i] = f32_value(r, i); break;
    case COMM_BF16: ((bf16_t *)dst)[i] = bf16_value(r, i); break;
    case COMM_I32: ((int32_t *)dst)[i] = i32_value(r, i); break;
    case COMM_I64: ((int64_t *)dst)[i] = i64_value(r, i); break;
    case COMM_U8: ((uint8_t *)dst)[i] = u8_value(r, i); break;
    }
}

/* comm.h's allreduce arithmetic on the host: ranks in order, fp32, bf16 rounded once, integers
 * wrapping. `order` lists the ranks in the order to add (the identity for the contract). */
static void expected_sum(void *out, enum comm_dtype dt, size_t n, int size, const int *order) {
    for (size_t i = 0; i < n; i++) {
        switch (dt) {
        case COMM_F32: {
            float a = f32_value(order[0], i);
            for (int k = 1; k < size; k++) a += f32_value(order[k], i);
            ((float *)out)[i] = a;
            break;
        }
        case COMM_BF16: {
            float a = bf16_to_f32(bf16_value(order[0], i));
            for (int k = 1; k < size; k++) a += bf16_to_f32(bf16_value(order[k], i));
            ((bf16_t *)out)[i] = bf16_from_f32(a);
            break;
        }
        case COMM_I32: {
            uint32_t a = 0;
            for (int k = 0; k < size; k++) a += (uint32_t)i32_value(order[k], i);
            ((uint32_t *)out)[i] = a;
            break;
        }
        case COMM_I64: {
            uint64_t a = 0;
            for (int k = 0; k < size; k++) a += (uint64_t)i64_value(order[k], i);
            ((uint64_t *)out)[i] = a;
            break;
        }
        case COMM_U8: {
            uint8_t a = 0;
            for (int k = 0; k < size; k++) a = (uint8_t)(a + u8_value(order[k], i));
            ((uint8_t *)out)[i] = a;
            break;
        }
        }
    }
}

static size_t first_diff(const void *a, const void *b, size_t n) {
    const uint8_t *x = a, *y = b;
    for (size_t i = 0; i < n; i++)
        if (x[i] != y[i]) return i;
    return n;
}

/* ------------------------------------------------------------------------------------------------
 * Device buffers through the backend (the CPU backend's are host memory: the same code runs) */

static void *dev_put(struct backend *be, const void *host, size_t bytes) {
    void *d = be->ops->alloc(be, bytes ? bytes : 1);
    if (bytes) be->ops->upload(be, d, host, bytes);
    return d;
}

static void dev_get(struct backend *be, void *host, const void *d, size_t bytes) {
    if (bytes) be->ops->download(be, host, d, bytes);
}

/* ------------------------------------------------------------------------------------------------
 * The op checks, on any comm whose buffers are `be` pointers */

static void check_allgather(struct comm *c, struct backend *be, const char *label, size_t bytes, int in_place) {
    size_t all = bytes * (size_t)c->size;
    uint8_t *mine = malloc(bytes + 1), *got = malloc(all + 1), *want = malloc(all + 1);
    for (size_t i = 0; i < bytes; i++) mine[i] = byte_value(c->rank, i);
    for (int r = 0; r < c->size; r++)
        for (size_t i = 0; i < bytes; i++) want[(size_t)r * bytes + i] = byte_value(r, i);
    memset(got, 0xA5, all); /* stale bytes that the gather must overwrite */
    void *drecv = dev_put(be, got, all), *dsend = NULL;
    if (in_place) {
        be->ops->upload(be, (char *)drecv + (size_t)c->rank * bytes, mine, bytes);
        c->ops->allgather(c, (char *)drecv + (size_t)c->rank * bytes, drecv, bytes, "check allgather");
    } else {
        dsend = dev_put(be, mine, bytes);
        c->ops->allgather(c, dsend, drecv, bytes, "check allgather");
    }
    dev_get(be, got, drecv, all);
    size_t d = first_diff(got, want, all);
    CHECK(d == all, "%s: allgather of %zu bytes%s: first wrong byte %zu (rank %zu's block)", label, bytes,
          in_place ? " in place" : "", d, bytes ? d / bytes : 0);
    if (dsend) be->ops->free(be, dsend);
    be->ops->free(be, drecv);
    free(mine);
    free(got);
    free(want);
}

/* Block d of rank s's send is marked (s, d): rank d must receive (s, d) in its block s. */
static void check_alltoall(struct comm *c, struct backend *be, const char *label, size_t bytes) {
    size_t all = bytes * (size_t)c->size;
    uint8_t *mine = malloc(all + 1), *got = malloc(all + 1), *want = malloc(all + 1);
    for (int r = 0; r < c->size; r++)
        for (size_t i = 0; i < bytes; i++) {
            mine[(size_t)r * bytes + i] = byte_value(c->rank * 1009 + r, i);
            want[(size_t)r * bytes + i] = byte_value(r * 1009 + c->rank, i);
        }
    memset(got, 0xA5, all);
    void *dsend = dev_put(be, mine, all), *drecv = dev_put(be, got, all);
    c->ops->alltoall(c, dsend, drecv, bytes, "check alltoall");
    dev_get(be, got, drecv, all);
    size_t d = first_diff(got, want, all);
    CHECK(d == all, "%s: alltoall of %zu bytes a pair: first wrong byte %zu (from rank %zu)", label, bytes, d,
          bytes ? d / bytes : 0);
    be->ops->free(be, dsend);
    be->ops->free(be, drecv);
    free(mine);
    free(got);
    free(want);
}

static void check_allreduce(struct comm *c, struct backend *be, const char *label, enum comm_dtype dt, size_t n) {
    size_t bytes = n * dt_size[dt];
    void *buf = malloc(bytes + 1), *want = malloc(bytes + 1);
    int *order = malloc(sizeof *order * (size_t)c->size);
    for (int r = 0; r < c->size; r++) order[r] = r;
    for (size_t i = 0; i < n; i++) put_value(buf, dt, c->rank, i);
    expected_sum(want, dt, n, c->size, order);
    void *d = dev_put(be, buf, bytes);
    c->ops->allreduce_sum(c, d, n, dt, "check allreduce");
    dev_get(be, buf, d, bytes);
    size_t diff = first_diff(buf, want, bytes);
    CHECK(diff == bytes, "%s: allreduce_sum of %zu x %s differs from the rank-order sum at element %zu", label, n,
          dt_name[dt], diff / dt_size[dt]);
    if (dt == COMM_BF16 && n > 7)
        CHECK(((bf16_t *)buf)[7] == 0x7FC0u, "%s: bf16 NaN summed to 0x%04x, want the canonical 0x7FC0", label,
              ((bf16_t *)buf)[7]);
    /* The data must tell the orders apart, or the check above proves nothing: reversed order
     * differs somewhere once 3 ranks add (2 ranks commute). */
    if (c->size >= 3 && dt == COMM_F32 && n >= 64) { /* one element may happen to commute */
        for (int r = 0; r < c->size; r++) order[r] = c->size - 1 - r;
        void *rev = malloc(bytes);
        expected_sum(rev, dt, n, c->size, order);
        CHECK(first_diff(rev, want, bytes) < bytes, "%s: the f32 data does not depend on the summation order", label);
        free(rev);
    }
    be->ops->free(be, d);
    free(buf);
    free(want);
    free(order);
}

/* The model's case: one rank holds each row, the others add exact zeros; the sum is that row. */
static void check_allreduce_owned_rows(struct comm *c, struct backend *be, const char *label) {
    enum { ROWS = 37, D = 64 };
    bf16_t *x = calloc(ROWS * D, sizeof *x), *want = calloc(ROWS * D, sizeof *want);
    for (int t = 0; t < ROWS; t++)
        for (int j = 0; j < D; j++) {
            bf16_t v = bf16_from_f32(f32_value(t % c->size + 77, (size_t)(t * D + j)));
            want[t * D + j] = v;
            if (t % c->size == c->rank) x[t * D + j] = v;
        }
    void *d = dev_put(be, x, sizeof *x * ROWS * D);
    c->ops->allreduce_sum(c, d, ROWS * D, COMM_BF16, "check owned rows");
    dev_get(be, x, d, sizeof *x * ROWS * D);
    size_t diff = first_diff(x, want, sizeof *x * ROWS * D);
    CHECK(diff == sizeof *x * ROWS * D, "%s: owned-row allreduce is not the owner's row at element %zu", label, diff / 2);
    be->ops->free(be, d);
    free(x);
    free(want);
}

static void check_bcast(struct comm *c, struct backend *be, const char *label, size_t bytes, int root) {
    uint8_t *h = malloc(bytes), *want = malloc(bytes);
    for (size_t i = 0; i < bytes; i++) {
        want[i] = byte_value(root + 500, i);
        h[i] = c->rank == root ? want[i] : (uint8_t)~want[i];
    }
    void *d = dev_put(be, h, bytes);
    c->ops->bcast(c, d, bytes, root, "check bcast");
    dev_get(be, h, d, bytes);
    CHECK(first_diff(h, want, bytes) == bytes, "%s: bcast of %zu bytes from %d: wrong bytes", label, bytes, root);
    be->ops->free(be, d);
    free(h);
    free(want);
}

/* Send/recv. First the exchange the table's isend exists for, one message at a time: isend to
 * the next rank, recv from the previous one, wait (on one rank: to itself), which must not
 * deadlock on either backend. Then two blocking messages from each even rank to the odd one
 * after it, which must arrive in order. */
static void check_p2p(struct comm *c, struct backend *be, const char *label, size_t bytes) {
    int next = (c->rank + 1) % c->size, prev = (c->rank + c->size - 1) % c->size;
    uint8_t *a = malloc(bytes), *b = malloc(bytes), *got = malloc(bytes), *want = malloc(bytes);
    void *da = be->ops->alloc(be, bytes), *db = be->ops->alloc(be, bytes), *dr = be->ops->alloc(be, bytes);
    for (int m = 0; m < 2; m++) {
        for (size_t i = 0; i < bytes; i++) a[i] = byte_value(c->rank + 100 * (m + 1), i);
        be->ops->upload(be, da, a, bytes);
        struct comm_req *r = c->ops->isend(c, da, bytes, next, 11 + m, "check isend");
        c->ops->recv(c, dr, bytes, prev, 11 + m, "check recv");
        dev_get(be, got, dr, bytes);
        for (size_t i = 0; i < bytes; i++) want[i] = byte_value(prev + 100 * (m + 1), i);
        CHECK(first_diff(got, want, bytes) == bytes, "%s: exchange %d of %zu bytes from rank %d: wrong bytes", label,
              m, bytes, prev);
        c->ops->wait(c, r);
    }
    c->ops->wait(c, NULL); /* a no-op */
    int peer = c->rank % 2 == 0 ? c->rank + 1 : c->rank - 1;
    if (c->size >= 2 && peer < c->size) { /* the last rank of an odd size sits out */
        if (c->rank % 2 == 0) {
            for (size_t i = 0; i < bytes; i++) {
                a[i] = byte_value(c->rank + 300, i);
                b[i] = byte_value(c->rank + 400, i);
            }
            be->ops->upload(be, da, a, bytes);
            be->ops->upload(be, db, b, bytes);
            c->ops->send(c, da, bytes, peer, 13, "check send a");
            c->ops->send(c, db, bytes, peer, 14, "check send b");
        } else {
            for (int m = 0; m < 2; m++) {
                c->ops->recv(c, dr, bytes, peer, 13 + m, "check recv");
                dev_get(be, got, dr, bytes);
                for (size_t i = 0; i < bytes; i++) want[i] = byte_value(peer + 300 + 100 * m, i);
                CHECK(first_diff(got, want, bytes) == bytes, "%s: blocking message %d of %zu bytes from %d: wrong bytes",
                      label, m, bytes, peer);
            }
        }
    }
    be->ops->free(be, da);
    be->ops->free(be, db);
    be->ops->free(be, dr);
    free(a);
    free(b);
    free(got);
    free(want);
}

static void check_comm(struct comm *c, struct backend *be, const char *label) {
    static const size_t gather_sizes[] = {1, 1000, 65537};
    for (size_t k = 0; k < sizeof gather_sizes / sizeof *gather_sizes; k++) {
        check_allgather(c, be, label, gather_sizes[k], 0);
        check_allgather(c, be, label, gather_sizes[k], 1);
        check_alltoall(c, be, label, gather_sizes[k]);
    }
    for (int dt = 0; dt < 5; dt++) {
        check_allreduce(c, be, label, (enum comm_dtype)dt, 1);
        check_allreduce(c, be, label, (enum comm_dtype)dt, 4099);
    }
    check_allreduce_owned_rows(c, be, label);
    check_bcast(c, be, label, 3001, 0);
    check_bcast(c, be, label, 3001, c->size - 1);
    check_p2p(c, be, label, 1);
    check_p2p(c, be, label, 100003);
    c->ops->barrier(c, "check barrier");
}

/* The same checks with the chunked paths forced: MPI messages of 1000 bytes, 4 KiB temporaries. */
static void check_comm_chunked(struct comm *c, struct backend *be, const char *label) {
    comm_mpi_set_chunk_limits(1000, 4096);
#ifdef DS_HAVE_CUDA
    comm_nccl_set_tmp_limit(4096);
#endif
    char l[96];
    snprintf(l, sizeof l, "%s (chunked)", label);
    check_allgather(c, be, l, 3001, 0);
    check_alltoall(c, be, l, 3001);
    for (int dt = 0; dt < 5; dt++) check_allreduce(c, be, l, (enum comm_dtype)dt, 5003);
    check_bcast(c, be, l, 3001, 0);
    check_p2p(c, be, l, 2500);
    comm_mpi_set_chunk_limits(0, 0);
#ifdef DS_HAVE_CUDA
    comm_nccl_set_tmp_limit(0);
#endif
}

/* ------------------------------------------------------------------------------------------------
 * Modes */

static int finish(void) {
    int mine[2] = {g_pass, g_fail}, sum[2] = {0, 0};
    MPI_Reduce(mine, sum, 2, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD);
    int any = g_fail, any_all = 0;
    MPI_Allreduce(&any, &any_all, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (g_rank == 0) {
        printf("%d passed, %d failed\n", sum[0], sum[1]);
        fflush(stdout);
    }
    MPI_Finalize();
    return any_all ? 1 : 0;
}

static int skip(const char *mode, const char *why) {
    if (g_rank == 0) {
        printf("ok - nccl comm %s # SKIP %s\n", mode, why);
        fflush(stdout);
    }
    MPI_Finalize();
    return 0;
}

/* The staging paths over the CPU backend: its pointers are host memory, so nothing but the
 * download/upload wrapping differs from the plain MPI comm, which is what this isolates. */
static int mode_cpu(void) {
    struct backend be;
    backend_cpu_init(&be);
    struct comm *c = comm_mpi_new_named(MPI_COMM_WORLD, "staged world (cpu)");
    comm_mpi_set_staging(c, &be);
    check_comm(c, &be, "mpi staged via cpu");
    check_comm_chunked(c, &be, "mpi staged via cpu");
    /* staging off again: host buffers, the plain path */
    comm_mpi_set_staging(c, NULL);
    check_allgather(c, &be, "mpi unstaged", 1000, 0);
    check_allreduce(c, &be, "mpi unstaged", COMM_F32, 4099);
    c->ops->free(c);
    backend_cpu_free(&be);
    return finish();
}

#ifdef DS_HAVE_CUDA

static int visible_gpus(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        n = 0;
    }
    return n;
}

static int node_rank(void) {
    MPI_Comm node;
    int r = 0;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &r);
    MPI_Comm_free(&node);
    return r;
}

/* The sum kernel for 1..16 ranks' rows on one GPU, against the host arithmetic. */
static void check_sum_kernel(struct backend *be) {
    static const int sizes[] = {1, 2, 3, 8, 16};
    enum { N = 3001 };
    for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
        int size = sizes[s], order[16];
        for (int r = 0; r < size; r++) order[r] = r;
        for (int dt = 0; dt < 5; dt++) {
            size_t esz = dt_size[dt];
            uint8_t *in = malloc(esz * N * (size_t)size), *got = malloc(esz * N), *want = malloc(esz * N);
            for (int r = 0; r < size; r++)
                for (size_t i = 0; i < N; i++) put_value(in + (size_t)r * N * esz, (enum comm_dtype)dt, r, i);
            expected_sum(want, (enum comm_dtype)dt, N, size, order);
            void *din = dev_put(be, in, esz * N * (size_t)size), *dout = be->ops->alloc(be, esz * N);
            comm_nccl_sum_rank_order(dout, din, N, size, (enum comm_dtype)dt, backend_cuda_stream(be));
            dev_get(be, got, dout, esz * N);
            size_t d = first_diff(got, want, esz * N);
            CHECK(d == esz * N, "sum kernel, %d ranks of %s: differs from the host's rank-order sum at element %zu",
                  size, dt_name[dt], d / esz);
            be->ops->free(be, din);
            be->ops->free(be, dout);
            free(in);
            free(got);
            free(want);
        }
    }
}

static int mode_nccl(void) {
    struct backend be;
    int dev = node_rank();
    if (backend_cuda_init(&be, dev)) return skip("nccl", ds_err_get()); /* the same on every rank only if no GPU */
    struct comm *c = comm_nccl_new(MPI_COMM_WORLD, "nccl world", backend_cuda_stream(&be));
    CHECK(c != NULL, "comm_nccl_new refused: %s", ds_err_get());
    if (c) {
        int size;
        MPI_Comm_size(MPI_COMM_WORLD, &size);
        CHECK(c->size == size && c->rank == g_rank, "nccl comm: rank %d of %d, want %d of %d", c->rank, c->size,
              g_rank, size);
        CHECK(strcmp(c->ops->name, "nccl") == 0, "comm backend '%s', want nccl", c->ops->name);
        check_comm(c, &be, "nccl");
        check_comm_chunked(c, &be, "nccl");
        c->ops->free(c);
    }
    check_sum_kernel(&be);
    /* the staged MPI comm on the same device buffers: the same expected bits */
    struct comm *m = comm_mpi_new_named(MPI_COMM_WORLD, "staged world");
    comm_mpi_set_staging(m, &be);
    check_comm(m, &be, "mpi staged via cuda");
    m->ops->free(m);
    backend_cuda_free(&be);
    return finish();
}

static int mode_shared(void) {
    struct backend be;
    if (backend_cuda_init(&be, 0)) return skip("shared", ds_err_get());
    int size;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    struct comm *c = comm_nccl_new(MPI_COMM_WORLD, "nccl world", backend_cuda_stream(&be));
    if (size >= 2) {
        CHECK(c == NULL, "comm_nccl_new accepted %d ranks on one GPU", size);
        CHECK(strstr(ds_err_get(), "share one GPU") && strstr(ds_err_get(), "comm_mpi_set_staging"),
              "refusal message: '%s'", ds_err_get());
        if (g_rank == 0) printf("# refusal: %s\n", ds_err_get());
    }
    if (c) c->ops->free(c);
    struct comm *m = comm_mpi_new_named(MPI_COMM_WORLD, "staged world");
    comm_mpi_set_staging(m, &be);
    check_comm(m, &be, "mpi staged via cuda");
    check_comm_chunked(m, &be, "mpi staged via cuda");
    m->ops->free(m);
    backend_cuda_free(&be);
    return finish();
}

/* Must end in ds_fatal (MPI_Abort): reaching the end is the failure. */
static int mode_hostptr(void) {
    struct backend be;
    if (backend_cuda_init(&be, node_rank())) return skip("hostptr", ds_err_get());
    struct comm *c = comm_nccl_new(MPI_COMM_WORLD, "nccl world", backend_cuda_stream(&be));
    if (!c) return skip("hostptr", ds_err_get());
    static uint8_t host_buf[64];
    c->ops->allreduce_sum(c, host_buf, sizeof host_buf, COMM_U8, "host buffer");
    fprintf(stderr, "rank %d: FAIL: a host buffer went through the NCCL comm unnoticed\n", g_rank);
    MPI_Finalize();
    return 1;
}

/* Holds the stream far past the deadline. */
static void CUDART_CB stall_stream(void *seconds) { sleep((unsigned)(*(double *)seconds * 10 + 1)); }

/* Must end in the watchdog (MPI_Abort). A stuck peer cannot be staged on one GPU (NCCL refuses a
 * send to self without its recv at once, "invalid usage"), so the stream the op is enqueued on is
 * stalled instead: to the poll that is the same as an NCCL kernel waiting for a peer. */
static int mode_hang(double seconds) {
    struct backend be;
    if (backend_cuda_init(&be, node_rank())) return skip("hang", ds_err_get());
    struct comm *c = comm_nccl_new(MPI_COMM_WORLD, "nccl world", backend_cuda_stream(&be));
    if (!c) return skip("hang", ds_err_get());
    comm_mpi_set_identity(g_rank, 0, g_rank);
    comm_set_context(0, 0);
    comm_set_deadline(seconds);
    static double secs;
    secs = seconds;
    void *d = be.ops->alloc(&be, 16 * sizeof(float));
    if (cudaLaunchHostFunc((cudaStream_t)backend_cuda_stream(&be), stall_stream, &secs) != cudaSuccess) {
        fprintf(stderr, "rank %d: FAIL: cudaLaunchHostFunc\n", g_rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    c->ops->allreduce_sum(c, d, 16, COMM_F32, "fault test");
    fprintf(stderr, "rank %d: FAIL: an allreduce behind a stalled stream completed\n", g_rank);
    MPI_Finalize();
    return 1;
}

#endif /* DS_HAVE_CUDA */

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    const char *mode = argc > 1 ? argv[1] : "";
    if (!strcmp(mode, "cpu")) return mode_cpu();
#ifdef DS_HAVE_CUDA
    int gpus = visible_gpus();
    if (!strcmp(mode, "gpus")) {
        if (g_rank == 0) printf("%d\n", gpus);
        MPI_Finalize();
        return 0;
    }
    if (gpus == 0 && (!strcmp(mode, "nccl") || !strcmp(mode, "shared") || !strcmp(mode, "hostptr") || !strcmp(mode, "hang")))
        return skip(mode, "no GPU");
    if (!strcmp(mode, "nccl")) return mode_nccl();
    if (!strcmp(mode, "shared")) return mode_shared();
    if (!strcmp(mode, "hostptr")) return mode_hostptr();
    if (!strcmp(mode, "hang") && argc > 2) return mode_hang(atof(argv[2]));
#else
    if (!strcmp(mode, "gpus")) {
        if (g_rank == 0) printf("0\n");
        MPI_Finalize();
        return 0;
    }
    if (!strcmp(mode, "nccl") || !strcmp(mode, "shared") || !strcmp(mode, "hostptr") || !strcmp(mode, "hang"))
        return skip(mode, "built without CUDA");
#endif
    if (g_rank == 0) fprintf(stderr, "usage: nccl_comm_check gpus|cpu|nccl|shared|hostptr|hang SECONDS\n");
    MPI_Finalize();
    return 2;
}
