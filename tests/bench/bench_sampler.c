/* The host sampler (src/sampler.c) at the real vocabulary: ms a row for the greedy pick, the
 * log-probability, a temperature draw over the whole vocabulary with top-p, and one with top-k 50
 * and top-p; the first version (tests/unit/sampler_ref.h) beside it, and a step's rows drawn by
 * one thread and by all of the rank's (dist.c draws the rows of a step in parallel). Rows are
 * shaped like a trained model's logits (a few high entries over a wide low spread).
 *
 *   build/bench/bench_sampler [out.csv] [rows]     (rows: a step's batch, default 64)
 *
 * Output: a table, and with out.csv rows of case,impl,threads,rows,ms_per_row,ms_per_step. */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../unit/sampler_ref.h"
#include "sampler.h"

enum { V = 129280 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

struct scase {
    const char *name;
    struct sample_params p;
    int logprob; /* time the log-probability instead of the draw */
};

static volatile long g_sink;

/* ms a row for `rows` rows on `threads` threads */
static double time_rows(const float *x, int rows, const struct scase *c, int ref, int threads) {
    double t0 = now();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int r = 0; r < rows; r++) {
        const float *row = x + (size_t)(r % 8) * V;
        long v;
        if (c->logprob) v = (long)(1e6 * (ref ? ref_logprob(row, V, r) : sampler_logprob(row, V, r)));
        else v = ref ? ref_pick(row, V, &c->p, (uint64_t)r, 1) : sampler_pick(row, V, &c->p, (uint64_t)r, 1);
        __atomic_fetch_add(&g_sink, v, __ATOMIC_RELAXED);
    }
    return (now() - t0) * 1e3 / rows;
}

int main(int argc, char **argv) {
    const char *csv = argc > 1 ? argv[1] : NULL;
    int rows = argc > 2 ? atoi(argv[2]) : 64;
    if (rows < 1) rows = 64;
    float *x = malloc(sizeof(float) * (size_t)V * 8);
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < (size_t)V * 8; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        double u = (double)(s >> 11) / 9007199254740992.0;
        x[i] = (float)(u * 8 - 12) + ((s >> 5) % 4000 == 0 ? 14.0f : 0.0f);
    }
    const struct scase cases[] = {
        {"greedy", {.temperature = 0}, 0},
        {"logprob", {.temperature = 0}, 1},
        {"T=0.8 top_p=0.95", {.temperature = 0.8f, .top_p = 0.95f, .seed = 1}, 0},
        {"T=0.8 top_k=50 top_p=0.95", {.temperature = 0.8f, .top_k = 50, .top_p = 0.95f, .seed = 1}, 0},
    };
    int nt = omp_get_max_threads();
    FILE *f = csv ? fopen(csv, "w") : NULL;
    if (csv && !f) {
        fprintf(stderr, "bench_sampler: cannot write %s\n", csv);
        return 1;
    }
    if (f) fprintf(f, "case,impl,threads,rows,ms_per_row,ms_per_step\n");
    printf("# V = %d, a step of %d rows; threads: 1 and %d (omp_get_max_threads)\n", V, rows, nt);
    printf("%-28s %-14s %7s %11s %12s\n", "case", "impl", "threads", "ms_per_row", "ms_per_step");
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++)
        for (int ref = 1; ref >= 0; ref--)
            for (int t = 1; t <= nt; t = t == nt ? nt + 1 : nt) {
                if (ref && t > 1) continue; /* the first version ran one row after another */
                int n = ref && !cases[k].logprob && cases[k].p.temperature > 0 ? 8 : rows; /* its qsort: ~25 ms a row */
                double ms = time_rows(x, n, &cases[k], ref, t);
                const char *impl = ref ? "first version" : "now";
                printf("%-28s %-14s %7d %11.3f %12.2f\n", cases[k].name, impl, t, ms, ms * rows);
                if (f) fprintf(f, "\"%s\",%s,%d,%d,%.4f,%.3f\n", cases[k].name, impl, t, rows, ms, ms * rows);
            }
    if (f) fclose(f);
    free(x);
    return 0;
}
