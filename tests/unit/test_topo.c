/* Unit tests for the pure parts of mpi/topo.c: the pipeline stage split and the TP fit check, on
 * the real V4.1-Flash preset and the two golden fixtures. The expected splits are written out
 * from spec/MODEL.md §5 (KV-sharing groups {2-7}, {8-13}, {14-19}, {20-39} in the real model) and
 * the fixtures' role tables, not recomputed with the rule topo.c uses. The world layout and the
 * communicators need MPI and are tested by tests/mpi/mpi_comm_check.c under mpirun.
 * Run from the repo root; GOLDEN points at shared/golden (default ../shared/golden). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "log.h"
#include "topo.h"

#define PRESET "data/presets/v41-flash.json"

static struct model_config *g_real, *g_tp8pp2, *g_small6;

static const char *golden(const char *spec) {
    static char buf[2][1024];
    static int slot;
    const char *g = getenv("GOLDEN");
    char *p = buf[slot++ & 1];
    snprintf(p, sizeof buf[0], "%s/%s/config.json", g && g[0] ? g : "../shared/golden", spec);
    return p;
}

static struct model_config *load(const char *path) {
    struct model_config *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    if (config_load(path, c)) {
        fprintf(stderr, "config_load(%s): %s\n", path, ds_err_get());
        free(c);
        return NULL;
    }
    return c;
}

static int setup(void **state) {
    g_real = load(PRESET);
    g_tp8pp2 = load(golden("tp8pp2"));
    g_small6 = load(golden("small6"));
    return g_real && g_tp8pp2 && g_small6 ? 0 : -1;
}

static int teardown(void **state) {
    struct model_config *all[] = {g_real, g_tp8pp2, g_small6};
    for (int i = 0; i < 3; i++) {
        if (all[i]) config_free(all[i]);
        free(all[i]);
    }
    return 0;
}

/* Split and compare with the expected first layer of every stage (the last stage ends at n). */
static void expect_split(const struct model_config *c, int pp, const int *counts, const int *first) {
    int b[TOPO_MAX_PP], e[TOPO_MAX_PP];
    int rc = topo_stage_split(c, pp, counts, b, e);
    if (rc) print_error("topo_stage_split(pp %d): %s\n", pp, ds_err_get());
    assert_int_equal(rc, 0);
    for (int s = 0; s < pp; s++) {
        assert_int_equal(b[s], first[s]);
        assert_int_equal(e[s], s + 1 < pp ? first[s + 1] : c->n_layers);
    }
}

/* Expect a rejection whose message contains every one of the given fragments. */
static void expect_split_error(const struct model_config *c, int pp, const int *counts, const char *frag1,
                               const char *frag2) {
    int b[TOPO_MAX_PP], e[TOPO_MAX_PP];
    ds_err_set("%s", "");
    assert_int_equal(topo_stage_split(c, pp, counts, b, e), -1);
    const char *msg = ds_err_get();
    if (!strstr(msg, frag1) || (frag2 && !strstr(msg, frag2)))
        fail_msg("message \"%s\" lacks \"%s\"%s%s", msg, frag1, frag2 ? " or " : "", frag2 ? frag2 : "");
}

static void expect_tp_error(const struct model_config *c, int tp, const char *frag) {
    ds_err_set("%s", "");
    assert_int_equal(topo_check_tp(c, tp), -1);
    if (!strstr(ds_err_get(), frag)) fail_msg("message \"%s\" lacks \"%s\"", ds_err_get(), frag);
}

/* ------------------------------------------------------------------------------------------------
 * Stage split: real preset */

static void test_real_pp2_default(void **state) {
    /* MODEL.md §5: stage 0 = layers 0-19, stage 1 = layers 20-39 */
    expect_split(g_real, 2, NULL, (const int[]){0, 20});
}

static void test_real_pp1(void **state) { expect_split(g_real, 1, NULL, (const int[]){0}); }

static void test_real_pp3_default(void **state) {
    /* ceil(40/3) = 14 is the start of group 14-19 (valid); ceil(80/3) = 27 lies in 20-39, whose
     * only valid boundary above 14 within reach is 20 (7 away; 40 is the end). */
    expect_split(g_real, 3, NULL, (const int[]){0, 14, 20});
}

