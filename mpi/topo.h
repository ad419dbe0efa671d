/* Parallel topology: world -> DP x PP x TP with TP fastest, then PP, then DP
 * (world rank = (dp * pp + stage) * tp + tp_rank), sub-communicators for TP groups, PP pairs and DP
 * replicas, the node-local communicator (MPI_COMM_TYPE_SHARED) and the GPU = node-local rank.
 * Also the pipeline stage split by layer ranges, which may not cut a KV-sharing group. */
#ifndef DS_TOPO_H
#define DS_TOPO_H

#include <stdio.h>

#include "comm.h"
#include "config.h"

#define TOPO_MAX_PP 64

struct topo {
    int world_size, world_rank;
    int tp, pp, dp;
    int tp_rank, pp_rank, dp_rank;
    int node_rank, node_size; /* node-local rank and size */
    int device;               /* GPU index = node-local rank (-1 on CPU runs) */
    char host[64];
    int layer_begin[TOPO_MAX_PP], layer_end[TOPO_MAX_PP]; /* backbone layers of each stage */
    struct comm *world, *tp_comm, *pp_comm, *dp_comm, *node_comm;
    /* pp_comm: the ranks with the same (dp, tp_rank), ordered by stage */
};

/* Stage split of the backbone layers (pure; unit-tested): explicit counts per stage (NULL = even
 * split moved to the nearest valid boundary). A boundary is valid when no layer at or after it
 * reads compressed KV or top-k from a layer before it. Returns 0 or -1 (ds_err_set). */
int topo_stage_split(const struct model_config *cfg, int pp, const int *counts, int *begin, int *end);

/* Check that TP fits the model: tp divides o_groups, heads, index heads, routed and DSpark experts
 * and vocab, and every quantized slice falls on 32-wide tiles. Returns 0 or -1 (ds_err_set). */
int topo_check_tp(const struct model_config *cfg, int tp);

/* Collective over MPI_COMM_WORLD (MPI must be initialised): factor the world (tp, pp given; 0 =
 * default: 16 ranks -> TP8 x PP2, otherwise TP = min(world, largest legal TP), PP = 1), split
 * the communicators, assign devices. Every rank validates the same way, so a bad layout is the same
 * one-line error on every rank. Returns 0 or -1 (ds_err_set). */
int topo_init(struct topo *t, const struct model_config *cfg, int tp, int pp, const int *pp_counts);
void topo_free(struct topo *t);
/* Rank 0 prints the table (rank, dp, pp, tp, host, pid, device) gathered from every rank; also
 * returned as text (caller frees) for /meta. */
char *topo_rank_table(const struct topo *t);

#endif /* DS_TOPO_H */
