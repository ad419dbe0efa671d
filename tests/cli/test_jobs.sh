#!/usr/bin/env bash
# Batch jobs with HDF5 files end to end (issue #5), TAP lines "ok - NAME".
#
# (a) round trip: `dsbatch prompts` -> 16-rank generate (TP8 x PP2) -> h5py reads /outputs, /trace,
#     /meta (names, shapes, dtypes, attributes, complete = 1) and finds the one-rank JSONL run's
#     tokens and text; (b) sampling invariance: the same seeds give the same tokens with max-seqs 1,
#     8 and 64 on one rank and on 16 ranks (two DP layouts); (c) resume: a job SIGKILLed after at
#     least two requests are recorded (the journal is polled) and resumed gives exactly the tokens
#     and log-probabilities of an uninterrupted run, on 1 rank and on 16 ranks (TP4 x PP2 x DP2);
#     another job spec is refused and the file left untouched; (d) score's log-probabilities equal
#     log-softmax of generate --save-logits rows within 1e-5; (e) scoring a 4,000-token prompt never
#     puts more rows than the chunk through the head; (f) bad input: one error line each, exit != 0,
#     no output that looks complete.
# h5py is Debian's (/usr/bin/python3); zstd datasets are read through the plugin built from
# src/h5zstd.c. KEEP=1 keeps the work folder.
set -u
DSBATCH=${DSBATCH:-build/dsbatch}
GOLDEN=${GOLDEN:-../shared/golden}
PY=/usr/bin/python3
T=$(mktemp -d "${TMPDIR:-/tmp}/dsbatch_jobs.XXXXXX")
trap '[ -n "${KEEP:-}" ] || rm -rf "$T"' EXIT
MPIRUN=(mpirun --allow-run-as-root --oversubscribe --timeout 300)
ok() { echo "ok - $1"; }
nok() {
  echo "not ok - $1"
  [ -n "${2:-}" ] && printf '%s\n' "$2" | head -20 | sed 's/^/#   /'
  return 0
}
check() { if eval "$2"; then ok "$1"; else nok "$1" "${3:-}"; fi; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
P=data/prompts/tiny.jsonl

# ---------------------------------------------------------------- tools: zstd plugin, h5py helpers
mkdir -p "$T/plugins"
mpicc -O2 -fPIC -shared -DH5ZSTD_PLUGIN $(pkg-config --cflags hdf5-openmpi) -o "$T/plugins/libh5zstd.so" \
  src/h5zstd.c -lzstd 2>"$T/plugin.err" || nok "zstd filter plugin builds" "$(cat "$T/plugin.err")"
H5PY=(env HDF5_PLUGIN_PATH="$T/plugins" "$PY" "$T/tool.py")
cat >"$T/tool.py" <<'EOF'
# Helpers for the checks: canonical results of an output (HDF5 or JSONL) keyed by prompt index,
# the journal's request count, and the layout checks of one output file.
import h5py, json, math, struct, sys
import numpy as np

def h5_results(path):
    o = h5py.File(path, "r")["outputs"]
    idx, off, tok, fin = (o[k][:] for k in ("prompt_index", "offsets", "tokens", "finish_reason"))
    lp = o["logprobs"][:] if "logprobs" in o else None
    return {int(i): (tok[off[r]:off[r + 1]].tolist(), min(int(fin[r]), 1),
                     lp[off[r]:off[r + 1]].tolist() if lp is not None else None) for r, i in enumerate(idx)}

def jsonl_results(path):
    out = {}
    for i, line in enumerate(open(path)):
        j = json.loads(line)
        out[i] = (j["output_tokens"], int(j["finish_reason"] != "length"), j.get("logprobs"))
    return out

def results(path):
    return h5_results(path) if path.endswith(".h5") else jsonl_results(path)

def same(a, b, exact):
    """tokens and finish equal; logprobs bit-identical (exact) or within JSON's printing (1e-12)."""
    if a.keys() != b.keys():
        return "prompts %s vs %s" % (sorted(a), sorted(b))
    for i in a:
        (ta, fa, la), (tb, fb, lb) = a[i], b[i]
        if ta != tb or fa != fb:
            return "prompt %d: tokens %s.. vs %s.. (finish %d vs %d)" % (i, ta[:6], tb[:6], fa, fb)
        if (la is None) != (lb is None):
            return "prompt %d: logprobs in one output only" % i
        if la is not None and any(x != y if exact else abs(x - y) > 1e-12 * max(1, abs(x)) for x, y in zip(la, lb)):
            return "prompt %d: logprobs differ" % i
    return None

def cmd_same(args):  # same [--exact] A B [C ...]: every output gives the first one's results
    exact = args[0] == "--exact"
    paths = args[1:] if exact else args
    ref = results(paths[0])
    for p in paths[1:]:
        why = same(ref, results(p), exact)
        if why:
            sys.exit("%s vs %s: %s" % (paths[0], p, why))
    print("%d outputs, %d prompts, %d tokens: identical" % (len(paths), len(ref), sum(len(v[0]) for v in ref.values())))

def cmd_journal(args):  # journal PATH: requests recorded in OUT.h5.journal (whole records only)
    try:
        b = open(args[0], "rb").read()
    except OSError:
        print(0)
        return
    pos = n = 0
    while pos + 24 <= len(b):
        typ, _, ln = struct.unpack_from("<IIQ", b, pos)
        if pos + 24 + ln > len(b):
            break
        n += typ == 3
        pos += 24 + ln
    print(n)

def cmd_layout(args):  # layout OUT.h5 PROMPTS.jsonl RANKS TEXT(0|1): the generate output's structure
    path, prompts, ranks, text = args[0], args[1], int(args[2]), args[3] == "1"
    rows = [json.loads(l) for l in open(prompts) if l.strip()]
    n = len(rows)
    f = h5py.File(path, "r")
    a = f.attrs
    assert a["format_version"] == 1 and a["kind"] == "generate" and a["complete"] == 1, dict(a)
    assert a["n_prompts"] == n and a["runs"] == 1 and len(a["fingerprint"]) == 16, dict(a)
    o = f["outputs"]
    want = {"prompt_index", "offsets", "tokens", "finish_reason", "logprobs"} | ({"text_chars", "text_offsets"} if text else set())
    assert set(o.keys()) == want, sorted(o.keys())
    idx, off, tok, fin, lp = (o[k][:] for k in ("prompt_index", "offsets", "tokens", "finish_reason", "logprobs"))
    assert idx.dtype == np.int64 and off.dtype == np.int64 and tok.dtype == np.int32 and fin.dtype == np.int8
    assert lp.dtype == np.float64 and idx.shape == (n,) and off.shape == (n + 1,) and fin.shape == (n,)
    assert sorted(idx.tolist()) == list(range(n)) and off[0] == 0 and tok.shape == (off[-1],) and lp.shape == tok.shape
    assert np.all(np.diff(off) >= 0) and set(fin.tolist()) <= {0, 1, 2} and np.all(lp <= 0)
    assert o["finish_reason"].attrs["meaning"].startswith("0 length")
    for r, i in enumerate(idx):
        m = rows[i].get("max_new_tokens", 16)
        assert off[r + 1] - off[r] == m or fin[r] != 0, (i, off[r + 1] - off[r], m, fin[r])
    if text:
        to = o["text_offsets"][:]
        assert to.shape == (n + 1,) and to[-1] == o["text_chars"].shape[0]
    req = f["trace/requests"][:]
    assert req.dtype.names == ("prompt_index", "run", "admit_s", "first_token_s", "last_token_s", "prompt_tokens",
                               "generated_tokens"), req.dtype.names
    assert req.shape == (n,) and req["prompt_index"].tolist() == idx.tolist() and set(req["run"].tolist()) == {0}
    assert req["prompt_tokens"].tolist() == [len(rows[i]["tokens"]) for i in idx]
    assert req["generated_tokens"].tolist() == np.diff(off).tolist()
    assert np.all(req["admit_s"] >= 0) and np.all(req["first_token_s"] >= req["admit_s"])
    assert np.all(req["last_token_s"] >= req["first_token_s"])
    st = f["trace/steps"][:]
    assert st.dtype.names == ("run", "rank", "stage", "tp", "step", "seqs", "rows", "start_s", "end_s", "compute_s",
                              "comm_s", "wait_s", "tp_comm_s"), st.dtype.names
    assert set(st["rank"].tolist()) == set(range(ranks)), sorted(set(st["rank"].tolist()))
    assert np.all(st["end_s"] >= st["start_s"]) and np.all(st["compute_s"] >= 0) and np.all(st["wait_s"] >= 0)
    assert np.all(st["comm_s"] >= 0) and (ranks == 1 or st["comm_s"].sum() > 0)
    # the TP collectives' part of each forward (16 ranks: TP8 x PP2, so every rank has some)
    assert np.all(st["tp_comm_s"] >= 0) and np.all(st["tp_comm_s"] <= st["compute_s"] + 1e-6)
    assert ranks == 1 or all(st["tp_comm_s"][st["rank"] == r].sum() > 0 for r in range(ranks))
    meta = json.loads(f["meta/json"][()])
    for k in ("job_spec", "model_config", "rank_table", "git_commit", "hosts", "versions", "start_time",
              "start_unix", "compression", "command", "fingerprint"):
        assert k in meta, k
    assert meta["command"] == "generate" and meta["fingerprint"] == a["fingerprint"]
    assert meta["job_spec"]["prompts"].endswith(".h5") and "resume" not in meta["job_spec"]
    assert meta["model_config"]["text_config"]["vocab_size"] > 0
    assert len(meta["rank_table"].strip().splitlines()) == ranks + 1
    assert {"mpi", "hdf5", "zstd"} <= set(meta["versions"]), meta["versions"]
    g = f["meta"].attrs
    assert g["end_unix"] >= g["start_unix"] > 0 and len(g["run_start_unix"]) == 1 and g["git_commit"] == meta["git_commit"]
    for k in ("hdf5_version", "mpi_version", "zstd_version", "hosts"):
        assert len(g[k]) > 0, k
    print("layout ok: %d prompts, %d tokens, %d step records from %d ranks, meta keys %s, versions %s" %
          (n, len(tok), len(st), ranks, ",".join(sorted(meta)), ",".join(sorted(meta["versions"]))))

def cmd_text(args):  # text OUT.h5 REF.jsonl: /outputs text equals the JSONL's decoded text
    o = h5py.File(args[0], "r")["outputs"]
    ref = [json.loads(l)["text"] for l in open(args[1])]
    idx, to, tc = o["prompt_index"][:], o["text_offsets"][:], o["text_chars"][:].tobytes()
    for r, i in enumerate(idx):
        assert tc[to[r]:to[r + 1]].decode() == ref[i], (i, tc[to[r]:to[r + 1]], ref[i])
    print("text of %d rows equals the JSONL's" % len(idx))

def cmd_resumed(args):  # resumed OUT.h5 N: complete, 2 runs, rows of both runs, each prompt once
    f = h5py.File(args[0], "r")
    n = int(args[1])
    assert f.attrs["complete"] == 1 and f.attrs["runs"] == 2, dict(f.attrs)
    req = f["trace/requests"][:]
    assert sorted(req["prompt_index"].tolist()) == list(range(n))
    assert set(req["run"].tolist()) == {0, 1}, set(req["run"].tolist())
    assert len(f["meta"].attrs["run_start_unix"]) == 2
    assert set(f["trace/steps"][:]["run"].tolist()) == {1}  # the killed run never gathered its steps
    print("complete, 2 runs: %d rows from run 0, %d from run 1" % ((req["run"] == 0).sum(), (req["run"] == 1).sum()))

def cmd_attr(args):  # attr OUT.h5 NAME: a root attribute (absent file: "none")
    try:
        print(h5py.File(args[0], "r").attrs[args[1]])
    except (OSError, KeyError):
        print("none")

def log_softmax_at(row, tok):
    row = np.asarray(row, dtype=np.float64)
    m = row.max()
    return row[tok] - m - math.log(np.exp(row - m).sum())

def cmd_score_vs_logits(args):  # SCORE.jsonl PREFIX_GEN.jsonl PROMPT.jsonl: 1e-5 per position
    score = json.loads(open(args[0]).readline())["token_logprobs"]
    prompt = json.loads(open(args[2]).readline())["tokens"]
    gen = [json.loads(l) for l in open(args[1])]
    assert len(gen) == len(prompt) - 1 == len(score), (len(gen), len(prompt), len(score))
    worst = 0.0
    for L, g in enumerate(gen, start=1):  # prefix of L tokens: its last prefill row predicts prompt[L]
        assert len(g["logits"]) == len(g["output_tokens"]) == 1 and len(g["logits"][0]) == 512
        worst = max(worst, abs(log_softmax_at(g["logits"][0], prompt[L]) - score[L - 1]))
    assert worst <= 1e-5, worst
    print("%d positions: |score - log_softmax(saved row)| <= %.2e" % (len(score), worst))

def cmd_score_vs_steps(args):  # SCORE.jsonl GEN.jsonl N: rows of generated steps vs score positions
    score = json.loads(open(args[0]).readline())["token_logprobs"]
    g = json.loads(open(args[1]).readline())
    n, out, rows = int(args[2]), g["output_tokens"], g["logits"]
    assert len(rows) == len(out) >= 2 and len(score) == n + len(out) - 1, (len(rows), len(out), len(score))
    worst = max(abs(log_softmax_at(rows[k], out[k]) - score[n - 1 + k]) for k in range(len(out)))
    assert worst <= 1e-5, worst
    print("%d generated steps: |score - log_softmax(saved row)| <= %.2e" % (len(out), worst))

def cmd_logits_h5(args):  # OUT.h5 GEN.jsonl: /outputs/logits rows = the JSONL's, logprobs = log-softmax
    f = h5py.File(args[0], "r")
    o = f["outputs"]
    lg, lo, idx, off, tok, lp = (o[k][:] for k in ("logits", "logits_offsets", "prompt_index", "offsets", "tokens", "logprobs"))
    ref = [json.loads(l) for l in open(args[1])]
    assert lg.dtype == np.float32 and lg.shape == (lo[-1], 512) and lo.shape == (len(idx) + 1,)
    worst = 0.0
    for r, i in enumerate(idx):
        rows = lg[lo[r]:lo[r + 1]]
        assert rows.shape[0] == off[r + 1] - off[r] == len(ref[i]["logits"])
        assert np.array_equal(rows, np.asarray(ref[i]["logits"], dtype=np.float32))
        for k in range(rows.shape[0]):
            worst = max(worst, abs(log_softmax_at(rows[k], tok[off[r] + k]) - lp[off[r] + k]))
    assert worst < 1e-9, worst
    print("%d rows of %d requests; logprobs = log_softmax(row)[token] within %.1e" % (lo[-1], len(idx), worst))

def cmd_scores_h5(args):  # OUT.h5 N_TOKENS: a score output's layout
    f = h5py.File(args[0], "r")
    s = f["scores"]
    assert f.attrs["kind"] == "score" and f.attrs["complete"] == 1
    assert set(s.keys()) == {"prompt_index", "offsets", "logprobs", "nll", "n_tokens"}, sorted(s.keys())
    n = int(args[1])
    assert s["n_tokens"][:].tolist() == [n] and s["logprobs"].shape == (n,) and s["offsets"][:].tolist() == [0, n]
    assert abs(s["nll"][0] + s["logprobs"][:].sum()) < 1e-6 * abs(s["nll"][0])
    st = f["trace/steps"][:]
    print("score output: %d logprobs, nll %.3f, %d steps of at most %d rows" % (n, s["nll"][0], len(st), st["rows"].max()))

def cmd_scores_same(args):  # A.h5 B.h5: the same prompts scored, bit for bit (rows in any order)
    def load(path):
        s = h5py.File(path, "r")["scores"]
        idx, off, lp, nll = s["prompt_index"][:], s["offsets"][:], s["logprobs"][:], s["nll"][:]
        return {int(p): (lp[off[r]:off[r + 1]].tobytes(), nll[r].tobytes()) for r, p in enumerate(idx)}
    a, b = load(args[0]), load(args[1])
    assert a.keys() == b.keys() and len(a) > 0, (sorted(a), sorted(b))
    bad = [p for p in a if a[p] != b[p]]
    assert not bad, "prompts scored differently: %s" % bad
    print("%d prompts, %d logprobs: identical" % (len(a), sum(len(v[0]) // 8 for v in a.values())))

globals()["cmd_" + sys.argv[1].replace("-", "_")](sys.argv[2:])
EOF

"$DSBATCH" mkmodel --preset tp8pp2 --seed 5 --out "$T/m16" >/dev/null 2>&1 || nok "mkmodel tp8pp2"
"$DSBATCH" mkmodel --preset tiny --seed 2 --out "$T/tiny" >/dev/null 2>&1 || nok "mkmodel tiny"
"$DSBATCH" prompts --from $P --out "$T/P.h5" >/dev/null 2>&1 || nok "prompts --from $P"

# ---------------------------------------------------------------- (a) round trip on 16 ranks
t0=$(now)
"$DSBATCH" generate --model "$T/m16" --prompts $P --out "$T/ref1.jsonl" --logprobs --quiet 2>"$T/err" ||
  nok "one-rank JSONL reference" "$(cat "$T/err")"
"${MPIRUN[@]}" -np 16 "$DSBATCH" generate --model "$T/m16" --prompts "$T/P.h5" --out "$T/O.h5" --logprobs --quiet \
  --watchdog 120 >"$T/log" 2>&1
rc=$?
secs=$(since "$t0")
"${H5PY[@]}" layout "$T/O.h5" $P 16 1 >"$T/py.out" 2>&1
check "round trip: 16 ranks (TP8 x PP2) read P.h5 and write O.h5; h5py finds /outputs, /trace/requests, /trace/steps of all 16 ranks, /meta, complete = 1 (${secs} s)" \
  '[ $rc -eq 0 ] && [ $(tail -1 "$T/py.out" | grep -c "^layout ok") -eq 1 ] && [ ! -e "$T/O.h5.journal" ]' \
  "rc=$rc $(grep -m3 error "$T/log"; cat "$T/py.out")"
sed 's/^/# /' "$T/py.out"
"${H5PY[@]}" same "$T/ref1.jsonl" "$T/O.h5" >"$T/py.out" 2>&1 && "${H5PY[@]}" text "$T/O.h5" "$T/ref1.jsonl" >>"$T/py.out" 2>&1
check "round trip: the 16-rank HDF5 output has the one-rank JSONL run's tokens, finish reasons, logprobs and text" \
  '[ $? -eq 0 ]' "$(cat "$T/py.out")"
"$DSBATCH" inspect "$T/O.h5" >"$T/inspect.txt" 2>&1
check "inspect O.h5: complete, 8 of 8 prompts, TTFT and ITL" \
  '[ $? -eq 0 ] && grep -q "complete 1" "$T/inspect.txt" && grep -q "8 of 8 prompts" "$T/inspect.txt" && grep -q "^TTFT" "$T/inspect.txt"' \
  "$(cat "$T/inspect.txt")"

# ---------------------------------------------------------------- (b) sampling invariance
S=(--temperature 0.9 --top-p 0.95 --top-k 100 --seed 3 --logprobs --quiet)
t0=$(now)
for s in 1 8 64; do
  "$DSBATCH" generate --model "$T/m16" --prompts $P --out "$T/s$s.jsonl" --max-seqs $s "${S[@]}" 2>"$T/err" ||
    nok "sampled, one rank, max-seqs $s" "$(cat "$T/err")"
done
"${MPIRUN[@]}" -np 16 "$DSBATCH" generate --model "$T/m16" --prompts "$T/P.h5" --out "$T/s16a.h5" --max-seqs 8 \
  --tp 4 --pp 2 --watchdog 120 "${S[@]}" >"$T/log" 2>&1 || nok "sampled, 16 ranks TP4 x PP2 x DP2" "$(grep -m3 error "$T/log")"
"${MPIRUN[@]}" -np 16 "$DSBATCH" generate --model "$T/m16" --prompts "$T/P.h5" --out "$T/s16b.h5" --max-seqs 64 \
  --tp 2 --pp 1 --watchdog 120 "${S[@]}" >"$T/log" 2>&1 || nok "sampled, 16 ranks TP2 x PP1 x DP8" "$(grep -m3 error "$T/log")"
"${H5PY[@]}" same "$T/s1.jsonl" "$T/s8.jsonl" "$T/s64.jsonl" "$T/s16a.h5" "$T/s16b.h5" >"$T/py.out" 2>&1 &&
  ! "${H5PY[@]}" same "$T/s1.jsonl" "$T/ref1.jsonl" >/dev/null 2>&1
check "sampling invariance: temperature/top-p/top-k with the same seeds give identical tokens for max-seqs 1, 8, 64 on one rank and on 16 ranks (DP2 max-seqs 8, DP8 max-seqs 64), and differ from greedy ($(since "$t0") s)" \
  '[ $? -eq 0 ]' "$(cat "$T/py.out")"
sed 's/^/# /' "$T/py.out"

# ---------------------------------------------------------------- (c) kill and resume
# wait_recorded JOURNAL N PID: poll until N requests are in the journal (or the job ended)
wait_recorded() {
  local c=0
  for _ in $(seq 1 3000); do
    c=$("$PY" "$T/tool.py" journal "$1")
    [ "$c" -ge "$2" ] && break
    kill -0 "$3" 2>/dev/null || break
    sleep 0.02
  done
  echo "$c"
}
"$PY" - "$T" <<'EOF'
import json, random, sys
r = random.Random(3)
with open(sys.argv[1] + "/work.jsonl", "w") as f:
    for i in range(48):
        f.write(json.dumps({"id": "w%d" % i, "tokens": [r.randrange(3, 500) for _ in range(r.randrange(4, 30))],
                            "max_new_tokens": 40}) + "\n")
with open(sys.argv[1] + "/work16.jsonl", "w") as f:
    for i in range(24):
        f.write(json.dumps({"id": i, "tokens": [r.randrange(3, 500) for _ in range(r.randrange(4, 30))],
                            "max_new_tokens": 24}) + "\n")
EOF
"$DSBATCH" prompts --from "$T/work.jsonl" --out "$T/W.h5" >/dev/null 2>&1 &&
  "$DSBATCH" prompts --from "$T/work16.jsonl" --out "$T/W16.h5" >/dev/null 2>&1 || nok "prompt files for resume"

M=$GOLDEN/small6
R=(--model "$M" --prompts "$T/W.h5" --logprobs --quiet --max-seqs 1 --temperature 0.8 --seed 4)
t0=$(now)
"$DSBATCH" generate "${R[@]}" --out "$T/full.h5" 2>"$T/err" || nok "uninterrupted one-rank run" "$(cat "$T/err")"
"$DSBATCH" generate "${R[@]}" --out "$T/k.h5" 2>"$T/err" &
pid=$!
c=$(wait_recorded "$T/k.h5.journal" 2 $pid)
kill -9 $pid 2>/dev/null
wait $pid 2>/dev/null
rc=$?
c=$("$PY" "$T/tool.py" journal "$T/k.h5.journal")
check "resume, 1 rank: SIGKILL after $c of 48 requests were recorded (exit $rc): complete = $("$PY" "$T/tool.py" attr "$T/k.h5" complete 2>/dev/null)" \
  '[ $rc -eq 137 ] && [ "$c" -ge 2 ] && [ "$c" -lt 48 ] && [ "$("${H5PY[@]}" attr "$T/k.h5" complete)" = 0 ]'
sums=$(md5sum "$T/k.h5" "$T/k.h5.journal")
"$DSBATCH" generate "${R[@]}" --out "$T/k.h5" --seed 5 --resume >"$T/out" 2>"$T/err"
rc=$?
check "resume with another job spec (--seed 5): refused, one error line, file and journal untouched" \
  '[ $rc -ne 0 ] && [ $(wc -l <"$T/err") -eq 1 ] && grep -q "different job spec or model" "$T/err" && [ "$(md5sum "$T/k.h5" "$T/k.h5.journal")" = "$sums" ]' \
  "rc=$rc $(cat "$T/err")"
"$DSBATCH" generate "${R[@]}" --out "$T/k.h5" --resume --watchdog 99 2>"$T/err"
rc=$?
"${H5PY[@]}" same --exact "$T/full.h5" "$T/k.h5" >"$T/py.out" 2>&1 && "${H5PY[@]}" resumed "$T/k.h5" 48 >>"$T/py.out" 2>&1
check "resume, 1 rank: --resume (with another --watchdog) completes the file: bit-identical tokens and logprobs to the uninterrupted run, no journal left ($(since "$t0") s)" \
  '[ $? -eq 0 ] && [ $rc -eq 0 ] && [ ! -e "$T/k.h5.journal" ]' "rc=$rc $(cat "$T/err" "$T/py.out")"
sed 's/^/# /' "$T/py.out"
sums=$(md5sum "$T/k.h5")
"$DSBATCH" generate "${R[@]}" --out "$T/k.h5" >"$T/out" 2>"$T/err"
rc=$?
check "a complete output without --resume: refused, one error line, untouched" \
  '[ $rc -ne 0 ] && [ $(wc -l <"$T/err") -eq 1 ] && grep -q "complete output of a finished job" "$T/err" && [ "$(md5sum "$T/k.h5")" = "$sums" ]' \
  "rc=$rc $(cat "$T/err")"
"$DSBATCH" generate "${R[@]}" --out "$T/k.h5" --resume >"$T/out" 2>"$T/err" &&
  "${H5PY[@]}" same --exact "$T/full.h5" "$T/k.h5" >"$T/py.out" 2>&1
check "--resume of a complete output: nothing to do, still complete and identical" \
  '[ $? -eq 0 ] && [ "$("${H5PY[@]}" attr "$T/k.h5" complete)" = 1 ]' "$(cat "$T/err" "$T/py.out")"

# 16 ranks, two replicas: rank 0 records its replica's requests and replica 1's as they arrive
R16=(--model "$T/m16" --prompts "$T/W16.h5" --logprobs --quiet --max-seqs 2 --temperature 0.7 --seed 11)
t0=$(now)
"$DSBATCH" generate "${R16[@]}" --out "$T/full16.h5" 2>"$T/err" || nok "uninterrupted reference (one rank)" "$(cat "$T/err")"
"${MPIRUN[@]}" -np 16 "$DSBATCH" generate "${R16[@]}" --out "$T/k16.h5" --tp 4 --pp 2 --watchdog 120 >"$T/log" 2>&1 &
mp=$!
c=$(wait_recorded "$T/k16.h5.journal" 2 $mp)
ranks=$(pgrep -P $mp | tr '\n' ' ')
[ -n "$ranks" ] && kill -9 $ranks 2>/dev/null
wait $mp 2>/dev/null
rc=$?
c=$("$PY" "$T/tool.py" journal "$T/k16.h5.journal")
left=0 # ranks still running (a killed rank is a zombie until init reaps it)
for p in $ranks; do ps -o stat= -p "$p" 2>/dev/null | grep -qv Z && left=$((left + 1)); done
check "resume, 16 ranks (TP4 x PP2 x DP2): all 16 ranks SIGKILLed after $c of 24 requests were recorded (mpirun exit $rc)" \
  '[ $rc -ne 0 ] && [ "$c" -ge 2 ] && [ "$c" -lt 24 ] && [ "$left" -eq 0 ] && [ "$(echo $ranks | wc -w)" -eq 16 ]' \
  "ranks: $ranks"
sums=$(md5sum "$T/k16.h5" "$T/k16.h5.journal")
"${MPIRUN[@]}" -np 16 "$DSBATCH" generate "${R16[@]}" --out "$T/k16.h5" --tp 4 --pp 2 --max-new-tokens 9 --resume \
  >"$T/log" 2>&1
rc=$?
n=$(grep -c "error: .*different job spec or model" "$T/log")
check "resume, 16 ranks, with another job spec (--max-new-tokens 9): refused on every rank ($n error lines), untouched" \
  '[ $rc -ne 0 ] && [ "$n" -eq 16 ] && [ "$(md5sum "$T/k16.h5" "$T/k16.h5.journal")" = "$sums" ]' "$(grep -m3 error "$T/log")"
"${MPIRUN[@]}" -np 16 "$DSBATCH" generate "${R16[@]}" --out "$T/k16.h5" --tp 4 --pp 2 --resume --watchdog 120 >"$T/log" 2>&1
rc=$?
"${H5PY[@]}" same --exact "$T/full16.h5" "$T/k16.h5" >"$T/py.out" 2>&1 && "${H5PY[@]}" resumed "$T/k16.h5" 24 >>"$T/py.out" 2>&1
check "resume, 16 ranks: the resumed file has bit-identical tokens and logprobs to an uninterrupted one-rank run ($(since "$t0") s)" \
  '[ $? -eq 0 ] && [ $rc -eq 0 ] && [ ! -e "$T/k16.h5.journal" ]' "rc=$rc $(grep -m3 error "$T/log"; cat "$T/py.out")"
sed 's/^/# /' "$T/py.out"

# score through the same kill and resume (one rank; --chunk 2 makes it long enough to kill)
S=(--model "$M" --prompts "$T/W.h5" --quiet --chunk 2)
t0=$(now)
"$DSBATCH" score "${S[@]}" --out "$T/sfull.h5" 2>"$T/err" || nok "uninterrupted score run" "$(cat "$T/err")"
"$DSBATCH" score "${S[@]}" --out "$T/sk.h5" 2>"$T/err" &
pid=$!
c=$(wait_recorded "$T/sk.h5.journal" 2 $pid)
kill -9 $pid 2>/dev/null
wait $pid 2>/dev/null
rc=$?
"$DSBATCH" score "${S[@]}" --out "$T/sk.h5" --resume 2>"$T/err"
rc2=$?
"${H5PY[@]}" scores-same "$T/sfull.h5" "$T/sk.h5" >"$T/py.out" 2>&1
check "score: SIGKILL after $c of 48 prompts were recorded, --resume completes the file: $(tail -1 "$T/py.out") ($(since "$t0") s)" \
  '[ $rc -eq 137 ] && [ "$c" -ge 2 ] && [ "$c" -lt 48 ] && [ $rc2 -eq 0 ] && grep -q identical "$T/py.out"' \
  "rc=$rc rc2=$rc2 $(cat "$T/err" "$T/py.out")"

# ---------------------------------------------------------------- (d) score = log-softmax of the engine's logits
"$PY" - "$T" <<'EOF'
import json, random, sys
r = random.Random(9)
toks = [r.randrange(3, 500) for _ in range(40)]
d = sys.argv[1]
open(d + "/p40.jsonl", "w").write(json.dumps({"id": "p40", "tokens": toks}) + "\n")
with open(d + "/prefixes.jsonl", "w") as f:
    for L in range(1, len(toks)):
        f.write(json.dumps({"id": L, "tokens": toks[:L], "max_new_tokens": 1}) + "\n")
EOF
# The engine's chunk-invariant settings: under the default reference window layout the last row
# of a prefill depends on the chunk's length (the reference's single-shot prefill), so a prefix
# prefilled alone and the same positions inside a longer chunk differ by up to ~0.1 nats there.
CI=(--window-layout decode --no-stale-index-keys)
t0=$(now)
"$DSBATCH" score --model "$T/tiny" --prompts "$T/p40.jsonl" --out "$T/score.jsonl" --chunk 4096 "${CI[@]}" 2>"$T/err" &&
  "$DSBATCH" generate --model "$T/tiny" --prompts "$T/prefixes.jsonl" --out "$T/prefix.jsonl" --chunk 4096 --save-logits \
    --max-seqs 8 --quiet "${CI[@]}" 2>>"$T/err" &&
  "$PY" "$T/tool.py" score-vs-logits "$T/score.jsonl" "$T/prefix.jsonl" "$T/p40.jsonl" >"$T/py.out" 2>&1
check "score: per-token logprobs equal log-softmax of generate --save-logits prefill rows (every prefix of a 40-token prompt, whole-prompt chunks) within 1e-5 ($(since "$t0") s)" \
  '[ $? -eq 0 ]' "$(cat "$T/err" "$T/py.out")"
sed 's/^/# /' "$T/py.out"
# the same prompt: generate 8 tokens saving every row, then score prompt + those tokens
"$DSBATCH" generate --model "$T/tiny" --prompts "$T/p40.jsonl" --out "$T/g40.jsonl" --chunk 4096 --save-logits \
  --max-new-tokens 8 --quiet "${CI[@]}" 2>"$T/err" &&
  "$PY" -c "
import json
p = json.loads(open('$T/p40.jsonl').readline()); g = json.loads(open('$T/g40.jsonl').readline())
print(json.dumps({'id': 'p40+out', 'tokens': p['tokens'] + g['output_tokens']}))" >"$T/p48.jsonl" &&
  "$DSBATCH" score --model "$T/tiny" --prompts "$T/p48.jsonl" --out "$T/score48.jsonl" --chunk 4096 "${CI[@]}" 2>>"$T/err" &&
  "$PY" "$T/tool.py" score-vs-steps "$T/score48.jsonl" "$T/g40.jsonl" 40 >"$T/py.out" 2>&1
check "score: logprobs of a prompt + its 8 generated tokens equal log-softmax of the saved rows (last prefill row and each decode step) within 1e-5" \
  '[ $? -eq 0 ]' "$(cat "$T/err" "$T/py.out")"
sed 's/^/# /' "$T/py.out"
"$DSBATCH" generate --model "$T/tiny" --prompts $P --out "$T/lg.jsonl" --save-logits --logprobs --max-new-tokens 6 --quiet 2>"$T/err" &&
  "$DSBATCH" generate --model "$T/tiny" --prompts "$T/P.h5" --out "$T/lg.h5" --save-logits --logprobs --max-new-tokens 6 \
    --max-seqs 3 --quiet 2>>"$T/err" &&
  "${H5PY[@]}" logits-h5 "$T/lg.h5" "$T/lg.jsonl" >"$T/py.out" 2>&1
check "--save-logits: /outputs/logits [rows, V] + logits_offsets equal the JSONL rows; logprobs = log-softmax(row)[token]" \
  '[ $? -eq 0 ]' "$(cat "$T/err" "$T/py.out")"
sed 's/^/# /' "$T/py.out"
"$PY" -c "
import json
for i in range(20): print(json.dumps({'id': i, 'tokens': [5, 6]}))" >"$T/many.jsonl"
"$DSBATCH" generate --model "$T/tiny" --prompts "$T/many.jsonl" --out "$T/big.h5" --save-logits --max-new-tokens 8000 \
  --max-seq-len 8192 --max-seqs 1 --quiet >"$T/out" 2>"$T/err"
rc=$?
check "--save-logits beyond 256 MiB: one error line, no output" \
  '[ $rc -ne 0 ] && [ $(wc -l <"$T/err") -eq 1 ] && grep -q "above the 256 MiB" "$T/err" && [ ! -e "$T/big.h5" ]' "$(cat "$T/err")"

# ---------------------------------------------------------------- (e) a 4,000-token prompt in chunks
"$DSBATCH" mkmodel --preset tiny --layers 0-1 --seed 4 --out "$T/tiny2" >/dev/null 2>&1 || nok "mkmodel tiny, 2 layers"
"$PY" -c "
import json, random
r = random.Random(1)
print(json.dumps({'id': 'long', 'tokens': [r.randrange(3, 500) for _ in range(4000)]}))" >"$T/long.jsonl"
"$DSBATCH" prompts --from "$T/long.jsonl" --out "$T/long.h5" >/dev/null 2>&1
t0=$(now)
"$DSBATCH" score --model "$T/tiny2" --prompts "$T/long.h5" --out "$T/long_score.h5" --chunk 256 --report-logits-rows \
  >"$T/out" 2>"$T/err"
rc=$?
rows=$(sed -n 's/^logits rows: at most \([0-9]*\) per forward.*/\1/p' "$T/out")
"${H5PY[@]}" scores-h5 "$T/long_score.h5" 3999 >"$T/py.out" 2>&1
check "score of a 4,000-token prompt with --chunk 256: the head never sees more than ${rows:-?} rows (<= 256); /scores holds 3999 logprobs ($(since "$t0") s)" \
  '[ $rc -eq 0 ] && [ -n "$rows" ] && [ "$rows" -le 256 ] && [ "$rows" -ge 1 ] && grep -q "^score output" "$T/py.out"' \
  "rc=$rc $(cat "$T/out" "$T/err" "$T/py.out")"
sed 's/^/# /' "$T/out" "$T/py.out"
# score on 16 ranks (TP8 x PP2: the model a single GPU cannot hold scores the same way): the same
# logprobs and NLL as one rank, bit for bit, and the 4,000-token prompt's bound on every rank
t0=$(now)
"$DSBATCH" score --model "$T/m16" --prompts "$T/P.h5" --out "$T/sc1.h5" --quiet 2>"$T/err"
"${MPIRUN[@]}" -np 16 "$DSBATCH" score --model "$T/m16" --prompts "$T/P.h5" --out "$T/sc16.h5" --quiet --watchdog 120 \
  --max-seqs 3 >"$T/log" 2>&1
rc=$?
"${H5PY[@]}" scores-same "$T/sc1.h5" "$T/sc16.h5" >"$T/py.out" 2>&1
check "score on 16 ranks (TP8 x PP2), 3 prompts a step = one rank, one prompt a step: $(tail -1 "$T/py.out") ($(since "$t0") s)" \
  '[ $rc -eq 0 ] && grep -q "identical" "$T/py.out"' "rc=$rc $(grep -m2 error "$T/log"; cat "$T/py.out")"
"${MPIRUN[@]}" -np 2 "$DSBATCH" score --model "$T/tiny2" --prompts "$T/long.h5" --out "$T/s2.h5" --chunk 256 --tp 2 \
  --report-logits-rows --quiet >"$T/out2" 2>"$T/log"
rc=$?
rows2=$(sed -n 's/^logits rows: at most \([0-9]*\) per forward.*/\1/p' "$T/out2")
"${H5PY[@]}" scores-same "$T/long_score.h5" "$T/s2.h5" >"$T/py.out" 2>&1
check "score of the 4,000-token prompt on 2 ranks (TP2): the same 3999 logprobs, at most ${rows2:-?} rows a forward on any rank" \
  '[ $rc -eq 0 ] && grep -q identical "$T/py.out" && [ -n "$rows2" ] && [ "$rows2" -le 256 ]' \
  "rc=$rc $(grep -m2 error "$T/log"; cat "$T/out2" "$T/py.out")"

# ---------------------------------------------------------------- (f) bad input
"$PY" - "$T" <<'EOF' >"$T/py.out" 2>&1
import h5py, numpy as np, sys
d = sys.argv[1]
def write(name, tokens=(5, 6, 7, 8, 9), offsets=(0, 2, 5), drop=None, extra=None):
    with h5py.File("%s/%s.h5" % (d, name), "w") as f:
        g = f.create_group("prompts")
        g.attrs["format_version"] = 1
        if drop != "tokens":
            g["tokens"] = np.array(tokens, dtype=np.int32)
        if drop != "offsets":
            g["offsets"] = np.array(offsets, dtype=np.int64)
        for k, v in (extra or {}).items():
            g[k] = v
write("missing_offsets", drop="offsets")
write("not_monotonic", offsets=(0, 3, 2, 5))
write("big_token", tokens=(5, 6, 600, 8, 9))
write("too_long", tokens=[5] * 130, offsets=(0, 10, 130))
write("good")
EOF
[ $? -eq 0 ] || nok "h5py writes the bad prompt files" "$(cat "$T/py.out")"
# bad NAME REGEX ARGS...: one rank, exactly one error line matching, exit != 0, no complete output
bad() {
  local name=$1 re=$2
  shift 2
  rm -f "$T/bad.h5"
  "$DSBATCH" generate --model "$M" --quiet "$@" >"$T/out" 2>"$T/err"
  local rc=$? lines complete
  lines=$(wc -l <"$T/err")
  complete=$("${H5PY[@]}" attr "$T/bad.h5" complete)
  if [ $rc -ne 0 ] && [ "$lines" -eq 1 ] && grep -qE -- "$re" "$T/err" && [ "$complete" != 1 ]; then
    ok "bad input, $name: $(sed 's/^dsbatch[^:]*: //' "$T/err") (output: $complete)"
  else
    nok "bad input, $name (rc $rc, $lines lines, complete=$complete)" "$(cat "$T/err")"
  fi
}
bad "missing dataset" 'missing_offsets.h5: /prompts/offsets: missing dataset' --prompts "$T/missing_offsets.h5" --out "$T/bad.h5"
bad "offsets not monotonic" 'not_monotonic.h5: /prompts/offsets: not monotonic' --prompts "$T/not_monotonic.h5" --out "$T/bad.h5"
bad "token id >= vocab" 'big_token.h5: /prompts/tokens\[2\]: prompt 1 token 0 is 600, outside the vocabulary \[0, 512\)' \
  --prompts "$T/big_token.h5" --out "$T/bad.h5"
bad "prompt longer than the model's maximum" 'too_long.h5: /prompts/offsets: prompt 1 has 120 tokens \+ max_new_tokens 16, above the maximum sequence length 128' \
  --prompts "$T/too_long.h5" --out "$T/bad.h5"
bad "unwritable output path" 'no/such/dir/out.h5: cannot write: No such file or directory' --prompts "$T/good.h5" \
  --out "$T/no/such/dir/out.h5"
bad "--resume with a JSONL output" '--resume needs an HDF5 output' --prompts "$T/good.h5" --out "$T/bad.jsonl" --resume
# sampling fields of a JSONL prompt line and numeric flags: the HDF5 reader's and `dsbatch
# prompts`' rules (prompt_fields.c, cli_args.c), one line naming the file, line and field or the flag
for kv in "temperature -1" "top_p 1.5" "top_p 0" "top_k -3" 'temperature "x"' "seed -1" "max_new_tokens 2.5"; do
  key=${kv%% *} val=${kv#* }
  printf '{"tokens": [5, 6, 7]}\n{"tokens": [5, 6], "%s": %s}\n' "$key" "$val" >"$T/badf.jsonl"
  bad "JSONL $key = $val" "badf.jsonl:2: $key: expected" --prompts "$T/badf.jsonl" --out "$T/bad.h5"
done
# a JSONL line's token ids: integers below the vocabulary (prompt_json_int, as `dsbatch prompts`)
for tk in "2.5 1" "512 1" "-1 0" '"a" 0'; do
  val=${tk% *} at=${tk##* }
  if [ "$at" = 1 ]; then printf '{"tokens": [5, %s]}\n' "$val"; else printf '{"tokens": [%s, 6]}\n' "$val"; fi >"$T/badt.jsonl"
  bad "JSONL token id $val" "badt.jsonl:1: tokens\[$at\]: token id outside the vocabulary \[0, 512\)" \
    --prompts "$T/badt.jsonl" --out "$T/bad.h5"
done
bad "--top-p 1.5" "--top-p: '1.5' is not a number in \(0, 1\]" --prompts "$T/good.h5" --out "$T/bad.h5" --top-p 1.5
bad "--temperature -1" "--temperature: '-1' is not a number" --prompts "$T/good.h5" --out "$T/bad.h5" --temperature -1
bad "--max-seqs x" "--max-seqs: 'x' is not an integer" --prompts "$T/good.h5" --out "$T/bad.h5" --max-seqs x
bad "--seed -1" "--seed: '-1' is not an integer" --prompts "$T/good.h5" --out "$T/bad.h5" --seed -1
echo "not HDF5" >"$T/notes.h5"
sums=$(md5sum "$T/notes.h5")
bad "--resume into a file that is not a dsbatch output" 'notes.h5: not an HDF5 file; refusing to resume into it' \
  --prompts "$T/good.h5" --out "$T/notes.h5" --resume
check "... and that file is left untouched" '[ "$(md5sum "$T/notes.h5")" = "$sums" ]'
"${MPIRUN[@]}" -np 16 "$DSBATCH" generate --model "$T/m16" --prompts "$T/big_token.h5" --out "$T/bad16.h5" --quiet >"$T/log" 2>&1
rc=$?
n=$(grep -c "error: .*big_token.h5: /prompts/tokens\[2\]: prompt 1 token 0 is 600" "$T/log")
m=$(grep -c "error:" "$T/log")
check "bad input on 16 ranks (token id >= vocab): the same single error line on every rank ($n), exit $rc, no output" \
  '[ $rc -ne 0 ] && [ "$n" -eq 16 ] && [ "$m" -eq 16 ] && [ ! -e "$T/bad16.h5" ]' "$(grep -m3 error "$T/log")"
"${MPIRUN[@]}" -np 16 "$DSBATCH" generate --model "$T/m16" --prompts "$T/good.h5" --out "$T/no/dir/o.h5" --quiet >"$T/log" 2>&1
rc=$?
n=$(grep -c "error: .*no/dir/o.h5: cannot write" "$T/log")
check "unwritable output on 16 ranks: rank 0's error line on every rank ($n), exit $rc" \
  '[ $rc -ne 0 ] && [ "$n" -eq 16 ]' "$(grep -m3 error "$T/log")"
