/* The host's work per decode step does not grow with the batch: on the tp8pp2 golden model (one
 * rank, through the profiling decorator over the CPU backend), a decode step of 8 sequences makes
 * the same backend calls as a step of 1 — every op, copy, upload and allocation the same number of
 * times; index_scores too, once per index layer for the whole batch although every sequence scores
 * its own key cache. A forward also waits for the device once:
 * the logits download, never for the indexer's top-k mid-forward. On a GPU every call is host time
 * on the step's critical path, so per-sequence copies (thousands per step at batch 64) were the
 * step's largest cost; this pins that they are gone. The step of 8 must also give each sequence
 * exactly the logits of the step of 1 (the batch changes no number). A greedy step
 * (model_forward_draws) draws with one argmax call and downloads only the draws, the tokens
 * sampler_pick takes from the logits of sequences in the same state; with log-probabilities
 * (model_forward_draws) one row_lse call and one more download, sampler_logprob's bits, for the
 * greedy tokens, for given targets (dsbatch score's rows) and for top-k draws (one row_topk call,
 * no argmax: sampler_pick's tokens); a temperature draw over every entry adds one row_lse call
 * (its weight total) and one download, and takes no row. */
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
#include "prof_backend.h"
#include "sampler.h"

#define B 8

static long calls[2][PROF_N_OPS_PUBLIC];

static void snapshot(struct backend *pb, long *out) {
    for (int i = 0; i < PROF_N_OPS_PUBLIC; i++) out[i] = prof_backend_calls(pb, prof_backend_op_name(i));
}

