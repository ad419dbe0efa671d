/* Sampling (see sampler.h). Top-k and top-p act on the temperature-scaled distribution; ties in
 * the order are broken by token id so the choice is a pure function of the logits and the key.
 *
 * Every definition here is one a backend can run where the logits are, from a few bytes a row:
 * greedy from each vocab slice's best (argmax op), top-k from each slice's k first entries
 * (row_topk), the log-probability from each slice's lse_core.h part (row_lse), and the draw over
 * the whole row (temperature, top_k off) from the row's 1,024 first entries and its weight total Z
 * in lse_core.h's slices (row_topk + row_lse with the temperature): the weights are
 * expf((x - M) / T) of float operands so that a GPU computes the same terms, top-p's prefix and the
 * draw are running sums in draw order, and only a draw whose nucleus or drawn position lies past
 * the list needs the whole row (sampler_pick_cand returns -1; flat rows). The host path below runs
 * the same functions on the row, so --save-logits, the CPU backend and any TP layout draw the same
 * tokens. Top-k draws keep the first version's arithmetic (glibc exp in double over the k entries).
 *
 * History: the first version sorted every index with qsort for any temperature (27 ms a row on the
 * CI machine: 1.7 s a step at batch 64, where a GPU step takes ~12 ms); then top-k selected its k
 * entries with a bounded heap and the full-row path radix-sorted the values (4.1 ms a row), and
 * the largest logit is found in 8 independent lanes; a hand-written exp (Taylor, vectorized) was no
 * faster than glibc's (1.2-1.6 against 1.1 ms a row). NaN logits are never drawn (a
 * log-probability over a row with NaN is NaN). */
#include "sampler.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "draw_order.h"
#include "log.h"
#include "lse_core.h"

void philox4x32(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3], k0 = key[0], k1 = key[1];
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1;
        c3 = (uint32_t)p0;
        c0 = n0;
        c2 = n2;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    out[0] = c0;
    out[1] = c1;
    out[2] = c2;
    out[3] = c3;
}

double sampler_uniform(uint64_t seed, uint64_t request, uint64_t position) {
    uint32_t ctr[4] = {(uint32_t)request, (uint32_t)(request >> 32), (uint32_t)position, (uint32_t)(position >> 32)};
    uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)}, o[4];
    philox4x32(ctr, key, o);
    uint64_t bits = ((uint64_t)o[0] << 21) ^ (uint64_t)o[1]; /* 53 random bits */
    return (double)(bits & ((1ull << 53) - 1)) / 9007199254740992.0;
}

enum { LANES = 8 };

/* Largest logit and its first index, NaN entries skipped (all NaN: -inf at 0). */
static float row_max(const float *x, int V, int *first) {
    float m[LANES];
    int at[LANES];
    for (int j = 0; j < LANES; j++) m[j] = -INFINITY, at[j] = -1;
    int i = 0;
    for (; i + LANES <= V; i += LANES)
        for (int j = 0; j < LANES; j++)
            if (x[i + j] > m[j]) m[j] = x[i + j], at[j] = i + j;
    for (int j = 0; i + j < V; j++)
        if (x[i + j] > m[j]) m[j] = x[i + j], at[j] = i + j;
    float best = -INFINITY;
    int b = -1;
    for (int j = 0; j < LANES; j++)
        if (at[j] >= 0 && (m[j] > best || (m[j] == best && at[j] < b))) best = m[j], b = at[j];
    if (b < 0) { /* nothing above -inf: the first -inf entry, else 0 */
        b = 0;
        for (int k = 0; k < V; k++)
            if (x[k] == -INFINITY) {
                b = k;
                break;
            }
    }
    *first = b;
    return best;
}

