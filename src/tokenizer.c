/* tokenizer.json reader, BPE encoder/decoder, chat prompts and the Engram token map (see
 * tokenizer.h for what is supported and why the engine needs it).
 *
 * The encoder follows the `tokenizers` library step for step, because the only acceptable result
 * is the library's ids: added tokens are cut out of the raw text (those flagged normalized=false)
 * and then out of the normalized text (normalized=true); every remaining segment goes through the
 * normalizer, the pre-tokenizer steps (each refines a list of pieces; Split behaviours as in the
 * library's NormalizedString::split), and BPE by merge rank (lowest rank first, leftmost among
 * equal ranks, as the library's merge queue pops them). Byte-level BPE never builds the mapped
 * "Ġ" strings: the 256 byte symbols are looked up once at load and merges are keyed by id pairs,
 * so a piece goes from raw bytes to ids directly. Words are cached (most text repeats words). */
#include "tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <cJSON.h>
#include <pcre2.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <utf8proc.h>

#include "log.h"

#define MAX_STEPS 32          /* normalizer / pre-tokenizer steps after flattening Sequences */
#define CACHE_MAX_WORD 256    /* longer pieces are not cached (rare, and they would bloat it) */
#define CACHE_MAX_ENTRIES (1u << 18)
#define ENGRAM_MAP_VERSION "dsbatch-engram-map-1"

/* ================================================================================================
 * Small containers: byte buffer, span list, string -> int map, id-pair -> merge map */

struct buf { char *p; size_t n, cap; };

/* Doubling growth of an array p holding n of cap elements, before appending one. */
#define GROW(p, n, cap)                                                                             \
    do {                                                                                            \
        if ((n) == (cap)) (cap) = (cap) ? 2 * (cap) : 64, (p) = ds_realloc((p), (cap) * sizeof *(p)); \
    } while (0)

static void buf_reserve(struct buf *b, size_t extra) {
    if (b->n + extra + 1 <= b->cap) return;
    size_t c = b->cap ? b->cap : 64;
    while (c < b->n + extra + 1) c *= 2;
    b->p = ds_realloc(b->p, c);
    b->cap = c;
}
static void buf_put(struct buf *b, const void *s, size_t n) {
    buf_reserve(b, n);
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}
static void buf_putc(struct buf *b, char c) { buf_put(b, &c, 1); }
static void buf_cp(struct buf *b, int32_t cp) {
    uint8_t tmp[4];
    buf_put(b, tmp, (size_t)utf8proc_encode_char(cp, tmp));
}

void tok_ids_free(struct tok_ids *v) { free(v->ids), memset(v, 0, sizeof *v); }
static void ids_push(struct tok_ids *v, int32_t id) {
    GROW(v->ids, v->n, v->cap);
    v->ids[v->n++] = id;
}

struct span { uint32_t s, e; uint8_t m; }; /* a span of a string; m = 1 for a pattern match */
struct spans { struct span *v; size_t n, cap; };
static void spans_push(struct spans *l, size_t s, size_t e, int m) {
    GROW(l->v, l->n, l->cap);
    l->v[l->n++] = (struct span){(uint32_t)s, (uint32_t)e, (uint8_t)m};
}

static uint64_t hash_bytes(const void *p, size_t n) {
    const unsigned char *s = p;
    uint64_t h = 0x9E3779B97F4A7C15ull ^ n;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, s, 8);
        h = (h ^ w) * 0xFF51AFD7ED558CCDull;
        h ^= h >> 32;
        s += 8, n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, s, n);
    h = (h ^ w) * 0xC4CEB9FE1A85EC53ull;
    return h ^ (h >> 29);
}

/* Open addressing; keys are not copied (the owner keeps them alive). */
struct smap_ent { uint64_t h; const char *k; uint32_t len; int32_t v; };
struct smap { struct smap_ent *e; size_t cap, n; }; /* cap: power of two, 0 = empty map */

static int32_t *smap_get(const struct smap *m, const char *k, size_t len, uint64_t h) {
    if (!m->cap) return NULL;
    for (size_t i = h & (m->cap - 1);; i = (i + 1) & (m->cap - 1)) {
        struct smap_ent *e = &m->e[i];
        if (!e->k) return NULL;
        if (e->h == h && e->len == len && !memcmp(e->k, k, len)) return &e->v;
    }
}
static void smap_put(struct smap *m, const char *k, size_t len, int32_t v) {
    if (2 * (m->n + 1) > m->cap) {
        struct smap old = *m;
        m->cap = old.cap ? 2 * old.cap : 1024;
        m->e = ds_calloc(m->cap, sizeof *m->e);
        m->n = 0;
        for (size_t i = 0; i < old.cap; i++)
            if (old.e[i].k) smap_put(m, old.e[i].k, old.e[i].len, old.e[i].v);
        free(old.e);
    }
    uint64_t h = hash_bytes(k, len);
    size_t i = h & (m->cap - 1);
    for (; m->e[i].k; i = (i + 1) & (m->cap - 1))
        if (m->e[i].h == h && m->e[i].len == len && !memcmp(m->e[i].k, k, len)) {
            m->e[i].v = v; /* a later duplicate wins, as in the library's hash maps */
            return;
        }
    m->e[i] = (struct smap_ent){h, k, (uint32_t)len, v};
    m->n++;
}
static void smap_free(struct smap *m) {
    free(m->e);
    memset(m, 0, sizeof *m);
}

/* (left id, right id) -> (rank, merged id); key UINT64_MAX = empty slot */
struct merge_map { uint64_t *key; int32_t *rank, *id; size_t cap; };
static uint64_t pair_key(int32_t a, int32_t b) { return (uint64_t)(uint32_t)a << 32 | (uint32_t)b; }
static size_t pair_slot(const struct merge_map *m, uint64_t k) {
    size_t i = (size_t)((k * 0x9E3779B97F4A7C15ull) >> 20) & (m->cap - 1);
    while (m->key[i] != UINT64_MAX && m->key[i] != k) i = (i + 1) & (m->cap - 1);
    return i;
}
static bool merge_get(const struct merge_map *m, int32_t a, int32_t b, int32_t *rank, int32_t *id) {
    if (!m->cap) return false;
    size_t i = pair_slot(m, pair_key(a, b));
    if (m->key[i] == UINT64_MAX) return false;
    *rank = m->rank[i], *id = m->id[i];
    return true;
}

/* ================================================================================================
 * UTF-8 and Unicode helpers */

/* Length of the valid UTF-8 sequence at s[0..n), or 0 when invalid. The ranges are those of the
 * Unicode standard's table 3-7, which is also what decides the "maximal subpart" replaced by one
 * U+FFFD in a lossy decode. *bad gets the length of that maximal invalid subpart. */
static size_t utf8_seq(const unsigned char *s, size_t n, size_t *bad) {
    unsigned c = s[0];
    *bad = 1;
    if (c < 0x80) return 1;
    size_t len;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c >= 0xE0 && c <= 0xEF) len = 3, lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
    else if (c >= 0xF0 && c <= 0xF4) len = 4, lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF;
    else return 0;
    for (size_t k = 1; k < len; k++) {
        if (k >= n || s[k] < (k == 1 ? lo : 0x80) || s[k] > (k == 1 ? hi : 0xBF)) {
            *bad = k;
            return 0;
        }
    }
    return len;
}

static void lossy_append(struct buf *out, const unsigned char *s, size_t n) {
    size_t i = 0, bad;
    while (i < n) {
        size_t l = utf8_seq(s + i, n - i, &bad);
        if (l) {
            buf_put(out, s + i, l);
            i += l;
        } else {
            buf_put(out, "\xEF\xBF\xBD", 3);
            i += bad;
        }
    }
}

/* Code point at s[*i] of a string already known to be valid; advances *i. */
static int32_t next_cp(const char *s, size_t n, size_t *i) {
    utf8proc_int32_t cp;
    utf8proc_ssize_t l = utf8proc_iterate((const utf8proc_uint8_t *)s + *i, (utf8proc_ssize_t)(n - *i), &cp);
    *i += l > 0 ? (size_t)l : 1;
    return l > 0 ? cp : 0xFFFD;
}

/* Rust's char::is_whitespace (the White_Space property): what the library's Strip and the added
 * tokens' lstrip/rstrip remove. */
static bool is_white_space(int32_t c) {
    return (c >= 9 && c <= 13) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) ||
           c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}
static bool is_numeric(int32_t c) { /* Rust char::is_numeric: Nd, Nl, No */
    utf8proc_category_t k = utf8proc_category(c);
    return k == UTF8PROC_CATEGORY_ND || k == UTF8PROC_CATEGORY_NL || k == UTF8PROC_CATEGORY_NO;
}
/* The library's StripAccents drops every mark (Mn, Mc, Me: unicode-normalization's
 * is_combining_mark), not only the nonspacing ones. */
