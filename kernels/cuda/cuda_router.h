/* Test hook of the SM80 router's selection (kernels/cuda/cuda_moe.cu), callable from host C: the
 * routing ids and weights from given gate logits, by a chosen kernel, so a test can hold the forms
 * against each other on crafted logits (exact ties, signed zeros, infinities, NaNs) that a gate
 * linear would rarely produce. The router op (backend.h) runs CUDA_ROUTER_AUTO after its gate. */
#ifndef DS_CUDA_ROUTER_H
#define DS_CUDA_ROUTER_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* AUTO: RANK where E <= 1024, k <= 32 and T <= 2 x the multiprocessors, else SERIAL. SERIAL: k rounds of a warp arg-max per
 * token (router_select_kernel). RANK: every expert's rank in one pass (router_rank_kernel). */
enum { CUDA_ROUTER_AUTO = 0, CUDA_ROUTER_SERIAL = 1, CUDA_ROUTER_RANK = 2 };

/* idx [T, k] int32, wts [T, k] fp32 from z [T, E] fp32 and bias [E] (NULL: none), all device
 * pointers: s = sqrt(softplus(z / temp)), the top k of s + bias (the CPU's order, ties to the lower
 * id, its NaN rule), weights s (divided by their sum + 1e-20 when norm and k > 1) · route_scale.
 * Asynchronous on `stream` (a cudaStream_t; NULL = the legacy default stream). */
void cuda_router_select(int form, int32_t *idx, float *wts, const float *z, const float *bias, int64_t T, int64_t E,
                        int64_t k, float temp, int norm, float route_scale, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* DS_CUDA_ROUTER_H */
