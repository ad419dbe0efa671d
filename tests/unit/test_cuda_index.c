/* The CUDA backend against the CPU reference backend: the indexer's selection ops (index_topk,
 * cand_mask), sparse_attn's index lists (attn_index) and the batched device copy (copy_segs); the
 * router's two selection kernels against each other and the CPU's scan (test_router_select); and
 * the head's row ops (argmax, row_topk, row_lse: the draws and log-probabilities where the logits
 * are). All are comparisons and moves only, or (row_lse) the same terms in the same order, so the
 * GPU must match the CPU bit for bit (TOL_GPU_DATA_EXACT, TOL_GPU_INDEX_SELECT_EXACT,
 * TOL_GPU_ROW_LSE_EXACT).
 *
 * The selection is where the two backends could part: the scores are bf16 and relu makes exact
 * zeros, so ties at the k-th place are the rule, and which of the tied entries are kept is
 * torch.topk's tie order (kernels/topk_core.h, which both backends run). The scores here are drawn
 * from a few dozen bf16 values, many exact (±)0, some -inf and a few NaN (NaN ranks largest),
 * with garbage past each row's n_valid and n that the ops must not see; per-row parameters mix
 * full rows, rows with n <= k (every entry selected), key caches shorter than the row, rows with
 * visible < n and empty rows. Widths cover the kernel's shared-memory path (up to 6,144 pairs)
 * and its global-scratch path (7,000; 50,000: a long context on a ratio-1 layer, where
 * k·64 <= n takes the heap select), the mask from NULL, random, and cand_mask's own output.
 * The CPU result is also checked against the ops' contracts (kernels/backend.h), so the test fails
 * even where both backends agree, and under DS_CUDA_OPS_ON_CPU: index_topk selects exactly
 * min(k, n) entries, ascending, none ranking below an unselected one, and hides those >= visible;
 * cand_mask keeps whole blocks, min(topk_blocks, blocks) of them less the -inf ones, the best by
 * block maximum, always the last visible one; attn_index's lists are the ones the host built
 * before it (window, compressed part, padding); ring_store writes a chunk's last W rows where
 * the host list put them and no other ring row; copy_segs writes its ranges and nothing else (the
 * poison around them survives). The harness is cuda_ops_common.h. */
#include "cuda_ops_common.h"
#ifdef DS_HAVE_CUDA
#include <cuda_runtime.h>

#include "cpu/cpu_internal.h"
#include "cuda/cuda_router.h"
#include "lse_core.h"
#endif
#include "attn_index_core.h"

_Static_assert(TOL_GPU_DATA_EXACT == 0 && TOL_GPU_INDEX_SELECT_EXACT == 0,
               "copy_segs, attn_index, ring_store, index_topk and cand_mask are compared bit for bit");

/* A violation of the op's contract by the CPU result (reported by cmp_end as a self-check failure). */
static void self_fail(struct cmp *c, const char *fmt, ...) {
    if (c->nself++) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->self, sizeof c->self, fmt, ap);
    va_end(ap);
}

static void cmp_i32_exact(struct cmp *c, const int32_t *g, const int32_t *r, int64_t n) {
    for (int64_t i = 0; i < n; i++) cmp_bits(c, i, (uint32_t)g[i], (uint32_t)r[i], g[i], r[i]);
}

static void cmp_u8_exact(struct cmp *c, const uint8_t *g, const uint8_t *r, int64_t n) {
    for (int64_t i = 0; i < n; i++) cmp_bits(c, i, g[i], r[i], g[i], r[i]);
}

static int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

/* ---------------------------------------------------------------------------------------------
 * Inputs: score rows with many exact ties, per-row parameters, masks */

/* One score as index_scores makes them: bf16, often exactly 0 (relu), -inf past visible, rarely NaN. */
static float draw_score(double zero_frac) {
    double u = urand();
    if (u < zero_frac) return (rnd64() & 7) ? 0.0f : -0.0f;
    u = (u - zero_frac) / (1.0 - zero_frac);
    if (u < 0.06) return -INFINITY;
    if (u < 0.065) return NAN;
    if (u < 0.8) return bf16_round(1.0f + 0.25f * (float)urand()); /* 32 values: ties everywhere */
    return bf16_round(gauss() * 0.5f);
}

/* S [T, ld_s]: row r scored over [0, min(n, n_valid)); past that, values the ops must not read
 * (the rest of the row is a shorter key cache's garbage or the next sequence's width). */
static void fill_scores(float *S, int64_t T, int64_t ld_s, const int32_t *p) {
    static const double zf[] = {0.05, 0.35, 0.7};
    for (int64_t r = 0; r < T; r++) {
        const int32_t *pr = p + r * TOPK_P_COUNT;
        int64_t lim = imin(pr[TOPK_P_N], pr[TOPK_P_VALID]);
        double z = zf[irand(3)];
        for (int64_t j = 0; j < ld_s; j++) {
            float *s = S + r * ld_s + j;
            if (j < lim)
                *s = draw_score(z);
            else
                *s = (j & 3) == 0 ? NAN : (j & 3) == 1 ? INFINITY : 1e30f * (float)(1.0 + urand());
        }
    }
}

/* p [T, TOPK_P_COUNT] by row kind (n <= ld_s on every row, as attention.c lays them out). */
static void make_params(int32_t *p, int64_t T, int64_t ld_s, int64_t k) {
    int64_t salt = irand(6);
    for (int64_t r = 0; r < T; r++) {
        int64_t n, nv, kk = k, vis;
        switch ((r + salt) % 6) {
        case 0: /* decode at the full width */
            n = nv = vis = ld_s;
            break;
        case 1: /* n <= k: every entry selected */
            n = nv = vis = 1 + irand(imin(ld_s, k));
            break;
        case 2: /* the key cache shorter than the row: entries >= n_valid read -inf */
            n = vis = ld_s / 2 + irand(ld_s - ld_s / 2 + 1);
            nv = irand(n + 1);
            break;
        case 3: /* visible < n (the chunk's whole width scored) */
            n = nv = ld_s / 2 + irand(ld_s - ld_s / 2 + 1);
            vis = irand(n + 1);
            break;
        case 4: /* a sequence with no keys yet: the zeros attention.c leaves */
            n = nv = kk = vis = 0;
            break;
        default: /* anything: n_valid and visible past n, k below k_max */
            n = irand(ld_s + 1);
            nv = irand(ld_s + 1);
            kk = 1 + irand(k);
            vis = irand(n + 9);
            break;
        }
        int32_t *pr = p + r * TOPK_P_COUNT;
        pr[TOPK_P_N] = (int32_t)n;
        pr[TOPK_P_VALID] = (int32_t)nv;
        pr[TOPK_P_K] = (int32_t)kk;
        pr[TOPK_P_VISIBLE] = (int32_t)vis;
    }
}

/* A candidate mask: mostly kept, any nonzero byte keeps (the contract tests mask[j] == 0). */
static void fill_mask(uint8_t *m, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t x = rnd64();
        m[i] = (x & 3) == 0 ? 0 : (x & 0x30) == 0 ? (uint8_t)(2 + (x >> 8) % 254) : 1;
    }
}

/* ---------------------------------------------------------------------------------------------
 * index_topk */

/* torch.topk's order for largest=True: NaN above everything (NaNs equal), then by value (-0 == +0). */
static bool score_above(float a, float b) { return isnan(a) ? !isnan(b) : !isnan(b) && a > b; }

/* Entry j of a row as the contract reads it (backend.h, index_topk), written here independently. */
static float read_entry(const float *row, int64_t j, int64_t nv, const uint8_t *mr, int64_t ld_m) {
    if (j >= nv || (mr && (j >= ld_m || !mr[j]))) return -INFINITY;
    return row[j];
}

/* The CPU's top [T, ld_top] against the contract. The selection before the visible mapping is
 * that of the same call with visible = INT32_MAX (visible only hides, after the selection). */
