/* The routed experts op (backend.h moe_experts: MODEL.md's FP4 experts with the SwiGLU) at a rank's
 * real shapes, the way the engine calls it once a layer (make bench; GPU machine, or --backend cpu
 * anywhere): 48 local experts of 384 (a TP8 x PP2 job's expert split), each w1 and w3 [2304, 5120]
 * and w2 [5120, 2304] in FP4 with per-32 e8m0 scales (18.8 MB an expert), top-6 routing drawn
 * uniformly over the 384 experts a token (as balanced as a trained router; bench_step's balanced
 * plan), routing weights in (0, 1), SwiGLU limit 10. A call takes T tokens; its pairs on this rank
 * are the slots whose expert is local (3/4 of a token's on average), and its bytes are the distinct
 * local experts it touches x an expert's bytes, plus x and y. 16 routing sets rotate (decode token
 * counts: the average over the experts they hit; one set above 256 tokens, a prefill chunk).
 * Timing as bench_attn: one pass over the sets as one graph segment (CUDA), replayed --iters times,
 * ms per call; eagerly (ours_eager). Bytes / time against the copy bandwidth measured in the same
 * run; FLOP/s as 2 x 3 x I x D a local pair.
 *   bench_moe [--backend cuda|cpu] [--tokens 1,8,64,256,2048] [--dims D,I] [--local N] [--iters N]
 *             [--csv F] [--dump DIR]
 * CSV: backend,device,tokens,d,inter,n_local,pairs,experts,path,ms_per_call,bytes,gb_per_s,
 *      fraction_of_copy_bw,copy_gb_per_s,tflops (pairs and experts: a call's averages).
 * --dump DIR writes the 8-token case's first set for tests/bench/torch_moe_baseline.py --check:
 * meta.txt (tokens k d inter n_dump limit), x.bin [8][D] bf16, idx.bin [8][k] int32 (expert ids,
 * local ones renumbered 0 .. n_dump-1 in experts.bin's order, others -1), wts.bin [8][k] fp32,
 * experts.bin [n_dump] int32, w1.bin / w3.bin [n_dump][I][D/2] and w2.bin [n_dump][D][I/2] (packed
 * e2m1, low nibble = even k), s1.bin / s3.bin [n_dump][I][D/32] and s2.bin [n_dump][D][I/32]
 * (e8m0), y.bin [8][k][D] bf16 (this op's output; slots routed elsewhere zero). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "bench/bench_util.h"
#include "formats.h"
#include "xorshift.h"

#define E_TOTAL 384
#define TOPK 6
#define NSETS 16
#define DECODE_MAX_T 256
#define LIMIT 10.0f

static uint64_t g_rng = 0x853c49e6748fea9bull;
static uint64_t rnd(void) { return xorshift64(&g_rng); }

/* One expert matrix [n, k] in FP4: random codes, scales 2^-8 .. 2^-6 (outputs of order one). */
static struct qweight make_fp4(int64_t n, int64_t k) {
    uint8_t *w = malloc((size_t)(n * k / 2)), *s = malloc((size_t)(n * k / 32));
    if (!w || !s) {
        fprintf(stderr, "bench_moe: out of host memory for the experts\n");
        exit(2);
    }
    for (int64_t i = 0; i < n * k / 2; i++) w[i] = (uint8_t)rnd();
    for (int64_t i = 0; i < n * k / 32; i++) s[i] = (uint8_t)(119 + rnd() % 3);
    struct qweight q = {.fmt = WF_FP4, .n = n, .k = k, .ld = k / 2, .s_ld = k / 32, .w = w, .s = s};
    return q;
}

/* The calls of one pass over a token count's routing sets (a call per set, into one output). */
struct pass {
    struct backend *be;
    bf16_t *y, *x;
    int32_t *idx;
    float *wts;
    int64_t T, D, n_local;
    int ns;
    const struct qweight *w1, *w3, *w2;
};

static void run_pass(const void *ctx) {
    const struct pass *p = ctx;
    for (int s = 0; s < p->ns; s++)
        p->be->ops->moe_experts(p->be, p->y, p->x + (int64_t)s * p->T * p->D, p->idx + (int64_t)s * p->T * TOPK,
                                p->wts + (int64_t)s * p->T * TOPK, p->T, TOPK, 0, p->n_local, p->w1, p->w3, p->w2, LIMIT);
}

