/* Unit tests for src/tokenizer.c (issue #8).
 *
 * The golden tokenizer (../shared/golden/tokenizer) carries the HF `tokenizers` library's own
 * answers: every case of cases.jsonl must give the library's ids and decoded text, round-trip,
 * and the Engram map built here must equal the reference's engram_map.safetensors (4,339
 * classes). CI does not have the library, so the component tests below carry its answers as
 * literals: the examples of its documentation and test suite (Split behaviours on
 * "the-final--countdown", Digits on "Hey 123 friend!", GPT-2 ByteLevel splits), and cases where
 * Oniguruma (its regex engine) and PCRE2 or its StripAccents and a Mn-only filter differ; every
 * literal was checked against tokenizers 0.23.3 when it was written. Malformed files must fail
 * with one error naming the file and the component. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"
#include "safetensors.h"
#include "tokenizer.h"

static const char *golden(void) {
    const char *g = getenv("GOLDEN");
    return g ? g : "../shared/golden";
}

static struct tokenizer *golden_tok(void) {
    char p[600];
    snprintf(p, sizeof p, "%s/tokenizer/tokenizer.json", golden());
    struct tokenizer *t = tok_load(p);
    if (!t) fprintf(stderr, "%s\n", ds_err_get());
    assert_non_null(t);
    return t;
}

/* A tokenizer.json around the given pre_tokenizer / normalizer JSON (a tiny byte-level BPE). */
static struct tokenizer *synth(const char *pre, const char *norm, const char *extra_model, const char *added) {
    char json[8192];
    snprintf(json, sizeof json,
             "{\"version\":\"1.0\",\"added_tokens\":[%s],\"normalizer\":%s,\"pre_tokenizer\":%s,\"post_processor\":null,"
             "\"decoder\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,\"c\":2,\"ab\":3,"
             "\"bc\":4,\"abc\":5,\"aa\":6,\"<X>\":7,\"Ġ\":8%s},\"merges\":[]}}",
             added ? added : "", norm ? norm : "null", pre ? pre : "null", extra_model ? extra_model : "");
    struct tokenizer *t = tok_load_text(json, strlen(json), "synthetic.json");
    if (!t) fprintf(stderr, "%s\n", ds_err_get());
    return t;
}

static struct tokenizer *synth_merges(const char *merges) {
    char json[4096];
    snprintf(json, sizeof json,
             "{\"added_tokens\":[],\"normalizer\":null,\"pre_tokenizer\":null,\"decoder\":{\"type\":\"ByteLevel\"},"
             "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,\"c\":2,\"ab\":3,\"bc\":4,\"abc\":5,\"aa\":6},\"merges\":[%s]}}",
             merges);
    struct tokenizer *t = tok_load_text(json, strlen(json), "merges.json");
    assert_non_null(t);
    return t;
}

/* "p0|p1|..." -> compare with the pre-tokenizer's pieces of text */
static void check_pieces(struct tokenizer *t, const char *text, const char *want) {
    char **pc;
    size_t n;
    assert_int_equal(tok_pre_tokenize(t, text, strlen(text), &pc, &n), 0);
    char got[1024] = "";
    for (size_t i = 0; i < n; i++) {
        if (i) strcat(got, "|");
        strcat(got, pc[i]);
        free(pc[i]);
    }
    free(pc);
    if (strcmp(got, want)) fprintf(stderr, "pieces of '%s': got '%s', want '%s'\n", text, got, want);
    assert_string_equal(got, want);
}

/* ---------------------------------------------------------------------------------------------
 * Golden fixture */

