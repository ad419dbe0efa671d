/* Unit tests for the CPU reference backend (kernels/cpu), op by op against kernels/backend.h.
 *
 * This backend is the oracle for the GPU kernels, so the tests pin its rounding points rather
 * than its rough values: most expected numbers are worked out by hand (with the arithmetic in the
 * comment next to them), chosen so that a different summation order, a missed bf16 rounding, a
 * swapped FP4 nibble or a different block structure gives a different bit pattern. Where a hand
 * case is too small to exercise the machinery (weight panels, T chunks, TP slices, 64-blocks of
 * sparse attention), the test carries its own plain scalar port of the backend.h formula and
 * requires equal bits, and where only the math is fixed (softmax, Engram gate) it compares with a
 * double-precision computation within a bf16 tolerance. The last test runs the parallel ops with
 * one and with two OpenMP threads and requires identical bytes. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "formats.h"
#include "log.h"

static struct backend be;
#define OPS (be.ops)
#define B(v) bf16_from_f32(v)
#define F(h) bf16_to_f32(h)

/* ---------------------------------------------------------------------------------------------
 * Helpers */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static float urand(void) { /* uniform in [-1, 1) */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)((double)(rng_state >> 11) * 0x1p-52 - 1.0);
}

static void fill_bf16(bf16_t *x, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) x[i] = B(urand() * scale);
}

static void fill_f32(float *x, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) x[i] = urand() * scale;
}

static struct qweight wq(enum wfmt fmt, int64_t n, int64_t k, int64_t ld, int64_t s_ld, const void *w,
                         const uint8_t *s) {
    struct qweight q = {.fmt = fmt, .n = n, .k = k, .ld = ld, .s_ld = s_ld, .w = w, .s = s, .be_priv = NULL};
    return q;
}

/* The backend.h formula for a quantized linear, one output at a time, no tricks. */
static void port_linear_quant(bf16_t *y, const bf16_t *x, int64_t T, const struct qweight *W) {
    int64_t k = W->k, nb = k / 32;
    uint8_t *q = malloc((size_t)k);
    float *sx = malloc((size_t)nb * sizeof(float));
    for (int64_t t = 0; t < T; t++) {
        act_quant_fp8_32(x + t * k, (size_t)k, q, sx);
        for (int64_t j = 0; j < W->n; j++) {
            const uint8_t *row = (const uint8_t *)W->w + j * W->ld;
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                float part = 0.0f, sw;
                for (int64_t i = b * 32; i < b * 32 + 32; i++) {
                    float wv = W->fmt == WF_FP8 ? e4m3_to_f32(row[i])
                                                : e2m1_to_f32((uint8_t)((i & 1) ? row[i / 2] >> 4 : row[i / 2] & 15));
                    part += e4m3_to_f32(q[i]) * wv;
                }
                sw = W->fmt == WF_FP8 ? e8m0_to_f32(W->s[(j / 32) * W->s_ld + b]) : e8m0_to_f32(W->s[j * W->s_ld + b]);
                acc += (part * sx[b]) * sw;
            }
            y[t * W->n + j] = B(acc);
        }
    }
    free(sx);
    free(q);
}

/* ---------------------------------------------------------------------------------------------
 * Memory and weights */

static void test_memory_ops(void **state) {
    uint8_t *p = OPS->alloc(&be, 100);
    for (int i = 0; i < 100; i++) assert_int_equal(p[i], 0);
    uint8_t src[100], back[100];
    for (int i = 0; i < 100; i++) src[i] = (uint8_t)(i * 7);
    OPS->upload(&be, p, src, 100);
    OPS->copy(&be, p + 50, p, 50);
    OPS->sync(&be);
    OPS->download(&be, back, p, 100);
    assert_memory_equal(back, src, 50);
    assert_memory_equal(back + 50, src, 50);
    OPS->free(&be, p);
}

static void test_weight_prepare(void **state) {
    int64_t n = 40, k = 64;
    float *wf = malloc((size_t)(n * k) * sizeof(float)), *deq = malloc((size_t)(n * k) * sizeof(float));
    uint8_t *q = malloc((size_t)(n * k)), s[2 * 2];
    fill_f32(wf, n * k, 3.0f);
    quant_fp8_tiles(wf, n, k, q, s);
    dequant_fp8_tiles(q, s, n, k, k, 2, deq);
    struct qweight w = wq(WF_FP8, n, k, k, 2, q, s);
    assert_int_equal(OPS->weight_prepare(&be, &w, false), 0);
    assert_int_equal(w.fmt, WF_FP8);
    assert_ptr_equal(w.w, q);
    assert_int_equal(OPS->weight_prepare(&be, &w, true), 0);
    assert_int_equal(w.fmt, WF_BF16);
    assert_int_equal(w.ld, k);
    assert_null(w.s);
    const bf16_t *c = w.w;
    for (int64_t i = 0; i < n * k; i++) assert_int_equal(c[i], B(deq[i]));
    OPS->weight_release(&be, &w);
    assert_int_equal(w.fmt, WF_FP8);
    assert_ptr_equal(w.w, q);
    assert_ptr_equal(w.s, s);
    assert_int_equal(w.ld, k);
    assert_null(w.be_priv);
    uint8_t p4[16] = {0}, s4[1] = {127};
    struct qweight w4 = wq(WF_FP4, 1, 32, 16, 1, p4, s4);
    assert_int_equal(OPS->weight_prepare(&be, &w4, true), -1); /* only FP8 converts */
    free(q);
    free(deq);
    free(wf);
}

/* ---------------------------------------------------------------------------------------------
 * Linears */

static void test_linear_fp8_hand(void **state) {
    /* W [2, 64]: row 0 all 1.0 (0x38); row 1 block 0 = 2.0 (0x40), block 1 = 0.5 (0x30).
     * One tile row, tile scales 2^0 and 2^2. */
    uint8_t w[2 * 64], s[2] = {127, 129};
    for (int i = 0; i < 64; i++) {
        w[i] = 0x38;
        w[64 + i] = i < 32 ? 0x40 : 0x30;
    }
    bf16_t x[2 * 64], y[4];
    for (int i = 0; i < 64; i++) {
        x[i] = B(i < 32 ? 1.0f : 3.0f);
        x[64 + i] = B(i < 32 ? 1.1f : 0.0f);
    }
    struct qweight W = wq(WF_FP8, 2, 64, 64, 2, w, s);
    OPS->linear(&be, y, x, 2, &W);
    /* t0: block 0: amax 1 -> s_x = 2^ceil(log2(1/448)) = 2^-8, q = 256; block 1: amax 3 -> 2^-7, q = 384.
     *   y0 = (32·256·1)·2^-8·1 + (32·384·1)·2^-7·4 = 32 + 384 = 416
     *   y1 = (32·256·2)·2^-8·1 + (32·384·0.5)·2^-7·4 = 64 + 192 = 256
     * t1: bf16(1.1) = 1.1015625 -> s_x = 2^-8, x/s = 282 -> e4m3 288 (step 32); block 1 is zero.
     *   y0 = 32·288·2^-8 = 36 (not 35.25: the activation quantization is visible), y1 = 72 */
    assert_true(F(y[0]) == 416.0f);
    assert_true(F(y[1]) == 256.0f);
    assert_true(F(y[2]) == 36.0f);
    assert_true(F(y[3]) == 72.0f);
}

static void test_linear_fp8_slice_vs_port(void **state) {
    /* A row-parallel TP slice: columns [32, 128) of a [70, 160] matrix (ld 160, scales offset by one
     * tile column); 70 rows cross panels and tile rows, T = 70 crosses the T chunk. */
    int64_t n = 70, kf = 160, k0 = 32, k = 96, T = 70, s_ld = 5;
    float *wf = malloc((size_t)(n * kf) * sizeof(float));
    uint8_t *q = malloc((size_t)(n * kf)), *s = malloc((size_t)(3 * s_ld));
    for (int64_t i = 0; i < n * kf; i++) wf[i] = urand() * (float)(1 + (i % 7));
    quant_fp8_tiles(wf, n, kf, q, s);
    bf16_t *x = malloc((size_t)(T * k) * sizeof(bf16_t));
    for (int64_t i = 0; i < T * k; i++) x[i] = B(urand() * (float)(1 << (i % 9)));
    bf16_t *y = malloc((size_t)(T * n) * sizeof(bf16_t)), *ye = malloc((size_t)(T * n) * sizeof(bf16_t));
    struct qweight W = wq(WF_FP8, n, k, kf, s_ld, q + k0, s + k0 / 32);
    OPS->linear(&be, y, x, T, &W);
    port_linear_quant(ye, x, T, &W);
    assert_memory_equal(y, ye, (size_t)(T * n) * sizeof(bf16_t));
    free(ye);
    free(y);
    free(x);
    free(s);
    free(q);
    free(wf);
}

