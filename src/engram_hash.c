/* Engram addressing constants and the n-gram hash (MODEL.md §3.4).
 *
 * The reference builds its hash tables in Python: primes from a shared "seen" set, offsets as a
 * per-table prefix sum, and multipliers drawn from numpy.random.default_rng(10007 * layer_id).
 * The table rows in the checkpoint were laid out by those exact numbers, so this file reproduces
 * them bit for bit in C: numpy's SeedSequence entropy mixing, the PCG64 bit generator and
 * Generator.integers' bounded draw (Lemire's method, with numpy's 32-bit path for small ranges),
 * a deterministic 64-bit Miller-Rabin for the primes, and the hash itself in exact int64
 * arithmetic (the products and the running XOR exceed 2^53, so floating point would corrupt ids). */
#include "engram_hash.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

/* ---------------------------------------------------------------------------------------------
 * Primes
 * ------------------------------------------------------------------------------------------- */

__extension__ typedef unsigned __int128 u128; /* GCC/Clang builtin; C11 has no 128-bit type */

static uint64_t mulmod64(uint64_t a, uint64_t b, uint64_t m) { return (uint64_t)((u128)a * b % m); }

static uint64_t powmod64(uint64_t b, uint64_t e, uint64_t m) {
    uint64_t r = 1 % m;
    b %= m;
    while (e) {
        if (e & 1) r = mulmod64(r, b, m);
        b = mulmod64(b, b, m);
        e >>= 1;
    }
    return r;
}

/* Miller-Rabin with the first twelve prime bases: this base set has no strong pseudoprime below
 * 3.3e24, so the answer is exact for every 64-bit n (no probabilistic error, no randomness). */
static bool is_prime_u64(uint64_t n) {
    static const uint64_t bases[] = {2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37};
    if (n < 2) return false;
    for (size_t i = 0; i < sizeof bases / sizeof bases[0]; i++) {
        if (n == bases[i]) return true;
        if (n % bases[i] == 0) return false;
    }
    uint64_t d = n - 1;
    int r = 0;
    while ((d & 1) == 0) {
        d >>= 1;
        r++;
    }
    for (size_t i = 0; i < sizeof bases / sizeof bases[0]; i++) {
        uint64_t x = powmod64(bases[i], d, n);
        if (x == 1 || x == n - 1) continue;
        bool witness = true;
        for (int k = 1; k < r; k++) {
            x = mulmod64(x, x, n);
            if (x == n - 1) {
                witness = false;
                break;
            }
        }
        if (witness) return false;
    }
    return true;
}

/* The largest prime below 2^63 is 2^63 - 25; above that no int64 answer exists, so -1 says so. */
int64_t next_prime_above(int64_t start) {
    if (start < 2) return 2;
    if (start >= INT64_MAX - 24) return -1;
    uint64_t c = (uint64_t)start + 1;
    if (c == 2) return 2;
    if ((c & 1) == 0) c++;
    while (!is_prime_u64(c)) c += 2;
    return (int64_t)c;
}

/* ---------------------------------------------------------------------------------------------
 * numpy.random.default_rng(seed).integers(0, high, n, dtype=int64)
 * ------------------------------------------------------------------------------------------- */

/* SeedSequence hash constants (numpy/random/bit_generator.pyx, from Melissa O'Neill's seed_seq). */
#define SS_INIT_A 0x43b0d7e5u
#define SS_MULT_A 0x931e8875u
#define SS_INIT_B 0x8b51f9ddu
#define SS_MULT_B 0x58f38dedu
#define SS_MIX_MULT_L 0xca01f9ddu
#define SS_MIX_MULT_R 0x4973f715u
#define SS_XSHIFT 16
#define SS_POOL 4

/* hashmix: the multiplier itself evolves on every call, so the call order matters. */
static uint32_t ss_hashmix(uint32_t value, uint32_t *hash_const) {
    value ^= *hash_const;
    *hash_const *= SS_MULT_A;
    value *= *hash_const;
    value ^= value >> SS_XSHIFT;
    return value;
}

