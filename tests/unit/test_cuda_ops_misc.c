/* The CUDA backend against the CPU reference backend: the elementwise ops (rmsnorm, rope,
 * qdq_fp8_32 / qdq_fp4_32 / qdq_fp4_16, interleave), mHC (hc_mixes with its Sinkhorn
 * comb, hc_collapse / hc_expand / hc_init), embed and Engram (engram_gather from host-resident
 * tables, engram_gate), attention (sparse_attn, compress_pool, index_scores), the tensor-core
 * kernels' act quant and weight decodes, and batch invariance of sparse_attn and index_scores.
 * Memory, weights, the dense ops and MoE are in test_cuda_ops.c; the harness, the rounding model
 * and how each kind of op is compared are in cuda_ops_common.h; the head's row ops (argmax,
 * row_topk, row_lse) in test_cuda_index.c. */
#include "cuda_ops_common.h"
#ifdef DS_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/attn_mma.h"
#include "cuda/linear_mma.h"
#endif

/* ---------------------------------------------------------------------------------------------
 * Models of the fused ops: what either backend may produce, given backend.h's rounding points and
 * the freedoms of tolerances.h */

/* The slope of the logistic function is at most its value at the point of [lo, hi] nearest 0. */
static double sig_slope_max(double lo, double hi) {
    if (lo <= 0.0 && hi >= 0.0) return 0.25;
    double s = sig(hi < 0.0 ? hi : lo);
    return s * (1.0 - s);
}

/* split_sinkhorn's comb in double, one step at a time: step 0 = row softmax + eps, odd = column
 * normalization, even > 0 = row normalization (2·iters steps; the last is a column step). */
#define HCMAX 4
#define HC2MAX (HCMAX * HCMAX)
static void sk_step(int s, int hc, double eps, const double *in, double *out) {
    if (s == 0) {
        for (int j = 0; j < hc; j++) {
            double mx = in[j * hc], e[HCMAX], sum = 0.0;
            for (int k = 1; k < hc; k++) mx = fmax(mx, in[j * hc + k]);
            for (int k = 0; k < hc; k++) {
                e[k] = exp(in[j * hc + k] - mx);
                sum += e[k];
            }
            for (int k = 0; k < hc; k++) out[j * hc + k] = e[k] / sum + eps;
        }
    } else if (s & 1) {
        for (int k = 0; k < hc; k++) {
            double sum = 0.0;
            for (int j = 0; j < hc; j++) sum += in[j * hc + k];
            for (int j = 0; j < hc; j++) out[j * hc + k] = in[j * hc + k] / (sum + eps);
        }
    } else {
        for (int j = 0; j < hc; j++) {
            double sum = 0.0;
            for (int k = 0; k < hc; k++) sum += in[j * hc + k];
            for (int k = 0; k < hc; k++) out[j * hc + k] = in[j * hc + k] / (sum + eps);
        }
    }
}

/* Jacobian of one step (central differences of the double map), J[e·n2 + f] = ∂out_e/∂in_f. */
static void sk_jac(int s, int hc, double eps, const double *in, double *J) {
    int n2 = hc * hc;
    double a[HC2MAX], o1[HC2MAX], o2[HC2MAX];
    memcpy(a, in, sizeof(double) * (size_t)n2);
    for (int f = 0; f < n2; f++) {
        double h = 1e-6 * fmax(fabs(in[f]), s == 0 ? 1.0 : 1e-9);
        a[f] = in[f] + h;
        sk_step(s, hc, eps, a, o1);
        a[f] = in[f] - h;
        sk_step(s, hc, eps, a, o2);
        a[f] = in[f];
        for (int e = 0; e < n2; e++) J[e * n2 + f] = (o1[e] - o2[e]) / (2.0 * h);
    }
}

struct hc_bound {
    double pre_c[HCMAX], pre_r[HCMAX], post_c[HCMAX], post_r[HCMAX], comb_c[HC2MAX], comb_r[HC2MAX];
};

/* hc_mixes for one token: centers (double) and radii of |gpu − cpu| (tolerances.h, hc_mixes). */
static void hc_model(const bf16_t *X, int64_t hc, int64_t D, const float *fn, const float *scale, const float *base,
                     int iters, float norm_eps, float hc_eps, struct hc_bound *b) {
    int64_t L = hc * D, nm = (2 + hc) * hc;
    double ss = 0.0;
    for (int64_t i = 0; i < L; i++) {
        double v = bf16_to_f32(X[i]);
        ss += v * v;
    }
    double r = 1.0 / sqrt(ss / (double)L + (double)norm_eps);
    double rho_r = (1.0 / sqrt(1.0 - TOL_GPU_SUM_RTOL_PER_TERM * (double)L) - 1.0) + 2.0 * TOL_GPU_NORM_SCALE_U * U;
    double m[(2 + HCMAX) * HCMAX], dm[(2 + HCMAX) * HCMAX];
    for (int64_t j = 0; j < nm; j++) {
        double acc = 0.0, A = 0.0;
        for (int64_t i = 0; i < L; i++) {
            double p = (double)bf16_to_f32(X[i]) * (double)fn[j * L + i];
            acc += p;
            A += fabs(p);
        }
        m[j] = acc * r;
        dm[j] = TOL_GPU_SUM_RTOL_PER_TERM * (double)L * A * r * (1.0 + rho_r) + fabs(m[j]) * (rho_r + 2.0 * U);
    }
    const double el = (TOL_GPU_LIBM_ULP + TOL_CPU_LIBM_ULP) * 2.0 * U; /* expf, both backends */
    for (int64_t j = 0; j < hc; j++) {
        for (int which = 0; which < 2; which++) {
            double mj = m[which * hc + j], dmj = dm[which * hc + j], sc = scale[which];
            double z = mj * sc + base[which * hc + j];
            double dz = fabs(sc) * dmj + 4.0 * U * (fabs(mj * sc) + fabs(z));
            double s = sig(z), slope = sig_slope_max(z - dz, z + dz);
            double rad = slope * dz + s * (el * (1.0 - s) + 4.0 * U);
            if (which == 0) {
                b->pre_c[j] = s + hc_eps;
                b->pre_r[j] = rad + 2.0 * U * (s + hc_eps);
            } else {
                b->post_c[j] = 2.0 * s;
                b->post_r[j] = 2.0 * rad;
            }
        }
    }
    int n2 = (int)(hc * hc), N = 2 * iters;
    double z[HC2MAX], dz[HC2MAX];
    for (int f = 0; f < n2; f++) {
        double mj = m[2 * hc + f];
        z[f] = mj * scale[2] + base[2 * hc + f];
        dz[f] = fabs(scale[2]) * dm[2 * hc + f] + 4.0 * U * (fabs(mj * scale[2]) + fabs(z[f]));
    }
    double(*C)[HC2MAX] = malloc(sizeof(double[HC2MAX]) * (size_t)(N + 1));
    assert_non_null(C);
    memcpy(C[0], z, sizeof z);
    for (int s = 0; s < N; s++) sk_step(s, (int)hc, hc_eps, C[s], C[s + 1]);
    double G[HC2MAX * HC2MAX], J[HC2MAX * HC2MAX], G2[HC2MAX * HC2MAX], bound[HC2MAX] = {0};
    for (int e = 0; e < n2; e++)
        for (int f = 0; f < n2; f++) G[e * n2 + f] = e == f;
    const double sums = (TOL_CPU_SUM_U_PER_TERM + TOL_GPU_SUM_U_PER_TERM) * (double)hc * U;
    for (int s = N - 1; s >= 0; s--) {
        /* this step's own rounding, relative to each of its outputs, carried by G = ∂out/∂C[s+1] */
        for (int f = 0; f < n2; f++) {
            double rho = sums + TOL_GPU_HC_SINKHORN_STEP_EXTRA_U * U;
            if (s == 0) {
                int j = f / (int)hc;
                double mx = z[j * hc];
                for (int k = 1; k < hc; k++) mx = fmax(mx, z[j * hc + k]);
                rho += 2.0 * U * fabs(z[f] - mx) + el; /* expf's argument and expf itself */
            }
            for (int e = 0; e < n2; e++) bound[e] += fabs(G[e * n2 + f]) * fabs(C[s + 1][f]) * rho;
        }
        sk_jac(s, (int)hc, hc_eps, C[s], J);
        for (int e = 0; e < n2; e++)
            for (int f = 0; f < n2; f++) {
                double a = 0.0;
                for (int g = 0; g < n2; g++) a += G[e * n2 + g] * J[g * n2 + f];
                G2[e * n2 + f] = a;
            }
        memcpy(G, G2, sizeof(double) * (size_t)(n2 * n2));
    }
    for (int e = 0; e < n2; e++) {
        for (int f = 0; f < n2; f++) bound[e] += fabs(G[e * n2 + f]) * dz[f];
        b->comb_c[e] = C[N][e];
        b->comb_r[e] = bound[e];
    }
    free(C);
}

/* sparse_attn for one (row, head): the interval of each output channel (tolerances.h). */
static void attn_model(const bf16_t *q, const bf16_t *kv, const int32_t *ir, int64_t n_idx, int64_t hd, float sink,
                       float scale, double *olo, double *ohi) {
    bool any = false;
    for (int64_t i = 0; i < n_idx; i++) any |= ir[i] >= 0;
    if (!any) {
        for (int64_t d = 0; d < hd; d++) olo[d] = ohi[d] = 0.0;
        return;
    }
    double *alo = calloc((size_t)hd, sizeof(double)), *ahi = calloc((size_t)hd, sizeof(double));
    double *plo = NEW(double, hd), *phi = NEW(double, hd), *pA = NEW(double, hd);
    assert_true(alo && ahi);
    iv_t m = iv_pt(-1e30), l = iv_pt(0.0), sv[64];
    for (int64_t b0 = 0; b0 < n_idx; b0 += 64) {
        int64_t nb = n_idx - b0 < 64 ? n_idx - b0 : 64, nv = 0;
        iv_t mn = m;
        for (int64_t i = 0; i < nb; i++) {
            int32_t id = ir[b0 + i];
            if (id < 0) continue;
            nv++;
            const bf16_t *k = kv + (int64_t)id * hd;
            double dot = 0.0, A = 0.0;
            for (int64_t d = 0; d < hd; d++) {
                double p = (double)bf16_to_f32(q[d]) * (double)bf16_to_f32(k[d]);
                dot += p;
                A += fabs(p);
            }
            double sc = dot * (double)scale, r = rad_sum((double)hd, A) * (double)scale + 2.0 * U * fabs(sc);
            sv[i] = iv(sc - r, sc + r);
            mn.lo = fmax(mn.lo, sv[i].lo);
            mn.hi = fmax(mn.hi, sv[i].hi);
        }
        iv_t a = iv(m.lo - mn.hi, fmin(0.0, m.hi - mn.lo));
        a = iv_widen(a, U * fmax(fabs(a.lo), fabs(a.hi)));
        iv_t alpha = iv(exp(a.lo) * (1.0 - EXP_REL), fmin(1.0, exp(fmin(a.hi, 0.0)) * (1.0 + EXP_REL)));
        for (int64_t d = 0; d < hd; d++) plo[d] = phi[d] = pA[d] = 0.0;
        double ls_lo = 0.0, ls_hi = 0.0;
        for (int64_t i = 0; i < nb; i++) {
            int32_t id = ir[b0 + i];
            if (id < 0) continue;
            iv_t e = iv(sv[i].lo - mn.hi, fmin(0.0, sv[i].hi - mn.lo));
            e = iv_widen(e, U * fmax(fabs(e.lo), fabs(e.hi)));
            iv_t P = iv(fmax(exp(e.lo) * (1.0 - EXP_REL) - 0x1p-149, 0.0), fmin(1.0, exp(fmin(e.hi, 0.0)) * (1.0 + EXP_REL)));
            ls_lo += P.lo;
            ls_hi += P.hi;
            iv_t pb = iv_bf16(P); /* P rounded to bf16 before P·V: one flip at most (P_FLIP_ULPS) */
            const bf16_t *row = kv + (int64_t)id * hd;
            for (int64_t d = 0; d < hd; d++) {
                double v = bf16_to_f32(row[d]);
                if (v >= 0) {
                    plo[d] += pb.lo * v;
                    phi[d] += pb.hi * v;
                } else {
                    plo[d] += pb.hi * v;
                    phi[d] += pb.lo * v;
                }
                pA[d] += pb.hi * fabs(v);
            }
        }
        iv_t ls = iv_sum(ls_lo, ls_hi, (double)nb, ls_hi);
        l = iv_round(iv_add(iv_round(iv_mul(l, alpha)), ls));
        for (int64_t d = 0; d < hd; d++) {
            iv_t pv = iv_sum(plo[d], phi[d], (double)(nv > 0 ? nv : 1), pA[d]);
            iv_t ac = iv_round(iv_add(iv_round(iv_mul(iv(alo[d], ahi[d]), alpha)), pv));
            alo[d] = ac.lo;
            ahi[d] = ac.hi;
        }
        m = mn;
    }
    iv_t a = iv((double)sink - m.hi, (double)sink - m.lo);
    a = iv_widen(a, U * fmax(fabs(a.lo), fabs(a.hi)));
    l = iv_round(iv_add(l, iv(exp(a.lo) * (1.0 - EXP_REL), exp(a.hi) * (1.0 + EXP_REL))));
    for (int64_t d = 0; d < hd; d++) {
        iv_t o = iv_bf16(iv_div_round(iv(alo[d], ahi[d]), l));
        olo[d] = o.lo;
        ohi[d] = o.hi;
    }
    free(alo);
    free(ahi);
    free(plo);
    free(phi);
    free(pA);
}

