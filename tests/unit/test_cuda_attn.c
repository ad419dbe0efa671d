/* The CUDA backend's attention ops against the CPU reference backend: sparse_attn (both paths:
 * the exact kernels and the tensor-core forms, which must agree with each other bit for bit) and
 * sparse_attn_rope (bit for bit the GPU's sparse_attn, then rope), sparse_attn_index (bit for bit
 * attn_index, then sparse_attn_rope),
 * compress_pool and index_scores, each against the interval of what either backend may produce
 * (the models below, from backend.h's rounding points and tolerances.h's freedoms), and the batch
 * invariance of sparse_attn and index_scores. Split from test_cuda_ops_misc.c (the elementwise,
 * mHC, embedding and Engram ops); the harness is cuda_ops_common.h. */
#include "cuda_ops_common.h"
#include "attn_index_core.h"
#ifdef DS_HAVE_CUDA
#include "cuda/attn_mma.h"
#endif

/* ---------------------------------------------------------------------------------------------
 * Models: what either backend may produce */

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
    assert_true(cuda_sparse_attn_mma_path(&gpu_be, CUDA_ATTN_TWO_PASS, d2, dq, dkv, di, T, H, hd, n_idx, ds, a.scale, NULL));
    const bool fits = cuda_sparse_attn_mma_path(&gpu_be, CUDA_ATTN_ONE_PASS, d1, dq, dkv, di, T, H, hd, n_idx, ds, a.scale, NULL);
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

/* sparse_attn_rope (path -1: the op through be_sparse_attn_rope; else the tensor-core form `path`
 * forced, with the RoPE in its stores) against the GPU's own sparse_attn, then rope, bit for bit:
 * the fused stores must give the two ops' bits. Positions near 0 and far out (sinf/cosf range
 * reduction). Returns false where the forced form refuses the shape (nothing launched). */
static bool attn_rope_case(const char *name, int path, int64_t T, int64_t H, int64_t hd, int64_t n_idx, int64_t nkv,
                           int64_t off, int64_t rd, bool inverse) {
    char tag[192];
    snprintf(tag, sizeof tag, "sparse_attn_rope %s T=%lld path %d", name, (long long)T, path);
    struct attn_in a = make_attn(tag, T, H, hd, n_idx, nkv);
    int32_t *pos = NEW(int32_t, T);
    for (int64_t t = 0; t < T; t++) pos[t] = (int32_t)(t % 2 ? irand(1 << 20) : irand(300));
    float *freqs = NEW(float, rd / 2 + 1);
    make_freqs(freqs, rd / 2, 10000.0, false);
    const size_t ob = (size_t)(T * H * hd) * 2;
    void *dq = g_in(a.q, (size_t)(T * H * hd) * 2), *dkv = g_in(a.kv, (size_t)(nkv * hd) * 2),
         *di = g_in(a.idx, (size_t)(T * n_idx) * 4), *dr = g_out(ob, PZ_16), *df = g_out(ob, PZ_16);
    int32_t *dpos = g_in(pos, (size_t)T * 4);
    float *dfr = g_in(freqs, (size_t)(rd / 2 + 1) * 4);
    const void *ds = g_tensor(a.sink, (size_t)H * 4, false);
    GPU->sparse_attn(&gpu_be, dr, dq, dkv, di, T, H, hd, n_idx, ds, a.scale);
    GPU->rope(&gpu_be, dr, T, H, H * hd, hd, off, rd, dpos, dfr, inverse);
    const struct attn_rope r = {off, rd, dpos, dfr, inverse};
    bool ran = true;
    if (path < 0) be_sparse_attn_rope(&gpu_be, df, dq, dkv, di, T, H, hd, n_idx, ds, a.scale, &r);
#ifdef DS_HAVE_CUDA
    else ran = cuda_sparse_attn_mma_path(&gpu_be, path, df, dq, dkv, di, T, H, hd, n_idx, ds, a.scale, &r);
#endif
    if (ran) {
        uint16_t *orf = NEW(uint16_t, T * H * hd), *ofu = NEW(uint16_t, T * H * hd);
        g_get(orf, dr, ob);
        g_get(ofu, df, ob);
        struct cmp c;
        cmp_begin(&c, "sparse_attn_rope", "= sparse_attn, rope: %s T=%lld path %d", name, (long long)T, path);
        for (int64_t i = 0; i < T * H * hd; i++) cmp_bits(&c, i, ofu[i], orf[i], bf16_to_f32(ofu[i]), bf16_to_f32(orf[i]));
        cmp_end(&c);
        free(orf);
        free(ofu);
    }
    g_free(dq);
    g_free(dkv);
    g_free(di);
    g_free(dr);
    g_free(df);
    g_free(dpos);
    g_free(dfr);
    GPU->tensor_release(&gpu_be, ds);
    free(pos);
    free(freqs);
    free_attn(&a);
    return ran;
}