static void topk_self(struct cmp *c, const int32_t *top, int64_t ld_top, const float *S, int64_t ld_s, const int32_t *p,
                      const uint8_t *mask, int64_t ld_m, int64_t T) {
    int32_t *pv = NEW(int32_t, T * TOPK_P_COUNT), *tv = NEW(int32_t, T * ld_top);
    memcpy(pv, p, sizeof(int32_t) * (size_t)(T * TOPK_P_COUNT));
    for (int64_t r = 0; r < T; r++) pv[r * TOPK_P_COUNT + TOPK_P_VISIBLE] = INT32_MAX;
    poison_host(tv, sizeof(int32_t) * (size_t)(T * ld_top), PZ_32I);
    CPU->index_topk(&cpu_be, tv, ld_top, S, ld_s, pv, mask, ld_m, T);
    uint8_t *sel = NEW(uint8_t, ld_s + 1);
    for (int64_t r = 0; r < T; r++) {
        const int32_t *pr = p + r * TOPK_P_COUNT, *o = top + r * ld_top, *v = tv + r * ld_top;
        int64_t n = pr[TOPK_P_N], nv = pr[TOPK_P_VALID], k = pr[TOPK_P_K], vis = pr[TOPK_P_VISIBLE];
        int64_t ke = k < 0 ? 0 : imin(k, n);
        const float *row = S + r * ld_s;
        const uint8_t *mr = mask ? mask + r * ld_m : NULL;
        memset(sel, 0, (size_t)n + 1);
        for (int64_t j = 0; j < ld_top; j++) {
            int64_t at = r * ld_top + j;
            if (j >= ke) {
                if (v[j] != -1) self_fail(c, "row %lld slot %lld: %d past the min(k, n) = %lld selections (must be -1)",
                                          (long long)r, (long long)j, v[j], (long long)ke);
            } else if (v[j] < 0 || v[j] >= n || (j && v[j] <= v[j - 1]))
                self_fail(c, "row %lld slot %lld: %d, the selections must be strictly ascending entries of [0, %lld)",
                          (long long)r, (long long)j, v[j], (long long)n);
            else
                sel[v[j]] = 1;
            int32_t want = j < ke && v[j] < vis ? v[j] : -1;
            if (o[j] != want)
                self_fail(c, "element %lld (row %lld): %d, but the selection %d with visible %lld makes it %d", (long long)at,
                          (long long)r, o[j], v[j], (long long)vis, want);
        }
        if (ke == 0 || ke == n) continue;
        float lo = 0, hi = 0;
        bool have_lo = false, have_hi = false;
        for (int64_t j = 0; j < n; j++) {
            float x = read_entry(row, j, nv, mr, ld_m);
            if (sel[j]) {
                if (!have_lo || score_above(lo, x)) lo = x;
                have_lo = true;
            } else {
                if (!have_hi || score_above(x, hi)) hi = x;
                have_hi = true;
            }
        }
        if (have_lo && have_hi && score_above(hi, lo))
            self_fail(c, "row %lld: an unselected entry reads %.9g, above the selected %.9g (n %lld, k %lld)", (long long)r,
                      hi, lo, (long long)n, (long long)k);
    }
    free(sel);
    free(pv);
    free(tv);
}

/* index_topk on both backends and the comparison: dS/dp/dm are the GPU's copies of S/p/mask (dm
 * NULL with mask NULL); the GPU's output is poisoned before the run. */
static void topk_compare(const char *what, int64_t ld_top, const float *S, const void *dS, int64_t ld_s, const int32_t *p,
                         const void *dp, const uint8_t *mask, const void *dm, int64_t ld_m, int64_t T) {
    size_t ob = sizeof(int32_t) * (size_t)(T * ld_top);
    int32_t *tc = NEW(int32_t, T * ld_top), *tg = NEW(int32_t, T * ld_top);
    poison_host(tc, ob, PZ_32I);
    CPU->index_topk(&cpu_be, tc, ld_top, S, ld_s, p, mask, ld_m, T);
    void *dt = g_out(ob, PZ_32I);
    GPU->index_topk(&gpu_be, dt, ld_top, dS, ld_s, dp, dm, ld_m, T);
    g_get(tg, dt, ob);
    g_free(dt);
    struct cmp c;
    cmp_begin(&c, "index_topk", "%s", what);
    cmp_i32_exact(&c, tg, tc, T * ld_top);
    topk_self(&c, tc, ld_top, S, ld_s, p, mask, ld_m, T);
    cmp_end(&c);
    free(tc);
    free(tg);
}

static void index_topk_case(int64_t T, int64_t ld_s, int64_t k, int64_t ld_top, bool with_mask) {
    char what[160];
    snprintf(what, sizeof what, "T=%lld ld_s=%lld k=%lld ld_top=%lld %s", (long long)T, (long long)ld_s, (long long)k,
             (long long)ld_top, with_mask ? "mask" : "mask=NULL");
    char tag[200];
    snprintf(tag, sizeof tag, "index_topk %s", what);
    seed_tag(tag);
    int32_t *p = NEW(int32_t, T * TOPK_P_COUNT);
    make_params(p, T, ld_s, k);
    float *S = NEW(float, T * ld_s);
    fill_scores(S, T, ld_s, p);
    uint8_t *mask = NULL;
    int64_t ld_m = 0;
    if (with_mask) { /* ld_m below n on the wider rows (entries past it masked), or past the row */
        ld_m = (rnd64() & 1) ? ld_s - ld_s / 4 : ld_s + 5;
        mask = NEW(uint8_t, T * ld_m);
        fill_mask(mask, T * ld_m);
    }
    void *dS = g_in(S, sizeof(float) * (size_t)(T * ld_s)), *dp = g_in(p, sizeof(int32_t) * (size_t)(T * TOPK_P_COUNT));
    void *dm = mask ? g_in(mask, (size_t)(T * ld_m)) : NULL;
    topk_compare(what, ld_top, S, dS, ld_s, p, dp, mask, dm, ld_m, T);
    g_free(dS);
    g_free(dp);
    if (dm) g_free(dm);
    free(p);
    free(S);
    free(mask);
}

static const int64_t WIDTHS[] = {300, 1024, 2048, 6144, 7000}; /* 6,144 pairs: the last in shared memory */
#define N_WIDTHS 5
static const int64_t T_TOPK[] = {1, 8, 64};

static void test_index_topk(void **st) {
    NEED_GPU(st);
    for (int t = 0; t < 3; t++)
        for (int w = 0; w < N_WIDTHS; w++) index_topk_case(T_TOPK[t], WIDTHS[w], INDEX_TOPK, INDEX_TOPK + (w & 1 ? 0 : 3), false);
}

static void test_index_topk_mask(void **st) {
    NEED_GPU(st);
    for (int t = 0; t < 3; t++)
        for (int w = 0; w < N_WIDTHS; w++) index_topk_case(T_TOPK[t], WIDTHS[w], INDEX_TOPK, INDEX_TOPK + (w & 1 ? 3 : 0), true);
}

/* k·64 <= n: ATen's partial_sort (the heap select) instead of nth_element */
static void test_index_topk_heap_select(void **st) {
    NEED_GPU(st);
    index_topk_case(8, 2048, 16, 19, false);
    index_topk_case(8, 6144, 64, 64, true);
    index_topk_case(17, 7000, 100, 101, false);
    index_topk_case(3, 7000, 1, 4, true);
}

/* ---------------------------------------------------------------------------------------------
 * cand_mask */

