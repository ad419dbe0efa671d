#!/usr/bin/env bash
# Backend calls per decode step of the TP8 x PP2 rank-0 shard (20 layers at V4.1-Flash dimensions,
# synthetic weights), counted by bench_step --profile on the CPU backend: the model code makes the
# same calls on every backend, so no GPU is needed. Writes results/host_calls_<label>.prof.csv and
# folds every such profile in results/ into results/host_calls_per_step.csv + .png.
# Usage: bash tests/bench/host_calls.sh LABEL   (e.g. the commit; ~7 min on 2 cores, 3 GB RAM)
set -euo pipefail
cd "$(dirname "$0")/../.."
label=${1:-$(git rev-parse --short HEAD)}
BUILD_DIR=${BUILD_DIR:-build}
prof=results/host_calls_${label}.prof.csv
"$BUILD_DIR"/bench/bench_step --backend cpu --ctx 8 --batch 1,8,64 --steps 1 --prefill "" --profile "$prof" \
  --csv /dev/null > /dev/null
args=()
for p in results/host_calls_*.prof.csv; do l=${p#results/host_calls_}; args+=("${l%.prof.csv}=$p"); done
python3 tests/bench/host_calls.py results/host_calls_per_step.csv "${args[@]}"
