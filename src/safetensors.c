/* safetensors reader and writer.
 *
 * The reader maps every shard read-only and trusts nothing in it until checked: each header is
 * copied out of the map (so a JSON parser can never run past the end of a mapping), parsed with
 * cJSON and validated entry by entry, then all tensors of all shards go into one array sorted by
 * name. Tensor data is never touched at open; only the header pages of each shard are read, which
 * keeps opening the 510 GB checkpoint (96k tensors, 48 shards) at O(n log n) in the tensor count.
 * Every bad-input failure leaves one line from ds_err_set that starts with the offending file.
 *
 * The writer fixes the whole header before the first data byte (so tensors can be streamed from
 * a converter without holding them in memory), lays the data out contiguously in declaration
 * order, as the safetensors library requires, and publishes the file by rename so a crash never
 * leaves a half-written file under the final name. */
#include "safetensors.h"

#include "log.h"

#include <cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define INDEX_NAME "model.safetensors.index.json"
#define ST_SUFFIX ".safetensors"
/* JSON numbers reach us as doubles; above 2^53 they are no longer exact integers. */
#define MAX_EXACT_INT 9007199254740992.0

/* ---------------------------------------------------------------- dtypes */

static const struct {
    const char *name;
    size_t size;
} dtype_table[ST_NDTYPES] = {
    [ST_BF16] = {"BF16", 2},       [ST_F16] = {"F16", 2},         [ST_F32] = {"F32", 4},
    [ST_F64] = {"F64", 8},         [ST_F8_E4M3] = {"F8_E4M3", 1}, [ST_F8_E8M0] = {"F8_E8M0", 1},
    [ST_I8] = {"I8", 1},           [ST_U8] = {"U8", 1},           [ST_I16] = {"I16", 2},
    [ST_I32] = {"I32", 4},         [ST_I64] = {"I64", 8},         [ST_BOOL] = {"BOOL", 1},
};

const char *st_dtype_name(enum st_dtype d) {
    return ((unsigned)d < ST_NDTYPES) ? dtype_table[d].name : "?";
}

size_t st_dtype_size(enum st_dtype d) { return ((unsigned)d < ST_NDTYPES) ? dtype_table[d].size : 0; }

int st_dtype_parse(const char *name, enum st_dtype *out) {
    if (!name) return -1;
    for (int i = 0; i < ST_NDTYPES; i++) {
        if (strcmp(name, dtype_table[i].name) == 0) {
            *out = (enum st_dtype)i;
            return 0;
        }
    }
    return -1;
}

/* ---------------------------------------------------------------- small helpers */

static uint64_t load_le64(const void *p) {
    const unsigned char *b = p;
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | b[i];
    return v;
}

static void store_le64(unsigned char *b, uint64_t v) {
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(v >> (8 * i));
}

static char *path_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    bool slash = a > 0 && dir[a - 1] == '/';
    char *p = ds_malloc(a + b + 2);
    memcpy(p, dir, a);
    if (!slash) p[a++] = '/';
    memcpy(p + a, name, b + 1);
    return p;
}

static bool ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && memcmp(s + a - b, suffix, b) == 0;
}

/* Error messages must stay on one line even when they quote pretty-printed JSON. */
static void snippet(char *out, size_t cap, const char *text, size_t len, size_t at) {
    size_t i = 0;
    for (size_t k = at; k < len && i + 1 < cap && i < 24; k++) {
        unsigned char c = (unsigned char)text[k];
        out[i++] = (c >= 0x20 && c < 0x7f) ? (char)c : ' ';
    }
    out[i] = '\0';
}

static void fmt_shape(char *out, size_t cap, const int64_t *shape, int ndim) {
    size_t used = 0;
    used += (size_t)snprintf(out, cap, "[");
    for (int i = 0; i < ndim && used < cap; i++)
        used += (size_t)snprintf(out + used, cap - used, i ? ",%" PRId64 : "%" PRId64, shape[i]);
    if (used < cap) snprintf(out + used, cap - used, "]");
}

/* Exact non-negative integer, or -1. */
static int json_uint(const cJSON *v, uint64_t *out) {
    if (!cJSON_IsNumber(v)) return -1;
    double d = v->valuedouble;
    if (!(d >= 0.0) || d > MAX_EXACT_INT) return -1;
    uint64_t u = (uint64_t)d;
    if ((double)u != d) return -1;
    *out = u;
    return 0;
}

/* Reads a whole small file (the index); NULL with an error set when unreadable. */
static char *read_text_file(const char *path, size_t *len) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        ds_err_set("%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    struct stat sb;
    CHECK_LIBC(fstat(fd, &sb));
    size_t size = (size_t)sb.st_size, got = 0;
    char *buf = ds_malloc(size + 1);
    while (got < size) {
        ssize_t r = read(fd, buf + got, size - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            ds_err_set("%s: read failed: %s", path, r < 0 ? strerror(errno) : "file shrank");
            free(buf);
            close(fd);
            return NULL;
        }
        got += (size_t)r;
    }
    CHECK_LIBC(close(fd));
    buf[size] = '\0';
    *len = size;
    return buf;
}