static bool is_mark(int32_t c) {
    utf8proc_category_t k = utf8proc_category(c);
    return k == UTF8PROC_CATEGORY_MN || k == UTF8PROC_CATEGORY_MC || k == UTF8PROC_CATEGORY_ME;
}
static bool is_word_char(int32_t c) {
    utf8proc_category_t k = utf8proc_category(c);
    return c == '_' || (k >= UTF8PROC_CATEGORY_LU && k <= UTF8PROC_CATEGORY_LO) ||
           (k >= UTF8PROC_CATEGORY_ND && k <= UTF8PROC_CATEGORY_NO);
}

/* Start of the character that ends at byte offset i (i > 0), and that character. */
static size_t prev_start(const char *s, size_t i) {
    do i--;
    while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80);
    return i;
}
static int32_t prev_cp(const char *s, size_t i) { return next_cp(s, i, &(size_t){prev_start(s, i)}); }

/* ================================================================================================
 * Tokenizer state */

enum pat_kind { PAT_REGEX, PAT_STRING, PAT_NUMERIC };
struct pattern {
    enum pat_kind kind;
    pcre2_code *re;
    bool jit; /* compiled by the JIT: matched through pcre2_jit_match, which skips re-checking */
    char *lit;
    size_t lit_len;
    bool invert;
};

enum split_behavior { SB_REMOVED, SB_ISOLATED, SB_MERGED_PREV, SB_MERGED_NEXT, SB_CONTIGUOUS };
enum norm_kind { NK_NFC, NK_NFD, NK_NFKC, NK_NFKD, NK_LOWER, NK_STRIP, NK_STRIP_ACCENTS, NK_REPLACE, NK_PREPEND };
enum pre_kind { PK_SPLIT, PK_BYTELEVEL };

struct norm_step {
    enum norm_kind kind;
    bool left, right;
    struct pattern pat;
    char *text; /* Replace content / Prepend string */
    size_t text_len;
};
struct pre_step {
    enum pre_kind kind;
    struct pattern pat;
    enum split_behavior behavior;
    bool prefix_space; /* ByteLevel add_prefix_space */
};

struct added {
    const char *content; /* searched in the text; normalized when `normalized` (see parse_model) */
    uint32_t len;
    int32_t id;
    bool special, normalized, lstrip, rstrip, single_word;
};
/* Added tokens of one kind (raw or normalized), grouped by first byte, longest first. */
struct added_group {
    int32_t *idx;
    size_t n;
    uint32_t start[257]; /* idx[start[b] .. start[b+1]) begin with byte b */
};

struct tokenizer {
    char source[512];
    /* id -> token string (model vocab, then added tokens override), in one arena */
    char *arena;
    int64_t *off;
    uint32_t *len;
    uint8_t *special;
    int32_t n_ids;
    struct smap vocab, added_map; /* string -> id */
    struct merge_map merges;
    int32_t unk_id;
    bool fuse_unk, byte_fallback, ignore_merges;
    /* byte level */
    bool byte_level;              /* a ByteLevel pre-tokenizer maps bytes to the model's symbols */
    bool decode_byte_level;       /* ByteLevel decoder (else tokens joined by " ") */
    int32_t byte_id[256];         /* id of each byte's mapped one-char token, -1 if missing */
    int32_t byte_char[256];       /* GPT-2 bytes_to_unicode */
    int16_t char_byte[512];       /* its inverse for code points < 512, -1 elsewhere */
    /* pipeline */
    struct added *added;
    size_t n_added;
    struct added_group raw_group, norm_group;
    struct norm_step norm[MAX_STEPS];
    int n_norm;
    struct pre_step pre[MAX_STEPS];
    int n_pre;
    /* BOS/EOS policy */
    int32_t prefix[8], suffix[8];
    int n_prefix, n_suffix;
    int policy; /* 0 none yet, 1 tokenizer_config, 2 post_processor */
    char policy_text[1400];
    /* scratch (hence one tokenizer per thread) */
    pcre2_match_data *md;
    struct buf nbuf, pbuf;
    struct spans sp, pieces, pieces2;
    int32_t *sym, *nxt, *prv;
    struct cand { int32_t rank, pos, id; } *heap;
    size_t sym_cap;
    /* word cache: piece bytes -> ids */
    struct smap cache;
    char **cache_chunks;
    size_t n_chunks, chunk_used;
    int32_t *cache_ids;
    size_t cache_n, cache_cap;
};

static int __attribute__((format(printf, 2, 3))) terr(const struct tokenizer *t, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    ds_err_set("%s: %s", t->source, msg);
    return -1;
}

int32_t tok_n_ids(const struct tokenizer *t) { return t->n_ids; }
const char *tok_id_to_token(const struct tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_ids && t->off[id] >= 0 ? t->arena + t->off[id] : NULL;
}
bool tok_is_special(const struct tokenizer *t, int32_t id) { return id >= 0 && id < t->n_ids && t->special[id]; }
int32_t tok_token_to_id(const struct tokenizer *t, const char *token) {
    size_t n = strlen(token);
    uint64_t h = hash_bytes(token, n);
    int32_t *v = smap_get(&t->added_map, token, n, h);
    if (!v) v = smap_get(&t->vocab, token, n, h);
    return v ? *v : -1;
}

/* ================================================================================================
 * Patterns and splitting */

/* tokenizer.json regexes are written for Oniguruma, the library's engine. PCRE2 agrees on the
 * syntax used in practice but not on a few escapes, which are rewritten to explicit classes:
 * \s is White_Space there (PCRE2 also takes U+180E), \h is a hex digit there (PCRE2: horizontal
 * space), \w is the Unicode word class there (Alphabetic, marks, numbers, connectors). */
#define ONIG_SPACE "\\t\\n\\x0B\\f\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"
#define ONIG_WORD "\\p{Alphabetic}\\p{M}\\p{N}\\p{Pc}"
static char *onig_to_pcre2(const char *p) {
    struct buf o = {0};
    bool in_class = false;
    for (size_t i = 0; p[i];) {
        char c = p[i];
        if (c == '\\' && p[i + 1]) {
            char d = p[i + 1];
            static const char *esc[][3] = {/* escape, inside a class, outside */
                {"s", ONIG_SPACE, "[" ONIG_SPACE "]"}, {"S", "\\S\\x{180E}", "[\\S\\x{180E}]"}, {"h", "0-9a-fA-F", "[0-9a-fA-F]"},
                {"H", NULL, "[^0-9a-fA-F]"}, {"w", ONIG_WORD, "[" ONIG_WORD "]"}, {"W", NULL, "[^" ONIG_WORD "]"}};
            const char *r = NULL;
            for (size_t k = 0; k < 6; k++)
                if (esc[k][0][0] == d) r = esc[k][in_class ? 1 : 2];
            if (r) {
                buf_put(&o, r, strlen(r));
                i += 2;
                continue;
            }
            buf_put(&o, p + i, 2);
            i += 2;
            if ((d == 'p' || d == 'P' || d == 'x') && p[i] == '{')
                while (p[i] && p[i - 1] != '}') buf_putc(&o, p[i++]);
            continue;
        }
        if (!in_class && c == '[') {
            in_class = true;
            buf_putc(&o, p[i++]);
            if (p[i] == '^') buf_putc(&o, p[i++]);
            if (p[i] == ']') buf_putc(&o, p[i++]); /* a leading ] is a member */
            continue;
        }
        if (in_class && c == '[' && p[i + 1] == ':') { /* POSIX class: copy through ":]" */
            const char *e = strstr(p + i + 2, ":]");
            size_t l = e ? (size_t)(e - (p + i)) + 2 : 1;
            buf_put(&o, p + i, l);
            i += l;
            continue;
        }
        if (in_class && c == ']') in_class = false;
        buf_putc(&o, p[i++]);
    }
    return o.p ? o.p : ds_strdup("");
}

static int pattern_compile(struct tokenizer *t, const char *where, const cJSON *pj, bool invert, struct pattern *p) {
    memset(p, 0, sizeof *p);
    p->invert = invert;
    const cJSON *re = cJSON_GetObjectItemCaseSensitive(pj, "Regex");
    const cJSON *lit = cJSON_GetObjectItemCaseSensitive(pj, "String");
    if (cJSON_IsString(lit)) {
        p->kind = PAT_STRING;
        p->lit = ds_strdup(lit->valuestring);
        p->lit_len = strlen(p->lit);
        return 0;
    }
    if (!cJSON_IsString(re)) return terr(t, "%s.pattern: expected {\"Regex\": ...} or {\"String\": ...}", where);
    int ec;
    PCRE2_SIZE eo;
    p->kind = PAT_REGEX;
    char *pat = onig_to_pcre2(re->valuestring);
    p->re = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &ec, &eo, NULL);
    free(pat);
    if (!p->re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(ec, msg, sizeof msg);
        return terr(t, "%s.pattern: regex does not compile at offset %zu: %s", where, (size_t)eo, (char *)msg);
    }
    p->jit = pcre2_jit_compile(p->re, PCRE2_JIT_COMPLETE) == 0; /* else the interpreter: same matches */
    return 0;
}

