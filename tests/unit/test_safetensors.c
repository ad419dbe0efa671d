/* Tests for src/safetensors.c: writer/reader round trips (single file and a two-shard folder with
 * an index), the golden checkpoints opened read-only, and damaged copies of the golden small6
 * checkpoint plus hand-made headers, each of which must be refused with one line naming the file
 * and the tensor or field. Offsets and shapes of golden tensors are taken from the file's own
 * header, parsed here independently of the code under test, so the data pointers are checked too.
 * Everything written goes into mkdtemp folders under /tmp that are removed afterwards. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <cJSON.h>
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"
#include "safetensors.h"

#define SHARD1 "model-00001-of-00001.safetensors"
#define INDEX "model.safetensors.index.json"

/* ---------------------------------------------------------------- helpers */

static const char *golden(void) {
    const char *g = getenv("GOLDEN");
    return (g && g[0]) ? g : "../shared/golden";
}

static void make_tmpdir(char *buf, size_t cap) {
    snprintf(buf, cap, "/tmp/test_st_XXXXXX");
    assert_non_null(mkdtemp(buf));
}

/* The temp folders are flat, so one level of unlink suffices. */
static void rm_tree(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    char p[4096];
    for (struct dirent *e; (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        unlink(p);
    }
    closedir(d);
    rmdir(dir);
}

static char *read_all(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    buf[n] = '\0';
    if (len) *len = (size_t)n;
    return buf;
}

static void write_all(const char *path, const void *buf, size_t len) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(buf, 1, len, f), len);
    assert_int_equal(fclose(f), 0);
}

static void copy_file(const char *src, const char *dst) {
    size_t n;
    char *b = read_all(src, &n);
    write_all(dst, b, n);
    free(b);
}

static bool exists(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0;
}

static uint64_t le64(const unsigned char *b) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | b[i];
    return v;
}

/* Independent header parse: the object, and the header length through *hlen. */
static cJSON *header_of(const char *path, size_t *hlen) {
    size_t n;
    char *b = read_all(path, &n);
    assert_true(n >= 8);
    uint64_t h = le64((const unsigned char *)b);
    assert_true(h <= n - 8);
    cJSON *root = cJSON_ParseWithLength(b + 8, (size_t)h);
    assert_non_null(root);
    free(b);
    if (hlen) *hlen = (size_t)h;
    return root;
}

/* Same-length in-place edit of the one occurrence of `from` inside the header. */
static void patch_header(const char *path, const char *from, const char *to) {
    assert_int_equal(strlen(from), strlen(to));
    size_t n;
    char *b = read_all(path, &n);
    size_t h = (size_t)le64((const unsigned char *)b);
    char *hdr = b + 8, save = hdr[h];
    hdr[h] = '\0';
    char *at = strstr(hdr, from);
    assert_non_null(at);
    assert_null(strstr(at + 1, from));
    memcpy(at, to, strlen(to));
    hdr[h] = save;
    write_all(path, b, n);
    free(b);
}

static void write_raw_st(const char *path, const char *header, size_t data_len) {
    size_t h = strlen(header);
    unsigned char *b = calloc(1, 8 + h + data_len);
    assert_non_null(b);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)h >> (8 * i));
    memcpy(b + 8, header, h);
    write_all(path, b, 8 + h + data_len);
    free(b);
}

/* st_open must fail, leave the model empty, and produce one line containing every substring. */
static void expect_fail(const char *path, ...) {
    struct st_model m;
    memset(&m, 0x5a, sizeof m);
    assert_int_equal(st_open(path, &m), -1);
    assert_int_equal(m.n_tensors, 0);
    assert_null(m.tensors);
    assert_int_equal(m.n_shards, 0);
    st_close(&m);
    const char *err = ds_err_get();
    assert_null(strchr(err, '\n'));
    va_list ap;
    va_start(ap, path);
    for (const char *s; (s = va_arg(ap, const char *));) {
        if (!strstr(err, s)) print_error("error '%s' lacks '%s'\n", err, s);
        assert_non_null(strstr(err, s));
    }
    va_end(ap);
}

static void assert_sorted(const struct st_model *m) {
    for (int i = 1; i < m->n_tensors; i++)
        assert_true(strcmp(m->tensors[i - 1].name, m->tensors[i].name) < 0);
}

static void assert_shape(const struct st_tensor *t, enum st_dtype dt, int ndim, const int64_t *shape) {
    assert_non_null(t);
    assert_int_equal(t->dtype, dt);
    assert_int_equal(t->ndim, ndim);
    size_t n = st_dtype_size(dt);
    for (int i = 0; i < ndim; i++) {
        assert_int_equal(t->shape[i], shape[i]);
        n *= (size_t)shape[i];
    }
    assert_int_equal(t->nbytes, n);
}

/* ---------------------------------------------------------------- dtypes */

