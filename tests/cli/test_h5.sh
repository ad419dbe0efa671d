#!/usr/bin/env bash
# HDF5 prompt and output files from the command line (issue #5), TAP lines "ok - NAME".
#
# `dsbatch prompts` builds prompt files from data/prompts/tiny.jsonl and from token-id text, and
# h5py (Debian's python3-h5py: /usr/bin/python3, since the pyenv python3 on PATH may lack it) must
# read back exactly the JSONL's tokens; zstd datasets are read through the filter plugin built from
# src/h5zstd.c with -DH5ZSTD_PLUGIN (HDF5_PLUGIN_PATH), and --zstd-level 0 files need no plugin.
# Bad prompt files written with h5py (one fault each) and bad JSONL give exactly one error line
# naming the file and the dataset (or line), exit status != 0, and leave no output behind.
# 16 ranks read disjoint shards collectively (build/mpitests/h5_prompts_check). `dsbatch inspect`
# summarises output files written by that helper (finished, partial, score), and h5py reads their
# datasets, the trace tables as record arrays and /meta.
set -u
DSBATCH=${DSBATCH:-build/dsbatch}
MPITESTS=${MPITESTS:-build/mpitests}
PY=/usr/bin/python3
T=$(mktemp -d "${TMPDIR:-/tmp}/dsbatch_h5.XXXXXX")
trap '[ -n "${KEEP:-}" ] || rm -rf "$T"' EXIT
ok() { echo "ok - $1"; }
nok() {
  echo "not ok - $1"
  [ -n "${2:-}" ] && printf '%s\n' "$2" | head -20 | sed 's/^/#   /'
  return 0
}
check() { if eval "$2"; then ok "$1"; else nok "$1" "${3:-}"; fi; }
MPIRUN=(mpirun --allow-run-as-root --oversubscribe)
P=data/prompts/tiny.jsonl

# ---------------------------------------------------------------- the zstd plugin for h5py
mkdir -p "$T/plugins"
if mpicc -O2 -fPIC -shared -DH5ZSTD_PLUGIN $(pkg-config --cflags hdf5-openmpi) -o "$T/plugins/libh5zstd.so" \
  src/h5zstd.c -lzstd 2>"$T/plugin.err"; then
  ok "zstd filter plugin builds from src/h5zstd.c"
else
  nok "zstd filter plugin builds from src/h5zstd.c" "$(cat "$T/plugin.err")"
fi
H5PY=(env HDF5_PLUGIN_PATH="$T/plugins" "$PY")

# ---------------------------------------------------------------- dsbatch prompts
"$DSBATCH" prompts --from $P --out "$T/tiny.h5" >"$T/out" 2>&1
check "prompts --from tiny.jsonl writes tiny.h5 (no .tmp left)" \
  '[ $? -eq 0 ] && [ -f "$T/tiny.h5" ] && [ ! -e "$T/tiny.h5.tmp" ] && grep -q "8 prompts" "$T/out"' "$(cat "$T/out")"
"${H5PY[@]}" - "$T/tiny.h5" "$P" >"$T/py.out" 2>&1 <<'EOF'
import h5py, json, sys, numpy as np
f = h5py.File(sys.argv[1], "r")
rows = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
g = f["prompts"]
assert g.attrs["format_version"] == 1, dict(g.attrs)
assert g.attrs["compression"] == "zstd-32015 level 3", dict(g.attrs)
tok, off = g["tokens"][:], g["offsets"][:]
assert tok.dtype == np.int32 and off.dtype == np.int64
assert off.shape == (len(rows) + 1,) and off[0] == 0 and off[-1] == len(tok)
ic, io = g["id_chars"][:].tobytes(), g["id_offsets"][:]
for i, r in enumerate(rows):
    assert tok[off[i]:off[i + 1]].tolist() == r["tokens"], i
    assert ic[io[i]:io[i + 1]].decode() == r["id"], i
    assert g["max_new_tokens"][i] == r.get("max_new_tokens", -1), i
assert g["tokens"].compression is None and 32015 in g["tokens"]._filters, g["tokens"]._filters
print("h5py ok:", len(rows), "prompts,", len(tok), "tokens")
EOF
check "h5py reads tiny.h5 (with the plugin): the JSONL's tokens, ids, max_new_tokens; zstd filter 32015" \
  '[ $? -eq 0 ]' "$(cat "$T/py.out")"
