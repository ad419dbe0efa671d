#!/usr/bin/env bash
# Sixteen ranks on CPU (issue #4): layout invariance — TP8xPP2, TP4xPP2, TP2xPP1, TP1xPP2 and
# TP2xPP2xDP2 give tokens and log-probabilities bit-identical to one rank, on the golden tp8pp2
# model and on a synthetic model of the same shape with another seed, the TP layouts also with the
# experts' owner exchange (--moe-exchange owner; these small models pick the gather by default); a killed rank ends the job;
# bad layouts are one error line per rank. TAP lines.
set -u
DSBATCH=${DSBATCH:-build/dsbatch}
GOLDEN=${GOLDEN:-../shared/golden}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
MPIRUN="mpirun --allow-run-as-root --oversubscribe --timeout 300"
ok() { echo "ok - $1"; }
nok() { echo "not ok - $1"; }

python3 -c "
import json,random
r=random.Random(11)
with open('$T/p.jsonl','w') as f:
    for i in range(6): f.write(json.dumps({'id':i,'tokens':[r.randrange(3,496) for _ in range(r.randrange(3,40))],'max_new_tokens':10})+'\n')
"
"$DSBATCH" mkmodel --preset tp8pp2 --seed 7 --out "$T/seed7" >/dev/null 2>&1 || nok "mkmodel tp8pp2 seed 7"

