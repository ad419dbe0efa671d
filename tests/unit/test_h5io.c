/* Unit tests of src/h5io.c, src/h5zstd.c and src/h5inspect.c: prompt files (round trip through
 * the writer and the MPI-IO reader, every kind of bad input named by its dataset), output files
 * (append, finish, refusal to overwrite, resume and its fingerprint refusal, score files), the zstd
 * filter, and durability under SIGKILL: a forked child appends requests and kills itself, and the
 * parent must find exactly the appended ones on resume; a second test kills the writer at random
 * moments, in the middle of appends, and checks that resume keeps only whole, correct requests.
 * MPI is initialised once (singleton) so the prompt reader uses the MPI-IO driver as in a job;
 * the children never call MPI. Files live in a fresh folder under $TMPDIR. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <cJSON.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <mpi.h>

#include "h5io.h"
#include "log.h"

static char g_dir[512];

static const char *tmp_path(const char *name) {
    static char buf[4][1024];
    static int slot;
    char *p = buf[slot++ & 3];
    snprintf(p, sizeof buf[0], "%s/%s", g_dir, name);
    return p;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ------------------------------------------------------------------------------------------------
 * A deterministic prompt set */

struct pset {
    struct h5_prompts_in in;
    int32_t *tokens;
    int64_t *offsets, *max_new, *seed, *int_ids;
    float *temp, *top_p;
    int32_t *top_k;
    char **ids, **texts;
};

static int64_t plen(int64_t i) { return 1 + (i * 7) % 13; }
static int32_t ptok(int64_t i, int64_t k) { return (int32_t)((i * 31 + k * 17) % 500); }

/* n prompts; every optional field when `full` (with some "job default" entries), string ids when
 * full, integer ids otherwise. */
static struct pset make_pset(int64_t n, bool full) {
    struct pset s = {0};
    s.offsets = calloc((size_t)n + 1, 8);
    for (int64_t i = 0; i < n; i++) s.offsets[i + 1] = s.offsets[i] + plen(i);
    s.tokens = calloc((size_t)s.offsets[n] + 1, 4);
    for (int64_t i = 0; i < n; i++)
        for (int64_t k = 0; k < plen(i); k++) s.tokens[s.offsets[i] + k] = ptok(i, k);
    s.in = (struct h5_prompts_in){.n = n, .tokens = s.tokens, .offsets = s.offsets};
    if (full) {
        s.max_new = calloc((size_t)n + 1, 8);
        s.seed = calloc((size_t)n + 1, 8);
        s.temp = calloc((size_t)n + 1, 4);
        s.top_p = calloc((size_t)n + 1, 4);
        s.top_k = calloc((size_t)n + 1, 4);
        s.ids = calloc((size_t)n + 1, sizeof(char *));
        s.texts = calloc((size_t)n + 1, sizeof(char *));
        for (int64_t i = 0; i < n; i++) {
            s.max_new[i] = i % 4 == 0 ? -1 : 10 + i;
            s.seed[i] = i % 5 == 0 ? -1 : 1000 + i;
            s.temp[i] = i % 3 == 0 ? NAN : 0.5f + (float)i / 100;
            s.top_p[i] = i % 2 == 0 ? NAN : 0.9f;
            s.top_k[i] = i % 6 == 0 ? -1 : (int32_t)i;
            char b[64];
            snprintf(b, sizeof b, "prompt-%lld", (long long)i);
            s.ids[i] = strdup(b);
            snprintf(b, sizeof b, "text %lld \xc3\xa9", (long long)i); /* UTF-8 survives */
            s.texts[i] = strdup(i == 3 ? "" : b);
        }
        s.in.max_new_tokens = s.max_new;
        s.in.seed = s.seed;
        s.in.temperature = s.temp;
        s.in.top_p = s.top_p;
        s.in.top_k = s.top_k;
        s.in.ids = (const char *const *)s.ids;
        s.in.texts = (const char *const *)s.texts;
    } else {
        s.int_ids = calloc((size_t)n + 1, 8);
        for (int64_t i = 0; i < n; i++) s.int_ids[i] = 100 * i + 7;
        s.in.int_ids = s.int_ids;
    }
    return s;
}

static void free_pset(struct pset *s) {
    for (int64_t i = 0; s->ids && i < s->in.n; i++) {
        free(s->ids[i]);
        free(s->texts[i]);
    }
    free(s->ids);
    free(s->texts);
    free(s->tokens);
    free(s->offsets);
    free(s->max_new);
    free(s->seed);
    free(s->int_ids);
    free(s->temp);
    free(s->top_p);
    free(s->top_k);
}

static const struct h5_prompt_limits g_lim = {
    .vocab = 500, .max_len = 0, .default_max_new = 16, .default_sp = {.temperature = 0, .top_k = 0, .top_p = 1, .seed = 42},
    .want_text = true};

/* Check one read prompt against the set it came from. */
static void check_prompt(const struct pset *s, const struct h5_prompt_batch *b, int64_t j) {
    int64_t i = b->index[j];
    assert_int_equal(b->offsets[j + 1] - b->offsets[j], plen(i));
    for (int64_t k = 0; k < plen(i); k++) assert_int_equal(b->tokens[b->offsets[j] + k], ptok(i, k));
    if (s->max_new) {
        assert_int_equal(b->max_new[j], s->max_new[i] < 0 ? 16 : s->max_new[i]);
        assert_int_equal(b->sp[j].seed, s->seed[i] < 0 ? 42 : (uint64_t)s->seed[i]);
        if (isnan(s->temp[i])) assert_true(b->sp[j].temperature == 0);
        else assert_true(b->sp[j].temperature == s->temp[i]);
        assert_true(b->sp[j].top_p == (isnan(s->top_p[i]) ? 1.0f : s->top_p[i]));
        assert_int_equal(b->sp[j].top_k, s->top_k[i] < 0 ? 0 : s->top_k[i]);
        assert_string_equal(b->id[j], s->ids[i]);
        assert_non_null(b->text);
        assert_string_equal(b->text[j], s->texts[i]);
        assert_int_equal(b->id_kind, 2);
    } else {
        assert_int_equal(b->max_new[j], 16);
        assert_int_equal(b->sp[j].seed, 42);
        assert_int_equal(b->id_kind, 1);
        assert_int_equal(b->int_id[j], 100 * i + 7);
        char e[32];
        snprintf(e, sizeof e, "%lld", (long long)(100 * i + 7));
        assert_string_equal(b->id[j], e);
        assert_null(b->text);
    }
}