/* The row's values in descending order into out[V] (LSD radix sort by 11-bit digits). */
static void sort_desc(const float *x, int V, float *out, uint32_t *k0, uint32_t *k1, float *tmp) {
    for (int i = 0; i < V; i++) k0[i] = desc_key(x[i]), out[i] = x[i];
    uint32_t *ka = k0, *kb = k1;
    float *va = out, *vb = tmp;
    for (int shift = 0; shift < 32; shift += 11) {
        int cnt[2049] = {0};
        for (int i = 0; i < V; i++) cnt[((ka[i] >> shift) & 2047u) + 1]++;
        for (int d = 0; d < 2048; d++) cnt[d + 1] += cnt[d];
        for (int i = 0; i < V; i++) {
            int p = cnt[(ka[i] >> shift) & 2047u]++;
            kb[p] = ka[i], vb[p] = va[i];
        }
        uint32_t *t = ka;
        ka = kb, kb = t;
        float *v = va;
        va = vb, vb = v;
    }
    if (va != out) memcpy(out, va, sizeof(float) * (size_t)V); /* three passes: the result is in tmp */
}

/* The top-k draw's position among its n values in draw order: weights e^((v - mx) / temp) in
 * double, the top-p prefix (the smallest whose share reaches top_p), then the first position whose
 * running sum exceeds u0 times the total — the first version's arithmetic, operation for operation. */
static int draw_position(const float *val, int n, double mx, double temp, float top_p, double u0) {
    double *pr = ds_malloc(sizeof(double) * (size_t)n), sum = 0;
    for (int i = 0; i < n; i++) sum += pr[i] = exp(((double)val[i] - mx) / temp);
    if (top_p > 0 && top_p < 1) {
        double c = 0;
        for (int i = 0; i < n; i++) {
            c += pr[i] / sum;
            if (c >= top_p) {
                n = i + 1;
                break;
            }
        }
        sum = 0;
        for (int i = 0; i < n; i++) sum += pr[i];
    }
    double u = u0 * sum, c = 0;
    int pos = n - 1;
    for (int i = 0; i < n; i++) {
        c += pr[i];
        if (u < c) {
            pos = i;
            break;
        }
    }
    free(pr);
    return pos;
}

/* pr[i], computed on first use (every loop below walks the positions from 0, so a draw that a
 * peaked row decides in its first entries computes those weights only; the same values and sums) */
static inline double lazy_weight(double *pr, int *have, const float *val, int i, float M, float T) {
    for (; *have <= i; (*have)++) pr[*have] = lse_wterm_host(val[*have], M, T);
    return pr[i];
}

/* The full-row temperature draw (top_k off) over the row's first n entries in draw order val[0..n)
 * (complete: every number of the row; NaN never among them), M the row's maximum, Z its weight
 * total (the row's lse_core.h temperature slices merged by sampler_wsum_merge). The weights are
 * lse_wterm_host's, expf((v - M) / T) of float operands, the sums sequential in draw order; top-p
 * keeps the shortest prefix whose running share Σ w / Z reaches top_p (the whole row if none does)
 * and totals it, else the total is Z; the position is the first whose running sum exceeds u0 times
 * that total (rounding past the end: the last of positive weight). Returns the position, or -1 when
 * the row's later entries could still decide (not complete, and no top-p prefix or draw ended in
 * the n). A row with +inf draws its first entry (its first +inf). */
static int draw_full(const float *val, int n, bool complete, float M, float T, float top_p, double Z, double u0) {
    if (M == INFINITY) return 0;
    M += 0.0f; /* as the slices' maxima: -0 -> +0 */
    double *pr = ds_malloc(sizeof(double) * (size_t)n), S = Z, c = 0;
    int m = n, pos = -1, have = 0;
    bool cut = false;
    if (top_p > 0 && top_p < 1) {
        for (int i = 0; i < n && !cut; i++) {
            c += lazy_weight(pr, &have, val, i, M, T) / Z;
            if (c >= top_p) m = i + 1, cut = true;
        }
        if (!cut && !complete) goto out;
        S = 0;
        for (int i = 0; i < m; i++) S += lazy_weight(pr, &have, val, i, M, T);
        cut = true;
    }
    const double u = u0 * S;
    c = 0;
    for (int i = 0; i < m; i++) {
        c += lazy_weight(pr, &have, val, i, M, T);
        if (u < c) {
            pos = i;
            goto out;
        }
    }
    if (!cut && !complete) goto out;
    for (pos = m - 1; pos > 0 && pr[pos] == 0; pos--) {} /* every weight below m computed by the scan */
out:
    free(pr);
    return pos;
}