static void pattern_free(struct pattern *p) {
    if (p->re) pcre2_code_free(p->re);
    free(p->lit);
}

/* Every match of p in s[0..n) as spans that cover s (the library's Pattern::find_matches): gaps
 * are non-matches; an empty regex match is a (harmless) empty span and the search moves on one
 * character, as Oniguruma's iterator does. */
static void find_matches(struct tokenizer *t, const struct pattern *p, const char *s, size_t n, struct spans *out) {
    out->n = 0;
    if (!n) {
        spans_push(out, 0, 0, 0);
        return;
    }
    size_t prev = 0, pos = 0;
    while (pos <= n) {
        size_t ms, me;
        if (p->kind == PAT_NUMERIC) { /* each numeric character is one match */
            for (ms = pos; ms < n; ms = me)
                if (me = ms, is_numeric(next_cp(s, n, &me))) break;
            if (ms >= n) break;
        } else if (p->kind == PAT_STRING) {
            if (!p->lit_len) break;
            const char *f = memmem(s + pos, n - pos, p->lit, p->lit_len);
            if (!f) break;
            ms = (size_t)(f - s), me = ms + p->lit_len;
        } else {
            int rc = p->jit ? pcre2_jit_match(p->re, (PCRE2_SPTR)s, n, pos, 0, t->md, NULL)
                            : pcre2_match(p->re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK, t->md, NULL);
            if (rc < 0) break; /* no match (other errors: only resource limits, treated alike) */
            PCRE2_SIZE *ov = pcre2_get_ovector_pointer(t->md);
            ms = ov[0], me = ov[1];
        }
        if (ms > prev) spans_push(out, prev, ms, p->invert);
        spans_push(out, ms, me, !p->invert);
        prev = pos = me;
        if (me == ms) { /* empty match: move on one character, as Oniguruma's iterator does */
            if (me >= n) break;
            next_cp(s, n, &pos);
        }
    }
    if (prev < n) spans_push(out, prev, n, p->invert);
}

/* Pieces from matches by behaviour (NormalizedString::split). Appends non-empty kept spans of
 * s (offsets shifted by base) to out. */
static void split_spans(const struct spans *m, enum split_behavior b, size_t base, struct spans *out) {
    size_t first = out->n;
    bool prev_match = false;
    if (b == SB_MERGED_NEXT) {
        /* walk backwards: a match joins the piece that follows it */
        for (size_t k = m->n; k-- > 0;) {
            const struct span *x = &m->v[k];
            if (x->m && !prev_match && out->n > first)
                out->v[out->n - 1].s = x->s;
            else
                spans_push(out, x->s, x->e, 0);
            prev_match = x->m;
        }
        for (size_t i = first, j = out->n - 1; i < j; i++, j--) {
            struct span tmp = out->v[i];
            out->v[i] = out->v[j], out->v[j] = tmp;
        }
    } else {
        for (size_t k = 0; k < m->n; k++) {
            const struct span *x = &m->v[k];
            bool join = (b == SB_MERGED_PREV && x->m && !prev_match) || (b == SB_CONTIGUOUS && x->m == prev_match);
            if (join && out->n > first)
                out->v[out->n - 1].e = x->e;
            else
                spans_push(out, x->s, x->e, b == SB_REMOVED && x->m);
            prev_match = x->m;
        }
    }
    size_t w = first;
    for (size_t k = first; k < out->n; k++)
        if (!out->v[k].m && out->v[k].e > out->v[k].s)
            out->v[w++] = (struct span){(uint32_t)(out->v[k].s + base), (uint32_t)(out->v[k].e + base), 0};
    out->n = w;
}

/* ================================================================================================
 * Normalizers */

static void unicode_form(const char *s, size_t n, int options, struct buf *out) {
    utf8proc_uint8_t *dst = NULL;
    utf8proc_ssize_t l = n ? utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &dst, options) : 0;
    out->n = 0;
    if (l > 0) buf_put(out, dst, (size_t)l);
    else if (l < 0) buf_put(out, s, n); /* valid input cannot fail; keep the text rather than lose it */
    else buf_reserve(out, 0), out->p[0] = 0;
    free(dst);
}

/* Rust's char::to_lowercase: the simple mapping, except U+0130 whose full lowercase is two chars. */
static void lower_cp(struct buf *out, int32_t c) {
    if (c == 0x130) {
        buf_putc(out, 'i');
        buf_cp(out, 0x307);
    } else {
        buf_cp(out, utf8proc_tolower(c));
    }
}

static void apply_norm(struct tokenizer *t, const struct norm_step *st, const char *s, size_t n, struct buf *out) {
    size_t i = 0;
    out->n = 0;
    buf_reserve(out, n);
    static const int forms[4] = {UTF8PROC_COMPOSE, UTF8PROC_DECOMPOSE, UTF8PROC_COMPOSE | UTF8PROC_COMPAT,
                                 UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT}; /* NFC, NFD, NFKC, NFKD */
    switch (st->kind) {
    case NK_NFC: case NK_NFD: case NK_NFKC: case NK_NFKD:
        unicode_form(s, n, UTF8PROC_STABLE | forms[st->kind - NK_NFC], out);
        return;
    case NK_LOWER:
        while (i < n) lower_cp(out, next_cp(s, n, &i));
        return;
    case NK_STRIP_ACCENTS:
        while (i < n) {
            size_t j = i;
            int32_t c = next_cp(s, n, &j);
            if (!is_mark(c)) buf_put(out, s + i, j - i);
            i = j;
        }
        return;
    case NK_STRIP: {
        size_t a = 0, b = n;
        while (st->left && a < b) {
            size_t j = a;
            if (!is_white_space(next_cp(s, n, &j))) break;
            a = j;
        }
        while (st->right && b > a && is_white_space(prev_cp(s, b))) b = prev_start(s, b);
        buf_put(out, s + a, b - a);
        return;
    }
    case NK_PREPEND:
        if (n) buf_put(out, st->text, st->text_len);
        buf_put(out, s, n);
        return;
    case NK_REPLACE: {
        struct spans m = {0};
        find_matches(t, &st->pat, s, n, &m);
        for (size_t k = 0; k < m.n; k++) {
            if (m.v[k].m) buf_put(out, st->text, st->text_len);
            else buf_put(out, s + m.v[k].s, m.v[k].e - m.v[k].s);
        }
        free(m.v);
        return;
    }
    }
}

/* ================================================================================================
 * BPE */

/* Merge queue order: lowest rank first, then leftmost (the library's Merge ordering). */
static bool cand_lt(const struct cand *a, const struct cand *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}
static void heap_push(struct cand *h, size_t *n, struct cand c) {
    size_t i = (*n)++;
    for (size_t p; i > 0 && cand_lt(&c, &h[p = (i - 1) / 2]); i = p) h[i] = h[p];
    h[i] = c;
}
static struct cand heap_pop(struct cand *h, size_t *n) {
    struct cand top = h[0], last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        const struct cand *best = &last;
        if (l < *n && cand_lt(&h[l], best)) m = l, best = &h[l];
        if (r < *n && cand_lt(&h[r], best)) m = r, best = &h[r];
        if (m == i) break;
        h[i] = h[m], i = m;
    }
    h[i] = last;
    return top;
}

static void push_pair(struct tokenizer *t, size_t *hn, int32_t pos) {
    int32_t rank, id, q = t->nxt[pos];
    if (q >= 0 && merge_get(&t->merges, t->sym[pos], t->sym[q], &rank, &id))
        heap_push(t->heap, hn, (struct cand){rank, pos, id});
}

static void cache_store(struct tokenizer *t, const char *s, size_t n, const int32_t *ids, size_t k) {
    if (t->cache.n >= CACHE_MAX_ENTRIES) { /* full: start over rather than track recency */
        for (size_t i = 0; i < t->n_chunks; i++) free(t->cache_chunks[i]);
        t->n_chunks = 0, t->cache_n = 0;
        smap_free(&t->cache);
    }
    const size_t chunk = 1 << 20;
    if (!t->n_chunks || t->chunk_used + n > chunk) {
        t->cache_chunks = ds_realloc(t->cache_chunks, (t->n_chunks + 1) * sizeof *t->cache_chunks);
        t->cache_chunks[t->n_chunks++] = ds_malloc(chunk);
        t->chunk_used = 0;
    }
    char *key = t->cache_chunks[t->n_chunks - 1] + t->chunk_used;
    memcpy(key, s, n);
    t->chunk_used += n;
    if (t->cache_n + k + 1 > t->cache_cap) {
        t->cache_cap = 2 * (t->cache_n + k + 1024);
        t->cache_ids = ds_realloc(t->cache_ids, t->cache_cap * sizeof *t->cache_ids);
    }
    smap_put(&t->cache, key, n, (int32_t)t->cache_n);
    t->cache_ids[t->cache_n++] = (int32_t)k;
    memcpy(t->cache_ids + t->cache_n, ids, k * sizeof *ids);
    t->cache_n += k;
}