static void test_golden_cases(void **state) {
    (void)state;
    struct tokenizer *t = golden_tok();
    char p[600];
    snprintf(p, sizeof p, "%s/tokenizer/cases.jsonl", golden());
    FILE *f = fopen(p, "r");
    assert_non_null(f);
    char *line = NULL;
    size_t cap = 0;
    int n = 0, bad_ids = 0, bad_dec = 0, bad_rt = 0;
    while (getline(&line, &cap, f) > 0) {
        cJSON *c = cJSON_Parse(line);
        assert_non_null(c);
        const char *text = cJSON_GetObjectItem(c, "text")->valuestring;
        const char *dec = cJSON_GetObjectItem(c, "decoded")->valuestring;
        const cJSON *ids = cJSON_GetObjectItem(c, "ids"), *v;
        struct tok_ids got = {0};
        assert_int_equal(tok_encode(t, text, strlen(text), &got), 0);
        size_t k = 0;
        bool same = got.n == (size_t)cJSON_GetArraySize(ids);
        cJSON_ArrayForEach(v, ids) same = same && k < got.n && got.ids[k++] == v->valueint;
        if (!same) {
            bad_ids++;
            fprintf(stderr, "case %d ids differ: %s\n  got:", n, text);
            for (k = 0; k < got.n; k++) fprintf(stderr, " %d", got.ids[k]);
            fprintf(stderr, "\n  want:");
            cJSON_ArrayForEach(v, ids) fprintf(stderr, " %d", v->valueint);
            fprintf(stderr, "\n");
        }
        /* decode the library's ids, and our own */
        int32_t *lib = malloc(sizeof(int32_t) * ((size_t)cJSON_GetArraySize(ids) + 1));
        k = 0;
        cJSON_ArrayForEach(v, ids) lib[k++] = v->valueint;
        char *d = tok_decode(t, lib, k, false, NULL);
        if (strcmp(d, dec)) bad_dec++, fprintf(stderr, "case %d decoded differs:\n  got  %s\n  want %s\n", n, d, dec);
        free(d);
        d = tok_decode(t, got.ids, got.n, false, NULL);
        if (strcmp(d, text)) bad_rt++, fprintf(stderr, "case %d round trip differs:\n  got  %s\n  want %s\n", n, d, text);
        free(d);
        free(lib);
        tok_ids_free(&got);
        cJSON_Delete(c);
        n++;
    }
    free(line);
    fclose(f);
    fprintf(stderr, "%d cases: %d ids, %d decoded, %d round-trip mismatches\n", n, bad_ids, bad_dec, bad_rt);
    assert_int_equal(n, 71);
    assert_int_equal(bad_ids, 0);
    assert_int_equal(bad_dec, 0);
    assert_int_equal(bad_rt, 0);
    tok_free(t);
}

static void test_golden_engram_map(void **state) {
    (void)state;
    struct tokenizer *t = golden_tok();
    char p[600];
    snprintf(p, sizeof p, "%s/tokenizer/engram_map.safetensors", golden());
    struct st_model m;
    assert_int_equal(st_open(p, &m), 0);
    const struct st_tensor *tm = st_find(&m, "token_map");
    assert_non_null(tm);
    assert_int_equal(tm->dtype, ST_I32);
    int32_t n, classes;
    int32_t *map = tok_engram_map(t, 0, -1, &n, &classes);
    assert_non_null(map);
    assert_int_equal(n, tm->shape[0]);
    assert_int_equal(classes, 4339);
    assert_int_equal(classes, atoi(st_metadata(&m, "n_classes")));
    const int32_t *want = tm->data;
    int diff = 0;
    for (int32_t i = 0; i < n; i++)
        if (map[i] != want[i] && diff++ < 10) {
            char *key = tok_engram_key(t, i, NULL);
            fprintf(stderr, "token %d (%s): class %d, reference %d (key '%s')\n", i, tok_id_to_token(t, i), map[i], want[i], key);
            free(key);
        }
    assert_int_equal(diff, 0);
    free(map);
    st_close(&m);
    tok_free(t);
}

/* ---------------------------------------------------------------------------------------------
 * Malformed files: one clear error each, naming the file and the component */

static void expect_load_error(const char *json, const char *want1, const char *want2) {
    char dir[] = "/tmp/tok_bad_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[256];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    FILE *f = fopen(path, "w");
    fputs(json, f);
    fclose(f);
    struct tokenizer *t = tok_load(path);
    const char *e = ds_err_get();
    if (t || !strstr(e, path) || !strstr(e, want1) || (want2 && !strstr(e, want2)))
        fprintf(stderr, "error: '%s' (wanted %s, %s, %s)\n", e, path, want1, want2 ? want2 : "");
    assert_null(t);
    assert_non_null(strstr(e, path));
    assert_non_null(strstr(e, want1));
    if (want2) assert_non_null(strstr(e, want2));
    assert_null(strchr(e, '\n'));
    unlink(path);
    rmdir(dir);
}

