/* The host weights the CUDA op tests share (test_cuda_ops.c, test_cuda_moe.c): weights shaped and
 * quantized like the checkpoint's (FP4 experts with e8m0 block scales; FP8 and BF16 come from
 * cuda_ops_common.h), each row as its exact fp32 values, the reference's act_quant dequantized, and
 * the exact double sums of a linear (S = Σ x·ŵ and A = Σ |x·ŵ|, which the tolerance models of
 * cuda_ops_common.h turn into intervals). cuda_weights_tables_init() fills the lookup tables. */
#ifndef DS_TESTS_CUDA_WEIGHTS_REF_H
#define DS_TESTS_CUDA_WEIGHTS_REF_H
#include "cuda_ops_common.h"

static float lut_e4m3[256], lut_e2m1[16];
static uint8_t fp4_mag_table[128]; /* 7 random bits -> e2m1 magnitude code, gaussian-shaped */

static inline void cuda_weights_tables_init(void) {
    for (int b = 0; b < 256; b++) lut_e4m3[b] = e4m3_to_f32((uint8_t)b);
    for (int c = 0; c < 16; c++) lut_e2m1[c] = e2m1_to_f32((uint8_t)c);
    /* |N(0, 1.6)| quantized to the e2m1 grid (bounds 0.25 0.75 1.25 1.75 2.5 3.5 5): the codes of a
     * block-scaled gaussian weight */
    const double edge[8] = {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, INFINITY};
    int pos = 0;
    for (int c = 0; c < 8; c++) {
        double p = erf(edge[c] / (1.6 * sqrt(2.0)));
        int upto = c == 7 ? 128 : (int)lround(p * 128.0);
        for (; pos < upto && pos < 128; pos++) fp4_mag_table[pos] = (uint8_t)c;
    }
}

/* FP4 experts [n, k] (packed [n, k/2], low nibble = even k) with e8m0 row scales 2^-10..2^-6. */
static inline struct hw hw_fp4(int64_t n, int64_t k) {
    struct hw h;
    int64_t ld = k / 2, s_ld = k / 32;
    uint8_t *d = NEW(uint8_t, n * ld), *s = NEW(uint8_t, n * s_ld);
    for (int64_t i = 0; i < n * ld; i += 4) {
        uint64_t r = rnd64();
        for (int b = 0; b < 4 && i + b < n * ld; b++) {
            uint32_t bits = (uint32_t)(r >> (16 * b));
            uint8_t lo = (uint8_t)(fp4_mag_table[bits & 127] | ((bits >> 7) & 1u) << 3);
            uint8_t hi = (uint8_t)(fp4_mag_table[(bits >> 8) & 127] | ((bits >> 15) & 1u) << 3);
            d[i + b] = (uint8_t)(lo | hi << 4);
        }
    }
    for (int64_t i = 0; i < n * s_ld; i++) s[i] = (uint8_t)(117 + rnd64() % 5);
    h.data = d;
    h.scale = s;
    h.q = qw(WF_FP4, n, k, ld, s_ld, d, s);
    return h;
}

/* Row j of a host weight as exact fp32 values (code · scale). */
static inline void w_row(const struct qweight *W, int64_t j, float *out) {
    int64_t k = W->k;
    switch (W->fmt) {
    case WF_BF16: {
        const bf16_t *r = (const bf16_t *)W->w + j * W->ld;
        for (int64_t i = 0; i < k; i++) out[i] = bf16_to_f32(r[i]);
    } break;
    case WF_F32: memcpy(out, (const float *)W->w + j * W->ld, (size_t)k * sizeof(float)); break;
    case WF_FP8: {
        const uint8_t *r = (const uint8_t *)W->w + j * W->ld, *s = W->s + (j / 32) * W->s_ld;
        for (int64_t b = 0; b < k / 32; b++) {
            float sc = e8m0_to_f32(s[b]);
            for (int64_t i = b * 32; i < b * 32 + 32; i++) out[i] = lut_e4m3[r[i]] * sc;
        }
    } break;
    case WF_FP4: {
        const uint8_t *r = (const uint8_t *)W->w + j * W->ld, *s = W->s + j * W->s_ld;
        for (int64_t b = 0; b < k / 32; b++) {
            float sc = e8m0_to_f32(s[b]);
            for (int64_t i = b * 32; i < b * 32 + 32; i++)
                out[i] = lut_e2m1[(i & 1) ? r[i / 2] >> 4 : r[i / 2] & 15] * sc;
        }
    } break;
    }
}

/* x̂: the reference's act_quant(x, 32) dequantized (e4m3 code · power-of-two scale, exact). */
static inline void act_deq(const bf16_t *x, int64_t n, float *out) {
    uint8_t *q = NEW(uint8_t, n);
    float *s = NEW(float, n / 32 + 1);
    act_quant_fp8_32(x, (size_t)n, q, s);
    for (int64_t i = 0; i < n; i++) out[i] = lut_e4m3[q[i]] * s[i / 32];
    free(s);
    free(q);
}

/* Exact sums in double: S[t,j] = Σ_i x[t,i]·ŵ[j,i], A[t,j] = Σ_i |x[t,i]·ŵ[j,i]| (x rows of stride
 * ldx, outputs of row stride n). */
static inline void ref_dot(const struct qweight *W, const float *x, int64_t ldx, int64_t T, double *S, double *A) {
    int64_t n = W->n, k = W->k;
#pragma omp parallel
    {
        float *row = NEW(float, k);
#pragma omp for schedule(dynamic, 8)
        for (int64_t j = 0; j < n; j++) {
            w_row(W, j, row);
            for (int64_t t = 0; t < T; t++) {
                const float *xt = x + t * ldx;
                double s = 0, a = 0;
                for (int64_t i = 0; i < k; i++) {
                    double p = (double)xt[i] * (double)row[i];
                    s += p;
                    a += fabs(p);
                }
                S[t * n + j] = s;
                A[t * n + j] = a;
            }
        }
        free(row);
    }
}

#endif