/* index_scores for one (row, key): d_h, p_h and S each rounded to bf16 (one flip each at most). */
static iv_t index_model(const bf16_t *qt, const bf16_t *kj, const float *wf, int64_t nh, int64_t d) {
    double s_lo = 0.0, s_hi = 0.0, A = 0.0;
    for (int64_t h = 0; h < nh; h++) {
        double dot = 0.0, Ad = 0.0;
        for (int64_t e = 0; e < d; e++) {
            double p = (double)bf16_to_f32(qt[h * d + e]) * (double)bf16_to_f32(kj[e]);
            dot += p;
            Ad += fabs(p);
        }
        iv_t dh = iv_bf16(iv_sum(dot, dot, (double)d, Ad));
        iv_t rl = iv(fmax(0.0, dh.lo), fmax(0.0, dh.hi));
        iv_t p = iv_bf16(iv_mul(rl, iv_pt(wf[h]))); /* bf16 · bf16: exact in fp32, one rounding */
        s_lo += p.lo;
        s_hi += p.hi;
        A += fmax(fabs(p.lo), fabs(p.hi));
    }
    return iv_bf16(iv_sum(s_lo, s_hi, (double)nh, A));
}

/* engram_gate for one (token, copy): the interval of each output channel. */
static void gate_model(const bf16_t *h, const bf16_t *key, const bf16_t *value, const float *w, int64_t D, float eps,
                       double *olo, double *ohi) {
    double ssh = 0, ssk = 0, dot = 0, A = 0;
    for (int64_t d = 0; d < D; d++) {
        double hv = bf16_to_f32(h[d]), kv = bf16_to_f32(key[d]), t = hv * (double)w[d] * kv;
        ssh += hv * hv;
        ssk += kv * kv;
        dot += t;
        A += fabs(t);
    }
    double g1 = TOL_GPU_SUM_U_PER_TERM * (double)D * U + (double)(D + 2) * 0x1p-53, nsc = TOL_GPU_NORM_SCALE_U * U;
    iv_t RH = iv(1.0 / sqrt(ssh * (1 + g1) / (double)D + eps) * (1 - nsc), 1.0 / sqrt(ssh * (1 - g1) / (double)D + eps) * (1 + nsc));
    iv_t RK = iv(1.0 / sqrt(ssk * (1 + g1) / (double)D + eps) * (1 - nsc), 1.0 / sqrt(ssk * (1 - g1) / (double)D + eps) * (1 + nsc));
    iv_t rstd = iv_round(iv_mul(RH, RK));
    iv_t DOT = iv_widen(iv_pt(dot), (g1 + 2.0 * U) * A); /* two rounded products per term */
    double isd = (float)(1.0 / sqrt((double)D));
    iv_t ISD = iv_widen_rel(iv_pt(isd), 2.0 * TOL_GPU_LIBM_ULP * U); /* a GPU may take D^-0.5 from rsqrtf */
    iv_t dp = iv_round(iv_mul(iv_round(iv_mul(DOT, rstd)), ISD));
    const double fl = (double)1e-6f;
    double a_lo = dp.lo <= 0.0 ? -sqrt(fmax(-dp.lo, fl)) : sqrt(fmax(dp.lo, fl));
    double a_hi = dp.hi >= 0.0 ? sqrt(fmax(dp.hi, fl)) : -sqrt(fmax(-dp.hi, fl));
    a_lo -= U * fabs(a_lo);
    a_hi += U * fabs(a_hi);
    iv_t g = iv_widen_rel(iv(sig(a_lo), sig(a_hi)), (2.0 * TOL_GPU_LIBM_ULP + 2.0) * U);
    for (int64_t d = 0; d < D; d++) {
        iv_t x = iv_round(iv_add(iv_pt(bf16_to_f32(h[d])), iv_round(iv_mul(g, iv_pt(bf16_to_f32(value[d]))))));
        x = iv_bf16(x);
        olo[d] = x.lo;
        ohi[d] = x.hi;
    }
}

/* compress_pool for one (group, channel) */
static iv_t pool_model(const float *kv, const float *score, int64_t r, int64_t n, int64_t c) {
    float mx = -INFINITY;
    for (int64_t j = 0; j < r; j++) mx = score[j * n + c] > mx ? score[j * n + c] : mx;
    if (mx == -INFINITY) return iv_pt(0.0);
    iv_t E[16], sum = iv_pt(0.0);
    assert_true(r <= 16);
    for (int64_t j = 0; j < r; j++) {
        float s = score[j * n + c];
        if (s == -INFINITY) {
            E[j] = iv_pt(0.0);
            continue;
        }
        float a = s - mx; /* the same correctly rounded subtraction on both */
        double e = exp((double)a);
        E[j] = iv(fmax(e * (1.0 - EXP_REL) - 0x1p-149, 0.0), e * (1.0 + EXP_REL) + 0x1p-149);
        sum = iv_add(sum, E[j]);
    }
    sum = iv_sum(sum.lo, sum.hi, (double)r, sum.hi);
    iv_t acc = iv_pt(0.0);
    double A = 0.0;
    for (int64_t j = 0; j < r; j++) {
        if (score[j * n + c] == -INFINITY) continue;
        iv_t w = iv_div_round(E[j], sum);
        double kvj = kv[j * n + c];
        acc = iv_add(acc, iv_round(iv_mul(iv_pt(kvj), w)));
        A += fabs(kvj) * w.hi;
    }
    return iv_bf16(iv_sum(acc.lo, acc.hi, (double)r, A));
}

/* =============================================================================================
 * Norms, RoPE, QDQ */

static void rmsnorm_case(int64_t T, int64_t n, bool alias) {
    char tag[128];
    snprintf(tag, sizeof tag, "rmsnorm n=%lld T=%lld%s", (long long)n, (long long)T, alias ? " in place" : "");
    seed_tag(tag);
    bf16_t *x = NEW(bf16_t, T * n), *w = NEW(bf16_t, n), *yc = NEW(bf16_t, T * n), *yg = NEW(bf16_t, T * n);
    for (int64_t t = 0; t < T; t++) fill_act(x + t * n, n, (float)pow(10.0, -2.0 + 4.0 * urand())); /* rows 0.01..100 */
    if (T > 2) memset(x + n, 0, (size_t)n * sizeof(bf16_t)); /* a zero row: r = 1e10, y = 0 */
    for (int64_t i = 0; i < n; i++) w[i] = bf16_from_f32(1.0f + 0.3f * gauss());
    memcpy(yc, x, (size_t)(T * n) * sizeof(bf16_t));
    CPU->rmsnorm(&cpu_be, yc, alias ? yc : x, w, T, n, 1e-20f, NULL);
    bf16_t *dx = g_in(x, (size_t)(T * n) * 2), *dy = alias ? dx : g_out((size_t)(T * n) * 2, PZ_16);
    const void *dw = g_tensor(w, (size_t)n * 2, false);
    GPU->rmsnorm(&gpu_be, dy, dx, dw, T, n, 1e-20f, NULL);
    g_get(yg, dy, (size_t)(T * n) * 2);
    if (!alias) g_free(dy);
    g_free(dx);
    GPU->tensor_release(&gpu_be, dw);
    struct cmp c;
    cmp_begin(&c, "rmsnorm", "n=%lld T=%lld%s", (long long)n, (long long)T, alias ? " (y == x)" : "");
    double rho = TOL_GPU_RMSNORM_RTOL(n);
    for (int64_t t = 0; t < T; t++) {
        double ss = 0;
        for (int64_t i = 0; i < n; i++) ss += (double)bf16_to_f32(x[t * n + i]) * bf16_to_f32(x[t * n + i]);
        double r = 1.0 / sqrt(ss / (double)n + 1e-20);
        for (int64_t i = 0; i < n; i++) {
            int64_t o = t * n + i;
            double G = bf16_to_f32(yg[o]), C = bf16_to_f32(yc[o]);
            cmp_tol(&c, o, G, C, rho * (fabs(C) + ulp_bf16(C)) + TOL_GPU_RMSNORM_OUT_ULPS * ulp_bf16(fmax(fabs(G), fabs(C))));
            double y = (double)bf16_to_f32(w[i]) * bf16_to_f32(x[o]) * r;
            cmp_self(&c, o, C, y, rho * fabs(y) + ulp_bf16(fmax(fabs(C), fabs(y) * (1 + rho))));
        }
    }
    cmp_end(&c);
    free(x);
    free(w);
    free(yc);
    free(yg);
}

static void test_rmsnorm(void **st) {
    NEED_GPU(st);
    const int64_t ns[] = {DIM, Q_LORA, HD, IDX_HD}, Ts[] = {1, 8, 17, 64};
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) rmsnorm_case(Ts[j], ns[i], false);
    rmsnorm_case(8, DIM, true);
    rmsnorm_case(17, HD, true);
    const int64_t odd[] = {1, 33, 37, 100, 129};
    for (int i = 0; i < 5; i++)
        for (int j = 0; j < NT_ODD; j += 2) rmsnorm_case(T_ODD[j], odd[i], false);
}

/* fp32 frequency table of MODEL.md §3.5 (fp32 pow and reciprocal; YaRN ramp when asked) */
static void make_freqs(float *f, int64_t half, double theta, bool yarn) {
    int64_t rd = 2 * half;
    for (int64_t i = 0; i < half; i++) f[i] = 1.0f / powf((float)theta, (float)(2 * i) / (float)rd);
    if (!yarn) return;
    double lt = log(theta);
    double lo = floor((double)rd * log(65536.0 / (2 * M_PI * 32)) / (2 * lt)), hi = ceil((double)rd * log(65536.0 / (2 * M_PI)) / (2 * lt));
    lo = fmax(lo, 0.0);
    hi = fmin(hi, (double)rd - 1);
    for (int64_t i = 0; i < half; i++) {
        double ramp = hi > lo ? fmin(fmax(((double)i - lo) / (hi - lo), 0.0), 1.0) : 0.0;
        f[i] = f[i] / 16.0f * (float)ramp + f[i] * (float)(1.0 - ramp);
    }
}