static void test_linear_fp4_nibbles(void **state) {
    /* Row 0: element 0 = 1.0 (code 2, low nibble), element 1 = 0.5 (code 1, high nibble): 0x12.
     * Row 1: the nibbles swapped (0x21) and a row scale of 2. x = [1, 2, 0...]: s_x = 2^-7,
     * q = [128, 256].  y0 = (128·1 + 256·0.5)·2^-7 = 2;  y1 = (128·0.5 + 256·1)·2^-7·2 = 5.
     * Reading the high nibble as the even element would give y0 = 2.5. */
    uint8_t w[2 * 16] = {0}, s[2] = {127, 128};
    w[0] = 0x12;
    w[16] = 0x21;
    bf16_t x[32] = {0}, y[2];
    x[0] = B(1.0f);
    x[1] = B(2.0f);
    struct qweight W = wq(WF_FP4, 2, 32, 16, 1, w, s);
    OPS->linear(&be, y, x, 1, &W);
    assert_true(F(y[0]) == 2.0f);
    assert_true(F(y[1]) == 5.0f);

    /* Random FP4 against the port: 19 rows (a partial panel), k = 64. */
    int64_t n = 19, k = 64, T = 5;
    float wf[19 * 64];
    uint8_t q[19 * 32], sc[19 * 2];
    fill_f32(wf, n * k, 4.0f);
    quant_fp4_rows(wf, n, k, q, sc);
    bf16_t xr[5 * 64], yr[5 * 19], ye[5 * 19];
    fill_bf16(xr, T * k, 10.0f);
    struct qweight W4 = wq(WF_FP4, n, k, k / 2, k / 32, q, sc);
    OPS->linear(&be, yr, xr, T, &W4);
    port_linear_quant(ye, xr, T, &W4);
    assert_memory_equal(yr, ye, sizeof yr);
}

static void test_linear_bf16_and_f32(void **state) {
    bf16_t x[3] = {B(1), B(2), B(3)}, w[6] = {B(1), B(1), B(1), B(0.5f), B(-1), B(2)}, y[2];
    struct qweight W = wq(WF_BF16, 2, 3, 3, 0, w, NULL);
    OPS->linear(&be, y, x, 1, &W);
    assert_true(F(y[0]) == 6.0f);
    assert_true(F(y[1]) == 4.5f);

    /* Sequential k order: 1 + 2^-24 + 2^-24 stays 1 in fp32 (each add is a tie to even); adding
     * the two small terms first would give 1 + 2^-23. */
    bf16_t xs[3] = {B(1.0f), B(0x1p-24f), B(0x1p-24f)}, ones[3] = {B(1), B(1), B(1)};
    float onesf[3] = {1, 1, 1}, yf;
    struct qweight Wb = wq(WF_BF16, 1, 3, 3, 0, ones, NULL), Wf = wq(WF_F32, 1, 3, 3, 0, onesf, NULL);
    OPS->linear_f32(&be, &yf, xs, 1, &Wb);
    assert_true(yf == 1.0f);
    OPS->linear_f32(&be, &yf, xs, 1, &Wf);
    assert_true(yf == 1.0f);
    OPS->head(&be, &yf, xs, 1, &Wb);
    assert_true(yf == 1.0f);

    /* fp32 weights are used unrounded: 0.1f is not a bf16 value. */
    float w01[2] = {0.1f, 0.1f};
    bf16_t x2[2] = {B(1.0f), B(2.0f)};
    struct qweight W01 = wq(WF_F32, 1, 2, 2, 0, w01, NULL);
    OPS->linear_f32(&be, &yf, x2, 1, &W01);
    assert_true(yf == 0.1f * 1.0f + 0.1f * 2.0f);

    /* Segments of BE_DOT_SEG (backend.h): segment 0 holds 1 and 2^-8, segment 1 starts with 2^-24
     * twice. Segment 1's sum 2^-23 is added as one term: 1 + 2^-8 + 2^-23, which bf16 rounds up to
     * 1 + 2^-7. One k-order chain drops each 2^-24 (a tie to even) and gives 1 + 2^-8, which bf16
     * rounds (a tie, to even) to 1. Every dense entry (linear, linear_f32, head) takes that order. */
    enum { KS = BE_DOT_SEG + 2 };
    bf16_t xk[KS], wk[KS], yb;
    float wkf[KS];
    for (int i = 0; i < KS; i++) xk[i] = B(0.0f), wk[i] = B(1.0f), wkf[i] = 1.0f;
    xk[0] = B(1.0f), xk[1] = B(0x1p-8f), xk[BE_DOT_SEG] = B(0x1p-24f), xk[BE_DOT_SEG + 1] = B(0x1p-24f);
    const float seg_sum = 1.0f + 0x1p-8f + 0x1p-23f;
    struct qweight Wk = wq(WF_BF16, 1, KS, KS, 0, wk, NULL), Wkf = wq(WF_F32, 1, KS, KS, 0, wkf, NULL);
    OPS->linear_f32(&be, &yf, xk, 1, &Wk);
    assert_true(yf == seg_sum);
    OPS->linear_f32(&be, &yf, xk, 1, &Wkf);
    assert_true(yf == seg_sum);
    OPS->head(&be, &yf, xk, 1, &Wk);
    assert_true(yf == seg_sum);
    OPS->linear(&be, &yb, xk, 1, &Wk);
    assert_int_equal(yb, B(1.0f + 0x1p-7f));
}

/* The segmented order the CPU backend's dense sums follow (backend.h, BE_DOT_SEG). */
static float seg_dot(const bf16_t *x, const bf16_t *wb, const float *wf, int64_t k) {
    float tot = 0.0f;
    for (int64_t s0 = 0; s0 < k; s0 += BE_DOT_SEG) {
        float a = 0.0f;
        for (int64_t i = s0; i < k && i < s0 + BE_DOT_SEG; i++) a += F(x[i]) * (wb ? F(wb[i]) : wf[i]);
        tot += a;
    }
    return tot;
}

static void test_linear_dense_vs_port(void **state) {
    /* T = 70 crosses the T chunk, 13 outputs end in a partial panel, W is a K slice (ld LD), and K
     * spans two whole BE_DOT_SEG segments and a partial one. */
    enum { T = 70, N = 13, K = 2 * BE_DOT_SEG + 40, LD = K + 8 };
    static bf16_t x[T * K], w[N * LD], y[T * N];
    static float wf[N * LD], yf[T * N];
    fill_bf16(x, T * K, 3.0f);
    fill_bf16(w, N * LD, 1.0f);
    fill_f32(wf, N * LD, 1.0f);
    struct qweight Wb = wq(WF_BF16, N, K, LD, 0, w + 8, NULL), Wf = wq(WF_F32, N, K, LD, 0, wf + 8, NULL);
    OPS->linear(&be, y, x, T, &Wb);
    for (int t = 0; t < T; t++)
        for (int j = 0; j < N; j++) assert_int_equal(y[t * N + j], B(seg_dot(x + t * K, w + j * LD + 8, NULL, K)));
    OPS->linear_f32(&be, yf, x, T, &Wf);
    for (int t = 0; t < T; t++)
        for (int j = 0; j < N; j++) assert_true(yf[t * N + j] == seg_dot(x + t * K, NULL, wf + j * LD + 8, K));
}

static void test_grouped_linear(void **state) {
    /* G = 2, r = 2, kg = 3. Group 0 rows [1,0,0], [0,1,1]; group 1 rows [1,1,1], [0,0,-1].
     * x = [[1,2,3], [4,5,6]] -> y = [1, 5, 15, -6]. */
    float wv[12] = {1, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, -1}, xv[12] = {1, 2, 3, 4, 5, 6, -1, 0, 2, 0, 0, 8};
    bf16_t w[12], x[12], y[8];
    for (int i = 0; i < 12; i++) {
        w[i] = B(wv[i]);
        x[i] = B(xv[i]);
    }
    struct qweight W = wq(WF_BF16, 4, 3, 3, 0, w, NULL);
    OPS->grouped_linear(&be, y, x, 2, 2, &W);
    float ex[8] = {1, 5, 15, -6, -1, 2, 8, -8};
    for (int i = 0; i < 8; i++) assert_true(F(y[i]) == ex[i]);
}

