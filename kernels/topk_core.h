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
 * (TOPK_FN). The ops run the block-parallel form (topk_par_*, below the sequential originals): the
 * CUDA kernels (kernels/cuda/cuda_index.cu) with one block of 128 threads per row, the CPU backend
 * (kernels/cpu/cpu_index.c) as a block of one thread, so the golden fixtures that check the CPU
 * backend's top-k sets check the formulation the GPU runs, and tests/unit/test_topk_core.c checks
 * it on several threads against the sequential original. The selection is comparisons and moves
 * only: no arithmetic that a compiler or a device could round differently. */
#ifndef DS_TOPK_CORE_H
#define DS_TOPK_CORE_H

#include <stdint.h>

#include "backend.h"

/* every function here: a static inline of plain C, on the device too (always inlined there, so no
 * call frame spills registers) */
#ifdef __CUDACC__
#define TOPK_FN static __host__ __device__ __forceinline__
#else
#define TOPK_FN static inline
#endif

/* -inf without a library call on either side */
TOPK_FN float topk_neg_inf(void) {
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
TOPK_FN int topk_comp(const struct topk_elem *x, const struct topk_elem *y) {
    int xn = x->v != x->v, yn = y->v != y->v;
    return (xn && !yn) || (x->v > y->v);
}

TOPK_FN void topk_swap(struct topk_elem *a, struct topk_elem *b) {
    struct topk_elem t = *a;
    *a = *b;
    *b = t;
}

TOPK_FN void topk_push_heap(struct topk_elem *first, int64_t hole, int64_t top, struct topk_elem value) {
    int64_t parent = (hole - 1) / 2;
    while (hole > top && topk_comp(&first[parent], &value)) {
        first[hole] = first[parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    first[hole] = value;
}

TOPK_FN void topk_adjust_heap(struct topk_elem *first, int64_t hole, int64_t len, struct topk_elem value) {
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

TOPK_FN void topk_make_heap(struct topk_elem *first, int64_t len) {
    if (len < 2) return;
    for (int64_t parent = (len - 2) / 2;; parent--) {
        topk_adjust_heap(first, parent, len, first[parent]);
        if (parent == 0) return;
    }
}

TOPK_FN void topk_heap_select(struct topk_elem *first, int64_t middle, int64_t last) {
    topk_make_heap(first, middle);
    for (int64_t i = middle; i < last; i++)
        if (topk_comp(&first[i], &first[0])) { /* pop_heap(first, middle, i) */
            struct topk_elem value = first[i];
            first[i] = first[0];
            topk_adjust_heap(first, 0, middle, value);
        }
}

TOPK_FN void topk_median_to_first(struct topk_elem *result, struct topk_elem *a, struct topk_elem *b,
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

TOPK_FN struct topk_elem *topk_unguarded_partition(struct topk_elem *first, struct topk_elem *last,
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

TOPK_FN void topk_insertion_sort(struct topk_elem *first, struct topk_elem *last) {
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

TOPK_FN int topk_lg(int64_t n) {
    int r = 0;
    while (n > 1) {
        n >>= 1;
        r++;
    }
    return r;
}

TOPK_FN void topk_nth_element(struct topk_elem *first, struct topk_elem *nth, struct topk_elem *last) {
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
TOPK_FN void topk_select(struct topk_elem *q, int64_t n, int64_t k) {
    if (k * 64 <= n)
        topk_heap_select(q, k, n); /* partial_sort: the heap holds the k selected, order irrelevant here */
    else
        topk_nth_element(q, q + k - 1, q + n);
}

/* ---- the same selection, block-parallel ----
 * topk_par_select leaves q exactly as topk_select does (every element at the same place), with the
 * work of each Hoare partition spread over nt threads: the sequential scan pairs the i-th element
 * from the left that is not better than the pivot ("left stopper" L_i) with the i-th from the right
 * that is not worse (R_i) and swaps them while L_i < R_i; elements between them are never moved
 * before they are scanned, so the pairs are those of the original order, L_i rising and R_i falling.
 * So the threads list the stoppers (a count per contiguous chunk, a scan, the positions in order),
 * find m = the number of pairs with L_i < R_i by bisection, swap the m pairs (distinct places) at
 * once, and the scan would have stopped at min(L_{m+1}, R_m) (R_0 = the range's end): the cut.
 * Pivot choice, the depth limit's heap select and the final insertion sort of <= 3 elements stay
 * on thread 0, as does topk_heap_select for k·64 <= n (contexts of tens of thousands of rows).
 * Every thread calls every function with the same arguments; TOPK_SYNC is the block's barrier
 * (nothing on the host, where tid = 0, nt = 1 runs the same phases in order). Work space: wl, wr
 * int32 [n + 1] and cnt int32 [2·nt + 2], and one struct topk_blk, all visible to every thread. */
#ifndef TOPK_SYNC /* a test may bring its own barrier (tests/unit/test_topk_core.c: threads) */
#ifdef __CUDA_ARCH__
#define TOPK_SYNC() __syncthreads()
#else
#define TOPK_SYNC() ((void)0)
#endif
#endif

struct topk_blk {
    int64_t first, last, depth, cut, m, nl, nr, o;
    int done;
    struct topk_elem pivot;
};

/* Thread tid's contiguous chunk [*lo, *hi) of [a, b). */
TOPK_FN void topk_chunk(int64_t a, int64_t b, int tid, int nt, int64_t *lo, int64_t *hi) {
    int64_t ch = (b - a + nt - 1) / nt;
    *lo = a + (int64_t)tid * ch;
    *hi = *lo + ch < b ? *lo + ch : b;
    if (*lo > b) *lo = b;
}

/* Exclusive scan of cnt[0..2·nt) by pairs (left, right counts) on thread 0; totals to s. */
TOPK_FN void topk_scan_pairs(int32_t *cnt, int nt, struct topk_blk *s, int tid) {
    if (tid == 0) {
        int64_t l = 0, r = 0;
        for (int t = 0; t < nt; t++) {
            int32_t cl = cnt[2 * t], cr = cnt[2 * t + 1];
            cnt[2 * t] = (int32_t)l;
            cnt[2 * t + 1] = (int32_t)r;
            l += cl;
            r += cr;
        }
        s->nl = l;
        s->nr = r;
    }
    TOPK_SYNC();
}

/* unguarded_partition(q + a, q + b, pivot): the cut into s->cut. */
TOPK_FN void topk_par_partition(struct topk_elem *q, int64_t a, int64_t b, int32_t *wl, int32_t *wr,
                                              int32_t *cnt, struct topk_blk *s, int tid, int nt) {
    const struct topk_elem P = s->pivot;
    int64_t lo, hi;
    topk_chunk(a, b, tid, nt, &lo, &hi);
    int32_t cl = 0, cr = 0;
    for (int64_t i = lo; i < hi; i++) {
        cl += !topk_comp(&q[i], &P);
        cr += !topk_comp(&P, &q[i]);
    }
    cnt[2 * tid] = cl;
    cnt[2 * tid + 1] = cr;
    TOPK_SYNC();
    topk_scan_pairs(cnt, nt, s, tid);
    int32_t ol = cnt[2 * tid], orr = cnt[2 * tid + 1];
    for (int64_t i = lo; i < hi; i++) {
        if (!topk_comp(&q[i], &P)) wl[ol++] = (int32_t)i;
        if (!topk_comp(&P, &q[i])) wr[orr++] = (int32_t)i;
    }
    TOPK_SYNC();
    int64_t nl = s->nl, nr = s->nr;
    if (tid == 0) {
        /* L_j = wl[j-1] rises, R_j = wr[nr-j] falls: L_j < R_j holds for j = 1..m */
        int64_t m0 = 0, m1 = nl < nr ? nl : nr;
        while (m0 < m1) {
            int64_t mid = (m0 + m1 + 1) / 2;
            if (wl[mid - 1] < wr[nr - mid])
                m0 = mid;
            else
                m1 = mid - 1;
        }
        int64_t rm = m0 ? wr[nr - m0] : b;
        s->m = m0;
        s->cut = m0 < nl && wl[m0] < rm ? wl[m0] : rm;
    }
    TOPK_SYNC();
    for (int64_t j = tid; j < s->m; j += nt) topk_swap(&q[wl[j]], &q[wr[nr - 1 - j]]);
    TOPK_SYNC();
}

/* topk_select(q, n, k), block-parallel: the same q afterwards. 0 < k <= n. */
TOPK_FN void topk_par_select(struct topk_elem *q, int64_t n, int64_t k, int32_t *wl, int32_t *wr,
                                           int32_t *cnt, struct topk_blk *s, int tid, int nt) {
    if (k * 64 <= n) {
        if (tid == 0) topk_heap_select(q, k, n);
        TOPK_SYNC();
        return;
    }
    int64_t nth = k - 1;
    if (tid == 0) {
        s->first = 0;
        s->last = n;
        s->depth = (int64_t)topk_lg(n) * 2;
        s->done = 0;
    }
    TOPK_SYNC();
    for (;;) {
        int64_t first = s->first, last = s->last;
        if (last - first <= 3) break;
        TOPK_SYNC(); /* every thread has read s before thread 0 writes it */
        if (tid == 0) {
            if (s->depth == 0) {
                topk_heap_select(q + first, nth + 1 - first, last - first);
                topk_swap(q + first, q + nth);
                s->done = 1;
            } else {
                s->depth--;
                int64_t mid = first + (last - first) / 2;
                topk_median_to_first(q + first, q + first + 1, q + mid, q + last - 1);
                s->pivot = q[first];
            }
        }
        TOPK_SYNC();
        if (s->done) break;
        topk_par_partition(q, first + 1, last, wl, wr, cnt, s, tid, nt);
        if (tid == 0) {
            if (s->cut <= nth)
                s->first = s->cut;
            else
                s->last = s->cut;
        }
        TOPK_SYNC();
    }
    if (tid == 0 && !s->done) topk_insertion_sort(q + s->first, q + s->last);
    TOPK_SYNC();
}

/* index_topk's row after q[0..n) holds (entry j, j) (backend.h): top[0..ld_top) = the k selected
 * positions ascending, those >= visible as -1, then -1. The ascending order comes from marking the
 * selected positions and a scan over them (no sort). */
TOPK_FN void topk_par_row(int32_t *top, int64_t ld_top, const int32_t *p, struct topk_elem *q, int32_t *wl,
                                        int32_t *wr, int32_t *cnt, struct topk_blk *s, int tid, int nt) {
    int64_t n = p[TOPK_P_N], k = p[TOPK_P_K], vis = p[TOPK_P_VISIBLE];
    if (k > n) k = n;
    if (k < 0) k = 0;
    for (int64_t j = k + tid; j < ld_top; j += nt) top[j] = -1;
    if (k == 0) return;
    if (k < n) topk_par_select(q, n, k, wl, wr, cnt, s, tid, nt);
    /* k == n: every entry is selected, so the set (hence the sorted list) cannot depend on the order */
    for (int64_t j = tid; j < n; j += nt) wl[j] = k == n;
    TOPK_SYNC();
    if (k < n)
        for (int64_t j = tid; j < k; j += nt) wl[q[j].i] = 1;
    TOPK_SYNC();
    int64_t lo, hi;
    topk_chunk(0, n, tid, nt, &lo, &hi);
    int32_t c = 0;
    for (int64_t j = lo; j < hi; j++) c += wl[j];
    cnt[2 * tid] = c;
    cnt[2 * tid + 1] = 0;
    TOPK_SYNC();
    topk_scan_pairs(cnt, nt, s, tid);
    int64_t o = cnt[2 * tid];
    for (int64_t j = lo; j < hi; j++)
        if (wl[j]) top[o++] = j >= vis ? -1 : (int32_t)j;
    TOPK_SYNC();
}

/* cand_mask's selection after q[0..nb) holds (block maximum, block) with the visible block forced:
 * keep[0..nb) (zeroed by the caller) marks the selected blocks with a maximum > -inf. */
TOPK_FN void topk_par_cand(uint8_t *keep, int64_t nb, int64_t topk_blocks, struct topk_elem *q,
                                         int32_t *wl, int32_t *wr, int32_t *cnt, struct topk_blk *s, int tid, int nt) {
    int64_t want = topk_blocks < nb ? topk_blocks : nb;
    if (want <= 0) return;
    /* want == nb: every block is selected (a context under topk_blocks · bs): no order to reproduce */
    if (want < nb) topk_par_select(q, nb, want, wl, wr, cnt, s, tid, nt);
    for (int64_t r = tid; r < want; r += nt)
        if (q[r].v > topk_neg_inf()) keep[q[r].i] = 1;
    TOPK_SYNC();
}

/* Entry j of a score row as index_topk reads it (backend.h). */
TOPK_FN float topk_entry(const float *S, int64_t j, int64_t n_valid, const uint8_t *mask, int64_t ld_m) {
    if (j >= n_valid) return topk_neg_inf();
    if (mask && (j >= ld_m || !mask[j])) return topk_neg_inf();
    return S[j];
}

/* Block b's maximum over entries [b·bs, min((b+1)·bs, n)) read without a mask; NaN never wins. */
TOPK_FN float topk_block_max(const float *S, int64_t b, int64_t bs, int64_t n, int64_t n_valid) {
    float mx = topk_neg_inf();
    for (int64_t j = b * bs; j < (b + 1) * bs && j < n; j++) {
        float v = topk_entry(S, j, n_valid, (const uint8_t *)0, 0);
        if (v > mx) mx = v;
    }
    return mx;
}

#endif /* DS_TOPK_CORE_H */
