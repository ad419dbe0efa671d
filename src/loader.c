/* Model folder loading (see loader.h). The Engram token map is required whenever the config has
 * Engram layers: hashing without it would silently address the wrong table rows. It comes from,
 * in this order:
 *  1. DIR/engram.safetensors (`token_map`): the golden fixtures' sidecar, an explicit override;
 *  2. a cached map: engram_map.<first 16 hex of sha256(tokenizer.json)>.safetensors in
 *     $DSBATCH_CACHE_DIR when set, else in DIR; used only if its metadata names the same full
 *     hash and the same map-builder/Unicode version;
 *  3. DIR/tokenizer.json: the map is built as MODEL.md §3.4 says (tok_engram_map: classes over the
 *     tokenizer's ids; vocabulary rows past them take the pad's class) and written to that cache (best effort: a
 *     read-only folder only costs the rebuild next time; concurrent ranks write private temporary
 *     files and rename, so the cache is never seen half written).
 * Keying by the file's hash means an edited tokenizer.json is never paired with a stale map. */
#include "loader.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"
#include "tokenizer.h"

/* ---- SHA-256 (FIPS 180-4), for the cache key ------------------------------------------------- */

static const uint32_t sha_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98, 0x12835b01,
    0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc,
    0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147,
    0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08,
    0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208,
    0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

static uint32_t ror(uint32_t x, int n) { return x >> n | x << (32 - n); }

static void sha_block(uint32_t h[8], const unsigned char *p) {
    uint32_t w[64], v[8];
    for (int i = 0; i < 16; i++) w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ror(w[i - 15], 7) ^ ror(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ror(w[i - 2], 17) ^ ror(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    memcpy(v, h, sizeof v);
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = v[7] + (ror(v[4], 6) ^ ror(v[4], 11) ^ ror(v[4], 25)) + ((v[4] & v[5]) ^ (~v[4] & v[6])) + sha_k[i] + w[i];
        uint32_t t2 = (ror(v[0], 2) ^ ror(v[0], 13) ^ ror(v[0], 22)) + ((v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]));
        memmove(v + 1, v, 7 * sizeof *v);
        v[4] += t1;
        v[0] = t1 + t2;
    }
    for (int i = 0; i < 8; i++) h[i] += v[i];
}

static int sha256_file(const char *path, char hex[65]) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        ds_err_set("%s: cannot open: %s", path, ds_errno_str());
        return -1;
    }
    uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    unsigned char blk[128];
    uint64_t total = 0;
    size_t r;
    while ((r = fread(blk, 1, 64, f)) == 64) sha_block(h, blk), total += 64;
    fclose(f);
    total += r;
    /* padding: 0x80, zeros, the bit length big-endian in the last 8 bytes of one or two blocks */
    memset(blk + r, 0, sizeof blk - r);
    blk[r] = 0x80;
    size_t nb = r + 9 > 64 ? 128 : 64;
    for (int i = 0; i < 8; i++) blk[nb - 1 - i] = (unsigned char)((total * 8) >> (8 * i));
    sha_block(h, blk);
    if (nb == 128) sha_block(h, blk + 64);
    for (int i = 0; i < 8; i++) snprintf(hex + 8 * i, 9, "%08x", h[i]);
    return 0;
}

/* ---- token map sources ------------------------------------------------------------------------ */

static int load_token_map(struct loaded_model *lm) {
    char path[700];
    snprintf(path, sizeof path, "%s/engram.safetensors", lm->dir);
    struct stat sb;
    if (stat(path, &sb) != 0) return 0;
    struct st_model side;
    if (st_open(path, &side)) return -1;
    const struct st_tensor *t = st_find(&side, "token_map");
    int rc = 0;
    if (!t || t->dtype != ST_I32 || t->ndim != 1) {
        ds_err_set("%s: token_map: expected an I32 vector", path);
        rc = -1;
    } else if (t->shape[0] < lm->cfg.vocab_size) {
        ds_err_set("%s: token_map: %lld entries for a vocabulary of %d", path, (long long)t->shape[0],
                   lm->cfg.vocab_size);
        rc = -1;
    } else if (engram_set_token_map(&lm->ec, &lm->cfg, t->data, (int)t->shape[0])) {
        char msg[900];
        snprintf(msg, sizeof msg, "%s: %s", path, ds_err_get());
        ds_err_set("%s", msg);
        rc = -1;
    } else {
        lm->have_token_map = true;
    }
    st_close(&side);
    return rc;
}

/* The cache's identity besides the file name's hash: the rows past the tokenizer's ids depend on
 * the config's vocabulary size and pad id, and the classes on the builder and Unicode version. */
static void cache_tag(const struct model_config *cfg, char *out, size_t n) {
    snprintf(out, n, "vocab %d pad %d; %s", cfg->vocab_size, cfg->engram_pad_id, tok_engram_map_version());
}

/* A cached map, when it is the one this tokenizer file, config and builder would give. */
static int32_t *read_cached_map(const char *path, const char *hex, const char *tag, int32_t *n) {
    struct stat sb;
    if (stat(path, &sb) != 0) return NULL;
    struct st_model c;
    if (st_open(path, &c)) return NULL; /* damaged: rebuilt and replaced */
    const struct st_tensor *t = st_find(&c, "token_map");
    const char *h = st_metadata(&c, "tokenizer_sha256"), *v = st_metadata(&c, "builder");
    int32_t *map = NULL;
    if (t && t->dtype == ST_I32 && t->ndim == 1 && h && v && !strcmp(h, hex) && !strcmp(v, tag)) {
        *n = (int32_t)t->shape[0];
        map = ds_malloc(t->nbytes + 4);
        memcpy(map, t->data, t->nbytes);
    }
    st_close(&c);
    return map;
}

