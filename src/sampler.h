/* Token sampling: greedy, temperature, top-k, top-p, with randomness from a counter-based
 * generator (Philox-4x32-10) keyed by (seed, request, position), so a request's tokens do not
 * depend on batch composition, concurrency, rank count or order. */
#ifndef DS_SAMPLER_H
#define DS_SAMPLER_H

#include <stdint.h>

struct sample_params {
    float temperature; /* 0 = greedy */
    int top_k;         /* 0 = off */
    float top_p;       /* 1 = off */
    uint64_t seed;
};

/* Philox-4x32-10 of counter (c0..c3) under key (k0, k1). */
void philox4x32(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);
/* Uniform in [0, 1) for (seed, request, position). */
double sampler_uniform(uint64_t seed, uint64_t request, uint64_t position);

/* Pick a token from logits [V] (not modified). Greedy: the first largest. Top-k (0 < top_k < V):
 * the k first entries in the draw order, weights e^((x - max) / T) in double, sequential sums.
 * Otherwise (the full row): weights expf((x - max) / T) of float operands (lse_core.h's temperature
 * terms), their total Z in lse_core.h's slices so that a backend gives it without the row, top-p's
 * prefix and the draw by running sums in draw order (sampler.c: draw_full). */
int sampler_pick(const float *logits, int V, const struct sample_params *p, uint64_t request, uint64_t position);

/* log-softmax of logits at `token`: x[token] - M - log S in double, M the row's maximum and S its
 * sum of exponentials in kernels/lse_core.h's order (slices, lanes, float differences, glibc's
 * expf), so the row_lse op's parts merged by sampler_lse_merge give the same bits on any backend
 * and any vocab split. NaN or +inf anywhere gives NaN. */
double sampler_logprob(const float *logits, int V, int token);

/* sampler_pick's draw of a row whose draw is greedy or top-k (0 < top_k < V), from the row's k
 * first entries in the draw order (kernels/draw_order.h; k >= 1 for greedy, >= top_k otherwise;
 * (NaN, -1) past its numbers), as the row_topk op and sampler_topk_merge give them: the same token
 * as sampler_pick over the whole row. */
struct be_topk_entry;
int sampler_pick_topk(const struct be_topk_entry *top, int64_t k, const struct sample_params *p, uint64_t request,
                      uint64_t position);
/* R rows' lists from np vocab slices of Vl ids: parts [np][R][k] (each row_topk's, columns of its
 * slice) merged into out [R][k], the k first of the row with whole-row ids. */
void sampler_topk_merge(struct be_topk_entry *out, const struct be_topk_entry *parts, int64_t R, int64_t np, int64_t k,
                        int64_t Vl);

/* A row's ns slices' parts (the row_lse op's, in id order) merged: *M = the row's maximum,
 * returns log Σ_j s_j · exp(m_j - M) (the sum in slice order, double). */
struct be_lse_part;
double sampler_lse_merge(const struct be_lse_part *p, int64_t ns, float *M);
/* The same merge of a temperature's slices (row_lse with temp): Σ_j s_j · exp((m_j - M) / temp),
 * the weight total Z of a full-row temperature draw. */
double sampler_wsum_merge(const struct be_lse_part *p, int64_t ns, float temp, float *M);

/* sampler_pick's full-row temperature draw (temperature > 0, top_k off: every entry in play, top-p
 * or not) from the row's k first entries in the draw order (row_topk + sampler_topk_merge) and its
 * weight total Z (row_lse with the temperature + sampler_wsum_merge) for a row of V entries: the
 * token, or -1 when those k entries do not decide the draw (a nucleus or a drawn position past
 * them: then sampler_pick over the whole row gives it). On trained models' rows the k = 1,024
 * first entries nearly always decide it. */
int sampler_pick_cand(const struct be_topk_entry *top, int64_t k, int64_t V, double Z, const struct sample_params *p,
                      uint64_t request, uint64_t position);
/* The k of a full-row temperature draw's list for a row of V entries: BE_TOPK_MAX (1,024), or V
 * when the row is shorter (then the list holds every number of the row and always decides). */
int64_t sampler_full_list_len(int64_t V);

/* The greedy draws of R rows whose vocabulary is split in np consecutive slices of Vl ids: parts
 * [np][R][2] int32 holds each slice's best (the backend's argmax op: a float's bits, then its index
 * in the slice or -1). tokens[r] = sampler_pick's draw at temperature 0 over the whole row: the
 * first best across the slices, 0 where every entry is NaN. */
void sampler_greedy_merge(int32_t *tokens, const int32_t *parts, int64_t R, int64_t np, int64_t Vl);

#endif /* DS_SAMPLER_H */
