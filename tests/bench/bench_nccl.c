/* TP collective benchmark (issue #7): latency and bus bandwidth of the comm table's allgather,
 * alltoall and allreduce_sum (mpi/comm.h: the very calls the model makes for its TP collectives) at
 * the model's message sizes, in the style of nccl-tests, and the two forms of the routed experts'
 * exchange side by side (--moe). Run under mpirun with one rank per GPU:
 *
 *   env NCCL_NVLS_ENABLE=0 mpirun -np 8 -x NCCL_NVLS_ENABLE=0 build/bench/bench_nccl [options]
 *
 * Each rank takes the GPU of its node-local rank (as the engine does), makes it current with
 * backend_cuda_init (kernels/backend.h: its stream and stream-ordered memory are the engine's) and
 * creates the TP comm with comm_nccl_new on that stream, as dist_tp_comm_for_backend does. With
 * --mpi-staging the MPI comm with device staging (comm_mpi_set_staging: what ranks sharing a GPU
 * use) is timed the same way; with --raw, ncclAllGather / ncclAllReduce called directly on a
 * communicator of the bench's own (the floor under the comm table: no pointer checks, no polling
 * wait, and a real ring/tree all-reduce instead of the table's gather + rank-order sum).
 *
 * Options:
 *   --sizes LIST    message sizes, comma-separated, bytes with optional suffix K/KB/M/MB (10^3, 10^6)
 *                   or KiB/MiB (2^10, 2^20), fractions allowed (2.6MB). Default
 *                   10KiB,32KiB,128KiB,512KiB,1MiB,2.6MB. A size is the argument the model passes:
 *                   allgather's bytes per rank, allreduce_sum's buffer bytes (rounded up to a whole
 *                   element of --dtype).
 *   --ops LIST      allgather,alltoall,allreduce (default allgather,allreduce); alltoall's size is
 *                   the bytes per rank pair
 *   --moe ROWS      also time the experts' TP exchange (model.c, enum moe_exchange) at these step
 *                   row counts T (comma-separated): "moe_gather" = one allgather of the slots
 *                   [T, k, D] bf16; "moe_owner" = an alltoall of their D/n column blocks, then an
 *                   allgather of the [T, D/n] sums (the collectives only: the pack, combine and
 *                   interleave kernels are not in the time). total_B is what one rank receives.
 *   --moe-shape D,k the slots' width and count (default 5120,6: V4.1-Flash)
 *   --dtype T       allreduce dtype: bf16 (default, the model's) or f32
 *   --iters N       timed iterations per size (default 50); --warmup N untimed ones first (10)
 *   --csv PATH      append one row per (comm, op, size); the header is written when PATH is empty
 *   --label TEXT    a free label for the CSV rows (e.g. "model b=64")
 *   --mpi-staging   also time the MPI comm with device staging
 *   --raw           also time ncclAllGather / ncclAllReduce directly
 *   --share         device = node-local rank modulo the visible GPUs (ranks may share one); the
 *                   NCCL comm then refuses (one GPU per rank) and only --mpi-staging runs
 *   --watchdog S    the comm table's deadline (default 120 s)
 *   --cpu           no GPU: the MPI comm staged through the CPU backend (host memory) only; tests the
 *                   bench itself where there is no GPU (the numbers are MPI over shared memory)
 *
 * Timing. Per iteration: MPI barrier, clock, one blocking op (the table's ops return once the
 * result is in place; the raw ops are followed by cudaStreamSynchronize), clock. An iteration's
 * time is the maximum over ranks (a collective is done when its last rank is), and the reported
 * time is the median over iterations (min, p90, max too). loop_us is the nccl-tests measure: N
 * ops back to back between two barriers, divided by N (the raw ops are enqueued back to back and
 * synchronized once). Bandwidths follow nccl-tests (PERFORMANCE.md there): algbw = S / time with S
 * the op's whole buffer (allgather: bytes per rank x ranks, i.e. the gathered size; allreduce: the
 * buffer), busbw = algbw x (n-1)/n for allgather and algbw x 2(n-1)/n for allreduce. Note that the
 * NCCL backend's allreduce_sum is an allgather of every rank's buffer plus a rank-order sum
 * (comm_nccl.c), so each rank receives (n-1) x S bytes, not the 2(n-1)/n x S of a ring all-reduce:
 * its busbw is the nccl-tests formula applied to its time, comparable with --raw's, not a link
 * rate. After the timing of each size the op is run once more on known data and the result
 * checked (the check column; any failure makes the exit code 1).
 *
 * Output: a table on rank 0's stdout (with NCCL's runtime version and NCCL_NVLS_ENABLE as seen by
 * the ranks) and, with --csv, rows of
 * label,comm,op,ranks,gpus,size_bytes,total_bytes,dtype,iters,median_us,min_us,p90_us,max_us,loop_us,
 * algbw_gbps,busbw_gbps,loop_busbw_gbps,check,nvls_env
 * (GB/s = 1e9 bytes/s). Without a GPU (or a build without CUDA) it prints one error line on rank 0
 * and exits 1. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include <mpi.h>

#include "backend.h"
#include "comm.h"
#include "comm_mpi.h"
#include "log.h"

#ifdef DS_HAVE_CUDA
#include <cuda_runtime.h>
#include <nccl.h>

#include "comm_nccl.h"
#endif

#define MAX_SIZES 64

static int g_rank, g_size;

/* One error line from rank 0, then every rank leaves with 1. Collective: every rank calls it. */
static int fail_all(const char *msg) {
    if (g_rank == 0) {
        fprintf(stderr, "bench_nccl: error: %s\n", msg);
        fflush(stderr);
    }
    MPI_Finalize();
    return 1;
}

