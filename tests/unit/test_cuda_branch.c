/* The CUDA backend's branches (backend.h: branch_begin / branch_end / branch_join), on the GPU.
 *
 * - Frees between begin and join wait for the join: a block freed on either lane is not handed
 *   out again before it (the other lane may still be reading it), and after the join it is.
 * - Two branches open at once (BE_MAX_BRANCHES): a block freed on either side lane or on the main
 *   lane stays deferred until the one join, which waits for both.
 * - Chains run as branches compute the bits they compute one after the other: the shared expert
 *   on a branch beside a query-like chain (two FP8 linears around an RMSNorm) on the main lane,
 *   and a K=V-like chain (an FP8 linear and an RMSNorm) either on the main lane after it or on a
 *   second branch (three lanes, as the model's attention input runs them), the model's shapes
 *   (TP8 rank: D 5120, inter 2304, q_lora 1280, head 512), T = 8 and 64, with the tensor-core
 *   linears and without; eagerly, recorded into a graph segment, and replayed twice, every output
 *   poisoned before each run. The chains take and free temporaries inside the ops, so a free
 *   list that let one lane reuse another's live block would show here as well.
 * Without a GPU every test skips; under DS_CUDA_OPS_ON_CPU (the CPU backend, which has no branch
 * ops) the first test skips and the second runs its chains in issue order. */
#include "cuda_ops_common.h"

static bool has_branches(void) { return GPU->branch_begin && GPU->branch_end && GPU->branch_join; }

static void test_branch_defers_frees(void **st) {
    NEED_GPU(st);
    if (!has_branches()) skip();
    const size_t n = 3 << 12; /* one scratch size class */
    void *a = GPU->scratch(&gpu_be, n);
    GPU->free(&gpu_be, a);
    void *b = GPU->scratch(&gpu_be, n);
    assert_ptr_equal(a, b); /* outside a branch a freed block is reused at once (what the rest relies on) */

    /* freed on the branch lane: not handed to the main lane before the join */
    GPU->branch_begin(&gpu_be);
    GPU->free(&gpu_be, b);
    void *c = GPU->scratch(&gpu_be, n); /* the branch itself asks again */
    assert_ptr_not_equal(c, b);
    GPU->branch_end(&gpu_be);
    void *d = GPU->scratch(&gpu_be, n);
    assert_ptr_not_equal(d, b);
    assert_ptr_not_equal(d, c);
    /* freed on the main lane while the branch may run: the branch's next block is another one */
    GPU->free(&gpu_be, d);
    void *e = GPU->scratch(&gpu_be, n);
    assert_ptr_not_equal(e, d);
    GPU->branch_join(&gpu_be);
    /* after the join both deferred blocks are back */
    void *f = GPU->scratch(&gpu_be, n), *g = GPU->scratch(&gpu_be, n);
    assert_true((f == b && g == d) || (f == d && g == b));

    /* two branches open at once: what either side lane or the main lane frees waits for the join */
    GPU->branch_begin(&gpu_be);
    GPU->free(&gpu_be, f);
    GPU->branch_end(&gpu_be);
    GPU->branch_begin(&gpu_be); /* the second lane, forked after the first ended */
    void *h = GPU->scratch(&gpu_be, n);
    assert_ptr_not_equal(h, f);
    GPU->free(&gpu_be, g);
    GPU->branch_end(&gpu_be);
    void *i = GPU->scratch(&gpu_be, n);
    assert_ptr_not_equal(i, f);
    assert_ptr_not_equal(i, g);
    GPU->branch_join(&gpu_be);
    void *j = GPU->scratch(&gpu_be, n), *k = GPU->scratch(&gpu_be, n);
    assert_true((j == f && k == g) || (j == g && k == f));
    void *ps[] = {c, e, h, i, j, k};
    for (int q = 0; q < 6; q++) GPU->free(&gpu_be, ps[q]);
    g_sync();
}

/* The three chains' weights and buffers. */
struct chains {
    struct hw w1, w3, w2, wa, wb, wc;
    struct qweight g1, g3, g2, ga, gb, gc;
    bf16_t *norm, *cnorm; /* [Q_LORA], [KV_N] host */
    const void *dnorm, *dcnorm;
    void *dx, *dsh, *dqr, *dq, *dkv;
    int64_t T;
};

