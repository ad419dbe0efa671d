/* MPI check of the HDF5 prompt reader (src/h5io.c), run under mpirun by tests/cli/test_h5.sh,
 * plus a one-process helper that writes output files for the inspect and h5py tests.
 *
 *   h5_prompts_check DIR [N]                      every rank: collective reads of DIR/prompts.h5
 *   h5_prompts_check write-output OUT.h5 [partial|score]   one process: a small output file
 *
 * The MPI mode: rank 0 writes N prompts (default 1000); all ranks open the file with the MPI-IO
 * driver and read it as dp = world size replicas (whole file, then in windows), as 4 replicas of 4
 * ranks (ranks of a replica must get identical shares), and a file whose one bad token sits in
 * one rank's share (every rank must fail with the same one-line error). Each prompt must be read by
 * exactly one replica, with the tokens and fields that were written. Each rank counts its checks;
 * rank 0 prints the timings and "N passed, N failed" summed over the world. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <mpi.h>

#include "h5io.h"
#include "log.h"

#include "mpi/mpi_check.h"

static int64_t plen(int64_t i) { return 1 + (i * 11) % 29; }
static int32_t ptok(int64_t i, int64_t k) { return (int32_t)((i * 7919 + k * 104729) % 32000); }

/* Rank 0 writes N prompts with every field; `bad` >= 0 puts token id 32000 into that prompt. */
static void write_prompts(const char *path, int64_t n, int64_t bad) {
    int64_t *off = calloc((size_t)n + 1, 8), *mn = calloc((size_t)n + 1, 8), *seed = calloc((size_t)n + 1, 8);
    for (int64_t i = 0; i < n; i++) off[i + 1] = off[i] + plen(i);
    int32_t *tok = calloc((size_t)off[n] + 1, 4), *topk = calloc((size_t)n + 1, 4);
    float *temp = calloc((size_t)n + 1, 4);
    char **ids = calloc((size_t)n + 1, sizeof *ids);
    for (int64_t i = 0; i < n; i++) {
        for (int64_t k = 0; k < plen(i); k++) tok[off[i] + k] = ptok(i, k);
        mn[i] = i % 3 ? i % 50 : -1;
        seed[i] = 17 * i;
        topk[i] = (int32_t)(i % 40);
        temp[i] = (float)(i % 10) / 10;
        char b[32];
        snprintf(b, sizeof b, "q%lld", (long long)i);
        ids[i] = strdup(b);
    }
    if (bad >= 0) tok[off[bad] + plen(bad) - 1] = 32000;
    struct h5_prompts_in in = {.n = n, .tokens = tok, .offsets = off, .max_new_tokens = mn, .temperature = temp,
                               .top_k = topk, .seed = seed, .ids = (const char *const *)ids};
    if (h5_prompts_write(path, &in)) ds_die_err();
    for (int64_t i = 0; i < n; i++) free(ids[i]);
    free(ids);
    free(off);
    free(mn);
    free(seed);
    free(tok);
    free(topk);
    free(temp);
}

static const struct h5_prompt_limits g_lim = {.vocab = 32000, .default_max_new = 64, .default_sp = {.top_p = 1}};

/* Check a share; adds each prompt read to count[]; returns a hash of the share. */
static uint64_t check_share(const struct h5_prompt_batch *b, int dp_rank, int dp, int64_t *count) {
    uint64_t h = 1469598103934665603ULL;
    int bad = 0;
    for (int64_t j = 0; j < b->n; j++) {
        int64_t i = b->index[j];
        if (i % dp != dp_rank || b->offsets[j + 1] - b->offsets[j] != plen(i)) bad++;
        for (int64_t k = 0; k < plen(i) && !bad; k++)
            if (b->tokens[b->offsets[j] + k] != ptok(i, k)) bad++;
        char want[32];
        snprintf(want, sizeof want, "q%lld", (long long)i);
        if (b->max_new[j] != (i % 3 ? i % 50 : 64) || b->sp[j].seed != (uint64_t)(17 * i) ||
            b->sp[j].top_k != (int)(i % 40) || b->sp[j].temperature != (float)(i % 10) / 10 || strcmp(b->id[j], want))
            bad++;
        count[i]++;
        h = (h ^ (uint64_t)i) * 1099511628211ULL;
    }
    CHECK(bad == 0, "share dp %d/%d: %d prompts differ from what was written", dp_rank, dp, bad);
    return h;
}