static void test_real_pp4_impossible(void **state) {
    /* 10 -> 8, 20 -> 20, then nothing after 20: layers 21-39 all read layer 20's compressed KV */
    expect_split_error(g_real, 4, NULL, "20-39", "--pp 4");
}

static void test_real_explicit_ok(void **state) {
    expect_split(g_real, 2, (const int[]){20, 20}, (const int[]){0, 20});
    expect_split(g_real, 2, (const int[]){14, 26}, (const int[]){0, 14});
    expect_split(g_real, 5, (const int[]){2, 6, 6, 6, 20}, (const int[]){0, 2, 8, 14, 20});
}

static void test_real_explicit_cuts_group(void **state) {
    /* boundary 10: layer 10 reads layer 8's compressed KV; the group is 8-13 */
    expect_split_error(g_real, 2, (const int[]){10, 30}, "--pp-layers 10,30: boundary at layer 10 cuts the KV-sharing group 8-13",
                       "layer 10 reads layer 8's compressed KV");
    expect_split_error(g_real, 2, (const int[]){30, 10}, "group 20-39", NULL);
    expect_split_error(g_real, 2, (const int[]){5, 35}, "group 2-7", NULL);
    /* the valid first boundary does not hide the bad second one */
    expect_split_error(g_real, 3, (const int[]){20, 4, 16}, "boundary at layer 24 cuts the KV-sharing group 20-39", NULL);
}

static void test_real_explicit_bad_counts(void **state) {
    expect_split_error(g_real, 2, (const int[]){20, 10}, "sum to 30", "40 backbone layers");
    expect_split_error(g_real, 2, (const int[]){40, 0}, "stage 1 gets 0 layers", NULL);
    expect_split_error(g_real, 3, (const int[]){20, 30, -10}, "stage 2 gets -10 layers", NULL);
}

static void test_real_bad_pp(void **state) {
    expect_split_error(g_real, 0, NULL, "--pp 0", NULL);
    expect_split_error(g_real, 41, NULL, "--pp 41", NULL);
}

/* ------------------------------------------------------------------------------------------------
 * Stage split: golden fixtures */

static void test_tp8pp2_pp2(void **state) {
    /* groups {2-3} and {4-7}: the even boundary 4 is valid */
    expect_split(g_tp8pp2, 2, NULL, (const int[]){0, 4});
}

static void test_tp8pp2_explicit(void **state) {
    expect_split(g_tp8pp2, 2, (const int[]){2, 6}, (const int[]){0, 2});
    expect_split_error(g_tp8pp2, 2, (const int[]){3, 5},
                       "--pp-layers 3,5: boundary at layer 3 cuts the KV-sharing group 2-3 (layer 3 reads layer 2's compressed KV)",
                       NULL);
    /* layer 7 reads the top-k that layer 6 published, and layer 4's KV */
    expect_split_error(g_tp8pp2, 2, (const int[]){7, 1}, "group 4-7", NULL);
}

static void test_tp8pp2_pp4(void **state) {
    /* ideal 2, 4, 6: 2 and 4 are valid; 6 lies inside 4-7 and nothing above 4 is valid */
    expect_split_error(g_tp8pp2, 4, NULL, "group 4-7", NULL);
    expect_split(g_tp8pp2, 3, NULL, (const int[]){0, 2, 4});
}

static void test_small6(void **state) {
    /* groups {1-2} and {3-5} */
    expect_split(g_small6, 2, NULL, (const int[]){0, 3});
    /* ideal 2 cuts {1-2}: 1 and 3 are both one away, the tie goes to 1; ideal 4 -> 3 */
    expect_split(g_small6, 3, NULL, (const int[]){0, 1, 3});
    expect_split_error(g_small6, 2, (const int[]){2, 4}, "group 1-2", NULL);
    expect_split_error(g_small6, 7, NULL, "more pipeline stages than the 6 backbone layers", NULL);
}

/* ------------------------------------------------------------------------------------------------
 * TP fit */

