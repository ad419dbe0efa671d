/* The indexer's selection as one piece of code for both backends: libstdc++'s introselect and
 * heap select over (value, index) pairs, exactly as ATen's CPU top-k runs them, and the per-row
 * work of the index_topk and cand_mask ops (kernels/backend.h) built on them.
 *
 * Why the step order matters: the index scores are bf16 and relu makes exact zeros, so ties at the
 * k-th place are real, and the reference's tie-breaking is that of ATen's CPU top-k: a queue of
 * (value, index) in index order run through std::nth_element (or std::partial_sort when k·64 <= n)
 * of libstdc++ with the comparator "x > y (NaN largest)". Reproducing those algorithms step by
 * step selects the same set on every tie, which the golden fixtures confirm. Written from the
 * algorithms' definitions.
 *
 * Everything is a static inline function of plain C that nvcc also compiles for the device
 * (TOPK_HD): the CPU backend (kernels/cpu/cpu_index.c) and the CUDA kernels
 * (kernels/cuda/cuda_index.cu: one row per CUDA block, the sequential selection on one thread) run
 * the same lines, so the golden fixtures that check the CPU backend's top-k sets check the GPU's
 * algorithm too. The selection is comparisons and moves only: no arithmetic that a compiler or a
 * device could round differently. */
#ifndef DS_TOPK_CORE_H
#define DS_TOPK_CORE_H

#include <stdint.h>

#include "backend.h"

#ifdef __CUDACC__
#define TOPK_HD __host__ __device__
#else
#define TOPK_HD
#endif

/* -inf without a library call on either side */
TOPK_HD static inline float topk_neg_inf(void) {
#ifdef __CUDA_ARCH__
    return __int_as_float((int)0xff800000u);
#else
    return -__builtin_inff();
#endif
}

/* 8 bytes, so a row of up to 6,144 fits a CUDA block's 48 KB of shared memory */
struct topk_elem {
    float v;
    int32_t i;
};

/* ATen's comparator for largest=True: NaN sorts first, then larger values. */
TOPK_HD static inline int topk_comp(const struct topk_elem *x, const struct topk_elem *y) {
    int xn = x->v != x->v, yn = y->v != y->v;
    return (xn && !yn) || (x->v > y->v);
}

TOPK_HD static inline void topk_swap(struct topk_elem *a, struct topk_elem *b) {
    struct topk_elem t = *a;
    *a = *b;
    *b = t;
}