static uint32_t ss_mix(uint32_t x, uint32_t y) {
    uint32_t r = SS_MIX_MULT_L * x - SS_MIX_MULT_R * y;
    r ^= r >> SS_XSHIFT;
    return r;
}

/* SeedSequence(seed).generate_state(4, uint64): the four words PCG64 is seeded from.
 * numpy turns an integer seed into little-endian 32-bit words, with 0 giving the single word [0]. */
static void seed_sequence_state(uint64_t seed, uint64_t words[4]) {
    uint32_t entropy[2];
    int n_ent = 0;
    if (seed == 0) entropy[n_ent++] = 0;
    while (seed) {
        entropy[n_ent++] = (uint32_t)seed;
        seed >>= 32;
    }

    uint32_t pool[SS_POOL];
    uint32_t hc = SS_INIT_A;
    for (int i = 0; i < SS_POOL; i++) pool[i] = ss_hashmix(i < n_ent ? entropy[i] : 0, &hc);
    for (int src = 0; src < SS_POOL; src++)
        for (int dst = 0; dst < SS_POOL; dst++)
            if (src != dst) pool[dst] = ss_mix(pool[dst], ss_hashmix(pool[src], &hc));
    /* A 64-bit seed has at most 2 words, never more than the pool, so numpy's "remaining
     * entropy" loop never runs here. */

    uint32_t out32[8];
    uint32_t hb = SS_INIT_B;
    for (int i = 0; i < 8; i++) {
        uint32_t v = pool[i % SS_POOL];
        v ^= hb;
        hb *= SS_MULT_B;
        v *= hb;
        v ^= v >> SS_XSHIFT;
        out32[i] = v;
    }
    /* uint64 output = consecutive uint32 pairs read little-endian. */
    for (int k = 0; k < 4; k++) words[k] = (uint64_t)out32[2 * k] | ((uint64_t)out32[2 * k + 1] << 32);
}

/* PCG64 (PCG XSL-RR 128/64), with numpy's one-word buffer for 32-bit draws. */
struct pcg64 {
    u128 state, inc;
    bool has_u32;
    uint32_t u32;
};

#define PCG_MULT ((((u128)0x2360ed051fc65da4ull) << 64) | 0x4385df649fccf645ull)

static void pcg_step(struct pcg64 *g) { g->state = g->state * PCG_MULT + g->inc; }

/* numpy's pcg64_set_seed: word 0/1 form the initial state (high, low), word 2/3 the stream;
 * then the standard PCG "srandom": state 0, step, add initstate, step. */
static void pcg_seed(struct pcg64 *g, const uint64_t w[4]) {
    u128 initstate = ((u128)w[0] << 64) | w[1];
    u128 initseq = ((u128)w[2] << 64) | w[3];
    g->state = 0;
    g->inc = (initseq << 1) | 1;
    pcg_step(g);
    g->state += initstate;
    pcg_step(g);
    g->has_u32 = false;
    g->u32 = 0;
}

/* Advance first, then output from the new state. */
static uint64_t pcg_next64(struct pcg64 *g) {
    pcg_step(g);
    uint64_t x = (uint64_t)(g->state >> 64) ^ (uint64_t)g->state;
    unsigned rot = (unsigned)(g->state >> 122);
    return (x >> rot) | (x << ((64 - rot) & 63));
}

/* A 32-bit draw returns the low half of a fresh 64-bit output and keeps the high half for the
 * next 32-bit draw, as numpy's PCG64 does. */
static uint32_t pcg_next32(struct pcg64 *g) {
    if (g->has_u32) {
        g->has_u32 = false;
        return g->u32;
    }
    uint64_t v = pcg_next64(g);
    g->has_u32 = true;
    g->u32 = (uint32_t)(v >> 32);
    return (uint32_t)v;
}