/* ---------------------------------------------------------------------------------------------
 * Norm, RoPE, QDQ */

static void test_rmsnorm(void **state) {
    bf16_t w[4] = {B(1), B(2), B(0.5f), B(-1)};
    bf16_t x[8] = {B(2), B(2), B(2), B(2), B(3), B(4), B(0), B(0)}, y[8];
    OPS->rmsnorm(&be, y, x, w, 2, 4, 1e-20f, NULL);
    /* Row 0: mean 4, r = 0.5 -> y = w. Row 1: mean 25/4, r = 1/2.5 = 0.4f; y = bf16(w·(x·r)). */
    float ex0[4] = {1, 2, 0.5f, -1};
    for (int i = 0; i < 4; i++) assert_true(F(y[i]) == ex0[i]);
    float r = 1.0f / sqrtf(6.25f + 1e-20f);
    assert_true(r == 0.4f);
    assert_int_equal(y[4], B(1.0f * (3.0f * r))); /* 1.2000000477 -> 1.203125 */
    assert_int_equal(y[5], B(2.0f * (4.0f * r)));
    assert_true(F(y[4]) == 1.203125f);
    /* In place gives the same bits. */
    OPS->rmsnorm(&be, x, x, w, 2, 4, 1e-20f, NULL);
    assert_memory_equal(x, y, sizeof y);
}

/* rmsnorm with a post: the norm, then rope on [off, off + rd) of each row, then the rows' QDQ,
 * as the three ops in turn (and the post visibly changes the rows) */
static void test_rmsnorm_post(void **state) {
    enum { T = 3, N = 64 };
    bf16_t x[T * N], w[N], y1[T * N], y2[T * N];
    fill_bf16(x, T * N, 3.0f);
    fill_bf16(w, N, 1.5f);
    int32_t pos[T] = {0, 7, 1000};
    float freqs[8];
    for (int i = 0; i < 8; i++) freqs[i] = powf(10000.0f, -(float)i / 8.0f);
    for (int q = 0; q < 2; q++) {
        const enum norm_qdq mode = q ? NORM_QDQ_FP4_32 : NORM_QDQ_FP8_32;
        const struct norm_post post = {N - 16, 16, pos, freqs, mode};
        OPS->rmsnorm(&be, y1, x, w, T, N, 1e-6f, &post);
        OPS->rmsnorm(&be, y2, x, w, T, N, 1e-6f, NULL);
        bf16_t plain[T * N];
        memcpy(plain, y2, sizeof plain);
        OPS->rope(&be, y2, T, 1, N, N, N - 16, 16, pos, freqs, false);
        (q ? OPS->qdq_fp4_32 : OPS->qdq_fp8_32)(&be, y2, T * N);
        assert_memory_equal(y1, y2, sizeof y1);
        assert_true(memcmp(y1, plain, sizeof plain) != 0);
    }
}

static void test_rope(void **state) {
    /* T = 2 rows of 2 heads x 8 (ld_head 8, ld_row 16), rotary part [4, 8): two pairs with
     * freqs 0.5 and 0. Row 0 at pos 0 must be untouched; row 1 at pos 1 rotates pair 0 by 0.5. */
    bf16_t x[32], orig[32];
    fill_bf16(x, 32, 2.0f);
    x[16 + 4] = B(1);
    x[16 + 5] = B(0); /* head 0 pair 0 = (1, 0) */
    x[24 + 4] = B(0);
    x[24 + 5] = B(1); /* head 1 pair 0 = (0, 1) */
    memcpy(orig, x, sizeof x);
    int32_t pos[2] = {0, 1};
    float freqs[2] = {0.5f, 0.0f};
    OPS->rope(&be, x, 2, 2, 16, 8, 4, 4, pos, freqs, false);
    assert_memory_equal(x, orig, 16 * sizeof(bf16_t));
    /* cos 0.5 = 0.87758 -> bf16 0.87890625; sin 0.5 = 0.47943 -> bf16 0.478515625. */
    assert_true(F(x[20]) == 0.87890625f);
    assert_true(F(x[21]) == 0.478515625f);
    assert_true(F(x[28]) == -0.478515625f);
    assert_true(F(x[29]) == 0.87890625f);
    for (int h = 0; h < 2; h++) {
        for (int i = 0; i < 4; i++) assert_int_equal(x[16 + h * 8 + i], orig[16 + h * 8 + i]);
        assert_int_equal(x[16 + h * 8 + 6], orig[16 + h * 8 + 6]); /* freq 0 pair: identity */
        assert_int_equal(x[16 + h * 8 + 7], orig[16 + h * 8 + 7]);
    }
    /* The inverse rotation of (1, 0) is (cos, -sin). */
    memcpy(x, orig, sizeof x);
    OPS->rope(&be, x, 2, 2, 16, 8, 4, 4, pos, freqs, true);
    assert_true(F(x[20]) == 0.87890625f);
    assert_true(F(x[21]) == -0.478515625f);
}

static void test_qdq(void **state) {
    int64_t n = 8192 + 64; /* crosses the 4096-element parallel chunks */
    bf16_t *a = malloc((size_t)n * sizeof(bf16_t)), *b = malloc((size_t)n * sizeof(bf16_t));
    for (int which = 0; which < 3; which++) {
        for (int64_t i = 0; i < n; i++) a[i] = B(urand() * (float)(1 << (i % 11)));
        memcpy(b, a, (size_t)n * sizeof(bf16_t));
        if (which == 0) {
            OPS->qdq_fp8_32(&be, a, n);
            qdq_fp8_32(b, (size_t)n);
        } else if (which == 1) {
            OPS->qdq_fp4_32(&be, a, n);
            qdq_fp4_32_ue8m0(b, (size_t)n);
        } else {
            OPS->qdq_fp4_16(&be, a, n);
            qdq_fp4_16_e4m3(b, (size_t)n);
        }
        assert_memory_equal(a, b, (size_t)n * sizeof(bf16_t));
    }
    /* FP4/32 by hand: amax 1 -> s = 2^ceil(log2(1/6)) = 1/4; 0.3/s = 1.2 -> e2m1 1.0 -> 0.25. */
    bf16_t x[32];
    for (int i = 0; i < 32; i++) x[i] = B(0.3f);
    x[0] = B(1.0f);
    OPS->qdq_fp4_32(&be, x, 32);
    assert_true(F(x[0]) == 1.0f);
    assert_true(F(x[1]) == 0.25f);
    free(b);
    free(a);
}

/* ---------------------------------------------------------------------------------------------
 * mHC */

/* split_sinkhorn in double, from MODEL.md §3.2, for comparison within a tolerance. */
static void sinkhorn_double(const double *m, int hc, const float *scale, const float *base, int iters, double eps,
                            double *pre, double *post, double *C) {
    for (int j = 0; j < hc; j++) {
        pre[j] = 1.0 / (1.0 + exp(-(m[j] * scale[0] + base[j]))) + eps;
        post[j] = 2.0 / (1.0 + exp(-(m[hc + j] * scale[1] + base[hc + j])));
    }
    for (int j = 0; j < hc; j++) {
        double mx = -INFINITY, sum = 0;
        for (int k = 0; k < hc; k++) {
            C[j * hc + k] = m[2 * hc + j * hc + k] * scale[2] + base[2 * hc + j * hc + k];
            mx = fmax(mx, C[j * hc + k]);
        }
        for (int k = 0; k < hc; k++) sum += exp(C[j * hc + k] - mx);
        for (int k = 0; k < hc; k++) C[j * hc + k] = exp(C[j * hc + k] - mx) / sum + eps;
    }
    for (int it = 0; it < iters; it++) {
        for (int j = 0; it > 0 && j < hc; j++) {
            double s = 0;
            for (int k = 0; k < hc; k++) s += C[j * hc + k];
            for (int k = 0; k < hc; k++) C[j * hc + k] /= s + eps;
        }
        for (int k = 0; k < hc; k++) {
            double s = 0;
            for (int j = 0; j < hc; j++) s += C[j * hc + k];
            for (int j = 0; j < hc; j++) C[j * hc + k] /= s + eps;
        }
    }
}

