/* The SM80 FP8/FP4 linear kernels against the CPU reference backend. The kernels sum in a fixed order
 * of their own (per-lane k-block partials folded by a warp-shuffle tree), so the outputs are held to
 * the linear bound of src/tolerances.h, not to equal bits:
 *     |gpu − cpu| <= TOL_GPU_LINEAR_RTOL_SUM · k · Σ|x̂·ŵ| + TOL_GPU_LINEAR_OUT_ULPS · ulp_bf16(out)
 * with Σ|x̂·ŵ| (x̂ the act_quant'ed activation, ŵ the dequantized weight) computed here per output in
 * double; the CPU result is also checked against the exact sum (a check of the bound itself).
 * Batch invariance: a row computed within T = 1 is bit-identical to the same row within T = 16.
 * Real V4.1-Flash per-rank decode shapes and odd ones, T = 1..16, outputs poisoned before each run
 * and guarded by sentinels. Skips cleanly without a GPU (CI compiles and links it; `make test-cuda`
 * on the GPU machine runs it). */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "formats.h"
#include "tolerances.h"

#ifdef DS_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/cuda_linear.h"

static uint64_t rng = 88172645463325252ull;
static uint32_t rnd(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}
static float gauss(void) {
    float a = 0;
    for (int i = 0; i < 12; i++) a += (float)(rnd() & 0xffffff) / 16777216.0f;
    return a - 6.0f;
}

#define SENTINEL 0xBEEF

static void *dmalloc(size_t n) {
    void *p = NULL;
    assert_int_equal(cudaMalloc(&p, n), cudaSuccess);
    return p;
}

/* One bf16 ulp at |v| (the spacing of v's binade; subnormal spacing below 2^-126). */
static double ulp_bf16(double v) {
    v = fabs(v);
    if (!(v >= 0x1p-126)) return 0x1p-133;
    int e;
    frexp(v, &e);
    return ldexp(1.0, e - 8);
}

struct lcase {
    int fp4;
    int64_t n, k, ld, s_ld;
    size_t wb, sb;
    uint8_t *w, *s, *dw, *ds;
};

static struct lcase make_case(int fp4, int64_t n, int64_t k) {
    struct lcase c = {.fp4 = fp4, .n = n, .k = k};
    int64_t s_rows = fp4 ? n : (n + 31) / 32;
    c.ld = fp4 ? k / 2 : k;
    c.s_ld = fp4 ? k / 32 : (k + 31) / 32;
    c.wb = (size_t)(n * c.ld);
    c.sb = (size_t)(s_rows * c.s_ld);
    c.w = malloc(c.wb);
    c.s = malloc(c.sb);
    for (size_t i = 0; i < c.wb; i++) {
        uint8_t b = (uint8_t)rnd();
        if (!fp4 && (b & 0x7f) == 0x7f) b ^= 1; /* no e4m3 NaN codes */
        c.w[i] = b;
    }
    for (size_t i = 0; i < c.sb; i++) c.s[i] = (uint8_t)(112 + rnd() % 24);
    c.dw = dmalloc(c.wb);
    c.ds = dmalloc(c.sb);
    assert_int_equal(cudaMemcpy(c.dw, c.w, c.wb, cudaMemcpyHostToDevice), cudaSuccess);
    assert_int_equal(cudaMemcpy(c.ds, c.s, c.sb, cudaMemcpyHostToDevice), cudaSuccess);
    if (fp4) cuda_fp4_pack(c.dw, (int64_t)c.wb, NULL); /* the device layout; c.w keeps the checkpoint's */
    return c;
}

static void free_case(struct lcase *c) {
    cudaFree(c->dw);
    cudaFree(c->ds);
    free(c->w);
    free(c->s);
}

/* y[T, n] on the GPU from device x, into host yg (poisoned before, 8 sentinels past the end checked). */
static void gpu_run(const struct lcase *c, const bf16_t *dx, int64_t T, bf16_t *yg) {
    bf16_t *dy = dmalloc(sizeof(bf16_t) * (size_t)(T * c->n + 8));
    void *ws = dmalloc(cuda_linear_workspace_bytes(T, c->k));
    bf16_t *h = malloc(sizeof(bf16_t) * (size_t)(T * c->n + 8));
    for (int64_t i = 0; i < T * c->n + 8; i++) h[i] = SENTINEL; /* poison + sentinels past the end */
    assert_int_equal(cudaMemcpy(dy, h, sizeof(bf16_t) * (size_t)(T * c->n + 8), cudaMemcpyHostToDevice), cudaSuccess);
    if (c->fp4)
        cuda_linear_fp4(dy, dx, T, c->dw, c->ds, c->n, c->k, c->ld, c->s_ld, ws, NULL);
    else
        cuda_linear_fp8(dy, dx, T, c->dw, c->ds, c->n, c->k, c->ld, c->s_ld, ws, NULL);
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
    assert_int_equal(cudaMemcpy(h, dy, sizeof(bf16_t) * (size_t)(T * c->n + 8), cudaMemcpyDeviceToHost), cudaSuccess);
    for (int i = 0; i < 8; i++) assert_int_equal(h[T * c->n + i], SENTINEL);
    memcpy(yg, h, sizeof(bf16_t) * (size_t)(T * c->n));
    cudaFree(dy);
    cudaFree(ws);
    free(h);
}