/* "2.6MB" -> 2600000, "10KiB" -> 10240; 0 on a malformed size. */
static size_t parse_size(const char *s) {
    char *e;
    double v = strtod(s, &e);
    if (e == s || !(v > 0)) return 0;
    double mul = 1;
    if (!*e || !strcasecmp(e, "B")) mul = 1;
    else if (!strcasecmp(e, "K") || !strcasecmp(e, "KB")) mul = 1e3;
    else if (!strcasecmp(e, "M") || !strcasecmp(e, "MB")) mul = 1e6;
    else if (!strcasecmp(e, "G") || !strcasecmp(e, "GB")) mul = 1e9;
    else if (!strcasecmp(e, "KiB")) mul = 1024;
    else if (!strcasecmp(e, "MiB")) mul = 1048576;
    else if (!strcasecmp(e, "GiB")) mul = 1073741824.0;
    else return 0;
    double b = round(v * mul); /* nearest byte: 2.6MB is 2600000, not one more from rounding */
    return b >= 1 && b < 1e12 ? (size_t)b : 0;
}

struct args {
    size_t sizes[MAX_SIZES];
    int n_sizes;
    bool do_gather, do_reduce, do_alltoall;
    int64_t moe_rows[MAX_SIZES];
    int n_moe;
    int64_t moe_D, moe_k;
    enum comm_dtype dt;
    int iters, warmup;
    const char *csv, *label;
    bool staging, raw, share, cpu;
    double watchdog;
};