/* rmsnorm with a post (RoPE, QDQ): one pass on the GPU where n % 32 == 0 up to 5,120 values, the
 * three kernels otherwise; either way the GPU's own rmsnorm, rope and qdq in turn, bit for bit
 * (each of those is checked against the CPU by its own test). */
static void rmsnorm_post_case(int64_t T, int64_t n, int64_t off, int64_t rd, enum norm_qdq q, bool alias) {
    char tag[160];
    snprintf(tag, sizeof tag, "rmsnorm post n=%lld T=%lld off=%lld rd=%lld qdq=%d%s", (long long)n, (long long)T,
             (long long)off, (long long)rd, (int)q, alias ? " in place" : "");
    seed_tag(tag);
    bf16_t *x = NEW(bf16_t, T * n), *w = NEW(bf16_t, n), *yc = NEW(bf16_t, T * n), *yg = NEW(bf16_t, T * n);
    for (int64_t t = 0; t < T; t++) fill_act(x + t * n, n, (float)pow(10.0, -2.0 + 4.0 * urand()));
    for (int64_t i = 0; i < n; i++) w[i] = bf16_from_f32(1.0f + 0.3f * gauss());
    int32_t *pos = NEW(int32_t, T);
    for (int64_t t = 0; t < T; t++) pos[t] = (int32_t)(t % 2 ? irand(1 << 20) : irand(300));
    float *freqs = NEW(float, rd / 2 + 1);
    make_freqs(freqs, rd / 2, 10000.0, false);
    bf16_t *dx = g_in(x, (size_t)(T * n) * 2), *dw = g_in(w, (size_t)n * 2);
    int32_t *dpos = g_in(pos, (size_t)T * 4);
    float *df = g_in(freqs, (size_t)(rd / 2 + 1) * 4);
    /* the three ops in turn */
    bf16_t *dy = g_out((size_t)(T * n) * 2, PZ_16);
    GPU->rmsnorm(&gpu_be, dy, dx, dw, T, n, 1e-6f, NULL);
    if (rd > 0) GPU->rope(&gpu_be, dy, T, 1, n, n, off, rd, dpos, df, false);
    if (q == NORM_QDQ_FP8_32) GPU->qdq_fp8_32(&gpu_be, dy, T * n);
    if (q == NORM_QDQ_FP4_32) GPU->qdq_fp4_32(&gpu_be, dy, T * n);
    g_get(yc, dy, (size_t)(T * n) * 2);
    g_free(dy);
    /* one op */
    const struct norm_post post = {off, rd, dpos, df, q};
    dy = alias ? dx : g_out((size_t)(T * n) * 2, PZ_16);
    GPU->rmsnorm(&gpu_be, dy, dx, dw, T, n, 1e-6f, &post);
    g_get(yg, dy, (size_t)(T * n) * 2);
    if (!alias) g_free(dy);
    g_free(dx);
    g_free(dw);
    g_free(dpos);
    g_free(df);
    struct cmp c;
    cmp_begin(&c, "rmsnorm+post", "n=%lld T=%lld off=%lld rd=%lld qdq=%d%s", (long long)n, (long long)T,
              (long long)off, (long long)rd, (int)q, alias ? " (y == x)" : "");
    cmp_bf16_exact(&c, yg, yc, T * n);
    cmp_end(&c);
    free(x);
    free(w);
    free(yc);
    free(yg);
    free(pos);
    free(freqs);
}

static void test_rmsnorm_post(void **st) {
    NEED_GPU(st);
    const int64_t Ts[] = {1, 8, 37};
    for (int i = 0; i < 3; i++) {
        rmsnorm_post_case(Ts[i], HD, HD - 64, 64, NORM_QDQ_FP8_32, true); /* the key rows */
        rmsnorm_post_case(Ts[i], 128, 64, 64, NORM_QDQ_FP4_32, true);     /* the index keys */
    }
    rmsnorm_post_case(5, HD, 0, 64, NORM_QDQ_NONE, false);      /* rope at the row's start, no QDQ */
    rmsnorm_post_case(3, DIM, 30, 10, NORM_QDQ_FP8_32, false);  /* rope from mid-chunk, over 2 chunks */
    rmsnorm_post_case(2, DIM, 0, 0, NORM_QDQ_FP4_32, false);    /* QDQ alone, 4 chunks a thread */
    rmsnorm_post_case(3, 5120 + 32, 448, 64, NORM_QDQ_FP8_32, false); /* past 5,120: the three kernels */
    rmsnorm_post_case(3, 96 + 8, 32, 16, NORM_QDQ_NONE, false);      /* n % 32 != 0: the three kernels */
    rmsnorm_post_case(2, 1024, 256, 258, NORM_QDQ_FP8_32, false);    /* past 256 rotary values: the three kernels */
}

static void rope_case(const char *name, int64_t T, int64_t nh, int64_t ld_row, int64_t ld_head, int64_t off, int64_t rd,
                      double theta, bool yarn, bool inverse) {
    char tag[160];
    snprintf(tag, sizeof tag, "rope %s T=%lld%s", name, (long long)T, inverse ? " inverse" : "");
    seed_tag(tag);
    int64_t n = T * ld_row, half = rd / 2;
    bf16_t *x = NEW(bf16_t, n), *xc = NEW(bf16_t, n), *xg = NEW(bf16_t, n);
    fill_act(x, n, 1.0f);
    memcpy(xc, x, (size_t)n * 2);
    int32_t *pos = NEW(int32_t, T);
    for (int64_t t = 0; t < T; t++)
        pos[t] = (int32_t)(t % 3 == 0 ? irand(200) : t % 3 == 1 ? irand(1 << 20) : 65536 + irand(1000));
    float *freqs = NEW(float, half);
    make_freqs(freqs, half, theta, yarn);
    CPU->rope(&cpu_be, xc, T, nh, ld_row, ld_head, off, rd, pos, freqs, inverse);
    bf16_t *dx = g_in(x, (size_t)n * 2);
    int32_t *dpos = g_in(pos, (size_t)T * 4);
    const void *df = g_tensor(freqs, (size_t)half * 4, false);
    GPU->rope(&gpu_be, dx, T, nh, ld_row, ld_head, off, rd, dpos, df, inverse);
    g_get(xg, dx, (size_t)n * 2);
    g_free(dx);
    g_free(dpos);
    GPU->tensor_release(&gpu_be, df);
    unsigned char *in_rope = calloc((size_t)n, 1);
    assert_non_null(in_rope);
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < nh; h++)
            for (int64_t i = 0; i < rd; i++) in_rope[t * ld_row + h * ld_head + off + i] = 1;
    struct cmp c;
    cmp_begin(&c, "rope", "%s T=%lld%s", name, (long long)T, inverse ? " inverse" : "");
    for (int64_t e = 0; e < n; e++) {
        double G = bf16_to_f32(xg[e]), C = bf16_to_f32(xc[e]);
        if (!in_rope[e]) { /* untouched: exact */
            cmp_bits(&c, e, xg[e], xc[e], G, C);
            continue;
        }
        int64_t p = (e - off) % ld_row % ld_head; /* position within the rope span, pairs (2i, 2i+1) */
        int64_t e0 = e - (p & 1);
        double ab = fabs(bf16_to_f32(x[e0])) + fabs(bf16_to_f32(x[e0 + 1]));
        cmp_tol(&c, e, G, C, TOL_GPU_ROPE_ATOL_U * U * ab + TOL_GPU_ROPE_OUT_ULPS * ulp_bf16(fmax(fabs(G), fabs(C))));
    }
    cmp_end(&c);
    free(in_rope);
    free(x);
    free(xc);
    free(xg);
    free(pos);
    free(freqs);
}

static void test_rope(void **st) {
    NEED_GPU(st);
    for (int i = 0; i < NT_REAL; i++) {
        int64_t T = T_REAL[i];
        rope_case("q 8 heads [448,512) theta 160000 YaRN", T, H_LOCAL, H_LOCAL * HD, HD, HD - 64, 64, 160000.0, true, false);
        rope_case("kv [448,512) theta 160000 YaRN", T, 1, HD, HD, HD - 64, 64, 160000.0, true, false);
        rope_case("index q 4 heads [64,128)", T, IDX_H_LOCAL, IDX_H_LOCAL * IDX_HD, IDX_HD, 64, 64, 160000.0, true, false);
        rope_case("o 8 heads theta 10000", T, H_LOCAL, H_LOCAL * HD, HD, HD - 64, 64, 10000.0, false, true);
    }
    for (int i = 0; i < NT_ODD; i++) {
        rope_case("odd 3 heads ld 100 row 333 off 30 rd 34", T_ODD[i], 3, 333, 100, 30, 34, 10000.0, false, false);
        rope_case("odd 3 heads ld 100 row 333 off 30 rd 34", T_ODD[i], 3, 333, 100, 30, 34, 160000.0, true, true);
        rope_case("odd 1 head rd 2", T_ODD[i], 1, 37, 37, 35, 2, 10000.0, false, false);
    }
}

/* QDQ inputs: activations with outliers, and blocks built to hit the quantizers' corners: all zero,
 * below the amax floor, one huge outlier, exact rounding ties, signed zeros and subnormals, near
 * the bf16 maximum. */
