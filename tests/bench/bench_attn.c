/* The sparse attention op (backend.h sparse_attn: MODEL.md §3.9) at a TP8 rank's real shapes, the
 * way the engine calls it (make bench; GPU machine, or --backend cpu anywhere): 8 heads of 512
 * channels (MQA: K = V, one 512-wide row per entry), 640 index entries a query row (the 128-slot
 * window, then the 512 compressed rows of the index top-k), the attention sink, scale 512^-0.5.
 * Two access patterns, as the model produces them:
 *  - decode (rows <= 256): every query row is its own sequence: a window of 128 consecutive ring
 *    rows and 512 distinct compressed rows (ascending) drawn from a pool of --pool rows
 *    (default 262,144 = 256 MiB, 5x an H100's L2), and 16 such index sets rotate so that the
 *    rows stream from HBM; the leading window entries of some rows are -1 (young sequences);
 *  - prefill (rows > 256): one sequence's chunk: row t's window is the chunk rows t-127 .. t
 *    (leading -1 for t < 127) and its 512 compressed rows are drawn from that sequence's 1,024
 *    (the chunk's 2,048 positions at ratio 2): the working set fits in L2, so the rate that
 *    matters is FLOP/s (4·T·H·n_idx·hd: q·k and P·V).
 * Timing: the calls of one pass over the index sets recorded as one graph segment when the
 * backend has them (the CUDA backend: how a decode step runs), replayed --iters times after a
 * warm replay, wall time over the replays with the backend synchronized, ms per call; and the
 * same calls issued eagerly (path ours_eager); on the CUDA backend also each tensor-core form
 * forced (paths two_pass, one_pass: kernels/cuda/attn_mma.h; graphs), whichever the op would take
 * at that row count. Decode rows report bytes (distinct kv rows read
 * + q + o + the index) / time and, on a GPU, the fraction of the device-to-device copy
 * bandwidth measured in the same run.
 *   bench_attn [--backend cuda|cpu] [--rows 1,8,64,256,2048] [--pool N] [--iters N] [--csv F]
 *              [--dump DIR]
 * CSV: backend,device,pattern,rows,heads,hd,n_idx,path,ms_per_call,bytes,gb_per_s,
 *      fraction_of_copy_bw,copy_gb_per_s,tflops
 * --dump DIR writes one decode case (8 rows, first index set) for tests/bench/torch_attn_baseline.py
 * --check: q.bin [8][H][hd] bf16, k.bin [8][n_idx][hd] bf16 (each row's gathered entries, zeros
 * for -1), idx.bin [8][n_idx] int32, sink.bin [H] fp32, o.bin [8][H][hd] bf16 (this op's output),
 * meta.txt (rows heads hd n_idx scale), so that the baseline is checked to compute the same op. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef DS_HAVE_CUDA
#include "cuda/attn_mma.h"
#endif

#include "backend.h"
#include "bench/bench_util.h"
#include "formats.h"
#include "xorshift.h"

#define HEADS 8
#define HD 512
#define WIN 128
#define TOPK 512
#define N_IDX (WIN + TOPK)
#define NSETS 16         /* index sets a decode pass rotates over */
#define DECODE_MAX_T 256 /* rows up to this: the decode pattern */
#define PREFILL_CMP 1024 /* a prefill chunk's compressed rows (2,048 positions at ratio 2) */

static uint64_t g_rng = 0x2545f4914f6cdd1dull;
static uint64_t rnd(void) { return xorshift64(&g_rng); }

