#!/usr/bin/env bash
# The attention benchmark's baseline computes our op (issue #6: "side by side, PyTorch doing the
# same op"): bench_attn on the CPU backend dumps an 8-row decode case (rows younger than the window
# included: -1 entries), and torch_attn_baseline.py --check recomputes the op in float64 from the
# dump (the formulas the torch baseline times) and requires the output within bf16 rounding, while
# the op without the sink or without the mask is outside that bound. On the GPU machine the same
# two commands check the CUDA backend's output (tests/gpu/device_run.sh). Skips on a build without
# the benchmarks (no CUDA toolkit). TAP lines.
set -u
BUILD=${BUILD_DIR:-build}
B="$BUILD/bench/bench_attn"
if [ ! -x "$B" ]; then echo "ok - bench_attn # SKIP not built (no CUDA toolkit)"; exit 0; fi
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
if "$B" --backend cpu --rows 8 --pool 4096 --iters 1 --dump "$d/dump" --csv "$d/a.csv" >"$d/out" 2>&1 &&
   [ "$(grep -c '^cpu,cpu,decode,8,8,512,640,ours' "$d/a.csv")" -eq 2 ] &&
   awk -F, 'NR > 1 && !($9 > 0 && $10 > 0) { bad = 1 } END { exit bad }' "$d/a.csv"; then
  echo "ok - bench_attn: the CPU backend's 8-row decode case timed (graph and eager rows, positive ms and bytes)"
else echo "not ok - bench_attn on the CPU backend"; cat "$d/out"; fi
if python3 tests/bench/torch_attn_baseline.py --check "$d/dump" >"$d/check" 2>&1; then
  echo "ok - the baseline's op is ours: $(cat "$d/check")"
else echo "not ok - the baseline's op against bench_attn's output: $(cat "$d/check")"; fi
# the check tells a different op apart: the output with one head's values shifted by 2 % of the
# largest magnitude (a sink or scale slip of that size) fails it
python3 - "$d/dump" <<'PY'
import sys, numpy as np
o = np.fromfile(f"{sys.argv[1]}/o.bin", np.uint16)
f = (o.astype(np.uint32) << 16).view(np.float32)
f[:512] += np.float32(0.02) * np.abs(f).max()
((f.view(np.uint32) + 0x8000) >> 16).astype(np.uint16).tofile(f"{sys.argv[1]}/o.bin")
PY
if python3 tests/bench/torch_attn_baseline.py --check "$d/dump" >"$d/check2" 2>&1; then
  echo "not ok - the check passed an output 2 % off in one head: $(cat "$d/check2")"
else echo "ok - the check fails an output 2 % off in one head"; fi
if "$B" --backend nope >"$d/bad" 2>&1; then echo "not ok - bench_attn took --backend nope"
elif grep -q "cuda or cpu" "$d/bad"; then echo "ok - bench_attn: an unknown backend is one error line"
else echo "not ok - bench_attn --backend nope: $(cat "$d/bad")"; fi
