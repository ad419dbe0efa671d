/* Row-local ops of the CPU reference backend: RMSNorm, interleaved RoPE, the three activation
 * quantize-dequantize steps, the mHC statistics / Sinkhorn split / collapse / expand, the token
 * embedding, the Engram row gather and gate.
 *
 * All of them work on one row (token) at a time, so rows are spread over OpenMP threads while the
 * arithmetic inside a row follows backend.h literally: sums in index order starting from the
 * stated first term, products rounded where the reference rounds them (-ffp-contract=off keeps
 * a·c − b·s from becoming an FMA), libm expf/sinf/cosf/sqrtf for the transcendental steps. */
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"
#include "log.h"

/* ---------------------------------------------------------------------------------------------
 * RMSNorm, RoPE, QDQ */

void cpu_op_rmsnorm(struct backend *be, bf16_t *y, const bf16_t *x, const bf16_t *w, int64_t T, int64_t n,
                    float eps, const struct norm_post *post) {
#pragma omp parallel
    {
        float *sq = ds_malloc((size_t)n * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            const bf16_t *xr = x + t * n;
            bf16_t *yr = y + t * n;
            for (int64_t i = 0; i < n; i++) {
                float v = bf16_to_f32(xr[i]);
                sq[i] = v * v;
            }
            float r = 1.0f / sqrtf(cpu_sum_torch(sq, n) / (float)n + eps);
            /* Each x is read before its own y is written, which is what makes y == x safe. */
            for (int64_t i = 0; i < n; i++) yr[i] = bf16_from_f32(bf16_to_f32(w[i]) * (bf16_to_f32(xr[i]) * r));
        }
        free(sq);
    }
    if (post && post->rd > 0) cpu_op_rope(be, y, T, 1, n, n, post->off, post->rd, post->pos, post->freqs, false);
    if (post && post->qdq == NORM_QDQ_FP8_32) cpu_op_qdq_fp8_32(be, y, T * n);
    if (post && post->qdq == NORM_QDQ_FP4_32) cpu_op_qdq_fp4_32(be, y, T * n);
}

void cpu_op_rope(struct backend *be, bf16_t *x, int64_t T, int64_t nh, int64_t ld_row, int64_t ld_head,
                 int64_t off, int64_t rd, const int32_t *pos, const float *freqs, bool inverse) {
    int64_t half = rd / 2;
    if (T <= 0 || half <= 0) return;
#pragma omp parallel
    {
        /* cos/sin depend only on (t, i): computed once per row, shared by its heads. */
        float *cs = ds_malloc((size_t)(2 * half) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float p = (float)pos[t];
            for (int64_t i = 0; i < half; i++) {
                float ang = p * freqs[i];
                cs[2 * i] = cosf(ang);
                cs[2 * i + 1] = inverse ? -sinf(ang) : sinf(ang);
            }
            for (int64_t h = 0; h < nh; h++) {
                bf16_t *v = x + t * ld_row + h * ld_head + off;
                for (int64_t i = 0; i < half; i++) {
                    float c = cs[2 * i], s = cs[2 * i + 1];
                    float a = bf16_to_f32(v[2 * i]), b = bf16_to_f32(v[2 * i + 1]);
                    float ac = a * c, bs = b * s, as = a * s, bc = b * c;
                    v[2 * i] = bf16_from_f32(ac - bs);
                    v[2 * i + 1] = bf16_from_f32(as + bc);
                }
            }
        }
        free(cs);
    }
}

/* Quantization groups are independent, so the array is cut into chunks that are a whole number
 * of groups (4096 is a multiple of both 16 and 32) and the chunks run in parallel. */
#define QDQ_CHUNK 4096

static void qdq_chunked(bf16_t *x, int64_t n, int64_t block, void (*fn)(bf16_t *, size_t), const char *name) {
    if (n % block != 0) ds_die("cpu %s: n = %lld is not a multiple of %lld", name, (long long)n, (long long)block);
    int64_t nchunk = (n + QDQ_CHUNK - 1) / QDQ_CHUNK;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < nchunk; c++) {
        int64_t i0 = c * QDQ_CHUNK, len = n - i0 < QDQ_CHUNK ? n - i0 : QDQ_CHUNK;
        fn(x + i0, (size_t)len);
    }
}

void cpu_op_qdq_fp8_32(struct backend *be, bf16_t *x, int64_t n) { qdq_chunked(x, n, 32, qdq_fp8_32, "qdq_fp8_32"); }

void cpu_op_qdq_fp4_32(struct backend *be, bf16_t *x, int64_t n) {
    qdq_chunked(x, n, 32, qdq_fp4_32_ue8m0, "qdq_fp4_32");
}

void cpu_op_qdq_fp4_16(struct backend *be, bf16_t *x, int64_t n) {
    qdq_chunked(x, n, 16, qdq_fp4_16_e4m3, "qdq_fp4_16");
}