/* The 8-token case's first set in the baseline's form (see the header). */
static int dump_case(const char *dir, struct backend *be, const struct pass *p, const bf16_t *xh, const int32_t *idxh,
                     const float *wtsh, const struct qweight *h1, const struct qweight *h3, const struct qweight *h2,
                     int64_t I) {
    const int64_t T = p->T, D = p->D;
    bf16_t *yd = be->ops->alloc(be, sizeof(uint16_t) * (size_t)(T * TOPK * D)); /* zero-filled */
    be->ops->moe_experts(be, yd, p->x, p->idx, p->wts, T, TOPK, 0, p->n_local, p->w1, p->w3, p->w2, LIMIT);
    uint16_t *yh = malloc(sizeof(uint16_t) * (size_t)(T * TOPK * D));
    be->ops->download(be, yh, yd, sizeof(uint16_t) * (size_t)(T * TOPK * D));
    be->ops->sync(be);
    be->ops->free(be, yd);
    int32_t experts[TOPK * 8], map[E_TOTAL], nd = 0, idx2[8 * TOPK];
    for (int e = 0; e < E_TOTAL; e++) map[e] = -1;
    for (int64_t i = 0; i < T * TOPK; i++) {
        const int32_t e = idxh[i];
        if (e < p->n_local && map[e] < 0) map[e] = nd, experts[nd++] = e;
        idx2[i] = e < p->n_local ? map[e] : -1;
    }
    const size_t b13 = (size_t)(I * D / 2), s13 = (size_t)(I * D / 32), b2 = (size_t)(D * I / 2), s2 = (size_t)(D * I / 32);
    uint8_t *w1 = malloc(b13 * nd + 1), *w3 = malloc(b13 * nd + 1), *w2 = malloc(b2 * nd + 1);
    uint8_t *sc1 = malloc(s13 * nd + 1), *sc3 = malloc(s13 * nd + 1), *sc2 = malloc(s2 * nd + 1);
    for (int j = 0; j < nd; j++) {
        const int e = experts[j];
        memcpy(w1 + b13 * j, h1[e].w, b13), memcpy(sc1 + s13 * j, h1[e].s, s13);
        memcpy(w3 + b13 * j, h3[e].w, b13), memcpy(sc3 + s13 * j, h3[e].s, s13);
        memcpy(w2 + b2 * j, h2[e].w, b2), memcpy(sc2 + s2 * j, h2[e].s, s2);
    }
    char meta[256];
    const int len = snprintf(meta, sizeof meta, "%lld %d %lld %lld %d %.9g\n", (long long)T, TOPK, (long long)D,
                             (long long)I, nd, LIMIT);
    int rc = bench_write_file("bench_moe", dir, "meta.txt", meta, (size_t)len) ||
             bench_write_file("bench_moe", dir, "x.bin", xh, sizeof(uint16_t) * (size_t)(T * D)) ||
             bench_write_file("bench_moe", dir, "idx.bin", idx2, sizeof(int32_t) * (size_t)(T * TOPK)) ||
             bench_write_file("bench_moe", dir, "wts.bin", wtsh, sizeof(float) * (size_t)(T * TOPK)) ||
             bench_write_file("bench_moe", dir, "experts.bin", experts, sizeof(int32_t) * (size_t)nd) ||
             bench_write_file("bench_moe", dir, "w1.bin", w1, b13 * nd) || bench_write_file("bench_moe", dir, "s1.bin", sc1, s13 * nd) ||
             bench_write_file("bench_moe", dir, "w3.bin", w3, b13 * nd) || bench_write_file("bench_moe", dir, "s3.bin", sc3, s13 * nd) ||
             bench_write_file("bench_moe", dir, "w2.bin", w2, b2 * nd) || bench_write_file("bench_moe", dir, "s2.bin", sc2, s2 * nd) ||
             bench_write_file("bench_moe", dir, "y.bin", yh, sizeof(uint16_t) * (size_t)(T * TOPK * D));
    free(w1), free(w3), free(w2), free(sc1), free(sc3), free(sc2), free(yh);
    return rc ? 2 : 0;
}

