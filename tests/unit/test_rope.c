/* RoPE frequency tables against the reference's fp32 bit patterns for the real model
 * (MODEL.md §3.13): θ=10000 without YaRN, and θ=160000 with YaRN ×16 over 65536, β 32/1.
 * Computing them in double and rounding once differs in 8–10 of the 32 entries, so this catches
 * any deviation from "fp32 pow, fp32 reciprocal, fp32 blend". */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <string.h>

#include "model.h"

static const uint32_t plain[32] = {
    0x3f800000, 0x3f3ff911, 0x3f0ff59a, 0x3ed7e89b, 0x3ea1e89b, 0x3e72d423, 0x3e361887, 0x3e088d77,
    0x3dcccccd, 0x3d99940d, 0x3d6655c2, 0x3d2cba15, 0x3d0186e3, 0x3cc2434f, 0x3c91ad39, 0x3c5a7bf2,
    0x3c23d70a, 0x3bf5b9b0, 0x3bb8449c, 0x3b8a2e77, 0x3b4f3e38, 0x3b1b690d, 0x3ae91528, 0x3aaec98e,
    0x3a83126f, 0x3a44948c, 0x3a136a16, 0x39dd1725, 0x39a5cb60, 0x3978a815, 0x393a7753, 0x390bd472};
static const uint32_t yarn[32] = {
    0x3f800000, 0x3f300a3a, 0x3ef21c1f, 0x3ea67d01, 0x3e64f92e, 0x3e1d7475, 0x3dd88cb4, 0x3d94e963,
    0x3d4ccccd, 0x3d0cd4fb, 0x3cc1b019, 0x3c8530ce, 0x3c372dbf, 0x3bfbed88, 0x3bad3d5e, 0x3b6e4237,
    0x3b147ae1, 0x3ab714e0, 0x3a5ebdb6, 0x3a0530ce, 0x399bb3af, 0x39305978, 0x38be904d, 0x383e9b5f,
    0x37a3d70c, 0x36b443d0, 0x3677eba6, 0x362a7be8, 0x35ea77ff, 0x35a13bdc, 0x355dbf30, 0x35187c4d};

static void check(const float *f, const uint32_t *want) {
    for (int i = 0; i < 32; i++) {
        uint32_t b;
        memcpy(&b, &f[i], 4);
        if (b != want[i]) fail_msg("entry %d: 0x%08x != 0x%08x", i, b, want[i]);
    }
}

static void test_plain(void **s) {
    (void)s;
    float f[32];
    rope_freqs(f, 64, 10000.0, false, 16, 65536, 32, 1);
    check(f, plain);
}

static void test_yarn(void **s) {
    (void)s;
    float f[32];
    rope_freqs(f, 64, 160000.0, true, 16, 65536, 32, 1);
    check(f, yarn);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_plain), cmocka_unit_test(test_yarn)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
