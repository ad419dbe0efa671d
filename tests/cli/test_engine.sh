#!/usr/bin/env bash
# The CPU engine end to end (issue #3): stream-forced verify of both golden models against the
# official reference; on small6: batch invariance (max-seqs 1 vs 8), chunked-prefill invariance (chunk 1, 7,
# 64 vs whole prompts, with the chunk-invariant settings), scoring, and bad input. TAP lines.
set -u
DSBATCH=${DSBATCH:-build/dsbatch}
GOLDEN=${GOLDEN:-../shared/golden}
M=$GOLDEN/small6
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
n=0
ok() { echo "ok - $1"; }
nok() { echo "not ok - $1"; }
check() { if eval "$2"; then ok "$1"; else nok "$1"; fi; }

for spec in small6 tp8pp2; do
  "$DSBATCH" verify --golden "$GOLDEN/$spec" > "$T/verify.txt" 2>&1
  check "verify $spec: every layer, top-k set, hash id and forced logit within tolerance" '[ $? -eq 0 ] && grep -q " 0 failed" "$T/verify.txt"'
  tail -1 "$T/verify.txt"
done

P=data/prompts/tiny.jsonl
"$DSBATCH" generate --model "$M" --prompts $P --out "$T/g1.jsonl" --max-seqs 1 2>"$T/err1"
"$DSBATCH" generate --model "$M" --prompts $P --out "$T/g8.jsonl" --max-seqs 8 2>"$T/err8"
check "generate: one output line per prompt, in order" '[ "$(wc -l < "$T/g1.jsonl")" -eq "$(wc -l < $P)" ] && python3 -c "
import json,sys
a=[json.loads(l) for l in open(\"$T/g1.jsonl\")]; p=[json.loads(l) for l in open(\"$P\")]
assert [x[\"id\"] for x in a]==[x[\"id\"] for x in p]
assert all(len(x[\"output_tokens\"])==y[\"max_new_tokens\"] or x[\"finish_reason\"]==\"stop\" for x,y in zip(a,p))
"'
check "batch invariance: max-seqs 1 and 8 give identical tokens" 'cmp -s "$T/g1.jsonl" "$T/g8.jsonl"'

FLAGS="--window-layout decode --no-stale-index-keys"
"$DSBATCH" generate --model "$M" --prompts $P --out "$T/c0.jsonl" --max-seqs 3 $FLAGS 2>/dev/null
for c in 1 7 64; do
  "$DSBATCH" generate --model "$M" --prompts $P --out "$T/c$c.jsonl" --max-seqs 3 --chunk $c $FLAGS 2>/dev/null
  check "chunked prefill: chunk $c gives the tokens of whole-prompt prefill" 'cmp -s "$T/c0.jsonl" "$T/c$c.jsonl"'
done

"$DSBATCH" generate --model "$M" --prompts $P --out "$T/t.jsonl" --temperature 0.8 --top-p 0.9 --seed 5 --max-seqs 1 2>/dev/null
"$DSBATCH" generate --model "$M" --prompts $P --out "$T/t8.jsonl" --temperature 0.8 --top-p 0.9 --seed 5 --max-seqs 8 2>/dev/null
check "sampling: same seed, max-seqs 1 vs 8, identical tokens" 'cmp -s "$T/t.jsonl" "$T/t8.jsonl" && ! cmp -s "$T/t.jsonl" "$T/g1.jsonl"'

"$DSBATCH" score --model "$M" --prompts $P --out "$T/s.jsonl" 2>/dev/null
check "score: n_tokens = len-1 logprobs <= 0, nll = -sum" 'python3 -c "
import json,math
for s,p in zip(open(\"$T/s.jsonl\"),open(\"$P\")):
    s=json.loads(s); p=json.loads(p)
    assert s[\"n_tokens\"]==len(p[\"tokens\"])-1==len(s[\"token_logprobs\"])
    assert all(x<=0 for x in s[\"token_logprobs\"])
    assert abs(s[\"nll\"]+sum(s[\"token_logprobs\"]))<1e-6*max(1,abs(s[\"nll\"]))
"'

echo '{"id":"bad","tokens":[1,2,512]}' > "$T/bad.jsonl"
"$DSBATCH" generate --model "$M" --prompts "$T/bad.jsonl" --out "$T/bad.out" 2>"$T/bad.err"; rc=$?
check "bad input: token id >= vocab is one error line naming the file and field, no output" '[ $rc -ne 0 ] && [ "$(wc -l < "$T/bad.err")" -eq 1 ] && grep -q "bad.jsonl:1: tokens\[2\]" "$T/bad.err" && [ ! -e "$T/bad.out" ]'
python3 -c "import json; print(json.dumps({'id':'long','tokens':[3]*200,'max_new_tokens':10}))" > "$T/long.jsonl"
"$DSBATCH" generate --model "$M" --prompts "$T/long.jsonl" --out "$T/long.out" 2>"$T/long.err"; rc=$?
check "bad input: prompt longer than the model's maximum is one error line, no output" '[ $rc -ne 0 ] && [ "$(wc -l < "$T/long.err")" -eq 1 ] && grep -q "exceeds" "$T/long.err" && [ ! -e "$T/long.out" ]'

# job specs: the file's options, overridden by flags
J=$T/job.json
printf '{"model": "%s", "prompts": "%s", "out": "%s", "max-seqs": 2, "logprobs": true, "seed": 9, "temperature": 0.7}\n' \
  "$M" "$P" "$T/job.jsonl" > "$J"
"$DSBATCH" generate --job "$J" --quiet 2>"$T/joberr"
"$DSBATCH" generate --model "$M" --prompts "$P" --out "$T/flags.jsonl" --max-seqs 2 --logprobs --seed 9 --temperature 0.7 --quiet 2>/dev/null
check "job spec: the same options as flags give the same output" 'cmp -s "$T/job.jsonl" "$T/flags.jsonl"'
"$DSBATCH" generate --job "$J" --temperature 0 --out "$T/over.jsonl" --quiet 2>/dev/null
"$DSBATCH" generate --model "$M" --prompts "$P" --out "$T/greedy.jsonl" --max-seqs 2 --logprobs --quiet 2>/dev/null
check "job spec: a flag overrides the file" 'cmp -s "$T/over.jsonl" "$T/greedy.jsonl"'
echo '[1,2]' > "$T/badjob.json"
"$DSBATCH" generate --job "$T/badjob.json" 2>"$T/badjob.err"; rc=$?
check "job spec: not an object is one error line naming the file" '[ $rc -ne 0 ] && [ "$(wc -l < "$T/badjob.err")" -eq 1 ] && grep -q badjob.json "$T/badjob.err"'