/* The CPU's mask [T, ld_m] against the contract (ld_m >= n on every row here). */
static void cand_self(struct cmp *c, const uint8_t *mask, int64_t ld_m, const float *S, int64_t ld_s, const int32_t *p,
                      int64_t T, int64_t topk_blocks, int64_t bs) {
    float *bm = NEW(float, ld_s / bs + 2);
    for (int64_t r = 0; r < T; r++) {
        const int32_t *pr = p + r * TOPK_P_COUNT;
        int64_t n = pr[TOPK_P_N], nv = pr[TOPK_P_VALID], vis = pr[TOPK_P_VISIBLE], nb = (n + bs - 1) / bs;
        const uint8_t *mr = mask + r * ld_m;
        for (int64_t j = 0; j < ld_m; j++) {
            bool ok = j >= n ? mr[j] == 0 : (mr[j] == 0 || mr[j] == 1) && mr[j] == mr[j / bs * bs];
            if (!ok)
                self_fail(c, "row %lld entry %lld: %u (n %lld: 0 past n, 0 or 1 and one value per block of %lld)",
                          (long long)r, (long long)j, mr[j], (long long)n, (long long)bs);
        }
        /* block maxima as the op reads the entries (-inf past n_valid; a NaN never wins) */
        for (int64_t b = 0; b < nb; b++) {
            bm[b] = -INFINITY;
            for (int64_t j = b * bs; j < imin((b + 1) * bs, n); j++) {
                float x = read_entry(S + r * ld_s, j, nv, NULL, 0);
                if (x > bm[b]) bm[b] = x;
            }
        }
        int64_t vb = vis > 0 && (vis - 1) / bs < nb ? (vis - 1) / bs : -1;
        if (vb >= 0) bm[vb] = INFINITY;
        int64_t want = imin(topk_blocks, nb), fin = 0, kept = 0;
        float lo = INFINITY, hi = -INFINITY;
        for (int64_t b = 0; b < nb; b++) {
            fin += bm[b] > -INFINITY;
            if (mr[b * bs]) {
                kept++;
                lo = fmin(lo, bm[b]);
            } else
                hi = fmax(hi, bm[b]);
        }
        if (kept != imin(want, fin))
            self_fail(c, "row %lld: %lld blocks kept, must be min(%lld, %lld blocks) less the -inf ones = %lld", (long long)r,
                      (long long)kept, (long long)topk_blocks, (long long)nb, (long long)imin(want, fin));
        if (kept && !(lo > -INFINITY && lo >= hi))
            self_fail(c, "row %lld: a kept block's maximum %.9g is below an unkept one's %.9g (or -inf)", (long long)r, lo, hi);
        if (vb >= 0 && want > 0 && !mr[vb * bs])
            self_fail(c, "row %lld: the block %lld of the last visible entry %lld is not kept", (long long)r, (long long)vb,
                      (long long)(vis - 1));
    }
    free(bm);
}

/* cand_mask on both backends; the GPU's mask stays on the device in *dm_out when asked for. */
static void cand_compare(const char *what, uint8_t *mc, int64_t ld_m, const float *S, const void *dS, int64_t ld_s,
                         const int32_t *p, const void *dp, int64_t T, int64_t topk_blocks, int64_t bs, void **dm_out) {
    size_t mb = (size_t)(T * ld_m), mb2 = mb + (mb & 1);
    uint8_t *mg = NEW(uint8_t, mb2);
    poison_host(mc, mb2, PZ_16);
    CPU->cand_mask(&cpu_be, mc, ld_m, S, ld_s, p, T, topk_blocks, bs);
    void *dm = g_out(mb2, PZ_16);
    GPU->cand_mask(&gpu_be, dm, ld_m, dS, ld_s, dp, T, topk_blocks, bs);
    g_get(mg, dm, mb2);
    struct cmp c;
    cmp_begin(&c, "cand_mask", "%s", what);
    cmp_u8_exact(&c, mg, mc, (int64_t)mb2); /* the odd byte past the mask: poison on both */
    cand_self(&c, mc, ld_m, S, ld_s, p, T, topk_blocks, bs);
    cmp_end(&c);
    free(mg);
    if (dm_out)
        *dm_out = dm;
    else
        g_free(dm);
}

static void cand_mask_case(int64_t T, int64_t ld_s, int64_t ld_m, int64_t topk_blocks, int64_t bs) {
    char what[160], tag[200];
    snprintf(what, sizeof what, "T=%lld ld_s=%lld ld_m=%lld top %lld blocks of %lld", (long long)T, (long long)ld_s,
             (long long)ld_m, (long long)topk_blocks, (long long)bs);
    snprintf(tag, sizeof tag, "cand_mask %s", what);
    seed_tag(tag);
    int32_t *p = NEW(int32_t, T * TOPK_P_COUNT);
    make_params(p, T, ld_s, INDEX_TOPK);
    float *S = NEW(float, T * ld_s);
    fill_scores(S, T, ld_s, p);
    uint8_t *mc = NEW(uint8_t, T * ld_m + 1);
    void *dS = g_in(S, sizeof(float) * (size_t)(T * ld_s)), *dp = g_in(p, sizeof(int32_t) * (size_t)(T * TOPK_P_COUNT));
    cand_compare(what, mc, ld_m, S, dS, ld_s, p, dp, T, topk_blocks, bs, NULL);
    g_free(dS);
    g_free(dp);
    free(p);
    free(S);
    free(mc);
}

#define CAND_BS 8
static void test_cand_mask(void **st) {
    NEED_GPU(st);
    const int64_t Ts[] = {1, 8}, blocks[] = {2048, 16}; /* 2048: V4.1's, every block of these widths */
    for (int t = 0; t < 2; t++)
        for (int w = 0; w < N_WIDTHS; w++)
            for (int b = 0; b < 2; b++) cand_mask_case(Ts[t], WIDTHS[w], WIDTHS[w] + (w & 1) * 3, blocks[b], CAND_BS);
    /* a 50,000-key context: 6,250 blocks, a real selection of 2048, the kernel's global scratch */
    cand_mask_case(1, 50000, 50000, 2048, CAND_BS);
    cand_mask_case(8, 50000, 50000, 2048, CAND_BS);
    cand_mask_case(3, 7000, 7000, 4, CAND_BS); /* the heap select (4·64 <= 875 blocks) */
    cand_mask_case(5, 1000, 1001, 7, 3);       /* an odd block size */
}

/* The candidate source layer's mask feeding a later layer's index_topk, both on the device, as
 * attention.c runs them (one p for both, ld_m = ld_s). */
static void cand_then_topk_case(int64_t T, int64_t ld_s) {
    char what[160], tag[200];
    snprintf(what, sizeof what, "T=%lld ld_s=%lld k=%d, cand_mask's mask", (long long)T, (long long)ld_s, INDEX_TOPK);
    snprintf(tag, sizeof tag, "cand then topk %s", what);
    seed_tag(tag);
    int32_t *p = NEW(int32_t, T * TOPK_P_COUNT);
    make_params(p, T, ld_s, INDEX_TOPK);
    float *S0 = NEW(float, T * ld_s), *S1 = NEW(float, T * ld_s);
    fill_scores(S0, T, ld_s, p);
    fill_scores(S1, T, ld_s, p);
    uint8_t *mc = NEW(uint8_t, T * ld_s + 1);
    void *dS0 = g_in(S0, sizeof(float) * (size_t)(T * ld_s)), *dS1 = g_in(S1, sizeof(float) * (size_t)(T * ld_s));
    void *dp = g_in(p, sizeof(int32_t) * (size_t)(T * TOPK_P_COUNT)), *dm = NULL;
    cand_compare(what, mc, ld_s, S0, dS0, ld_s, p, dp, T, 2048, CAND_BS, &dm);
    topk_compare(what, INDEX_TOPK, S1, dS1, ld_s, p, dp, mc, dm, ld_s, T);
    g_free(dm);
    g_free(dS0);
    g_free(dS1);
    g_free(dp);
    free(p);
    free(S0);
    free(S1);
    free(mc);
}

static void test_cand_then_topk(void **st) {
    NEED_GPU(st);
    cand_then_topk_case(1, 50000); /* 512·64 <= 50,000: the heap select */
    cand_then_topk_case(8, 50000);
    cand_then_topk_case(8, 7000);
}

/* ---------------------------------------------------------------------------------------------
 * attn_index */

