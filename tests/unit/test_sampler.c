/* src/sampler.c against its first version, kept here as the oracle: a qsort of every index by
 * (logit desc, id asc), the weights e^((x - max) / T) in double in that order, the sums and the
 * draw sequential — and the log-probability's sequential sum over the row in double. The fast
 * version (top-k by a bounded heap, top-p over radix-sorted values, the maximum in lanes) must give
 * the same token for every row free of NaN: rows built to tie (a handful of levels), with +0 and
 * -0, -inf and +inf entries, sizes from 1 to the real vocabulary, every combination of temperature,
 * top-k and top-p; its log-probability (kernels/lse_core.h's order and float terms) must be within
 * TOL_LOGPROB_EXPF_U's bound of the first version's. Rows with NaN follow the new rule instead: a
 * NaN entry is never drawn, and the log-probability over such a row is NaN. Also the draws where
 * the logits are (model_forward_draws): the backend's argmax op per vocab slice +
 * sampler_greedy_merge gives the token sampler_pick draws at temperature 0, the row_topk op per
 * slice + sampler_topk_merge + sampler_pick_topk the token of every greedy and top-k draw, and the
 * row_lse op per slice + sampler_lse_merge the bits of sampler_logprob, for every split. */
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
#include "lse_core.h"
#include "tolerances.h"
#include "sampler.h"
#include "xorshift.h"

static uint64_t g_rng = 0x243f6a8885a308d3ull;
static uint64_t rnd(void) { return xorshift64(&g_rng); }

#include "sampler_ref.h"

/* ---- rows ---- */

enum row_kind { R_SPREAD, R_LEVELS, R_ZEROS, R_INF, R_PEAKED };

static void make_row(float *x, int V, enum row_kind kind) {
    for (int i = 0; i < V; i++) {
        double u = (double)(rnd() >> 11) / 9007199254740992.0;
        switch (kind) {
        case R_SPREAD: x[i] = (float)(u * 30 - 15); break;
        case R_LEVELS: x[i] = (float)((int)(u * 5)) * 0.75f - 1.5f; break; /* 5 values: long runs of ties */
        case R_ZEROS: x[i] = u < 0.3 ? 0.0f : u < 0.6 ? -0.0f : (float)(u * 4 - 3); break;
        case R_INF: x[i] = u < 0.2 ? -INFINITY : (float)(u * 8 - 4); break;
        case R_PEAKED: x[i] = (float)(u * 6 - 20) + (i % 97 == 3 ? 25.0f : 0.0f); break; /* a trained model's shape */
        }
    }
}

/* The bound of TOL_LOGPROB_EXPF_U for a row (src/tolerances.h): u·(expf's ulps + Σ p_i (M - x_i))
 * + both double sums' n·2^-53, p_i and M from the double-precision oracle. */
static double logprob_bound(const float *x, int V) {
    double mx = -INFINITY, s = 0, w = 0;
    for (int i = 0; i < V; i++)
        if (x[i] > mx) mx = x[i];
    for (int i = 0; i < V; i++)
        if (x[i] > -INFINITY) {
            const double e = exp((double)x[i] - mx);
            s += e, w += e * (mx - (double)x[i]);
        }
    return TOL_FP32_U * (TOL_LOGPROB_EXPF_U + w / s) * 1.01 + 2.0 * V * 0x1p-53;
}

