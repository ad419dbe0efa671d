#!/usr/bin/env bash
# The node-local Engram service (mpi/engram_service.c) under mpirun, through
# build/mpitests/engram_service_check on the golden tp8pp2 model: TP8 x PP2 on 16 oversubscribed
# ranks of one host (both stages share the node, so the node holds stage 0's tables for all 16 and
# only stage 0's ranks may read them), TP2 x PP2 on 4, the service's byte count against
# `dsbatch plan` for the same node, and the refusal when the tables exceed the node's memory (a
# limit below their size stands in for a 203 GB table on a small host). TAP lines; wall times in
# the names. Every mpirun has --timeout so a hang fails instead of blocking.
set -u
MPITESTS=${MPITESTS:-build/mpitests}
DSBATCH=${DSBATCH:-build/dsbatch}
GOLDEN=${GOLDEN:-../shared/golden}
CHECK=$MPITESTS/engram_service_check
M=$GOLDEN/tp8pp2
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
ok() { echo "ok - $1"; }
nok() { echo "not ok - $1"; }
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --timeout 120)

if [ ! -x "$CHECK" ]; then
  nok "engram_service_check is built ($CHECK missing)"
  exit 1
fi
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
# run NAME NP ARGS...: output in $T/NAME.log, exit code in $rc, seconds in $secs
run() {
  local name=$1 np=$2
  shift 2
  local t0; t0=$(now)
  "${MPIRUN[@]}" -np "$np" "$CHECK" "$@" >"$T/$name.log" 2>&1
  rc=$?
  secs=$(elapsed "$t0" "$(now)")
}

for spec in "16 8 2" "4 2 2"; do
  set -- $spec
  np=$1 tp=$2 pp=$3
  name="np${np}_tp${tp}_pp${pp}"
  run "$name" "$np" "$M" "$tp" "$pp"
  summary=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$T/$name.log" | tail -1)
  info=$(grep -m1 'engram service holds' "$T/$name.log")
  if [ "$rc" -eq 0 ] && [[ "$summary" == *" passed, 0 failed" ]]; then
    ok "mpirun -np $np engram_service_check tp $tp pp $pp: $summary; ${info#node } (${secs} s)"
  else
    nok "mpirun -np $np engram_service_check tp $tp pp $pp: rc $rc, ${summary:-no summary} (${secs} s)"
    grep -E 'FAIL|error|watchdog|FATAL' "$T/$name.log" | head -20 | sed 's/^/#   /'
  fi
done

# The bytes the service allocated are the bytes plan reports for a node holding all 16 ranks.
held=$(sed -n 's/.*engram service holds \([0-9]*\) bytes.*/\1/p' "$T/np16_tp8_pp2.log" | head -1)
planned=$("$DSBATCH" plan --model "$M" --tp 8 --pp 2 --ranks-per-node 16 --json 2>&1 |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["nodes"][0]["engram_host_bytes"])' 2>&1)
if [ -n "$held" ] && [ "$held" = "$planned" ]; then
  ok "service bytes on the node ($held) = plan --ranks-per-node 16 engram_host_bytes"
else
  nok "service bytes on the node (${held:-none}) = plan --ranks-per-node 16 engram_host_bytes ($planned)"
fi

# Tables larger than the node's memory: every rank refuses before allocating, naming the bytes.
run limit 16 "$M" 8 2 limit 60000
summary=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$T/limit.log" | tail -1)
msg=$(grep -m1 '^refused: ' "$T/limit.log")
if [ "$rc" -eq 0 ] && [[ "$summary" == *" passed, 0 failed" ]] &&
   [[ "$msg" =~ need\ [0-9]+\ bytes.*but\ the\ Engram\ service\ limit\ is\ 60000\ bytes ]]; then
  ok "tables over the memory limit refused on all 16 ranks: ${msg#refused: } (${secs} s)"
else
  nok "tables over the memory limit: rc $rc, ${summary:-no summary}, '${msg}'"
  grep -E 'FAIL|error|FATAL' "$T/limit.log" | head -20 | sed 's/^/#   /'
fi
exit 0
