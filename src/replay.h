/* Replay of a golden fixture through the engine (issue #3 "Replay and verify"): the fixture's
 * prompt is prefilled and its greedy tokens fed one per step, either with the fixture's per-layer
 * input stream forced into every block (stream) or with the stream running free (tokens). The
 * engine's results are collected under the fixture's own tensor names. */
#ifndef DS_REPLAY_H
#define DS_REPLAY_H

#include <stdbool.h>
#include <stdint.h>

#include "model.h"
#include "safetensors.h"

enum replay_force { REPLAY_FORCE_STREAM = 0, REPLAY_FORCE_TOKENS };

/* One result tensor, host memory. */
struct replay_tensor {
    char name[96];
    enum st_dtype dtype;
    int ndim;
    int64_t shape[3];
    void *data;
};

struct replay_result {
    int n;
    struct replay_tensor *t;
    bool prefill_forced, decode_forced;
};

/* How a forward runs: on one engine (NULL: model_forward) or across pipeline stages. */
struct replay_fwd {
    int (*fn)(void *ctx, const struct fwd_seq *seqs, int n, float *logits, const struct fwd_hooks *hooks);
    void *ctx;
};

/* Run the fixture through a freshly reset slot 0 of m. */
int replay_run(struct model *m, struct st_model *fixture, enum replay_force force, const struct replay_fwd *fwd,
               struct replay_result *res);
struct replay_tensor *replay_find(struct replay_result *res, const char *name);
int replay_write(const struct replay_result *res, const char *path);
void replay_free(struct replay_result *res);

#endif /* DS_REPLAY_H */