#define QB_N 2048 /* wq_b's rows in this test: 4 heads of 512 (the real 4096 adds nothing here) */
#define KV_N 512  /* wkv's rows: one head */

/* the K=V-like chain: an FP8 linear and an RMSNorm */
static void kv_chain_issue(struct chains *c) {
    GPU->linear(&gpu_be, c->dkv, c->dx, c->T, &c->gc);
    GPU->rmsnorm(&gpu_be, c->dkv, c->dkv, c->dcnorm, c->T, KV_N, 1e-6f, NULL);
}

/* branches: 0 all in issue order; 1 the shared expert on a branch; 2 the K=V chain on a second */
static void chains_issue(struct chains *c, int branches) {
    if (!has_branches()) branches = 0; /* the CPU stand-in: issue order */
    if (branches) GPU->branch_begin(&gpu_be);
    GPU->shared_expert(&gpu_be, c->dsh, c->dx, c->T, &c->g1, &c->g3, &c->g2, 10.0f);
    if (branches) GPU->branch_end(&gpu_be);
    if (branches == 2) {
        GPU->branch_begin(&gpu_be);
        kv_chain_issue(c);
        GPU->branch_end(&gpu_be);
    }
    GPU->linear(&gpu_be, c->dqr, c->dx, c->T, &c->ga);
    GPU->rmsnorm(&gpu_be, c->dqr, c->dqr, c->dnorm, c->T, Q_LORA, 1e-6f, NULL);
    GPU->linear(&gpu_be, c->dq, c->dqr, c->T, &c->gb);
    if (branches < 2) kv_chain_issue(c);
    if (branches) GPU->branch_join(&gpu_be);
}

static void chains_poison(struct chains *c) {
    size_t sz[] = {(size_t)(c->T * DIM) * 2, (size_t)(c->T * Q_LORA) * 2, (size_t)(c->T * QB_N) * 2,
                   (size_t)(c->T * KV_N) * 2};
    void *d[] = {c->dsh, c->dqr, c->dq, c->dkv};
    for (int i = 0; i < 4; i++) {
        void *h = xmalloc(sz[i]);
        poison_host(h, sz[i], PZ_16);
        g_put(d[i], h, sz[i]);
        free(h);
    }
}

/* The outputs, one host array: sh, then qr, then q, then kv. */
static void chains_get(struct chains *c, bf16_t *out) {
    g_get(out, c->dsh, (size_t)(c->T * DIM) * 2);
    g_get(out + c->T * DIM, c->dqr, (size_t)(c->T * Q_LORA) * 2);
    g_get(out + c->T * (DIM + Q_LORA), c->dq, (size_t)(c->T * QB_N) * 2);
    g_get(out + c->T * (DIM + Q_LORA + QB_N), c->dkv, (size_t)(c->T * KV_N) * 2);
}

