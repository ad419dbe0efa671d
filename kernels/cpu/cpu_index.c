/* The indexer's selection ops on the CPU backend (index_topk, cand_mask) and sparse_attn's index
 * lists and window ring (attn_index, ring_store: kernels/attn_index_core.h, the entries the CUDA
 * kernels compute too). Every row of the selection runs kernels/topk_core.h's block-parallel
 * selection as a block of one thread — the code the CUDA kernels run with a block of 128 — so a
 * top-k set is the same on both backends by construction, and the golden fixtures check the
 * formulation the GPU runs. Rows are independent (OpenMP over rows only). */
#include <stdlib.h>
#include <string.h>

#include "attn_index_core.h"
#include "cpu_internal.h"
#include "log.h"
#include "topk_core.h"

static int64_t max_p(const int32_t *p, int64_t T, int field) {
    int64_t m = 0;
    for (int64_t r = 0; r < T; r++)
        if (p[r * TOPK_P_COUNT + field] > m) m = p[r * TOPK_P_COUNT + field];
    return m;
}

/* One OpenMP thread's work space for rows of up to n entries (topk_core.h's block of one thread). */
struct topk_ws {
    struct topk_elem *q;
    int32_t *wl, *wr, cnt[4];
    struct topk_blk st;
};

static void ws_init(struct topk_ws *w, int64_t n) {
    w->q = ds_malloc(sizeof *w->q * (size_t)(n + 1));
    w->wl = ds_malloc(sizeof *w->wl * (size_t)(n + 1));
    w->wr = ds_malloc(sizeof *w->wr * (size_t)(n + 1));
}

static void ws_free(struct topk_ws *w) {
    free(w->q);
    free(w->wl);
    free(w->wr);
}

void cpu_op_index_topk(struct backend *be, int32_t *top, int64_t ld_top, const float *S, int64_t ld_s,
                       const int32_t *p, const uint8_t *mask, int64_t ld_m, int64_t T) {
    int64_t nmax = max_p(p, T, TOPK_P_N);
#pragma omp parallel
    {
        struct topk_ws w;
        ws_init(&w, nmax);
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < T; r++) {
            const int32_t *pr = p + r * TOPK_P_COUNT;
            const float *row = S + r * ld_s;
            const uint8_t *mr = mask ? mask + r * ld_m : NULL;
            for (int64_t j = 0; j < pr[TOPK_P_N]; j++)
                w.q[j] = (struct topk_elem){topk_entry(row, j, pr[TOPK_P_VALID], mr, ld_m), (int32_t)j};
            topk_par_row(top + r * ld_top, ld_top, pr, w.q, w.wl, w.wr, w.cnt, &w.st, 0, 1);
        }
        ws_free(&w);
    }
}

void cpu_op_cand_mask(struct backend *be, uint8_t *mask, int64_t ld_m, const float *S, int64_t ld_s,
                      const int32_t *p, int64_t T, int64_t topk_blocks, int64_t bs) {
    int64_t nbmax = (max_p(p, T, TOPK_P_N) + bs - 1) / bs;
#pragma omp parallel
    {
        struct topk_ws w;
        ws_init(&w, nbmax);
        uint8_t *keep = ds_malloc((size_t)nbmax + 1);
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < T; r++) {
            const int32_t *pr = p + r * TOPK_P_COUNT;
            int64_t n = pr[TOPK_P_N], vis = pr[TOPK_P_VISIBLE], nb = (n + bs - 1) / bs;
            for (int64_t b = 0; b < nb; b++)
                w.q[b] = (struct topk_elem){topk_block_max(S + r * ld_s, b, bs, n, pr[TOPK_P_VALID]), (int32_t)b};
            if (vis > 0 && (vis - 1) / bs < nb) w.q[(vis - 1) / bs].v = __builtin_inff();
            memset(keep, 0, (size_t)nb + 1);
            topk_par_cand(keep, nb, topk_blocks, w.q, w.wl, w.wr, w.cnt, &w.st, 0, 1);
            uint8_t *out = mask + r * ld_m;
            for (int64_t j = 0; j < ld_m; j++) out[j] = j < n ? keep[j / bs] : 0;
        }
        free(keep);
        ws_free(&w);
    }
}

void cpu_op_attn_index(struct backend *be, int32_t *dst, int64_t n_idx, const int32_t *geo, int64_t T,
                       const struct attn_index_par *par) {
    for (int64_t r = 0; r < T; r++) {
        const int32_t *g = geo + r * AIX_COLS, *srow = par->k ? par->src + r * par->ld_src : NULL;
        for (int64_t j = 0; j < n_idx; j++)
            dst[r * n_idx + j] = attn_index_entry(g, j, par->W, par->ring0, srow, par->k, par->src0, par->cap);
    }
}

void cpu_op_ring_store(struct backend *be, bf16_t *ring, const bf16_t *kv, const int32_t *geo, int64_t T, int64_t W,
                       int64_t hd) {
    for (int64_t r = 0; r < T; r++) {
        const int64_t q = ring_store_row(geo + r * AIX_COLS, W);
        if (q >= 0) memcpy(ring + q * hd, kv + r * hd, sizeof(bf16_t) * (size_t)hd);
    }
}
