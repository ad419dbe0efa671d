/* The kv arena (model_internal.h) moves its caches when a forward needs more scratch rows than any
 * before: a sequence decoding across such a move must give exactly the logits it gives without it.
 * tp8pp2 golden model, one rank: sequence A prefilled and decoded in slot 0; after 3 steps a
 * longer prompt B is prefilled in slot 1 (the arena grows with A's rings and compressed rows live),
 * then A decodes 3 more steps. A second model decodes A alone (no growth after its prefill). All
 * six of A's decode logits must be bit-identical; a move that lost or misplaced a cache row would
 * change them. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "golden_fixture.h"
#include "model.h"

static void test_decode_across_arena_growth(void **s) {
    (void)s;
    struct golden_case g;
    golden_case_open(&g, "tp8pp2");
    assert_true(g.S >= 3);
    struct loaded_model lm;
    struct backend be;
    assert_int_equal(backend_cpu_init(&be), 0);
    assert_int_equal(loader_open(&lm, g.dir, NULL), 0);
    struct engine_opts eo = engine_opts_default(&lm.cfg);
    eo.max_seqs = 2;
    eo.kv_scratch_rows = 8; /* so that B's prefill, not the start, sizes the arena */
    struct model *grow = model_new(&lm.cfg, &lm.w, &be, &lm.ec, &eo), *alone = model_new(&lm.cfg, &lm.w, &be, &lm.ec, &eo);
    int64_t V = lm.cfg.vocab_size, a_len = 3, b_len = 48;
    int32_t *btok = malloc(sizeof(int32_t) * (size_t)b_len);
    for (int64_t i = 0; i < b_len; i++) btok[i] = g.prompt[i % g.S];
    float *la = malloc(sizeof(float) * (size_t)V), *lb = malloc(sizeof(float) * (size_t)V);
    struct fwd_seq a = {.slot = 0, .start = 0, .len = a_len, .tokens = g.prompt};
    assert_int_equal(model_forward(grow, &a, 1, la, NULL), 0);
    assert_int_equal(model_forward(alone, &a, 1, lb, NULL), 0);
    int32_t tok[6] = {7, 11, 13, 17, 19, 23};
    int differ = 0;
    for (int k = 0; k < 6; k++) {
        if (k == 3) { /* B: a prompt longer than every forward so far */
            struct fwd_seq bq = {.slot = 1, .start = 0, .len = b_len, .tokens = btok};
            assert_int_equal(model_forward(grow, &bq, 1, lb, NULL), 0);
        }
        struct fwd_seq d = {.slot = 0, .start = a_len + k, .len = 1, .tokens = &tok[k]};
        assert_int_equal(model_forward(grow, &d, 1, la, NULL), 0);
        assert_int_equal(model_forward(alone, &d, 1, lb, NULL), 0);
        if (memcmp(la, lb, sizeof(float) * (size_t)V)) differ++;
    }
    printf("decode steps of A differing after the arena grew: %d of 6\n", differ);
    assert_int_equal(differ, 0);
    free(la);
    free(lb);
    free(btok);
    model_free(grow);
    model_free(alone);
    loader_close(&lm);
    backend_cpu_free(&be);
    st_close(&g.f);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_decode_across_arena_growth)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
