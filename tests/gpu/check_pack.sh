#!/usr/bin/env bash
# Pack a correctness check small enough to travel beside an A/B pack (tests/gpu/ab_pack.sh) in one
# device call: build/dsbatch, the named CUDA test binaries (default test_cuda_ops test_cuda_moe
# test_cuda_ops_misc test_cuda_attn: the op tests against the CPU backend), the small6 golden
# fixture and the libraries the binaries load, into carry/check.tgz. The device tool carries
# 64 MiB in all and each CUDA binary holds the whole kernel suite (~10 MB compressed), so a call
# that also carries ab.tgz (two revisions, ~23 MB) has room for dsbatch, small6 and one or two
# tests (with one: 29 MB); the full run (tests/gpu/pack.sh + device_run.sh test engine) needs a
# call of its own. AB_LIBS=1 leaves out the libraries the A/B pack beside it already holds (~7 MB;
# check_run.sh takes those from there): only dsbatch's own (HDF5 and what it loads, which
# bench_step does not link, with libcurl's TLS chain) stay. `--verify-only` packs no test, only
# dsbatch and small6 (the golden verify): 22 MB with AB_LIBS=1, beside a 3-revision A/B pack.
# BUILD (default build) is the build folder the binaries come from: an A/B pack's worktree after
# `make -C tmp/ab/LABEL all` (BUILD=tmp/ab/LABEL/build) tests that revision, patch and all.
#   bash tests/gpu/check_pack.sh test_cuda_attn
#   then, on the device (carry ["carry/check.tgz", "carry/ab.tgz"]):
#   bash tests/gpu/check_run.sh && T_RUN=60 REPS=2 bash tests/gpu/ab_run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
GOLDEN=${GOLDEN:-../shared/golden}
BUILD=${BUILD:-build}
C=carry
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(test_cuda_ops test_cuda_moe test_cuda_ops_misc test_cuda_attn)
[ "${tests[*]}" = --verify-only ] && tests=()
rm -rf $C/check $C/check.tgz
mkdir -p $C/check/bin $C/check/lib $C/check/golden
cp "$BUILD/dsbatch" $C/check/bin/
for t in ${tests[@]+"${tests[@]}"}; do
  [ -x "$BUILD/tests/$t" ] || { echo "check_pack.sh: no $BUILD/tests/$t (make first)" >&2; exit 2; }
  cp "$BUILD/tests/$t" $C/check/bin/
done
strip $C/check/bin/*
. tests/gpu/carry_libs.sh
carry_libs $C/check/lib $C/check/bin/*
if [ "${AB_LIBS:-0}" = 1 ]; then
  [ -f $C/ab.tgz ] || { echo "check_pack.sh: AB_LIBS=1 wants carry/ab.tgz (tests/gpu/ab_pack.sh first)" >&2; exit 2; }
  # the libraries the A/B pack holds stay out; check_run.sh unpacks that pack's first
  have=$(tar -tzf $C/ab.tgz | sed -n 's|^lib/||p')
  for f in $C/check/lib/*; do
    if echo "$have" | grep -qx "${f##*/}"; then rm -f "$f"; fi
  done
fi
cp -r "$GOLDEN/small6" $C/check/golden/
rm -f $C/check/golden/small6/run.log
tar -C $C -czf $C/check.tgz check
du -sh $C/check.tgz
if [ "$(stat -c %s $C/check.tgz)" -gt $((64 << 20)) ]; then
  echo "check_pack.sh: $C/check.tgz is larger than the device tool's 64 MiB: name fewer tests" >&2
  exit 1
fi
