/* The first version of src/sampler.c's draw and log-probability, kept as the oracle of
 * test_sampler.c and the baseline of bench_sampler.c: a qsort of every index by (logit desc, id
 * asc), the weights e^((x - max) / T) in double in that order, the sums and the draw sequential. */
#ifndef DS_SAMPLER_REF_H
#define DS_SAMPLER_REF_H

#include <math.h>
#include <stdlib.h>

#include "sampler.h"

static int cmp_desc(const void *a, const void *b, void *ctx) {
    const float *l = ctx;
    int x = *(const int *)a, y = *(const int *)b;
    if (l[x] != l[y]) return l[x] > l[y] ? -1 : 1;
    return x - y;
}

static int ref_pick(const float *logits, int V, const struct sample_params *p, uint64_t request, uint64_t position) {
    int best = 0;
    for (int i = 1; i < V; i++)
        if (logits[i] > logits[best]) best = i;
    if (p->temperature <= 0) return best;
    int *order = malloc(sizeof(int) * (size_t)V);
    for (int i = 0; i < V; i++) order[i] = i;
    qsort_r(order, (size_t)V, sizeof *order, cmp_desc, (void *)logits);
    int n = (p->top_k > 0 && p->top_k < V) ? p->top_k : V;
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