static void test_prompts_round_trip(void **state) {
    (void)state;
    for (int full = 0; full < 2; full++) {
        struct pset s = make_pset(37, full);
        const char *path = tmp_path(full ? "full.h5" : "plain.h5");
        assert_int_equal(h5_prompts_write(path, &s.in), 0);
        struct stat sb;
        char tmp[1100];
        snprintf(tmp, sizeof tmp, "%s.tmp", path);
        assert_int_not_equal(stat(tmp, &sb), 0); /* renamed away */
        struct h5_prompts p;
        assert_int_equal(h5_prompts_open(&p, path, MPI_COMM_WORLD), 0);
        assert_int_equal(p.n_prompts, 37);
        assert_int_equal(p.n_tokens, s.offsets[37]);
        /* The whole file, then three replicas over a window: disjoint, covering, i % 3 == r. */
        struct h5_prompt_batch b;
        assert_int_equal(h5_prompts_read(&p, 0, 37, 0, 1, &g_lim, &b), 0);
        assert_int_equal(b.n, 37);
        for (int64_t j = 0; j < b.n; j++) {
            assert_int_equal(b.index[j], j);
            check_prompt(&s, &b, j);
        }
        h5_prompt_batch_free(&b);
        int seen[37] = {0};
        for (int r = 0; r < 3; r++) {
            assert_int_equal(h5_prompts_read(&p, 5, 20, r, 3, &g_lim, &b), 0);
            for (int64_t j = 0; j < b.n; j++) {
                assert_int_equal(b.index[j] % 3, r);
                seen[b.index[j]]++;
                check_prompt(&s, &b, j);
            }
            h5_prompt_batch_free(&b);
        }
        for (int i = 0; i < 37; i++) assert_int_equal(seen[i], i >= 5 && i < 25 ? 1 : 0);
        /* An empty share still takes part and returns nothing. */
        assert_int_equal(h5_prompts_read(&p, 36, 1, 1, 2, &g_lim, &b), 0);
        assert_int_equal(b.n, 0);
        h5_prompt_batch_free(&b);
        h5_prompts_close(&p);
        free_pset(&s);
    }
}