static void test_hc_mixes_one_iter_hand(void **state) {
    /* hc = 2, D = 1, X = [1, 1]: r = 1/sqrt(2/2) = 1 and m[j] = fn[j][0] (fn[j][1] = 0).
     * m = 0 except the C logit [0][1] = ln 3, so row 0 softmaxes to [1/4, 3/4] and row 1 to
     * [1/2, 1/2]; then + eps and one column normalization. */
    const double eps = 1e-6;
    float L = logf(3.0f);
    float fn[8 * 2] = {0};
    fn[5 * 2] = L;
    float scale[3] = {1, 1, 1}, base[8] = {0};
    bf16_t X[2] = {B(1), B(1)};
    float pre[2], post[2], comb[4];
    OPS->hc_mixes(&be, pre, post, comb, X, 1, 2, 1, fn, scale, base, 1, 0.0f, 1e-6f);
    assert_true(pre[0] == 0.5f + 1e-6f && pre[1] == 0.5f + 1e-6f);
    assert_true(post[0] == 1.0f && post[1] == 1.0f);
    double c00 = 0.25 + eps, c01 = 0.75 + eps, c10 = 0.5 + eps, c11 = 0.5 + eps;
    double s0 = c00 + c10 + eps, s1 = c01 + c11 + eps;
    assert_true(fabs(comb[0] - c00 / s0) < 1e-6);
    assert_true(fabs(comb[1] - c01 / s1) < 1e-6);
    assert_true(fabs(comb[2] - c10 / s0) < 1e-6);
    assert_true(fabs(comb[3] - c11 / s1) < 1e-6);
}

static void test_hc_mixes_sinkhorn(void **state) {
    int hc = 4, D = 16, T = 3, nm = 24, L = 64;
    bf16_t X[3 * 64];
    float fn[24 * 64], scale[3] = {0.7f, 1.3f, 1.0f}, base[24];
    fill_bf16(X, T * L, 3.0f);
    fill_f32(fn, nm * L, 0.2f);
    fill_f32(base, nm, 1.0f);
    float pre[12], post[12], comb[48];
    for (int iters = 3; iters <= 20; iters += 17) {
        OPS->hc_mixes(&be, pre, post, comb, X, T, hc, D, fn, scale, base, iters, 1e-20f, 1e-6f);
        for (int t = 0; t < T; t++) {
            double m[24], dpre[4], dpost[4], dC[16], ss = 0;
            for (int i = 0; i < L; i++) ss += (double)F(X[t * L + i]) * F(X[t * L + i]);
            double r = 1.0 / sqrt(ss / L + 1e-20);
            for (int j = 0; j < nm; j++) {
                double a = 0;
                for (int i = 0; i < L; i++) a += (double)F(X[t * L + i]) * fn[j * L + i];
                m[j] = a * r;
            }
            sinkhorn_double(m, hc, scale, base, iters, 1e-6, dpre, dpost, dC);
            for (int j = 0; j < hc; j++) {
                assert_true(fabs(pre[t * hc + j] - dpre[j]) < 1e-5);
                assert_true(fabs(post[t * hc + j] - dpost[j]) < 1e-5);
            }
            for (int i = 0; i < 16; i++) assert_true(fabs(comb[t * 16 + i] - dC[i]) < 1e-5);
            if (iters == 20) { /* (approximately) doubly stochastic, columns last */
                for (int a = 0; a < hc; a++) {
                    double rs = 0, cs = 0;
                    for (int b = 0; b < hc; b++) {
                        rs += comb[t * 16 + a * hc + b];
                        cs += comb[t * 16 + b * hc + a];
                    }
                    assert_true(fabs(cs - 1.0) < 1e-5);
                    assert_true(fabs(rs - 1.0) < 1e-3);
                }
            }
        }
    }
}

static void test_hc_collapse_expand_init(void **state) {
    /* collapse: X = [[1,2,3],[4,5,6]], p = [0.5, 0.25] -> [1.5, 2.25, 3]; p = [1, 0] -> X0. */
    bf16_t X[12] = {B(1), B(2), B(3), B(4), B(5), B(6), B(1), B(2), B(3), B(4), B(5), B(6)}, y[6];
    float p[4] = {0.5f, 0.25f, 1.0f, 0.0f};
    OPS->hc_collapse(&be, y, X, p, 2, 2, 3, NULL, 0.0f);
    float ey[6] = {1.5f, 2.25f, 3, 1, 2, 3};
    for (int i = 0; i < 6; i++) assert_true(F(y[i]) == ey[i]);
    /* with a norm weight: the collapse, then rmsnorm of its bf16 rows (rows [1.5, 2.25, 3] and
     * [1, 2, 3]: different scales, so a norm of the wrong row or of X would show) */
    bf16_t wn[3] = {B(1), B(0.5f), B(2)}, yn[6], yr[6];
    OPS->hc_collapse(&be, yn, X, p, 2, 2, 3, wn, 1e-6f);
    OPS->rmsnorm(&be, yr, y, wn, 2, 3, 1e-6f, NULL);
    for (int i = 0; i < 6; i++) assert_true(yn[i] == yr[i]);
    assert_true(F(yn[0]) != F(yn[3]));

    /* expand: y = [1, 2], X0 = [1, 0], X1 = [0, 1], post = [1, 0.5], comb rows [1, 2], [3, 4].
     * Xo[0] = 1·y + (1·X0 + 3·X1) = [2, 5]; Xo[1] = 0.5·y + (2·X0 + 4·X1) = [2.5, 5]. */
    bf16_t ye[2] = {B(1), B(2)}, Xe[4] = {B(1), B(0), B(0), B(1)}, Xo[4];
    float post[2] = {1.0f, 0.5f}, comb[4] = {1, 2, 3, 4};
    OPS->hc_expand(&be, Xo, ye, Xe, post, comb, 1, 2, 2, 1);
    float eo[4] = {2, 5, 2.5f, 5};
    for (int i = 0; i < 4; i++) assert_true(F(Xo[i]) == eo[i]);
    /* y in column blocks (y_blocks 2 of width 1, two rows: y [2, T, 1]) reads element (t, d) at
     * (d·T + t): rows y0 = [1, 2], y1 = [4, 8] lie as [1, 4, 2, 8]; the plain layout's answer */
    {
        bf16_t y2[4] = {B(1), B(2), B(4), B(8)}, y2b[4] = {B(1), B(4), B(2), B(8)};
        bf16_t X2[8] = {B(1), B(0), B(0), B(1), B(2), B(1), B(1), B(2)}, Xp[8], Xb[8];
        float post2[4] = {1.0f, 0.5f, 0.25f, 2.0f}, comb2[8] = {1, 2, 3, 4, 0.5f, 1, 1.5f, 2};
        OPS->hc_expand(&be, Xp, y2, X2, post2, comb2, 2, 2, 2, 1);
        OPS->hc_expand(&be, Xb, y2b, X2, post2, comb2, 2, 2, 2, 2);
        assert_memory_equal(Xb, Xp, sizeof Xp);
        /* and the blocks read as plain rows would give another answer (the layout matters) */
        OPS->hc_expand(&be, Xb, y2b, X2, post2, comb2, 2, 2, 2, 1);
        assert_true(memcmp(Xb, Xp, sizeof Xp) != 0);
    }

    bf16_t e[4] = {B(1), B(2), B(3), B(4)}, Xi[16];
    float pre[8];
    memset(pre, 0xFF, sizeof pre);
    OPS->hc_init(&be, Xi, pre, e, 2, 4, 2);
    for (int t = 0; t < 2; t++)
        for (int c = 0; c < 4; c++) {
            assert_memory_equal(Xi + (t * 4 + c) * 2, e + t * 2, 2 * sizeof(bf16_t));
            assert_true(pre[t * 4 + c] == (c == 0 ? 1.0f : 0.0f));
        }
}

/* ---------------------------------------------------------------------------------------------
 * Embedding and Engram */

static void test_embed(void **state) {
    /* The local shard holds rows 10..12. */
    bf16_t table[6] = {B(1), B(2), B(3), B(4), B(5), B(6)}, e[10];
    int32_t ids[5] = {9, 10, 12, 13, 11};
    memset(e, 0xFF, sizeof e);
    OPS->embed(&be, e, ids, 5, table, 10, 3, 2);
    float ex[10] = {0, 0, 1, 2, 5, 6, 0, 0, 3, 4};
    for (int i = 0; i < 10; i++) assert_true(F(e[i]) == ex[i]);
    assert_int_equal(e[0], 0);
}

