/* Mixture-of-experts ops of the CPU reference backend (MODEL.md §3.10): the sqrt-softplus router
 * with bias-only selection, the routed experts and the shared expert (clamped SwiGLU).
 *
 * The routed output is a sum of bf16 expert outputs into an fp32 buffer, and fp32 addition is not
 * associative, so the order is the contract: experts in ascending id, and within one expert its
 * tokens in ascending t. Each expert's tokens are gathered into one block and run through the
 * ordinary linears (which parallelize over outputs); the experts themselves run one after another
 * so the accumulation never depends on the thread count. */
#include <stdlib.h>
#include <stdbool.h>
#include <string.h>

#include "cpu_internal.h"
#include "log.h"

void cpu_router_select_row(int32_t *ir, float *wr, float *s, unsigned char *taken, const float *z, const float *bias,
                           int64_t E, int64_t k, float temp, bool norm, float route_scale) {
    for (int64_t e = 0; e < E; e++) {
        float zt = z[e] / temp;
        float sp = zt > 20.0f ? zt : log1pf(expf(zt)); /* torch softplus, threshold 20 */
        s[e] = sqrtf(sp);
    }
    memset(taken, 0, (size_t)E);
    for (int64_t slot = 0; slot < k; slot++) {
        /* Strictly greater while scanning up from id 0: a tie keeps the lower id. */
        int64_t best = -1;
        float bv = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            if (taken[e]) continue;
            float v = bias ? s[e] + bias[e] : s[e];
            if (best < 0 || v > bv) {
                best = e;
                bv = v;
            }
        }
        taken[best] = 1;
        ir[slot] = (int32_t)best;
        wr[slot] = s[best];
    }
    if (norm && k > 1) {
        float sum = 0.0f;
        for (int64_t slot = 0; slot < k; slot++) sum += wr[slot];
        float den = sum + 1e-20f;
        for (int64_t slot = 0; slot < k; slot++) wr[slot] /= den;
    }
    for (int64_t slot = 0; slot < k; slot++) wr[slot] *= route_scale;
}

void cpu_op_router(struct backend *be, int32_t *idx, float *wts, const bf16_t *x, int64_t T,
                   const struct qweight *gate, const float *bias, int64_t k, float temp, bool norm,
                   float route_scale) {
    int64_t E = gate->n;
    if (T <= 0) return;
    if (k > E) ds_die("cpu router: top-%lld of %lld experts", (long long)k, (long long)E);
    float *z = ds_malloc((size_t)(T * E) * sizeof(float));
    cpu_op_linear_f32(be, z, x, T, gate);
#pragma omp parallel
    {
        unsigned char *taken = ds_malloc((size_t)E);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) /* the scores overwrite the row's logits */
            cpu_router_select_row(idx + t * k, wts + t * k, z + t * E, taken, z + t * E, bias, E, k, temp, norm,
                                  route_scale);
        free(taken);
    }
    free(z);
}

static void swiglu_rows(bf16_t *h, const bf16_t *g, const bf16_t *u, const float *wt, int64_t rows, int64_t I,
                        float limit) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < I; i++) {
            float gv = bf16_to_f32(g[r * I + i]), uv = bf16_to_f32(u[r * I + i]);
            if (limit > 0.0f) {
                uv = uv < -limit ? -limit : (uv > limit ? limit : uv);
                gv = gv > limit ? limit : gv;
            }
            float hv = (gv / (1.0f + expf(-gv))) * uv;
            if (wt) hv = wt[r] * hv;
            h[r * I + i] = bf16_from_f32(hv);
        }
    }
}

static void check_ffn_shapes(const struct qweight *w1, const struct qweight *w3, const struct qweight *w2,
                             const char *who) {
    if (w3->n != w1->n || w3->k != w1->k || w2->k != w1->n)
        ds_die("cpu %s: inconsistent shapes w1 [%lld, %lld], w3 [%lld, %lld], w2 [%lld, %lld]", who,
               (long long)w1->n, (long long)w1->k, (long long)w3->n, (long long)w3->k, (long long)w2->n,
               (long long)w2->k);
}