/* Files written by other tools (h5py): unsigned seeds above 2^63, int64 tokens, no ids. */
static void test_prompts_foreign_types(void **state) {
    (void)state;
    const char *path = tmp_path("foreign.h5");
    hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    hid_t g = H5Gcreate2(f, "prompts", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    int64_t ver = 1;
    hid_t sp = H5Screate(H5S_SCALAR);
    hid_t a = H5Acreate2(g, "format_version", H5T_STD_I64LE, sp, H5P_DEFAULT, H5P_DEFAULT);
    H5Awrite(a, H5T_NATIVE_INT64, &ver);
    H5Aclose(a);
    H5Sclose(sp);
    int64_t tok[5] = {1, 2, 3, 4, 5}, off[3] = {0, 2, 5};
    uint64_t seed[2] = {UINT64_C(9223372036854775813), 7};
    hsize_t d5 = 5, d3 = 3, d2 = 2;
    struct {
        const char *name;
        hid_t type;
        hsize_t *dims;
        void *data;
    } ds[] = {{"tokens", H5T_STD_I64LE, &d5, tok}, {"offsets", H5T_STD_I64LE, &d3, off}, {"seed", H5T_STD_U64LE, &d2, seed}};
    for (int i = 0; i < 3; i++) {
        hid_t s = H5Screate_simple(1, ds[i].dims, NULL);
        hid_t d = H5Dcreate2(g, ds[i].name, ds[i].type, s, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
        assert_true(H5Dwrite(d, ds[i].type == H5T_STD_U64LE ? H5T_NATIVE_UINT64 : H5T_NATIVE_INT64, H5S_ALL, H5S_ALL,
                             H5P_DEFAULT, ds[i].data) >= 0);
        H5Dclose(d);
        H5Sclose(s);
    }
    H5Gclose(g);
    H5Fclose(f);
    struct h5_prompts p;
    assert_int_equal(h5_prompts_open(&p, path, MPI_COMM_SELF), 0);
    struct h5_prompt_batch b;
    assert_int_equal(h5_prompts_read(&p, 0, 2, 0, 1, &g_lim, &b), 0);
    assert_true(b.sp[0].seed == UINT64_C(9223372036854775813));
    assert_true(b.sp[1].seed == 7);
    assert_int_equal(b.tokens[4], 5);
    assert_string_equal(b.id[1], "1");
    assert_int_equal(b.id_kind, 0);
    h5_prompt_batch_free(&b);
    h5_prompts_close(&p);
}

/* ------------------------------------------------------------------------------------------------
 * Bad prompt files: one error naming the file and the dataset */

enum mutation {
    M_DROP_TOKENS, M_DROP_OFFSETS, M_DROP_VERSION, M_VERSION_2, M_OFFSETS_DECREASE, M_OFFSETS_START,
    M_OFFSETS_END, M_EMPTY_PROMPT, M_TOKEN_VOCAB, M_TOKEN_NEGATIVE, M_TEMP_SHORT, M_ID_OFFSETS_SHORT,
    M_ID_CHARS_MISSING, M_FLOAT_TOKENS, M_OFFSETS_2D, M_BAD_TEMPERATURE, M_BAD_TOP_P, M_NO_GROUP, M_ID_OFFSETS_END,
};

static void set_elem(hid_t f, const char *name, int64_t at, hid_t mtype, const void *v) {
    hid_t d = H5Dopen2(f, name, H5P_DEFAULT);
    hid_t fs = H5Dget_space(d);
    hsize_t st = (hsize_t)at, one = 1;
    H5Sselect_hyperslab(fs, H5S_SELECT_SET, &st, NULL, &one, NULL);
    hid_t ms = H5Screate_simple(1, &one, NULL);
    assert_true(H5Dwrite(d, mtype, ms, fs, H5P_DEFAULT, v) >= 0);
    H5Sclose(ms);
    H5Sclose(fs);
    H5Dclose(d);
}

static void replace(hid_t f, const char *name, hid_t type, int rank, const hsize_t *dims) {
    H5Ldelete(f, name, H5P_DEFAULT);
    hid_t s = H5Screate_simple(rank, dims, NULL);
    hid_t d = H5Dcreate2(f, name, type, s, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    assert_true(d >= 0);
    H5Dclose(d);
    H5Sclose(s);
}

static void mutate(const char *path, enum mutation m) {
    hid_t f = H5Fopen(path, H5F_ACC_RDWR, H5P_DEFAULT);
    assert_true(f >= 0);
    int64_t v;
    int32_t t;
    float x;
    hsize_t dims[2] = {10, 2};
    switch (m) {
    case M_DROP_TOKENS: H5Ldelete(f, "/prompts/tokens", H5P_DEFAULT); break;
    case M_DROP_OFFSETS: H5Ldelete(f, "/prompts/offsets", H5P_DEFAULT); break;
    case M_DROP_VERSION:
    case M_VERSION_2: break; /* below: attributes live on the group */
    case M_OFFSETS_DECREASE: v = 2, set_elem(f, "/prompts/offsets", 3, H5T_NATIVE_INT64, &v); break;
    case M_OFFSETS_START: v = 1, set_elem(f, "/prompts/offsets", 0, H5T_NATIVE_INT64, &v); break;
    case M_OFFSETS_END: v = plen(0) + plen(1) + plen(2) + plen(3) + plen(4) + plen(5) + plen(6) + plen(7) + plen(8) + plen(9) - 1;
        set_elem(f, "/prompts/offsets", 10, H5T_NATIVE_INT64, &v); break;
    case M_EMPTY_PROMPT: v = plen(0), set_elem(f, "/prompts/offsets", 2, H5T_NATIVE_INT64, &v); break;
    case M_TOKEN_VOCAB: t = 500, set_elem(f, "/prompts/tokens", 9, H5T_NATIVE_INT32, &t); break;
    case M_TOKEN_NEGATIVE: t = -3, set_elem(f, "/prompts/tokens", 2, H5T_NATIVE_INT32, &t); break;
    case M_TEMP_SHORT: dims[0] = 9, replace(f, "/prompts/temperature", H5T_IEEE_F32LE, 1, dims); break;
    case M_ID_OFFSETS_SHORT: dims[0] = 10, replace(f, "/prompts/id_offsets", H5T_STD_I64LE, 1, dims); break;
    case M_ID_CHARS_MISSING: H5Ldelete(f, "/prompts/id_chars", H5P_DEFAULT); break;
    case M_FLOAT_TOKENS: dims[0] = 62, replace(f, "/prompts/tokens", H5T_IEEE_F32LE, 1, dims); break;
    case M_OFFSETS_2D: dims[0] = 11, replace(f, "/prompts/offsets", H5T_STD_I64LE, 2, dims); break;
    case M_BAD_TEMPERATURE: x = -1, set_elem(f, "/prompts/temperature", 4, H5T_NATIVE_FLOAT, &x); break;
    case M_BAD_TOP_P: x = 0, set_elem(f, "/prompts/top_p", 5, H5T_NATIVE_FLOAT, &x); break;
    case M_NO_GROUP: H5Lmove(f, "/prompts", f, "/other", H5P_DEFAULT, H5P_DEFAULT); break;
    case M_ID_OFFSETS_END: v = 1000, set_elem(f, "/prompts/id_offsets", 10, H5T_NATIVE_INT64, &v); break;
    }
    if (m == M_VERSION_2 || m == M_DROP_VERSION) {
        hid_t g = H5Gopen2(f, "/prompts", H5P_DEFAULT);
        H5Adelete(g, "format_version");
        if (m == M_VERSION_2) {
            int32_t two = 2;
            hid_t s = H5Screate(H5S_SCALAR);
            hid_t a = H5Acreate2(g, "format_version", H5T_STD_I32LE, s, H5P_DEFAULT, H5P_DEFAULT);
            H5Awrite(a, H5T_NATIVE_INT32, &two);
            H5Aclose(a);
            H5Sclose(s);
        }
        H5Gclose(g);
    }
    H5Fclose(f);
}

/* Open + read with limits; expect failure with every fragment in the one error line. */
static void expect_bad(const char *path, int64_t max_len, const char *frag1, const char *frag2) {
    struct h5_prompts p;
    struct h5_prompt_limits lim = g_lim;
    lim.max_len = max_len;
    int rc = h5_prompts_open(&p, path, MPI_COMM_WORLD);
    if (rc == 0) {
        struct h5_prompt_batch b;
        rc = h5_prompts_read(&p, 0, p.n_prompts, 0, 1, &lim, &b);
        if (rc == 0) h5_prompt_batch_free(&b);
        h5_prompts_close(&p);
    }
    const char *e = ds_err_get();
    if (rc != -1 || !strstr(e, path) || !strstr(e, frag1) || (frag2 && !strstr(e, frag2)))
        fail_msg("expected an error with '%s' / '%s', got rc %d: %s", frag1, frag2 ? frag2 : "", rc, e);
    assert_null(strchr(e, '\n'));
}

static void test_prompts_bad_input(void **state) {
    (void)state;
    static const struct {
        enum mutation m;
        const char *frag1, *frag2;
    } cases[] = {
        {M_DROP_TOKENS, "/prompts/tokens", "missing dataset"},
        {M_DROP_OFFSETS, "/prompts/offsets", "missing dataset"},
        {M_DROP_VERSION, "/prompts", "format_version"},
        {M_VERSION_2, "format_version 2", "not supported"},
        {M_OFFSETS_DECREASE, "/prompts/offsets", "not monotonic"},
        {M_OFFSETS_START, "/prompts/offsets", "must be 0"},
        {M_OFFSETS_END, "/prompts/offsets", "does not match /prompts/tokens length"},
        {M_EMPTY_PROMPT, "/prompts/offsets", "prompt 1 is empty"},
        {M_TOKEN_VOCAB, "/prompts/tokens[9]", "is 500, outside the vocabulary [0, 500)"},
        {M_TOKEN_NEGATIVE, "/prompts/tokens[2]", "is -3, outside the vocabulary"},
        {M_TEMP_SHORT, "/prompts/temperature", "length 9, expected 10"},
        {M_ID_OFFSETS_SHORT, "/prompts/id_offsets", "length 10, expected 11"},
        {M_ID_CHARS_MISSING, "/prompts/id_chars", "missing dataset"},
        {M_FLOAT_TOKENS, "/prompts/tokens", "expected integer values"},
        {M_OFFSETS_2D, "/prompts/offsets", "1-D"},
        {M_BAD_TEMPERATURE, "/prompts/temperature", "prompt 4"},
        {M_BAD_TOP_P, "/prompts/top_p", "prompt 5"},
        {M_NO_GROUP, "/prompts", "missing group"},
        {M_ID_OFFSETS_END, "/prompts/id_offsets", "does not match /prompts/id_chars"},
    };
    struct pset s = make_pset(10, true);
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        char name[64];
        snprintf(name, sizeof name, "bad%zu.h5", c);
        const char *path = tmp_path(name);
        assert_int_equal(h5_prompts_write(path, &s.in), 0);
        mutate(path, cases[c].m);
        expect_bad(path, 0, cases[c].frag1, cases[c].frag2);
    }
    /* Too long for the model: prompt 1 has 8 tokens + max_new_tokens 11. */
    const char *path = tmp_path("long.h5");
    assert_int_equal(h5_prompts_write(path, &s.in), 0);
    expect_bad(path, 18, "/prompts/offsets", "prompt 1 has 8 tokens + max_new_tokens 11, above the maximum sequence length 18");
    /* Not a file, not HDF5, truncated. */
    expect_bad(tmp_path("missing.h5"), 0, "cannot open", "No such file");
    const char *txt = tmp_path("text.h5");
    FILE *f = fopen(txt, "w");
    fputs("{\"tokens\": [1, 2]}\n", f);
    fclose(f);
    expect_bad(txt, 0, "not an HDF5 file", NULL);
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    assert_int_equal(truncate(path, sb.st_size / 2), 0);
    expect_bad(path, 0, "cannot be opened as HDF5", NULL);
    /* Bad arguments. */
    const char *good = tmp_path("good.h5");
    assert_int_equal(h5_prompts_write(good, &s.in), 0);
    struct h5_prompts p;
    struct h5_prompt_batch b;
    assert_int_equal(h5_prompts_open(&p, good, MPI_COMM_WORLD), 0);
    assert_int_equal(h5_prompts_read(&p, 5, 6, 0, 1, &g_lim, &b), -1);
    assert_non_null(strstr(ds_err_get(), "the file has 10"));
    assert_int_equal(h5_prompts_read(&p, 0, 1, 2, 2, &g_lim, &b), -1);
    h5_prompts_close(&p);
    free_pset(&s);
}

/* ------------------------------------------------------------------------------------------------
 * zstd filter */

static void test_zstd_filter(void **state) {
    (void)state;
    const char *path = tmp_path("zstd.h5");
    h5zstd_register();
    hid_t f = H5Fcreate(path, H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    enum { N = 200000 };
    int32_t *v = malloc(sizeof *v * N), *r = malloc(sizeof *r * N);
    for (int i = 0; i < N; i++) v[i] = (int32_t)((i * 2654435761u) % 1000);
    hsize_t dims = N, chunk = 16384;
    hid_t s = H5Screate_simple(1, &dims, NULL), dcpl = H5Pcreate(H5P_DATASET_CREATE);
    H5Pset_chunk(dcpl, 1, &chunk);
    unsigned level = 3;
    assert_true(H5Pset_filter(dcpl, H5Z_FILTER_ZSTD_ID, H5Z_FLAG_MANDATORY, 1, &level) >= 0);
    hid_t d = H5Dcreate2(f, "v", H5T_STD_I32LE, s, H5P_DEFAULT, dcpl, H5P_DEFAULT);
    assert_true(H5Dwrite(d, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, v) >= 0);
    H5Dclose(d);
    H5Pclose(dcpl);
    H5Sclose(s);
    H5Fclose(f);
    f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    d = H5Dopen2(f, "v", H5P_DEFAULT);
    assert_true(H5Dread(d, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, r) >= 0);
    assert_memory_equal(v, r, sizeof *v * N);
    hsize_t stored = H5Dget_storage_size(d);
    assert_true(stored < sizeof *v * (hsize_t)N / 2); /* 1000 values: well under 16 bits each */
    dcpl = H5Dget_create_plist(d);
    unsigned flags, cd[4];
    size_t ncd = 4;
    char name[32];
    assert_true(H5Pget_filter_by_id2(dcpl, H5Z_FILTER_ZSTD_ID, &flags, &ncd, cd, sizeof name, name, NULL) >= 0);
    assert_int_equal(ncd, 1);
    assert_int_equal(cd[0], 3);
    assert_string_equal(name, "zstd");
    H5Pclose(dcpl);
    H5Dclose(d);
    H5Fclose(f);
    print_message("zstd level 3: %d int32 -> %llu bytes (%.2fx)\n", N, (unsigned long long)stored,
                  (double)(sizeof *v * N) / (double)stored);
    /* Level 0: no filter, and the file says so. */
    h5io_set_zstd_level(0);
    struct pset ps = make_pset(4, false);
    const char *plain = tmp_path("nozstd.h5");
    assert_int_equal(h5_prompts_write(plain, &ps.in), 0);
    h5io_set_zstd_level(3);
    f = H5Fopen(plain, H5F_ACC_RDONLY, H5P_DEFAULT);
    d = H5Dopen2(f, "/prompts/tokens", H5P_DEFAULT);
    dcpl = H5Dget_create_plist(d);
    assert_int_equal(H5Pget_nfilters(dcpl), 0);
    H5Pclose(dcpl);
    H5Dclose(d);
    H5Fclose(f);
    free_pset(&ps);
    free(v);
    free(r);
}

/* ------------------------------------------------------------------------------------------------
 * Output files */

#define FP "0123456789abcdef"
static const char *g_meta = "{\"job_spec\":{\"mode\":\"generate\",\"max_new_tokens\":8},\"git_commit\":\"abc123\"}";

/* The request a test records for prompt i. */
static int64_t olen(int64_t i) { return i % 7; }
static int32_t otok(int64_t i, int64_t k) { return (int32_t)((i * 13 + k) % 1000); }
static double olp(int64_t i, int64_t k) { return -(double)(k + 1) / (double)(i + 1); }

static int append_req(struct h5_out *o, int64_t i) {
    int32_t t[8];
    double lp[8];
    for (int64_t k = 0; k < olen(i); k++) t[k] = otok(i, k), lp[k] = olp(i, k);
    struct h5_request_trace tr = {.admit_s = 0.1 * (double)i, .first_token_s = 0.1 * (double)i + 0.05,
                                  .last_token_s = 0.1 * (double)i + 0.05 + 0.01 * (double)(olen(i) - 1),
                                  .prompt_tokens = 3 + i, .generated_tokens = olen(i)};
    return h5_out_append(o, i, t, lp, olen(i), (int)(i % 3), &tr);
}

static void *read_ds(hid_t f, const char *name, hid_t mtype, size_t esize, int64_t *n) {
    hid_t d = H5Dopen2(f, name, H5P_DEFAULT);
    assert_true(d >= 0);
    hid_t s = H5Dget_space(d);
    hssize_t np = H5Sget_simple_extent_npoints(s);
    void *buf = calloc((size_t)np + 1, esize);
    if (np > 0) assert_true(H5Dread(d, mtype, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf) >= 0);
    H5Sclose(s);
    H5Dclose(d);
    *n = np;
    return buf;
}

static int64_t root_attr(hid_t f, const char *name) {
    int64_t v = -1;
    hid_t a = H5Aopen(f, name, H5P_DEFAULT);
    H5Aread(a, H5T_NATIVE_INT64, &v);
    H5Aclose(a);
    return v;
}

/* Check a generate output: `expect` rows, each exactly the request append_req wrote; returns the
 * prompts found (bitmask for up to 64 prompts). */
static uint64_t verify_output(const char *path, int64_t expect, int64_t complete) {
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    assert_true(f >= 0);
    int64_t n, noff, ntok, nlp, nfin, nreq;
    int64_t *idx = read_ds(f, "/outputs/prompt_index", H5T_NATIVE_INT64, 8, &n);
    int64_t *off = read_ds(f, "/outputs/offsets", H5T_NATIVE_INT64, 8, &noff);
    int32_t *tok = read_ds(f, "/outputs/tokens", H5T_NATIVE_INT32, 4, &ntok);
    double *lp = read_ds(f, "/outputs/logprobs", H5T_NATIVE_DOUBLE, 8, &nlp);
    int8_t *fin = read_ds(f, "/outputs/finish_reason", H5T_NATIVE_INT8, 1, &nfin);
    assert_int_equal(n, expect);
    assert_int_equal(noff, n + 1);
    assert_int_equal(nfin, n);
    assert_int_equal(off[0], 0);
    assert_int_equal(off[n], ntok);
    assert_int_equal(nlp, ntok);
    uint64_t seen = 0;
    for (int64_t r = 0; r < n; r++) {
        int64_t i = idx[r];
        assert_false(seen >> i & 1);
        seen |= UINT64_C(1) << i;
        assert_int_equal(off[r + 1] - off[r], olen(i));
        assert_int_equal(fin[r], i % 3);
        for (int64_t k = 0; k < olen(i); k++) {
            assert_int_equal(tok[off[r] + k], otok(i, k));
            assert_true(lp[off[r] + k] == olp(i, k));
        }
    }
    hid_t d = H5Dopen2(f, "/trace/requests", H5P_DEFAULT);
    hid_t s = H5Dget_space(d);
    nreq = H5Sget_simple_extent_npoints(s);
    assert_int_equal(nreq, n);
    H5Sclose(s);
    H5Dclose(d);
    assert_int_equal(root_attr(f, "complete"), complete);
    H5Fclose(f);
    free(idx);
    free(off);
    free(tok);
    free(lp);
    free(fin);
    return seen;
}

static void test_out_round_trip(void **state) {
    (void)state;
    const char *path = tmp_path("out.h5");
    struct h5_out o;
    char *meta = h5_meta_json(&(struct h5_meta){.job_spec_json = "{\"mode\":\"generate\",\"prompts\":\"p.h5\"}",
                                                .model_config_json = "{\"vocab_size\":512}", .rank_table = "rank 0",
                                                .git_commit = "abc123", .hosts = "vm"});
    assert_int_equal(h5_out_create(&o, path, meta, FP, 10, true), 0);
    free(meta);
    for (int64_t i = 9; i >= 0; i--) assert_int_equal(append_req(&o, i), 0);
    struct h5_step_trace ev[3] = {{.rank = 0, .step = 0, .seqs = 4, .rows = 40, .start_s = 0, .end_s = 0.1, .compute_s = 0.08},
                                  {.rank = 1, .stage = 1, .step = 0, .seqs = 4, .rows = 40, .start_s = 0.1, .end_s = 0.2},
                                  {.rank = 0, .step = 1, .seqs = 4, .rows = 4, .start_s = 0.2, .end_s = 0.25}};
    assert_int_equal(h5_out_write_steps(&o, ev, 3), 0);
    assert_int_equal(h5_out_finish(&o), 0);
    assert_int_equal(verify_output(path, 10, 1), 0x3ff);
    /* /meta and the trace tables as h5py would see them. */
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    hid_t d = H5Dopen2(f, "/meta/json", H5P_DEFAULT);
    hid_t t = H5Tcopy(H5T_C_S1);
    H5Tset_size(t, H5T_VARIABLE);
    H5Tset_cset(t, H5T_CSET_UTF8);
    char *js = NULL;
    assert_true(H5Dread(d, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, &js) >= 0);
    cJSON *j = cJSON_Parse(js);
    assert_non_null(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "job_spec"), "prompts"));
    assert_non_null(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "versions"), "hdf5"));
    assert_non_null(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "versions"), "zstd"));
    assert_non_null(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "versions"), "mpi"));
    cJSON_Delete(j);
    H5free_memory(js);
    H5Tclose(t);
    H5Dclose(d);
    assert_true(H5Aexists_by_name(f, "/meta", "git_commit", H5P_DEFAULT) > 0);
    assert_true(H5Aexists_by_name(f, "/meta", "end_unix", H5P_DEFAULT) > 0);
    int64_t ns;
    hid_t sd = H5Dopen2(f, "/trace/steps", H5P_DEFAULT), stype = H5Dget_type(sd);
    void *steps = read_ds(f, "/trace/steps", stype, 128, &ns);
    assert_int_equal(ns, 3);
    assert_int_equal(H5Tget_nmembers(stype), 13); /* with tp_comm_s */
    free(steps);
    H5Tclose(stype);
    H5Dclose(sd);
    H5Fclose(f);
    /* inspect */
    const char *txt = tmp_path("inspect.txt");
    FILE *out = fopen(txt, "w");
    if (h5_inspect(path, out)) fail_msg("inspect: %s", ds_err_get());
    fclose(out);
    char buf[8192] = "";
    out = fopen(txt, "r");
    size_t got = fread(buf, 1, sizeof buf - 1, out);
    buf[got] = 0;
    fclose(out);
    assert_non_null(strstr(buf, "complete 1"));
    assert_non_null(strstr(buf, "10 of 10 prompts recorded"));
    assert_non_null(strstr(buf, "\"prompts\":\"p.h5\""));
    assert_non_null(strstr(buf, "24 generated")); /* sum of i % 7 for i < 10 */
    assert_non_null(strstr(buf, "TTFT         p50 0.0500 s"));
    assert_non_null(strstr(buf, "ITL          p50 0.0100 s"));
    assert_non_null(strstr(buf, "3 step records"));
}