int main(int argc, char **argv) {
    const char *backend = "cuda", *csv = NULL, *dump = NULL;
    int64_t toks[16] = {1, 8, 64, 256, 2048}, dims[2] = {5120, 2304}, n_local = 48;
    int n_toks = 5, iters = 20;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--backend") && i + 1 < argc) backend = argv[++i];
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) n_toks = bench_parse_list(argv[++i], toks, 16);
        else if (!strcmp(argv[i], "--dims") && i + 1 < argc) {
            if (bench_parse_list(argv[++i], dims, 2) != 2) dims[0] = 0;
        } else if (!strcmp(argv[i], "--local") && i + 1 < argc) n_local = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--csv") && i + 1 < argc) csv = argv[++i];
        else if (!strcmp(argv[i], "--dump") && i + 1 < argc) dump = argv[++i];
        else {
            fprintf(stderr, "usage: bench_moe [--backend cuda|cpu] [--tokens 1,8,64,256,2048] [--dims D,I] [--local N] "
                            "[--iters N] [--csv F] [--dump DIR]\n");
            return 2;
        }
    }
    const int64_t D = dims[0], I = dims[1];
    if (n_toks <= 0 || iters <= 0 || D <= 0 || I <= 0 || D % 32 || I % 32 || n_local < 1 || n_local > E_TOTAL) {
        fprintf(stderr, "bench_moe: --tokens and --iters take positive numbers, --dims two multiples of 32, "
                        "--local 1 .. %d\n", E_TOTAL);
        return 2;
    }
    struct backend be;
    const char *device;
    double copy_bw;
    if (bench_backend_open("bench_moe", backend, &be, &device, &copy_bw)) return 2;
    const struct backend_ops *ops = be.ops;
    FILE *f = bench_csv_open(csv, "backend,device,tokens,d,inter,n_local,pairs,experts,path,ms_per_call,bytes,"
                                  "gb_per_s,fraction_of_copy_bw,copy_gb_per_s,tflops\n");

    /* the experts: host copies kept (the CPU backend reads them; the dump writes them) */
    struct qweight *h1 = calloc((size_t)n_local, sizeof *h1), *h3 = calloc((size_t)n_local, sizeof *h3),
                   *h2 = calloc((size_t)n_local, sizeof *h2), *w1 = calloc((size_t)n_local, sizeof *w1),
                   *w3 = calloc((size_t)n_local, sizeof *w3), *w2 = calloc((size_t)n_local, sizeof *w2);
    for (int64_t e = 0; e < n_local; e++) {
        h1[e] = make_fp4(I, D), h3[e] = make_fp4(I, D), h2[e] = make_fp4(D, I);
        w1[e] = h1[e], w3[e] = h3[e], w2[e] = h2[e];
        if (ops->weight_prepare(&be, &w1[e], false) || ops->weight_prepare(&be, &w3[e], false) ||
            ops->weight_prepare(&be, &w2[e], false)) {
            fprintf(stderr, "bench_moe: weight_prepare failed\n");
            return 2;
        }
    }
    const double ebytes = 2.0 * (double)(I * D / 2 + I * D / 32) + (double)(D * I / 2 + D * I / 32);
    printf("# %s (%s), %lld local experts of %d, top-%d, w1/w3 [%lld, %lld], w2 [%lld, %lld] FP4 (%.2f MB an expert); "
           "device-to-device copy %.0f GB/s\n",
           device, backend, (long long)n_local, E_TOTAL, TOPK, (long long)I, (long long)D, (long long)D, (long long)I,
           ebytes / 1e6, copy_bw / 1e9);
    printf("# %6s %7s %7s %-10s %10s %10s %9s %8s\n", "tokens", "pairs", "experts", "path", "ms/call", "GB/s", "of copy",
           "TFLOP/s");

    int rc = 0;
    bool dumped = false;
    for (int ti = 0; ti < n_toks; ti++) {
        const int64_t T = toks[ti];
        const int ns = T <= DECODE_MAX_T ? NSETS : 1;
        bf16_t *xh = malloc(sizeof(uint16_t) * (size_t)(ns * T * D));
        int32_t *idxh = malloc(sizeof(int32_t) * (size_t)(ns * T * TOPK));
        float *wtsh = malloc(sizeof(float) * (size_t)(ns * T * TOPK));
        for (int64_t i = 0; i < ns * T * D; i++) xh[i] = bf16_from_f32((float)((int64_t)(rnd() % 2001) - 1000) * 1e-3f);
        double pairs = 0.0, experts = 0.0;
        for (int s = 0; s < ns; s++) {
            uint8_t hit[E_TOTAL] = {0};
            for (int64_t t = 0; t < T; t++) {
                int32_t *ir = idxh + ((int64_t)s * T + t) * TOPK;
                for (int j = 0; j < TOPK;) {
                    const int32_t e = (int32_t)(rnd() % E_TOTAL);
                    bool dup = false;
                    for (int u = 0; u < j; u++) dup |= ir[u] == e;
                    if (dup) continue;
                    ir[j] = e;
                    wtsh[((int64_t)s * T + t) * TOPK + j] = (float)(1 + rnd() % 999) * 1e-3f;
                    if (e < n_local) pairs += 1.0, experts += !hit[e], hit[e] = 1;
                    j++;
                }
            }
        }
        pairs /= ns, experts /= ns;
        bf16_t *x = ops->alloc(&be, sizeof(uint16_t) * (size_t)(ns * T * D));
        int32_t *idx = ops->alloc(&be, sizeof(int32_t) * (size_t)(ns * T * TOPK));
        float *wts = ops->alloc(&be, sizeof(float) * (size_t)(ns * T * TOPK));
        bf16_t *y = ops->alloc(&be, sizeof(uint16_t) * (size_t)(T * TOPK * D));
        ops->upload(&be, x, xh, sizeof(uint16_t) * (size_t)(ns * T * D));
        ops->upload(&be, idx, idxh, sizeof(int32_t) * (size_t)(ns * T * TOPK));
        ops->upload(&be, wts, wtsh, sizeof(float) * (size_t)(ns * T * TOPK));
        struct pass p = {&be, y, x, idx, wts, T, D, n_local, ns, w1, w3, w2};
        double ms[2];
        const uint64_t key[3] = {0x30e0001u, (uint64_t)T, (uint64_t)ns};
        for (int eager = 0; eager < 2; eager++) ms[eager] = bench_time_pass(&be, run_pass, &p, ns, key, 3, !eager, iters);
        if (dump && T == 8) {
            rc |= dump_case(dump, &be, &p, xh, idxh, wtsh, h1, h3, h2, I);
            dumped = true;
        }
        const double bytes = experts * ebytes + 2.0 * (double)(T * D) + 2.0 * pairs * (double)D;
        const double flops = pairs * 6.0 * (double)(I * D);
        for (int eager = 0; eager < 2; eager++) {
            const char *path = eager ? "ours_eager" : "ours";
            const double gbs = bytes / (ms[eager] * 1e-3) / 1e9, tf = flops / (ms[eager] * 1e-3) / 1e12;
            const double frac = copy_bw > 0 ? gbs * 1e9 / copy_bw : 0.0;
            printf("  %6lld %7.1f %7.1f %-10s %10.4f %10.0f %8.1f%% %8.2f\n", (long long)T, pairs, experts, path, ms[eager],
                   gbs, 100.0 * frac, tf);
            if (f)
                fprintf(f, "%s,%s,%lld,%lld,%lld,%lld,%.2f,%.2f,%s,%.5f,%.0f,%.1f,%.4f,%.1f,%.3f\n", backend, device,
                        (long long)T, (long long)D, (long long)I, (long long)n_local, pairs, experts, path, ms[eager],
                        bytes, gbs, frac, copy_bw / 1e9, tf);
        }
        ops->free(&be, x);
        ops->free(&be, idx);
        ops->free(&be, wts);
        ops->free(&be, y);
        free(xh);
        free(idxh);
        free(wtsh);
    }
    if (dump && !dumped) {
        fprintf(stderr, "bench_moe: --dump writes the 8-token case: put 8 in --tokens\n");
        rc = 2;
    }
    if (f) fclose(f);
    for (int64_t e = 0; e < n_local; e++) {
        ops->weight_release(&be, &w1[e]), ops->weight_release(&be, &w3[e]), ops->weight_release(&be, &w2[e]);
        free((void *)h1[e].w), free((void *)h1[e].s), free((void *)h3[e].w), free((void *)h3[e].s);
        free((void *)h2[e].w), free((void *)h2[e].s);
    }
    free(h1), free(h3), free(h2), free(w1), free(w3), free(w2);
    return rc;
}
