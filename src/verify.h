/* `dsbatch verify`: replay every prompt of a golden fixture folder with the stream forced and
 * judge the engine layer by layer against the tolerance table (src/tolerances.h). */
#ifndef DS_VERIFY_H
#define DS_VERIFY_H

#include <stdio.h>

#include "model.h"
#include "safetensors.h"

struct verify_summary {
    int checks, failures;
    double worst_layer_rel, median_layer_rel; /* over every layer of every fixture */
    double worst_forced_logits, worst_head_logits;
    int topk_rows_diff_unexcused, hash_mismatches;
};

/* Compare one fixture: replays it on m (slot 0) and prints one line per layer and phase. */
int verify_fixture(struct model *m, struct st_model *fx, const char *label, FILE *out, struct verify_summary *sum);

#endif /* DS_VERIFY_H */
