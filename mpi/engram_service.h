/* The node-local Engram service: the Engram tables (layers.L.engram.embed.weight/.scale, ~101.5 GB
 * each in the release) held once per node in shared host memory, not once per rank.
 *
 * Every rank of a node that runs an Engram layer needs random rows of that layer's whole table;
 * eight private copies (or eight row slices plus an all-reduce per lookup) would cost 8x the host
 * memory or a collective per Engram layer. So node-local rank 0 allocates one MPI shared-memory
 * window over the node communicator sized for the union of the Engram layers of every stage that
 * has a rank on the node (stages may share a node), the node's ranks fill it once from the
 * mmap'd checkpoint, and every rank reads the same physical bytes through its own pointer.
 *
 * The sizing helpers are pure (no MPI) so `dsbatch plan` reports exactly the bytes the service
 * will allocate. */
#ifndef DS_ENGRAM_SERVICE_H
#define DS_ENGRAM_SERVICE_H

#include <stdint.h>

#include "config.h"

struct topo;
struct loaded_model;
struct engram_service;

/* Collective over the node (topo->node_comm). Every rank passes its own loaded model (bound for
 * its slice; only the mmap'd tensors are read). Returns NULL with ds_err_set when the tables do not
 * fit the node's memory or a table is missing from the checkpoint; every rank of the node reaches
 * the same verdict, before anything is allocated. The bytes are copied: `lm` may close afterwards. */
struct engram_service *engram_service_new(const struct topo *t, struct loaded_model *lm);

/* The node's copy of `layer`'s table: e4m3 [rows, head_dim] row-major, *scale e8m0
 * [rows, head_dim / 32]. NULL (and *rows = 0) when the calling rank's stage does not run `layer`
 * or `layer` has no Engram table: a rank only ever reads the layers it runs, even when the node
 * also holds another co-located stage's tables. */
const uint8_t *engram_service_table(const struct engram_service *s, int layer, const uint8_t **scale, int64_t *rows);

/* Bytes of the node's shared allocation (tables, scales and alignment), the same on every rank of
 * the node; 0 on a node whose stages run no Engram layer. */
uint64_t engram_service_bytes(const struct engram_service *s);

/* Collective over the node: releases the window. NULL is a no-op (not collective). */
void engram_service_free(struct engram_service *s);

/* Host memory the service may use per node, in bytes; 0 (the default) means the node's physical
 * memory (sysconf). Lets an operator keep room for the page cache and pinned buffers, and lets the
 * tests reach the too-large path with small tables. Set it the same on every rank. */
void engram_service_set_memory_limit(uint64_t bytes);

/* --- planning helpers (pure) --- */

/* Bit i set: Engram table i (engram_layer_ids[i]) belongs to backbone layers [begin, end). */
uint64_t engram_service_layer_mask(const struct model_config *cfg, int layer_begin, int layer_end);

/* Bytes the service allocates on a node holding the tables of `mask` (tables and scales, each
 * started on a 4 KiB boundary). */
uint64_t engram_service_layout_bytes(const struct model_config *cfg, uint64_t mask);

#endif /* DS_ENGRAM_SERVICE_H */
