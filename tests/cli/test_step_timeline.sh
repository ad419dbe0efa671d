#!/usr/bin/env bash
# tests/bench/step_timeline.py on a hand-made kernel trace whose split is known (TAP lines).
# Two profiler windows (batch 1 and 8) of three steps each; the script skips each window's first
# step. Steps 2 and 3 of a window (t = base + 1000.., base + 2000..; µs) are the same pattern:
#   embed +0-100 (alone), gap 100-200, A 200-500 on stream 1 beside B 300-400 on stream 2 (overlap
#   100, A alone 200), gap 500-600, C 600-900 (alone); step 2 ends where step 3's embed starts
#   (+1000: 100 idle after its last kernel), step 3 at its last kernel's end (+900).
#   Per step on average: wall 950, idle 250 (50 after the last kernel), one kernel 600, overlap
#   100; exposed: A 200, B 0; idle in front of C 100.
# The steps' embed, A and C come mangled, as CUPTI names kernels (c++filt reads them back; C
# in an anonymous namespace, which the kernel name drops).
# A wrong sweep (idle counted under a running kernel, overlap charged to one kernel, the first
# step kept, a gap charged after the kernel that started last instead of the one that ended last)
# changes these numbers.
set -u
TMP=$(mktemp -d "${TMPDIR:-/tmp}/dsbatch_timeline.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
ok() { echo "ok - $1"; }
not_ok() { echo "not ok - $1"; [ -n "${2:-}" ] && printf '%s\n' "$2" | head -20 | sed 's/^/#   /'; return 0; }
U=1000 # ns a µs
k() { echo "kernel,$(($2 * U)),$(($3 * U)),$4,0,0,1,32,\"$1\""; } # NAME START END STREAM (µs)
{
  echo "kind,start_ns,end_ns,stream,graph,corr,grid,block,name"
  for base in 0 4000; do
    echo "range_on,$((base * U)),$((base * U)),0,0,0,0,0,\"\""
    k "void embed_kernel<8>(int)" $((base + 10)) $((base + 950)) 1 # the first step (skipped)
    for off in $((base + 1000)) $((base + 2000)); do
      k "_Z12embed_kernelILi8EEvi" $off $((off + 100)) 1
      k "_Z8A_kernelILi1ELi2EEvPfi" $((off + 200)) $((off + 500)) 1
      k "B_kernel" $((off + 300)) $((off + 400)) 2
      k "_ZN12_GLOBAL__N_18C_kernelEi" $((off + 600)) $((off + 900)) 1
    done
    echo "range_off,$(((base + 3500) * U)),$(((base + 3500) * U)),0,0,0,0,0,\"\""
  done
} > "$TMP/trace.csv"
if python3 tests/bench/step_timeline.py --trace "$TMP/trace.csv" --batches 1,8 --steps 3 --summary "$TMP/s.csv" \
  --kernels "$TMP/k.csv" --gaps "$TMP/g.csv" > "$TMP/out" 2>&1; then ok "step_timeline.py runs on a two-window trace"; else
  not_ok "step_timeline.py runs on a two-window trace" "$(cat "$TMP/out")"; exit 0; fi
check() {
  local name=$1 want=$2 got=$3
  if [ "$got" = "$want" ]; then ok "$name ($got)"; else not_ok "$name" "want $want, got $got"; fi
}
# field C of the row whose batch is B (and kernel K): the names hold commas, so csv reads them
col() { python3 -c 'import csv,sys; print(next((r[sys.argv[3]] for r in csv.DictReader(open(sys.argv[1])) if r["batch"] == sys.argv[2]), ""))' "$TMP/s.csv" "$1" "$2"; }
kcol() { python3 -c 'import csv,sys; print(next((r[sys.argv[4]] for r in csv.DictReader(open(sys.argv[1])) if r["batch"] == sys.argv[2] and r["kernel"] == sys.argv[3]), ""))' "$TMP/k.csv" "$1" "$2" "$3"; }
# the gap row of kernel K after kernel P: its idle µs a step and gaps a step ("" when there is none)
gcol() { python3 -c 'import csv,sys; print(next((r[sys.argv[5]] for r in csv.DictReader(open(sys.argv[1])) if r["batch"] == sys.argv[2] and r["kernel"] == sys.argv[3] and r["after"] == sys.argv[4]), ""))' "$TMP/g.csv" "$1" "$2" "$3" "$4"; }
for b in 1 8; do
  check "batch $b: wall per step" 0.95 "$(col $b traced_ms)"
  check "batch $b: idle per step" 0.25 "$(col $b idle_ms)"
  check "batch $b: idle after the last kernel" 0.05 "$(col $b of_which_after_last_ms)"
  check "batch $b: one kernel running" 0.6 "$(col $b one_kernel_ms)"
  check "batch $b: overlap" 0.1 "$(col $b overlap_ms)"
  check "batch $b: A's exposed time (running alone)" 200.0 "$(kcol $b 'A_kernel<1, 2>' exposed_us)"
  check "batch $b: B's exposed time (always beside A)" 0.0 "$(kcol $b B_kernel exposed_us)"
  check "batch $b: C's idle in front" 100.0 "$(kcol $b C_kernel idle_before_us)"
  check "batch $b: embed launches per step" 1.0 "$(kcol $b 'embed_kernel<8>' launches_per_step)"
  # C waits after A, the kernel whose end left the GPU empty (B started later than A but ended first)
  check "batch $b: the gap before C is after A" "100.0 1.0" "$(gcol $b C_kernel 'A_kernel<1, 2>' idle_us) $(gcol $b C_kernel 'A_kernel<1, 2>' gaps_per_step)"
  check "batch $b: no gap is charged after B" "" "$(gcol $b C_kernel B_kernel idle_us)"
  check "batch $b: the gap before A is after the embedding" 100.0 "$(gcol $b 'A_kernel<1, 2>' 'embed_kernel<8>' idle_us)"
done
# the lanes between the embedding and C: A on stream 1 (lane 0, the span's first kernel), B on
# stream 2 (lane 1), once in each of the two steps used, times from the embedding's end
if python3 tests/bench/step_timeline.py --trace "$TMP/trace.csv" --batches 1,8 --steps 3 --summary "$TMP/s3.csv" \
  --kernels "$TMP/k3.csv" --lanes "$TMP/l.csv" --lane-from embed_kernel --lane-to C_kernel > "$TMP/out3" 2>&1; then
  lcol() { python3 -c 'import csv,sys; print(" ".join(next(([r[c] for c in sys.argv[4:]] for r in csv.DictReader(open(sys.argv[1])) if r["batch"] == sys.argv[2] and r["lane"] + "." + r["pos"] == sys.argv[3]), [])))' "$TMP/l.csv" "$@"; }
  for b in 1 8; do
    check "batch $b: lane 0 is A: spans, wait, duration, end (µs)" "A_kernel<1, 2> 2 100.0 300.0 400.0" "$(lcol $b 0.0 kernel spans wait_us dur_us end_us)"
    check "batch $b: lane 1 is B: spans, wait, duration, end (µs)" "B_kernel 2 200.0 100.0 300.0" "$(lcol $b 1.0 kernel spans wait_us dur_us end_us)"
    check "batch $b: no third lane or second position" "" "$(lcol $b 2.0 kernel)$(lcol $b 0.1 kernel)"
    # A ends 100 µs after B (the other lane's kernel that ended last before it); B ends before A
    check "batch $b: A's duration range, and what it ends after" "300.0 300.0 B_kernel 100.0" "$(lcol $b 0.0 dur_min_us dur_max_us ends_after ends_after_us)"
    check "batch $b: B ends after nothing of another lane" "" "$(lcol $b 1.0 ends_after ends_after_us | tr -d ' ')"
  done
else
  not_ok "step_timeline.py --lanes runs" "$(cat "$TMP/out3")"
fi
if python3 tests/bench/step_timeline.py --trace "$TMP/trace.csv" --batches 1,8 --steps 3 --summary "$TMP/s4.csv" \
  --kernels "$TMP/k4.csv" --lanes "$TMP/l4.csv" > "$TMP/out4" 2>&1; then not_ok "--lanes without a span is refused" "$(cat "$TMP/out4")"
elif grep -q "no span from" "$TMP/out4"; then ok "--lanes without a span is refused"
else not_ok "--lanes without a span is refused" "$(cat "$TMP/out4")"; fi
# a window without the step count's embed launches is an error, not a silent split
if python3 tests/bench/step_timeline.py --trace "$TMP/trace.csv" --batches 1,8 --steps 2 --summary "$TMP/s2.csv" \
  --kernels "$TMP/k2.csv" > "$TMP/out2" 2>&1; then not_ok "a wrong step count is refused" "$(cat "$TMP/out2")"
elif grep -q "expected 2 steps" "$TMP/out2"; then ok "a wrong step count is refused"
else not_ok "a wrong step count is refused" "$(cat "$TMP/out2")"; fi