static void check_cover(int64_t *count, int64_t n, int64_t expect, const char *what) {
    CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, count, (int)n, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD));
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; i++) wrong += count[i] != expect;
    CHECK(wrong == 0, "%s: %lld prompts not read exactly %lld times", what, (long long)wrong, (long long)expect);
    memset(count, 0, sizeof *count * (size_t)n);
}

static int mpi_mode(const char *dir, int64_t n) {
    int size;
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    log_set_identity(g_rank, 0, g_rank);
    char path[1024], bad[1024];
    snprintf(path, sizeof path, "%s/prompts.h5", dir);
    snprintf(bad, sizeof bad, "%s/bad_prompts.h5", dir);
    double t0 = MPI_Wtime();
    if (g_rank == 0) {
        write_prompts(path, n, -1);
        write_prompts(bad, n, 5 % n); /* prompt 5: in rank 5's share when dp = 16 */
    }
    CHECK_MPI(MPI_Barrier(MPI_COMM_WORLD));
    double t_write = MPI_Wtime() - t0;
    int64_t *count = calloc((size_t)n, sizeof *count);

    /* dp = world: the whole file in one read each. */
    t0 = MPI_Wtime();
    struct h5_prompts p;
    int rc = h5_prompts_open(&p, path, MPI_COMM_WORLD);
    CHECK(rc == 0, "open: %s", ds_err_get());
    if (rc) return 1;
    CHECK(p.n_prompts == n, "n_prompts %lld", (long long)p.n_prompts);
    int64_t n_tokens = p.n_tokens;
    double t_open = MPI_Wtime() - t0;
    t0 = MPI_Wtime();
    struct h5_prompt_batch b;
    rc = h5_prompts_read(&p, 0, n, g_rank, size, &g_lim, &b);
    double t_read = MPI_Wtime() - t0;
    CHECK(rc == 0, "read: %s", ds_err_get());
    if (!rc) {
        check_share(&b, g_rank, size, count);
        h5_prompt_batch_free(&b);
    }
    check_cover(count, n, 1, "dp = world, whole file");

    /* Windows of 97 prompts (not a multiple of dp): shares stay i % dp == rank. */
    for (int64_t first = 0; first < n; first += 97) {
        int64_t cnt = n - first < 97 ? n - first : 97;
        rc = h5_prompts_read(&p, first, cnt, g_rank, size, &g_lim, &b);
        CHECK(rc == 0, "window %lld: %s", (long long)first, ds_err_get());
        if (!rc) {
            check_share(&b, g_rank, size, count);
            h5_prompt_batch_free(&b);
        }
    }
    check_cover(count, n, 1, "dp = world, windows of 97");

    /* 4 replicas of size/4 ranks (TP x PP inside a replica): identical shares within a replica. */
    if (size % 4 == 0) {
        int dp = 4, r = g_rank / (size / 4);
        rc = h5_prompts_read(&p, 0, n, r, dp, &g_lim, &b);
        CHECK(rc == 0, "dp 4: %s", ds_err_get());
        uint64_t h = rc ? 0 : check_share(&b, r, dp, count);
        if (!rc) h5_prompt_batch_free(&b);
        uint64_t *all = calloc((size_t)size, 8);
        CHECK_MPI(MPI_Allgather(&h, 1, MPI_UINT64_T, all, 1, MPI_UINT64_T, MPI_COMM_WORLD));
        for (int q = 0; q < size; q++)
            if (q / (size / 4) == r) CHECK(all[q] == h, "rank %d of replica %d read another share", q, r);
        free(all);
        check_cover(count, n, size / 4, "dp 4 x 4 ranks");
    }
    h5_prompts_close(&p);

    /* One bad token in one rank's share: every rank fails with the same line. */
    rc = h5_prompts_open(&p, bad, MPI_COMM_WORLD);
    CHECK(rc == 0, "open bad file: %s", ds_err_get());
    if (!rc) {
        rc = h5_prompts_read(&p, 0, n, g_rank, size, &g_lim, &b);
        if (!rc) h5_prompt_batch_free(&b);
        h5_prompts_close(&p);
    }
    char mine[1024], first[1024];
    snprintf(mine, sizeof mine, "%s", rc ? ds_err_get() : "");
    memcpy(first, mine, sizeof first);
    CHECK_MPI(MPI_Bcast(first, (int)sizeof first, MPI_CHAR, 0, MPI_COMM_WORLD));
    CHECK(rc == -1 && strstr(mine, "/prompts/tokens[") && strstr(mine, "prompt 5 ") && !strcmp(mine, first),
          "bad token: rc %d, '%s' (rank 0: '%s')", rc, mine, first);
    if (g_rank == 0) printf("error on every rank: %s\n", mine);

    double t[3] = {t_write, t_open, t_read}, tmax[3];
    CHECK_MPI(MPI_Reduce(t, tmax, 3, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD));
    int counts[2] = {g_pass, g_fail}, sum[2];
    CHECK_MPI(MPI_Reduce(counts, sum, 2, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD));
    if (g_rank == 0) {
        printf("%d ranks, %lld prompts, %lld tokens: write %.3f s, open %.3f s, collective read of all shares %.3f s\n",
               size, (long long)n, (long long)n_tokens, tmax[0], tmax[1], tmax[2]);
        printf("%d passed, %d failed\n", sum[0], sum[1]);
    }
    free(count);
    int failed = g_rank == 0 ? sum[1] : 0;
    CHECK_MPI(MPI_Bcast(&failed, 1, MPI_INT, 0, MPI_COMM_WORLD));
    return failed != 0;
}