/* The model symbol(s) of one character or byte that has no vocab entry of its own. */
static void add_missing(struct tokenizer *t, const unsigned char *c, size_t len, size_t *ns) {
    if (t->byte_fallback) {
        int32_t ids[4];
        size_t k = 0;
        for (; k < len; k++) {
            char name[8];
            snprintf(name, sizeof name, "<0x%02X>", c[k]);
            int32_t *v = smap_get(&t->vocab, name, 6, hash_bytes(name, 6));
            if (!v) break;
            ids[k] = *v;
        }
        if (k == len) {
            for (k = 0; k < len; k++) t->sym[(*ns)++] = ids[k];
            return;
        }
    }
    if (t->unk_id < 0) return; /* the library drops it */
    if (t->fuse_unk && *ns > 0 && t->sym[*ns - 1] == t->unk_id) return;
    t->sym[(*ns)++] = t->unk_id;
}

static void bpe_piece(struct tokenizer *t, const char *s, size_t n, struct tok_ids *out) {
    uint64_t h = hash_bytes(s, n);
    int32_t *hit = n <= CACHE_MAX_WORD ? smap_get(&t->cache, s, n, h) : NULL;
    if (hit) {
        const int32_t *c = t->cache_ids + *hit;
        for (int32_t k = 0; k < c[0]; k++) ids_push(out, c[1 + k]);
        return;
    }
    size_t start = out->n;
    const unsigned char *u = (const unsigned char *)s;
    if (t->ignore_merges) { /* the whole word as one token when the vocab has it */
        struct buf w = {0};
        if (t->byte_level)
            for (size_t i = 0; i < n; i++) buf_cp(&w, t->byte_char[u[i]]);
        else
            buf_put(&w, s, n);
        int32_t *v = smap_get(&t->vocab, w.p, w.n, hash_bytes(w.p, w.n));
        free(w.p);
        if (v) {
            ids_push(out, *v);
            goto done;
        }
    }
    if (n + 4 > t->sym_cap) {
        t->sym_cap = 2 * (n + 4);
        t->sym = ds_realloc(t->sym, t->sym_cap * sizeof *t->sym);
        t->nxt = ds_realloc(t->nxt, t->sym_cap * sizeof *t->nxt);
        t->prv = ds_realloc(t->prv, t->sym_cap * sizeof *t->prv);
        t->heap = ds_realloc(t->heap, t->sym_cap * sizeof *t->heap);
    }
    size_t ns = 0;
    for (size_t i = 0; i < n;) {
        size_t l = 1;
        int32_t id = -1;
        if (t->byte_level) {
            id = t->byte_id[u[i]];
        } else {
            size_t j = i;
            next_cp(s, n, &j);
            l = j - i;
            int32_t *v = smap_get(&t->vocab, s + i, l, hash_bytes(s + i, l));
            if (v) id = *v;
        }
        if (id >= 0) t->sym[ns++] = id;
        else add_missing(t, u + i, l, &ns);
        i += l;
    }
    for (size_t i = 0; i < ns; i++) t->prv[i] = (int32_t)i - 1, t->nxt[i] = i + 1 < ns ? (int32_t)i + 1 : -1;
    size_t hn = 0;
    for (size_t i = 0; i + 1 < ns; i++) push_pair(t, &hn, (int32_t)i);
    while (hn) {
        struct cand c = heap_pop(t->heap, &hn);
        int32_t q = t->nxt[c.pos], rank, id;
        /* stale entry: the left symbol was absorbed, or either side changed since the push */
        if (t->sym[c.pos] < 0 || q < 0 || !merge_get(&t->merges, t->sym[c.pos], t->sym[q], &rank, &id) || id != c.id)
            continue;
        t->sym[c.pos] = id;
        t->sym[q] = -1;
        t->nxt[c.pos] = t->nxt[q];
        if (t->nxt[q] >= 0) t->prv[t->nxt[q]] = c.pos;
        if (t->prv[c.pos] >= 0) push_pair(t, &hn, t->prv[c.pos]);
        push_pair(t, &hn, c.pos);
    }
    for (int32_t i = ns ? 0 : -1; i >= 0; i = t->nxt[i]) ids_push(out, t->sym[i]);
done:
    if (n <= CACHE_MAX_WORD) cache_store(t, s, n, out->ids + start, out->n - start);
}

/* ================================================================================================
 * Encoding */

/* Next added token of group g in s[from..n): match bounds (lstrip/rstrip included) and id. */
static bool next_added(const struct tokenizer *t, const struct added_group *g, const char *s, size_t n, size_t from,
                       size_t *ms, size_t *me, int32_t *id) {
    if (!g->n) return false;
    for (size_t i = from; i < n; i++) {
        unsigned c = (unsigned char)s[i];
        for (size_t k = g->start[c]; k < g->start[c + 1]; k++) {
            const struct added *a = &t->added[g->idx[k]];
            if (a->len > n - i || memcmp(s + i, a->content, a->len)) continue;
            size_t b = i, e = i + a->len;
            if (a->single_word && ((b > 0 && is_word_char(prev_cp(s, b))) || (e < n && is_word_char(next_cp(s, n, &(size_t){e})))))
                continue;
            while (a->lstrip && b > from && is_white_space(prev_cp(s, b))) b = prev_start(s, b);
            while (a->rstrip && e < n) {
                size_t j = e;
                if (!is_white_space(next_cp(s, n, &j))) break;
                e = j;
            }
            *ms = b, *me = e, *id = a->id;
            return true;
        }
    }
    return false;
}

/* The pre-tokenizer's pieces of s[0..n) as spans of t->pbuf. */
static struct spans *pre_tokenize(struct tokenizer *t, const char *s, size_t n) {
    t->pbuf.n = 0;
    buf_put(&t->pbuf, s, n);
    struct spans *cur = &t->pieces, *nxt = &t->pieces2;
    cur->n = 0;
    spans_push(cur, 0, n, 0);
    for (int k = 0; k < t->n_pre; k++) {
        const struct pre_step *st = &t->pre[k];
        nxt->n = 0;
        for (size_t i = 0; i < cur->n; i++) {
            size_t a = cur->v[i].s, b = cur->v[i].e;
            if (st->kind == PK_BYTELEVEL && st->prefix_space && t->pbuf.p[a] != ' ') {
                size_t at = t->pbuf.n; /* the piece with a space in front, copied to the end */
                buf_reserve(&t->pbuf, b - a + 1); /* before taking a pointer into the buffer */
                t->pbuf.p[at] = ' ';
                memcpy(t->pbuf.p + at + 1, t->pbuf.p + a, b - a);
                t->pbuf.n += b - a + 1;
                t->pbuf.p[t->pbuf.n] = 0;
                a = at, b = t->pbuf.n;
            }
            if (st->kind == PK_BYTELEVEL && !st->pat.re) {
                spans_push(nxt, a, b, 0);
                continue;
            }
            find_matches(t, &st->pat, t->pbuf.p + a, b - a, &t->sp);
            split_spans(&t->sp, st->behavior, a, nxt);
        }
        struct spans *tmp = cur;
        cur = nxt, nxt = tmp;
    }
    return cur;
}

/* Pre-tokenizer steps and BPE on one segment that holds no added token. */
static void encode_plain(struct tokenizer *t, const char *s, size_t n, struct tok_ids *out) {
    if (!n) return;
    struct spans *cur = pre_tokenize(t, s, n);
    for (size_t i = 0; i < cur->n; i++) bpe_piece(t, t->pbuf.p + cur->v[i].s, cur->v[i].e - cur->v[i].s, out);
}

int tok_pre_tokenize(struct tokenizer *t, const char *text, size_t len, char ***pieces, size_t *n) {
    struct spans none = {0}, *cur = len ? pre_tokenize(t, text, len) : &none;
    *pieces = ds_malloc((cur->n + 1) * sizeof **pieces);
    for (size_t i = 0; i < cur->n; i++) {
        size_t l = cur->v[i].e - cur->v[i].s;
        (*pieces)[i] = ds_malloc(l + 1);
        memcpy((*pieces)[i], t->pbuf.p + cur->v[i].s, l);
        (*pieces)[i][l] = 0;
    }
    *n = cur->n;
    return 0;
}

/* The normalizer's output for s[0..n), left in t->nbuf. */
static void normalize(struct tokenizer *t, const char *s, size_t n) {
    struct buf tmp = {0};
    t->nbuf.n = 0;
    buf_put(&t->nbuf, s, n);
    for (int k = 0; k < t->n_norm; k++) {
        apply_norm(t, &t->norm[k], t->nbuf.p, t->nbuf.n, &tmp);
        struct buf x = t->nbuf;
        t->nbuf = tmp, tmp = x;
    }
    free(tmp.p);
}

char *tok_normalize_text(struct tokenizer *t, const char *text, size_t len, size_t *len_out) {
    normalize(t, text, len);
    if (len_out) *len_out = t->nbuf.n;
    return ds_strdup(t->nbuf.p);
}

