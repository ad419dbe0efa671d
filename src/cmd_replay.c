/* `dsbatch replay` and `dsbatch verify` (issue #3): load a model folder on the CPU backend, run
 * golden fixtures through it with the stream or the tokens forced, and write the engine's results
 * (replay) or judge them against the fixture layer by layer (verify). */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "dist.h"
#include "engine_cli.h"
#include "log.h"
#include "model.h"
#include "replay.h"
#include "tolerances.h"
#include "verify.h"

/* Positions a fixture needs: prompt + decode steps. */
static int64_t fixture_len(struct st_model *fx) {
    const struct st_tensor *p = st_find(fx, "prompt_ids"), *g = st_find(fx, "greedy_tokens");
    return (p ? p->shape[0] : 0) + (g ? g->shape[0] : 0) + 1;
}

int cmd_replay(int argc, char **argv) {
    const char *model = NULL, *fixture = NULL, *out = NULL;
    enum replay_force force = REPLAY_FORCE_STREAM;
    struct engine_flags f = {0};
    for (int i = 1; i < argc; i++) {
        if (engine_flag_parse(argc, argv, &i, &f)) continue;
        if (!strcmp(argv[i], "--model") && i + 1 < argc)
            model = argv[++i];
        else if (!strcmp(argv[i], "--fixture") && i + 1 < argc)
            fixture = argv[++i];
        else if (!strcmp(argv[i], "--out") && i + 1 < argc)
            out = argv[++i];
        else if (!strcmp(argv[i], "--force") && i + 1 < argc) {
            const char *v = argv[++i];
            if (!strcmp(v, "stream"))
                force = REPLAY_FORCE_STREAM;
            else if (!strcmp(v, "tokens"))
                force = REPLAY_FORCE_TOKENS;
            else
                ds_die("--force: '%s' is not one of stream, tokens", v);
        } else if (!strcmp(argv[i], "--help")) {
            printf("usage: dsbatch replay --model DIR --fixture promptK.safetensors --force stream|tokens --out R.safetensors\n"
                   "       [--no-stale-index-keys] [--window-layout reference|decode] [--backend cpu|cuda] [--exact-linears] [--eager]\n");
            return 0;
        } else
            ds_die("replay: unknown option '%s'", argv[i]);
    }
    if (!model || !fixture || !out) ds_die("replay: --model, --fixture and --out are required");
    struct st_model fx;
    if (st_open(fixture, &fx)) ds_die_err();
    struct loaded_model lm;
    struct backend be;
    struct model *m = engine_open(&lm, &be, model, &f, 0, fixture_len(&fx), 1);
    struct replay_result res;
    if (replay_run(m, &fx, force, NULL, &res)) ds_die_err();
    if (replay_write(&res, out)) ds_die_err();
    replay_free(&res);
    engine_close(m, &lm, &be, &f);
    st_close(&fx);
    return 0;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* One stage's report of a fixture: the reporting rank (TP rank 0 of replica 0) of each stage sends
 * its text and summary to world rank 0, which prints them in stage order. */
static void report_stage(struct dist_engine *d, char *text, size_t len, const struct verify_summary *part,
                         struct verify_summary *fixture_sum) {
    struct topo *t = &d->topo;
    struct comm *w = t->world;
    bool reporter = t->tp_rank == 0 && t->dp_rank == 0;
    if (t->world_rank == 0) {
        fwrite(text, 1, len, stdout);
        verify_merge(fixture_sum, part);
        struct verify_summary *other = ds_malloc(sizeof *other);
        for (int s = 1; s < t->pp; s++) {
            int64_t n;
            w->ops->recv(w, &n, sizeof n, s * t->tp, 91, "verify report");
            char *buf = ds_malloc((size_t)n + 1);
            w->ops->recv(w, buf, (size_t)n, s * t->tp, 91, "verify report");
            w->ops->recv(w, other, sizeof *other, s * t->tp, 91, "verify report");
            fwrite(buf, 1, (size_t)n, stdout);
            verify_merge(fixture_sum, other);
            free(buf);
        }
        free(other);
    } else if (reporter) {
        int64_t n = (int64_t)len;
        w->ops->send(w, &n, sizeof n, 0, 91, "verify report");
        w->ops->send(w, text, len, 0, 91, "verify report");
        w->ops->send(w, part, sizeof *part, 0, 91, "verify report");
    }
}

int cmd_verify(int argc, char **argv) {
    const char *golden = NULL;
    struct engine_flags f = {0};
    struct dist_opts dopt = {0};
    for (int i = 1; i < argc; i++) {
        if (engine_flag_parse(argc, argv, &i, &f) || dist_flag_parse(argc, argv, &i, &dopt)) continue;
        if (!strcmp(argv[i], "--golden") && i + 1 < argc)
            golden = argv[++i];
        else if (!strcmp(argv[i], "--help")) {
            printf("usage: dsbatch verify --golden DIR   (DIR = a fixture folder: model + promptK.safetensors)\n"
                   "       [--no-stale-index-keys] [--window-layout reference|decode] [--backend cpu|cuda] [--exact-linears] [--eager]\n"
                   "       [--tp N] [--pp N] [--pp-layers A,B,..] [--watchdog S] [--moe-exchange auto|gather|owner]\n"
                   "       (the last line: under mpirun)\n");
            return 0;
        } else
            ds_die("verify: unknown option '%s'", argv[i]);
    }
    if (!golden) ds_die("verify: --golden DIR is required");
    DIR *dir = opendir(golden);
    if (!dir) ds_die("%s: cannot open folder", golden);
    char *names[256];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(dir)) && n < 256)
        if (!strncmp(e->d_name, "prompt", 6) && strstr(e->d_name, ".safetensors")) names[n++] = ds_strdup(e->d_name);
    closedir(dir);
    if (!n) ds_die("%s: no promptK.safetensors fixtures", golden);
    qsort(names, (size_t)n, sizeof *names, cmp_str);

    int64_t need = 0;
    struct st_model *fx = ds_calloc((size_t)n, sizeof *fx);
    for (int i = 0; i < n; i++) {
        char p[1024];
        snprintf(p, sizeof p, "%s/%s", golden, names[i]);
        if (st_open(p, &fx[i])) ds_die_err();
        if (fixture_len(&fx[i]) > need) need = fixture_len(&fx[i]);
    }
    struct dist_engine d;
    dopt.min_len = need;
    dopt.max_seqs = 1;
    dist_open(&d, golden, &f, &dopt);
    struct replay_fwd fwd = {.fn = dist_forward_sync, .ctx = &d};
    bool last = d.topo.pp_rank == d.topo.pp - 1;
    struct verify_summary *sum = ds_calloc(1, sizeof *sum), *part = ds_calloc(1, sizeof *part),
                          *fsum = ds_calloc(1, sizeof *fsum);
    for (int i = 0; i < n; i++) {
        char label[64];
        snprintf(label, sizeof label, "%.*s", (int)(strlen(names[i]) - strlen(".safetensors")), names[i]);
        char *text = NULL;
        size_t len = 0;
        FILE *mem = open_memstream(&text, &len);
        CHECK_PTR(mem, "open_memstream");
        memset(part, 0, sizeof *part);
        if (verify_fixture(d.m, &fx[i], label, mem, part, &fwd, last)) ds_die_err();
        fclose(mem);
        memset(fsum, 0, sizeof *fsum);
        report_stage(&d, text, len, part, fsum);
        if (d.topo.world_rank == 0) {
            verify_median(fsum, label, stdout);
            fsum->n_rels = 0;
            verify_merge(sum, fsum);
            if (fsum->median_layer_rel > sum->median_layer_rel) sum->median_layer_rel = fsum->median_layer_rel;
        }
        free(text);
        st_close(&fx[i]);
        free(names[i]);
    }
    int failures = sum->failures;
    d.topo.world->ops->bcast(d.topo.world, &failures, sizeof failures, 0, "verify result");
    if (d.topo.world_rank == 0)
        printf("verify %s: %d checks, %d failed; worst layer rel_rms %.3e (max %.0e), median %.3e (max %.0e); "
           "worst forced-logits |d| %.3e (max %.2g); unexcused top-k rows %d; hash mismatches %d\n",
           golden, sum->checks, sum->failures, sum->worst_layer_rel, TOL_LAYER_REL_RMS_MAX, sum->median_layer_rel,
           TOL_LAYER_REL_RMS_MEDIAN, sum->worst_forced_logits, TOL_FORCED_LOGITS_MAX_ABS,
           sum->topk_rows_diff_unexcused, sum->hash_mismatches);
    free(fx);
    free(sum);
    free(part);
    free(fsum);
    dist_close(&d);
    return failures ? 1 : 0;
}