/* Σ x̂·ŵ (exact, double) and Σ|x̂·ŵ| per output: the terms the kernel's fp32 sum adds. */
static void ref_sums(const struct lcase *c, const bf16_t *x, int64_t T, double *S, double *A) {
    int64_t k = c->k, nb = k / 32;
    uint8_t *q = malloc((size_t)k);
    float *sx = malloc(sizeof(float) * (size_t)nb), *xh = malloc(sizeof(float) * (size_t)(T * k)),
          *wr = malloc(sizeof(float) * (size_t)k);
    for (int64_t t = 0; t < T; t++) {
        act_quant_fp8_32(x + t * k, (size_t)k, q, sx);
        for (int64_t i = 0; i < k; i++) xh[t * k + i] = e4m3_to_f32(q[i]) * sx[i / 32];
    }
    for (int64_t j = 0; j < c->n; j++) {
        const uint8_t *row = c->w + j * c->ld;
        for (int64_t i = 0; i < k; i++) {
            float v = c->fp4 ? e2m1_to_f32((uint8_t)((i & 1) ? row[i / 2] >> 4 : row[i / 2] & 15)) : e4m3_to_f32(row[i]);
            uint8_t sb = c->fp4 ? c->s[j * c->s_ld + i / 32] : c->s[(j / 32) * c->s_ld + i / 32];
            wr[i] = v * e8m0_to_f32(sb);
        }
        for (int64_t t = 0; t < T; t++) {
            double s = 0, a = 0;
            for (int64_t i = 0; i < k; i++) {
                double p = (double)xh[t * k + i] * (double)wr[i];
                s += p;
                a += fabs(p);
            }
            S[t * c->n + j] = s;
            A[t * c->n + j] = a;
        }
    }
    free(q);
    free(sx);
    free(xh);
    free(wr);
}

static void run_case(int fp4, int64_t T, int64_t n, int64_t k) {
    struct lcase c = make_case(fp4, n, k);
    bf16_t *x = malloc(sizeof(bf16_t) * (size_t)(T * k)), *yc = malloc(sizeof(bf16_t) * (size_t)(T * n));
    bf16_t *yg = malloc(sizeof(bf16_t) * (size_t)(T * n));
    for (int64_t i = 0; i < T * k; i++) x[i] = bf16_from_f32(gauss() * 3.0f);
    struct backend be;
    assert_int_equal(backend_cpu_init(&be), 0);
    struct qweight q = {.fmt = fp4 ? WF_FP4 : WF_FP8, .n = n, .k = k, .ld = c.ld, .s_ld = c.s_ld, .w = c.w, .s = c.s};
    be.ops->linear(&be, yc, x, T, &q);

    bf16_t *dx = dmalloc(sizeof(bf16_t) * (size_t)(T * k));
    assert_int_equal(cudaMemcpy(dx, x, sizeof(bf16_t) * (size_t)(T * k), cudaMemcpyHostToDevice), cudaSuccess);
    gpu_run(&c, dx, T, yg);

    double *S = malloc(sizeof(double) * (size_t)(T * n)), *A = malloc(sizeof(double) * (size_t)(T * n));
    ref_sums(&c, x, T, S, A);
    int64_t bad = 0, first = -1, differ = 0, self_bad = 0;
    double max_abs = 0, max_rel = 0, max_ratio = 0, first_tol = 0;
    for (int64_t i = 0; i < T * n; i++) {
        double G = bf16_to_f32(yg[i]), C = bf16_to_f32(yc[i]), d = G == C ? 0.0 : fabs(G - C);
        double tol = TOL_GPU_LINEAR_RTOL_SUM * (double)k * A[i] + TOL_GPU_LINEAR_OUT_ULPS * ulp_bf16(fmax(fabs(G), fabs(C)));
        if (yg[i] != yc[i]) {
            differ++;
            if (d > max_abs) max_abs = d;
            if (C != 0 && d / fabs(C) > max_rel) max_rel = d / fabs(C);
        }
        if (!(d <= tol)) {
            if (first < 0) first = i, first_tol = tol;
            bad++;
        } else if (d > 0 && d / tol > max_ratio)
            max_ratio = d / tol;
        /* the CPU is within its own share of the bound of the exact sum (checks the bound) */
        double r = TOL_CPU_SUM_U_PER_TERM * (double)k * TOL_FP32_U * A[i] + (double)(k + 2) * 0x1p-53 * A[i];
        if (!(fabs(C - S[i]) <= r + ulp_bf16(fmax(fabs(C), fabs(S[i]) + r)))) self_bad++;
    }
    print_message("%s T=%lld n=%lld k=%lld: %lld of %lld outputs differ, max|d| %.3g, max rel %.3g, max d/tol %.3g\n",
                  fp4 ? "fp4" : "fp8", (long long)T, (long long)n, (long long)k, (long long)differ, (long long)(T * n),
                  max_abs, max_rel, max_ratio);
    if (self_bad) fail_msg("%lld CPU outputs outside the exact sum's bound: the test's reference is wrong", (long long)self_bad);
    if (bad)
        fail_msg("%lld outputs out of tolerance; first %lld: gpu %g cpu %g, |d| %.3g > tol %.3g", (long long)bad,
                 (long long)first, bf16_to_f32(yg[first]), bf16_to_f32(yc[first]),
                 fabs(bf16_to_f32(yg[first]) - bf16_to_f32(yc[first])), first_tol);
    cudaFree(dx);
    backend_cpu_free(&be);
    free_case(&c);
    free(x);
    free(yc);
    free(yg);
    free(S);
    free(A);
}