/* A segment of raw text between non-normalized added tokens. */
static void encode_segment(struct tokenizer *t, const char *s, size_t n, struct tok_ids *out) {
    if (t->n_norm) {
        normalize(t, s, n);
        s = t->nbuf.p, n = t->nbuf.n;
    }
    /* encode_plain reuses pbuf, never nbuf, so s stays valid through the loop */
    size_t pos = 0, ms, me;
    int32_t id;
    while (next_added(t, &t->norm_group, s, n, pos, &ms, &me, &id)) {
        encode_plain(t, s + pos, ms - pos, out);
        ids_push(out, id);
        pos = me;
    }
    encode_plain(t, s + pos, n - pos, out);
}

int tok_encode(struct tokenizer *t, const char *text, size_t len, struct tok_ids *out) {
    size_t bad;
    for (size_t i = 0; i < len;) {
        size_t l = utf8_seq((const unsigned char *)text + i, len - i, &bad);
        if (!l) {
            ds_err_set("text is not valid UTF-8 (byte %zu)", i);
            return -1;
        }
        i += l;
    }
    size_t pos = 0, ms, me;
    int32_t id;
    while (next_added(t, &t->raw_group, text, len, pos, &ms, &me, &id)) {
        encode_segment(t, text + pos, ms - pos, out);
        ids_push(out, id);
        pos = me;
    }
    encode_segment(t, text + pos, len - pos, out);
    return 0;
}

char *tok_decode(const struct tokenizer *t, const int32_t *ids, size_t n, bool skip_special, size_t *len_out) {
    struct buf raw = {0}, out = {0};
    bool first = true;
    for (size_t k = 0; k < n; k++) {
        const char *s = tok_id_to_token(t, ids[k]);
        if (!s || (skip_special && t->special[ids[k]])) continue;
        size_t l = t->len[ids[k]];
        if (!t->decode_byte_level) { /* no decoder: the library joins the tokens with spaces */
            if (!first) buf_putc(&raw, ' ');
            buf_put(&raw, s, l);
            first = false;
            continue;
        }
        /* each token maps back to bytes only if every char is a byte symbol; else its UTF-8 as is */
        size_t mark = raw.n;
        for (size_t i = 0; i < l;) {
            int32_t c = next_cp(s, l, &i);
            if (c >= 512 || t->char_byte[c] < 0) {
                raw.n = mark;
                buf_put(&raw, s, l);
                break;
            }
            buf_putc(&raw, (char)t->char_byte[c]);
        }
    }
    lossy_append(&out, (const unsigned char *)raw.p, raw.n);
    free(raw.p);
    if (!out.p) buf_reserve(&out, 0), out.p[0] = 0;
    if (len_out) *len_out = out.n;
    return out.p;
}

/* ================================================================================================
 * Loading */

static const cJSON *jget(const cJSON *o, const char *k) { return cJSON_GetObjectItemCaseSensitive(o, k); }
static bool jbool(const cJSON *o, const char *k, bool dflt) {
    const cJSON *v = jget(o, k);
    return cJSON_IsBool(v) ? cJSON_IsTrue(v) : dflt;
}
static const char *jtype(const cJSON *o) {
    const cJSON *v = jget(o, "type");
    return cJSON_IsString(v) ? v->valuestring : "(no type)";
}

/* A Sequence (normalizers or pre-tokenizers) is flattened: each member parsed by fn under the
 * path WHERE.KEY[i] for error messages. Returns 1 when j is not a Sequence. */
static int parse_sequence(struct tokenizer *t, const cJSON *j, const char *key, const char *where,
                          int (*fn)(struct tokenizer *, const cJSON *, const char *)) {
    if (strcmp(jtype(j), "Sequence")) return 1;
    const cJSON *l = jget(j, key), *x;
    int i = 0;
    if (!cJSON_IsArray(l)) return terr(t, "%s.%s: expected an array", where, key);
    cJSON_ArrayForEach(x, l) {
        char w[300];
        snprintf(w, sizeof w, "%.200s.%s[%d]", where, key, i++);
        if (fn(t, x, w)) return -1;
    }
    return 0;
}

static int parse_normalizer(struct tokenizer *t, const cJSON *j, const char *where) {
    if (!j || cJSON_IsNull(j)) return 0;
    const char *ty = jtype(j);
    int seq = parse_sequence(t, j, "normalizers", where, parse_normalizer);
    if (seq <= 0) return seq;
    if (t->n_norm == MAX_STEPS) return terr(t, "%s: more than %d normalizer steps", where, MAX_STEPS);
    struct norm_step *st = &t->norm[t->n_norm];
    memset(st, 0, sizeof *st);
    static const struct { const char *name; enum norm_kind kind; } simple[] = {
        {"NFC", NK_NFC}, {"NFD", NK_NFD}, {"NFKC", NK_NFKC}, {"NFKD", NK_NFKD}, {"Lowercase", NK_LOWER},
        {"StripAccents", NK_STRIP_ACCENTS}, {"Strip", NK_STRIP}, {"Replace", NK_REPLACE}, {"Prepend", NK_PREPEND}};
    size_t k = 0;
    while (k < sizeof simple / sizeof *simple && strcmp(simple[k].name, ty)) k++;
    if (k == sizeof simple / sizeof *simple)
        return terr(t, "%s: normalizer type '%s' is not supported (supported: NFC, NFD, NFKC, NFKD, Lowercase, Strip, "
                       "StripAccents, Replace, Prepend, Sequence)", where, ty);
    st->kind = simple[k].kind;
    st->left = jbool(j, "strip_left", true);
    st->right = jbool(j, "strip_right", true);
    const cJSON *txt = jget(j, st->kind == NK_REPLACE ? "content" : "prepend");
    if (st->kind == NK_REPLACE || st->kind == NK_PREPEND) {
        if (!cJSON_IsString(txt)) return terr(t, "%s: %s needs a string", where, st->kind == NK_REPLACE ? "content" : "prepend");
        st->text = ds_strdup(txt->valuestring);
        st->text_len = strlen(st->text);
    }
    if (st->kind == NK_REPLACE && pattern_compile(t, where, jget(j, "pattern"), false, &st->pat)) return -1;
    t->n_norm++;
    return 0;
}

static int parse_pre(struct tokenizer *t, const cJSON *j, const char *where) {
    if (!j || cJSON_IsNull(j)) return 0;
    const char *ty = jtype(j);
    int seq = parse_sequence(t, j, "pretokenizers", where, parse_pre);
    if (seq <= 0) return seq;
    if (t->n_pre == MAX_STEPS) return terr(t, "%s: more than %d pre-tokenizer steps", where, MAX_STEPS);
    if (t->byte_level)
        return terr(t, "%s: pre-tokenizer '%s' after ByteLevel is not supported (ByteLevel must be the last step)", where, ty);
    struct pre_step *st = &t->pre[t->n_pre];
    memset(st, 0, sizeof *st);
    st->behavior = SB_ISOLATED;
    if (!strcmp(ty, "Split")) {
        static const char *names[] = {"Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"};
        const cJSON *b = jget(j, "behavior");
        int k = 0;
        while (k < 5 && !(cJSON_IsString(b) && !strcmp(b->valuestring, names[k]))) k++;
        if (k == 5) return terr(t, "%s.behavior: '%s' is not a Split behaviour", where, cJSON_IsString(b) ? b->valuestring : "?");
        st->behavior = (enum split_behavior)k;
        if (pattern_compile(t, where, jget(j, "pattern"), jbool(j, "invert", false), &st->pat)) return -1;
    } else if (!strcmp(ty, "Digits")) {
        st->pat.kind = PAT_NUMERIC;
        st->behavior = jbool(j, "individual_digits", false) ? SB_ISOLATED : SB_CONTIGUOUS;
    } else if (!strcmp(ty, "ByteLevel")) {
        st->kind = PK_BYTELEVEL;
        st->prefix_space = jbool(j, "add_prefix_space", true);
        if (jbool(j, "use_regex", true)) { /* GPT-2's own split, as the library hard-codes it */
            cJSON *p = cJSON_CreateObject();
            cJSON_AddStringToObject(p, "Regex", "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+");
            int rc = pattern_compile(t, where, p, false, &st->pat);
            cJSON_Delete(p);
            if (rc) return -1;
        }
        t->byte_level = true;
    } else {
        return terr(t, "%s: pre-tokenizer type '%s' is not supported (supported: Sequence, Split, ByteLevel, Digits)", where, ty);
    }
    t->n_pre++;
    return 0;
}

