#!/usr/bin/env bash
# CPU engine throughput on the golden models (single rank): 8 prompts of 32 random tokens, 64 new
# tokens each, greedy, max-seqs 1 and 8. Writes results/cpu_engine_throughput.csv with the commit,
# host and core count. Not a timed test: run it with `bash tests/bench_cpu.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
GOLDEN=${GOLDEN:-../shared/golden}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
python3 -c "
import json,random
r=random.Random(3)
with open('$T/p.jsonl','w') as f:
    for i in range(8): f.write(json.dumps({'id':i,'tokens':[r.randrange(3,496) for _ in range(32)]})+'\n')"
out=results/cpu_engine_throughput.csv
echo "model,max_seqs,prompt_tokens,generated_tokens,wall_s,generated_tok_per_s,cores,host,commit" > $out
for d in small6 tp8pp2; do
  for s in 1 8; do
    start=$(date +%s.%N)
    build/dsbatch generate --model "$GOLDEN/$d" --prompts "$T/p.jsonl" --out "$T/o.jsonl" --max-seqs $s \
      --max-new-tokens 64 --max-seq-len 128
    end=$(date +%s.%N)
    python3 -c "
import json; g=sum(len(json.loads(l)['output_tokens']) for l in open('$T/o.jsonl')); w=$end-$start
print('$d,$s,256,%d,%.3f,%.1f,$(nproc),$(hostname -s),$(git rev-parse --short HEAD)' % (g, w, g/w))" >> $out
  done
done
cat $out