/* ---------------------------------------------------------------- reader */

static int cmp_tensor_name(const void *a, const void *b) {
    const struct st_tensor *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    if (c) return c;
    return (x->shard > y->shard) - (x->shard < y->shard);
}

struct span {
    const char *begin;
    size_t nbytes;
    const char *name;
};

static int cmp_span(const void *a, const void *b) {
    const struct span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return (x->nbytes > y->nbytes) - (x->nbytes < y->nbytes);
}

/* The safetensors library never checks this, but a loader that trusted overlapping tensors would
 * silently alias two weights, so reject it here, once, per shard. */
static int check_overlaps(const struct st_model *m, int first, const char *path,
                          const char *data_area) {
    int n = m->n_tensors - first;
    if (n < 2) return 0;
    struct span *s = ds_malloc((size_t)n * sizeof *s);
    int k = 0;
    for (int i = first; i < m->n_tensors; i++) {
        if (m->tensors[i].nbytes == 0) continue; /* empty tensors occupy no bytes */
        s[k++] = (struct span){m->tensors[i].data, m->tensors[i].nbytes, m->tensors[i].name};
    }
    qsort(s, (size_t)k, sizeof *s, cmp_span);
    int rc = 0;
    const struct span *reach = NULL; /* span ending furthest so far */
    for (int i = 0; i < k; i++) {
        if (reach && s[i].begin < reach->begin + reach->nbytes) {
            size_t a0 = (size_t)(reach->begin - data_area), b0 = (size_t)(s[i].begin - data_area);
            ds_err_set("%s: tensor %s: data_offsets [%zu,%zu] overlap tensor %s [%zu,%zu]", path,
                       s[i].name, b0, b0 + s[i].nbytes, reach->name, a0, a0 + reach->nbytes);
            rc = -1;
            break;
        }
        if (!reach || s[i].begin + s[i].nbytes > reach->begin + reach->nbytes) reach = &s[i];
    }
    free(s);
    return rc;
}

/* Validates one header entry; on success fills *t (name not set). */
static int parse_entry(const char *path, const char *name, const cJSON *e, const char *data_area,
                       size_t data_size, struct st_tensor *t) {
#define ENTRY_ERR(...)                                                                           \
    do {                                                                                         \
        char why_[512];                                                                          \
        snprintf(why_, sizeof why_, __VA_ARGS__);                                                \
        ds_err_set("%s: tensor %s: %s", path, name, why_);                                       \
        return -1;                                                                               \
    } while (0)
    if (!cJSON_IsObject(e)) ENTRY_ERR("header entry is not a JSON object");
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *off = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!dt) ENTRY_ERR("missing \"dtype\"");
    if (!cJSON_IsString(dt)) ENTRY_ERR("\"dtype\" is not a string");
    if (st_dtype_parse(dt->valuestring, &t->dtype) != 0)
        ENTRY_ERR("unknown dtype \"%.32s\"", dt->valuestring);
    if (!sh) ENTRY_ERR("missing \"shape\"");
    if (!cJSON_IsArray(sh)) ENTRY_ERR("\"shape\" is not an array");
    int nd = cJSON_GetArraySize(sh);
    if (nd > ST_MAX_DIMS) ENTRY_ERR("shape has %d dims, at most %d supported", nd, ST_MAX_DIMS);
    t->ndim = nd;
    int i = 0;
    for (const cJSON *d = sh->child; d; d = d->next, i++) {
        uint64_t v;
        if (json_uint(d, &v) != 0) ENTRY_ERR("shape[%d] is not a non-negative integer", i);
        t->shape[i] = (int64_t)v;
    }
    if (!off) ENTRY_ERR("missing \"data_offsets\"");
    uint64_t begin, end;
    if (!cJSON_IsArray(off) || cJSON_GetArraySize(off) != 2 || json_uint(off->child, &begin) != 0 ||
        json_uint(off->child->next, &end) != 0)
        ENTRY_ERR("\"data_offsets\" is not [begin, end] with non-negative integers");
    if (begin > end)
        ENTRY_ERR("data_offsets [%" PRIu64 ",%" PRIu64 "] have begin > end", begin, end);

    char shape_txt[200];
    fmt_shape(shape_txt, sizeof shape_txt, t->shape, t->ndim);
    uint64_t nbytes = st_dtype_size(t->dtype);
    for (int k = 0; k < t->ndim; k++) {
        if (__builtin_mul_overflow(nbytes, (uint64_t)t->shape[k], &nbytes))
            ENTRY_ERR("shape %s x %s overflows 64 bits", shape_txt, st_dtype_name(t->dtype));
    }
    if (nbytes != end - begin)
        ENTRY_ERR("shape %s x %s = %" PRIu64 " bytes but data_offsets span %" PRIu64, shape_txt,
                  st_dtype_name(t->dtype), nbytes, end - begin);
    if (end > data_size)
        ENTRY_ERR("data_offsets [%" PRIu64 ",%" PRIu64 "] end beyond the data area of %zu bytes "
                  "(truncated file?)",
                  begin, end, data_size);
    t->nbytes = (size_t)nbytes;
    t->data = data_area + begin;
    return 0;