void cpu_op_moe_experts(struct backend *be, bf16_t *y, const bf16_t *x, const int32_t *idx, const float *wts,
                        int64_t T, int64_t k, int64_t e0, int64_t n_local, const struct qweight *w1,
                        const struct qweight *w3, const struct qweight *w2, float limit) {
    if (T <= 0 || n_local <= 0) return;
    int64_t D = w1[0].k, I = w1[0].n, Dout = w2[0].n;
    /* Size the gather buffers for the busiest local expert. */
    int64_t *count = ds_calloc((size_t)n_local, sizeof(int64_t));
    for (int64_t i = 0; i < T * k; i++)
        if (idx[i] >= e0 && idx[i] < e0 + n_local) count[idx[i] - e0]++;
    int64_t cap = 0;
    for (int64_t le = 0; le < n_local; le++) cap = count[le] > cap ? count[le] : cap;
    if (cap == 0) {
        free(count);
        return;
    }
    int64_t *tok = ds_malloc((size_t)cap * sizeof(int64_t)); /* flat (t, slot) index */
    float *wt = ds_malloc((size_t)cap * sizeof(float));
    bf16_t *xg = ds_malloc((size_t)(cap * D) * sizeof(bf16_t));
    bf16_t *gb = ds_malloc((size_t)(cap * I) * sizeof(bf16_t));
    bf16_t *ub = ds_malloc((size_t)(cap * I) * sizeof(bf16_t));
    bf16_t *yb = ds_malloc((size_t)(cap * Dout) * sizeof(bf16_t));
    for (int64_t le = 0; le < n_local; le++) {
        if (count[le] == 0) continue;
        check_ffn_shapes(&w1[le], &w3[le], &w2[le], "moe_experts");
        if (w1[le].k != D || w1[le].n != I || w2[le].n != Dout) ds_die("cpu moe_experts: experts differ in shape");
        int64_t c = 0;
        for (int64_t t = 0; t < T; t++)
            for (int64_t slot = 0; slot < k; slot++)
                if (idx[t * k + slot] == e0 + le) {
                    tok[c] = t * k + slot;
                    wt[c] = wts[t * k + slot];
                    memcpy(xg + c * D, x + t * D, (size_t)D * sizeof(bf16_t));
                    c++;
                }
        cpu_op_linear(be, gb, xg, c, &w1[le]);
        cpu_op_linear(be, ub, xg, c, &w3[le]);
        swiglu_rows(gb, gb, ub, wt, c, I, limit); /* h overwrites g row by row, element by element */
        cpu_op_linear(be, yb, gb, c, &w2[le]);
        for (int64_t r = 0; r < c; r++) memcpy(y + tok[r] * Dout, yb + r * Dout, (size_t)Dout * sizeof(bf16_t));
    }
    free(yb);
    free(ub);
    free(gb);
    free(xg);
    free(wt);
    free(tok);
    free(count);
}

void cpu_op_moe_combine(struct backend *be, bf16_t *out, const bf16_t *y, const int32_t *idx, const bf16_t *sh,
                        int64_t ld_sh, int64_t T, int64_t k, int64_t D, int64_t per_part, int64_t P) {
    enum { MAX_K = 64 };
    if (k > MAX_K) ds_die("cpu moe_combine: top-%lld exceeds %d", (long long)k, MAX_K);
    if (sh && ld_sh < D) ds_die("cpu moe_combine: shared rows %lld apart, narrower than %lld", (long long)ld_sh, (long long)D);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const int32_t *it = idx + t * k;
        const bf16_t *rows[MAX_K]; /* the token's computed slots' rows in ascending expert id */
        int64_t nr = 0;
        bool done[MAX_K];
        for (int64_t s = 0; s < k; s++) done[s] = false;
        for (int64_t r = 0; r < k; r++) {
            int64_t best = -1;
            for (int64_t s = 0; s < k; s++)
                if (!done[s] && (best < 0 || it[s] < it[best])) best = s;
            done[best] = true;
            int64_t part = it[best] / per_part;
            if (part < P) rows[nr++] = y + ((part * T + t) * k + best) * D;
        }
        for (int64_t d = 0; d < D; d++) {
            float a = 0.0f;
            for (int64_t r = 0; r < nr; r++) a += bf16_to_f32(rows[r][d]);
            out[t * D + d] = bf16_from_f32(sh ? a + bf16_to_f32(sh[t * ld_sh + d]) : a);
        }
    }
}

void cpu_op_shared_expert(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, const struct qweight *w1,
                          const struct qweight *w3, const struct qweight *w2, float limit) {
    if (T <= 0) return;
    check_ffn_shapes(w1, w3, w2, "shared_expert");
    int64_t I = w1->n;
    bf16_t *gb = ds_malloc((size_t)(T * I) * sizeof(bf16_t));
    bf16_t *ub = ds_malloc((size_t)(T * I) * sizeof(bf16_t));
    cpu_op_linear(be, gb, x, T, w1);
    cpu_op_linear(be, ub, x, T, w3);
    swiglu_rows(gb, gb, ub, NULL, T, I, limit);
    cpu_op_linear(be, y, gb, T, w2);
    free(ub);
    free(gb);
}
