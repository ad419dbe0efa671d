/* The CUDA backend's MoE ops against the CPU reference backend: moe_combine (exact), the router
 * (selection consistent with the score intervals, weights within them; the fused decode-step
 * selection), moe_experts on the rank's 48 of 384 FP4 experts (SIMT and tensor-core forms),
 * shared_expert, and batch invariance of moe_experts. The models below bound what either backend
 * may produce for a fused op, given backend.h's rounding points and tolerances.h's freedoms. */
#include "cuda_weights_ref.h"
#ifdef DS_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/cuda_router.h"
#include "cuda/linear_mma.h"
#endif

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
 * moe_combine: exact */

/* ld_sh > D: the shared expert's rows are ld_sh wide and the combine reads their last D columns in
 * place (a TP rank's block of the owner exchange); 0 means D. E_TIES: ids drawn with repeats from
 * a few experts, so the order's ties (the lower slot first) decide the sums' order. */
static bool g_combine_ties;
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
            if (g_combine_ties) { /* two experts in each of parts 0-2 */
                e = (int32_t)irand(3) * (int32_t)per_part + (int32_t)irand(2);
            } else {
                do e = (int32_t)irand(E);
                while (i32_in(idx + t * k, s, e));
            }
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
    /* repeated expert ids in a token's slots, both kernels: the lower slot first */
    g_combine_ties = true;
    moe_combine_case(1, TOPK, DIM, E_LOCAL, 8, 8, true, 0);
    moe_combine_case(64, TOPK, DIM, E_LOCAL, 8, 8, true, 0);
    moe_combine_case(5, 8, 136, 5, 2, 8, false, 0);
    g_combine_ties = false;
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
    g_free(dy);
    struct cmp c;
#ifdef DS_HAVE_CUDA
    /* with x's activation form (shared_expert_act, under the mma switch): the same bits */
    if (gpu_state == 1 && GPU->shared_expert_act && GPU->act_bytes && GPU->act_bytes(&gpu_be, T, D)) {
        const size_t ab = GPU->act_bytes(&gpu_be, T, D);
        void *dq = g_out(ab, PZ_16);
        cuda_linear_mma_act_quant(dq, dx, T, D, NULL);
        assert_int_equal(cudaDeviceSynchronize(), cudaSuccess); /* the legacy stream */
        bf16_t *ya = NEW(bf16_t, T * D);
        dy = g_out((size_t)(T * D) * 2, PZ_16);
        GPU->shared_expert_act(&gpu_be, dy, dx, dq, T, &g1, &g3, &g2, limit);
        g_get(ya, dy, (size_t)(T * D) * 2);
        g_free(dy);
        g_free(dq);
        cmp_begin(&c, "shared_expert_act", "%s T=%lld = shared_expert", name, (long long)T);
        cmp_bf16_exact(&c, ya, yg, T * D);
        cmp_end(&c);
        free(ya);
    }
#endif
    g_free(dx);
    double *lo = NEW(double, D), *hi = NEW(double, D);

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
    cuda_weights_tables_init();
    return cuda_ops_group_setup(st);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_moe_combine),
        cmocka_unit_test(test_router),
        cmocka_unit_test(test_moe_experts),
        cmocka_unit_test(test_moe_experts_mma),
        cmocka_unit_test(test_shared_expert),
        cmocka_unit_test(test_batch_invariance_moe_experts),
    };
    cuda_ops_test_filters();
    return cmocka_run_group_tests(tests, group_setup, cuda_ops_group_teardown);
}
