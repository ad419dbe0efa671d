/* Shared by the MPI check programs of tests/mpi (run under mpirun by tests/cli scripts): the
 * per-rank pass/fail counters with the CHECK macro that names rank, file and line of a failure,
 * and the known per-rank data generators the comm checks compare collectives against. */
#ifndef DS_TESTS_MPI_CHECK_H
#define DS_TESTS_MPI_CHECK_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

static int g_pass, g_fail, g_rank;

#define CHECK(cond, ...)                                                          \
    do {                                                                          \
        if (cond) {                                                               \
            g_pass++;                                                             \
        } else {                                                                  \
            g_fail++;                                                             \
            fprintf(stderr, "rank %d: FAIL %s:%d: ", g_rank, __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                                         \
            fputc('\n', stderr);                                                  \
        }                                                                         \
    } while (0)

static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

/* Signed values spread over 2^-20 .. 2^20 so that additions round and partly cancel. */
static inline float f32_value(int rank, size_t i) {
    uint32_t h = mix32(mix32((uint32_t)rank + 0x9e3779b9u) ^ (uint32_t)i);
    float v = ldexpf(1.0f + (float)(h & 0xffffu) / 65536.0f, (int)((h >> 16) % 41u) - 20);
    return (h >> 31) ? -v : v;
}
static inline int64_t i64_value(int rank, size_t i) { return ((int64_t)(rank + 1) << 40) - (int64_t)i * 977; }
static inline int32_t i32_value(int rank, size_t i) { return (int32_t)(rank * 100003) - (int32_t)i; }

#endif /* DS_TESTS_MPI_CHECK_H */
