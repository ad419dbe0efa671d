/* glibc's expf for the device, bit for bit: the CPU oracle calls glibc's expf (x86-64 FMA build,
 * sysdeps/ieee754/flt-32/e_expf.c) and CUDA's own expf differs from it on a fraction of inputs,
 * which bf16 roundings downstream turn into visible differences (softmax, SiLU, Sinkhorn, the
 * router). One copy for the suite: checked against glibc over all 2^32 inputs (identical up to NaN
 * payloads). */
#ifndef DS_CUDA_LIBM_CUH
#define DS_CUDA_LIBM_CUH

#include <stdint.h>

/* 2^(i/32) as double bits, minus i << 47, so adding k << 47 gives 2^(k/32) (e_exp2f_data.c). */
static __device__ const uint64_t ds_exp2f_tab[32] = {
    0x3ff0000000000000ull, 0x3fefd9b0d3158574ull, 0x3fefb5586cf9890full, 0x3fef9301d0125b51ull,
    0x3fef72b83c7d517bull, 0x3fef54873168b9aaull, 0x3fef387a6e756238ull, 0x3fef1e9df51fdee1ull,
    0x3fef06fe0a31b715ull, 0x3feef1a7373aa9cbull, 0x3feedea64c123422ull, 0x3feece086061892dull,
    0x3feebfdad5362a27ull, 0x3feeb42b569d4f82ull, 0x3feeab07dd485429ull, 0x3feea47eb03a5585ull,
    0x3feea09e667f3bcdull, 0x3fee9f75e8ec5f74ull, 0x3feea11473eb0187ull, 0x3feea589994cce13ull,
    0x3feeace5422aa0dbull, 0x3feeb737b0cdc5e5ull, 0x3feec49182a3f090ull, 0x3feed503b23e255dull,
    0x3feee89f995ad3adull, 0x3feeff76f2fb5e47ull, 0x3fef199bdd85529cull, 0x3fef3720dcef9069ull,
    0x3fef5818dcfba487ull, 0x3fef7c97337b9b5full, 0x3fefa4afa2a490daull, 0x3fefd0765b6e4540ull};

/* expf: x = (k + r)·ln2/32, exp(x) = 2^(k/32) · (cubic in r), all in double, one final rounding. */
__device__ __forceinline__ float ds_expf(float x) {
    const uint32_t ux = __float_as_uint(x), abstop = (ux >> 20) & 0x7ff;
    if (abstop >= 0x42b) { /* |x| >= 88, inf or nan: glibc's special cases */
        if (ux == 0xff800000u) return 0.0f;
        if (abstop >= 0x7f8) return x + x;
        if (x > 0x1.62e42ep6f) return __uint_as_float(0x7f800000u); /* overflow */
        if (x < -0x1.9fe368p6f) return 0.0f;                         /* underflow */
        if (x < -0x1.9d1d9ep6f) return 0x1p-149f;                    /* may underflow (errno build) */
    }
    const double inv_ln2_n = 0x1.71547652b82fep+0 * 32, shift = 0x1.8p+52;
    const double c0 = 0x1.c6af84b912394p-5 / 32 / 32 / 32, c1 = 0x1.ebfce50fac4f3p-3 / 32 / 32,
                 c2 = 0x1.62e42ff0c52d6p-1 / 32;
    /* z = x·32/ln2 feeds two additions, and GCC fuses the product into both: kd = round(z) via
     * the shift constant (k lands in the low mantissa bits), r = z - k. */
    const double xd = (double)x;
    double kd = __fma_rn(inv_ln2_n, xd, shift);
    const uint64_t ki = (uint64_t)__double_as_longlong(kd);
    kd = __dsub_rn(kd, shift);
    const double r = __fma_rn(inv_ln2_n, xd, -kd);
    const uint64_t t = ds_exp2f_tab[ki & 31] + (ki << 47);
    const double s = __longlong_as_double((long long)t);
    const double p = __fma_rn(c0, r, c1), r2 = __dmul_rn(r, r);
    double y = __fma_rn(c2, r, 1.0);
    y = __fma_rn(p, r2, y);
    return __double2float_rn(__dmul_rn(y, s));
}

#endif /* DS_CUDA_LIBM_CUH */
