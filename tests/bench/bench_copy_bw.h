/* The benchmarks' ceiling: device-to-device copy bandwidth of the current GPU (cudaMemcpyAsync of
 * 1 GiB, bytes read + written / time, after three warm copies), in bytes/s. One definition, so
 * every CSV's "fraction of copy" divides by the same measurement. Exits 2 on a CUDA error. */
#ifndef DS_BENCH_COPY_BW_H
#define DS_BENCH_COPY_BW_H

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define BENCH_CK(x)                                                                                 \
    do {                                                                                            \
        cudaError_t e_ = (x);                                                                       \
        if (e_ != cudaSuccess) {                                                                    \
            fprintf(stderr, "bench: %s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(2);                                                                                \
        }                                                                                           \
    } while (0)

static inline double bench_copy_bandwidth(void) {
    size_t bytes = (size_t)1 << 30;
    void *a, *b;
    BENCH_CK(cudaMalloc(&a, bytes));
    BENCH_CK(cudaMalloc(&b, bytes));
    BENCH_CK(cudaMemset(a, 1, bytes));
    cudaEvent_t e0, e1;
    BENCH_CK(cudaEventCreate(&e0));
    BENCH_CK(cudaEventCreate(&e1));
    for (int i = 0; i < 3; i++) BENCH_CK(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
    BENCH_CK(cudaEventRecord(e0, 0));
    const int reps = 20;
    for (int i = 0; i < reps; i++) BENCH_CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0));
    BENCH_CK(cudaEventRecord(e1, 0));
    BENCH_CK(cudaEventSynchronize(e1));
    float ms;
    BENCH_CK(cudaEventElapsedTime(&ms, e0, e1));
    BENCH_CK(cudaEventDestroy(e0));
    BENCH_CK(cudaEventDestroy(e1));
    BENCH_CK(cudaFree(a));
    BENCH_CK(cudaFree(b));
    return 2.0 * (double)bytes * reps / (ms * 1e-3);
}

#endif