static void file_bytes(const char *path, char **data, long *len) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    *len = ftell(f);
    fseek(f, 0, SEEK_SET);
    *data = malloc((size_t)*len);
    assert_int_equal(fread(*data, 1, (size_t)*len, f), (size_t)*len);
    fclose(f);
}

static void test_out_resume(void **state) {
    (void)state;
    const char *path = tmp_path("resume.h5");
    unlink(path);
    struct h5_out o;
    uint8_t done[10];
    assert_int_equal(h5_out_open_resume(&o, path, FP, 10, done), 1); /* nothing yet */
    assert_int_equal(h5_out_create(&o, path, g_meta, FP, 10, true), 0);
    for (int64_t i = 0; i < 10; i += 2) assert_int_equal(append_req(&o, i), 0);
    assert_int_equal(h5_out_finish(&o), -1); /* 5 of 10: not complete */
    assert_non_null(strstr(ds_err_get(), "only 5 of 10 prompts recorded"));
    assert_int_equal(verify_output(path, 5, 0), 0x155);

    /* Another job's spec or prompt count: refused, file untouched. */
    char *before, *after;
    long lb, la;
    file_bytes(path, &before, &lb);
    assert_int_equal(h5_out_open_resume(&o, path, "fedcba9876543210", 10, done), -1);
    assert_non_null(strstr(ds_err_get(), "a different job spec or model"));
    assert_non_null(strstr(ds_err_get(), path));
    assert_int_equal(h5_out_open_resume(&o, path, FP, 11, done), -1);
    assert_non_null(strstr(ds_err_get(), "a prompt set of another size"));
    file_bytes(path, &after, &la);
    assert_int_equal(la, lb);
    assert_memory_equal(before, after, (size_t)lb);
    free(before);
    free(after);

    /* Resume: the even prompts are done; record the odd ones. */
    memset(done, 7, sizeof done);
    assert_int_equal(h5_out_open_resume(&o, path, FP, 10, done), 0);
    for (int i = 0; i < 10; i++) assert_int_equal(done[i], i % 2 == 0);
    assert_int_equal(o.n_done, 5);
    assert_int_equal(o.run, 1);
    assert_int_equal(append_req(&o, 4), -1); /* already recorded */
    assert_non_null(strstr(ds_err_get(), "prompt 4 is already recorded"));
    for (int64_t i = 1; i < 10; i += 2) assert_int_equal(append_req(&o, i), 0);
    assert_int_equal(h5_out_finish(&o), 0);
    assert_int_equal(verify_output(path, 10, 1), 0x3ff);
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    assert_int_equal(root_attr(f, "runs"), 2);
    hid_t a = H5Aopen_by_name(f, "/meta", "run_start_unix", H5P_DEFAULT, H5P_DEFAULT);
    hid_t s = H5Aget_space(a);
    assert_int_equal(H5Sget_simple_extent_npoints(s), 2);
    H5Sclose(s);
    H5Aclose(a);
    H5Fclose(f);

    /* A complete output: create refuses, resume finds everything done. */
    assert_int_equal(h5_out_create(&o, path, g_meta, FP, 10, true), -1);
    assert_non_null(strstr(ds_err_get(), "complete output"));
    assert_int_equal(h5_out_open_resume(&o, path, FP, 10, done), 0);
    for (int i = 0; i < 10; i++) assert_int_equal(done[i], 1);
    assert_int_equal(h5_out_finish(&o), 0);

    /* Not ours: a prompt file, a text file; an unwritable place. */
    struct pset ps = make_pset(3, false);
    const char *pf = tmp_path("notout.h5");
    assert_int_equal(h5_prompts_write(pf, &ps.in), 0);
    free_pset(&ps);
    assert_int_equal(h5_out_create(&o, pf, g_meta, FP, 3, false), -1);
    assert_non_null(strstr(ds_err_get(), "not a dsbatch output file"));
    assert_int_equal(h5_out_open_resume(&o, pf, FP, 3, done), -1);
    assert_non_null(strstr(ds_err_get(), "not a dsbatch output file"));
    const char *txt = tmp_path("notout.txt");
    FILE *tf = fopen(txt, "w");
    fputs("hello\n", tf);
    fclose(tf);
    assert_int_equal(h5_out_create(&o, txt, g_meta, FP, 3, false), -1);
    assert_non_null(strstr(ds_err_get(), "not an HDF5 file"));
    assert_int_equal(h5_out_create(&o, tmp_path("no/such/dir/out.h5"), g_meta, FP, 3, false), -1);
    assert_non_null(strstr(ds_err_get(), "cannot write: No such file or directory"));
    assert_int_equal(h5_out_create(&o, tmp_path("badmeta.h5"), "not json", FP, 3, false), -1);

    /* A partial output of a killed job may be replaced by a fresh run. */
    const char *part = tmp_path("partial.h5");
    assert_int_equal(h5_out_create(&o, part, g_meta, FP, 4, true), 0);
    assert_int_equal(append_req(&o, 1), 0);
    h5_out_close(&o);
    assert_int_equal(h5_out_create(&o, part, g_meta, FP, 4, true), 0);
    assert_int_equal(o.n_done, 0);
    /* Bad requests. */
    assert_int_equal(h5_out_append(&o, 4, NULL, NULL, 0, 0, NULL), -1);
    assert_int_equal(h5_out_append(&o, 0, NULL, NULL, 0, 3, NULL), -1);
    assert_int_equal(h5_out_append_score(&o, 0, NULL, 0, 0, NULL), -1);
    h5_out_close(&o);
}

