/* `dsbatch verify`: replay every prompt of a golden fixture folder with the stream forced and
 * judge the engine layer by layer against the tolerance table (src/tolerances.h). */
#ifndef DS_VERIFY_H
#define DS_VERIFY_H

#include <stdio.h>

#include "model.h"
#include "safetensors.h"

#include "replay.h"

#define VERIFY_MAX_RELS 4096

struct verify_summary {
    int checks, failures;
    double worst_layer_rel, median_layer_rel; /* over every layer of every fixture */
    double worst_forced_logits, worst_head_logits;
    int topk_rows_diff_unexcused, hash_mismatches;
    int n_rels;                            /* the current fixture's per-layer x_out errors */
    double layer_rels[VERIFY_MAX_RELS];
};

/* Compare one fixture: replays it on m (slot 0, forward through `fwd`) and prints one line per
 * layer and phase that this engine computed; logits are judged only where `have_logits` (the
 * stage with the head). The fixture's layer errors are collected in sum->layer_rels. */
int verify_fixture(struct model *m, struct st_model *fx, const char *label, FILE *out, struct verify_summary *sum,
                   const struct replay_fwd *fwd, bool have_logits);
/* Judge the median of the collected layer errors of one fixture, print it, reset the list. */
void verify_median(struct verify_summary *sum, const char *label, FILE *out);
/* Fold a stage's summary of the same fixture into sum (counts add, worst values max, errors join). */
void verify_merge(struct verify_summary *sum, const struct verify_summary *part);

#endif /* DS_VERIFY_H */
