/* Per-layer comparison of a stream-forced replay against its golden fixture (see verify.h).
 * Errors are relative RMS (‖a−b‖/‖b‖ over the whole tensor) and max |a−b|; index selections are
 * compared as sets per row, a difference being excused only on rows where the fixture's metadata
 * lists an exact tie at the k-th place (its own tie-breaking is implementation-defined). */
#include "verify.h"

#include <cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "formats.h"
#include "log.h"
#include "model_internal.h"
#include "replay.h"
#include "tolerances.h"

static double elem(const void *p, enum st_dtype dt, int64_t i) {
    return dt == ST_BF16 ? bf16_to_f32(((const bf16_t *)p)[i]) : ((const float *)p)[i];
}

static void errors(const struct st_tensor *g, const struct replay_tensor *r, int64_t rows, double *rel,
                   double *maxabs) {
    int64_t per = (int64_t)(g->nbytes / st_dtype_size(g->dtype)) / g->shape[0];
    double se = 0, sg = 0, mx = 0;
    for (int64_t i = 0; i < rows * per; i++) {
        double a = elem(r->data, r->dtype, i), b = elem(g->data, g->dtype, i), d = a - b;
        se += d * d;
        sg += b * b;
        if (fabs(d) > mx || isnan(d)) mx = isnan(d) ? INFINITY : fabs(d);
    }
    *rel = sg > 0 ? sqrt(se / sg) : sqrt(se);
    *maxabs = mx;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Is query row `row` of (phase, step, layer) listed as a boundary tie in the fixture metadata?
 * Candidate-block ties of the candidate source also excuse the layers that filter by it. */
static bool tie_listed(cJSON *ties, bool decode, int64_t step, int layer, int64_t row, int cand_src) {
    cJSON *t;
    cJSON_ArrayForEach(t, ties) {
        cJSON *ph = cJSON_GetObjectItem(t, "phase"), *st = cJSON_GetObjectItem(t, "step");
        cJSON *ly = cJSON_GetObjectItem(t, "layer"), *rows = cJSON_GetObjectItem(t, "rows");
        if (!cJSON_IsString(ph) || !cJSON_IsNumber(ly) || !cJSON_IsArray(rows)) continue;
        if (strcmp(ph->valuestring, decode ? "decode" : "prefill")) continue;
        if (decode && (!cJSON_IsNumber(st) || (int64_t)st->valuedouble != step)) continue;
        int tl = ly->valueint;
        if (tl != layer && !(tl == cand_src && layer > cand_src)) continue;
        cJSON *rv;
        cJSON_ArrayForEach(rv, rows) {
            if (cJSON_IsNumber(rv) && (int64_t)rv->valuedouble == (decode ? 0 : row)) return true;
        }
    }
    return false;
}

static int set_diff(const int32_t *a, const int32_t *b, int64_t k) {
    int d = 0;
    for (int64_t i = 0; i < k; i++) {
        if (a[i] < 0) continue;
        bool found = false;
        for (int64_t j = 0; j < k && !found; j++) found = b[j] == a[i];
        d += !found;
    }
    for (int64_t i = 0; i < k; i++) {
        if (b[i] < 0) continue;
        bool found = false;
        for (int64_t j = 0; j < k && !found; j++) found = a[j] == b[i];
        d += !found;
    }
    return d;
}

int verify_fixture(struct model *m, struct st_model *fx, const char *label, FILE *out, struct verify_summary *sum,
                   const struct replay_fwd *fwd, bool have_logits) {
    const struct model_config *cfg = m->cfg;
    struct replay_result res;
    if (replay_run(m, fx, REPLAY_FORCE_STREAM, fwd, &res)) return -1;
    cJSON *meta = NULL, *ties = NULL;
    const char *ms = st_metadata(fx, "meta");
    if (ms && (meta = cJSON_Parse(ms))) ties = cJSON_GetObjectItem(meta, "topk_ties");
    int fails = 0;

    for (int phase = 0; phase < 2; phase++) {
        bool dec = phase == 1;
        if (dec ? !res.decode_forced : !res.prefill_forced) continue;
        for (int l = 0; l < cfg->n_layers; l++) {
            const char *fmt[2][2] = {{"layers.%d.x_out", "layers.%d.pre_out"},
                                     {"layers.%d.decode_x_out", "layers.%d.decode_pre_out"}};
            for (int w = 0; w < 2; w++) {
                char n[96];
                snprintf(n, sizeof n, fmt[phase][w], l);
                const struct st_tensor *g = st_find(fx, n);
                struct replay_tensor *r = replay_find(&res, n);
                if (!g || !r) continue;
                double rel, mx;
                errors(g, r, g->shape[0], &rel, &mx);
                double tol = w == 0 ? TOL_LAYER_REL_RMS_MAX : TOL_PRE_REL_RMS_MAX;
                bool ok = rel <= tol;
                fails += !ok;
                sum->checks++;
                if (w == 0) {
                    if (sum->n_rels < VERIFY_MAX_RELS) sum->layer_rels[sum->n_rels++] = rel;
                    if (rel > sum->worst_layer_rel) sum->worst_layer_rel = rel;
                }
                fprintf(out, "%-8s %-24s rel_rms %.3e  max_abs %.3e  %s\n", label, n, rel, mx, ok ? "PASS" : "FAIL");
            }
        }
        /* index selections */
        for (int l = 0; l < cfg->n_layers; l++) {
            if (!cfg->role[l].is_index_source) continue;
            char n[96];
            snprintf(n, sizeof n, dec ? "index.%d.decode_topk" : "index.%d.topk", l);
            const struct st_tensor *g = st_find(fx, n);
            struct replay_tensor *r = replay_find(&res, n);
            if (!g || !r) continue;
            int64_t rows = g->shape[0], k = g->shape[1];
            int diff_rows = 0, excused = 0;
            for (int64_t i = 0; i < rows; i++) {
                int d = set_diff((const int32_t *)g->data + i * k, (const int32_t *)r->data + i * k, k);
                if (!d) continue;
                if (ties && tie_listed(ties, dec, i, l, i, cfg->candidate_source) && d <= 2 * (int)k)
                    excused++;
                else
                    diff_rows++;
            }
            sum->checks++;
            sum->topk_rows_diff_unexcused += diff_rows;
            fails += diff_rows > 0;
            fprintf(out, "%-8s %-24s rows %lld  differing %d  excused-by-tie %d  %s\n", label, n, (long long)rows,
                    diff_rows, excused, diff_rows ? "FAIL" : "PASS");
        }
    }
    /* Engram hash ids: integers, exact, in every phase */
    for (int i = 0; i < res.n; i++) {
        struct replay_tensor *r = &res.t[i];
        if (strncmp(r->name, "engram.", 7)) continue;
        const struct st_tensor *g = st_find(fx, r->name);
        if (!g) continue;
        int64_t cnt = (int64_t)(g->nbytes / 4), bad = 0;
        for (int64_t j = 0; j < cnt; j++) bad += ((const int32_t *)g->data)[j] != ((int32_t *)r->data)[j];
        sum->checks++;
        sum->hash_mismatches += (int)bad;
        fails += bad > 0;
        fprintf(out, "%-8s %-24s mismatches %lld  %s\n", label, r->name, (long long)bad, bad ? "FAIL" : "PASS");
    }
    /* logits of the forced last layer */
    const char *lg[2] = {"prefill_logits", "decode_logits"};
    bool forced[2] = {res.prefill_forced, res.decode_forced};
    for (int w = 0; w < 2 && have_logits; w++) {
        const struct st_tensor *g = st_find(fx, lg[w]);
        struct replay_tensor *r = replay_find(&res, lg[w]);
        if (!g || !r) continue;
        double rel, mx;
        errors(g, r, g->shape[0], &rel, &mx);
        if (forced[w]) {
            bool ok = mx <= TOL_FORCED_LOGITS_MAX_ABS;
            fails += !ok;
            sum->checks++;
            if (mx > sum->worst_forced_logits) sum->worst_forced_logits = mx;
            fprintf(out, "%-8s %-24s max_abs %.3e (stream-forced)  %s\n", label, lg[w], mx, ok ? "PASS" : "FAIL");
        } else {
            fprintf(out, "%-8s %-24s max_abs %.3e (free-running, tokens forced; reported, not judged)\n", label,
                    lg[w], mx);
        }
    }
    cJSON_Delete(meta);
    replay_free(&res);
    sum->failures += fails;
    return 0;
}

void verify_median(struct verify_summary *sum, const char *label, FILE *out) {
    if (!sum->n_rels) return;
    qsort(sum->layer_rels, (size_t)sum->n_rels, sizeof *sum->layer_rels, cmp_d);
    double med = sum->layer_rels[sum->n_rels / 2];
    if (med > sum->median_layer_rel) sum->median_layer_rel = med;
    bool ok = med <= TOL_LAYER_REL_RMS_MEDIAN;
    sum->failures += !ok;
    sum->checks++;
    fprintf(out, "%-8s median layer rel_rms %.3e  %s\n", label, med, ok ? "PASS" : "FAIL");
    sum->n_rels = 0;
}

void verify_merge(struct verify_summary *sum, const struct verify_summary *part) {
    sum->checks += part->checks;
    sum->failures += part->failures;
    sum->topk_rows_diff_unexcused += part->topk_rows_diff_unexcused;
    sum->hash_mismatches += part->hash_mismatches;
    if (part->worst_layer_rel > sum->worst_layer_rel) sum->worst_layer_rel = part->worst_layer_rel;
    if (part->worst_forced_logits > sum->worst_forced_logits) sum->worst_forced_logits = part->worst_forced_logits;
    for (int i = 0; i < part->n_rels && sum->n_rels < VERIFY_MAX_RELS; i++)
        sum->layer_rels[sum->n_rels++] = part->layer_rels[i];
}
