/* The MPI backend of the comm table on host buffers, with the watchdog.
 *
 * Every operation is posted as a nonblocking MPI call and completed by polling MPI_Test against a
 * deadline instead of a blocking call, because a blocking MPI call cannot be interrupted: a peer
 * that died or a pipeline deadlock would hang the job until the batch system kills it, with no
 * hint of where. On expiry the rank prints who it is and what it was waiting for, then aborts the
 * whole job. The poll spins briefly and then sleeps 50-200 us, so 16 ranks oversubscribed on two
 * cores leave each other CPU time (Open MPI's nonblocking collectives only progress when the
 * peers call MPI_Test, so a spinning rank would starve the rank it waits for).
 *
 * allreduce_sum is not MPI_Allreduce: MPI may combine in any tree order, so fp32 results would
 * depend on the rank count and the algorithm chosen. Instead every rank gathers all inputs and
 * adds them in rank order r = 0, 1, ..., identically on every rank. The temporary is bounded by
 * reducing in rounds. MPI counts are int, so larger transfers go in pieces.
 *
 * Device staging (comm_mpi_set_staging) wraps each operation in a download of its input into a
 * host buffer and an upload of its result. Open MPI is built without CUDA support on both the CI
 * and the GPU machines, so a device pointer handed to MPI would be read as host memory; staging is
 * the slow but always-available path for ranks that share a GPU (NCCL takes one GPU per rank).
 * The host buffer stays with the comm between calls for the same reason as the allreduce
 * temporary. The MPI operation itself is the unstaged one, so results are bit-identical. */
#include "comm_mpi.h"

#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "formats.h"
#include "log.h"

struct mpi_priv {
    MPI_Comm comm;
    char name[64];
    /* allreduce_sum's gather buffer, kept between calls: a fresh multi-MiB malloc per reduction
     * is a fresh mmap whose pages the kernel zeroes on first touch, which cost more than the sum */
    void *tmp;
    size_t tmp_cap;
    /* device staging: the backend whose pointers the ops receive (NULL: host buffers) and the
     * host copy they go through, kept between calls like tmp: page-locked by the backend that
     * allocated it (stage_owner's host_alloc), so the copies run at the link's rate */
    struct backend *stage_be, *stage_owner;
    void *stage;
    size_t stage_cap;
};

#define DEFAULT_MAX_TMP ((size_t)64 << 20)

static double g_deadline = 300.0;
static int g_ctx_stage = -1, g_ctx_mb = -1;          /* comm_set_context */
static int g_id_rank = -1, g_id_stage = -1, g_id_tp = -1; /* comm_mpi_set_identity */
static size_t g_max_msg = INT_MAX, g_max_tmp = DEFAULT_MAX_TMP;

void comm_set_deadline(double seconds) { g_deadline = seconds > 0 ? seconds : 0; }
double comm_get_deadline(void) { return g_deadline; }

void comm_set_context(int pp_stage, int micro_batch) {
    g_ctx_stage = pp_stage;
    g_ctx_mb = micro_batch;
}

void comm_get_context(int *pp_stage, int *micro_batch) {
    if (pp_stage) *pp_stage = g_ctx_stage >= 0 ? g_ctx_stage : g_id_stage;
    if (micro_batch) *micro_batch = g_ctx_mb;
}

void comm_mpi_set_identity(int world_rank, int pp_stage, int tp_rank) {
    g_id_rank = world_rank;
    g_id_stage = pp_stage;
    g_id_tp = tp_rank;
}

void comm_mpi_set_chunk_limits(size_t max_msg_bytes, size_t max_tmp_bytes) {
    g_max_msg = max_msg_bytes && max_msg_bytes < (size_t)INT_MAX ? max_msg_bytes : (size_t)INT_MAX;
    g_max_tmp = max_tmp_bytes ? max_tmp_bytes : DEFAULT_MAX_TMP;
}

static const struct comm_ops mpi_ops; /* defined at the end; comms made here point to it */

