/* Number formats: conversions between fp32 and the checkpoint's encodings (bf16, e4m3fn, e8m0,
 * e2m1), the reference's three activation quantize-dequantize steps, and the (de)quantizers of
 * stored weights. Everything here must match the official kernels bit for bit (MODEL.md §2.1,
 * §3.0), so the conversions work on integer bit patterns rather than on libm rounding, never
 * depend on the current FP rounding mode, and are compiled without FMA contraction: a single
 * differently rounded QDQ value changes a scale and then a whole block downstream. */
#include "formats.h"

#include <math.h>
#include <string.h>

#include "log.h"

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* ---------------------------------------------------------------------------------------------
 * bf16 */

bf16_t bf16_from_f32(float f) {
    uint32_t u = f32_bits(f);
    /* torch's CPU conversion (which produced the golden fixtures) returns the canonical quiet NaN
     * rather than a truncated payload, which could otherwise round up into infinity. */
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (bf16_t)0x7FC0u;
    /* Adding 0x7FFF plus the lowest kept bit rounds half to even; a carry out of the mantissa
     * moves into the exponent, which is exactly the next binade (or infinity). */
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

/* ---------------------------------------------------------------------------------------------
 * e4m3fn */

float e4m3_to_f32(uint8_t b) {
    uint32_t sign = (uint32_t)(b & 0x80u) << 24;
    uint32_t exp = (b >> 3) & 0xFu;
    uint32_t man = b & 0x7u;
    if (exp == 0xFu && man == 0x7u) return f32_from_bits(sign | 0x7FC00000u);
    if (exp == 0) {
        /* Subnormal: man/8 * 2^-6; the product is exact (at most three significant bits). */
        float v = (float)man * 0x1p-9f;
        return sign ? -v : v;
    }
    /* Rebias 7 -> 127 and widen the mantissa from 3 to 23 bits. */
    return f32_from_bits(sign | ((exp + 120u) << 23) | (man << 20));
}

uint8_t e4m3_from_f32(float f) {
    uint32_t u = f32_bits(f);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return 0x7F; /* NaN, whatever its sign (CUDA satfinite) */
    if (a > 0x43E00000u) return (uint8_t)(sign | 0x7E); /* beyond 448, infinity included */
    if (a >= 0x3C800000u) {
        /* Normal target (|f| >= 2^-6): keep 3 of the 23 mantissa bits with half-to-even; the
         * carry may bump the exponent, which is the correct next value. |f| <= 448 cannot carry
         * past 448, which is representable. */
        uint32_t r = (a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
        return (uint8_t)(sign | (r - (120u << 3)));
    }
    /* Subnormal target: the code is round(|f| * 2^9) in [0, 8]; 8 is the smallest normal, whose
     * code happens to be 8 as well. The scaling by 2^9 is exact, so only the integer rounding
     * remains, done by hand to stay independent of the FP rounding mode. */
    float x = f32_from_bits(a) * 0x1p9f;
    uint32_t i = (uint32_t)x; /* truncation */
    float frac = x - (float)i; /* exact: x < 8 has no bits below what a float keeps */
    if (frac > 0.5f || (frac == 0.5f && (i & 1u))) i++;
    return (uint8_t)(sign | i);
}

/* ---------------------------------------------------------------------------------------------
 * e8m0 and e2m1 */

float e8m0_to_f32(uint8_t b) {
    if (b == 0xFF) return f32_from_bits(0x7FC00000u);
    /* 2^-127 is below the normal range; build its subnormal pattern directly. */
    if (b == 0) return f32_from_bits(0x00400000u);
    return f32_from_bits((uint32_t)b << 23);
}

static const float e2m1_table[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                     -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

float e2m1_to_f32(uint8_t code) { return e2m1_table[code & 0xFu]; }

uint8_t e2m1_from_f32(float f) {
    float a = fabsf(f);
    /* The code is the number of rounding boundaries below |f|; at an exact boundary the value
     * goes to the even code, which is upward only where the upper neighbour has an even code. */
    uint8_t code = (uint8_t)((a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                             (a >= 3.5f) + (a > 5.0f));
    return (uint8_t)(code | (signbit(f) ? 8u : 0u));
}

/* ---------------------------------------------------------------------------------------------
 * Scales and activation QDQ */

/* ceil(log2(t)) from t's bits, as the reference kernel does: the exponent field, plus one when
 * any mantissa bit is set. Exact for normal t; a subnormal or zero t gives -126 or -127. */
static inline int32_t log2_ceil_bits(float t) {
    uint32_t u = f32_bits(t);
    return (int32_t)((u >> 23) & 0xFFu) - 127 + ((u & 0x7FFFFFu) != 0);
}

float ds_round_scale_pow2(float amax, float max_inv) {
    float t = amax * max_inv;
    /* Shifted unsigned: a NaN t yields 256 << 23, which would overflow a signed int (the
     * kernel's int32 wraps to the same bits, -0.0). */
    return f32_from_bits((uint32_t)(log2_ceil_bits(t) + 127) << 23);
}

static inline float clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

static inline float group_amax(const bf16_t *x, size_t n) {
    float m = 0.0f;
    for (size_t i = 0; i < n; i++) {
        float a = fabsf(bf16_to_f32(x[i]));
        if (a > m) m = a;
    }
    return m;
}

/* The reference literals: Python's 1/448 and 1/6 as fp32 (the nearest floats). */
#define FP8_MAX_INV ((float)(1.0 / 448.0))
#define FP4_MAX_INV ((float)(1.0 / 6.0))

void act_quant_fp8_32(const bf16_t *x, size_t n, uint8_t *q, float *s) {
    for (size_t g = 0; g < n / 32; g++) {
        const bf16_t *xg = x + g * 32;
        float amax = group_amax(xg, 32);
        if (amax < 1e-4f) amax = 1e-4f;
        float sc = ds_round_scale_pow2(amax, FP8_MAX_INV);
        s[g] = sc;
        for (int i = 0; i < 32; i++)
            q[g * 32 + i] = e4m3_from_f32(clampf(bf16_to_f32(xg[i]) / sc, -448.0f, 448.0f));
    }
}

void qdq_fp8_32(bf16_t *x, size_t n) {
    for (size_t g = 0; g < n / 32; g++) {
        bf16_t *xg = x + g * 32;
        float amax = group_amax(xg, 32);
        if (amax < 1e-4f) amax = 1e-4f;
        float sc = ds_round_scale_pow2(amax, FP8_MAX_INV);
        for (int i = 0; i < 32; i++) {
            uint8_t c = e4m3_from_f32(clampf(bf16_to_f32(xg[i]) / sc, -448.0f, 448.0f));
            xg[i] = bf16_from_f32(e4m3_to_f32(c) * sc);
        }
    }
}

void qdq_fp4_32_ue8m0(bf16_t *x, size_t n) {
    for (size_t g = 0; g < n / 32; g++) {
        bf16_t *xg = x + g * 32;
        float amax = group_amax(xg, 32);
        if (amax < 6.0f * 0x1p-126f) amax = 6.0f * 0x1p-126f;
        float sc = ds_round_scale_pow2(amax, FP4_MAX_INV);
        for (int i = 0; i < 32; i++) {
            float v = clampf(bf16_to_f32(xg[i]) / sc, -6.0f, 6.0f);
            xg[i] = bf16_from_f32(e2m1_to_f32(e2m1_from_f32(v)) * sc);
        }
    }
}

void qdq_fp4_16_e4m3(bf16_t *x, size_t n) {
    for (size_t g = 0; g < n / 16; g++) {
        bf16_t *xg = x + g * 16;
        float amax = group_amax(xg, 16);
        if (amax < 6.0f * 0x1p-9f) amax = 6.0f * 0x1p-9f;
        /* Not a power of two, so x/s and x*(1/s) differ: the reference divides. */
        float sc = e4m3_to_f32(e4m3_from_f32(amax / 6.0f));
        for (int i = 0; i < 16; i++) {
            float v = clampf(bf16_to_f32(xg[i]) / sc, -6.0f, 6.0f);
            xg[i] = bf16_from_f32(e2m1_to_f32(e2m1_from_f32(v)) * sc);
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * Stored weights */

void dequant_fp8_tiles(const uint8_t *w, const uint8_t *s, int64_t n, int64_t k, int64_t ld, int64_t s_ld,
                       float *out) {
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *srow = s + (i / 32) * s_ld;
        for (int64_t j = 0; j < k; j++)
            out[i * k + j] = e4m3_to_f32(w[i * ld + j]) * e8m0_to_f32(srow[j / 32]);
    }
}

void dequant_fp8_tiles_bf16(const uint8_t *w, const uint8_t *s, int64_t n, int64_t k, int64_t ld, int64_t s_ld,
                            bf16_t *out) {
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *srow = s + (i / 32) * s_ld;
        for (int64_t j = 0; j < k; j++)
            out[i * k + j] = bf16_from_f32(e4m3_to_f32(w[i * ld + j]) * e8m0_to_f32(srow[j / 32]));
    }
}

void dequant_fp4_rows(const uint8_t *w, const uint8_t *s, int64_t n, int64_t k, float *out) {
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *wrow = w + i * (k / 2);
        const uint8_t *srow = s + i * (k / 32);
        for (int64_t j = 0; j < k; j++) {
            uint8_t byte = wrow[j / 2];
            uint8_t code = (j & 1) ? (uint8_t)(byte >> 4) : (uint8_t)(byte & 0xFu);
            out[i * k + j] = e2m1_to_f32(code) * e8m0_to_f32(srow[j / 32]);
        }
    }
}

void dequant_engram_row(const uint8_t *w, const uint8_t *s, int dim, bf16_t *out) {
    for (int j = 0; j < dim; j++)
        out[j] = bf16_from_f32(e4m3_to_f32(w[j]) * e8m0_to_f32(s[j / 32]));
}

/* e8m0 byte of the smallest power of two that brings amax within the format's range; an all-zero
 * block gets 1.0 so the scale byte is an ordinary value. */
static uint8_t weight_scale_byte(float amax, float max_inv) {
    if (amax == 0.0f) return 127;
    int32_t b = log2_ceil_bits(amax * max_inv) + 127;
    if (b < 0) b = 0;
    if (b > 254) b = 254;
    return (uint8_t)b;
}

void quant_fp8_tiles(const float *w, int64_t n, int64_t k, uint8_t *q, uint8_t *s) {
    int64_t tn = (n + 31) / 32, tk = (k + 31) / 32;
    for (int64_t ti = 0; ti < tn; ti++) {
        int64_t i0 = ti * 32, i1 = i0 + 32 < n ? i0 + 32 : n;
        for (int64_t tj = 0; tj < tk; tj++) {
            int64_t j0 = tj * 32, j1 = j0 + 32 < k ? j0 + 32 : k;
            float amax = 0.0f;
            for (int64_t i = i0; i < i1; i++)
                for (int64_t j = j0; j < j1; j++) {
                    float a = fabsf(w[i * k + j]);
                    if (a > amax) amax = a;
                }
            uint8_t sb = weight_scale_byte(amax, FP8_MAX_INV);
            s[ti * tk + tj] = sb;
            float sc = e8m0_to_f32(sb);
            for (int64_t i = i0; i < i1; i++)
                for (int64_t j = j0; j < j1; j++) q[i * k + j] = e4m3_from_f32(w[i * k + j] / sc);
        }
    }
}

void quant_fp4_rows(const float *w, int64_t n, int64_t k, uint8_t *q, uint8_t *s) {
    if (k % 32 != 0) ds_die("quant_fp4_rows: k = %lld is not a multiple of 32", (long long)k);
    int64_t nb = k / 32;
    for (int64_t i = 0; i < n; i++) {
        const float *wrow = w + i * k;
        uint8_t *qrow = q + i * (k / 2);
        for (int64_t b = 0; b < nb; b++) {
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) {
                float a = fabsf(wrow[b * 32 + j]);
                if (a > amax) amax = a;
            }
            uint8_t sb = weight_scale_byte(amax, FP4_MAX_INV);
            s[i * nb + b] = sb;
            float sc = e8m0_to_f32(sb);
            for (int j = 0; j < 32; j += 2) {
                uint8_t lo = e2m1_from_f32(clampf(wrow[b * 32 + j] / sc, -6.0f, 6.0f));
                uint8_t hi = e2m1_from_f32(clampf(wrow[b * 32 + j + 1] / sc, -6.0f, 6.0f));
                qrow[(b * 32 + j) / 2] = (uint8_t)(lo | (hi << 4));
            }
        }
    }
}
