#!/usr/bin/env bash
# The device comms under mpirun (mpi/comm_nccl.c, device staging in mpi/comm_mpi.c) through
# build/mpitests/nccl_comm_check. Everywhere: the MPI comm staged through the CPU backend on 1 and
# 4 ranks (the staging code paths; CI has no GPU). With a GPU: the NCCL comm on one rank per GPU
# (every op on device buffers, the rank-order sum kernel for up to 16 simulated ranks), 4 ranks on
# one GPU (comm_nccl_new must refuse on every rank, the staged MPI comm must then be right), a host
# buffer handed to the NCCL comm (must abort naming it), and an allreduce that cannot complete (the
# watchdog must fire with the MPI backend's line). Without a GPU or without a CUDA build, the GPU cases are
# TAP skips. Every mpirun has --timeout so a hang fails instead of blocking.
set -u
MPITESTS=${MPITESTS:-build/mpitests}
CHECK=$MPITESTS/nccl_comm_check
. "$(dirname "$0")/mpi_check_lib.sh"

# expect_summary NAME TITLE: exit 0 and rank 0's "N passed, 0 failed"; a skip line passes through.
expect_summary() {
  local name=$1 title=$2 summary skipline
  skipline=$(grep -m1 '^ok - .* # SKIP ' "$T/$name.log")
  if [ "$rc" -eq 0 ] && [ -n "$skipline" ]; then
    echo "$skipline"
    return
  fi
  summary=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$T/$name.log" | tail -1)
  if [ "$rc" -eq 0 ] && [[ "$summary" == *" passed, 0 failed" ]]; then
    ok "$title: $summary (${secs} s)"
  else
    nok "$title: rc $rc, ${summary:-no summary} (${secs} s)"
    grep -E 'FAIL|error|watchdog|FATAL' "$T/$name.log" | head -20
  fi
}

# Staging through the CPU backend: no GPU needed.
for np in 1 4; do
  run "cpu_np$np" 120 "$np" cpu
  expect_summary "cpu_np$np" "mpirun -np $np nccl_comm_check cpu: MPI comm staged through the CPU backend"
done

run gpus 60 1 gpus
gpus=$(grep -E '^[0-9]+$' "$T/gpus.log" | tail -1)
gpus=${gpus:-0}
if [ "$gpus" -eq 0 ]; then
  # the program says why (no GPU, or built without CUDA) in its own skip line
  for mode in nccl shared hostptr hang; do
    run "skip_$mode" 60 1 "$mode" 1
    line=$(grep -m1 '^ok - .* # SKIP ' "$T/skip_$mode.log")
    if [ "$rc" -eq 0 ] && [ -n "$line" ]; then
      echo "$line"
    else
      nok "nccl_comm_check $mode without a GPU must skip: rc $rc"
      tail -5 "$T/skip_$mode.log"
    fi
  done
  exit 0
fi

# One rank per GPU (at most 8): the NCCL comm.
np=$((gpus < 8 ? gpus : 8))
run nccl 300 "$np" nccl
expect_summary nccl "mpirun -np $np nccl_comm_check nccl: NCCL comm on $np GPU(s), sum kernel, staged comm"

# Four ranks on GPU 0: NCCL refuses on every rank, the staged MPI comm takes over.
run shared 300 4 shared
expect_summary shared "mpirun -np 4 nccl_comm_check shared: NCCL refused on a shared GPU, MPI staging through CUDA"
echo "$(grep -m1 '^# refusal: ' "$T/shared.log")"

# A host pointer through the NCCL comm: the job ends, naming the op and the argument.
run hostptr 60 1 hostptr
msg=$(grep -m1 "allreduce_sum (64 x u8) 'host buffer' on nccl world: buf is a host pointer" "$T/hostptr.log")
if [ "$rc" -ne 0 ] && [ -n "$msg" ]; then
  ok "hostptr: host buffer refused by the NCCL comm, rc $rc"
else
  nok "hostptr: rc $rc, message: ${msg:-none}"
  tail -10 "$T/hostptr.log"
fi

# An allreduce behind a stalled stream (a peer that never comes, as one GPU can show it): only the
# watchdog can end it, with the MPI backend's line.
run hang 60 1 hang 3
wd=$(grep -m1 "dsbatch: watchdog: rank 0 (pp 0, tp 0, micro-batch 0) host .*: allreduce_sum (16 x f32) 'fault test' on nccl world pending after 3\.[0-9] s" "$T/hang.log")
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && [ -n "$wd" ] && awk -v s="$secs" 'BEGIN { exit !(s < 40) }'; then
  ok "hang: NCCL watchdog fired after the 3 s deadline, job ended with rc $rc after ${secs} s"
else
  nok "hang: rc $rc after ${secs} s, watchdog line: ${wd:-none}"
  tail -20 "$T/hang.log"
fi
echo "# $wd"