static void test_engram_gather(void **state) {
    /* Local rows 5 and 6 of a [*, 64] table: row 5 all 1.0 with scales 2^0, 2^1; row 6 all 2.0
     * except element 33 = -1.0, scales 2^-1, 2^3. Id 7 is not local. */
    uint8_t table[2 * 64], scale[4] = {127, 128, 126, 130};
    for (int i = 0; i < 64; i++) {
        table[i] = 0x38;
        table[64 + i] = 0x40;
    }
    table[64 + 33] = 0xB8;
    int64_t ids[3] = {5, 6, 7};
    bf16_t rows[3 * 64];
    memset(rows, 0xFF, sizeof rows);
    OPS->engram_gather(&be, rows, ids, 1, 3, table, scale, 5, 2, 64);
    for (int i = 0; i < 64; i++) {
        assert_true(F(rows[i]) == (i < 32 ? 1.0f : 2.0f));
        assert_true(F(rows[64 + i]) == (i < 32 ? 1.0f : (i == 33 ? -8.0f : 16.0f)));
        assert_int_equal(rows[128 + i], 0);
    }
}

static void test_engram_gate(void **state) {
    int64_t T = 3, hc = 4, D = 64;
    bf16_t X[3 * 4 * 64], X0[3 * 4 * 64], kv[3 * 5 * 64];
    float w[4 * 64];
    fill_bf16(X, T * hc * D, 2.0f);
    fill_bf16(kv, T * (hc + 1) * D, 1.5f);
    fill_f32(w, hc * D, 4.0f);
    memcpy(X0, X, sizeof X);
    OPS->engram_gate(&be, X, kv, w, T, hc, D, 1e-20f);
    for (int64_t t = 0; t < T; t++)
        for (int64_t c = 0; c < hc; c++) {
            const bf16_t *h = X0 + (t * hc + c) * D, *key = kv + t * (hc + 1) * D + c * D,
                         *val = kv + t * (hc + 1) * D + hc * D;
            double sh = 0, sk = 0, dot = 0;
            for (int64_t d = 0; d < D; d++) {
                sh += (double)F(h[d]) * F(h[d]);
                sk += (double)F(key[d]) * F(key[d]);
                dot += (double)F(h[d]) * w[c * D + d] * F(key[d]);
            }
            dot *= 1.0 / sqrt(sh / D + 1e-20) / sqrt(sk / D + 1e-20) / sqrt((double)D);
            double g = 1.0 / (1.0 + exp(-copysign(sqrt(fmax(fabs(dot), 1e-6)), dot)));
            for (int64_t d = 0; d < D; d++) {
                double e = F(h[d]) + g * F(val[d]);
                double got = F(X[(t * hc + c) * D + d]);
                assert_true(fabs(got - e) <= fabs(e) * 0x1p-7 + 1e-5);
            }
        }
    /* w = 0: dot = +0, so the gate is sigmoid(+sqrt(1e-6)) = sigmoid(1e-3), not 0.5. */
    memset(w, 0, sizeof w);
    memcpy(X, X0, sizeof X);
    OPS->engram_gate(&be, X, kv, w, 1, hc, D, 1e-20f);
    float g = 1.0f / (1.0f + expf(-sqrtf(1e-6f)));
    for (int64_t d = 0; d < D; d++)
        assert_int_equal(X[d], B(F(X0[d]) + g * F(kv[hc * D + d])));
}

/* ---------------------------------------------------------------------------------------------
 * Attention */

/* backend.h's sparse_attn written out plainly (hd <= 64 here): block-64 online softmax, P rounded
 * to bf16 against the block's running max, each block's P·V summed on its own, then the sink. */
static void port_sparse_attn(bf16_t *o, const bf16_t *q, const bf16_t *kv, const int32_t *idx, int64_t T,
                             int64_t H, int64_t hd, int64_t n_idx, const float *sink, float scale) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            const int32_t *ir = idx + t * n_idx;
            const bf16_t *qr = q + (t * H + h) * hd;
            bf16_t *out = o + (t * H + h) * hd;
            int any = 0;
            for (int64_t i = 0; i < n_idx; i++) any |= ir[i] >= 0;
            if (!any) {
                memset(out, 0, (size_t)hd * sizeof(bf16_t));
                continue;
            }
            float m = -1e30f, l = 0.0f, acc[64] = {0};
            for (int64_t b0 = 0; b0 < n_idx; b0 += 64) {
                int64_t nb = n_idx - b0 < 64 ? n_idx - b0 : 64;
                float sc[64], p[64], mn = m, ls = 0.0f;
                for (int64_t i = 0; i < nb; i++) {
                    int32_t id = ir[b0 + i];
                    sc[i] = -INFINITY;
                    if (id < 0) continue;
                    float dot = 0.0f;
                    for (int64_t d = 0; d < hd; d++) dot += F(qr[d]) * F(kv[id * hd + d]);
                    sc[i] = dot * scale;
                    if (sc[i] > mn) mn = sc[i];
                }
                float alpha = expf(m - mn);
                for (int64_t i = 0; i < nb; i++) {
                    p[i] = ir[b0 + i] < 0 ? 0.0f : expf(sc[i] - mn);
                    ls += p[i];
                }
                l = l * alpha + ls;
                for (int64_t d = 0; d < hd; d++) {
                    float pv = 0.0f;
                    for (int64_t i = 0; i < nb; i++)
                        if (ir[b0 + i] >= 0) pv += bf16_round(p[i]) * F(kv[ir[b0 + i] * hd + d]);
                    acc[d] = acc[d] * alpha + pv;
                }
                m = mn;
            }
            l += expf(sink[h] - m);
            for (int64_t d = 0; d < hd; d++) out[d] = B(acc[d] / l);
        }
}

static void test_sparse_attn_single_and_empty(void **state) {
    /* One valid entry (in the second 64-block) and a sink far below: P = exp(0) = 1, the
     * denominator is 1, and the output is that kv row bit for bit. */
    int64_t H = 2, hd = 8, n = 100;
    bf16_t q[16], kv[5 * 8], o[2 * 16];
    fill_bf16(q, 16, 1.0f);
    fill_bf16(kv, 40, 3.0f);
    int32_t idx[2 * 100];
    for (int i = 0; i < 200; i++) idx[i] = -1;
    idx[70] = 3;
    float sink[2] = {-1e30f, -1e30f};
    memset(o, 0x7F, sizeof o);
    OPS->sparse_attn(&be, o, q, kv, idx, 2, H, hd, n, sink, 0.3f);
    assert_memory_equal(o, kv + 3 * 8, 8 * sizeof(bf16_t));
    assert_memory_equal(o + 8, kv + 3 * 8, 8 * sizeof(bf16_t));
    for (int i = 16; i < 32; i++) assert_int_equal(o[i], 0); /* row 1: no valid entry */
}

static void test_sparse_attn_vs_double(void **state) {
    enum { T = 2, H = 3, HD = 16, N = 200, NKV = 50 };
    bf16_t q[T * H * HD], kv[NKV * HD], o[T * H * HD];
    int32_t idx[T * N];
    fill_bf16(q, T * H * HD, 2.0f);
    fill_bf16(kv, NKV * HD, 1.0f);
    for (int i = 0; i < T * N; i++) idx[i] = urand() < -0.6f ? -1 : (int32_t)((urand() + 1.0f) * 0.5f * NKV);
    float sink[H] = {0.5f, -1.0f, 2.0f}, scale = 0.25f;
    OPS->sparse_attn(&be, o, q, kv, idx, T, H, HD, N, sink, scale);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < H; h++) {
            double s[N], mx = sink[h], den = 0, num[HD] = {0};
            for (int i = 0; i < N; i++) {
                if (idx[t * N + i] < 0) continue;
                double dot = 0;
                for (int d = 0; d < HD; d++) dot += (double)F(q[(t * H + h) * HD + d]) * F(kv[idx[t * N + i] * HD + d]);
                s[i] = dot * scale;
                mx = fmax(mx, s[i]);
            }
            for (int i = 0; i < N; i++) {
                if (idx[t * N + i] < 0) continue;
                double p = exp(s[i] - mx);
                den += p;
                for (int d = 0; d < HD; d++) num[d] += p * F(kv[idx[t * N + i] * HD + d]);
            }
            den += exp(sink[h] - mx);
            for (int d = 0; d < HD; d++) assert_true(fabs(F(o[(t * H + h) * HD + d]) - num[d] / den) < 1e-2);
        }
}