/* A batch of sequence chunks as attention.c lays it out: sequence i has slot slot[i], its chunk
 * positions start[i] .. start[i] + len[i] - 1 at rows row0[i] ..; the window is W wide, or (the
 * reference layout's prefill, from position 0) min(len, W). The expected lists are written the way
 * the host wrote them before attn_index (per sequence, per position, window then compressed part
 * then padding), not by kernels/attn_index_core.h, so the check is independent of the code under
 * test. */
static void attn_index_case(int n, int64_t W, int64_t k, int64_t pad, bool ref_layout, bool decode) {
    char what[160], tag[200];
    snprintf(what, sizeof what, "seqs=%d W=%lld k=%lld pad=%lld %s%s", n, (long long)W, (long long)k, (long long)pad,
             ref_layout ? "reference layout" : "ring layout", decode ? ", decode" : ", chunks");
    snprintf(tag, sizeof tag, "attn_index %s", what);
    seed_tag(tag);
    int64_t *start = NEW(int64_t, n), *len = NEW(int64_t, n), *row0 = NEW(int64_t, n), *slot = NEW(int64_t, n);
    int64_t T = 0, nw_max = 0;
    for (int i = 0; i < n; i++) {
        len[i] = decode ? 1 : 1 + irand(2 * W);
        start[i] = (rnd64() & 3) == 0 ? 0 : irand(5 * W); /* some chunks from position 0 */
        slot[i] = 2 * i + irand(2);                        /* distinct slots, not in order */
        row0[i] = T;
        T += len[i];
        const int64_t nw = ref_layout && start[i] == 0 ? imin(len[i], W) : W;
        nw_max = nw > nw_max ? nw : nw_max;
    }
    const int64_t n_idx = nw_max + k + pad, ld_src = k + 3, chunk0 = 100000, ring0 = 5000, src0 = 900000, cap = 777;
    int32_t *geo = NEW(int32_t, T * AIX_COLS), *src = NEW(int32_t, T * ld_src), *want = NEW(int32_t, T * n_idx);
    for (int64_t i = 0; i < T * ld_src; i++) src[i] = (rnd64() & 3) == 0 ? -1 : (int32_t)irand(cap);
    for (int i = 0; i < n; i++) {
        const int64_t nw = ref_layout && start[i] == 0 ? imin(len[i], W) : W;
        for (int64_t t = 0; t < len[i]; t++) {
            const int64_t p = start[i] + t, r = row0[i] + t;
            int32_t *g = geo + r * AIX_COLS, *ir = want + r * n_idx;
            g[AIX_P] = (int32_t)p, g[AIX_START] = (int32_t)start[i], g[AIX_CHUNK_ROW] = (int32_t)(chunk0 + row0[i]);
            g[AIX_SLOT] = (int32_t)slot[i], g[AIX_NW] = (int32_t)nw, g[AIX_END] = (int32_t)(start[i] + len[i]);
            int64_t e = 0;
            for (int64_t w = 0; w < nw; w++) {
                const int64_t qp = nw < W ? (p - W + 1 > 0 ? p - W + 1 : 0) + w : p - W + 1 + w;
                ir[e++] = qp < 0 || qp > p ? -1
                          : qp >= start[i] ? (int32_t)(chunk0 + row0[i] + qp - start[i])
                                           : (int32_t)(ring0 + slot[i] * W + qp % W);
            }
            for (int64_t j = 0; j < k; j++) {
                const int32_t c = src[r * ld_src + j];
                ir[e++] = c < 0 ? -1 : (int32_t)(c + src0 + slot[i] * cap);
            }
            while (e < n_idx) ir[e++] = -1;
        }
    }
    const struct attn_index_par pc = {W, ring0, k ? src : NULL, ld_src, k, src0, cap};
    size_t db = sizeof(int32_t) * (size_t)(T * n_idx);
    int32_t *dc = NEW(int32_t, T * n_idx), *dg = NEW(int32_t, T * n_idx);
    poison_host(dc, db, PZ_32I);
    CPU->attn_index(&cpu_be, dc, n_idx, geo, T, &pc);
    void *dgeo = g_in(geo, sizeof(int32_t) * (size_t)(T * AIX_COLS)), *ds = g_in(src, sizeof(int32_t) * (size_t)(T * ld_src));
    void *dd = g_out(db, PZ_32I);
    struct attn_index_par pg = pc;
    pg.src = k ? ds : NULL;
    GPU->attn_index(&gpu_be, dd, n_idx, dgeo, T, &pg);
    g_get(dg, dd, db);
    g_free(dgeo);
    g_free(ds);
    g_free(dd);
    struct cmp c;
    cmp_begin(&c, "attn_index", "%s", what);
    cmp_i32_exact(&c, dg, dc, T * n_idx);
    for (int64_t i = 0; i < T * n_idx; i++)
        if (dc[i] != want[i]) {
            self_fail(&c, "row %lld entry %lld: %d, must be %d", (long long)(i / n_idx), (long long)(i % n_idx), dc[i],
                      want[i]);
            break;
        }
    cmp_end(&c);
    free(start);
    free(len);
    free(row0);
    free(slot);
    free(geo);
    free(src);
    free(want);
    free(dc);
    free(dg);
}

/* ring_store: chunks of 1 to 3W rows (so some rows are not among their chunk's last W and must
 * not be stored); the expected ring is written per sequence as attention.c's host list was (its
 * last min(len, W) rows to slot·W + p mod W), every other ring row keeps its poison. */
static void ring_store_case(int n, int64_t W, int64_t hd, bool decode) {
    char what[160], tag[200];
    snprintf(what, sizeof what, "seqs=%d W=%lld hd=%lld%s", n, (long long)W, (long long)hd, decode ? ", decode" : ", chunks");
    snprintf(tag, sizeof tag, "ring_store %s", what);
    seed_tag(tag);
    const int slots = 2 * n + 1;
    int64_t T = 0, *len = NEW(int64_t, n), *start = NEW(int64_t, n);
    for (int i = 0; i < n; i++) {
        len[i] = decode ? 1 : 1 + irand(3 * W);
        start[i] = irand(4 * W);
        T += len[i];
    }
    int32_t *geo = NEW(int32_t, T * AIX_COLS);
    uint16_t *kv = NEW(uint16_t, T * hd), *want = NEW(uint16_t, slots * W * hd);
    for (int64_t i = 0; i < T * hd; i++) kv[i] = (uint16_t)rnd64();
    size_t rb = sizeof(uint16_t) * (size_t)(slots * W * hd);
    poison_host(want, rb, PZ_16);
    for (int i = 0, r = 0; i < n; i++) {
        const int slot = 2 * i + (int)irand(2);
        for (int64_t t = 0; t < len[i]; t++, r++) {
            int32_t *g = geo + (int64_t)r * AIX_COLS;
            g[AIX_P] = (int32_t)(start[i] + t), g[AIX_START] = (int32_t)start[i], g[AIX_CHUNK_ROW] = 0;
            g[AIX_SLOT] = slot, g[AIX_NW] = (int32_t)W, g[AIX_END] = (int32_t)(start[i] + len[i]);
            if (t >= len[i] - W) memcpy(want + ((int64_t)slot * W + (start[i] + t) % W) * hd, kv + (int64_t)r * hd, (size_t)hd * 2);
        }
    }
    uint16_t *rc = NEW(uint16_t, slots * W * hd), *rg = NEW(uint16_t, slots * W * hd);
    poison_host(rc, rb, PZ_16);
    CPU->ring_store(&cpu_be, rc, kv, geo, T, W, hd);
    void *dkv = g_in(kv, sizeof(uint16_t) * (size_t)(T * hd)), *dgeo = g_in(geo, sizeof(int32_t) * (size_t)(T * AIX_COLS));
    void *dr = g_out(rb, PZ_16);
    GPU->ring_store(&gpu_be, dr, dkv, dgeo, T, W, hd);
    g_get(rg, dr, rb);
    g_free(dkv);
    g_free(dgeo);
    g_free(dr);
    struct cmp c;
    cmp_begin(&c, "ring_store", "%s", what);
    for (int64_t i = 0; i < slots * W * hd; i++) cmp_bits(&c, i, rg[i], rc[i], rg[i], rc[i]);
    for (int64_t i = 0; i < slots * W * hd; i++)
        if (rc[i] != want[i]) {
            self_fail(&c, "ring row %lld column %lld: %#x, must be %#x", (long long)(i / hd), (long long)(i % hd),
                      (unsigned)rc[i], (unsigned)want[i]);
            break;
        }
    cmp_end(&c);
    free(len);
    free(start);
    free(geo);
    free(kv);
    free(want);
    free(rc);
    free(rg);
}