#undef ENTRY_ERR
}

/* Keeps __metadata__ both as JSON text (what the header promises in metadata_json) and, behind the
 * text's NUL, as decoded pairs: 0x01 key NUL value NUL ... then a final NUL. st_metadata walks the
 * pairs, so it can return a plain string the model owns without any extra field in st_model. */
static int keep_metadata(struct st_model *m, const char *path, const cJSON *meta) {
    if (!cJSON_IsObject(meta)) {
        ds_err_set("%s: __metadata__ is not a JSON object", path);
        return -1;
    }
    char *json = cJSON_PrintUnformatted(meta);
    CHECK_PTR(json, "cJSON_PrintUnformatted");
    size_t total = strlen(json) + 2;
    for (const cJSON *c = meta->child; c; c = c->next)
        if (cJSON_IsString(c) && c->string) total += 1 + strlen(c->string) + 1 + strlen(c->valuestring) + 1;
    char *blob = ds_malloc(total), *p = blob;
    size_t n = strlen(json) + 1;
    memcpy(p, json, n);
    p += n;
    cJSON_free(json);
    for (const cJSON *c = meta->child; c; c = c->next) {
        if (!cJSON_IsString(c) || !c->string) continue; /* only string values are kept */
        *p++ = '\1';
        n = strlen(c->string) + 1;
        memcpy(p, c->string, n);
        p += n;
        n = strlen(c->valuestring) + 1;
        memcpy(p, c->valuestring, n);
        p += n;
    }
    *p = '\0';
    m->metadata_json = blob;
    return 0;
}

/* Maps shard k, validates its header and appends its tensors to m->tensors. */
static int load_shard(struct st_model *m, int k, int *cap) {
    const char *path = m->shard_paths[k];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        ds_err_set("%s: cannot open: %s", path, strerror(errno));
        return -1;
    }
    struct stat sb;
    CHECK_LIBC(fstat(fd, &sb));
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        ds_err_set("%s: not a regular file", path);
        return -1;
    }
    size_t size = (size_t)sb.st_size;
    if (size < 8) {
        close(fd);
        ds_err_set("%s: file is %zu bytes, shorter than the 8-byte header length", path, size);
        return -1;
    }
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) ds_fatal(__FILE__, __LINE__, __func__, "libc", "mmap", ds_errno_str());
    CHECK_LIBC(close(fd));
    m->maps[k] = map;
    m->map_sizes[k] = size;

    uint64_t hlen = load_le64(map);
    if (hlen > size - 8) {
        ds_err_set("%s: header length %" PRIu64 " exceeds the file size (%zu bytes)", path, hlen,
                   size);
        return -1;
    }
    size_t hl = (size_t)hlen;
    const char *data_area = (const char *)map + 8 + hl;
    size_t data_size = size - 8 - hl;
    char *text = ds_malloc(hl + 1);
    memcpy(text, (const char *)map + 8, hl);
    text[hl] = '\0';

    int rc = -1;
    const char *stop = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, hl, &stop, 0);
    char near[32];
    if (!root) {
        size_t at = stop ? (size_t)(stop - text) : 0;
        snippet(near, sizeof near, text, hl, at);
        ds_err_set("%s: header is not valid JSON (byte %zu of %zu, near '%s')", path, at, hl, near);
        goto out;
    }
    /* The writers pad the header with spaces; anything else after the JSON is damage. */
    for (const char *p = stop; p < text + hl; p++) {
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            snippet(near, sizeof near, text, hl, (size_t)(p - text));
            ds_err_set("%s: header has trailing bytes after the JSON (byte %zu, near '%s')", path,
                       (size_t)(p - text), near);
            goto out;
        }
    }
    if (!cJSON_IsObject(root)) {
        ds_err_set("%s: header is not a JSON object", path);
        goto out;
    }
    int first = m->n_tensors;
    bool seen_meta = false;
    for (const cJSON *e = root->child; e; e = e->next) {
        if (strcmp(e->string, "__metadata__") == 0) {
            if (seen_meta) continue;
            seen_meta = true;
            if (k == 0) {
                if (keep_metadata(m, path, e) != 0) goto out;
            } else if (!cJSON_IsObject(e)) {
                ds_err_set("%s: __metadata__ is not a JSON object", path);
                goto out;
            }
            continue;
        }
        if (m->n_tensors == INT_MAX) {
            ds_err_set("%s: too many tensors", path);
            goto out;
        }
        if (m->n_tensors == *cap) {
            *cap = *cap ? (*cap > INT_MAX / 2 ? INT_MAX : *cap * 2) : 1024;
            m->tensors = ds_realloc(m->tensors, (size_t)*cap * sizeof *m->tensors);
        }
        struct st_tensor t = {0};
        if (parse_entry(path, e->string, e, data_area, data_size, &t) != 0) goto out;
        t.name = ds_strdup(e->string);
        t.shard = k;
        m->tensors[m->n_tensors++] = t;
    }
    rc = check_overlaps(m, first, path, data_area);