static void qdq_fill(bf16_t *x, int64_t n, int64_t B, int fp4) {
    fill_act(x, n, 1.0f);
    for (int64_t b0 = 0; b0 < n; b0 += B) {
        int64_t kind = (b0 / B) % 8;
        bf16_t *xb = x + b0;
        switch (kind) {
        case 1: memset(xb, 0, (size_t)B * 2); break;
        case 2:
            for (int64_t i = 0; i < B; i++) xb[i] = bf16_from_f32(gauss() * 1e-6f);
            break;
        case 3: xb[irand(B)] = bf16_from_f32((rnd64() & 1 ? -1.0f : 1.0f) * 3e4f); break;
        case 4: { /* amax an exact power-of-two multiple of the format max: ties at exact midpoints */
            float s = ldexpf(1.0f, (int)irand(12) - 6);
            const float t8[] = {1.0625f, 1.1875f, 2.125f, 0.0078125f * 3, 13.0f, 208.0f};
            const float t4[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
            for (int64_t i = 0; i < B; i++) {
                float v = fp4 ? t4[i % 7] : t8[i % 6];
                xb[i] = bf16_from_f32((i & 1 ? -v : v) * s);
            }
            xb[0] = bf16_from_f32((fp4 ? 6.0f : 448.0f) * s);
        } break;
        case 5:
            for (int64_t i = 0; i < B; i++) xb[i] = (bf16_t)(i & 1 ? 0x8000u : (uint16_t)(1 + irand(0x7F)));
            break;
        case 6:
            for (int64_t i = 0; i < B; i++) xb[i] = bf16_from_f32(gauss() * 1e37f);
            break;
        default: break;
        }
    }
}

/* Every bf16 bit pattern twice (n = 2^17): in order, so a block of B consecutive codes is quantized
 * under a scale near its own magnitude; then again with each block's first value replaced by an
 * outlier 2^4 .. 2^19 times the block's last (largest) magnitude, so the others land in the
 * formats' subnormals or round to zero (and past the bf16 range the outlier is infinite). finite:
 * the infinities and NaNs of the patterns are zeros instead — the e2m1 quantizers keep a NaN
 * quotient's sign bit as a signed zero, and inf / inf is the host's default NaN (negative on
 * x86-64) on the CPU but the positive canonical NaN on the GPU. */
static void qdq_fill_all(bf16_t *x, int64_t B, bool finite) {
    for (int64_t i = 0; i < 65536; i++) {
        const bool nonfinite = (i & 0x7f80) == 0x7f80;
        x[i] = x[65536 + i] = finite && nonfinite ? (bf16_t)0 : (bf16_t)i;
    }
    for (int64_t i = 0; i < 65536; i += B) {
        const float top = bf16_to_f32(x[i + B - 1]), out = ldexpf(top, 4 + (int)((i / B) % 16));
        const bf16_t ob = bf16_from_f32(out);
        if (top == top && (!finite || isfinite(bf16_to_f32(ob)))) x[65536 + i] = ob;
    }
}

static void qdq_run(int which, int64_t n, const char *what, bool every) {
    static const char *names[] = {"qdq_fp8_32", "qdq_fp4_32", "qdq_fp4_16"};
    int64_t B = which == 2 ? 16 : 32;
    char tag[128];
    snprintf(tag, sizeof tag, "%s %s n=%lld", names[which], what, (long long)n);
    seed_tag(tag);
    bf16_t *x = NEW(bf16_t, n), *xg = NEW(bf16_t, n);
    if (every)
        qdq_fill_all(x, B, which != 0); /* n = 2^17 */
    else
        qdq_fill(x, n, B, which != 0);
    bf16_t *dx = g_in(x, (size_t)n * 2);
    void (*cf[])(struct backend *, bf16_t *, int64_t) = {CPU->qdq_fp8_32, CPU->qdq_fp4_32, CPU->qdq_fp4_16};
    void (*gf[])(struct backend *, bf16_t *, int64_t) = {GPU->qdq_fp8_32, GPU->qdq_fp4_32, GPU->qdq_fp4_16};
    cf[which](&cpu_be, x, n);
    gf[which](&gpu_be, dx, n);
    g_get(xg, dx, (size_t)n * 2);
    g_free(dx);
    struct cmp c;
    cmp_begin(&c, names[which], "%s n=%lld", what, (long long)n);
    cmp_bf16_exact(&c, xg, x, n);
    cmp_end(&c);
    free(x);
    free(xg);
}

static void qdq_case(int which, int64_t n, const char *what) { qdq_run(which, n, what, false); }

/* The tensor-core linears' activation quantization (cuda_linear_mma_act_quant: 4 threads per
 * 32-group, mma_quant8, the quantizer the routed-expert and shared-expert epilogues share in its
 * 2-per-thread form) on every bf16 pattern, against the CPU's act_quant_fp8_32: each stored value
 * is bf16(e4m3 value · scale) at its k-permuted place (position 8c + 2t + e of a group holds
 * k = 8t + 2c + e), bit for bit (a NaN only as a NaN: its payload feeds nothing but the mma). */
static void test_mma_act_quant(void **st) {
    NEED_GPU(st);
#ifndef DS_HAVE_CUDA
    skip();
#else
    if (gpu_state != 1) skip(); /* a CUDA kernel called directly: no CPU stand-in */
    const int64_t n = 131072, k = 4096, T = n / k;
    bf16_t *x = NEW(bf16_t, n), *xg = NEW(bf16_t, n), *xr = NEW(bf16_t, n);
    uint8_t *q = NEW(uint8_t, n);
    float *s = NEW(float, n / 32);
    qdq_fill_all(x, 32, false);
    act_quant_fp8_32(x, (size_t)n, q, s);
    for (int64_t g = 0; g < n / 32; g++)
        for (int p = 0; p < 32; p++) {
            const int c = p / 8, t = (p % 8) / 2, e = p % 2;
            xr[g * 32 + p] = bf16_from_f32(e4m3_to_f32(q[g * 32 + 8 * t + 2 * c + e]) * s[g]);
        }
    void *dx = g_in(x, (size_t)n * 2), *dq = g_out((size_t)n * 2, PZ_16);
    cuda_linear_mma_act_quant(dq, dx, T, k, NULL);
    /* the legacy default stream: the backend's own stream, where g_get downloads, does not wait for it */
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
    g_get(xg, dq, (size_t)n * 2);
    struct cmp c;
    cmp_begin(&c, "mma act quant", "every bf16 pattern, n=%lld", (long long)n);
    for (int64_t i = 0; i < n; i++) {
        const float a = bf16_to_f32(xg[i]), b = bf16_to_f32(xr[i]);
        if (a != a && b != b) continue;
        cmp_bits(&c, i, xg[i], xr[i], a, b);
    }
    cmp_end(&c);
    g_free(dx);
    g_free(dq);
    free(x), free(xg), free(xr), free(q), free(s);
#endif
}

/* The tensor-core kernels' in-register weight decodes (e2m1x8_to_bf16x2, e4m3x8_to_bf16x2 of
 * mma_sm80.cuh) on every 32-bit word of codes, against the CPU's e2m1_to_f32 / e4m3_to_f32 rounded
 * to bf16 (exact: every e2m1 and e4m3 value is a bf16), bit for bit, signed zeros included; e4m3
 * NaN codes as the +-480 the kernels document. A wrong table entry, a sign taken from the
 * neighbouring code or bits leaking across codes would each fail. */
static void test_mma_weight_decode(void **st) {
    NEED_GPU(st);
#ifndef DS_HAVE_CUDA
    skip();
#else
    if (gpu_state != 1) skip(); /* a CUDA kernel called directly: no CPU stand-in */
    uint16_t t2[16], t8[256];
    for (int c = 0; c < 16; c++) t2[c] = bf16_from_f32(e2m1_to_f32((uint8_t)c));
    for (int b = 0; b < 256; b++) {
        const float v = (b & 0x7f) == 0x7f ? ((b & 0x80) ? -480.0f : 480.0f) : e4m3_to_f32((uint8_t)b);
        t8[b] = bf16_from_f32(v);
    }
    assert_true(t2[8] == 0x8000 && t8[0x80] == 0x8000); /* the tables keep -0 */
    uint32_t first = 0;
    const int64_t bad = cuda_linear_mma_decode_check(t2, t8, &first);
    if (bad) fprintf(stderr, "  weight decode: %lld of 2^32 words differ, first 0x%08x\n", (long long)bad, first);
    else fprintf(stderr, "  weight decode: all 2^32 words of e2m1 and e4m3 codes as the CPU's values\n");
    assert_int_equal(bad, 0);
#endif
}

static void test_qdq(void **st) {
    NEED_GPU(st);
    for (int i = 0; i < NT_REAL; i++) {
        qdq_case(0, T_REAL[i] * HD, "window kv rows");
        qdq_case(1, T_REAL[i] * IDX_H_LOCAL * IDX_HD, "index q rows");
        qdq_case(2, T_REAL[i] * HD, "compressed kv rows");
    }
    qdq_case(0, 64 * HD, "window kv rows");
    qdq_case(1, 2048 * IDX_HD, "index keys");
    for (int w = 0; w < 3; w++) qdq_run(w, 131072, "every bf16 pattern", true);
    const int64_t odd[] = {1, 3, 33, 37, 129};
    for (int i = 0; i < 5; i++) {
        qdq_case(0, 32 * odd[i], "odd");
        qdq_case(1, 32 * odd[i], "odd");
        qdq_case(2, 16 * odd[i], "odd");
    }
}

/* =============================================================================================
 * mHC */

/* The residual stream: per-copy RMS spread over 0.5..20, outliers. */
static void fill_stream(bf16_t *X, int64_t T, int64_t hc, int64_t D) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t c = 0; c < hc; c++) fill_act(X + (t * hc + c) * D, D, (float)(0.5 + 19.5 * urand() * urand()));
}

static void hc_mixes_case(int64_t T, int64_t D, int iters) {
    const int64_t hc = HC, L = hc * D, nm = (2 + hc) * hc;
    char tag[128];
    snprintf(tag, sizeof tag, "hc_mixes D=%lld T=%lld iters=%d", (long long)D, (long long)T, iters);
    seed_tag(tag);
    bf16_t *X = NEW(bf16_t, T * L);
    fill_stream(X, T, hc, D);
    float *fn = NEW(float, nm * L), scale[3], base[(2 + HC) * HC];
    fill_f32(fn, nm * L, 0.0f, (float)(1.0 / sqrt((double)L)) * 2.0f);
    scale[0] = 0.8f + 0.2f * gauss();
    scale[1] = 0.6f + 0.2f * gauss();
    scale[2] = 1.5f + 0.3f * gauss();
    fill_f32(base, nm, 0.0f, 0.5f);
    float *pc = NEW(float, T * hc), *qc = NEW(float, T * hc), *cc = NEW(float, T * hc * hc);
    float *pg = NEW(float, T * hc), *qg = NEW(float, T * hc), *cg = NEW(float, T * hc * hc);
    CPU->hc_mixes(&cpu_be, pc, qc, cc, X, T, hc, D, fn, scale, base, iters, 1e-20f, 1e-6f);
    void *dX = g_in(X, (size_t)(T * L) * 2);
    float *dp = g_out((size_t)(T * hc) * 4, PZ_32F), *dq = g_out((size_t)(T * hc) * 4, PZ_32F),
          *dc = g_out((size_t)(T * hc * hc) * 4, PZ_32F);
    const float *dfn = g_tensor(fn, (size_t)(nm * L) * 4, false), *dsc = g_tensor(scale, sizeof scale, false),
                *dba = g_tensor(base, (size_t)nm * 4, false);
    GPU->hc_mixes(&gpu_be, dp, dq, dc, dX, T, hc, D, dfn, dsc, dba, iters, 1e-20f, 1e-6f);
    g_get(pg, dp, (size_t)(T * hc) * 4);
    g_get(qg, dq, (size_t)(T * hc) * 4);
    g_get(cg, dc, (size_t)(T * hc * hc) * 4);
    g_free(dX);
    g_free(dp);
    g_free(dq);
    g_free(dc);
    GPU->tensor_release(&gpu_be, dfn);
    GPU->tensor_release(&gpu_be, dsc);
    GPU->tensor_release(&gpu_be, dba);
    struct cmp c[3];
    cmp_begin(&c[0], "hc_mixes", "pre D=%lld T=%lld iters=%d", (long long)D, (long long)T, iters);
    cmp_begin(&c[1], "hc_mixes", "post D=%lld T=%lld iters=%d", (long long)D, (long long)T, iters);
    cmp_begin(&c[2], "hc_mixes", "comb D=%lld T=%lld iters=%d", (long long)D, (long long)T, iters);
    for (int64_t t = 0; t < T; t++) {
        struct hc_bound b;
        hc_model(X + t * L, hc, D, fn, scale, base, iters, 1e-20f, 1e-6f, &b);
        for (int64_t j = 0; j < hc; j++) {
            int64_t o = t * hc + j;
            cmp_tol(&c[0], o, pg[o], pc[o], b.pre_r[j]);
            cmp_self(&c[0], o, pc[o], b.pre_c[j], b.pre_r[j]);
            cmp_tol(&c[1], o, qg[o], qc[o], b.post_r[j]);
            cmp_self(&c[1], o, qc[o], b.post_c[j], b.post_r[j]);
        }
        for (int64_t f = 0; f < hc * hc; f++) {
            int64_t o = t * hc * hc + f;
            cmp_tol(&c[2], o, cg[o], cc[o], b.comb_r[f]);
            cmp_self(&c[2], o, cc[o], b.comb_c[f], b.comb_r[f]);
        }
    }
    for (int i = 0; i < 3; i++) cmp_end(&c[i]);
    free(X);
    free(fn);
    free(pc);
    free(qc);
    free(cc);
    free(pg);
    free(qg);
    free(cg);
}

static void test_hc_mixes(void **st) {
    NEED_GPU(st);
    for (int i = 0; i < NT_REAL; i++) hc_mixes_case(T_REAL[i], DIM, 20);
    hc_mixes_case(100, DIM, 20); /* from HC_R_BIG_T rows on, the larger row blocks (the last one partial) */
    hc_mixes_case(300, DIM, 20); /* above ROW_WIDE_T (256) rows: the finish kernel's narrow CTA */
    const int64_t odd[] = {1, 33, 129};
    for (int i = 0; i < 3; i++) {
        hc_mixes_case(3, odd[i], 20);
        hc_mixes_case(1, odd[i], 1);
        hc_mixes_case(17, odd[i], 3);
        hc_mixes_case(70, odd[i], 3);
    }
}