static void test_ring_store(void **st) {
    NEED_GPU(st);
    for (int t = 0; t < 3; t++) ring_store_case((int)T_TOPK[t], WINDOW, 512, true);
    ring_store_case(256, WINDOW, 512, true);
    ring_store_case(4, 16, 64, false);
    ring_store_case(3, 8, 8, false);
}

static void test_attn_index(void **st) {
    NEED_GPU(st);
    for (int t = 0; t < 3; t++) attn_index_case((int)T_TOPK[t], WINDOW, INDEX_TOPK, 0, false, true);
    attn_index_case(64, WINDOW, 0, 0, false, true); /* a window-only layer */
    attn_index_case(3, WINDOW, INDEX_TOPK, 5, true, false);
    attn_index_case(5, 16, 37, 2, true, false);
    attn_index_case(4, 16, 0, 1, false, false);
}

/* ---------------------------------------------------------------------------------------------
 * copy_segs */

/* n segments of the given sizes (aligned[i]: src and dst offsets on 16 bytes; else both odd)
 * from one buffer into another, placed in a random order with gaps; the segment list is in yet
 * another order. */
static void copy_segs_case(const char *what, const size_t *bytes, const bool *aligned, int64_t n) {
    char tag[200];
    snprintf(tag, sizeof tag, "copy_segs %s", what);
    seed_tag(tag);
    size_t bmax = 0;
    for (int64_t i = 0; i < n; i++) bmax = bytes[i] > bmax ? bytes[i] : bmax;
    size_t ssz = bmax + 4096, dsz = 0, *so = NEW(size_t, n), *dof = NEW(size_t, n);
    int64_t *ord = NEW(int64_t, n), *lst = NEW(int64_t, n);
    for (int64_t i = 0; i < n; i++) ord[i] = lst[i] = i;
    for (int64_t i = n - 1; i > 0; i--) { /* two shuffles: placement order and list order */
        int64_t a = irand(i + 1), b = irand(i + 1), t = ord[i];
        ord[i] = ord[a];
        ord[a] = t;
        t = lst[i];
        lst[i] = lst[b];
        lst[b] = t;
    }
    for (int64_t q = 0; q < n; q++) {
        int64_t i = ord[q];
        size_t range = ssz - bytes[i] - 16;
        so[i] = aligned[i] ? (size_t)irand((int64_t)(range / 16)) * 16 : (size_t)irand((int64_t)range) | 1;
        dsz += (size_t)irand(40);
        dsz = aligned[i] ? (dsz + 15) / 16 * 16 : dsz | 1;
        dof[i] = dsz;
        dsz += bytes[i];
    }
    dsz = (dsz + 64) & ~(size_t)1;
    uint8_t *src = NEW(uint8_t, ssz), *dc = NEW(uint8_t, dsz), *dg = NEW(uint8_t, dsz);
    for (size_t i = 0; i < ssz; i++) src[i] = (uint8_t)rnd64();
    poison_host(dc, dsz, PZ_16);
    uint8_t *gs = g_in(src, ssz), *gd = g_out(dsz, PZ_16);
    struct copy_seg *hs = NEW(struct copy_seg, n), *gsg = NEW(struct copy_seg, n);
    for (int64_t q = 0; q < n; q++) {
        int64_t i = lst[q];
        hs[q] = (struct copy_seg){dc + dof[i], src + so[i], bytes[i]};
        gsg[q] = (struct copy_seg){gd + dof[i], gs + so[i], bytes[i]};
    }
    CPU->copy_segs(&cpu_be, hs, n);
    GPU->copy_segs(&gpu_be, gsg, n);
    g_get(dg, gd, dsz);
    g_free(gs);
    g_free(gd);
    struct cmp c;
    cmp_begin(&c, "copy_segs", "%s", what);
    cmp_u8_exact(&c, dg, dc, (int64_t)dsz);
    /* the CPU's destination: each segment's source bytes, the poison everywhere else */
    uint8_t *want = NEW(uint8_t, dsz);
    poison_host(want, dsz, PZ_16);
    for (int64_t i = 0; i < n; i++)
        if (bytes[i]) memcpy(want + dof[i], src + so[i], bytes[i]);
    for (size_t i = 0; i < dsz; i++)
        if (dc[i] != want[i]) self_fail(&c, "destination byte %zu: %#x, must be %#x", i, dc[i], want[i]);
    cmp_end(&c);
    free(want);
    free(so);
    free(dof);
    free(ord);
    free(lst);
    free(src);
    free(dc);
    free(dg);
    free(hs);
    free(gsg);
}

static void test_copy_segs(void **st) {
    NEED_GPU(st);
    seed_tag("copy_segs sizes");
    /* decode: small rows at odd addresses */
    size_t b1[64];
    bool a1[64];
    for (int i = 0; i < 64; i++) {
        b1[i] = 1 + (size_t)irand(300);
        a1[i] = false;
    }
    b1[0] = 1;
    b1[1] = 300;
    copy_segs_case("64 segments of 1..300 bytes, odd offsets", b1, a1, 64);
    /* 64 copies go in the kernel's parameters, 65 through an upload: both sides of the bound */
    size_t b65[65];
    bool a65[65];
    for (int i = 0; i < 65; i++) {
        b65[i] = 16 * (1 + (size_t)irand(64));
        a65[i] = i % 3 != 0;
    }
    copy_segs_case("65 segments of 16..1024 bytes, aligned and odd", b65, a65, 65);
    /* cache rows and ranges: whole 64 KB pieces, a piece of 1 byte, 16-byte words or bytes */
    const size_t big[] = {0, 1, 15, 16, 17, 1024, 2048, 65536, 65537, 300000};
    size_t b2[40];
    bool a2[40];
    int n2 = 0;
    for (int al = 0; al < 2; al++)
        for (int i = 0; i < 10; i++) {
            b2[n2] = big[i];
            a2[n2++] = al;
        }
    for (int i = 0; i < 20; i++) {
        b2[n2] = 1 + (size_t)irand(300);
        a2[n2++] = i & 1;
    }
    copy_segs_case("0..300000 bytes, aligned and odd", b2, a2, n2);
    /* few long copies, many pieces each, in the parameters (the TP stand-in's exchange at batch
     * 256: 8 copies of ~2 MB): a block's pieces cross from one copy into the next */
    size_t b4[9];
    bool a4[9];
    for (int i = 0; i < 9; i++) {
        b4[i] = i == 4 ? 0 : (size_t)(1 << 21) + (size_t)irand(70000);
        a4[i] = i != 6;
    }
    copy_segs_case("9 copies of 0 or ~2 MB, ~270 pieces", b4, a4, 9);
    /* more pieces than the launch's 65,535 blocks (its grid-stride loop) */
    int64_t n3 = 70000;
    size_t *b3 = NEW(size_t, n3);
    bool *a3 = NEW(bool, n3);
    for (int64_t i = 0; i < n3; i++) {
        b3[i] = (rnd64() & 1) ? 16 : 1 + (size_t)irand(20);
        a3[i] = b3[i] == 16;
    }
    copy_segs_case("70000 segments of 1..20 bytes", b3, a3, n3);
    free(b3);
    free(a3);
}