static void same_bits_case(int64_t T, bool mma) {
    char tag[96];
    snprintf(tag, sizeof tag, "branch T=%lld mma=%d", (long long)T, mma);
    seed_tag(tag);
    mma_switch(mma);
    struct chains c = {.T = T};
    c.w1 = hw_fp8(MOE_INTER, DIM, 0, DIM, 0.02f), c.w3 = hw_fp8(MOE_INTER, DIM, 0, DIM, 0.02f);
    c.w2 = hw_fp8(DIM, MOE_INTER, 0, MOE_INTER, 0.02f);
    c.wa = hw_fp8(Q_LORA, DIM, 0, DIM, 0.02f), c.wb = hw_fp8(QB_N, Q_LORA, 0, Q_LORA, 0.03f);
    c.g1 = g_weight(&c.w1.q, false), c.g3 = g_weight(&c.w3.q, false), c.g2 = g_weight(&c.w2.q, false);
    c.wc = hw_fp8(KV_N, DIM, 0, DIM, 0.02f);
    c.ga = g_weight(&c.wa.q, false), c.gb = g_weight(&c.wb.q, false), c.gc = g_weight(&c.wc.q, false);
    c.norm = NEW(bf16_t, Q_LORA), c.cnorm = NEW(bf16_t, KV_N);
    for (int64_t i = 0; i < Q_LORA; i++) c.norm[i] = bf16_from_f32(0.5f + (float)urand());
    for (int64_t i = 0; i < KV_N; i++) c.cnorm[i] = bf16_from_f32(0.5f + (float)urand());
    c.dnorm = g_tensor(c.norm, (size_t)Q_LORA * 2, false);
    c.dcnorm = g_tensor(c.cnorm, (size_t)KV_N * 2, false);
    bf16_t *x = NEW(bf16_t, T * DIM);
    fill_act(x, T * DIM, 1.0f);
    c.dx = g_in(x, (size_t)(T * DIM) * 2);
    c.dsh = g_alloc((size_t)(T * DIM) * 2), c.dqr = g_alloc((size_t)(T * Q_LORA) * 2);
    c.dq = g_alloc((size_t)(T * QB_N) * 2), c.dkv = g_alloc((size_t)(T * KV_N) * 2);

    int64_t n_out = T * (DIM + Q_LORA + QB_N + KV_N);
    bf16_t *ref = NEW(bf16_t, n_out), *got = NEW(bf16_t, n_out);
    chains_poison(&c);
    chains_issue(&c, 0);
    chains_get(&c, ref);
    for (int64_t i = 0; i < n_out; i++)
        if (ref[i] == POISON16) fail_msg("%s: output %lld of the serial run left unwritten", tag, (long long)i);

    const char *runs[] = {"eager", "recorded", "replayed", "replayed again"};
    for (int nb = 1; nb <= 2; nb++) {
        const uint64_t key[] = {0xB4A2C400u + (uint64_t)nb, (uint64_t)T, (uint64_t)(uintptr_t)c.dx, mma};
        for (int r = 0; r < 4; r++) {
            chains_poison(&c);
            if (r == 0 || !GPU->graph_begin) {
                chains_issue(&c, nb);
            } else {
                bool issue = GPU->graph_begin(&gpu_be, key, 4);
                assert_int_equal(issue, r == 1); /* the first time it records, then it replays */
                if (issue) {
                    chains_issue(&c, nb);
                    GPU->graph_end(&gpu_be);
                }
            }
            chains_get(&c, got);
            int64_t bad = 0, first = -1;
            for (int64_t i = 0; i < n_out; i++)
                if (got[i] != ref[i] && !bad++) first = i;
            print_message("  branch T=%-3lld mma=%d lanes=%d %-15s %lld of %lld outputs differ from the serial run\n",
                          (long long)T, mma, nb + 1, runs[r], (long long)bad, (long long)n_out);
            if (bad)
                fail_msg("%s lanes=%d %s: %lld outputs differ from the serial run; first at %lld (%#x, serial %#x)",
                         tag, nb + 1, runs[r], (long long)bad, (long long)first, got[first], ref[first]);
        }
    }

    void *bufs[] = {c.dx, c.dsh, c.dqr, c.dq, c.dkv};
    for (int i = 0; i < 5; i++) g_free(bufs[i]);
    GPU->tensor_release(&gpu_be, c.dnorm);
    GPU->tensor_release(&gpu_be, c.dcnorm);
    struct qweight *gs[] = {&c.g1, &c.g3, &c.g2, &c.ga, &c.gb, &c.gc};
    for (int i = 0; i < 6; i++) GPU->weight_release(&gpu_be, gs[i]);
    struct hw *hs[] = {&c.w1, &c.w3, &c.w2, &c.wa, &c.wb, &c.wc};
    for (int i = 0; i < 6; i++) hw_free(hs[i]);
    free(c.norm);
    free(c.cnorm);
    free(x);
    free(ref);
    free(got);
    mma_switch(false);
}

static void test_branch_same_bits(void **st) {
    NEED_GPU(st);
    const int64_t Ts[] = {8, 64};
    for (int i = 0; i < 2; i++) {
        same_bits_case(Ts[i], true);
        same_bits_case(Ts[i], false);
    }
}

int main(void) {
    cuda_ops_test_filters();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_branch_defers_frees),
        cmocka_unit_test(test_branch_same_bits),
    };
    return cmocka_run_group_tests(tests, cuda_ops_group_setup, cuda_ops_group_teardown);
}