static void test_dtypes(void **state) {
    (void)state;
    const char *names[ST_NDTYPES] = {"BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E8M0",
                                     "I8",   "U8",  "I16", "I32", "I64",     "BOOL"};
    const size_t sizes[ST_NDTYPES] = {2, 2, 4, 8, 1, 1, 1, 1, 2, 4, 8, 1};
    for (int i = 0; i < ST_NDTYPES; i++) {
        enum st_dtype d;
        assert_string_equal(st_dtype_name((enum st_dtype)i), names[i]);
        assert_int_equal(st_dtype_size((enum st_dtype)i), sizes[i]);
        assert_int_equal(st_dtype_parse(names[i], &d), 0);
        assert_int_equal(d, i);
    }
    enum st_dtype d;
    assert_int_equal(st_dtype_parse("XX16", &d), -1);
    assert_int_equal(st_dtype_parse("bf16", &d), -1);
    assert_int_equal(st_dtype_parse("", &d), -1);
}

/* ---------------------------------------------------------------- writer round trips */

struct spec {
    const char *name;
    enum st_dtype dt;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
};

/* Declared out of name order and with odd sizes, so sorting and unaligned offsets are exercised. */
static const struct spec specs[] = {
    {"z.bf16", ST_BF16, 2, {3, 4}},
    {"a.f32", ST_F32, 1, {5}},
    {"m.i8", ST_I8, 1, {7}},
    {"b.f64", ST_F64, 2, {2, 2}},
    {"q.f8", ST_F8_E4M3, 2, {4, 2}},
    {"q.f8.scale", ST_F8_E8M0, 1, {3}},
    {"u8", ST_U8, 1, {1}},
    {"i16", ST_I16, 3, {2, 1, 3}},
    {"scalar.i32", ST_I32, 0, {0}},
    {"i64", ST_I64, 1, {2}},
    {"flags", ST_BOOL, 1, {3}},
    {"empty.f16", ST_F16, 2, {0, 4}},
    {"eight.dims", ST_F32, 8, {1, 1, 1, 1, 1, 1, 2, 1}},
};
#define N_SPECS (int)(sizeof specs / sizeof specs[0])

static size_t spec_bytes(const struct spec *s) {
    size_t n = st_dtype_size(s->dt);
    for (int i = 0; i < s->ndim; i++) n *= (size_t)s->shape[i];
    return n;
}

static void fill(unsigned char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(seed * 131u + i * 7u + 1u);
}

static void check_specs(const struct st_model *m, int shard) {
    for (int i = 0; i < N_SPECS; i++) {
        const struct st_tensor *t = st_find(m, specs[i].name);
        assert_shape(t, specs[i].dt, specs[i].ndim, specs[i].shape);
        assert_int_equal(t->shard, shard);
        unsigned char want[64];
        fill(want, t->nbytes, (unsigned)i);
        if (t->nbytes) assert_memory_equal(t->data, want, t->nbytes);
    }
}

static void test_roundtrip_single(void **state) {
    (void)state;
    char dir[64], path[128], tmp[160];
    make_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/out.safetensors", dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);

    struct st_writer *w = st_writer_new();
    st_writer_set_metadata(w, "format", "pt");
    st_writer_set_metadata(w, "quote", "say \"hi\" \\ twice\nnewline");
    st_writer_set_metadata(w, "empty", "");
    st_writer_set_metadata(w, "format", "pt2"); /* a second set replaces */
    for (int i = 0; i < N_SPECS; i++)
        assert_int_equal(st_writer_declare(w, specs[i].name, specs[i].dt, specs[i].ndim, specs[i].shape), i);
    assert_int_equal(st_writer_begin(w, path), 0);
    assert_true(exists(tmp));
    assert_false(exists(path));
    size_t total = 0;
    for (int i = 0; i < N_SPECS; i++) {
        unsigned char buf[64];
        size_t n = spec_bytes(&specs[i]);
        fill(buf, n, (unsigned)i);
        assert_int_equal(st_writer_write(w, i, buf, n), 0);
        total += n;
    }
    assert_int_equal(st_writer_finish(w), 0);
    assert_true(exists(path));
    assert_false(exists(tmp));

    /* Layout as the reference writer does it: metadata first, padded to 8, no gaps. */
    size_t flen, hlen;
    char *raw = read_all(path, &flen);
    hlen = (size_t)le64((unsigned char *)raw);
    assert_int_equal((8 + hlen) % 8, 0);
    assert_int_equal(flen, 8 + hlen + total);
    assert_memory_equal(raw + 8, "{\"__metadata__\":{", 17);
    free(raw);

    struct st_model m;
    assert_int_equal(st_open(path, &m), 0);
    assert_int_equal(m.n_tensors, N_SPECS);
    assert_int_equal(m.n_shards, 1);
    assert_string_equal(m.dir, dir);
    assert_sorted(&m);
    check_specs(&m, 0);
    /* data_offsets follow declaration order, back to back */
    const char *expect = st_find(&m, specs[0].name)->data;
    for (int i = 0; i < N_SPECS; i++) {
        const struct st_tensor *t = st_find(&m, specs[i].name);
        if (t->nbytes) assert_ptr_equal(t->data, expect);
        expect = (const char *)t->data + t->nbytes;
    }
    assert_null(st_find(&m, "nope"));
    assert_null(st_find(&m, ""));
    assert_string_equal(st_metadata(&m, "format"), "pt2");
    assert_string_equal(st_metadata(&m, "quote"), "say \"hi\" \\ twice\nnewline");
    assert_string_equal(st_metadata(&m, "empty"), "");
    assert_null(st_metadata(&m, "missing"));
    assert_non_null(m.metadata_json);
    assert_int_equal(m.metadata_json[0], '{');
    st_close(&m);
    st_close(&m); /* idempotent */
    rm_tree(dir);
}

