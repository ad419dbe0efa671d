/* The log-sum-exp of a logits row, in one order for every backend and rank count: what a
 * log-probability is (sampler_logprob) and what the row_lse op computes where the logits are.
 *
 * Why an order of our own: a log-probability over V = 129,280 logits is a sum of V exponentials,
 * and a sum's bits depend on its order. The host's sequential sum cannot run on a GPU, and a vocab
 * split over TP ranks cannot run it either, so the order is defined here in pieces that both can
 * run: the row cuts into lse_slices(V) slices of consecutive ids (8 where V allows, the TP8 head's
 * column blocks, so TP 1, 2, 4 and 8 hold whole slices); a slice has its maximum m (NaN skipped,
 * -0 read as +0) and its sum s = Σ expf(x - m) in double, each entry in lane (i / 4) mod 256 (the
 * i-th of the slice; groups of 4 so a GPU thread reads 16 bytes), a lane's entries in id order, the
 * 256 lanes folded as a tree (lane l += lane l + h for h = 128, 64, ..., 1). The host merges the
 * slices in id order (sampler_lse_merge). The exponential is glibc's expf on the host and its
 * bit-for-bit copy on the device (kernels/cuda/cuda_libm.cuh), the difference x - m rounded to
 * float first: ~2^-24 relative per term against a double exp (tolerance in src/tolerances.h).
 * An entry of -inf adds 0 whatever m is; NaN or +inf anywhere makes the slice's sum NaN, and that
 * NaN is always LSE_NAN_BITS: which NaN an exp or a subtraction yields differs between the x86 host
 * (the sign of inf - inf, the payload of the operand) and the GPU (one canonical NaN), so the
 * result is pinned to one, to keep the sums' bits equal everywhere.
 *
 * The same slices, lanes and tree with a temperature T > 0 give the weight sums of the full-row
 * temperature draws (sampler.c: the draw's total Z, so that a backend can give it without the row):
 * each term is then expf((x - m) / T) (float difference, float quotient), and a NaN entry adds 0
 * like -inf (NaN is never drawn); +inf still makes the sum NaN (LSE_NAN_BITS).
 *
 * Plain C for the host; the CUDA kernel (cuda_linear_ops.cu) runs the same lanes, tree and terms. */
#ifndef DS_LSE_CORE_H
#define DS_LSE_CORE_H

#include <stdint.h>

#define LSE_LANES 256
#define LSE_GROUP 4      /* consecutive entries a lane takes at a time */
#define LSE_SLICES_MAX 8 /* the TP8 head's column blocks */
#define LSE_NAN_BITS 0x7ff8000000000000ull /* a NaN sum's bits, on every backend */

/* Slices of a row of V ids: the largest of 8, 4, 2, 1 that divides V. */
static inline int64_t lse_slices(int64_t V) {
    int64_t n = LSE_SLICES_MAX;
    while (n > 1 && V % n) n /= 2;
    return n;
}

/* The lane of the i-th entry of a slice. */
static inline int lse_lane(int64_t i) { return (int)((i / LSE_GROUP) % LSE_LANES); }

#ifndef __CUDACC__
#include <math.h>
#include <string.h>

#include "backend.h"

/* A term of a temperature sum (T > 0): 0 for -inf and NaN; the one expression sampler.c's draw
 * weights use too. */
static inline double lse_wterm_host(float x, float m, float T) { return x > -INFINITY ? (double)expf((x - m) / T) : 0.0; }

/* One slice of n entries (host): its part, t = the entry at index ti of the slice (ti < 0: 0);
 * T == 0: the log-probability's terms expf(x - m), else the temperature sum's (lse_wterm_host). */
static inline struct be_lse_part lse_slice_host(const float *x, int64_t n, int64_t ti, float T) {
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++)
        if (x[i] > m) m = x[i];
    m += 0.0f; /* -0 -> +0: the maximum's bits do not depend on which zero a scan met first */
    double acc[LSE_LANES] = {0};
    if (T > 0)
        for (int64_t i = 0; i < n; i++) acc[lse_lane(i)] += lse_wterm_host(x[i], m, T);
    else
        for (int64_t i = 0; i < n; i++) acc[lse_lane(i)] += x[i] == -INFINITY ? 0.0 : (double)expf(x[i] - m);
    for (int h = LSE_LANES / 2; h > 0; h /= 2)
        for (int l = 0; l < h; l++) acc[l] += acc[l + h];
    if (acc[0] != acc[0]) {
        const uint64_t nan_bits = LSE_NAN_BITS;
        memcpy(&acc[0], &nan_bits, sizeof acc[0]);
    }
    return (struct be_lse_part){.s = acc[0], .m = m, .t = ti >= 0 ? x[ti] : 0.0f};
}
#endif

#endif /* DS_LSE_CORE_H */