/* ---------------------------------------------------------------------------------------------
 * mHC */

static void normalize_columns(float *C, int64_t hc, float eps) {
    for (int64_t k = 0; k < hc; k++) {
        float sum = 0.0f;
        for (int64_t j = 0; j < hc; j++) sum += C[j * hc + k];
        float den = sum + eps;
        for (int64_t j = 0; j < hc; j++) C[j * hc + k] /= den;
    }
}

/* split_sinkhorn of one row (MODEL.md §3.2): m has (2 + hc) * hc entries. */
static void split_sinkhorn(const float *m, int64_t hc, const float *scale, const float *base, int iters,
                           float eps, float *pre, float *post, float *C) {
    for (int64_t j = 0; j < hc; j++) {
        pre[j] = cpu_sigmoid(m[j] * scale[0] + base[j]) + eps;
        post[j] = 2.0f * cpu_sigmoid(m[hc + j] * scale[1] + base[hc + j]);
    }
    for (int64_t j = 0; j < hc; j++) {
        float *row = C + j * hc;
        for (int64_t k = 0; k < hc; k++) row[k] = m[2 * hc + j * hc + k] * scale[2] + base[2 * hc + j * hc + k];
        float mx = row[0];
        for (int64_t k = 1; k < hc; k++) mx = row[k] > mx ? row[k] : mx;
        float sum = 0.0f;
        for (int64_t k = 0; k < hc; k++) {
            row[k] = expf(row[k] - mx);
            sum += row[k];
        }
        for (int64_t k = 0; k < hc; k++) row[k] = row[k] / sum + eps;
    }
    /* The softmax already made the rows sum to one, so the first pass is a column step alone;
     * the remaining iters - 1 passes are row then column, as the reference's loop. */
    normalize_columns(C, hc, eps);
    for (int it = 1; it < iters; it++) {
        for (int64_t j = 0; j < hc; j++) {
            float *row = C + j * hc;
            float sum = 0.0f;
            for (int64_t k = 0; k < hc; k++) sum += row[k];
            float den = sum + eps;
            for (int64_t k = 0; k < hc; k++) row[k] /= den;
        }
        normalize_columns(C, hc, eps);
    }
}

void cpu_op_hc_mixes(struct backend *be, float *pre, float *post, float *comb, const bf16_t *X, int64_t T,
                     int64_t hc, int64_t D, const float *fn, const float *scale, const float *base, int iters,
                     float norm_eps, float hc_eps) {
    int64_t L = hc * D, nm = (2 + hc) * hc;
    if (T <= 0) return;
#pragma omp parallel
    {
        float *xf = ds_malloc((size_t)L * sizeof(float)), *sq = ds_malloc((size_t)L * sizeof(float));
        float *m = ds_malloc((size_t)nm * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            const bf16_t *xr = X + t * L;
            for (int64_t i = 0; i < L; i++) {
                xf[i] = bf16_to_f32(xr[i]);
                sq[i] = xf[i] * xf[i];
            }
            float r = 1.0f / sqrtf(cpu_sum_torch(sq, L) / (float)L + norm_eps);
            for (int64_t j = 0; j < nm; j++) {
                const float *f = fn + j * L;
                float acc = 0.0f;
                for (int64_t s0 = 0; s0 < L; s0 += BE_HC_MIX_SEG) {
                    const int64_t s1 = s0 + BE_HC_MIX_SEG < L ? s0 + BE_HC_MIX_SEG : L;
                    float part = 0.0f;
                    for (int64_t i = s0; i < s1; i++) part += xf[i] * f[i];
                    acc += part;
                }
                m[j] = acc * r;
            }
            split_sinkhorn(m, hc, scale, base, iters, hc_eps, pre + t * hc, post + t * hc, comb + t * hc * hc);
        }
        free(m);
        free(xf);
        free(sq);
    }
}

void cpu_op_hc_collapse(struct backend *be, bf16_t *y, const bf16_t *X, const float *p, int64_t T, int64_t hc,
                        int64_t D, const bf16_t *norm_w, float eps) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const bf16_t *xr = X + t * hc * D;
        const float *pr = p + t * hc;
        for (int64_t d = 0; d < D; d++) {
            float acc = pr[0] * bf16_to_f32(xr[d]);
            for (int64_t j = 1; j < hc; j++) acc += pr[j] * bf16_to_f32(xr[j * D + d]);
            y[t * D + d] = bf16_from_f32(acc);
        }
    }
    if (norm_w) cpu_op_rmsnorm(be, y, y, norm_w, T, D, eps, NULL);
}