out:
    cJSON_Delete(root);
    free(text);
    return rc;
}

/* Sorts all tensors and rejects a name present twice (two shards, or a repeated header key). */
static int finish_tensors(struct st_model *m) {
    if (m->n_tensors > 1)
        qsort(m->tensors, (size_t)m->n_tensors, sizeof *m->tensors, cmp_tensor_name);
    for (int i = 1; i < m->n_tensors; i++) {
        const struct st_tensor *a = &m->tensors[i - 1], *b = &m->tensors[i];
        if (strcmp(a->name, b->name) != 0) continue;
        if (a->shard == b->shard)
            ds_err_set("%s: tensor %s appears twice in the header", m->shard_paths[a->shard], a->name);
        else
            ds_err_set("%s: tensor %s is also in %s", m->shard_paths[b->shard], b->name,
                       m->shard_paths[a->shard]);
        return -1;
    }
    return 0;
}

static void alloc_shards(struct st_model *m, int n) {
    m->n_shards = n;
    m->shard_paths = ds_calloc((size_t)n, sizeof *m->shard_paths);
    m->maps = ds_calloc((size_t)n, sizeof *m->maps);
    m->map_sizes = ds_calloc((size_t)n, sizeof *m->map_sizes);
}

static int load_all(struct st_model *m) {
    int cap = 0;
    for (int k = 0; k < m->n_shards; k++)
        if (load_shard(m, k, &cap) != 0) return -1;
    return finish_tensors(m);
}

struct wm_entry {
    const char *tensor;
    const char *shard;
    int shard_idx;
};

static int cmp_wm_shard(const void *a, const void *b) {
    const struct wm_entry *x = a, *y = b;
    int c = strcmp(x->shard, y->shard);
    return c ? c : strcmp(x->tensor, y->tensor);
}

static int cmp_wm_tensor(const void *a, const void *b) {
    const struct wm_entry *x = a, *y = b;
    return strcmp(x->tensor, y->tensor);
}

/* Both sides sorted by name, so one merge pass finds every tensor the index and the shards
 * disagree about. */
static int match_index(const struct st_model *m, const char *index_path, struct wm_entry *w,
                       int nw) {
    for (int i = 1; i < nw; i++) {
        if (strcmp(w[i - 1].tensor, w[i].tensor) == 0) {
            ds_err_set("%s: weight_map: tensor '%s' is listed twice", index_path, w[i].tensor);
            return -1;
        }
    }
    int i = 0, j = 0;
    while (i < nw || j < m->n_tensors) {
        int c = i >= nw ? 1 : j >= m->n_tensors ? -1 : strcmp(w[i].tensor, m->tensors[j].name);
        if (c < 0) {
            ds_err_set("%s: weight_map: tensor '%s' not found in its shard %s", index_path,
                       w[i].tensor, m->shard_paths[w[i].shard_idx]);
            return -1;
        }
        if (c > 0) {
            ds_err_set("%s: tensor %s is not in the weight_map of %s",
                       m->shard_paths[m->tensors[j].shard], m->tensors[j].name, index_path);
            return -1;
        }
        if (w[i].shard_idx != m->tensors[j].shard) {
            ds_err_set("%s: weight_map: tensor '%s' is mapped to shard '%s' but found in %s",
                       index_path, w[i].tensor, w[i].shard, m->shard_paths[m->tensors[j].shard]);
            return -1;
        }
        i++;
        j++;
    }
    return 0;
}

static int open_indexed(const char *dir, const char *index_path, struct st_model *m) {
    size_t len = 0;
    char *text = read_text_file(index_path, &len);
    if (!text) return -1;
    int rc = -1;
    struct wm_entry *w = NULL;
    const char *stop = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, &stop, 0);
    char near[32];
    if (!root) {
        size_t at = stop ? (size_t)(stop - text) : 0;
        snippet(near, sizeof near, text, len, at);
        ds_err_set("%s: not valid JSON (byte %zu of %zu, near '%s')", index_path, at, len, near);
        goto out;
    }
    for (const char *p = stop; p < text + len; p++) {
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            snippet(near, sizeof near, text, len, (size_t)(p - text));
            ds_err_set("%s: trailing bytes after the JSON (byte %zu, near '%s')", index_path,
                       (size_t)(p - text), near);
            goto out;
        }
    }
    const cJSON *wmap = cJSON_IsObject(root) ? cJSON_GetObjectItemCaseSensitive(root, "weight_map") : NULL;
    if (!cJSON_IsObject(wmap)) {
        ds_err_set("%s: weight_map missing or not a JSON object", index_path);
        goto out;
    }
    int nw = cJSON_GetArraySize(wmap);
    if (nw == 0) {
        ds_err_set("%s: weight_map is empty", index_path);
        goto out;
    }
    w = ds_malloc((size_t)nw * sizeof *w);
    int i = 0;
    for (const cJSON *e = wmap->child; e; e = e->next, i++) {
        if (!cJSON_IsString(e) || !e->valuestring[0]) {
            ds_err_set("%s: weight_map: tensor '%s': shard is not a non-empty string", index_path,
                       e->string);
            goto out;
        }
        w[i] = (struct wm_entry){e->string, e->valuestring, -1};
    }
    /* Shards in name order, so shard 0 (metadata source) is the first shard of the set. */
    qsort(w, (size_t)nw, sizeof *w, cmp_wm_shard);
    int ns = 0;
    for (i = 0; i < nw; i++) {
        if (i == 0 || strcmp(w[i].shard, w[i - 1].shard) != 0) ns++;
        w[i].shard_idx = ns - 1;
    }
    alloc_shards(m, ns);
    for (i = 0; i < nw; i++) {
        int s = w[i].shard_idx;
        if (m->shard_paths[s]) continue;
        m->shard_paths[s] = path_join(dir, w[i].shard);
        struct stat sb;
        if (stat(m->shard_paths[s], &sb) != 0) {
            ds_err_set("%s: weight_map: shard '%s' (for tensor '%s') not found", index_path,
                       w[i].shard, w[i].tensor);
            goto out;
        }
    }
    if (load_all(m) != 0) goto out;
    qsort(w, (size_t)nw, sizeof *w, cmp_wm_tensor);
    rc = match_index(m, index_path, w, nw);
