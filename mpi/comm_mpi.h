/* The MPI backend of the comm table (comm.h) on host buffers. It is what CPU ranks use and what CI
 * runs the real TP x PP schedule on (16 oversubscribed ranks); the NCCL backend implements the
 * same table on device buffers. Every operation is a nonblocking MPI call completed under the
 * watchdog (comm_set_deadline), so a stuck peer ends the job with a message instead of a hang. */
#ifndef DS_COMM_MPI_H
#define DS_COMM_MPI_H

#include <stddef.h>

#include <mpi.h>

#include "comm.h"

/* Collective over `c`: duplicates it (the caller keeps and frees `c`), sets MPI_ERRORS_RETURN on
 * the duplicate so CHECK_MPI sees every failure. The watchdog names it by MPI's name for `c`. */
struct comm *comm_mpi_new(MPI_Comm c);
/* The same with the name the watchdog prints ("tp group 1", "pp pair 3", ...). */
struct comm *comm_mpi_new_named(MPI_Comm c, const char *name);

/* The MPI communicator behind a comm made here (for the rare call the table lacks). */
MPI_Comm comm_mpi_handle(const struct comm *c);

/* Who this rank is, for the watchdog's message (set by topo_init next to log_set_identity). */
void comm_mpi_set_identity(int world_rank, int pp_stage, int tp_rank);

/* Largest piece, in bytes, one MPI call moves (default INT_MAX) and the bound on the allreduce
 * temporary (default 64 MiB). Tests lower them to run the chunked paths on small buffers;
 * 0 restores the default. */
void comm_mpi_set_chunk_limits(size_t max_msg_bytes, size_t max_tmp_bytes);

/* Current watchdog settings (shared with other backends through these getters). */
double comm_get_deadline(void);
void comm_get_context(int *pp_stage, int *micro_batch);

#endif /* DS_COMM_MPI_H */