static void check_rows(int V, int n_rows) {
    static const float temps[] = {0.0f, 0.3f, 1.0f, 2.5f};
    static const float top_ps[] = {1.0f, 0.95f, 0.5f, 0.0f};
    int top_ks[] = {0, 1, 5, 50, V - 1, V, V + 3};
    float *x = malloc(sizeof(float) * (size_t)V);
    int cases = 0;
    for (int r = 0; r < n_rows; r++) {
        make_row(x, V, (enum row_kind)(r % 5));
        for (int ti = 0; ti < 4; ti++)
            for (int ki = 0; ki < 7; ki++)
                for (int pi = 0; pi < 4; pi++) {
                    if (top_ks[ki] < 0) continue;
                    struct sample_params p = {.temperature = temps[ti], .top_k = top_ks[ki], .top_p = top_ps[pi],
                                              .seed = 7 + (uint64_t)r};
                    uint64_t req = (uint64_t)(r * 31 + ki), pos = (uint64_t)(pi * 5 + ti);
                    int want = ref_pick(x, V, &p, req, pos), got = sampler_pick(x, V, &p, req, pos);
                    if (want != got)
                        fail_msg("V=%d row %d (kind %d) T=%g top_k=%d top_p=%g: token %d, the first version drew %d", V,
                                 r, r % 5, p.temperature, p.top_k, p.top_p, got, want);
                    cases++;
                }
        const double tol = logprob_bound(x, V);
        for (int k = 0; k < 4; k++) {
            int tok = (int)(rnd() % (uint64_t)V);
            double a = ref_logprob(x, V, tok), b = sampler_logprob(x, V, tok);
            if (!(a == b || (isnan(a) && isnan(b)) || fabs(a - b) <= tol))
                fail_msg("V=%d row %d: logprob of %d is %.17g, the first version's %.17g (bound %.3g)", V, r, tok, b, a, tol);
        }
    }
    assert_true(cases > 0);
    free(x);
}

static void test_same_tokens_small(void **s) {
    (void)s;
    for (int V = 1; V <= 40; V += 3) check_rows(V, 10);
    check_rows(1000, 10);
}

/* the real vocabulary (fewer rows: the oracle's qsort takes ~25 ms a row) */
static void test_same_tokens_vocab(void **s) {
    (void)s;
    check_rows(129280, 5);
}

/* Temperature draws follow the distribution: 20,000 draws over 6 logits, each token's count
 * within 5 standard deviations of its probability (a draw that ignored the weights, the
 * temperature or the uniform would be far outside). */
static void test_draw_distribution(void **s) {
    (void)s;
    float x[6] = {1.0f, 0.5f, -0.25f, 2.0f, 0.0f, -1.0f};
    struct sample_params p = {.temperature = 0.7f, .seed = 11};
    int count[6] = {0};
    enum { N = 20000 };
    for (int i = 0; i < N; i++) count[sampler_pick(x, 6, &p, 5, (uint64_t)i)]++;
    double z = 0;
    for (int i = 0; i < 6; i++) z += exp((x[i] - 2.0) / 0.7);
    for (int i = 0; i < 6; i++) {
        double pr = exp((x[i] - 2.0) / 0.7) / z, sd = sqrt(N * pr * (1 - pr));
        if (fabs(count[i] - N * pr) > 5 * sd) fail_msg("token %d drawn %d times of %d, expected %.0f", i, count[i], N, N * pr);
    }
}

/* NaN entries are never drawn; a NaN anywhere makes the log-probability NaN. */
static void test_nan_rows(void **s) {
    (void)s;
    enum { V = 300 };
    float x[V];
    for (int r = 0; r < 20; r++) {
        make_row(x, V, (enum row_kind)(r % 5));
        for (int i = 0; i < V; i++)
            if (rnd() % 4 == 0) x[i] = NAN;
        x[0] = NAN; /* the first version's scan kept entry 0 when it was NaN */
        for (int k = 0; k < 6; k++) {
            struct sample_params p = {.temperature = k ? 0.5f * k : 0.0f, .top_k = k == 3 ? 4 : 0,
                                      .top_p = k == 4 ? 0.8f : 1.0f, .seed = 3};
            int t = sampler_pick(x, V, &p, (uint64_t)r, (uint64_t)k);
            assert_true(t >= 0 && t < V);
            if (isnan(x[t])) fail_msg("row %d, case %d: drew NaN entry %d", r, k, t);
        }
        assert_true(isnan(sampler_logprob(x, V, 1)));
    }
}

/* R rows of every kind, NaN sprinkled into some, and rows all NaN, all -inf, -inf with NaN, a
 * single +inf, ±0 ties; with_nan 0 leaves the NaN out (rows 1 mod 3 and the first two specials). */
