#!/usr/bin/env bash
# Text in, text out (issue #8), through the CLI. TAP lines.
# - mkmodel writes a tokenizer.json for its presets whose Engram map has exactly the config's class
#   count, so a folder without the engram.safetensors sidecar loads (map built, cached by hash);
# - a JSONL file of {"text": ...} prompts runs through `generate` on the tiny model and returns the
#   decoded text next to the tokens (checked against an independent byte-level decode);
# - a text prompt gives exactly the tokens of the same prompt given as the golden tokenizer's ids
#   (cases.jsonl), with the BOS policy and with --chat;
# - the cache follows the tokenizer file's hash and $DSBATCH_CACHE_DIR; a class-count mismatch and
#   every bad input are one error line;
# - the real vocabulary size: 129,280 ids, 99,092 classes.
set -u
DSBATCH=${DSBATCH:-build/dsbatch}
GOLDEN=${GOLDEN:-../shared/golden}
T=$(mktemp -d "${TMPDIR:-/tmp}/dsbatch_text.XXXXXX")
trap '[ -n "${KEEP:-}" ] || rm -rf "$T"' EXIT
ok() { echo "ok - $1"; }
nok() { echo "not ok - $1"; [ -n "${2:-}" ] && printf '%s\n' "$2" | head -20 | sed 's/^/#   /'; return 0; }
check() { if eval "$2"; then ok "$1"; else nok "$1" "${3:-}"; fi; }
# expect_error NAME PATTERN CMD...: non-zero exit, exactly one stderr line, matching PATTERN
expect_error() {
  local name=$1 pat=$2; shift 2
  "$@" >"$T/stdout" 2>"$T/stderr"; local rc=$?
  if [ $rc -ne 0 ] && [ "$(wc -l <"$T/stderr")" -eq 1 ] && grep -qE -- "$pat" "$T/stderr"; then ok "$name"
  else nok "$name" "exit $rc, wanted one line /$pat/: $(cat "$T/stderr")"; fi
}
TOK=$GOLDEN/tokenizer/tokenizer.json

