/* What the op benchmarks (bench_attn, bench_moe, bench_head_draw) share: the clock, the
 * comma-separated count lists, the backend by name (the CUDA one as the engine runs it, with the
 * copy bandwidth of its card for the "fraction of copy" columns), the timing of a pass of op calls
 * as one graph segment or eagerly, and the dump files the PyTorch baselines' checks read. Static
 * functions of a header: each benchmark is one C file. */
#ifndef DS_BENCH_UTIL_H
#define DS_BENCH_UTIL_H

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#ifdef DS_HAVE_CUDA
#include "bench/bench_copy_bw.h"
#endif

#include "backend.h"

static inline double bench_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* "1,8,64" -> out (at most max values of 1 .. 2^20); the count, or -1 for anything else. */
static inline int bench_parse_list(const char *s, int64_t *out, int max) {
    int n = 0;
    while (*s && n < max) {
        char *e;
        long long v = strtoll(s, &e, 10);
        if (e == s || v <= 0 || v > (1 << 20) || (*e && *e != ',')) return -1;
        out[n++] = v;
        s = *e == ',' ? e + 1 : e;
    }
    return *s ? -1 : n;
}

/* The backend named `name` (cuda: device 0 with the tensor-core switch on, as the engine runs
 * without --exact-linears): 0, or 2 after one error line naming prog. *device: the card's name;
 * copy_bw (when not NULL): its device-to-device copy bandwidth in bytes/s, 0 on the CPU. */
static inline int bench_backend_open(const char *prog, const char *name, struct backend *be, const char **device,
                                     double *copy_bw) {
    *device = "cpu";
    if (copy_bw) *copy_bw = 0.0;
    if (!strcmp(name, "cpu")) return backend_cpu_init(be) ? 2 : 0;
    if (strcmp(name, "cuda")) {
        fprintf(stderr, "%s: --backend is cuda or cpu, not '%s'\n", prog, name);
        return 2;
    }
#ifdef DS_HAVE_CUDA
    if (backend_cuda_init(be, 0)) {
        fprintf(stderr, "%s: no usable CUDA device\n", prog);
        return 2;
    }
    static struct cudaDeviceProp prop;
    *device = cudaGetDeviceProperties(&prop, 0) == cudaSuccess ? prop.name : "cuda:0";
    backend_cuda_set_mma(be, true);
    if (copy_bw) *copy_bw = bench_copy_bandwidth();
    return 0;
#else
    fprintf(stderr, "%s: built without CUDA (use --backend cpu)\n", prog);
    return 2;
#endif
}

/* ms per call of `pass` (calls op calls): one warm pass (with graphs: the recording), then iters
 * passes with the backend synchronized around them; graphs: each pass one graph segment of the
 * given key (what it must depend on: the shape and the path), where the backend has them. */
static inline double bench_time_pass(struct backend *be, void (*pass)(const void *), const void *ctx, int calls,
                                     const uint64_t *key, int n_key, bool graphs, int iters) {
    const struct backend_ops *ops = be->ops;
    graphs = graphs && ops->graph_begin;
    double t0 = 0.0;
    for (int it = -1; it < iters; it++) {
        if (it == 0) {
            ops->sync(be);
            t0 = bench_now_s();
        }
        if (!graphs) pass(ctx);
        else if (ops->graph_begin(be, key, n_key)) {
            pass(ctx);
            ops->graph_end(be);
        }
    }
    ops->sync(be);
    return 1e3 * (bench_now_s() - t0) / ((double)iters * calls);
}

/* The CSV at path (none: NULL) with its header line; exits 2 when it cannot be written. */
static inline FILE *bench_csv_open(const char *path, const char *header) {
    if (!path) return NULL;
    FILE *f = fopen(path, "w");
    if (!f || fputs(header, f) < 0) {
        perror(path);
        exit(2);
    }
    return f;
}

/* dir/name <- bytes of p (dir made if missing); 0, or -1 after an error line naming prog. */
static inline int bench_write_file(const char *prog, const char *dir, const char *name, const void *p, size_t bytes) {
    char path[4096];
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, bytes, f) != bytes || fclose(f)) {
        fprintf(stderr, "%s: cannot write %s: %s\n", prog, path, strerror(errno));
        return -1;
    }
    return 0;
}

#endif
