#!/usr/bin/env bash
# The benchmarks' PyTorch baselines compute our ops (issue #6: "side by side, PyTorch doing the same
# op"). Attention: bench_attn on the CPU backend dumps an 8-row decode case (rows younger than the
# window included: -1 entries), and torch_attn_baseline.py --check recomputes the op in float64
# from the dump (the formulas the torch baseline times) and requires the output within bf16
# rounding, while the op without the sink or without the mask is outside that bound. Routed
# experts: bench_moe dumps an 8-token case at small dims (96 local experts of 384, so a dozen local
# pairs), and torch_moe_baseline.py --check recomputes every pair with the reference's roundings,
# the op without the routing weight or the activation quantization outside the bound. Each check
# must also fail a tampered output. On the GPU machine the same commands check the CUDA backend's
# output (tests/gpu/device_run.sh). Skips on a build without the benchmarks (no CUDA toolkit). TAP.
set -u
BUILD=${BUILD_DIR:-build}
if [ ! -x "$BUILD/bench/bench_attn" ] || [ ! -x "$BUILD/bench/bench_moe" ]; then
  echo "ok - bench baselines # SKIP the benchmarks are not built (no CUDA toolkit)"; exit 0
fi
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
# tamper FILE ELEMENTS: the bf16 output's first ELEMENTS values moved by 2 % of its largest magnitude
tamper() {
  python3 - "$1" "$2" <<'PY'
import sys, numpy as np
o = np.fromfile(sys.argv[1], np.uint16)
f = (o.astype(np.uint32) << 16).view(np.float32)
f[:int(sys.argv[2])] += np.float32(0.02) * np.abs(f).max()
((f.view(np.uint32) + 0x8000) >> 16).astype(np.uint16).tofile(sys.argv[1])
PY
}
# run NAME BENCH_ARGS... : the bench's CPU case with a dump, its CSV rows, the baseline's check
for op in attn moe; do
  if [ $op = attn ]; then args="--rows 8 --pool 4096"; out=o.bin; n=512; what="8-row decode case"
  else args="--tokens 8 --dims 256,128 --local 96"; out=y.bin; n=256; what="8-token case"; fi
  if "$BUILD/bench/bench_$op" --backend cpu $args --iters 1 --dump "$d/$op" --csv "$d/$op.csv" >"$d/$op.out" 2>&1 &&
     [ "$(grep -c '^cpu,cpu,' "$d/$op.csv")" -eq 2 ] &&
     awk -F, 'NR > 1 { for (i = 1; i <= NF; i++) if ($i == "ours" || $i == "ours_eager") ok++ } END { exit ok != 2 }' "$d/$op.csv"; then
    echo "ok - bench_$op: the CPU backend's $what timed (graph and eager rows)"
  else echo "not ok - bench_$op on the CPU backend"; cat "$d/$op.out"; fi
  if python3 tests/bench/torch_${op}_baseline.py --check "$d/$op" >"$d/$op.check" 2>&1; then
    echo "ok - the $op baseline's op is ours: $(cat "$d/$op.check")"
  else echo "not ok - the $op baseline's op against bench_$op's output: $(cat "$d/$op.check")"; fi
  tamper "$d/$op/$out" $n
  if python3 tests/bench/torch_${op}_baseline.py --check "$d/$op" >"$d/$op.check2" 2>&1; then
    echo "not ok - the $op check passed an output moved by 2 % in its first $n values: $(cat "$d/$op.check2")"
  else echo "ok - the $op check fails an output moved by 2 % in its first $n values"; fi
  if "$BUILD/bench/bench_$op" --backend nope >"$d/bad" 2>&1; then echo "not ok - bench_$op took --backend nope"
  elif grep -q "cuda or cpu" "$d/bad"; then echo "ok - bench_$op: an unknown backend is one error line"
  else echo "not ok - bench_$op --backend nope: $(cat "$d/bad")"; fi
done
