/* kernels/topk_core.h's block-parallel selection against its sequential original, on the CPU with
 * real threads: this file sets TOPK_SYNC to a pthread barrier, so nt threads run the very phases a
 * CUDA block runs (chunked stopper lists, scans, the swaps of one partition at once), and the
 * result must be the sequential one element for element — the same permutation of q after
 * topk_par_select as after topk_select (libstdc++'s introselect / heap select in torch's tie
 * order), the same sorted top-k rows (topk_par_row vs topk_select + sort + the visible rule) and the
 * same candidate blocks (topk_par_cand). Inputs are built to tie: values from a handful of levels,
 * many exact zeros, -inf and NaN; sizes from 1 to 40,000 (the heap-select path), k from 1 to n. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static pthread_barrier_t g_bar;
#define TOPK_SYNC() pthread_barrier_wait(&g_bar)
#include "topk_core.h"
#include "xorshift.h"

#define MAX_NT 8

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) { return xorshift64(&g_rng); }

/* tie-heavy scores: kind 0 = few levels, 1 = mostly zeros, 2 = many distinct, all with -inf and NaN */
static float draw(int kind) {
    uint64_t r = rnd() % 1000;
    if (r < 20) return -INFINITY;
    if (r < 25) return NAN;
    if (kind == 1 && r < 700) return 0.0f;
    if (kind == 0) return (float)(rnd() % 5) * 0.25f;
    return (float)(rnd() % 4096) / 64.0f - 8.0f;
}

static void fill(struct topk_elem *q, int64_t n, int kind) {
    for (int64_t j = 0; j < n; j++) q[j] = (struct topk_elem){draw(kind), (int32_t)j};
}

enum job { JOB_SELECT, JOB_ROW, JOB_CAND };
struct shared {
    enum job job;
    struct topk_elem *q;
    int64_t n, k;
    int32_t *wl, *wr, *cnt, *top, p[TOPK_P_COUNT];
    int64_t ld_top;
    uint8_t *keep;
    struct topk_blk s;
    int nt;
};
struct targ {
    struct shared *sh;
    int tid;
};

static void *worker(void *v) {
    struct targ *a = v;
    struct shared *sh = a->sh;
    if (sh->job == JOB_SELECT) topk_par_select(sh->q, sh->n, sh->k, sh->wl, sh->wr, sh->cnt, &sh->s, a->tid, sh->nt);
    if (sh->job == JOB_ROW) topk_par_row(sh->top, sh->ld_top, sh->p, sh->q, sh->wl, sh->wr, sh->cnt, &sh->s, a->tid, sh->nt);
    if (sh->job == JOB_CAND) topk_par_cand(sh->keep, sh->n, sh->k, sh->q, sh->wl, sh->wr, sh->cnt, &sh->s, a->tid, sh->nt);
    return NULL;
}

/* every thread runs the job, as every thread of a CUDA block does */
static void run_block(struct shared *sh, int nt) {
    pthread_t th[MAX_NT];
    struct targ ta[MAX_NT];
    sh->nt = nt;
    assert_int_equal(pthread_barrier_init(&g_bar, NULL, (unsigned)nt), 0);
    for (int t = 0; t < nt; t++) {
        ta[t] = (struct targ){sh, t};
        assert_int_equal(pthread_create(&th[t], NULL, worker, &ta[t]), 0);
    }
    for (int t = 0; t < nt; t++) pthread_join(th[t], NULL);
    pthread_barrier_destroy(&g_bar);
}

static struct shared *new_shared(int64_t n) {
    struct shared *sh = calloc(1, sizeof *sh);
    sh->q = malloc(sizeof *sh->q * (size_t)(n + 1));
    sh->wl = malloc(sizeof(int32_t) * (size_t)(n + 1));
    sh->wr = malloc(sizeof(int32_t) * (size_t)(n + 1));
    sh->cnt = malloc(sizeof(int32_t) * (2 * MAX_NT + 2));
    sh->top = malloc(sizeof(int32_t) * (size_t)(n + 8));
    sh->keep = calloc((size_t)n + 1, 1);
    return sh;
}

static void free_shared(struct shared *sh) {
    free(sh->q);
    free(sh->wl);
    free(sh->wr);
    free(sh->cnt);
    free(sh->top);
    free(sh->keep);
    free(sh);
}

static const int64_t SIZES[] = {1, 2, 3, 4, 5, 7, 17, 64, 100, 513, 1000, 2048, 4099, 40000};
static const int NTS[] = {1, 3, 8};

static int64_t pick_k(int64_t n, int c) {
    int64_t ks[] = {1, 2, n / 2, n - 1, n, 512, 3, 1 + (int64_t)(rnd() % (uint64_t)n)};
    int64_t k = ks[c % 8];
    return k < 1 ? 1 : k > n ? n : k;
}