/* The real shape (8 heads of 512, the inverse RoPE on the last 64 channels: the P·V slice kernel's
 * 16-, 32- and 64-channel slices at 1-8, 17 and 40 rows, the one pass from 80, the split P·V at 129
 * and 600 rows forced) and odd ones: a rotary span across slice edges (hd 128, off 42, rd 60), the
 * forward rotation, 3 heads (a partial head group), rd 0 (no RoPE), an odd first channel (the
 * forms refuse it; the op then runs the two ops). The mma switch off: the exact kernels, then
 * rope. */
static void test_sparse_attn_rope(void **st) {
    NEED_GPU(st);
    const int64_t rows[] = {1, 8, 17, 40, 129, 600};
    for (int mma = 0; mma < 2; mma++) {
        mma_switch(mma);
        for (int i = 0; i < 6; i++)
            attn_rope_case(mma ? "mma real" : "real", -1, rows[i], H_LOCAL, HD, WINDOW + INDEX_TOPK, WINDOW + 2048,
                           HD - 64, 64, true);
        attn_rope_case(mma ? "mma span across slices" : "span across slices", -1, 17, 3, 128, 100, 300, 42, 60, false);
    }
    mma_switch(true);
    attn_rope_case("mma no rotary part", -1, 5, 3, 128, 100, 300, 0, 0, true);
    attn_rope_case("mma odd first channel", -1, 5, 3, 128, 100, 300, 43, 60, true);
#ifdef DS_HAVE_CUDA
    if (gpu_state == 1) { /* the forms called directly: not on the CPU stand-in */
        for (int i = 0; i < 6; i++) {
            assert_true(attn_rope_case("real", CUDA_ATTN_TWO_PASS, rows[i], H_LOCAL, HD, WINDOW + INDEX_TOPK, WINDOW + 2048,
                                       HD - 64, 64, true));
            assert_true(attn_rope_case("real", CUDA_ATTN_ONE_PASS, rows[i], H_LOCAL, HD, WINDOW + INDEX_TOPK, WINDOW + 2048,
                                       HD - 64, 64, true));
        }
        assert_true(attn_rope_case("span across slices", CUDA_ATTN_TWO_PASS, 129, 3, 128, 100, 300, 42, 60, false));
        assert_true(attn_rope_case("span across slices", CUDA_ATTN_ONE_PASS, 17, 3, 128, 100, 300, 42, 60, false));
        assert_false(attn_rope_case("odd pair start", CUDA_ATTN_TWO_PASS, 3, 3, 128, 100, 300, 43, 60, false));
    }
#endif
    mma_switch(false);
}

/* sparse_attn_index (path -1: the op through be_sparse_attn_index; else the tensor-core form `path`
 * forced over the formed entries) against attn_index's lists through sparse_attn_rope, both on the
 * GPU, bit for bit: a batch laid out as attention.c lays it out (n sequences in distinct slots, one
 * row each or chunks of up to 2W rows, some from position 0 with the reference layout's shorter
 * window), window entries in the chunk and in the ring, k compressed entries with -1 among them,
 * -1 padding. Returns whether the op (or the form) took the call; false means nothing ran and the
 * lists path is what the helper ran instead. */
