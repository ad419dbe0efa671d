#!/usr/bin/env bash
# On the GPU machine (device tool, carry ["carry/check.tgz", ...] from tests/gpu/check_pack.sh):
# every packed CUDA test binary, then `dsbatch verify --golden small6 --backend cuda` with and
# without --exact-linears. Logs go to $OUT/check.tgz (the device tool brings back only a handful
# of files); stdout has the cmocka summary lines and the verify lines. Exits non-zero when any
# test or verify fails, so `check_run.sh && ab_run.sh` measures only a build that passed.
set -u
cd "$(dirname "$0")/../.." || exit 2
[ -f carry/check.tgz ] || { echo "check_run.sh: no carry/check.tgz (tests/gpu/check_pack.sh, and carry it)" >&2; exit 2; }
rm -rf carry/check && tar -C carry -xzf carry/check.tgz
# a pack made with AB_LIBS=1 holds only the libraries the A/B pack lacks: that pack's first, then its own
mkdir -p carry/lib
[ -f carry/ab.tgz ] && tar -C carry -xzf carry/ab.tgz lib
cp -a carry/check/lib/. carry/lib/
. tests/gpu/carry_env.sh
W=$(mktemp -d)
nvidia-smi -L | tee "$W/device.txt"
rc=0
for t in carry/check/bin/test_*; do
  [ -e "$t" ] || continue # a --verify-only pack
  n=$(basename "$t")
  CMOCKA_MESSAGE_OUTPUT=STDOUT timeout "${T_TEST:-200}" "$t" > "$W/$n.txt" 2>&1 || rc=1
  echo "$n: $(grep -hE '^\[  (PASSED|FAILED)  \] [0-9]+ test' "$W/$n.txt" | tr '\n' ' ')"
done
for mode in "" --exact-linears; do
  if timeout 120 carry/check/bin/dsbatch verify --golden carry/check/golden/small6 --backend cuda $mode \
       > "$W/verify$mode.txt" 2>&1; then :; else rc=1; fi
  echo "verify${mode:+ $mode}: $(tail -1 "$W/verify$mode.txt")"
done
tar -C "$W" -czf "$OUT/check.tgz" . && rm -rf "$W"
exit $rc