int sampler_pick_cand(const struct be_topk_entry *top, int64_t k, int64_t V, double Z, const struct sample_params *p,
                      uint64_t request, uint64_t position) {
    if (top[0].i < 0) return 0; /* every entry NaN: row_max's 0 */
    if (p->temperature <= 0 || top[0].v == -INFINITY) return top[0].i;
    int n = 0;
    while (n < k && top[n].i >= 0) n++;
    float *val = ds_malloc(sizeof(float) * (size_t)n);
    for (int i = 0; i < n; i++) val[i] = top[i].v;
    const int pos = draw_full(val, n, n < k || k >= V, top[0].v, p->temperature, p->top_p, Z,
                              sampler_uniform(p->seed, request, position));
    free(val);
    return pos < 0 ? -1 : top[pos].i;
}

int64_t sampler_full_list_len(int64_t V) { return V < BE_TOPK_MAX ? V : BE_TOPK_MAX; }

/* The weight total of a full-row temperature draw from the row's own slices (what the backends'
 * row_lse with the temperature gives). */
static double row_wsum(const float *logits, int V, float T) {
    struct be_lse_part parts[LSE_SLICES_MAX];
    const int64_t ns = lse_slices(V), n = V / ns;
    for (int64_t j = 0; j < ns; j++) parts[j] = lse_slice_host(logits + j * n, n, -1, T);
    float M;
    return sampler_wsum_merge(parts, ns, T, &M);
}

int sampler_pick(const float *logits, int V, const struct sample_params *p, uint64_t request, uint64_t position) {
    int best;
    float fmx = row_max(logits, V, &best);
    if (p->temperature <= 0 || fmx == -INFINITY) return best;
    /* a top-k draw: from the row's top_k first entries; the full row: from its first entries as a
     * backend's row_topk gives them and its total Z, and only when those do not decide the draw,
     * every entry sorted (below) */
    const bool topk = p->top_k > 0 && p->top_k < V;
    const int k = topk ? p->top_k : (int)sampler_full_list_len(V);
    const double Z = topk ? 0.0 : row_wsum(logits, V, p->temperature);
    {
        int *ids = ds_malloc(sizeof(int) * (size_t)k);
        struct be_topk_entry *top = ds_malloc(sizeof *top * (size_t)k);
        draw_top_k_list(logits, V, k, ids, top); /* >= 1 number: the row has one above -inf */
        const int pick = topk ? sampler_pick_topk(top, k, p, request, position)
                              : sampler_pick_cand(top, k, V, Z, p, request, position);
        free(top);
        free(ids);
        if (topk || pick >= 0) return pick;
    }
    /* every entry in play, in descending order of the logits (the values alone fix the weights and
     * the sums; which id holds a value matters only for the drawn position) */
    int n = V;
    float *val = ds_malloc(sizeof(float) * (size_t)V * 2);
    uint32_t *keys = ds_malloc(sizeof(uint32_t) * (size_t)V * 2);
    sort_desc(logits, V, val, keys, keys + V, val + V);
    while (n > 0 && val[n - 1] != val[n - 1]) n--; /* NaN entries sort last and are never drawn */
    int pos = draw_full(val, n, true, val[0], p->temperature, p->top_p, Z, sampler_uniform(p->seed, request, position));
    /* the id at sorted position pos: among the entries equal to its value (a contiguous run of
     * the sorted values), the one of that rank by id */
    float v = val[pos];
    int q = pos;
    while (q > 0 && val[q - 1] == v) q--;
    int rank = pos - q, pick = best;
    for (int i = 0; i < V; i++)
        if (logits[i] == v && rank-- == 0) {
            pick = i;
            break;
        }
    free(val);
    free(keys);
    return pick;
}

