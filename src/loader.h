/* Opening a model folder: config.json, the checkpoint (validated and bound for this rank's slice)
 * and the Engram constants with their token map (the checkpoint's engram.safetensors sidecar when
 * present). One call so every command and every rank loads a model the same way. */
#ifndef DS_LOADER_H
#define DS_LOADER_H

#include "config.h"
#include "engram_hash.h"
#include "safetensors.h"
#include "weights.h"

struct loaded_model {
    char dir[512];
    struct model_config cfg;
    struct st_model st;
    struct model_weights w;
    struct engram_consts ec;
    bool have_token_map;
};

/* Returns 0 or -1 (ds_err_set). `opt` NULL = whole model on one rank. */
int loader_open(struct loaded_model *lm, const char *dir, const struct bind_opts *opt);
/* The same in two steps, for callers whose bind options depend on the config (TP/PP layout):
 * the config alone, then the checkpoint, weights and Engram constants. */
int loader_open_config(struct loaded_model *lm, const char *dir);
int loader_bind(struct loaded_model *lm, const struct bind_opts *opt);
void loader_close(struct loaded_model *lm);

#endif /* DS_LOADER_H */