static void test_add_save(void **state) {
    (void)state;
    char dir[64], path[128];
    make_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/small.safetensors", dir);
    struct st_writer *w = st_writer_new();
    for (int i = 0; i < N_SPECS; i++) {
        unsigned char buf[64];
        fill(buf, spec_bytes(&specs[i]), (unsigned)i);
        assert_int_equal(st_writer_add(w, specs[i].name, specs[i].dt, specs[i].ndim, specs[i].shape, buf), 0);
        memset(buf, 0, sizeof buf); /* the writer must have copied */
    }
    assert_int_equal(st_writer_save(w, path), 0);
    struct st_model m;
    assert_int_equal(st_open(path, &m), 0);
    assert_int_equal(m.n_tensors, N_SPECS);
    check_specs(&m, 0);
    assert_null(m.metadata_json); /* no metadata set: no __metadata__ written */
    assert_null(st_metadata(&m, "format"));
    st_close(&m);
    rm_tree(dir);
}

static void test_writer_misuse(void **state) {
    (void)state;
    char dir[64], path[128], tmp[160];
    make_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/w.safetensors", dir);
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    const int64_t s2[2] = {2, 2}, bad[1] = {-3};
    unsigned char buf[16] = {0};

    struct st_writer *w = st_writer_new();
    assert_int_equal(st_writer_declare(w, "x", ST_F32, 2, s2), 0);
    assert_int_equal(st_writer_declare(w, "x", ST_F32, 2, s2), -1);
    assert_non_null(strstr(ds_err_get(), "x declared twice"));
    assert_int_equal(st_writer_declare(w, "y", ST_F32, 9, s2), -1);
    assert_int_equal(st_writer_declare(w, "y", ST_F32, 1, bad), -1);
    assert_int_equal(st_writer_declare(w, "__metadata__", ST_F32, 1, s2), -1);
    assert_int_equal(st_writer_declare(w, "y", ST_NDTYPES, 1, s2), -1);
    assert_int_equal(st_writer_declare(w, "y", ST_U8, 1, s2), 1);
    assert_int_equal(st_writer_begin(w, path), 0);
    assert_int_equal(st_writer_declare(w, "late", ST_U8, 1, s2), -1);
    assert_int_equal(st_writer_write(w, 1, buf, 2), -1); /* out of order */
    assert_non_null(strstr(ds_err_get(), "out of order"));
    assert_non_null(strstr(ds_err_get(), "w.safetensors"));
    st_writer_abort(w);
    assert_false(exists(tmp));
    assert_false(exists(path));

    w = st_writer_new();
    assert_int_equal(st_writer_declare(w, "x", ST_F32, 2, s2), 0);
    assert_int_equal(st_writer_begin(w, path), 0);
    assert_int_equal(st_writer_write(w, 0, buf, 12), -1); /* wrong size */
    assert_non_null(strstr(ds_err_get(), "tensor x: got 12 bytes, declared 16"));
    assert_int_equal(st_writer_finish(w), -1); /* failed writer: finish cleans up */
    assert_false(exists(tmp));
    assert_false(exists(path));

    w = st_writer_new();
    assert_int_equal(st_writer_declare(w, "x", ST_F32, 2, s2), 0);
    assert_int_equal(st_writer_declare(w, "y", ST_U8, 1, s2), 1);
    assert_int_equal(st_writer_begin(w, path), 0);
    assert_int_equal(st_writer_write(w, 0, buf, 16), 0);
    assert_int_equal(st_writer_finish(w), -1); /* y never written */
    assert_non_null(strstr(ds_err_get(), "only 1 of 2"));
    assert_false(exists(tmp));
    assert_false(exists(path));

    w = st_writer_new();
    assert_int_equal(st_writer_add(w, "x", ST_F32, 2, s2, NULL), -1);
    assert_int_equal(st_writer_declare(w, "x", ST_F32, 2, s2), 0); /* the refused add left nothing */
    assert_int_equal(st_writer_save(w, path), -1);                /* x has no data */
    assert_non_null(strstr(ds_err_get(), "tensor x"));
    assert_false(exists(path));

    w = st_writer_new();
    assert_int_equal(st_writer_declare(w, "x", ST_F32, 2, s2), 0);
    assert_int_equal(st_writer_begin(w, "/nonexistent_dir_for_st/out.safetensors"), -1);
    assert_non_null(strstr(ds_err_get(), "/nonexistent_dir_for_st/out.safetensors"));
    st_writer_abort(w);
    rm_tree(dir);
}