/* copy_segs inside a graph segment (backend.h: up to BE_COPY_SEGS_GRAPH copies; the TP stand-in's
 * collectives in bench_step --tp-standin graph): recorded once, then replayed with new source bytes
 * and a poisoned destination each time — a replay must copy what the sources hold then, to the
 * same places, and touch nothing else. An allgather's shape: 8 copies of one source, here one of
 * them ~2 MB (many pieces), one odd-sized and one empty. */
static void test_copy_segs_recorded(void **st) {
    NEED_GPU(st);
    if (!GPU->graph_begin) skip();
    seed_tag("copy_segs recorded");
    enum { N = 8 };
    const size_t bytes[N] = {(size_t)(1 << 21) + 4096, 777, 0, 16, 65536, 65537, 48, 1};
    size_t off[N + 1], ssz = 0;
    off[0] = 0;
    for (int i = 0; i < N; i++) off[i + 1] = (off[i] + bytes[i] + 64) & ~(size_t)15;
    for (int i = 0; i < N; i++) ssz = bytes[i] > ssz ? bytes[i] : ssz;
    const size_t dsz = off[N];
    uint8_t *src = NEW(uint8_t, ssz), *want = NEW(uint8_t, dsz), *got = NEW(uint8_t, dsz), *pz = NEW(uint8_t, dsz);
    poison_host(pz, dsz, PZ_16);
    uint8_t *gs = g_in(src, ssz), *gd = g_out(dsz, PZ_16);
    struct copy_seg segs[N];
    for (int i = 0; i < N; i++) segs[i] = (struct copy_seg){gd + off[i], gs, bytes[i]};
    const uint64_t key[] = {0xC0B1E5u, (uint64_t)(uintptr_t)gd, (uint64_t)(uintptr_t)gs, N};
    const char *runs[] = {"recorded", "replayed", "replayed again"};
    for (int r = 0; r < 3; r++) {
        for (size_t i = 0; i < ssz; i++) src[i] = (uint8_t)rnd64();
        GPU->upload(&gpu_be, gs, src, ssz);
        GPU->upload(&gpu_be, gd, pz, dsz);
        bool issue = GPU->graph_begin(&gpu_be, key, 4);
        assert_int_equal(issue, r == 0); /* the first time it records, then it replays */
        if (issue) {
            GPU->copy_segs(&gpu_be, segs, N);
            GPU->graph_end(&gpu_be);
        }
        g_get(got, gd, dsz);
        memcpy(want, pz, dsz);
        for (int i = 0; i < N; i++) memcpy(want + off[i], src, bytes[i]);
        struct cmp c;
        cmp_begin(&c, "copy_segs", "8 copies of one source, %s", runs[r]);
        cmp_u8_exact(&c, got, want, (int64_t)dsz);
        cmp_end(&c);
    }
    g_free(gs);
    g_free(gd);
    free(src);
    free(want);
    free(got);
    free(pz);
}

/* The CUDA backend's memory paths under load, with no synchronization between calls (as a forward
 * runs): scratch and zero-filled blocks taken from and returned to the free lists by size, small
 * uploads through the pinned ring (far more than its 32 MB, so it wraps many times), the host buffer
 * overwritten as soon as each upload returns, each block read by a device copy and freed at once
 * (its next owner's upload is ordered after that copy). A reused block must never show another
 * upload's bytes, an alloc must come back zeroed, and every sample must be the bytes uploaded. */
static void test_memory_reuse_and_ring(void **st) {
    NEED_GPU(st);
    seed_tag("memory reuse and upload ring");
    enum { N = 2000, SAMPLE = 128 };
    size_t rec_bytes = (size_t)N * 2 * SAMPLE;
    uint8_t *rec = GPU->alloc(&gpu_be, rec_bytes), *want = NEW(uint8_t, rec_bytes), *got = NEW(uint8_t, rec_bytes);
    uint8_t *h = NEW(uint8_t, 300000);
    size_t total = 0;
    for (int i = 0; i < N; i++) {
        size_t bytes = SAMPLE + (size_t)irand(i % 3 == 0 ? 300000 - SAMPLE : 4096);
        bool zeroed = i % 5 == 0;
        uint8_t *d = zeroed ? GPU->alloc(&gpu_be, bytes) : GPU->scratch(&gpu_be, bytes);
        uint8_t *w = want + (size_t)i * 2 * SAMPLE;
        if (zeroed) {
            memset(w, 0, 2 * SAMPLE);
        } else {
            for (size_t j = 0; j < bytes; j++) h[j] = (uint8_t)(rnd64() >> 7);
            GPU->upload(&gpu_be, d, h, bytes);
            total += bytes;
            memcpy(w, h, SAMPLE);
            memcpy(w + SAMPLE, h + bytes - SAMPLE, SAMPLE);
            memset(h, 0xA5, bytes); /* the caller may reuse its buffer at once */
        }
        GPU->copy(&gpu_be, rec + (size_t)i * 2 * SAMPLE, d, SAMPLE);
        GPU->copy(&gpu_be, rec + (size_t)i * 2 * SAMPLE + SAMPLE, d + bytes - SAMPLE, SAMPLE);
        GPU->free(&gpu_be, d);
    }
    GPU->download(&gpu_be, got, rec, rec_bytes);
    struct cmp c;
    cmp_begin(&c, "memory", "%d blocks, %.0f MB uploaded", N, (double)total / 1e6);
    for (size_t j = 0; j < rec_bytes; j++) cmp_bits(&c, (long long)j, got[j], want[j], got[j], want[j]);
    cmp_end(&c);
    GPU->free(&gpu_be, rec);
    free(want);
    free(got);
    free(h);
}

/* =============================================================================================
 * The router's selection (cuda_router.h): the rank kernel against the serial arg-max kernel, and
 * both against the CPU's scan (cpu_router_select_row, cpu_op_router's per-token step, on the same
 * logits), on crafted gate logits a gate linear rarely makes: exact ties (repeated values, -0
 * beside +0), +-inf, NaN at the first id (which the CPU's scan then keeps) and elsewhere (never
 * chosen unless first), rows of one value, and the score's z > 20 switch. Ids must agree exactly and weights bit for bit:
 * a different order of ties, a NaN rule broken, a candidate lost between the rank kernel's two
 * passes or a weight summed in another order would each fail. */

#ifdef DS_HAVE_CUDA
/* Row r of the crafted logits (kind r % 8) */
static void router_crafted_row(float *z, int64_t E, int64_t r) {
    static const float few[] = {0.75f, -0.0f, 0.0f, 1.5f, -2.0f};
    for (int64_t e = 0; e < E; e++) {
        switch (r % 8) {
        case 0: z[e] = (float)(4.0 * urand() - 2.0); break;                    /* distinct */
        case 1: z[e] = few[irand(5)]; break;                                    /* ties, signed zeros */
        case 2: z[e] = irand(9) == 0 ? (irand(2) ? INFINITY : -INFINITY) : (float)(urand() - 0.5); break;
        case 3: z[e] = e == 0 || irand(11) == 0 ? NAN : (float)(urand() - 0.5); break; /* NaN first */
        case 4: z[e] = e < 3 || irand(40) == 0 ? NAN : few[irand(5)]; break;
        case 5: z[e] = e == E / 2 ? NAN : (float)(2.0 * urand()); break;      /* NaN never first */
        case 6: z[e] = 1.25f; break;                                            /* one value */
        default: z[e] = (float)(10.0 + 20.0 * urand()); if (irand(4) == 0) z[e] = 25.0f; break; /* z > 20 */
        }
    }
}

