/* Sampling (see sampler.h). Top-k and top-p act on the temperature-scaled distribution; ties in
 * the sort are broken by token id so the choice is a pure function of the logits and the key. */
#include "sampler.h"

#include <math.h>
#include <stdlib.h>

#include "log.h"

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

static const float *g_sort_logits;
static int cmp_desc(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    float lx = g_sort_logits[x], ly = g_sort_logits[y];
    if (lx != ly) return lx > ly ? -1 : 1;
    return x - y;
}

int sampler_pick(const float *logits, int V, const struct sample_params *p, uint64_t request, uint64_t position) {
    int best = 0;
    for (int i = 1; i < V; i++)
        if (logits[i] > logits[best]) best = i;
    if (p->temperature <= 0) return best;
    int *order = ds_malloc(sizeof(int) * (size_t)V);
    for (int i = 0; i < V; i++) order[i] = i;
    g_sort_logits = logits;
    qsort(order, (size_t)V, sizeof *order, cmp_desc);
    int n = (p->top_k > 0 && p->top_k < V) ? p->top_k : V;
    double *pr = ds_malloc(sizeof(double) * (size_t)n), sum = 0, mx = logits[order[0]];
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

double sampler_logprob(const float *logits, int V, int token) {
    double mx = logits[0], s = 0;
    for (int i = 1; i < V; i++)
        if (logits[i] > mx) mx = logits[i];
    for (int i = 0; i < V; i++) s += exp((double)logits[i] - mx);
    return (double)logits[token] - mx - log(s);
}
