/* Job spec files expanded into command-line options (see jobspec.h). Values become option text
 * exactly as a user would type them: numbers as printed by %.17g (integers without a fraction),
 * true as a bare flag (false leaves it out), arrays joined with commas. */
#include "jobspec.h"

#include <cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

static char *value_text(const cJSON *v) {
    char buf[64];
    if (cJSON_IsString(v)) return ds_strdup(v->valuestring);
    if (cJSON_IsNumber(v)) {
        if (v->valuedouble == (double)(long long)v->valuedouble)
            snprintf(buf, sizeof buf, "%lld", (long long)v->valuedouble);
        else
            snprintf(buf, sizeof buf, "%.17g", v->valuedouble);
        return ds_strdup(buf);
    }
    if (cJSON_IsArray(v)) {
        size_t cap = 16, len = 0;
        char *out = ds_malloc(cap);
        out[0] = 0;
        const cJSON *e;
        cJSON_ArrayForEach(e, v) {
            if (cJSON_IsArray(e) || cJSON_IsObject(e)) {
                free(out);
                return NULL;
            }
            char *t = value_text(e);
            if (!t) {
                free(out);
                return NULL;
            }
            size_t need = len + strlen(t) + 2;
            if (need > cap) out = ds_realloc(out, cap = need * 2);
            len += (size_t)sprintf(out + len, "%s%s", len ? "," : "", t);
            free(t);
        }
        return out;
    }
    return NULL;
}

int jobspec_expand(int argc, char **argv, int *argc_out, char ***argv_out) {
    int at = -1;
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--job")) at = i;
    char **out = ds_calloc((size_t)argc + 1, sizeof *out);
    int n = 0;
    out[n++] = argv[0];
    if (at >= 0) {
        const char *path = argv[at + 1];
        FILE *f = fopen(path, "rb");
        if (!f) {
            ds_err_set("%s: cannot open job spec: %s", path, ds_errno_str());
            free(out);
            return -1;
        }
        fseek(f, 0, SEEK_END);
        long sz = ftell(f);
        fseek(f, 0, SEEK_SET);
        char *text = ds_malloc((size_t)sz + 1);
        size_t got = fread(text, 1, (size_t)sz, f);
        text[got] = 0;
        fclose(f);
        cJSON *j = cJSON_Parse(text);
        free(text);
        if (!cJSON_IsObject(j)) {
            ds_err_set("%s: a job spec must be a JSON object of options", path);
            cJSON_Delete(j);
            free(out);
            return -1;
        }
        int cap = argc + 1;
        const cJSON *kv;
        cJSON_ArrayForEach(kv, j) {
            if (n + 3 > cap) out = ds_realloc(out, sizeof *out * (size_t)(cap *= 2));
            char opt[256];
            snprintf(opt, sizeof opt, "--%s", kv->string);
            if (cJSON_IsBool(kv)) {
                if (cJSON_IsTrue(kv)) out[n++] = ds_strdup(opt);
                continue;
            }
            char *v = value_text(kv);
            if (!v) {
                ds_err_set("%s: %s: expected a string, number, bool or a list of them", path, kv->string);
                cJSON_Delete(j);
                free(out);
                return -1;
            }
            out[n++] = ds_strdup(opt);
            out[n++] = v;
        }
        cJSON_Delete(j);
        if (n + argc > cap) out = ds_realloc(out, sizeof *out * (size_t)(n + argc + 1));
    }
    for (int i = 1; i < argc; i++) {
        if (i == at || i == at + 1) continue;
        out[n++] = argv[i];
    }
    out[n] = NULL;
    *argc_out = n;
    *argv_out = out;
    return 0;
}

char *jobspec_effective_json(int argc, char **argv) {
    cJSON *j = cJSON_CreateObject();
    for (int i = 1; i < argc; i++) {
        if (strncmp(argv[i], "--", 2)) continue;
        const char *key = argv[i] + 2;
        cJSON_DeleteItemFromObject(j, key);
        if (i + 1 < argc && strncmp(argv[i + 1], "--", 2))
            cJSON_AddStringToObject(j, key, argv[++i]);
        else
            cJSON_AddTrueToObject(j, key);
    }
    char *s = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    return s;
}