static int add_template_ids(struct tokenizer *t, const cJSON *pp, const char *where) {
    const char *ty = jtype(pp);
    if (!strcmp(ty, "ByteLevel")) return 0; /* offsets only */
    if (!strcmp(ty, "Sequence")) {
        const cJSON *x;
        cJSON_ArrayForEach(x, jget(pp, "processors")) if (add_template_ids(t, x, where)) return -1;
        return 0;
    }
    if (!strcmp(ty, "RobertaProcessing") || !strcmp(ty, "BertProcessing")) {
        const cJSON *cls = jget(pp, "cls"), *sep = jget(pp, "sep");
        if (!cJSON_IsNumber(cJSON_GetArrayItem(cls, 1)) || !cJSON_IsNumber(cJSON_GetArrayItem(sep, 1)))
            return terr(t, "%s: cls/sep: expected [token, id] pairs", where);
        t->prefix[0] = cJSON_GetArrayItem(cls, 1)->valueint, t->n_prefix = 1;
        t->suffix[0] = cJSON_GetArrayItem(sep, 1)->valueint, t->n_suffix = 1;
        return 0;
    }
    if (strcmp(ty, "TemplateProcessing"))
        return terr(t, "%s: post-processor type '%s' is not supported (supported: TemplateProcessing, ByteLevel, "
                       "RobertaProcessing, BertProcessing, Sequence)", where, ty);
    const cJSON *x, *sp = jget(pp, "special_tokens");
    bool after = false;
    t->n_prefix = t->n_suffix = 0;
    cJSON_ArrayForEach(x, jget(pp, "single")) {
        const cJSON *st = jget(x, "SpecialToken");
        if (!st) {
            after = true; /* {"Sequence": {"id": "A"}}: the text itself */
            continue;
        }
        const cJSON *name = jget(st, "id"), *ent = cJSON_IsString(name) ? jget(sp, name->valuestring) : NULL, *v;
        if (!ent) return terr(t, "%s.single: special token '%s' missing from special_tokens", where, cJSON_IsString(name) ? name->valuestring : "?");
        cJSON_ArrayForEach(v, jget(ent, "ids")) {
            int *cnt = after ? &t->n_suffix : &t->n_prefix;
            if (*cnt == 8) return terr(t, "%s.single: more than 8 special ids on one side", where);
            (after ? t->suffix : t->prefix)[(*cnt)++] = v->valueint;
        }
    }
    return 0;
}

/* By first byte, then longest first (leftmost-longest matching), then file order. */
static int cmp_added(const void *a, const void *b, void *ctx) {
    const struct added *ad = ctx;
    int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    unsigned fa = (unsigned char)ad[i].content[0], fb = (unsigned char)ad[j].content[0];
    if (fa != fb) return fa < fb ? -1 : 1;
    if (ad[i].len != ad[j].len) return ad[i].len > ad[j].len ? -1 : 1;
    return (i > j) - (i < j);
}

static void build_group(struct tokenizer *t, struct added_group *g, bool normalized) {
    g->idx = ds_malloc((t->n_added + 1) * sizeof *g->idx);
    for (size_t i = 0; i < t->n_added; i++)
        if (t->added[i].normalized == normalized && t->added[i].len) g->idx[g->n++] = (int32_t)i;
    qsort_r(g->idx, g->n, sizeof *g->idx, cmp_added, t->added);
    size_t k = 0;
    for (unsigned c = 0; c <= 256; c++) {
        g->start[c] = (uint32_t)k;
        while (c < 256 && k < g->n && (unsigned char)t->added[g->idx[k]].content[0] == c) k++;
    }
}

static int parse_model(struct tokenizer *t, const cJSON *root) {
    const cJSON *m = jget(root, "model"), *ty = jget(m, "type"), *vocab = jget(m, "vocab"), *merges = jget(m, "merges");
    const cJSON *added = jget(root, "added_tokens"), *x;
    if (!cJSON_IsObject(m)) return terr(t, "model: missing");
    if (ty && !(cJSON_IsString(ty) && !strcmp(ty->valuestring, "BPE")))
        return terr(t, "model.type '%s' is not supported (only BPE)", cJSON_IsString(ty) ? ty->valuestring : "?");
    if (!cJSON_IsObject(vocab)) return terr(t, "model.vocab: expected an object of token -> id");
    if (merges && !cJSON_IsArray(merges)) return terr(t, "model.merges: expected an array");
    static const char *unsupported[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int k = 0; k < 2; k++)
        if ((x = jget(m, unsupported[k])) && !cJSON_IsNull(x) && !(cJSON_IsString(x) && !x->valuestring[0]))
            return terr(t, "model.%s is not supported", unsupported[k]);
    if ((x = jget(m, "dropout")) && cJSON_IsNumber(x) && x->valuedouble > 0) return terr(t, "model.dropout > 0 is not supported");
    /* ids and the arena size first, so the arena never moves once keys point into it */
    size_t bytes = 0;
    int64_t max_id = -1;
    int i = 0;
    cJSON_ArrayForEach(x, vocab) {
        if (!cJSON_IsNumber(x) || x->valuedouble < 0 || x->valuedouble > 1e9 || x->valuedouble != (double)x->valueint)
            return terr(t, "model.vocab['%s']: expected a non-negative integer id", x->string);
        bytes += strlen(x->string) + 1;
        if (x->valueint > max_id) max_id = x->valueint;
    }
    if (added && !cJSON_IsArray(added)) return terr(t, "added_tokens: expected an array");
    /* A token flagged normalized is searched in normalized text, so its content goes through the
     * normalizer first, and the library then also gives that form back as the token's string. */
    size_t n_added = (size_t)cJSON_GetArraySize(added);
    char **astr = ds_calloc(n_added + 1, sizeof *astr);
    int rc = 0;
    cJSON_ArrayForEach(x, added) {
        const cJSON *c = jget(x, "content"), *id = jget(x, "id");
        if (!cJSON_IsString(c) || !cJSON_IsNumber(id) || id->valuedouble < 0 || id->valuedouble > 1e9) {
            rc = terr(t, "added_tokens[%d]: expected content (string) and id (non-negative integer)", i);
            goto out;
        }
        bool norm = jbool(x, "normalized", !jbool(x, "special", false));
        astr[i] = norm ? tok_normalize_text(t, c->valuestring, strlen(c->valuestring), NULL) : ds_strdup(c->valuestring);
        bytes += strlen(astr[i]) + 1;
        if (id->valueint > max_id) max_id = id->valueint;
        i++;
    }
    if (max_id >= INT32_MAX / 2) {
        rc = terr(t, "model.vocab: ids up to %lld", (long long)max_id);
        goto out;
    }
    t->n_ids = (int32_t)max_id + 1;
    t->arena = ds_malloc(bytes + 1);
    t->off = ds_malloc(((size_t)t->n_ids + 1) * sizeof *t->off);
    t->len = ds_calloc((size_t)t->n_ids + 1, sizeof *t->len);
    t->special = ds_calloc((size_t)t->n_ids + 1, 1);
    for (int32_t k = 0; k < t->n_ids; k++) t->off[k] = -1;
    size_t at = 0;
    cJSON_ArrayForEach(x, vocab) {
        size_t l = strlen(x->string);
        memcpy(t->arena + at, x->string, l + 1);
        t->off[x->valueint] = (int64_t)at, t->len[x->valueint] = (uint32_t)l;
        smap_put(&t->vocab, t->arena + at, l, x->valueint);
        at += l + 1;
    }
    t->n_added = n_added;
    t->added = ds_calloc(t->n_added + 1, sizeof *t->added);
    i = 0;
    cJSON_ArrayForEach(x, added) {
        struct added *a = &t->added[i];
        const char *c = astr[i++];
        size_t l = strlen(c);
        memcpy(t->arena + at, c, l + 1);
        *a = (struct added){.content = t->arena + at, .len = (uint32_t)l, .id = jget(x, "id")->valueint,
                            .special = jbool(x, "special", false), .lstrip = jbool(x, "lstrip", false),
                            .rstrip = jbool(x, "rstrip", false), .single_word = jbool(x, "single_word", false)};
        a->normalized = jbool(x, "normalized", !a->special);
        t->off[a->id] = (int64_t)at, t->len[a->id] = (uint32_t)l, t->special[a->id] = a->special;
        smap_put(&t->added_map, t->arena + at, l, a->id);
        at += l + 1;
    }
out:
    for (size_t k = 0; k < n_added; k++) free(astr[k]);
    free(astr);
    if (rc) return rc;
    const cJSON *unk = jget(m, "unk_token");
    t->unk_id = -1;
    if (cJSON_IsString(unk) && (t->unk_id = tok_token_to_id(t, unk->valuestring)) < 0)
        return terr(t, "model.unk_token '%s' is not in model.vocab", unk->valuestring);
    t->fuse_unk = jbool(m, "fuse_unk", false);
    t->byte_fallback = jbool(m, "byte_fallback", false);
    t->ignore_merges = jbool(m, "ignore_merges", false);
    /* merges: rank = position; the merged token must be in the vocab */
    size_t nm = (size_t)cJSON_GetArraySize(merges), cap = 1024;
    while (cap < 2 * nm + 2) cap *= 2;
    t->merges = (struct merge_map){ds_malloc(cap * sizeof(uint64_t)), ds_malloc(cap * sizeof(int32_t)),
                                   ds_malloc(cap * sizeof(int32_t)), cap};
    memset(t->merges.key, 0xFF, cap * sizeof(uint64_t));
    struct buf cat = {0};
    i = 0;
    cJSON_ArrayForEach(x, merges) {
        const char *a = NULL, *b = NULL;
        char *own = NULL;
        if (cJSON_IsString(x)) { /* "a b": the only space separates the two tokens */
            own = ds_strdup(x->valuestring);
            char *sp = strchr(own, ' ');
            if (!sp || strchr(sp + 1, ' ') || sp == own || !sp[1]) {
                free(own);
                return terr(t, "model.merges[%d]: '%s' is not two tokens separated by one space", i, x->valuestring);
            }
            *sp = 0, a = own, b = sp + 1;
        } else if (cJSON_GetArraySize(x) == 2 && cJSON_IsString(cJSON_GetArrayItem(x, 0)) && cJSON_IsString(cJSON_GetArrayItem(x, 1))) {
            a = cJSON_GetArrayItem(x, 0)->valuestring, b = cJSON_GetArrayItem(x, 1)->valuestring;
        } else {
            return terr(t, "model.merges[%d]: expected \"a b\" or [\"a\", \"b\"]", i);
        }
        cat.n = 0;
        buf_put(&cat, a, strlen(a));
        buf_put(&cat, b, strlen(b));
        int32_t *ia = smap_get(&t->vocab, a, strlen(a), hash_bytes(a, strlen(a)));
        int32_t *ib = smap_get(&t->vocab, b, strlen(b), hash_bytes(b, strlen(b)));
        int32_t *ic = smap_get(&t->vocab, cat.p, cat.n, hash_bytes(cat.p, cat.n));
        if (!ia || !ib || !ic) {
            rc = terr(t, "model.merges[%d] ('%s' + '%s'): token '%s' is not in model.vocab", i, a, b,
                          !ia ? a : !ib ? b : cat.p);
            free(own), free(cat.p);
            return rc;
        }
        size_t s = pair_slot(&t->merges, pair_key(*ia, *ib));
        t->merges.key[s] = pair_key(*ia, *ib), t->merges.rank[s] = i, t->merges.id[s] = *ic;
        free(own);
        i++;
    }
    free(cat.p);
    return 0;
}