/* Lemire's nearly-divisionless bounded draw in [0, rng]; rng < 2^32 - 1. */
static uint64_t lemire32(struct pcg64 *g, uint32_t rng) {
    uint32_t excl = rng + 1;
    uint64_t m = (uint64_t)pcg_next32(g) * excl;
    uint32_t left = (uint32_t)m;
    if (left < excl) {
        uint32_t threshold = (UINT32_MAX - rng) % excl; /* = 2^32 mod excl */
        while (left < threshold) {
            m = (uint64_t)pcg_next32(g) * excl;
            left = (uint32_t)m;
        }
    }
    return m >> 32;
}

/* The same in 64 bits; rng < 2^64 - 1. */
static uint64_t lemire64(struct pcg64 *g, uint64_t rng) {
    uint64_t excl = rng + 1;
    u128 m = (u128)pcg_next64(g) * excl;
    uint64_t left = (uint64_t)m;
    if (left < excl) {
        uint64_t threshold = (UINT64_MAX - rng) % excl; /* = 2^64 mod excl */
        while (left < threshold) {
            m = (u128)pcg_next64(g) * excl;
            left = (uint64_t)m;
        }
    }
    return (uint64_t)(m >> 64);
}

/* numpy computes the inclusive range rng = (high - 1) - low and dispatches on it: 0 draws
 * nothing, up to 2^32-1 uses 32-bit draws (a full 32-bit range takes the raw word), above that the
 * 64-bit Lemire draw. numpy raises for high <= 0; this returns zeros (callers pass high >= 1). */
void np_default_rng_integers(uint64_t seed, int64_t high, int n, int64_t *out) {
    if (n <= 0) return;
    if (high <= 1) {
        for (int i = 0; i < n; i++) out[i] = 0;
        return;
    }
    uint64_t words[4];
    seed_sequence_state(seed, words);
    struct pcg64 g;
    pcg_seed(&g, words);
    uint64_t rng = (uint64_t)high - 1;
    for (int i = 0; i < n; i++) {
        uint64_t v;
        if (rng == UINT32_MAX)
            v = pcg_next32(&g);
        else if (rng < UINT32_MAX)
            v = lemire32(&g, (uint32_t)rng);
        else
            v = lemire64(&g, rng); /* rng < 2^63, never the full-64-bit case */
        out[i] = (int64_t)v;
    }
}

/* ---------------------------------------------------------------------------------------------
 * Constants from the config
 * ------------------------------------------------------------------------------------------- */

/* Messages name the config key; the config loader that calls us already knows the file. */
static const char *cfg_name(const struct model_config *cfg) { (void)cfg; return "config"; }

/* The reference's loop, kept literally: for every (layer, n-gram) the search restarts at
 * vocab_size - 1 and takes the smallest prime above the current point that no earlier entry used.
 * Primes are only ever taken from the chain of consecutive primes above vocab_size - 1, so the
 * walk runs over that chain (computed once, grown on demand) with a used flag per chain entry
 * instead of re-running Miller-Rabin on every restart. */
struct prime_chain {
    int64_t *p;
    bool *used;
    int n, cap;
};

static int chain_get(struct prime_chain *c, int i, int64_t *out) {
    while (c->n <= i) {
        if (c->n == c->cap) {
            c->cap = c->cap ? 2 * c->cap : 256;
            c->p = ds_realloc(c->p, (size_t)c->cap * sizeof *c->p);
            c->used = ds_realloc(c->used, (size_t)c->cap * sizeof *c->used);
        }
        int64_t q = next_prime_above(c->p[c->n - 1]);
        if (q < 0) return -1;
        c->p[c->n] = q;
        c->used[c->n] = false;
        c->n++;
    }
    *out = c->p[i];
    return 0;
}