/* Thousands of tensors declared in scrambled order: the reader must sort and find every one. */
static void test_many_tensors(void **state) {
    (void)state;
    enum { N = 20000 };
    char dir[64], path[128], name[32];
    make_tmpdir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/many.safetensors", dir);
    struct st_writer *w = st_writer_new();
    const int64_t one[1] = {1};
    for (int i = 0; i < N; i++) {
        int k = (int)(((long)i * 7919) % N); /* a permutation: gcd(7919, N) = 1 */
        unsigned char v = (unsigned char)k;
        snprintf(name, sizeof name, "t.%05d", k);
        assert_int_equal(st_writer_add(w, name, ST_U8, 1, one, &v), 0);
    }
    assert_int_equal(st_writer_save(w, path), 0);
    struct st_model m;
    assert_int_equal(st_open(path, &m), 0);
    assert_int_equal(m.n_tensors, N);
    assert_sorted(&m);
    for (int k = 0; k < N; k++) {
        snprintf(name, sizeof name, "t.%05d", k);
        const struct st_tensor *t = st_find(&m, name);
        assert_non_null(t);
        assert_ptr_equal(t, &m.tensors[k]);
        assert_int_equal(*(const unsigned char *)t->data, (unsigned char)k);
    }
    st_close(&m);
    rm_tree(dir);
}

/* ---------------------------------------------------------------- sharded folders */

static void write_shard(const char *path, const char *const *names, int n, bool meta) {
    struct st_writer *w = st_writer_new();
    if (meta) st_writer_set_metadata(w, "format", "pt");
    for (int i = 0; i < n; i++) {
        int64_t shape[1] = {(int64_t)strlen(names[i]) + 1};
        assert_int_equal(st_writer_add(w, names[i], ST_U8, 1, shape, names[i]), 0); /* data = name */
    }
    assert_int_equal(st_writer_save(w, path), 0);
}

static void write_index(const char *dir, const char *body) {
    char p[256], text[2048];
    snprintf(p, sizeof p, "%s/%s", dir, INDEX);
    snprintf(text, sizeof text, "{\n  \"metadata\": {\"total_size\": 0},\n  \"weight_map\": {%s}\n}\n", body);
    write_all(p, text, strlen(text));
}

static void test_sharded_folder(void **state) {
    (void)state;
    char dir[64], s1[128], s2[128], side[128];
    make_tmpdir(dir, sizeof dir);
    snprintf(s1, sizeof s1, "%s/model-00001-of-00002.safetensors", dir);
    snprintf(s2, sizeof s2, "%s/model-00002-of-00002.safetensors", dir);
    const char *a[] = {"layers.0.w", "embed.weight"}, *b[] = {"layers.1.w", "head.weight", "norm"};
    write_shard(s1, a, 2, true);
    write_shard(s2, b, 3, false);
    /* sidecars that are not shards must be ignored when an index exists */
    snprintf(side, sizeof side, "%s/prompt0.safetensors", dir);
    write_shard(side, a, 1, false);
    write_index(dir, "\"head.weight\": \"model-00002-of-00002.safetensors\","
                     "\"layers.0.w\": \"model-00001-of-00002.safetensors\","
                     "\"norm\": \"model-00002-of-00002.safetensors\","
                     "\"embed.weight\": \"model-00001-of-00002.safetensors\","
                     "\"layers.1.w\": \"model-00002-of-00002.safetensors\"");
    struct st_model m;
    assert_int_equal(st_open(dir, &m), 0);
    assert_int_equal(m.n_shards, 2);
    assert_int_equal(m.n_tensors, 5);
    assert_string_equal(m.shard_paths[0], s1);
    assert_string_equal(m.shard_paths[1], s2);
    assert_sorted(&m);
    const char *all[] = {"embed.weight", "head.weight", "layers.0.w", "layers.1.w", "norm"};
    const int shard_of[] = {0, 1, 0, 1, 1};
    for (int i = 0; i < 5; i++) {
        const struct st_tensor *t = st_find(&m, all[i]);
        assert_non_null(t);
        assert_int_equal(t->shard, shard_of[i]);
        assert_int_equal(t->nbytes, strlen(all[i]) + 1);
        assert_string_equal((const char *)t->data, all[i]);
        assert_false(t->bound);
    }
    assert_string_equal(st_metadata(&m, "format"), "pt");
    st_close(&m);

    /* index puts a tensor in the wrong shard */
    write_index(dir, "\"head.weight\": \"model-00001-of-00002.safetensors\","
                     "\"layers.0.w\": \"model-00001-of-00002.safetensors\","
                     "\"norm\": \"model-00002-of-00002.safetensors\","
                     "\"embed.weight\": \"model-00001-of-00002.safetensors\","
                     "\"layers.1.w\": \"model-00002-of-00002.safetensors\"");
    expect_fail(dir, INDEX, "head.weight", "model-00002-of-00002.safetensors", NULL);

    /* index lists a tensor twice */
    write_index(dir, "\"head.weight\": \"model-00002-of-00002.safetensors\","
                     "\"head.weight\": \"model-00002-of-00002.safetensors\"");
    expect_fail(dir, INDEX, "head.weight", "twice", NULL);

    /* the same tensor in both shards */
    const char *b2[] = {"layers.1.w", "head.weight", "norm", "embed.weight"};
    write_shard(s2, b2, 4, false);
    write_index(dir, "\"head.weight\": \"model-00002-of-00002.safetensors\","
                     "\"layers.0.w\": \"model-00001-of-00002.safetensors\","
                     "\"norm\": \"model-00002-of-00002.safetensors\","
                     "\"embed.weight\": \"model-00001-of-00002.safetensors\","
                     "\"layers.1.w\": \"model-00002-of-00002.safetensors\"");
    expect_fail(dir, "embed.weight", "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors", NULL);
    rm_tree(dir);
}

