/* Unit tests of src/formats.c: the number-format conversions, the three activation QDQ steps and
 * the weight (de)quantizers. The formats must be bit-exact with the reference kernels, so the
 * checks compare bit patterns, not tolerances. Expected values come from three places that share
 * no code with formats.c: an e4m3 decode table generated offline with ml_dtypes (embedded below),
 * hand-derived cases (each with its arithmetic in a comment), and slow nearest-value searches
 * over the whole code tables, written here in a different style (doubles, frexp/ldexp, linear
 * scans with an explicit even-code tie rule) and run against the fast code on random groups. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats.h"

/* ---------------------------------------------------------------------------------------------
 * Helpers */

static float fbits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint32_t bitsf(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static bf16_t bf(float f) { return bf16_from_f32(f); }

/* splitmix64: deterministic, so a failure reproduces. */
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rng_next(void) {
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double rng_unit(void) { return (double)(rng_next() >> 11) * 0x1p-53; }
static int rng_int(int lo, int hi) { return lo + (int)(rng_next() % (uint64_t)(hi - lo + 1)); }

/* OCP e4m3fn decode of all 256 codes as fp32 bit patterns, generated offline by
 * numpy.arange(256, dtype=uint8).view(ml_dtypes.float8_e4m3fn).astype(float32). 0x7F and 0xFF
 * are NaN (only NaN-ness is checked there). */
static const uint32_t e4m3_expected[256] = {
    0x00000000u, 0x3b000000u, 0x3b800000u, 0x3bc00000u, 0x3c000000u, 0x3c200000u, 0x3c400000u, 0x3c600000u,
    0x3c800000u, 0x3c900000u, 0x3ca00000u, 0x3cb00000u, 0x3cc00000u, 0x3cd00000u, 0x3ce00000u, 0x3cf00000u,
    0x3d000000u, 0x3d100000u, 0x3d200000u, 0x3d300000u, 0x3d400000u, 0x3d500000u, 0x3d600000u, 0x3d700000u,
    0x3d800000u, 0x3d900000u, 0x3da00000u, 0x3db00000u, 0x3dc00000u, 0x3dd00000u, 0x3de00000u, 0x3df00000u,
    0x3e000000u, 0x3e100000u, 0x3e200000u, 0x3e300000u, 0x3e400000u, 0x3e500000u, 0x3e600000u, 0x3e700000u,
    0x3e800000u, 0x3e900000u, 0x3ea00000u, 0x3eb00000u, 0x3ec00000u, 0x3ed00000u, 0x3ee00000u, 0x3ef00000u,
    0x3f000000u, 0x3f100000u, 0x3f200000u, 0x3f300000u, 0x3f400000u, 0x3f500000u, 0x3f600000u, 0x3f700000u,
    0x3f800000u, 0x3f900000u, 0x3fa00000u, 0x3fb00000u, 0x3fc00000u, 0x3fd00000u, 0x3fe00000u, 0x3ff00000u,
    0x40000000u, 0x40100000u, 0x40200000u, 0x40300000u, 0x40400000u, 0x40500000u, 0x40600000u, 0x40700000u,
    0x40800000u, 0x40900000u, 0x40a00000u, 0x40b00000u, 0x40c00000u, 0x40d00000u, 0x40e00000u, 0x40f00000u,
    0x41000000u, 0x41100000u, 0x41200000u, 0x41300000u, 0x41400000u, 0x41500000u, 0x41600000u, 0x41700000u,
    0x41800000u, 0x41900000u, 0x41a00000u, 0x41b00000u, 0x41c00000u, 0x41d00000u, 0x41e00000u, 0x41f00000u,
    0x42000000u, 0x42100000u, 0x42200000u, 0x42300000u, 0x42400000u, 0x42500000u, 0x42600000u, 0x42700000u,
    0x42800000u, 0x42900000u, 0x42a00000u, 0x42b00000u, 0x42c00000u, 0x42d00000u, 0x42e00000u, 0x42f00000u,
    0x43000000u, 0x43100000u, 0x43200000u, 0x43300000u, 0x43400000u, 0x43500000u, 0x43600000u, 0x43700000u,
    0x43800000u, 0x43900000u, 0x43a00000u, 0x43b00000u, 0x43c00000u, 0x43d00000u, 0x43e00000u, 0x7fc00000u,
    0x80000000u, 0xbb000000u, 0xbb800000u, 0xbbc00000u, 0xbc000000u, 0xbc200000u, 0xbc400000u, 0xbc600000u,
    0xbc800000u, 0xbc900000u, 0xbca00000u, 0xbcb00000u, 0xbcc00000u, 0xbcd00000u, 0xbce00000u, 0xbcf00000u,
    0xbd000000u, 0xbd100000u, 0xbd200000u, 0xbd300000u, 0xbd400000u, 0xbd500000u, 0xbd600000u, 0xbd700000u,
    0xbd800000u, 0xbd900000u, 0xbda00000u, 0xbdb00000u, 0xbdc00000u, 0xbdd00000u, 0xbde00000u, 0xbdf00000u,
    0xbe000000u, 0xbe100000u, 0xbe200000u, 0xbe300000u, 0xbe400000u, 0xbe500000u, 0xbe600000u, 0xbe700000u,
    0xbe800000u, 0xbe900000u, 0xbea00000u, 0xbeb00000u, 0xbec00000u, 0xbed00000u, 0xbee00000u, 0xbef00000u,
    0xbf000000u, 0xbf100000u, 0xbf200000u, 0xbf300000u, 0xbf400000u, 0xbf500000u, 0xbf600000u, 0xbf700000u,
    0xbf800000u, 0xbf900000u, 0xbfa00000u, 0xbfb00000u, 0xbfc00000u, 0xbfd00000u, 0xbfe00000u, 0xbff00000u,
    0xc0000000u, 0xc0100000u, 0xc0200000u, 0xc0300000u, 0xc0400000u, 0xc0500000u, 0xc0600000u, 0xc0700000u,
    0xc0800000u, 0xc0900000u, 0xc0a00000u, 0xc0b00000u, 0xc0c00000u, 0xc0d00000u, 0xc0e00000u, 0xc0f00000u,
    0xc1000000u, 0xc1100000u, 0xc1200000u, 0xc1300000u, 0xc1400000u, 0xc1500000u, 0xc1600000u, 0xc1700000u,
    0xc1800000u, 0xc1900000u, 0xc1a00000u, 0xc1b00000u, 0xc1c00000u, 0xc1d00000u, 0xc1e00000u, 0xc1f00000u,
    0xc2000000u, 0xc2100000u, 0xc2200000u, 0xc2300000u, 0xc2400000u, 0xc2500000u, 0xc2600000u, 0xc2700000u,
    0xc2800000u, 0xc2900000u, 0xc2a00000u, 0xc2b00000u, 0xc2c00000u, 0xc2d00000u, 0xc2e00000u, 0xc2f00000u,
    0xc3000000u, 0xc3100000u, 0xc3200000u, 0xc3300000u, 0xc3400000u, 0xc3500000u, 0xc3600000u, 0xc3700000u,
    0xc3800000u, 0xc3900000u, 0xc3a00000u, 0xc3b00000u, 0xc3c00000u, 0xc3d00000u, 0xc3e00000u, 0xffc00000u,
};

static float e4m3_ref(uint8_t code) { return fbits(e4m3_expected[code]); }

static const double e2m1_magnitudes[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};

/* ---------------------------------------------------------------------------------------------
 * Slow reference implementations (independent of formats.c) */

/* bf16 by comparing the distances to the two bf16 neighbours in double. */
static bf16_t slow_bf16(float f) {
    if (isnan(f)) return 0x7FC0;
    uint32_t u = bitsf(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    double a = fabs((double)f);
    uint16_t lo = (uint16_t)((bitsf(fabsf(f)) >> 16) & 0x7FFFu); /* truncation toward zero */
    if (lo == 0x7F80) return (uint16_t)(sign | lo); /* infinity */
    uint16_t hi = (uint16_t)(lo + 1);
    double lo_v = (double)bf16_to_f32(lo);
    double hi_v = hi == 0x7F80 ? ldexp(1.0, 128) : (double)bf16_to_f32(hi);
    double dl = a - lo_v, dh = hi_v - a;
    uint16_t m = dl < dh ? lo : dh < dl ? hi : ((lo & 1) ? hi : lo);
    return (uint16_t)(sign | m);
}

/* e4m3 by scanning all 127 finite magnitudes; ties go to the even code, and anything beyond the
 * largest finite value saturates (satfinite). */
static uint8_t slow_e4m3(float f) {
    if (isnan(f)) return 0x7F;
    double a = fabs((double)f);
    uint8_t best = 0x7E;
    if (a <= 448.0) {
        double best_d = INFINITY;
        for (int c = 0; c <= 0x7E; c++) {
            double d = fabs((double)e4m3_ref((uint8_t)c) - a);
            if (d < best_d || (d == best_d && (c & 1) == 0)) {
                best_d = d;
                best = (uint8_t)c;
            }
        }
    }
    return (uint8_t)(best | (signbit(f) ? 0x80 : 0));
}

/* e2m1 by scanning the 8 magnitudes with the same even-code tie rule. */
static uint8_t slow_e2m1(float f) {
    double a = fabs((double)f);
    int best = 0;
    double best_d = INFINITY;
    for (int c = 0; c < 8; c++) {
        double d = fabs(e2m1_magnitudes[c] - a);
        if (d < best_d || (d == best_d && (c & 1) == 0)) {
            best_d = d;
            best = c;
        }
    }
    return (uint8_t)(best | (signbit(f) ? 8 : 0));
}

static float slow_e2m1_value(uint8_t code) {
    double m = e2m1_magnitudes[code & 7];
    return (float)((code & 8) ? -m : m);
}

/* 2^ceil(log2(t)) for a normal positive t, through frexpf: t = m * 2^e with m in [0.5, 1), so t
 * is a power of two exactly when m == 0.5. */
static float slow_pow2_ceil(float t) {
    int e;
    float m = frexpf(t, &e);
    return m == 0.5f ? ldexpf(1.0f, e - 1) : ldexpf(1.0f, e);
}

static float slow_amax(const bf16_t *x, int n) {
    double m = 0.0;
    for (int i = 0; i < n; i++) m = fmax(m, fabs((double)bf16_to_f32(x[i])));
    return (float)m;
}

static float slow_clamp(float v, float lim) { return v > lim ? lim : v < -lim ? -lim : v; }

static void slow_qdq_fp8_32(bf16_t *x, uint8_t *q, float *s_out) {
    float amax = fmaxf(slow_amax(x, 32), 1e-4f);
    float s = slow_pow2_ceil(amax * (float)(1.0 / 448.0));
    *s_out = s;
    for (int i = 0; i < 32; i++) {
        q[i] = slow_e4m3(slow_clamp(bf16_to_f32(x[i]) / s, 448.0f));
        x[i] = slow_bf16(e4m3_ref(q[i]) * s);
    }
}

static void slow_qdq_fp4_32(bf16_t *x) {
    float amax = fmaxf(slow_amax(x, 32), ldexpf(6.0f, -126));
    float s = slow_pow2_ceil(amax * (float)(1.0 / 6.0));
    for (int i = 0; i < 32; i++) {
        uint8_t c = slow_e2m1(slow_clamp(bf16_to_f32(x[i]) / s, 6.0f));
        x[i] = slow_bf16(slow_e2m1_value(c) * s);
    }
}

static void slow_qdq_fp4_16(bf16_t *x) {
    float amax = fmaxf(slow_amax(x, 16), ldexpf(6.0f, -9));
    float s = e4m3_ref(slow_e4m3(amax / 6.0f));
    for (int i = 0; i < 16; i++) {
        uint8_t c = slow_e2m1(slow_clamp(bf16_to_f32(x[i]) / s, 6.0f));
        x[i] = slow_bf16(slow_e2m1_value(c) * s);
    }
}

/* Random bf16 groups that stress the interesting regions: wide dynamic range, exact grid points
 * (hence exact ties after scaling), amax at exact format maxima, groups below the amax clamps,
 * arbitrary bit patterns (subnormals included), and single outliers. */
static bf16_t random_finite_bf16(void) {
    for (;;) {
        bf16_t h = (bf16_t)rng_next();
        if ((h & 0x7F80) != 0x7F80) return h;
    }
}

static void random_group(bf16_t *x, int n, int kind_hint) {
    int kind = kind_hint >= 0 ? kind_hint : rng_int(0, 6);
    int e = rng_int(-30, 30);
    switch (kind) {
    case 0: /* smooth values, one magnitude per group */
        for (int i = 0; i < n; i++) {
            double g = rng_unit() + rng_unit() + rng_unit() - 1.5;
            x[i] = bf((float)ldexp(g, e));
        }
        break;
    case 1: /* quarter-integer grid: ties of e2m1 and e4m3 after a power-of-two scale */
        for (int i = 0; i < n; i++) x[i] = bf((float)ldexp(rng_int(-24, 24) * 0.25, e));
        break;
    case 2: /* amax exactly at a format maximum times a power of two */
        for (int i = 0; i < n; i++) x[i] = bf((float)ldexp(rng_unit() * 2.0 - 1.0, e));
        x[rng_int(0, n - 1)] = bf((float)ldexp(rng_int(0, 1) ? 448.0 : 6.0, e));
        break;
    case 3: /* tiny groups, below the amax clamps */
        for (int i = 0; i < n; i++) x[i] = bf((float)ldexp(rng_unit() * 2.0 - 1.0, rng_int(-140, -10)));
        break;
    case 4: /* arbitrary finite bit patterns */
        for (int i = 0; i < n; i++) x[i] = random_finite_bf16();
        break;
    case 5: /* one outlier, zeros and signed zeros elsewhere */
        for (int i = 0; i < n; i++) x[i] = (rng_next() & 1) ? 0x8000 : 0x0000;
        x[rng_int(0, n - 1)] = bf((float)ldexp(rng_unit() * 2.0 - 1.0, e));
        break;
    default: /* e4m3-representable multiples: ties of the fp4 path with e4m3 scales */
        for (int i = 0; i < n; i++) x[i] = bf(e4m3_ref((uint8_t)rng_int(0, 0x7E)) * (float)rng_int(-6, 6) * 0.25f);
        break;
    }
}

/* ---------------------------------------------------------------------------------------------
 * bf16 */

static void test_bf16_cases(void **state) {
    (void)state;
    static const struct {
        uint32_t in;
        uint16_t out;
    } cases[] = {
        {0x3F800000u, 0x3F80}, /* 1.0 */
        {0x3F808000u, 0x3F80}, /* exact tie, lower neighbour even: down */
        {0x3F818000u, 0x3F82}, /* exact tie, lower neighbour odd: up */
        {0xBF818000u, 0xBF82}, /* the same with a sign */
        {0xBF808000u, 0xBF80},
        {0x3F808001u, 0x3F81}, /* just above a tie */
        {0x3F807FFFu, 0x3F80}, /* just below a tie */
        {0x3FFF8000u, 0x4000}, /* tie that carries into the exponent */
        {0x7F7FFFFFu, 0x7F80}, /* FLT_MAX overflows to +inf */
        {0x7F7F8000u, 0x7F80}, /* tie at the top, odd neighbour: inf */
        {0x7F7F7FFFu, 0x7F7F}, /* just below: largest finite bf16 */
        {0xFF7FFFFFu, 0xFF80}, /* -FLT_MAX to -inf */
        {0x7F800000u, 0x7F80}, /* +inf */
        {0xFF800000u, 0xFF80}, /* -inf */
        {0x80000000u, 0x8000}, /* -0 keeps its sign */
        {0x00000000u, 0x0000},
        {0x00008000u, 0x0000}, /* subnormal tie to even (zero) */
        {0x00018000u, 0x0002}, /* subnormal tie to even (up) */
        {0x00000001u, 0x0000}, /* smallest subnormal underflows */
        {0x80000001u, 0x8000}, /* to a signed zero */
        {0x007FFFFFu, 0x0080}, /* largest subnormal rounds up to the smallest normal */
        {0x80018000u, 0x8002},
        {0x00010000u, 0x0001}, /* exact subnormal */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint16_t got = bf16_from_f32(fbits(cases[i].in));
        if (got != cases[i].out) fail_msg("bf16_from_f32(0x%08x) = 0x%04x, want 0x%04x", cases[i].in, got, cases[i].out);
    }
    /* NaNs stay NaN and quiet, including payloads a truncation would turn into inf or a zero. */
    static const uint32_t nans[] = {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu, 0x7F80FFFFu};
    for (size_t i = 0; i < sizeof nans / sizeof nans[0]; i++) {
        uint16_t h = bf16_from_f32(fbits(nans[i]));
        assert_true(isnan(bf16_to_f32(h)));
        assert_int_equal(h & 0x0040, 0x0040);
    }
    assert_true(signbit(bf16_to_f32(0x8000)));
    assert_true(bf16_round(1.00390625f) == 1.0f); /* 1 + 2^-8: tie, stays at 1 */
}

static void test_bf16_exhaustive_roundtrip(void **state) {
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = bf16_to_f32((bf16_t)h);
        assert_int_equal(bitsf(f), h << 16);
        if (isnan(f)) {
            assert_true(isnan(bf16_to_f32(bf16_from_f32(f))));
            continue;
        }
        if (bf16_from_f32(f) != h) fail_msg("bf16 0x%04x does not round-trip (got 0x%04x)", h, bf16_from_f32(f));
    }
}

static void test_bf16_vs_slow(void **state) {
    (void)state;
    /* Around every bf16 value: its tie point and both neighbours of the tie. */
    for (uint32_t h = 0; h < 65536; h++) {
        static const uint32_t low_parts[] = {0x0000, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x0001};
        for (size_t j = 0; j < 6; j++) {
            uint32_t u = (h << 16) | low_parts[j];
            float f = fbits(u);
            if (isnan(f)) continue;
            if (bf16_from_f32(f) != slow_bf16(f))
                fail_msg("bf16_from_f32(0x%08x) = 0x%04x, slow 0x%04x", u, bf16_from_f32(f), slow_bf16(f));
        }
    }
    for (int i = 0; i < 1000000; i++) {
        uint32_t u = (uint32_t)rng_next();
        float f = fbits(u);
        if (isnan(f)) continue;
        if (bf16_from_f32(f) != slow_bf16(f))
            fail_msg("bf16_from_f32(0x%08x) = 0x%04x, slow 0x%04x", u, bf16_from_f32(f), slow_bf16(f));
    }
}

/* ---------------------------------------------------------------------------------------------
 * e4m3 */

static void test_e4m3_decode_all(void **state) {
    (void)state;
    for (int c = 0; c < 256; c++) {
        float v = e4m3_to_f32((uint8_t)c);
        if ((c & 0x7F) == 0x7F) {
            assert_true(isnan(v));
            continue;
        }
        if (bitsf(v) != e4m3_expected[c]) fail_msg("e4m3 0x%02x -> 0x%08x, want 0x%08x", c, bitsf(v), e4m3_expected[c]);
    }
    /* Anchors of the format, by hand: max, smallest normal, smallest subnormal. */
    assert_true(e4m3_to_f32(0x7E) == 448.0f);
    assert_true(e4m3_to_f32(0xFE) == -448.0f);
    assert_true(e4m3_to_f32(0x08) == 0x1p-6f);
    assert_true(e4m3_to_f32(0x01) == 0x1p-9f);
    assert_true(e4m3_to_f32(0x07) == 7 * 0x1p-9f);
    assert_true(e4m3_to_f32(0x38) == 1.0f);
    assert_true(signbit(e4m3_to_f32(0x80)) && e4m3_to_f32(0x80) == 0.0f);
}

static void test_e4m3_encode_roundtrip(void **state) {
    (void)state;
    for (int c = 0; c < 256; c++) {
        if ((c & 0x7F) == 0x7F) continue;
        uint8_t got = e4m3_from_f32(e4m3_ref((uint8_t)c));
        if (got != c) fail_msg("e4m3 value of 0x%02x encodes to 0x%02x", c, got);
    }
}

static void test_e4m3_encode_midpoints(void **state) {
    (void)state;
    for (int sign = 0; sign < 2; sign++) {
        for (int c = 0; c < 0x7E; c++) {
            uint8_t lo = (uint8_t)(c | (sign << 7)), hi = (uint8_t)((c + 1) | (sign << 7));
            float mid = (e4m3_ref(lo) + e4m3_ref(hi)) * 0.5f; /* exact: few significant bits */
            uint8_t even = (c & 1) ? hi : lo;
            if (e4m3_from_f32(mid) != even) fail_msg("tie %g -> 0x%02x, want 0x%02x", (double)mid, e4m3_from_f32(mid), even);
            float toward_zero = nextafterf(mid, 0.0f), away = nextafterf(mid, sign ? -INFINITY : INFINITY);
            if (e4m3_from_f32(toward_zero) != lo) fail_msg("below tie %a -> 0x%02x", (double)toward_zero, e4m3_from_f32(toward_zero));
            if (e4m3_from_f32(away) != hi) fail_msg("above tie %a -> 0x%02x", (double)away, e4m3_from_f32(away));
        }
    }
}

static void test_e4m3_encode_saturation_nan(void **state) {
    (void)state;
    static const float big[] = {448.0f, 448.5f, 463.9f, 464.0f, 464.1f, 480.0f, 512.0f, 1e6f, 1e30f, FLT_MAX, INFINITY};
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
        assert_int_equal(e4m3_from_f32(big[i]), 0x7E);
        assert_int_equal(e4m3_from_f32(-big[i]), 0xFE);
    }
    assert_int_equal(e4m3_from_f32(NAN), 0x7F);
    assert_int_equal(e4m3_from_f32(-NAN), 0x7F);
    assert_int_equal(e4m3_from_f32(fbits(0x7F800001u)), 0x7F);
    /* The last step below the maximum: 416 (0x7D, odd) and 448 (0x7E) tie at 432, to 448. */
    assert_int_equal(e4m3_from_f32(432.0f), 0x7E);
    assert_int_equal(e4m3_from_f32(431.9f), 0x7D);
    assert_int_equal(e4m3_from_f32(-431.0f), 0xFD);
    assert_int_equal(e4m3_from_f32(-432.0f), 0xFE);
}

static void test_e4m3_encode_subnormal(void **state) {
    (void)state;
    /* Subnormal codes are m * 2^-9, m = 0..7; 8 * 2^-9 = 2^-6 is the smallest normal (code 0x08). */
    assert_int_equal(e4m3_from_f32(0x1p-10f), 0x00); /* tie 0 / 1: even is 0 */
    assert_int_equal(e4m3_from_f32(nextafterf(0x1p-10f, 1.0f)), 0x01);
    assert_int_equal(e4m3_from_f32(3 * 0x1p-10f), 0x02); /* tie 1 / 2 */
    assert_int_equal(e4m3_from_f32(5 * 0x1p-10f), 0x02); /* tie 2 / 3 */
    assert_int_equal(e4m3_from_f32(7 * 0x1p-10f), 0x04); /* tie 3 / 4 */
    assert_int_equal(e4m3_from_f32(13 * 0x1p-10f), 0x06); /* tie 6 / 7 */
    assert_int_equal(e4m3_from_f32(15 * 0x1p-10f), 0x08); /* tie 7 / smallest normal */
    assert_int_equal(e4m3_from_f32(nextafterf(15 * 0x1p-10f, 0.0f)), 0x07);
    assert_int_equal(e4m3_from_f32(0x1p-6f * 1.0625f), 0x08); /* first normal tie: 8 / 9 */
    assert_int_equal(e4m3_from_f32(1e-30f), 0x00);
    assert_int_equal(e4m3_from_f32(fbits(1)), 0x00);
    assert_int_equal(e4m3_from_f32(-1e-30f), 0x80); /* the sign survives underflow */
    assert_int_equal(e4m3_from_f32(-0.0f), 0x80);
    assert_int_equal(e4m3_from_f32(-3 * 0x1p-10f), 0x82);
    assert_int_equal(e4m3_from_f32(-0.3f), 0xAA); /* 0.3 between 0.28125 and 0.3125: 0.3125 = 0x2A */
}

static void test_e4m3_encode_vs_slow(void **state) {
    (void)state;
    /* A strided sweep over every fp32 pattern from 0 to 512, both signs. */
    for (uint32_t u = 0; u <= 0x44000000u; u += 997) {
        for (int sign = 0; sign < 2; sign++) {
            float f = fbits(u | ((uint32_t)sign << 31));
            if (e4m3_from_f32(f) != slow_e4m3(f))
                fail_msg("e4m3_from_f32(%a) = 0x%02x, slow 0x%02x", (double)f, e4m3_from_f32(f), slow_e4m3(f));
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * e8m0, e2m1, scales */

static void test_e8m0(void **state) {
    (void)state;
    assert_int_equal(bitsf(e8m0_to_f32(0)), 0x00400000u); /* 2^-127, a subnormal */
    assert_true(e8m0_to_f32(0) == ldexpf(1.0f, -127));
    assert_int_equal(bitsf(e8m0_to_f32(1)), 0x00800000u);
    assert_true(e8m0_to_f32(127) == 1.0f);
    assert_true(e8m0_to_f32(128) == 2.0f);
    assert_true(e8m0_to_f32(0x73) == 0x1p-12f);
    assert_true(e8m0_to_f32(254) == 0x1p127f);
    assert_true(isnan(e8m0_to_f32(255)));
}

static void test_e2m1_decode(void **state) {
    (void)state;
    static const float want[16] = {0, .5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -.5f, -1, -1.5f, -2, -3, -4, -6};
    for (int c = 0; c < 16; c++) {
        assert_int_equal(bitsf(e2m1_to_f32((uint8_t)c)), bitsf(want[c]));
        assert_int_equal(e2m1_from_f32(want[c]), c);
    }
}

static void test_e2m1_ties(void **state) {
    (void)state;
    static const struct {
        float x;
        uint8_t code;
    } cases[] = {
        {0.25f, 0}, /* 0 / 0.5: down */
        {0.75f, 2}, /* 0.5 / 1: up */
        {1.25f, 2}, /* 1 / 1.5: down */
        {1.75f, 4}, /* 1.5 / 2: up */
        {2.5f, 4},  /* 2 / 3: down */
        {3.5f, 6},  /* 3 / 4: up */
        {5.0f, 6},  /* 4 / 6: down */
        {0.2f, 0},    {0.3f, 1},  {0.74f, 1}, {0.76f, 2}, {1.3f, 3}, {1.7f, 3}, {2.4f, 4},
        {2.6f, 5},    {3.4f, 5},  {3.6f, 6},  {4.9f, 6},  {5.1f, 7}, {6.0f, 7},
        {-0.25f, 8},  {-0.75f, 10}, {-1.25f, 10}, {-1.75f, 12}, {-2.5f, 12}, {-3.5f, 14}, {-5.0f, 14},
        {-6.0f, 15},  {-0.0f, 8}, {0.0f, 0},  {-0.1f, 8},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint8_t got = e2m1_from_f32(cases[i].x);
        if (got != cases[i].code) fail_msg("e2m1_from_f32(%g) = %u, want %u", (double)cases[i].x, got, cases[i].code);
    }
    /* The boundaries' float neighbours. */
    static const float mids[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    for (int i = 0; i < 7; i++) {
        assert_int_equal(e2m1_from_f32(nextafterf(mids[i], 0.0f)), i);
        assert_int_equal(e2m1_from_f32(nextafterf(mids[i], 7.0f)), i + 1);
    }
    /* Every fp32 in [0, 6], strided, against the scan. */
    for (uint32_t u = 0; u <= 0x40C00000u; u += 1009) {
        float f = fbits(u);
        assert_int_equal(e2m1_from_f32(f), slow_e2m1(f));
        assert_int_equal(e2m1_from_f32(-f), slow_e2m1(-f));
    }
}

static void test_round_scale_pow2(void **state) {
    (void)state;
    const float inv448 = (float)(1.0 / 448.0), inv6 = (float)(1.0 / 6.0);
    assert_int_equal(bitsf(inv448), 0x3B124925u); /* the literal the reference uses */
    assert_int_equal(bitsf(inv6), 0x3E2AAAABu);
    assert_true(ds_round_scale_pow2(448.0f, inv448) == 1.0f);
    assert_true(ds_round_scale_pow2(449.0f, inv448) == 2.0f);
    assert_true(ds_round_scale_pow2(447.0f, inv448) == 1.0f);
    assert_true(ds_round_scale_pow2(1.0f, inv448) == 0x1p-8f); /* 1/448 = 2^-8.8 */
    assert_true(ds_round_scale_pow2(1e-4f, inv448) == 0x1p-22f);
    for (int k = -100; k <= 100; k++) /* amax exactly at the maximum keeps its power */
        assert_true(ds_round_scale_pow2(ldexpf(448.0f, k), inv448) == ldexpf(1.0f, k));
    assert_true(ds_round_scale_pow2(6.0f, inv6) == 1.0f);
    assert_true(ds_round_scale_pow2(7.0f, inv6) == 2.0f);
    assert_true(ds_round_scale_pow2(3.0f, inv6) == 0.5f);
    assert_true(ds_round_scale_pow2(12.0f, inv6) == 2.0f);
    assert_true(ds_round_scale_pow2(ldexpf(6.0f, -126), inv6) == 0x1p-126f);
    assert_true(ds_round_scale_pow2(1.5f, 1.0f) == 2.0f);
    assert_true(ds_round_scale_pow2(0.75f, 1.0f) == 1.0f);
    assert_true(ds_round_scale_pow2(1.0f, 1.0f) == 1.0f);
    assert_true(ds_round_scale_pow2(nextafterf(1.0f, 2.0f), 1.0f) == 2.0f);
    assert_int_equal(bitsf(ds_round_scale_pow2(FLT_MAX, 1.0f)), 0x7F800000u); /* 2^128 -> inf bits */
    for (int i = 0; i < 200000; i++) {
        float amax = (float)ldexp(rng_unit() + 0.5, rng_int(-100, 100));
        float inv = rng_next() & 1 ? inv448 : inv6;
        float got = ds_round_scale_pow2(amax, inv), want = slow_pow2_ceil(amax * inv);
        if (bitsf(got) != bitsf(want)) fail_msg("scale(%a) = %a, want %a", (double)amax, (double)got, (double)want);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Activation QDQ: hand-derived cases */

static void fill_group(bf16_t *x, int n, const float *v, int nv) {
    for (int i = 0; i < n; i++) x[i] = i < nv ? bf(v[i]) : 0;
}

static void expect_bf16(const bf16_t *got, const uint16_t *want, int n, const char *what) {
    for (int i = 0; i < n; i++)
        if (got[i] != want[i]) fail_msg("%s: element %d = 0x%04x, want 0x%04x", what, i, got[i], want[i]);
}

/* No fp8 or fp4/32 case below reaches the ±448 / ±6 clamps: for every bf16 amax the
 * exponent-bit scale equals the exact 2^ceil(log2(amax/max)) (checked offline over all bf16
 * values), so |x/s| never exceeds the maximum. Saturation is exercised by fp4/16, whose e4m3
 * scale can round down, and by the e4m3 encoder tests. */
static void test_qdq_fp8_hand(void **state) {
    (void)state;
    bf16_t x[64];
    uint8_t q[64];
    float s[2];

    /* amax 1792 = 448 * 4 stays at scale 4 exactly. Then, over 4: 4.25 -> 1.0625, a tie between
     * 1 and 1.125, to the even 1 -> 4; 4.75 -> 1.1875, tie 1.125/1.25 -> 1.25 -> 5; 2^-7 -> 2^-9,
     * the smallest subnormal; 2^-8 -> 2^-10, tie 0/2^-9 -> +0; -3*2^-8 -> -1.5*2^-9, tie -> -2^-8,
     * times 4 = -2^-6; 1000 -> 250, step 16 -> 256 -> 1024; 1700 is bf16 1696 -> 424, step 32
     * -> 416 -> 1664. Signed zeros keep their signs. */
    const float a[] = {1792, -1792, 4.25f, 4.75f, 1.0f, 0.0f, -0.0f, 0x1p-7f, 0x1p-8f, -3 * 0x1p-8f, 1000, 1700};
    const uint16_t a_want[] = {0x44e0, 0xc4e0, 0x4080, 0x40a0, 0x3f80, 0x0000,
                               0x8000, 0x3c00, 0x0000, 0xbc80, 0x4480, 0x44d0};
    const uint8_t a_codes[] = {0x7E, 0xFE, 0x38, 0x3A, 0x28, 0x00, 0x80, 0x01, 0x00, 0x82, 0x78, 0x7D};
    fill_group(x, 32, a, 12);
    /* The second group: amax 1.0 -> scale 2^-8 (1/448 = 2^-8.8). 0.3 is bf16 0.30078125 -> 77,
     * step 8 -> 80 -> 0.3125; 0.001 (bf16 0.00099945) -> 0.256, step 1/32 -> 0.25 -> 2^-10;
     * -0.99 (bf16 -0.98828125) -> -253, step 16 -> -256 -> -1. */
    const float b[] = {1.0f, 0.3f, -0.3f, 0.0625f, 0.001f, -0.99f};
    const uint16_t b_want[] = {0x3f80, 0x3ea0, 0xbea0, 0x3d80, 0x3a80, 0xbf80};
    fill_group(x + 32, 32, b, 6);

    act_quant_fp8_32(x, 64, q, s);
    assert_true(s[0] == 4.0f);
    assert_true(s[1] == 0x1p-8f);
    assert_memory_equal(q, a_codes, sizeof a_codes);
    for (int i = 12; i < 32; i++) assert_int_equal(q[i], 0);
    qdq_fp8_32(x, 64);
    expect_bf16(x, a_want, 12, "fp8 exact-power group");
    expect_bf16(x + 32, b_want, 6, "fp8 amax-1 group");
    for (int i = 12; i < 32; i++) assert_int_equal(x[i], 0);

    /* Tiny amax: max |x| = 5e-5 is clamped to 1e-4 -> scale 2^-22 (1e-4/448 = 2^-22.09). 1e-6
     * (bf16 0x3586) * 2^22 = 4.19 -> 4 -> 0x3580; -5e-5 (0xb852) -> -209.7, step 16 -> -208 ->
     * 0xb850; 3e-5 (0x37fc) -> 126.9, step 8 -> 128 -> 2^-15 = 0x3800. */
    const float c[] = {1e-6f, -5e-5f, 3e-5f};
    const uint16_t c_want[] = {0x3580, 0xb850, 0x3800, 0x0000};
    fill_group(x, 32, c, 3);
    act_quant_fp8_32(x, 32, q, s);
    assert_true(s[0] == 0x1p-22f);
    qdq_fp8_32(x, 32);
    expect_bf16(x, c_want, 4, "fp8 tiny group");

    /* All zeros (either sign): scale from the clamp, values unchanged. */
    for (int i = 0; i < 32; i++) x[i] = (i & 1) ? 0x8000 : 0x0000;
    qdq_fp8_32(x, 32);
    for (int i = 0; i < 32; i++) assert_int_equal(x[i], (i & 1) ? 0x8000 : 0x0000);

    /* Far from 1: amax 448 * 2^100 keeps scale 2^100; -1.3 * 2^100 is bf16 -1.296875 * 2^100,
     * over the scale -1.296875, step 1/8 -> -1.25 -> 0xf1a0; 2^90 -> 2^-10, tie with 0 -> 0. */
    const float d[] = {448.0f * 0x1p100f, -1.3f * 0x1p100f, 0x1p90f};
    const uint16_t d_want[] = {0x75e0, 0xf1a0, 0x0000};
    fill_group(x, 32, d, 3);
    qdq_fp8_32(x, 32);
    expect_bf16(x, d_want, 3, "fp8 2^100 group");

    /* Exactly 448 stays, with scale 1 (not 2); 432 is the 416/448 tie, to the even 448. */
    const float e[] = {448.0f, -448.0f, 416.0f, 432.0f, 424.0f};
    const uint16_t e_want[] = {0x43e0, 0xc3e0, 0x43d0, 0x43e0, 0x43d0};
    fill_group(x, 32, e, 5);
    act_quant_fp8_32(x, 32, q, s);
    assert_true(s[0] == 1.0f);
    qdq_fp8_32(x, 32);
    expect_bf16(x, e_want, 5, "fp8 amax-448 group");
}

static void test_qdq_fp4_32_hand(void **state) {
    (void)state;
    bf16_t x[32];
    /* amax 6 -> scale 1 (6 * fp32(1/6) rounds to exactly 1). Every e2m1 boundary, both signs:
     * up only at 0.75, 1.75, 3.5. */
    const float a[] = {6, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5, -0.25f, -0.75f, -1.25f, -1.75f,
                       -2.5f, -3.5f, -5, 0.0f, -0.0f, 0.2f, 0.3f, -0.3f, -6, 5.5f, 4.5f};
    const float a_want[] = {6, 0, 1, 1, 2, 2, 4, 4, -0.0f, -1, -1, -2, -2, -4, -4, 0, -0.0f, 0, 0.5f, -0.5f, -6, 6, 4};
    fill_group(x, 32, a, 23);
    qdq_fp4_32_ue8m0(x, 32);
    for (int i = 0; i < 23; i++)
        if (x[i] != bf(a_want[i])) fail_msg("fp4/32 ties: element %d = 0x%04x, want %g", i, x[i], (double)a_want[i]);

    /* The same ties at scale 2: amax 12 -> 2; 1.5 -> 0.75 -> 1 -> 2; 2.5 -> 1.25 -> 1 -> 2;
     * 7 -> 3.5 -> 4 -> 8. */
    const float b[] = {12, 1.5f, 2.5f, 7, -3.5f, 10};
    const float b_want[] = {12, 2, 2, 8, -4, 8};
    fill_group(x, 32, b, 6);
    qdq_fp4_32_ue8m0(x, 32);
    for (int i = 0; i < 6; i++)
        if (x[i] != bf(b_want[i])) fail_msg("fp4/32 scale 2: element %d = 0x%04x, want %g", i, x[i], (double)b_want[i]);

    /* amax 7 is not a power-of-two multiple of 6: scale 2, so 7 itself goes to 3.5 -> 4 -> 8;
     * -1.4 (bf16 -1.3984375) -> -0.699 -> -0.5 -> -1; 0.6 -> 0.3 -> 0.5 -> 1. */
    const float c[] = {7, 3, -1.4f, 0.6f};
    const float c_want[] = {8, 3, -1, 1};
    fill_group(x, 32, c, 4);
    qdq_fp4_32_ue8m0(x, 32);
    for (int i = 0; i < 4; i++) assert_int_equal(x[i], bf(c_want[i]));

    /* Below the clamp: amax is raised to 6 * 2^-126, scale 2^-126. 2^-127 -> 0.5 stays;
     * 3 * 2^-129 -> 0.375 -> 0.5 -> 2^-127; -2^-130 -> -1/16 -> -0; 1e-39 (bf16 11 * 2^-133) ->
     * 11/128 -> +0. */
    const uint16_t d_in[] = {0x0040, 0x0030, 0x8008, 0x000b};
    const uint16_t d_want[] = {0x0040, 0x0040, 0x8000, 0x0000};
    memset(x, 0, sizeof x);
    memcpy(x, d_in, sizeof d_in);
    qdq_fp4_32_ue8m0(x, 32);
    expect_bf16(x, d_want, 4, "fp4/32 tiny group");

    for (int i = 0; i < 32; i++) x[i] = (i & 1) ? 0x8000 : 0x0000;
    qdq_fp4_32_ue8m0(x, 32);
    for (int i = 0; i < 32; i++) assert_int_equal(x[i], (i & 1) ? 0x8000 : 0x0000);
}

static void test_qdq_fp4_16_hand(void **state) {
    (void)state;
    bf16_t x[32];
    /* Two groups of 16 in one call, each with its own scale. First: amax 6 -> 6/6 = 1 -> scale 1,
     * the boundary ties. Second: amax 9 -> 1.5 (an e4m3 value, not a power of two): 1.125 ->
     * 0.75 -> 1 -> 1.5; 2 -> 1.333 -> 1.5 -> 2.25; -4.6 (bf16 -4.59375) -> -3.0625 -> -3 -> -4.5. */
    const float a[] = {6, 0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5, -0.75f, -1.75f, -3.5f, -0.0f};
    const float a_want[] = {6, 0, 1, 1, 2, 2, 4, 4, -1, -2, -4, -0.0f};
    const float b[] = {9, 1.125f, -1.125f, 2.0f, -4.6f};
    const float b_want[] = {9, 1.5f, -1.5f, 2.25f, -4.5f};
    fill_group(x, 16, a, 12);
    fill_group(x + 16, 16, b, 5);
    qdq_fp4_16_e4m3(x, 32);
    for (int i = 0; i < 12; i++)
        if (x[i] != bf(a_want[i])) fail_msg("fp4/16 ties: element %d = 0x%04x, want %g", i, x[i], (double)a_want[i]);
    for (int i = 0; i < 5; i++)
        if (x[16 + i] != bf(b_want[i])) fail_msg("fp4/16 scale 1.5: element %d = 0x%04x", i, x[16 + i]);

    /* Division, not multiplication by the reciprocal: amax 11.25 -> scale 1.875. 2.34375 / 1.875
     * is exactly the tie 1.25 (-> 1 -> 1.875), while 2.34375 * fp32(1/1.875) = 1.2500001 would
     * give 1.5 -> 2.8125. Likewise 4.6875 -> 2.5 -> 2 -> 3.75 and 9.375 -> 5 -> 4 -> 7.5. */
    const float c[] = {11.25f, 2.34375f, 4.6875f, 9.375f, -2.34375f, 1.0f};
    const float c_want[] = {11.25f, 1.875f, 3.75f, 7.5f, -1.875f, 0.9375f};
    fill_group(x, 16, c, 6);
    qdq_fp4_16_e4m3(x, 16);
    for (int i = 0; i < 6; i++)
        if (x[i] != bf(c_want[i])) fail_msg("fp4/16 division: element %d = 0x%04x, want %g", i, x[i], (double)c_want[i]);

    /* Saturation of the value: amax 6.375 -> 1.0625, an e4m3 tie that goes down to 1, so 6.375
     * over the scale exceeds 6 and clamps to 6. */
    const float d[] = {6.375f, -6.375f, 0.75f, 3.1f};
    const float d_want[] = {6, -6, 1, 3};
    fill_group(x, 16, d, 4);
    qdq_fp4_16_e4m3(x, 16);
    for (int i = 0; i < 4; i++) assert_int_equal(x[i], bf(d_want[i]));

    /* Saturation of the scale: 6000 is bf16 6016, /6 > 448 -> scale 448; 6016/448 -> clamps to
     * 6 -> 2688; -3000 (bf16 -3008) -> -6.7 -> -2688; 100 -> 0.22 -> 0. */
    const float e[] = {6000, 448, 100, -3000};
    const float e_want[] = {2688, 448, 0, -2688};
    fill_group(x, 16, e, 4);
    qdq_fp4_16_e4m3(x, 16);
    for (int i = 0; i < 4; i++) assert_int_equal(x[i], bf(e_want[i]));

    /* Below the clamp: amax raised to 6 * 2^-9, scale 2^-9 (the smallest e4m3 subnormal).
     * 0.75 * 2^-9 -> 1 -> 2^-9; -2^-10 -> -0.5 stays; 0.001 (bf16 0x3a83) -> 0.51 -> 0.5 -> 2^-10. */
    const uint16_t f_in[] = {0x3b00, 0x3ac0, 0xba80, 0x3a83};
    const uint16_t f_want[] = {0x3b00, 0x3b00, 0xba80, 0x3a80};
    memset(x, 0, sizeof x);
    memcpy(x, f_in, sizeof f_in);
    qdq_fp4_16_e4m3(x, 16);
    expect_bf16(x, f_want, 4, "fp4/16 tiny group");

    for (int i = 0; i < 16; i++) x[i] = (i & 1) ? 0x8000 : 0x0000;
    qdq_fp4_16_e4m3(x, 16);
    for (int i = 0; i < 16; i++) assert_int_equal(x[i], (i & 1) ? 0x8000 : 0x0000);
}

/* ---------------------------------------------------------------------------------------------
 * Activation QDQ: randomized cross-check against the slow versions */

#define RANDOM_GROUPS 100000

static void test_qdq_fp8_random(void **state) {
    (void)state;
    bf16_t x[32], fast[32], slow[32];
    uint8_t q[32], slow_q[32];
    float s, slow_s;
    for (int g = 0; g < RANDOM_GROUPS; g++) {
        random_group(x, 32, -1);
        memcpy(fast, x, sizeof x);
        memcpy(slow, x, sizeof x);
        qdq_fp8_32(fast, 32);
        slow_qdq_fp8_32(slow, slow_q, &slow_s);
        act_quant_fp8_32(x, 32, q, &s);
        if (bitsf(s) != bitsf(slow_s)) fail_msg("fp8 group %d: scale %a, slow %a", g, (double)s, (double)slow_s);
        for (int i = 0; i < 32; i++) {
            if (q[i] != slow_q[i]) fail_msg("fp8 group %d elem %d (0x%04x): code 0x%02x, slow 0x%02x", g, i, x[i], q[i], slow_q[i]);
            if (fast[i] != slow[i]) fail_msg("fp8 group %d elem %d (0x%04x): 0x%04x, slow 0x%04x", g, i, x[i], fast[i], slow[i]);
        }
    }
}

static void test_qdq_fp4_32_random(void **state) {
    (void)state;
    bf16_t x[32], fast[32], slow[32];
    for (int g = 0; g < RANDOM_GROUPS; g++) {
        random_group(x, 32, -1);
        memcpy(fast, x, sizeof x);
        memcpy(slow, x, sizeof x);
        qdq_fp4_32_ue8m0(fast, 32);
        slow_qdq_fp4_32(slow);
        for (int i = 0; i < 32; i++)
            if (fast[i] != slow[i]) fail_msg("fp4/32 group %d elem %d (0x%04x): 0x%04x, slow 0x%04x", g, i, x[i], fast[i], slow[i]);
    }
}

static void test_qdq_fp4_16_random(void **state) {
    (void)state;
    bf16_t x[16], fast[16], slow[16];
    for (int g = 0; g < RANDOM_GROUPS; g++) {
        random_group(x, 16, -1);
        memcpy(fast, x, sizeof x);
        memcpy(slow, x, sizeof x);
        qdq_fp4_16_e4m3(fast, 16);
        slow_qdq_fp4_16(slow);
        for (int i = 0; i < 16; i++)
            if (fast[i] != slow[i]) fail_msg("fp4/16 group %d elem %d (0x%04x): 0x%04x, slow 0x%04x", g, i, x[i], fast[i], slow[i]);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Weight dequantization */

static void test_dequant_fp8_tiles_hand(void **state) {
    (void)state;
    /* 33 x 33: four tiles, three of them partial. Every code is 1.0 (0x38), so the output shows
     * which tile scale each element picked. */
    enum { N = 33, K = 33 };
    uint8_t w[N * K];
    memset(w, 0x38, sizeof w);
    const uint8_t s[4] = {127, 128, 129, 130}; /* 1, 2, 4, 8 */
    float out[N * K];
    dequant_fp8_tiles(w, s, N, K, K, 2, out);
    assert_true(out[0] == 1.0f);
    assert_true(out[31] == 1.0f);
    assert_true(out[32] == 2.0f);              /* row 0, col 32: tile (0,1) */
    assert_true(out[31 * K + 31] == 1.0f);
    assert_true(out[31 * K + 32] == 2.0f);
    assert_true(out[32 * K + 0] == 4.0f);      /* row 32: tile (1,0) */
    assert_true(out[32 * K + 32] == 8.0f);
    /* Codes with structure: -448 at 2^-3, a subnormal at 2^10, NaN scale and NaN code. */
    w[0] = 0xFE;
    w[32 * K + 32] = 0x03; /* 3 * 2^-9 */
    const uint8_t s2[4] = {124, 255, 255, 137};
    dequant_fp8_tiles(w, s2, N, K, K, 2, out);
    assert_true(out[0] == -56.0f);
    assert_true(isnan(out[32]));
    assert_true(isnan(out[32 * K]));
    assert_true(out[32 * K + 32] == 6.0f);
}

static void test_dequant_fp8_tiles_strided(void **state) {
    (void)state;
    /* 40 x 36 inside a 48-wide buffer, scales inside a 4-wide buffer; the padding holds NaN
     * codes/scales so reading it shows up. */
    enum { N = 40, K = 36, LD = 48, SLD = 4 };
    uint8_t w[N * LD], s[2 * SLD];
    for (int i = 0; i < N; i++)
        for (int j = 0; j < LD; j++) w[i * LD + j] = j < K ? (uint8_t)((i * 7 + j * 13) % 256) : 0x7F;
    for (int ti = 0; ti < 2; ti++)
        for (int tj = 0; tj < SLD; tj++) s[ti * SLD + tj] = tj < 2 ? (uint8_t)(120 + ti * 5 + tj * 2) : 255;
    float out[N * K];
    dequant_fp8_tiles(w, s, N, K, LD, SLD, out);
    for (int i = 0; i < N; i++)
        for (int j = 0; j < K; j++) {
            uint8_t code = w[i * LD + j];
            double want = (double)e4m3_ref(code) * ldexp(1.0, 120 + (i / 32) * 5 + (j / 32) * 2 - 127);
            float got = out[i * K + j];
            if ((code & 0x7F) == 0x7F) {
                assert_true(isnan(got));
                continue;
            }
            if (bitsf(got) != bitsf((float)want)) fail_msg("fp8 tile (%d,%d) = %a, want %a", i, j, (double)got, want);
        }
}

static void test_dequant_fp4_rows_hand(void **state) {
    (void)state;
    enum { N = 2, K = 64 };
    uint8_t w[N * K / 2];
    memset(w, 0, sizeof w);
    w[0] = 0x72;  /* element 0 = code 2 (1.0), element 1 = code 7 (6.0): low nibble first */
    w[1] = 0x9F;  /* element 2 = code 15 (-6), element 3 = code 9 (-0.5) */
    w[16] = 0x18; /* element 32 = code 8 (-0), element 33 = code 1 (0.5), second scale block */
    w[32] = 0x07; /* row 1, element 0 = code 7 (6), element 1 = 0 */
    w[63] = 0xD5; /* row 1, element 62 = code 5 (3), element 63 = code 13 (-3) */
    const uint8_t s[N * 2] = {127, 129, 0, 130}; /* row 0: 1, 4; row 1: 2^-127, 8 */
    float out[N * K];
    dequant_fp4_rows(w, s, N, K, out);
    assert_true(out[0] == 1.0f);
    assert_true(out[1] == 6.0f);
    assert_true(out[2] == -6.0f);
    assert_true(out[3] == -0.5f);
    assert_true(out[4] == 0.0f);
    assert_true(out[32] == 0.0f && signbit(out[32]));
    assert_true(out[33] == 2.0f);
    assert_true(out[K + 0] == ldexpf(6.0f, -127)); /* exact subnormal */
    assert_true(out[K + 1] == 0.0f);
    assert_true(out[K + 62] == 24.0f);
    assert_true(out[K + 63] == -24.0f);
}

static void test_dequant_engram_row(void **state) {
    (void)state;
    enum { DIM = 64 };
    uint8_t w[DIM], s[DIM / 32] = {127, 0};
    memset(w, 0, sizeof w);
    w[0] = 0x38;  /* 1.0 */
    w[1] = 0xFE;  /* -448 */
    w[2] = 0x7F;  /* NaN */
    /* Second block at 2^-127: the products are fp32 subnormals that bf16 must round (RNE) onto
     * its coarser subnormal grid of 2^-133. 0x08 = 2^-6 -> exactly 2^-133; 0x09 = 1.125 -> 1;
     * 0x0A = 1.25 -> 1; 0x0C = 1.5 -> tie -> 2; 0x0D = 1.625 -> 2; 0x8E = -1.75 -> -2. */
    w[32] = 0x08;
    w[33] = 0x09;
    w[34] = 0x0A;
    w[35] = 0x0C;
    w[36] = 0x0D;
    w[37] = 0x8E;
    w[38] = 0x80;
    bf16_t out[DIM];
    dequant_engram_row(w, s, DIM, out);
    assert_int_equal(out[0], 0x3F80);
    assert_int_equal(out[1], 0xC3E0);
    assert_true(isnan(bf16_to_f32(out[2])));
    assert_int_equal(out[3], 0x0000);
    assert_int_equal(out[32], 0x0001);
    assert_int_equal(out[33], 0x0001);
    assert_int_equal(out[34], 0x0001);
    assert_int_equal(out[35], 0x0002);
    assert_int_equal(out[36], 0x0002);
    assert_int_equal(out[37], 0x8002);
    assert_int_equal(out[38], 0x8000);
    s[0] = 255;
    dequant_engram_row(w, s, DIM, out);
    assert_true(isnan(bf16_to_f32(out[0])) && isnan(bf16_to_f32(out[31])));
    assert_int_equal(out[32], 0x0001);
}

/* ---------------------------------------------------------------------------------------------
 * Weight quantization and round trips */

/* Half the distance to the neighbouring e4m3 codes around v >= 0 (a value already scaled). */
static double e4m3_half_step(double v) {
    if (v < 0x1p-6) return 0x1p-10;
    int e;
    frexp(v, &e); /* v in [2^(e-1), 2^e) */
    return ldexp(1.0, e - 1 - 4);
}

static double e2m1_half_step(double v) { return v <= 2.0 ? 0.25 : v <= 4.0 ? 0.5 : 1.0; }

static void test_quant_fp8_tiles_layout(void **state) {
    (void)state;
    enum { N = 33, K = 33 };
    float w[N * K];
    memset(w, 0, sizeof w);
    w[0] = 1.0f;          /* tile (0,0): amax 1 -> 2^-8 -> byte 119 */
    w[1] = -0.5f;
    w[32] = 448.0f;       /* tile (0,1): exactly 448 -> 1.0 -> byte 127 */
    w[32 * K] = 900.0f;   /* tile (1,0): 900/448 = 2^1.006 -> 4 -> byte 129 */
    /* tile (1,1): all zero -> byte 127 */
    uint8_t q[N * K + 8], s[4 + 8];
    memset(q, 0xAB, sizeof q);
    memset(s, 0xAB, sizeof s);
    quant_fp8_tiles(w, N, K, q, s);
    assert_int_equal(s[0], 119);
    assert_int_equal(s[1], 127);
    assert_int_equal(s[2], 129);
    assert_int_equal(s[3], 127);
    for (int i = 4; i < 12; i++) assert_int_equal(s[i], 0xAB); /* nothing written past the end */
    for (int i = N * K; i < N * K + 8; i++) assert_int_equal(q[i], 0xAB);
    assert_int_equal(q[0], 0x78);       /* 1/2^-8 = 256 = 2^8: exponent field 15 */
    assert_int_equal(q[1], 0xF0);       /* -128 */
    assert_int_equal(q[32], 0x7E);      /* 448 */
    assert_int_equal(q[32 * K], 0x76);  /* 900/4 = 225 -> 224 = 1.75 * 128 */
    assert_int_equal(q[32 * K + 32], 0x00);

    /* Scale byte extremes: an infinite amax would give byte 255 (NaN) and is clamped to 254; a
     * subnormal amax whose scaled value underflows to 0 gets byte 0, the bit trick's floor. */
    float w2[32 * 64];
    memset(w2, 0, sizeof w2);
    w2[0] = INFINITY;
    w2[32] = fbits(1); /* 2^-149 */
    uint8_t q2[32 * 64], s2[2];
    quant_fp8_tiles(w2, 32, 64, q2, s2);
    assert_int_equal(s2[0], 254);
    assert_int_equal(q2[0], 0x7E);
    assert_int_equal(s2[1], 0);
    assert_int_equal(q2[32], 0x00);
}

static void test_quant_fp8_tiles_roundtrip(void **state) {
    (void)state;
    enum { N = 70, K = 100, TN = 3, TK = 4 };
    static float w[N * K], back[N * K];
    static uint8_t q[N * K];
    uint8_t s[TN * TK];
    int tile_exp[TN][TK];
    for (int ti = 0; ti < TN; ti++)
        for (int tj = 0; tj < TK; tj++) tile_exp[ti][tj] = rng_int(-40, 40);
    for (int i = 0; i < N; i++)
        for (int j = 0; j < K; j++) {
            double v = (rng_unit() * 2.0 - 1.0) * (rng_unit() < 0.1 ? 1.0 : rng_unit());
            w[i * K + j] = (float)ldexp(v, tile_exp[i / 32][j / 32]);
        }
    for (int i = 32; i < 64; i++) /* one all-zero tile */
        for (int j = 32; j < 64; j++) w[i * K + j] = 0.0f;
    for (int i = 0; i < 32; i++) /* tile (0,0) has amax at an exact maximum: 448 * 2^-3 */
        for (int j = 0; j < 32; j++) w[i * K + j] = fminf(fmaxf(w[i * K + j], -50.0f), 50.0f);
    w[0] = 448.0f * 0x1p-3f;
    quant_fp8_tiles(w, N, K, q, s);
    assert_int_equal(s[0], 124);
    assert_int_equal(s[1 * TK + 1], 127);
    for (int ti = 0; ti < TN; ti++)
        for (int tj = 0; tj < TK; tj++) {
            if (ti == 1 && tj == 1) continue;
            double amax = 0;
            for (int i = ti * 32; i < N && i < ti * 32 + 32; i++)
                for (int j = tj * 32; j < K && j < tj * 32 + 32; j++) amax = fmax(amax, fabs((double)w[i * K + j]));
            double sc = ldexp(1.0, s[ti * TK + tj] - 127);
            /* Smallest power of two that holds amax. */
            assert_true(amax / sc <= 448.0);
            assert_true(amax / (sc * 0.5) > 448.0);
        }
    dequant_fp8_tiles(q, s, N, K, K, TK, back);
    for (int i = 0; i < N; i++)
        for (int j = 0; j < K; j++) {
            float sc = e8m0_to_f32(s[(i / 32) * TK + j / 32]);
            float v = w[i * K + j] / sc;
            assert_int_equal(q[i * K + j], slow_e4m3(v));
            double err = fabs((double)back[i * K + j] - (double)w[i * K + j]);
            if (err > e4m3_half_step(fabs((double)v)) * sc)
                fail_msg("fp8 round trip (%d,%d): %a -> %a", i, j, (double)w[i * K + j], (double)back[i * K + j]);
        }
}

static void test_quant_fp4_rows(void **state) {
    (void)state;
    /* Nibble order by hand: amax 6 -> byte 127; codes 2, 7 -> 0x72; codes 9 (-0.5), 15 (-6) -> 0xF9. */
    float w[32] = {1.0f, 6.0f, -0.5f, -6.0f};
    uint8_t q[16 + 4], s[1 + 4];
    memset(q, 0xAB, sizeof q);
    memset(s, 0xAB, sizeof s);
    quant_fp4_rows(w, 1, 32, q, s);
    assert_int_equal(s[0], 127);
    assert_int_equal(s[1], 0xAB);
    assert_int_equal(q[0], 0x72);
    assert_int_equal(q[1], 0xF9);
    for (int i = 2; i < 16; i++) assert_int_equal(q[i], 0x00);
    assert_int_equal(q[16], 0xAB);

    /* amax 7 -> scale 2; 7/2 = 3.5 is the tie that goes up, to 4. */
    float w7[32] = {7.0f, 2.5f};
    quant_fp4_rows(w7, 1, 32, q, s);
    assert_int_equal(s[0], 128);
    assert_int_equal(q[0], 0x26); /* codes 6 (4.0) and 2 (1.0: 1.25 ties down) */
}

static void test_quant_fp4_rows_roundtrip(void **state) {
    (void)state;
    enum { N = 5, K = 96, NB = K / 32 };
    float w[N * K], back[N * K];
    uint8_t q[N * K / 2], s[N * NB];
    for (int i = 0; i < N; i++)
        for (int b = 0; b < NB; b++) {
            int e = rng_int(-30, 30);
            for (int j = 0; j < 32; j++) w[i * K + b * 32 + j] = (float)ldexp(rng_unit() * 2.0 - 1.0, e);
        }
    for (int j = 0; j < 32; j++) w[2 * K + 32 + j] = 0.0f; /* one all-zero block */
    quant_fp4_rows(w, N, K, q, s);
    assert_int_equal(s[2 * NB + 1], 127);
    dequant_fp4_rows(q, s, N, K, back);
    for (int i = 0; i < N; i++)
        for (int b = 0; b < NB; b++) {
            double amax = 0;
            for (int j = 0; j < 32; j++) amax = fmax(amax, fabs((double)w[i * K + b * 32 + j]));
            double sc = ldexp(1.0, s[i * NB + b] - 127);
            if (amax > 0) {
                assert_true(amax / sc <= 6.0);
                assert_true(amax / (sc * 0.5) > 6.0);
            }
            for (int j = 0; j < 32; j++) {
                int idx = i * K + b * 32 + j;
                float v = w[idx] / (float)sc;
                uint8_t code = (idx & 1) ? (uint8_t)(q[idx / 2] >> 4) : (uint8_t)(q[idx / 2] & 0xF);
                assert_int_equal(code, slow_e2m1(v));
                double err = fabs((double)back[idx] - (double)w[idx]);
                if (err > e2m1_half_step(fabs((double)v)) * sc)
                    fail_msg("fp4 round trip (%d,%d): %a -> %a", i, b * 32 + j, (double)w[idx], (double)back[idx]);
            }
        }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bf16_cases),
        cmocka_unit_test(test_bf16_exhaustive_roundtrip),
        cmocka_unit_test(test_bf16_vs_slow),
        cmocka_unit_test(test_e4m3_decode_all),
        cmocka_unit_test(test_e4m3_encode_roundtrip),
        cmocka_unit_test(test_e4m3_encode_midpoints),
        cmocka_unit_test(test_e4m3_encode_saturation_nan),
        cmocka_unit_test(test_e4m3_encode_subnormal),
        cmocka_unit_test(test_e4m3_encode_vs_slow),
        cmocka_unit_test(test_e8m0),
        cmocka_unit_test(test_e2m1_decode),
        cmocka_unit_test(test_e2m1_ties),
        cmocka_unit_test(test_round_scale_pow2),
        cmocka_unit_test(test_qdq_fp8_hand),
        cmocka_unit_test(test_qdq_fp4_32_hand),
        cmocka_unit_test(test_qdq_fp4_16_hand),
        cmocka_unit_test(test_qdq_fp8_random),
        cmocka_unit_test(test_qdq_fp4_32_random),
        cmocka_unit_test(test_qdq_fp4_16_random),
        cmocka_unit_test(test_dequant_fp8_tiles_hand),
        cmocka_unit_test(test_dequant_fp8_tiles_strided),
        cmocka_unit_test(test_dequant_fp4_rows_hand),
        cmocka_unit_test(test_dequant_engram_row),
        cmocka_unit_test(test_quant_fp8_tiles_layout),
        cmocka_unit_test(test_quant_fp8_tiles_roundtrip),
        cmocka_unit_test(test_quant_fp4_rows),
        cmocka_unit_test(test_quant_fp4_rows_roundtrip),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
