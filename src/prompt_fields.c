/* The per-prompt fields of a JSONL prompt line (see prompt_fields.h). */
#include "prompt_fields.h"

#include <math.h>
#include <string.h>

#include "log.h"

int prompt_json_int(const cJSON *v, double lo, double hi, int64_t *out) {
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < lo || v->valuedouble > hi)
        return -1;
    *out = (int64_t)v->valuedouble;
    return 0;
}

int prompt_fields_json(const cJSON *j, const char *path, int line, struct prompt_fields *f) {
    memset(f, 0, sizeof *f);
    const cJSON *v;
    int64_t x;
    if ((v = cJSON_GetObjectItem(j, "max_new_tokens"))) {
        if (prompt_json_int(v, 0, 9.0e15, &f->max_new)) {
            ds_err_set("%s:%d: max_new_tokens: expected an integer >= 0", path, line);
            return -1;
        }
        f->has_max_new = true;
    }
    if ((v = cJSON_GetObjectItem(j, "temperature"))) {
        if (!cJSON_IsNumber(v) || !(v->valuedouble >= 0) || !isfinite(v->valuedouble) || !isfinite((float)v->valuedouble)) {
            ds_err_set("%s:%d: temperature: expected a number >= 0", path, line);
            return -1;
        }
        f->temperature = (float)v->valuedouble;
        f->has_temperature = true;
    }
    if ((v = cJSON_GetObjectItem(j, "top_p"))) {
        if (!cJSON_IsNumber(v) || !(v->valuedouble > 0 && v->valuedouble <= 1)) {
            ds_err_set("%s:%d: top_p: expected a number in (0, 1]", path, line);
            return -1;
        }
        f->top_p = (float)v->valuedouble;
        f->has_top_p = true;
    }
    if ((v = cJSON_GetObjectItem(j, "top_k"))) {
        if (prompt_json_int(v, 0, INT32_MAX, &x)) {
            ds_err_set("%s:%d: top_k: expected an integer >= 0", path, line);
            return -1;
        }
        f->top_k = (int32_t)x;
        f->has_top_k = true;
    }
    if ((v = cJSON_GetObjectItem(j, "seed"))) {
        if (prompt_json_int(v, 0, 9007199254740992.0, &x)) {
            ds_err_set("%s:%d: seed: expected an integer in [0, 2^53]", path, line);
            return -1;
        }
        f->seed = (uint64_t)x;
        f->has_seed = true;
    }
    return 0;
}
