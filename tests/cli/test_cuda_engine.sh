#!/usr/bin/env bash
# The whole model on the GPU (issue #6): stream-forced verify of both golden models with the CUDA
# backend against the official reference; batch invariance on the GPU (max-seqs 1, 8 and 64 give
# byte-identical tokens and logprobs), with CUDA graphs and as with --eager; 16 ranks TP8 x PP2 sharing one GPU (TP collectives through
# MPI with host staging) pass verify and give the tokens of one GPU rank. Skips without a GPU
# (CI has none); `make test-cuda` runs it on the GPU machine. TAP lines.
set -u
DSBATCH=${DSBATCH:-build/dsbatch}
GOLDEN=${GOLDEN:-../shared/golden}
MPIRUN=${MPIRUN:-mpirun --allow-run-as-root --oversubscribe --timeout 600}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
ok() { echo "ok - $1"; }
nok() { echo "not ok - $1"; }
check() { if eval "$2"; then ok "$1"; else nok "$1"; fi; }

if ! "$DSBATCH" verify --golden "$GOLDEN/small6" --backend cuda > "$T/v_small6.txt" 2>&1; then
  if grep -q "no CUDA device\|built without CUDA" "$T/v_small6.txt"; then
    echo "ok - cuda engine # SKIP no GPU or no CUDA build: $(head -1 "$T/v_small6.txt")"
    exit 0
  fi
fi

for spec in small6 tp8pp2; do
  [ -s "$T/v_$spec.txt" ] || "$DSBATCH" verify --golden "$GOLDEN/$spec" --backend cuda > "$T/v_$spec.txt" 2>&1
  check "verify $spec on the GPU: every layer, top-k set, hash id and forced logit within tolerance" \
    'grep -q " 0 failed" "$T/v_$spec.txt"'
  tail -1 "$T/v_$spec.txt"
done

# the default runs the FP8/FP4 linears on the tensor cores; --exact-linears keeps the CPU's k order
# (bit-identical linears): the same per-layer tolerances either way
for spec in small6 tp8pp2; do
  "$DSBATCH" verify --golden "$GOLDEN/$spec" --backend cuda --exact-linears > "$T/vm_$spec.txt" 2>&1
  check "verify $spec on the GPU with --exact-linears (the CPU's k order in the linears)" 'grep -q " 0 failed" "$T/vm_$spec.txt"'
  tail -1 "$T/vm_$spec.txt"
done

# 70 prompts of varied length from the tiny model's vocabulary, greedy, with logprobs
python3 - "$T/p.jsonl" <<'EOF'
import json, random, sys
r = random.Random(11)
with open(sys.argv[1], "w") as f:
    for i in range(70):
        n = r.randint(1, 40)
        f.write(json.dumps({"id": "q%d" % i, "tokens": [r.randrange(3, 500) for _ in range(n)],
                            "max_new_tokens": r.randint(1, 12)}) + "\n")
EOF
M=$GOLDEN/small6
for s in 1 8 64; do
  "$DSBATCH" generate --model "$M" --prompts "$T/p.jsonl" --out "$T/g$s.jsonl" --max-seqs $s --logprobs \
    --backend cuda 2>"$T/gerr$s" || cat "$T/gerr$s"
done
check "GPU batch invariance: max-seqs 1 and 8 give identical tokens and logprobs" \
  '[ -s "$T/g1.jsonl" ] && cmp -s "$T/g1.jsonl" "$T/g8.jsonl"'
check "GPU batch invariance: max-seqs 1 and 64 give identical tokens and logprobs" \
  '[ -s "$T/g1.jsonl" ] && cmp -s "$T/g1.jsonl" "$T/g64.jsonl"'
# the runs above replay CUDA graphs for their decode steps; --eager launches every op from the host
"$DSBATCH" generate --model "$M" --prompts "$T/p.jsonl" --out "$T/e8.jsonl" --max-seqs 8 --logprobs \
  --backend cuda --eager 2>"$T/eerr8" || cat "$T/eerr8"
grep -h "graph segments" "$T/gerr8" | sed 's/^/# max-seqs 8: /'
check "CUDA graphs: max-seqs 8 recorded and replayed graph segments" \
  'grep -qE "graph segments: [1-9][0-9]* recorded, [1-9][0-9]* replayed" "$T/gerr8"'