/* Returns NULL or the error text. */
static const char *parse_args(int argc, char **argv, struct args *a) {
    static char err[512];
    *a = (struct args){.do_gather = true, .do_reduce = true, .dt = COMM_BF16, .iters = 50, .warmup = 10,
                       .label = "", .watchdog = 120, .moe_D = 5120, .moe_k = 6};
    const char *sizes = "10KiB,32KiB,128KiB,512KiB,1MiB,2.6MB";
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(o, "--mpi-staging")) a->staging = true;
        else if (!strcmp(o, "--raw")) a->raw = true;
        else if (!strcmp(o, "--share")) a->share = true;
        else if (!strcmp(o, "--cpu")) a->cpu = a->staging = true;
        else if (!strcmp(o, "--help") || !strcmp(o, "-h")) return "help";
        else if (!v) {
            snprintf(err, sizeof err, "unknown option or missing value: '%s' (see --help)", o);
            return err;
        } else {
            i++;
            if (!strcmp(o, "--sizes")) sizes = v;
            else if (!strcmp(o, "--csv")) a->csv = v;
            else if (!strcmp(o, "--label")) a->label = v;
            else if (!strcmp(o, "--iters")) a->iters = atoi(v);
            else if (!strcmp(o, "--warmup")) a->warmup = atoi(v);
            else if (!strcmp(o, "--watchdog")) a->watchdog = atof(v);
            else if (!strcmp(o, "--dtype")) {
                if (!strcmp(v, "bf16")) a->dt = COMM_BF16;
                else if (!strcmp(v, "f32")) a->dt = COMM_F32;
                else {
                    snprintf(err, sizeof err, "--dtype: '%s' is not bf16 or f32", v);
                    return err;
                }
            } else if (!strcmp(o, "--ops")) {
                a->do_gather = strstr(v, "allgather") != NULL;
                a->do_reduce = strstr(v, "allreduce") != NULL;
                a->do_alltoall = strstr(v, "alltoall") != NULL;
                if (!a->do_gather && !a->do_reduce && !a->do_alltoall) {
                    snprintf(err, sizeof err, "--ops: '%s' names none of allgather, alltoall, allreduce", v);
                    return err;
                }
            } else if (!strcmp(o, "--moe")) {
                char *list = ds_strdup(v), *save = NULL;
                for (char *tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
                    long long r = atoll(tok);
                    if (r < 1 || a->n_moe == MAX_SIZES) {
                        snprintf(err, sizeof err, "--moe: '%s' is not a row count >= 1 (at most %d of them)", tok,
                                 MAX_SIZES);
                        free(list);
                        return err;
                    }
                    a->moe_rows[a->n_moe++] = r;
                }
                free(list);
            } else if (!strcmp(o, "--moe-shape")) {
                long long d = 0, k = 0;
                if (sscanf(v, "%lld,%lld", &d, &k) != 2 || d < 1 || k < 1) {
                    snprintf(err, sizeof err, "--moe-shape: '%s' is not D,k (two positive integers)", v);
                    return err;
                }
                a->moe_D = d;
                a->moe_k = k;
            } else {
                snprintf(err, sizeof err, "unknown option '%s' (see --help)", o);
                return err;
            }
        }
    }
    if (a->iters < 1 || a->warmup < 0) return "--iters must be >= 1 and --warmup >= 0";
    char *list = ds_strdup(sizes), *save = NULL;
    for (char *tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        size_t b = parse_size(tok);
        if (!b) {
            snprintf(err, sizeof err, "--sizes: '%s' is not a size (bytes, or a number with K, KB, KiB, M, MB, MiB)",
                     tok);
            free(list);
            return err;
        }
        if (a->n_sizes == MAX_SIZES) {
            snprintf(err, sizeof err, "--sizes: more than %d sizes", MAX_SIZES);
            free(list);
            return err;
        }
        a->sizes[a->n_sizes++] = b;
    }
    free(list);
    if (!a->n_sizes) return "--sizes: empty list";
    return NULL;
}

static void usage(void) {
    printf("usage: mpirun -np N bench_nccl [--sizes 10KiB,32KiB,...] [--ops allgather,alltoall,allreduce]\n"
           "       [--dtype bf16|f32] [--moe ROWS] [--moe-shape D,k] [--iters N] [--warmup N] [--csv PATH]\n"
           "       [--label TEXT] [--mpi-staging] [--raw] [--share] [--watchdog S] [--cpu]\n"
           "One rank per GPU (device = node-local rank); times the comm table's allgather, alltoall and\n"
           "allreduce_sum on the NCCL comm (and the MPI comm with device staging, and raw NCCL), nccl-tests\n"
           "style, and with --moe the experts' gather and owner exchanges at those step rows.\n"
           "Keep NCCL_NVLS_ENABLE=0 where NVLink multicast must stay off.\n");
}

#ifdef DS_HAVE_CUDA

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The percentile of sorted v[n] (nearest rank). */
static double pct(const double *v, int n, double p) {
    int i = (int)ceil(p * n) - 1;
    if (i < 0) i = 0;
    if (i >= n) i = n - 1;
    return v[i];
}

static int node_rank(void) {
    MPI_Comm node;
    int r = 0;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &r);
    MPI_Comm_free(&node);
    return r;
}

enum bench_op { OP_GATHER, OP_REDUCE, OP_ALLTOALL, OP_MOE_GATHER, OP_MOE_OWNER };
static const char *const op_names[] = {"allgather", "allreduce_sum", "alltoall", "moe_gather", "moe_owner"};
enum bench_comm { BC_NCCL, BC_STAGED, BC_RAW };
static const char *const comm_names[] = {"nccl", "mpi-staged", "nccl-raw"};

