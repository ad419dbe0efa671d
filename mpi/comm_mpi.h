/* The MPI backend of the comm table (comm.h) on host buffers. It is what CPU ranks use and what CI
 * runs the real TP x PP schedule on (16 oversubscribed ranks); the NCCL backend implements the
 * same table on device buffers. Every operation is a nonblocking MPI call completed under the
 * watchdog (comm_set_deadline), so a stuck peer ends the job with a message instead of a hang.
 *
 * With device staging (comm_mpi_set_staging) the same comm takes backend (device) buffers and
 * copies them through host memory around each MPI call: Open MPI here is not CUDA-aware, and NCCL
 * refuses two ranks on one GPU, so this is how several ranks sharing a GPU talk. */
#ifndef DS_COMM_MPI_H
#define DS_COMM_MPI_H

#include <stddef.h>

#include <mpi.h>

#include "comm.h"

struct backend;

/* Collective over `c`: duplicates it (the caller keeps and frees `c`), sets MPI_ERRORS_RETURN on
 * the duplicate so CHECK_MPI sees every failure. The watchdog names it by MPI's name for `c`. */
struct comm *comm_mpi_new(MPI_Comm c);
/* The same with the name the watchdog prints ("tp group 1", "pp pair 3", ...). */
struct comm *comm_mpi_new_named(MPI_Comm c, const char *name);

/* The MPI communicator behind a comm made here (for the rare call the table lacks). Aborts when
 * `c` is not an MPI comm (an NCCL comm's priv is not an MPI_Comm). */
MPI_Comm comm_mpi_handle(const struct comm *c);

/* Device staging (local, not collective): from now on every buffer handed to an op of `c` is a
 * pointer of backend `be` (be->ops->alloc memory). Each op downloads its input into a host buffer
 * that the comm owns and grows as needed (page-locked by `be` where it can: host_alloc), runs
 * the usual MPI operation on it, and uploads the
 * result (isend stages into a buffer of its own, freed by wait). Results are the same bits as the
 * host path: allreduce_sum still adds in rank order on the host. Ranks need not agree: staging
 * changes only where this rank's buffers live, not the bytes on the wire. be == NULL turns
 * staging off (the default: host buffers). `be` must outlive the comm or the next call. */
void comm_mpi_set_staging(struct comm *c, struct backend *be);

/* Who this rank is, for the watchdog's message (set by topo_init next to log_set_identity). */
void comm_mpi_set_identity(int world_rank, int pp_stage, int tp_rank);

/* Largest piece, in bytes, one MPI call moves (default INT_MAX) and the bound on the allreduce
 * temporary (default 64 MiB). Tests lower them to run the chunked paths on small buffers;
 * 0 restores the default. */
void comm_mpi_set_chunk_limits(size_t max_msg_bytes, size_t max_tmp_bytes);

/* Current watchdog settings (shared with other backends through these getters). */
double comm_get_deadline(void);
void comm_get_context(int *pp_stage, int *micro_batch);

/* The watchdog's one line on stderr, the same for every backend: "dsbatch: watchdog: rank R (pp S,
 * tp T, micro-batch M) host H: <desc> '<what>' on <comm_name> pending after W s". Prints only;
 * the caller aborts (the NCCL backend first aborts its NCCL communicator). */
/* One operation in flight, shared by the comm backends: what the watchdog names, and when it
 * started (the deadline covers the whole operation, every piece of it, not each piece). */
struct comm_op {
    const char *comm_name;
    char desc[96]; /* "allreduce_sum", "send (to 3, tag 0)", ... */
    const char *what;
    double start;
};
void comm_op_begin(struct comm_op *o, const char *comm_name, const char *what, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
double comm_now_s(void); /* monotonic seconds */
void comm_watchdog_print(const char *comm_name, const char *desc, const char *what, double waited);

#endif /* DS_COMM_MPI_H */