static struct mpi_priv *priv_of(const struct comm *c) { return (struct mpi_priv *)c->priv; }

/* Another backend's priv is not an mpi_priv: reading it as one would hand MPI garbage. */
static void require_mpi(const struct comm *c, const char *func) {
    if (!c || c->ops != &mpi_ops)
        ds_fatal(__FILE__, __LINE__, func, "dsbatch", func, c ? "the comm is not an MPI comm (comm_mpi_new)" : "NULL comm");
}

MPI_Comm comm_mpi_handle(const struct comm *c) {
    require_mpi(c, __func__);
    return priv_of(c)->comm;
}

/* Release the staging copy with what allocated it. */
static void stage_release(struct mpi_priv *p) {
    struct backend *o = p->stage_owner;
    if (o && o->ops->host_free) o->ops->host_free(o, p->stage);
    else free(p->stage);
    p->stage = NULL;
    p->stage_cap = 0;
    p->stage_owner = NULL;
}

void comm_mpi_set_staging(struct comm *c, struct backend *be) {
    require_mpi(c, __func__);
    struct mpi_priv *p = priv_of(c);
    /* back to host buffers, or another backend: the copy goes (the next is the new one's) */
    if (p->stage && be != p->stage_owner) stage_release(p);
    p->stage_be = be;
}

/* The comm's host copy for a staged operation, grown (never shrunk) to `bytes`. */
static void *stage_host(struct mpi_priv *p, size_t bytes) {
    if (p->stage_cap < bytes) {
        stage_release(p);
        struct backend *be = p->stage_be;
        p->stage = be->ops->host_alloc ? be->ops->host_alloc(be, bytes) : ds_malloc(bytes);
        p->stage_owner = be;
        p->stage_cap = bytes;
    }
    return p->stage;
}

/* ------------------------------------------------------------------------------------------------
 * Watchdog */

double comm_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void comm_op_begin(struct comm_op *o, const char *comm_name, const char *what, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(o->desc, sizeof o->desc, fmt, ap);
    va_end(ap);
    o->comm_name = comm_name;
    o->what = what ? what : "";
    o->start = comm_now_s();
}

static inline double now_s(void) { return comm_now_s(); }

static void fmt_id(char *buf, size_t n, int v) {
    if (v >= 0)
        snprintf(buf, n, "%d", v);
    else
        snprintf(buf, n, "-");
}

void comm_watchdog_print(const char *comm_name, const char *desc, const char *what, double waited) {
    int rank = g_id_rank, stage, mb;
    if (rank < 0) MPI_Comm_rank(MPI_COMM_WORLD, &rank); /* no CHECK: we are aborting anyway */
    comm_get_context(&stage, &mb);
    char host[256] = "?", s_stage[16], s_tp[16], s_mb[16];
    gethostname(host, sizeof host - 1);
    fmt_id(s_stage, sizeof s_stage, stage);
    fmt_id(s_tp, sizeof s_tp, g_id_tp);
    fmt_id(s_mb, sizeof s_mb, mb);
    fflush(stdout);
    fprintf(stderr, "dsbatch: watchdog: rank %d (pp %s, tp %s, micro-batch %s) host %s: %s '%s' on %s pending after %.1f s\n",
            rank, s_stage, s_tp, s_mb, host, desc, what ? what : "", comm_name, waited);
    fflush(stderr);
}

static void __attribute__((noreturn)) watchdog_fire(const struct comm_op *o, double waited) {
    comm_watchdog_print(o->comm_name, o->desc, o->what, waited);
    MPI_Abort(MPI_COMM_WORLD, 3);
    _exit(3); /* MPI_Abort does not return; this only keeps the contract if it ever does */
}

/* Complete one request under the watchdog. A short spin first: on an idle machine most small
 * operations finish within a few polls, and sleeping at once would add latency to every one. */
