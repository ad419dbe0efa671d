#!/usr/bin/env bash
# CLI tests of `dsbatch plan` (TAP lines "ok - NAME" / "not ok - NAME").
#
# plan must agree with inspect, which binds the same slices: per rank, plan's weight bytes plus the
# Engram row slice inspect lists are inspect's bytes mapped, over all ranks they sum to inspect's
# total, and the Engram tables plan puts on stage 0's node are exactly the row slices stage 0's TP
# ranks would split. The KV bytes per token are re-derived here from config.json with the formula
# the header line states (MODEL.md §4.1 in bf16: head_dim x 2 B compressed KV and index_head_dim x
# 2 B index keys per `ratio` tokens, plus stage 0's mirrors of later key owners), and the --gpu-mem
# capacity from the JSON's own fields. Bad layouts and a GPU too small are one stderr line, exit 1,
# nothing on stdout. Runs from the repository root; $DSBATCH and $GOLDEN come from run_tests.sh.
set -u
DSBATCH=${DSBATCH:-build/dsbatch}
GOLDEN=${GOLDEN:-../shared/golden}
TMP=$(mktemp -d "${TMPDIR:-/tmp}/dsbatch_plan.XXXXXX")
trap '[ -n "${KEEP:-}" ] || rm -rf "$TMP"' EXIT

ok() { echo "ok - $1"; }
not_ok() {
  echo "not ok - $1"
  [ -n "${2:-}" ] && printf '%s\n' "$2" | head -20 | sed 's/^/#   /'
  return 0
}
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
# run NAME CMD...: ok when CMD exits 0; stdout in $TMP/out, stderr in $TMP/err
run() {
  local name=$1; shift
  local t0; t0=$(now)
  if "$@" >"$TMP/out" 2>"$TMP/err"; then ok "$name ($(secs "$t0" "$(now)") s)"; else not_ok "$name" "$(cat "$TMP/err")"; fi
}
# expect_error NAME PATTERN CMD...: exit 1, exactly one stderr line matching PATTERN, empty stdout
expect_error() {
  local name=$1 pat=$2; shift 2
  "$@" >"$TMP/stdout" 2>"$TMP/stderr"; local rc=$?
  local lines; lines=$(wc -l <"$TMP/stderr")
  if [ $rc -eq 1 ] && [ "$lines" -eq 1 ] && [ ! -s "$TMP/stdout" ] && grep -qE -- "$pat" "$TMP/stderr"; then
    ok "$name: $(cat "$TMP/stderr")"
  else
    not_ok "$name" "exit $rc, $lines stderr lines, wanted /$pat/: $(cat "$TMP/stderr") $(head -3 "$TMP/stdout")"
  fi
}

# The KV formula from config.json alone (the engine's bf16 caches), per stage [begin, end).
cat >"$TMP/kv.py" <<'EOF'
import json
def kv_per_token(cfg_path, begin, end, first, stale=True):
    c = json.load(open(cfg_path)).get('text_config') or json.load(open(cfg_path))
    ratios, hd, idd = c['compress_ratios'], c['head_dim'], c['index_head_dim']
    kv, ix = set(c['kv_source_layer_ids']), set(c['index_source_layer_ids'])
    tok = 0.0
    for l in range(c['num_hidden_layers']):
        r = ratios[l]
        if r <= 0 or l not in kv:
            continue
        if begin <= l < end:
            tok += hd * 2 / r + (idd * 2 / r if l in ix else 0)
        elif first and stale and l in ix:
            tok += idd * 2 / r
    return tok
EOF

# ---------------------------------------------------------------- golden tp8pp2, TP8 x PP2
M=$GOLDEN/tp8pp2
run "plan golden tp8pp2 --tp 8 --pp 2" "$DSBATCH" plan --model "$M" --tp 8 --pp 2
cp "$TMP/out" "$TMP/plan.txt"
rows=$(grep -cE '^ +[0-9]+ +[01] +[0-7] +[0-9]+ +[0-9]+-[0-9]+ ' "$TMP/plan.txt")
pairs=$(grep -E '^ +[0-9]+ +[01] +[0-7] +[0-9]+ +[0-9]+-[0-9]+ ' "$TMP/plan.txt" | awk '{print $2 "," $3}' | sort -u | wc -l)
if [ "$rows" -eq 16 ] && [ "$pairs" -eq 16 ] && grep -q 'CPU/bf16 layout the engine uses today' "$TMP/plan.txt" &&
   grep -q 'workspace = peak activations' "$TMP/plan.txt"; then
  ok "text table: 16 rows, one per (pp, tp) of 2 x 8, with the KV layout and workspace header lines"
else
  not_ok "text table: 16 rows, one per (pp, tp)" "$(cat "$TMP/plan.txt")"
