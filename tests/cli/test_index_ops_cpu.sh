#!/usr/bin/env bash
# The new selection and copy ops' contract checks on any machine: test_cuda_index with a second
# CPU backend standing in for the GPU (DS_CUDA_OPS_ON_CPU) — the GPU-vs-CPU comparison is then
# trivially exact, but every self-check runs against the CPU backend: top-k sets are top-k (ties at
# the k-th place included), sorted, hidden past `visible`, padded; candidate masks select the best
# blocks and keep the visible one; attn_index builds the lists the host built; copy_segs copies exactly its
# segments; memory blocks reused by size keep their own bytes. On a GPU machine `make test-cuda` runs the same program against the CUDA backend.
set -u
BUILD_DIR=${BUILD_DIR:-build}
bin=$BUILD_DIR/tests/test_cuda_index
out=$(DS_CUDA_OPS_ON_CPU=1 CMOCKA_MESSAGE_OUTPUT=STDOUT "$bin" 2>&1); rc=$?
n=$(printf '%s\n' "$out" | sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' | tail -1)
if [ "$rc" -eq 0 ] && [ "${n:-0}" -ge 8 ]; then
  echo "ok - index_topk / cand_mask / attn_index / copy_segs / memory contracts on the CPU backend ($n test groups)"
else
  printf '%s\n' "$out" | tail -30
  echo "not ok - index_topk / cand_mask / attn_index / copy_segs / memory contracts on the CPU backend"
fi
