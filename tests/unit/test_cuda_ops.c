/* The CUDA backend against the CPU reference backend: memory ops (alloc/upload/copy/download),
 * weight_prepare (FP8, FP4, BF16, F32, dequant_bf16) and tensor_prepare, the dense family (linear on
 * FP8, FP4 and BF16 weights, linear_f32, grouped_linear, head), the MoE ops (router, moe_experts,
 * moe_combine, shared_expert), the tensor-core linears' pair call (two weights in one launch, bit
 * for bit the two calls), and batch invariance of linear, head and moe_experts. The elementwise,
 * mHC, Engram and attention ops are in test_cuda_ops_misc.c; the harness, the rounding model and
 * how each kind of op is compared are in cuda_ops_common.h. */
#include "cuda_ops_common.h"
#ifdef DS_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/fp4_layout.h"
#include "cuda/cuda_router.h"
#include "cuda/linear_mma.h"
#endif

/* ---------------------------------------------------------------------------------------------
 * Host weights, shaped and quantized like the checkpoint's */

static float lut_e4m3[256], lut_e2m1[16];
static uint8_t fp4_mag_table[128]; /* 7 random bits -> e2m1 magnitude code, gaussian-shaped */

static void build_tables(void) {
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
static struct hw hw_fp4(int64_t n, int64_t k) {
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
static void w_row(const struct qweight *W, int64_t j, float *out) {
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
static void act_deq(const bf16_t *x, int64_t n, float *out) {
    uint8_t *q = NEW(uint8_t, n);
    float *s = NEW(float, n / 32 + 1);
    act_quant_fp8_32(x, (size_t)n, q, s);
    for (int64_t i = 0; i < n; i++) out[i] = lut_e4m3[q[i]] * s[i / 32];
    free(s);
    free(q);
}

/* Exact sums in double: S[t,j] = Σ_i x[t,i]·ŵ[j,i], A[t,j] = Σ_i |x[t,i]·ŵ[j,i]| (x rows of stride
 * ldx, outputs of row stride n). */
static void ref_dot(const struct qweight *W, const float *x, int64_t ldx, int64_t T, double *S, double *A) {
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

/* ---------------------------------------------------------------------------------------------
 * Models of the fused ops: what either backend may produce, given backend.h's rounding points and
 * the freedoms of tolerances.h */

/* act_quant (block 32, e4m3, power-of-two scale) of values known only to lie in [lo_i, hi_i] (bf16
 * values): the dequantized x̂_i lies in [qlo_i, qhi_i] for every scale the block's amax interval
 * allows (e4m3 RNE is monotone for a fixed scale). */
static void act_quant_iv(const float *lo, const float *hi, int64_t n, float *qlo, float *qhi) {
    const float max_inv = (float)(1.0 / 448.0);
    for (int64_t g = 0; g < n / 32; g++) {
        float amin = 0.0f, amax = 0.0f;
        for (int64_t i = g * 32; i < g * 32 + 32; i++) {
            float a_lo = (lo[i] <= 0.0f && hi[i] >= 0.0f) ? 0.0f : fminf(fabsf(lo[i]), fabsf(hi[i]));
            float a_hi = fmaxf(fabsf(lo[i]), fabsf(hi[i]));
            amin = fmaxf(amin, a_lo);
            amax = fmaxf(amax, a_hi);
        }
        amin = fmaxf(amin, 1e-4f);
        amax = fmaxf(amax, 1e-4f);
        float s0 = ds_round_scale_pow2(amin, max_inv), s1 = ds_round_scale_pow2(amax, max_inv);
        for (int64_t i = g * 32; i < g * 32 + 32; i++) {
            float ql = INFINITY, qh = -INFINITY;
            for (float s = s0; s <= s1; s *= 2.0f) {
                float a = lo[i] / s, b = hi[i] / s;
                a = a < -448.0f ? -448.0f : (a > 448.0f ? 448.0f : a);
                b = b < -448.0f ? -448.0f : (b > 448.0f ? 448.0f : b);
                float va = lut_e4m3[e4m3_from_f32(a)] * s, vb = lut_e4m3[e4m3_from_f32(b)] * s;
                ql = fminf(ql, va);
                qh = fmaxf(qh, vb);
            }
            qlo[i] = ql;
            qhi[i] = qh;
        }
    }
}

/* silu(g) = g / (1 + e^-g) over [a, b] (exact range: the function dips to its minimum at -1.2785) */
static double silu_d(double g) { return g / (1.0 + exp(-g)); }
static iv_t silu_iv(iv_t g) {
    const double xm = -1.2784645427610738;
    if (g.hi <= xm) return iv(silu_d(g.hi), silu_d(g.lo));
    if (g.lo >= xm) return iv(silu_d(g.lo), silu_d(g.hi));
    return iv(silu_d(xm), fmax(silu_d(g.lo), silu_d(g.hi)));
}

/* One token through one expert (moe_experts / shared_expert): the interval of each y channel. */
static void expert_model(const bf16_t *x, const struct qweight *w1, const struct qweight *w3, const struct qweight *w2,
                         bool has_wt, float wt, float limit, double *ylo, double *yhi) {
    int64_t D = w1->k, I = w1->n, Dout = w2->n;
    float *xq = NEW(float, D), *hlo = NEW(float, I), *hhi = NEW(float, I), *qlo = NEW(float, I), *qhi = NEW(float, I);
    act_deq(x, D, xq);
#pragma omp parallel
    {
        float *r1 = NEW(float, D), *r3 = NEW(float, D);
#pragma omp for schedule(static)
        for (int64_t j = 0; j < I; j++) {
            w_row(w1, j, r1);
            w_row(w3, j, r3);
            double sg = 0, ag = 0, su = 0, au = 0;
            for (int64_t i = 0; i < D; i++) {
                double p = (double)xq[i] * r1[i], q = (double)xq[i] * r3[i];
                sg += p;
                ag += fabs(p);
                su += q;
                au += fabs(q);
            }
            iv_t g = iv_bf16(iv_sum(sg, sg, (double)D, ag)), u = iv_bf16(iv_sum(su, su, (double)D, au));
            if (limit > 0.0f) {
                u.lo = fmin(fmax(u.lo, -limit), limit);
                u.hi = fmin(fmax(u.hi, -limit), limit);
                g.lo = fmin(g.lo, limit);
                g.hi = fmin(g.hi, limit);
            }
            iv_t s = iv_widen_rel(silu_iv(g), (2.0 * TOL_GPU_LIBM_ULP + 2.0) * U);
            iv_t h = iv_round(iv_mul(s, u));
            if (has_wt) h = iv_round(iv_mul(h, iv_pt(wt)));
            h = iv_bf16(h);
            hlo[j] = (float)h.lo;
            hhi[j] = (float)h.hi;
        }
        free(r1);
        free(r3);
    }
    act_quant_iv(hlo, hhi, I, qlo, qhi);
#pragma omp parallel
    {
        float *r2 = NEW(float, I);
#pragma omp for schedule(static)
        for (int64_t d = 0; d < Dout; d++) {
            w_row(w2, d, r2);
            double lo = 0, hi = 0, A = 0;
            for (int64_t j = 0; j < I; j++) {
                double a = (double)qlo[j] * r2[j], b = (double)qhi[j] * r2[j];
                lo += fmin(a, b);
                hi += fmax(a, b);
                A += fmax(fabs(a), fabs(b));
            }
            iv_t y = iv_bf16(iv_sum(lo, hi, (double)I, A));
            ylo[d] = y.lo;
            yhi[d] = y.hi;
        }
        free(r2);
    }
    free(xq);
    free(hlo);
    free(hhi);
    free(qlo);
    free(qhi);
}

/* Router scores s = sqrt(softplus(z / temp)) and v = s + bias, from the exact z (S, A over D). */
static void router_model(const double *S, const double *A, const float *bias, int64_t E, int64_t D, float temp,
                         iv_t *s_iv, iv_t *v_iv) {
    for (int64_t e = 0; e < E; e++) {
        iv_t z = iv_sum(S[e], S[e], (double)D, A[e]);
        iv_t zt = iv_round(iv(z.lo / temp, z.hi / temp));
        double sp_lo = zt.lo > 20.0 ? zt.lo : log1p(exp(zt.lo)), sp_hi = zt.hi > 20.0 ? zt.hi : log1p(exp(zt.hi));
        iv_t sp = iv_widen_rel(iv(sp_lo, sp_hi), 2.0 * TOL_GPU_LIBM_ULP * U);        /* log1pf */
        sp = iv_widen(sp, EXP_REL * sig(zt.hi) + (zt.hi > 19.0 ? 3e-9 : 0.0)); /* expf; the z > 20 switch */
        sp.lo = fmax(sp.lo, 0.0);
        s_iv[e] = iv_round(iv(sqrt(sp.lo), sqrt(sp.hi)));
        v_iv[e] = bias ? iv_round(iv_add(s_iv[e], iv_pt(bias[e]))) : s_iv[e];
    }
}

/* A selection is consistent with the score intervals when no expert ranked above another (or chosen
 * over an unchosen one) is certainly below it. Returns 0 or writes why. */
static int router_consistent(const int32_t *idx, int64_t k, int64_t E, const iv_t *v, char *why, size_t wn) {
    for (int64_t a = 0; a < k; a++) {
        if (idx[a] < 0 || idx[a] >= E) {
            snprintf(why, wn, "slot %lld holds expert %d, outside [0, %lld)", (long long)a, idx[a], (long long)E);
            return -1;
        }
        for (int64_t b = 0; b < a; b++)
            if (idx[b] == idx[a]) {
                snprintf(why, wn, "expert %d chosen twice", idx[a]);
                return -1;
            }
    }
    for (int64_t a = 0; a < k; a++)
        for (int64_t b = a + 1; b < k; b++)
            if (v[idx[a]].hi < v[idx[b]].lo) {
                snprintf(why, wn, "slot %lld (expert %d, score <= %.9g) ranked above slot %lld (expert %d, >= %.9g)",
                         (long long)a, idx[a], v[idx[a]].hi, (long long)b, idx[b], v[idx[b]].lo);
                return -1;
            }
    unsigned char *chosen = calloc((size_t)E, 1);
    assert_non_null(chosen);
    for (int64_t a = 0; a < k; a++) chosen[idx[a]] = 1;
    int rc = 0;
    for (int64_t a = 0; a < k && !rc; a++)
        for (int64_t f = 0; f < E; f++)
            if (!chosen[f] && v[idx[a]].hi < v[f].lo) {
                snprintf(why, wn, "expert %lld (score >= %.9g) left out for expert %d (score <= %.9g)", (long long)f,
                         v[f].lo, idx[a], v[idx[a]].hi);
                rc = -1;
                break;
            }
    free(chosen);
    return rc;
}

/* The routing weights for a given selection. */
static void router_weights(const int32_t *idx, int64_t k, const iv_t *s_iv, bool norm, float route_scale, iv_t *w) {
    iv_t sum = iv_pt(0.0);
    for (int64_t a = 0; a < k; a++) {
        w[a] = s_iv[idx[a]];
        sum = iv_add(sum, w[a]);
    }
    if (norm && k > 1) {
        iv_t den = iv_round(iv_add(iv_sum(sum.lo, sum.hi, (double)k, sum.hi), iv_pt(1e-20)));
        for (int64_t a = 0; a < k; a++) w[a] = iv_div_round(w[a], den);
    }
    for (int64_t a = 0; a < k; a++) w[a] = iv_round(iv_mul(w[a], iv_pt(route_scale)));
}

/* =============================================================================================
 * Memory, weights, tensors */

static void test_memory_ops(void **st) {
    NEED_GPU(st);
    const size_t sizes[] = {1, 33, 4096, (1u << 20) + 37};
    struct cmp c;
    seed_tag("memory");
    cmp_begin(&c, "memory", "alloc (zeroed)/upload/copy/download/sync/free");
    for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++) {
        size_t n = sizes[si];
        uint8_t *a = g_alloc(n), *b = g_alloc(n), *h = NEW(uint8_t, n), *back = NEW(uint8_t, n);
        g_get(back, a, n);
        for (size_t i = 0; i < n; i++) cmp_bits(&c, (long long)i, back[i], 0, back[i], 0);
        for (size_t i = 0; i < n; i++) h[i] = (uint8_t)rnd64();
        GPU->upload(&gpu_be, a, h, n);
        GPU->copy(&gpu_be, b, a, n);
        GPU->sync(&gpu_be);
        GPU->download(&gpu_be, back, b, n);
        GPU->sync(&gpu_be);
        for (size_t i = 0; i < n; i++) cmp_bits(&c, (long long)i, back[i], h[i], back[i], h[i]);
        /* a copy into the middle of a buffer, from an offset of another */
        size_t half = n / 2;
        GPU->copy(&gpu_be, b + half, a + (n - half) / 2, half);
        GPU->download(&gpu_be, back, b, n);
        GPU->sync(&gpu_be);
        for (size_t i = 0; i < half; i++) cmp_bits(&c, (long long)i, back[half + i], h[(n - half) / 2 + i], 0, 0);
        g_free(a);
        g_free(b);
        free(h);
        free(back);
    }
    cmp_end(&c);
}

static size_t w_esz(enum wfmt f) { return f == WF_BF16 ? 2 : f == WF_F32 ? 4 : 1; }
static size_t w_row_bytes(const struct qweight *w) {
    return w->fmt == WF_FP4 ? (size_t)(w->k / 2) : (size_t)w->k * w_esz(w->fmt);
}

/* The prepared (device) weight holds the same values as the host description, whatever its layout:
 * read it back row by row through its own ld / s_ld (FP4 words from the device layout back into
 * the checkpoint's, fp4_layout.h). */
static void cmp_prepared(struct cmp *c, const struct qweight *h, const struct qweight *g) {
    if (g->fmt != h->fmt || g->n != h->n || g->k != h->k) {
        cmp_fail(c, "prepared weight describes fmt %d [%lld, %lld], host fmt %d [%lld, %lld]", (int)g->fmt,
                 (long long)g->n, (long long)g->k, (int)h->fmt, (long long)h->n, (long long)h->k);
        return;
    }
    size_t rb = w_row_bytes(h), esz = w_esz(h->fmt);
    uint8_t *row = NEW(uint8_t, rb);
    for (int64_t j = 0; j < h->n; j++) {
        g_get(row, (const uint8_t *)g->w + (size_t)(j * g->ld) * esz, rb);
        if (h->fmt == WF_FP4)
            for (size_t i = 0; i + 4 <= rb; i += 4) {
                uint32_t u;
                memcpy(&u, row + i, 4);
                u = fp4_unpack_word(u);
                memcpy(row + i, &u, 4);
            }
        const uint8_t *hr = (const uint8_t *)h->w + (size_t)(j * h->ld) * esz;
        for (size_t i = 0; i < rb; i++) cmp_bits(c, (long long)(j * (int64_t)rb + (int64_t)i), row[i], hr[i], row[i], hr[i]);
    }
    free(row);
    if (h->fmt == WF_FP8 || h->fmt == WF_FP4) {
        int64_t srows = h->fmt == WF_FP8 ? (h->n + 31) / 32 : h->n, sb = (h->k + 31) / 32;
        uint8_t *s = NEW(uint8_t, sb);
        for (int64_t r = 0; r < srows; r++) {
            g_get(s, g->s + r * g->s_ld, (size_t)sb);
            for (int64_t i = 0; i < sb; i++) cmp_bits(c, (long long)(r * sb + i), s[i], h->s[r * h->s_ld + i], 0, 0);
        }
        free(s);
    }
}

static void test_weight_prepare(void **st) {
    NEED_GPU(st);
    seed_tag("weight_prepare");
    struct hw hs[6] = {hw_fp8(129, 1088, 0, 1088, 0.02f), hw_fp8(100, 2048, 1024, 1024, 0.02f), hw_fp4(37, 160),
                       hw_bf16(33, 100, 0.02f), hw_f32(1, 37, 0.5f), hw_fp8(O_LORA, O_GROUP_IN, 0, O_GROUP_IN, 0.02f)};
    const char *names[6] = {"FP8 [129,1088]", "FP8 TP slice [100,1024] of 2048", "FP4 [37,160]", "BF16 [33,100]",
                            "F32 [1,37]", "FP8 wo_a [1024,4096]"};
    for (int i = 0; i < 6; i++) {
        struct cmp c;
        cmp_begin(&c, "weight_prepare", "%s", names[i]);
        struct qweight g = g_weight(&hs[i].q, false);
        cmp_prepared(&c, &hs[i].q, &g);
        GPU->weight_release(&gpu_be, &g);
        cmp_end(&c);
    }
    /* dequant_bf16 (wo_a): the GPU's bf16 copy equals the CPU backend's */
    for (int i = 0; i < 6; i += 5) {
        struct cmp c;
        cmp_begin(&c, "weight_prepare", "%s dequant_bf16", names[i]);
        struct qweight hc = hs[i].q, g = g_weight(&hs[i].q, true);
        assert_int_equal(CPU->weight_prepare(&cpu_be, &hc, true), 0);
        if (g.fmt != WF_BF16) cmp_fail(&c, "fmt %d after dequant_bf16, not WF_BF16", (int)g.fmt);
        else cmp_prepared(&c, &hc, &g);
        GPU->weight_release(&gpu_be, &g);
        CPU->weight_release(&cpu_be, &hc);
        cmp_end(&c);
    }
    for (int i = 0; i < 6; i++) hw_free(&hs[i]);
}

static void test_tensor_prepare(void **st) {
    NEED_GPU(st);
    seed_tag("tensor_prepare");
    struct cmp c;
    cmp_begin(&c, "tensor_prepare", "device copy, 1000 fp32");
    float *h = NEW(float, 1000), *back = NEW(float, 1000);
    fill_f32(h, 1000, 0.0f, 3.0f);
    const void *p = g_tensor(h, 1000 * sizeof(float), false);
    g_get(back, p, 1000 * sizeof(float));
    cmp_f32_exact(&c, back, h, 1000);
    GPU->tensor_release(&gpu_be, p);
    cmp_end(&c);
    /* host-resident: read by an op (embed) */
    cmp_begin(&c, "tensor_prepare", "host-resident table read by embed");
    int64_t nrows = 37, D = 96, T = 17, row0 = 1000;
    bf16_t *tab = NEW(bf16_t, nrows * D), *ec = NEW(bf16_t, T * D), *eg = NEW(bf16_t, T * D);
    fill_gauss_bf16(tab, nrows * D, 1.0f);
    int32_t ids[17];
    for (int64_t t = 0; t < T; t++) ids[t] = (int32_t)(t % 3 ? row0 + irand(nrows) : irand(3000));
    const void *pt = g_tensor(tab, (size_t)(nrows * D) * sizeof(bf16_t), true);
    int32_t *dids = g_in(ids, sizeof ids);
    bf16_t *de = g_out((size_t)(T * D) * sizeof(bf16_t), PZ_16);
    GPU->embed(&gpu_be, de, dids, T, pt, row0, nrows, D);
    g_get(eg, de, (size_t)(T * D) * sizeof(bf16_t));
    CPU->embed(&cpu_be, ec, ids, T, tab, row0, nrows, D);
    cmp_bf16_exact(&c, eg, ec, T * D);
    g_free(dids);
    g_free(de);
    GPU->tensor_release(&gpu_be, pt);
    cmp_end(&c);
    /* buffers in the pages of a host-resident tensor stay ordinary copy targets and sources: the
     * bytes right before and after it, in the same pages, are downloaded into and uploaded from
     * while it is registered (a partly registered copy range is refused by the driver) */
    cmp_begin(&c, "tensor_prepare", "copies into the pages of a host-resident tensor");
    {
        size_t pg = 4096, off = 1000, tb = 2 * pg + 123, nb = 1500;
        uint8_t *area = (uint8_t *)aligned_alloc(pg, 4 * pg), *src = NEW(uint8_t, nb), *want = NEW(uint8_t, nb);
        assert_non_null(area);
        for (size_t i = 0; i < 4 * pg; i++) area[i] = (uint8_t)(i * 7 + 1);
        for (size_t i = 0; i < nb; i++) src[i] = (uint8_t)(i * 13 + 5);
        const void *pr = g_tensor(area + off, tb, true);
        uint8_t *dsrc = g_in(src, nb);
        g_get(area + off + tb, dsrc, nb);        /* after it, same page */
        g_get(area + off - 900, dsrc, 900);      /* before it, same page */
        uint8_t *dback = g_out(nb, PZ_16);
        GPU->upload(&gpu_be, dback, area + off + tb, nb);
        g_get(want, dback, nb);
        for (size_t i = 0; i < nb; i++) {
            cmp_bits(&c, (long long)i, area[off + tb + i], src[i], area[off + tb + i], src[i]);
            cmp_bits(&c, (long long)i, want[i], src[i], want[i], src[i]);
            if (i < 900) cmp_bits(&c, (long long)i, area[off - 900 + i], src[i], area[off - 900 + i], src[i]);
        }
        g_free(dsrc);
        g_free(dback);
        GPU->tensor_release(&gpu_be, pr);
        free(area);
        free(src);
        free(want);
    }
    cmp_end(&c);
    free(h);
    free(back);
    free(tab);
    free(ec);
    free(eg);
}

/* =============================================================================================
 * Dense: linear (FP8/FP4/BF16), linear_f32, head */

enum dense_op { OP_LINEAR, OP_LINEAR_F32, OP_HEAD };
static const char *dense_name[] = {"linear", "linear_f32", "head"};

static void dense_run(struct backend *be, enum dense_op op, void *y, const bf16_t *x, int64_t T, const struct qweight *W) {
    if (op == OP_LINEAR) be->ops->linear(be, y, x, T, W);
    else if (op == OP_LINEAR_F32) be->ops->linear_f32(be, y, x, T, W);
    else be->ops->head(be, y, x, T, W);
}

/* One bf16 output of a linear-type op over k terms with exact sum S and Σ|terms| A: the GPU within
 * TOL_GPU_LINEAR_RTOL_SUM·k·A and TOL_GPU_LINEAR_OUT_ULPS of the CPU; the CPU within its own sum
 * bound (and the double evaluation's error) plus one bf16 rounding of S. */
static void cmp_linear_bf16(struct cmp *c, long long i, double G, double C, double S, double A, int64_t k) {
    cmp_tol(c, i, G, C, TOL_GPU_LINEAR_RTOL_SUM * (double)k * A + TOL_GPU_LINEAR_OUT_ULPS * ulp_bf16(fmax(fabs(G), fabs(C))));
    double r = TOL_CPU_SUM_U_PER_TERM * (double)k * U * A + (double)(k + 2) * 0x1p-53 * A;
    cmp_self(c, i, C, S, r + ulp_bf16(fmax(fabs(C), fabs(S) + r)));
}

/* the dense BF16 sums under the tensor-core switch (dense_mma of cuda_linear_ops.cu): fp32 outputs
 * of linear_f32 and head within TOL_GPU_DENSE_MMA_U_PER_TERM of the CPU instead of its bits where
 * the tiles take the shape (test_dense_mma sets it around its cases); the shapes they cannot take
 * (F32 weights, k % 32) keep the exact kernels and so the CPU's bits */
static bool g_dense_mma;

static bool dense_mma_shape(const struct qweight *W) {
    return W->fmt == WF_BF16 && W->k % 32 == 0 && (W->ld * 2) % 16 == 0;
}

static void check_dense(enum dense_op op, const char *name, const struct qweight *Wh, const struct qweight *Wg, int64_t T,
                        float xrms) {
    int64_t n = Wh->n, k = Wh->k;
    char tag[160];
    snprintf(tag, sizeof tag, "%s %s T=%lld", dense_name[op], name, (long long)T);
    seed_tag(tag);
    bool f32 = op != OP_LINEAR, quant = op == OP_LINEAR && (Wh->fmt == WF_FP8 || Wh->fmt == WF_FP4);
    size_t esz = f32 ? 4 : 2;
    bf16_t *x = NEW(bf16_t, T * k);
    fill_act(x, T * k, xrms);
    void *yc = xmalloc((size_t)(T * n) * esz), *yg = xmalloc((size_t)(T * n) * esz);
    dense_run(&cpu_be, op, yc, x, T, Wh);
    void *dx = g_in(x, (size_t)(T * k) * sizeof(bf16_t)), *dy = g_out((size_t)(T * n) * esz, f32 ? PZ_32F : PZ_16);
    dense_run(&gpu_be, op, dy, dx, T, Wg);
    g_get(yg, dy, (size_t)(T * n) * esz);
    g_free(dx);
    g_free(dy);
    float *xf = NEW(float, T * k);
    for (int64_t t = 0; t < T; t++) {
        if (quant) act_deq(x + t * k, k, xf + t * k);
        else
            for (int64_t i = 0; i < k; i++) xf[t * k + i] = bf16_to_f32(x[t * k + i]);
    }
    double *S = NEW(double, T * n), *A = NEW(double, T * n);
    ref_dot(Wh, xf, k, T, S, A);
    struct cmp c;
    cmp_begin(&c, dense_name[op], "%s%s T=%lld", Wh->fmt == WF_FP8 ? "FP8 " : Wh->fmt == WF_FP4 ? "FP4 " : Wh->fmt == WF_F32 ? "F32 " : "BF16 ",
              name, (long long)T);
    for (int64_t i = 0; i < T * n; i++) {
        if (f32) {
            double G = ((float *)yg)[i], C = ((float *)yc)[i];
            if (g_dense_mma && dense_mma_shape(Wh))
                cmp_tol(&c, i, G, C, TOL_GPU_DENSE_MMA_U_PER_TERM * (double)k * U * A[i] + (double)(2 * k + 2) * TOL_FP32_UNDERFLOW_ABS);
            else
                cmp_tol(&c, i, G, C, TOL_GPU_DENSE_F32_EXACT); /* within the sum bound a fortiori */
            /* + the underflow term of the 2k + 2 roundings (k products, k + 2 adds) */
            cmp_self(&c, i, C, S[i], TOL_CPU_SUM_U_PER_TERM * (double)k * U * A[i] + (double)(k + 2) * 0x1p-53 * A[i] +
                                         (double)(2 * k + 2) * TOL_FP32_UNDERFLOW_ABS);
        } else
            cmp_linear_bf16(&c, i, bf16_to_f32(((bf16_t *)yg)[i]), bf16_to_f32(((bf16_t *)yc)[i]), S[i], A[i], k);
    }
    cmp_end(&c);
    free(x);
    free(yc);
    free(yg);
    free(xf);
    free(S);
    free(A);
}

static void dense_cases(enum dense_op op, const char *name, struct hw *h, const int64_t *Ts, int nT, float xrms) {
    struct qweight g = g_weight(&h->q, false);
    for (int i = 0; i < nT; i++) check_dense(op, name, &h->q, &g, Ts[i], xrms);
    GPU->weight_release(&gpu_be, &g);
    hw_free(h);
}

/* odd extents: n in {1, 33, 37, 100, 129}, k multiples of 32 but not of 1024 */
static const int64_t ODD_NK[][2] = {{1, 32}, {33, 96}, {37, 160}, {100, 1056}, {129, 2080}};

/* the case name of an odd extent {n, k} */
static const char *odd_name(char *nm, size_t size, const int64_t nk[2]) {
    snprintf(nm, size, "odd [%lld,%lld]", (long long)nk[0], (long long)nk[1]);
    return nm;
}

static void test_linear_fp8(void **st) {
    NEED_GPU(st);
    struct hw h;
    seed_tag("fp8 weights");
    h = hw_fp8(Q_LORA, DIM, 0, DIM, 0.02f), dense_cases(OP_LINEAR, "wq_a [1280,5120]", &h, T_REAL, NT_REAL, 1.0f);
    h = hw_fp8(H_LOCAL * HD, Q_LORA, 0, Q_LORA, 0.03f), dense_cases(OP_LINEAR, "wq_b slice [4096,1280]", &h, T_REAL, NT_REAL, 1.0f);
    h = hw_fp8(HD, DIM, 0, DIM, 0.02f), dense_cases(OP_LINEAR, "wkv [512,5120]", &h, T_REAL, NT_REAL, 1.0f);
    h = hw_fp8(DIM, 8 * O_LORA, RANK * O_LORA, O_LORA, 0.02f),
    dense_cases(OP_LINEAR, "wo_b TP slice [5120,1024] of 8192", &h, T_REAL, NT_REAL, 1.0f);
    h = hw_fp8(MOE_INTER, DIM, 0, DIM, 0.02f), dense_cases(OP_LINEAR, "shared w1 [2304,5120]", &h, T_REAL, NT_REAL, 1.0f);
    h = hw_fp8(DIM, MOE_INTER, 0, MOE_INTER, 0.02f), dense_cases(OP_LINEAR, "shared w2 [5120,2304]", &h, T_REAL, NT_REAL, 0.2f);
    h = hw_fp8(IDX_H_LOCAL * IDX_HD, Q_LORA, 0, Q_LORA, 0.03f),
    dense_cases(OP_LINEAR, "indexer wq_b slice [512,1280]", &h, T_REAL, NT_REAL, 1.0f);
    {
        const int64_t Ts[] = {1, 3};
        h = hw_fp8(5 * DIM, 6144, 0, 6144, 0.02f), dense_cases(OP_LINEAR, "engram wkv [25600,6144]", &h, Ts, 2, 0.5f);
    }
    for (int i = 0; i < 5; i++) {
        char nm[64];
        h = hw_fp8(ODD_NK[i][0], ODD_NK[i][1], 0, ODD_NK[i][1], 0.05f);
        dense_cases(OP_LINEAR, odd_name(nm, sizeof nm, ODD_NK[i]), &h, T_ODD, NT_ODD, 1.0f);
    }
    h = hw_fp8(37, 160, 32, 96, 0.05f), dense_cases(OP_LINEAR, "odd slice [37,96] of 160 at 32", &h, T_ODD, NT_ODD, 1.0f);
}

static void test_linear_fp4(void **st) {
    NEED_GPU(st);
    struct hw h;
    seed_tag("fp4 weights");
    h = hw_fp4(MOE_INTER, DIM), dense_cases(OP_LINEAR, "expert w1 [2304,5120]", &h, T_REAL, NT_REAL, 1.0f);
    h = hw_fp4(DIM, MOE_INTER), dense_cases(OP_LINEAR, "expert w2 [5120,2304]", &h, T_REAL, NT_REAL, 0.2f);
    for (int i = 0; i < 5; i++) {
        char nm[64];
        h = hw_fp4(ODD_NK[i][0], ODD_NK[i][1]), dense_cases(OP_LINEAR, odd_name(nm, sizeof nm, ODD_NK[i]), &h, T_ODD, NT_ODD, 1.0f);
    }
}

static const int64_t ODD_NK_DENSE[][2] = {{1, 1}, {33, 37}, {37, 100}, {100, 129}, {129, 1056}};

static void test_linear_bf16(void **st) {
    NEED_GPU(st);
    struct hw h;
    seed_tag("bf16 weights");
    h = hw_bf16(HD, DIM, 0.02f), dense_cases(OP_LINEAR, "compressor wkv (ratio 1) [512,5120]", &h, T_REAL, NT_REAL, 1.0f);
    h = hw_bf16(IDX_HD, HD, 0.05f), dense_cases(OP_LINEAR, "indexer wk [128,512]", &h, T_REAL, NT_REAL, 1.0f);
    h = hw_bf16(IDX_H_LOCAL, DIM, 0.02f), dense_cases(OP_LINEAR, "weights_proj slice [4,5120]", &h, T_REAL, NT_REAL, 1.0f);
    for (int i = 0; i < 5; i++) {
        char nm[64];
        h = hw_bf16(ODD_NK_DENSE[i][0], ODD_NK_DENSE[i][1], 0.05f);
        dense_cases(OP_LINEAR, odd_name(nm, sizeof nm, ODD_NK_DENSE[i]), &h, T_ODD, NT_ODD, 1.0f);
    }
}

/* linear_f32 at the odd extents, F32 and BF16 weights in turn */
static void linear_f32_odd_cases(void) {
    for (int i = 0; i < 5; i++) {
        char nm[64];
        struct hw h = (i & 1) ? hw_f32(ODD_NK_DENSE[i][0], ODD_NK_DENSE[i][1], 0.05f)
                              : hw_bf16(ODD_NK_DENSE[i][0], ODD_NK_DENSE[i][1], 0.05f);
        dense_cases(OP_LINEAR_F32, odd_name(nm, sizeof nm, ODD_NK_DENSE[i]), &h, T_ODD, NT_ODD, 1.0f);
    }
}

static void test_linear_f32(void **st) {
    NEED_GPU(st);
    struct hw h;
    seed_tag("f32 linear weights");
    h = hw_bf16(N_EXPERTS, DIM, 0.02f), dense_cases(OP_LINEAR_F32, "gate [384,5120]", &h, T_REAL, NT_REAL, 1.0f);
    { /* above 256 rows the prefill tiling, with k = 5,120 + 96: 40 whole segments and a short one */
        const int64_t Tp[] = {300};
        h = hw_bf16(100, DIM + 96, 0.02f), dense_cases(OP_LINEAR_F32, "prefill tiling [100,5216]", &h, Tp, 1, 1.0f);
    }
    h = hw_bf16(HD, DIM, 0.02f), dense_cases(OP_LINEAR_F32, "compressor wkv/wgate [512,5120]", &h, T_REAL, NT_REAL, 1.0f);
    h = hw_f32(1, DIM + 256, 0.02f), dense_cases(OP_LINEAR_F32, "F32 confidence proj [1,5376]", &h, T_REAL, NT_REAL, 1.0f);
    linear_f32_odd_cases();
    /* prefill-sized calls (T > 256): the tiled kernel, its token, row and k tails */
    const int64_t Tp[] = {300, 600};
    h = hw_bf16(N_EXPERTS, DIM, 0.02f), dense_cases(OP_LINEAR_F32, "gate [384,5120] prefill", &h, Tp, 2, 1.0f);
    h = hw_bf16(37, 1000, 0.05f), dense_cases(OP_LINEAR_F32, "odd [37,1000] prefill", &h, Tp, 1, 1.0f);
    h = hw_bf16(HD, DIM, 0.02f), dense_cases(OP_LINEAR, "BF16 compressor wkv [512,5120] prefill", &h, Tp, 1, 1.0f);
    /* products below the fp32 normal range (x ~ 2^-64, w ~ 2^-66): a fused multiply-add rounds
     * them differently from the CPU's product-then-sum (most outputs of this case differ), so every
     * kernel has to notice and take the separately rounded form; T = 1 (dense_seg), 8, 17
     * (dense_segsum, 4 token rows a CTA), 64, 200 (dense_tile by segment: 32-row tiles at 64, 64-row
     * at 200) and 300 (dense_tile) */
    const int64_t Tt[] = {1, 8, 17, 64, 200, 300};
    h = hw_bf16(N_EXPERTS, DIM, 0x1p-66f), dense_cases(OP_LINEAR_F32, "gate [384,5120] subnormal products", &h, Tt, 6, 0x1p-64f);
    const int64_t Tm[] = {130, 256}; /* dense_tile by segment (64-row tiles; the odd one 32-row), token tails */
    h = hw_bf16(N_EXPERTS, DIM, 0.02f), dense_cases(OP_LINEAR_F32, "gate [384,5120] 65..256 rows", &h, Tm, 2, 1.0f);
    h = hw_bf16(37, 1000, 0.05f), dense_cases(OP_LINEAR_F32, "odd [37,1000] 65..256 rows", &h, Tm, 1, 1.0f);
    /* 64 token rows a CTA (the grid of 64-row tiles has >= DT_WIDE_CTAS = 128 CTAs: 58 x 9 here;
     * the prefill cases above take 32-row tiles): token, row and k tails, and the separately
     * rounded form */
    const int64_t Tw[] = {3700};
    h = hw_bf16(520, 160, 0.05f), dense_cases(OP_LINEAR_F32, "odd [520,160] 64-row tiles", &h, Tw, 1, 1.0f);
    h = hw_bf16(520, 160, 0x1p-66f), dense_cases(OP_LINEAR_F32, "odd [520,160] 64-row tiles, subnormal products", &h, Tw, 1, 0x1p-64f);
    h = hw_bf16(520, 160, 0.05f), dense_cases(OP_LINEAR, "BF16 odd [520,160] 64-row tiles", &h, Tw, 1, 1.0f);
}

static void test_head(void **st) {
    NEED_GPU(st);
    struct hw h;
    seed_tag("head weights");
    const int64_t Ts[] = {1, 8};
    h = hw_bf16(VOCAB_LOCAL, DIM, 0.02f), dense_cases(OP_HEAD, "vocab slice [16160,5120]", &h, Ts, 2, 1.0f);
    for (int i = 0; i < 5; i++) {
        char nm[64];
        h = hw_bf16(ODD_NK_DENSE[i][0], ODD_NK_DENSE[i][1], 0.05f);
        dense_cases(OP_HEAD, odd_name(nm, sizeof nm, ODD_NK_DENSE[i]), &h, T_ODD, NT_ODD, 1.0f);
    }
}

/* grouped_linear (wo_a): x [T, G, kg], W [G·r, kg] bf16 (prepared from FP8 with dequant_bf16 as the
 * model does, or plain BF16) */
static void grouped_case(const char *name, struct hw *h, bool from_fp8, int64_t G, const int64_t *Ts, int nT) {
    struct qweight hc = h->q, g = g_weight(&h->q, from_fp8);
    if (from_fp8) assert_int_equal(CPU->weight_prepare(&cpu_be, &hc, true), 0);
    int64_t n = hc.n, kg = hc.k, r = n / G;
    for (int ti = 0; ti < nT; ti++) {
        int64_t T = Ts[ti];
        char tag[160];
        snprintf(tag, sizeof tag, "grouped %s T=%lld", name, (long long)T);
        seed_tag(tag);
        bf16_t *x = NEW(bf16_t, T * G * kg), *yc = NEW(bf16_t, T * n), *yg = NEW(bf16_t, T * n);
        fill_act(x, T * G * kg, 1.0f);
        CPU->grouped_linear(&cpu_be, yc, x, T, G, &hc);
        void *dx = g_in(x, (size_t)(T * G * kg) * 2), *dy = g_out((size_t)(T * n) * 2, PZ_16);
        GPU->grouped_linear(&gpu_be, dy, dx, T, G, &g);
        g_get(yg, dy, (size_t)(T * n) * 2);
        g_free(dx);
        g_free(dy);
        float *xf = NEW(float, T * G * kg);
        for (int64_t i = 0; i < T * G * kg; i++) xf[i] = bf16_to_f32(x[i]);
        double *S = NEW(double, T * r), *A = NEW(double, T * r);
        struct cmp c;
        cmp_begin(&c, "grouped_linear", "%s G=%lld T=%lld", name, (long long)G, (long long)T);
        for (int64_t gi = 0; gi < G; gi++) {
            struct qweight v = hc;
            v.n = r;
            v.w = (const bf16_t *)hc.w + gi * r * hc.ld;
            ref_dot(&v, xf + gi * kg, G * kg, T, S, A);
            for (int64_t t = 0; t < T; t++)
                for (int64_t j = 0; j < r; j++) {
                    int64_t o = t * n + gi * r + j;
                    cmp_linear_bf16(&c, o, bf16_to_f32(yg[o]), bf16_to_f32(yc[o]), S[t * r + j], A[t * r + j], kg);
                }
        }
        cmp_end(&c);
        free(x);
        free(yc);
        free(yg);
        free(xf);
        free(S);
        free(A);
    }
    GPU->weight_release(&gpu_be, &g);
    if (from_fp8) CPU->weight_release(&cpu_be, &hc);
    hw_free(h);
}

struct grouped_ctx {
    const struct qweight *g;
    int64_t G;
    const void *dx;
};

static void grouped_rows(void *vc, int64_t r0, int64_t T, void *out) {
    struct grouped_ctx *c = vc;
    size_t rb = (size_t)c->g->n * 2;
    void *dy = g_out((size_t)T * rb, PZ_16);
    GPU->grouped_linear(&gpu_be, dy, (const bf16_t *)c->dx + r0 * c->G * c->g->k, T, c->G, c->g);
    g_get(out, dy, (size_t)T * rb);
    g_free(dy);
}

/* grouped_linear with the mma switch on: the BF16 groups on the tensor cores (decode tiling up to
 * 64 rows, prefill tiling above), within the same order-free bound of the CPU backend; shapes the
 * tensor cores cannot take (kg not a multiple of 32) stay exact. Rows do not depend on T. */
static void test_grouped_linear_mma(void **st) {
    NEED_GPU(st);
    mma_switch(true);
    seed_tag("grouped mma weights");
    const int64_t Ts[] = {1, 8, 17, 64, 300};
    struct hw h = hw_fp8(O_LORA, O_GROUP_IN, 0, O_GROUP_IN, 0.02f);
    grouped_case("mma wo_a TP8 (1 group [1024,4096], FP8->bf16)", &h, true, 1, Ts, 5);
    h = hw_fp8(8 * 128, 512, 0, 512, 0.03f);
    grouped_case("mma 8 groups [8x128,512] (FP8->bf16)", &h, true, 8, Ts, 5);
    h = hw_bf16(3 * 40, 1056, 0.05f); /* n8 tiles cut short, k past one chunk */
    grouped_case("mma odd 3 groups [3x40,1056]", &h, false, 3, T_ODD, NT_ODD);
    h = hw_bf16(3 * 37, 100, 0.05f);
    grouped_case("mma odd 3 groups [3x37,100] (exact: kg % 32)", &h, false, 3, T_ODD, NT_ODD);
    const int64_t Tb[] = {8, 16, 64, 300}, probes[] = {0, 5, 7, 15, 63, 150, 299};
    struct hw hb[2] = {hw_fp8(O_LORA, O_GROUP_IN, 0, O_GROUP_IN, 0.02f), hw_bf16(3 * 40, 1056, 0.05f)};
    const int64_t Gs[2] = {1, 3};
    const char *names[2] = {"mma wo_a TP8 [1024,4096]", "mma odd 3 groups [3x40,1056]"};
    for (int i = 0; i < 2; i++) {
        struct qweight g = g_weight(&hb[i].q, i == 0);
        int64_t row = Gs[i] * g.k;
        bf16_t *x = NEW(bf16_t, 300 * row);
        fill_act(x, 300 * row, 1.0f);
        struct grouped_ctx c = {&g, Gs[i], g_in(x, (size_t)(300 * row) * 2)};
        batch_invariance("grouped_linear", names[i], grouped_rows, &c, (size_t)g.n * 2, Tb, 4, probes, 7);
        g_free((void *)c.dx);
        free(x);
        GPU->weight_release(&gpu_be, &g);
        hw_free(&hb[i]);
    }
    mma_switch(false);
}

static void test_grouped_linear(void **st) {
    NEED_GPU(st);
    seed_tag("grouped weights");
    struct hw h = hw_fp8(O_LORA, O_GROUP_IN, 0, O_GROUP_IN, 0.02f);
    grouped_case("wo_a TP8 (1 group [1024,4096], FP8->bf16)", &h, true, 1, T_REAL, NT_REAL);
    h = hw_fp8(8 * 128, 512, 0, 512, 0.03f);
    grouped_case("8 groups [8x128,512] (FP8->bf16)", &h, true, 8, T_REAL, NT_REAL);
    /* 32..256 rows: dense_tile by segment with the groups in its grid (32-row tiles at 40 rows,
     * 64-row at 130: 3 x 2 x 8 x 16 CTAs) */
    const int64_t Tg[] = {40, 130};
    h = hw_fp8(8 * 128, 2048, 0, 2048, 0.02f);
    grouped_case("8 groups [8x128,2048] 32..256 rows", &h, true, 8, Tg, 2);
    h = hw_bf16(3 * 37, 100, 0.05f);
    grouped_case("odd 3 groups [3x37,100]", &h, false, 3, T_ODD, NT_ODD);
    h = hw_bf16(2 * 1, 33, 0.05f);
    grouped_case("odd 2 groups [2x1,33]", &h, false, 2, T_ODD, NT_ODD);
}

/* =============================================================================================
 * moe_combine: exact */

/* ld_sh > D: the shared expert's rows are ld_sh wide and the combine reads their last D columns in
 * place (a TP rank's block of the owner exchange); 0 means D. */
static void moe_combine_case(int64_t T, int64_t k, int64_t D, int64_t per_part, int64_t P, int64_t parts, bool with_sh,
                             int64_t ld_sh) {
    char tag[128];
    if (ld_sh == 0) ld_sh = D;
    int64_t off = ld_sh - D;
    snprintf(tag, sizeof tag, "moe_combine T=%lld k=%lld D=%lld P=%lld sh=%d ld=%lld", (long long)T, (long long)k,
             (long long)D, (long long)P, (int)with_sh, (long long)ld_sh);
    seed_tag(tag);
    int64_t E = per_part * parts;
    bf16_t *y = NEW(bf16_t, P * T * k * D);
    fill_act(y, P * T * k * D, 0.3f);
    int32_t *idx = NEW(int32_t, T * k);
    for (int64_t t = 0; t < T; t++)
        for (int64_t s = 0; s < k; s++) {
            int32_t e;
            do e = (int32_t)irand(E);
            while (i32_in(idx + t * k, s, e));
            idx[t * k + s] = e;
        }
    bf16_t *sh = NEW(bf16_t, T * ld_sh), *oc = NEW(bf16_t, T * D), *og = NEW(bf16_t, T * D);
    fill_act(sh, T * ld_sh, 1.0f);
    CPU->moe_combine(&cpu_be, oc, y, idx, with_sh ? sh + off : NULL, ld_sh, T, k, D, per_part, P);
    void *dy = g_in(y, (size_t)(P * T * k * D) * 2), *di = g_in(idx, (size_t)(T * k) * 4);
    bf16_t *ds = g_in(sh, (size_t)(T * ld_sh) * 2);
    void *dout = g_out((size_t)(T * D) * 2, PZ_16);
    GPU->moe_combine(&gpu_be, dout, dy, di, with_sh ? ds + off : NULL, ld_sh, T, k, D, per_part, P);
    g_get(og, dout, (size_t)(T * D) * 2);
    g_free(dout);
    g_free(ds);
    g_free(dy);
    g_free(di);
    struct cmp c;
    cmp_begin(&c, "moe_combine", "T=%lld k=%lld D=%lld %lld/part P=%lld of %lld%s ld_sh=%lld", (long long)T,
              (long long)k, (long long)D, (long long)per_part, (long long)P, (long long)parts,
              with_sh ? "" : " sh=NULL", (long long)ld_sh);
    cmp_bf16_exact(&c, og, oc, T * D);
    cmp_end(&c);
    free(y);
    free(idx);
    free(sh);
    free(oc);
    free(og);
}

static void test_moe_combine(void **st) {
    NEED_GPU(st);
    for (int i = 0; i < NT_REAL; i++) moe_combine_case(T_REAL[i], TOPK, DIM, E_LOCAL, 8, 8, true, 0);
    moe_combine_case(64, TOPK, DIM, E_LOCAL, 8, 8, true, 0);
    moe_combine_case(300, TOPK, DIM, E_LOCAL, 8, 8, true, 0); /* from 32 rows on: the 8-wide kernel */
    moe_combine_case(300, TOPK, DIM, E_LOCAL, 8, 8, false, 0);
    moe_combine_case(40, 4, 136, 5, 3, 8, true, 0);
    moe_combine_case(17, 4, 37, 5, 3, 8, true, 0); /* slots of parts >= 3 skipped */
    moe_combine_case(3, 1, 129, 37, 1, 1, false, 0);
    moe_combine_case(1, 3, 100, 16, 8, 8, true, 0);
    moe_combine_case(1, 3, 100, 16, 8, 8, false, 0);
    /* one rank's column block of the owner exchange (TP8: D / 8 columns, sh rows D wide) */
    for (int i = 0; i < NT_REAL; i++) moe_combine_case(T_REAL[i], TOPK, DIM / 8, E_LOCAL, 8, 8, true, DIM);
    moe_combine_case(40, 4, 136, 5, 3, 8, true, 141); /* rows not 16-byte aligned: the narrow kernel */
}

/* =============================================================================================
 * MoE: router, moe_experts, shared_expert */

static void router_case(const char *name, int64_t T, int64_t E, int64_t D, int64_t k, float temp, bool norm, float rs) {
    char tag[160];
    snprintf(tag, sizeof tag, "router %s T=%lld", name, (long long)T);
    seed_tag(tag);
    struct hw gate = hw_bf16(E, D, 0.02f);
    float *bias = NEW(float, E);
    fill_f32(bias, E, 0.0f, 0.3f);
    if (E > 11) { /* two identical experts: an exact tie, lower id first */
        memcpy((bf16_t *)gate.data + 11 * D, (bf16_t *)gate.data + 10 * D, (size_t)D * 2);
        bias[11] = bias[10] = 2.0f;
    }
    bf16_t *x = NEW(bf16_t, T * D);
    fill_act(x, T * D, 1.0f);
    int32_t *ic = NEW(int32_t, T * k), *ig = NEW(int32_t, T * k);
    float *wc = NEW(float, T * k), *wg = NEW(float, T * k);
    CPU->router(&cpu_be, ic, wc, x, T, &gate.q, bias, k, temp, norm, rs);
    struct qweight gg = g_weight(&gate.q, false);
    const void *db = g_tensor(bias, (size_t)E * 4, false);
    void *dx = g_in(x, (size_t)(T * D) * 2), *di = g_out((size_t)(T * k) * 4, PZ_32I), *dw = g_out((size_t)(T * k) * 4, PZ_32F);
    GPU->router(&gpu_be, di, dw, dx, T, &gg, db, k, temp, norm, rs);
    g_get(ig, di, (size_t)(T * k) * 4);
    g_get(wg, dw, (size_t)(T * k) * 4);
    g_free(dx);
    g_free(di);
    g_free(dw);
    GPU->tensor_release(&gpu_be, db);
    GPU->weight_release(&gpu_be, &gg);
    float *xf = NEW(float, T * D);
    for (int64_t i = 0; i < T * D; i++) xf[i] = bf16_to_f32(x[i]);
    double *S = NEW(double, T * E), *A = NEW(double, T * E);
    ref_dot(&gate.q, xf, D, T, S, A);
    iv_t *s_iv = NEW(iv_t, E), *v_iv = NEW(iv_t, E), *w_iv = NEW(iv_t, k);
    struct cmp c;
    cmp_begin(&c, "router", "%s T=%lld", name, (long long)T);
    long long same = 0;
    char why[300];
    for (int64_t t = 0; t < T; t++) {
        router_model(S + t * E, A + t * E, bias, E, D, temp, s_iv, v_iv);
        const int32_t *gi = ig + t * k, *ci = ic + t * k;
        if (router_consistent(gi, k, E, v_iv, why, sizeof why)) cmp_fail(&c, "row %lld: GPU selection: %s", (long long)t, why);
        if (router_consistent(ci, k, E, v_iv, why, sizeof why) && !c.nself++)
            snprintf(c.self, sizeof c.self, "row %lld: CPU selection: %s", (long long)t, why);
        same += !memcmp(gi, ci, (size_t)k * 4);
        if (!TOL_GPU_ROUTER_NEAR_TIE_SWAPS && memcmp(gi, ci, (size_t)k * 4))
            cmp_fail(&c, "row %lld: the GPU selected other experts than the CPU", (long long)t);
        bool gvalid = true;
        for (int64_t a = 0; a < k; a++) gvalid &= gi[a] >= 0 && gi[a] < E;
        if (gvalid) {
            router_weights(gi, k, s_iv, norm, rs, w_iv);
            for (int64_t a = 0; a < k; a++) {
                double G = wg[t * k + a], C = wc[t * k + a];
                if (!(G >= w_iv[a].lo && G <= w_iv[a].hi))
                    cmp_fail(&c, "row %lld slot %lld: weight %.9g outside [%.9g, %.9g]", (long long)t, (long long)a, G, w_iv[a].lo,
                             w_iv[a].hi);
                if (gi[a] == ci[a]) cmp_note(&c, G, C);
            }
        }
        router_weights(ci, k, s_iv, norm, rs, w_iv);
        for (int64_t a = 0; a < k; a++)
            if (!(wc[t * k + a] >= w_iv[a].lo && wc[t * k + a] <= w_iv[a].hi))
                cmp_self(&c, t * k + a, wc[t * k + a], 0.5 * (w_iv[a].lo + w_iv[a].hi), 0.5 * (w_iv[a].hi - w_iv[a].lo));
    }
    /* a different selection is allowed only between experts whose score intervals overlap (checked
     * above); the weights are compared where both backends chose the same expert in the same slot */
    print_message("  %-15s %-46s %lld of %lld rows select the same experts in the same order\n", "router", name, same, (long long)T);
    cmp_end(&c);
    free(x);
    free(ic);
    free(ig);
    free(wc);
    free(wg);
    free(bias);
    free(xf);
    free(S);
    free(A);
    free(s_iv);
    free(v_iv);
    free(w_iv);
    hw_free(&gate);
}

/* Under the mma switch the router op folds its gate's tensor-core k-chunks inside the rank
 * selection (no chunk-fold launch): its ids and weights must be, bit for bit, those of the gate
 * alone (linear_f32, whose chunk fold is the tilings') followed by the rank selection. T = 200 is
 * still the rank form's (up to twice the SMs), on the 128 x 128 gate tiling. */
static void router_fused_case(int64_t T) {
    const int64_t E = N_EXPERTS, D = DIM, k = TOPK;
    char tag[160];
    snprintf(tag, sizeof tag, "router fused gate T=%lld", (long long)T);
    seed_tag(tag);
    struct hw gate = hw_bf16(E, D, 0.02f);
    float *bias = NEW(float, E);
    fill_f32(bias, E, 0.0f, 0.3f);
    bf16_t *x = NEW(bf16_t, T * D);
    fill_act(x, T * D, 1.0f);
    struct qweight gg = g_weight(&gate.q, false);
    const void *db = g_tensor(bias, (size_t)E * 4, false);
    void *dx = g_in(x, (size_t)(T * D) * 2), *dz = g_out((size_t)(T * E) * 4, PZ_32F);
    void *di[2] = {g_out((size_t)(T * k) * 4, PZ_32I), g_out((size_t)(T * k) * 4, PZ_32I)};
    void *dw[2] = {g_out((size_t)(T * k) * 4, PZ_32F), g_out((size_t)(T * k) * 4, PZ_32F)};
    GPU->router(&gpu_be, di[0], dw[0], dx, T, &gg, db, k, 1.0f, true, 1.5f);
    GPU->linear_f32(&gpu_be, dz, dx, T, &gg);
    cuda_router_select(CUDA_ROUTER_RANK, di[1], dw[1], dz, db, T, E, k, 1.0f, 1, 1.5f, backend_cuda_stream(&gpu_be));
    int32_t *ih[2] = {NEW(int32_t, T * k), NEW(int32_t, T * k)};
    float *wh[2] = {NEW(float, T * k), NEW(float, T * k)};
    for (int i = 0; i < 2; i++) {
        g_get(ih[i], di[i], (size_t)(T * k) * 4);
        g_get(wh[i], dw[i], (size_t)(T * k) * 4);
    }
    struct cmp c;
    cmp_begin(&c, "router", "fused gate fold = linear_f32 + rank selection T=%lld", (long long)T);
    for (int64_t i = 0; i < T * k; i++)
        if (ih[0][i] != ih[1][i])
            cmp_fail(&c, "row %lld slot %lld: expert %d, composition %d", (long long)(i / k), (long long)(i % k), ih[0][i],
                     ih[1][i]);
    cmp_f32_exact(&c, wh[0], wh[1], T * k);
    cmp_end(&c);
    for (int i = 0; i < 2; i++) {
        g_free(di[i]);
        g_free(dw[i]);
        free(ih[i]);
        free(wh[i]);
    }
    g_free(dx);
    g_free(dz);
    GPU->tensor_release(&gpu_be, db);
    GPU->weight_release(&gpu_be, &gg);
    hw_free(&gate);
    free(bias);
    free(x);
}

static void test_router(void **st) {
    NEED_GPU(st);
    const int64_t Ts[] = {1, 8, 17, 64};
    for (int i = 0; i < 4; i++) router_case("384 experts top-6 (+bias, norm, x1.5)", Ts[i], N_EXPERTS, DIM, TOPK, 1.0f, true, 1.5f);
    /* the gate on the tensor cores (dense_mma): its sums within the order-free bound the model
     * already allows, so the same checks; at 300 rows the 128 x 128 tiling */
    mma_switch(true);
    const int64_t Tm[] = {1, 64, 300};
    for (int i = 0; i < 3; i++) router_case("mma 384 experts top-6 (+bias, norm, x1.5)", Tm[i], N_EXPERTS, DIM, TOPK, 1.0f, true, 1.5f);
    const int64_t Tf[] = {1, 8, 200};
    if (gpu_state == 1) /* the selection kernel is called directly: not on the CPU stand-in */
        for (int i = 0; i < 3; i++) router_fused_case(Tf[i]);
    mma_switch(false);
    router_case("DSpark 128 experts top-3", 8, 128, DIM, 3, 1.0f, true, 1.5f);
    router_case("odd 37 experts top-1 temp 2", 17, 37, 100, 1, 2.0f, true, 1.0f);
    router_case("odd 33 experts top-4 no norm", 3, 33, 129, 4, 1.0f, false, 1.0f);
}

/* Routing like a busy rank: about 40% of the slots on local experts (half of those on 8 hot ones),
 * the rest anywhere; distinct experts per token; positive weights summing to route_scale. */
static void make_routing(int32_t *idx, float *wts, int64_t T, int64_t k, int64_t E, int64_t e0, int64_t n_local) {
    for (int64_t t = 0; t < T; t++) {
        float sum = 0.0f;
        for (int64_t s = 0; s < k; s++) {
            int32_t e;
            do {
                double r = urand();
                if (r < 0.2) e = (int32_t)(e0 + irand(n_local < 8 ? n_local : 8));
                else if (r < 0.4) e = (int32_t)(e0 + irand(n_local));
                else e = (int32_t)irand(E);
            } while (i32_in(idx + t * k, s, e));
            idx[t * k + s] = e;
            wts[t * k + s] = 0.2f + (float)urand();
            sum += wts[t * k + s];
        }
        for (int64_t s = 0; s < k; s++) wts[t * k + s] = wts[t * k + s] / sum * 1.5f;
    }
}

struct experts {
    int64_t n_local, D, I, e0, E;
    struct hw *w1, *w3, *w2;
    struct qweight *h1, *h3, *h2, *g1, *g3, *g2;
};

static struct experts make_experts(int64_t n_local, int64_t D, int64_t I, int64_t e0, int64_t E) {
    struct experts x = {n_local, D, I, e0, E, NEW(struct hw, n_local), NEW(struct hw, n_local), NEW(struct hw, n_local),
                        NEW(struct qweight, n_local), NEW(struct qweight, n_local), NEW(struct qweight, n_local),
                        NEW(struct qweight, n_local), NEW(struct qweight, n_local), NEW(struct qweight, n_local)};
    for (int64_t e = 0; e < n_local; e++) {
        x.w1[e] = hw_fp4(I, D);
        x.w3[e] = hw_fp4(I, D);
        x.w2[e] = hw_fp4(D, I);
        x.h1[e] = x.w1[e].q;
        x.h3[e] = x.w3[e].q;
        x.h2[e] = x.w2[e].q;
        x.g1[e] = g_weight(&x.h1[e], false);
        x.g3[e] = g_weight(&x.h3[e], false);
        x.g2[e] = g_weight(&x.h2[e], false);
    }
    return x;
}

/* The real shape: rank RANK's 48 of 384 FP4 experts [2304, 5120] */
static struct experts rank_experts(void) { return make_experts(E_LOCAL, DIM, MOE_INTER, RANK * E_LOCAL, N_EXPERTS); }

static void free_experts(struct experts *x) {
    for (int64_t e = 0; e < x->n_local; e++) {
        GPU->weight_release(&gpu_be, &x->g1[e]);
        GPU->weight_release(&gpu_be, &x->g3[e]);
        GPU->weight_release(&gpu_be, &x->g2[e]);
        hw_free(&x->w1[e]);
        hw_free(&x->w3[e]);
        hw_free(&x->w2[e]);
    }
    free(x->w1);
    free(x->w3);
    free(x->w2);
    free(x->h1);
    free(x->h3);
    free(x->h2);
    free(x->g1);
    free(x->g3);
    free(x->g2);
}

/* GPU->moe_experts on host data: x [T, D], idx/wts [T, k] uploaded, y [T, k, D] poisoned on the
 * device (slots routed elsewhere must keep it), run, downloaded into yg. */
static void gpu_moe_experts(bf16_t *yg, const bf16_t *x, const int32_t *idx, const float *wts, int64_t T, int64_t k,
                            struct experts *ex, float limit) {
    const int64_t D = ex->D;
    void *dx = g_in(x, (size_t)(T * D) * 2), *di = g_in(idx, (size_t)(T * k) * 4), *dw = g_in(wts, (size_t)(T * k) * 4),
         *dy = g_out((size_t)(T * k * D) * 2, PZ_16);
    GPU->moe_experts(&gpu_be, dy, dx, di, dw, T, k, ex->e0, ex->n_local, ex->g1, ex->g3, ex->g2, limit);
    g_get(yg, dy, (size_t)(T * k * D) * 2);
    g_free(dx);
    g_free(di);
    g_free(dw);
    g_free(dy);
}

static void moe_experts_case(const char *name, struct experts *ex, int64_t T, int64_t k, float limit) {
    int64_t D = ex->D, Dout = ex->D;
    char tag[160];
    snprintf(tag, sizeof tag, "moe_experts %s T=%lld", name, (long long)T);
    seed_tag(tag);
    bf16_t *x = NEW(bf16_t, T * D), *yc = NEW(bf16_t, T * k * Dout), *yg = NEW(bf16_t, T * k * Dout);
    fill_act(x, T * D, 1.0f);
    int32_t *idx = NEW(int32_t, T * k);
    float *wts = NEW(float, T * k);
    make_routing(idx, wts, T, k, ex->E, ex->e0, ex->n_local);
    poison_host(yc, (size_t)(T * k * Dout) * 2, PZ_16);
    CPU->moe_experts(&cpu_be, yc, x, idx, wts, T, k, ex->e0, ex->n_local, ex->h1, ex->h3, ex->h2, limit);
    gpu_moe_experts(yg, x, idx, wts, T, k, ex, limit);
    double *lo = NEW(double, Dout), *hi = NEW(double, Dout);
    struct cmp c;
    cmp_begin(&c, "moe_experts", "%s T=%lld", name, (long long)T);
    long long local = 0;
    for (int64_t ts = 0; ts < T * k; ts++) {
        int64_t e = idx[ts];
        const bf16_t *g = yg + ts * Dout, *r = yc + ts * Dout;
        if (e < ex->e0 || e >= ex->e0 + ex->n_local) { /* another rank's slot: the poison survives */
            for (int64_t d = 0; d < Dout; d++) {
                cmp_bits(&c, ts * Dout + d, g[d], POISON16, bf16_to_f32(g[d]), NAN);
                if (r[d] != POISON16) cmp_self(&c, ts * Dout + d, 1, 0, 0);
            }
            continue;
        }
        local++;
        int64_t le = e - ex->e0;
        expert_model(x + (ts / k) * D, &ex->h1[le], &ex->h3[le], &ex->h2[le], true, wts[ts], limit, lo, hi);
        for (int64_t d = 0; d < Dout; d++) cmp_iv(&c, ts * Dout + d, bf16_to_f32(g[d]), bf16_to_f32(r[d]), iv(lo[d], hi[d]));
    }
    snprintf(c.what + strlen(c.what), sizeof c.what - strlen(c.what), " (%lld local slots)", local);
    cmp_end(&c);
    free(x);
    free(yc);
    free(yg);
    free(idx);
    free(wts);
    free(lo);
    free(hi);
}

static void test_moe_experts(void **st) {
    NEED_GPU(st);
    seed_tag("experts real");
    struct experts ex = rank_experts();
    for (int i = 0; i < NT_REAL; i++) moe_experts_case("48 of 384 FP4 [2304,5120] top-6", &ex, T_REAL[i], TOPK, 10.0f);
    free_experts(&ex);
    seed_tag("experts odd");
    ex = make_experts(3, 96, 64, 5, 37);
    moe_experts_case("odd 3 of 37 [64,96] top-2 limit 0.5", &ex, 17, 2, 0.5f);
    moe_experts_case("odd 3 of 37 [64,96] top-4 no limit", &ex, 3, 4, 0.0f);
    moe_experts_case("odd 3 of 37 [64,96] top-1", &ex, 64, 1, 10.0f);
    free_experts(&ex);
}

/* The tensor-core routed experts (the mma switch) against the composition of the GPU's own
 * tensor-core ops: with every routing weight 1, pair (t, slot) on local expert e must be, bit for
 * bit, shared_expert(x_t) with e's weights — linear w1, linear w3, the SwiGLU, linear w2, all on
 * the tensor-core linears, one expert's rows per call. T = 300 at the real shape takes two passes
 * of the path's partial buffer (moe_mma.h). */
static void moe_mma_composition_case(const char *name, struct experts *ex, int64_t T, int64_t k, float limit) {
    const int64_t D = ex->D;
    char tag[160];
    snprintf(tag, sizeof tag, "moe_experts mma composition %s T=%lld", name, (long long)T);
    seed_tag(tag);
    bf16_t *x = NEW(bf16_t, T * D), *yg = NEW(bf16_t, T * k * D), *xr = NEW(bf16_t, T * k * D), *yr = NEW(bf16_t, T * k * D);
    int32_t *idx = NEW(int32_t, T * k);
    float *wts = NEW(float, T * k);
    int64_t *slot = NEW(int64_t, T * k);
    fill_act(x, T * D, 1.0f);
    make_routing(idx, wts, T, k, ex->E, ex->e0, ex->n_local);
    bool any = false;
    for (int64_t i = 0; i < T * k; i++) {
        wts[i] = 1.0f;
        any |= idx[i] >= ex->e0 && idx[i] < ex->e0 + ex->n_local;
    }
    if (!any) idx[0] = (int32_t)ex->e0; /* no slot was local: one is (a row's experts stay distinct) */
    gpu_moe_experts(yg, x, idx, wts, T, k, ex, limit);
    struct cmp c;
    cmp_begin(&c, "moe_experts", "mma = composition of GPU ops: %s T=%lld", name, (long long)T);
    long long local = 0;
    for (int64_t le = 0; le < ex->n_local; le++) {
        int64_t n = 0;
        for (int64_t ts = 0; ts < T * k; ts++)
            if (idx[ts] == ex->e0 + le) {
                memcpy(xr + n * D, x + (ts / k) * D, (size_t)D * 2);
                slot[n++] = ts;
            }
        if (!n) continue;
        void *dxr = g_in(xr, (size_t)(n * D) * 2), *dyr = g_out((size_t)(n * D) * 2, PZ_16);
        GPU->shared_expert(&gpu_be, dyr, dxr, n, &ex->g1[le], &ex->g3[le], &ex->g2[le], limit);
        g_get(yr, dyr, (size_t)(n * D) * 2);
        g_free(dxr);
        g_free(dyr);
        for (int64_t r = 0; r < n; r++)
            for (int64_t d = 0; d < D; d++)
                cmp_bits(&c, slot[r] * D + d, yg[slot[r] * D + d], yr[r * D + d], bf16_to_f32(yg[slot[r] * D + d]),
                         bf16_to_f32(yr[r * D + d]));
        local += n;
    }
    for (int64_t ts = 0; ts < T * k; ts++) /* another rank's slot: the poison survives */
        if (idx[ts] < ex->e0 || idx[ts] >= ex->e0 + ex->n_local)
            for (int64_t d = 0; d < D; d++) cmp_bits(&c, ts * D + d, yg[ts * D + d], POISON16, bf16_to_f32(yg[ts * D + d]), NAN);
    snprintf(c.what + strlen(c.what), sizeof c.what - strlen(c.what), " (%lld local slots)", local);
    if (!local) cmp_fail(&c, "no slot was routed to a local expert: the case checks nothing");
    cmp_end(&c);
    free(x);
    free(yg);
    free(xr);
    free(yr);
    free(idx);
    free(wts);
    free(slot);
}

/* moe_experts with the mma switch on: the same order-free bound of the CPU backend as the exact
 * kernels (the routing weights as made), and bit-identical to the composition above. */
static void test_moe_experts_mma(void **st) {
    NEED_GPU(st);
    mma_switch(true);
    seed_tag("experts real");
    struct experts ex = rank_experts();
    for (int i = 0; i < NT_REAL; i++) moe_experts_case("mma 48 of 384 FP4 [2304,5120] top-6", &ex, T_REAL[i], TOPK, 10.0f);
    /* T = 300 and 1200 take the prefill path (moe_mma.h): ~18 and ~71 local pairs per expert */
    const int64_t Ts[] = {1, 8, 64, 300, 1200};
    for (int i = 0; i < 5; i++) moe_mma_composition_case("48 of 384 FP4 [2304,5120] top-6", &ex, Ts[i], TOPK, 10.0f);
    free_experts(&ex);
    seed_tag("experts odd");
    ex = make_experts(3, 96, 64, 5, 37);
    moe_experts_case("mma odd 3 of 37 [64,96] top-2 limit 0.5", &ex, 17, 2, 0.5f);
    moe_experts_case("mma odd 3 of 37 [64,96] top-4 no limit", &ex, 3, 4, 0.0f);
    moe_mma_composition_case("odd 3 of 37 [64,96] top-2 limit 0.5", &ex, 40, 2, 0.5f);
    moe_mma_composition_case("odd 3 of 37 [64,96] top-1", &ex, 64, 1, 10.0f);
    /* under 16 tokens: the 4-warp CTAs of 64 rows, y's 96 rows cutting the second one short */
    moe_mma_composition_case("odd 3 of 37 [64,96] top-4", &ex, 3, 4, 0.0f);
    /* the prefill path: y's 96 columns cut its second 64-column tile short */
    moe_experts_case("mma odd 3 of 37 [64,96] top-2 prefill path", &ex, 300, 2, 0.5f);
    moe_mma_composition_case("odd 3 of 37 [64,96] top-2 prefill path", &ex, 300, 2, 0.5f);
    free_experts(&ex);
    seed_tag("experts odd wide");
    ex = make_experts(2, 1088, 1056, 0, 9); /* k past one chunk, row tiles cut short: 1088 = 1024 + 64, 1056 = 16·66 */
    moe_mma_composition_case("odd 2 of 9 [1056,1088] top-3", &ex, 37, 3, 10.0f);
    /* under 16 tokens (one k-chunk a CTA, 4-warp CTAs): ~10 pairs an expert, so two 8-pair tiles */
    moe_mma_composition_case("odd 2 of 9 [1056,1088] top-3", &ex, 15, 3, 10.0f);
    /* the prefill path: ~250 pairs per expert (several 64-pair tiles, the last one partial), w1's
     * scale rows 34 bytes apart (the byte-wise scale reads) */
    moe_mma_composition_case("odd 2 of 9 [1056,1088] top-3 prefill path", &ex, 400, 3, 10.0f);
    free_experts(&ex);
    seed_tag("experts odd wide 2");
    ex = make_experts(2, 1120, 1056, 0, 9); /* 35 k-blocks: the prefill path's last stage half past k; y's last tile cut short */
    moe_mma_composition_case("odd 2 of 9 [1056,1120] top-3 prefill path", &ex, 400, 3, 10.0f);
    free_experts(&ex);
    mma_switch(false);
}

static void shared_expert_case(const char *name, int64_t T, int64_t D, int64_t I, float limit) {
    char tag[160];
    snprintf(tag, sizeof tag, "shared_expert %s T=%lld", name, (long long)T);
    seed_tag(tag);
    struct hw w1 = hw_fp8(I, D, 0, D, 0.02f), w3 = hw_fp8(I, D, 0, D, 0.02f), w2 = hw_fp8(D, I, 0, I, 0.02f);
    struct qweight g1 = g_weight(&w1.q, false), g3 = g_weight(&w3.q, false), g2 = g_weight(&w2.q, false);
    bf16_t *x = NEW(bf16_t, T * D), *yc = NEW(bf16_t, T * D), *yg = NEW(bf16_t, T * D);
    fill_act(x, T * D, limit > 0 && limit < 1 ? 4.0f : 1.0f);
    CPU->shared_expert(&cpu_be, yc, x, T, &w1.q, &w3.q, &w2.q, limit);
    void *dx = g_in(x, (size_t)(T * D) * 2), *dy = g_out((size_t)(T * D) * 2, PZ_16);
    GPU->shared_expert(&gpu_be, dy, dx, T, &g1, &g3, &g2, limit);
    g_get(yg, dy, (size_t)(T * D) * 2);
    g_free(dx);
    g_free(dy);
    double *lo = NEW(double, D), *hi = NEW(double, D);
    struct cmp c;
    cmp_begin(&c, "shared_expert", "%s T=%lld", name, (long long)T);
    for (int64_t t = 0; t < T; t++) {
        expert_model(x + t * D, &w1.q, &w3.q, &w2.q, false, 0.0f, limit, lo, hi);
        for (int64_t d = 0; d < D; d++) cmp_iv(&c, t * D + d, bf16_to_f32(yg[t * D + d]), bf16_to_f32(yc[t * D + d]), iv(lo[d], hi[d]));
    }
    cmp_end(&c);
    GPU->weight_release(&gpu_be, &g1);
    GPU->weight_release(&gpu_be, &g3);
    GPU->weight_release(&gpu_be, &g2);
    hw_free(&w1);
    hw_free(&w3);
    hw_free(&w2);
    free(x);
    free(yc);
    free(yg);
    free(lo);
    free(hi);
}

static void test_shared_expert(void **st) {
    NEED_GPU(st);
    for (int i = 0; i < NT_REAL; i++) shared_expert_case("FP8 [2304,5120]", T_REAL[i], DIM, MOE_INTER, 10.0f);
    shared_expert_case("odd [64,96] limit 0.5", 17, 96, 64, 0.5f);
    shared_expert_case("odd [32,160] no limit", 3, 160, 32, 0.0f);
    /* the tensor-core form (w1 and w3 unfolded into the SwiGLU): one pair launch up to 512 rows,
     * two calls above; the bits are held to the routed experts' in test_moe_experts_mma */
    mma_switch(true);
    const int64_t Tm[] = {1, 64, 600};
    for (int i = 0; i < 3; i++) shared_expert_case("mma FP8 [2304,5120]", Tm[i], DIM, MOE_INTER, 10.0f);
    shared_expert_case("mma odd [64,96] limit 0.5", 17, 96, 64, 0.5f);
    shared_expert_case("mma odd [128,1088] two k-chunks", 40, 1088, 128, 10.0f);
    mma_switch(false);
}

/* =============================================================================================
 * Batch invariance */

struct lin_ctx {
    enum dense_op op;
    const struct qweight *W;
    const bf16_t *dx;
    int64_t n, k;
};

static void lin_rows(void *vc, int64_t r0, int64_t T, void *out) {
    struct lin_ctx *c = vc;
    size_t esz = c->op == OP_LINEAR ? 2 : 4;
    void *dy = g_out((size_t)(T * c->n) * esz, esz == 2 ? PZ_16 : PZ_32F);
    dense_run(&gpu_be, c->op, dy, c->dx + r0 * c->k, T, c->W);
    g_get(out, dy, (size_t)(T * c->n) * esz);
    g_free(dy);
}

static void lin_invariance(enum dense_op op, const char *name, struct hw *h, const int64_t *Ts, int nT, const int64_t *probes,
                           int np) {
    int64_t Tmax = Ts[nT - 1], k = h->q.k;
    seed_tag(name);
    bf16_t *x = NEW(bf16_t, Tmax * k);
    fill_act(x, Tmax * k, 1.0f);
    struct qweight g = g_weight(&h->q, false);
    struct lin_ctx c = {op, &g, g_in(x, (size_t)(Tmax * k) * 2), h->q.n, k};
    batch_invariance(dense_name[op], name, lin_rows, &c, (size_t)h->q.n * (op == OP_LINEAR ? 2 : 4), Ts, nT, probes, np);
    g_free((void *)c.dx);
    GPU->weight_release(&gpu_be, &g);
    hw_free(h);
    free(x);
}

static void test_batch_invariance_linear(void **st) {
    NEED_GPU(st);
    const int64_t Ts[] = {8, 64, 300}, probes[] = {0, 5, 7, 63, 150, 299};
    struct hw h;
    seed_tag("bi weights");
    h = hw_fp8(H_LOCAL * HD, Q_LORA, 0, Q_LORA, 0.03f), lin_invariance(OP_LINEAR, "FP8 wq_b slice [4096,1280]", &h, Ts, 3, probes, 6);
    h = hw_fp8(DIM, 8 * O_LORA, RANK * O_LORA, O_LORA, 0.02f),
    lin_invariance(OP_LINEAR, "FP8 wo_b TP slice [5120,1024]", &h, Ts, 3, probes, 6);
    h = hw_fp4(MOE_INTER, DIM), lin_invariance(OP_LINEAR, "FP4 expert w1 [2304,5120]", &h, Ts, 3, probes, 6);
    h = hw_bf16(HD, DIM, 0.02f), lin_invariance(OP_LINEAR, "BF16 [512,5120]", &h, Ts, 3, probes, 6);
    h = hw_fp8(37, 160, 0, 160, 0.05f), lin_invariance(OP_LINEAR, "FP8 odd [37,160]", &h, Ts, 3, probes, 6);
    /* the exact dense kernels: the GEMV up to 256 rows, the tiled kernel above, the same chains */
    h = hw_bf16(N_EXPERTS, DIM, 0.02f), lin_invariance(OP_LINEAR_F32, "BF16 gate [384,5120]", &h, Ts, 3, probes, 6);
    h = hw_bf16(37, 1000, 0.05f), lin_invariance(OP_LINEAR_F32, "BF16 odd [37,1000]", &h, Ts, 3, probes, 6);
}

/* The tensor-core linears (the backend's mma switch): the decode tiling (T <= 64) and the
 * prefill tiling (T > 64) within the linear bound of the CPU backend, and bit-identical to each
 * other for the same row — a row alone, in a call of 8, 16, 24 or 64 (decode kernel: one, one, two,
 * four m16 tiles) and in a call of 128 or 300 (prefill kernel) — so the switch keeps results batch
 * invariant. */

static void test_linear_mma(void **st) {
    NEED_GPU(st);
    mma_switch(true);
    const int64_t Ts[] = {1, 3, 8, 9, 16, 17, 64, 130, 300};
    struct hw h;
    seed_tag("mma weights");
    h = hw_fp8(Q_LORA, DIM, 0, DIM, 0.02f), dense_cases(OP_LINEAR, "mma wq_a [1280,5120]", &h, Ts, 9, 1.0f);
    h = hw_fp8(HD, DIM, 0, DIM, 0.02f), dense_cases(OP_LINEAR, "mma wkv [512,5120]", &h, Ts, 9, 1.0f);
    h = hw_fp8(DIM, 8 * O_LORA, RANK * O_LORA, O_LORA, 0.02f),
    dense_cases(OP_LINEAR, "mma wo_b TP slice [5120,1024] of 8192", &h, Ts, 9, 1.0f);
    h = hw_fp4(MOE_INTER, DIM), dense_cases(OP_LINEAR, "mma FP4 w1 [2304,5120]", &h, Ts, 9, 1.0f);
    h = hw_fp4(DIM, MOE_INTER), dense_cases(OP_LINEAR, "mma FP4 w2 [5120,2304]", &h, Ts, 9, 0.2f);
    for (int i = 0; i < 5; i++) {
        char nm[64];
        h = hw_fp8(ODD_NK[i][0], ODD_NK[i][1], 0, ODD_NK[i][1], 0.05f);
        dense_cases(OP_LINEAR, odd_name(nm, sizeof nm, ODD_NK[i]), &h, T_ODD, NT_ODD, 1.0f);
        h = hw_fp4(ODD_NK[i][0], ODD_NK[i][1]), dense_cases(OP_LINEAR, odd_name(nm, sizeof nm, ODD_NK[i]), &h, T_ODD, NT_ODD, 1.0f);
    }
    h = hw_fp8(37, 160, 32, 96, 0.05f), dense_cases(OP_LINEAR, "mma odd slice [37,96] of 160 at 32", &h, T_ODD, NT_ODD, 1.0f);
    mma_switch(false);
}

static void test_linear_mma_kernels_agree(void **st) {
    NEED_GPU(st);
    mma_switch(true);
    /* 3 and 8: the FP8 split kernel (rows past T zero-filled, then every row live) */
    /* 24: two m16 tiles a CTA (17..32 rows); 64: four */
    const int64_t Ts[] = {3, 8, 16, 24, 64, 128, 300}, probes[] = {0, 5, 7, 15, 23, 63, 150, 299};
    struct hw h;
    seed_tag("mma bi weights");
    h = hw_fp8(H_LOCAL * HD, Q_LORA, 0, Q_LORA, 0.03f), lin_invariance(OP_LINEAR, "mma FP8 wq_b slice [4096,1280]", &h, Ts, 7, probes, 8);
    h = hw_fp8(DIM, 8 * O_LORA, RANK * O_LORA, O_LORA, 0.02f),
    lin_invariance(OP_LINEAR, "mma FP8 wo_b TP slice [5120,1024]", &h, Ts, 7, probes, 8);
    h = hw_fp4(MOE_INTER, DIM), lin_invariance(OP_LINEAR, "mma FP4 expert w1 [2304,5120]", &h, Ts, 7, probes, 8);
    h = hw_fp8(37, 160, 0, 160, 0.05f), lin_invariance(OP_LINEAR, "mma FP8 odd [37,160]", &h, Ts, 7, probes, 8);
    h = hw_fp4(33, 96), lin_invariance(OP_LINEAR, "mma FP4 odd [33,96]", &h, Ts, 7, probes, 8);
    mma_switch(false);
}

/* Two weights in one launch (cuda_linear_mma_pair: the shared expert's w1 and w3) against each
 * weight's own call on the same quantized x: the same bits for every output, in every decode form
 * (T = 1, 3, 8 the split kernel; 9, 16 one m16 tile a CTA; 24 two; 64 four) and, at the real seam
 * (2,304 rows, a multiple of 128), the FP8 tiles CUDA_MMA_AUTO takes from 32 rows (40, 64: 64 x 64;
 * 96, 300: 128 x 64; the FP4 pair above 128 rows: 128 x 128), FP8 and FP4, and at the smallest seam
 * (32 rows, which keeps the decode tiling), with a second weight of another size. */
static void test_linear_mma_pair(void **st) {
    NEED_GPU(st);
#ifndef DS_HAVE_CUDA
    skip();
#else
    if (gpu_state != 1) skip(); /* the tensor-core entry points called directly: no CPU stand-in */
    const int64_t Ts[] = {1, 3, 8, 9, 16, 24, 40, 64, 96, 300};
    const struct {
        bool fp4;
        int64_t n1, n2, k;
        const char *name;
    } cs[] = {{false, MOE_INTER, MOE_INTER, DIM, "FP8 w1 | w3 [2304 | 2304, 5120]"},
              {true, MOE_INTER, 256, 640, "FP4 [2304 | 256, 640]"},
              {false, 32, 37, 160, "FP8 [32 | 37, 160]"},
              {true, 64, 48, 96, "FP4 [64 | 48, 96]"}};
    seed_tag("mma pair");
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        const int64_t n1 = cs[ci].n1, n2 = cs[ci].n2, k = cs[ci].k, n = n1 + n2;
        struct hw a = cs[ci].fp4 ? hw_fp4(n1, k) : hw_fp8(n1, k, 0, k, 0.02f);
        struct hw b = cs[ci].fp4 ? hw_fp4(n2, k) : hw_fp8(n2, k, 0, k, 0.02f);
        struct qweight ga = g_weight(&a.q, false), gb = g_weight(&b.q, false);
        assert_true(ga.ld == gb.ld && ga.s_ld == gb.s_ld);
        const int fmt = (int)ga.fmt;
        for (int ti = 0; ti < (int)(sizeof Ts / sizeof Ts[0]); ti++) {
            const int64_t T = Ts[ti];
            if (T > 256 && n1 % CUDA_MMA_PAIR_SEAM) continue; /* past the decode tiling such a seam is refused */
            bf16_t *x = NEW(bf16_t, T * k), *yp = NEW(bf16_t, T * n), *ya = NEW(bf16_t, T * n1), *yb = NEW(bf16_t, T * n2);
            fill_act(x, T * k, 1.0f);
            void *dx = g_in(x, (size_t)(T * k) * 2), *dq = g_out(cuda_linear_mma_act_bytes(T, k), PZ_16);
            void *ws = g_out(cuda_linear_mma_workspace_bytes(T, n, k), PZ_16);
            void *dyp = g_out((size_t)(T * n) * 2, PZ_16), *dya = g_out((size_t)(T * n1) * 2, PZ_16),
                 *dyb = g_out((size_t)(T * n2) * 2, PZ_16);
            const int tl = CUDA_MMA_AUTO | CUDA_MMA_PREQUANT;
            cuda_linear_mma_act_quant(dq, dx, T, k, NULL);
            cuda_linear_mma_pair(tl, fmt, dyp, dq, T, ga.w, ga.s, n1, gb.w, gb.s, n2, k, ga.ld, ga.s_ld, ws, NULL);
            cuda_linear_mma_tiling(tl, fmt, dya, dq, T, ga.w, ga.s, n1, k, ga.ld, ga.s_ld, ws, NULL);
            cuda_linear_mma_tiling(tl, fmt, dyb, dq, T, gb.w, gb.s, n2, k, gb.ld, gb.s_ld, ws, NULL);
            /* these ran on the legacy default stream, which the backend's own (non-blocking) stream,
             * where g_get downloads, does not wait for */
            assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
            g_get(yp, dyp, (size_t)(T * n) * 2);
            g_get(ya, dya, (size_t)(T * n1) * 2);
            g_get(yb, dyb, (size_t)(T * n2) * 2);
            struct cmp c;
            cmp_begin(&c, "linear pair", "%s T=%lld", cs[ci].name, (long long)T);
            for (int64_t t = 0; t < T; t++)
                for (int64_t j = 0; j < n; j++) {
                    const bf16_t r = j < n1 ? ya[t * n1 + j] : yb[t * n2 + j - n1];
                    cmp_bits(&c, t * n + j, yp[t * n + j], r, bf16_to_f32(yp[t * n + j]), bf16_to_f32(r));
                }
            cmp_end(&c);
            g_free(dx), g_free(dq), g_free(ws), g_free(dyp), g_free(dya), g_free(dyb);
            free(x), free(yp), free(ya), free(yb);
        }
        GPU->weight_release(&gpu_be, &ga);
        GPU->weight_release(&gpu_be, &gb);
        hw_free(&a);
        hw_free(&b);
    }
#endif
}

/* The forced FP8 decode forms (CUDA_MMA_DECODE_MT1 / _MT2 / _MT4, which bench_linear_cuda --forms
 * times to choose the forms' row ranges) and the forced prefill tiles (128 x 128, 128 x 64, 64 x
 * 64: bench_linear_cuda --tiles) against the call's own choice on the same quantized x: the same
 * bits for every output, at row counts where each form is not the default one (3: the split
 * kernel's; 24, 40, 64, 130: one, two or four m16 tiles and more than one row tile; 300: the tiles
 * with a part-filled last row tile, the decode forms left out), a real shape, a weight slice (row
 * stride above k) and odd sizes. */
static void test_linear_mma_forms(void **st) {
    NEED_GPU(st);
#ifndef DS_HAVE_CUDA
    skip();
#else
    if (gpu_state != 1) skip(); /* the tensor-core entry points called directly: no CPU stand-in */
    const int64_t Ts[] = {3, 24, 40, 64, 130, 300};
    const int forms[] = {CUDA_MMA_DECODE_MT1,     CUDA_MMA_DECODE_MT2,     CUDA_MMA_DECODE_MT4,
                         CUDA_MMA_PREFILL,        CUDA_MMA_PREFILL_128x64, CUDA_MMA_PREFILL_64x64};
    const char *form_names[] = {"MT1", "MT2", "MT4", "128x128", "128x64", "64x64"};
    const char *names[] = {"wq_a [1280,5120]", "wo_b TP slice [5120,1024]", "odd [37,160]"};
    struct hw hs[3];
    seed_tag("mma forms");
    hs[0] = hw_fp8(Q_LORA, DIM, 0, DIM, 0.02f);
    hs[1] = hw_fp8(DIM, 8 * O_LORA, RANK * O_LORA, O_LORA, 0.02f);
    hs[2] = hw_fp8(37, 160, 0, 160, 0.05f);
    for (size_t hi = 0; hi < sizeof hs / sizeof hs[0]; hi++) {
        struct qweight g = g_weight(&hs[hi].q, false);
        const int64_t n = g.n, k = g.k;
        for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
            const int64_t T = Ts[ti];
            bf16_t *x = NEW(bf16_t, T * k), *ya = NEW(bf16_t, T * n), *yf = NEW(bf16_t, T * n);
            fill_act(x, T * k, 1.0f);
            void *dx = g_in(x, (size_t)(T * k) * 2), *dq = g_out(cuda_linear_mma_act_bytes(T, k), PZ_16);
            void *ws = g_out(cuda_linear_mma_workspace_bytes(T, n, k), PZ_16), *dya = g_out((size_t)(T * n) * 2, PZ_16);
            cuda_linear_mma_act_quant(dq, dx, T, k, NULL);
            cuda_linear_mma_tiling(CUDA_MMA_AUTO | CUDA_MMA_PREQUANT, (int)g.fmt, dya, dq, T, g.w, g.s, n, k, g.ld, g.s_ld,
                                   ws, NULL);
            assert_int_equal(cudaDeviceSynchronize(), cudaSuccess); /* the legacy stream (see test_linear_mma_pair) */
            g_get(ya, dya, (size_t)(T * n) * 2);
            for (size_t fi = 0; fi < sizeof forms / sizeof forms[0]; fi++) {
                if (T > 256 && forms[fi] >= CUDA_MMA_DECODE_MT1 && forms[fi] <= CUDA_MMA_DECODE_MT4) continue; /* decode rows */
                void *dyf = g_out((size_t)(T * n) * 2, PZ_16);
                cuda_linear_mma_tiling(forms[fi] | CUDA_MMA_PREQUANT, (int)g.fmt, dyf, dq, T, g.w, g.s, n, k, g.ld,
                                       g.s_ld, ws, NULL);
                assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
                g_get(yf, dyf, (size_t)(T * n) * 2);
                struct cmp c;
                cmp_begin(&c, "linear form", "%s T=%lld %s", names[hi], (long long)T, form_names[fi]);
                for (int64_t i = 0; i < T * n; i++)
                    cmp_bits(&c, i, yf[i], ya[i], bf16_to_f32(yf[i]), bf16_to_f32(ya[i]));
                cmp_end(&c);
                g_free(dyf);
            }
            g_free(dx), g_free(dq), g_free(ws), g_free(dya);
            free(x), free(ya), free(yf);
        }
        GPU->weight_release(&gpu_be, &g);
        hw_free(&hs[hi]);
    }
#endif
}

/* The dense BF16 sums on the tensor cores (the engine's default, dense_mma): the head at a TP8
 * rank's vocabulary slice at decode and prefill row counts (the decode tiling, the 128 x 128
 * tiling, several row blocks), one rank's whole vocabulary, and odd extents (one k-chunk: the
 * accumulator stored as the output; n8 tiles cut short); linear_f32 at the router gate's and the
 * compressor's shapes, and the F32 weight and k % 32 != 0 shapes, which keep the exact kernels (the
 * CPU's bits); linear on BF16 weights (bf16 out) at the compressor's, the indexer's wk and
 * weights_proj shapes; the same rows at T = 8, 64 and 300 give the same bits (batch invariance). */
static void test_dense_mma(void **st) {
    NEED_GPU(st);
    mma_switch(true);
    g_dense_mma = true;
    struct hw h;
    seed_tag("head mma weights");
    const int64_t Ts[] = {1, 8, 64, 300};
    h = hw_bf16(VOCAB_LOCAL, DIM, 0.02f), dense_cases(OP_HEAD, "mma vocab slice [16160,5120]", &h, Ts, 4, 1.0f);
    const int64_t Tv[] = {2, 9};
    h = hw_bf16(VOCAB, DIM, 0.02f), dense_cases(OP_HEAD, "mma whole vocabulary [129280,5120]", &h, Tv, 2, 1.0f);
    /* 300,000 outputs a row of one k-chunk (the accumulator stored as the output, no workspace) */
    const int64_t Tw[] = {250};
    h = hw_bf16(300000, 32, 0.05f), dense_cases(OP_HEAD, "mma [300000,32] wide rows", &h, Tw, 1, 1.0f);
    /* two k-chunks' partials, 525 KB a row: 249 rows a block of the 128 MiB workspace, so 260 rows
     * are two blocks (the prefill's head takes this path: [16160, 5120] at 2,048 rows is five) */
    const int64_t Tr[] = {260};
    h = hw_bf16(67200, 1056, 0.05f), dense_cases(OP_HEAD, "mma [67200,1056] in row blocks", &h, Tr, 1, 1.0f);
    static const int64_t odd[][2] = {{37, 96}, {1, 32}, {129, 1056}, {100, 2080}};
    for (int i = 0; i < 4; i++) {
        char nm[64];
        h = hw_bf16(odd[i][0], odd[i][1], 0.05f);
        dense_cases(OP_HEAD, odd_name(nm, sizeof nm, odd[i]), &h, T_ODD, NT_ODD, 1.0f);
    }
    h = hw_bf16(VOCAB_LOCAL, DIM, 0.02f), lin_invariance(OP_HEAD, "mma vocab slice [16160,5120]", &h, BI_T, 2, BI_PROBES, 4);
    const int64_t Tb[] = {8, 64, 300}, probes[] = {0, 5, 7, 63, 150, 299};
    h = hw_bf16(333, 1056, 0.05f), lin_invariance(OP_HEAD, "mma odd [333,1056]", &h, Tb, 3, probes, 6);

    seed_tag("linear_f32 mma weights");
    const int64_t Tg[] = {1, 8, 17, 64, 130, 256, 600};
    h = hw_bf16(N_EXPERTS, DIM, 0.02f), dense_cases(OP_LINEAR_F32, "mma gate [384,5120]", &h, Tg, 7, 1.0f);
    h = hw_bf16(HD, DIM, 0.02f), dense_cases(OP_LINEAR_F32, "mma compressor wkv/wgate [512,5120]", &h, Ts, 4, 1.0f);
    h = hw_bf16(100, DIM + 96, 0.02f), dense_cases(OP_LINEAR_F32, "mma [100,5216] (a short last chunk)", &h, Ts, 4, 1.0f);
    /* the exact kernels: F32 weights, k not a multiple of 32 */
    h = hw_f32(1, DIM + 256, 0.02f), dense_cases(OP_LINEAR_F32, "F32 confidence proj [1,5376] (exact)", &h, T_ODD, NT_ODD, 1.0f);
    linear_f32_odd_cases();
    h = hw_bf16(N_EXPERTS, DIM, 0.02f), lin_invariance(OP_LINEAR_F32, "mma gate [384,5120]", &h, Tb, 3, probes, 6);

    seed_tag("bf16 linear mma weights");
    h = hw_bf16(HD, DIM, 0.02f), dense_cases(OP_LINEAR, "mma compressor wkv (ratio 1) [512,5120]", &h, Ts, 4, 1.0f);
    h = hw_bf16(IDX_HD, HD, 0.05f), dense_cases(OP_LINEAR, "mma indexer wk [128,512]", &h, Ts, 4, 1.0f);
    h = hw_bf16(IDX_H_LOCAL, DIM, 0.02f), dense_cases(OP_LINEAR, "mma weights_proj slice [4,5120]", &h, Ts, 4, 1.0f);
    for (int i = 0; i < 5; i++) {
        char nm[64];
        h = hw_bf16(ODD_NK_DENSE[i][0], ODD_NK_DENSE[i][1], 0.05f);
        dense_cases(OP_LINEAR, odd_name(nm, sizeof nm, ODD_NK_DENSE[i]), &h, T_ODD, NT_ODD, 1.0f);
    }
    h = hw_bf16(IDX_H_LOCAL, DIM, 0.02f), lin_invariance(OP_LINEAR, "mma BF16 weights_proj [4,5120]", &h, Tb, 3, probes, 6);
    g_dense_mma = false;
    mma_switch(false);
}

static void test_batch_invariance_head(void **st) {
    NEED_GPU(st);
    struct hw h;
    seed_tag("bi head");
    h = hw_bf16(VOCAB_LOCAL, DIM, 0.02f), lin_invariance(OP_HEAD, "vocab slice [16160,5120]", &h, BI_T, 2, BI_PROBES, 4);
}

struct moe_ctx {
    struct experts *ex;
    int64_t k;
    float limit;
    const void *dx, *di, *dw;
};

static void moe_rows(void *vc, int64_t r0, int64_t T, void *out) {
    struct moe_ctx *c = vc;
    struct experts *ex = c->ex;
    size_t rb = (size_t)(c->k * ex->D) * 2;
    void *dy = g_out((size_t)T * rb, PZ_16);
    GPU->moe_experts(&gpu_be, dy, (const bf16_t *)c->dx + r0 * ex->D, (const int32_t *)c->di + r0 * c->k,
                     (const float *)c->dw + r0 * c->k, T, c->k, ex->e0, ex->n_local, ex->g1, ex->g3, ex->g2, c->limit);
    g_get(out, dy, (size_t)T * rb);
    g_free(dy);
}

static void test_batch_invariance_moe_experts(void **st) {
    NEED_GPU(st);
    seed_tag("bi experts");
    struct experts ex = rank_experts();
    bf16_t *x = NEW(bf16_t, 300 * DIM);
    int32_t *idx = NEW(int32_t, 300 * TOPK);
    float *wts = NEW(float, 300 * TOPK);
    fill_act(x, 300 * DIM, 1.0f);
    make_routing(idx, wts, 300, TOPK, N_EXPERTS, ex.e0, ex.n_local);
    struct moe_ctx c = {&ex, TOPK, 10.0f, g_in(x, (size_t)(300 * DIM) * 2), g_in(idx, 300 * TOPK * 4), g_in(wts, 300 * TOPK * 4)};
    batch_invariance("moe_experts", "48 of 384 FP4 top-6", moe_rows, &c, (size_t)(TOPK * DIM) * 2, BI_T, 2, BI_PROBES, 4);
    mma_switch(true);
    const int64_t Ts[] = {8, 64, 300}, probes[] = {0, 5, 7, 63, 150, 299};
    batch_invariance("moe_experts", "mma 48 of 384 FP4 top-6", moe_rows, &c, (size_t)(TOPK * DIM) * 2, Ts, 3, probes, 6);
    mma_switch(false);
    g_free((void *)c.dx);
    g_free((void *)c.di);
    g_free((void *)c.dw);
    free_experts(&ex);
    free(x);
    free(idx);
    free(wts);
}

/* =============================================================================================
 * Setup */

static int group_setup(void **st) {
    build_tables();
    return cuda_ops_group_setup(st);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_memory_ops),
        cmocka_unit_test(test_weight_prepare),
        cmocka_unit_test(test_tensor_prepare),
        cmocka_unit_test(test_linear_fp8),
        cmocka_unit_test(test_linear_fp4),
        cmocka_unit_test(test_linear_bf16),
        cmocka_unit_test(test_linear_f32),
        cmocka_unit_test(test_grouped_linear),
        cmocka_unit_test(test_grouped_linear_mma),
        cmocka_unit_test(test_head),
        cmocka_unit_test(test_dense_mma),
        cmocka_unit_test(test_moe_combine),
        cmocka_unit_test(test_router),
        cmocka_unit_test(test_moe_experts),
        cmocka_unit_test(test_moe_experts_mma),
        cmocka_unit_test(test_shared_expert),
        cmocka_unit_test(test_batch_invariance_linear),
        cmocka_unit_test(test_linear_mma),
        cmocka_unit_test(test_linear_mma_kernels_agree),
        cmocka_unit_test(test_linear_mma_pair),
        cmocka_unit_test(test_linear_mma_forms),
        cmocka_unit_test(test_batch_invariance_head),
        cmocka_unit_test(test_batch_invariance_moe_experts),
    };
    cuda_ops_test_filters();
    return cmocka_run_group_tests(tests, group_setup, cuda_ops_group_teardown);
}
