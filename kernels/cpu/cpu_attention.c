/* Attention-side ops of the CPU reference backend: sparse attention with the sink (a port of the
 * reference kernel's block-64 online softmax, MODEL.md §3.9), the ratio-2 compressor's softmax
 * pooling (§3.6) and the indexer's scores (§3.7).
 *
 * sparse_attn is bit-sensitive to its structure, not only to its sums: P is rounded to bf16
 * against the running max of each 64-entry block, so the block boundaries over the concatenated
 * index row and the moment the accumulators are rescaled are part of the numerics and are kept
 * exactly. Each (row, head) pair, pooled group or score is independent, which is what the OpenMP
 * loops split; every dot product is still one sequential fp32 sum. */
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"
#include "log.h"

#define ATTN_BLOCK 64

/* Four independent sequential dots against one query: more work per loop without reordering. */
static void dot4_bf16(const float *q, const bf16_t *k0, const bf16_t *k1, const bf16_t *k2, const bf16_t *k3,
                      int64_t n, float out[4]) {
    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    for (int64_t d = 0; d < n; d++) {
        float qd = q[d];
        a0 += qd * bf16_to_f32(k0[d]);
        a1 += qd * bf16_to_f32(k1[d]);
        a2 += qd * bf16_to_f32(k2[d]);
        a3 += qd * bf16_to_f32(k3[d]);
    }
    out[0] = a0;
    out[1] = a1;
    out[2] = a2;
    out[3] = a3;
}

static float dot_bf16(const float *q, const bf16_t *k, int64_t n) {
    float a = 0.0f;
    for (int64_t d = 0; d < n; d++) a += q[d] * bf16_to_f32(k[d]);
    return a;
}

/* Raw q·k of the valid entries listed in pos[0..nv) of one block; invalid ones are never touched
 * (their kv row does not exist). */
static void block_dots(const float *qf, const bf16_t *kv, const int32_t *ids, const int *pos, int nv, int64_t hd,
                       float *s) {
    int v = 0;
    for (; v + 4 <= nv; v += 4) {
        float o[4];
        dot4_bf16(qf, kv + (int64_t)ids[pos[v]] * hd, kv + (int64_t)ids[pos[v + 1]] * hd,
                  kv + (int64_t)ids[pos[v + 2]] * hd, kv + (int64_t)ids[pos[v + 3]] * hd, hd, o);
        for (int u = 0; u < 4; u++) s[pos[v + u]] = o[u];
    }
    for (; v < nv; v++) s[pos[v]] = dot_bf16(qf, kv + (int64_t)ids[pos[v]] * hd, hd);
}

void cpu_op_sparse_attn(struct backend *be, bf16_t *o, const bf16_t *q, const bf16_t *kv, const int32_t *idx,
                        int64_t T, int64_t H, int64_t hd, int64_t n_idx, const float *sink, float scale) {
    if (T <= 0 || H <= 0) return;
#pragma omp parallel
    {
        float *qf = ds_malloc((size_t)hd * sizeof(float));
        float *acc = ds_malloc((size_t)hd * sizeof(float));
        float *pv = ds_malloc((size_t)hd * sizeof(float));
        float s[ATTN_BLOCK], p[ATTN_BLOCK];
        int pos[ATTN_BLOCK];
#pragma omp for schedule(dynamic, 1)
        for (int64_t th = 0; th < T * H; th++) {
            int64_t t = th / H, h = th % H;
            const int32_t *ir = idx + t * n_idx;
            bf16_t *out = o + th * hd;
            bool any = false;
            for (int64_t i = 0; i < n_idx && !any; i++) any = ir[i] >= 0;
            if (!any) {
                memset(out, 0, (size_t)hd * sizeof(bf16_t));
                continue;
            }
            for (int64_t d = 0; d < hd; d++) qf[d] = bf16_to_f32(q[th * hd + d]);
            for (int64_t d = 0; d < hd; d++) acc[d] = 0.0f;
            float m = -1e30f, l = 0.0f;
            for (int64_t b0 = 0; b0 < n_idx; b0 += ATTN_BLOCK) {
                int nb = (int)(n_idx - b0 < ATTN_BLOCK ? n_idx - b0 : ATTN_BLOCK);
                const int32_t *ids = ir + b0;
                int nv = 0;
                for (int i = 0; i < nb; i++) {
                    s[i] = -INFINITY;
                    if (ids[i] >= 0) pos[nv++] = i;
                }
                block_dots(qf, kv, ids, pos, nv, hd, s);
                float m_new = m;
                for (int v = 0; v < nv; v++) {
                    float sv = s[pos[v]] * scale;
                    s[pos[v]] = sv;
                    if (sv > m_new) m_new = sv;
                }
                float alpha = expf(m - m_new);
                float lsum = 0.0f;
                for (int i = 0; i < nb; i++) {
                    p[i] = ids[i] >= 0 ? expf(s[i] - m_new) : 0.0f;
                    lsum += p[i];
                }
                l = l * alpha + lsum;
                /* The block's P·V is formed on its own (from zero, entries in order) and then
                 * added to the rescaled accumulator, as the kernel's per-block GEMM does. */
                for (int64_t d = 0; d < hd; d++) pv[d] = 0.0f;
                for (int v = 0; v < nv; v++) {
                    float pb = bf16_round(p[pos[v]]);
                    const bf16_t *row = kv + (int64_t)ids[pos[v]] * hd;
                    for (int64_t d = 0; d < hd; d++) pv[d] += pb * bf16_to_f32(row[d]);
                }
                for (int64_t d = 0; d < hd; d++) acc[d] = acc[d] * alpha + pv[d];
                m = m_new;
            }
            if (sink) l += expf(sink[h] - m);
            for (int64_t d = 0; d < hd; d++) out[d] = bf16_from_f32(acc[d] / l);
        }
        free(pv);
        free(acc);
        free(qf);
    }
}

