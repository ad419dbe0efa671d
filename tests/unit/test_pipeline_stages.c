/* Pipeline stages in one process: the tp8pp2 golden model split 0-3 / 4-7 into two engines that
 * pass the stream (X, P) and the stale-index-key sync by hand, fed the fixture's prompt and greedy
 * tokens. Every logit must be bit-identical to the whole model on one engine — including the
 * decode steps where the stale-key quirk makes stage 0 score against stage 1's layer-4 keys. */
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

static void run(bool stale) {
    char dir[512];
    golden_dir(dir, sizeof dir, "tp8pp2");
    struct st_model f;
    int64_t S;
    const int32_t *prompt = golden_prompt(dir, 0, &f, &S);
    const struct st_tensor *gr = st_find(&f, "greedy_tokens");
    int64_t N = gr->shape[0] - 1;
    const int32_t *toks = gr->data;

    struct loaded_model whole, s0, s1;
    struct backend be;
    assert_int_equal(backend_cpu_init(&be), 0);
    assert_int_equal(loader_open(&whole, dir, NULL), 0);
    golden_bind_stages(dir, 4, &s0, &s1);
    struct engine_opts eo = engine_opts_default(&whole.cfg);
    eo.stale_index_keys = stale;
    struct model *mw = model_new(&whole.cfg, &whole.w, &be, &whole.ec, &eo);
    struct model *m0 = model_new(&s0.cfg, &s0.w, &be, &s0.ec, &eo);
    struct model *m1 = model_new(&s1.cfg, &s1.w, &be, &s1.ec, &eo);

    int64_t V = whole.cfg.vocab_size, D = whole.cfg.dim, hc = whole.cfg.hc_mult;
    float *lw = malloc(sizeof(float) * (size_t)V), *lp = malloc(sizeof(float) * (size_t)V);
    bf16_t *X = malloc((size_t)(S * hc * D) * 2);
    float *P = malloc(sizeof(float) * (size_t)(S * hc));
    int64_t mismatched = 0;
    for (int64_t k = -1; k < N; k++) {
        struct fwd_seq q = k < 0 ? (struct fwd_seq){.slot = 0, .start = 0, .len = S, .tokens = prompt}
                                 : (struct fwd_seq){.slot = 0, .start = S + k, .len = 1, .tokens = toks + k};
        assert_int_equal(model_forward(mw, &q, 1, lw, NULL), 0);
        struct stage_io io0 = {.X_out = X, .P_out = P}, io1 = {.X_in = X, .P_in = P};
        assert_int_equal(model_forward_stage(m0, &q, 1, &io0, NULL, NULL), 0);
        assert_int_equal(model_forward_stage(m1, &q, 1, &io1, lp, NULL), 0);
        uint8_t *sync = NULL;
        size_t len = 0;
        model_key_sync_append(m1, &q, 1, &sync, &len);
        assert_int_equal(model_key_sync_apply(m0, sync, len), 0);
        free(sync);
        if (memcmp(lw, lp, sizeof(float) * (size_t)V)) mismatched++;
    }
    printf("stale keys %s: %lld of %lld steps differ\n", stale ? "on" : "off", (long long)mismatched, (long long)N + 1);
    assert_int_equal(mismatched, 0);
    model_free(mw);
    model_free(m0);
    model_free(m1);
    loader_close(&whole);
    loader_close(&s0);
    loader_close(&s1);
    backend_cpu_free(&be);
    st_close(&f);
    free(lw);
    free(lp);
    free(X);
    free(P);
}

static void test_stages_stale_keys(void **s) { (void)s; run(true); }
static void test_stages_owner_keys(void **s) { (void)s; run(false); }

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_stages_stale_keys),
                                       cmocka_unit_test(test_stages_owner_keys)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