# ------------------------------------------------------------------ mkmodel's tokenizer
"$DSBATCH" mkmodel --preset tiny --seed 1 --out "$T/tiny" >/dev/null
check "mkmodel tiny writes tokenizer.json: 512 ids, byte symbols, specials at bos/eos/pad, ByteLevel decoder" 'python3 -c "
import json
t = json.load(open(\"$T/tiny/tokenizer.json\"))
ids = sorted(t[\"model\"][\"vocab\"].values())
assert ids == list(range(512)), ids[:10]
sp = {a[\"id\"]: a[\"content\"] for a in t[\"added_tokens\"] if a[\"special\"]}
assert sp[0] == \"<｜begin▁of▁sentence｜>\" and sp[1] == \"<｜end▁of▁sentence｜>\" and sp[2] == \"<｜▁pad▁｜>\", sp
assert \"<｜User｜>\" in sp.values() and \"<｜Assistant｜>\" in sp.values() and \"</think>\" in sp.values()
assert t[\"decoder\"][\"type\"] == \"ByteLevel\" and len(t[\"model\"][\"merges\"]) == 512 - len(sp) - 256
"'

# ------------------------------------------------------------------ text prompts end to end
cat > "$T/p.jsonl" <<'EOF'
{"id": "en", "text": "The quick brown fox jumps over the lazy dog.", "max_new_tokens": 12}
{"id": "mixed", "text": "Ünïcödé 123 中文 😀 <think>", "max_new_tokens": 12}
{"id": "ids", "tokens": [0, 40, 41, 42], "max_new_tokens": 12}
EOF
"$DSBATCH" generate --model "$T/tiny" --prompts "$T/p.jsonl" --out "$T/o.jsonl" --quiet --max-seq-len 128 2>"$T/err"
cat > "$T/decode.py" <<'EOF'
# independent ByteLevel decode: GPT-2's byte <-> char table, specials skipped, invalid UTF-8 -> U+FFFD
import json, sys
bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
cs = bs[:] + [256 + i for i in range(256 - len(bs))]
bs += [b for b in range(256) if b not in bs]
back = {chr(c): b for b, c in zip(bs, cs)}
tok = json.load(open(sys.argv[1]))
inv = {i: s for s, i in tok["model"]["vocab"].items()}
special = {a["id"] for a in tok["added_tokens"] if a["special"]}
def decode(ids):
    out = b""
    for i in ids:
        if i in special: continue
        s = inv[i]
        out += bytes(back[c] for c in s) if all(c in back for c in s) else s.encode()
    return out.decode("utf-8", "replace")
for line in open(sys.argv[2]):
    r = json.loads(line)
    assert isinstance(r["text"], str) and r["text"] == decode(r["output_tokens"]), (r["id"], r["text"], decode(r["output_tokens"]))
    assert len(r["output_tokens"]) == 12 or r["finish_reason"] == "stop"
print("ok")
EOF
check "generate: a text prompt file on the tiny model returns text; \"text\" = the output tokens decoded" \
  '[ "$(wc -l < "$T/o.jsonl")" -eq 3 ] && python3 "$T/decode.py" "$T/tiny/tokenizer.json" "$T/o.jsonl" >/dev/null' "$(cat "$T/err" "$T/o.jsonl")"
"$DSBATCH" score --model "$T/tiny" --prompts "$T/p.jsonl" --out "$T/s.jsonl" --max-seq-len 128 2>/dev/null
check "score: text prompts are scored too (BOS + ids, n_tokens = len - 1)" \
  'python3 -c "import json; r=[json.loads(l) for l in open(\"$T/s.jsonl\")]; assert len(r)==3 and all(x[\"n_tokens\"]==len(x[\"token_logprobs\"])>2 for x in r)"'

# ------------------------------------------------------------------ text == the library's ids
# A tiny model with room for the golden tokenizer's 6,000 ids; greedy outputs of a text prompt and
# of the same prompt as ids must be identical.
"$DSBATCH" mkmodel --preset tiny --seed 4 --vocab_size 6016 --dspark_noise_token_id 6015 --out "$T/v6k" >/dev/null
python3 - "$GOLDEN/tokenizer/cases.jsonl" "$T" <<'EOF'
import json, sys
cases = [json.loads(l) for l in open(sys.argv[1])]
pick = [c for c in cases if c["ids"]][:12] + [c for c in cases if 0 in c["ids"] or 5 in c["ids"]]
with open(sys.argv[2] + "/text.jsonl", "w") as t, open(sys.argv[2] + "/ids.jsonl", "w") as i, \
     open(sys.argv[2] + "/chat_ids.jsonl", "w") as c:
    for k, x in enumerate(pick):
        t.write(json.dumps({"id": k, "text": x["text"], "max_new_tokens": 4}) + "\n")
        i.write(json.dumps({"id": k, "tokens": [0] + x["ids"], "max_new_tokens": 4}) + "\n")
        c.write(json.dumps({"id": k, "tokens": [0, 3] + x["ids"] + [4, 6], "max_new_tokens": 4}) + "\n")
EOF
G="$DSBATCH generate --model $T/v6k --tokenizer $TOK --quiet --max-seqs 4 --max-seq-len 256"
$G --prompts "$T/text.jsonl" --out "$T/ot.jsonl" 2>"$T/err"
$G --prompts "$T/ids.jsonl" --out "$T/oi.jsonl" 2>>"$T/err"
check "text prompts = the golden tokenizer's ids with the config's BOS (same generated tokens, 13 cases)" \
  'python3 -c "
import json
a=[json.loads(l)[\"output_tokens\"] for l in open(\"$T/ot.jsonl\")]; b=[json.loads(l)[\"output_tokens\"] for l in open(\"$T/oi.jsonl\")]
assert len(a)==len(b)>=13 and a==b"' "$(cat "$T/err")"
$G --prompts "$T/text.jsonl" --out "$T/oc.jsonl" --chat 2>"$T/err"
$G --prompts "$T/chat_ids.jsonl" --out "$T/oci.jsonl" 2>>"$T/err"
check "--chat: <bos><｜User｜>TEXT<｜Assistant｜></think> (same generated tokens as those ids)" \
  'python3 -c "
import json
a=[json.loads(l)[\"output_tokens\"] for l in open(\"$T/oc.jsonl\")]; b=[json.loads(l)[\"output_tokens\"] for l in open(\"$T/oci.jsonl\")]
assert a==b and len(a)>=13"' "$(cat "$T/err")"
expect_error "--think on a tokenizer without <｜System｜>: one error naming the token" "System" \
  $G --prompts "$T/text.jsonl" --out "$T/x.jsonl" --think 50

# ------------------------------------------------------------------ Engram map from tokenizer.json
cp -r "$T/tiny" "$T/nosc" && rm "$T/nosc/engram.safetensors"
"$DSBATCH" generate --model "$T/nosc" --prompts "$T/p.jsonl" --out "$T/n1.jsonl" --quiet --max-seq-len 128 2>"$T/err"; rc=$?
key=$(sha256sum "$T/nosc/tokenizer.json" | cut -c1-16)
C="$T/nosc/engram_map.$key.safetensors"
check "no sidecar: the map is built from tokenizer.json (256 classes) and cached as engram_map.<sha256[:16]>" \
  '[ $rc -eq 0 ] && [ -f "$C" ] && python3 -c "
import json,struct,array
b=open(\"$C\",\"rb\").read(); n=struct.unpack(\"<Q\",b[:8])[0]; h=json.loads(b[8:8+n])
m=array.array(\"i\"); m.frombytes(b[8+n:])
assert h[\"__metadata__\"][\"n_classes\"]==\"256\" and len(m)==512 and max(m)==255 and h[\"__metadata__\"][\"tokenizer_sha256\"].startswith(\"$key\")"' "$(cat "$T/err")"
ino=$(stat -c %i "$C")
"$DSBATCH" generate --model "$T/nosc" --prompts "$T/p.jsonl" --out "$T/n2.jsonl" --quiet --max-seq-len 128 2>/dev/null
check "second run reads the cache (same file, same outputs)" '[ "$(stat -c %i "$C")" = "$ino" ] && cmp -s "$T/n1.jsonl" "$T/n2.jsonl"'
echo >> "$T/nosc/tokenizer.json"
"$DSBATCH" generate --model "$T/nosc" --prompts "$T/p.jsonl" --out "$T/n3.jsonl" --quiet --max-seq-len 128 2>/dev/null
check "an edited tokenizer.json gets its own cache entry (keyed by the file's hash)" \
  '[ "$(ls "$T"/nosc/engram_map.*.safetensors | wc -l)" -eq 2 ] && cmp -s "$T/n1.jsonl" "$T/n3.jsonl"'
mkdir -p "$T/cache"
DSBATCH_CACHE_DIR="$T/cache" "$DSBATCH" generate --model "$T/nosc" --prompts "$T/p.jsonl" --out "$T/n4.jsonl" --quiet --max-seq-len 128 2>/dev/null
check "DSBATCH_CACHE_DIR holds the cache instead of the model folder" \
  '[ "$(ls "$T"/cache/engram_map.*.safetensors | wc -l)" -eq 1 ] && cmp -s "$T/n1.jsonl" "$T/n4.jsonl"'
"$DSBATCH" generate --model "$T/tiny" --prompts "$T/p.jsonl" --out "$T/n5.jsonl" --quiet --max-seq-len 128 2>/dev/null
check "the engram.safetensors sidecar still overrides (no cache written next to it)" \
  '[ -s "$T/n5.jsonl" ] && ! ls "$T"/tiny/engram_map.* >/dev/null 2>&1'
cp -r "$T/tiny" "$T/mismatch" && rm "$T/mismatch/engram.safetensors" && cp "$TOK" "$T/mismatch/tokenizer.json"
expect_error "class count != engram_compressed_vocab_size: one error naming tokenizer.json and both numbers" \
  "mismatch/tokenizer.json: .*4339 classes.*engram_compressed_vocab_size = 256" \
  "$DSBATCH" generate --model "$T/mismatch" --prompts "$T/p.jsonl" --out "$T/x.jsonl"

# ------------------------------------------------------------------ bad input
expect_error "text prompt on a folder without tokenizer.json: one error naming the line and tokenizer.json" \
  "p.jsonl:1: a text prompt needs a tokenizer.*tokenizer.json" \
  "$DSBATCH" generate --model "$GOLDEN/small6" --prompts "$T/p.jsonl" --out "$T/x.jsonl"
echo '{"id": 1, "text": "a", "tokens": [1]}' > "$T/both.jsonl"
expect_error "tokens and text on one line: one error" "both.jsonl:1: give either tokens or text" \
  "$DSBATCH" generate --model "$T/tiny" --prompts "$T/both.jsonl" --out "$T/x.jsonl"
cp -r "$T/tiny" "$T/badtok"
printf '{"model": {"type": "BPE", "vocab": {"a": 0,}}' > "$T/badtok/tokenizer.json"
expect_error "malformed tokenizer.json in the model folder: one error naming it (bad JSON)" "badtok/tokenizer.json: not valid JSON" \
  "$DSBATCH" generate --model "$T/badtok" --prompts "$T/p.jsonl" --out "$T/x.jsonl"
printf '{"model": {"type": "Unigram", "vocab": {"a": 0}}}' > "$T/badtok/tokenizer.json"
expect_error "malformed tokenizer.json: unknown model type" "badtok/tokenizer.json: model.type 'Unigram' is not supported" \
  "$DSBATCH" generate --model "$T/badtok" --prompts "$T/p.jsonl" --out "$T/x.jsonl"
printf '{"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": ["a b"]}}' > "$T/badtok/tokenizer.json"
expect_error "malformed tokenizer.json: a merge naming a missing token" "badtok/tokenizer.json: model.merges\[0\].*'ab' is not in model.vocab" \
  "$DSBATCH" generate --model "$T/badtok" --prompts "$T/p.jsonl" --out "$T/x.jsonl"
printf '{"id": 1, "text": "Hello"}\n' > "$T/big.jsonl"
expect_error "a tokenizer with ids past the model's vocabulary: one error naming the token" "outside the model's vocabulary" \
  "$DSBATCH" generate --model "$T/tiny" --tokenizer "$TOK" --prompts "$T/big.jsonl" --out "$T/x.jsonl"

# ------------------------------------------------------------------ the real vocabulary size
"$DSBATCH" mkmodel --preset tiny --vocab_size 129280 --engram_compressed_vocab_size 99092 --dspark_noise_token_id 129279 \
  --out "$T/real" >/dev/null 2>"$T/err" && rm "$T/real/engram.safetensors"
start=$(date +%s.%N)
"$DSBATCH" inspect "$T/real" >/dev/null 2>>"$T/err"; rc=$?
end=$(date +%s.%N)
check "129,280 ids: mkmodel's tokenizer.json gives 99,092 Engram classes, map built at load ($(python3 -c "print('%.2f' % ($end - $start))") s)" \
  '[ $rc -eq 0 ] && python3 -c "
import json,struct,glob
b=open(glob.glob(\"$T/real/engram_map.*\")[0],\"rb\").read(); n=struct.unpack(\"<Q\",b[:8])[0]
assert json.loads(b[8:8+n])[\"__metadata__\"][\"n_classes\"]==\"99092\""' "$(cat "$T/err")"
rm -rf "$T/real"
