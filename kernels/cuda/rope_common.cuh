/* The rope op's arithmetic (backend.h) on the device, one copy for every kernel that rotates: the
 * angle (float)pos · freq, its (cos, sin) by the glibc ports of cuda_libm.cuh, and one pair's
 * rotation to bf16 codes (rope_kernel, rmsnorm_post_kernel and rope_parts_kernel in
 * cuda_elementwise.cu; the attention output's inverse RoPE in attention_mma_sm80.cu). */
#ifndef DS_CUDA_ROPE_COMMON_CUH
#define DS_CUDA_ROPE_COMMON_CUH

#include "cuda_common.cuh"
#include "cuda_libm.cuh"

__device__ __forceinline__ float2 rope_cs(int32_t pos, float freq) {
    const float ang = __fmul_rn(__int2float_rn(pos), freq);
    return make_float2(ds_sinf_cosf(ang, 1), ds_sinf_cosf(ang, 0));
}
__device__ __forceinline__ void rope_rotate(float a, float b, float c, float s, uint16_t &o0, uint16_t &o1) {
    o0 = ds_bf16_rne(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
    o1 = ds_bf16_rne(__fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c)));
}

#endif /* DS_CUDA_ROPE_COMMON_CUH */