void cpu_op_compress_pool(struct backend *be, bf16_t *lat, const float *kv, const float *score, int64_t G,
                          int64_t r, int64_t n) {
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < G; g++) {
        const float *kg = kv + g * r * n, *sg = score + g * r * n;
        for (int64_t c = 0; c < n; c++) {
            float mx = -INFINITY;
            for (int64_t j = 0; j < r; j++) mx = sg[j * n + c] > mx ? sg[j * n + c] : mx;
            /* A channel whose slots are all unfilled (-inf) has no softmax; the reference never
             * pools such a group, and zero keeps it from turning into NaN. */
            if (mx == -INFINITY) {
                lat[g * n + c] = 0;
                continue;
            }
            float sum = 0.0f;
            for (int64_t j = 0; j < r; j++) sum += expf(sg[j * n + c] - mx);
            float acc = 0.0f;
            for (int64_t j = 0; j < r; j++) {
                float e = expf(sg[j * n + c] - mx);
                /* An unfilled slot's kv may be anything: its weight is exactly 0, so skip it
                 * rather than multiply (0 · inf would be NaN). */
                if (e == 0.0f) continue;
                acc += kg[j * n + c] * (e / sum);
            }
            lat[g * n + c] = bf16_from_f32(acc);
        }
    }
}

void cpu_op_index_scores(struct backend *be, float *S, int64_t ld_s, const bf16_t *q, int64_t ld_q,
                         const bf16_t *K, const bf16_t *const *K_rows, const int32_t *nk_rows, const bf16_t *w,
                         float w_scale, const int32_t *visible, int64_t T, int64_t nh, int64_t d, int64_t nk) {
    if (T <= 0 || nk <= 0) return;
    /* q widened once (exact) and the head weights scaled and rounded once, as the reference does
     * before scoring; both are shared by all keys. */
    float *qf = ds_malloc((size_t)(T * nh * d) * sizeof(float));
    float *wf = ds_malloc((size_t)(T * nh) * sizeof(float));
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < nh * d; i++) qf[t * nh * d + i] = bf16_to_f32(q[t * ld_q + i]);
    for (int64_t i = 0; i < T * nh; i++) wf[i] = bf16_round(bf16_to_f32(w[i]) * w_scale);
#pragma omp parallel for schedule(static)
    for (int64_t tj = 0; tj < T * nk; tj++) {
        int64_t t = tj / nk, j = tj % nk;
        if (nk_rows && j >= nk_rows[t]) continue; /* past this row's own keys: not written */
        float *out = S + t * ld_s + j;
        if (visible && j >= visible[t]) {
            *out = -INFINITY;
            continue;
        }
        const bf16_t *kr = (K_rows ? K_rows[t] : K) + j * d;
        const float *qt = qf + t * nh * d;
        float acc = 0.0f;
        for (int64_t h = 0; h < nh; h++) {
            float dh = bf16_round(dot_bf16(qt + h * d, kr, d));
            float relu = dh < 0.0f ? 0.0f : dh;
            acc += bf16_round(relu * wf[t * nh + h]);
        }
        *out = bf16_round(acc);
    }
    free(wf);
    free(qf);
}