static void router_select_case(int64_t T, int64_t E, int64_t k, bool with_bias, float temp, bool norm, float rs) {
    char tag[128];
    snprintf(tag, sizeof tag, "router select E=%lld k=%lld T=%lld", (long long)E, (long long)k, (long long)T);
    seed_tag(tag);
    float *z = NEW(float, T * E), *bias = with_bias ? NEW(float, E) : NULL;
    for (int64_t t = 0; t < T; t++) router_crafted_row(z + t * E, E, t);
    if (bias)
        for (int64_t e = 0; e < E; e++) bias[e] = irand(3) == 0 ? 0.5f : (float)(0.25 * urand()); /* ties in v too */
    int32_t *ih = NEW(int32_t, T * k), *ig[2];
    float *wh = NEW(float, T * k), *wg[2], *sh = NEW(float, E);
    unsigned char *taken = calloc((size_t)E, 1);
    assert_non_null(taken);
    for (int64_t t = 0; t < T; t++) /* the CPU backend's own per-token selection */
        cpu_router_select_row(ih + t * k, wh + t * k, sh, taken, z + t * E, bias, E, k, temp, norm, rs);
    free(sh);
    free(taken);
    void *dz = g_in(z, (size_t)(T * E) * 4), *db = bias ? g_in(bias, (size_t)E * 4) : NULL;
    const int forms[2] = {CUDA_ROUTER_SERIAL, CUDA_ROUTER_RANK};
    for (int f = 0; f < 2; f++) {
        void *di = g_out((size_t)(T * k) * 4, PZ_32I), *dw = g_out((size_t)(T * k) * 4, PZ_32F);
        cuda_router_select(forms[f], di, dw, dz, db, T, E, k, temp, norm, rs, NULL);
        assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
        ig[f] = NEW(int32_t, T * k);
        wg[f] = NEW(float, T * k);
        g_get(ig[f], di, (size_t)(T * k) * 4);
        g_get(wg[f], dw, (size_t)(T * k) * 4);
        g_free(di);
        g_free(dw);
    }
    long long bad_rank = 0, bad_serial = 0;
    for (int64_t i = 0; i < T * k; i++) {
        bad_rank += ig[1][i] != ig[0][i] || memcmp(&wg[1][i], &wg[0][i], 4) != 0;
        /* NaN weights as NaN: CUDA's arithmetic makes the canonical NaN, x86 keeps the input's */
        const bool both_nan = isnan(wg[0][i]) && isnan(wh[i]);
        bad_serial += ig[0][i] != ih[i] || (!both_nan && memcmp(&wg[0][i], &wh[i], 4) != 0);
        if ((ig[1][i] != ig[0][i] || ig[0][i] != ih[i]) && bad_rank + bad_serial < 4)
            fprintf(stderr, "  %s row %lld slot %lld: rank %d, serial %d, cpu %d\n", tag, (long long)(i / k),
                    (long long)(i % k), ig[1][i], ig[0][i], ih[i]);
    }
    print_message("  %-15s E=%-5lld k=%-3lld T=%-4lld bias=%d: rank vs serial %lld, serial vs CPU %lld of %lld slots differ\n",
                  "router select", (long long)E, (long long)k, (long long)T, with_bias, bad_rank, bad_serial,
                  (long long)(T * k));
    assert_int_equal(bad_rank, 0);
    assert_int_equal(bad_serial, 0);
    g_free(dz);
    if (db) g_free(db);
    for (int f = 0; f < 2; f++) free(ig[f]), free(wg[f]);
    free(z), free(bias), free(ih), free(wh);
}
#endif

static void test_router_select(void **st) {
    NEED_GPU(st);
#ifndef DS_HAVE_CUDA
    skip();
#else
    if (gpu_state != 1) skip(); /* CUDA kernels called directly: no CPU stand-in */
    router_select_case(40, 384, 6, true, 1.0f, true, 1.5f);  /* V4.1: 384 experts, top 6 */
    router_select_case(300, 384, 6, true, 1.0f, true, 1.5f); /* > 2 rows per SM: the serial form's 4 a CTA */
    router_select_case(24, 128, 3, true, 1.0f, true, 1.5f);  /* DSpark */
    router_select_case(16, 37, 1, false, 2.0f, true, 1.0f);
    router_select_case(16, 33, 4, true, 1.0f, false, 1.0f);
    router_select_case(16, 1000, 32, true, 1.0f, true, 2.5f); /* the rank form's largest k */
    router_select_case(8, 1024, 8, false, 1.0f, true, 1.0f);
    router_select_case(8, 32, 32, true, 1.0f, true, 1.0f);    /* k = E: everything ranked */
#endif
}


/* =============================================================================================
 * argmax (the head's greedy draw): exact, value bits and index; row_topk (the top-k draws' lists):
 * exact, every entry's bits; row_lse (the log-probabilities' slices): exact
 * (TOL_GPU_ROW_LSE_EXACT), every field's bits */

_Static_assert(TOL_GPU_ROW_LSE_EXACT == 0, "row_lse is compared bit for bit");

/* rows of six kinds: spread, long runs of ties, ties among NaN, nothing above -inf, ±0, all NaN */
static void head_rows(float *x, int64_t R, int64_t V) {
    for (int64_t r = 0; r < R; r++) {
        float *row = x + r * V;
        const int kind = (int)(r % 6);
        for (int64_t i = 0; i < V; i++) {
            const uint64_t u = rnd64();
            switch (kind) {
            case 0: row[i] = (float)((double)(u >> 11) / 9007199254740992.0 * 30 - 15); break; /* spread */
            case 1: row[i] = (float)(int)(u % 5) * 0.75f - 1.5f; break;                       /* long runs of ties */
            case 2: row[i] = u % 3 == 0 ? NAN : (float)(int)(u % 7); break;                    /* ties among NaN */
            case 3: row[i] = u % 2 ? -INFINITY : NAN; break;                                    /* nothing above -inf */
            case 4: row[i] = (u >> 8) % 2 ? 0.0f : -0.0f; break;                                /* ±0: all equal */
            default: row[i] = NAN; break;                                                       /* all NaN */
            }
        }
        if (kind == 0 && r % 12 == 6) row[V - 1] = INFINITY;
    }
}

static void argmax_case(int64_t R, int64_t V) {
    char tag[96];
    snprintf(tag, sizeof tag, "argmax R=%lld V=%lld", (long long)R, (long long)V);
    seed_tag(tag);
    float *x = NEW(float, (size_t)(R * V));
    int32_t *oc = NEW(int32_t, (size_t)(2 * R)), *og = NEW(int32_t, (size_t)(2 * R));
    head_rows(x, R, V);
    CPU->argmax(&cpu_be, oc, x, R, V);
    void *dx = g_in(x, sizeof(float) * (size_t)(R * V)), *dd = g_out(sizeof(int32_t) * (size_t)(2 * R), PZ_32I);
    GPU->argmax(&gpu_be, dd, dx, R, V);
    g_get(og, dd, sizeof(int32_t) * (size_t)(2 * R));
    g_free(dx);
    g_free(dd);
    struct cmp c;
    cmp_begin(&c, "argmax", "R=%lld V=%lld", (long long)R, (long long)V);
    for (int64_t i = 0; i < 2 * R; i++) cmp_bits(&c, (long long)i, og[i], oc[i], og[i], oc[i]);
    cmp_end(&c);
    free(x);
    free(oc);
    free(og);
}

static void test_argmax(void **st) {
    NEED_GPU(st);
    static const int64_t Rs[] = {1, 8, 64, 256};
    for (int i = 0; i < 4; i++) argmax_case(Rs[i], VOCAB_LOCAL); /* a TP8 rank's head columns */
    argmax_case(12, VOCAB);                                       /* one rank's whole vocabulary */
    argmax_case(13, 1001);                                        /* rows not 16-byte aligned */
    argmax_case(6, 1);
    argmax_case(6, 3);
}