check "CUDA graphs give the tokens and logprobs of --eager (max-seqs 8)" \
  '[ -s "$T/e8.jsonl" ] && cmp -s "$T/g8.jsonl" "$T/e8.jsonl"'
"$DSBATCH" generate --model "$M" --prompts "$T/p.jsonl" --out "$T/c1.jsonl" --max-seqs 8 --logprobs 2>/dev/null
python3 - "$T/c1.jsonl" "$T/g8.jsonl" <<'EOF'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
same = sum(x["output_tokens"] == y["output_tokens"] for x, y in zip(a, b))
first = sum(x["output_tokens"][:1] == y["output_tokens"][:1] for x, y in zip(a, b))
print("# GPU vs CPU backend, small6 greedy: %d/%d sequences identical, first token %d/%d (reported, not judged:"
      " random-weight models amplify last-bit differences, see the golden README)" % (same, len(a), first, len(a)))
EOF

# 16 ranks TP8 x PP2 on one GPU: NCCL refuses two ranks per GPU, so TP goes through MPI staging
$MPIRUN -np 16 "$DSBATCH" verify --golden "$GOLDEN/tp8pp2" --tp 8 --pp 2 --backend cuda --watchdog 300 \
  > "$T/v16.txt" 2>"$T/v16.err"
check "16 ranks TP8 x PP2 on the GPU: verify tp8pp2 passes" 'grep -q " 0 failed" "$T/v16.txt"'
tail -1 "$T/v16.txt"
grep -m1 "staging" "$T/v16.err" | sed 's/^/# /'
head -c 2000 "$T/p.jsonl" | head -8 > "$T/p8.jsonl"
"$DSBATCH" generate --model "$GOLDEN/tp8pp2" --prompts "$T/p8.jsonl" --out "$T/one.jsonl" --max-seqs 4 --logprobs \
  --backend cuda 2>/dev/null
$MPIRUN -np 16 "$DSBATCH" generate --model "$GOLDEN/tp8pp2" --prompts "$T/p8.jsonl" --out "$T/six.jsonl" --max-seqs 4 \
  --logprobs --tp 8 --pp 2 --backend cuda --quiet 2>"$T/g16.err"
check "16 ranks TP8 x PP2 on the GPU give the tokens and logprobs of one GPU rank" \
  '[ -s "$T/one.jsonl" ] && cmp -s "$T/one.jsonl" "$T/six.jsonl"'
# the experts' owner exchange on the GPU (pack and unpack interleaves, the column-block combine,
# its own graph segment in decode steps; these small models pick the gather by default), and with
# 8 sequences a step (>= TP) the row-split logits: an all-to-all of the head's columns and the
# draws shared out over the TP group (model_logits_split)
$MPIRUN -np 16 "$DSBATCH" generate --model "$GOLDEN/tp8pp2" --prompts "$T/p8.jsonl" --out "$T/own.jsonl" --max-seqs 8 \
  --logprobs --tp 8 --pp 2 --backend cuda --quiet --moe-exchange owner 2>"$T/g16o.err"
check "16 ranks TP8 x PP2 on the GPU, --moe-exchange owner, 8 sequences (row-split draws), give the tokens and logprobs of one GPU rank" \
  '[ -s "$T/one.jsonl" ] && cmp -s "$T/one.jsonl" "$T/own.jsonl"'
# greedy without --logprobs draws on the GPU (model_forward_draws: the argmax op over each rank's
# head columns, 8 bytes a row gathered and downloaded): the tokens of the host's draw over the rows
# (g8: --logprobs, so its log-probabilities too come from the GPU: the row_lse op's parts; the
# --save-logits run downloads the rows and draws and scores them on the host)
"$DSBATCH" generate --model "$M" --prompts "$T/p.jsonl" --out "$T/gd8.jsonl" --max-seqs 8 --backend cuda 2>/dev/null
"$DSBATCH" generate --model "$M" --prompts "$T/p.jsonl" --out "$T/gh8.jsonl" --max-seqs 8 --backend cuda --logprobs \
  --save-logits 2>/dev/null
