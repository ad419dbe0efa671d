/* The per-prompt fields of a JSONL prompt line (max_new_tokens, temperature, top_p, top_k, seed),
 * read and checked in one place for `dsbatch prompts` (JSONL -> HDF5) and for `generate` / `score`
 * reading JSONL, with the rules of the HDF5 prompt reader (h5io.c): max_new_tokens an integer >= 0,
 * temperature a finite number >= 0, top_p in (0, 1], top_k an integer >= 0, seed an integer in
 * [0, 2^53] (JSON numbers are doubles). A bad field is one error naming the file, line and field. */
#ifndef DS_PROMPT_FIELDS_H
#define DS_PROMPT_FIELDS_H

#include <cJSON.h>
#include <stdbool.h>
#include <stdint.h>

struct prompt_fields {
    bool has_max_new, has_temperature, has_top_p, has_top_k, has_seed; /* given on the line */
    int64_t max_new;
    float temperature, top_p;
    int32_t top_k;
    uint64_t seed;
};

/* 0, or -1 with ds_err_set("PATH:LINE: FIELD: expected ..."). */
int prompt_fields_json(const cJSON *j, const char *path, int line, struct prompt_fields *f);
/* A JSON number that is an integer in [lo, hi]: 0 and *out, else -1. */
int prompt_json_int(const cJSON *v, double lo, double hi, int64_t *out);

#endif /* DS_PROMPT_FIELDS_H */