out:
    free(w);
    cJSON_Delete(root);
    free(text);
    return rc;
}

/* A folder without an index: exactly one model*.safetensors; the golden sidecars
 * (prompt*.safetensors, engram.safetensors) sit next to it and are not shards. */
static int open_unindexed(const char *dir, struct st_model *m) {
    DIR *d = opendir(dir);
    if (!d) {
        ds_err_set("%s: cannot open folder: %s", dir, strerror(errno));
        return -1;
    }
    char *found = NULL;
    int count = 0;
    char second[256] = "";
    for (struct dirent *e; (e = readdir(d));) {
        if (strncmp(e->d_name, "model", 5) != 0 || !ends_with(e->d_name, ST_SUFFIX)) continue;
        if (count++ == 0)
            found = ds_strdup(e->d_name);
        else if (!second[0])
            snprintf(second, sizeof second, "%s", e->d_name);
    }
    CHECK_LIBC(closedir(d));
    if (count != 1) {
        if (count == 0)
            ds_err_set("%s: no %s and no model*.safetensors file", dir, INDEX_NAME);
        else
            ds_err_set("%s: no %s but %d model*.safetensors files (%s, %s, ...)", dir, INDEX_NAME,
                       count, found, second);
        free(found);
        return -1;
    }
    alloc_shards(m, 1);
    m->shard_paths[0] = path_join(dir, found);
    free(found);
    return load_all(m);
}

int st_open(const char *path, struct st_model *m) {
    memset(m, 0, sizeof *m);
    struct stat sb;
    if (!path || stat(path, &sb) != 0) {
        ds_err_set("%s: cannot open: %s", path ? path : "(null)", path ? strerror(errno) : "no path");
        return -1;
    }
    int rc;
    if (S_ISDIR(sb.st_mode)) {
        m->dir = ds_strdup(path);
        char *index_path = path_join(path, INDEX_NAME);
        if (access(index_path, F_OK) == 0)
            rc = open_indexed(path, index_path, m);
        else
            rc = open_unindexed(path, m);
        free(index_path);
    } else {
        const char *slash = strrchr(path, '/');
        if (!slash) {
            m->dir = ds_strdup(".");
        } else {
            size_t n = slash == path ? 1 : (size_t)(slash - path);
            m->dir = ds_malloc(n + 1);
            memcpy(m->dir, path, n);
            m->dir[n] = '\0';
        }
        alloc_shards(m, 1);
        m->shard_paths[0] = ds_strdup(path);
        rc = load_all(m);
    }
    if (rc != 0) st_close(m);
    return rc;
}

void st_close(struct st_model *m) {
    if (!m) return;
    for (int i = 0; i < m->n_tensors; i++) free(m->tensors[i].name);
    free(m->tensors);
    for (int k = 0; k < m->n_shards; k++) {
        if (m->maps && m->maps[k]) CHECK_LIBC(munmap(m->maps[k], m->map_sizes[k]));
        if (m->shard_paths) free(m->shard_paths[k]);
    }
    free(m->shard_paths);
    free(m->maps);
    free(m->map_sizes);
    free(m->dir);
    free(m->metadata_json);
    memset(m, 0, sizeof *m);
}

