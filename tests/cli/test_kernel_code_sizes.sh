#!/usr/bin/env bash
# tests/bench/kernel_code_sizes.py on one source of the suite (TAP lines): every __global__ kernel
# of kernels/cuda/cuda_index.cu gets a row with a size in whole 16-byte instructions, largest
# first; the sizes follow the code (the same file compiled with one kernel's body doubled by a
# second copy of its loop reads larger); and --timeline sets a hand-made timeline's kernels beside
# their sizes, a kernel it cannot size as "?". A parse that took another readelf column, dropped
# the template arguments the timeline names, or sorted wrongly breaks one of these. Needs nvcc
# (/usr/local/cuda/bin, or NVCC) and readelf: skipped (ok, with a note) where there is none.
set -u
cd "$(dirname "$0")/../.." || exit 2
TMP=$(mktemp -d "${TMPDIR:-/tmp}/dsbatch_codesizes.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
ok() { echo "ok - $1"; }
not_ok() { echo "not ok - $1"; [ -n "${2:-}" ] && printf '%s\n' "$2" | head -20 | sed 's/^/#   /'; return 0; }
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
if [ ! -x "$NVCC" ] || ! command -v readelf > /dev/null; then
  ok "kernel_code_sizes.py: skipped (no nvcc at $NVCC or no readelf)"
  exit 0
fi
S=tests/bench/kernel_code_sizes.py
SRC=kernels/cuda/cuda_index.cu

if out=$(NVCC=$NVCC python3 $S --files $SRC --out "$TMP/s.csv" 2>&1); then
  ok "kernel_code_sizes.py runs on $SRC"
else
  not_ok "kernel_code_sizes.py runs on $SRC" "$out"
fi
want=$(grep -A1 "__global__" $SRC | grep -o "[a-z_0-9]*_kernel" | sort -u)
got=$(tail -n +2 "$TMP/s.csv" | cut -d, -f2 | sort -u)
if [ -n "$want" ] && [ "$want" = "$got" ]; then
  ok "every __global__ kernel of $SRC has a row ($(echo $want))"
else
  not_ok "every __global__ kernel of $SRC has a row" "want: $want
got: $got"
fi
if python3 - "$TMP/s.csv" <<'E'; then ok "sizes are whole 16-byte instructions, largest first"; else not_ok "sizes are whole 16-byte instructions, largest first"; fi
import csv, sys
r = [int(x["code_bytes"]) for x in csv.DictReader(open(sys.argv[1]))]
sys.exit(0 if r and all(s > 0 and s % 16 == 0 for s in r) and r == sorted(r, reverse=True) else 1)
E

# the same file with ring_store_kernel's body run twice over a second pointer: more code
mkdir -p "$TMP/k/kernels/cuda" "$TMP/k/src"
cp -r kernels/*.h "$TMP/k/kernels/" 2>/dev/null
cp kernels/cuda/*.h kernels/cuda/*.cuh "$TMP/k/kernels/cuda/"
cp src/*.h "$TMP/k/src/"
python3 - "$SRC" "$TMP/k/$SRC" <<'E'
import re, sys
s = open(sys.argv[1]).read()
m = re.search(r"__global__ void ring_store_kernel\(([^)]*)\) \{\n(.*?)\n\}\n", s, re.S)
body = m.group(2)
s = s[:m.start()] + "__global__ void ring_store_kernel(%s) {\n%s\n#pragma unroll 1\n    for (int rep = 0; rep < 2; rep++) {\n%s\n    ring = ring + W * 7;\n    }\n}\n" % (m.group(1), body, body) + s[m.end():]
open(sys.argv[2], "w").write(s)
E
mkdir -p "$TMP/k/tests/bench" && cp tests/bench/kernel_code_sizes.py tests/bench/step_timeline.py "$TMP/k/tests/bench/"
if NVCC=$NVCC python3 "$TMP/k/tests/bench/kernel_code_sizes.py" --files $SRC --out "$TMP/big.csv" > "$TMP/big.txt" 2>&1; then
  a=$(grep ",ring_store_kernel," "$TMP/s.csv" | cut -d, -f3)
  b=$(grep ",ring_store_kernel," "$TMP/big.csv" | cut -d, -f3)
  if [ -n "$a" ] && [ -n "$b" ] && [ "$b" -gt "$a" ]; then
    ok "a kernel with more code reads larger ($a -> $b bytes)"
  else
    not_ok "a kernel with more code reads larger" "before '$a', after '$b'"
  fi
else
  not_ok "kernel_code_sizes.py runs on the changed source" "$(cat "$TMP/big.txt")"
fi

# --timeline: a step_timeline.sh kernels CSV of two kernels, one not in the sources
cat > "$TMP/tl.csv" <<'E'
batch,kernel,launches_per_step,sum_us,exposed_us,idle_before_us,exposed_plus_idle_pct
1,attn_index_kernel,20.0,28.4,28.4,67.5,2.7
1,some_other_kernel<4>,2.0,10.0,40.0,0.0,1.0
8,attn_index_kernel,20.0,30.0,30.0,60.0,2.0
E
out=$(NVCC=$NVCC python3 $S --files $SRC --out "$TMP/s2.csv" --timeline "$TMP/tl.csv" --batch 1 2>&1 |
  sed -n '/, batch 1: kernel/,$p')
line1=$(printf '%s\n' "$out" | grep -n "some_other_kernel<4>" | head -1)
line2=$(printf '%s\n' "$out" | grep -n "attn_index_kernel  " | head -1)
kb=$(awk -F, '$2 == "attn_index_kernel" {printf "%.1f", $3 / 1024}' "$TMP/s.csv")
if printf '%s\n' "$line1" | grep -q "?" && printf '%s\n' "$line2" | grep -q " $kb " &&
   [ "${line1%%:*}" -lt "${line2%%:*}" ] && printf '%s\n' "$line2" | grep -q " 1.42 "; then
  ok "--timeline: each kernel beside its size ($kb KB; ? where none), its µs a launch, most exposed first"
else
  not_ok "--timeline: each kernel beside its size" "$out"
fi
if NVCC=$NVCC python3 $S --files $SRC --out "$TMP/s3.csv" --timeline "$TMP/tl.csv" --batch 64 > "$TMP/e.txt" 2>&1; then
  not_ok "--timeline without rows of the batch fails" "$(cat "$TMP/e.txt")"
else
  grep -q "no rows of batch 64" "$TMP/e.txt" && ok "--timeline without rows of the batch fails, naming it" ||
    not_ok "--timeline without rows of the batch fails, naming it" "$(cat "$TMP/e.txt")"
fi
