/* The first version of src/sampler.c's draw and log-probability, kept as the oracle of
 * test_sampler.c and the baseline of bench_sampler.c: a qsort of every index by (logit desc, id
 * asc), the weights e^((x - max) / T) in double in that order, the sums and the draw sequential.
 * The full-row temperature draw (top_k off) has since been redefined so that a backend can draw it
 * from a list and a total (sampler_pick_cand): ref_pick_full is that definition written plainly
 * over the whole sorted row — float weights expf((x - max) / T), the total Z of the row's
 * lse_core.h temperature slices (lse_slice_host + sampler_wsum_merge, checked on their own by
 * test_lse_split), top-p's prefix by running shares of Z, the draw by running sums. */
#ifndef DS_SAMPLER_REF_H
#define DS_SAMPLER_REF_H

#include <math.h>
#include <stdlib.h>

#include "backend.h"
#include "lse_core.h"
#include "sampler.h"

static int cmp_desc(const void *a, const void *b, void *ctx) {
    const float *l = ctx;
    int x = *(const int *)a, y = *(const int *)b;
    if (l[x] != l[y]) return l[x] > l[y] ? -1 : 1;
    return x - y;
}

static int ref_pick_full(const float *logits, int V, const int *order, const struct sample_params *p, double u0) {
    const float T = p->temperature, M = logits[order[0]] + 0.0f;
    if (M == INFINITY) return order[0];
    struct be_lse_part parts[LSE_SLICES_MAX];
    const int64_t ns = lse_slices(V), sl = V / ns;
    for (int64_t j = 0; j < ns; j++) parts[j] = lse_slice_host(logits + j * sl, sl, -1, T);
    float zm;
    const double Z = sampler_wsum_merge(parts, ns, T, &zm);
    double *pr = malloc(sizeof(double) * (size_t)V), S = Z;
    for (int i = 0; i < V; i++) {
        const float x = logits[order[i]];
        pr[i] = x > -INFINITY ? (double)expf((x - M) / T) : 0.0;
    }
    int n = V;
    if (p->top_p > 0 && p->top_p < 1) {
        double c = 0;
        for (int i = 0; i < V; i++) {
            c += pr[i] / Z;
            if (c >= p->top_p) {
                n = i + 1;
                break;
            }
        }
        S = 0;
        for (int i = 0; i < n; i++) S += pr[i];
    }
    const double u = u0 * S;
    double c = 0;
    int pick = -1;
    for (int i = 0; i < n && pick < 0; i++) {
        c += pr[i];
        if (u < c) pick = order[i];
    }
    if (pick < 0) { /* rounding past the end: the last of positive weight */
        int i = n - 1;
        while (i > 0 && pr[i] == 0) i--;
        pick = order[i];
    }
    free(pr);
    return pick;
}

static int ref_pick(const float *logits, int V, const struct sample_params *p, uint64_t request, uint64_t position) {
    int best = 0;
    for (int i = 1; i < V; i++)
        if (logits[i] > logits[best]) best = i;
    if (p->temperature <= 0) return best;
    int *order = malloc(sizeof(int) * (size_t)V);
    for (int i = 0; i < V; i++) order[i] = i;
    qsort_r(order, (size_t)V, sizeof *order, cmp_desc, (void *)logits);
    if (!(p->top_k > 0 && p->top_k < V)) {
        const int pick = ref_pick_full(logits, V, order, p, sampler_uniform(p->seed, request, position));
        free(order);
        return pick;
    }
    int n = p->top_k;
    double *pr = malloc(sizeof(double) * (size_t)n), sum = 0, mx = logits[order[0]];
    for (int i = 0; i < n; i++) sum += pr[i] = exp(((double)logits[order[i]] - mx) / p->temperature);
    if (p->top_p > 0 && p->top_p < 1) {
        double c = 0;
        int keep = n;
        for (int i = 0; i < n; i++) {
            c += pr[i] / sum;
            if (c >= p->top_p) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
        sum = 0;
        for (int i = 0; i < n; i++) sum += pr[i];
    }
    double u = sampler_uniform(p->seed, request, position) * sum, c = 0;
    int pick = order[n - 1];
    for (int i = 0; i < n; i++) {
        c += pr[i];
        if (u < c) {
            pick = order[i];
            break;
        }
    }
    free(order);
    free(pr);
    return pick;
}

static double ref_logprob(const float *logits, int V, int token) {
    double mx = logits[0], s = 0;
    for (int i = 1; i < V; i++)
        if (logits[i] > mx) mx = logits[i];
    for (int i = 0; i < V; i++) s += exp((double)logits[i] - mx);
    return (double)logits[token] - mx - log(s);
}

#endif /* DS_SAMPLER_REF_H */
