/* The CUDA backend against the CPU reference backend: memory ops (alloc/upload/copy/download),
 * weight_prepare (FP8, FP4, BF16, F32, dequant_bf16) and tensor_prepare, the dense family (linear on
 * FP8, FP4 and BF16 weights, linear_f32, grouped_linear, head), the tensor-core linears' pair call
 * (two weights in one launch, bit for bit the two calls) and forms, and batch invariance of linear
 * and head. The MoE ops are in test_cuda_moe.c, the elementwise, mHC, Engram and attention ops in
 * test_cuda_ops_misc.c; the harness, the rounding model and how each kind of op is compared are in
 * cuda_ops_common.h, the shared host weights in cuda_weights_ref.h. */
#include "cuda_weights_ref.h"
#ifdef DS_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/fp4_layout.h"
#include "cuda/linear_mma.h"
#endif

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
        if (h->fmt == WF_FP4 && gpu_state == 1) /* the CUDA layout; the CPU stand-in keeps the checkpoint's */
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

/* linear_cols (the op through be_linear_cols) against interleave, then linear, both on the GPU, bit
 * for bit. Returns whether the op took the call (false: the helper interleaved, then ran linear). */
static bool linear_cols_case(const char *name, struct hw *h, int64_t S, int64_t T) {
    struct qweight g = g_weight(&h->q, false);
    const int64_t k = g.k, n = g.n;
    const size_t xbytes = (size_t)(T * k) * 2, ybytes = (size_t)(T * n) * 2;
    bf16_t *xb = NEW(bf16_t, T * k);
    fill_act(xb, T * k, 1.0f);
    void *dxb = g_in(xb, xbytes), *dx = g_out(xbytes, PZ_16), *dx2 = g_out(xbytes, PZ_16), *dr = g_out(ybytes, PZ_16),
         *df = g_out(ybytes, PZ_16);
    GPU->interleave(&gpu_be, dx, dxb, S, T, (size_t)(k / S) * 2);
    GPU->linear(&gpu_be, dr, dx, T, &g);
    const bool took = GPU->linear_cols && GPU->linear_cols(&gpu_be, df, dxb, S, T, &g);
    if (!took) be_linear_cols(&gpu_be, df, dx2, dxb, S, T, &g);
    bf16_t *yr = NEW(bf16_t, T * n), *yf = NEW(bf16_t, T * n);
    g_get(yr, dr, ybytes);
    g_get(yf, df, ybytes);
    struct cmp c;
    cmp_begin(&c, "linear_cols", "= interleave, linear: %s S=%lld T=%lld", name, (long long)S, (long long)T);
    for (int64_t i = 0; i < T * n; i++) cmp_bits(&c, i, yf[i], yr[i], bf16_to_f32(yf[i]), bf16_to_f32(yr[i]));
    cmp_end(&c);
    g_free(dxb), g_free(dx), g_free(dx2), g_free(dr), g_free(df);
    free(xb), free(yr), free(yf);
    GPU->weight_release(&gpu_be, &g);
    return took;
}

/* wo_b's shape (the TP gather's 8 blocks of 1,024 columns, this rank's 640 rows of 8,192) at decode
 * (the split kernel, one to four m16 tiles) and prefill row counts, an FP4 weight, 3 blocks of 32
 * (the smallest): the op takes them under the mma switch on the GPU; it declines BF16 weights,
 * blocks not a multiple of 32 wide and, switch off, the exact kernels — the helper's interleave
 * path, which the comparison checks as well. */