static void split_rows(float *x, int R, int V, int with_nan) {
    for (int r = 0; r < R; r++) {
        float *row = x + (size_t)r * V;
        make_row(row, V, (enum row_kind)(r % 5));
        if (r % 3 == 1 && with_nan)
            for (int i = 0; i < V; i++)
                if (rnd() % 3 == 0) row[i] = NAN;
        if (r == R - 1 && with_nan) for (int i = 0; i < V; i++) row[i] = NAN;
        if (r == R - 2) for (int i = 0; i < V; i++) row[i] = -INFINITY;
        if (r == R - 3 && with_nan) for (int i = 0; i < V; i++) row[i] = i % 2 ? NAN : -INFINITY;
        if (r == R - 4) row[V / 2] = INFINITY;
        if (r == R - 5) for (int i = 0; i < V; i++) row[i] = i % 3 ? -0.0f : 0.0f;
        if (r == R - 6 && V > 4) for (int i = 0; i < V / 2; i++) row[i] = -INFINITY; /* whole slices of -inf */
    }
}

/* sl [R, Vl] = columns [j Vl, (j + 1) Vl) of x [R, V]: TP rank j's head block. */
static void take_slice(float *sl, const float *x, int R, int V, int Vl, int j) {
    for (int r = 0; r < R; r++) memcpy(sl + (size_t)r * Vl, x + (size_t)r * V + (size_t)j * Vl, sizeof(float) * Vl);
}

/* The CPU argmax op on each of np slices of R rows, merged, against sampler_pick(temperature 0)
 * on the whole rows (split_rows). */
static void test_greedy_split(void **s) {
    (void)s;
    struct backend be;
    assert_int_equal(backend_cpu_init(&be), 0);
    static const int Vs[] = {1, 2, 3, 8, 40, 1000, 129280};
    for (size_t vi = 0; vi < sizeof Vs / sizeof *Vs; vi++) {
        const int V = Vs[vi], R = V > 1000 ? 6 : 24;
        float *x = malloc(sizeof(float) * (size_t)R * V), *sl = malloc(sizeof(float) * (size_t)R * V);
        int32_t *parts = malloc(sizeof(int32_t) * 2 * (size_t)R * 8), *tok = malloc(sizeof(int32_t) * (size_t)R);
        split_rows(x, R, V, 1);
        for (int np = 1; np <= 8; np *= 2) {
            if (V % np) continue;
            const int Vl = V / np;
            for (int j = 0; j < np; j++) {
                take_slice(sl, x, R, V, Vl, j);
                be.ops->argmax(&be, parts + 2 * (size_t)j * R, sl, R, Vl);
            }
            sampler_greedy_merge(tok, parts, R, np, Vl);
            for (int r = 0; r < R; r++) {
                struct sample_params p = {.temperature = 0.0f};
                const int want = sampler_pick(x + (size_t)r * V, V, &p, 1, 2);
                if (tok[r] != want) fail_msg("V=%d split %d row %d: merged argmax %d, sampler_pick %d", V, np, r, tok[r], want);
                if (np == 1) { /* the op's value is the drawn entry's, NaN bits where it found none */
                    float v;
                    memcpy(&v, &parts[2 * r], sizeof v);
                    if (parts[2 * r + 1] >= 0 ? memcmp(&v, &x[(size_t)r * V + parts[2 * r + 1]], sizeof v) != 0 : !isnan(v))
                        fail_msg("V=%d row %d: argmax value %g at %d", V, r, v, parts[2 * r + 1]);
                }
            }
        }
        free(x), free(sl), free(parts), free(tok);
    }
    backend_cpu_free(&be);
}

/* The CPU row_topk op on each of np vocab slices, merged (sampler_topk_merge): the whole row's list
 * (the op on the row, bit for bit), and sampler_pick_topk on it draws sampler_pick's token for
 * greedy and top-k draws at several temperatures and top-p, from lists as long as top_k and longer
 * (a step's k is its largest top_k). */
