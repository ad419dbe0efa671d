#!/usr/bin/env bash
# On the GPU machine (device tool, after tests/gpu/pack.sh): Nsight Compute sections of the hot
# decode kernels — the tensor-core routed experts at batch 64 inside bench_step's decode step, and
# the decode linear tiling at T = 1 in bench_linear_cuda — into $OUT/ncu_*.txt; or, with KERNEL,
# any kernel of a decode step or (PREFILL) of a prefill. A diagnosis aid
# for issue #6 (where a kernel's time goes: occupancy, stalls, memory throughput), not a test.
set -u
cd "$(dirname "$0")/../.."
. tests/gpu/carry_env.sh
NCU=${NCU:-/usr/local/cuda/bin/ncu}
SECTIONS=${SECTIONS:-"--section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats"}
# STALLS=1 adds the per-reason warp stall ratios and the pipes' utilization to the KERNEL reports
if [ -n "${STALLS:-}" ]; then
  m=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active
  for r in barrier long_scoreboard short_scoreboard math_pipe_throttle mio_throttle wait not_selected selected dispatch_stall lg_throttle no_instruction branch_resolving; do
    m=$m,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
  done
  SECTIONS="$SECTIONS --metrics $m"
fi
# SOURCE=1 (with KERNEL) also keeps each report's per-instruction view: the SASS as the driver
# compiled it for this GPU, with each instruction's execution count and stall samples by reason
# ($OUT/ncu_source_<i>.csv.gz; tests/bench/sass_hotspots.py summarizes one: opcode mix, stall
# reasons, the hottest instructions). Where a kernel's instructions go, which the section totals
# do not say (f8803ea's diagnosis of the experts' decode kernel came from it).
if [ -n "${SOURCE:-}" ]; then SECTIONS="$SECTIONS --section SourceCounters"; fi
# KERNEL="REGEX ...": for each REGEX, the first ${COUNT:-3} kernels matching it inside one timed
# decode step of batch ${BATCH:-1} (bench_step --profiler-range, eager so kernels map to ops), or
# with PREFILL=N inside the timed prefill of one N-token prompt (one report each,
# ncu_kernel_<i>.txt); REGEX matches the name as ncu demangles it ("void
# <unnamed>::mma_linear_kernel<(int)1, ...>"): e.g. KERNEL=dense_segsum, or
# PREFILL=2048 KERNEL="mma_linear_kernel<.int.1 moe_wide_kernel<.int.2"
if [ -n "${KERNEL:-}" ]; then
  if [ -n "${PREFILL:-}" ]; then shape=(--ctx 0 --batch "" --prefill "$PREFILL"); else shape=(--ctx 64 --batch "${BATCH:-1}" --steps 1 --prefill "" --eager); fi
  i=0
  for re in $KERNEL; do
    rep=()
    [ -n "${SOURCE:-}" ] && rep=(-o "$OUT/ncu_rep_$i" -f)
    timeout ${T_NCU:-200} $NCU --profile-from-start off --kernel-name-base demangled --kernel-name "regex:$re" --launch-count ${COUNT:-3} $SECTIONS \
      "${rep[@]}" carry/gpu/bench/bench_step --backend cuda "${shape[@]}" --profiler-range > "$OUT/ncu_kernel_$i.txt" 2>&1
    if [ -n "${SOURCE:-}" ]; then # the report itself is large: only its text views come back
      $NCU -i "$OUT/ncu_rep_$i.ncu-rep" >> "$OUT/ncu_kernel_$i.txt" 2>&1
      $NCU -i "$OUT/ncu_rep_$i.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip > "$OUT/ncu_source_$i.csv.gz"
      rm -f "$OUT/ncu_rep_$i.ncu-rep"
      python3 tests/bench/sass_hotspots.py "$OUT/ncu_source_$i.csv.gz" --top 12
    fi
    grep -E "^  (void )?[a-z_]|stalled|pipe|Duration|Throughput|Achieved Occupancy|Registers|Stall|Issued Warp|No Eligible|Warp Cycles|L2 Hit|Pipe" "$OUT/ncu_kernel_$i.txt" | head -${LINES_EACH:-60}
    i=$((i + 1))
  done
  exit 0
fi
# the context prefill (64 x 64 tokens: 2 forwards x 20 layers x 8 passes x 2 kernels = 640 launches)
# and the warm-up step (40) come first
timeout 240 $NCU --kernel-name regex:moe_mma_kernel --launch-skip ${MOE_SKIP:-680} --launch-count 2 $SECTIONS \
  carry/gpu/bench/bench_step --backend cuda --ctx 64 --batch 64 --steps 1 --prefill "" > "$OUT/ncu_moe.txt" 2>&1
[ -n "${NO_LINEAR:-}" ] || timeout 200 $NCU --kernel-name regex:mma_decode_kernel --launch-skip ${LIN_SKIP:-0} --launch-count 1 $SECTIONS \
  carry/gpu/bench/bench_linear_cuda /tmp/lin.csv > "$OUT/ncu_linear.txt" 2>&1
grep -E "Duration|Throughput|Achieved Occupancy|Theoretical Occupancy|Registers|Block Limit|Stall|Issued Warp|No Eligible|Warp Cycles" "$OUT"/ncu_*.txt | head -80
