/* The tests' and benchmarks' seeded inputs: Marsaglia's xorshift64 (13, 7, 17), one step of the
 * state *s (never 0). One generator, so every file's sequence from a given seed is the same. */
#ifndef DS_TESTS_XORSHIFT_H
#define DS_TESTS_XORSHIFT_H

#include <stdint.h>

static inline uint64_t xorshift64(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

#endif