static void test_decode_calls_independent_of_batch(void **s) {
    (void)s;
    struct golden_case g;
    golden_case_open(&g, "tp8pp2");

    struct loaded_model lm;
    struct backend cpu, pb;
    assert_int_equal(backend_cpu_init(&cpu), 0);
    prof_backend_init(&pb, &cpu);
    assert_int_equal(loader_open(&lm, g.dir, NULL), 0);
    struct engine_opts eo = engine_opts_default(&lm.cfg);
    eo.max_seqs = B + 1;
    struct model *m = model_new(&lm.cfg, &lm.w, &pb, &lm.ec, &eo);
    int64_t V = lm.cfg.vocab_size;
    float *l1 = malloc(sizeof(float) * (size_t)V), *lb = malloc(sizeof(float) * (size_t)(V * B));

    /* slot 0 alone, slots 1..B together: the same prompt in every slot, prefilled one by one, so
     * both steps run at the same position (compressor groups and top-k widths alike) */
    for (int q = 0; q <= B; q++) {
        struct fwd_seq p = {.slot = q, .start = 0, .len = g.S, .tokens = g.prompt};
        assert_int_equal(model_forward(m, &p, 1, l1, NULL), 0);
    }
    int32_t tok = 5;
    struct fwd_seq one = {.slot = 0, .start = g.S, .len = 1, .tokens = &tok}, many[B];
    for (int q = 0; q < B; q++) many[q] = (struct fwd_seq){.slot = q + 1, .start = g.S, .len = 1, .tokens = &tok};
    prof_backend_reset(&pb);
    assert_int_equal(model_forward(m, &one, 1, l1, NULL), 0);
    snapshot(&pb, calls[0]);
    prof_backend_reset(&pb);
    assert_int_equal(model_forward(m, many, B, lb, NULL), 0);
    snapshot(&pb, calls[1]);

    int n_index = 0, differ = 0;
    for (int l = 0; l < lm.cfg.n_layers; l++) n_index += lm.cfg.role[l].is_index_source;
    for (int i = 0; i < PROF_N_OPS_PUBLIC; i++) {
        const char *op = prof_backend_op_name(i);
        printf("%-16s batch 1: %4ld  batch %d: %4ld\n", op, calls[0][i], B, calls[1][i]);
        if (calls[1][i] != calls[0][i]) differ++;
    }
    assert_int_equal(differ, 0);
    assert_true(n_index > 0);
    assert_int_equal(prof_backend_calls(&pb, "index_scores"), n_index);
    assert_int_equal(prof_backend_calls(&pb, "index_topk"), n_index);
    assert_int_equal(prof_backend_calls(&pb, "download"), 1); /* the logits */
    for (int q = 0; q < B; q++) assert_memory_equal(l1, lb + (size_t)q * V, sizeof(float) * (size_t)V);

    /* slots 1..B are in one state: the next step's logits for the first half, greedy draws for
     * the second; every draw is sampler_pick's over those logits */
    int32_t tok2 = 7, drawn[B / 2];
    struct fwd_seq lo[B / 2], hi[B / 2];
    for (int q = 0; q < B / 2; q++) {
        lo[q] = (struct fwd_seq){.slot = q + 1, .start = g.S + 1, .len = 1, .tokens = &tok2};
        hi[q] = (struct fwd_seq){.slot = q + 1 + B / 2, .start = g.S + 1, .len = 1, .tokens = &tok2};
    }
    assert_int_equal(model_forward(m, lo, B / 2, lb, NULL), 0);
    prof_backend_reset(&pb);
    struct head_draws greedy_hd = {.tokens = drawn};
    assert_int_equal(model_forward_draws(m, hi, B / 2, NULL, &greedy_hd, NULL), 0);
    assert_int_equal(prof_backend_calls(&pb, "argmax"), 1);
    assert_int_equal(prof_backend_calls(&pb, "download"), 1); /* the draws, 8 bytes a row */
    struct sample_params greedy = {.temperature = 0.0f};
    for (int q = 0; q < B / 2; q++) assert_int_equal(drawn[q], sampler_pick(lb + (size_t)q * V, (int)V, &greedy, 0, 0));

    /* two more steps, each the first half's logits beside the second half's draws: greedy tokens
     * with their log-probabilities, then the log-probabilities of given ids (-1: none) */
    int32_t targets[B / 2] = {3, -1, (int32_t)V - 1, 0};
    struct sample_params sp[B / 2] = {{.temperature = 0.9f, .top_k = 40, .seed = 1}, {.temperature = 0.0f},
                                      {.temperature = 1.3f, .top_k = 3, .top_p = 0.8f, .seed = 2},
                                      {.temperature = 0.6f, .top_k = 500, .seed = 3}};
    uint64_t keys[B] = {11, 12, 13, 14, 100, 100, 101, 101}; /* requests, then positions */
    for (int k = 0; k < 4; k++) {
        double lp[B / 2];
        for (int q = 0; q < B / 2; q++) lo[q].start++, hi[q].start++;
        assert_int_equal(model_forward(m, lo, B / 2, lb, NULL), 0);
        prof_backend_reset(&pb);
        struct head_draws hd = {.tokens = k == 1 ? NULL : drawn, .targets = k == 1 ? targets : NULL, .lp = lp};
        if (k >= 2) hd.params = sp, hd.request = keys, hd.position = keys + B / 2;
        if (k == 3) sp[2].top_k = 0; /* a draw over every entry: the list (V <= BE_TOPK_MAX: the whole row) and its total */
        assert_int_equal(model_forward_draws(m, hi, B / 2, NULL, &hd, NULL), 0);
        assert_int_equal(prof_backend_calls(&pb, "argmax"), k == 0 ? 1 : 0);
        assert_int_equal(prof_backend_calls(&pb, "row_topk"), k >= 2 ? 1 : 0);
        assert_int_equal(prof_backend_calls(&pb, "row_lse"), k == 3 ? 2 : 1);
        /* draws; 16 bytes a row and slice; the full-row draw's totals */
        assert_int_equal(prof_backend_calls(&pb, "download"), k == 1 ? 1 : k == 3 ? 3 : 2);
        for (int q = 0; q < B / 2; q++) {
            const float *row = lb + (size_t)q * V;
            const int t = k == 1 ? targets[q] : drawn[q];
            const double want = t < 0 ? 0.0 : sampler_logprob(row, (int)V, t);
            if (k == 0) assert_int_equal(drawn[q], sampler_pick(row, (int)V, &greedy, 0, 0));
            if (k >= 2) assert_int_equal(drawn[q], sampler_pick(row, (int)V, &sp[q], keys[q], keys[B / 2 + q]));
            assert_memory_equal(&lp[q], &want, sizeof want);
            assert_true(t < 0 || (lp[q] <= 0 && lp[q] > -1e3));
        }
    }
    assert_true(V <= BE_TOPK_MAX);
    int64_t full, whole;
    model_draw_stats(m, &full, &whole);
    assert_int_equal(full, 1);
    assert_int_equal(whole, 0);

    free(l1);
    free(lb);
    model_free(m);
    loader_close(&lm);
    prof_backend_free(&pb);
    backend_cpu_free(&cpu);
    st_close(&g.f);
}