static void op_wait(const struct comm_op *o, MPI_Request *req, MPI_Status *st) {
    enum { SPIN_POLLS = 64 };
    long sleep_ns = 50000;
    for (long polls = 0;; polls++) {
        int done = 0;
        CHECK_MPI(MPI_Test(req, &done, st ? st : MPI_STATUS_IGNORE));
        if (done) return;
        if (polls < SPIN_POLLS) continue;
        if (g_deadline > 0) {
            double waited = now_s() - o->start;
            if (waited > g_deadline) watchdog_fire(o, waited);
        }
        struct timespec ts = {0, sleep_ns};
        nanosleep(&ts, NULL);
        if (sleep_ns < 200000) sleep_ns *= 2;
    }
}

/* ------------------------------------------------------------------------------------------------
 * Operations */

/* k bytes whose extent is `extent` (a whole block): one piece of every rank's block in one
 * collective, for transfers over MPI's int count. The base type may go at once (MPI keeps what the
 * derived one needs). */
static MPI_Datatype piece_type(size_t k, size_t extent) {
    MPI_Datatype piece, strided;
    CHECK_MPI(MPI_Type_contiguous((int)k, MPI_BYTE, &piece));
    CHECK_MPI(MPI_Type_create_resized(piece, 0, (MPI_Aint)extent, &strided));
    CHECK_MPI(MPI_Type_commit(&strided));
    CHECK_MPI(MPI_Type_free(&piece));
    return strided;
}

static void allgather_op(struct comm *c, const struct comm_op *o, const void *send, void *recv, size_t bytes) {
    MPI_Comm mc = priv_of(c)->comm;
    if (bytes == 0) return;
    char *rbuf = recv;
    /* The caller may pass its own slot of recv as send (an in-place gather); MPI wants that said
     * with MPI_IN_PLACE rather than aliased buffers. */
    int in_place = (const char *)send == rbuf + (size_t)c->rank * bytes;
    if (bytes <= g_max_msg) {
        MPI_Request req;
        CHECK_MPI(MPI_Iallgather(in_place ? MPI_IN_PLACE : send, (int)bytes, MPI_BYTE, rbuf, (int)bytes, MPI_BYTE, mc, &req));
        op_wait(o, &req, NULL);
        return;
    }
    /* Piece [off, off + k) of every rank's block: the receive type is k bytes whose extent is the
     * whole block, so rank r's piece lands at recv + off + r * bytes. */
    for (size_t off = 0; off < bytes; off += g_max_msg) {
        size_t k = bytes - off < g_max_msg ? bytes - off : g_max_msg;
        MPI_Datatype strided = piece_type(k, bytes);
        MPI_Request req;
        const void *s = in_place ? MPI_IN_PLACE : (const void *)((const char *)send + off);
        CHECK_MPI(MPI_Iallgather(s, in_place ? 0 : (int)k, MPI_BYTE, rbuf + off, 1, strided, mc, &req));
        op_wait(o, &req, NULL);
        CHECK_MPI(MPI_Type_free(&strided));
    }
}

static void mpi_allgather(struct comm *c, const void *send, void *recv, size_t bytes, const char *what) {
    struct comm_op o;
    comm_op_begin(&o, priv_of(c)->name, what, "allgather (%zu bytes per rank)", bytes);
    struct mpi_priv *p = priv_of(c);
    if (!p->stage_be || bytes == 0) {
        allgather_op(c, &o, send, recv, bytes);
        return;
    }
    /* Staged: this rank's block is downloaded straight into its own slot of the host gather,
     * which makes it an in-place gather (no second host copy), then all blocks go up at once. */
    struct backend *be = p->stage_be;
    size_t all = bytes * (size_t)c->size;
    char *h = stage_host(p, all), *mine = h + (size_t)c->rank * bytes;
    be->ops->download(be, mine, send, bytes);
    allgather_op(c, &o, mine, h, bytes);
    be->ops->upload(be, recv, h, all);
}

/* Piece [off, off + k) of every rank's block of send and recv: one element of k bytes whose extent
 * is the whole block, so the piece for rank r lies at off + r * bytes on both sides. */
