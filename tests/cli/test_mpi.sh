#!/usr/bin/env bash
# The MPI layer under mpirun (mpi/topo.c, mpi/comm_mpi.c) through build/mpitests/mpi_comm_check:
# the TP8 x PP2 layout on 16 oversubscribed ranks, TP4 x PP2 and TP2 x PP2 x DP2 on 8, the default
# layout, the rejections (tp 3 against o_groups = 8; a world that does not factor) on every rank,
# and the two fault paths: a rank killed while the others reduce (the job must end), and a rank
# alive but absent (the watchdog must name the pending operation). TAP lines; wall times are in
# the names so CI logs show them. Every mpirun has --timeout so a hang fails instead of blocking.
set -u
MPITESTS=${MPITESTS:-build/mpitests}
GOLDEN=${GOLDEN:-../shared/golden}
CHECK=$MPITESTS/mpi_comm_check
CFG=$GOLDEN/tp8pp2/config.json
. "$(dirname "$0")/mpi_check_lib.sh"

# Successful layouts: exit 0 and rank 0's summary with 0 failed.
for spec in "16 8 2" "8 4 2" "8 2 2" "16 0 0"; do
  set -- $spec
  np=$1 tp=$2 pp=$3
  name="np${np}_tp${tp}_pp${pp}"
  run "$name" 300 "$np" "$tp" "$pp" "$CFG" 60
  summary=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$T/$name.log" | tail -1)
  layout=$(grep '^world ' "$T/$name.log" | sed 's/;.*//')
  if [ "$rc" -eq 0 ] && [[ "$summary" == *" passed, 0 failed" ]]; then
    ok "mpirun -np $np mpi_comm_check $tp $pp: $layout: $summary (${secs} s)"
  else
    nok "mpirun -np $np mpi_comm_check $tp $pp: rc $rc, ${summary:-no summary} (${secs} s)"
    grep -E 'FAIL|error|watchdog|FATAL' "$T/$name.log" | head -20
  fi
done

# tp 3 does not fit o_groups = 8: every rank rejects it with the same line and exits non-zero.
run tp3 120 16 3 2 "$CFG"
lines=$(grep -c 'error: --tp 3 does not divide o_groups = 8' "$T/tp3.log")
if [ "$rc" -ne 0 ] && [ "$lines" -eq 16 ]; then
  ok "tp 3 on 16 ranks rejected on every rank: '--tp 3 does not divide o_groups = 8' x $lines, rc $rc"
else
  nok "tp 3 on 16 ranks: rc $rc, $lines of 16 ranks printed the o_groups error"
  head -20 "$T/tp3.log"
fi

# 6 ranks cannot hold tp 4 x pp 1.
run np6 120 6 4 1 "$CFG"
lines=$(grep -c 'error: world size 6 is not divisible by tp 4 x pp 1' "$T/np6.log")
if [ "$rc" -ne 0 ] && [ "$lines" -eq 6 ]; then
  ok "world 6 with tp 4 rejected on every rank: 'world size 6 is not divisible by tp 4 x pp 1', rc $rc"
else
  nok "world 6 with tp 4: rc $rc, $lines of 6 ranks printed the error"
  head -20 "$T/np6.log"
fi

# Rank 3 SIGKILLs itself after a barrier while the others enter an allreduce (5 s deadline): the
# job must end, by mpirun noticing the dead rank or by the watchdog, well within 60 s.
run kill 60 16 kill 5 "$CFG"
if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ] && awk -v s="$secs" 'BEGIN { exit !(s < 60) }'; then
  ok "kill: rank 3 killed during an allreduce, job ended with rc $rc after ${secs} s"
else
  nok "kill: rc $rc after ${secs} s (must end non-zero within 60 s)"
  tail -20 "$T/kill.log"
fi

# Rank 3 stays alive but never joins the allreduce: only the watchdog can end this job, and it
# must say who waits for what.
run hang 60 16 hang 5 "$CFG"
wd=$(grep -m1 "dsbatch: watchdog: rank [0-9]* (pp [0-9]*, tp [0-9]*, micro-batch 0) host .*: allreduce_sum (16 x f32) 'fault test' on world pending after 5\.[0-9] s" "$T/hang.log")
if [ "$rc" -ne 0 ] && [ -n "$wd" ] && awk -v s="$secs" 'BEGIN { exit !(s < 30) }'; then
  ok "hang: watchdog fired after the 5 s deadline, job ended with rc $rc after ${secs} s"
else
  nok "hang: rc $rc after ${secs} s, watchdog line: ${wd:-none}"
  tail -20 "$T/hang.log"
fi
echo "# $wd"