static int cmp_i32(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* k distinct values of [0, n) (k <= n), ascending, into out; mark: n bytes of scratch, zero on
 * entry and on return */
static void pick_sorted(int32_t *out, int k, int64_t n, int64_t base, uint8_t *mark) {
    for (int i = 0; i < k;) {
        const int64_t v = (int64_t)(rnd() % (uint64_t)n);
        if (mark[v]) continue;
        mark[v] = 1;
        out[i++] = (int32_t)(base + v);
    }
    for (int i = 0; i < k; i++) mark[out[i] - base] = 0;
    qsort(out, (size_t)k, sizeof *out, cmp_i32);
}

/* One index set of T rows [T][N_IDX] (see the header): decode rows in a pool of P rows, prefill
 * rows in a chunk [0, T) followed by its compressed rows [T, T + PREFILL_CMP). Returns the number
 * of valid entries. */
static int64_t make_index(int32_t *idx, int64_t T, int64_t P, uint8_t *mark) {
    int64_t valid = 0;
    for (int64_t t = 0; t < T; t++) {
        int32_t *ir = idx + t * N_IDX;
        if (T <= DECODE_MAX_T) {
            const int64_t w0 = (int64_t)(rnd() % (uint64_t)(P - WIN));
            const int young = t % 4 == 3 ? (int)(rnd() % WIN) : 0; /* a quarter of the rows: younger than the window */
            for (int w = 0; w < WIN; w++) ir[w] = w < young ? -1 : (int32_t)(w0 + w);
            pick_sorted(ir + WIN, TOPK, P, 0, mark);
        } else {
            for (int w = 0; w < WIN; w++) {
                const int64_t p = t - (WIN - 1) + w;
                ir[w] = p < 0 ? -1 : (int32_t)p;
            }
            pick_sorted(ir + WIN, TOPK, PREFILL_CMP, T, mark);
        }
        for (int e = 0; e < N_IDX; e++) valid += ir[e] >= 0;
    }
    return valid;
}

/* The calls of one pass over a row count's index sets (a call per set, into one output). */
enum { FORM_OP = -1, FORM_TWO = 1, FORM_ONE = 2 }; /* the op, or a tensor-core form (attn_mma.h) */
struct pass {
    struct backend *be;
    bf16_t *o, *q, *kv;
    int32_t *idx;
    float *sink;
    int64_t T;
    int ns;
    float scale;
    int form;
};

static void run_pass(const void *ctx) {
    const struct pass *p = ctx;
    for (int s = 0; s < p->ns; s++) {
        bf16_t *qs = p->q + (int64_t)s * p->T * HEADS * HD;
        int32_t *is = p->idx + (int64_t)s * p->T * N_IDX;
        if (p->form == FORM_OP) {
            p->be->ops->sparse_attn(p->be, p->o, qs, p->kv, is, p->T, HEADS, HD, N_IDX, p->sink, p->scale);
            continue;
        }
#ifdef DS_HAVE_CUDA
        if (!cuda_sparse_attn_mma_path(p->be, p->form, p->o, qs, p->kv, is, p->T, HEADS, HD, N_IDX, p->sink, p->scale, NULL)) {
            fprintf(stderr, "bench_attn: the tensor-core form %d refused the shape\n", p->form);
            exit(2);
        }
#endif
    }
}

int main(int argc, char **argv) {
    const char *backend = "cuda", *csv = NULL, *dump = NULL;
    int64_t rows[16] = {1, 8, 64, 256, 2048}, pool = 262144;
    int n_rows = 5, iters = 20;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--backend") && i + 1 < argc) backend = argv[++i];
        else if (!strcmp(argv[i], "--rows") && i + 1 < argc) n_rows = bench_parse_list(argv[++i], rows, 16);
        else if (!strcmp(argv[i], "--pool") && i + 1 < argc) pool = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--csv") && i + 1 < argc) csv = argv[++i];
        else if (!strcmp(argv[i], "--dump") && i + 1 < argc) dump = argv[++i];
        else {
            fprintf(stderr, "usage: bench_attn [--backend cuda|cpu] [--rows 1,8,64,256,2048] [--pool N] [--iters N] "
                            "[--csv F] [--dump DIR]\n");
            return 2;
        }
    }
    if (n_rows <= 0 || iters <= 0 || pool < 2 * TOPK || pool > ((int64_t)1 << 30)) {
        fprintf(stderr, "bench_attn: --rows and --iters take positive numbers, --pool %d .. 2^30 rows\n", 2 * TOPK);
        return 2;
    }
    struct backend be;
    const char *device;
    double copy_bw;
    if (bench_backend_open("bench_attn", backend, &be, &device, &copy_bw)) return 2;
    const struct backend_ops *ops = be.ops;
    FILE *f = bench_csv_open(csv, "backend,device,pattern,rows,heads,hd,n_idx,path,ms_per_call,bytes,gb_per_s,"
                                  "fraction_of_copy_bw,copy_gb_per_s,tflops\n");
    printf("# %s (%s), heads %d, hd %d, %d index entries a row, pool %lld rows; device-to-device copy %.0f GB/s\n",
           device, backend, HEADS, HD, N_IDX, (long long)pool, copy_bw / 1e9);
    printf("# %-7s %5s %-10s %10s %10s %9s %8s\n", "pattern", "rows", "path", "ms/call", "GB/s", "of copy", "TFLOP/s");

    /* the kv pool [pool][HD] bf16, values in [-1, 1]: scores of order one after the scale */
    const float scale = 1.0f / sqrtf((float)HD);
    uint16_t *kvh = malloc(sizeof(uint16_t) * (size_t)(pool * HD));
    float sinkh[HEADS];
    uint8_t *mark = calloc((size_t)pool, 1);
    if (!kvh || !mark) {
        fprintf(stderr, "bench_attn: out of host memory for a pool of %lld rows\n", (long long)pool);
        return 2;
    }
    for (int64_t i = 0; i < pool * HD; i++) kvh[i] = bf16_from_f32((float)((int64_t)(rnd() % 2001) - 1000) * 1e-3f);
    /* sinks -6 .. 4.5: the larger ones weigh against a row's 640 entries (exp(4.5) = 90), so that the
     * dump's check tells an op with the sink from one without */
    for (int h = 0; h < HEADS; h++) sinkh[h] = 1.5f * (float)(h - 4);
    bf16_t *kv = ops->alloc(&be, sizeof(uint16_t) * (size_t)(pool * HD));
    float *sink = ops->alloc(&be, sizeof sinkh);
    ops->upload(&be, kv, kvh, sizeof(uint16_t) * (size_t)(pool * HD));
    ops->upload(&be, sink, sinkh, sizeof sinkh);

    int rc = 0;
    for (int ri = 0; ri < n_rows; ri++) {
        const int64_t T = rows[ri];
        const bool decode = T <= DECODE_MAX_T;
        if (!decode && T + PREFILL_CMP > pool) {
            fprintf(stderr, "bench_attn: %lld prefill rows need a pool of %lld rows\n", (long long)T,
                    (long long)(T + PREFILL_CMP));
            return 2;
        }
        const int ns = decode ? NSETS : 1;
        int32_t *idxh = malloc(sizeof(int32_t) * (size_t)(ns * T * N_IDX));
        uint16_t *qh = malloc(sizeof(uint16_t) * (size_t)(ns * T * HEADS * HD));
        int64_t valid = 0;
        for (int s = 0; s < ns; s++) valid += make_index(idxh + (int64_t)s * T * N_IDX, T, decode ? pool : T + PREFILL_CMP, mark);
        for (int64_t i = 0; i < ns * T * HEADS * HD; i++)
            qh[i] = bf16_from_f32((float)((int64_t)(rnd() % 2001) - 1000) * 1e-3f);
        int32_t *idx = ops->alloc(&be, sizeof(int32_t) * (size_t)(ns * T * N_IDX));
        bf16_t *q = ops->alloc(&be, sizeof(uint16_t) * (size_t)(ns * T * HEADS * HD));
        bf16_t *o = ops->alloc(&be, sizeof(uint16_t) * (size_t)(T * HEADS * HD));
        ops->upload(&be, idx, idxh, sizeof(int32_t) * (size_t)(ns * T * N_IDX));
        ops->upload(&be, q, qh, sizeof(uint16_t) * (size_t)(ns * T * HEADS * HD));

        /* the paths: the op (graph, eager), and on the CUDA backend each tensor-core form forced */
        struct pass p = {&be, o, q, kv, idx, sink, T, ns, scale, FORM_OP};
        enum { NPATH = 4 };
        static const char *const pnames[NPATH] = {"ours", "ours_eager", "two_pass", "one_pass"};
        double ms[NPATH];
        const int npath = strcmp(backend, "cuda") ? 2 : NPATH;
        for (int pi = 0; pi < npath; pi++) {
            p.form = pi < 2 ? FORM_OP : pi == 2 ? FORM_TWO : FORM_ONE;
            const uint64_t key[4] = {0xa77e0001u, (uint64_t)T, (uint64_t)ns, (uint64_t)(p.form + 2)};
            ms[pi] = bench_time_pass(&be, run_pass, &p, ns, key, 4, pi != 1, iters);
        }
        if (dump && T == 8) {
            /* the first set's output, then its inputs in the baseline's form */
            ops->sparse_attn(&be, o, q, kv, idx, T, HEADS, HD, N_IDX, sink, scale);
            uint16_t *oh = malloc(sizeof(uint16_t) * (size_t)(T * HEADS * HD)),
                     *kg = calloc((size_t)(T * N_IDX * HD), sizeof(uint16_t));
            ops->download(&be, oh, o, sizeof(uint16_t) * (size_t)(T * HEADS * HD));
            ops->sync(&be);
            for (int64_t e = 0; e < T * N_IDX; e++)
                if (idxh[e] >= 0) memcpy(kg + e * HD, kvh + (int64_t)idxh[e] * HD, sizeof(uint16_t) * HD);
            char meta[256];
            const int len = snprintf(meta, sizeof meta, "%lld %d %d %d %.9g\n", (long long)T, HEADS, HD, N_IDX, scale);
            if (bench_write_file("bench_attn", dump, "q.bin", qh, sizeof(uint16_t) * (size_t)(T * HEADS * HD)) ||
                bench_write_file("bench_attn", dump, "k.bin", kg, sizeof(uint16_t) * (size_t)(T * N_IDX * HD)) ||
                bench_write_file("bench_attn", dump, "idx.bin", idxh, sizeof(int32_t) * (size_t)(T * N_IDX)) ||
                bench_write_file("bench_attn", dump, "sink.bin", sinkh, sizeof sinkh) ||
                bench_write_file("bench_attn", dump, "o.bin", oh, sizeof(uint16_t) * (size_t)(T * HEADS * HD)) ||
                bench_write_file("bench_attn", dump, "meta.txt", meta, (size_t)len))
                rc = 2;
            free(oh);
            free(kg);
        }
        /* bytes of one call: its valid entries' distinct rows (decode: each row its own), q, o, idx */
        const double bytes = decode ? (double)valid / ns * HD * 2 + 2.0 * T * HEADS * HD * 2 + (double)T * N_IDX * 4 : 0.0;
        const double flops = 4.0 * (double)T * HEADS * N_IDX * HD;
        for (int pi = 0; pi < npath; pi++) {
            const char *path = pnames[pi];
            const double gbs = bytes / (ms[pi] * 1e-3) / 1e9, tf = flops / (ms[pi] * 1e-3) / 1e12;
            const double frac = copy_bw > 0 ? gbs * 1e9 / copy_bw : 0.0;
            printf("  %-7s %5lld %-10s %10.4f %10.0f %8.1f%% %8.2f\n", decode ? "decode" : "prefill", (long long)T, path,
                   ms[pi], gbs, 100.0 * frac, tf);
            if (f)
                fprintf(f, "%s,%s,%s,%lld,%d,%d,%d,%s,%.5f,%.0f,%.1f,%.4f,%.1f,%.3f\n", backend, device,
                        decode ? "decode" : "prefill", (long long)T, HEADS, HD, N_IDX, path, ms[pi], bytes, gbs, frac,
                        copy_bw / 1e9, tf);
        }
        ops->free(&be, idx);
        ops->free(&be, q);
        ops->free(&be, o);
        free(idxh);
        free(qh);
    }
    if (dump && rc == 0) {
        bool had8 = false;
        for (int ri = 0; ri < n_rows; ri++) had8 |= rows[ri] == 8;
        if (!had8) {
            fprintf(stderr, "bench_attn: --dump writes the 8-row case: put 8 in --rows\n");
            rc = 2;
        }
    }
    if (f) fclose(f);
    ops->free(&be, kv);
    ops->free(&be, sink);
    free(kvh);
    free(mark);
    return rc;
}