static void test_unindexed_folder(void **state) {
    (void)state;
    char dir[64], p[128];
    make_tmpdir(dir, sizeof dir);
    expect_fail(dir, dir, "model", NULL); /* empty folder */
    const char *a[] = {"x", "y"}, *b[] = {"z"};
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    write_shard(p, a, 2, true);
    snprintf(p, sizeof p, "%s/prompt0.safetensors", dir);
    write_shard(p, b, 1, false);
    snprintf(p, sizeof p, "%s/engram.safetensors", dir);
    write_shard(p, b, 1, false);
    struct st_model m;
    assert_int_equal(st_open(dir, &m), 0);
    assert_int_equal(m.n_shards, 1);
    assert_int_equal(m.n_tensors, 2);
    assert_non_null(strstr(m.shard_paths[0], "model.safetensors"));
    assert_null(st_find(&m, "z"));
    st_close(&m);
    snprintf(p, sizeof p, "%s/model-extra.safetensors", dir);
    write_shard(p, b, 1, false);
    expect_fail(dir, dir, "2 model*.safetensors", NULL);
    rm_tree(dir);
}

/* ---------------------------------------------------------------- golden checkpoints */

struct known {
    const char *name;
    enum st_dtype dt;
    int ndim;
    int64_t shape[2];
};

static void check_golden(const char *spec, const struct known *k, int nk) {
    char dir[1024], index[1100], shard[1100];
    snprintf(dir, sizeof dir, "%s/%s", golden(), spec);
    snprintf(index, sizeof index, "%s/%s", dir, INDEX);
    snprintf(shard, sizeof shard, "%s/%s", dir, SHARD1);
    if (!exists(index)) fail_msg("golden checkpoint %s missing (set GOLDEN)", index);

    char *itext = read_all(index, NULL);
    cJSON *iroot = cJSON_Parse(itext);
    assert_non_null(iroot);
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(iroot, "weight_map");
    int n_wm = cJSON_GetArraySize(wm);
    size_t hlen;
    cJSON *hdr = header_of(shard, &hlen);

    struct st_model m;
    if (st_open(dir, &m) != 0) fail_msg("st_open(%s): %s", dir, ds_err_get());
    assert_int_equal(m.n_tensors, n_wm);
    assert_int_equal(m.n_shards, 1);
    assert_string_equal(m.dir, dir);
    assert_sorted(&m);
    for (const cJSON *e = wm->child; e; e = e->next) {
        const struct st_tensor *t = st_find(&m, e->string);
        assert_non_null(t);
        assert_int_equal(t->shard, 0);
    }
    assert_string_equal(st_metadata(&m, "format"), "pt");
    for (int i = 0; i < nk; i++) {
        const struct st_tensor *t = st_find(&m, k[i].name);
        assert_shape(t, k[i].dt, k[i].ndim, k[i].shape);
        /* data must be exactly the bytes at 8 + header + begin */
        const cJSON *offs = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(hdr, k[i].name), "data_offsets");
        size_t begin = (size_t)offs->child->valuedouble;
        FILE *f = fopen(shard, "rb");
        assert_non_null(f);
        char *want = malloc(t->nbytes);
        fseek(f, (long)(8 + hlen + begin), SEEK_SET);
        assert_int_equal(fread(want, 1, t->nbytes, f), t->nbytes);
        fclose(f);
        assert_memory_equal(t->data, want, t->nbytes);
        free(want);
    }
    st_close(&m);

    /* The shard on its own opens to the same tensors. */
    assert_int_equal(st_open(shard, &m), 0);
    assert_int_equal(m.n_tensors, n_wm);
    assert_string_equal(m.dir, dir);
    st_close(&m);
    cJSON_Delete(hdr);
    cJSON_Delete(iroot);
    free(itext);
}

