# Shared by the TAP scripts that run an MPI check program (test_mpi.sh, test_nccl.sh): source it
# after setting CHECK (the program). Gives ok/nok, a temp folder $T removed on exit, and
# `run NAME TIMEOUT NP ARGS...` (output in $T/NAME.log, exit code in $rc, seconds in $secs).
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
ok() { echo "ok - $1"; }
nok() { echo "not ok - $1"; }
# root in CI containers; --oversubscribe: more ranks than cores (and than GPUs)
MPIRUN=(mpirun --allow-run-as-root --oversubscribe)

if [ ! -x "$CHECK" ]; then
  nok "${CHECK##*/} is built ($CHECK missing)"
  exit 1
fi

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

run() {
  local name=$1 limit=$2 np=$3
  shift 3
  local t0
  t0=$(now)
  "${MPIRUN[@]}" --timeout "$limit" -np "$np" "$CHECK" "$@" > "$T/$name.log" 2>&1
  rc=$?
  secs=$(elapsed "$t0" "$(now)")
}
