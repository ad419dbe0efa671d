/* libstdc++'s introselect / heap select over (value, index) pairs, as ATen's CPU top-k uses them
 * (see topk.h). Written from the algorithms' definitions; the step order matters for ties. */
#include "topk.h"

#include <math.h>
#include <stdlib.h>

#include "log.h"

struct elem {
    float v;
    int64_t i;
};

/* ATen's comparator for largest=True: NaN sorts first, then larger values. */
static int comp(const struct elem *x, const struct elem *y) {
    return (isnan(x->v) && !isnan(y->v)) || (x->v > y->v);
}

static void swap_e(struct elem *a, struct elem *b) {
    struct elem t = *a;
    *a = *b;
    *b = t;
}

static void push_heap(struct elem *first, int64_t hole, int64_t top, struct elem value) {
    int64_t parent = (hole - 1) / 2;
    while (hole > top && comp(&first[parent], &value)) {
        first[hole] = first[parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    first[hole] = value;
}

static void adjust_heap(struct elem *first, int64_t hole, int64_t len, struct elem value) {
    int64_t top = hole, child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (comp(&first[child], &first[child - 1])) child--;
        first[hole] = first[child];
        hole = child;
    }
    if ((len & 1) == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        first[hole] = first[child - 1];
        hole = child - 1;
    }
    push_heap(first, hole, top, value);
}

static void make_heap(struct elem *first, int64_t len) {
    if (len < 2) return;
    for (int64_t parent = (len - 2) / 2;; parent--) {
        adjust_heap(first, parent, len, first[parent]);
        if (parent == 0) return;
    }
}

static void heap_select(struct elem *first, int64_t middle, int64_t last) {
    make_heap(first, middle);
    for (int64_t i = middle; i < last; i++)
        if (comp(&first[i], &first[0])) { /* pop_heap(first, middle, i) */
            struct elem value = first[i];
            first[i] = first[0];
            adjust_heap(first, 0, middle, value);
        }
}

static void move_median_to_first(struct elem *result, struct elem *a, struct elem *b, struct elem *c) {
    if (comp(a, b)) {
        if (comp(b, c))
            swap_e(result, b);
        else if (comp(a, c))
            swap_e(result, c);
        else
            swap_e(result, a);
    } else if (comp(a, c))
        swap_e(result, a);
    else if (comp(b, c))
        swap_e(result, c);
    else
        swap_e(result, b);
}

static struct elem *unguarded_partition(struct elem *first, struct elem *last, struct elem *pivot) {
    for (;;) {
        while (comp(first, pivot)) first++;
        last--;
        while (comp(pivot, last)) last--;
        if (!(first < last)) return first;
        swap_e(first, last);
        first++;
    }
}

static void insertion_sort(struct elem *first, struct elem *last) {
    if (first == last) return;
    for (struct elem *i = first + 1; i != last; i++) {
        if (comp(i, first)) {
            struct elem val = *i;
            for (struct elem *p = i; p != first; p--) *p = *(p - 1);
            *first = val;
        } else {
            struct elem val = *i, *l = i, *next = i - 1;
            while (comp(&val, next)) {
                *l = *next;
                l = next;
                next--;
            }
            *l = val;
        }
    }
}

static int lg(int64_t n) {
    int r = 0;
    while (n > 1) {
        n >>= 1;
        r++;
    }
    return r;
}

static void nth_element(struct elem *first, struct elem *nth, struct elem *last) {
    if (first == last || nth == last) return;
    int64_t depth = (int64_t)lg(last - first) * 2;
    while (last - first > 3) {
        if (depth == 0) {
            heap_select(first, nth + 1 - first, last - first);
            swap_e(first, nth);
            return;
        }
        depth--;
        struct elem *mid = first + (last - first) / 2;
        move_median_to_first(first, first + 1, mid, last - 1);
        struct elem *cut = unguarded_partition(first + 1, last, first);
        if (cut <= nth)
            first = cut;
        else
            last = cut;
    }
    insertion_sort(first, last);
}

void torch_topk(const float *v, int64_t n, int64_t k, int32_t *out) {
    if (k <= 0) return;
    struct elem *q = ds_malloc(sizeof *q * (size_t)n);
    for (int64_t j = 0; j < n; j++) q[j] = (struct elem){v[j], j};
    if (k * 64 <= n)
        heap_select(q, k, n); /* partial_sort: the heap holds the k selected, order irrelevant here */
    else
        nth_element(q, q + k - 1, q + n);
    for (int64_t j = 0; j < k; j++) out[j] = (int32_t)q[j].i;
    free(q);
}