"$PY" -c "
import h5py, sys
f = h5py.File('$T/tiny.h5', 'r')
assert f['prompts/tokens'].shape == (197,) and f['prompts'].attrs['format_version'] == 1
try:
    f['prompts/tokens'][:]
    sys.exit('read zstd data without the filter?')
except OSError as e:
    assert 'filter' in str(e).lower() or 'zstd' in str(e).lower(), e
" >"$T/py.out" 2>&1
check "h5py without the plugin: shapes and attributes readable, data needs the filter (clear OSError)" \
  '[ $? -eq 0 ]' "$(cat "$T/py.out")"

# Token-id text, uncompressed: readable by plain h5py.
printf '1 2 3\n\n40 50\n  7  \n' >"$T/ids.txt"
"$DSBATCH" prompts --from "$T/ids.txt" --out "$T/ids.h5" --zstd-level 0 >"$T/out" 2>&1 &&
  "$PY" -c "
import h5py
g = h5py.File('$T/ids.h5', 'r')['prompts']
assert g['tokens'][:].tolist() == [1, 2, 3, 40, 50, 7] and g['offsets'][:].tolist() == [0, 3, 5, 6]
assert g.attrs['compression'] == 'none' and 'id' not in g
" >>"$T/out" 2>&1
check "prompts from token-id text with --zstd-level 0: 3 prompts, blank lines skipped, plain h5py reads it" \
  '[ $? -eq 0 ]' "$(cat "$T/out")"

"$DSBATCH" prompts --check "$T/tiny.h5" --vocab 512 --max-len 100 >"$T/out" 2>&1
check "prompts --check tiny.h5 --vocab 512: valid, 8 prompts" '[ $? -eq 0 ] && grep -q "8 prompts, 197 tokens" "$T/out"' \
  "$(cat "$T/out")"
"$DSBATCH" inspect "$T/tiny.h5" >"$T/out" 2>&1
check "inspect tiny.h5 describes the prompt file" '[ $? -eq 0 ] && grep -q "prompt file, 8 prompts" "$T/out"' "$(cat "$T/out")"

# one_error NAME EXPECTED_REGEX CMD...: exit != 0 and exactly one stderr line matching
one_error() {
  local name=$1 re=$2
  shift 2
  "$@" >"$T/stdout" 2>"$T/stderr"
  local rc=$?
  local lines
  lines=$(wc -l <"$T/stderr")
  if [ "$rc" -ne 0 ] && [ "$lines" -eq 1 ] && grep -qE "$re" "$T/stderr"; then
    ok "$name: $(cat "$T/stderr")"
  else
    nok "$name (rc $rc, $lines stderr lines)" "$(cat "$T/stderr")"
  fi
}

one_error "token id >= vocab" 'tiny.h5: /prompts/tokens\[[0-9]+\]: prompt [0-9]+ token [0-9]+ is [0-9]+, outside the vocabulary \[0, 100\)' \
  "$DSBATCH" prompts --check "$T/tiny.h5" --vocab 100
one_error "prompt longer than the maximum" 'tiny.h5: /prompts/offsets: prompt 2 has 33 tokens \+ max_new_tokens 8, above the maximum sequence length 40' \
  "$DSBATCH" prompts --check "$T/tiny.h5" --max-len 40

# Bad prompt files, each with one fault, written by h5py (uncompressed).
"$PY" - "$T" >"$T/py.out" 2>&1 <<'EOF'
import h5py, numpy as np, sys
d = sys.argv[1]
def write(name, tokens=[1, 2, 3, 4, 5], offsets=[0, 2, 5], version=1, extra=None, drop=None):
    with h5py.File(f"{d}/{name}.h5", "w") as f:
        g = f.create_group("prompts")
        if version is not None:
            g.attrs["format_version"] = version
        if drop != "tokens":
            g["tokens"] = np.array(tokens, dtype=np.int32)
        if drop != "offsets":
            g["offsets"] = np.array(offsets, dtype=np.int64)
        for k, v in (extra or {}).items():
            g[k] = v