static void init_byte_tables(struct tokenizer *t) {
    int n = 0;
    for (int b = 0; b < 256; b++) {
        bool keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
        t->byte_char[b] = keep ? b : 256 + n++;
    }
    memset(t->char_byte, 0xFF, sizeof t->char_byte);
    for (int b = 0; b < 256; b++) {
        t->char_byte[t->byte_char[b]] = (int16_t)b;
        char s[4];
        int l = (int)utf8proc_encode_char(t->byte_char[b], (utf8proc_uint8_t *)s);
        int32_t *v = smap_get(&t->vocab, s, (size_t)l, hash_bytes(s, (size_t)l));
        t->byte_id[b] = v ? *v : -1;
    }
}

size_t tok_byte_level_encode(const void *bytes, size_t n, char *out) {
    struct tokenizer tmp; /* only the byte tables are used */
    const unsigned char *b = bytes;
    size_t o = 0;
    memset(&tmp, 0, sizeof tmp);
    init_byte_tables(&tmp);
    for (size_t i = 0; i < n; i++) o += (size_t)utf8proc_encode_char(tmp.byte_char[b[i]], (utf8proc_uint8_t *)out + o);
    out[o] = 0;
    return o;
}

struct tokenizer *tok_load_text(const char *json, size_t len, const char *source) {
    struct tokenizer *t = ds_calloc(1, sizeof *t);
    snprintf(t->source, sizeof t->source, "%s", source);
    t->md = pcre2_match_data_create(1, NULL);
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root || !cJSON_IsObject(root)) {
        const char *e = cJSON_GetErrorPtr();
        size_t at = e && e >= json && e <= json + len ? (size_t)(e - json) : 0;
        terr(t, "not valid JSON (near byte %zu)", at);
        goto fail;
    }
    const cJSON *dec = jget(root, "decoder");
    if (parse_normalizer(t, jget(root, "normalizer"), "normalizer") || parse_pre(t, jget(root, "pre_tokenizer"), "pre_tokenizer") ||
        parse_model(t, root))
        goto fail;
    if (dec && !cJSON_IsNull(dec)) {
        if (strcmp(jtype(dec), "ByteLevel")) {
            terr(t, "decoder: type '%s' is not supported (supported: ByteLevel or null)", jtype(dec));
            goto fail;
        }
        t->decode_byte_level = true;
    }
    const cJSON *pp = jget(root, "post_processor");
    if (pp && !cJSON_IsNull(pp)) {
        if (add_template_ids(t, pp, "post_processor")) goto fail;
        if (t->n_prefix || t->n_suffix) t->policy = 2;
        snprintf(t->policy_text, sizeof t->policy_text, "%s: post_processor adds %d id(s) before the text, %d after",
                 source, t->n_prefix, t->n_suffix);
    }
    for (int b = 0; b < 2; b++)
        for (int k = 0; k < (b ? t->n_suffix : t->n_prefix); k++)
            if (!tok_id_to_token(t, (b ? t->suffix : t->prefix)[k])) {
                terr(t, "post_processor: id %d is not a token", (b ? t->suffix : t->prefix)[k]);
                goto fail;
            }
    init_byte_tables(t);
    build_group(t, &t->raw_group, false);
    build_group(t, &t->norm_group, true);
    cJSON_Delete(root);
    return t;
fail:
    cJSON_Delete(root);
    tok_free(t);
    return NULL;
}

static char *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    struct buf b = {0};
    char tmp[65536];
    size_t r;
    while ((r = fread(tmp, 1, sizeof tmp, f)) > 0) buf_put(&b, tmp, r);
    fclose(f);
    if (!b.p) buf_reserve(&b, 0), b.p[0] = 0;
    *len = b.n;
    return b.p;
}

/* tokenizer_config.json: add_bos_token / add_eos_token decide the framing when present. */
static int read_tokenizer_config(struct tokenizer *t, const char *path) {
    size_t len;
    char *txt = slurp(path, &len);
    if (!txt) return 0;
    cJSON *c = cJSON_ParseWithLength(txt, len);
    free(txt);
    if (!c) {
        ds_err_set("%s: not valid JSON", path);
        return -1;
    }
    const cJSON *ab = jget(c, "add_bos_token"), *ae = jget(c, "add_eos_token");
    int rc = 0;
    if (cJSON_IsBool(ab) || cJSON_IsBool(ae)) {
        t->n_prefix = t->n_suffix = 0;
        for (int k = 0; k < 2 && !rc; k++) {
            if (!cJSON_IsTrue(k ? ae : ab)) continue;
            const cJSON *tk = jget(c, k ? "eos_token" : "bos_token");
            if (cJSON_IsObject(tk)) tk = jget(tk, "content");
            int32_t id = cJSON_IsString(tk) ? tok_token_to_id(t, tk->valuestring) : -1;
            if (id < 0) {
                ds_err_set("%s: add_%s_token is true but %s_token is missing or not a token", path, k ? "eos" : "bos", k ? "eos" : "bos");
                rc = -1;
            }
            if (k) t->suffix[t->n_suffix++] = id;
            else t->prefix[t->n_prefix++] = id;
        }
        t->policy = 1;
        snprintf(t->policy_text, sizeof t->policy_text, "%s: add_bos_token=%s add_eos_token=%s", path,
                 cJSON_IsTrue(ab) ? "true" : "false", cJSON_IsTrue(ae) ? "true" : "false");
    }
    cJSON_Delete(c);
    return rc;
}

struct tokenizer *tok_load(const char *path) {
    size_t len;
    char *txt = slurp(path, &len);
    if (!txt) {
        ds_err_set("%s: cannot open: %s", path, ds_errno_str());
        return NULL;
    }
    struct tokenizer *t = tok_load_text(txt, len, path);
    free(txt);
    if (!t) return NULL;
    char cfg[600];
    const char *slash = strrchr(path, '/');
    snprintf(cfg, sizeof cfg, "%.*stokenizer_config.json", slash ? (int)(slash - path + 1) : 0, path);
    if (read_tokenizer_config(t, cfg)) {
        tok_free(t);
        return NULL;
    }
    return t;
}

struct tokenizer *tok_open_model(const char *dir, const char *path, int32_t bos_id, bool *missing) {
    char p[1100];
    snprintf(p, sizeof p, "%s/tokenizer.json", dir);
    if (path) snprintf(p, sizeof p, "%s", path);
    struct stat sb;
    *missing = stat(p, &sb) != 0;
    if (*missing) return NULL;
    struct tokenizer *t = tok_load(p);
    if (t) tok_set_default_bos(t, bos_id);
    return t;
}

