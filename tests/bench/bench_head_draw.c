/* The last stage's head, greedy draw and log-probabilities at the real per-rank shapes, both ways
 * the engine can run them (make bench; GPU machine, or --backend cpu anywhere):
 *  - host: the head's logits [R, V_local] fp32 downloaded into host_alloc memory (page-locked on
 *    a GPU) and each row drawn by sampler_pick at temperature 0 on the rank's OpenMP threads
 *    (what a step with --save-logits or a temperature still does);
 *  - backend: the argmax op where the logits are, [R][2] int32 downloaded and merged
 *    (model_forward_draws' path on one rank: sampler_greedy_merge of one slice);
 *  - host_lp / backend_lp: the same for one log-probability a row (a target id each, as `dsbatch
 *    score` takes every prompt row's): sampler_logprob over the downloaded rows, or the row_lse op
 *    (lse_slices(V_local) slices) + [R][slices] parts downloaded + sampler_lse_merge;
 *  - host_topk / backend_topk: a top-k draw a row (temperature 0.8, top-k 50, top-p 0.95):
 *    sampler_pick over the downloaded rows, or the row_topk op + [R][50] lists downloaded +
 *    sampler_pick_topk (one slice: the merge of a TP rank's list is not counted);
 *  - host_tp / backend_tp: a full-row temperature draw a row (temperature 0.3, top-p 0.95, no
 *    top-k): sampler_pick over the downloaded rows, or the row_topk op (BE_TOPK_MAX entries) and
 *    row_lse with the temperature, both downloaded, + sampler_wsum_merge + sampler_pick_cand, and
 *    for rows the list does not decide the row downloaded + sampler_pick (counted: "whole rows").
 *    The temperature is low because these rows are random: at 0.3 their 0.95-nucleus is a few
 *    hundred entries at most, as a trained model's rows at its usual temperatures.
 * Each is timed from the head's launch to the tokens or log-probabilities on the host (the backend
 * synchronized), as a step pays them, and the head alone beside them — on the GPU as the engine
 * runs it (the tensor-core switch on: cuda_op_head's BF16 mma tilings) and with --exact-linears'
 * exact kernel (path head_exact); the host and backend draws must give the same tokens and the
 * same log-probability bits (exit 1 otherwise). x [R, 5120] bf16 and the head [V_local, 5120] bf16
 * are random. V_local 16,160 is a TP8 rank's columns of the 129,280 vocabulary (the row-split draw
 * then hands each rank R/8 whole rows: the host path's download and draws shrink by 8, the
 * all-to-all is not counted here); 129,280 is one rank's whole head.
 *   bench_head_draw [--backend cuda|cpu] [--rows 1,8,64,256] [--vocab 16160,129280] [--iters N] [--csv F]
 * CSV: backend,device,v_local,rows,path,ms,ms_min (path: head, host, backend, head_exact, host_lp,
 * backend_lp, host_topk, backend_topk, host_tp, backend_tp). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "bench/bench_util.h"
#include "formats.h"
#include "lse_core.h"
#include "sampler.h"
#include "xorshift.h"

#define DIM 5120

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) { return xorshift64(&g_rng); }

/* The host paths: the logits lg [R, V] downloaded into host and each row drawn by sampler_pick
 * (request r, the given position) on the rank's threads, as dist.c draws downloaded rows. */
static void host_draws(struct backend *be, float *host, const float *lg, int64_t R, int64_t V,
                       const struct sample_params *sp, uint64_t position, int32_t *out) {
    be->ops->download(be, host, lg, sizeof(float) * (size_t)(R * V));
    be->ops->sync(be);
#pragma omp parallel for schedule(dynamic, 1) if (R > 1)
    for (int64_t r = 0; r < R; r++) out[r] = sampler_pick(host + r * V, (int)V, sp, (uint64_t)r, position);
}