static void test_linear_cols(void **st) {
    NEED_GPU(st);
    const bool gpu = gpu_state == 1; /* the CPU stand-in has no such op */
    const int64_t Ts[] = {1, 8, 24, 64, 300};
    struct hw h;
    seed_tag("linear_cols");
    mma_switch(true);
    h = hw_fp8(DIM / 8, 8 * O_LORA, 0, 8 * O_LORA, 0.02f);
    for (int i = 0; i < 5; i++) assert_true(linear_cols_case("FP8 wo_b [640,8192]", &h, 8, Ts[i]) == gpu);
    hw_free(&h);
    h = hw_fp4(256, 640), assert_true(linear_cols_case("FP4 [256,640]", &h, 5, 17) == gpu), hw_free(&h);
    h = hw_fp8(37, 96, 0, 96, 0.05f), assert_true(linear_cols_case("FP8 odd [37,96]", &h, 3, 9) == gpu);
    assert_false(linear_cols_case("FP8 blocks of 48", &h, 2, 9));
    hw_free(&h);
    h = hw_bf16(64, 256, 0.05f), assert_false(linear_cols_case("BF16 [64,256]", &h, 8, 5)), hw_free(&h);
    mma_switch(false);
    h = hw_fp8(DIM / 8, 8 * O_LORA, 0, 8 * O_LORA, 0.02f);
    assert_false(linear_cols_case("exact FP8 wo_b", &h, 8, 3));
    hw_free(&h);
}

#ifdef DS_HAVE_CUDA
/* One weight's forced tilings against CUDA_MMA_AUTO at each row count, bit for bit: FP8 on the same
 * quantized x (CUDA_MMA_PREQUANT), BF16 on x itself; the decode forms (DECODE, MT1-MT4) only up to
 * their 256 rows. */
static void mma_forms_case(const char *name, const struct qweight *g, const int64_t *Ts, size_t nT, const int *forms,
                           const char *const *form_names, size_t nf) {
    const int64_t n = g->n, k = g->k;
    const bool q = g->fmt != WF_BF16;
    const int flag = q ? CUDA_MMA_PREQUANT : 0;
    for (size_t ti = 0; ti < nT; ti++) {
        const int64_t T = Ts[ti];
        bf16_t *x = NEW(bf16_t, T * k), *ya = NEW(bf16_t, T * n), *yf = NEW(bf16_t, T * n);
        fill_act(x, T * k, 1.0f);
        void *dx = g_in(x, (size_t)(T * k) * 2), *dq = q ? g_out(cuda_linear_mma_act_bytes(T, k), PZ_16) : dx;
        void *ws = g_out(cuda_linear_mma_workspace_bytes(T, n, k), PZ_16), *dya = g_out((size_t)(T * n) * 2, PZ_16);
        if (q) cuda_linear_mma_act_quant(dq, dx, T, k, NULL);
        cuda_linear_mma_tiling(CUDA_MMA_AUTO | flag, (int)g->fmt, dya, dq, T, g->w, g->s, n, k, g->ld, g->s_ld, ws, NULL);
        assert_int_equal(cudaDeviceSynchronize(), cudaSuccess); /* the legacy stream (see test_linear_mma_pair) */
        g_get(ya, dya, (size_t)(T * n) * 2);
        for (size_t fi = 0; fi < nf; fi++) {
            const bool dec = forms[fi] == CUDA_MMA_DECODE || (forms[fi] >= CUDA_MMA_DECODE_MT1 && forms[fi] <= CUDA_MMA_DECODE_MT4);
            if (T > 256 && dec) continue; /* decode rows */
            void *dyf = g_out((size_t)(T * n) * 2, PZ_16);
            cuda_linear_mma_tiling(forms[fi] | flag, (int)g->fmt, dyf, dq, T, g->w, g->s, n, k, g->ld, g->s_ld, ws, NULL);
            assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
            g_get(yf, dyf, (size_t)(T * n) * 2);
            struct cmp c;
            cmp_begin(&c, "linear form", "%s T=%lld %s", name, (long long)T, form_names[fi]);
            for (int64_t i = 0; i < T * n; i++) cmp_bits(&c, i, yf[i], ya[i], bf16_to_f32(yf[i]), bf16_to_f32(ya[i]));
            cmp_end(&c);
            g_free(dyf);
        }
        if (q) g_free(dq);
        g_free(dx), g_free(ws), g_free(dya);
        free(x), free(ya), free(yf);
    }
}
#endif