static void test_sparse_attn_block_boundary(void **state) {
    /* By hand, hd = 2, q = [1, 0], scale 1, no sink: entry a = kv [0, 1] (logit 0) and entry
     * b = kv [1, -0.3671875] (logit 1); every other slot is -1.
     * Row A has a in block 0 and b in block 1: a is weighted by P = 1 against its own block's max,
     *   then rescaled by alpha = expf(-1) = 0.36787945 (fp32), so acc[1] = 0.36787945 - 0.3671875.
     * Row B has both in block 0: a's P = expf(-1) is rounded to bf16 first = 0.3671875, and
     *   acc[1] = 0.3671875 - 0.3671875 = 0 exactly. Same softmax, different bits. */
    enum { N = 128 };
    bf16_t q2[2] = {B(1), B(0)}, kv2[4] = {B(0), B(1), B(1), B(-0.3671875f)}, o2[2][2], e2[2][2];
    int32_t rows[2][N];
    for (int i = 0; i < N; i++) rows[0][i] = rows[1][i] = -1;
    rows[0][10] = 0, rows[0][100] = 1; /* A */
    rows[1][10] = 0, rows[1][20] = 1;  /* B */
    float nosink[1] = {-1e30f};
    for (int r = 0; r < 2; r++) {
        OPS->sparse_attn(&be, o2[r], q2, kv2, rows[r], 1, 1, 2, N, nosink, 1.0f);
        port_sparse_attn(e2[r], q2, kv2, rows[r], 1, 1, 2, N, nosink, 1.0f);
        assert_memory_equal(o2[r], e2[r], sizeof o2[r]);
    }
    float alpha = expf(-1.0f);
    assert_int_equal(o2[0][1], B((alpha - 0.3671875f) / (alpha + 1.0f)));
    assert_true(F(o2[0][1]) != 0.0f);
    assert_int_equal(o2[1][1], 0);

    /* Random rows, and the same row with its highest-logit entry swapped across the boundary:
     * both bit-equal to the port. */
    enum { H = 2, HD = 16 };
    bf16_t q[H * HD], kv[N * HD], oa[H * HD], ea[H * HD];
    fill_bf16(q, H * HD, 2.0f);
    fill_bf16(kv, N * HD, 2.0f);
    int32_t ia[N];
    for (int i = 0; i < N; i++) ia[i] = i;
    int best = 64;
    float bs = -INFINITY;
    for (int i = 64; i < N; i++) {
        float dot = 0.0f;
        for (int d = 0; d < HD; d++) dot += F(q[d]) * F(kv[i * HD + d]);
        if (dot > bs) bs = dot, best = i;
    }
    float sink[H] = {0.0f, 1.0f};
    for (int r = 0; r < 2; r++) {
        if (r == 1) ia[5] = best, ia[best] = 5;
        OPS->sparse_attn(&be, oa, q, kv, ia, 1, H, HD, N, sink, 1.0f);
        port_sparse_attn(ea, q, kv, ia, 1, H, HD, N, sink, 1.0f);
        assert_memory_equal(oa, ea, sizeof oa);
    }
}

static void test_compress_pool(void **state) {
    /* Group 0: channel 0 scores [0, ln 3] -> softmax [1/4, 3/4], kv [4, 8] -> 7; channel 1 scores
     * [1, 1] -> [1/2, 1/2], kv [2, 6] -> 4. Group 1: an unfilled slot (-inf score, kv NaN or inf)
     * gets weight 0, so the filled slot's kv comes through unchanged. [G, r, n] layout. */
    float L = logf(3.0f);
    float score[8] = {0, 1, L, 1, -INFINITY, 2, 0, -INFINITY};
    float kv[8] = {4, 2, 8, 6, NAN, -3, 5, INFINITY};
    bf16_t lat[4];
    OPS->compress_pool(&be, lat, kv, score, 2, 2, 2);
    float ex[4] = {7, 4, 5, -3};
    for (int i = 0; i < 4; i++) assert_true(F(lat[i]) == ex[i]);
}

static void test_index_scores(void **state) {
    /* nh = 2, d = 2, q rows padded to ld_q = 5; K = [1,0], [0,1], [1,1]; w = bf16(w_raw · 0.5).
     * t0: q = [1,2], [-1,3], w = [0.5, 1]:  j0: 0.5·1 + 1·relu(-1) = 0.5;  j1: 0.5·2 + 3 = 4;
     *     j2: 0.5·3 + 2 = 3.5.   t1: q = [0.5,0.5], [1,1], w = [0.5, 0.5], visible 1: j0 = 0.75. */
    float qv[10] = {1, 2, -1, 3, 99, 0.5f, 0.5f, 1, 1, 99}, kv[6] = {1, 0, 0, 1, 1, 1};
    bf16_t q[10], K[6], w[4] = {B(1), B(2), B(1), B(1)};
    for (int i = 0; i < 10; i++) q[i] = B(qv[i]);
    for (int i = 0; i < 6; i++) K[i] = B(kv[i]);
    int32_t vis[2] = {3, 1};
    float S[8];
    for (int i = 0; i < 8; i++) S[i] = 123.0f;
    OPS->index_scores(&be, S, 4, q, 5, K, NULL, NULL, w, 0.5f, vis, 2, 2, 2, 3);
    float ex[8] = {0.5f, 4, 3.5f, 123, 0.75f, -INFINITY, -INFINITY, 123};
    for (int i = 0; i < 8; i++) assert_true(S[i] == ex[i]);

    /* Each head's dot is rounded to bf16: 1 + 2^-9 -> 1.0. */
    bf16_t q1[2] = {B(1.0f), B(0x1p-9f)}, K1[2] = {B(1), B(1)}, w1[1] = {B(1)};
    int32_t v1 = 1;
    OPS->index_scores(&be, S, 1, q1, 2, K1, NULL, NULL, w1, 1.0f, &v1, 1, 1, 2, 1);
    assert_true(S[0] == 1.0f);
    /* ... and rounded before the weight: d = 1 + 1.25·2^-8 -> 1.0078125, times w = 1.5 is the tie
     * 1.51171875 -> 1.515625; the unrounded d would give 1.5078125. */
    q1[1] = B(0x1.4p-8f);
    w1[0] = B(1.5f);
    OPS->index_scores(&be, S, 1, q1, 2, K1, NULL, NULL, w1, 1.0f, &v1, 1, 1, 2, 1);
    assert_true(S[0] == 1.515625f);
    /* The head sum is fp32, rounded once: 1 + 2^-8 + 2^-8 = 1.0078125 (head by head in bf16 each
     * add would be a tie back to 1.0). */
    bf16_t q3[3] = {B(1.0f), B(0x1p-8f), B(0x1p-8f)}, K3[1] = {B(1)}, w3[3] = {B(1), B(1), B(1)};
    OPS->index_scores(&be, S, 1, q3, 3, K3, NULL, NULL, w3, 1.0f, &v1, 1, 3, 1, 1);
    assert_true(S[0] == 1.0078125f);
}

/* ---------------------------------------------------------------------------------------------
 * MoE */

static void test_router(void **state) {
    bf16_t gw[4 * 2] = {0}, x[2] = {B(1), B(0)};
    struct qweight G = wq(WF_BF16, 4, 2, 2, 0, gw, NULL);
    float bias[4] = {0}, wts[3];
    int32_t idx[3];
    /* All logits 0: a four-way tie goes to the lowest ids; s/(s + s + 1e-20) = 0.5, times 1.5. */
    OPS->router(&be, idx, wts, x, 1, &G, bias, 2, 1.0f, true, 1.5f);
    assert_int_equal(idx[0], 0);
    assert_int_equal(idx[1], 1);
    assert_true(wts[0] == 0.75f && wts[1] == 0.75f);
    /* The bias picks (a tie between 2 and 3 -> 2 first) but does not enter the weights. */
    bias[2] = bias[3] = 0.1f;
    OPS->router(&be, idx, wts, x, 1, &G, bias, 2, 1.0f, false, 1.0f);
    assert_int_equal(idx[0], 2);
    assert_int_equal(idx[1], 3);
    float s0 = sqrtf(log1pf(expf(0.0f)));
    assert_true(wts[0] == s0 && wts[1] == s0);
    /* z = [0, 30, 0, 8]: order 1, 3, then the tie 0/2 -> 0; no normalization. */
    bias[2] = bias[3] = 0.0f;
    gw[2] = B(30.0f);
    gw[6] = B(8.0f);
    OPS->router(&be, idx, wts, x, 1, &G, bias, 3, 1.0f, false, 1.0f);
    assert_int_equal(idx[0], 1);
    assert_int_equal(idx[1], 3);
    assert_int_equal(idx[2], 0);
    assert_true(wts[0] == sqrtf(30.0f) && wts[1] == sqrtf(log1pf(expf(8.0f))) && wts[2] == s0);
    /* temp divides z; k = 1 is never normalized even with norm set. */
    OPS->router(&be, idx, wts, x, 1, &G, bias, 1, 2.0f, true, 1.5f);
    assert_int_equal(idx[0], 1);
    assert_true(wts[0] == sqrtf(log1pf(expf(15.0f))) * 1.5f);
}