static void test_topk_split(void **s) {
    (void)s;
    struct backend be;
    assert_int_equal(backend_cpu_init(&be), 0);
    static const int Vs[] = {1, 3, 8, 40, 1000, 129280};
    static const int ks[] = {1, 2, 7, 50, 333, BE_TOPK_MAX};
    static const float temps[] = {0.0f, 0.3f, 1.0f, 2.5f}, top_ps[] = {1.0f, 0.95f, 0.5f};
    for (size_t vi = 0; vi < sizeof Vs / sizeof *Vs; vi++) {
        const int V = Vs[vi], R = V > 5000 ? 7 : 24;
        float *x = malloc(sizeof(float) * (size_t)R * V), *sl = malloc(sizeof(float) * (size_t)R * V);
        struct be_topk_entry *whole = malloc(sizeof *whole * (size_t)R * BE_TOPK_MAX),
                             *parts = malloc(sizeof *parts * (size_t)R * BE_TOPK_MAX * 8),
                             *merged = malloc(sizeof *merged * (size_t)R * BE_TOPK_MAX);
        split_rows(x, R, V, 1);
        for (size_t ki = 0; ki < sizeof ks / sizeof *ks; ki++) {
            const int k = ks[ki];
            if (k > 2 * V + 8) continue;
            be.ops->row_topk(&be, whole, x, R, V, k);
            for (int np = 2; np <= 8; np *= 2) {
                if (V % np) continue;
                const int Vl = V / np;
                for (int j = 0; j < np; j++) {
                    take_slice(sl, x, R, V, Vl, j);
                    be.ops->row_topk(&be, parts + (size_t)j * R * k, sl, R, Vl, k);
                }
                sampler_topk_merge(merged, parts, R, np, k, Vl);
                for (int64_t e = 0; e < (int64_t)R * k; e++)
                    if (memcmp(&merged[e], &whole[e], sizeof *merged) && !(merged[e].i < 0 && whole[e].i < 0))
                        fail_msg("V=%d k=%d split %d: entry %lld is (%g, %d), the whole row's (%g, %d)", V, k, np,
                                 (long long)e, merged[e].v, merged[e].i, whole[e].v, whole[e].i);
            }
            for (int r = 0; r < R; r++)
                for (int ti = 0; ti < 4; ti++)
                    for (int pi = 0; pi < 3; pi++)
                        for (int h = 0; h < 2; h++) { /* top_k = k, then half of it from the longer list */
                            const int tk = h ? (k > 1 ? k / 2 : 1) : k;
                            struct sample_params p = {.temperature = temps[ti], .top_k = tk, .top_p = top_ps[pi], .seed = 9};
                            if (p.temperature > 0 && tk >= V) continue; /* a draw over every entry: not a top-k draw */
                            const uint64_t req = (uint64_t)(r * 7 + ti), pos = (uint64_t)(pi + 3 * k);
                            const int want = sampler_pick(x + (size_t)r * V, V, &p, req, pos);
                            const int got = sampler_pick_topk(whole + (size_t)r * k, k, &p, req, pos);
                            if (got != want)
                                fail_msg("V=%d row %d k=%d top_k=%d T=%g top_p=%g: token %d from the list, %d from the row", V,
                                         r, k, tk, p.temperature, p.top_p, got, want);
                        }
        }
        free(x), free(sl), free(whole), free(parts), free(merged);
    }
    backend_cpu_free(&be);
}

/* The CPU row_lse op on each of np vocab slices (each rank's lse_slices(V) / np slices, the target
 * as a column of the rank's or -1), the parts concatenated in rank order and merged: the bits of
 * sampler_logprob over the whole row for every split and every kind of row (NaN rows: NaN on
 * both), and the target's entry taken from the slice that holds it. Also the slice count: 8 where V
 * allows, and a row's parts are each slice's alone (a slice's part does not change when another
 * slice's entries do). */
