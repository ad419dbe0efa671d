/* Shared pieces of the SM80 suite: the CUDA check macro (which ends the whole job through the host
 * runtime's ds_fatal, like every other library check), and exact number-format conversions that
 * match src/formats.c bit for bit (RNE, no FMA contraction: every rounding point is an explicit
 * __fadd_rn/__fmul_rn/__fdiv_rn so nvcc cannot fuse it). */
#ifndef DS_CUDA_COMMON_CUH
#define DS_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

extern "C" void ds_fatal(const char *file, int line, const char *func, const char *lib, const char *call,
                         const char *msg);

#define CUDA_CHECK(call)                                                                          \
    do {                                                                                          \
        cudaError_t ds_ce_ = (call);                                                              \
        if (ds_ce_ != cudaSuccess)                                                                \
            ds_fatal(__FILE__, __LINE__, __func__, "CUDA", #call, cudaGetErrorString(ds_ce_));     \
    } while (0)
/* After every launch: a bad configuration is reported where it happened. */
#define KERNEL_CHECK() CUDA_CHECK(cudaGetLastError())

/* bf16 bits -> fp32, exact. */
__device__ __forceinline__ float ds_bf16f(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }

/* bf16_from_f32 of src/formats.c: RNE by integer add; any NaN becomes the canonical 0x7FC0, as
 * torch's CPU conversion does (the CUDA intrinsic keeps another NaN pattern). */
__device__ __forceinline__ uint16_t ds_bf16_rne(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* 16 bytes of 8 bf16 (element 2i in the low half of word i) <-> 8 fp32, exact / ds_bf16_rne. */
__device__ __forceinline__ void unpack8(uint4 v, float f[8]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ uint4 pack8(const float f[8]) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = (uint32_t)ds_bf16_rne(f[2 * i]) | ((uint32_t)ds_bf16_rne(f[2 * i + 1]) << 16);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

/* The tensor-core linears' k-chunk fold (mma_chunk_sum_kernel, linear_mma_sm80.cu), for the
 * kernels that take their unfolded partials (CUDA_MMA_OUT_PARTS) instead of a fold launch: an
 * output's p[c·cs], c < nch, the first as it is, then each next in chunk order; and the fold's
 * rounding to a bf16 output (the intrinsic's RNE, with its NaN pattern, as the fold stores it). */
__device__ __forceinline__ float mma_fold_chunks(const float *__restrict__ p, int64_t cs, int nch) {
    float v = p[0];
    for (int c = 1; c < nch; c++) v = __fadd_rn(v, p[(int64_t)c * cs]);
    return v;
}
__device__ __forceinline__ uint16_t mma_fold_bf16(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
/* The same for 4 consecutive outputs (16-byte aligned, cs4 float4s between chunks), streaming loads
 * (partials are read once) */
__device__ __forceinline__ float4 mma_fold_chunks4(const float4 *__restrict__ p, int64_t cs4, int nch) {
    float4 v = __ldcs(p);
#pragma unroll 4
    for (int c = 1; c < nch; c++) {
        const float4 u = __ldcs(p + (int64_t)c * cs4);
        v.x = __fadd_rn(v.x, u.x), v.y = __fadd_rn(v.y, u.y), v.z = __fadd_rn(v.z, u.z), v.w = __fadd_rn(v.w, u.w);
    }
    return v;
}

/* e8m0 byte -> 2^(b-127); 255 = NaN; 0 = 2^-127 (subnormal). */
__device__ __forceinline__ float ds_e8m0(uint8_t b) {
    if (b == 255) return __int_as_float(0x7fc00000);
    if (b == 0) return __int_as_float(0x00400000);
    return __int_as_float((int)b << 23);
}

/* e4m3fn byte -> float, exact, by moving the fields into an fp32 (bias 7 -> 127); subnormals
 * (exponent 0) are mantissa x 2^-9; 0x7F/0xFF are NaN. A handful of integer ops, where the
 * conversion intrinsic goes through half precision. */
__device__ __forceinline__ float ds_e4m3(uint32_t b) {
    uint32_t sign = (b & 0x80u) << 24, e = (b >> 3) & 0xfu, m = b & 7u;
    if ((b & 0x7fu) == 0x7fu) return __int_as_float(0x7fc00000);
    if (e) return __int_as_float((int)(sign | ((e + 120u) << 23) | (m << 20)));
    return __int_as_float((int)(sign | (uint32_t)__float_as_int((float)m * 0.001953125f)));
}

/* 2^ceil(log2(amax · max_inv)) from the exponent bits (ds_round_scale_pow2). */
__device__ __forceinline__ float ds_scale_pow2(float amax, float max_inv) {
    const uint32_t u = __float_as_uint(__fmul_rn(amax, max_inv));
    const int32_t e = (int32_t)((u >> 23) & 0xffu) - 127 + ((u & 0x7fffffu) != 0);
    return __uint_as_float((uint32_t)(e + 127) << 23);
}

/* The FP8 activation scale of a group's amax: the amax floored at 1e-4 by fmaxf (so a NaN amax,
 * a group of NaNs only, takes the floor, as formats.c's amax of `if (a > m)` from 0 never becomes
 * NaN), then 2^ceil(log2(amax / 448)) (act_quant_fp8_32). */
__device__ __forceinline__ float ds_fp8_scale(float amax) {
    return ds_scale_pow2(fmaxf(amax, 1e-4f), (float)(1.0 / 448.0));
}

/* 1 / sc for a power-of-two scale sc (mantissa zero), exact: 2^-e is a float for every scale the
 * quantizers form (2^-22 ... 2^120); sc = inf gives 0, so v · (1 / sc) equals the reference's v / sc
 * there too (±0 for finite v, NaN for infinite v). v · 2^-e and v / 2^e are the same real number,
 * so the correctly rounded product is the correctly rounded quotient, and one multiply replaces an
 * IEEE division per value. */
__device__ __forceinline__ float ds_pow2_inv(float sc) {
    const uint32_t e = (__float_as_uint(sc) >> 23) & 0xffu;
    if (e == 0xffu) return 0.0f;
    if (e == 0xfeu) return __uint_as_float(0x00400000u); /* 2^-127 */
    return __uint_as_float((0xfeu - e) << 23);
}

/* The value of e4m3_from_f32(r) (src/formats.c) as a float, for |r| <= 448 or NaN (a clamped
 * quotient): the normal range keeps 3 mantissa bits, half to even, by an integer add (a carry bumps
 * the exponent, the correct next value); below 2^-6 the value is rint(|r| · 2^9) · 2^-9 (exact
 * scalings, rint half to even); NaN gives the NaN of code 0x7F (ds_e4m3). The sign is kept, -0
 * included. No code is formed: the quantizers only need q, and the software conversion of SM80
 * (no e4m3 cvt before SM89) cost more than the rest of the quantization. */
__device__ __forceinline__ float ds_e4m3_val(float r) {
    const uint32_t u = __float_as_uint(r), a = u & 0x7fffffffu, sign = u & 0x80000000u;
    if (a > 0x7f800000u) return __int_as_float(0x7fc00000);
    const uint32_t nrm = (a + 0x7ffffu + ((a >> 20) & 1u)) & 0xfff00000u;
    const float sub = __fmul_rn(rintf(__fmul_rn(__uint_as_float(a), 512.0f)), 0x1p-9f);
    return __uint_as_float(sign | (a >= 0x3c800000u ? nrm : __float_as_uint(sub)));
}

/* The reference's FP8 activation quantization of one value, as the e4m3 value q: clamp(v / sc,
 * ±448) with `v < lo ? lo : (v > hi ? hi : v)` (a NaN passes, as formats.c's clampf) rounded to
 * e4m3; rsc = ds_pow2_inv(sc). q · sc is the dequantized value (exact in fp32 for the scales in
 * use, and in bf16: q has at most 4 significant bits). */
__device__ __forceinline__ float ds_fp8_q(float v, float rsc) {
    float r = __fmul_rn(v, rsc);
    r = r < -448.0f ? -448.0f : (r > 448.0f ? 448.0f : r);
    return ds_e4m3_val(r);
}

/* e2m1 code -> float: magnitude = 2^(e-1) * (1 + m/2) for e > 0, m/2 for e == 0 (arithmetic, so
 * no table lands in local memory). */
__device__ __forceinline__ float ds_e2m1(uint32_t code) {
    uint32_t e = (code >> 1) & 3, m = code & 1;
    float v = e ? __int_as_float((int)((126 + e) << 23) | (int)(m << 22)) : 0.5f * (float)m;
    return (code & 8) ? -v : v;
}

/* cp.async (SM80) through generic shared-memory pointers, for the kernels outside the mma files
 * (mma_sm80.cuh has its own, on shared addresses): 16 bytes global -> shared (ds_cp16), or with
 * the bytes past src_bytes zero-filled (ds_cp16z); commit; wait until at most N groups are in
 * flight. The "memory" clobbers keep the compiler from moving shared-memory accesses across them. */
__device__ __forceinline__ void ds_cp16(void *smem, const void *gmem) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void ds_cp16z(void *smem, const void *gmem, int src_bytes) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void ds_cp_commit(void) { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void ds_cp_wait(void) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

#endif /* DS_CUDA_COMMON_CUH */