TOPK_HD static inline void topk_push_heap(struct topk_elem *first, int64_t hole, int64_t top, struct topk_elem value) {
    int64_t parent = (hole - 1) / 2;
    while (hole > top && topk_comp(&first[parent], &value)) {
        first[hole] = first[parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    first[hole] = value;
}

TOPK_HD static inline void topk_adjust_heap(struct topk_elem *first, int64_t hole, int64_t len, struct topk_elem value) {
    int64_t top = hole, child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (topk_comp(&first[child], &first[child - 1])) child--;
        first[hole] = first[child];
        hole = child;
    }
    if ((len & 1) == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        first[hole] = first[child - 1];
        hole = child - 1;
    }
    topk_push_heap(first, hole, top, value);
}

TOPK_HD static inline void topk_make_heap(struct topk_elem *first, int64_t len) {
    if (len < 2) return;
    for (int64_t parent = (len - 2) / 2;; parent--) {
        topk_adjust_heap(first, parent, len, first[parent]);
        if (parent == 0) return;
    }
}

TOPK_HD static inline void topk_heap_select(struct topk_elem *first, int64_t middle, int64_t last) {
    topk_make_heap(first, middle);
    for (int64_t i = middle; i < last; i++)
        if (topk_comp(&first[i], &first[0])) { /* pop_heap(first, middle, i) */
            struct topk_elem value = first[i];
            first[i] = first[0];
            topk_adjust_heap(first, 0, middle, value);
        }
}

TOPK_HD static inline void topk_median_to_first(struct topk_elem *result, struct topk_elem *a, struct topk_elem *b,
                                                struct topk_elem *c) {
    if (topk_comp(a, b)) {
        if (topk_comp(b, c))
            topk_swap(result, b);
        else if (topk_comp(a, c))
            topk_swap(result, c);
        else
            topk_swap(result, a);
    } else if (topk_comp(a, c))
        topk_swap(result, a);
    else if (topk_comp(b, c))
        topk_swap(result, c);
    else
        topk_swap(result, b);
}

TOPK_HD static inline struct topk_elem *topk_unguarded_partition(struct topk_elem *first, struct topk_elem *last,
                                                                 struct topk_elem *pivot) {
    for (;;) {
        while (topk_comp(first, pivot)) first++;
        last--;
        while (topk_comp(pivot, last)) last--;
        if (!(first < last)) return first;
        topk_swap(first, last);
        first++;
    }
}

TOPK_HD static inline void topk_insertion_sort(struct topk_elem *first, struct topk_elem *last) {
    if (first == last) return;
    for (struct topk_elem *i = first + 1; i != last; i++) {
        if (topk_comp(i, first)) {
            struct topk_elem val = *i;
            for (struct topk_elem *p = i; p != first; p--) *p = *(p - 1);
            *first = val;
        } else {
            struct topk_elem val = *i, *l = i, *next = i - 1;
            while (topk_comp(&val, next)) {
                *l = *next;
                l = next;
                next--;
            }
            *l = val;
        }
    }
}

TOPK_HD static inline int topk_lg(int64_t n) {
    int r = 0;
    while (n > 1) {
        n >>= 1;
        r++;
    }
    return r;
}

TOPK_HD static inline void topk_nth_element(struct topk_elem *first, struct topk_elem *nth, struct topk_elem *last) {
    if (first == last || nth == last) return;
    int64_t depth = (int64_t)topk_lg(last - first) * 2;
    while (last - first > 3) {
        if (depth == 0) {
            topk_heap_select(first, nth + 1 - first, last - first);
            topk_swap(first, nth);
            return;
        }
        depth--;
        struct topk_elem *mid = first + (last - first) / 2;
        topk_median_to_first(first, first + 1, mid, last - 1);
        struct topk_elem *cut = topk_unguarded_partition(first + 1, last, first);
        if (cut <= nth)
            first = cut;
        else
            last = cut;
    }
    topk_insertion_sort(first, last);
}

/* ATen's choice for topk(sorted=False) on CPU: q[0..k) holds the k selected afterwards, in the
 * order the algorithm leaves them. 0 < k <= n. */
TOPK_HD static inline void topk_select(struct topk_elem *q, int64_t n, int64_t k) {
    if (k * 64 <= n)
        topk_heap_select(q, k, n); /* partial_sort: the heap holds the k selected, order irrelevant here */
    else
        topk_nth_element(q, q + k - 1, q + n);
}

/* Ascending heapsort of distinct int32 values (the selected positions): O(k log k) on one thread,
 * and for distinct keys the same result as any other sort. */
TOPK_HD static inline void topk_sift_i32(int32_t *a, int64_t root, int64_t n) {
    for (;;) {
        int64_t c = 2 * root + 1;
        if (c >= n) return;
        if (c + 1 < n && a[c + 1] > a[c]) c++;
        if (a[root] >= a[c]) return;
        int32_t t = a[root];
        a[root] = a[c];
        a[c] = t;
        root = c;
    }
}

TOPK_HD static inline void topk_sort_i32(int32_t *a, int64_t n) {
    for (int64_t i = n / 2 - 1; i >= 0; i--) topk_sift_i32(a, i, n);
    for (int64_t e = n - 1; e > 0; e--) {
        int32_t t = a[0];
        a[0] = a[e];
        a[e] = t;
        topk_sift_i32(a, 0, e);
    }
}

/* Entry j of a score row as index_topk reads it (backend.h). */
TOPK_HD static inline float topk_entry(const float *S, int64_t j, int64_t n_valid, const uint8_t *mask, int64_t ld_m) {
    if (j >= n_valid) return topk_neg_inf();
    if (mask && (j >= ld_m || !mask[j])) return topk_neg_inf();
    return S[j];
}

/* The sequential part of one index_topk row, after q[0..n) has been filled with (entry j, j):
 * select, sort the positions, hide the invisible. Writes top[0..k) (k <= n clamped). */
TOPK_HD static inline void topk_row_finish(int32_t *top, const int32_t *p, struct topk_elem *q) {
    int64_t n = p[TOPK_P_N], k = p[TOPK_P_K], vis = p[TOPK_P_VISIBLE];
    if (k > n) k = n;
    if (k <= 0) return;
    if (k == n) {
        /* every entry is selected: the set, hence the sorted list, cannot depend on the order */
        for (int64_t j = 0; j < k; j++) top[j] = (int32_t)j;
    } else {
        topk_select(q, n, k);
        for (int64_t j = 0; j < k; j++) top[j] = q[j].i;
        topk_sort_i32(top, k);
    }
    for (int64_t j = 0; j < k; j++)
        if (top[j] >= vis) top[j] = -1;
}

/* The sequential part of one cand_mask row, after q[0..nb) holds (block maximum, block) with the
 * last visible block forced to +inf: marks keep[0..nb) (zeroed by the caller). */
TOPK_HD static inline void topk_cand_finish(uint8_t *keep, int64_t nb, int64_t topk_blocks, struct topk_elem *q) {
    int64_t want = topk_blocks < nb ? topk_blocks : nb;
    if (want <= 0) return;
    if (want == nb) {
        /* every block is selected (a context under topk_blocks · bs): no order to reproduce */
        for (int64_t r = 0; r < nb; r++)
            if (q[r].v > topk_neg_inf()) keep[r] = 1;
        return;
    }
    topk_select(q, nb, want);
    for (int64_t r = 0; r < want; r++)
        if (q[r].v > topk_neg_inf()) keep[q[r].i] = 1;
}

/* Block b's maximum over entries [b·bs, min((b+1)·bs, n)) read without a mask; NaN never wins. */
TOPK_HD static inline float topk_block_max(const float *S, int64_t b, int64_t bs, int64_t n, int64_t n_valid) {
    float mx = topk_neg_inf();
    for (int64_t j = b * bs; j < (b + 1) * bs && j < n; j++) {
        float v = topk_entry(S, j, n_valid, (const uint8_t *)0, 0);
        if (v > mx) mx = v;
    }
    return mx;
}

#endif /* DS_TOPK_CORE_H */
