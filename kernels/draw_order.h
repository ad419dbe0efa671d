/* The draw order of sampler.c as one piece of code for the host sampler, the CPU backend's row_topk
 * op and the CUDA kernel: a larger logit first, equal logits by the lower id, NaN never. A top-k
 * draw (sampler_pick with 0 < top_k < V) depends only on the row's k first entries in this order,
 * so a backend can select them where the logits are, each vocab slice its own k (slices hold
 * disjoint id ranges, so their lists merge into the row's), and the host draws from k entries
 * instead of downloading the row.
 *
 * desc_key maps a float to a key whose unsigned order is the descending order of the floats (NaN
 * last, -0 just after +0); with the id below it, a 64-bit key orders entries exactly as the draw
 * does. Comparisons and moves only: no arithmetic a device could round differently. */
#ifndef DS_DRAW_ORDER_H
#define DS_DRAW_ORDER_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define DRAW_FN static __host__ __device__ __forceinline__
#else
#define DRAW_FN static inline
#endif

/* Keys whose unsigned order is the floats' descending order (NaN last, -0 just after +0). */
DRAW_FN uint32_t desc_key(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0xffffffffu;
    return (u & 0x80000000u) ? u : ~u & 0x7fffffffu;
}

/* The key of the draw order: ±0 are one value there (ties by id), so -0 keys as +0. */
DRAW_FN uint32_t draw_key(float f) { return desc_key(f == 0.0f ? 0.0f : f); }

#ifndef __CUDACC__
#include <math.h>

#include "backend.h"

/* The order of the draw: a before b when its logit is larger, ties by the lower id. */
static inline int draw_before(const float *x, int a, int b) { return x[a] > x[b] || (x[a] == x[b] && a < b); }

/* Put `item` at the root of heap[0..n) (the last of the order at the root) and sift it down. */
static inline void draw_sift_down(const float *x, int *heap, int n, int item) {
    int h = 0;
    for (;;) {
        int c = 2 * h + 1;
        if (c >= n) break;
        if (c + 1 < n && draw_before(x, heap[c], heap[c + 1])) c++;
        if (!draw_before(x, item, heap[c])) break;
        heap[h] = heap[c], h = c;
    }
    heap[h] = item;
}

/* The first k entries of the order into out[k], sorted (a bounded heap whose root is the last of
 * the k kept); NaN entries are left out, so fewer than k come back when there are not k numbers.
 * Returns how many. */
static inline int draw_top_k_ids(const float *x, int V, int k, int *out) {
    int n = 0;
    for (int i = 0; i < V; i++) {
        if (x[i] != x[i]) continue;
        if (n < k) { /* sift up from the end */
            int h = n++;
            while (h > 0 && draw_before(x, out[(h - 1) / 2], i)) out[h] = out[(h - 1) / 2], h = (h - 1) / 2;
            out[h] = i;
        } else if (draw_before(x, i, out[0])) { /* it beats the last kept: replaces the root */
            draw_sift_down(x, out, n, i);
        }
    }
    for (int end = n - 1; end > 0; end--) { /* heap sort: the root (last in order) to the end */
        int last = out[end];
        out[end] = out[0];
        draw_sift_down(x, out, end, last);
    }
    return n;
}

/* The same k first entries as a row_topk list (the op's contract, backend.h): out[k] the logits and
 * ids in order, (NaN, -1) past the row's numbers; ids is scratch of k. Returns how many are numbers. */
static inline int draw_top_k_list(const float *x, int V, int k, int *ids, struct be_topk_entry *out) {
    const int n = draw_top_k_ids(x, V, k, ids);
    for (int j = 0; j < k; j++) out[j] = j < n ? (struct be_topk_entry){x[ids[j]], ids[j]} : (struct be_topk_entry){NAN, -1};
    return n;
}
#endif

#endif /* DS_DRAW_ORDER_H */
