#!/usr/bin/env bash
# Slurm end to end (issue #5): start a real slurmctld + slurmd for this host (no systemd, no munge:
# auth/none; ../shared/notes/INFRA.md §4) with state, spool, logs and ports of its own under a temp
# dir, submit slurm/dsbatch_cpu_smoke.sbatch with sbatch (16 ranks, srun --mpi=pmix, then mpirun),
# poll squeue every 0.5 s, read each job's state and exit code from `scontrol show job` (no
# accounting, so no sacct), compare the output with a one-rank `dsbatch generate` byte for byte, and
# check that a failing job is reported FAILED. The node also declares 8 stand-in GPUs (gres/gpu on
# /dev/null links), so the two GPU scripts run under sbatch as well, on CPU ranks: 1x8 as written,
# 2x8 with only --nodes=1 --ntasks-per-node=16 overridden; a wrapper records what each rank sees.
# Slurm is shut down (`scontrol shutdown`) and the daemons and any process left with this test's
# SLURM_CONF are ended by pid on exit. TAP lines.
# Needs root and the Debian packages slurmctld slurmd slurm-client (.ci/run installs them).
set -u
DSBATCH=${DSBATCH:-build/dsbatch}
DSBATCH=$(cd "$(dirname "$DSBATCH")" && pwd)/$(basename "$DSBATCH")
export DSBATCH
PROMPTS=data/prompts/tiny.jsonl
T0=$(date +%s.%N)
ok() { echo "ok - $1"; }
nok() { echo "not ok - $1"; }
secs() { python3 -c "import time; print('%.1f' % (time.time() - $1))"; }

# --- preconditions: say why, never skip silently
missing=""
for c in slurmctld slurmd sbatch squeue sinfo scontrol scancel srun; do
  command -v "$c" >/dev/null 2>&1 || missing="$missing $c"
done
if [ -n "$missing" ]; then
  nok "slurm: missing commands:$missing (apt-get install slurmctld slurmd slurm-client)"; exit 0
fi
if [ "$(id -u)" != 0 ]; then
  nok "slurm: slurmd must run as root to start jobs (uid $(id -u))"; exit 0
fi
[ -x "$DSBATCH" ] || { nok "slurm: no dsbatch binary at $DSBATCH"; exit 0; }

# a test run from inside a Slurm job must not hand that job's variables to the scripts
for v in $(compgen -e | grep '^SLURM_'); do unset "$v"; done

T=$(mktemp -d /tmp/dsbatch-slurm.XXXXXX)
chmod 755 "$T"
mkdir -p "$T/state" "$T/spool" "$T/log" "$T/pmix" "$T/jobs" "$T/dev"
CTLD_PID=""; SLURMD_PID=""
export SLURM_CONF=$T/slurm.conf
# the jobs run a copy: a rebuild of build/ while the test runs must not change the binary under it
cp "$DSBATCH" "$T/dsbatch" && DSBATCH=$T/dsbatch

alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }
# processes outside this script's own tree that carry this test's SLURM_CONF: job steps, ranks
leftovers() {
  python3 - "$$" "$SLURM_CONF" <<'PY'
import os, sys
me, conf = sys.argv[1], ("SLURM_CONF=" + sys.argv[2]).encode()
def ppid(p):
    try: return open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]
    except OSError: return "0"
for p in filter(str.isdigit, os.listdir("/proc")):
    try: env = open(f"/proc/{p}/environ", "rb").read().split(b"\0")
    except OSError: continue
    if conf not in env: continue
    q = p
    while q not in ("0", "1", me): q = ppid(q)
    if q != me: print(p)