/* The stale-key sync between pipeline stages (model_key_sync_append on the later stage, _apply on
 * stage 0's mirrors) moves every new key row of a forward in one download and one upload, however
 * many sequences the forward has: tp8pp2 split 0-3 / 4-7 as in test_pipeline_stages, decode steps
 * of 1 and of B sequences. The rows themselves are checked there (bit-identical logits). */
static void test_key_sync_calls_independent_of_batch(void **s) {
    (void)s;
    struct golden_case g;
    golden_case_open(&g, "tp8pp2");
    struct loaded_model l0, l1;
    struct backend cpu, pb;
    assert_int_equal(backend_cpu_init(&cpu), 0);
    prof_backend_init(&pb, &cpu);
    golden_bind_stages(g.dir, 4, &l0, &l1);
    struct engine_opts eo = engine_opts_default(&l0.cfg);
    eo.max_seqs = B + 1;
    struct model *m0 = model_new(&l0.cfg, &l0.w, &pb, &l0.ec, &eo);
    struct model *m1 = model_new(&l1.cfg, &l1.w, &pb, &l1.ec, &eo);
    int64_t V = l0.cfg.vocab_size, D = l0.cfg.dim, hc = l0.cfg.hc_mult, T = g.S > B ? g.S : B;
    float *lg = malloc(sizeof(float) * (size_t)(V * B)), *P = malloc(sizeof(float) * (size_t)(T * hc));
    bf16_t *X = malloc((size_t)(T * hc * D) * 2);
    int32_t tok = 5;
    long dl[2] = {0}, ul[2] = {0}, rows[2] = {0};
    for (int pass = -1; pass < 2; pass++) {
        /* pass -1: prefill every slot; 0: a decode step of slot 0; 1: of slots 1..B together */
        struct fwd_seq q[B + 1];
        int n = 0;
        if (pass < 0)
            for (int k = 0; k <= B; k++) q[n++] = (struct fwd_seq){.slot = k, .start = 0, .len = g.S, .tokens = g.prompt};
        else if (pass == 0)
            q[n++] = (struct fwd_seq){.slot = 0, .start = g.S, .len = 1, .tokens = &tok};
        else
            for (int k = 1; k <= B; k++) q[n++] = (struct fwd_seq){.slot = k, .start = g.S, .len = 1, .tokens = &tok};
        for (int i = 0; i < (pass < 0 ? n : 1); i++) {
            struct fwd_seq *qs = pass < 0 ? &q[i] : q;
            int nq = pass < 0 ? 1 : n;
            struct stage_io io0 = {.X_out = X, .P_out = P}, io1 = {.X_in = X, .P_in = P};
            assert_int_equal(model_forward_stage(m0, qs, nq, &io0, NULL, NULL), 0);
            assert_int_equal(model_forward_stage(m1, qs, nq, &io1, lg, NULL), 0);
            uint8_t *sync = NULL;
            size_t len = 0;
            prof_backend_reset(&pb);
            model_key_sync_append(m1, qs, nq, &sync, &len);
            if (pass >= 0) dl[pass] = prof_backend_calls(&pb, "download");
            prof_backend_reset(&pb);
            assert_int_equal(model_key_sync_apply(m0, sync, len), 0);
            if (pass >= 0) {
                ul[pass] = prof_backend_calls(&pb, "upload");
                int32_t ns, nr;
                memcpy(&ns, sync, 4);
                memcpy(&nr, sync + 4 + 8 * (size_t)ns, 4);
                rows[pass] = nr;
            }
            free(sync);
        }
    }
    printf("key sync: batch 1: %ld rows, %ld downloads, %ld uploads; batch %d: %ld rows, %ld downloads, %ld uploads\n",
           rows[0], dl[0], ul[0], B, rows[1], dl[1], ul[1]);
    assert_true(rows[0] > 0);
    assert_int_equal(rows[1], rows[0] * B);
    assert_int_equal(dl[0], 1);
    assert_int_equal(dl[1], 1);
    assert_int_equal(ul[0], 1);
    assert_int_equal(ul[1], 1);
    free(lg);
    free(P);
    free(X);
    model_free(m0);
    model_free(m1);
    loader_close(&l0);
    loader_close(&l1);
    prof_backend_free(&pb);
    backend_cpu_free(&cpu);
    st_close(&g.f);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_decode_calls_independent_of_batch),
                                       cmocka_unit_test(test_key_sync_calls_independent_of_batch)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
