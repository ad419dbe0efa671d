/* Model folder loading (see loader.h). The Engram token map is required whenever the config has
 * Engram layers: hashing without it would silently address the wrong table rows. */
#include "loader.h"

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "log.h"

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
        if (!lm->have_token_map) {
            ds_err_set("%s: the config has Engram layers but the folder has no engram.safetensors token map "
                       "(building it from tokenizer.json is not supported yet)", dir);
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