static void write_cached_map(const char *path, const char *hex, const char *tag, const int32_t *map, int32_t n,
                             int32_t classes) {
    char tmp[1200], ncls[32];
    snprintf(tmp, sizeof tmp, "%s.%ld", path, (long)getpid());
    snprintf(ncls, sizeof ncls, "%d", classes);
    struct st_writer *w = st_writer_new();
    st_writer_set_metadata(w, "tokenizer_sha256", hex);
    st_writer_set_metadata(w, "builder", tag);
    st_writer_set_metadata(w, "n_classes", ncls);
    int64_t shape[1] = {n};
    if (st_writer_add(w, "token_map", ST_I32, 1, shape, map) || st_writer_save(w, tmp)) {
        log_warn("%s: cannot write the Engram token map cache (%s); it will be rebuilt next time", path, ds_err_get());
    } else if (rename(tmp, path)) {
        log_warn("%s: cannot write the Engram token map cache (%s); it will be rebuilt next time", path, ds_errno_str());
        unlink(tmp);
    }
}

/* The map from DIR/tokenizer.json (through the cache). 0 with have_token_map unset when the folder
 * has no tokenizer.json. */
static int token_map_from_tokenizer(struct loaded_model *lm) {
    char tpath[700], cpath[1100], hex[65];
    snprintf(tpath, sizeof tpath, "%s/tokenizer.json", lm->dir);
    struct stat sb;
    if (stat(tpath, &sb) != 0) return 0;
    if (sha256_file(tpath, hex)) return -1;
    const char *cdir = getenv("DSBATCH_CACHE_DIR");
    snprintf(cpath, sizeof cpath, "%s/engram_map.%.16s.safetensors", cdir && *cdir ? cdir : lm->dir, hex);
    int32_t n = 0, classes = -1;
    char tag[300];
    cache_tag(&lm->cfg, tag, sizeof tag);
    int32_t *map = read_cached_map(cpath, hex, tag, &n);
    bool built = !map;
    if (built) {
        struct tokenizer *t = tok_load(tpath);
        if (!t) return -1;
        map = tok_engram_map(t, lm->cfg.vocab_size, lm->cfg.engram_pad_id, &n, &classes);
        tok_free(t);
    } else {
        for (int32_t i = 0; i < n; i++) classes = map[i] >= classes ? map[i] + 1 : classes;
    }
    int rc = 0;
    if (classes != lm->cfg.engram_compressed_vocab) {
        ds_err_set("%s: the Engram token map built from it has %d classes but %s sets engram_compressed_vocab_size = %lld "
                   "(MODEL.md §3.4: they must be equal)", tpath, classes, lm->cfg.source, (long long)lm->cfg.engram_compressed_vocab);
        rc = -1;
    } else if (engram_set_token_map(&lm->ec, &lm->cfg, map, n)) {
        char msg[900];
        snprintf(msg, sizeof msg, "%s: %s", tpath, ds_err_get());
        ds_err_set("%s", msg);
        rc = -1;
    } else {
        lm->have_token_map = true;
        if (built) write_cached_map(cpath, hex, tag, map, n, classes);
    }
    free(map);
    return rc;
}

int loader_open_config(struct loaded_model *lm, const char *dir) {
    memset(lm, 0, sizeof *lm);
    snprintf(lm->dir, sizeof lm->dir, "%s", dir);
    char path[700];
    snprintf(path, sizeof path, "%s/config.json", dir);
    return config_load(path, &lm->cfg);
}

int loader_open(struct loaded_model *lm, const char *dir, const struct bind_opts *opt) {
    if (loader_open_config(lm, dir)) return -1;
    return loader_bind(lm, opt);
}

int loader_bind(struct loaded_model *lm, const struct bind_opts *opt) {
    const char *dir = lm->dir;
    char path[700];
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (st_open(dir, &lm->st)) {
        config_free(&lm->cfg);
        return -1;
    }
    struct bind_opts single = bind_opts_single(&lm->cfg);
    if (weights_bind(&lm->w, &lm->cfg, &lm->st, opt ? opt : &single)) goto fail;
    if (lm->cfg.n_engram > 0) {
        if (engram_consts_init(&lm->ec, &lm->cfg)) {
            char msg[900];
            snprintf(msg, sizeof msg, "%s: %s", path, ds_err_get());
            ds_err_set("%s", msg);
            goto fail;
        }
        if (load_token_map(lm)) goto fail;
        if (!lm->have_token_map && token_map_from_tokenizer(lm)) goto fail;
        if (!lm->have_token_map) {
            ds_err_set("%s: the config has Engram layers but the folder has neither an engram.safetensors token map "
                       "nor a tokenizer.json to build it from", dir);
            goto fail;
        }
    }
    return 0;
fail:
    loader_close(lm);
    return -1;
}

void loader_close(struct loaded_model *lm) {
    weights_free(&lm->w);
    engram_consts_free(&lm->ec);
    st_close(&lm->st);
    config_free(&lm->cfg);
}