/* The journal rebuilds a damaged file; steps survive; no journal, no resume; a busy file is left alone. */
static void test_out_rebuild(void **state) {
    (void)state;
    const char *path = tmp_path("rebuild.h5");
    char jpath[1100];
    snprintf(jpath, sizeof jpath, "%s.journal", path);
    struct h5_out o, o2;
    uint8_t done[10];
    assert_int_equal(h5_out_create(&o, path, g_meta, FP, 10, true), 0);
    for (int64_t i = 0; i < 5; i++) assert_int_equal(append_req(&o, i), 0);
    struct h5_step_trace ev[2] = {{.rank = 3, .step = 7}, {.rank = 4, .step = 8}};
    assert_int_equal(h5_out_write_steps(&o, ev, 2), 0);
    /* A second writer, or a fresh run over a live output, must not touch it. */
    assert_int_equal(h5_out_open_resume(&o2, path, FP, 10, done), -1);
    assert_non_null(strstr(ds_err_get(), "in use by a running job"));
    assert_int_equal(h5_out_create(&o2, path, g_meta, FP, 10, true), -1);
    assert_non_null(strstr(ds_err_get(), "in use by a running job"));
    h5_out_close(&o);
    /* Garbage over the second half of the file: the journal still has all five requests. */
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    FILE *f = fopen(path, "r+b");
    fseek(f, sb.st_size / 2, SEEK_SET);
    for (long k = sb.st_size / 2; k < sb.st_size; k++) fputc((int)(k * 131 % 251), f);
    fclose(f);
    assert_int_equal(h5_out_open_resume(&o, path, FP, 10, done), 0);
    assert_int_equal(o.n_done, 5);
    assert_int_equal(o.n_steps, 2);
    for (int i = 0; i < 10; i++) assert_int_equal(done[i], i < 5);
    for (int64_t i = 5; i < 10; i++) assert_int_equal(append_req(&o, i), 0);
    assert_int_equal(h5_out_finish(&o), 0);
    assert_int_equal(verify_output(path, 10, 1), 0x3ff);
    assert_int_not_equal(stat(jpath, &sb), 0); /* finish removed the journal */
    hid_t h = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    hid_t d = H5Dopen2(h, "/trace/steps", H5P_DEFAULT), sp = H5Dget_space(d);
    assert_int_equal(H5Sget_simple_extent_npoints(sp), 2);
    H5Sclose(sp);
    H5Dclose(d);
    H5Fclose(h);
    /* An unfinished output whose journal is gone cannot be trusted. */
    const char *lone = tmp_path("lone.h5");
    assert_int_equal(h5_out_create(&o, lone, g_meta, FP, 4, false), 0);
    assert_int_equal(append_req(&o, 2), 0);
    h5_out_close(&o);
    snprintf(jpath, sizeof jpath, "%s.journal", lone);
    assert_int_equal(unlink(jpath), 0);
    assert_int_equal(h5_out_open_resume(&o, lone, FP, 4, done), -1);
    assert_non_null(strstr(ds_err_get(), "without its journal"));
}