static void test_bad_json(void **state) {
    (void)state;
    expect_load_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0,}", "not valid JSON", NULL);
}
static void test_unknown_model_type(void **state) {
    (void)state;
    expect_load_error("{\"model\": {\"type\": \"WordPiece\", \"vocab\": {\"a\": 0}}}", "model.type", "WordPiece");
}
static void test_merge_missing_token(void **state) {
    (void)state;
    expect_load_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [\"a b\", \"ab c\"]}}",
                      "model.merges[1]", "'c' is not in model.vocab");
    expect_load_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": [[\"a\", \"b\"]]}}",
                      "model.merges[0]", "'ab' is not in model.vocab");
}
static void test_unsupported_components(void **state) {
    (void)state;
    const char *model = "\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}";
    char j[1024];
    snprintf(j, sizeof j, "{\"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Whitespace\"}]}, %s}", model);
    expect_load_error(j, "pre_tokenizer.pretokenizers[0]", "'Whitespace' is not supported");
    snprintf(j, sizeof j, "{\"normalizer\": {\"type\": \"BertNormalizer\"}, %s}", model);
    expect_load_error(j, "normalizer", "'BertNormalizer' is not supported");
    snprintf(j, sizeof j, "{\"decoder\": {\"type\": \"WordPiece\"}, %s}", model);
    expect_load_error(j, "decoder", "'WordPiece' is not supported");
    snprintf(j, sizeof j, "{\"post_processor\": {\"type\": \"Mystery\"}, %s}", model);
    expect_load_error(j, "post_processor", "'Mystery' is not supported");
    snprintf(j, sizeof j, "{\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"(a\"}, \"behavior\": \"Isolated\"}, %s}", model);
    expect_load_error(j, "pre_tokenizer.pattern", "does not compile");
    snprintf(j, sizeof j, "{\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"a\"}, \"behavior\": \"Sideways\"}, %s}", model);
    expect_load_error(j, "pre_tokenizer.behavior", "Sideways");
    snprintf(j, sizeof j, "{\"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"ByteLevel\"}, {\"type\": \"Digits\"}]}, %s}", model);
    expect_load_error(j, "pre_tokenizer.pretokenizers[1]", "after ByteLevel");
    expect_load_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"continuing_subword_prefix\": \"##\"}}",
                      "model.continuing_subword_prefix", NULL);
    expect_load_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [\"a\"]}}", "model.merges[0]", "one space");
    expect_load_error("{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": -1}}}", "model.vocab['a']", NULL);
}

/* ---------------------------------------------------------------------------------------------
 * Components */

static void test_split_behaviors(void **state) {
    (void)state;
    static const char *beh[5][2] = {
        {"Removed", "the|final|countdown"},
        {"Isolated", "the|-|final|-|-|countdown"},
        {"MergedWithPrevious", "the-|final-|-|countdown"},
        {"MergedWithNext", "the|-final|-|-countdown"},
        {"Contiguous", "the|-|final|--|countdown"},
    };
    for (int k = 0; k < 5; k++) {
        char pre[256];
        snprintf(pre, sizeof pre, "{\"type\":\"Split\",\"pattern\":{\"String\":\"-\"},\"behavior\":\"%s\",\"invert\":false}", beh[k][0]);
        struct tokenizer *t = synth(pre, NULL, NULL, NULL);
        assert_non_null(t);
        check_pieces(t, "the-final--countdown", beh[k][1]);
        tok_free(t);
        snprintf(pre, sizeof pre, "{\"type\":\"Split\",\"pattern\":{\"Regex\":\"-\"},\"behavior\":\"%s\"}", beh[k][0]);
        t = synth(pre, NULL, NULL, NULL);
        check_pieces(t, "the-final--countdown", beh[k][1]);
        tok_free(t);
    }
    /* invert: the pattern's matches become the pieces and the gaps the delimiters (removed here) */
    struct tokenizer *t = synth("{\"type\":\"Split\",\"pattern\":{\"Regex\":\"\\\\w+\"},\"behavior\":\"Removed\",\"invert\":true}", NULL, NULL, NULL);
    check_pieces(t, "Hey friend! How", "Hey|friend|How");
    tok_free(t);
    t = synth("{\"type\":\"Split\",\"pattern\":{\"Regex\":\"\\\\w+\"},\"behavior\":\"MergedWithPrevious\",\"invert\":true}", NULL, NULL, NULL);
    check_pieces(t, "Hey friend! How", "Hey |friend! |How");
    tok_free(t);
    t = synth("{\"type\":\"Split\",\"pattern\":{\"String\":\" \"},\"behavior\":\"Removed\"}", NULL, NULL, NULL);
    check_pieces(t, "Hey friend!  How are you?", "Hey|friend!|How|are|you?");
    tok_free(t);
}

