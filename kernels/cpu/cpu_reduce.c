/* The fp32 row sum of the reference, in its exact order.
 *
 * The reference computes every mean and sum over a contiguous fp32 row (RMSNorm's mean of squares,
 * the mHC and Engram statistics, the Engram gate's dot product) with torch's CPU sum kernel:
 * the row is read as vectors of CPU_SUM_LANES floats, the vectors are accumulated by a 4-way ILP
 * cascade (four running vector sums, each a 4-level cascade whose level width grows with the row),
 * the four are added, the scalar tail is summed from 0, and the vector lanes are added to it in
 * lane order. A plain left-to-right sum differs from that in the last fp32 bit of most rows, which
 * becomes a one-ulp bf16 difference after RMSNorm often enough to flip an FP4/FP8 QDQ step or an
 * expert choice downstream. The golden fixtures were made by torch on an AVX-512 CPU, so the
 * vectors are 16 floats wide; the algorithm itself was checked bit-exact against torch's sum. */
#include <string.h>

#include "cpu_internal.h"

#define CPU_SUM_ILP 4
#define CPU_SUM_LEVELS 4

#define CPU_SUM_MAX_LANES 16

/* One vector register of `lanes` floats (lanes <= CPU_SUM_MAX_LANES). */
typedef struct {
    float v[CPU_SUM_MAX_LANES];
} vecf;

static inline void vadd(vecf *a, const vecf *b, int lanes) {
    for (int l = 0; l < lanes; l++) a->v[l] = a->v[l] + b->v[l];
}

static inline void vload(vecf *a, const float *x, int lanes) {
    memset(a, 0, sizeof *a);
    memcpy(a->v, x, sizeof(float) * (size_t)lanes);
}

static int ceil_log2(int64_t x) {
    int r = 0;
    while (((int64_t)1 << r) < x) r++;
    return r;
}

/* Four running sums over `size` groups of CPU_SUM_ILP consecutive vectors, cascaded over levels
 * so that long rows add partial sums of similar magnitude. */
static void multi_row_sum(const float *x, int64_t size, int lanes, vecf out[CPU_SUM_ILP]) {
    int64_t level_power = ceil_log2(size) / CPU_SUM_LEVELS;
    if (level_power < 4) level_power = 4;
    const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    vecf acc[CPU_SUM_LEVELS][CPU_SUM_ILP], v;
    memset(acc, 0, sizeof acc);
    int64_t i = 0;
    while (i + level_step <= size) {
        for (int64_t j = 0; j < level_step; j++, i++)
            for (int k = 0; k < CPU_SUM_ILP; k++) {
                vload(&v, x + (i * CPU_SUM_ILP + k) * lanes, lanes);
                vadd(&acc[0][k], &v, lanes);
            }
        for (int j = 1; j < CPU_SUM_LEVELS; j++) {
            for (int k = 0; k < CPU_SUM_ILP; k++) {
                vadd(&acc[j][k], &acc[j - 1][k], lanes);
                memset(&acc[j - 1][k], 0, sizeof(vecf));
            }
            if (i & (level_mask << (j * level_power))) break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < CPU_SUM_ILP; k++) {
            vload(&v, x + (i * CPU_SUM_ILP + k) * lanes, lanes);
            vadd(&acc[0][k], &v, lanes);
        }
    for (int j = 1; j < CPU_SUM_LEVELS; j++)
        for (int k = 0; k < CPU_SUM_ILP; k++) vadd(&acc[0][k], &acc[j][k], lanes);
    memcpy(out, acc[0], sizeof(vecf) * CPU_SUM_ILP);
}

float cpu_sum_torch_lanes(const float *x, int64_t n, int lanes) {
    int64_t nvec = n / lanes, size_ilp = nvec / CPU_SUM_ILP;
    vecf ps[CPU_SUM_ILP], v;
    if (size_ilp > 0)
        multi_row_sum(x, size_ilp, lanes, ps);
    else
        memset(ps, 0, sizeof ps);
    for (int64_t i = size_ilp * CPU_SUM_ILP; i < nvec; i++) {
        vload(&v, x + i * lanes, lanes);
        vadd(&ps[0], &v, lanes);
    }
    for (int k = 1; k < CPU_SUM_ILP; k++) vadd(&ps[0], &ps[k], lanes);
    float fin = 0.0f;
    for (int64_t k = nvec * lanes; k < n; k++) fin += x[k];
    for (int l = 0; l < lanes; l++) fin += ps[0].v[l];
    return fin;
}

float cpu_sum_torch(const float *x, int64_t n) { return cpu_sum_torch_lanes(x, n, CPU_SUM_LANES); }