void cpu_op_hc_expand(struct backend *be, bf16_t *Xo, const bf16_t *y, const bf16_t *X, const float *post,
                      const float *comb, int64_t T, int64_t hc, int64_t D, int64_t y_blocks) {
    if (y_blocks < 1 || D % y_blocks)
        ds_die("hc_expand: y_blocks %lld does not divide D %lld", (long long)y_blocks, (long long)D);
    const int64_t Db = D / y_blocks; /* y [y_blocks, T, Db] */
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const bf16_t *xr = X + t * hc * D;
        const float *c = comb + t * hc * hc;
        for (int64_t k = 0; k < hc; k++) {
            float pk = post[t * hc + k];
            bf16_t *o = Xo + (t * hc + k) * D;
            for (int64_t d = 0; d < D; d++) {
                float mix = c[k] * bf16_to_f32(xr[d]);
                for (int64_t j = 1; j < hc; j++) mix += c[j * hc + k] * bf16_to_f32(xr[j * D + d]);
                const bf16_t yv = y[(d / Db * T + t) * Db + d % Db];
                o[d] = bf16_from_f32(pk * bf16_to_f32(yv) + mix);
            }
        }
    }
}

void cpu_op_hc_init(struct backend *be, bf16_t *X, float *pre, const bf16_t *e, int64_t T, int64_t hc,
                    int64_t D) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        for (int64_t c = 0; c < hc; c++) memcpy(X + (t * hc + c) * D, e + t * D, (size_t)D * sizeof(bf16_t));
        for (int64_t c = 0; c < hc; c++) pre[t * hc + c] = c == 0 ? 1.0f : 0.0f;
    }
}

/* ---------------------------------------------------------------------------------------------
 * Embedding and Engram */

void cpu_op_embed(struct backend *be, bf16_t *e, const int32_t *ids, int64_t T, const bf16_t *table,
                  int64_t row0, int64_t nrows, int64_t D) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++) {
        int64_t id = ids[t];
        if (id >= row0 && id < row0 + nrows)
            memcpy(e + t * D, table + (id - row0) * D, (size_t)D * sizeof(bf16_t));
        else
            memset(e + t * D, 0, (size_t)D * sizeof(bf16_t));
    }
}

void cpu_op_engram_gather(struct backend *be, bf16_t *rows, const int64_t *ids, int64_t T, int64_t C,
                          const uint8_t *table, const uint8_t *scale, int64_t row0, int64_t nrows, int64_t hd) {
    int64_t nsc = hd / 32;
#pragma omp parallel for schedule(static)
    for (int64_t tc = 0; tc < T * C; tc++) {
        int64_t id = ids[tc];
        bf16_t *out = rows + tc * hd;
        if (id >= row0 && id < row0 + nrows) {
            int64_t l = id - row0;
            dequant_engram_row(table + l * hd, scale + l * nsc, (int)hd, out);
        } else {
            memset(out, 0, (size_t)hd * sizeof(bf16_t));
        }
    }
}

void cpu_op_engram_gate(struct backend *be, bf16_t *X, const bf16_t *kv, const float *w, int64_t T,
                        int64_t hc, int64_t D, float eps) {
    float inv_sqrt_d = (float)(1.0 / sqrt((double)D));
#pragma omp parallel
    {
        float *tmp = ds_malloc((size_t)D * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            const bf16_t *kvr = kv + t * (hc + 1) * D;
            const bf16_t *value = kvr + hc * D;
            for (int64_t c = 0; c < hc; c++) {
                bf16_t *h = X + (t * hc + c) * D;
                const bf16_t *key = kvr + c * D;
                const float *wc = w + c * D;
                /* each statistic is a materialized fp32 row summed in the reference's order */
                for (int64_t d = 0; d < D; d++) tmp[d] = bf16_to_f32(h[d]) * bf16_to_f32(h[d]);
                float ss_h = cpu_sum_torch(tmp, D);
                for (int64_t d = 0; d < D; d++) tmp[d] = bf16_to_f32(key[d]) * bf16_to_f32(key[d]);
                float ss_k = cpu_sum_torch(tmp, D);
                for (int64_t d = 0; d < D; d++) tmp[d] = (bf16_to_f32(h[d]) * wc[d]) * bf16_to_f32(key[d]);
                float dot = cpu_sum_torch(tmp, D);
                float rstd = (1.0f / sqrtf(ss_h / (float)D + eps)) * (1.0f / sqrtf(ss_k / (float)D + eps));
                dot = (dot * rstd) * inv_sqrt_d;
                float g = cpu_sigmoid(copysignf(sqrtf(fmaxf(fabsf(dot), 1e-6f)), dot));
                for (int64_t d = 0; d < D; d++) h[d] = bf16_from_f32(bf16_to_f32(h[d]) + g * bf16_to_f32(value[d]));
            }
        }
        free(tmp);
    }
}

void cpu_op_interleave(struct backend *be, void *dst, const void *src, int64_t S, int64_t T, size_t bytes) {
    for (int64_t s = 0; s < S; s++)
        for (int64_t t = 0; t < T; t++)
            memcpy((char *)dst + ((size_t)(t * S + s)) * bytes, (const char *)src + ((size_t)(s * T + t)) * bytes, bytes);
}