static void hc_elementwise_case(int64_t T, int64_t D) {
    const int64_t hc = HC;
    char tag[128];
    snprintf(tag, sizeof tag, "hc collapse/expand/init D=%lld T=%lld", (long long)D, (long long)T);
    seed_tag(tag);
    bf16_t *X = NEW(bf16_t, T * hc * D), *y = NEW(bf16_t, T * D), *e = NEW(bf16_t, T * D);
    fill_stream(X, T, hc, D);
    fill_act(y, T * D, 1.0f);
    fill_act(e, T * D, 0.05f);
    float *p = NEW(float, T * hc), *post = NEW(float, T * hc), *comb = NEW(float, T * hc * hc);
    for (int64_t i = 0; i < T * hc; i++) {
        p[i] = (float)urand() + 1e-6f;
        post[i] = 2.0f * (float)urand();
    }
    for (int64_t i = 0; i < T * hc * hc; i++) comb[i] = (float)urand() * 0.5f;
    struct cmp c;
    void *dX = g_in(X, (size_t)(T * hc * D) * 2), *dy = g_in(y, (size_t)(T * D) * 2), *de = g_in(e, (size_t)(T * D) * 2);
    void *dp = g_in(p, (size_t)(T * hc) * 4), *dpost = g_in(post, (size_t)(T * hc) * 4), *dcomb = g_in(comb, (size_t)(T * hc * hc) * 4);
    /* collapse */
    bf16_t *oc = NEW(bf16_t, T * hc * D), *og = NEW(bf16_t, T * hc * D);
    CPU->hc_collapse(&cpu_be, oc, X, p, T, hc, D, NULL, 0.0f);
    void *dout = g_out((size_t)(T * D) * 2, PZ_16);
    GPU->hc_collapse(&gpu_be, dout, dX, dp, T, hc, D, NULL, 0.0f);
    g_get(og, dout, (size_t)(T * D) * 2);
    g_free(dout);
    cmp_begin(&c, "hc_collapse", "D=%lld T=%lld", (long long)D, (long long)T);
    cmp_bf16_exact(&c, og, oc, T * D);
    cmp_end(&c);
    /* collapse with the block's rmsnorm (one pass for D % 8 == 0 up to 8192, the two kernels
     * otherwise): the GPU's own collapse then rmsnorm, bit for bit (each of them is checked against
     * the CPU: above, and test_rmsnorm within its bound) */
    bf16_t *wn = NEW(bf16_t, D);
    for (int64_t i = 0; i < D; i++) wn[i] = bf16_from_f32(1.0f + 0.3f * gauss());
    void *dwn = g_in(wn, (size_t)D * 2);
    dout = g_out((size_t)(T * D) * 2, PZ_16);
    GPU->hc_collapse(&gpu_be, dout, dX, dp, T, hc, D, NULL, 0.0f);
    GPU->rmsnorm(&gpu_be, dout, dout, dwn, T, D, 1e-6f, NULL);
    g_get(oc, dout, (size_t)(T * D) * 2);
    g_free(dout);
    dout = g_out((size_t)(T * D) * 2, PZ_16);
    GPU->hc_collapse(&gpu_be, dout, dX, dp, T, hc, D, dwn, 1e-6f);
    g_get(og, dout, (size_t)(T * D) * 2);
    g_free(dout);
    g_free(dwn);
    free(wn);
    cmp_begin(&c, "hc_collapse+norm", "D=%lld T=%lld", (long long)D, (long long)T);
    cmp_bf16_exact(&c, og, oc, T * D);
    cmp_end(&c);
    /* expand */
    CPU->hc_expand(&cpu_be, oc, y, X, post, comb, T, hc, D);
    dout = g_out((size_t)(T * hc * D) * 2, PZ_16);
    GPU->hc_expand(&gpu_be, dout, dy, dX, dpost, dcomb, T, hc, D);
    g_get(og, dout, (size_t)(T * hc * D) * 2);
    g_free(dout);
    cmp_begin(&c, "hc_expand", "D=%lld T=%lld", (long long)D, (long long)T);
    cmp_bf16_exact(&c, og, oc, T * hc * D);
    cmp_end(&c);
    /* init */
    float *prc = NEW(float, T * hc), *prg = NEW(float, T * hc);
    CPU->hc_init(&cpu_be, oc, prc, e, T, hc, D);
    dout = g_out((size_t)(T * hc * D) * 2, PZ_16);
    void *dpre = g_out((size_t)(T * hc) * 4, PZ_32F);
    GPU->hc_init(&gpu_be, dout, dpre, de, T, hc, D);
    g_get(og, dout, (size_t)(T * hc * D) * 2);
    g_get(prg, dpre, (size_t)(T * hc) * 4);
    g_free(dout);
    g_free(dpre);
    cmp_begin(&c, "hc_init", "D=%lld T=%lld", (long long)D, (long long)T);
    cmp_bf16_exact(&c, og, oc, T * hc * D);
    cmp_f32_exact(&c, prg, prc, T * hc);
    cmp_end(&c);
    g_free(dX);
    g_free(dy);
    g_free(de);
    g_free(dp);
    g_free(dpost);
    g_free(dcomb);
    free(X);
    free(y);
    free(e);
    free(p);
    free(post);
    free(comb);
    free(oc);
    free(og);
    free(prc);
    free(prg);
}

static void test_hc_collapse_expand_init(void **st) {
    NEED_GPU(st);
    for (int i = 0; i < NT_REAL; i++) hc_elementwise_case(T_REAL[i], DIM);
    hc_elementwise_case(64, DIM);
    hc_elementwise_case(300, DIM); /* above ROW_WIDE_T (256) rows: the collapse + norm's narrow CTA */
    const int64_t odd[] = {1, 37, 129};
    for (int i = 0; i < 3; i++) hc_elementwise_case(i == 1 ? 17 : 3, odd[i]);
    hc_elementwise_case(3, 8200); /* above the fused collapse + norm's 8192: the two kernels */
    hc_elementwise_case(2, 8192); /* its largest row */
}

/* =============================================================================================
 * Embedding, Engram */

static void embed_case(int64_t T, int64_t nrows, int64_t D, int64_t row0, int64_t vocab) {
    char tag[128];
    snprintf(tag, sizeof tag, "embed rows=%lld D=%lld T=%lld", (long long)nrows, (long long)D, (long long)T);
    seed_tag(tag);
    bf16_t *tab = NEW(bf16_t, nrows * D), *ec = NEW(bf16_t, T * D), *eg = NEW(bf16_t, T * D);
    fill_gauss_bf16(tab, nrows * D, 0.02f);
    int32_t *ids = NEW(int32_t, T);
    for (int64_t t = 0; t < T; t++) ids[t] = (int32_t)(t % 3 == 0 ? row0 + irand(nrows) : irand(vocab)); /* ~1/8 else */
    if (T > 2) ids[1] = (int32_t)(row0 + nrows - 1), ids[2] = (int32_t)(row0 + nrows);                 /* the edges */
    CPU->embed(&cpu_be, ec, ids, T, tab, row0, nrows, D);
    const void *dt = g_tensor(tab, (size_t)(nrows * D) * 2, false);
    void *di = g_in(ids, (size_t)T * 4), *de = g_out((size_t)(T * D) * 2, PZ_16);
    GPU->embed(&gpu_be, de, di, T, dt, row0, nrows, D);
    g_get(eg, de, (size_t)(T * D) * 2);
    g_free(di);
    g_free(de);
    GPU->tensor_release(&gpu_be, dt);
    struct cmp c;
    cmp_begin(&c, "embed", "rows [%lld,+%lld) D=%lld T=%lld", (long long)row0, (long long)nrows, (long long)D, (long long)T);
    cmp_bf16_exact(&c, eg, ec, T * D);
    cmp_end(&c);
    free(tab);
    free(ec);
    free(eg);
    free(ids);
}

static void test_embed(void **st) {
    NEED_GPU(st);
    const int64_t Ts[] = {1, 8, 64};
    for (int i = 0; i < 3; i++) embed_case(Ts[i], VOCAB_LOCAL, DIM, RANK * VOCAB_LOCAL, VOCAB);
    embed_case(17, 37, 33, 100, 1000);
    embed_case(3, 1, 129, 5, 10);
}

static void engram_gather_case(int64_t T, int64_t C, int64_t nrows, int64_t hd, int64_t row0) {
    char tag[128];
    snprintf(tag, sizeof tag, "engram_gather C=%lld hd=%lld T=%lld", (long long)C, (long long)hd, (long long)T);
    seed_tag(tag);
    uint8_t *tab = NEW(uint8_t, nrows * hd), *sc = NEW(uint8_t, nrows * (hd / 32));
    for (int64_t i = 0; i < nrows * hd; i++) {
        uint8_t b = (uint8_t)rnd64();
        tab[i] = (b & 0x7F) == 0x7F ? (uint8_t)(b ^ 1) : b; /* no NaN codes */
    }
    for (int64_t i = 0; i < nrows * (hd / 32); i++) sc[i] = (uint8_t)(115 + irand(21));
    for (int64_t r = 0; r < nrows; r += 97) { /* padding rows of the sharded table: weight 0, scale 1 */
        memset(tab + r * hd, 0, (size_t)hd);
        memset(sc + r * (hd / 32), 127, (size_t)(hd / 32));
    }
    int64_t *ids = NEW(int64_t, T * C);
    for (int64_t i = 0; i < T * C; i++) {
        int64_t k = irand(4);
        ids[i] = k < 2 ? row0 + irand(nrows) : k == 2 ? irand(row0 > 0 ? row0 : 1) : row0 + nrows + irand(384006168);
    }
    ids[0] = row0;
    if (T * C > 1) ids[T * C - 1] = row0 + nrows;
    bf16_t *rc = NEW(bf16_t, T * C * hd), *rg = NEW(bf16_t, T * C * hd);
    CPU->engram_gather(&cpu_be, rc, ids, T, C, tab, sc, row0, nrows, hd);
    const void *dt = g_tensor(tab, (size_t)(nrows * hd), true), *ds = g_tensor(sc, (size_t)(nrows * (hd / 32)), true);
    void *di = g_in(ids, (size_t)(T * C) * 8), *dr = g_out((size_t)(T * C * hd) * 2, PZ_16);
    GPU->engram_gather(&gpu_be, dr, di, T, C, dt, ds, row0, nrows, hd);
    g_get(rg, dr, (size_t)(T * C * hd) * 2);
    g_free(di);
    g_free(dr);
    GPU->tensor_release(&gpu_be, dt);
    GPU->tensor_release(&gpu_be, ds);
    struct cmp c;
    cmp_begin(&c, "engram_gather", "host-resident rows=%lld C=%lld hd=%lld T=%lld", (long long)nrows, (long long)C,
              (long long)hd, (long long)T);
    cmp_bf16_exact(&c, rg, rc, T * C * hd);
    cmp_end(&c);
    free(tab);
    free(sc);
    free(ids);
    free(rc);
    free(rg);
}

static void test_engram_gather(void **st) {
    NEED_GPU(st);
    const int64_t row0 = (int64_t)RANK * 48000771; /* ceil(384006168 / 8) rows per rank */
    for (int i = 0; i < NT_REAL; i++) engram_gather_case(T_REAL[i], 24, 100003, 256, row0);
    engram_gather_case(3, 1, 1, 32, 7);
    engram_gather_case(17, 5, 37, 96, 0);
}