static void test_tp_real(void **state) {
    for (int tp = 1; tp <= 8; tp *= 2) {
        if (topo_check_tp(g_real, tp)) fail_msg("tp %d: %s", tp, ds_err_get());
    }
    expect_tp_error(g_real, 3, "--tp 3 does not divide o_groups = 8");
    expect_tp_error(g_real, 16, "--tp 16 does not divide o_groups = 8");
    expect_tp_error(g_real, 0, "--tp 0");
}

static void test_tp_golden(void **state) {
    for (int tp = 1; tp <= 8; tp *= 2) {
        if (topo_check_tp(g_tp8pp2, tp)) fail_msg("tp8pp2 tp %d: %s", tp, ds_err_get());
    }
    expect_tp_error(g_tp8pp2, 3, "--tp 3 does not divide o_groups = 8");
    expect_tp_error(g_tp8pp2, 16, "--tp 16 does not divide o_groups = 8");
    /* small6 has 2 output groups: TP 2 at most */
    assert_int_equal(topo_check_tp(g_small6, 1), 0);
    assert_int_equal(topo_check_tp(g_small6, 2), 0);
    expect_tp_error(g_small6, 4, "--tp 4 does not divide o_groups = 2");
}

/* Each remaining rule on a copy of the golden config with one field changed (the copy shares the
 * parsed JSON with the original and is never freed). */
static void test_tp_each_rule(void **state) {
    struct model_config *c = malloc(sizeof *c);
    assert_non_null(c);

    *c = *g_tp8pp2;
    c->n_heads = 12; /* o_groups 8 still divides by 8; the heads do not */
    expect_tp_error(c, 8, "does not divide num_attention_heads = 12");

    *c = *g_tp8pp2;
    c->index_n_heads = 4;
    expect_tp_error(c, 8, "does not divide index_n_heads = 4");
    c->index_n_heads = 0; /* no indexer: not a constraint */
    c->index_head_dim = 0;
    assert_int_equal(topo_check_tp(c, 8), 0);

    *c = *g_tp8pp2;
    c->n_routed_experts = 12;
    expect_tp_error(c, 8, "does not divide n_routed_experts = 12");

    *c = *g_tp8pp2;
    c->role[c->n_layers + 1].n_experts = 12;
    expect_tp_error(c, 8, "= 12 (DSpark block mtp.1)");
    c->n_mtp = 0; /* without DSpark blocks their experts do not matter */
    assert_int_equal(topo_check_tp(c, 8), 0);

    *c = *g_tp8pp2;
    c->vocab_size = 500;
    expect_tp_error(c, 8, "does not divide vocab_size = 500");
    assert_int_equal(topo_check_tp(c, 4), 0);

    /* slices: 8 heads x 48 / 8 = 48 rows is not whole 32-blocks; at tp 2 it is 192 */
    *c = *g_tp8pp2;
    c->head_dim = 48;
    expect_tp_error(c, 8, "attn.wq_b slice per rank");
    assert_int_equal(topo_check_tp(c, 2), 0);

    *c = *g_tp8pp2;
    c->o_lora_rank = 16; /* 8 x 16 / 8 = 16 */
    expect_tp_error(c, 8, "attn.wo_a");
    assert_int_equal(topo_check_tp(c, 4), 0);

    *c = *g_tp8pp2;
    c->index_head_dim = 16; /* 8 x 16 / 8 = 16 */
    expect_tp_error(c, 8, "indexer.wq_b");
    free(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_real_pp2_default),
        cmocka_unit_test(test_real_pp1),
        cmocka_unit_test(test_real_pp3_default),
        cmocka_unit_test(test_real_pp4_impossible),
        cmocka_unit_test(test_real_explicit_ok),
        cmocka_unit_test(test_real_explicit_cuts_group),
        cmocka_unit_test(test_real_explicit_bad_counts),
        cmocka_unit_test(test_real_bad_pp),
        cmocka_unit_test(test_tp8pp2_pp2),
        cmocka_unit_test(test_tp8pp2_explicit),
        cmocka_unit_test(test_tp8pp2_pp4),
        cmocka_unit_test(test_small6),
        cmocka_unit_test(test_tp_real),
        cmocka_unit_test(test_tp_golden),
        cmocka_unit_test(test_tp_each_rule),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