static void alltoall_op(struct comm *c, const struct comm_op *o, const void *send, void *recv, size_t bytes) {
    MPI_Comm mc = priv_of(c)->comm;
    if (bytes == 0) return;
    if (bytes <= g_max_msg) {
        MPI_Request req;
        CHECK_MPI(MPI_Ialltoall(send, (int)bytes, MPI_BYTE, recv, (int)bytes, MPI_BYTE, mc, &req));
        op_wait(o, &req, NULL);
        return;
    }
    for (size_t off = 0; off < bytes; off += g_max_msg) {
        size_t k = bytes - off < g_max_msg ? bytes - off : g_max_msg;
        MPI_Datatype strided = piece_type(k, bytes);
        MPI_Request req;
        CHECK_MPI(MPI_Ialltoall((const char *)send + off, 1, strided, (char *)recv + off, 1, strided, mc, &req));
        op_wait(o, &req, NULL);
        CHECK_MPI(MPI_Type_free(&strided));
    }
}

static void mpi_alltoall(struct comm *c, const void *send, void *recv, size_t bytes, const char *what) {
    struct comm_op o;
    comm_op_begin(&o, priv_of(c)->name, what, "alltoall (%zu bytes per rank pair)", bytes);
    struct mpi_priv *p = priv_of(c);
    if (!p->stage_be || bytes == 0) {
        alltoall_op(c, &o, send, recv, bytes);
        return;
    }
    /* Staged: both halves in the comm's one host copy (send blocks, then the received ones). */
    struct backend *be = p->stage_be;
    size_t all = bytes * (size_t)c->size;
    char *hs = stage_host(p, 2 * all), *hr = hs + all;
    be->ops->download(be, hs, send, all);
    alltoall_op(c, &o, hs, hr, bytes);
    be->ops->upload(be, recv, hr, all);
}

static size_t dtype_size(enum comm_dtype dt) {
    switch (dt) {
    case COMM_F32: return 4;
    case COMM_BF16: return 2;
    case COMM_I32: return 4;
    case COMM_I64: return 8;
    case COMM_U8: return 1;
    }
    ds_fatal(__FILE__, __LINE__, __func__, "dsbatch", "dtype_size", "unknown comm_dtype");
}

/* out[i] = in[0][i] + in[1][i] + ... + in[size-1][i], left to right; in is [size][n]. Floats add
 * in fp32 (this file is built with -ffp-contract=off, so no fused multiply-adds reorder roundings);
 * integers wrap as unsigned, which is exact whenever the true sum fits and never undefined. */
static void sum_rank_order(void *out, const void *in, size_t n, int size, enum comm_dtype dt) {
    switch (dt) {
    case COMM_F32: {
        float *o = out;
        const float *x = in;
        memcpy(o, x, n * sizeof *o);
        for (int r = 1; r < size; r++)
            for (size_t i = 0; i < n; i++) o[i] += x[(size_t)r * n + i];
        break;
    }
    case COMM_BF16: {
        /* fp32 accumulators in blocks on the stack; one RNE rounding to bf16 per element at the end */
        enum { BLK = 1024 };
        float acc[BLK];
        bf16_t *o = out;
        const bf16_t *x = in;
        for (size_t b = 0; b < n; b += BLK) {
            size_t m = n - b < BLK ? n - b : BLK;
            for (size_t i = 0; i < m; i++) acc[i] = bf16_to_f32(x[b + i]);
            for (int r = 1; r < size; r++)
                for (size_t i = 0; i < m; i++) acc[i] += bf16_to_f32(x[(size_t)r * n + b + i]);
            for (size_t i = 0; i < m; i++) o[b + i] = bf16_from_f32(acc[i]);
        }
        break;
    }
    case COMM_I32: {
        uint32_t *o = out;
        const uint32_t *x = in;
        memcpy(o, x, n * sizeof *o);
        for (int r = 1; r < size; r++)
            for (size_t i = 0; i < n; i++) o[i] += x[(size_t)r * n + i];
        break;
    }
    case COMM_I64: {
        uint64_t *o = out;
        const uint64_t *x = in;
        memcpy(o, x, n * sizeof *o);
        for (int r = 1; r < size; r++)
            for (size_t i = 0; i < n; i++) o[i] += x[(size_t)r * n + i];
        break;
    }
    case COMM_U8: {
        uint8_t *o = out;
        const uint8_t *x = in;
        memcpy(o, x, n);
        for (int r = 1; r < size; r++)
            for (size_t i = 0; i < n; i++) o[i] = (uint8_t)(o[i] + x[(size_t)r * n + i]);
        break;
    }
    }
}