static void test_digits_and_sequence(void **state) {
    (void)state;
    struct tokenizer *t = synth("{\"type\":\"Digits\",\"individual_digits\":false}", NULL, NULL, NULL);
    check_pieces(t, "Hey 123 friend!", "Hey |123| friend!");
    tok_free(t);
    t = synth("{\"type\":\"Digits\",\"individual_digits\":true}", NULL, NULL, NULL);
    check_pieces(t, "Hey 123 friend!", "Hey |1|2|3| friend!");
    check_pieces(t, "x²½", "x|²|½"); /* is_numeric: No counts too */
    tok_free(t);
    t = synth("{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Digits\",\"individual_digits\":false},"
              "{\"type\":\"Split\",\"pattern\":{\"String\":\" \"},\"behavior\":\"MergedWithNext\"}]}", NULL, NULL, NULL);
    check_pieces(t, "ab 12 cd", "ab| |12| cd");
    tok_free(t);
}

static void test_bytelevel_pre(void **state) {
    (void)state;
    struct tokenizer *t = synth("{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":true}", NULL, NULL, NULL);
    check_pieces(t, "Hello my friend, how is your day going?", "Hello| my| friend|,| how| is| your| day| going|?");
    check_pieces(t, "Hello there\nHello there", "Hello| there|\n|Hello| there");
    check_pieces(t, "Hello there       dear", "Hello| there|      | dear");
    check_pieces(t, "it's i⭢j", "it|'s| i|⭢|j");
    tok_free(t);
    t = synth("{\"type\":\"ByteLevel\",\"add_prefix_space\":true,\"use_regex\":true}", NULL, NULL, NULL);
    check_pieces(t, "Hello my friend", " Hello| my| friend");
    check_pieces(t, " Hello", " Hello");
    tok_free(t);
    /* without its regex, every piece of the previous steps gets the prefix space */
    t = synth("{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{\"String\":\"-\"},\"behavior\":\"Removed\"},"
              "{\"type\":\"ByteLevel\",\"add_prefix_space\":true,\"use_regex\":false}]}", NULL, NULL, NULL);
    check_pieces(t, "ab-cd- e", " ab| cd| e");
    tok_free(t);
}

static void check_norm(const char *norm, const char *in, const char *want) {
    struct tokenizer *t = synth(NULL, norm, NULL, NULL);
    assert_non_null(t);
    char *got = tok_normalize_text(t, in, strlen(in), NULL);
    if (strcmp(got, want)) fprintf(stderr, "%s on '%s': got '%s', want '%s'\n", norm, in, got, want);
    assert_string_equal(got, want);
    free(got);
    tok_free(t);
}

static void test_normalizers(void **state) {
    (void)state;
    check_norm("{\"type\":\"NFKC\"}", "ﬁ ＡＢ ² ㍻", "fi AB 2 平成");
    check_norm("{\"type\":\"NFC\"}", "e\xCC\x81", "é");
    check_norm("{\"type\":\"NFD\"}", "é", "e\xCC\x81");
    check_norm("{\"type\":\"NFKD\"}", "ﬁé", "fie\xCC\x81");
    check_norm("{\"type\":\"Lowercase\"}", "HeLLo ΣΑΣ İ", "hello σασ i\xCC\x87");
    check_norm("{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"NFD\"},{\"type\":\"StripAccents\"}]}", "Café naïve Ångström", "Cafe naive Angstrom");
    /* every mark goes, spacing (Mc) and enclosing (Me) ones too, as the library's StripAccents does */
    check_norm("{\"type\":\"StripAccents\"}", "कि का a\xE2\x83\x9D" "b", "क क ab");
    check_norm("{\"type\":\"Strip\",\"strip_left\":true,\"strip_right\":true}", " \t\xE3\x80\x80 a b \n\xC2\xA0", "a b");
    check_norm("{\"type\":\"Strip\",\"strip_left\":false,\"strip_right\":true}", "  a  ", "  a");
    check_norm("{\"type\":\"Replace\",\"pattern\":{\"String\":\" \"},\"content\":\"▁\"}", "a b  c", "a▁b▁▁c");
    check_norm("{\"type\":\"Replace\",\"pattern\":{\"Regex\":\"[ \\\\t]+\"},\"content\":\" \"}", "a \t b\tc", "a b c");
    check_norm("{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"Prepend\",\"prepend\":\"▁\"},{\"type\":\"Replace\",\"pattern\":{\"String\":\" \"},\"content\":\"▁\"}]}",
               "hi there", "▁hi▁there");
}