int engram_consts_init(struct engram_consts *ec, const struct model_config *cfg) {
    memset(ec, 0, sizeof *ec);
    const char *src = cfg_name(cfg);
    int nl = cfg->n_engram, ng = cfg->engram_max_ngram, nh = cfg->engram_n_heads;
    if (nl < 0 || nl > CFG_MAX_LIST) {
        ds_err_set("%s: engram_layer_ids: %d entries (0..%d allowed)", src, nl, CFG_MAX_LIST);
        return -1;
    }
    if (nl > 0) {
        if (ng < 2 || ng > ENGRAM_MAX_NGRAM) {
            ds_err_set("%s: engram_max_ngram_size: %d (2..%d supported)", src, ng, ENGRAM_MAX_NGRAM);
            return -1;
        }
        if (nh < 1 || nh > ENGRAM_MAX_HEADS) {
            ds_err_set("%s: engram_n_heads: %d (1..%d supported)", src, nh, ENGRAM_MAX_HEADS);
            return -1;
        }
        if (cfg->engram_vocab_size < 1) {
            ds_err_set("%s: engram_vocab_size: %lld (must be >= 1)", src, (long long)cfg->engram_vocab_size);
            return -1;
        }
        if (cfg->engram_compressed_vocab < 1) {
            ds_err_set("%s: engram_compressed_vocab_size: %lld (must be >= 1)", src,
                       (long long)cfg->engram_compressed_vocab);
            return -1;
        }
    }
    for (int li = 0; li < nl; li++) {
        if (cfg->engram_layer_ids[li] < 0) {
            ds_err_set("%s: engram_layer_ids[%d]: %d is negative", src, li, cfg->engram_layer_ids[li]);
            return -1;
        }
    }

    ec->n_layers = nl;
    ec->max_ngram = ng;
    ec->n_heads = nh;
    ec->n_cols = nl > 0 ? (ng - 1) * nh : 0;
    ec->token_map = NULL;
    ec->vocab = 0;
    if (nl == 0) return 0;

    /* Primes and offsets. */
    struct prime_chain ch = {0};
    ch.cap = 256;
    ch.p = ds_malloc((size_t)ch.cap * sizeof *ch.p);
    ch.used = ds_malloc((size_t)ch.cap * sizeof *ch.used);
    ch.p[0] = next_prime_above(cfg->engram_vocab_size - 1);
    ch.used[0] = false;
    ch.n = 1;
    int rc = 0;
    if (ch.p[0] < 0) rc = -1;
    for (int li = 0; li < nl && rc == 0; li++) {
        ec->layer_ids[li] = cfg->engram_layer_ids[li];
        for (int n = 0; n < ng - 1 && rc == 0; n++) {
            int at = 0; /* chain index of the first prime above "current" = vocab_size - 1 */
            for (int h = 0; h < nh; h++) {
                int64_t q = 0;
                for (;;) {
                    if (chain_get(&ch, at, &q) != 0) {
                        rc = -1;
                        break;
                    }
                    if (!ch.used[at]) break;
                    at++;
                }
                if (rc) break;
                ch.used[at] = true;
                ec->primes[li][n][h] = q;
                at++; /* current = q: the next search starts strictly above it */
            }
        }
        if (rc) break;
        int64_t sum = 0;
        for (int n = 0; n < ng - 1 && rc == 0; n++)
            for (int h = 0; h < nh; h++) {
                ec->offsets[li][n * nh + h] = sum;
                /* Only an absurd engram_vocab_size near 2^63 can overflow the row count. */
                if (__builtin_add_overflow(sum, ec->primes[li][n][h], &sum)) {
                    rc = -1;
                    break;
                }
            }
        if (rc) break;
        ec->table_rows[li] = sum;
        if (sum != cfg->engram_num_embeddings[li]) {
            ds_err_set("%s: engram_num_embeddings[%d] = %lld, but the primes of engram layer %d sum to %lld",
                       src, li, (long long)cfg->engram_num_embeddings[li], ec->layer_ids[li],
                       (long long)sum);
            free(ch.p);
            free(ch.used);
            return -1;
        }
    }
    free(ch.p);
    free(ch.used);
    if (rc) {
        ds_err_set("%s: engram_vocab_size: %lld leaves no room for the engram primes in int64", src,
                   (long long)cfg->engram_vocab_size);
        return -1;
    }

    /* Multipliers: odd numbers 2v+1 with v < B, B chosen so that any compressed id times any
     * multiplier stays below 2^63 (the hash never overflows int64). */
    int64_t bound = (INT64_MAX / cfg->engram_compressed_vocab) / 2;
    if (bound < 1) bound = 1;
    for (int li = 0; li < nl; li++) {
        int64_t v[ENGRAM_MAX_NGRAM];
        np_default_rng_integers(10007ull * (uint64_t)ec->layer_ids[li], bound, ng, v);
        for (int s = 0; s < ng; s++) ec->mult[li][s] = v[s] * 2 + 1;
    }
    return 0;
}