/* The host reduction: gather, then sum_rank_order, in rounds. */
static void allreduce_host(struct comm *c, const struct comm_op *o, void *buf, size_t count, enum comm_dtype dt) {
    size_t esz = dtype_size(dt);
    /* Elements per round so that the gathered copy (size x round) stays within g_max_tmp. */
    size_t per_round = g_max_tmp / (esz * (size_t)c->size);
    if (per_round == 0) per_round = 1;
    if (per_round > count) per_round = count;
    struct mpi_priv *p = priv_of(c);
    size_t need = per_round * esz * (size_t)c->size;
    if (p->tmp_cap < need) {
        free(p->tmp);
        p->tmp = ds_malloc(need);
        p->tmp_cap = need;
    }
    char *tmp = p->tmp, *b = buf;
    for (size_t off = 0; off < count; off += per_round) {
        size_t n = count - off < per_round ? count - off : per_round;
        allgather_op(c, o, b + off * esz, tmp, n * esz);
        sum_rank_order(b + off * esz, tmp, n, c->size, dt);
    }
}

static void mpi_allreduce_sum(struct comm *c, void *buf, size_t count, enum comm_dtype dt, const char *what) {
    static const char *const names[] = {"f32", "bf16", "i32", "i64", "u8"};
    struct comm_op o;
    comm_op_begin(&o, priv_of(c)->name, what, "allreduce_sum (%zu x %s)", count, names[dt]);
    if (count == 0) return;
    struct mpi_priv *p = priv_of(c);
    if (!p->stage_be) {
        allreduce_host(c, &o, buf, count, dt);
        return;
    }
    struct backend *be = p->stage_be;
    size_t bytes = count * dtype_size(dt);
    void *h = stage_host(p, bytes);
    be->ops->download(be, h, buf, bytes);
    allreduce_host(c, &o, h, count, dt);
    be->ops->upload(be, buf, h, bytes);
}

static void bcast_host(struct comm *c, const struct comm_op *o, void *buf, size_t bytes, int root) {
    for (size_t off = 0; off < bytes; off += g_max_msg) {
        size_t k = bytes - off < g_max_msg ? bytes - off : g_max_msg;
        MPI_Request req;
        CHECK_MPI(MPI_Ibcast((char *)buf + off, (int)k, MPI_BYTE, root, priv_of(c)->comm, &req));
        op_wait(o, &req, NULL);
    }
}

static void mpi_bcast(struct comm *c, void *buf, size_t bytes, int root, const char *what) {
    struct comm_op o;
    comm_op_begin(&o, priv_of(c)->name, what, "bcast (%zu bytes from %d)", bytes, root);
    struct mpi_priv *p = priv_of(c);
    if (!p->stage_be || bytes == 0) {
        bcast_host(c, &o, buf, bytes, root);
        return;
    }
    /* Staged: only the root's buffer is read and only the others' are written. */
    struct backend *be = p->stage_be;
    void *h = stage_host(p, bytes);
    if (c->rank == root) be->ops->download(be, h, buf, bytes);
    bcast_host(c, &o, h, bytes, root);
    if (c->rank != root) be->ops->upload(be, buf, h, bytes);
}

/* Pieces of one send go out in order with the same tag; MPI's non-overtaking rule for one
 * (source, tag, communicator) keeps them in order at the receiver. */