/* The routed-expert sum as the model runs it on one rank: per-slot outputs, then the
 * ascending-expert-id fp32 combine plus sh (may be NULL) into out (one part covering every expert). */
static void moe_out(bf16_t *out, const bf16_t *x, const int32_t *idx, const float *wts, const bf16_t *sh, int64_t T,
                    int64_t k, int64_t e0, int64_t n, const struct qweight *w1, const struct qweight *w3,
                    const struct qweight *w2, float limit) {
    int64_t D = w2[0].n;
    bf16_t *y = calloc((size_t)(T * k * D), sizeof(bf16_t));
    OPS->moe_experts(&be, y, x, idx, wts, T, k, e0, n, w1, w3, w2, limit);
    /* slots of non-local experts below e0 + n were not written and read as +0, which adds nothing;
     * experts at or beyond e0 + n fall outside the one part and are skipped */
    OPS->moe_combine(&be, out, y, idx, sh, D, T, k, D, e0 + n, 1);
    free(y);
}

/* The combine's arithmetic: the slots in ascending expert id from +0 in fp32, then + sh in fp32,
 * then one bf16 rounding. Slot 0 holds expert 1 (2^-8), slot 1 expert 0 (1): the sum 1 + 2^-8 is a
 * bf16 tie (rounds to even 1) without sh, and 1 + 2^-7 (exact) with sh = 2^-8, which a rounding
 * of the sum before the add would turn into 1 as well. */
static void test_moe_combine_rounding(void **state) {
    int32_t idx[2] = {1, 0};
    bf16_t y[2] = {B(0x1p-8f), B(1.0f)}, sh[1] = {B(0x1p-8f)}, out[1];
    OPS->moe_combine(&be, out, y, idx, NULL, 1, 1, 2, 1, 4, 1);
    assert_true(F(out[0]) == 1.0f);
    OPS->moe_combine(&be, out, y, idx, sh, 1, 1, 2, 1, 4, 1);
    assert_true(F(out[0]) == 1.0078125f);
    /* the part rule: with one expert a part, expert 1 is part 1, skipped when P = 1: 1 + 2^-8, a tie */
    OPS->moe_combine(&be, out, y, idx, sh, 1, 1, 2, 1, 1, 1);
    assert_true(F(out[0]) == 1.0f);
}

/* The owner exchange (model.c): a TP rank combines only its block of D / P columns, from every
 * rank's slots of those columns, with sh read in place (ld_sh = D). Each block must equal those
 * columns of the whole combine, bit for bit, in every part layout (4 parts of 3 experts, k = 5,
 * slots of part 3 skipped when P = 3). */
static void test_moe_combine_columns(void **state) {
    enum { T = 7, K = 5, D = 24, NB = 4, DC = D / NB, PER = 3, PARTS = 4 };
    for (int P = PARTS - 1; P <= PARTS; P++) {
        bf16_t *y = malloc(sizeof(bf16_t) * PARTS * T * K * D), *sh = malloc(sizeof(bf16_t) * T * D);
        bf16_t *full = malloc(sizeof(bf16_t) * T * D), *yc = malloc(sizeof(bf16_t) * PARTS * T * K * DC);
        bf16_t *oc = malloc(sizeof(bf16_t) * T * DC);
        int32_t idx[T * K];
        fill_bf16(y, PARTS * T * K * D, 2.0f);
        fill_bf16(sh, T * D, 1.0f);
        for (int t = 0; t < T; t++) /* K distinct experts of PER * PARTS, in no particular order */
            for (int s = 0; s < K; s++) idx[t * K + s] = (int32_t)((t * 7 + s * 5) % (PER * PARTS));
        OPS->moe_combine(&be, full, y, idx, sh, D, T, K, D, PER, P);
        for (int b = 0; b < NB; b++) {
            for (int64_t r = 0; r < (int64_t)PARTS * T * K; r++) memcpy(yc + r * DC, y + r * D + b * DC, sizeof(bf16_t) * DC);
            OPS->moe_combine(&be, oc, yc, idx, sh + b * DC, D, T, K, DC, PER, P);
            for (int t = 0; t < T; t++)
                for (int d = 0; d < DC; d++) assert_int_equal(oc[t * DC + d], full[t * D + b * DC + d]);
        }
        free(y), free(sh), free(full), free(yc), free(oc);
    }
}

static void test_moe_expert_order(void **state) {
    /* Every expert: g = 32 (silu(32) = 32 in fp32), u = 1, routing weight 1, so h = 32.
     * Expert 0's w2 gives y = [32·2^19, 32] = [2^24, 32]; experts 1 and 2 give [1, 0].
     * Token 0 routes to [2, 1, 0] (top-k order). In ascending expert order the fp32 sum is
     * (2^24 + 1) + 1 = 2^24 (two ties to even); in slot order it would be 1 + 1 + 2^24 = 2^24 + 2.
     * sh = -2^24 in column 0 leaves 0 of the one and 2 of the other (bf16 would not tell 2^24 from
     * 2^24 + 2). Token 1 routes to [1, 9, 0] (9 is not local), plus sh = 0.5 in column 1. */
    bf16_t w1[2] = {B(32), B(0)}, w3[2] = {B(1), B(0)}, w2big[2] = {B(0x1p19f), B(1)}, w2s[2] = {B(0x1p-5f), B(0)};
    struct qweight W1[3], W3[3], W2[3];
    for (int e = 0; e < 3; e++) {
        W1[e] = wq(WF_BF16, 1, 2, 2, 0, w1, NULL);
        W3[e] = wq(WF_BF16, 1, 2, 2, 0, w3, NULL);
        W2[e] = wq(WF_BF16, 2, 1, 1, 0, e == 0 ? w2big : w2s, NULL);
    }
    bf16_t x[4] = {B(1), B(0), B(1), B(0)};
    int32_t idx[6] = {2, 1, 0, 1, 9, 0};
    float wts[6] = {1, 1, 1, 1, 1, 1};
    bf16_t sh[4] = {B(-0x1p24f), B(0), B(-0x1p24f), B(0.5f)}, out[4];
    moe_out(out, x, idx, wts, sh, 2, 3, 0, 3, W1, W3, W2, 0.0f);
    assert_true(F(out[0]) == 0.0f && F(out[1]) == 32.0f);
    assert_true(F(out[2]) == 0.0f && F(out[3]) == 32.5f);
    /* Local range [1, 3): token 0 gets experts 1 and 2 only (no shared expert). */
    moe_out(out, x, idx, wts, NULL, 2, 3, 1, 2, W1 + 1, W3 + 1, W2 + 1, 0.0f);
    assert_true(F(out[0]) == 2.0f && F(out[2]) == 1.0f);
}

/* One routed token through expert (w1, w3, w2) with the ops' own linears, by the formula. */
static void expert_one(float *acc, const bf16_t *x, float wt, const struct qweight *w1, const struct qweight *w3,
                       const struct qweight *w2, float limit) {
    int64_t I = w1->n;
    bf16_t g[64], u[64], h[64], y[64];
    OPS->linear(&be, g, x, 1, w1);
    OPS->linear(&be, u, x, 1, w3);
    for (int64_t i = 0; i < I; i++) {
        float gv = F(g[i]), uv = F(u[i]);
        if (limit > 0) {
            uv = fminf(fmaxf(uv, -limit), limit);
            gv = fminf(gv, limit);
        }
        h[i] = B(wt * ((gv / (1.0f + expf(-gv))) * uv));
    }
    OPS->linear(&be, y, h, 1, w2);
    for (int64_t d = 0; d < w2->n; d++) acc[d] += F(y[d]);
}

