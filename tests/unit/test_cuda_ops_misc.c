/* The CUDA backend against the CPU reference backend: the elementwise ops (rmsnorm, rope,
 * qdq_fp8_32 / qdq_fp4_32 / qdq_fp4_16, interleave), mHC (hc_mixes with its Sinkhorn
 * comb, hc_collapse / hc_expand / hc_init), embed and Engram (engram_gather from host-resident
 * tables, engram_gate), and the tensor-core kernels' act quant and weight decodes. Memory,
 * weights, the dense ops and MoE are in test_cuda_ops.c; attention (sparse_attn and its forms,
 * compress_pool, index_scores, their batch invariance) in test_cuda_attn.c; the harness, the
 * rounding model and how each kind of op is compared are in cuda_ops_common.h; the head's row ops
 * (argmax, row_topk, row_lse) in test_cuda_index.c. */
#include "cuda_ops_common.h"
#ifdef DS_HAVE_CUDA
#include <cuda_runtime.h>

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

/* hc_mixes on the tensor cores (the mma switch, test_hc_mixes_mma): m's sum bound with
 * TOL_GPU_HC_MIX_MMA_U_PER_TERM for the GPU where hc·D is a multiple of 32 */
static bool g_hc_mma;

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
        const double rtol = g_hc_mma && L % 32 == 0 ? (TOL_CPU_SUM_U_PER_TERM + TOL_GPU_HC_MIX_MMA_U_PER_TERM) * U
                                                    : TOL_GPU_SUM_RTOL_PER_TERM;
        dm[j] = rtol * (double)L * A * r * (1.0 + rho_r) + fabs(m[j]) * (rho_r + 2.0 * U);
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

/* What the norm-and-RoPE cases hand the ops, on the host and the device: a norm's weights [n]
 * (1 + 0.3 N(0, 1)), T positions (odd rows far out) and the RoPE frequencies of rd values. */
struct norm_in {
    bf16_t *w, *dw;
    int32_t *pos, *dpos;
    float *freqs, *df;
};

static struct norm_in norm_in_new(int64_t T, int64_t n, int64_t rd) {
    struct norm_in a;
    a.w = NEW(bf16_t, n);
    for (int64_t i = 0; i < n; i++) a.w[i] = bf16_from_f32(1.0f + 0.3f * gauss());
    a.pos = NEW(int32_t, T);
    for (int64_t t = 0; t < T; t++) a.pos[t] = (int32_t)(t % 2 ? irand(1 << 20) : irand(300));
    a.freqs = NEW(float, rd / 2 + 1);
    make_freqs(a.freqs, rd / 2, 10000.0, false);
    a.dw = g_in(a.w, (size_t)n * 2);
    a.dpos = g_in(a.pos, (size_t)T * 4);
    a.df = g_in(a.freqs, (size_t)(rd / 2 + 1) * 4);
    return a;
}

static void norm_in_free(struct norm_in *a) {
    g_free(a->dw);
    g_free(a->dpos);
    g_free(a->df);
    free(a->w);
    free(a->pos);
    free(a->freqs);
}

/* rmsnorm with a post (RoPE, QDQ): one pass on the GPU where n % 32 == 0 up to 5,120 values, the
 * three kernels otherwise; either way the GPU's own rmsnorm, rope and qdq in turn, bit for bit
 * (each of those is checked against the CPU by its own test). */