int sampler_pick_topk(const struct be_topk_entry *top, int64_t k, const struct sample_params *p, uint64_t request,
                      uint64_t position) {
    int n = 0; /* the row's numbers among its k first */
    if (p->temperature > 0 && p->top_k < k) k = p->top_k;
    while (n < k && top[n].i >= 0) n++;
    if (n == 0) return 0; /* every entry NaN: row_max's 0 */
    if (p->temperature <= 0 || top[0].v == -INFINITY) return top[0].i;
    const double u0 = sampler_uniform(p->seed, request, position);
    float *val = ds_malloc(sizeof(float) * (size_t)n);
    for (int i = 0; i < n; i++) val[i] = top[i].v;
    const int pick = top[draw_position(val, n, (double)top[0].v, p->temperature, p->top_p, u0)].i;
    free(val);
    return pick;
}

void sampler_topk_merge(struct be_topk_entry *out, const struct be_topk_entry *parts, int64_t R, int64_t np, int64_t k,
                        int64_t Vl) {
    int64_t *at = ds_malloc(sizeof(int64_t) * (size_t)np); /* next entry of each slice's list */
    for (int64_t r = 0; r < R; r++) {
        memset(at, 0, sizeof(int64_t) * (size_t)np);
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1;
            for (int64_t s = 0; s < np; s++) { /* slices in id order: a later one wins only when larger */
                const struct be_topk_entry *e = parts + (s * R + r) * k + at[s];
                if (at[s] < k && e->i >= 0 && (best < 0 || e->v > parts[(best * R + r) * k + at[best]].v)) best = s;
            }
            if (best < 0) {
                out[r * k + j] = (struct be_topk_entry){NAN, -1};
                continue;
            }
            const struct be_topk_entry *e = parts + (best * R + r) * k + at[best]++;
            out[r * k + j] = (struct be_topk_entry){e->v, (int32_t)(best * Vl + e->i)};
        }
    }
    free(at);
}

double sampler_wsum_merge(const struct be_lse_part *p, int64_t ns, float temp, float *M) {
    float mx = -INFINITY;
    for (int64_t j = 0; j < ns; j++)
        if (p[j].m > mx) mx = p[j].m;
    double s = 0;
    for (int64_t j = 0; j < ns; j++) /* a slice of -inf adds nothing; a NaN sum makes s NaN */
        if (p[j].s != 0) s += p[j].s * exp(((double)p[j].m - (double)mx) / (double)temp);
    *M = mx;
    return s;
}

/* the temperature 1 sum (a quotient by 1 is exact: the same bits as without it) */
double sampler_lse_merge(const struct be_lse_part *p, int64_t ns, float *M) { return log(sampler_wsum_merge(p, ns, 1.0f, M)); }

double sampler_logprob(const float *logits, int V, int token) {
    struct be_lse_part p[LSE_SLICES_MAX];
    const int64_t ns = lse_slices(V), n = V / ns;
    for (int64_t j = 0; j < ns; j++) p[j] = lse_slice_host(logits + j * n, n, -1, 0.0f);
    float mx;
    const double ls = sampler_lse_merge(p, ns, &mx);
    return (double)logits[token] - (double)mx - ls;
}

void sampler_greedy_merge(int32_t *tokens, const int32_t *parts, int64_t R, int64_t np, int64_t Vl) {
    for (int64_t r = 0; r < R; r++) {
        float bv = 0;
        int64_t best = -1;
        for (int64_t j = 0; j < np; j++) { /* slices in id order: a later one wins only when larger */
            const int32_t *e = parts + 2 * (j * R + r);
            float v;
            memcpy(&v, &e[0], sizeof v);
            if (e[1] >= 0 && (best < 0 || v > bv)) bv = v, best = j * Vl + e[1];
        }
        tokens[r] = best < 0 ? 0 : (int32_t)best;
    }
}