/* Escapes where Oniguruma (the library's regex engine) and PCRE2 disagree; the answers are the
 * library's (tokenizers 0.23 pre_tokenize_str). */
static void test_oniguruma_escapes(void **state) {
    (void)state;
    struct tokenizer *t = synth("{\"type\":\"Split\",\"pattern\":{\"Regex\":\"\\\\s+\"},\"behavior\":\"Isolated\"}", NULL, NULL, NULL);
    check_pieces(t, "a\xE1\xA0\x8E" "b", "a\xE1\xA0\x8E" "b");       /* U+180E is not \s there */
    check_pieces(t, "a\xC2\x85" "b\xE2\x80\xA8" "c", "a|\xC2\x85|b|\xE2\x80\xA8|c"); /* U+0085, U+2028 are */
    tok_free(t);
    t = synth("{\"type\":\"Split\",\"pattern\":{\"Regex\":\"\\\\w+\"},\"behavior\":\"Isolated\"}", NULL, NULL, NULL);
    check_pieces(t, "#²\xE3\x82\x99Ⅻ_#\xE2\x80\x8D#", "#|²\xE3\x82\x99Ⅻ_|#\xE2\x80\x8D#"); /* numbers, marks, Pc; not ZWJ */
    tok_free(t);
    t = synth("{\"type\":\"Split\",\"pattern\":{\"Regex\":\"\\\\h+|[^\\\\S\\\\n]+\"},\"behavior\":\"Removed\"}", NULL, NULL, NULL);
    check_pieces(t, "xy\tz 0fA\ng", "xy|z|\ng"); /* \h is a hex digit there */
    tok_free(t);
}

static void test_bpe_ranks(void **state) {
    (void)state;
    struct tok_ids v = {0};
    struct tokenizer *t = synth_merges("\"b c\", \"a b\", \"a bc\"");
    assert_int_equal(tok_encode(t, "abc", 3, &v), 0); /* bc (rank 0) first, then a+bc */
    assert_int_equal(v.n, 1);
    assert_int_equal(v.ids[0], 5);
    tok_free(t);
    v.n = 0;
    t = synth_merges("\"a b\", \"b c\"");
    assert_int_equal(tok_encode(t, "abc", 3, &v), 0); /* ab first; no ab+c merge */
    assert_int_equal(v.n, 2);
    assert_int_equal(v.ids[0], 3);
    assert_int_equal(v.ids[1], 2);
    v.n = 0;
    tok_free(t);
    t = synth_merges("[\"a\", \"a\"]");
    assert_int_equal(tok_encode(t, "aaa", 3, &v), 0); /* equal ranks: leftmost first */
    assert_int_equal(v.n, 2);
    assert_int_equal(v.ids[0], 6);
    assert_int_equal(v.ids[1], 0);
    v.n = 0;
    assert_int_equal(tok_encode(t, "aaxa", 4, &v), 0); /* x is not in the vocab and there is no unk: dropped */
    assert_int_equal(v.n, 2);
    tok_free(t);
    tok_ids_free(&v);
}

static void test_added_tokens(void **state) {
    (void)state;
    const char *added =
        "{\"id\":7,\"content\":\"<X>\",\"special\":true,\"normalized\":false,\"lstrip\":true,\"rstrip\":false,\"single_word\":false},"
        "{\"id\":9,\"content\":\"Hey\",\"special\":false,\"normalized\":true}";
    struct tokenizer *t = synth(NULL, "{\"type\":\"Lowercase\"}", NULL, added);
    assert_non_null(t);
    struct tok_ids v = {0};
    assert_int_equal(tok_encode(t, "a  <X>HEYb", 10, &v), 0); /* lstrip eats the spaces; HEY matches after lowercasing */
    assert_int_equal(v.n, 4);
    assert_int_equal(v.ids[0], 0);
    assert_int_equal(v.ids[1], 7);
    assert_int_equal(v.ids[2], 9);
    assert_int_equal(v.ids[3], 1);
    v.n = 0;
    assert_int_equal(tok_encode(t, "<x>", 3, &v), 0); /* not normalized: "<x>" is plain text */
    assert_true(v.n != 1 || v.ids[0] != 7);
    assert_string_equal(tok_id_to_token(t, 9), "hey"); /* a normalized token is stored normalized, as the library does */
    char *d = tok_decode(t, (int32_t[]){0, 7, 9, 1}, 4, true, NULL);
    assert_string_equal(d, "aheyb"); /* special <X> skipped, non-special added token kept */
    free(d);
    d = tok_decode(t, (int32_t[]){0, 7, 9, 1, 99999, -3}, 6, false, NULL);
    assert_string_equal(d, "a<X>heyb");
    free(d);
    tok_ids_free(&v);
    tok_free(t);
}