int engram_set_token_map(struct engram_consts *ec, const struct model_config *cfg, const int32_t *map,
                         int vocab) {
    const char *src = cfg_name(cfg);
    if (!map || vocab <= 0) {
        ds_err_set("%s: engram token map: empty (%d entries)", src, vocab);
        return -1;
    }
    if (cfg->engram_pad_id < 0 || cfg->engram_pad_id >= vocab) {
        ds_err_set("%s: engram_pad_token_id: %d outside the token map's %d entries", src, cfg->engram_pad_id,
                   vocab);
        return -1;
    }
    int32_t mx = -1;
    for (int i = 0; i < vocab; i++) {
        if (map[i] < 0) {
            ds_err_set("%s: engram token map: entry %d is negative (%d)", src, i, map[i]);
            return -1;
        }
        if (map[i] > mx) mx = map[i];
    }
    if ((int64_t)mx + 1 != cfg->engram_compressed_vocab) {
        ds_err_set("%s: engram_compressed_vocab_size: %lld, but the token map has %lld classes", src,
                   (long long)cfg->engram_compressed_vocab, (long long)mx + 1);
        return -1;
    }
    int32_t *copy = ds_malloc((size_t)vocab * sizeof *copy);
    memcpy(copy, map, (size_t)vocab * sizeof *copy);
    free(ec->token_map);
    ec->token_map = copy;
    ec->vocab = vocab;
    ec->pad = map[cfg->engram_pad_id];
    return 0;
}

void engram_consts_free(struct engram_consts *ec) {
    free(ec->token_map);
    ec->token_map = NULL;
    ec->vocab = 0;
}

/* ---------------------------------------------------------------------------------------------
 * The hash
 * ------------------------------------------------------------------------------------------- */

void engram_hash_position(const struct engram_consts *ec, int li, const int64_t *hist, int64_t pos,
                          int64_t *out) {
    const int ng = ec->max_ngram, nh = ec->n_heads;
    int64_t prod[ENGRAM_MAX_NGRAM];
    bool blocked = false;
    for (int s = 0; s < ng; s++) {
        /* Cumulative: an n-gram that reaches before position 0 or through an image token is padded
         * from that point on, so every longer n-gram is padded too. */
        int64_t src = hist[pos - s >= 0 ? pos - s : 0];
        blocked = blocked || pos < s || src == ENGRAM_DEAD;
        int64_t tok = blocked ? ec->pad : src;
        prod[s] = tok * ec->mult[li][s]; /* < 2^63 because tok < compressed vocab (see the bound) */
    }
    int64_t roll = prod[0];
    for (int n = 1; n < ng; n++) {
        roll ^= prod[n]; /* both operands >= 0, so roll stays >= 0 and % is the Python modulo */
        const int64_t *pr = ec->primes[li][n - 1];
        const int64_t *off = &ec->offsets[li][(n - 1) * nh];
        for (int h = 0; h < nh; h++) out[(n - 1) * nh + h] = roll % pr[h] + off[h];
    }
}