static bool attn_index_op_case(const char *name, int path, int n, bool decode, int64_t W, int64_t k, int64_t H,
                               int64_t hd) {
    char tag[192];
    snprintf(tag, sizeof tag, "sparse_attn_index %s n=%d %s k=%lld path %d", name, n, decode ? "decode" : "chunks",
             (long long)k, path);
    seed_tag(tag);
    const int64_t ring0 = 4 * W, cap = 300, slots = 2 * n + 1, src0 = ring0 + slots * W, nkv = src0 + slots * cap;
    int64_t T = 0, nw_max = 0;
    int64_t *start = NEW(int64_t, n), *len = NEW(int64_t, n);
    for (int i = 0; i < n; i++) {
        len[i] = decode ? 1 : 1 + irand(2 * W);
        start[i] = (rnd64() & 3) == 0 ? 0 : irand(5 * W);
        T += len[i];
    }
    const int64_t ld_src = k + 3;
    int32_t *geo = NEW(int32_t, T * AIX_COLS), *src = NEW(int32_t, T * ld_src + 1);
    for (int64_t i = 0; i < T * ld_src; i++) src[i] = (rnd64() & 3) == 0 ? -1 : (int32_t)irand(cap);
    for (int i = 0, r = 0; i < n; i++) {
        const int64_t nw = start[i] == 0 && (i & 1) ? (len[i] < W ? len[i] : W) : W, slot = 2 * i + irand(2);
        nw_max = nw > nw_max ? nw : nw_max;
        for (int64_t t = 0; t < len[i]; t++, r++) {
            int32_t *g = geo + (int64_t)r * AIX_COLS;
            g[AIX_P] = (int32_t)(start[i] + t), g[AIX_START] = (int32_t)start[i], g[AIX_CHUNK_ROW] = (int32_t)(r - t);
            g[AIX_SLOT] = (int32_t)slot, g[AIX_NW] = (int32_t)nw, g[AIX_END] = (int32_t)(start[i] + len[i]);
        }
    }
    const int64_t n_idx = nw_max + k + 5; /* some padding */
    struct attn_in a = make_attn(tag, T, H, hd, 1, nkv);
    int32_t *dgeo = g_in(geo, sizeof(int32_t) * (size_t)(T * AIX_COLS)), *dsrc = g_in(src, sizeof(int32_t) * (size_t)(T * ld_src + 1));
    const struct attn_index_par par = {W, ring0, k ? dsrc : NULL, ld_src, k, src0, cap};
    int32_t *pos = NEW(int32_t, T);
    for (int64_t t = 0; t < T; t++) pos[t] = geo[t * AIX_COLS + AIX_P];
    float *freqs = NEW(float, 33);
    make_freqs(freqs, 32, 10000.0, false);
    int32_t *dpos = g_in(pos, (size_t)T * 4);
    float *dfr = g_in(freqs, 33 * 4);
    const struct attn_rope r = {hd - 64, 64, dpos, dfr, true};
    const size_t ob = (size_t)(T * H * hd) * 2;
    void *dq = g_in(a.q, ob), *dkv = g_in(a.kv, (size_t)(nkv * hd) * 2), *dr = g_out(ob, PZ_16), *df = g_out(ob, PZ_16);
    int32_t *di = g_out(sizeof(int32_t) * (size_t)(T * n_idx), PZ_32I), *dj = g_out(sizeof(int32_t) * (size_t)(T * n_idx), PZ_32I);
    const void *ds = g_tensor(a.sink, (size_t)H * 4, false);
    GPU->attn_index(&gpu_be, di, n_idx, dgeo, T, &par);
    be_sparse_attn_rope(&gpu_be, dr, dq, dkv, di, T, H, hd, n_idx, ds, a.scale, &r);
    bool took = false;
    if (path < 0) {
        took = GPU->sparse_attn_index && GPU->sparse_attn_index(&gpu_be, df, dq, dkv, dgeo, &par, T, H, hd, n_idx, ds, a.scale, &r);
        if (!took) be_sparse_attn_index(&gpu_be, df, dq, dkv, dj, dgeo, &par, T, H, hd, n_idx, ds, a.scale, &r);
    }
#ifdef DS_HAVE_CUDA
    else took = cuda_sparse_attn_index_path(&gpu_be, path, df, dq, dkv, dgeo, &par, T, H, hd, n_idx, ds, a.scale, &r);
#endif
    if (took || path < 0) {
        uint16_t *orf = NEW(uint16_t, T * H * hd), *ofu = NEW(uint16_t, T * H * hd);
        g_get(orf, dr, ob);
        g_get(ofu, df, ob);
        struct cmp c;
        cmp_begin(&c, "sparse_attn_index", "= attn_index, sparse_attn_rope: %s", tag);
        for (int64_t i = 0; i < T * H * hd; i++) cmp_bits(&c, i, ofu[i], orf[i], bf16_to_f32(ofu[i]), bf16_to_f32(orf[i]));
        cmp_end(&c);
        free(orf);
        free(ofu);
    }
    g_free(dgeo);
    g_free(dsrc);
    g_free(dpos);
    g_free(dfr);
    g_free(dq);
    g_free(dkv);
    g_free(dr);
    g_free(df);
    g_free(di);
    g_free(dj);
    GPU->tensor_release(&gpu_be, ds);
    free(start);
    free(len);
    free(geo);
    free(src);
    free(pos);
    free(freqs);
    free_attn(&a);
    return took;
}