static void engram_gate_case(int64_t T, int64_t D) {
    const int64_t hc = HC;
    char tag[128];
    snprintf(tag, sizeof tag, "engram_gate D=%lld T=%lld", (long long)D, (long long)T);
    seed_tag(tag);
    bf16_t *X = NEW(bf16_t, T * hc * D), *kv = NEW(bf16_t, T * (hc + 1) * D), *Xc = NEW(bf16_t, T * hc * D),
           *Xg = NEW(bf16_t, T * hc * D);
    fill_stream(X, T, hc, D);
    if (T > 1) memset(X + (1 * hc + 2) * D, 0, (size_t)D * 2); /* a zero copy: dot = 0, the 1e-6 floor */
    for (int64_t t = 0; t < T; t++) {
        fill_act(kv + t * (hc + 1) * D, hc * D, 1.0f);
        fill_act(kv + t * (hc + 1) * D + hc * D, D, 0.3f);
    }
    float *w = NEW(float, hc * D);
    for (int64_t i = 0; i < hc * D; i++)
        w[i] = bf16_to_f32(bf16_from_f32(1.0f + 0.2f * gauss())) * bf16_to_f32(bf16_from_f32(1.0f + 0.2f * gauss()));
    memcpy(Xc, X, (size_t)(T * hc * D) * 2);
    CPU->engram_gate(&cpu_be, Xc, kv, w, T, hc, D, 1e-20f);
    void *dX = g_in(X, (size_t)(T * hc * D) * 2), *dkv = g_in(kv, (size_t)(T * (hc + 1) * D) * 2);
    const void *dw = g_tensor(w, (size_t)(hc * D) * 4, false);
    GPU->engram_gate(&gpu_be, dX, dkv, dw, T, hc, D, 1e-20f);
    g_get(Xg, dX, (size_t)(T * hc * D) * 2);
    g_free(dX);
    g_free(dkv);
    GPU->tensor_release(&gpu_be, dw);
    double *lo = NEW(double, D), *hi = NEW(double, D);
    struct cmp c;
    cmp_begin(&c, "engram_gate", "D=%lld T=%lld", (long long)D, (long long)T);
    for (int64_t t = 0; t < T; t++)
        for (int64_t ci = 0; ci < hc; ci++) {
            const bf16_t *kvr = kv + t * (hc + 1) * D;
            gate_model(X + (t * hc + ci) * D, kvr + ci * D, kvr + hc * D, w + ci * D, D, 1e-20f, lo, hi);
            for (int64_t d = 0; d < D; d++) {
                int64_t o = (t * hc + ci) * D + d;
                cmp_iv(&c, o, bf16_to_f32(Xg[o]), bf16_to_f32(Xc[o]), iv(lo[d], hi[d]));
            }
        }
    cmp_end(&c);
    free(X);
    free(kv);
    free(Xc);
    free(Xg);
    free(w);
    free(lo);
    free(hi);
}

static void test_engram_gate(void **st) {
    NEED_GPU(st);
    for (int i = 0; i < NT_REAL; i++) engram_gate_case(T_REAL[i], DIM);
    const int64_t odd[] = {1, 33, 129};
    for (int i = 0; i < 3; i++) engram_gate_case(3, odd[i]);
    engram_gate_case(300, DIM); /* 1,200 rows, above EG_WIDE_ROWS: a warp per row */
    engram_gate_case(300, 33);
}

/* =============================================================================================
 * interleave: exact */

static void interleave_case(int64_t S, int64_t T, size_t bytes) {
    char tag[96];
    snprintf(tag, sizeof tag, "interleave S=%lld T=%lld bytes=%zu", (long long)S, (long long)T, bytes);
    seed_tag(tag);
    size_t total = (size_t)(S * T) * bytes;
    uint8_t *src = NEW(uint8_t, total), *dc = NEW(uint8_t, total), *dg = NEW(uint8_t, total);
    for (size_t i = 0; i < total; i++) src[i] = (uint8_t)rnd64();
    CPU->interleave(&cpu_be, dc, src, S, T, bytes);
    void *ds = g_in(src, total), *dd = g_out(total + (total & 1), PZ_16);
    GPU->interleave(&gpu_be, dd, ds, S, T, bytes);
    g_get(dg, dd, total);
    g_free(ds);
    g_free(dd);
    struct cmp c;
    cmp_begin(&c, "interleave", "S=%lld T=%lld bytes=%zu", (long long)S, (long long)T, bytes);
    for (size_t i = 0; i < total; i++) cmp_bits(&c, (long long)i, dg[i], dc[i], dg[i], dc[i]);
    cmp_end(&c);
    free(src);
    free(dc);
    free(dg);
}

static void test_interleave(void **st) {
    NEED_GPU(st);
    for (int i = 0; i < NT_REAL; i++) {
        interleave_case(8, T_REAL[i], (DIM / 8) * 2);      /* per-rank column blocks of bf16 rows */
        interleave_case(8, T_REAL[i], (N_EXPERTS / 8) * 4); /* fp32 logits/scores blocks */
    }
    interleave_case(3, 17, 6);
    interleave_case(5, 1, 37 * 4);
    interleave_case(2, 64, 1);
}

/* =============================================================================================
 * Attention: sparse_attn, compress_pool, index_scores */

/* The kv rows one sparse_attn call reads: WINDOW window rows (FP8 QDQ'd) then ncomp compressed rows
 * (FP4/16 QDQ'd), all RMS-normalized-looking. */
static bf16_t *make_attn_kv(int64_t nkv, int64_t hd) {
    bf16_t *kv = NEW(bf16_t, nkv * hd);
    fill_act(kv, nkv * hd, 1.0f);
    int64_t nw = nkv < WINDOW ? nkv : WINDOW;
    qdq_fp8_32(kv, (size_t)(nw * hd));
    if (nkv > nw) qdq_fp4_16_e4m3(kv + nw * hd, (size_t)((nkv - nw) * hd));
    return kv;
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Index rows as MODEL.md §3.9 builds them (window part then compressed part, −1 = unused but still
 * in its slot), by kind: decode late, decode early (leading −1), prefill-like (trailing −1), no
 * valid entry at all, random holes with a whole 64-block of −1. For n_idx != 640 the row is filled
 * from kv rows with the same kinds of holes. */
static void make_idx_row(int32_t *ir, int64_t n_idx, int64_t nkv, int64_t t) {
    int kind = (int)(t % 5);
    for (int64_t i = 0; i < n_idx; i++) ir[i] = -1;
    if (kind == 3) return;
    if (n_idx == WINDOW + INDEX_TOPK && nkv > WINDOW + INDEX_TOPK) {
        int64_t ncomp = nkv - WINDOW;
        if (kind == 0 || kind == 4) { /* ring oldest first, then 512 ascending compressed entries */
            int64_t p = 127 + irand(100000);
            for (int64_t i = 0; i < WINDOW; i++) ir[i] = (int32_t)((p + 1 + i) % WINDOW);
            int64_t vis = ncomp / 2 + irand(ncomp / 2), cnt = vis < INDEX_TOPK ? vis : INDEX_TOPK;
            for (int64_t i = 0; i < cnt; i++) {
                int32_t c;
                do c = (int32_t)irand(vis);
                while (i32_in(ir + WINDOW, i, c + WINDOW));
                ir[WINDOW + i] = c + WINDOW;
            }
            qsort(ir + WINDOW, (size_t)cnt, sizeof(int32_t), cmp_i32);
            if (kind == 4) {
                for (int64_t i = 0; i < n_idx; i++)
                    if (urand() < 0.3) ir[i] = -1;
                for (int64_t i = 256; i < 320; i++) ir[i] = -1;
            }
        } else if (kind == 1) { /* early decode: p < 127, leading −1, (p+1)/2 compressed visible */
            int64_t p = irand(127);
            for (int64_t i = 0; i <= p; i++) ir[WINDOW - 1 - p + i] = (int32_t)i;
            for (int64_t i = 0; i < (p + 1) / 2; i++) ir[WINDOW + i] = (int32_t)(WINDOW + i);
        } else { /* prefill row i: window positions 0..i, trailing −1 */
            int64_t i0 = irand(WINDOW);
            for (int64_t i = 0; i <= i0; i++) ir[i] = (int32_t)i;
            for (int64_t i = 0; i < 40; i++) ir[WINDOW + i] = (int32_t)(WINDOW + 3 * i);
        }
        return;
    }
    for (int64_t i = 0; i < n_idx; i++) ir[i] = urand() < (kind == 4 ? 0.5 : 0.9) ? (int32_t)irand(nkv) : -1;
    if (kind == 1 && n_idx > 64)
        for (int64_t i = 0; i < 64; i++) ir[i] = -1; /* a first block with nothing valid */
}

struct attn_in {
    int64_t T, H, hd, n_idx, nkv;
    bf16_t *q, *kv;
    int32_t *idx;
    float *sink, scale;
};

static struct attn_in make_attn(const char *tag, int64_t T, int64_t H, int64_t hd, int64_t n_idx, int64_t nkv) {
    struct attn_in a = {T, H, hd, n_idx, nkv, NULL, NULL, NULL, NULL, (float)(1.0 / sqrt((double)hd))};
    seed_tag(tag);
    a.kv = make_attn_kv(nkv, hd);
    a.q = NEW(bf16_t, T * H * hd);
    for (int64_t th = 0; th < T * H; th++) fill_act(a.q + th * hd, hd, th % 4 == 3 ? 4.0f : 1.5f); /* some peaky heads */
    a.idx = NEW(int32_t, T * n_idx);
    for (int64_t t = 0; t < T; t++) make_idx_row(a.idx + t * n_idx, n_idx, nkv, t);
    a.sink = NEW(float, H);
    fill_f32(a.sink, H, 0.0f, 2.0f);
    return a;
}

static void free_attn(struct attn_in *a) {
    free(a->q);
    free(a->kv);
    free(a->idx);
    free(a->sink);
}

static void sparse_attn_case(const char *name, int64_t T, int64_t H, int64_t hd, int64_t n_idx, int64_t nkv) {
    char tag[160];
    snprintf(tag, sizeof tag, "sparse_attn %s T=%lld", name, (long long)T);
    struct attn_in a = make_attn(tag, T, H, hd, n_idx, nkv);
    bf16_t *oc = NEW(bf16_t, T * H * hd), *og = NEW(bf16_t, T * H * hd);
    CPU->sparse_attn(&cpu_be, oc, a.q, a.kv, a.idx, T, H, hd, n_idx, a.sink, a.scale);
    void *dq = g_in(a.q, (size_t)(T * H * hd) * 2), *dkv = g_in(a.kv, (size_t)(nkv * hd) * 2),
         *di = g_in(a.idx, (size_t)(T * n_idx) * 4), *dout = g_out((size_t)(T * H * hd) * 2, PZ_16);
    const void *ds = g_tensor(a.sink, (size_t)H * 4, false);
    GPU->sparse_attn(&gpu_be, dout, dq, dkv, di, T, H, hd, n_idx, ds, a.scale);
    g_get(og, dout, (size_t)(T * H * hd) * 2);
    g_free(dq);
    g_free(dkv);
    g_free(di);
    g_free(dout);
    GPU->tensor_release(&gpu_be, ds);
    double *lo = NEW(double, T * H * hd), *hi = NEW(double, T * H * hd);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t th = 0; th < T * H; th++)
        attn_model(a.q + th * hd, a.kv, a.idx + (th / H) * n_idx, n_idx, hd, a.sink[th % H], a.scale, lo + th * hd, hi + th * hd);
    struct cmp c;
    cmp_begin(&c, "sparse_attn", "%s T=%lld", name, (long long)T);
    for (int64_t i = 0; i < T * H * hd; i++) cmp_iv(&c, i, bf16_to_f32(og[i]), bf16_to_f32(oc[i]), iv(lo[i], hi[i]));
    cmp_end(&c);
    free(lo);
    free(hi);
    free(oc);
    free(og);
    free_attn(&a);
}

