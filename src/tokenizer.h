/* Text <-> token ids for the release's tokenizer.json (HF `tokenizers` format, byte-level BPE), and
 * the Engram compressed-token map built from it (MODEL.md §3.4).
 *
 * Users give text, and Engram hashes n-grams of *compressed* ids whose map is defined by decoding
 * every token of the tokenizer, so the engine needs the tokenizer itself, reproduced id for id.
 * What is read: model BPE (vocab, merges as "a b" strings or ["a","b"] pairs, unk_token,
 * byte_fallback, ignore_merges), added_tokens (special / normalized / lstrip / rstrip /
 * single_word), normalizer (null, NFC, NFD, NFKC, NFKD, Lowercase, Strip, StripAccents, Replace,
 * Prepend, Sequence), pre_tokenizer (Sequence, Split with a String or Regex pattern and any
 * behaviour, ByteLevel with or without its own regex, Digits), post_processor (null, ByteLevel,
 * TemplateProcessing, RobertaProcessing, BertProcessing, Sequence) and decoder (null, ByteLevel).
 * Anything else is one error line naming the component and the file. Regexes (written for the
 * library's Oniguruma) run in PCRE2 (UTF + UCP) with \s \S \h \H \w \W rewritten to Oniguruma's
 * meaning; Unicode normalization and case mapping come from utf8proc.
 *
 * A tokenizer keeps scratch buffers and a word cache: one tokenizer per thread. */
#ifndef DS_TOKENIZER_H
#define DS_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct tokenizer;

/* A growable id list (tok_encode appends to it). */
struct tok_ids {
    int32_t *ids;
    size_t n, cap;
};
void tok_ids_free(struct tok_ids *v);

/* Load `path` (a tokenizer.json). A tokenizer_config.json next to it, when present, is read for
 * add_bos_token / add_eos_token / bos_token / eos_token. Returns NULL with ds_err_set("<file>: ...").
 * tok_load_text: the same from memory; `source` names it in errors; no tokenizer_config.json. */
struct tokenizer *tok_load(const char *path);
struct tokenizer *tok_load_text(const char *json, size_t len, const char *source);
void tok_free(struct tokenizer *t);
/* The tokenizer of a model folder, as generate and the HDF5 prompt path find it: `path` when not
 * NULL, else DIR/tokenizer.json; its BOS default is the config's bos_token_id (see below). Returns
 * NULL with *missing = true when the file does not exist (no error set), or NULL with ds_err_set
 * for a bad file. */
struct tokenizer *tok_open_model(const char *dir, const char *path, int32_t bos_id, bool *missing);

/* Ids are 0..tok_n_ids()-1; an id no entry names (a hole) decodes to nothing. */
int32_t tok_n_ids(const struct tokenizer *t);
int32_t tok_token_to_id(const struct tokenizer *t, const char *token); /* -1 when unknown */
const char *tok_id_to_token(const struct tokenizer *t, int32_t id);    /* NULL for a hole */
bool tok_is_special(const struct tokenizer *t, int32_t id);

/* Encode UTF-8 text exactly as tokenizers' `encode(text, add_special_tokens=False)`: added tokens
 * found in the text first, then normalizer, pre-tokenizer and BPE. Appends to `out`.
 * Invalid UTF-8 is an error (-1, ds_err_set) since the reference cannot represent it. */
int tok_encode(struct tokenizer *t, const char *text, size_t len, struct tok_ids *out);

/* Decode as tokenizers' `decode(ids, skip_special_tokens)`: the decoder's bytes, invalid UTF-8
 * replaced by U+FFFD per maximal invalid subsequence (Rust's from_utf8_lossy), so the result is
 * always valid UTF-8. Returns a malloc'd NUL-terminated string; *len_out (optional) its length.
 * Ids outside 0..n_ids-1 are skipped, as the library does for ids it does not know. */
char *tok_decode(const struct tokenizer *t, const int32_t *ids, size_t n, bool skip_special, size_t *len_out);