static void mpi_send(struct comm *c, const void *buf, size_t bytes, int dst, int tag, const char *what) {
    struct comm_op o;
    comm_op_begin(&o, priv_of(c)->name, what, "send (%zu bytes to %d, tag %d)", bytes, dst, tag);
    struct mpi_priv *p = priv_of(c);
    if (p->stage_be && bytes) {
        void *h = stage_host(p, bytes);
        p->stage_be->ops->download(p->stage_be, h, buf, bytes);
        buf = h;
    }
    for (size_t off = 0; off < bytes; off += g_max_msg) {
        size_t k = bytes - off < g_max_msg ? bytes - off : g_max_msg;
        MPI_Request req;
        CHECK_MPI(MPI_Isend((const char *)buf + off, (int)k, MPI_BYTE, dst, tag, priv_of(c)->comm, &req));
        op_wait(&o, &req, NULL);
    }
}

struct comm_req {
    struct comm_op o;
    int n;
    MPI_Request *reqs;
    void *host; /* staged isend: the host copy in flight, freed by wait */
};

static struct comm_req *mpi_isend(struct comm *c, const void *buf, size_t bytes, int dst, int tag, const char *what) {
    struct comm_req *r = ds_calloc(1, sizeof *r);
    comm_op_begin(&r->o, priv_of(c)->name, what, "send (%zu bytes to %d, tag %d)", bytes, dst, tag);
    struct mpi_priv *p = priv_of(c);
    if (p->stage_be && bytes) {
        /* its own copy, not the comm's: the comm's is reused by the next operation while this
         * send is still in flight */
        r->host = ds_malloc(bytes);
        p->stage_be->ops->download(p->stage_be, r->host, buf, bytes);
        buf = r->host;
    }
    size_t pieces = bytes ? (bytes + g_max_msg - 1) / g_max_msg : 0;
    r->reqs = ds_malloc(sizeof(MPI_Request) * (pieces + 1));
    for (size_t off = 0; off < bytes; off += g_max_msg) {
        size_t k = bytes - off < g_max_msg ? bytes - off : g_max_msg;
        CHECK_MPI(MPI_Isend((const char *)buf + off, (int)k, MPI_BYTE, dst, tag, priv_of(c)->comm, &r->reqs[r->n++]));
    }
    return r;
}

static void mpi_wait(struct comm *c, struct comm_req *r) {
    (void)c;
    if (!r) return;
    r->o.start = now_s(); /* the deadline covers the wait, not the time the caller spent elsewhere */
    for (int i = 0; i < r->n; i++) op_wait(&r->o, &r->reqs[i], NULL);
    free(r->reqs);
    free(r->host);
    free(r);
}

static void mpi_recv(struct comm *c, void *buf, size_t bytes, int src, int tag, const char *what) {
    struct comm_op o;
    comm_op_begin(&o, priv_of(c)->name, what, "recv (%zu bytes from %d, tag %d)", bytes, src, tag);
    struct mpi_priv *p = priv_of(c);
    void *dev = NULL; /* staged: the device buffer the host copy goes up to at the end */
    if (p->stage_be && bytes) {
        dev = buf;
        buf = stage_host(p, bytes);
    }
    for (size_t off = 0; off < bytes; off += g_max_msg) {
        size_t k = bytes - off < g_max_msg ? bytes - off : g_max_msg;
        MPI_Request req;
        MPI_Status st;
        CHECK_MPI(MPI_Irecv((char *)buf + off, (int)k, MPI_BYTE, src, tag, priv_of(c)->comm, &req));
        op_wait(&o, &req, &st);
        /* A shorter message than asked for is a protocol mismatch between the stages: say so
         * instead of computing on a partly stale buffer. (A longer one is MPI_ERR_TRUNCATE.) */
        int got = 0;
        CHECK_MPI(MPI_Get_count(&st, MPI_BYTE, &got));
        if ((size_t)got != k) {
            char msg[160];
            snprintf(msg, sizeof msg, "'%s' on %s: got %d bytes from rank %d, expected %zu", o.what, o.comm_name,
                     got, src, k);
            ds_fatal(__FILE__, __LINE__, __func__, "MPI", "MPI_Irecv", msg);
        }
    }
    if (dev) p->stage_be->ops->upload(p->stage_be, dev, buf, bytes);
}