int st_model_from_tensors(struct st_model *m, const char *label, struct st_tensor *tensors, int n) {
    memset(m, 0, sizeof *m);
    m->dir = ds_strdup(label);
    alloc_shards(m, 1); /* one pseudo-shard, never mapped: st_close skips NULL maps */
    m->shard_paths[0] = ds_strdup(label);
    m->tensors = tensors;
    m->n_tensors = n;
    for (int i = 0; i < n; i++) {
        struct st_tensor *t = &tensors[i];
        t->shard = 0;
        t->bound = false;
        size_t es = st_dtype_size(t->dtype), count = 1;
        bool ok = es > 0 && t->ndim >= 0 && t->ndim <= ST_MAX_DIMS && t->data;
        for (int j = 0; ok && j < t->ndim; j++) {
            ok = t->shape[j] >= 0;
            count *= (size_t)t->shape[j];
        }
        if (!ok || count * es != t->nbytes) {
            char shape[128];
            fmt_shape(shape, sizeof shape, t->shape, t->ndim > 0 && t->ndim <= ST_MAX_DIMS ? t->ndim : 0);
            ds_err_set("%s: tensor %s: dtype %s shape %s does not match its %zu bytes (or has no data)", label,
                       t->name, st_dtype_name(t->dtype), shape, t->nbytes);
            st_close(m);
            return -1;
        }
    }
    if (finish_tensors(m)) {
        st_close(m);
        return -1;
    }
    return 0;
}

struct st_tensor *st_find(const struct st_model *m, const char *name) {
    if (!m || !name) return NULL;
    int lo = 0, hi = m->n_tensors - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        int c = strcmp(name, m->tensors[mid].name);
        if (c == 0) return &m->tensors[mid];
        if (c < 0)
            hi = mid - 1;
        else
            lo = mid + 1;
    }
    return NULL;
}

const char *st_metadata(const struct st_model *m, const char *key) {
    if (!m || !m->metadata_json || !key) return NULL;
    const char *p = m->metadata_json + strlen(m->metadata_json) + 1;
    while (*p == '\1') {
        const char *k = p + 1;
        const char *v = k + strlen(k) + 1;
        if (strcmp(k, key) == 0) return v;
        p = v + strlen(v) + 1;
    }
    return NULL;
}

/* ---------------------------------------------------------------- writer */

struct wtensor {
    char *name;
    enum st_dtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    size_t nbytes;
    void *data; /* st_writer_add only */
    bool has_data;
};

struct st_writer {
    struct wtensor *t;
    int n, cap;
    int *slots; /* open-addressing set of tensor indices by name; -1 = empty */
    size_t n_slots;
    char **meta_key, **meta_val;
    int n_meta, meta_cap;
    char *path, *tmp_path;
    int fd;
    int next; /* next tensor st_writer_write expects */
    bool begun, failed;
};

struct sbuf {
    char *p;
    size_t n, cap;
};

static void sb_put(struct sbuf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        while (b->n + n + 1 > b->cap) b->cap = b->cap ? b->cap * 2 : 4096;
        b->p = ds_realloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
}

static void sb_str(struct sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

static void sb_json_string(struct sbuf *b, const char *s) {
    sb_put(b, "\"", 1);
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        char esc[8];
        if (*c == '"' || *c == '\\') {
            esc[0] = '\\';
            esc[1] = (char)*c;
            sb_put(b, esc, 2);
        } else if (*c < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", *c);
            sb_put(b, esc, 6);
        } else {
            sb_put(b, (const char *)c, 1);
        }
    }
    sb_put(b, "\"", 1);
}

static uint64_t name_hash(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

/* Slot where `name` is, or the empty slot where it would go. */
static size_t slot_of(const struct st_writer *w, const char *name) {
    size_t mask = w->n_slots - 1, i = (size_t)name_hash(name) & mask;
    while (w->slots[i] >= 0 && strcmp(w->t[w->slots[i]].name, name) != 0) i = (i + 1) & mask;
    return i;
}

static void grow_slots(struct st_writer *w) {
    free(w->slots);
    w->n_slots = w->n_slots ? w->n_slots * 2 : 64;
    w->slots = ds_malloc(w->n_slots * sizeof *w->slots);
    for (size_t i = 0; i < w->n_slots; i++) w->slots[i] = -1;
    for (int k = 0; k < w->n; k++) w->slots[slot_of(w, w->t[k].name)] = k;
}

struct st_writer *st_writer_new(void) {
    struct st_writer *w = ds_calloc(1, sizeof *w);
    w->fd = -1;
    grow_slots(w);
    return w;
}

int st_writer_declare(struct st_writer *w, const char *name, enum st_dtype dtype, int ndim,
                      const int64_t *shape) {
    if (!w) return -1;
    const char *nm = name ? name : "(null)";
    if (w->begun) {
        ds_err_set("st_writer_declare: tensor %s declared after st_writer_begin", nm);
        return -1;
    }
    if (!name || strcmp(name, "__metadata__") == 0) {
        ds_err_set("st_writer_declare: invalid tensor name %s", nm);
        return -1;
    }
    if ((unsigned)dtype >= ST_NDTYPES) {
        ds_err_set("st_writer_declare: tensor %s: invalid dtype %d", name, (int)dtype);
        return -1;
    }
    if (ndim < 0 || ndim > ST_MAX_DIMS || (ndim > 0 && !shape)) {
        ds_err_set("st_writer_declare: tensor %s: ndim %d not in 0..%d", name, ndim, ST_MAX_DIMS);
        return -1;
    }
    uint64_t nbytes = st_dtype_size(dtype);
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0 || (double)shape[i] > MAX_EXACT_INT ||
            __builtin_mul_overflow(nbytes, (uint64_t)shape[i], &nbytes) || nbytes > SIZE_MAX) {
            ds_err_set("st_writer_declare: tensor %s: bad shape[%d] = %" PRId64, name, i, shape[i]);
            return -1;
        }
    }
    size_t s = slot_of(w, name);
    if (w->slots[s] >= 0) {
        ds_err_set("st_writer_declare: tensor %s declared twice", name);
        return -1;
    }
    if (w->n == w->cap) {
        w->cap = w->cap ? w->cap * 2 : 64;
        w->t = ds_realloc(w->t, (size_t)w->cap * sizeof *w->t);
    }
    struct wtensor *t = &w->t[w->n];
    memset(t, 0, sizeof *t);
    t->name = ds_strdup(name);
    t->dtype = dtype;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
    t->nbytes = (size_t)nbytes;
    w->slots[s] = w->n;
    int idx = w->n++;
    if ((size_t)w->n * 2 > w->n_slots) grow_slots(w);
    return idx;
}