check "greedy drawn on the GPU (no --logprobs, max-seqs 8): the tokens of the host's draw" \
  'python3 tests/tools/same_tokens.py "$T/gh8.jsonl" "$T/gd8.jsonl"'
check "greedy with --logprobs on the GPU (argmax + row_lse, max-seqs 8): the host's tokens and log-probability bits" \
  'python3 tests/tools/same_tokens.py --logprobs "$T/gh8.jsonl" "$T/g8.jsonl"'
# top-k draws on the GPU (row_topk lists merged and drawn on the host) against the host's draw
"$DSBATCH" generate --model "$M" --prompts "$T/p.jsonl" --out "$T/tk8.jsonl" --max-seqs 8 --backend cuda --logprobs \
  --temperature 0.9 --top-k 40 --top-p 0.9 --seed 4 2>/dev/null
"$DSBATCH" generate --model "$M" --prompts "$T/p.jsonl" --out "$T/tkh8.jsonl" --max-seqs 8 --backend cuda --logprobs \
  --temperature 0.9 --top-k 40 --top-p 0.9 --seed 4 --save-logits 2>/dev/null
check "top-k draws on the GPU (row_topk + row_lse, max-seqs 8): the host's tokens and log-probability bits" \
  'python3 tests/tools/same_tokens.py --logprobs "$T/tkh8.jsonl" "$T/tk8.jsonl"'
# full-row temperature draws on the GPU (row_topk lists of 1,024 + row_lse's temperature sums,
# sampler_pick_cand; the whole rows where those do not decide) against the host's draw, on a
# vocabulary of 4,096 where T 1.0 / top-p 0.9 rows of a random model need the rows and T 0.05 rows
# do not (the log counts both)
"$DSBATCH" mkmodel --preset tp8pp2 --seed 8 --vocab_size 4096 --out "$T/v4k" >/dev/null 2>&1
python3 tests/tools/full_row_prompts.py "$T/pf.jsonl" 12
"$DSBATCH" generate --model "$T/v4k" --prompts "$T/pf.jsonl" --out "$T/pf8.jsonl" --max-seqs 8 --backend cuda --logprobs \
  2>"$T/pf8.err"
"$DSBATCH" generate --model "$T/v4k" --prompts "$T/pf.jsonl" --out "$T/pfh8.jsonl" --max-seqs 8 --backend cuda --logprobs \
  --save-logits 2>/dev/null
grep -m1 "full-row" "$T/pf8.err" | sed 's/^/# /'
check "full-row temperature draws on the GPU (row_topk + row_lse with temperatures, max-seqs 8): the host's tokens and log-probability bits" \
  'python3 tests/tools/same_tokens.py --logprobs "$T/pfh8.jsonl" "$T/pf8.jsonl" && grep -q "120 drawn where the logits are, [1-9]" "$T/pf8.err"'
$MPIRUN -np 16 "$DSBATCH" generate --model "$GOLDEN/tp8pp2" --prompts "$T/p8.jsonl" --out "$T/gd16.jsonl" --max-seqs 8 \
  --tp 8 --pp 2 --backend cuda --quiet 2>"$T/gd16.err"
check "greedy drawn on the GPU by 16 ranks TP8 x PP2 (each rank its vocab columns): one GPU rank's host-drawn tokens" \
  'python3 tests/tools/same_tokens.py "$T/one.jsonl" "$T/gd16.jsonl"'
# score on the distributed engine: every row's log-probability, split over the TP ranks
"$DSBATCH" score --model "$GOLDEN/tp8pp2" --prompts "$T/p8.jsonl" --out "$T/sc1.jsonl" --backend cuda --chunk 16 2>/dev/null
$MPIRUN -np 16 "$DSBATCH" score --model "$GOLDEN/tp8pp2" --prompts "$T/p8.jsonl" --out "$T/sc16.jsonl" --tp 8 --pp 2 \
  --backend cuda --chunk 16 --quiet 2>"$T/s16.err"
check "score on 16 ranks TP8 x PP2 on the GPU gives one GPU rank's log-probabilities" \
  '[ -s "$T/sc1.jsonl" ] && cmp -s "$T/sc1.jsonl" "$T/sc16.jsonl"'