static void mpi_barrier(struct comm *c, const char *what) {
    struct comm_op o;
    comm_op_begin(&o, priv_of(c)->name, what, "barrier");
    MPI_Request req;
    CHECK_MPI(MPI_Ibarrier(priv_of(c)->comm, &req));
    op_wait(&o, &req, NULL);
}

static void mpi_free(struct comm *c) {
    if (!c) return;
    struct mpi_priv *p = priv_of(c);
    CHECK_MPI(MPI_Comm_free(&p->comm));
    free(p->tmp);
    stage_release(p); /* before the backend goes: comm_mpi_set_staging says so */
    free(p);
    free(c);
}

/* The collectives as the table offers them: timed into c->busy_s. A staged comm's device work is
 * finished first (its download would wait for it anyway), so that wait is not counted. */
static double timed_begin(struct comm *c) {
    struct mpi_priv *p = priv_of(c);
    if (p->stage_be) p->stage_be->ops->sync(p->stage_be);
    return now_s();
}
static void timed_allgather(struct comm *c, const void *send, void *recv, size_t bytes, const char *what) {
    double t0 = timed_begin(c);
    mpi_allgather(c, send, recv, bytes, what);
    c->busy_s += now_s() - t0;
}
static void timed_alltoall(struct comm *c, const void *send, void *recv, size_t bytes, const char *what) {
    double t0 = timed_begin(c);
    mpi_alltoall(c, send, recv, bytes, what);
    c->busy_s += now_s() - t0;
}
static void timed_allreduce_sum(struct comm *c, void *buf, size_t count, enum comm_dtype dt, const char *what) {
    double t0 = timed_begin(c);
    mpi_allreduce_sum(c, buf, count, dt, what);
    c->busy_s += now_s() - t0;
}
static void timed_bcast(struct comm *c, void *buf, size_t bytes, int root, const char *what) {
    double t0 = timed_begin(c);
    mpi_bcast(c, buf, bytes, root, what);
    c->busy_s += now_s() - t0;
}

static const struct comm_ops mpi_ops = {
    .name = "mpi",
    .allgather = timed_allgather,
    .alltoall = timed_alltoall,
    .allreduce_sum = timed_allreduce_sum,
    .bcast = timed_bcast,
    .send = mpi_send,
    .recv = mpi_recv,
    .barrier = mpi_barrier,
    .free = mpi_free,
    .isend = mpi_isend,
    .wait = mpi_wait,
};

struct comm *comm_mpi_new_named(MPI_Comm c, const char *name) {
    struct mpi_priv *p = ds_calloc(1, sizeof *p);
    struct comm *cm = ds_calloc(1, sizeof *cm);
    cm->ops = &mpi_ops;
    cm->priv = p;
    snprintf(p->name, sizeof p->name, "%s", name && name[0] ? name : "communicator");
    /* The duplicate is collective too, so it gets the watchdog like everything else. */
    struct comm_op o;
    comm_op_begin(&o, priv_of(cm)->name, "comm_mpi_new", "MPI_Comm_idup");
    MPI_Request req;
    CHECK_MPI(MPI_Comm_idup(c, &p->comm, &req));
    op_wait(&o, &req, NULL);
    CHECK_MPI(MPI_Comm_set_errhandler(p->comm, MPI_ERRORS_RETURN));
    CHECK_MPI(MPI_Comm_set_name(p->comm, p->name));
    CHECK_MPI(MPI_Comm_rank(p->comm, &cm->rank));
    CHECK_MPI(MPI_Comm_size(p->comm, &cm->size));
    return cm;
}

struct comm *comm_mpi_new(MPI_Comm c) {
    char name[MPI_MAX_OBJECT_NAME] = "";
    int len = 0;
    CHECK_MPI(MPI_Comm_get_name(c, name, &len));
    return comm_mpi_new_named(c, name);
}