static void rmsnorm_post_case(int64_t T, int64_t n, int64_t off, int64_t rd, enum norm_qdq q, bool alias) {
    char tag[160];
    snprintf(tag, sizeof tag, "rmsnorm post n=%lld T=%lld off=%lld rd=%lld qdq=%d%s", (long long)n, (long long)T,
             (long long)off, (long long)rd, (int)q, alias ? " in place" : "");
    seed_tag(tag);
    bf16_t *x = NEW(bf16_t, T * n), *yc = NEW(bf16_t, T * n), *yg = NEW(bf16_t, T * n);
    for (int64_t t = 0; t < T; t++) fill_act(x + t * n, n, (float)pow(10.0, -2.0 + 4.0 * urand()));
    struct norm_in a = norm_in_new(T, n, rd);
    bf16_t *dx = g_in(x, (size_t)(T * n) * 2);
    /* the three ops in turn */
    bf16_t *dy = g_out((size_t)(T * n) * 2, PZ_16);
    GPU->rmsnorm(&gpu_be, dy, dx, a.dw, T, n, 1e-6f, NULL);
    if (rd > 0) GPU->rope(&gpu_be, dy, T, 1, n, n, off, rd, a.dpos, a.df, false);
    if (q == NORM_QDQ_FP8_32) GPU->qdq_fp8_32(&gpu_be, dy, T * n);
    if (q == NORM_QDQ_FP4_32) GPU->qdq_fp4_32(&gpu_be, dy, T * n);
    g_get(yc, dy, (size_t)(T * n) * 2);
    g_free(dy);
    /* one op */
    const struct norm_post post = {off, rd, a.dpos, a.df, q};
    dy = alias ? dx : g_out((size_t)(T * n) * 2, PZ_16);
    GPU->rmsnorm(&gpu_be, dy, dx, a.dw, T, n, 1e-6f, &post);
    g_get(yg, dy, (size_t)(T * n) * 2);
    if (!alias) g_free(dy);
    g_free(dx);
    norm_in_free(&a);
    struct cmp c;
    cmp_begin(&c, "rmsnorm+post", "n=%lld T=%lld off=%lld rd=%lld qdq=%d%s", (long long)n, (long long)T,
              (long long)off, (long long)rd, (int)q, alias ? " (y == x)" : "");
    cmp_bf16_exact(&c, yg, yc, T * n);
    cmp_end(&c);
    free(x);
    free(yc);
    free(yg);
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

#ifdef DS_HAVE_CUDA
/* An op's activation form dq [abn bytes] of y [T, n] on the device, against the act quant
 * kernel's of y: bit for bit. */
static void cmp_act_form(struct cmp *c, const void *dq, const bf16_t *dy, int64_t T, int64_t n, size_t abn) {
    bf16_t *qg = NEW(bf16_t, T * n), *qr = NEW(bf16_t, T * n);
    void *dqr = g_out(abn, PZ_16);
    g_get(qg, dq, (size_t)(T * n) * 2);
    cuda_linear_mma_act_quant(dqr, dy, T, n, NULL);
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
    g_get(qr, dqr, (size_t)(T * n) * 2);
    cmp_bf16_exact(c, qg, qr, T * n);
    g_free(dqr);
    free(qg), free(qr);
}
#endif

/* linear_post: a projection and its norm (with RoPE, QDQ) or its RoPE (and QDQ) as one op. Under
 * the mma switch the CUDA backend folds the linear's k-chunks in the second pass; either way the
 * op must give, bit for bit, the GPU's own linear then rmsnorm / rope / qdq ops in turn
 * (be_linear_post_composed), each of which its own test holds to the CPU. */
static void linear_post_case(const char *name, const struct hw *h, int64_t T, bool norm, int64_t head, int64_t off,
                             int64_t rd, enum norm_qdq q, bool mma) {
    const int64_t n = h->q.n, k = h->q.k;
    char tag[200];
    snprintf(tag, sizeof tag, "linear_post %s T=%lld%s", name, (long long)T, mma ? " mma" : "");
    seed_tag(tag);
    mma_switch(mma);
    bf16_t *x = NEW(bf16_t, T * k), *yc = NEW(bf16_t, T * n), *yg = NEW(bf16_t, T * n);
    fill_act(x, T * k, 1.0f);
    struct norm_in a = norm_in_new(T, n, rd);
    struct qweight gw = g_weight(&h->q, false);
    bf16_t *dx = g_in(x, (size_t)(T * k) * 2);
    const struct linear_post lp = {norm ? a.dw : NULL, 1e-6f, head, {off, rd, a.dpos, a.df, q}, NULL, NULL};
    bf16_t *dy = g_out((size_t)(T * n) * 2, PZ_16);
    be_linear_post_composed(&gpu_be, dy, dx, T, &gw, &lp); /* the ops in turn */
    g_get(yc, dy, (size_t)(T * n) * 2);
    g_free(dy);
    dy = g_out((size_t)(T * n) * 2, PZ_16);
    be_linear_post(&gpu_be, dy, dx, T, &gw, &lp); /* the op */
    g_get(yg, dy, (size_t)(T * n) * 2);
    g_free(dy);
    struct cmp c;
#ifdef DS_HAVE_CUDA
    /* the op reading x's activation form (lp.xa, as hc_collapse_act leaves it): the same bits */
    if (gpu_state == 1 && mma && GPU->act_bytes && GPU->act_bytes(&gpu_be, T, k)) {
        const size_t ab = GPU->act_bytes(&gpu_be, T, k);
        void *dq = g_out(ab, PZ_16);
        cuda_linear_mma_act_quant(dq, dx, T, k, NULL);
        assert_int_equal(cudaDeviceSynchronize(), cudaSuccess); /* the legacy stream */
        /* and y's own act form (lp.ya, as the query chain's qr takes it), where n allows one:
         * the act quant kernel's of y, bit for bit */
        const size_t abn = n % 32 ? 0 : GPU->act_bytes(&gpu_be, T, n);
        struct linear_post lpa = lp;
        lpa.xa = dq;
        void *dqy = abn ? g_out(abn, PZ_16) : NULL;
        lpa.ya = dqy;
        bf16_t *ya = NEW(bf16_t, T * n);
        dy = g_out((size_t)(T * n) * 2, PZ_16);
        be_linear_post(&gpu_be, dy, dx, T, &gw, &lpa);
        g_get(ya, dy, (size_t)(T * n) * 2);
        cmp_begin(&c, "linear_post xa", "%s T=%lld = without it%s", name, (long long)T, abn ? ", ya its act form" : "");
        cmp_bf16_exact(&c, ya, yg, T * n);
        if (abn) {
            cmp_act_form(&c, dqy, dy, T, n, abn);
            g_free(dqy);
        }
        cmp_end(&c);
        g_free(dy);
        g_free(dq);
        free(ya);
    }
#endif
    g_free(dx);

    norm_in_free(&a);
    GPU->weight_release(&gpu_be, &gw);
    mma_switch(false);
    cmp_begin(&c, "linear_post", "%s T=%lld%s = its ops in turn", name, (long long)T, mma ? " mma" : "");
    cmp_bf16_exact(&c, yg, yc, T * n);
    cmp_end(&c);
    free(x);
    free(yc);
    free(yg);
}

/* linear_post_pair: two linear_posts of one x (wq_a + q_norm beside wkv + kv_norm with RoPE and
 * QDQ) must give each output the bits of its own linear_post, with and without x's activation form
 * (xa) and the first output's (ya: then compared with the act quant of the first output). Under
 * the mma switch the CUDA backend makes both in one pair linear and one norm launch; the shapes it
 * refuses (here a second weight of another k) run the two in turn. */
static void linear_post_pair_case(const struct hw *h1, const struct hw *h2, int64_t T, bool act, bool mma) {
    const int64_t n1 = h1->q.n, n2 = h2->q.n, k = h1->q.k, k2 = h2->q.k;
    char tag[200];
    snprintf(tag, sizeof tag, "linear_post_pair [%lld,%lld]+[%lld,%lld] T=%lld%s%s", (long long)n1, (long long)k,
             (long long)n2, (long long)k2, (long long)T, act ? " act" : "", mma ? " mma" : "");
    seed_tag(tag);
    mma_switch(mma);
    bf16_t *x = NEW(bf16_t, T * k), *y1 = NEW(bf16_t, T * n1), *y2 = NEW(bf16_t, T * n2);
    bf16_t *r1 = NEW(bf16_t, T * n1), *r2 = NEW(bf16_t, T * n2);
    fill_act(x, T * k, 1.0f);
    struct norm_in a1 = norm_in_new(T, n1, 0), a2 = norm_in_new(T, n2, 64);
    struct qweight g1 = g_weight(&h1->q, false), g2 = g_weight(&h2->q, false);
    bf16_t *dx = g_in(x, (size_t)(T * k) * 2);
    struct linear_post lp1 = {a1.dw, 1e-6f, n1, {0, 0, NULL, NULL, NORM_QDQ_NONE}, NULL, NULL};
    struct linear_post lp2 = {a2.dw, 1e-6f, n2, {n2 - 64, 64, a2.dpos, a2.df, NORM_QDQ_FP8_32}, NULL, NULL};
    void *dq = NULL, *dqy = NULL;
    size_t abn = 0;
#ifdef DS_HAVE_CUDA
    if (act && gpu_state == 1 && GPU->act_bytes && GPU->act_bytes(&gpu_be, T, k) && k == k2) {
        dq = g_out(GPU->act_bytes(&gpu_be, T, k), PZ_16);
        cuda_linear_mma_act_quant(dq, dx, T, k, NULL);
        assert_int_equal(cudaDeviceSynchronize(), cudaSuccess); /* the legacy stream */
        abn = GPU->act_bytes(&gpu_be, T, n1);
        if (abn) dqy = g_out(abn, PZ_16);
        lp1.xa = lp2.xa = dq;
        lp1.ya = dqy;
    }
#endif
    /* each alone */
    bf16_t *d1 = g_out((size_t)(T * n1) * 2, PZ_16), *d2 = g_out((size_t)(T * n2) * 2, PZ_16);
    struct linear_post s1 = lp1;
    s1.ya = NULL;
    be_linear_post(&gpu_be, d1, dx, T, &g1, &s1);
    be_linear_post(&gpu_be, d2, dx, T, &g2, &lp2);
    g_get(r1, d1, (size_t)(T * n1) * 2);
    g_get(r2, d2, (size_t)(T * n2) * 2);
    g_free(d1);
    g_free(d2);
    /* the pair */
    d1 = g_out((size_t)(T * n1) * 2, PZ_16);
    d2 = g_out((size_t)(T * n2) * 2, PZ_16);
    be_linear_post_pair(&gpu_be, d1, d2, dx, T, &g1, &lp1, &g2, &lp2);
    g_get(y1, d1, (size_t)(T * n1) * 2);
    g_get(y2, d2, (size_t)(T * n2) * 2);
    struct cmp c;
    cmp_begin(&c, "linear_post_pair", "[%lld,%lld]+[%lld,%lld] T=%lld%s%s = each alone", (long long)n1, (long long)k,
              (long long)n2, (long long)k2, (long long)T, dq ? " xa" : "", mma ? " mma" : "");
    cmp_bf16_exact(&c, y1, r1, T * n1);
    cmp_bf16_exact(&c, y2, r2, T * n2);
#ifdef DS_HAVE_CUDA
    if (dqy) cmp_act_form(&c, dqy, d1, T, n1, abn); /* the first output's act form */
#endif
    cmp_end(&c);
    g_free(d1);
    g_free(d2);
    if (dqy) g_free(dqy);
    if (dq) g_free(dq);
    g_free(dx);
    norm_in_free(&a1);
    norm_in_free(&a2);
    GPU->weight_release(&gpu_be, &g1);
    GPU->weight_release(&gpu_be, &g2);
    mma_switch(false);
    free(x), free(y1), free(y2), free(r1), free(r2);
}

static void test_linear_post_pair(void **st) {
    NEED_GPU(st);
    struct hw wq_a = hw_fp8(Q_LORA, DIM, 0, DIM, 0.02f), wkv = hw_fp8(HD, DIM, 0, DIM, 0.02f);
    const int64_t Ts[] = {1, 5, 8, 17, 64, 300};
    for (int i = 0; i < 6; i++)
        for (int act = 0; act < 2; act++) linear_post_pair_case(&wq_a, &wkv, Ts[i], act, true);
    linear_post_pair_case(&wq_a, &wkv, 3, false, false); /* without the switch: the two in turn */
    /* a second weight of another k: the two in turn */
    struct hw other = hw_fp8(HD, 2048, 0, 2048, 0.02f);
    linear_post_pair_case(&wq_a, &other, 3, false, true);
    hw_free(&other);
    /* a first weight of 64 rows (the golden fixtures' q_lora_rank): the pair in the decode tiling,
     * the two in turn past it (the prefill tilings want the seam on a 128-row tile's edge) */
    struct hw q64 = hw_fp8(64, DIM, 0, DIM, 0.02f);
    linear_post_pair_case(&q64, &wkv, 100, true, true);
    linear_post_pair_case(&q64, &wkv, 300, true, true);
    hw_free(&q64);
    hw_free(&wq_a);
    hw_free(&wkv);
}

static void test_linear_post(void **st) {
    NEED_GPU(st);
    struct hw wq_a = hw_fp8(Q_LORA, DIM, 0, DIM, 0.02f), wkv = hw_fp8(HD, DIM, 0, DIM, 0.02f);
    struct hw wq_b = hw_fp8(H_LOCAL * HD, Q_LORA, 0, Q_LORA, 0.03f), iwq_b = hw_fp8(4 * 128, Q_LORA, 0, Q_LORA, 0.03f);
    const int64_t Ts[] = {1, 8, 17, 64, 300, 600};
    for (int m = 0; m < 2; m++)
        for (int i = 0; i < 6; i++) {
            if (!m && i > 2) continue; /* without the switch: the ops in turn anyway */
            /* the query chain (wq_a + q_norm, wq_b + RoPE), the window K=V rows, the indexer's queries */
            linear_post_case("wq_a [1280,5120] + norm", &wq_a, Ts[i], true, Q_LORA, 0, 0, NORM_QDQ_NONE, m);
            linear_post_case("wq_b [4096,1280] + rope", &wq_b, Ts[i], false, HD, HD - 64, 64, NORM_QDQ_NONE, m);
            linear_post_case("wkv [512,5120] + norm rope qdq", &wkv, Ts[i], true, HD, HD - 64, 64, NORM_QDQ_FP8_32, m);
            linear_post_case("idx wq_b [512,1280] + rope qdq", &iwq_b, Ts[i], false, 128, 64, 64, NORM_QDQ_FP4_32, m);
        }
    hw_free(&wq_a);
    hw_free(&wkv);
    hw_free(&wq_b);
    hw_free(&iwq_b);
    /* BF16 weights (the dense tilings' chunks); odd shapes: rows past the one-pass norm's 5,120,
     * n % 32 != 0, a single k-chunk (the ops in turn), a rotary part at a head's start */
    struct hw b = hw_bf16(256, 2048 + 64, 0.03f);
    linear_post_case("bf16 [256,2112] + norm rope qdq", &b, 17, true, 256, 192, 64, NORM_QDQ_FP4_32, true);
    linear_post_case("bf16 [256,2112] + rope", &b, 5, false, 64, 0, 32, NORM_QDQ_NONE, true);
    hw_free(&b);
    b = hw_fp8(5120 + 32, 2048, 0, 2048, 0.02f);
    linear_post_case("fp8 [5152,2048] + norm", &b, 3, true, 5152, 0, 0, NORM_QDQ_NONE, true);
    hw_free(&b);
    b = hw_fp8(104, 2048, 0, 2048, 0.02f);
    linear_post_case("fp8 [104,2048] + norm rope", &b, 3, true, 104, 32, 16, NORM_QDQ_NONE, true);
    hw_free(&b);
    b = hw_fp8(256, 1024, 0, 1024, 0.02f);
    linear_post_case("fp8 [256,1024] + norm (one chunk)", &b, 9, true, 256, 192, 64, NORM_QDQ_FP8_32, true);
    hw_free(&b);
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

/* The mixes' dot products on the tensor cores (cuda_mhc.cu, hc_mixes_mma): decode and prefill row
 * counts (the decode tiling, the 128 x 128 tiling), the same model with the mma sum bound; hc·D not
 * a multiple of 32 keeps the CUDA-core chains (the CPU's bits, inside the same model) */
/* hc_prepare's pieces (made once at load) against the split hc_mixes makes itself on every call:
 * the same pre, post and comb, bit for bit */
static void hc_prepare_case(int64_t T, int64_t D) {
    const int64_t hc = HC, L = hc * D, nm = (2 + hc) * hc;
    char tag[128];
    snprintf(tag, sizeof tag, "hc_prepare D=%lld T=%lld", (long long)D, (long long)T);
    seed_tag(tag);
    bf16_t *X = NEW(bf16_t, T * L);
    fill_stream(X, T, hc, D);
    float *fn = NEW(float, nm * L), scale[3] = {0.9f, 0.7f, 1.4f}, base[(2 + HC) * HC];
    fill_f32(fn, nm * L, 0.0f, (float)(1.0 / sqrt((double)L)) * 2.0f);
    fill_f32(base, nm, 0.0f, 0.5f);
    void *dX = g_in(X, (size_t)(T * L) * 2);
    const float *dsc = g_tensor(scale, sizeof scale, false), *dba = g_tensor(base, (size_t)nm * 4, false);
    size_t nb[3] = {(size_t)(T * hc) * 4, (size_t)(T * hc) * 4, (size_t)(T * hc * hc) * 4};
    float *out[2][3];
    for (int prep = 0; prep < 2; prep++) {
        const float *dfn = g_tensor(fn, (size_t)(nm * L) * 4, false);
        if (prep) {
            if (gpu_state == 1) assert_non_null(GPU->hc_prepare); /* the CPU stand-in has none */
            if (GPU->hc_prepare) GPU->hc_prepare(&gpu_be, dfn, hc, D);
        }
        float *d[3];
        for (int i = 0; i < 3; i++) d[i] = g_out(nb[i], PZ_32F);
        GPU->hc_mixes(&gpu_be, d[0], d[1], d[2], dX, T, hc, D, dfn, dsc, dba, 20, 1e-20f, 1e-6f);
        for (int i = 0; i < 3; i++) {
            out[prep][i] = xmalloc(nb[i]);
            g_get(out[prep][i], d[i], nb[i]);
            g_free(d[i]);
        }
        GPU->tensor_release(&gpu_be, dfn);
    }
    struct cmp c;
    cmp_begin(&c, "hc_mixes", "prepared fn = per-call split D=%lld T=%lld", (long long)D, (long long)T);
    for (int i = 0; i < 3; i++)
        for (size_t e = 0; e < nb[i] / 4; e++) {
            uint32_t a, b;
            memcpy(&a, out[1][i] + e, 4);
            memcpy(&b, out[0][i] + e, 4);
            cmp_bits(&c, (long long)e, a, b, out[1][i][e], out[0][i][e]);
        }
    cmp_end(&c);
    for (int p = 0; p < 2; p++)
        for (int i = 0; i < 3; i++) free(out[p][i]);
    g_free(dX);
    GPU->tensor_release(&gpu_be, dsc);
    GPU->tensor_release(&gpu_be, dba);
    free(X);
    free(fn);
}

static void test_hc_mixes_mma(void **st) {
    NEED_GPU(st);
    mma_switch(true);
    g_hc_mma = true;
    const int64_t Ts[] = {1, 8, 17, 100, 300};
    for (int i = 0; i < 5; i++) hc_mixes_case(Ts[i], DIM, 20);
    hc_mixes_case(9, 40, 3);  /* L = 160: one short k-chunk */
    hc_mixes_case(3, 33, 20); /* L = 132: the chains */
    /* L = 32,768: 32 k-chunks' sums, more than the finish stages in shared memory: it walks them in
     * global memory */
    hc_mixes_case(2, 8192, 3);
    hc_prepare_case(17, DIM);
    hc_prepare_case(300, DIM);
    g_hc_mma = false;
    mma_switch(false);
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

/* hc_collapse_act (the tensor-core linears' activation form of y written by the collapse + norm):
 * y as hc_collapse with the norm gave it (yref), and ya as the act quant kernel makes it from that
 * y, bit for bit — the one pass where D % 256 == 0, the two kernels otherwise. */
static void hc_collapse_act_check(const bf16_t *yref, const void *dX, const void *dp, const void *dwn, int64_t T,
                                  int64_t hc, int64_t D) {
#ifdef DS_HAVE_CUDA
    if (gpu_state != 1 || !GPU->act_bytes || !GPU->hc_collapse_act || D % 32) return;
    mma_switch(true);
    const size_t ab = GPU->act_bytes(&gpu_be, T, D);
    assert_true(ab >= (size_t)(T * D) * 2);
    bf16_t *yg = NEW(bf16_t, T * D), *qr = NEW(bf16_t, ab / 2), *qg = NEW(bf16_t, ab / 2);
    void *dyr = g_in(yref, (size_t)(T * D) * 2), *dqr = g_out(ab, PZ_16);
    cuda_linear_mma_act_quant(dqr, dyr, T, D, NULL);
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess); /* the legacy stream, as test_mma_act_quant */
    g_get(qr, dqr, ab);
    void *dy = g_out((size_t)(T * D) * 2, PZ_16), *dq = g_out(ab, PZ_16);
    GPU->hc_collapse_act(&gpu_be, dy, dq, dX, dp, T, hc, D, dwn, 1e-6f);
    g_get(yg, dy, (size_t)(T * D) * 2);
    g_get(qg, dq, ab);
    mma_switch(false);
    struct cmp c;
    cmp_begin(&c, "hc_collapse_act", "D=%lld T=%lld: y and its act form", (long long)D, (long long)T);
    cmp_bf16_exact(&c, yg, yref, T * D);
    cmp_bf16_exact(&c, qg, qr, T * D);
    cmp_end(&c);
    g_free(dyr);
    g_free(dqr);
    g_free(dy);
    g_free(dq);
    free(yg), free(qr), free(qg);
#else
    (void)yref, (void)dX, (void)dp, (void)dwn, (void)T, (void)hc, (void)D;
#endif
}

/* hc_expand_collapse (a block's residual update and the next sublayer's input in one op): Xo as
 * the GPU's hc_expand gives it and y (and ya, y's act form) as its collapse + norm then gives it
 * from that Xo, bit for bit — one pass where the kernel takes the shape (hc 4, D % 8, column
 * blocks of a multiple of 8, D % 256 with ya), the ops in turn otherwise; y whole and in column
 * blocks (nb), with and without ya. */
static void hc_expand_collapse_check(const bf16_t *y, const void *dX, const void *dpost, const void *dcomb,
                                     const void *dp, const void *dwn, int64_t T, int64_t hc, int64_t D) {
#ifdef DS_HAVE_CUDA
    if (gpu_state != 1 || !GPU->hc_expand_collapse) return;
    const size_t xb = (size_t)(T * hc * D) * 2, yb = (size_t)(T * D) * 2;
    bf16_t *xr = NEW(bf16_t, T * hc * D), *xg = NEW(bf16_t, T * hc * D), *yr = NEW(bf16_t, T * D),
           *yg = NEW(bf16_t, T * D), *yblk = NEW(bf16_t, T * D);
    for (int64_t nb = 1; nb <= 8; nb *= 8) {
        if (D % nb) continue;
        const int64_t Db = D / nb;
        for (int64_t t = 0; t < T; t++)
            for (int64_t d = 0; d < D; d++) yblk[(d / Db * T + t) * Db + d % Db] = y[t * D + d];
        void *dyin = g_in(yblk, yb);
        for (int act = 0; act < 2; act++) {
            mma_switch(act == 1);
            const size_t ab = act && GPU->act_bytes && GPU->hc_collapse_act ? GPU->act_bytes(&gpu_be, T, D) : 0;
            if (act && !ab) {
                mma_switch(false);
                continue;
            }
            bf16_t *qr = ab ? NEW(bf16_t, ab / 2) : NULL, *qg = ab ? NEW(bf16_t, ab / 2) : NULL;
            void *dxr = g_out(xb, PZ_16), *dyr = g_out(yb, PZ_16), *dqr = ab ? g_out(ab, PZ_16) : NULL;
            GPU->hc_expand(&gpu_be, dxr, dyin, dX, dpost, dcomb, T, hc, D, nb);
            if (ab)
                GPU->hc_collapse_act(&gpu_be, dyr, dqr, dxr, dp, T, hc, D, dwn, 1e-6f);
            else
                GPU->hc_collapse(&gpu_be, dyr, dxr, dp, T, hc, D, dwn, 1e-6f);
            void *dxg = g_out(xb, PZ_16), *dyg = g_out(yb, PZ_16), *dqg = ab ? g_out(ab, PZ_16) : NULL;
            GPU->hc_expand_collapse(&gpu_be, dxg, dyin, dX, dpost, dcomb, nb, dyg, dqg, dp, dwn, 1e-6f, T, hc, D);
            g_get(xr, dxr, xb), g_get(xg, dxg, xb), g_get(yr, dyr, yb), g_get(yg, dyg, yb);
            if (ab) g_get(qr, dqr, ab), g_get(qg, dqg, ab);
            mma_switch(false);
            struct cmp c;
            cmp_begin(&c, "hc_expand_collapse", "D=%lld T=%lld blocks=%lld%s", (long long)D, (long long)T, (long long)nb,
                      ab ? " with ya" : "");
            cmp_bf16_exact(&c, xg, xr, T * hc * D);
            cmp_bf16_exact(&c, yg, yr, T * D);
            if (ab) cmp_bf16_exact(&c, qg, qr, (int64_t)(ab / 2));
            cmp_end(&c);
            g_free(dxr), g_free(dyr), g_free(dxg), g_free(dyg);
            if (ab) g_free(dqr), g_free(dqg);
            free(qr), free(qg);
        }
        g_free(dyin);
    }
    free(xr), free(xg), free(yr), free(yg), free(yblk);
#else
    (void)y, (void)dX, (void)dpost, (void)dcomb, (void)dp, (void)dwn, (void)T, (void)hc, (void)D;
#endif
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
    cmp_begin(&c, "hc_collapse+norm", "D=%lld T=%lld", (long long)D, (long long)T);
    cmp_bf16_exact(&c, og, oc, T * D);
    cmp_end(&c);
    hc_collapse_act_check(og, dX, dp, dwn, T, hc, D);
    hc_expand_collapse_check(y, dX, dpost, dcomb, dp, dwn, T, hc, D);
    g_free(dwn);
    free(wn);
    /* expand */
    CPU->hc_expand(&cpu_be, oc, y, X, post, comb, T, hc, D, 1);
    dout = g_out((size_t)(T * hc * D) * 2, PZ_16);
    GPU->hc_expand(&gpu_be, dout, dy, dX, dpost, dcomb, T, hc, D, 1);
    g_get(og, dout, (size_t)(T * hc * D) * 2);
    g_free(dout);
    cmp_begin(&c, "hc_expand", "D=%lld T=%lld", (long long)D, (long long)T);
    cmp_bf16_exact(&c, og, oc, T * hc * D);
    cmp_end(&c);
    /* y in column blocks, as a TP all-gather leaves it ([nb, T, D / nb]; 8 blocks: a TP8 group's,
     * blocks of a multiple of 8 columns on the vector kernels, else the scalar one): the plain
     * layout's bits, the CPU's blocked form too */
    for (int64_t nb = 2; nb <= 8; nb *= 2) {
        if (D % nb) continue;
        const int64_t Db = D / nb;
        bf16_t *yb = NEW(bf16_t, T * D), *ob = NEW(bf16_t, T * hc * D);
        for (int64_t t = 0; t < T; t++)
            for (int64_t d = 0; d < D; d++) yb[(d / Db * T + t) * Db + d % Db] = y[t * D + d];
        CPU->hc_expand(&cpu_be, ob, yb, X, post, comb, T, hc, D, nb);
        void *dyb = g_in(yb, (size_t)(T * D) * 2);
        dout = g_out((size_t)(T * hc * D) * 2, PZ_16);
        GPU->hc_expand(&gpu_be, dout, dyb, dX, dpost, dcomb, T, hc, D, nb);
        g_get(og, dout, (size_t)(T * hc * D) * 2);
        g_free(dout);
        g_free(dyb);
        cmp_begin(&c, "hc_expand blocked", "D=%lld T=%lld blocks=%lld", (long long)D, (long long)T, (long long)nb);
        cmp_bf16_exact(&c, og, oc, T * hc * D);
        cmp_bf16_exact(&c, ob, oc, T * hc * D);
        cmp_end(&c);
        free(yb);
        free(ob);
    }
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
    hc_elementwise_case(5, 96);   /* D % 256 != 0: the collapse's act form by the two kernels */
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

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_rmsnorm_post),
        cmocka_unit_test(test_rope),
        cmocka_unit_test(test_linear_post),
        cmocka_unit_test(test_linear_post_pair),
        cmocka_unit_test(test_qdq), cmocka_unit_test(test_mma_act_quant), cmocka_unit_test(test_mma_weight_decode),
        cmocka_unit_test(test_hc_mixes),
        cmocka_unit_test(test_hc_mixes_mma),
        cmocka_unit_test(test_hc_collapse_expand_init),
        cmocka_unit_test(test_embed),
        cmocka_unit_test(test_engram_gather),
        cmocka_unit_test(test_engram_gate),
        cmocka_unit_test(test_interleave),
    };
    cuda_ops_test_filters();
    return cmocka_run_group_tests(tests, cuda_ops_group_setup, cuda_ops_group_teardown);
}