/* Diagnostics and tests: the normalizer's output (malloc'd; the text itself without normalizer),
 * and the pre-tokenizer's pieces of a text holding no added token, as raw bytes before the
 * byte-level mapping (*pieces and each piece malloc'd). */
char *tok_normalize_text(struct tokenizer *t, const char *text, size_t len, size_t *len_out);
int tok_pre_tokenize(struct tokenizer *t, const char *text, size_t len, char ***pieces, size_t *n);

/* GPT-2's byte-level spelling of raw bytes (what ByteLevel maps them to before BPE): writes a
 * NUL-terminated string of at most 2n bytes + NUL to out and returns its length. */
size_t tok_byte_level_encode(const void *bytes, size_t n, char *out);

/* ---- prompts ---------------------------------------------------------------------------------- */

/* Where the BOS/EOS that frame a plain text prompt come from, in this order:
 *  1. tokenizer_config.json's add_bos_token / add_eos_token (with its bos_token / eos_token), as
 *     transformers rebuilds the post-processor from them;
 *  2. the tokenizer.json post_processor (TemplateProcessing "single", Roberta/Bert cls+sep);
 *  3. neither says anything: BOS = `default_bos` (the model config's bos_token_id), no EOS. */
void tok_set_default_bos(struct tokenizer *t, int32_t default_bos);
/* One line saying which of the three rules applies and what it adds, for logs. */
const char *tok_bos_policy(const struct tokenizer *t);

enum tok_chat { TOK_CHAT_NONE = 0, TOK_CHAT_PLAIN, TOK_CHAT_THINKING };

struct tok_prompt_opts {
    enum tok_chat chat;  /* NONE: the text as is, framed by the BOS policy above */
    const char *system;  /* chat only: optional system message (NULL = none) */
    int reasoning_effort; /* TOK_CHAT_THINKING only: 1..100 */
};

/* The DeepSeek-V4.1 chat prompt for one user message (see tokenizer.c, "Chat format"), malloc'd.
 * Fails (NULL, ds_err_set) when the tokenizer lacks one of the special tokens it needs. */
char *tok_chat_text(const struct tokenizer *t, const char *user, const struct tok_prompt_opts *o);

/* Text prompt -> ids: chat formatting (its BOS is part of the template) or the BOS policy. */
int tok_encode_prompt(struct tokenizer *t, const char *text, size_t len, const struct tok_prompt_opts *o,
                      struct tok_ids *out);

/* ---- Engram compressed-token map (MODEL.md §3.4) ---------------------------------------------- */

/* map[id] for the tokenizer's ids 0..tok_n_ids-1 (the reference's range(len(tokenizer))): decode
 * the id alone (specials kept); a text containing U+FFFD keys by the raw token string, otherwise
 * by NFKC, NFD, strip accents (every mark: Mn, Mc, Me, as the library's StripAccents), lowercase,
 * [ \t\r\n]+ -> " ", a lone " " protected from the strip, strip (White_Space), or the text itself
 * if that leaves nothing; classes numbered in first-seen order. When the model's vocabulary is
 * larger (min_ids > tok_n_ids) the rows no token names get the class of `tail_id` (the caller
 * passes engram_pad_token_id), so they add no class the reference would not count; tail_id < 0
 * or not a token id: they decode to nothing like any unknown id and share that key's class.
 * Returns the malloc'd map with *n_out = max(tok_n_ids, min_ids) entries and *n_classes. */
int32_t *tok_engram_map(const struct tokenizer *t, int32_t min_ids, int32_t tail_id, int32_t *n_out, int32_t *n_classes);

/* The key the map above gives one id (malloc'd, *len_out its length), for tests and diagnostics. */
char *tok_engram_key(const struct tokenizer *t, int32_t id, size_t *len_out);

/* Version string of the map builder and of the Unicode tables it used; a cached map from another
 * version is rebuilt. */
const char *tok_engram_map_version(void);

#endif /* DS_TOKENIZER_H */