/* head_rows, with some rows of few levels mixing ±0 (ties the list must break by column) */
static void row_topk_case(int64_t R, int64_t V, int64_t k) {
    char tag[96];
    snprintf(tag, sizeof tag, "row_topk R=%lld V=%lld k=%lld", (long long)R, (long long)V, (long long)k);
    seed_tag(tag);
    float *x = NEW(float, (size_t)(R * V));
    struct be_topk_entry *oc = NEW(struct be_topk_entry, (size_t)(R * k)), *og = NEW(struct be_topk_entry, (size_t)(R * k));
    head_rows(x, R, V);
    for (int64_t r = 3; r < R; r += 7)
        for (int64_t i = 0; i < V; i++) {
            const uint64_t u = rnd64();
            x[r * V + i] = u % 4 == 0 ? 0.0f : u % 4 == 1 ? -0.0f : (float)(int)(u % 9) - 6.0f;
        }
    CPU->row_topk(&cpu_be, oc, x, R, V, k);
    void *dx = g_in(x, sizeof(float) * (size_t)(R * V)), *dd = g_out(sizeof *og * (size_t)(R * k), PZ_32I);
    GPU->row_topk(&gpu_be, dd, dx, R, V, k);
    g_get(og, dd, sizeof *og * (size_t)(R * k));
    g_free(dx), g_free(dd);
    struct cmp c;
    cmp_begin(&c, "row_topk", "R=%lld V=%lld k=%lld", (long long)R, (long long)V, (long long)k);
    for (int64_t i = 0; i < R * k; i++) {
        uint32_t gv, cv;
        memcpy(&gv, &og[i].v, 4), memcpy(&cv, &oc[i].v, 4);
        cmp_bits(&c, (long long)(2 * i), gv, cv, og[i].v, oc[i].v);
        cmp_bits(&c, (long long)(2 * i + 1), (uint32_t)og[i].i, (uint32_t)oc[i].i, og[i].i, oc[i].i);
    }
    cmp_end(&c);
    free(x), free(oc), free(og);
}

static void test_row_topk(void **st) {
    NEED_GPU(st);
    static const int64_t Rs[] = {1, 8, 64};
    for (int i = 0; i < 3; i++) row_topk_case(Rs[i], VOCAB_LOCAL, 50); /* a TP8 rank's head columns */
    row_topk_case(9, VOCAB, 1024);                                       /* one rank's vocabulary, the longest list */
    row_topk_case(14, VOCAB, 1);
    row_topk_case(13, 1001, 333);
    row_topk_case(12, 40, 64); /* fewer columns than k */
    row_topk_case(6, 3, 2);
}

/* kinds 1..5 of head_rows, then (r % 6 == 0) peaked rows: a trained model's shape, where the sum
 * is a few large terms and many tiny ones; targets anywhere, -1 in every fifth row. wt: the
 * temperature sums (full-row draws' totals), each row its own temperature, every seventh 0 (the
 * plain sums in the same launch) */
static void row_lse_case(int64_t R, int64_t V, int64_t ns, int64_t off, bool wt) {
    static const float temps[] = {0.0f, 0.7f, 1.0f, 0.05f, 2.5f, 1.3f, 0.3f};
    char tag[96];
    snprintf(tag, sizeof tag, "row_lse R=%lld V=%lld ns=%lld off=%lld wt=%d", (long long)R, (long long)V, (long long)ns,
             (long long)off, (int)wt);
    seed_tag(tag);
    float *x = NEW(float, (size_t)(R * V + off));
    struct be_lse_part *oc = NEW(struct be_lse_part, (size_t)(R * ns)), *og = NEW(struct be_lse_part, (size_t)(R * ns));
    int32_t *tg = NEW(int32_t, (size_t)R);
    head_rows(x + off, R, V);
    for (int64_t r = 0; r < R; r += 6)
        for (int64_t i = 0; i < V; i++)
            x[off + r * V + i] = (float)((double)(rnd64() >> 11) / 9007199254740992.0 * 6 - 20) + (i % 97 == 3 ? 25.0f : 0.0f);
    for (int64_t r = 0; r < R; r++) tg[r] = r % 5 == 4 ? -1 : (int32_t)(rnd64() % (uint64_t)V);
    float *th = NEW(float, (size_t)R);
    for (int64_t r = 0; r < R; r++) th[r] = temps[r % 7];
    CPU->row_lse(&cpu_be, oc, x + off, R, V, ns, tg, wt ? th : NULL);
    float *dx = g_in(x, sizeof(float) * (size_t)(R * V + off)), *dth = g_in(th, sizeof(float) * (size_t)R);
    void *dt = g_in(tg, sizeof(int32_t) * (size_t)R), *dd = g_out(sizeof *og * (size_t)(R * ns), PZ_32I);
    GPU->row_lse(&gpu_be, dd, dx + off, R, V, ns, dt, wt ? dth : NULL);
    g_get(og, dd, sizeof *og * (size_t)(R * ns));
    g_free(dx), g_free(dt), g_free(dd), g_free(dth);
    if (wt && V > 3) { /* the temperatures reach the sums: rows at T != 1 are not all their plain sums */
        int differ = 0;
        for (int64_t r = 0; r < R; r++)
            if (th[r] > 0 && th[r] != 1.0f) differ += oc[r * ns].s != lse_slice_host(x + off + r * V, V / ns, -1, 0.0f).s;
        if (R > 1 && !differ) fail_msg("%s: every temperature sum equals its plain sum", tag);
    }
    struct cmp c;
    cmp_begin(&c, "row_lse", "R=%lld V=%lld ns=%lld wt=%d", (long long)R, (long long)V, (long long)ns, (int)wt);
    for (int64_t i = 0; i < R * ns; i++) {
        uint64_t gs, cs;
        uint32_t gm, cm, gt, ct;
        memcpy(&gs, &og[i].s, 8), memcpy(&cs, &oc[i].s, 8);
        memcpy(&gm, &og[i].m, 4), memcpy(&cm, &oc[i].m, 4);
        memcpy(&gt, &og[i].t, 4), memcpy(&ct, &oc[i].t, 4);
        cmp_bits(&c, (long long)(3 * i), gs, cs, og[i].s, oc[i].s);
        cmp_bits(&c, (long long)(3 * i + 1), gm, cm, og[i].m, oc[i].m);
        cmp_bits(&c, (long long)(3 * i + 2), gt, ct, og[i].t, oc[i].t);
    }
    cmp_end(&c);
    free(x), free(oc), free(og), free(tg), free(th);
}

static void test_row_lse(void **st) {
    NEED_GPU(st);
    static const int64_t Rs[] = {1, 8, 64, 256};
    for (int wt = 0; wt < 2; wt++) {
        for (int i = 0; i < 4; i++) row_lse_case(Rs[i], VOCAB_LOCAL, 1, 0, wt); /* a TP8 rank's head columns */
        row_lse_case(12, VOCAB, 8, 0, wt);                                       /* one rank's whole vocabulary */
        row_lse_case(10, VOCAB / 2, 4, 0, wt);                                   /* TP2 */
        row_lse_case(13, 1004, 4, 0, wt);                                        /* slices not 16-byte aligned */
        row_lse_case(7, 4099, 1, 1, wt);                                         /* rows not aligned, a short group */
        row_lse_case(6, 3, 1, 0, wt);
        row_lse_case(6, 1, 1, 0, wt);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_index_topk),
        cmocka_unit_test(test_index_topk_mask),
        cmocka_unit_test(test_index_topk_heap_select),
        cmocka_unit_test(test_cand_mask),
        cmocka_unit_test(test_cand_then_topk),
        cmocka_unit_test(test_attn_index),
        cmocka_unit_test(test_ring_store),
        cmocka_unit_test(test_copy_segs),
        cmocka_unit_test(test_copy_segs_recorded),
        cmocka_unit_test(test_memory_reuse_and_ring),
        cmocka_unit_test(test_router_select),
        cmocka_unit_test(test_argmax),
        cmocka_unit_test(test_row_topk),
        cmocka_unit_test(test_row_lse),
    };
    cuda_ops_test_filters();
    return cmocka_run_group_tests(tests, cuda_ops_group_setup, cuda_ops_group_teardown);
}