/* A journal written before the steps' tp_comm_s (record type 4, rows of 72 bytes) still resumes:
 * its step rows are read (tp_comm_s 0) and the request records after them are not lost. The old
 * record is spliced in after the header record of a fresh journal. */
static void test_out_journal_v1_steps(void **state) {
    (void)state;
    const char *path = tmp_path("v1steps.h5");
    char jpath[1100];
    snprintf(jpath, sizeof jpath, "%s.journal", path);
    struct h5_out o;
    uint8_t done[6];
    assert_int_equal(h5_out_create(&o, path, g_meta, FP, 6, true), 0);
    for (int64_t i = 0; i < 3; i++) assert_int_equal(append_req(&o, i), 0);
    h5_out_close(&o);
    FILE *f = fopen(jpath, "rb");
    assert_non_null(f);
    static uint8_t j[1 << 20];
    size_t n = fread(j, 1, sizeof j, f);
    fclose(f);
    uint64_t hlen;
    memcpy(&hlen, j + 8, 8);
    size_t head = 24 + (size_t)hlen; /* the header record */
    struct {
        int32_t run, rank, stage, tp, step, seqs, rows, pad;
        double start_s, end_s, compute_s, comm_s, wait_s;
    } v1[2] = {{.rank = 5, .step = 11, .seqs = 2, .compute_s = 0.25}, {.rank = 6, .step = 12, .seqs = 3, .wait_s = 0.5}};
    assert_int_equal(sizeof v1, 144);
    uint8_t rec[24 + sizeof v1];
    uint32_t type = 4, zero = 0;
    uint64_t len = sizeof v1, sum = 14695981039346656037ull;
    memcpy(rec, &type, 4), memcpy(rec + 4, &zero, 4), memcpy(rec + 8, &len, 8), memcpy(rec + 16, v1, sizeof v1);
    for (size_t i = 0; i < 16 + sizeof v1; i++) sum = (sum ^ rec[i]) * 1099511628211ull; /* FNV-1a */
    memcpy(rec + 16 + sizeof v1, &sum, 8);
    f = fopen(jpath, "wb");
    fwrite(j, 1, head, f), fwrite(rec, 1, sizeof rec, f), fwrite(j + head, 1, n - head, f);
    fclose(f);
    assert_int_equal(h5_out_open_resume(&o, path, FP, 6, done), 0);
    assert_int_equal(o.n_done, 3);
    assert_int_equal(o.n_steps, 2);
    for (int64_t i = 3; i < 6; i++) assert_int_equal(append_req(&o, i), 0);
    assert_int_equal(h5_out_finish(&o), 0);
    hid_t h = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT), d = H5Dopen2(h, "/trace/steps", H5P_DEFAULT);
    struct {
        int32_t step;
        double compute_s, wait_s, tp_comm_s;
    } got[2];
    hid_t t = H5Tcreate(H5T_COMPOUND, sizeof got[0]);
    H5Tinsert(t, "step", HOFFSET(__typeof__(got[0]), step), H5T_NATIVE_INT32);
    H5Tinsert(t, "compute_s", HOFFSET(__typeof__(got[0]), compute_s), H5T_NATIVE_DOUBLE);
    H5Tinsert(t, "wait_s", HOFFSET(__typeof__(got[0]), wait_s), H5T_NATIVE_DOUBLE);
    H5Tinsert(t, "tp_comm_s", HOFFSET(__typeof__(got[0]), tp_comm_s), H5T_NATIVE_DOUBLE);
    memset(got, 0xff, sizeof got);
    assert_true(H5Dread(d, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, got) >= 0);
    assert_int_equal(got[0].step, 11);
    assert_int_equal(got[1].step, 12);
    assert_true(got[0].compute_s == 0.25 && got[1].wait_s == 0.5);
    assert_true(got[0].tp_comm_s == 0.0 && got[1].tp_comm_s == 0.0);
    H5Tclose(t);
    H5Dclose(d);
    H5Fclose(h);
}