struct fp4_experts {
    uint8_t q1[3][32 * 32], q3[3][32 * 32], q2[3][64 * 16], s1[3][32 * 2], s3[3][32 * 2], s2[3][64];
    struct qweight W1[3], W3[3], W2[3];
};

static void make_fp4_experts(struct fp4_experts *ex) { /* D = 64, I = 32 */
    float wf[64 * 64];
    for (int e = 0; e < 3; e++) {
        fill_f32(wf, 32 * 64, 2.0f);
        quant_fp4_rows(wf, 32, 64, ex->q1[e], ex->s1[e]);
        fill_f32(wf, 32 * 64, 2.0f);
        quant_fp4_rows(wf, 32, 64, ex->q3[e], ex->s3[e]);
        fill_f32(wf, 64 * 32, 2.0f);
        quant_fp4_rows(wf, 64, 32, ex->q2[e], ex->s2[e]);
        ex->W1[e] = wq(WF_FP4, 32, 64, 32, 2, ex->q1[e], ex->s1[e]);
        ex->W3[e] = wq(WF_FP4, 32, 64, 32, 2, ex->q3[e], ex->s3[e]);
        ex->W2[e] = wq(WF_FP4, 64, 32, 16, 1, ex->q2[e], ex->s2[e]);
    }
}

static void test_moe_fp4_gather(void **state) {
    enum { T = 5, K = 2, D = 64 };
    static struct fp4_experts ex;
    make_fp4_experts(&ex);
    bf16_t x[T * D];
    fill_bf16(x, T * D, 5.0f);
    int32_t idx[T * K] = {4, 6, 3, 5, 6, 4, 7, 5, 4, 5}; /* local experts 4..6; 3 and 7 are not */
    float wts[T * K], ea[T * D] = {0};
    bf16_t out[T * D], eb[T * D];
    for (int i = 0; i < T * K; i++) wts[i] = 0.2f + (urand() + 1.0f);
    moe_out(out, x, idx, wts, NULL, T, K, 4, 3, ex.W1, ex.W3, ex.W2, 10.0f);
    for (int e = 4; e < 7; e++)
        for (int t = 0; t < T; t++)
            for (int s = 0; s < K; s++)
                if (idx[t * K + s] == e)
                    expert_one(ea + t * D, x + t * D, wts[t * K + s], &ex.W1[e - 4], &ex.W3[e - 4], &ex.W2[e - 4],
                               10.0f);
    for (int i = 0; i < T * D; i++) eb[i] = B(ea[i]);
    assert_memory_equal(out, eb, sizeof out);
}

static void test_shared_expert_limit(void **state) {
    /* Two hidden units, w2 = identity: unit 0 has g = 32 (clamped to 10 from above) and u = 20
     * (clamped to 10); unit 1 has g = -30, which has no lower clamp. */
    bf16_t w1[4] = {B(32), B(0), B(-30), B(0)}, w3[4] = {B(20), B(0), B(1), B(0)},
           w2[4] = {B(1), B(0), B(0), B(1)};
    struct qweight W1 = wq(WF_BF16, 2, 2, 2, 0, w1, NULL), W3 = wq(WF_BF16, 2, 2, 2, 0, w3, NULL),
                   W2 = wq(WF_BF16, 2, 2, 2, 0, w2, NULL);
    bf16_t x[2] = {B(1), B(0)}, y[2];
    OPS->shared_expert(&be, y, x, 1, &W1, &W3, &W2, 10.0f);
    assert_int_equal(y[0], B((10.0f / (1.0f + expf(-10.0f))) * 10.0f));
    assert_int_equal(y[1], B(-30.0f / (1.0f + expf(30.0f))));
    assert_true(F(y[1]) < 0.0f && F(y[1]) > -1e-10f);
    OPS->shared_expert(&be, y, x, 1, &W1, &W3, &W2, 0.0f); /* limit 0: no clamp */
    assert_true(F(y[0]) == 640.0f);
}

/* ---------------------------------------------------------------------------------------------
 * Thread count */

static void test_thread_count_independent(void **state) {
    enum { T = 70, N = 100, K = 256, H = 4, HD = 32, NI = 150, NKV = 40, NK = 40 };
    float *wf = malloc((size_t)N * K * sizeof(float));
    uint8_t *q8 = malloc((size_t)N * K), s8[4 * 8];
    fill_f32(wf, N * K, 2.0f);
    quant_fp8_tiles(wf, N, K, q8, s8);
    struct qweight W8 = wq(WF_FP8, N, K, K, 8, q8, s8);
    static bf16_t x[T * K], y[2][T * N], qa[3 * H * HD], kv[NKV * HD], oa[2][3 * H * HD];
    static struct fp4_experts ex;
    make_fp4_experts(&ex);
    fill_bf16(x, T * K, 4.0f);
    fill_bf16(qa, 3 * H * HD, 1.0f);
    fill_bf16(kv, NKV * HD, 1.0f);
    int32_t idx[3 * NI], ridx[T * 2];
    for (int i = 0; i < 3 * NI; i++) idx[i] = urand() < -0.5f ? -1 : (int32_t)((urand() + 1.0f) * 0.5f * NKV);
    float sink[H] = {0, 1, -1, 2}, S[2][3 * NK], wts[T * 2];
    static bf16_t mo[2][T * 64], shx[T * 64];
    fill_bf16(shx, T * 64, 1.0f);
    bf16_t wraw[3 * H];
    fill_bf16(wraw, 3 * H, 1.0f);
    int32_t vis[3] = {NK, 20, 1};
    for (int t = 0; t < T; t++) {
        ridx[2 * t] = t % 3;
        ridx[2 * t + 1] = (t + 1) % 3;
        wts[2 * t] = wts[2 * t + 1] = 0.5f;
    }
    for (int r = 0; r < 2; r++) {
        omp_set_num_threads(r + 1);
        OPS->linear(&be, y[r], x, T, &W8);
        OPS->sparse_attn(&be, oa[r], qa, kv, idx, 3, H, HD, NI, sink, 0.2f);
        OPS->index_scores(&be, S[r], NK, qa, H * HD, kv, NULL, NULL, wraw, 0.5f, vis, 3, H, HD, NK);
        moe_out(mo[r], x, ridx, wts, shx, T, 2, 0, 3, ex.W1, ex.W3, ex.W2, 10.0f);
    }
    omp_set_num_threads(2);
    assert_memory_equal(y[0], y[1], sizeof y[0]);
    assert_memory_equal(oa[0], oa[1], sizeof oa[0]);
    assert_memory_equal(S[0], S[1], sizeof S[0]);
    assert_memory_equal(mo[0], mo[1], sizeof mo[0]);
    free(q8);
    free(wf);
}

int main(void) {
    backend_cpu_init(&be);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_memory_ops),
        cmocka_unit_test(test_weight_prepare),
        cmocka_unit_test(test_linear_fp8_hand),
        cmocka_unit_test(test_linear_fp8_slice_vs_port),
        cmocka_unit_test(test_linear_fp4_nibbles),
        cmocka_unit_test(test_linear_bf16_and_f32),
        cmocka_unit_test(test_linear_dense_vs_port),
        cmocka_unit_test(test_grouped_linear),
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_rmsnorm_post),
        cmocka_unit_test(test_rope),
        cmocka_unit_test(test_qdq),
        cmocka_unit_test(test_hc_mixes_one_iter_hand),
        cmocka_unit_test(test_hc_mixes_sinkhorn),
        cmocka_unit_test(test_hc_collapse_expand_init),
        cmocka_unit_test(test_embed),
        cmocka_unit_test(test_engram_gather),
        cmocka_unit_test(test_engram_gate),
        cmocka_unit_test(test_sparse_attn_single_and_empty),
        cmocka_unit_test(test_sparse_attn_vs_double),
        cmocka_unit_test(test_sparse_attn_block_boundary),
        cmocka_unit_test(test_compress_pool),
        cmocka_unit_test(test_index_scores),
        cmocka_unit_test(test_router),
        cmocka_unit_test(test_moe_expert_order),
        cmocka_unit_test(test_moe_combine_rounding),
        cmocka_unit_test(test_moe_combine_columns),
        cmocka_unit_test(test_moe_fp4_gather),
        cmocka_unit_test(test_shared_expert_limit),
        cmocka_unit_test(test_thread_count_independent),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    backend_cpu_free(&be);
    return rc;
}
