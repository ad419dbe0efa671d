/* Top-k selection that breaks exact ties the way the reference's torch.topk does on CPU.
 * The index scores are bf16 and relu makes exact zeros, so ties at the k-th place are real; the
 * reference's tie-breaking is that of ATen's CPU top-k: a queue of (value, index) in index order
 * run through std::nth_element (or std::partial_sort when k·64 <= n) of libstdc++ with the
 * comparator "x > y (NaN largest)". Reproducing those algorithms step by step selects the same
 * set on every tie, which the golden fixtures confirm. */
#ifndef DS_TOPK_H
#define DS_TOPK_H

#include <stdint.h>

/* The k selected indices of v[0..n) (largest), in the order the algorithm leaves them (unsorted,
 * as topk(sorted=False)). k <= n. */
void torch_topk(const float *v, int64_t n, int64_t k, int32_t *out);

#endif /* DS_TOPK_H */