/* A small finished (or, with "partial", killed-looking) output file, or a score file. */
static int write_output(const char *path, const char *variant) {
    bool score = variant && !strcmp(variant, "score"), partial = variant && !strcmp(variant, "partial");
    enum { N = 12 };
    char *meta = h5_meta_json(&(struct h5_meta){
        .job_spec_json = "{\"mode\":\"generate\",\"prompts\":\"tiny.h5\",\"max_new_tokens\":8,\"temperature\":0}",
        .model_config_json = "{\"vocab_size\":512}", .rank_table = "rank 0 dp 0 pp 0 tp 0", .git_commit = "test",
        .hosts = "localhost"});
    char fp[H5IO_FINGERPRINT_LEN];
    h5_job_fingerprint(meta, fp);
    struct h5_out o;
    int rc = score ? h5_out_create_score(&o, path, meta, "cafe0000cafe0000", N)
                   : h5_out_create(&o, path, meta, "cafe0000cafe0000", N, true);
    free(meta);
    if (rc) ds_die_err();
    for (int64_t i = 0; i < (partial ? N / 2 : N); i++) {
        int64_t n = 1 + i % 8;
        int32_t tok[8];
        double lp[8];
        for (int64_t k = 0; k < n; k++) tok[k] = (int32_t)(i * 10 + k), lp[k] = -0.25 * (double)(k + 1);
        /* TTFT 0.1 + 0.01 i s, ITL 0.02 s, admitted 0.05 s apart */
        struct h5_request_trace tr = {.admit_s = 0.05 * (double)i, .first_token_s = 0.05 * (double)i + 0.1 + 0.01 * (double)i,
                                      .prompt_tokens = 5 + i, .generated_tokens = score ? 0 : n};
        tr.last_token_s = tr.first_token_s + 0.02 * (double)(n - 1);
        rc = score ? h5_out_append_score(&o, i, lp, n, 0.25 * (double)(n * (n + 1) / 2), &tr)
                   : h5_out_append(&o, i, tok, lp, n, (int)(i % 3), &tr);
        if (rc) ds_die_err();
    }
    struct h5_step_trace ev[4];
    for (int s = 0; s < 4; s++)
        ev[s] = (struct h5_step_trace){.rank = s % 2, .stage = s % 2, .step = s / 2, .seqs = 4, .rows = 12,
                                       .start_s = 0.1 * s, .end_s = 0.1 * s + 0.08, .compute_s = 0.07, .comm_s = 0.01};
    if (h5_out_write_steps(&o, ev, 4)) ds_die_err();
    if (partial) {
        h5_out_close(&o);
        return 0;
    }
    if (h5_out_finish(&o)) ds_die_err();
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 3 && !strcmp(argv[1], "write-output")) return write_output(argv[2], argc > 3 ? argv[3] : NULL);
    if (argc < 2) {
        fprintf(stderr, "usage: %s DIR [N] | write-output OUT.h5 [partial|score]\n", argv[0]);
        return 2;
    }
    MPI_Init(&argc, &argv);
    int rc = mpi_mode(argv[1], argc > 2 ? atoll(argv[2]) : 1000);
    MPI_Finalize();
    return rc;
}