fi
run "plan golden tp8pp2 --json" "$DSBATCH" plan --model "$M" --tp 8 --pp 2 --json
cp "$TMP/out" "$TMP/plan.json"
run "inspect golden tp8pp2 --tp 8 --pp 2" "$DSBATCH" inspect "$M" --tp 8 --pp 2
cp "$TMP/out" "$TMP/inspect.txt"
cat >"$TMP/check_golden.py" <<'EOF'
import json, re, sys
sys.path.insert(0, sys.argv[4])
from kv import kv_per_token
plan = json.load(open(sys.argv[1]))
text = open(sys.argv[2]).read()
cfg = sys.argv[3]
ins = {}
for m in re.finditer(r'^ +(\d+) +(\d+) +(\d+) +\S+ +(\d+) \(.*?\) +(\d+) +(\d+)$', text, re.M):
    r, s, t, mapped, eng, exp = map(int, m.groups())
    ins[r] = dict(stage=s, tp=t, mapped=mapped, engram=eng, experts=exp)
total = int(re.search(r'all ranks map (\d+) bytes', text).group(1))
ranks = plan['ranks']
assert len(ranks) == 16 and len(ins) == 16, (len(ranks), len(ins))
assert sorted((r['pp'], r['tp']) for r in ranks) == [(s, t) for s in range(2) for t in range(8)]
for r in ranks:
    i = ins[r['rank']]
    assert (i['stage'], i['tp']) == (r['pp'], r['tp'])
    # the invariant: weights (GPU) + the Engram row slice = what inspect says the rank maps
    assert r['weight_bytes'] + i['engram'] == i['mapped'], (r['rank'], r['weight_bytes'], i)
    assert r['expert_bytes'] == i['experts']
    assert r['engram_row_slice_bytes'] == i['engram']
assert sum(r['weight_bytes'] for r in ranks) + sum(i['engram'] for i in ins.values()) == total
# the tables held once on stage 0's node = the row slices stage 0's 8 ranks would split
n0, n1 = plan['nodes']
assert n0['engram_layers'] == [1, 3] and n1['engram_layers'] == [], plan['nodes']
assert n0['engram_table_bytes'] == sum(i['engram'] for i in ins.values() if i['stage'] == 0) > 0
assert n0['engram_table_bytes'] <= n0['engram_host_bytes'] < n0['engram_table_bytes'] + 4 * 4096
assert n1['engram_host_bytes'] == 0
for r in ranks:
    st = plan['stages'][r['pp']]
    want = kv_per_token(cfg, st['layer_begin'], st['layer_end'], r['pp'] == 0)
    assert r['kv_bytes_per_token'] == want, (r['rank'], r['kv_bytes_per_token'], want)
    # replicated parts: every TP rank of a stage holds the same KV and workspace
    same = [x for x in ranks if x['pp'] == r['pp']]
    assert all(x['kv_bytes_per_seq'] == r['kv_bytes_per_seq'] and x['workspace_bytes'] == r['workspace_bytes'] for x in same)
assert [s['layer_begin'] for s in plan['stages']] == [0, 4]
print(f"weights {sum(r['weight_bytes'] for r in ranks)} + engram slices = inspect total {total}; "
      f"node 0 Engram {n0['engram_table_bytes']} table bytes ({n0['engram_host_bytes']} allocated); "
      f"KV/token stage 0 {ranks[0]['kv_bytes_per_token']:g} B, stage 1 {ranks[8]['kv_bytes_per_token']:g} B")
EOF
if msg=$(python3 "$TMP/check_golden.py" "$TMP/plan.json" "$TMP/inspect.txt" "$M/config.json" "$TMP" 2>&1); then
  ok "plan agrees with inspect and the KV formula: $msg"
else
  not_ok "plan agrees with inspect and the KV formula" "$msg"
fi

# ---------------------------------------------------------------- v41-flash slice (real dimensions) with --gpu-mem
# Four layers (window, window + Engram, KV source with index keys, reader): every cache kind. Two
# experts keep the slice near 1.2 GB (test_mkmodel_inspect.sh's bound for CI is 1.5 GB).
V41=(--preset v41-flash --layers 0-3 --experts 2 --vocab_size 8192 --dspark_noise_token_id 8191
     --engram_vocab_size 1000 --engram_compressed_vocab_size 4096 --seed 1)