static void test_lse_split(void **s) {
    (void)s;
    struct backend be;
    assert_int_equal(backend_cpu_init(&be), 0);
    assert_int_equal(lse_slices(129280), 8);
    assert_int_equal(lse_slices(1004), 4);
    assert_int_equal(lse_slices(1001), 1);
    static const int Vs[] = {1, 2, 3, 8, 40, 1000, 1004, 4099, 129280};
    for (size_t vi = 0; vi < sizeof Vs / sizeof *Vs; vi++) {
        const int V = Vs[vi], R = V > 5000 ? 8 : 24, ns = (int)lse_slices(V);
        float *x = malloc(sizeof(float) * (size_t)R * V), *sl = malloc(sizeof(float) * (size_t)R * V);
        struct be_lse_part *parts = malloc(sizeof *parts * (size_t)R * ns), row[LSE_SLICES_MAX];
        int32_t *tg = malloc(sizeof(int32_t) * (size_t)R), *tl = malloc(sizeof(int32_t) * (size_t)R);
        split_rows(x, R, V, 1);
        for (int r = 0; r < R; r++) tg[r] = (int32_t)(rnd() % (uint64_t)V);
        for (int np = 1; np <= ns; np *= 2) {
            const int Vl = V / np, nsl = ns / np;
            for (int j = 0; j < np; j++) {
                take_slice(sl, x, R, V, Vl, j);
                for (int r = 0; r < R; r++) tl[r] = tg[r] >= j * Vl && tg[r] < (j + 1) * Vl ? tg[r] - j * Vl : -1;
                be.ops->row_lse(&be, parts + (size_t)j * R * nsl, sl, R, Vl, nsl, tl, NULL);
            }
            for (int r = 0; r < R; r++) {
                for (int k = 0; k < ns; k++) row[k] = parts[((size_t)(k / nsl) * R + r) * nsl + k % nsl];
                float mx;
                const double ls = sampler_lse_merge(row, ns, &mx);
                const float tv = row[tg[r] / (V / ns)].t;
                const double got = (double)tv - (double)mx - ls, want = sampler_logprob(x + (size_t)r * V, V, tg[r]);
                if (memcmp(&tv, &x[(size_t)r * V + tg[r]], sizeof tv))
                    fail_msg("V=%d split %d row %d: target entry %g, the row has %g", V, np, r, tv, x[(size_t)r * V + tg[r]]);
                if (memcmp(&got, &want, sizeof got) && !(isnan(got) && isnan(want)))
                    fail_msg("V=%d split %d row %d: merged parts give %.17g, sampler_logprob %.17g", V, np, r, got, want);
            }
        }
        if (ns > 1) { /* slice 0's part of row 0 does not see the other slices */
            struct be_lse_part a, b;
            be.ops->row_lse(&be, parts, x, 1, V, ns, NULL, NULL);
            a = parts[0];
            for (int i = V / ns; i < V; i++) x[i] = 50.0f;
            be.ops->row_lse(&be, parts, x, 1, V, ns, NULL, NULL);
            b = parts[0];
            assert_memory_equal(&a, &b, sizeof a);
            assert_true(parts[1].m == 50.0f && parts[1].s == (double)(V / ns));
        }
        free(x), free(sl), free(parts), free(tg), free(tl);
    }
    { /* a NaN sum is one NaN whatever made it (x86's inf - inf is a negative NaN, a NaN entry keeps
         its payload, the GPU has one canonical NaN): its bits are LSE_NAN_BITS */
        uint32_t payload = 0x7fc01234u;
        float rows[3][4] = {{1.0f, INFINITY, 2.0f, 3.0f}, {1.0f, 0.0f, 2.0f, 3.0f}, {-INFINITY, INFINITY, 0, 0}};
        memcpy(&rows[1][1], &payload, sizeof payload);
        struct be_lse_part p[3];
        be.ops->row_lse(&be, p, &rows[0][0], 3, 4, 1, NULL, NULL);
        for (int r = 0; r < 3; r++) {
            uint64_t bits;
            memcpy(&bits, &p[r].s, sizeof bits);
            if (bits != LSE_NAN_BITS) fail_msg("NaN sum of row %d has bits %#llx", r, (unsigned long long)bits);
        }
    }
    backend_cpu_free(&be);
}

