/* Synthetic checkpoints without files.
 *
 * Two users need the list of every tensor a config implies (name, dtype, shape, as weights.c
 * binds them): mkmodel, which generates seeded data and writes a release-format folder, and the
 * benchmarks, which need the real 40-layer geometry (hundreds of GB) bound through the real
 * weights_bind without writing or even holding it. The inventory lives here so both use one list.
 *
 * synth_st_model() turns an inventory into an in-memory struct st_model whose tensors all point
 * into a few shared random pools, one per dtype, each only as large as that dtype's largest tensor
 * (plus a little slack for per-tensor offsets): the whole checkpoint then costs ~2 GB of memory
 * at real size, yet every tensor has plausible bytes (no NaN codes, bounded scales), so kernels
 * run at their data-independent speed. Weight values repeat between tensors: it is a timing
 * model, not a numerical one. */
#ifndef DS_SYNTH_H
#define DS_SYNTH_H

#include <stdint.h>

#include "config.h"
#include "safetensors.h"

/* How mkmodel generates a tensor's data (the pools ignore it; they are per dtype). */
enum synth_gen {
    SYNTH_F32,    /* mean + std * N(0,1) */
    SYNTH_BF16,   /* the same, rounded to bf16 */
    SYNTH_FP8_W,  /* e4m3 [n,k] of a 32x32-tile quantized N(0, std) matrix; partner = its scale */
    SYNTH_FP8_S,  /* e8m0 [ceil(n/32), ceil(k/32)] */
    SYNTH_FP4_W,  /* I8 [n, k/2] packed e2m1 of N(0, std); partner = its scale */
    SYNTH_FP4_S,  /* e8m0 [n, k/32] */
    SYNTH_ROWS_W, /* Engram table e4m3 [rows, hd], one scale per row per 32 columns */
    SYNTH_ROWS_S, /* e8m0 [rows, hd/32] */
};

struct synth_tensor {
    char name[128];
    enum st_dtype dt;
    int ndim;
    int64_t shape[2];
    enum synth_gen kind;
    float mean, std;
    int64_t n, k;  /* logical matrix of a quantized pair */
    uint64_t key;  /* random stream: hash of the logical name, shared by a weight and its scale */
    int partner;   /* other half of a quantized pair, or -1 */
    int shard;     /* mkmodel's shard assignment */
    size_t nbytes;
};

struct synth_inventory {
    struct synth_tensor *t;
    int n, cap;
    uint64_t total; /* bytes of all tensors */
};

/* Every tensor of the checkpoint of `c`, in natural order (embed, layers, DSpark, norm, head);
 * a quantized weight is immediately followed by its scale. */
void synth_inventory_build(struct synth_inventory *inv, const struct model_config *c);
void synth_inventory_free(struct synth_inventory *inv);

/* The shared random pools behind an in-memory checkpoint (owned; synth_pools_free). */
struct synth_pools {
    void *pool[ST_NDTYPES];
    size_t size[ST_NDTYPES];
};

/* Fill `st` with every tensor of `inv`, data pointing into pools made for it (seeded): BF16 values
 * ~ N(0, 0.02); F32 small values (N(0, 0.01)); F8_E4M3 the codes of N(0, 1) values (never the NaN
 * codes 0x7f/0xff; uniform bytes would put ±448 outliers in every block and activations far
 * larger than a real model's); F8_E8M0 scales 2^-9..2^-1 (bytes 0x76..0x7e); I8 (packed e2m1)
 * any byte. Each tensor starts
 * at its own 64-byte-aligned offset into its pool so neighbouring tensors differ. st is then used
 * like an opened checkpoint (weights_bind, st_find); st_close frees its tables, synth_pools_free
 * the data (after st is no longer used). `label` names it in error messages. Returns 0 or -1. */
int synth_st_model(struct st_model *st, const struct synth_inventory *inv, struct synth_pools *pools,
                   uint64_t seed, const char *label);
void synth_pools_free(struct synth_pools *pools);

/* Shrink the Engram tables of cfg in memory: engram_vocab_size (where the reference's prime search
 * starts) becomes `vocab_start` and engram_num_embeddings the prime sums that follow from it, as a
 * release would state them. Everything else stays as loaded. Returns 0 or -1 (ds_err_set). */
int synth_shrink_engram(struct model_config *cfg, int64_t vocab_start);

#endif /* DS_SYNTH_H */
