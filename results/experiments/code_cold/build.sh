#!/usr/bin/env bash
# Builds code_cold (see code_cold.cu) against the kernels of the checkout at REPO (default: this
# one): bash results/experiments/code_cold/build.sh [REPO]; then on the GPU machine ./code_cold.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=${1:-$here/../../..}
f=$repo/kernels/cuda/cuda_elementwise.cu
a=$(grep -n "^enum { QDQ_FP8_32" "$f" | cut -d: -f1)
b=$(grep -n "^template <int MODE, int EPT> __device__ __forceinline__ void qdq_group" "$f" | cut -d: -f1)
e=$(awk -v s="$b" 'NR > s && /^}/ {print NR; exit}' "$f")
c=$(grep -n "^/\* One row of rmsnorm_post_kernel" "$f" | cut -d: -f1)
d=$(grep -n "^bool cuda_rmsnorm_post_shape" "$f" | cut -d: -f1)
out=$(mktemp -d)
{ sed -n "${a},${e}p" "$f"; sed -n "${c},$((d - 1))p" "$f"; } > "$out/code_cold_kernels.cuh"
"${NVCC:-/usr/local/cuda/bin/nvcc}" -O3 -std=c++17 -gencode 'arch=compute_80,code=[sm_80,compute_80]' \
  -I"$out" -I"$repo/kernels/cuda" -I"$repo/kernels" -I"$repo/src" -o "${OUTBIN:-code_cold}" "$here/code_cold.cu"
rm -rf "$out"