struct bench {
    const struct args *a;
    struct backend *be;
    cudaStream_t stream;
    struct comm *nccl, *staged;
    ncclComm_t raw;
    int gpus; /* distinct GPUs among the ranks */
    FILE *csv;
    int failed;
    const char *nvls;
};

static size_t dt_size(enum comm_dtype dt) { return dt == COMM_F32 ? 4 : 2; }

static void check_cuda(cudaError_t e, const char *what) {
    if (e != cudaSuccess) ds_fatal(__FILE__, __LINE__, "bench_nccl", "CUDA", what, cudaGetErrorString(e));
}
static void check_nccl(ncclResult_t r, const char *what) {
    if (r != ncclSuccess) ds_fatal(__FILE__, __LINE__, "bench_nccl", "NCCL", what, ncclGetErrorString(r));
}

/* One op of the chosen comm on the prepared buffers; blocking for the table's comms; the raw ops
 * only enqueue (the caller synchronizes). size: allgather's bytes per rank, allreduce's buffer,
 * alltoall's bytes per rank pair; for the two MoE exchanges, the slots' bytes [T, k, D] (send and
 * recv hold n times that, buf [T, D]). */
static void run_op(struct bench *B, enum bench_comm bc, enum bench_op op, void *send, void *recv, void *buf,
                   size_t size) {
    enum comm_dtype dt = B->a->dt;
    size_t count = size / dt_size(dt);
    if (op == OP_ALLTOALL || op == OP_MOE_GATHER || op == OP_MOE_OWNER) {
        struct comm *c = bc == BC_NCCL ? B->nccl : B->staged;
        if (op == OP_ALLTOALL) {
            c->ops->alltoall(c, send, recv, size, "bench alltoall");
        } else if (op == OP_MOE_GATHER) {
            c->ops->allgather(c, send, recv, size, "bench moe gather");
        } else {
            size_t cols = size / (size_t)g_size / (size_t)B->a->moe_k; /* [T, D/n] bf16 */
            c->ops->alltoall(c, send, recv, size / (size_t)g_size, "bench moe owner blocks");
            c->ops->allgather(c, send, buf, cols, "bench moe owner sums");
        }
        return;
    }
    if (bc == BC_RAW) {
        if (op == OP_GATHER)
            check_nccl(ncclAllGather(send, recv, size, ncclUint8, B->raw, B->stream), "ncclAllGather");
        else
            check_nccl(ncclAllReduce(buf, buf, count, dt == COMM_F32 ? ncclFloat32 : ncclBfloat16, ncclSum, B->raw,
                                     B->stream),
                       "ncclAllReduce");
        return;
    }
    struct comm *c = bc == BC_NCCL ? B->nccl : B->staged;
    if (op == OP_GATHER)
        c->ops->allgather(c, send, recv, size, "bench allgather");
    else
        c->ops->allreduce_sum(c, buf, count, dt, "bench allreduce");
}