/* Full-row temperature draws (top_k off) where the logits are: each of np vocab slices' row_topk
 * list (BE_TOPK_MAX entries, or V) and row_lse temperature parts, merged (sampler_topk_merge,
 * sampler_wsum_merge) and drawn by sampler_pick_cand — where that returns -1, the engine takes the
 * row: sampler_pick's token for every split, temperature and top-p, whenever the list decides.
 * Both outcomes must occur where the list is shorter than the row: peaked rows (a trained model's
 * shape) and low temperatures decide from the list, flat rows at high temperature need the row;
 * a list holding every number of the row always decides. */
static void test_full_split(void **s) {
    (void)s;
    struct backend be;
    assert_int_equal(backend_cpu_init(&be), 0);
    static const int Vs[] = {1, 3, 40, 1000, 2048, 129280};
    static const float temps[] = {0.05f, 0.7f, 1.0f, 2.5f}, top_ps[] = {1.0f, 0.95f, 0.5f};
    for (size_t vi = 0; vi < sizeof Vs / sizeof *Vs; vi++) {
        const int V = Vs[vi], R = V > 5000 ? 7 : 24, k = V < BE_TOPK_MAX ? V : BE_TOPK_MAX, ns = (int)lse_slices(V);
        float *x = malloc(sizeof(float) * (size_t)R * V), *sl = malloc(sizeof(float) * (size_t)R * V), th[24];
        struct be_topk_entry *parts = malloc(sizeof *parts * (size_t)R * k * 8), *merged = malloc(sizeof *merged * (size_t)R * k);
        struct be_lse_part *lp = malloc(sizeof *lp * (size_t)R * ns), row[LSE_SLICES_MAX];
        int decided = 0, undecided = 0;
        split_rows(x, R, V, 1);
        for (int np = 1; np <= ns; np *= 2) {
            const int Vl = V / np, nsl = ns / np;
            for (int ti = 0; ti < 4; ti++) {
                for (int r = 0; r < R; r++) th[r] = temps[ti];
                for (int j = 0; j < np; j++) {
                    take_slice(sl, x, R, V, Vl, j);
                    be.ops->row_topk(&be, parts + (size_t)j * R * k, sl, R, Vl, k);
                    be.ops->row_lse(&be, lp + (size_t)j * R * nsl, sl, R, Vl, nsl, NULL, th);
                }
                sampler_topk_merge(merged, parts, R, np, k, Vl);
                for (int r = 0; r < R; r++) {
                    for (int j = 0; j < ns; j++) row[j] = lp[((size_t)(j / nsl) * R + r) * nsl + j % nsl];
                    float mx;
                    const double Z = sampler_wsum_merge(row, ns, temps[ti], &mx);
                    for (int pi = 0; pi < 3; pi++) {
                        struct sample_params p = {.temperature = temps[ti], .top_p = top_ps[pi], .seed = 5};
                        const uint64_t req = (uint64_t)(r * 3 + np), pos = (uint64_t)(ti * 3 + pi);
                        const int got = sampler_pick_cand(merged + (size_t)r * k, k, V, Z, &p, req, pos);
                        if (got < 0) {
                            if (k == V) fail_msg("V=%d row %d: a list of the whole row did not decide", V, r);
                            undecided++;
                            continue;
                        }
                        decided++;
                        const int want = sampler_pick(x + (size_t)r * V, V, &p, req, pos);
                        if (got != want)
                            fail_msg("V=%d split %d row %d T=%g top_p=%g: token %d from the list, %d from the row", V, np, r,
                                     p.temperature, p.top_p, got, want);
                    }
                }
            }
        }
        if (k < V && (decided == 0 || undecided == 0))
            fail_msg("V=%d: %d draws decided by the list, %d not: both kinds expected", V, decided, undecided);
        free(x), free(sl), free(parts), free(merged), free(lp);
    }
    backend_cpu_free(&be);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_same_tokens_small),
        cmocka_unit_test(test_same_tokens_vocab),
        cmocka_unit_test(test_draw_distribution),
        cmocka_unit_test(test_nan_rows),
        cmocka_unit_test(test_greedy_split),
        cmocka_unit_test(test_lse_split),
        cmocka_unit_test(test_topk_split),
        cmocka_unit_test(test_full_split),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
