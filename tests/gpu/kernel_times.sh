#!/usr/bin/env bash
# On the GPU machine (device tool, after tests/gpu/pack.sh): the per-kernel breakdown of a decode
# step, as the step runs (CUDA graphs replayed, unless EAGER=1). Nsight Compute collects only the
# timed steps (bench_step --profiler-range; --profile-from-start off) and only each kernel's
# duration (gpu__time_duration.sum), with the caches and clocks left as they run
# (--cache-control none --clock-control none); ncu serializes the kernels, so the launch gaps
# between them are not in these numbers. tests/bench/kernel_times.py sums them per kernel into
# $OUT/cuda_step_kernels.csv. Env: BATCHES (default "1 8 64"), STEPS (2); PREFILL (default none:
# prompt lengths whose timed prefill is broken down the same way into $OUT/cuda_prefill_kernels.csv,
# one prompt each, "batch" = its length).
set -u
cd "$(dirname "$0")/../.."
. tests/gpu/carry_env.sh
NCU=${NCU:-/usr/local/cuda/bin/ncu}
STEPS=${STEPS:-2}
args=()
for b in ${BATCHES:-1 8 64}; do
  timeout ${T_NCU:-200} $NCU --profile-from-start off --metrics gpu__time_duration.sum --cache-control none \
    --clock-control none --csv carry/gpu/bench/bench_step --backend cuda --ctx 64 --batch "$b" --steps "$STEPS" \
    --prefill "" --profiler-range ${EAGER:+--eager} > "$OUT/ncu_kernels_b$b.csv" 2> "$OUT/ncu_kernels_b$b.err"
  args+=("$b=$OUT/ncu_kernels_b$b.csv")
done
python3 tests/bench/kernel_times.py --steps "$STEPS" --out "$OUT/cuda_step_kernels.csv" "${args[@]}"
if [ -n "${PREFILL:-}" ]; then
  pargs=()
  for p in $PREFILL; do
    timeout ${T_NCU:-200} $NCU --profile-from-start off --metrics gpu__time_duration.sum --cache-control none \
      --clock-control none --csv carry/gpu/bench/bench_step --backend cuda --ctx 0 --batch "" --prefill "$p" \
      --profiler-range > "$OUT/ncu_kernels_p$p.csv" 2> "$OUT/ncu_kernels_p$p.err"
    pargs+=("$p=$OUT/ncu_kernels_p$p.csv")
  done
  python3 tests/bench/kernel_times.py --steps 1 --out "$OUT/cuda_prefill_kernels.csv" "${pargs[@]}"
fi
# the raw ncu tables in one archive: the device tool brings back only a handful of files, and a
# run that also leaves device_run.sh's run.tgz must stay under that count
raw=$(cd "$OUT" && ls ncu_kernels_* 2>/dev/null)
if [ -n "$raw" ]; then tar -C "$OUT" -czf "$OUT/ncu_raw.tgz" $raw && rm -f "$OUT"/ncu_kernels_*; fi
