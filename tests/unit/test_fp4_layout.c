/* Unit tests of the device layout of FP4 weights (kernels/cuda/fp4_layout.h), on the CPU: the
 * packing is a bijection of 32-bit words (every single-bit word lands on a distinct bit and comes
 * back; random words round-trip), and the raw bf16 pairs the decode reads from a packed word,
 * times 2^126, are the e2m1 values of the checkpoint word's codes in the order the tensor-core
 * kernels expect (code 2j low, 2j + 1 high half of pair j) — every code at every position,
 * against formats.c's e2m1 table — and the exact kernels' pairing (codes j | j + 4) of the same
 * halves. The GPU side (the bf16 multiply on every 2^32 word) is
 * test_cuda_ops_misc's decode check; this one runs in CI. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <string.h>

#include "cuda/fp4_layout.h"
#include "formats.h"

/* The value of a bf16 bit pattern, subnormals included, computed from its fields (not by widening
 * to fp32 bits, so the check does not share the decode's reading of the pattern). */
static double bf16_value(uint32_t h) {
    const int s = (h >> 15) & 1, e = (h >> 7) & 0xff, m = h & 0x7f;
    const double mag = e == 0 ? ldexp((double)m, -126 - 7) : ldexp(1.0 + m / 128.0, e - 127);
    return s ? -mag : mag;
}

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static uint32_t next32(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

static void test_bijection(void **st) {
    (void)st;
    uint32_t seen = 0;
    for (int b = 0; b < 32; b++) {
        const uint32_t p = fp4_pack_word(1u << b);
        assert_int_equal(__builtin_popcount(p), 1); /* a bit move */
        assert_int_equal(seen & p, 0);             /* onto a bit no other source takes */
        seen |= p;
        assert_int_equal(fp4_unpack_word(p), 1u << b);
    }
    assert_int_equal(seen, 0xffffffffu);
    for (int i = 0; i < 100000; i++) {
        const uint32_t u = next32();
        assert_int_equal(fp4_unpack_word(fp4_pack_word(u)), u);
        assert_int_equal(fp4_pack_word(fp4_unpack_word(u)), u);
    }
}

static void test_raw_pairs(void **st) {
    (void)st;
    /* each of the 16 codes at each of the 8 positions, the other codes random */
    for (int pos = 0; pos < 8; pos++)
        for (uint32_t code = 0; code < 16; code++)
            for (int rep = 0; rep < 64; rep++) {
                const uint32_t u = (next32() & ~(15u << (4 * pos))) | code << (4 * pos);
                uint32_t r[4];
                fp4_raw_pairs(fp4_pack_word(u), r);
                for (int c = 0; c < 8; c++) {
                    const uint32_t h = (r[c / 2] >> (16 * (c % 2))) & 0xffffu;
                    const uint8_t cc = (uint8_t)((u >> (4 * c)) & 15u);
                    const double want = e2m1_to_f32(cc), got = ldexp(bf16_value(h), 126);
                    if (got != want || signbit(got) != signbit(want))
                        fail_msg("word %08x code %u at %d: raw pair half %04x reads %g, e2m1 %g", u, cc, c, h, got, want);
                    /* only the sign, exponent-low and top-mantissa bits: the bf16 multiply by 2^126 is exact */
                    assert_int_equal(h & ~0x81C0u, 0);
                }
                /* the exact kernels' pairing: the same halves as codes j | j + 4 */
                uint32_t q[4];
                fp4_raw_pairs_j4(fp4_pack_word(u), q);
                for (int j = 0; j < 4; j++) {
                    assert_int_equal(q[j] & 0xffffu, (r[j / 2] >> (16 * (j % 2))) & 0xffffu);
                    assert_int_equal(q[j] >> 16, (r[(j + 4) / 2] >> (16 * (j % 2))) & 0xffffu);
                }
            }
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_bijection), cmocka_unit_test(test_raw_pairs)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