void st_writer_set_metadata(struct st_writer *w, const char *key, const char *value) {
    if (!w || !key || !value) return;
    if (w->begun) {
        /* The header is already on disk; make the mistake visible at st_writer_finish. */
        if (!w->failed) ds_err_set("st_writer_set_metadata: key %s set after st_writer_begin", key);
        w->failed = true;
        return;
    }
    for (int i = 0; i < w->n_meta; i++) {
        if (strcmp(w->meta_key[i], key) == 0) {
            free(w->meta_val[i]);
            w->meta_val[i] = ds_strdup(value);
            return;
        }
    }
    if (w->n_meta == w->meta_cap) {
        w->meta_cap = w->meta_cap ? w->meta_cap * 2 : 8;
        w->meta_key = ds_realloc(w->meta_key, (size_t)w->meta_cap * sizeof *w->meta_key);
        w->meta_val = ds_realloc(w->meta_val, (size_t)w->meta_cap * sizeof *w->meta_val);
    }
    w->meta_key[w->n_meta] = ds_strdup(key);
    w->meta_val[w->n_meta] = ds_strdup(value);
    w->n_meta++;
}

static int write_all(struct st_writer *w, const void *data, size_t n) {
    const char *p = data;
    while (n > 0) {
        ssize_t r = write(w->fd, p, n);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            ds_err_set("%s: write failed: %s", w->tmp_path, strerror(errno));
            w->failed = true;
            return -1;
        }
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

int st_writer_begin(struct st_writer *w, const char *path) {
    if (!w) return -1;
    if (w->begun || w->failed || !path) {
        if (!w->failed)
            ds_err_set("%s: st_writer_begin called twice or without a path", path ? path : "(null)");
        w->failed = true;
        return -1;
    }
    struct sbuf b = {0};
    sb_str(&b, "{");
    bool comma = false;
    if (w->n_meta > 0) {
        sb_str(&b, "\"__metadata__\":{");
        for (int i = 0; i < w->n_meta; i++) {
            if (i) sb_str(&b, ",");
            sb_json_string(&b, w->meta_key[i]);
            sb_str(&b, ":");
            sb_json_string(&b, w->meta_val[i]);
        }
        sb_str(&b, "}");
        comma = true;
    }
    uint64_t off = 0;
    char num[64];
    for (int i = 0; i < w->n; i++) {
        const struct wtensor *t = &w->t[i];
        if (comma) sb_str(&b, ",");
        comma = true;
        sb_json_string(&b, t->name);
        sb_str(&b, ":{\"dtype\":\"");
        sb_str(&b, st_dtype_name(t->dtype));
        sb_str(&b, "\",\"shape\":[");
        for (int k = 0; k < t->ndim; k++) {
            snprintf(num, sizeof num, k ? ",%" PRId64 : "%" PRId64, t->shape[k]);
            sb_str(&b, num);
        }
        snprintf(num, sizeof num, "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}", off,
                 off + t->nbytes);
        sb_str(&b, num);
        off += t->nbytes;
    }
    sb_str(&b, "}");
    /* Pad like the reference writer so the data area starts 8-byte aligned in the file. */
    while (b.n % 8) sb_str(&b, " ");

    w->path = ds_strdup(path);
    size_t pl = strlen(path);
    w->tmp_path = ds_malloc(pl + 5);
    memcpy(w->tmp_path, path, pl);
    memcpy(w->tmp_path + pl, ".tmp", 5);
    w->fd = open(w->tmp_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (w->fd < 0) {
        ds_err_set("%s: cannot create: %s", w->tmp_path, strerror(errno));
        free(b.p);
        w->failed = true;
        return -1;
    }
    w->begun = true;
    unsigned char len8[8];
    store_le64(len8, b.n);
    int rc = write_all(w, len8, 8);
    if (rc == 0) rc = write_all(w, b.p, b.n);
    free(b.p);
    return rc;
}

int st_writer_write(struct st_writer *w, int idx, const void *data, size_t nbytes) {
    if (!w) return -1;
    if (w->failed) return -1; /* the first error's message stays */
    if (!w->begun) {
        ds_err_set("st_writer_write: tensor %d written before st_writer_begin", idx);
        w->failed = true;
        return -1;
    }
    if (idx != w->next || idx >= w->n) {
        ds_err_set("%s: st_writer_write: tensor %d (%s) written out of order; expected %d (%s)",
                   w->path, idx, (idx >= 0 && idx < w->n) ? w->t[idx].name : "?", w->next,
                   w->next < w->n ? w->t[w->next].name : "none left");
        w->failed = true;
        return -1;
    }
    const struct wtensor *t = &w->t[idx];
    if (nbytes != t->nbytes || (nbytes > 0 && !data)) {
        ds_err_set("%s: st_writer_write: tensor %s: got %zu bytes, declared %zu", w->path, t->name,
                   data ? nbytes : 0, t->nbytes);
        w->failed = true;
        return -1;
    }
    if (write_all(w, data, nbytes) != 0) return -1;
    w->next++;
    return 0;
}

static void writer_free(struct st_writer *w) {
    for (int i = 0; i < w->n; i++) {
        free(w->t[i].name);
        free(w->t[i].data);
    }
    free(w->t);
    free(w->slots);
    for (int i = 0; i < w->n_meta; i++) {
        free(w->meta_key[i]);
        free(w->meta_val[i]);
    }
    free(w->meta_key);
    free(w->meta_val);
    free(w->path);
    free(w->tmp_path);
    free(w);
}

void st_writer_abort(struct st_writer *w) {
    if (!w) return;
    if (w->fd >= 0) close(w->fd);
    if (w->begun) unlink(w->tmp_path);
    writer_free(w);
}

/* Durability of the rename itself needs the folder synced; failing that only weakens crash
 * safety, so it is best effort. */
static void sync_parent(const char *path) {
    const char *slash = strrchr(path, '/');
    char *dir;
    if (!slash) {
        dir = ds_strdup(".");
    } else {
        size_t n = slash == path ? 1 : (size_t)(slash - path);
        dir = ds_malloc(n + 1);
        memcpy(dir, path, n);
        dir[n] = '\0';
    }
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        (void)fsync(fd);
        close(fd);
    }
    free(dir);
}

int st_writer_finish(struct st_writer *w) {
    if (!w) return -1;
    if (!w->failed && !w->begun) {
        ds_err_set("st_writer_finish: called before st_writer_begin");
        w->failed = true;
    }
    if (!w->failed && w->next != w->n) {
        ds_err_set("%s: st_writer_finish: only %d of %d tensors written (next: %s)", w->path,
                   w->next, w->n, w->t[w->next].name);
        w->failed = true;
    }
    if (!w->failed && fsync(w->fd) != 0) {
        ds_err_set("%s: fsync failed: %s", w->tmp_path, strerror(errno));
        w->failed = true;
    }
    if (!w->failed) {
        int rc = close(w->fd);
        w->fd = -1;
        if (rc != 0) {
            ds_err_set("%s: close failed: %s", w->tmp_path, strerror(errno));
            w->failed = true;
        }
    }
    if (!w->failed && rename(w->tmp_path, w->path) != 0) {
        ds_err_set("%s: rename to %s failed: %s", w->tmp_path, w->path, strerror(errno));
        w->failed = true;
    }
    if (w->failed) {
        st_writer_abort(w);
        return -1;
    }
    sync_parent(w->path);
    writer_free(w);
    return 0;
}

int st_writer_add(struct st_writer *w, const char *name, enum st_dtype dtype, int ndim,
                  const int64_t *shape, const void *data) {
    if (!w) return -1;
    if (!data) {
        /* Checked before declaring, so a refused call leaves nothing behind. */
        bool empty = false;
        for (int i = 0; shape && i < ndim && i < ST_MAX_DIMS; i++) empty |= shape[i] == 0;
        if (!empty) {
            ds_err_set("st_writer_add: tensor %s: no data", name ? name : "(null)");
            return -1;
        }
    }
    int idx = st_writer_declare(w, name, dtype, ndim, shape);
    if (idx < 0) return -1;
    struct wtensor *t = &w->t[idx];
    if (t->nbytes > 0) {
        t->data = ds_malloc(t->nbytes);
        memcpy(t->data, data, t->nbytes);
    }
    t->has_data = true;
    return 0;
}

int st_writer_save(struct st_writer *w, const char *path) {
    if (!w) return -1;
    for (int i = 0; i < w->n; i++) {
        if (!w->t[i].has_data) {
            ds_err_set("%s: st_writer_save: tensor %s was declared without data", path ? path : "?",
                       w->t[i].name);
            st_writer_abort(w);
            return -1;
        }
    }
    if (st_writer_begin(w, path) != 0) {
        st_writer_abort(w);
        return -1;
    }
    for (int i = 0; i < w->n; i++) {
        if (st_writer_write(w, i, w->t[i].data, w->t[i].nbytes) != 0) {
            st_writer_abort(w);
            return -1;
        }
    }
    return st_writer_finish(w);
}