/* The forced FP8 decode forms (CUDA_MMA_DECODE_MT1 / _MT2 / _MT4, which bench_linear_cuda --forms
 * times to choose the forms' row ranges) and the forced prefill tiles (128 x 128, 128 x 64, 64 x
 * 64: bench_linear_cuda --tiles) against the call's own choice on the same quantized x: the same
 * bits for every output, at row counts where each form is not the default one (3: the split
 * kernel's; 24, 40, 64, 130: one, two or four m16 tiles and more than one row tile; 300: the tiles
 * with a part-filled last row tile, the decode forms left out), a real shape, a weight slice (row
 * stride above k) and odd sizes. Then BF16 weights through the tilings BF16 has (decode, 128 x 128,
 * 64 x 64) at the mHC mixes' pieces [72, 20480] (20 k-chunks), the router gate's [384, 5120] and
 * an odd [37, 160]. */
static void test_linear_mma_forms(void **st) {
    NEED_GPU(st);
#ifndef DS_HAVE_CUDA
    skip();
#else
    if (gpu_state != 1) skip(); /* the tensor-core entry points called directly: no CPU stand-in */
    const int64_t Ts[] = {3, 24, 40, 64, 130, 300}, Tb[] = {3, 64, 130, 300};
    const int forms[] = {CUDA_MMA_DECODE_MT1,     CUDA_MMA_DECODE_MT2,     CUDA_MMA_DECODE_MT4,
                         CUDA_MMA_PREFILL,        CUDA_MMA_PREFILL_128x64, CUDA_MMA_PREFILL_64x64};
    const char *const form_names[] = {"MT1", "MT2", "MT4", "128x128", "128x64", "64x64"};
    const int bforms[] = {CUDA_MMA_DECODE, CUDA_MMA_PREFILL, CUDA_MMA_PREFILL_64x64};
    const char *const bform_names[] = {"decode", "128x128", "64x64"};
    const char *names[] = {"wq_a [1280,5120]", "wo_b TP slice [5120,1024]", "odd [37,160]",
                           "hc mixes [72,20480] bf16", "gate [384,5120] bf16", "odd [37,160] bf16"};
    struct hw hs[6];
    seed_tag("mma forms");
    hs[0] = hw_fp8(Q_LORA, DIM, 0, DIM, 0.02f);
    hs[1] = hw_fp8(DIM, 8 * O_LORA, RANK * O_LORA, O_LORA, 0.02f);
    hs[2] = hw_fp8(37, 160, 0, 160, 0.05f);
    hs[3] = hw_bf16(72, 4 * DIM, 0.02f);
    hs[4] = hw_bf16(N_EXPERTS, DIM, 0.02f);
    hs[5] = hw_bf16(37, 160, 0.05f);
    for (size_t hi = 0; hi < sizeof hs / sizeof hs[0]; hi++) {
        struct qweight g = g_weight(&hs[hi].q, false);
        if (hi < 3) mma_forms_case(names[hi], &g, Ts, sizeof Ts / sizeof *Ts, forms, form_names, sizeof forms / sizeof *forms);
        else mma_forms_case(names[hi], &g, Tb, sizeof Tb / sizeof *Tb, bforms, bform_names, sizeof bforms / sizeof *bforms);
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

/* =============================================================================================
 * Setup */

static int group_setup(void **st) {
    cuda_weights_tables_init();
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
        cmocka_unit_test(test_batch_invariance_linear),
        cmocka_unit_test(test_linear_mma),
        cmocka_unit_test(test_linear_mma_kernels_agree),
        cmocka_unit_test(test_linear_mma_pair),
        cmocka_unit_test(test_linear_cols),
        cmocka_unit_test(test_linear_mma_forms),
        cmocka_unit_test(test_batch_invariance_head),
    };
    cuda_ops_test_filters();
    return cmocka_run_group_tests(tests, group_setup, cuda_ops_group_teardown);
}