void tok_free(struct tokenizer *t) {
    if (!t) return;
    for (int k = 0; k < t->n_norm; k++) pattern_free(&t->norm[k].pat), free(t->norm[k].text);
    for (int k = 0; k < t->n_pre; k++) pattern_free(&t->pre[k].pat);
    for (size_t i = 0; i < t->n_chunks; i++) free(t->cache_chunks[i]);
    free(t->cache_chunks), free(t->cache_ids);
    smap_free(&t->cache), smap_free(&t->vocab), smap_free(&t->added_map);
    free(t->merges.key), free(t->merges.rank), free(t->merges.id);
    free(t->arena), free(t->off), free(t->len), free(t->special), free(t->added);
    free(t->raw_group.idx), free(t->norm_group.idx);
    free(t->nbuf.p), free(t->pbuf.p), free(t->sp.v), free(t->pieces.v), free(t->pieces2.v);
    free(t->sym), free(t->nxt), free(t->prv), free(t->heap);
    if (t->md) pcre2_match_data_free(t->md);
    free(t);
}

/* ================================================================================================
 * Prompts: BOS policy and the chat format
 *
 * Chat format (DeepSeek-V4.1, one user turn), as rendered by the release's encoding_dsv41.py
 * (known through SGLang's python/sglang/srt/entrypoints/openai/encoding_dsv41.py, "adapted from
 * the DeepSeek-V4.1 release reference implementation", and independent ports that agree):
 *   chat:      BOS [<｜System｜>SYSTEM] <｜User｜>TEXT <｜Assistant｜></think>
 *   thinking:  BOS <｜System｜>Reasoning Effort: N (range 1-100, the higher the value, the more
 *              thorough the reasoning)\n\n [SYSTEM] <｜User｜>TEXT <｜Assistant｜><think>
 * (no spaces between the parts). The chat text carries its own BOS, so nothing else is added. */

void tok_set_default_bos(struct tokenizer *t, int32_t default_bos) {
    if (t->policy) return;
    t->n_prefix = 0, t->n_suffix = 0;
    if (default_bos >= 0) t->prefix[t->n_prefix++] = default_bos;
    snprintf(t->policy_text, sizeof t->policy_text,
             "%s: no tokenizer_config.json add_bos_token and no post_processor: BOS %d from the model config",
             t->source, default_bos);
}

const char *tok_bos_policy(const struct tokenizer *t) { return t->policy_text; }

static int need_special(const struct tokenizer *t, const char *tok) {
    int32_t id = tok_token_to_id(t, tok);
    if (id >= 0 && smap_get(&t->added_map, tok, strlen(tok), hash_bytes(tok, strlen(tok)))) return 0;
    ds_err_set("%s: the chat format needs the added token %s, which this tokenizer does not have", t->source, tok);
    return -1;
}

char *tok_chat_text(const struct tokenizer *t, const char *user, const struct tok_prompt_opts *o) {
    const char *sys_tok = "<｜System｜>", *user_tok = "<｜User｜>", *asst_tok = "<｜Assistant｜>";
    bool think = o->chat == TOK_CHAT_THINKING;
    const char *bos = t->n_prefix ? tok_id_to_token(t, t->prefix[0]) : tok_id_to_token(t, tok_token_to_id(t, "<｜begin▁of▁sentence｜>"));
    if (!bos) {
        ds_err_set("%s: the chat format needs a BOS token", t->source);
        return NULL;
    }
    if (need_special(t, user_tok) || need_special(t, asst_tok) || need_special(t, think ? "<think>" : "</think>") ||
        ((think || o->system) && need_special(t, sys_tok)))
        return NULL;
    if (think && (o->reasoning_effort < 1 || o->reasoning_effort > 100)) {
        ds_err_set("reasoning effort %d: must be 1..100", o->reasoning_effort);
        return NULL;
    }
    char eff[160];
    snprintf(eff, sizeof eff, "Reasoning Effort: %d (range 1-100, the higher the value, the more thorough the reasoning)\n\n",
             o->reasoning_effort);
    const char *parts[] = {bos, think || o->system ? sys_tok : "", think ? eff : "", o->system ? o->system : "",
                           user_tok, user, asst_tok, think ? "<think>" : "</think>"};
    struct buf b = {0};
    for (size_t k = 0; k < sizeof parts / sizeof *parts; k++) buf_put(&b, parts[k], strlen(parts[k]));
    return b.p;
}

int tok_encode_prompt(struct tokenizer *t, const char *text, size_t len, const struct tok_prompt_opts *o, struct tok_ids *out) {
    if (o && o->chat != TOK_CHAT_NONE) {
        if (memchr(text, 0, len)) {
            ds_err_set("text contains a NUL character");
            return -1;
        }
        char *s = tok_chat_text(t, text, o);
        if (!s) return -1;
        int rc = tok_encode(t, s, strlen(s), out);
        free(s);
        return rc;
    }
    for (int k = 0; k < t->n_prefix; k++) ids_push(out, t->prefix[k]);
    if (tok_encode(t, text, len, out)) return -1;
    for (int k = 0; k < t->n_suffix; k++) ids_push(out, t->suffix[k]);
    return 0;
}

/* ================================================================================================
 * Engram compressed-token map (MODEL.md §3.4; the reference builds it with the `tokenizers`
 * normalizers Sequence[NFKC, NFD, StripAccents, Lowercase, Replace([ \t\r\n]+ -> " "),
 * Replace(^ $ -> U+E000), Strip, Replace(U+E000 -> " ")]) */

const char *tok_engram_map_version(void) {
    static char v[96];
    snprintf(v, sizeof v, "%s utf8proc %s unicode %s", ENGRAM_MAP_VERSION, utf8proc_version(), utf8proc_unicode_version());
    return v;
}

static void engram_normalize(const char *s, size_t n, struct buf *out) {
    struct buf a = {0}, b = {0};
    unicode_form(s, n, UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT, &a); /* NFKC */
    unicode_form(a.p, a.n, UTF8PROC_STABLE | UTF8PROC_DECOMPOSE, &b);           /* NFD */
    /* StripAccents, Lowercase and the whitespace collapse in one pass: a dropped mark between two
     * blanks does not interrupt the run, exactly as if the steps ran one after the other */
    a.n = 0;
    bool in_ws = false;
    for (size_t i = 0; i < b.n;) {
        int32_t c = next_cp(b.p, b.n, &i);
        if (is_mark(c)) continue;
        if (c == ' ' || c == '\t' || c == '\r' || c == '\n') {
            if (!in_ws) buf_putc(&a, ' ');
            in_ws = true;
            continue;
        }
        in_ws = false;
        lower_cp(&a, c);
    }
    out->n = 0;
    if (a.n == 1 && a.p[0] == ' ') {
        buf_putc(out, ' '); /* the lone space survives the strip (the sentinel step) */
    } else {
        struct norm_step strip = {.kind = NK_STRIP, .left = true, .right = true};
        apply_norm(NULL, &strip, a.p ? a.p : "", a.n, out);
        /* the sentinel's way back also turns any U+E000 already in the text into a space (a byte
         * search is safe: UTF-8 never matches inside another character) */
        for (char *q; out->n && (q = memmem(out->p, out->n, "\xEE\x80\x80", 3));) {
            *q = ' ';
            memmove(q + 1, q + 3, out->n - (size_t)(q + 3 - out->p) + 1);
            out->n -= 2;
        }
    }
    free(a.p), free(b.p);
}

char *tok_engram_key(const struct tokenizer *t, int32_t id, size_t *len_out) {
    size_t n;
    char *text = tok_decode(t, &id, 1, false, &n);
    struct buf key = {0};
    if (memmem(text, n, "\xEF\xBF\xBD", 3)) {
        const char *raw = tok_id_to_token(t, id);
        buf_put(&key, raw, raw ? t->len[id] : 0);
    } else {
        engram_normalize(text, n, &key);
        if (!key.n) buf_put(&key, text, n);
    }
    free(text);
    if (!key.p) buf_reserve(&key, 0), key.p[0] = 0;
    if (len_out) *len_out = key.n;
    return key.p;
}

int32_t *tok_engram_map(const struct tokenizer *t, int32_t min_ids, int32_t tail_id, int32_t *n_out, int32_t *n_classes) {
    int32_t n = t->n_ids > min_ids ? t->n_ids : min_ids;
    int32_t *map = ds_malloc(((size_t)n + 1) * sizeof *map);
    char **keys = ds_malloc(((size_t)n + 1) * sizeof *keys);
    struct smap seen = {0};
    int32_t classes = 0;
    for (int32_t id = 0; id < n; id++) {
        size_t l;
        keys[id] = NULL;
        if (id >= t->n_ids && tail_id >= 0 && tail_id < t->n_ids) { map[id] = map[tail_id]; continue; }
        keys[id] = tok_engram_key(t, id, &l);
        int32_t *v = smap_get(&seen, keys[id], l, hash_bytes(keys[id], l));
        map[id] = v ? *v : classes;
        if (!v) smap_put(&seen, keys[id], l, classes++);
    }
    for (int32_t id = 0; id < n; id++) free(keys[id]);
    free(keys), smap_free(&seen);
    *n_out = n, *n_classes = classes;
    return map;
}
