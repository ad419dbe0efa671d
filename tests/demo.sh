#!/usr/bin/env bash
# `make demo`: on a fresh machine, install what is missing (as root; otherwise print the command),
# build, make the tiny synthetic model, generate continuations for data/prompts/tiny.jsonl on the
# CPU engine and print them. Takes well under two minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS="build-essential pkg-config libopenmpi-dev openmpi-bin libhdf5-openmpi-dev libzstd-dev libcjson-dev libcmocka-dev python3"
missing=""
for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing
  else
    echo "missing packages; run: sudo apt-get install -y --no-install-recommends$missing" >&2
    exit 1
  fi
fi
make -j2 build/dsbatch
D=$(mktemp -d)
trap 'rm -rf "$D"' EXIT
time build/dsbatch mkmodel --preset tiny --seed 1 --out "$D/tiny"
time build/dsbatch generate --model "$D/tiny" --prompts data/prompts/tiny.jsonl --out "$D/out.jsonl" --max-seqs 4
echo "--- outputs ($D/out.jsonl)"
cat "$D/out.jsonl"