/* Both paths: the exact kernels (mma switch off) and the tensor-core kernels (on; the two-pass
 * form's column slices of 16, 32 and 64 channels at T = 1, 17 and 64, the one-pass form from 80
 * rows: T = 128 and the odd 3-head case at 129; the two passes' split softmax + P·V, which the op
 * takes from 128 rows only where the one pass does not fit, in test_sparse_attn_forms). hd = 96
 * does not fit the tensor-core kernels (hd % 64): with the switch on it must take the exact ones. */
static void test_sparse_attn(void **st) {
    NEED_GPU(st);
    for (int mma = 0; mma < 2; mma++) {
        mma_switch(mma);
        const char *p = mma ? "mma " : "";
        char nm[96];
        snprintf(nm, sizeof nm, "%s8 heads, window 128 + top-512 of 2048", p);
        for (int i = 0; i < NT_REAL; i++) sparse_attn_case(nm, T_REAL[i], H_LOCAL, HD, WINDOW + INDEX_TOPK, WINDOW + 2048);
        if (mma) sparse_attn_case(nm, 64, H_LOCAL, HD, WINDOW + INDEX_TOPK, WINDOW + 2048);
        if (mma) sparse_attn_case(nm, 128, H_LOCAL, HD, WINDOW + INDEX_TOPK, WINDOW + 2048); /* the split kernels */
        const int64_t odd_n[] = {1, 37, 100, 129};
        for (int i = 0; i < 4; i++) {
            snprintf(nm, sizeof nm, "%sodd n_idx=%lld 3 heads", p, (long long)odd_n[i]);
            sparse_attn_case(nm, i & 1 ? 17 : (i == 2 && mma ? 129 : 3), 3, HD, odd_n[i], 300);
            snprintf(nm, sizeof nm, "%sodd n_idx=%lld 1 head", p, (long long)odd_n[i]);
            sparse_attn_case(nm, 5, 1, HD, odd_n[i], 33);
        }
        snprintf(nm, sizeof nm, "%s12 heads hd=64", p);
        sparse_attn_case(nm, 9, 12, 64, 200, 150);
        snprintf(nm, sizeof nm, "%s4 heads hd=96", p);
        sparse_attn_case(nm, 6, 4, 96, 130, 150);
    }
    mma_switch(false);
}

#ifdef DS_HAVE_CUDA
/* One shape through both tensor-core forms (attn_mma.h) forced: the one pass must give the two
 * passes' bits on every row (both run the same operations per element in the same order), and
 * write nothing past the output. Returns false where the one pass refuses the shape. */
static bool attn_forms_case(const char *name, int64_t T, int64_t H, int64_t hd, int64_t n_idx, int64_t nkv) {
    char tag[160];
    snprintf(tag, sizeof tag, "sparse_attn forms %s T=%lld", name, (long long)T);
    struct attn_in a = make_attn(tag, T, H, hd, n_idx, nkv);
    const size_t ob = (size_t)(T * H * hd) * 2;
    void *dq = g_in(a.q, (size_t)(T * H * hd) * 2), *dkv = g_in(a.kv, (size_t)(nkv * hd) * 2),
         *di = g_in(a.idx, (size_t)(T * n_idx) * 4), *d2 = g_out(ob, PZ_16), *d1 = g_out(ob, PZ_16);
    const void *ds = g_tensor(a.sink, (size_t)H * 4, false);
    assert_true(cuda_sparse_attn_mma_path(&gpu_be, CUDA_ATTN_TWO_PASS, d2, dq, dkv, di, T, H, hd, n_idx, ds, a.scale));
    const bool fits = cuda_sparse_attn_mma_path(&gpu_be, CUDA_ATTN_ONE_PASS, d1, dq, dkv, di, T, H, hd, n_idx, ds, a.scale);
    if (fits) {
        uint16_t *o2 = NEW(uint16_t, T * H * hd), *o1 = NEW(uint16_t, T * H * hd);
        g_get(o2, d2, ob);
        g_get(o1, d1, ob);
        struct cmp c;
        cmp_begin(&c, "sparse_attn", "one pass = two passes, %s T=%lld", name, (long long)T);
        for (int64_t i = 0; i < T * H * hd; i++)
            cmp_bits(&c, i, o1[i], o2[i], bf16_to_f32(o1[i]), bf16_to_f32(o2[i]));
        cmp_end(&c);
        free(o1);
        free(o2);
    }
    g_free(dq);
    g_free(dkv);
    g_free(di);
    g_free(d2);
    g_free(d1); /* the sentinels past both outputs are checked here */
    GPU->tensor_release(&gpu_be, ds);
    free_attn(&a);
    return fits;
}
#endif

/* The one-pass form against the two-pass one, bit for bit, over the row kinds of make_idx_row
 * (leading / trailing -1, rows without a valid entry, a whole block of -1), partial head groups (3
 * heads, 12 heads = a group and a half), n_idx not a multiple of 64 or of 4, hd 64 (one P·V warp
 * busy of 8) and a row count past the AUTO range; hd 1024 does not fit the one pass (its P·V takes
 * 64 channels a warp, 512 a CTA) and must be refused with nothing launched. */
static void test_sparse_attn_forms(void **st) {
    NEED_GPU(st);
#ifndef DS_HAVE_CUDA
    skip();
#else
    if (gpu_state != 1) skip(); /* CUDA kernels called directly: no CPU stand-in */
    const int64_t rows[] = {1, 8, 40, 129, 600};
    for (int i = 0; i < 5; i++)
        assert_true(attn_forms_case("8 heads, window 128 + top-512 of 2048", rows[i], H_LOCAL, HD, WINDOW + INDEX_TOPK,
                                    WINDOW + 2048));
    const int64_t odd_n[] = {1, 37, 100, 129};
    for (int i = 0; i < 4; i++) {
        assert_true(attn_forms_case("odd n_idx, 3 heads", 17, 3, HD, odd_n[i], 300));
        assert_true(attn_forms_case("odd n_idx, 1 head", 5, 1, HD, odd_n[i], 33));
    }
    assert_true(attn_forms_case("12 heads hd=64", 9, 12, 64, 200, 150));
    assert_false(attn_forms_case("8 heads hd=1024", 3, 8, 1024, 70, 90));
#endif
}

static void compress_pool_case(int64_t G, int64_t r, int64_t n) {
    char tag[128];
    snprintf(tag, sizeof tag, "compress_pool G=%lld r=%lld n=%lld", (long long)G, (long long)r, (long long)n);
    seed_tag(tag);
    float *kv = NEW(float, G * r * n), *sc = NEW(float, G * r * n);
    fill_f32(kv, G * r * n, 0.0f, 1.0f);
    fill_f32(sc, G * r * n, 0.0f, 2.0f);
    for (int64_t g = 0; g < G; g++) {
        if (g % 4 == 3) /* a partial group: its last slot unfilled (score −inf, kv anything) */
            for (int64_t c = 0; c < n; c++) {
                sc[(g * r + r - 1) * n + c] = -INFINITY;
                kv[(g * r + r - 1) * n + c] = NAN;
            }
        if (g % 5 == 4) /* every slot unfilled in some channels */
            for (int64_t j = 0; j < r; j++)
                for (int64_t c = 0; c < n; c += 3) {
                    sc[(g * r + j) * n + c] = -INFINITY;
                    kv[(g * r + j) * n + c] = INFINITY;
                }
    }
    bf16_t *lc = NEW(bf16_t, G * n), *lg = NEW(bf16_t, G * n);
    CPU->compress_pool(&cpu_be, lc, kv, sc, G, r, n);
    void *dkv = g_in(kv, (size_t)(G * r * n) * 4), *dsc = g_in(sc, (size_t)(G * r * n) * 4), *dl = g_out((size_t)(G * n) * 2, PZ_16);
    GPU->compress_pool(&gpu_be, dl, dkv, dsc, G, r, n);
    g_get(lg, dl, (size_t)(G * n) * 2);
    g_free(dkv);
    g_free(dsc);
    g_free(dl);
    struct cmp c;
    cmp_begin(&c, "compress_pool", "G=%lld r=%lld n=%lld", (long long)G, (long long)r, (long long)n);
    for (int64_t g = 0; g < G; g++)
        for (int64_t ch = 0; ch < n; ch++) {
            iv_t b = pool_model(kv + g * r * n, sc + g * r * n, r, n, ch);
            cmp_iv(&c, g * n + ch, bf16_to_f32(lg[g * n + ch]), bf16_to_f32(lc[g * n + ch]), b);
        }
    cmp_end(&c);
    free(kv);
    free(sc);
    free(lc);
    free(lg);
}

static void test_compress_pool(void **st) {
    NEED_GPU(st);
    const int64_t Gs[] = {1, 4, 8, 32};
    for (int i = 0; i < 4; i++) compress_pool_case(Gs[i], 2, HD);
    compress_pool_case(3, 2, 37);
    compress_pool_case(17, 1, 129);
    compress_pool_case(5, 3, 1);
}

struct index_in {
    int64_t T, nh, d, nk, ld_q, ld_s;
    bf16_t *q, *K, *w;
    int32_t *vis;
    float w_scale;
};

static struct index_in make_index(const char *tag, int64_t T, int64_t nh, int64_t d, int64_t nk, int64_t ld_q, int64_t ld_s) {
    struct index_in x = {T, nh, d, nk, ld_q, ld_s, NULL, NULL, NULL, NULL, (float)(1.0 / sqrt((double)(d * nh * 8)))};
    seed_tag(tag);
    if (nh * 8 == 32) x.w_scale = (float)(1.0 / sqrt(128.0) / sqrt(32.0)); /* 128^-0.5 · 32^-0.5 */
    x.q = NEW(bf16_t, T * ld_q);
    fill_act(x.q, T * ld_q, 1.0f);
    for (int64_t t = 0; t < T; t++) qdq_fp4_32_ue8m0(x.q + t * ld_q, (size_t)(nh * d)); /* after RoPE, FP4 QDQ */
    x.K = NEW(bf16_t, nk * d);
    fill_act(x.K, nk * d, 1.0f);
    qdq_fp4_32_ue8m0(x.K, (size_t)(nk * d));
    x.w = NEW(bf16_t, T * nh);
    fill_gauss_bf16(x.w, T * nh, 1.0f);
    x.vis = NEW(int32_t, T);
    for (int64_t t = 0; t < T; t++) {
        int k = (int)(t % 4);
        x.vis[t] = (int32_t)(k == 0 ? nk : k == 1 ? irand(nk + 1) : k == 2 ? 0 : (nk > 1 ? nk - 1 : 1));
    }
    return x;
}

static void free_index(struct index_in *x) {
    free(x->q);
    free(x->K);
    free(x->w);
    free(x->vis);
}

