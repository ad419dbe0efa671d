#!/usr/bin/env bash
# On the GPU machine (device tool, carry ["carry/ab.tgz"] from tests/gpu/ab_pack.sh): the kernel
# timeline of decode steps, as they run (graphs replayed, both streams), for every packed revision:
# bench_step once plainly (its own ms per step) and once under tests/gpu/cupti_trace.c (a CUDA
# injection library: every kernel's start and end on the device clock), then
# tests/bench/step_timeline.py splits each traced step into idle / one kernel / overlapped time and
# charges each kernel its exposed time and the idle gap in front of it. Env: BATCHES (default
# "1,64"), STEPS (5), CTX (64), LABELS (default: every packed revision). Everything comes back in $OUT/timeline.tgz (per label:
# LABEL_summary.csv, LABEL_kernels.csv, LABEL_gaps.csv, LABEL_lanes.csv (the attention input's lanes), the runs' outputs; the raw trace compressed); stdout has
# the summary lines.
set -u
cd "$(dirname "$0")/../.." || exit 2
[ -f carry/ab.tgz ] || { echo "step_timeline.sh: no carry/ab.tgz (tests/gpu/ab_pack.sh, and carry it)" >&2; exit 2; }
rm -rf carry/ab && tar -C carry -xzf carry/ab.tgz # afresh, as ab_run.sh: a warm machine keeps an older one
. tests/gpu/carry_env.sh
BATCHES=${BATCHES:-1,64}
STEPS=${STEPS:-5}
W=$(mktemp -d)
# the CUPTI the library was built against (its activity records' layout is that header's), ahead of
# the machine's own, and nothing else of carry/lib ahead of it
CUPTI_DIR=$W/cupti; mkdir -p "$CUPTI_DIR"
for f in carry/lib/libcupti.so*; do [ -e "$f" ] && ln -sf "$PWD/$f" "$CUPTI_DIR/"; done
if [ -n "${LABELS:-}" ]; then read -r -a labels <<< "$LABELS"; else mapfile -t labels < carry/ab/LABELS; fi
for label in "${labels[@]}"; do
  bin=$PWD/carry/ab/$label/bench_step
  # the preset by absolute path: the traced run works in its own folder, where neither the working
  # directory's data/ nor the binary's ../../data (carry/data) is
  args=(--backend cuda --preset "$PWD/data/presets/v41-flash.json" --ctx "${CTX:-64}" --batch "$BATCHES"
        --steps "$STEPS" --prefill "" --profiler-range)
  timeout "${T_RUN:-200}" "$bin" "${args[@]}" --csv "$W/${label}_plain.csv" > "$W/${label}_plain.txt" 2>&1
  mkdir -p "$W/$label"
  (cd "$W/$label" && LD_LIBRARY_PATH=$CUPTI_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
    CUDA_INJECTION64_PATH=$OLDPWD/carry/ab/libcupti_trace.so timeout "${T_RUN:-200}" "$bin" "${args[@]}" \
    --csv "$W/${label}_traced.csv" > "$W/${label}_traced.txt" 2>&1)
  echo "$label: plain $(awk '/^decode /{printf "b%s %s ms; ", $2, $4}' "$W/${label}_plain.txt")traced $(awk '/^decode /{printf "b%s %s ms; ", $2, $4}' "$W/${label}_traced.txt")"
  python3 tests/bench/step_timeline.py --trace "$W/$label/kernel_trace.csv" --batches "$BATCHES" --steps "$STEPS" \
    --bench-csv "$W/${label}_plain.csv" --summary "$W/${label}_summary.csv" --kernels "$W/${label}_kernels.csv" --gaps "$W/${label}_gaps.csv" \
    --lanes "$W/${label}_lanes.csv" > "$W/${label}_timeline.txt" 2>&1 || echo "step_timeline.sh: $label: step_timeline.py failed"
  head -n 40 "$W/${label}_timeline.txt"
  gzip -f "$W/$label/kernel_trace.csv" 2>/dev/null
  tar -C "$W" -czf "$OUT/timeline.tgz" --exclude=./cupti . # after every label: a call cut short keeps the labels done
done
rm -rf "$W"
