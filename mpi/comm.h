/* The comm table: every collective and point-to-point transfer the model needs, over an opaque
 * communicator, so model code never calls MPI or NCCL directly. The MPI backend (comm_mpi.c) works
 * on host buffers; the NCCL backend (CUDA issue) implements the same table on device buffers.
 *
 * Every operation is blocking from the caller's view, and has a deadline (the watchdog): when it
 * expires the rank prints rank, pipeline stage, micro-batch and the pending operation, and aborts
 * the whole job. Any library failure aborts the whole job too (CHECK_MPI). Reductions are
 * deterministic: the result depends only on the inputs and the rank order, never on timing. */
#ifndef DS_COMM_H
#define DS_COMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum comm_dtype { COMM_F32 = 0, COMM_BF16, COMM_I32, COMM_I64, COMM_U8 };

struct comm;
struct comm_req; /* a send started by isend, finished by wait */

struct comm_ops {
    const char *name;
    /* recv[r * bytes .. (r+1) * bytes) = send of rank r. */
    void (*allgather)(struct comm *c, const void *send, void *recv, size_t bytes, const char *what);
    /* recv[r * bytes .. (r+1) * bytes) = block `rank` of rank r's send (send[r * bytes ..) goes to
     * rank r): the transpose of [size][size] blocks over the ranks. send and recv do not overlap. */
    void (*alltoall)(struct comm *c, const void *send, void *recv, size_t bytes, const char *what);
    /* Element-wise sum over ranks, in place. F32 and BF16 are summed in fp32 in rank order
     * (r = 0, 1, ...) and rounded once (BF16); integer types exactly. */
    void (*allreduce_sum)(struct comm *c, void *buf, size_t count, enum comm_dtype dt, const char *what);
    void (*bcast)(struct comm *c, void *buf, size_t bytes, int root, const char *what);
    void (*send)(struct comm *c, const void *buf, size_t bytes, int dst, int tag, const char *what);
    void (*recv)(struct comm *c, void *buf, size_t bytes, int src, int tag, const char *what);
    void (*barrier)(struct comm *c, const char *what);
    /* A send that returns at once (the buffer must stay untouched until wait): the pipeline's
     * answers travel against the flow of micro-batches, and two blocking sends facing each other
     * would wait for each other forever once a message is too large to be buffered. */
    struct comm_req *(*isend)(struct comm *c, const void *buf, size_t bytes, int dst, int tag, const char *what);
    void (*wait)(struct comm *c, struct comm_req *r); /* under the watchdog; frees r; NULL is a no-op */
    void (*free)(struct comm *c);
};

struct comm {
    const struct comm_ops *ops;
    int rank, size;
    void *priv; /* backend state (MPI_Comm for the MPI backend) */
    /* Seconds this rank has spent in the collectives (allgather, alltoall, allreduce_sum, bcast)
     * so far, waiting for its peers included, for the step trace's TP share. MPI: the call's host
     * time (with device staging, from after the queued kernels are done: they are the step's, not
     * the collective's). NCCL: the collective's span on the stream, between CUDA events. */
    double busy_s;
    /* allgather and alltoall only enqueue device work on the model's backend stream, through the
     * backend's own ops, and return without waiting for it: then the model records them inside its
     * graph segments (model_tp_between) instead of ending a segment at each one. False for the MPI
     * and NCCL backends (each op waits for its data under the watchdog: comm_nccl.c); bench_step's
     * TP stand-in sets it with --tp-standin graph. */
    bool stream_ordered;
};

/* The watchdog's deadline for every blocking operation, in seconds (job spec; default 300). */
void comm_set_deadline(double seconds);
/* What the rank is doing, for the watchdog's message. */
void comm_set_context(int pp_stage, int micro_batch);

#endif /* DS_COMM_H */