static void index_scores_case(const char *name, int64_t T, int64_t nh, int64_t d, int64_t nk, int64_t ld_q, int64_t ld_s) {
    char tag[160];
    snprintf(tag, sizeof tag, "index_scores %s T=%lld", name, (long long)T);
    struct index_in x = make_index(tag, T, nh, d, nk, ld_q, ld_s);
    float *Sc = NEW(float, T * ld_s), *Sg = NEW(float, T * ld_s);
    poison_host(Sc, (size_t)(T * ld_s) * 4, PZ_32F);
    CPU->index_scores(&cpu_be, Sc, ld_s, x.q, ld_q, x.K, NULL, NULL, x.w, x.w_scale, x.vis, T, nh, d, nk);
    void *dq = g_in(x.q, (size_t)(T * ld_q) * 2), *dK = g_in(x.K, (size_t)(nk * d) * 2), *dw = g_in(x.w, (size_t)(T * nh) * 2),
         *dv = g_in(x.vis, (size_t)T * 4), *dS = g_out((size_t)(T * ld_s) * 4, PZ_32F);
    GPU->index_scores(&gpu_be, dS, ld_s, dq, ld_q, dK, NULL, NULL, dw, x.w_scale, dv, T, nh, d, nk);
    g_get(Sg, dS, (size_t)(T * ld_s) * 4);
    g_free(dq);
    g_free(dK);
    g_free(dw);
    g_free(dv);
    g_free(dS);
    float *wf = NEW(float, T * nh);
    for (int64_t i = 0; i < T * nh; i++) wf[i] = bf16_round(bf16_to_f32(x.w[i]) * x.w_scale);
    iv_t *b = NEW(iv_t, T * nk);
#pragma omp parallel for schedule(dynamic, 16)
    for (int64_t tj = 0; tj < T * nk; tj++)
        b[tj] = index_model(x.q + (tj / nk) * ld_q, x.K + (tj % nk) * d, wf + (tj / nk) * nh, nh, d);
    struct cmp c;
    cmp_begin(&c, "index_scores", "%s T=%lld", name, (long long)T);
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < ld_s; j++) {
            int64_t o = t * ld_s + j;
            uint32_t gb, cb;
            memcpy(&gb, Sg + o, 4);
            memcpy(&cb, Sc + o, 4);
            if (j >= nk) { /* row padding: untouched */
                cmp_bits(&c, o, gb, POISON32F, Sg[o], Sc[o]);
                if (cb != POISON32F) cmp_self(&c, o, 1, 0, 0);
            } else if (j >= x.vis[t]) { /* masked: −inf on both */
                cmp_bits(&c, o, gb, cb, Sg[o], Sc[o]);
                if (!(Sc[o] == -INFINITY)) cmp_self(&c, o, Sc[o], -INFINITY, 0);
            } else {
                if ((gb & 0xFFFFu) && !isnan(Sg[o])) cmp_fail(&c, "score %lld: %.9g is not a bf16 value", (long long)o, Sg[o]);
                cmp_iv(&c, o, Sg[o], Sc[o], b[t * nk + j]);
            }
        }
    cmp_end(&c);
    free(Sc);
    free(Sg);
    free(wf);
    free(b);
    free_index(&x);
}

static void test_index_scores(void **st) {
    NEED_GPU(st);
    for (int i = 0; i < NT_REAL; i++)
        index_scores_case("4 heads x 128, 2048 keys", T_REAL[i], IDX_H_LOCAL, IDX_HD, 2048, IDX_H_LOCAL * IDX_HD, 2048 + 16);
    const int64_t odd_nk[] = {1, 33, 129};
    for (int i = 0; i < 3; i++) {
        char nm[64];
        snprintf(nm, sizeof nm, "odd 3 heads, %lld keys, strided q", (long long)odd_nk[i]);
        index_scores_case(nm, 17, 3, IDX_HD, odd_nk[i], 3 * IDX_HD + 64, odd_nk[i] + 3);
        snprintf(nm, sizeof nm, "odd 1 head, %lld keys", (long long)odd_nk[i]);
        index_scores_case(nm, 3, 1, IDX_HD, odd_nk[i], IDX_HD, odd_nk[i]);
    }
}

/* Rows of several sequences in one call (K_rows / nk_rows, what the model does for a batch): every
 * row must be bit-identical to that row scored alone against its own keys (on the CPU backend, the
 * self-check), the GPU bit-identical to the CPU, and columns past a row's own key count keep their
 * poison. Keys are slices of one pool at random row offsets, some counts 0 or 1. */
static void test_index_scores_rows(void **st) {
    NEED_GPU(st);
    enum { T = 12 };
    const int64_t nh = IDX_H_LOCAL, d = IDX_HD, nk = 700, ld_q = IDX_H_LOCAL * IDX_HD, ld_s = 700 + 5;
    struct index_in x = make_index("index_scores rows", T, nh, d, nk, ld_q, ld_s);
    int32_t nkr[T];
    int64_t off[T];
    const bf16_t *kh[T], *kdev[T];
    void *dK = g_in(x.K, (size_t)(nk * d) * 2);
    for (int t = 0; t < T; t++) {
        nkr[t] = (int32_t)(t % 4 == 0 ? nk : t % 4 == 1 ? 1 + irand(nk / 2) : t % 4 == 2 ? 0 : 1);
        off[t] = irand(nk - nkr[t] + 1);
        kh[t] = x.K + off[t] * d;
        kdev[t] = (const bf16_t *)dK + off[t] * d;
    }
    float *Sc = NEW(float, T * ld_s), *Sg = NEW(float, T * ld_s), *S1 = NEW(float, ld_s);
    poison_host(Sc, (size_t)(T * ld_s) * 4, PZ_32F);
    CPU->index_scores(&cpu_be, Sc, ld_s, x.q, ld_q, NULL, kh, nkr, x.w, x.w_scale, x.vis, T, nh, d, nk);
    void *dq = g_in(x.q, (size_t)(T * ld_q) * 2), *dw = g_in(x.w, (size_t)(T * nh) * 2), *dv = g_in(x.vis, (size_t)T * 4),
         *dkr = g_in(kdev, sizeof kdev), *dnk = g_in(nkr, sizeof nkr), *dS = g_out((size_t)(T * ld_s) * 4, PZ_32F);
    GPU->index_scores(&gpu_be, dS, ld_s, dq, ld_q, NULL, dkr, dnk, dw, x.w_scale, dv, T, nh, d, nk);
    g_get(Sg, dS, (size_t)(T * ld_s) * 4);
    struct cmp c;
    cmp_begin(&c, "index_scores", "per-row keys T=%d, counts 0..%lld", T, (long long)nk);
    for (int t = 0; t < T; t++) {
        poison_host(S1, (size_t)ld_s * 4, PZ_32F);
        if (nkr[t])
            CPU->index_scores(&cpu_be, S1, ld_s, x.q + t * ld_q, ld_q, kh[t], NULL, NULL, x.w + t * nh, x.w_scale,
                              x.vis + t, 1, nh, d, nkr[t]);
        for (int64_t j = 0; j < ld_s; j++) {
            int64_t o = t * ld_s + j;
            uint32_t gb, cb, ab;
            memcpy(&gb, Sg + o, 4);
            memcpy(&cb, Sc + o, 4);
            memcpy(&ab, S1 + j, 4);
            cmp_bits(&c, o, gb, cb, Sg[o], Sc[o]);
            if (cb != ab) cmp_self(&c, o, 1, 0, 0); /* the batch call differs from the row alone */
            if (j >= nkr[t] && cb != POISON32F) cmp_self(&c, o, 1, 0, 0); /* written past the row's keys */
        }
    }
    cmp_end(&c);
    g_free(dq);
    g_free(dK);
    g_free(dw);
    g_free(dv);
    g_free(dkr);
    g_free(dnk);
    g_free(dS);
    free(Sc);
    free(Sg);
    free(S1);
    free_index(&x);
}

/* =============================================================================================
 * Batch invariance */

struct attn_ctx {
    struct attn_in *a;
    const void *dq, *dkv, *di, *ds;
};

static void attn_rows(void *vc, int64_t r0, int64_t T, void *out) {
    struct attn_ctx *c = vc;
    struct attn_in *a = c->a;
    size_t rb = (size_t)(a->H * a->hd) * 2;
    void *dout = g_out((size_t)T * rb, PZ_16);
    GPU->sparse_attn(&gpu_be, dout, (const bf16_t *)c->dq + r0 * a->H * a->hd, c->dkv, (const int32_t *)c->di + r0 * a->n_idx,
                     T, a->H, a->hd, a->n_idx, c->ds, a->scale);
    g_get(out, dout, (size_t)T * rb);
    g_free(dout);
}

static void test_batch_invariance_sparse_attn(void **st) {
    NEED_GPU(st);
    /* 128 rows: with the switch on, T = 1, 8 and 64 take the two-pass kernels (one launch of
     * softmax and P·V after the scores), T = 128 the one-pass kernel (attn_mma.h's AUTO), which
     * must give every row the same bits (test_sparse_attn_forms: the split softmax + P·V too) */
    enum { BI_ROWS = 128 };
    const int64_t bi_t[] = {8, 64, BI_ROWS}, bi_probes[] = {0, 5, 7, 63, BI_ROWS - 1};
    struct attn_in a = make_attn("bi sparse_attn", BI_ROWS, H_LOCAL, HD, WINDOW + INDEX_TOPK, WINDOW + 2048);
    struct attn_ctx c = {&a, g_in(a.q, (size_t)(BI_ROWS * H_LOCAL * HD) * 2), g_in(a.kv, (size_t)(a.nkv * HD) * 2),
                         g_in(a.idx, (size_t)(BI_ROWS * a.n_idx) * 4), g_tensor(a.sink, H_LOCAL * 4, false)};
    for (int mma = 0; mma < 2; mma++) {
        mma_switch(mma);
        batch_invariance("sparse_attn", mma ? "mma 8 heads, window 128 + top-512" : "8 heads, window 128 + top-512",
                         attn_rows, &c, (size_t)(H_LOCAL * HD) * 2, bi_t, 3, bi_probes, 5);
    }
    mma_switch(false);
    g_free((void *)c.dq);
    g_free((void *)c.dkv);
    g_free((void *)c.di);
    GPU->tensor_release(&gpu_be, c.ds);
    free_attn(&a);
}

struct index_ctx {
    struct index_in *x;
    const void *dq, *dK, *dw, *dv;
};

static void index_rows(void *vc, int64_t r0, int64_t T, void *out) {
    struct index_ctx *c = vc;
    struct index_in *x = c->x;
    void *dS = g_out((size_t)(T * x->ld_s) * 4, PZ_32F);
    GPU->index_scores(&gpu_be, dS, x->ld_s, (const bf16_t *)c->dq + r0 * x->ld_q, x->ld_q, c->dK, NULL, NULL, (const bf16_t *)c->dw + r0 * x->nh,
                      x->w_scale, (const int32_t *)c->dv + r0, T, x->nh, x->d, x->nk);
    g_get(out, dS, (size_t)(T * x->ld_s) * 4);
    g_free(dS);
}

static void test_batch_invariance_index_scores(void **st) {
    NEED_GPU(st);
    struct index_in x = make_index("bi index_scores", 64, IDX_H_LOCAL, IDX_HD, 2048, IDX_H_LOCAL * IDX_HD, 2048 + 16);
    struct index_ctx c = {&x, g_in(x.q, (size_t)(64 * x.ld_q) * 2), g_in(x.K, (size_t)(x.nk * x.d) * 2), g_in(x.w, (size_t)(64 * x.nh) * 2),
                          g_in(x.vis, 64 * 4)};
    batch_invariance("index_scores", "4 heads x 128, 2048 keys", index_rows, &c, (size_t)x.ld_s * 4, BI_T, 2, BI_PROBES, 4);
    g_free((void *)c.dq);
    g_free((void *)c.dK);
    g_free((void *)c.dw);
    g_free((void *)c.dv);
    free_index(&x);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_rmsnorm_post),
        cmocka_unit_test(test_rope),
        cmocka_unit_test(test_qdq), cmocka_unit_test(test_mma_act_quant), cmocka_unit_test(test_mma_weight_decode),
        cmocka_unit_test(test_hc_mixes),
        cmocka_unit_test(test_hc_collapse_expand_init),
        cmocka_unit_test(test_embed),
        cmocka_unit_test(test_engram_gather),
        cmocka_unit_test(test_engram_gate),
        cmocka_unit_test(test_interleave),
        cmocka_unit_test(test_sparse_attn),
        cmocka_unit_test(test_compress_pool),
        cmocka_unit_test(test_index_scores),
        cmocka_unit_test(test_index_scores_rows),
        cmocka_unit_test(test_sparse_attn_forms),
        cmocka_unit_test(test_batch_invariance_sparse_attn),
        cmocka_unit_test(test_batch_invariance_index_scores),
    };
    cuda_ops_test_filters();
    return cmocka_run_group_tests(tests, cuda_ops_group_setup, cuda_ops_group_teardown);
}
