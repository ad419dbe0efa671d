/* Engram addressing (MODEL.md §3.4): primes and offsets from the config, the hash multipliers
 * reproducing numpy's default_rng(10007*layer).integers(0, B, 4) bit for bit, the compressed token
 * map, and the n-gram hash itself in exact int64 arithmetic. Pure integer work, no weights. */
#ifndef DS_ENGRAM_HASH_H
#define DS_ENGRAM_HASH_H

#include <stdint.h>

#include "config.h"

#define ENGRAM_MAX_NGRAM 8
#define ENGRAM_MAX_HEADS 32
#define ENGRAM_DEAD (-1) /* history entry of an image token: breaks every n-gram through it */

struct engram_consts {
    int n_layers;                 /* number of engram layers */
    int layer_ids[CFG_MAX_LIST];  /* model layer id per engram table */
    int max_ngram;                /* n-grams 2..max_ngram */
    int n_heads;
    int n_cols;                   /* (max_ngram - 1) * n_heads hash columns per layer */
    int64_t primes[CFG_MAX_LIST][ENGRAM_MAX_NGRAM - 1][ENGRAM_MAX_HEADS];
    int64_t offsets[CFG_MAX_LIST][(ENGRAM_MAX_NGRAM - 1) * ENGRAM_MAX_HEADS];
    int64_t mult[CFG_MAX_LIST][ENGRAM_MAX_NGRAM];
    int64_t table_rows[CFG_MAX_LIST]; /* sum of the layer's primes; must equal engram_num_embeddings */
    int vocab;                        /* token ids covered by token_map */
    int32_t *token_map;               /* [vocab] raw id -> compressed id, owned */
    int64_t pad;                      /* compressed pad id = token_map[engram_pad_id] */
};

/* Primes, offsets and multipliers from the config (token_map left NULL). Checks that each table's
 * prime sum equals engram_num_embeddings. Returns 0 or -1 (ds_err_set). */
int engram_consts_init(struct engram_consts *ec, const struct model_config *cfg);
/* Install a token map (copied); sets pad from cfg->engram_pad_id and checks the class count
 * (max id + 1) against engram_compressed_vocab. */
int engram_set_token_map(struct engram_consts *ec, const struct model_config *cfg, const int32_t *map,
                         int vocab);
void engram_consts_free(struct engram_consts *ec);

/* numpy.random.default_rng(seed).integers(0, high, size=n, dtype=np.int64), exactly. */
void np_default_rng_integers(uint64_t seed, int64_t high, int n, int64_t *out);
/* Smallest prime > start (deterministic Miller-Rabin, exact for 64-bit). */
int64_t next_prime_above(int64_t start);

/* Hash columns of the token at absolute position `pos` for engram table `li`.
 * hist: compressed ids of positions 0..pos (hist[pos] is the current token; ENGRAM_DEAD breaks).
 * out: n_cols row ids, offsets included, n-gram-major. */
void engram_hash_position(const struct engram_consts *ec, int li, const int64_t *hist, int64_t pos,
                          int64_t *out);

#endif /* DS_ENGRAM_HASH_H */