static void test_golden_small6(void **state) {
    (void)state;
    const struct known k[] = {
        {"embed.weight", ST_BF16, 2, {512, 256}},
        {"head.weight", ST_BF16, 2, {512, 256}},
        {"layers.0.ffn.experts.0.w1.weight", ST_I8, 2, {128, 128}},
        {"layers.0.ffn.experts.0.w1.scale", ST_F8_E8M0, 2, {128, 8}},
        {"layers.0.attn.wq_a.weight", ST_F8_E4M3, 2, {64, 256}},
        {"layers.0.attn.wq_a.scale", ST_F8_E8M0, 2, {2, 8}},
        {"layers.0.attn.attn_sink", ST_F32, 1, {4}},
        {"mtp.0.norm.weight", ST_BF16, 1, {256}},
    };
    check_golden("small6", k, (int)(sizeof k / sizeof k[0]));
}

static void test_golden_tp8pp2(void **state) {
    (void)state;
    const struct known k[] = {
        {"embed.weight", ST_BF16, 2, {512, 256}},
        {"layers.0.ffn.experts.0.w1.weight", ST_I8, 2, {128, 128}},
        {"layers.0.attn.wq_a.weight", ST_F8_E4M3, 2, {64, 256}},
        {"layers.0.attn.attn_sink", ST_F32, 1, {8}},
    };
    check_golden("tp8pp2", k, (int)(sizeof k / sizeof k[0]));
}

static void test_golden_sidecars(void **state) {
    (void)state;
    char p[1024];
    snprintf(p, sizeof p, "%s/small6/prompt0.safetensors", golden());
    cJSON *hdr = header_of(p, NULL);
    int n = cJSON_GetArraySize(hdr) - (cJSON_GetObjectItemCaseSensitive(hdr, "__metadata__") ? 1 : 0);
    cJSON_Delete(hdr);
    struct st_model m;
    if (st_open(p, &m) != 0) fail_msg("st_open(%s): %s", p, ds_err_get());
    assert_int_equal(m.n_tensors, n);
    assert_string_equal(st_metadata(&m, "format"), "deepseek-v41-golden/1");
    const char *meta = st_metadata(&m, "meta");
    assert_non_null(meta);
    assert_non_null(strstr(meta, "\"spec\": \"small6\""));
    const int64_t s5[1] = {5};
    assert_shape(st_find(&m, "prompt_ids"), ST_I32, 1, s5);
    st_close(&m);

    snprintf(p, sizeof p, "%s/small6/engram.safetensors", golden());
    assert_int_equal(st_open(p, &m), 0);
    const int64_t s24[2] = {2, 4};
    assert_shape(st_find(&m, "multipliers"), ST_I64, 2, s24);
    assert_string_equal(st_metadata(&m, "pad_id"), "1");
    st_close(&m);
}

/* ---------------------------------------------------------------- damaged copies of small6 */

struct damage {
    char dir[64];
    char shard[128];
    char index[128];
};

static int damage_setup(void **state) {
    struct damage *d = calloc(1, sizeof *d);
    make_tmpdir(d->dir, sizeof d->dir);
    const char *files[] = {"config.json", INDEX, SHARD1};
    char src[1024], dst[256];
    for (int i = 0; i < 3; i++) {
        snprintf(src, sizeof src, "%s/small6/%s", golden(), files[i]);
        snprintf(dst, sizeof dst, "%s/%s", d->dir, files[i]);
        copy_file(src, dst);
    }
    snprintf(d->shard, sizeof d->shard, "%s/%s", d->dir, SHARD1);
    snprintf(d->index, sizeof d->index, "%s/%s", d->dir, INDEX);
    *state = d;
    return 0;
}

static int damage_teardown(void **state) {
    struct damage *d = *state;
    rm_tree(d->dir);
    free(d);
    return 0;
}

static void test_damage_none(void **state) {
    struct damage *d = *state;
    struct st_model m;
    assert_int_equal(st_open(d->dir, &m), 0); /* the copy itself is fine */
    st_close(&m);
}

static void test_damage_truncated(void **state) {
    struct damage *d = *state;
    size_t hlen, n;
    cJSON *hdr = header_of(d->shard, &hlen);
    /* one byte short: only the tensor ending last loses data */
    const char *last = NULL;
    double last_end = -1;
    for (const cJSON *e = hdr->child; e; e = e->next) {
        if (!strcmp(e->string, "__metadata__")) continue;
        double end = cJSON_GetObjectItemCaseSensitive(e, "data_offsets")->child->next->valuedouble;
        if (end > last_end) {
            last_end = end;
            last = e->string;
        }
    }
    char *b = read_all(d->shard, &n);
    assert_int_equal(n, 8 + hlen + (size_t)last_end);
    write_all(d->shard, b, n - 1);
    expect_fail(d->dir, SHARD1, last, "beyond the data area", NULL);
    write_all(d->shard, b, n / 2);
    expect_fail(d->dir, SHARD1, "truncated", NULL);
    write_all(d->shard, b, 5);
    expect_fail(d->dir, SHARD1, "shorter than", NULL);
    free(b);
    cJSON_Delete(hdr);
}