write("missing_offsets", drop="offsets")
write("missing_tokens", drop="tokens")
write("not_monotonic", offsets=[0, 3, 2, 5])
write("bad_start", offsets=[1, 2, 5])
write("bad_end", offsets=[0, 2, 4])
write("negative_token", tokens=[1, -2, 3, 4, 5])
write("short_temperature", extra={"temperature": np.array([0.5], dtype=np.float32)})
write("no_version", version=None)
write("ok")
with h5py.File(f"{d}/neither.h5", "w") as f:
    f["x"] = [1]
open(f"{d}/not_hdf5.h5", "w").write("not hdf5\n")
EOF
check "h5py writes the bad prompt files" '[ $? -eq 0 ]' "$(cat "$T/py.out")"
one_error "missing dataset" 'missing_offsets.h5: /prompts/offsets: missing dataset' "$DSBATCH" prompts --check "$T/missing_offsets.h5"
one_error "missing tokens (inspect)" 'missing_tokens.h5: /prompts/tokens: missing dataset' "$DSBATCH" inspect "$T/missing_tokens.h5"
one_error "offsets not monotonic" 'not_monotonic.h5: /prompts/offsets: not monotonic' "$DSBATCH" prompts --check "$T/not_monotonic.h5"
one_error "offsets not starting at 0" 'bad_start.h5: /prompts/offsets: offsets\[0\] = 1, must be 0' "$DSBATCH" prompts --check "$T/bad_start.h5"
one_error "offsets not ending at len(tokens)" 'bad_end.h5: /prompts/offsets: last entry 4 does not match /prompts/tokens length 5' \
  "$DSBATCH" prompts --check "$T/bad_end.h5"
one_error "negative token id" 'negative_token.h5: /prompts/tokens\[1\]: prompt 0 token 1 is -2, negative$' "$DSBATCH" prompts --check "$T/negative_token.h5"
one_error "optional dataset of the wrong length" 'short_temperature.h5: /prompts/temperature: length 1, expected 2' \
  "$DSBATCH" prompts --check "$T/short_temperature.h5"
one_error "no format_version" 'no_version.h5: /prompts: missing integer attribute format_version' "$DSBATCH" prompts --check "$T/no_version.h5"
one_error "not an HDF5 file" 'not_hdf5.h5: not an HDF5 file' "$DSBATCH" prompts --check "$T/not_hdf5.h5"
one_error "no such file" 'nowhere.h5: cannot open: No such file' "$DSBATCH" prompts --check "$T/nowhere.h5"
"$DSBATCH" prompts --check "$T/ok.h5" --vocab 6 >"$T/out" 2>&1
check "a well-formed h5py-written prompt file passes --check" '[ $? -eq 0 ] && grep -q "2 prompts, 5 tokens" "$T/out"' "$(cat "$T/out")"

# Bad JSONL: one error line naming the line, no output file and no .tmp left.
printf '{"id": "a", "tokens": [1, 2]}\n{"id": "b", "tokens": [3, -4]}\n' >"$T/bad.jsonl"
one_error "bad JSONL token" 'bad.jsonl:2: tokens\[1\]: not a token id' "$DSBATCH" prompts --from "$T/bad.jsonl" --out "$T/bad_out.h5"
check "bad JSONL leaves no output" '[ ! -e "$T/bad_out.h5" ] && [ ! -e "$T/bad_out.h5.tmp" ]'
one_error "unwritable output" 'no/such/dir/p.h5: cannot write: No such file or directory' \
  "$DSBATCH" prompts --from $P --out "$T/no/such/dir/p.h5"

# ---------------------------------------------------------------- 16 ranks, disjoint shards
t0=$(date +%s.%N)
"${MPIRUN[@]}" --timeout 300 -np 16 "$MPITESTS/h5_prompts_check" "$T" 1000 >"$T/mpi.log" 2>&1
rc=$?
secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
summary=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$T/mpi.log" | tail -1)
check "16 ranks read disjoint shards (dp 16, windows, dp 4 x 4) covering every prompt once; a bad token fails all ranks alike: ${summary:-no summary} (${secs} s)" \
  '[ $rc -eq 0 ] && [[ "$summary" == *" passed, 0 failed" ]]' "$(grep -E 'FAIL|error|rank' "$T/mpi.log" | head)"
grep -E '^16 ranks' "$T/mpi.log" | sed 's/^/# /'