"$DSBATCH" mkmodel "${V41[@]}" --out "$TMP/v41" --dry-run >"$TMP/out" 2>&1
bytes=$(sed -n 's/.* \([0-9]*\) bytes$/\1/p' "$TMP/out")
if [ -n "$bytes" ] && [ "$bytes" -lt 1500000000 ]; then
  ok "v41-flash 4-layer slice is small enough for CI ($bytes bytes)"
  run "mkmodel v41-flash --layers 0-3 --experts 2" "$DSBATCH" mkmodel "${V41[@]}" --out "$TMP/v41"
  run "plan v41 slice --tp 2 --pp 2 --gpu-mem 2G" "$DSBATCH" plan --model "$TMP/v41" --tp 2 --pp 2 --gpu-mem 2G
  cp "$TMP/out" "$TMP/v41.txt"
  if [ "$(grep -cE '^ +[0-9]+ +[01] +[01] +[01] +[0-9]+-[0-9]+ +[0-9]+\.[0-9]{2} [KMGT]?B .* [0-9]+ tokens \([0-9]+ x 4096\)$' "$TMP/v41.txt")" -eq 4 ] &&
     grep -q -- '--gpu-mem 2G = 2147483648 bytes' "$TMP/v41.txt"; then
    ok "v41 text table: 4 rows with sizes to 2 decimals and a KV capacity in tokens"
  else
    not_ok "v41 text table: 4 rows with sizes to 2 decimals and a KV capacity in tokens" "$(cat "$TMP/v41.txt")"
  fi
  run "plan v41 slice --json" "$DSBATCH" plan --model "$TMP/v41" --tp 2 --pp 2 --gpu-mem 2G --json
  cp "$TMP/out" "$TMP/v41.json"
  cat >"$TMP/check_v41.py" <<'EOF'
import json, sys
sys.path.insert(0, sys.argv[3])
from kv import kv_per_token
p = json.load(open(sys.argv[1]))
g = p['gpu_mem_bytes']
assert g == 2 << 30
out = []
for r in p['ranks']:
    st = p['stages'][r['pp']]
    want = kv_per_token(sys.argv[2], st['layer_begin'], st['layer_end'], r['pp'] == 0)
    assert r['kv_bytes_per_token'] == want, (r, want)
    left = g - r['weight_bytes'] - r['prepared_bytes'] - r['workspace_bytes'] - r['kv_fixed_bytes']
    assert left > 0 and r['kv_capacity_tokens'] == int(left // r['kv_bytes_per_token']), r
    assert r['kv_fixed_bytes'] >= p['max_seqs'] * r['kv_bytes_per_seq']
    out.append(f"rank {r['rank']}: {r['kv_bytes_per_token']:g} B/token, {r['kv_capacity_tokens']} tokens")
# real dimensions: stage 1 owns layer 2 (ratio 2, 512-wide KV + 128-wide keys), stage 0 mirrors its keys
assert [r['kv_bytes_per_token'] for r in p['ranks']] == [128, 128, 640, 640]
assert p['nodes'][0]['engram_layers'] == [1] and p['nodes'][0]['engram_host_bytes'] > 0
print('; '.join(out))
EOF
  if msg=$(python3 "$TMP/check_v41.py" "$TMP/v41.json" "$TMP/v41/config.json" "$TMP" 2>&1); then
    ok "v41 capacity = (gpu-mem - weights - prepared - workspace - per-sequence KV) / KV per token: $msg"
  else
    not_ok "v41 capacity = (gpu-mem - weights - prepared - workspace - per-sequence KV) / KV per token" "$msg"
  fi
  expect_error "--gpu-mem below one rank's weights" \
    '^dsbatch: error: plan: rank 0 \(pp 0, tp 0\): its weights alone are [0-9]+ bytes .*--gpu-mem 100M = 104857600 bytes$' \
    "$DSBATCH" plan --model "$TMP/v41" --tp 2 --pp 2 --gpu-mem 100M
  expect_error "--gpu-mem that holds the weights but not the workspace" \
    '^dsbatch: error: plan: rank 0 \(pp 0, tp 0\): weights [0-9]+ \+ prepared [0-9]+ \+ workspace [0-9]+ \+ per-sequence KV [0-9]+ = [0-9]+ bytes exceed --gpu-mem 500M = 524288000 bytes$' \
    "$DSBATCH" plan --model "$TMP/v41" --tp 2 --pp 2 --gpu-mem 500M
  rm -rf "$TMP/v41"
else
  not_ok "v41-flash 4-layer slice is small enough for CI" "$(cat "$TMP/out")"
fi

# ---------------------------------------------------------------- refusals
expect_error "--tp 3 is refused by the topology check" '^dsbatch: error: --tp 3 does not divide o_groups = 8$' \
  "$DSBATCH" plan --model "$M" --tp 3 --pp 2
expect_error "--pp 5 cannot cut 8 layers without splitting a KV-sharing group" '^dsbatch: error: --pp 5: no valid boundary' \
  "$DSBATCH" plan --model "$M" --tp 8 --pp 5
expect_error "a malformed --gpu-mem" "^dsbatch: error: plan: --gpu-mem '40X'" \
  "$DSBATCH" plan --model "$M" --tp 8 --pp 2 --gpu-mem 40X
expect_error "a missing model folder" "$TMP/nowhere" "$DSBATCH" plan --model "$TMP/nowhere" --tp 1 --pp 1
exit 0