/* The real shape (8 heads of 512, W = 128, 512 compressed entries): decode batches of 1, 8 and 96
 * rows (two passes, and the one pass from 80), chunks of several sequences (the one pass; the split
 * two passes at 128 rows and more), no compressed part; then each form forced, and an odd shape (3
 * heads of 128, a short window). On the GPU the op takes every call under the mma switch and
 * declines with it off (the exact kernels read lists), where the helper runs attn_index and
 * sparse_attn_rope. */
static void test_sparse_attn_index(void **st) {
    NEED_GPU(st);
    const bool gpu = gpu_state == 1; /* the CPU stand-in has no such op: the helper's lists path */
    mma_switch(true);
    const int ns[] = {1, 8, 96};
    for (int i = 0; i < 3; i++) assert_true(attn_index_op_case("real", -1, ns[i], true, WINDOW, INDEX_TOPK, H_LOCAL, HD) == gpu);
    assert_true(attn_index_op_case("real", -1, 3, false, WINDOW, INDEX_TOPK, H_LOCAL, HD) == gpu);
    assert_true(attn_index_op_case("real, no compressed part", -1, 4, false, WINDOW, 0, H_LOCAL, HD) == gpu);
    assert_true(attn_index_op_case("3 heads hd=128", -1, 5, false, 16, 40, 3, 128) == gpu);
#ifdef DS_HAVE_CUDA
    if (gpu) {
        for (int p = CUDA_ATTN_TWO_PASS; p <= CUDA_ATTN_ONE_PASS; p++) {
            assert_true(attn_index_op_case("real", p, 2, true, WINDOW, INDEX_TOPK, H_LOCAL, HD));
            assert_true(attn_index_op_case("real", p, 2, false, WINDOW, INDEX_TOPK, H_LOCAL, HD));
        }
        assert_false(attn_index_op_case("hd=1024", CUDA_ATTN_ONE_PASS, 2, true, WINDOW, 64, 8, 1024));
    }
#endif
    mma_switch(false);
    assert_false(attn_index_op_case("exact kernels", -1, 8, true, WINDOW, INDEX_TOPK, H_LOCAL, HD));
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
    /* head counts that leave a round part-empty (8, 12) or need two (64), prefill-sized rows, and an
     * unaligned head dim */
    index_scores_case("8 heads x 128, 300 keys", 9, 8, IDX_HD, 300, 8 * IDX_HD, 300);
    index_scores_case("12 heads x 128, 300 keys", 9, 12, IDX_HD, 300, 12 * IDX_HD, 301);
    index_scores_case("64 heads x 128, 200 keys", 5, 64, IDX_HD, 200, 64 * IDX_HD, 200);
    index_scores_case("4 heads x 128, 512 keys, 96 rows", 96, IDX_H_LOCAL, IDX_HD, 512, IDX_H_LOCAL * IDX_HD, 512);
    index_scores_case("odd 4 heads x 37, 150 keys", 6, 4, 37, 150, 4 * 37 + 3, 150);
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

/* Padding at the end of the index lists changes no bit: a decode step in a graph segment runs the
 * attention over lists widened to a multiple of 64 with -1 entries (attention.c), where an eager
 * step has them as wide as the batch needs; the two must agree bit for bit, on every kernel form
 * (the exact kernels, the two-pass tensor-core kernels at 1-64 rows, the one pass at 128). */
static void test_sparse_attn_padding(void **st) {
    NEED_GPU(st);
    enum { N0 = 200, N1 = 320, ROWS = 128 };
    struct attn_in a = make_attn("sparse_attn padding", ROWS, H_LOCAL, HD, N0, WINDOW + 2048);
    int32_t *wide = NEW(int32_t, ROWS * N1);
    for (int64_t t = 0; t < ROWS; t++)
        for (int64_t i = 0; i < N1; i++) wide[t * N1 + i] = i < N0 ? a.idx[t * N0 + i] : -1;
    const size_t ob = (size_t)(ROWS * H_LOCAL * HD) * 2;
    void *dq = g_in(a.q, ob), *dkv = g_in(a.kv, (size_t)(a.nkv * HD) * 2), *d0 = g_in(a.idx, (size_t)(ROWS * N0) * 4),
         *d1 = g_in(wide, (size_t)(ROWS * N1) * 4);
    const void *ds = g_tensor(a.sink, H_LOCAL * 4, false);
    bf16_t *o0 = NEW(bf16_t, ROWS * H_LOCAL * HD), *o1 = NEW(bf16_t, ROWS * H_LOCAL * HD);
    const int64_t Ts[] = {1, 8, 64, ROWS};
    for (int mma = 0; mma < 2; mma++) {
        mma_switch(mma);
        for (int i = 0; i < 4; i++) {
            const int64_t T = Ts[i];
            void *dout = g_out(ob, PZ_16);
            GPU->sparse_attn(&gpu_be, dout, dq, dkv, d0, T, H_LOCAL, HD, N0, ds, a.scale);
            g_get(o0, dout, (size_t)(T * H_LOCAL * HD) * 2);
            g_free(dout);
            dout = g_out(ob, PZ_16);
            GPU->sparse_attn(&gpu_be, dout, dq, dkv, d1, T, H_LOCAL, HD, N1, ds, a.scale);
            g_get(o1, dout, (size_t)(T * H_LOCAL * HD) * 2);
            g_free(dout);
            struct cmp c;
            cmp_begin(&c, "sparse_attn padded lists", "%s T=%lld, %d -> %d entries", mma ? "mma" : "exact", (long long)T,
                      N0, N1);
            cmp_bf16_exact(&c, o1, o0, T * H_LOCAL * HD);
            cmp_end(&c);
        }
    }
    mma_switch(false);
    g_free(dq);
    g_free(dkv);
    g_free(d0);
    g_free(d1);
    GPU->tensor_release(&gpu_be, ds);
    free(o0);
    free(o1);
    free(wide);
    free_attn(&a);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sparse_attn),
        cmocka_unit_test(test_sparse_attn_padding),
        cmocka_unit_test(test_sparse_attn_forms),
        cmocka_unit_test(test_sparse_attn_rope),
        cmocka_unit_test(test_sparse_attn_index),
        cmocka_unit_test(test_compress_pool),
        cmocka_unit_test(test_index_scores),
        cmocka_unit_test(test_index_scores_rows),
        cmocka_unit_test(test_batch_invariance_sparse_attn),
        cmocka_unit_test(test_batch_invariance_index_scores),
    };
    cuda_ops_test_filters();
    return cmocka_run_group_tests(tests, cuda_ops_group_setup, cuda_ops_group_teardown);
}
