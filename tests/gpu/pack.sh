#!/usr/bin/env bash
# Pack what a run on the GPU machine needs into carry/ (ignored by git; name it in the device
# tool's `carry`): the CUDA build's binaries, the shared libraries the GPU machine may lack
# (../shared/notes/INFRA.md §5: it has Open MPI, NCCL, CUDA and zstd, not parallel HDF5), and the
# golden fixtures the tests read. tests/gpu/device_run.sh is the other half.
set -euo pipefail
cd "$(dirname "$0")/../.."
GOLDEN=${GOLDEN:-../shared/golden}
C=carry
rm -rf $C/gpu $C/lib $C/golden
mkdir -p $C/gpu/tests $C/gpu/bench $C/gpu/mpitests $C/lib $C/golden
cp build/dsbatch $C/gpu/
for f in build/tests/test_cuda_*; do case $f in *.d) ;; *) cp "$f" $C/gpu/tests/ ;; esac; done
for f in build/bench/*; do case $f in *.d) ;; *) [ -f "$f" ] && cp "$f" $C/gpu/bench/ ;; esac; done
for f in build/mpitests/*; do case $f in *.d) ;; *) cp "$f" $C/gpu/mpitests/ ;; esac; done
strip $C/gpu/dsbatch $C/gpu/tests/* $C/gpu/bench/* $C/gpu/mpitests/* 2>/dev/null || true
# Each CUDA binary holds the whole kernel suite (~14 MB), so all of them pass the device tool's
# 64 MiB: PACK_LEAVE names binaries a run does not use, left out (e.g. "bench_nccl
# nccl_comm_check" for `device_run.sh test engine bench`; multi and nccl need them).
for b in ${PACK_LEAVE:-}; do rm -f $C/gpu/tests/$b $C/gpu/bench/$b $C/gpu/mpitests/$b; done
# every library the binaries load except the C runtime and MPI (the GPU machine's own 4.1 is used)
. tests/gpu/carry_libs.sh
carry_libs $C/lib $C/gpu/dsbatch $C/gpu/tests/*
for g in small6 tp8pp2; do cp -r "$GOLDEN/$g" $C/golden/; done
rm -f $C/golden/*/run.log
# one compressed archive travels (the device tool carries 64 MiB in all); device_run.sh unpacks it
tar -C $C -czf $C/pkg.tgz gpu lib golden
du -sh $C/pkg.tgz
if [ "$(stat -c %s $C/pkg.tgz)" -gt $((64 << 20)) ]; then
  echo "pack.sh: $C/pkg.tgz is larger than the device tool's 64 MiB: leave out what the run does not use (PACK_LEAVE)" >&2
  exit 1
fi