static void test_score_file(void **state) {
    (void)state;
    const char *path = tmp_path("score.h5");
    struct h5_out o;
    assert_int_equal(h5_out_create_score(&o, path, g_meta, FP, 3), 0);
    double lp[4] = {-1, -2, -3, -4};
    assert_int_equal(h5_out_append_score(&o, 2, lp, 4, 10, NULL), 0);
    assert_int_equal(h5_out_append_score(&o, 0, lp, 1, 1, NULL), 0);
    h5_out_close(&o);
    uint8_t done[3];
    assert_int_equal(h5_out_open_resume(&o, path, FP, 3, done), 0);
    assert_true(done[0] && !done[1] && done[2]);
    assert_int_equal(h5_out_append(&o, 1, NULL, NULL, 0, 0, NULL), -1); /* a score file */
    assert_int_equal(h5_out_append_score(&o, 1, lp, 2, 3, NULL), 0);
    assert_int_equal(h5_out_finish(&o), 0);
    hid_t f = H5Fopen(path, H5F_ACC_RDONLY, H5P_DEFAULT);
    int64_t n, nv, nn;
    double *v = read_ds(f, "/scores/logprobs", H5T_NATIVE_DOUBLE, 8, &nv);
    double *nll = read_ds(f, "/scores/nll", H5T_NATIVE_DOUBLE, 8, &nn);
    int64_t *cnt = read_ds(f, "/scores/n_tokens", H5T_NATIVE_INT64, 8, &n);
    assert_int_equal(nv, 7);
    assert_int_equal(n, 3);
    assert_true(nll[0] == 10 && nll[1] == 1 && nll[2] == 3);
    assert_true(cnt[0] == 4 && cnt[1] == 1 && cnt[2] == 2);
    assert_true(v[4] == -1 && v[6] == -2);
    H5Fclose(f);
    free(v);
    free(nll);
    free(cnt);
    FILE *out = fopen("/dev/null", "w");
    assert_int_equal(h5_inspect(path, out), 0);
    fclose(out);
}

/* ------------------------------------------------------------------------------------------------
 * SIGKILL */

/* Child: create (when asked) and append prompts order[0..k), then die without any cleanup. */
static void child_append_and_die(const char *path, bool create, const int64_t *order, int64_t k) {
    struct h5_out o;
    uint8_t done[64];
    if (create ? h5_out_create(&o, path, g_meta, FP, 64, true) : h5_out_open_resume(&o, path, FP, 64, done)) _exit(3);
    for (int64_t i = 0; i < k; i++)
        if (append_req(&o, order[i])) _exit(4);
    raise(SIGKILL);
    _exit(5);
}

