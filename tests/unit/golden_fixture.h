/* What the engine-level unit tests share about the golden fixtures (test_pipeline_stages.c,
 * test_step_calls.c): where they are, a prompt's token ids, and the tp8pp2 model bound as two
 * pipeline stages. Static inline: each test program includes its own copy. */
#ifndef DS_TESTS_GOLDEN_FIXTURE_H
#define DS_TESTS_GOLDEN_FIXTURE_H

#include <stdio.h>
#include <stdlib.h>

#include "loader.h"
#include "safetensors.h"

/* dir = GOLDEN/spec (GOLDEN from the environment, else ../shared/golden) */
static inline void golden_dir(char *dir, size_t n, const char *spec) {
    const char *g = getenv("GOLDEN");
    snprintf(dir, n, "%s/%s", g ? g : "../shared/golden", spec);
}

/* Opens dir/prompt<k>.safetensors into f; returns its prompt ids and their count in *S. */
static inline const int32_t *golden_prompt(const char *dir, int k, struct st_model *f, int64_t *S) {
    char fx[700];
    snprintf(fx, sizeof fx, "%s/prompt%d.safetensors", dir, k);
    assert_int_equal(st_open(fx, f), 0);
    const struct st_tensor *ids = st_find(f, "prompt_ids");
    assert_non_null(ids);
    *S = ids->shape[0];
    return ids->data;
}

/* A fixture folder and its prompt 0, opened together (close with st_close(&g->f)). */
struct golden_case {
    char dir[512];
    struct st_model f;
    int64_t S;             /* prompt length */
    const int32_t *prompt; /* [S] */
};

static inline void golden_case_open(struct golden_case *g, const char *spec) {
    golden_dir(g->dir, sizeof g->dir, spec);
    g->prompt = golden_prompt(g->dir, 0, &g->f, &g->S);
}

/* The model in dir bound as stage 0 (layers [0, split), embedding) and the last stage. */
static inline void golden_bind_stages(const char *dir, int split, struct loaded_model *s0, struct loaded_model *s1) {
    assert_int_equal(loader_open_config(s0, dir), 0);
    assert_int_equal(loader_open_config(s1, dir), 0);
    struct bind_opts o0 = bind_opts_single(&s0->cfg), o1 = o0;
    o0.layer_end = split;
    o0.last_stage = false;
    o1.layer_begin = split;
    o1.first_stage = false;
    assert_int_equal(loader_bind(s0, &o0), 0);
    assert_int_equal(loader_bind(s1, &o1), 0);
}

#endif /* DS_TESTS_GOLDEN_FIXTURE_H */