static void test_damage_header_length(void **state) {
    struct damage *d = *state;
    size_t n;
    unsigned char *b = (unsigned char *)read_all(d->shard, &n);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)n >> (8 * i));
    write_all(d->shard, b, n);
    expect_fail(d->dir, SHARD1, "header length", NULL);
    b[7] = 0xff; /* absurd length must not wrap around */
    write_all(d->shard, b, n);
    expect_fail(d->dir, SHARD1, "header length", NULL);
    free(b);
}

static void test_damage_dtype_size(void **state) {
    struct damage *d = *state;
    patch_header(d->shard, "\"embed.weight\":{\"dtype\":\"BF16\"", "\"embed.weight\":{\"dtype\":\"F32\" ");
    expect_fail(d->dir, SHARD1, "tensor embed.weight",
                "shape [512,256] x F32 = 524288 bytes but data_offsets span 262144", NULL);
}

static void test_damage_dtype_unknown(void **state) {
    struct damage *d = *state;
    patch_header(d->shard, "\"embed.weight\":{\"dtype\":\"BF16\"", "\"embed.weight\":{\"dtype\":\"XX16\"");
    expect_fail(d->dir, SHARD1, "embed.weight", "unknown dtype", "XX16", NULL);
}

static void test_damage_shape(void **state) {
    struct damage *d = *state;
    patch_header(d->shard, "\"embed.weight\":{\"dtype\":\"BF16\",\"shape\":[512,256]",
                 "\"embed.weight\":{\"dtype\":\"BF16\",\"shape\":[512,128]");
    expect_fail(d->dir, SHARD1, "embed.weight", "[512,128]", "262144", NULL);
    patch_header(d->shard, "\"embed.weight\":{\"dtype\":\"BF16\",\"shape\":[512,128]",
                 "\"embed.weight\":{\"dtype\":\"BF16\",\"shape\":[512,-28]");
    expect_fail(d->dir, SHARD1, "embed.weight", "shape[1]", NULL);
}

static void test_damage_overlap(void **state) {
    struct damage *d = *state;
    cJSON *hdr = header_of(d->shard, NULL);
    const cJSON *eo = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(hdr, "embed.weight"), "data_offsets");
    const cJSON *ho = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(hdr, "head.weight"), "data_offsets");
    char from[128], to[128];
    snprintf(from, sizeof from, "\"data_offsets\":[%.0f,%.0f]", ho->child->valuedouble, ho->child->next->valuedouble);
    snprintf(to, sizeof to, "\"data_offsets\":[%.0f,%.0f]", eo->child->valuedouble, eo->child->next->valuedouble);
    assert_int_equal(strlen(from), strlen(to)); /* same-size tensors next to each other in small6 */
    patch_header(d->shard, from, to);
    expect_fail(d->dir, SHARD1, "overlap", "embed.weight", "head.weight", NULL);
    cJSON_Delete(hdr);
}

static void edit_index(const struct damage *d, const char *remove, const char *set, const char *to) {
    char *text = read_all(d->index, NULL);
    cJSON *root = cJSON_Parse(text);
    assert_non_null(root);
    cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (remove) {
        assert_non_null(cJSON_GetObjectItemCaseSensitive(wm, remove));
        cJSON_DeleteItemFromObjectCaseSensitive(wm, remove);
    }
    if (set) {
        cJSON_DeleteItemFromObjectCaseSensitive(wm, set);
        cJSON_AddStringToObject(wm, set, to);
    }
    char *out = cJSON_Print(root);
    write_all(d->index, out, strlen(out));
    cJSON_free(out);
    cJSON_Delete(root);
    free(text);
}

static void test_damage_index_missing_tensor(void **state) {
    struct damage *d = *state;
    edit_index(d, "head.weight", NULL, NULL);
    expect_fail(d->dir, SHARD1, "head.weight", INDEX, NULL);
}

static void test_damage_index_extra_tensor(void **state) {
    struct damage *d = *state;
    edit_index(d, NULL, "layers.99.bogus.weight", SHARD1);
    expect_fail(d->dir, INDEX, "layers.99.bogus.weight", SHARD1, NULL);
}

static void test_damage_index_missing_shard(void **state) {
    struct damage *d = *state;
    edit_index(d, NULL, "head.weight", "model-00002-of-00002.safetensors");
    expect_fail(d->dir, INDEX, "shard 'model-00002-of-00002.safetensors' (for tensor 'head.weight') not found", NULL);
}