static void test_sigkill_between_appends(void **state) {
    (void)state;
    const char *path = tmp_path("killed.h5");
    int64_t order[64];
    for (int i = 0; i < 64; i++) order[i] = (i * 37) % 64;
    /* Two killed runs (7 requests, then 9 more after a resume), then a clean one. */
    int64_t ks[2] = {7, 9}, total = 0;
    for (int run = 0; run < 2; run++) {
        fflush(NULL);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) child_append_and_die(path, run == 0, order + total, ks[run]);
        int st;
        assert_int_equal(waitpid(pid, &st, 0), pid);
        assert_true(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
        total += ks[run];
        struct h5_out o;
        uint8_t done[64];
        assert_int_equal(h5_out_open_resume(&o, path, FP, 64, done), 0);
        assert_int_equal(o.n_done, total);
        for (int i = 0; i < 64; i++) {
            bool want = false;
            for (int64_t j = 0; j < total; j++) want |= order[j] == i;
            assert_int_equal(done[i], want);
        }
        h5_out_close(&o);
        assert_int_equal(verify_output(path, total, 0) != 0, true);
    }
    struct h5_out o;
    uint8_t done[64];
    assert_int_equal(h5_out_open_resume(&o, path, FP, 64, done), 0);
    for (int i = 0; i < 64; i++)
        if (!done[i]) assert_int_equal(append_req(&o, i), 0);
    assert_int_equal(h5_out_finish(&o), 0);
    assert_true(verify_output(path, 64, 1) == UINT64_MAX);
}

/* A child that resumes PATH and appends the missing prompts in order; then it waits for its kill
 * (or exits, when not `wait`). It never returns. */
static pid_t writer_child(const char *path, bool wait) {
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid > 0) return pid;
    struct h5_out o;
    uint8_t done[64];
    if (h5_out_open_resume(&o, path, FP, 64, done)) _exit(3);
    for (int64_t i = o.n_done; i < 64; i++)
        if (append_req(&o, i)) _exit(4);
    h5_out_close(&o);
    if (wait) pause();
    _exit(0);
}

/* The writer is killed at arbitrary moments: inside appends (the HDF5 flush included) and inside
 * the rebuild that resume does. One file is resumed again and again; every resume must succeed
 * with a prefix of the prompts (the child appends them in order) that never shrinks. */
static void test_sigkill_anywhere(void **state) {
    (void)state;
    int iters = 3 + (getenv("H5IO_KILLS") ? atoi(getenv("H5IO_KILLS")) : 24), files = 0, stalls = 0;
    double span_us = 0;
    const char *path = tmp_path("anywhere.h5");
    int64_t prev = 64;
    srand(12345);
    for (int iter = 0; iter < iters; iter++) {
        struct h5_out o;
        uint8_t done[64];
        if (prev == 64) { /* start over */
            unlink(path);
            assert_int_equal(h5_out_create(&o, path, g_meta, FP, 64, true), 0);
            h5_out_close(&o);
            prev = 0;
            files++;
        }
        /* Kill at a uniform moment of one whole run (resume + 64 appends), timed as the fastest of
         * the first three runs, which go uninterrupted. */
        pid_t pid = writer_child(path, iter >= 3);
        double t0 = now_s();
        if (iter < 3) {
            int st;
            assert_int_equal(waitpid(pid, &st, 0), pid);
            double us = 1e6 * (now_s() - t0);
            span_us = iter == 0 || us < span_us ? us : span_us;
            assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        } else {
            usleep((useconds_t)(rand() % (int)(span_us + 1)));
            kill(pid, SIGKILL);
            int st;
            assert_int_equal(waitpid(pid, &st, 0), pid);
        }
        if (h5_out_open_resume(&o, path, FP, 64, done)) fail_msg("resume after kill %d: %s", iter, ds_err_get());
        int64_t n = o.n_done;
        h5_out_close(&o);
        uint64_t seen = verify_output(path, n, 0);
        assert_true(seen == (n == 64 ? UINT64_MAX : (UINT64_C(1) << n) - 1)); /* a prefix, in order */
        assert_true(n >= prev);
        stalls += n == prev;
        prev = n;
    }
    print_message("%d kills at random moments of a %.0f ms run, over %d files: every resume kept whole requests "
                  "only, never fewer (%d kills landed before a new request)\n",
                  iters - 3, span_us / 1e3, files, stalls);
}

static void test_append_cost(void **state) {
    (void)state;
    const char *path = tmp_path("cost.h5");
    struct h5_out o;
    enum { N = 1000, LEN = 64 };
    assert_int_equal(h5_out_create(&o, path, g_meta, FP, N, true), 0);
    int32_t t[LEN];
    double lp[LEN];
    for (int k = 0; k < LEN; k++) t[k] = k * 7, lp[k] = -0.5 * k;
    double t0 = now_s();
    for (int i = 0; i < N; i++) assert_int_equal(h5_out_append(&o, i, t, lp, LEN, 0, NULL), 0);
    double dt = now_s() - t0;
    assert_int_equal(h5_out_finish(&o), 0);
    struct stat sb;
    stat(path, &sb);
    print_message("%d appends of %d tokens + logprobs: %.3f ms per append (flush included), file %lld bytes\n", N, LEN,
                  1e3 * dt / N, (long long)sb.st_size);
    assert_true(dt / N < 0.05);
}

static void test_fingerprint_meta(void **state) {
    (void)state;
    char a[H5IO_FINGERPRINT_LEN], b[H5IO_FINGERPRINT_LEN], c[H5IO_FINGERPRINT_LEN];
    h5_job_fingerprint("{\"mode\":\"generate\"}{\"vocab\":512}", a);
    h5_job_fingerprint("{\"mode\":\"generate\"}{\"vocab\":512}", b);
    h5_job_fingerprint("{\"mode\":\"generate\"}{\"vocab\":513}", c);
    assert_string_equal(a, b);
    assert_string_not_equal(a, c);
    assert_int_equal(strlen(a), 16);
    char *m = h5_meta_json(&(struct h5_meta){.job_spec_json = "not json", .cuda_version = "13.0"});
    cJSON *j = cJSON_Parse(m);
    assert_string_equal(cJSON_GetObjectItem(j, "job_spec")->valuestring, "not json");
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "versions"), "cuda")->valuestring, "13.0");
    assert_non_null(cJSON_GetObjectItem(j, "start_time"));
    cJSON_Delete(j);
    free(m);
}

static int setup(void **state) {
    (void)state;
    setenv("OMPI_MCA_mpi_warn_on_fork", "0", 1);
    MPI_Init(NULL, NULL);
    const char *t = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/dsbatch_h5io.XXXXXX", t && t[0] ? t : "/tmp");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (!getenv("KEEP") && system(cmd) != 0) return -1;
    MPI_Finalize();
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prompts_round_trip),
        cmocka_unit_test(test_prompts_foreign_types),
        cmocka_unit_test(test_prompts_bad_input),
        cmocka_unit_test(test_zstd_filter),
        cmocka_unit_test(test_out_round_trip),
        cmocka_unit_test(test_out_resume),
        cmocka_unit_test(test_out_rebuild),
        cmocka_unit_test(test_out_journal_v1_steps),
        cmocka_unit_test(test_score_file),
        cmocka_unit_test(test_sigkill_between_appends),
        cmocka_unit_test(test_sigkill_anywhere),
        cmocka_unit_test(test_append_cost),
        cmocka_unit_test(test_fingerprint_meta),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
