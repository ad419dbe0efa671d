/* The profiling decorator (kernels/prof_backend.c) over the CPU backend: ops through it compute
 * exactly what the inner backend computes, every timed op is counted once per call under its own
 * name, the memory ops pass through, and reset clears the counts; with a device clock each op is
 * charged the span between its marks. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "formats.h"
#include "prof_backend.h"

static void fill(bf16_t *x, int64_t n, uint32_t seed) {
    for (int64_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        x[i] = bf16_from_f32(((float)(seed >> 8) / 16777216.0f - 0.5f) * 4.0f);
    }
}

/* the report's row for `op`: calls per `per` and whether it was there */
static int report_calls(struct backend *pb, const char *op, int per, double *calls) {
    char buf[8192] = {0};
    FILE *f = fmemopen(buf, sizeof buf - 1, "w");
    prof_backend_report(pb, f, "t", per);
    fclose(f);
    char key[64];
    snprintf(key, sizeof key, "t,%s,", op);
    const char *at = strstr(buf, key);
    if (!at) return 0;
    *calls = atof(at + strlen(key));
    return 1;
}

static void test_passthrough_and_counts(void **state) {
    struct backend cpu, pb;
    assert_int_equal(backend_cpu_init(&cpu), 0);
    prof_backend_init(&pb, &cpu);
    const int64_t T = 3, n = 40, k = 64;
    bf16_t *x = malloc(sizeof(bf16_t) * T * k), *w = malloc(sizeof(bf16_t) * n * k);
    bf16_t *y0 = malloc(sizeof(bf16_t) * T * n), *y1 = malloc(sizeof(bf16_t) * T * n);
    fill(x, T * k, 1);
    fill(w, n * k, 2);
    struct qweight q = {.fmt = WF_BF16, .n = n, .k = k, .ld = k, .w = w};
    cpu.ops->linear(&cpu, y0, x, T, &q);
    memset(y1, 0xff, sizeof(bf16_t) * T * n);
    pb.ops->linear(&pb, y1, x, T, &q);
    pb.ops->linear(&pb, y1, x, T, &q);
    assert_memory_equal(y0, y1, sizeof(bf16_t) * T * n);
    pb.ops->rmsnorm(&pb, y1, y0, w, T, n, 1e-6f, NULL);
    cpu.ops->rmsnorm(&cpu, y0, y0, w, T, n, 1e-6f, NULL);
    assert_memory_equal(y0, y1, sizeof(bf16_t) * T * n);

    /* memory ops go through to the inner backend */
    bf16_t *d = pb.ops->alloc(&pb, 64);
    pb.ops->upload(&pb, d, x, 64);
    bf16_t back[32];
    pb.ops->download(&pb, back, d, 64);
    assert_memory_equal(back, x, 64);
    pb.ops->free(&pb, d);

    double calls = 0;
    assert_true(report_calls(&pb, "linear", 1, &calls));
    assert_true(calls == 2.0);
    assert_true(report_calls(&pb, "rmsnorm", 2, &calls));
    assert_true(calls == 0.5); /* divided by `per` */
    assert_true(report_calls(&pb, "upload", 1, &calls) && calls == 1.0);
    assert_false(report_calls(&pb, "sparse_attn", 1, &calls)); /* never called: no row */
    prof_backend_reset(&pb);
    assert_false(report_calls(&pb, "linear", 1, &calls));
    prof_backend_free(&pb);
    backend_cpu_free(&cpu);
    free(x), free(w), free(y0), free(y1);
}

/* A fake device clock: mark i stands at i² ms, so a span's time tells which marks bound it. */
static int g_marks, g_resets;
static int fake_mark(void *ctx) { return g_marks++; }
static double fake_ms(void *ctx, int a, int b) { return (double)b * b - (double)a * a; }
static void fake_reset(void *ctx) { g_marks = 0, g_resets++; }

static double report_ms(struct backend *pb, const char *op) {
    char buf[8192] = {0};
    FILE *f = fmemopen(buf, sizeof buf - 1, "w");
    prof_backend_report(pb, f, "t", 1);
    fclose(f);
    char key[64];
    snprintf(key, sizeof key, "t,%s,", op);
    const char *at = strstr(buf, key);
    if (!at) return -1;
    at = strchr(at + strlen(key), ',');
    return atof(at + 1);
}

/* With a device clock each op is charged the span between the mark before it and the one after,
 * resolved at the report (after the inner backend's sync), and the marks start over there. */
static void test_device_clock_spans(void **state) {
    struct backend cpu, pb;
    assert_int_equal(backend_cpu_init(&cpu), 0);
    const struct prof_clock clk = {NULL, fake_mark, fake_ms, fake_reset};
    g_resets = 0;
    prof_backend_init_device(&pb, &cpu, &clk);
    assert_int_equal(g_resets, 1);
    bf16_t x[64], y[64], w[64];
    fill(x, 64, 3);
    fill(w, 64, 4);
    pb.ops->rmsnorm(&pb, y, x, w, 2, 32, 1e-6f, NULL); /* marks 0, 1: 1 ms */
    pb.ops->qdq_fp8_32(&pb, y, 64);              /* marks 2, 3: 5 ms */
    pb.ops->rmsnorm(&pb, y, x, w, 2, 32, 1e-6f, NULL); /* marks 4, 5: 9 ms */
    assert_int_equal(g_marks, 6);
    assert_true(report_ms(&pb, "rmsnorm") == 10.0); /* ms_per_step in the report */
    assert_int_equal(g_resets, 2);
    pb.ops->qdq_fp8_32(&pb, y, 64); /* marks 0, 1 again: 1 ms more */
    prof_backend_reset(&pb);        /* resolves, then clears */
    assert_true(report_ms(&pb, "qdq_fp8_32") < 0);
    pb.ops->qdq_fp8_32(&pb, y, 64);
    assert_true(report_ms(&pb, "qdq_fp8_32") == 1.0);
    prof_backend_free(&pb);
    backend_cpu_free(&cpu);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_passthrough_and_counts),
                                       cmocka_unit_test(test_device_clock_spans)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
