/* C interface of the SM80 linear kernels (kernels/cuda/linear_sm80.cu), callable from host C
 * (no CUDA headers needed). Pointers are device pointers; shapes as in kernels/backend.h:
 * y[T, n] bf16 = x[T, k] bf16 · Wᵀ with FP8 (32x32 tile scales) or FP4 (per-row-per-32 scales)
 * weights and the reference's FP8 activation quantization, bit-identical to the CPU backend. */
#ifndef DS_CUDA_LINEAR_H
#define DS_CUDA_LINEAR_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Number of usable CUDA devices; 0 when there is no GPU or no driver (never an error). */
int cuda_device_count(void);

/* Workspace for the activation quantization: T*k floats + T*(k/32) floats, device memory. */
size_t cuda_linear_workspace_bytes(int64_t T, int64_t k);

/* W: e4m3 [n, ld] (+ scales e8m0 [ceil(n/32), s_ld]); k a multiple of 32; T <= CUDA_LINEAR_MAX_T. */
void cuda_linear_fp8(uint16_t *y, const uint16_t *x, int64_t T, const uint8_t *w, const uint8_t *s, int64_t n,
                     int64_t k, int64_t ld, int64_t s_ld, void *workspace, void *stream);
/* W: packed e2m1 [n, ld bytes] in the device layout (fp4_layout.h: weight_prepare's, or an array
 * passed through cuda_fp4_pack) (+ scales e8m0 [n, s_ld]). */
void cuda_linear_fp4(uint16_t *y, const uint16_t *x, int64_t T, const uint8_t *w, const uint8_t *s, int64_t n,
                     int64_t k, int64_t ld, int64_t s_ld, void *workspace, void *stream);

/* A compact array of packed e2m1 codes (`bytes` a multiple of 4, w 4-byte aligned; rows of k/2
 * bytes are whole words since k % 32 == 0) from the checkpoint's layout into the device layout of
 * every FP4 kernel (fp4_layout.h), in place, on `stream`. */
void cuda_fp4_pack(uint8_t *w, int64_t bytes, void *stream);

#define CUDA_LINEAR_MAX_T 16

#ifdef __cplusplus
}
#endif

#endif /* DS_CUDA_LINEAR_H */