/* Each row computed alone (T = 1) is bit-identical to the same row computed within T = 16. */
static void run_invariance(int fp4, int64_t n, int64_t k) {
    const int64_t T = CUDA_LINEAR_MAX_T;
    struct lcase c = make_case(fp4, n, k);
    bf16_t *x = malloc(sizeof(bf16_t) * (size_t)(T * k)), *yb = malloc(sizeof(bf16_t) * (size_t)(T * n)),
           *y1 = malloc(sizeof(bf16_t) * (size_t)n);
    for (int64_t i = 0; i < T * k; i++) x[i] = bf16_from_f32(gauss() * 3.0f);
    bf16_t *dx = dmalloc(sizeof(bf16_t) * (size_t)(T * k));
    assert_int_equal(cudaMemcpy(dx, x, sizeof(bf16_t) * (size_t)(T * k), cudaMemcpyHostToDevice), cudaSuccess);
    gpu_run(&c, dx, T, yb);
    int64_t bad_rows = 0, first = -1;
    for (int64_t r = 0; r < T; r++) {
        gpu_run(&c, dx + r * k, 1, y1);
        if (memcmp(y1, yb + r * n, sizeof(bf16_t) * (size_t)n)) {
            if (first < 0) first = r;
            bad_rows++;
        }
    }
    print_message("%s n=%lld k=%lld: batch invariance T=1 vs T=%lld: %lld of %lld rows differ\n", fp4 ? "fp4" : "fp8",
                  (long long)n, (long long)k, (long long)T, (long long)bad_rows, (long long)T);
    if (bad_rows) fail_msg("row %lld computed alone differs from the same row within T=%lld", (long long)first, (long long)T);
    cudaFree(dx);
    free_case(&c);
    free(x);
    free(yb);
    free(y1);
}

static int have_gpu(void) { return cuda_device_count() > 0; }

static void test_fp8_real_shapes(void **st) {
    (void)st;
    if (!have_gpu()) skip();
    /* TP8 per-rank decode shapes: wq_a, wkv, wq_b slice, wo_b (output-row split), shared expert */
    const int64_t sh[][2] = {{1280, 5120}, {512, 5120}, {4096, 1280}, {640, 8192}, {2304, 5120}, {5120, 2304}};
    const int64_t Ts[] = {1, 8, 16};
    for (size_t i = 0; i < sizeof sh / sizeof *sh; i++)
        for (size_t j = 0; j < 3; j++) run_case(0, Ts[j], sh[i][0], sh[i][1]);
}

static void test_fp4_real_shapes(void **st) {
    (void)st;
    if (!have_gpu()) skip();
    const int64_t sh[][2] = {{2304, 5120}, {5120, 2304}};
    const int64_t Ts[] = {1, 4, 16};
    for (size_t i = 0; i < 2; i++)
        for (size_t j = 0; j < 3; j++) run_case(1, Ts[j], sh[i][0], sh[i][1]);
}

static void test_odd_shapes(void **st) {
    (void)st;
    if (!have_gpu()) skip();
    run_case(0, 3, 1, 32);   /* one row, one block */
    run_case(0, 7, 129, 96); /* partial tile rows, 3 blocks */
    run_case(0, 5, 33, 1088); /* 34 blocks: a second, partial round of 32 */
    run_case(1, 2, 37, 64);
    run_case(1, 9, 100, 1056);
}

static void test_batch_invariance(void **st) {
    (void)st;
    if (!have_gpu()) skip();
    run_invariance(0, 1280, 5120); /* wq_a */
    run_invariance(0, 640, 8192);
    run_invariance(1, 2304, 5120); /* expert w1 */
    run_invariance(1, 5120, 2304); /* expert w2 */
    run_invariance(0, 129, 1088);
    run_invariance(1, 37, 64);
}
#else
static void test_fp8_real_shapes(void **st) { (void)st; skip(); }
static void test_fp4_real_shapes(void **st) { (void)st; skip(); }
static void test_odd_shapes(void **st) { (void)st; skip(); }
static void test_batch_invariance(void **st) { (void)st; skip(); }
#endif

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_fp8_real_shapes), cmocka_unit_test(test_fp4_real_shapes),
                                       cmocka_unit_test(test_odd_shapes), cmocka_unit_test(test_batch_invariance)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
