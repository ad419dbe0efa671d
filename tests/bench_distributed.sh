#!/usr/bin/env bash
# The 16-rank CPU job (TP8 x PP2 on the golden tp8pp2 model, as CI runs it): wall time, tokens/s,
# and from the per-step trace how busy each pipeline stage is, how much of the time both stages
# compute at once (micro-batches in flight), and the TP collectives' part of the forwards (8 ranks
# a core here: mostly waiting for peers that are not scheduled). Writes
# results/cpu_16rank_tp8pp2.json and the trace CSV next to it. Not a timed test:
# `bash tests/bench_distributed.sh` (2 cores oversubscribed 8x).
set -euo pipefail
cd "$(dirname "$0")/.."
GOLDEN=${GOLDEN:-../shared/golden}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
python3 -c "
import json,random
r=random.Random(21)
with open('$T/p.jsonl','w') as f:
    for i in range(16): f.write(json.dumps({'id':i,'tokens':[r.randrange(3,496) for _ in range(48)],'max_new_tokens':32})+'\n')"
start=$(date +%s.%N)
mpirun --allow-run-as-root --oversubscribe --timeout 600 -np 16 build/dsbatch generate --model "$GOLDEN/tp8pp2" \
  --prompts "$T/p.jsonl" --out "$T/o.jsonl" --max-seqs 8 --trace results/cpu_16rank_tp8pp2_trace.csv 2>"$T/log"
end=$(date +%s.%N)
python3 - "$start" "$end" "$T/log" <<'PY'
import csv, json, sys, subprocess, re
start, end, log = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
rows = list(csv.DictReader(open('results/cpu_16rank_tp8pp2_trace.csv')))
tp0 = [r for r in rows if r['tp'] == '0']
span = max(float(r['end_s']) for r in tp0) - min(float(r['start_s']) for r in tp0)
busy = {}
for s in ('0', '1'):
    ev = [(float(r['start_s']), float(r['end_s'])) for r in tp0 if r['stage'] == s]
    busy[s] = sum(e - b for b, e in ev)
# time during which both stages compute: intersect the two stages' busy intervals
ev0 = sorted((float(r['start_s']), float(r['end_s'])) for r in tp0 if r['stage'] == '0')
ev1 = sorted((float(r['start_s']), float(r['end_s'])) for r in tp0 if r['stage'] == '1')
both, j = 0.0, 0
for b0, e0 in ev0:
    for b1, e1 in ev1:
        both += max(0.0, min(e0, e1) - max(b0, b1))
m = re.search(r'generated (\d+) tokens .* in ([0-9.]+) s', open(log).read())
out = {
    'command': 'bash tests/bench_distributed.sh',
    'commit': subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip(),
    'ranks': 16, 'layout': 'TP8 x PP2', 'cores': int(subprocess.run(['nproc'], capture_output=True, text=True).stdout),
    'prompts': 16, 'prompt_tokens_each': 48, 'new_tokens_each': 32, 'max_seqs': 8,
    'wall_s_mpirun': round(end - start, 2),
    'generate_s': float(m.group(2)), 'generated_tokens': int(m.group(1)),
    'generated_tok_per_s': round(int(m.group(1)) / float(m.group(2)), 1),
    'trace_span_s': round(span, 3),
    'stage0_busy_fraction': round(busy['0'] / span, 3), 'stage1_busy_fraction': round(busy['1'] / span, 3),
    'both_stages_busy_fraction': round(both / span, 3),
    'steps_stage0': len(ev0), 'steps_stage1': len(ev1),
    # of the forwards' time, the part in TP collectives (tp_comm_s: waits for slower peers included)
    'tp_comm_fraction_of_forward': round(sum(float(r['tp_comm_s']) for r in rows) /
                                         sum(float(r['compute_s']) for r in rows), 3),
}
json.dump(out, open('results/cpu_16rank_tp8pp2.json', 'w'), indent=1)
print(json.dumps(out, indent=1))
PY