static void test_decode_lossy(void **state) {
    (void)state;
    struct tokenizer *t = golden_tok();
    /* ids of the byte tokens: the ByteLevel symbol of each byte */
    const char *bytes_syms[3] = {"â", "Ĥ", "¬"}; /* 0xE2 0x82 0xAC = "€" */
    int32_t ids[3];
    for (int k = 0; k < 3; k++) assert_true((ids[k] = tok_token_to_id(t, bytes_syms[k])) >= 0);
    char *d = tok_decode(t, ids, 3, false, NULL);
    assert_string_equal(d, "€");
    free(d);
    d = tok_decode(t, ids, 2, false, NULL); /* a truncated sequence is one U+FFFD */
    assert_string_equal(d, "\xEF\xBF\xBD");
    free(d);
    d = tok_decode(t, ids + 1, 2, false, NULL); /* two lone continuation bytes: two U+FFFD */
    assert_string_equal(d, "\xEF\xBF\xBD\xEF\xBF\xBD");
    free(d);
    struct tok_ids v = {0};
    assert_int_equal(tok_encode(t, "bad \xC3(", 6, &v), -1); /* invalid UTF-8 input is an error */
    tok_ids_free(&v);
    tok_free(t);
}

static void test_engram_keys(void **state) {
    (void)state;
    struct tokenizer *t = golden_tok();
    static const char *cases[][2] = {
        {"ĠThe", "the"}, {"Caf", "caf"}, {"ĠĠ", " "}, {"Ċ", " "}, {"ĉ", " "}, {"Ġ", " "}, {"<｜User｜>", "<|user|>"}, {"<think>", "<think>"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        int32_t id = tok_token_to_id(t, cases[k][0]);
        if (id < 0) continue; /* not every spelling is in this vocabulary */
        char *key = tok_engram_key(t, id, NULL);
        if (strcmp(key, cases[k][1])) fprintf(stderr, "%s: key '%s', want '%s'\n", cases[k][0], key, cases[k][1]);
        assert_string_equal(key, cases[k][1]);
        free(key);
    }
    /* a lone byte of a multi-byte character decodes to U+FFFD: the raw token is the key */
    int32_t id = tok_token_to_id(t, "Ã");
    assert_true(id >= 0);
    char *key = tok_engram_key(t, id, NULL);
    assert_string_equal(key, "Ã");
    free(key);
    /* vocabulary rows past the tokenizer's ids: the pad's class (no class the reference would not
     * count), or, without a pad, the class of the empty text an unknown id decodes to */
    int32_t n, classes, *map = tok_engram_map(t, 6002, 2, &n, &classes);
    assert_int_equal(n, 6002);
    assert_int_equal(classes, 4339);
    assert_int_equal(map[6000], map[2]);
    assert_int_equal(map[6001], map[2]);
    free(map);
    map = tok_engram_map(t, 6002, -1, &n, &classes);
    assert_int_equal(map[6000], map[6001]);
    assert_int_equal(classes, 4340);
    free(map);
    tok_free(t);
}

/* ---------------------------------------------------------------------------------------------
 * Prompts */

static void test_bos_policy_and_chat(void **state) {
    (void)state;
    struct tokenizer *t = golden_tok();
    tok_set_default_bos(t, 0);
    assert_non_null(strstr(tok_bos_policy(t), "from the model config"));
    struct tok_ids v = {0};
    struct tok_prompt_opts plain = {0}, chat = {.chat = TOK_CHAT_PLAIN};
    assert_int_equal(tok_encode_prompt(t, "Hello", 5, &plain, &v), 0);
    assert_int_equal(v.ids[0], 0);
    assert_int_equal(v.ids[1], 3307);
    assert_int_equal(v.n, 2);
    v.n = 0;
    assert_int_equal(tok_encode_prompt(t, "Hello", 5, &chat, &v), 0);
    /* <bos><｜User｜>Hello<｜Assistant｜></think> */
    assert_int_equal(v.n, 5);
    assert_int_equal(v.ids[0], 0);
    assert_int_equal(v.ids[1], 3);
    assert_int_equal(v.ids[2], 3307);
    assert_int_equal(v.ids[3], 4);
    assert_int_equal(v.ids[4], 6);
    char *s = tok_chat_text(t, "Hi", &chat);
    assert_string_equal(s, "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>");
    free(s);
    struct tok_prompt_opts think = {.chat = TOK_CHAT_THINKING, .reasoning_effort = 50};
    assert_null(tok_chat_text(t, "Hi", &think)); /* this vocabulary has no <｜System｜> */
    assert_non_null(strstr(ds_err_get(), "<｜System｜>"));
    tok_ids_free(&v);
    tok_free(t);

    /* a TemplateProcessing post-processor and a tokenizer_config.json, in that priority order */
    char dir[] = "/tmp/tok_bos_XXXXXX", path[256];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    FILE *f = fopen(path, "w");
    fputs("{\"added_tokens\":[{\"id\":0,\"content\":\"<s>\",\"special\":true},{\"id\":1,\"content\":\"</s>\",\"special\":true}],"
          "\"post_processor\":{\"type\":\"TemplateProcessing\",\"single\":[{\"SpecialToken\":{\"id\":\"<s>\",\"type_id\":0}},"
          "{\"Sequence\":{\"id\":\"A\",\"type_id\":0}},{\"SpecialToken\":{\"id\":\"</s>\",\"type_id\":0}}],"
          "\"special_tokens\":{\"<s>\":{\"id\":\"<s>\",\"ids\":[0],\"tokens\":[\"<s>\"]},\"</s>\":{\"id\":\"</s>\",\"ids\":[1],\"tokens\":[\"</s>\"]}}},"
          "\"model\":{\"type\":\"BPE\",\"vocab\":{\"<s>\":0,\"</s>\":1,\"a\":2},\"merges\":[]}}", f);
    fclose(f);
    t = tok_load(path);
    assert_non_null(t);
    tok_set_default_bos(t, 2); /* ignored: the file says what to add */
    v.n = 0;
    assert_int_equal(tok_encode_prompt(t, "a", 1, &plain, &v), 0);
    assert_int_equal(v.n, 3);
    assert_int_equal(v.ids[0], 0);
    assert_int_equal(v.ids[2], 1);
    tok_free(t);
    char cfg[256];
    snprintf(cfg, sizeof cfg, "%s/tokenizer_config.json", dir);
    f = fopen(cfg, "w");
    fputs("{\"add_bos_token\": true, \"add_eos_token\": false, \"bos_token\": {\"content\": \"<s>\"}}", f);
    fclose(f);
    t = tok_load(path);
    assert_non_null(t);
    v.n = 0;
    assert_int_equal(tok_encode_prompt(t, "a", 1, &plain, &v), 0);
    assert_int_equal(v.n, 2);
    assert_int_equal(v.ids[0], 0);
    assert_int_equal(v.ids[1], 2);
    assert_non_null(strstr(tok_bos_policy(t), "add_bos_token=true"));
    tok_free(t);
    tok_ids_free(&v);
    unlink(cfg);
    unlink(path);
    rmdir(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden_cases),
        cmocka_unit_test(test_golden_engram_map),
        cmocka_unit_test(test_bad_json),
        cmocka_unit_test(test_unknown_model_type),
        cmocka_unit_test(test_merge_missing_token),
        cmocka_unit_test(test_unsupported_components),
        cmocka_unit_test(test_split_behaviors),
        cmocka_unit_test(test_digits_and_sequence),
        cmocka_unit_test(test_bytelevel_pre),
        cmocka_unit_test(test_normalizers),
        cmocka_unit_test(test_oniguruma_escapes),
        cmocka_unit_test(test_bpe_ranks),
        cmocka_unit_test(test_added_tokens),
        cmocka_unit_test(test_decode_lossy),
        cmocka_unit_test(test_engram_keys),
        cmocka_unit_test(test_bos_policy_and_chat),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