PY
}
cleanup() {
  trap - EXIT INT TERM
  if alive "$CTLD_PID"; then
    ids=$(squeue -h -o %i 2>/dev/null)
    if [ -n "$ids" ]; then
      scancel $ids 2>/dev/null
      for _ in $(seq 40); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.25; done
    fi
    scontrol shutdown >/dev/null 2>&1
  fi
  for _ in $(seq 40); do alive "$CTLD_PID" || alive "$SLURMD_PID" || break; sleep 0.25; done
  for p in $CTLD_PID $SLURMD_PID $(leftovers); do alive "$p" && kill -9 "$p" 2>/dev/null; done
  if [ -n "${KEEP_SLURM_TMP:-}" ]; then echo "# kept $T"; else rm -rf "$T"; fi
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# --- configuration for this host: own ports (another test run on the same host must not collide),
# first job id random (pmix and job paths are per job id), CPUs=16 on any core count.
# proctrack/linuxproc, not pgid: here PID 1 reaps orphans late, and srun leaves an orphaned child
# in the batch script's process group, so pgid's end-of-job wait (sleep 1 s, then 2 s until the
# group is empty) added 3 s to every job that ran srun. batch_sched_delay=0: a submitted job is
# scheduled at the next 1 s tick instead of after up to 3 s.
HOST=$(hostname -s)
read -r CTLD_PORT SLURMD_PORT < <(python3 -c "
import socket
s=[socket.socket() for _ in range(2)]
for x in s: x.bind(('127.0.0.1', 0))
print(*[x.getsockname()[1] for x in s])")
cat > "$SLURM_CONF" <<EOF
ClusterName=dsbatchci
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
MpiDefault=pmix
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
GresTypes=gpu
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=300
FirstJobId=$(( (RANDOM % 9000 + 1000) * 100 ))
StateSaveLocation=$T/state
SlurmdSpoolDir=$T/spool
SlurmctldPidFile=$T/slurmctld.pid
SlurmdPidFile=$T/slurmd.pid
SlurmctldLogFile=$T/log/slurmctld.log
SlurmdLogFile=$T/log/slurmd.log
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=16 RealMemory=1000 Gres=gpu:8 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
# read from the folder of slurm.conf: keep PMIx's per-job client folders out of /tmp
echo "PMIxCliTmpDirBase=$T/pmix" > "$T/mpi.conf"
# 8 stand-in GPUs: gres/gpu wants character devices, /dev/null will do (nothing opens them here)
for i in 0 1 2 3 4 5 6 7; do ln -s /dev/null "$T/dev/gpu$i"; done
echo "Name=gpu File=$T/dev/gpu[0-7]" > "$T/gres.conf"

logs() { tail -n 5 "$T"/log/*.log 2>/dev/null | tr '\n' ' ' | cut -c1-600; }

# --- start the daemons in the foreground of background jobs, so their pids are ours to end
t=$(date +%s.%N)
slurmctld -D -f "$SLURM_CONF" </dev/null >"$T/log/slurmctld.out" 2>&1 &
CTLD_PID=$!
slurmd -D -f "$SLURM_CONF" </dev/null >"$T/log/slurmd.out" 2>&1 &
SLURMD_PID=$!
state=""
for _ in $(seq 120); do   # 30 s at most
  state=$(sinfo -h -n "$HOST" -o %T 2>/dev/null)
  [ "$state" = idle ] && break
  alive "$CTLD_PID" && alive "$SLURMD_PID" || break
  sleep 0.25
done
if [ "$state" = idle ]; then
  ok "slurm: slurmctld + slurmd started without systemd (auth/none, ports $CTLD_PORT/$SLURMD_PORT), node $HOST idle in $(secs "$t") s"
else
  nok "slurm: node $HOST not idle (state '$state'; slurmctld $(alive "$CTLD_PID" && echo up || echo dead), slurmd $(alive "$SLURMD_PID" && echo up || echo dead)): $(logs) $(cat "$T"/log/*.out 2>/dev/null | tail -3)"
  exit 0
fi

# submit KEY=VALUE... SCRIPT: prints the job id; the job's log is $T/jobs/ID.out
submit() {
  local script=${*: -1}
  env "${@:1:$#-1}" sbatch --parsable --output="$T/jobs/%j.out" "$script" 2>"$T/sbatch.err" | cut -d';' -f1
}
# wait_job ID: poll squeue every 0.5 s (sbatch --wait polls every 8 s) up to JOB_WAIT s (jobs here take
# 2-5 s); then JOB_STATE and JOB_EXIT from scontrol (the record stays MinJobAge = 300 s)
JOB_WAIT=${JOB_WAIT:-180}
wait_job() {
  local id=$1 n=0
  while [ -n "$(squeue -h -j "$id" -o %T 2>/dev/null)" ]; do
    n=$((n + 1))
    if [ $n -ge $((JOB_WAIT * 2)) ]; then scancel "$id"; JOB_STATE="still-queued-after-${JOB_WAIT}s"; JOB_EXIT=?; return 1; fi
    sleep 0.5
  done
  local rec; rec=$(scontrol -o show job "$id" 2>/dev/null)
  JOB_STATE=$(sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' <<<"$rec")
  JOB_EXIT=$(sed -n 's/.* ExitCode=\([0-9:]*\).*/\1/p' <<<"$rec")
}
joblog() { tail -n 4 "$T/jobs/$1.out" 2>/dev/null | tr '\n' ' ' | cut -c1-500; }

# --- 1. the CPU smoke job as written: srun --mpi=pmix, 16 ranks, makes the tiny model
t=$(date +%s.%N)
id=$(submit MODEL="$T/model" PROMPTS="$PROMPTS" OUT="$T/smoke.jsonl" slurm/dsbatch_cpu_smoke.sbatch)
if [ -z "$id" ]; then
  nok "slurm: sbatch refused the smoke job: $(cat "$T/sbatch.err")"
else
  wait_job "$id"
  # no accounting (AccountingStorageType=none): sacct refuses, so states come from scontrol
  sacct_says=$(sacct -n -j "$id" 2>&1); sacct_rc=$?
  if [ "$JOB_STATE" = COMPLETED ] && [ "$JOB_EXIT" = 0:0 ] && grep -q '^dsbatch smoke: OK' "$T/jobs/$id.out" \
     && [ -f "$T/model/config.json" ] && [ $sacct_rc -ne 0 ]; then
    ok "slurm: sbatch dsbatch_cpu_smoke.sbatch (srun --mpi=pmix, 16 ranks TP2xPP2xDP4, model made by mkmodel): job $id COMPLETED, exit $JOB_EXIT (scontrol; sacct: '$sacct_says'), $(secs "$t") s"
  elif [ $sacct_rc -eq 0 ]; then
    nok "slurm: sacct answered although accounting is off: $sacct_says"
  else
    nok "slurm: smoke job $id: state $JOB_STATE exit $JOB_EXIT: $(joblog "$id") | $(logs)"
  fi
fi

# --- 2. its output: one line per prompt, byte-identical to one rank
"$DSBATCH" generate --model "$T/model" --prompts "$PROMPTS" --out "$T/one.jsonl" >/dev/null 2>"$T/one.err"
want=$(grep -c . "$PROMPTS")
got=$(wc -l < "$T/smoke.jsonl" 2>/dev/null || echo 0)
if [ "$got" = "$want" ] && cmp -s "$T/one.jsonl" "$T/smoke.jsonl"; then
  ok "slurm: smoke output has one line per prompt ($got) and is byte-identical to a one-rank generate"
else
  nok "slurm: smoke output has $got lines for $want prompts, or differs from one rank ($(tail -1 "$T/one.err"))"
fi

# --- 3. the same script with LAUNCHER=mpirun (Open MPI takes its 16 slots from Slurm), model present
t=$(date +%s.%N)
id=$(submit LAUNCHER=mpirun TP=1 PP=2 MODEL="$T/model" PROMPTS="$PROMPTS" OUT="$T/smoke_mpirun.jsonl" slurm/dsbatch_cpu_smoke.sbatch)
if [ -n "$id" ] && wait_job "$id" && [ "$JOB_STATE" = COMPLETED ] && [ "$JOB_EXIT" = 0:0 ] \
   && ! grep -q mkmodel "$T/jobs/$id.out" && cmp -s "$T/one.jsonl" "$T/smoke_mpirun.jsonl"; then
  ok "slurm: LAUNCHER=mpirun inside the allocation (16 ranks TP1xPP2xDP8, existing model): job $id COMPLETED, output = one rank, $(secs "$t") s"
else
  nok "slurm: mpirun smoke job ${id:-?}: state ${JOB_STATE:-?} exit ${JOB_EXIT:-?}: $(joblog "$id") $(cat "$T/sbatch.err")"
fi

# --- 4, 5. the GPU scripts under sbatch on CPU ranks and stand-in GPUs (the tiny model allows TP <= 2).
# A wrapper in front of dsbatch records, per launched rank: world rank, node-local rank, visible GPUs.
cat > "$T/dsbatch-wrap" <<EOF
#!/bin/sh
if [ -n "\${PMIX_RANK:-}" ]; then
  echo "\$PMIX_RANK \${OMPI_COMM_WORLD_LOCAL_RANK:-\${SLURM_LOCALID:-?}} \${CUDA_VISIBLE_DEVICES:-none}" > "\$RANKS/\$PMIX_RANK"
fi
exec "$DSBATCH" "\$@"
EOF
chmod +x "$T/dsbatch-wrap"
# gpu_job NAME NRANKS [SBATCH-OPTIONS...] -- [VAR=VALUE...] SCRIPT
gpu_job() {
  local name=$1 n=$2; shift 2
  local opts=(); while [ "$1" != -- ]; do opts+=("$1"); shift; done; shift
  local script=${*: -1} t id ranks bad=""
  t=$(date +%s.%N)
  mkdir -p "$T/ranks_$name"
  id=$(env "${@:1:$#-1}" DSBATCH="$T/dsbatch-wrap" RANKS="$T/ranks_$name" MODEL="$T/model" PROMPTS="$PROMPTS" \
       OUT="$T/$name.jsonl" sbatch --parsable --output="$T/jobs/%j.out" --time=00:05:00 "${opts[@]}" "$script" 2>"$T/sbatch.err" | cut -d';' -f1)
  if [ -z "$id" ]; then nok "slurm: sbatch refused $script: $(cat "$T/sbatch.err")"; return; fi
  wait_job "$id"
  ranks=$(cat "$T/ranks_$name"/* 2>/dev/null | sort -n)
  [ "$(grep -c . <<<"$ranks")" = "$n" ] || bad="$bad ranks-launched=$(grep -c . <<<"$ranks")"
  awk '$1 != $2 || $3 != "0,1,2,3,4,5,6,7" { exit 1 }' <<<"$ranks" || bad="$bad rank-view:$(head -2 <<<"$ranks" | tr '\n' ';')"
  { grep -q '^+ .*dsbatch-wrap plan ' "$T/jobs/$id.out" && grep -q '^plan ' "$T/jobs/$id.out"; } || bad="$bad no-plan"
  cmp -s "$T/one.jsonl" "$T/$name.jsonl" || bad="$bad output-differs"
  if [ "$JOB_STATE" = COMPLETED ] && [ "$JOB_EXIT" = 0:0 ] && [ -z "$bad" ]; then
    ok "slurm: sbatch ${opts[*]:+${opts[*]} }$script (${*:1:$#-1}): job $id COMPLETED, $n ranks each see GPUs 0-7 with node-local rank = rank, plan printed, output = one rank, $(secs "$t") s"
  else
    nok "slurm: $script job $id: state $JOB_STATE exit $JOB_EXIT$bad: $(joblog "$id")"
  fi
}
export OMPI_MCA_mpi_yield_when_idle=1   # 8 or 16 ranks on this machine's cores
gpu_job 1x8 8 -- BACKEND=cpu TP=2 PP=1 slurm/dsbatch_1x8.sbatch
gpu_job 2x8 16 --nodes=1 --ntasks-per-node=16 -- BACKEND=cpu LAUNCHER=mpirun TP=2 PP=2 slurm/dsbatch_2x8_a800.sbatch
unset OMPI_MCA_mpi_yield_when_idle

# --- 6. a failing job is reported as failed: dsbatch refuses the layout (TP4 on 2 output groups)
# on every rank, srun exits non-zero and set -e ends the script
id=$(submit MODEL="$T/model" PROMPTS="$PROMPTS" TP=4 PP=2 OUT="$T/fail.jsonl" slurm/dsbatch_cpu_smoke.sbatch)
if [ -n "$id" ] && wait_job "$id" && [ "$JOB_STATE" = FAILED ] && [ "${JOB_EXIT%%:*}" != 0 ] \
   && grep -q 'does not divide' "$T/jobs/$id.out" && ! grep -q 'smoke: OK' "$T/jobs/$id.out"; then
  ok "slurm: a failing job (dsbatch refuses TP4 on the tiny model) is reported FAILED, exit $JOB_EXIT"
else
  nok "slurm: failing job ${id:-?}: state ${JOB_STATE:-?} exit ${JOB_EXIT:-?} (want FAILED, non-zero): $(joblog "$id")"
fi
id=$(submit MODEL="$T/model" PROMPTS="$T/no_such_prompts.jsonl" OUT="$T/fail2.jsonl" slurm/dsbatch_cpu_smoke.sbatch)
if [ -n "$id" ] && wait_job "$id" && [ "$JOB_STATE" = FAILED ] && [ "${JOB_EXIT%%:*}" != 0 ] \
   && grep -q 'cannot read PROMPTS' "$T/jobs/$id.out" && [ ! -e "$T/fail2.jsonl" ]; then
  ok "slurm: a job on a missing prompt file is reported FAILED, exit $JOB_EXIT, no output file"
else
  nok "slurm: missing-prompts job ${id:-?}: state ${JOB_STATE:-?} exit ${JOB_EXIT:-?} (want FAILED, non-zero): $(joblog "$id")"
fi

# --- 7. all three scripts: effective commands (DRY_RUN), #SBATCH lines, no hard-coded paths or hosts
bad=""
for s in slurm/dsbatch_2x8_a800.sbatch slurm/dsbatch_1x8.sbatch slurm/dsbatch_cpu_smoke.sbatch; do
  bash -n "$s" || bad="$bad $s:syntax"
  grep -q '^set -euo pipefail' "$s" || bad="$bad $s:no-set-euo"
  for k in nodes time job-name output; do grep -q "^#SBATCH --$k=" "$s" || bad="$bad $s:no-$k"; done
  grep -qE '^#SBATCH --(ntasks|ntasks-per-node)=' "$s" || bad="$bad $s:no-tasks"
  if grep -nE '^[^#]*(^|[[:space:]"'"'"'=:(])/(work|home|scratch|tmp|data|mnt|opt|usr|srv|gpfs|lustre)/' "$s" >/dev/null; then
    bad="$bad $s:abs-path"
  fi
  # hosts, partitions and accounts are the submitter's (sbatch -p/-A/-w on the command line)
  if grep -qE '^#SBATCH +(-w|-p|-A|--nodelist|--partition|--account|--exclude)' "$s"; then bad="$bad $s:site-specific"; fi
done
grep -q '^#SBATCH --gpus-per-node=8' slurm/dsbatch_2x8_a800.sbatch || bad="$bad 2x8:gpus"
grep -q '^#SBATCH --gpus-per-node=8' slurm/dsbatch_1x8.sbatch || bad="$bad 1x8:gpus"
d2=$(env -u DSBATCH DRY_RUN=1 SLURM_SUBMIT_DIR="$T/sub" SLURM_JOB_ID=42 SLURM_JOB_NUM_NODES=2 SLURM_NTASKS_PER_NODE=8 \
     SLURM_NTASKS=16 bash slurm/dsbatch_2x8_a800.sbatch 2>&1)
grep -q "^+ srun --mpi=pmix --nodes=2 --ntasks=16 --ntasks-per-node=8 --distribution=block .*$T/sub/build/dsbatch generate --model $T/sub/models/DeepSeek-V4.1-Flash --prompts $T/sub/data/prompts/tiny.jsonl --out $T/sub/dsbatch-42.jsonl --tp 8 --pp 2 --backend cuda" <<<"$d2" \
  || bad="$bad 2x8:dry-run"
d2m=$(env -u DSBATCH DRY_RUN=1 LAUNCHER=mpirun TP=8 PP=2 PP_LAYERS=4,4 WATCHDOG=60 TRACE=t.csv EXTRA_ARGS="--max-seqs 4" \
      SLURM_SUBMIT_DIR="$T/sub" SLURM_JOB_NUM_NODES=2 SLURM_NTASKS_PER_NODE=8 bash slurm/dsbatch_2x8_a800.sbatch 2>&1)
grep -q "^+ mpirun -np 16 --map-by ppr:8:node .* generate .* --tp 8 --pp 2 --pp-layers 4,4 --watchdog 60 --trace t.csv --backend cuda --max-seqs 4" <<<"$d2m" \
  || bad="$bad 2x8:dry-run-mpirun"
d1=$(env -u DSBATCH DRY_RUN=1 SLURM_SUBMIT_DIR="$T/sub" SLURM_JOB_ID=43 bash slurm/dsbatch_1x8.sbatch 2>&1)
grep -q "^+ srun --mpi=pmix --nodes=1 --ntasks=8 .* generate .* --tp 8 --pp 1 --backend cuda" <<<"$d1" || bad="$bad 1x8:dry-run"
if [ -z "$bad" ]; then
  ok "slurm: GPU scripts (2x8 TP8xPP2, 1x8 TP8) print the expected srun/mpirun commands; #SBATCH lines, set -euo pipefail, no hard-coded paths, hosts, partitions or accounts"
else
  nok "slurm: script checks failed:$bad"
fi

# --- 8. shut down: nothing of ours left running
scontrol shutdown >/dev/null 2>&1
for _ in $(seq 40); do alive "$CTLD_PID" || alive "$SLURMD_PID" || break; sleep 0.25; done
left=""
alive "$CTLD_PID" && left="$left slurmctld($CTLD_PID)"
alive "$SLURMD_PID" && left="$left slurmd($SLURMD_PID)"
for p in $(leftovers); do left="$left $(cat /proc/"$p"/comm 2>/dev/null)($p)"; kill -9 "$p" 2>/dev/null; done
if [ -z "$left" ]; then
  ok "slurm: scontrol shutdown stopped slurmctld and slurmd, no job process left (test wall time $(secs "$T0") s)"
else
  nok "slurm: still running after scontrol shutdown:$left (killed)"
fi
exit 0