static void test_par_select_is_the_sequential_select(void **st) {
    (void)st;
    long cases = 0;
    for (size_t si = 0; si < sizeof SIZES / sizeof *SIZES; si++) {
        int64_t n = SIZES[si];
        struct shared *sh = new_shared(n);
        struct topk_elem *ref = malloc(sizeof *ref * (size_t)n), *in = malloc(sizeof *in * (size_t)n);
        for (int c = 0; c < 24; c++) {
            int64_t k = pick_k(n, c);
            fill(in, n, c % 3);
            memcpy(ref, in, sizeof *ref * (size_t)n);
            topk_select(ref, n, k);
            for (size_t ti = 0; ti < sizeof NTS / sizeof *NTS; ti++) {
                memcpy(sh->q, in, sizeof *in * (size_t)n);
                sh->job = JOB_SELECT;
                sh->n = n;
                sh->k = k;
                run_block(sh, NTS[ti]);
                if (memcmp(sh->q, ref, sizeof *ref * (size_t)n))
                    fail_msg("n=%lld k=%lld kind %d threads %d: q differs from topk_select", (long long)n, (long long)k,
                             c % 3, NTS[ti]);
                cases++;
            }
        }
        free(ref);
        free(in);
        free_shared(sh);
    }
    printf("par_select: %ld cases identical to the sequential select\n", cases);
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

static void test_par_row_is_select_sort_hide(void **st) {
    (void)st;
    long cases = 0;
    for (size_t si = 0; si < sizeof SIZES / sizeof *SIZES; si++) {
        int64_t n = SIZES[si], ld_top = n + 3;
        struct shared *sh = new_shared(n);
        struct topk_elem *in = malloc(sizeof *in * (size_t)n), *ref = malloc(sizeof *ref * (size_t)n);
        int32_t *want = malloc(sizeof(int32_t) * (size_t)ld_top);
        for (int c = 0; c < 16; c++) {
            int64_t k = pick_k(n, c), vis = c & 1 ? n : (int64_t)(rnd() % (uint64_t)(n + 1));
            fill(in, n, c % 3);
            /* the first CPU engine's path: select, positions, qsort, hide the invisible, pad */
            memcpy(ref, in, sizeof *ref * (size_t)n);
            topk_select(ref, n, k);
            for (int64_t j = 0; j < ld_top; j++) want[j] = -1;
            for (int64_t j = 0; j < k; j++) want[j] = ref[j].i;
            qsort(want, (size_t)k, sizeof *want, cmp_i32);
            for (int64_t j = 0; j < k; j++)
                if (want[j] >= vis) want[j] = -1;
            for (size_t ti = 0; ti < sizeof NTS / sizeof *NTS; ti++) {
                memcpy(sh->q, in, sizeof *in * (size_t)n);
                for (int64_t j = 0; j < ld_top; j++) sh->top[j] = 0x5A5A5A5A;
                sh->job = JOB_ROW;
                sh->p[TOPK_P_N] = (int32_t)n;
                sh->p[TOPK_P_VALID] = (int32_t)n;
                sh->p[TOPK_P_K] = (int32_t)k;
                sh->p[TOPK_P_VISIBLE] = (int32_t)vis;
                sh->ld_top = ld_top;
                run_block(sh, NTS[ti]);
                if (memcmp(sh->top, want, sizeof *want * (size_t)ld_top))
                    fail_msg("n=%lld k=%lld visible %lld threads %d: row differs", (long long)n, (long long)k,
                             (long long)vis, NTS[ti]);
                cases++;
            }
        }
        free(in);
        free(ref);
        free(want);
        free_shared(sh);
    }
    printf("par_row: %ld cases identical to select + sort + visible\n", cases);
}

static void test_par_cand_is_the_sequential_choice(void **st) {
    (void)st;
    long cases = 0;
    for (size_t si = 0; si < sizeof SIZES / sizeof *SIZES; si++) {
        int64_t nb = SIZES[si];
        struct shared *sh = new_shared(nb);
        struct topk_elem *in = malloc(sizeof *in * (size_t)nb), *ref = malloc(sizeof *ref * (size_t)nb);
        uint8_t *want = malloc((size_t)nb);
        for (int c = 0; c < 12; c++) {
            int64_t want_k = pick_k(nb, c);
            fill(in, nb, c % 3);
            memcpy(ref, in, sizeof *ref * (size_t)nb);
            memset(want, 0, (size_t)nb);
            if (want_k < nb) topk_select(ref, nb, want_k);
            for (int64_t r = 0; r < want_k; r++)
                if (ref[r].v > -INFINITY) want[ref[r].i] = 1;
            for (size_t ti = 0; ti < sizeof NTS / sizeof *NTS; ti++) {
                memcpy(sh->q, in, sizeof *in * (size_t)nb);
                memset(sh->keep, 0, (size_t)nb);
                sh->job = JOB_CAND;
                sh->n = nb;
                sh->k = want_k;
                run_block(sh, NTS[ti]);
                if (memcmp(sh->keep, want, (size_t)nb))
                    fail_msg("blocks %lld want %lld threads %d: kept blocks differ", (long long)nb, (long long)want_k,
                             NTS[ti]);
                cases++;
            }
        }
        free(in);
        free(ref);
        free(want);
        free_shared(sh);
    }
    printf("par_cand: %ld cases identical to the sequential choice\n", cases);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_par_select_is_the_sequential_select),
                                       cmocka_unit_test(test_par_row_is_select_sort_hide),
                                       cmocka_unit_test(test_par_cand_is_the_sequential_choice)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