# ---------------------------------------------------------------- output files: inspect and h5py
"$MPITESTS/h5_prompts_check" write-output "$T/out.h5" >"$T/w.log" 2>&1 &&
  "$MPITESTS/h5_prompts_check" write-output "$T/partial.h5" partial >>"$T/w.log" 2>&1 &&
  "$MPITESTS/h5_prompts_check" write-output "$T/score.h5" score >>"$T/w.log" 2>&1
check "helper writes a finished, a partial and a score output" '[ $? -eq 0 ] && [ ! -e "$T/out.h5.journal" ] && [ -e "$T/partial.h5.journal" ]' \
  "$(cat "$T/w.log")"
"$DSBATCH" inspect "$T/out.h5" >"$T/inspect.txt" 2>&1
check "inspect OUT.h5: complete, requests, tokens, throughput, TTFT and ITL p50/p90/p99, job spec" \
  '[ $? -eq 0 ] && grep -q "complete 1" "$T/inspect.txt" && grep -q "12 of 12 prompts recorded" "$T/inspect.txt" &&
   grep -q "46 generated" "$T/inspect.txt" && grep -qE "^TTFT +p50 0.1500 s +p90 0.2000 s +p99 0.2100 s" "$T/inspect.txt" &&
   grep -qE "^ITL +p50 0.0200 s" "$T/inspect.txt" && grep -q "\"prompts\":\"tiny.h5\"" "$T/inspect.txt" &&
   grep -qE "^throughput .* tok/s" "$T/inspect.txt"' "$(cat "$T/inspect.txt")"
sed 's/^/# /' "$T/inspect.txt"
"$DSBATCH" inspect "$T/partial.h5" >"$T/out" 2>&1
check "inspect of a killed job's file says complete 0 (resumable), 6 of 12" \
  '[ $? -eq 0 ] && grep -q "complete 0" "$T/out" && grep -q "6 of 12 prompts" "$T/out"' "$(cat "$T/out")"
"$DSBATCH" inspect "$T/score.h5" >"$T/out" 2>&1
check "inspect of a score file: scored tokens and NLL per token" \
  '[ $? -eq 0 ] && grep -q "dsbatch score output" "$T/out" && grep -q "46 scored; NLL" "$T/out"' "$(cat "$T/out")"
one_error "inspect of an HDF5 file that is neither" 'neither.h5: neither a dsbatch output' "$DSBATCH" inspect "$T/neither.h5"
"${H5PY[@]}" - "$T/out.h5" "$T/partial.h5" >"$T/py.out" 2>&1 <<'EOF'
import h5py, json, sys, numpy as np
f = h5py.File(sys.argv[1], "r")
assert f.attrs["complete"] == 1 and f.attrs["kind"] == "generate" and f.attrs["n_prompts"] == 12
o = f["outputs"]
idx, off, tok, lp, fin = (o[k][:] for k in ("prompt_index", "offsets", "tokens", "logprobs", "finish_reason"))
assert idx.shape == (12,) and off.shape == (13,) and tok.shape == (off[-1],) and lp.shape == tok.shape
for r, i in enumerate(idx):
    n = 1 + i % 8
    assert tok[off[r]:off[r + 1]].tolist() == [i * 10 + k for k in range(n)]
    assert fin[r] == i % 3
req = f["trace/requests"][:]
assert req.dtype.names == ("prompt_index", "run", "admit_s", "first_token_s", "last_token_s", "prompt_tokens",
                           "generated_tokens"), req.dtype.names
assert np.allclose(req["first_token_s"] - req["admit_s"], 0.1 + 0.01 * req["prompt_index"])
steps = f["trace/steps"][:]
assert len(steps) == 4 and "compute_s" in steps.dtype.names and "rank" in steps.dtype.names
meta = json.loads(f["meta/json"][()])
assert meta["job_spec"]["prompts"] == "tiny.h5" and "hdf5" in meta["versions"] and "zstd" in meta["versions"]
assert f["meta"].attrs["git_commit"] == "test" and f["meta"].attrs["end_unix"] > 0
p = h5py.File(sys.argv[2], "r")
assert p.attrs["complete"] == 0 and p["outputs/prompt_index"].shape == (6,)
print("h5py ok")
EOF
check "h5py reads outputs (CSR tokens, logprobs, finish), trace tables as record arrays, /meta JSON, complete flags" \
  '[ $? -eq 0 ]' "$(cat "$T/py.out")"
