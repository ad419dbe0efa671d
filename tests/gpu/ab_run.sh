#!/usr/bin/env bash
# On the GPU machine (device tool, carry ["carry/ab.tgz"] from tests/gpu/ab_pack.sh): the card's
# copy bandwidth (bench_linear_cuda, the first revision's), then bench_step of every packed
# revision in turn, REPS rounds (default 2), with the same BENCH_ARGS (default: context 64, batch
# 1, 8, 64, 256, 5 timed steps, a 2,048-token prefill). Everything comes back in $OUT/ab.tgz: each
# run's output, copy.csv, and alternated.csv (tests/bench/step_alternated.py's rows, each run
# labelled by its revision's LABEL); stdout has one line per run. VARIANTS="name=args;name=args"
# runs each revision once per variant in every round, with the variant's arguments after
# BENCH_ARGS, labelled LABEL-name (bench_step --tp-standin async|sync|graph side by side). LABELS="a b"
# runs only those packed revisions (a pack that also holds a diagnostic build for step_timeline.sh). To keep the rows:
#   python3 tests/bench/step_alternated.py --copy-gbps G --device NAME --out results/cuda_step_alternated.csv \
#       --append LABEL=run.txt ...   (or append alternated.csv's rows as they are)
set -u
cd "$(dirname "$0")/../.." || exit 2
[ -f carry/ab.tgz ] || { echo "ab_run.sh: no carry/ab.tgz (tests/gpu/ab_pack.sh, and carry it)" >&2; exit 2; }
rm -rf carry/ab && tar -C carry -xzf carry/ab.tgz
. tests/gpu/carry_env.sh
REPS=${REPS:-2}
BENCH_ARGS=${BENCH_ARGS:---ctx 64 --batch 1,8,64,256 --steps 5 --prefill 2048}
# as the shell reads them, so an empty argument can be given (--prefill "": no prefill); split on
# blanks, the quotes reached bench_step as two characters and it ran nothing
eval "bench_args=($BENCH_ARGS)" || { echo "ab_run.sh: BENCH_ARGS does not parse: $BENCH_ARGS" >&2; exit 2; }
W=$(mktemp -d)
device=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "device: $device"
timeout 120 carry/ab/bench_linear_cuda "$W/copy.csv" 1 > "$W/copy.txt" 2>&1
gbps=$(awk -F, 'NR == 2 {print $11}' "$W/copy.csv" 2>/dev/null)
if [ -n "$gbps" ]; then echo "copy: $gbps GB/s"; else echo "copy: not measured"; fi
mapfile -t labels < carry/ab/LABELS
if [ -n "${LABELS:-}" ]; then
  for l in $LABELS; do
    [ -x "carry/ab/$l/bench_step" ] || { echo "ab_run.sh: LABELS names '$l', which is not packed (${labels[*]})" >&2; exit 2; }
  done
  read -r -a labels <<< "$LABELS"
fi
IFS=';' read -r -a variants <<< "${VARIANTS:-=}"
specs=()
for rep in $(seq 1 "$REPS"); do
  for label in "${labels[@]}"; do
    for v in "${variants[@]}"; do
      vname=${v%%=*}
      eval "extra=(${v#*=})" || { echo "ab_run.sh: variant does not parse: $v" >&2; exit 2; }
      rl=$label${vname:+-$vname}
      out="$W/${rl}_$rep.txt"
      timeout "${T_RUN:-200}" "carry/ab/$label/bench_step" --backend cuda "${bench_args[@]}" "${extra[@]}" > "$out" 2>&1
      rc=$?
      echo "$rl run $rep (rc $rc): $(awk '/^(decode|prefill) /{printf "%s %s %s ms; ", $1, $2, $4}' "$out")"
      # a failed run (a variant's flag an older revision lacks, say) is reported above and left out of
      # alternated.csv, which would otherwise not be written at all
      [ $rc -eq 0 ] && specs+=("$rl=$out")
      tar -C "$W" -czf "$OUT/ab.tgz" . # after every run: a call cut short still brings back the runs done
    done
  done
done
python3 tests/bench/step_alternated.py --copy-gbps "${gbps:-0}" --device "$device" --out "$W/alternated.csv" "${specs[@]}" ||
  echo "ab_run.sh: step_alternated.py failed (see the runs' outputs)"
tar -C "$W" -czf "$OUT/ab.tgz" . && rm -rf "$W"
