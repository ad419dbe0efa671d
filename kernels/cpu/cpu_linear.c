/* Dense projections of the CPU reference backend: the quantized linear (FP8 32x32 tiles or FP4
 * rows, with the reference's per-32 activation quantization), the plain bf16 linear, the fp32
 * linear of the router and the ratio-2 compressor, the grouped wo_a projection and the head, and
 * the head's row reductions (argmax; row_lse in kernels/lse_core.h's order; row_topk by the
 * host sampler's own selection, kernels/draw_order.h).
 *
 * Every output element is one sequential fp32 sum in k order (per 32-wide block for the quantized
 * path; per BE_DOT_SEG segment, the segment sums then added in order, for the dense ones), exactly
 * as backend.h states, because this file is the oracle the GPU GEMMs are checked against. Speed
 * comes only from things that cannot move a rounding: activations are quantized
 * once per row, weights are decoded through lookup tables into a k-major panel of CPU_LANES rows,
 * each lane (one output) keeps its own sum so the compiler may vectorize across outputs, and
 * panels are spread over OpenMP threads (each output is owned by one thread, so the thread count
 * never matters). */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"
#include "draw_order.h"
#include "lse_core.h"
#include "log.h"

/* Rows of x handled per pass: bounds the quantized-activation scratch and keeps it cache-resident
 * while every weight panel streams over it. */
#define T_CHUNK 64

static float e4m3_lut[256];
static float fp4_pair_lut[256][2];
static pthread_once_t lut_once = PTHREAD_ONCE_INIT;

static void build_luts(void) {
    for (int b = 0; b < 256; b++) {
        e4m3_lut[b] = e4m3_to_f32((uint8_t)b);
        fp4_pair_lut[b][0] = e2m1_to_f32((uint8_t)(b & 0xF));
        fp4_pair_lut[b][1] = e2m1_to_f32((uint8_t)(b >> 4));
    }
}

const float *cpu_e4m3_lut(void) {
    pthread_once(&lut_once, build_luts);
    return e4m3_lut;
}

