#!/usr/bin/env bash
# A/B throughput sweep: `bash jobs/run_sweep.sh jobs/sweep_tiny.json OUTDIR [mpirun args...]`.
# Each variant is the base job spec with the variant's options on top; every variant runs the
# same prompts with the same seeds, writes OUTDIR/NAME.jsonl, and one CSV row
# (variant, generated tokens, seconds, tok/s) goes to OUTDIR/sweep.csv. The engine's outputs do not
# depend on batch size or layout, so variants differ only in time; the script checks that too
# (variants that chunk prompts differently need the chunk-invariant settings in the base:
# "window-layout": "decode", "no-stale-index-keys": true, as the example has).
set -euo pipefail
spec=$1 out=$2
shift 2
DSBATCH=${DSBATCH:-build/dsbatch}
mkdir -p "$out"
echo "variant,generated_tokens,seconds,tok_per_s,tokens_sha256" > "$out/sweep.csv"
python3 - "$spec" "$out" <<'PY'
import json, sys
spec, out = json.load(open(sys.argv[1])), sys.argv[2]
for v in spec["variants"]:
    job = dict(spec["base"]); job.update({k: x for k, x in v.items() if k != "name"})
    job["out"] = f"{out}/{v['name']}.jsonl"
    json.dump(job, open(f"{out}/{v['name']}.json", "w"), indent=1)
    print(v["name"])
PY
for job in "$out"/*.json; do
  name=$(basename "$job" .json)
  start=$(date +%s.%N)
  if [ $# -gt 0 ]; then "$@" "$DSBATCH" generate --job "$job"; else "$DSBATCH" generate --job "$job"; fi
  end=$(date +%s.%N)
  python3 - "$out/$name.jsonl" "$name" "$start" "$end" >> "$out/sweep.csv" <<'PY'
import hashlib, json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
toks = [r["output_tokens"] for r in rows]
n = sum(len(t) for t in toks); secs = float(sys.argv[4]) - float(sys.argv[3])
print(f"{sys.argv[2]},{n},{secs:.3f},{n / secs:.1f},{hashlib.sha256(json.dumps(toks).encode()).hexdigest()[:16]}")
PY
done
if [ "$(cut -d, -f5 "$out/sweep.csv" | tail -n +2 | sort -u | wc -l)" -ne 1 ]; then
  echo "sweep: variants produced different tokens" >&2
  exit 1
fi
cat "$out/sweep.csv"
