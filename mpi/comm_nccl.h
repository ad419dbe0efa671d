/* The NCCL backend of the comm table (comm.h) on device buffers, built only with CUDA
 * (DS_HAVE_CUDA). One rank per GPU: NCCL refuses two ranks on one device, so comm_nccl_new checks
 * that first and returns NULL, and the caller falls back to the MPI backend with device staging
 * (comm_mpi_set_staging), which is how 16 ranks share one GPU.
 *
 * Every buffer handed to an op is device memory of the caller's current device; the ops enqueue
 * on the stream given at creation (the CUDA backend's, backend_cuda_stream) and then wait for that
 * stream under the watchdog, so they are blocking from the caller's view like the MPI backend's,
 * and they order after every kernel the caller enqueued before. Differences from the MPI backend:
 *  - allreduce_sum keeps comm.h's contract (fp32 in rank order, one bf16 rounding) by gathering
 *    every rank's buffer and summing in rank order on the device, not by ncclAllReduce, whose
 *    ring/tree order depends on the rank count and the algorithm NCCL picks; the results are the
 *    same bits as the MPI backend's. The price is traffic: size x count elements per rank.
 *  - send/recv have no tags (NCCL has none): messages between two ranks match in the order they
 *    were issued, and a size mismatch is not detected. NCCL has no eager buffering: a send
 *    completes only once its receiver has posted the recv, and ops of one comm run in issue
 *    order. isend is therefore deferred until the comm's next op or the wait; a recv issued while
 *    isends are pending goes out with them as one NCCL group, which serves the exchange isend
 *    exists for (each rank isends to its peer, recvs from it, waits; also to itself), but that
 *    recv returns only once every send of the group was received: a peer that first waits for
 *    something else from us deadlocks where MPI would have buffered (the watchdog names it).
 *    A send to oneself must be an isend followed by the recv (NCCL refuses a lone one as invalid
 *    usage, which aborts the job). Keep host data, and pipeline traffic with several messages in
 *    flight, on an MPI comm (with staging for device buffers).
 *  - barrier is an MPI barrier over the same ranks. */
#ifndef DS_COMM_NCCL_H
#define DS_COMM_NCCL_H

#ifdef DS_HAVE_CUDA

#include <stddef.h>

#include <mpi.h>

#include "comm.h"

/* Collective over `c` (the caller keeps and frees `c`): checks that every rank has a CUDA device
 * and that no two ranks share one (device UUIDs gathered over `c`), then ncclGetUniqueId on rank
 * 0, MPI_Bcast, ncclCommInitRank on the caller's current device. `name` is what the watchdog
 * prints; `cuda_stream` is a cudaStream_t of that device (NULL: the legacy default stream).
 * Returns NULL with ds_err_set on every rank alike when a rank has no device or two ranks share
 * one; library failures abort the job (CHECK_NCCL). */
struct comm *comm_nccl_new(MPI_Comm c, const char *name, void *cuda_stream);

/* Bound, in bytes, on the device scratch of allreduce_sum (the gathered copy of one round; default
 * 64 MiB, larger reductions go in rounds). Tests lower it to run the rounds on small buffers;
 * 0 restores the default. */
void comm_nccl_set_tmp_limit(size_t max_tmp_bytes);

/* The device half of allreduce_sum, for tests (one GPU cannot hold an NCCL comm of several
 * ranks): out[i] = in[0][i] + in[1][i] + ... + in[nranks-1][i] with in = [nranks][count] device
 * memory, the arithmetic comm.h states, enqueued on `cuda_stream` and waited for. */
void comm_nccl_sum_rank_order(void *out, const void *in, size_t count, int nranks, enum comm_dtype dt, void *cuda_stream);

#endif /* DS_HAVE_CUDA */
#endif /* DS_COMM_NCCL_H */