const float *cpu_fp4_pair_lut(void) {
    pthread_once(&lut_once, build_luts);
    return &fp4_pair_lut[0][0];
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* ---------------------------------------------------------------------------------------------
 * Weight panels: CPU_LANES consecutive rows of W decoded to fp32, stored k-major
 * (panel[i * CPU_LANES + lane]). Lanes past the last row are zero and their results discarded. */

static void panel_dense(const struct qweight *W, int64_t row0, int64_t nrows, float *panel) {
    int64_t k = W->k;
    for (int lane = 0; lane < CPU_LANES; lane++) {
        int64_t j = row0 + lane;
        if (lane >= nrows) {
            for (int64_t i = 0; i < k; i++) panel[i * CPU_LANES + lane] = 0.0f;
        } else if (W->fmt == WF_BF16) {
            const bf16_t *row = (const bf16_t *)W->w + j * W->ld;
            for (int64_t i = 0; i < k; i++) panel[i * CPU_LANES + lane] = bf16_to_f32(row[i]);
        } else {
            const float *row = (const float *)W->w + j * W->ld;
            for (int64_t i = 0; i < k; i++) panel[i * CPU_LANES + lane] = row[i];
        }
    }
}

/* Quantized panel: values are the bare e4m3 / e2m1 codes' values; the per-block weight scale goes
 * to sp[b * CPU_LANES + lane] so it is applied after the block partial, as the reference does. */
static void panel_quant(const struct qweight *W, int64_t row0, int64_t nrows, float *panel, float *sp) {
    int64_t k = W->k, nb = k / 32;
    const float *l8 = cpu_e4m3_lut();
    const float *l4 = cpu_fp4_pair_lut();
    for (int lane = 0; lane < CPU_LANES; lane++) {
        int64_t j = row0 + lane;
        if (lane >= nrows) {
            for (int64_t i = 0; i < k; i++) panel[i * CPU_LANES + lane] = 0.0f;
            for (int64_t b = 0; b < nb; b++) sp[b * CPU_LANES + lane] = 0.0f;
            continue;
        }
        const uint8_t *row = (const uint8_t *)W->w + j * W->ld;
        const uint8_t *srow;
        if (W->fmt == WF_FP8) {
            srow = W->s + (j / 32) * W->s_ld; /* one scale per 32x32 tile */
            for (int64_t i = 0; i < k; i++) panel[i * CPU_LANES + lane] = l8[row[i]];
        } else {
            srow = W->s + j * W->s_ld; /* one scale per row per 32 */
            for (int64_t i = 0; i < k; i += 2) {
                panel[i * CPU_LANES + lane] = l4[2 * row[i / 2]];
                panel[(i + 1) * CPU_LANES + lane] = l4[2 * row[i / 2] + 1];
            }
        }
        for (int64_t b = 0; b < nb; b++) sp[b * CPU_LANES + lane] = e8m0_to_f32(srow[b]);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Lane kernels: the same arithmetic as the scalar formula of backend.h, CPU_LANES outputs at once. */

static void dot_quant(const float *qx, const float *sx, const float *panel, const float *sp, int64_t nb,
                      float out[CPU_LANES]) {
    float acc[CPU_LANES] = {0};
    for (int64_t b = 0; b < nb; b++) {
        float part[CPU_LANES] = {0};
        const float *xb = qx + b * 32;
        const float *pb = panel + b * 32 * CPU_LANES;
        for (int i = 0; i < 32; i++) {
            float xi = xb[i];
#pragma omp simd
            for (int l = 0; l < CPU_LANES; l++) part[l] += xi * pb[i * CPU_LANES + l];
        }
        float s = sx[b];
#pragma omp simd
        for (int l = 0; l < CPU_LANES; l++) acc[l] += (part[l] * s) * sp[b * CPU_LANES + l];
    }
    memcpy(out, acc, sizeof acc);
}

static void dot_dense(const float *x, const float *panel, int64_t k, float out[CPU_LANES]) {
    float tot[CPU_LANES] = {0};
    for (int64_t s0 = 0; s0 < k; s0 += BE_DOT_SEG) {
        const int64_t s1 = min64(k, s0 + BE_DOT_SEG);
        float acc[CPU_LANES] = {0};
        for (int64_t i = s0; i < s1; i++) {
            float xi = x[i];
#pragma omp simd
            for (int l = 0; l < CPU_LANES; l++) acc[l] += xi * panel[i * CPU_LANES + l];
        }
#pragma omp simd
        for (int l = 0; l < CPU_LANES; l++) tot[l] += acc[l];
    }
    memcpy(out, tot, sizeof tot);
}

/* ---------------------------------------------------------------------------------------------
 * Drivers */

static void linear_quant(bf16_t *y, const bf16_t *x, int64_t T, const struct qweight *W) {
    int64_t n = W->n, k = W->k, nb = k / 32;
    if (k % 32 != 0) ds_die("cpu linear: quantized weight with k = %lld, not a multiple of 32", (long long)k);
    int64_t tcap = min64(T, T_CHUNK);
    float *qx = ds_malloc((size_t)(tcap * k) * sizeof(float));
    float *sx = ds_malloc((size_t)(tcap * nb) * sizeof(float));
    uint8_t *codes = ds_malloc((size_t)(tcap * k));
    const float *l8 = cpu_e4m3_lut();
    int64_t npanel = (n + CPU_LANES - 1) / CPU_LANES;
    for (int64_t t0 = 0; t0 < T; t0 += T_CHUNK) {
        int64_t tc = min64(T - t0, T_CHUNK);
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < tc; t++) {
            act_quant_fp8_32(x + (t0 + t) * k, (size_t)k, codes + t * k, sx + t * nb);
            for (int64_t i = 0; i < k; i++) qx[t * k + i] = l8[codes[t * k + i]];
        }
#pragma omp parallel
        {
            float *panel = ds_malloc((size_t)(k * CPU_LANES) * sizeof(float));
            float *sp = ds_malloc((size_t)(nb * CPU_LANES) * sizeof(float));
#pragma omp for schedule(dynamic, 4)
            for (int64_t p = 0; p < npanel; p++) {
                int64_t j0 = p * CPU_LANES, nr = min64(CPU_LANES, n - j0);
                panel_quant(W, j0, nr, panel, sp);
                for (int64_t t = 0; t < tc; t++) {
                    float out[CPU_LANES];
                    dot_quant(qx + t * k, sx + t * nb, panel, sp, nb, out);
                    for (int64_t l = 0; l < nr; l++) y[(t0 + t) * n + j0 + l] = bf16_from_f32(out[l]);
                }
            }
            free(sp);
            free(panel);
        }
    }
    free(codes);
    free(sx);
    free(qx);
}

/* Plain fp32 linear over rows [row0, row0 + nout) of a BF16/F32 weight. x rows have stride ldx,
 * outputs go to yb (bf16) or yf (fp32) with row stride ldy; used with strides by grouped_linear. */
static void linear_dense(const bf16_t *x, int64_t ldx, int64_t T, const struct qweight *W, int64_t row0,
                         int64_t nout, bf16_t *yb, float *yf, int64_t ldy) {
    int64_t k = W->k;
    int64_t tcap = min64(T, T_CHUNK);
    float *xf = ds_malloc((size_t)(tcap * k) * sizeof(float));
    int64_t npanel = (nout + CPU_LANES - 1) / CPU_LANES;
    for (int64_t t0 = 0; t0 < T; t0 += T_CHUNK) {
        int64_t tc = min64(T - t0, T_CHUNK);
        for (int64_t t = 0; t < tc; t++)
            for (int64_t i = 0; i < k; i++) xf[t * k + i] = bf16_to_f32(x[(t0 + t) * ldx + i]);
#pragma omp parallel
        {
            float *panel = ds_malloc((size_t)(k * CPU_LANES) * sizeof(float));
#pragma omp for schedule(dynamic, 4)
            for (int64_t p = 0; p < npanel; p++) {
                int64_t j0 = p * CPU_LANES, nr = min64(CPU_LANES, nout - j0);
                panel_dense(W, row0 + j0, nr, panel);
                for (int64_t t = 0; t < tc; t++) {
                    float out[CPU_LANES];
                    dot_dense(xf + t * k, panel, k, out);
                    for (int64_t l = 0; l < nr; l++) {
                        if (yb)
                            yb[(t0 + t) * ldy + j0 + l] = bf16_from_f32(out[l]);
                        else
                            yf[(t0 + t) * ldy + j0 + l] = out[l];
                    }
                }
            }
            free(panel);
        }
    }
    free(xf);
}

/* ---------------------------------------------------------------------------------------------
 * Ops */

void cpu_op_linear(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, const struct qweight *W) {
    if (T <= 0 || W->n <= 0) return;
    switch (W->fmt) {
    case WF_FP8:
    case WF_FP4: linear_quant(y, x, T, W); break;
    case WF_BF16: linear_dense(x, W->k, T, W, 0, W->n, y, NULL, W->n); break;
    default: ds_die("cpu linear: weight format %d is not allowed (F32 goes through linear_f32)", (int)W->fmt);
    }
}

void cpu_op_linear_f32(struct backend *be, float *y, const bf16_t *x, int64_t T, const struct qweight *W) {
    if (T <= 0 || W->n <= 0) return;
    if (W->fmt != WF_BF16 && W->fmt != WF_F32)
        ds_die("cpu linear_f32: weight format %d is not BF16 or F32", (int)W->fmt);
    linear_dense(x, W->k, T, W, 0, W->n, NULL, y, W->n);
}

void cpu_op_grouped_linear(struct backend *be, bf16_t *y, const bf16_t *x, int64_t T, int64_t G,
                           const struct qweight *W) {
    if (T <= 0 || G <= 0) return;
    if (W->fmt != WF_BF16 && W->fmt != WF_F32)
        ds_die("cpu grouped_linear: weight format %d; prepare it with dequant_bf16", (int)W->fmt);
    if (W->n % G != 0) ds_die("cpu grouped_linear: n = %lld is not divisible by G = %lld", (long long)W->n,
                              (long long)G);
    int64_t r = W->n / G, kg = W->k;
    for (int64_t g = 0; g < G; g++) linear_dense(x + g * kg, G * kg, T, W, g * r, r, y + g * r, NULL, G * r);
}

void cpu_op_head(struct backend *be, float *logits, const bf16_t *x, int64_t T, const struct qweight *W) {
    cpu_op_linear_f32(be, logits, x, T, W);
}

/* The rows in index order: a later entry wins only when larger, so ties keep the lowest index. */
void cpu_op_argmax(struct backend *be, int32_t *out, const float *x, int64_t R, int64_t V) {
    (void)be;
    if (V > INT32_MAX) ds_die("cpu argmax: V = %lld does not fit an int32 index", (long long)V);
#pragma omp parallel for schedule(static) if (R > 1)
    for (int64_t r = 0; r < R; r++) {
        const float *row = x + r * V;
        float best = NAN;
        int32_t at = -1;
        for (int64_t i = 0; i < V; i++)
            if (row[i] == row[i] && (at < 0 || row[i] > best)) best = row[i], at = (int32_t)i;
        memcpy(&out[2 * r], &best, sizeof best);
        out[2 * r + 1] = at;
    }
}

/* lse_core.h's slices, each row's in turn (the op's contract is that order, not a thread count). */
void cpu_op_row_lse(struct backend *be, struct be_lse_part *out, const float *x, int64_t R, int64_t V, int64_t ns,
                    const int32_t *target, const float *temp) {
    (void)be;
    if (ns < 1 || V % ns) ds_die("cpu row_lse: %lld slices do not divide %lld columns", (long long)ns, (long long)V);
    const int64_t n = V / ns;
#pragma omp parallel for schedule(static) if (R * ns > 1)
    for (int64_t q = 0; q < R * ns; q++) {
        const int64_t r = q / ns, j = q % ns, c = target ? target[r] : -1;
        out[q] = lse_slice_host(x + r * V + j * n, n, c >= j * n && c < (j + 1) * n ? c - j * n : -1,
                                temp && temp[r] > 0 ? temp[r] : 0.0f);
    }
}

void cpu_op_row_topk(struct backend *be, struct be_topk_entry *out, const float *x, int64_t R, int64_t V, int64_t k) {
    (void)be;
    if (k < 1 || k > BE_TOPK_MAX || V < 1 || V > INT32_MAX)
        ds_die("cpu row_topk: k = %lld must be in 1..%d and V = %lld fit an int32", (long long)k, BE_TOPK_MAX, (long long)V);
#pragma omp parallel for schedule(dynamic, 1) if (R > 1)
    for (int64_t r = 0; r < R; r++) {
        int ids[BE_TOPK_MAX];
        draw_top_k_list(x + r * V, (int)V, (int)k, ids, out + r * k);
    }
}