static void test_damage_index_malformed(void **state) {
    struct damage *d = *state;
    size_t n;
    char *text = read_all(d->index, &n);
    write_all(d->index, text, n / 2); /* cut in the middle */
    expect_fail(d->dir, INDEX, "not valid JSON", NULL);
    write_all(d->index, "{\"metadata\": {}}", 16);
    expect_fail(d->dir, INDEX, "weight_map", NULL);
    write_all(d->index, "{\"weight_map\": {\"head.weight\": 7}}", 34);
    expect_fail(d->dir, INDEX, "weight_map", "head.weight", NULL);
    write_all(d->index, text, n);
    free(text);
}

/* ---------------------------------------------------------------- hand-made headers */

static void test_bad_headers(void **state) {
    (void)state;
    static const struct {
        const char *header;
        size_t data;
        const char *want1, *want2;
    } cases[] = {
        {"not json", 0, "not valid JSON", NULL},
        {"", 0, "not valid JSON", NULL},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}} x", 4, "trailing", NULL},
        {"[1,2]", 0, "not a JSON object", NULL},
        {"{\"a\":5}", 0, "tensor a", "not a JSON object"},
        {"{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "tensor a", "missing \"dtype\""},
        {"{\"a\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "tensor a", "\"dtype\" is not a string"},
        {"{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, "tensor a", "missing \"shape\""},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":\"1\",\"data_offsets\":[0,4]}}", 4, "tensor a", "\"shape\" is not"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4, "tensor a", "shape[0]"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}", 4, "tensor a", "shape[0]"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4, "tensor a", "9 dims"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, "tensor a", "missing \"data_offsets\""},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4, "tensor a", "data_offsets"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,\"4\"]}}", 4, "tensor a", "data_offsets"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}", 4, "tensor a", "begin > end"},
        {"{\"a\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]}}", 4, "tensor a", "beyond the data area"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296],\"data_offsets\":[0,4]}}", 4,
         "tensor a", "overflows"},
        {"{\"__metadata__\":[1]}", 0, "__metadata__", NULL},
        {"{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
         "\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}", 2, "tensor a", "twice"},
        {"{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},"
         "\"b\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[1,3]}}", 3, "tensor b", "overlap tensor a"},
    };
    char dir[64], p[128];
    make_tmpdir(dir, sizeof dir);
    snprintf(p, sizeof p, "%s/bad.safetensors", dir);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        write_raw_st(p, cases[i].header, cases[i].data);
        expect_fail(p, "bad.safetensors", cases[i].want1, cases[i].want2, NULL);
    }
    write_all(p, "\x10\0\0", 3);
    expect_fail(p, "bad.safetensors", "shorter than", NULL);
    expect_fail("/nonexistent_dir_for_st/x.safetensors", "/nonexistent_dir_for_st/x.safetensors", NULL);

    /* Valid oddities: empty tensors may share an offset, non-string metadata is skipped. */
    write_raw_st(p, "{\"__metadata__\":{\"x\":\"y\",\"n\":3},"
                    "\"a\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]},"
                    "\"b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}   ", 1);
    struct st_model m;
    assert_int_equal(st_open(p, &m), 0);
    assert_int_equal(m.n_tensors, 2);
    assert_string_equal(st_metadata(&m, "x"), "y");
    assert_null(st_metadata(&m, "n"));
    st_close(&m);
    rm_tree(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dtypes),
        cmocka_unit_test(test_roundtrip_single),
        cmocka_unit_test(test_add_save),
        cmocka_unit_test(test_writer_misuse),
        cmocka_unit_test(test_many_tensors),
        cmocka_unit_test(test_sharded_folder),
        cmocka_unit_test(test_unindexed_folder),
        cmocka_unit_test(test_golden_small6),
        cmocka_unit_test(test_golden_tp8pp2),
        cmocka_unit_test(test_golden_sidecars),
        cmocka_unit_test_setup_teardown(test_damage_none, damage_setup, damage_teardown),
        cmocka_unit_test_setup_teardown(test_damage_truncated, damage_setup, damage_teardown),
        cmocka_unit_test_setup_teardown(test_damage_header_length, damage_setup, damage_teardown),
        cmocka_unit_test_setup_teardown(test_damage_dtype_size, damage_setup, damage_teardown),
        cmocka_unit_test_setup_teardown(test_damage_dtype_unknown, damage_setup, damage_teardown),
        cmocka_unit_test_setup_teardown(test_damage_shape, damage_setup, damage_teardown),
        cmocka_unit_test_setup_teardown(test_damage_overlap, damage_setup, damage_teardown),
        cmocka_unit_test_setup_teardown(test_damage_index_missing_tensor, damage_setup, damage_teardown),
        cmocka_unit_test_setup_teardown(test_damage_index_extra_tensor, damage_setup, damage_teardown),
        cmocka_unit_test_setup_teardown(test_damage_index_missing_shard, damage_setup, damage_teardown),
        cmocka_unit_test_setup_teardown(test_damage_index_malformed, damage_setup, damage_teardown),
        cmocka_unit_test(test_bad_headers),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