for model in "$GOLDEN/tp8pp2" "$T/seed7"; do
  name=$(basename "$model")
  for mode in greedy sampled; do
    S=""; [ $mode = sampled ] && S="--temperature 0.9 --top-p 0.95 --seed 3"
    "$DSBATCH" generate --model "$model" --prompts "$T/p.jsonl" --out "$T/ref.jsonl" --max-seqs 4 --logprobs $S 2>"$T/err" \
      || { nok "$name $mode: one-rank reference: $(tail -1 "$T/err")"; continue; }
    for lay in "16 8 2" "8 4 2" "2 2 1" "2 1 2" "8 2 2" "16 8 2 owner" "8 4 2 owner" "2 2 1 owner"; do
      set -- $lay
      dp=$(( $1 / ($2 * $3) ))
      X=""; [ $# -gt 3 ] && X="--moe-exchange $4"
      start=$(date +%s.%N)
      $MPIRUN -np $1 "$DSBATCH" generate --model "$model" --prompts "$T/p.jsonl" --out "$T/out.jsonl" --max-seqs 4 \
        --logprobs --tp $2 --pp $3 --watchdog 120 $S $X >"$T/log" 2>&1
      rc=$?
      secs=$(python3 -c "import time; print('%.1f' % (time.time() - $start))")
      if [ $rc -eq 0 ] && cmp -s "$T/ref.jsonl" "$T/out.jsonl"; then
        ok "$name $mode: TP$2 x PP$3 x DP$dp${X:+ $X} ($1 ranks, ${secs} s) tokens and logprobs bit-identical to one rank"
      else
        nok "$name $mode: TP$2 x PP$3 x DP$dp${X:+ $X} ($1 ranks) rc=$rc differs from one rank: $(grep -m1 error "$T/log")"
      fi
    done
  done
done

# greedy and top-k steps that keep no logits rows draw where the logits are (model_forward_draws:
# each TP rank's argmax over its vocab columns, 8 bytes a row gathered, or its row_topk list, 8
# bytes an entry, and with --logprobs its row_lse parts, 16 bytes a row and slice; no rows
# downloaded): the tokens and log-probability bits of the host's draw over the downloaded rows
# (the --save-logits runs, one rank), on 1, 8 and 16 ranks
"$DSBATCH" generate --model "$GOLDEN/tp8pp2" --prompts "$T/p.jsonl" --out "$T/gl.jsonl" --max-seqs 4 --logprobs \
  --save-logits 2>/dev/null
# the same prompts with per-request draws: greedy, top-k 40 at T 0.9, top-k 5 at T 1.3 and top-p 0.8
python3 - "$T/p.jsonl" "$T/pk.jsonl" <<'EOF'
import json, sys
kinds = [{}, {"temperature": 0.9, "top_k": 40, "seed": 5}, {"temperature": 1.3, "top_k": 5, "top_p": 0.8, "seed": 6}]
with open(sys.argv[2], "w") as f:
    for i, line in enumerate(open(sys.argv[1])):
        j = json.loads(line); j.update(kinds[i % 3]); f.write(json.dumps(j) + "\n")
EOF
"$DSBATCH" generate --model "$GOLDEN/tp8pp2" --prompts "$T/pk.jsonl" --out "$T/gkl.jsonl" --max-seqs 4 --logprobs \
  --save-logits 2>/dev/null
# drawn PROMPTS REF WHAT [--logprobs]: a run of the layout in $run / $lay on the backend's draws,
# the tokens (and with --logprobs the log-probability bits) of the host's draw REF
drawn() {
  local prompts=$1 ref=$2 what=$3 lp=${4:-}
  "${run[@]}" generate --model "$GOLDEN/tp8pp2" --prompts "$prompts" --out "$T/gn.jsonl" --max-seqs 4 --tp $tp --pp $pp \
    $lp --watchdog 120 $X >"$T/log" 2>&1
  if [ $? -eq 0 ] && python3 tests/tools/same_tokens.py $lp "$ref" "$T/gn.jsonl" && { [ -n "$lp" ] || ! grep -q logprobs "$T/gn.jsonl"; }; then
    ok "$what, TP$tp x PP$pp${X:+ $X} ($np ranks): the host's tokens${lp:+ and log-probability bits}"
  else
    nok "$what, TP$tp x PP$pp${X:+ $X} ($np ranks) differs from the host's draw: $(grep -m1 error "$T/log")"
  fi
}
for lay in "1 1 1" "16 8 2" "8 4 2" "16 8 2 owner"; do
  set -- $lay
  np=$1 tp=$2 pp=$3 X=""; [ $# -gt 3 ] && X="--moe-exchange $4"
  if [ $np -eq 1 ]; then run=("$DSBATCH"); else run=($MPIRUN -np $np "$DSBATCH"); fi
  drawn "$T/p.jsonl" "$T/gl.jsonl" "greedy drawn on the backend (argmax; no --logprobs)"
  drawn "$T/p.jsonl" "$T/gl.jsonl" "greedy with --logprobs drawn on the backend (argmax + row_lse)" --logprobs
  drawn "$T/pk.jsonl" "$T/gkl.jsonl" "top-k draws on the backend (row_topk + row_lse; greedy and top-k 40 / 5 rows in a step)" --logprobs
done

# full-row temperature draws (no top-k) where the logits are: each rank's row_topk list of 1,024
# entries and row_lse's temperature sums decide most draws (sampler_pick_cand); a draw they do not
# decide (a flat row's nucleus past the list) gathers the whole rows. On a vocabulary of 4,096 the
# T 1.0 / top-p 0.9 rows of this random model take the rows and the T 0.05 and T 0.3 / top-p 0.5
# rows do not: the host's tokens and log-probability bits either way, and the log counts both
"$DSBATCH" mkmodel --preset tp8pp2 --seed 8 --vocab_size 4096 --out "$T/v4k" >/dev/null 2>&1 || nok "mkmodel tp8pp2 vocab 4096"
python3 tests/tools/full_row_prompts.py "$T/pf.jsonl" 6
"$DSBATCH" generate --model "$T/v4k" --prompts "$T/pf.jsonl" --out "$T/pfl.jsonl" --max-seqs 4 --logprobs --save-logits 2>/dev/null
for lay in "1 1 1" "16 8 2" "4 4 1"; do
  set -- $lay
  np=$1 tp=$2 pp=$3
  if [ $np -eq 1 ]; then run=("$DSBATCH"); else run=($MPIRUN -np $np "$DSBATCH"); fi
  "${run[@]}" generate --model "$T/v4k" --prompts "$T/pf.jsonl" --out "$T/gn.jsonl" --max-seqs 4 --tp $tp --pp $pp \
    --logprobs --watchdog 120 >"$T/log" 2>&1
  rc=$?
  stats=$(grep -o "full-row temperature draws: [0-9]* drawn where the logits are, [0-9]* of them" "$T/log" | grep -o "[0-9][0-9]*" | tr '\n' ' ')
  set -- $stats
  if [ $rc -eq 0 ] && python3 tests/tools/same_tokens.py --logprobs "$T/pfl.jsonl" "$T/gn.jsonl" && [ $# -eq 2 ] \
     && [ "$1" -eq 60 ] && [ "$2" -gt 0 ] && [ "$2" -lt "$1" ]; then
    ok "full-row temperature draws on the backend, TP$tp x PP$pp ($np ranks; $2 of $1 from the whole row): the host's tokens and log-probability bits"
  else
    nok "full-row temperature draws on the backend, TP$tp x PP$pp ($np ranks; draws: ${stats:-none}) differ from the host's draw: $(grep -m1 error "$T/log")"
  fi
done

# --save-logits keeps the rows on rank 0 only, yet the TP group must take one path: every rank
# draws on the host then (a rank drawing on the backend would gather 8 bytes a row against rank
# 0's rows and abort)
"$DSBATCH" generate --model "$GOLDEN/tp8pp2" --prompts "$T/p.jsonl" --out "$T/sl1.jsonl" --max-seqs 4 --save-logits 2>/dev/null
$MPIRUN -np 2 "$DSBATCH" generate --model "$GOLDEN/tp8pp2" --prompts "$T/p.jsonl" --out "$T/sl2.jsonl" --max-seqs 4 \
  --save-logits --tp 2 --watchdog 120 >"$T/log" 2>&1
if [ $? -eq 0 ] && [ -s "$T/sl1.jsonl" ] && cmp -s "$T/sl1.jsonl" "$T/sl2.jsonl"; then
  ok "greedy with --save-logits on TP2: the saved rows and tokens of one rank"
else
  nok "greedy with --save-logits on TP2 differs from one rank: $(grep -m1 -i "error\|abort" "$T/log")"
fi

# TP8 with 8 sequences a step: every TP rank draws one row of the step (row-split logits,
# model_logits_split: an all-to-all of the head's columns, the draws all-gathered), sampled
python3 -c "
import json,random
r=random.Random(12)
with open('$T/p10.jsonl','w') as f:
    for i in range(10): f.write(json.dumps({'id':i,'tokens':[r.randrange(3,496) for _ in range(r.randrange(3,30))],'max_new_tokens':8})+'\n')
"
S="--temperature 0.9 --top-p 0.95 --top-k 40 --seed 5"
"$DSBATCH" generate --model "$GOLDEN/tp8pp2" --prompts "$T/p10.jsonl" --out "$T/r10.jsonl" --max-seqs 8 --logprobs $S 2>/dev/null
$MPIRUN -np 16 "$DSBATCH" generate --model "$GOLDEN/tp8pp2" --prompts "$T/p10.jsonl" --out "$T/o10.jsonl" --max-seqs 8 \
  --logprobs --tp 8 --pp 2 --watchdog 120 $S >"$T/log" 2>&1
if [ $? -eq 0 ] && [ -s "$T/r10.jsonl" ] && cmp -s "$T/r10.jsonl" "$T/o10.jsonl"; then
  ok "TP8 x PP2, 8 sequences a step (the TP ranks share the draws), sampled with top-k and top-p: bit-identical to one rank"
else
  nok "TP8 x PP2 with shared draws differs from one rank: $(grep -m1 error "$T/log")"
fi

# Engram tables served once per node (the default on many ranks) vs each rank's row slice + sum
for e in service per-rank; do
  $MPIRUN -np 16 "$DSBATCH" generate --model "$GOLDEN/tp8pp2" --prompts "$T/p.jsonl" --out "$T/e_$e.jsonl" --max-seqs 4 \
    --logprobs --engram $e --watchdog 120 >"$T/log" 2>&1 || nok "--engram $e: $(grep -m1 error "$T/log")"
done
"$DSBATCH" generate --model "$GOLDEN/tp8pp2" --prompts "$T/p.jsonl" --out "$T/e_one.jsonl" --max-seqs 4 --logprobs 2>/dev/null
if cmp -s "$T/e_service.jsonl" "$T/e_per-rank.jsonl" && cmp -s "$T/e_one.jsonl" "$T/e_service.jsonl"; then
  ok "Engram served by the node's service = per-rank table slices = one rank (TP8 x PP2)"
else
  nok "Engram service and per-rank slices differ"
fi

# the golden per-layer verification on 16 ranks (TP8 x PP2): same verdict and numbers as one rank
"$DSBATCH" verify --golden "$GOLDEN/tp8pp2" 2>/dev/null | tail -1 > "$T/v1"
$MPIRUN -np 16 "$DSBATCH" verify --golden "$GOLDEN/tp8pp2" --tp 8 --pp 2 --watchdog 120 2>"$T/verr" | tail -1 > "$T/v16"
rc=${PIPESTATUS[0]}
if [ $rc -eq 0 ] && grep -q " 0 failed" "$T/v16" && cmp -s "$T/v1" "$T/v16"; then
  ok "verify tp8pp2 on TP8 x PP2: $(cut -c1-120 "$T/v16")"
else
  nok "verify tp8pp2 on TP8 x PP2: rc=$rc $(cat "$T/v16") $(grep -m1 error "$T/verr")"
fi

# the verification with the owner exchange: the same numbers again
$MPIRUN -np 16 "$DSBATCH" verify --golden "$GOLDEN/tp8pp2" --tp 8 --pp 2 --watchdog 120 --moe-exchange owner \
  2>"$T/verr" | tail -1 > "$T/v16o"
rc=${PIPESTATUS[0]}
if [ $rc -eq 0 ] && cmp -s "$T/v1" "$T/v16o"; then
  ok "verify tp8pp2 on TP8 x PP2 --moe-exchange owner: the one-rank report"
else
  nok "verify tp8pp2 --moe-exchange owner: rc=$rc $(cat "$T/v16o") $(grep -m1 error "$T/verr")"
fi

# an unknown exchange: one error line naming the option, on every rank, no output
$MPIRUN -np 2 "$DSBATCH" generate --model "$GOLDEN/tp8pp2" --prompts "$T/p.jsonl" --out "$T/bad.jsonl" --tp 2 \
  --moe-exchange scatter >"$T/log" 2>&1
rc=$?
n=$(grep -c "moe-exchange: 'scatter' is not one of auto, gather, owner" "$T/log")
if [ $rc -ne 0 ] && [ "$n" -eq 2 ] && [ ! -e "$T/bad.jsonl" ]; then ok "--moe-exchange scatter: one error per rank"; else nok "--moe-exchange scatter: rc=$rc, $n error lines"; fi

# a bad layout: one error line on every rank, before any loading
$MPIRUN -np 16 "$DSBATCH" generate --model "$GOLDEN/tp8pp2" --prompts "$T/p.jsonl" --out "$T/bad.jsonl" --tp 3 >"$T/log" 2>&1
rc=$?
n=$(grep -c "does not divide" "$T/log")
if [ $rc -ne 0 ] && [ "$n" -eq 16 ] && [ ! -e "$T/bad.jsonl" ]; then ok "tp 3: one error per rank ($n), exit $rc, no output"; else nok "tp 3: rc=$rc, $n error lines"; fi
$MPIRUN -np 16 "$DSBATCH" generate --model "$GOLDEN/tp8pp2" --prompts "$T/p.jsonl" --out "$T/bad.jsonl" --tp 8 --pp 2 \
  --pp-layers 3,5 >"$T/log" 2>&1
rc=$?
n=$(grep -c "cuts the KV-sharing group" "$T/log")
if [ $rc -ne 0 ] && [ "$n" -eq 16 ]; then ok "--pp-layers 3,5 cutting a KV-sharing group: one error per rank"; else nok "--pp-layers 3,5: rc=$rc, $n error lines"; fi

# kill one rank mid-run: every rank must end, well within the watchdog deadline (10 s)
python3 -c "
import json,random
r=random.Random(5)
with open('$T/long.jsonl','w') as f:
    for i in range(8): f.write(json.dumps({'id':i,'tokens':[r.randrange(3,496) for _ in range(60)],'max_new_tokens':150})+'\n')
"
start=$(date +%s.%N)
$MPIRUN -np 16 "$DSBATCH" generate --model "$GOLDEN/tp8pp2" --prompts "$T/long.jsonl" --out "$T/k.jsonl" --watchdog 10 \
  --max-seqs 8 --max-seq-len 256 >"$T/klog" 2>&1 &
mp=$!
victim=""
for _ in $(seq 1 100); do
  sleep 0.2
  victim=$(pgrep -f "long.jsonl" | while read -r p; do [ "$(cat /proc/$p/comm 2>/dev/null)" = dsbatch ] && echo $p; done | sed -n 6p)
  [ -n "$victim" ] && grep -q "rank  dp" "$T/klog" && break
done
sleep 1
kill -9 "$victim" 2>/dev/null
wait $mp
rc=$?
secs=$(python3 -c "import time; print('%.1f' % (time.time() - $start))")
left=$(pgrep -f "long.jsonl" | while read -r p; do [ "$(cat /proc/$p/comm 2>/dev/null)" = dsbatch ] && echo $p; done | wc -l)
if [ -n "$victim" ] && [ $rc -ne 0 ] && [ "$left" -eq 0 ] && [ ! -e "$T/k.jsonl" ]; then
  ok "SIGKILL of one rank ends all 16 (exit $rc, ${secs} s from start, no output file)"
else
  nok "SIGKILL of one rank: victim='$victim' rc=$rc ranks left=$left"
fi
