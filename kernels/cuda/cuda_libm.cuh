/* glibc's expf, sinf and cosf for the device, bit for bit: the CPU oracle calls glibc's (x86-64 FMA
 * build, sysdeps/ieee754/flt-32) and CUDA's own differ from them on a fraction of inputs, which
 * bf16 roundings downstream turn into visible differences (softmax, SiLU, Sinkhorn, the router,
 * RoPE). One copy for the suite: checked against glibc over all 2^32 inputs (identical up to NaN
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

/* ---------------------------------------------------------------------------------------------
 * glibc's sinf and cosf (sysdeps/ieee754/flt-32: s_sinf.c, s_cosf.c, s_sincosf.h;
 * the algorithms of ARM's optimized-routines), re-expressed with explicit double roundings.
 * x86-64 glibc runs the variant compiled with -mfma, in which GCC fuses each a*b + c of the source
 * into an FMA; the __fma_rn calls below are those fusions. Checked against glibc 2.36 (x86-64,
 * FMA variant) over all 2^32 inputs: identical results. */

/* 4/pi to 192 bits, 8 new bits per entry (s_sincosf_data.c). */
static __device__ const uint32_t ds_inv_pio4[24] = {
    0xa2,       0xa2f9,     0xa2f983,   0xa2f9836e, 0xf9836e4e, 0x836e4e44, 0x6e4e4415, 0x4e441529,
    0x441529fc, 0x1529fc27, 0x29fc2757, 0xfc2757d1, 0x2757d1f5, 0x57d1f534, 0xd1f534dd, 0xf534ddc0,
    0x34ddc0db, 0xddc0db62, 0xc0db6295, 0xdb629599, 0x6295993c, 0x95993c43, 0x993c4390, 0x3c439041};

/* sinf_poly: the sine polynomial for even n, the cosine one (signed by sg, the table that
 * returns -cos) for odd n. */
__device__ __forceinline__ float ds_sincos_poly(double x, double x2, double sg, int n) {
    if ((n & 1) == 0) {
        const double x3 = __dmul_rn(x, x2), s1 = __fma_rn(x2, -0x1.994eb3774cf24p-13, 0x1.1107605230bc4p-7);
        const double x7 = __dmul_rn(x3, x2), s = __fma_rn(x3, -0x1.555545995a603p-3, x);
        return __double2float_rn(__fma_rn(x7, s1, s));
    }
    const double x4 = __dmul_rn(x2, x2);
    const double c2 = __fma_rn(x2, sg * 0x1.99343027bf8c3p-16, sg * -0x1.6c087e89a359dp-10);
    const double c1 = __fma_rn(x2, sg * -0x1.ffffffd0c621cp-2, sg);
    const double x6 = __dmul_rn(x4, x2), c = __fma_rn(x4, sg * 0x1.55553e1068f19p-5, c1);
    return __double2float_rn(__fma_rn(x6, c2, c));
}

/* sinf(y) (want_cos = 0) or cosf(y) (want_cos = 1): range reduction to [-pi/4, pi/4] and quadrant
 * n, by one multiply-subtract below 120, by 4/pi in fixed point above. */
static __device__ float ds_sinf_cosf(float y, int want_cos) {
    const uint32_t top = (__float_as_uint(y) >> 20) & 0x7ff;
    double x = (double)y;
    if (top < 0x3f4) { /* |y| < pi/4 */
        if (top < 0x398) return want_cos ? 1.0f : y; /* |y| < 2^-12 */
        return ds_sincos_poly(x, __dmul_rn(x, x), 1.0, want_cos);
    }
    int n, q;
    if (top < 0x42f) { /* |y| < 120 */
        const double r = __dmul_rn(x, 0x1.45F306DC9C883p+23);
        n = (__double2int_rz(r) + 0x800000) >> 24;
        x = __fma_rn(-(double)n, 0x1.921FB54442D18p0, x);
        q = n;
    } else if (top < 0x7f8) {
        uint32_t xi = __float_as_uint(y);
        const int sign = (int)(xi >> 31);
        const uint32_t *arr = &ds_inv_pio4[(xi >> 26) & 15];
        const int sh = (xi >> 23) & 7;
        xi = ((xi & 0xffffff) | 0x800000) << sh;
        uint64_t res0 = (uint32_t)(xi * arr[0]); /* 32-bit product, as in the source */
        const uint64_t res1 = (uint64_t)xi * arr[4], res2 = (uint64_t)xi * arr[8];
        res0 = (res2 >> 32) | (res0 << 32);
        res0 += res1;
        const uint64_t nn = (res0 + (1ull << 61)) >> 62;
        res0 -= nn << 62;
        x = __dmul_rn(__ll2double_rn((long long)res0), 0x1.921FB54442D18p-62);
        n = (int)nn;
        q = n + sign;
    } else {
        return __uint_as_float(0x7fc00000u); /* inf, nan: nan (becomes 0x7FC0 in bf16 either way) */
    }
    const double s = ((q + 1) & 2) ? -1.0 : 1.0; /* sign[q & 3] = {1, -1, -1, 1} */
    const double sg = (q & 2) ? -1.0 : 1.0;      /* the second table (negated cosine) */
    return ds_sincos_poly(__dmul_rn(x, s), __dmul_rn(x, x), sg, want_cos ? n ^ 1 : n);
}

#endif /* DS_CUDA_LIBM_CUH */
