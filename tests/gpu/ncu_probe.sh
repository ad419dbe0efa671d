#!/usr/bin/env bash
# On the GPU machine (device tool, after tests/gpu/pack.sh): Nsight Compute sections of the hot
# decode kernels — the tensor-core routed experts at batch 64 inside bench_step's decode step, and
# the decode linear tiling at T = 1 in bench_linear_cuda — into $OUT/ncu_*.txt; or, with KERNEL,
# any kernel of a decode step. A diagnosis aid
# for issue #6 (where a kernel's time goes: occupancy, stalls, memory throughput), not a test.
set -u
cd "$(dirname "$0")/../.."
. tests/gpu/carry_env.sh
NCU=${NCU:-/usr/local/cuda/bin/ncu}
SECTIONS=${SECTIONS:-"--section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats"}
# KERNEL=REGEX: only the first 3 kernels matching REGEX inside one timed decode step of batch
# ${BATCH:-1} (bench_step --profiler-range, eager so kernels map to ops), e.g. KERNEL=dense_segsum
if [ -n "${KERNEL:-}" ]; then
  timeout 200 $NCU --profile-from-start off --kernel-name "regex:$KERNEL" --launch-count 3 $SECTIONS \
    carry/gpu/bench/bench_step --backend cuda --ctx 64 --batch "${BATCH:-1}" --steps 1 --prefill "" --profiler-range \
    --eager > "$OUT/ncu_kernel.txt" 2>&1
  grep -E "Duration|Throughput|Achieved Occupancy|Registers|Stall|Issued Warp|No Eligible|Warp Cycles|L2 Hit" "$OUT/ncu_kernel.txt" | head -60
  exit 0
fi
# the context prefill (64 x 64 tokens: 2 forwards x 20 layers x 8 passes x 2 kernels = 640 launches)
# and the warm-up step (40) come first
timeout 240 $NCU --kernel-name regex:moe_mma_kernel --launch-skip ${MOE_SKIP:-680} --launch-count 2 $SECTIONS \
  carry/gpu/bench/bench_step --backend cuda --ctx 64 --batch 64 --steps 1 --prefill "" > "$OUT/ncu_moe.txt" 2>&1
[ -n "${NO_LINEAR:-}" ] || timeout 200 $NCU --kernel-name regex:mma_decode_kernel --launch-skip ${LIN_SKIP:-0} --launch-count 1 $SECTIONS \
  carry/gpu/bench/bench_linear_cuda /tmp/lin.csv > "$OUT/ncu_linear.txt" 2>&1
grep -E "Duration|Throughput|Achieved Occupancy|Theoretical Occupancy|Registers|Block Limit|Stall|Issued Warp|No Eligible|Warp Cycles" "$OUT"/ncu_*.txt | head -80