/* bf16 bits of a small integer (exact up to 256). */
static uint16_t bf16_int(int v) {
    float f = (float)v;
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

/* Run the op once on known data and check the result on the host: allgather's block r holds
 * bytes (r * 7 + i) & 0xff; allreduce of every rank's (rank + 1) gives n(n+1)/2 everywhere. */
static bool check_once(struct bench *B, enum bench_comm bc, enum bench_op op, void *send, void *recv, void *buf,
                       size_t size) {
    struct backend *be = B->be;
    bool ok = true;
    if (op == OP_MOE_GATHER || op == OP_MOE_OWNER) return true; /* their ops are checked on their own */
    if (op == OP_ALLTOALL) { /* block d of rank s holds (s * 7 + d * 13 + i) & 0xff */
        size_t all = size * (size_t)g_size;
        uint8_t *h = ds_malloc(all);
        for (int d = 0; d < g_size; d++)
            for (size_t i = 0; i < size; i++) h[(size_t)d * size + i] = (uint8_t)(g_rank * 7 + d * 13 + (int)i);
        be->ops->upload(be, send, h, all);
        memset(h, 0xEE, all);
        be->ops->upload(be, recv, h, all);
        run_op(B, bc, op, send, recv, buf, size);
        be->ops->download(be, h, recv, all);
        for (int s = 0; s < g_size && ok; s++)
            for (size_t i = 0; i < size; i++)
                if (h[(size_t)s * size + i] != (uint8_t)(s * 7 + g_rank * 13 + (int)i)) {
                    ok = false;
                    break;
                }
        free(h);
    } else if (op == OP_GATHER) {
        uint8_t *h = ds_malloc(size * (size_t)g_size);
        for (size_t i = 0; i < size; i++) h[i] = (uint8_t)(g_rank * 7 + (int)i);
        be->ops->upload(be, send, h, size);
        memset(h, 0xEE, size * (size_t)g_size);
        be->ops->upload(be, recv, h, size * (size_t)g_size);
        run_op(B, bc, op, send, recv, buf, size);
        if (bc == BC_RAW) check_cuda(cudaStreamSynchronize(B->stream), "cudaStreamSynchronize");
        be->ops->download(be, h, recv, size * (size_t)g_size);
        for (int r = 0; r < g_size && ok; r++)
            for (size_t i = 0; i < size; i++)
                if (h[(size_t)r * size + i] != (uint8_t)(r * 7 + (int)i)) {
                    ok = false;
                    break;
                }
        free(h);
    } else {
        size_t count = size / dt_size(B->a->dt);
        void *h = ds_malloc(size);
        for (size_t i = 0; i < count; i++) {
            if (B->a->dt == COMM_F32) ((float *)h)[i] = (float)(g_rank + 1);
            else ((uint16_t *)h)[i] = bf16_int(g_rank + 1);
        }
        be->ops->upload(be, buf, h, size);
        run_op(B, bc, op, send, recv, buf, size);
        if (bc == BC_RAW) check_cuda(cudaStreamSynchronize(B->stream), "cudaStreamSynchronize");
        be->ops->download(be, h, buf, size);
        int want = g_size * (g_size + 1) / 2;
        for (size_t i = 0; i < count && ok; i++)
            ok = B->a->dt == COMM_F32 ? ((float *)h)[i] == (float)want : ((uint16_t *)h)[i] == bf16_int(want);
        free(h);
    }
    int mine = ok ? 0 : 1, any = 0;
    MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    return any == 0;
}

static void bench_one(struct bench *B, enum bench_comm bc, enum bench_op op, size_t size_req) {
    const struct args *a = B->a;
    struct backend *be = B->be;
    size_t esz = op == OP_REDUCE ? dt_size(a->dt) : 1;
    size_t size = (size_req + esz - 1) / esz * esz;
    int64_t rows = 0;
    if (op == OP_MOE_GATHER || op == OP_MOE_OWNER) { /* size_req is the step's rows */
        rows = (int64_t)size_req;
        size = (size_t)(rows * a->moe_k * a->moe_D) * 2;
    }
    void *send = NULL, *recv = NULL, *buf = NULL;
    if (op == OP_GATHER) {
        send = be->ops->alloc(be, size);
        recv = be->ops->alloc(be, size * (size_t)g_size);
    } else if (op == OP_REDUCE) {
        buf = be->ops->alloc(be, size);
    } else { /* alltoall: n blocks each way; the MoE forms: the slots, n of them gathered, [T, D] */
        send = be->ops->alloc(be, size * (op == OP_ALLTOALL ? (size_t)g_size : 1));
        recv = be->ops->alloc(be, size * (size_t)g_size);
        if (rows) buf = be->ops->alloc(be, (size_t)(rows * a->moe_D) * 2);
    }
    be->ops->sync(be);
    /* In-place allreduce repeated on the same buffer: the values grow (bf16 overflow to inf is
     * no slower), which does not matter for the time; the check below re-uploads known data. */
    int n = a->iters;
    double *t = ds_malloc(sizeof(double) * (size_t)n), *tmax = ds_malloc(sizeof(double) * (size_t)n);
    for (int it = 0; it < a->warmup + n; it++) {
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        run_op(B, bc, op, send, recv, buf, size);
        if (bc == BC_RAW) check_cuda(cudaStreamSynchronize(B->stream), "cudaStreamSynchronize");
        double t1 = MPI_Wtime();
        if (it >= a->warmup) t[it - a->warmup] = t1 - t0;
    }
    MPI_Allreduce(t, tmax, n, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    double l0 = MPI_Wtime();
    for (int it = 0; it < n; it++) run_op(B, bc, op, send, recv, buf, size);
    if (bc == BC_RAW) check_cuda(cudaStreamSynchronize(B->stream), "cudaStreamSynchronize");
    double loop = MPI_Wtime() - l0, loop_max = 0;
    MPI_Allreduce(&loop, &loop_max, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    bool ok = check_once(B, bc, op, send, recv, buf, size);
    if (!ok) B->failed++;

    qsort(tmax, (size_t)n, sizeof *tmax, cmp_double);
    double med = pct(tmax, n, 0.5), lus = loop_max / n;
    /* total: nccl-tests' S (the gathered size, the reduced buffer, all of a rank's alltoall blocks);
     * the MoE forms: the bytes one rank receives, which is also their busbw's numerator */
    size_t total = op == OP_GATHER || op == OP_ALLTOALL ? size * (size_t)g_size : size;
    double factor = op == OP_GATHER || op == OP_ALLTOALL ? (double)(g_size - 1) / g_size : 2.0 * (g_size - 1) / g_size;
    if (op == OP_MOE_GATHER) total = size * (size_t)(g_size - 1), factor = 1;
    if (op == OP_MOE_OWNER)
        total = size / (size_t)g_size * (size_t)(g_size - 1) * (size_t)(a->moe_k + 1) / (size_t)a->moe_k, factor = 1;
    double algbw = (double)total / med / 1e9, busbw = algbw * factor, loop_busbw = (double)total / lus / 1e9 * factor;
    const char *opname = op_names[op];
    const char *dtname = op == OP_REDUCE ? (a->dt == COMM_F32 ? "f32" : "bf16") : op >= OP_MOE_GATHER ? "bf16" : "u8";
    char label[160];
    if (rows)
        snprintf(label, sizeof label, "%s%smoe T=%lld D=%lld k=%lld", a->label, a->label[0] ? " " : "", (long long)rows,
                 (long long)a->moe_D, (long long)a->moe_k);
    else
        snprintf(label, sizeof label, "%s", a->label);
    if (g_rank == 0) {
        char tail[32] = "";
        if (rows) snprintf(tail, sizeof tail, "  T=%lld", (long long)rows);
        printf("%-11s %-13s %10zu %11zu %10.1f %9.1f %9.1f %9.1f %9.1f %10.2f %10.2f  %s%s\n", comm_names[bc], opname,
               size, total, med * 1e6, tmax[0] * 1e6, pct(tmax, n, 0.9) * 1e6, tmax[n - 1] * 1e6, lus * 1e6, algbw,
               busbw, ok ? "ok" : "FAIL", tail);
        fflush(stdout);
        if (B->csv) {
            fprintf(B->csv, "\"%s\",%s,%s,%d,%d,%zu,%zu,%s,%d,%.2f,%.2f,%.2f,%.2f,%.2f,%.4f,%.4f,%.4f,%s,%s\n", label,
                    comm_names[bc], opname, g_size, B->gpus, size, total, dtname, n, med * 1e6, tmax[0] * 1e6,
                    pct(tmax, n, 0.9) * 1e6, tmax[n - 1] * 1e6, lus * 1e6, algbw, busbw, loop_busbw, ok ? "ok" : "FAIL",
                    B->nvls);
            fflush(B->csv);
        }
    }
    free(t);
    free(tmax);
    if (send) be->ops->free(be, send);
    if (recv) be->ops->free(be, recv);
    if (buf) be->ops->free(be, buf);
    be->ops->sync(be);
}

static void bench_comm(struct bench *B, enum bench_comm bc) {
    const struct args *a = B->a;
    for (int s = 0; s < a->n_sizes; s++) {
        if (a->do_gather) bench_one(B, bc, OP_GATHER, a->sizes[s]);
        if (a->do_alltoall && bc != BC_RAW) bench_one(B, bc, OP_ALLTOALL, a->sizes[s]);
        if (a->do_reduce) bench_one(B, bc, OP_REDUCE, a->sizes[s]);
    }
    for (int s = 0; s < a->n_moe && bc != BC_RAW; s++) {
        bench_one(B, bc, OP_MOE_GATHER, (size_t)a->moe_rows[s]);
        bench_one(B, bc, OP_MOE_OWNER, (size_t)a->moe_rows[s]);
    }
}

/* Number of distinct GPUs among the ranks (by PCI bus id and host), for the report. */
static int distinct_gpus(int dev) {
    char me[96] = {0}, bus[32] = {0}, host[64] = {0};
    gethostname(host, sizeof host - 1);
    if (cudaDeviceGetPCIBusId(bus, (int)sizeof bus, dev) != cudaSuccess) (void)cudaGetLastError();
    snprintf(me, sizeof me, "%s/%s", host, bus);
    char *all = ds_malloc(sizeof me * (size_t)g_size);
    MPI_Allgather(me, sizeof me, MPI_CHAR, all, sizeof me, MPI_CHAR, MPI_COMM_WORLD);
    int n = 0;
    for (int r = 0; r < g_size; r++) {
        bool seen = false;
        for (int q = 0; q < r && !seen; q++) seen = !strcmp(all + (size_t)r * sizeof me, all + (size_t)q * sizeof me);
        n += !seen;
    }
    free(all);
    return n;
}

static void free_backend(const struct args *a, struct backend *be) {
    if (a->cpu) backend_cpu_free(be);
    else backend_cuda_free(be);
}

static int run(const struct args *a) {
    int nodes_rank = node_rank();
    int visible = 0;
    if (cudaGetDeviceCount(&visible) != cudaSuccess) {
        (void)cudaGetLastError();
        visible = 0;
    }
    int dev = a->share && visible > 0 ? nodes_rank % visible : nodes_rank;
    struct backend be;
    char why[400] = "";
    int bad = a->cpu ? backend_cpu_init(&be) != 0 : backend_cuda_init(&be, dev) != 0;
    if (bad) snprintf(why, sizeof why, "%s", ds_err_get());
    /* the first failing rank's reason, on every rank, so rank 0 prints one line */
    int first_bad = bad ? g_rank : g_size, fb = g_size, n_bad = 0;
    MPI_Allreduce(&first_bad, &fb, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(&bad, &n_bad, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (n_bad) {
        MPI_Bcast(why, sizeof why, MPI_CHAR, fb, MPI_COMM_WORLD);
        char msg[700];
        snprintf(msg, sizeof msg,
                 "%d of %d ranks have no usable GPU (rank %d: %s); bench_nccl needs one CUDA device per rank "
                 "(device = node-local rank%s)",
                 n_bad, g_size, fb, why, a->share ? " modulo the visible GPUs" : "; --share lets ranks share one");
        return fail_all(msg);
    }
    if (a->n_moe && a->moe_D % g_size) {
        char msg[200];
        snprintf(msg, sizeof msg, "--moe: D = %lld does not split into %d column blocks", (long long)a->moe_D, g_size);
        free_backend(a, &be);
        return fail_all(msg);
    }
    comm_mpi_set_identity(g_rank, 0, g_rank);
    comm_set_deadline(a->watchdog);
    struct bench B = {.a = a, .be = &be, .stream = a->cpu ? NULL : (cudaStream_t)backend_cuda_stream(&be)};
    B.gpus = a->cpu ? 0 : distinct_gpus(dev);
    const char *nv = getenv("NCCL_NVLS_ENABLE");
    B.nvls = nv ? nv : "unset";
    /* NCCL_NVLS_ENABLE as every rank sees it must agree (mpirun -x): say so when it does not */
    char mine[16] = {0}, *allnv = ds_malloc(sizeof mine * (size_t)g_size);
    snprintf(mine, sizeof mine, "%s", B.nvls);
    MPI_Gather(mine, sizeof mine, MPI_CHAR, allnv, sizeof mine, MPI_CHAR, 0, MPI_COMM_WORLD);
    bool nv_mixed = false;
    if (g_rank == 0)
        for (int r = 1; r < g_size; r++) nv_mixed |= strcmp(allnv + (size_t)r * sizeof mine, mine) != 0;
    free(allnv);

    B.nccl = a->cpu ? NULL : comm_nccl_new(MPI_COMM_WORLD, "bench tp comm (nccl)", B.stream);
    char refusal[600] = "";
    if (!B.nccl) snprintf(refusal, sizeof refusal, "%s", a->cpu ? "--cpu" : ds_err_get());
    if (!B.nccl && !a->staging) {
        char msg[700];
        snprintf(msg, sizeof msg, "comm_nccl_new refused: %s", refusal);
        free_backend(a, &be);
        return fail_all(msg);
    }
    if (a->staging) {
        B.staged = comm_mpi_new_named(MPI_COMM_WORLD, "bench tp comm (staged)");
        comm_mpi_set_staging(B.staged, &be);
    }
    if (a->raw && B.nccl) {
        ncclUniqueId id;
        memset(&id, 0, sizeof id);
        if (g_rank == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
        MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
        check_nccl(ncclCommInitRank(&B.raw, g_size, id, g_rank), "ncclCommInitRank");
    }
    if (g_rank == 0 && a->csv) {
        B.csv = fopen(a->csv, "a");
        if (!B.csv) {
            fprintf(stderr, "bench_nccl: error: %s: cannot open for appending\n", a->csv);
        } else if (ftell(B.csv) == 0) {
            fprintf(B.csv, "label,comm,op,ranks,gpus,size_bytes,total_bytes,dtype,iters,median_us,min_us,p90_us,max_us,"
                           "loop_us,algbw_gbps,busbw_gbps,loop_busbw_gbps,check,nvls_env\n");
        }
    }
    if (g_rank == 0) {
        int ver = 0;
        ncclGetVersion(&ver);
        struct cudaDeviceProp prop;
        memset(&prop, 0, sizeof prop);
        if (a->cpu) snprintf(prop.name, sizeof prop.name, "no GPU: --cpu, host memory");
        else check_cuda(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties");
        printf("# bench_nccl: %d ranks on %d GPU%s (%s), device = node-local rank%s; NCCL runtime %d (built %d.%d.%d); "
               "NCCL_NVLS_ENABLE=%s%s\n",
               g_size, B.gpus, B.gpus == 1 ? "" : "s", prop.name, a->share ? " mod visible" : "", ver, NCCL_MAJOR,
               NCCL_MINOR, NCCL_PATCH, B.nvls, nv_mixed ? " (NOT the same on every rank: pass it with mpirun -x)" : "");
        printf("# %d timed iterations after %d warm-up; time = max over ranks, median over iterations; "
               "allreduce dtype %s; label '%s'\n",
               a->iters, a->warmup, a->dt == COMM_F32 ? "f32" : "bf16", a->label);
        if (!B.nccl) printf("# NCCL comm refused (%s): timing the staged MPI comm only\n", refusal);
        printf("%-11s %-13s %10s %11s %10s %9s %9s %9s %9s %10s %10s  %s\n", "comm", "op", "size_B", "total_B",
               "median_us", "min_us", "p90_us", "max_us", "loop_us", "algbw_GB/s", "busbw_GB/s", "check");
        fflush(stdout);
    }
    if (B.nccl) bench_comm(&B, BC_NCCL);
    if (B.staged) bench_comm(&B, BC_STAGED);
    if (B.raw) bench_comm(&B, BC_RAW);

    if (B.csv) fclose(B.csv);
    if (B.raw) check_nccl(ncclCommDestroy(B.raw), "ncclCommDestroy");
    if (B.staged) B.staged->ops->free(B.staged);
    if (B.nccl) B.nccl->ops->free(B.nccl);
    free_backend(a, &be);
    int failed = B.failed;
    if (g_rank == 0 && failed) printf("# %d result check%s FAILED\n", failed, failed == 1 ? "" : "s");
    MPI_Finalize();
    return failed ? 1 : 0;
}

#endif /* DS_HAVE_CUDA */

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_size);
    log_set_identity(g_rank, 0, g_rank);
    struct args a;
    const char *err = parse_args(argc, argv, &a);
    if (err && !strcmp(err, "help")) {
        if (g_rank == 0) usage();
        MPI_Finalize();
        return 0;
    }
    if (err) return fail_all(err);
#ifdef DS_HAVE_CUDA
    return run(&a);
#else
    return fail_all("this build has no CUDA backend (build with nvcc present); bench_nccl needs one GPU per rank");
#endif
}
