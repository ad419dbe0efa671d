#!/usr/bin/env bash
# Tokenizer encode throughput on one core (issue #8): MB of UTF-8 text per second through
# tok_encode with the golden byte-level BPE tokenizer (DeepSeek-V3/V4 pre-tokenizer layout), on two
# inputs built deterministically from this repository: "english" (the README and a fixed
# paragraph, repeated to 4 MiB) and "code" (every C source and header, in name order, repeated to
# 4 MiB); plus "english-cold": the English input with no word repeated, so the word cache never
# hits (each paragraph copy gets a unique numbered suffix on every word). Best of 3 runs each,
# pinned to CPU 0 when taskset exists. Writes results/tokenizer_throughput.csv
# (commit, host, input, MB/s, bytes, tokens). Not a timed test: run `bash tests/bench_tokenizer.sh`
# after `make`.
set -euo pipefail
cd "$(dirname "$0")/.."
GOLDEN=${GOLDEN:-../shared/golden}
BUILD_DIR=${BUILD_DIR:-build}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT

cat > "$T/bench.c" <<'EOF'
/* Encodes a file N times with one tokenizer and prints "bytes tokens best_seconds". */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "log.h"
#include "tokenizer.h"
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char **argv) {
    struct tokenizer *t = tok_load(argv[1]);
    if (!t) { fprintf(stderr, "%s\n", ds_err_get()); return 1; }
    FILE *f = fopen(argv[2], "rb");
    fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    if (fread(s, 1, (size_t)n, f) != (size_t)n) return 1;
    fclose(f);
    double best = 1e30; size_t ntok = 0;
    for (int r = 0; r < 3; r++) {
        struct tok_ids v = {0};
        double t0 = now();
        if (tok_encode(t, s, (size_t)n, &v)) { fprintf(stderr, "%s\n", ds_err_get()); return 1; }
        double dt = now() - t0;
        if (dt < best) best = dt;
        ntok = v.n;
        tok_ids_free(&v);
    }
    printf("%ld %zu %.6f\n", n, ntok, best);
    tok_free(t);
    return 0;
}
EOF
mpicc -std=c11 -D_GNU_SOURCE -O2 -Isrc "$T/bench.c" -o "$T/bench" "$BUILD_DIR/libdsbatch.a" \
  $(pkg-config --libs libcjson hdf5-openmpi libpcre2-8 libutf8proc) -lzstd -lm -lpthread -fopenmp

python3 - "$T" <<'EOF'
import glob, sys
out = sys.argv[1]
size = 4 << 20
para = ("The quick brown fox jumps over the lazy dog while the committee reviews its quarterly budget. "
        "Researchers at the university published a detailed study of coastal erosion, noting that storms "
        "in 2023 moved more sand than in the previous decade combined. \"We didn't expect this,\" said one "
        "author; others weren't surprised.\n\n")
english = open("README.md", encoding="utf-8").read() + "\n\n" + para
def repeat(s):
    return (s * (size // len(s.encode()) + 1)).encode()[:size].decode("utf-8", "ignore")
open(f"{out}/english.txt", "w", encoding="utf-8").write(repeat(english))
code = "".join(open(p, encoding="utf-8").read() for p in sorted(glob.glob("src/*.[ch]") + glob.glob("kernels/cpu/*.[ch]") + glob.glob("mpi/*.[ch]")))
open(f"{out}/code.txt", "w", encoding="utf-8").write(repeat(code))
words, cold, k = english.split(" "), [], 0
while sum(map(len, cold)) < size:
    cold.append(" ".join(w + "x" + format(k * len(words) + i, "x") for i, w in enumerate(words)))
    k += 1
open(f"{out}/english-cold.txt", "w", encoding="utf-8").write("".join(cold)[:size])
EOF

pin=""
command -v taskset >/dev/null && pin="taskset -c 0"
out=results/tokenizer_throughput.csv
commit=$(git rev-parse --short HEAD)
echo "commit,host,input,mb_per_s,bytes,tokens" > $out
for input in english code english-cold; do
  read -r bytes tokens secs < <(OMP_NUM_THREADS=1 $pin "$T/bench" "$GOLDEN/tokenizer/tokenizer.json" "$T/$input.txt")
  python3 -c "print('$commit,$(hostname -s),$input,%.2f,$bytes,$tokens' % ($bytes / $secs / 1e6))" >> $out
done
cat $out
