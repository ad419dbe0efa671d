#!/usr/bin/env bash
# The one test runner: every cmocka unit binary (build/tests/test_*), then every CLI test script
# (tests/cli/test_*.sh, which print TAP-style "ok - NAME" / "not ok - NAME" lines). It sums the
# counts and ends with the line CI reads: "N passed, N failed". A binary that crashes or a script
# that exits non-zero without reporting counts as one failure.
set -u
BUILD_DIR=${BUILD_DIR:-build}
export GOLDEN=${GOLDEN:-$(cd "$(dirname "$0")/../.." && pwd)/shared/golden}
export DSBATCH=${DSBATCH:-$PWD/$BUILD_DIR/dsbatch}
export MPITESTS=${MPITESTS:-$PWD/$BUILD_DIR/mpitests}
pass=0; fail=0; failed_names=()
log=$(mktemp -d)
for t in "$BUILD_DIR"/tests/test_*; do
  [ -x "$t" ] || continue
  name=$(basename "$t")
  CMOCKA_MESSAGE_OUTPUT=STDOUT timeout 1800 "$t" >"$log/$name.out" 2>&1; rc=$?
  p=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$log/$name.out" | tail -1)
  f=$(sed -n 's/^\[  FAILED  \] \([0-9]*\) test.*/\1/p' "$log/$name.out" | tail -1)
  p=${p:-0}; f=${f:-0}
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi
  pass=$((pass + p)); fail=$((fail + f))
  if [ "$f" -ne 0 ]; then failed_names+=("$name"); cat "$log/$name.out"; fi
  echo "$name: $p passed, $f failed"
done
for s in tests/cli/test_*.sh; do
  [ -f "$s" ] || continue
  name=$(basename "$s" .sh)
  timeout 1800 bash "$s" >"$log/$name.out" 2>&1; rc=$?
  p=$(grep -c '^ok ' "$log/$name.out"); f=$(grep -c '^not ok ' "$log/$name.out")
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; fi
  pass=$((pass + p)); fail=$((fail + f))
  if [ "$f" -ne 0 ]; then failed_names+=("$name"); cat "$log/$name.out"; fi
  echo "$name: $p passed, $f failed"
done
rm -rf "$log"
[ "${#failed_names[@]}" -eq 0 ] || echo "failing: ${failed_names[*]}"
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