int main(int argc, char **argv) {
    const char *backend = "cuda", *csv = NULL;
    int64_t rows[16] = {1, 8, 64, 256}, vocab[8] = {16160, 129280};
    int n_rows = 4, n_vocab = 2, iters = 20;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--backend") && i + 1 < argc) backend = argv[++i];
        else if (!strcmp(argv[i], "--rows") && i + 1 < argc) n_rows = bench_parse_list(argv[++i], rows, 16);
        else if (!strcmp(argv[i], "--vocab") && i + 1 < argc) n_vocab = bench_parse_list(argv[++i], vocab, 8);
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--csv") && i + 1 < argc) csv = argv[++i];
        else {
            fprintf(stderr, "usage: bench_head_draw [--backend cuda|cpu] [--rows 1,8,64,256] [--vocab 16160,129280] "
                            "[--iters N] [--csv F]\n");
            return 2;
        }
    }
    if (n_rows <= 0 || n_vocab <= 0 || iters <= 0) {
        fprintf(stderr, "bench_head_draw: --rows, --vocab and --iters take positive numbers\n");
        return 2;
    }
    struct backend be;
    const char *device;
    if (bench_backend_open("bench_head_draw", backend, &be, &device, NULL)) return 2;
    const struct backend_ops *ops = be.ops;
    FILE *f = csv ? fopen(csv, "w") : NULL;
    if (csv && !f) {
        perror(csv);
        return 2;
    }
    if (f) fprintf(f, "backend,device,v_local,rows,path,ms,ms_min\n");
    printf("%-8s %8s %5s %10s %10s %10s %10s %10s %10s %10s %10s %10s %10s   (ms a step, mean of %d; host = download + host "
           "draws)\n",
           "backend", "v_local", "rows", "head", "host", "backend", "head_exact", "host_lp", "backend_lp", "host_topk",
           "backend_topk", "host_tp", "backend_tp", iters);
    int rc = 0;
    for (int vi = 0; vi < n_vocab; vi++) {
        const int64_t V = vocab[vi];
        bf16_t *wh = malloc(sizeof(uint16_t) * (size_t)(V * DIM));
        for (int64_t i = 0; i < V * DIM; i++) wh[i] = bf16_from_f32((float)((int64_t)(rnd() % 2001) - 1000) * 1e-4f);
        struct qweight W = {.fmt = WF_BF16, .n = V, .k = DIM, .ld = DIM, .w = wh};
        if (ops->weight_prepare(&be, &W, false)) {
            fprintf(stderr, "bench_head_draw: weight_prepare failed\n");
            return 2;
        }
        for (int ri = 0; ri < n_rows; ri++) {
            const int64_t R = rows[ri];
            bf16_t *xh = malloc(sizeof(uint16_t) * (size_t)(R * DIM));
            for (int64_t i = 0; i < R * DIM; i++) xh[i] = bf16_from_f32((float)((int64_t)(rnd() % 2001) - 1000) * 1e-3f);
            bf16_t *x = ops->alloc(&be, sizeof(uint16_t) * (size_t)(R * DIM));
            float *lg = ops->alloc(&be, sizeof(float) * (size_t)(R * V));
            int32_t *am = ops->alloc(&be, sizeof(int32_t) * (size_t)(2 * R));
            const int64_t ns = lse_slices(V);
            struct be_lse_part *pt = ops->alloc(&be, sizeof *pt * (size_t)(R * ns)), *pth = malloc(sizeof *pth * (size_t)(R * ns));
            int32_t *tgh = malloc(sizeof(int32_t) * (size_t)R), *tg = ops->alloc(&be, sizeof(int32_t) * (size_t)R);
            double *lp_host = malloc(sizeof(double) * (size_t)R), *lp_be = malloc(sizeof(double) * (size_t)R);
            enum { TOPK = 50 };
            const struct sample_params tsp = {.temperature = 0.8f, .top_k = TOPK, .top_p = 0.95f, .seed = 1};
            struct be_topk_entry *tk = ops->alloc(&be, sizeof *tk * (size_t)(R * TOPK)),
                                 *tkh = malloc(sizeof *tkh * (size_t)(R * TOPK));
            int32_t *k_host = malloc(sizeof(int32_t) * (size_t)R), *k_be = malloc(sizeof(int32_t) * (size_t)R);
            const struct sample_params psp = {.temperature = 0.3f, .top_p = 0.95f, .seed = 3};
            const int64_t KC = sampler_full_list_len(V);
            struct be_topk_entry *cd = ops->alloc(&be, sizeof *cd * (size_t)(R * KC)),
                                 *cdh = malloc(sizeof *cdh * (size_t)(R * KC));
            float *tph = malloc(sizeof(float) * (size_t)R), *tpd = ops->alloc(&be, sizeof(float) * (size_t)R),
                  *whole = malloc(sizeof(float) * (size_t)V);
            for (int64_t r = 0; r < R; r++) tph[r] = psp.temperature;
            ops->upload(&be, tpd, tph, sizeof(float) * (size_t)R);
            struct be_lse_part *wp = ops->alloc(&be, sizeof *wp * (size_t)(R * ns)), *wph = malloc(sizeof *wph * (size_t)(R * ns));
            int32_t *p_host = malloc(sizeof(int32_t) * (size_t)R), *p_be = malloc(sizeof(int32_t) * (size_t)R);
            int64_t n_whole = 0;
            for (int64_t r = 0; r < R; r++) tgh[r] = (int32_t)(rnd() % (uint64_t)V);
            ops->upload(&be, tg, tgh, sizeof(int32_t) * (size_t)R);
            float *host = ops->host_alloc ? ops->host_alloc(&be, sizeof(float) * (size_t)(R * V))
                                          : malloc(sizeof(float) * (size_t)(R * V));
            int32_t *amh = malloc(sizeof(int32_t) * (size_t)(2 * R)), *t_host = malloc(sizeof(int32_t) * (size_t)R),
                    *t_be = malloc(sizeof(int32_t) * (size_t)R);
            ops->upload(&be, x, xh, sizeof(uint16_t) * (size_t)(R * DIM));
            enum { NP = 10 };
            double sum[NP] = {0}, mn[NP];
            for (int p = 0; p < NP; p++) mn[p] = 1e30;
            for (int it = -2; it < iters; it++) { /* two warm-up rounds */
                double t[NP];
                for (int p = 0; p < NP; p++) {
#ifdef DS_HAVE_CUDA
                    if (p == 3 && strcmp(backend, "cpu")) backend_cuda_set_mma(&be, false);
#endif
                    ops->sync(&be);
                    const double t0 = bench_now_s();
                    ops->head(&be, lg, x, R, &W);
                    if (p == 1) {
                        const struct sample_params greedy = {.temperature = 0.0f};
                        host_draws(&be, host, lg, R, V, &greedy, 0, t_host);
                    } else if (p == 2) {
                        ops->argmax(&be, am, lg, R, V);
                        ops->download(&be, amh, am, sizeof(int32_t) * (size_t)(2 * R));
                        ops->sync(&be);
                        sampler_greedy_merge(t_be, amh, R, 1, V);
                    } else if (p == 4) {
                        ops->download(&be, host, lg, sizeof(float) * (size_t)(R * V));
                        ops->sync(&be);
#pragma omp parallel for schedule(static) if (R > 1)
                        for (int64_t r = 0; r < R; r++) lp_host[r] = sampler_logprob(host + r * V, (int)V, tgh[r]);
                    } else if (p == 5) {
                        ops->row_lse(&be, pt, lg, R, V, ns, tg, NULL);
                        ops->download(&be, pth, pt, sizeof *pt * (size_t)(R * ns));
                        ops->sync(&be);
                        for (int64_t r = 0; r < R; r++) {
                            float mx;
                            const double ls = sampler_lse_merge(pth + r * ns, ns, &mx);
                            lp_be[r] = (double)pth[r * ns + tgh[r] / (V / ns)].t - (double)mx - ls;
                        }
                    } else if (p == 6) {
                        host_draws(&be, host, lg, R, V, &tsp, 7, k_host);
                    } else if (p == 7) {
                        ops->row_topk(&be, tk, lg, R, V, TOPK);
                        ops->download(&be, tkh, tk, sizeof *tkh * (size_t)(R * TOPK));
                        ops->sync(&be);
#pragma omp parallel for schedule(static) if (R > 8) /* as model.c's head_topk */
                        for (int64_t r = 0; r < R; r++) k_be[r] = sampler_pick_topk(tkh + r * TOPK, TOPK, &tsp, (uint64_t)r, 7);
                    } else if (p == 8) {
                        host_draws(&be, host, lg, R, V, &psp, 9, p_host);
                    } else if (p == 9) {
                        ops->row_lse(&be, wp, lg, R, V, ns, NULL, tpd);
                        ops->row_topk(&be, cd, lg, R, V, KC);
                        ops->download(&be, wph, wp, sizeof *wph * (size_t)(R * ns));
                        ops->download(&be, cdh, cd, sizeof *cdh * (size_t)(R * KC));
                        ops->sync(&be);
#pragma omp parallel for schedule(static) if (R > 8) /* as model.c's head_topk */
                        for (int64_t r = 0; r < R; r++) {
                            float mx;
                            const double Z = sampler_wsum_merge(wph + r * ns, ns, psp.temperature, &mx);
                            p_be[r] = sampler_pick_cand(cdh + r * KC, KC, V, Z, &psp, (uint64_t)r, 9);
                        }
                        for (int64_t r = 0; r < R; r++) {
                            if (p_be[r] >= 0) continue;
                            ops->download(&be, whole, lg + r * V, sizeof(float) * (size_t)V);
                            ops->sync(&be);
                            p_be[r] = sampler_pick(whole, (int)V, &psp, (uint64_t)r, 9);
                            n_whole += it >= 0;
                        }
                    }
                    ops->sync(&be);
                    t[p] = bench_now_s() - t0;
#ifdef DS_HAVE_CUDA
                    if (p == 3 && strcmp(backend, "cpu")) backend_cuda_set_mma(&be, true);
#endif
                }
                if (it < 0) continue;
                for (int p = 0; p < NP; p++) {
                    sum[p] += t[p];
                    if (t[p] < mn[p]) mn[p] = t[p];
                }
                if (memcmp(t_host, t_be, sizeof(int32_t) * (size_t)R)) {
                    fprintf(stderr, "bench_head_draw: V %lld rows %lld: the backend's draws differ from the host's\n",
                            (long long)V, (long long)R);
                    rc = 1;
                }
                if (memcmp(k_host, k_be, sizeof(int32_t) * (size_t)R)) {
                    fprintf(stderr, "bench_head_draw: V %lld rows %lld: the backend's top-k draws differ from the host's\n",
                            (long long)V, (long long)R);
                    rc = 1;
                }
                if (memcmp(p_host, p_be, sizeof(int32_t) * (size_t)R)) {
                    fprintf(stderr, "bench_head_draw: V %lld rows %lld: the backend's full-row draws differ from the host's\n",
                            (long long)V, (long long)R);
                    rc = 1;
                }
                if (memcmp(lp_host, lp_be, sizeof(double) * (size_t)R)) {
                    fprintf(stderr, "bench_head_draw: V %lld rows %lld: the backend's log-probabilities differ from the host's\n",
                            (long long)V, (long long)R);
                    rc = 1;
                }
            }
            static const char *const names[NP] = {"head",      "host",         "backend", "head_exact", "host_lp",
                                                  "backend_lp", "host_topk", "backend_topk", "host_tp", "backend_tp"};
            printf("%-8s %8lld %5lld", backend, (long long)V, (long long)R);
            for (int p = 0; p < NP; p++) printf(" %10.3f", 1e3 * sum[p] / iters);
            printf("   whole rows %lld of %lld\n", (long long)n_whole, (long long)(R * iters));
            for (int p = 0; p < NP && f; p++)
                fprintf(f, "%s,%s,%lld,%lld,%s,%.4f,%.4f\n", backend, device, (long long)V, (long long)R, names[p],
                        1e3 * sum[p] / iters, 1e3 * mn[p]);
            ops->free(&be, x);
            ops->free(&be, lg);
            ops->free(&be, am);
            ops->free(&be, pt);
            ops->free(&be, tg);
            ops->free(&be, tk);
            ops->free(&be, cd);
            ops->free(&be, tpd);
            ops->free(&be, wp);
            free(cdh), free(tph), free(whole), free(wph), free(p_host), free(p_be);
            free(pth), free(tgh), free(lp_host), free(lp_be), free(tkh), free(k_host), free(k_be);
            if (ops->host_alloc) ops->host_free(&be, host);
            else free(host);
            free(xh), free(amh), free(t_host), free(t_be);
        }
        ops->weight_release(&be, &W);
        free(wh);
    }
    if (f) fclose(f);
    return rc;
}
