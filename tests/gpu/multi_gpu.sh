#!/usr/bin/env bash
# Issue #7 on a machine of 8 GPUs, one rank per GPU, TP collectives through NCCL. Run it on the
# device machine after tests/gpu/pack.sh, like device_run.sh (whose step `multi` calls it). Its
# steps use dsbatch, bench_nccl and bench_step, not the op tests, and the whole pack passes the
# device tool's 64 MiB, so pack with
#   PACK_LEAVE="test_cuda_ops test_cuda_moe test_cuda_ops_misc test_cuda_attn test_cuda_index test_cuda_branch" bash tests/gpu/pack.sh
#
#   bash tests/gpu/device_run.sh multi                             # every step below, in order
#   MULTI_STEPS="mkmodel decode" bash tests/gpu/device_run.sh multi # some steps (a later call)
#
# Steps (MULTI_STEPS, default "topo golden nccl mkmodel decode"):
#   topo     nvidia-smi topo -m and the GPU list, cores, memory, disk            -> $OUT/topo.txt
#   golden   (1) `verify --golden tp8pp2 --backend cuda` on 1 GPU rank, then under mpirun -np 8 as
#            TP8 x PP1 and TP4 x PP2: each must pass, print the very lines of the 1-rank report
#            (compared sorted: under PP the stages report in turn; the layouts compute bit-identical
#            values), and use NCCL (no MPI-staging fallback); greedy tokens and
#            logprobs of `generate` on the fixture's own prompts (as many new tokens as the fixture's
#            greedy_tokens) must be byte-identical to 1 GPU rank's. Agreement with the fixture's
#            greedy tokens is reported, not judged (golden README: free-running greedy equality is
#            not the test). TAP lines.
#   nccl     (3) build/bench/bench_nccl (the comm table's allgather / allreduce_sum, nccl-tests
#            style) at 8, 4 and 2 ranks, NCCL comm + MPI staging + raw NCCL, default sizes
#            10 KiB .. 2.6 MB; then at 8 ranks at exactly the message sizes of a decode step of the
#            synthetic model for each concurrency (label "model"), and both forms of the experts'
#            exchange at those step rows (--moe: gather vs owner, the --moe-exchange choice; the
#            summary reports both a layer and which one auto picks), with NCCL's INIT/ENV log
#            excerpted (NVLS must be reported off)    -> $OUT/nccl.csv (also kept in WORK for later calls)
#   mkmodel  (2) the synthetic checkpoint (SYNTH_ARGS, default: v41-flash at the real per-rank
#            dimensions, 128 routed experts instead of 384, Engram tables shrunk with
#            engram_vocab_size 500000: ~120 GB instead of 509 GB, so the 235 GB disk holds it; the
#            weights per GPU are ~15 GB of 141) into SYNTH_DIR (default /tmp/ds-v41-synth, kept for
#            later calls while the machine stays up; reused when SYNTH_ARGS match). Prints the
#            size from --dry-run first. The writer starts in the background right after topo and
#            runs alongside golden and nccl (cores and disk only); this step waits for it, and one
#            that does not finish within the budget keeps running for the next call.
#   decode   (2) `dsbatch generate` on the synthetic checkpoint, TP8 x PP1 (DECODE_LAYOUTS), at
#            concurrency 1, 8, 64 (CONC: that many prompts of PLEN random tokens, NEW new tokens
#            each, --max-seqs = concurrency), HDF5 output (`dsbatch inspect`: TTFT, ITL, tok/s)
#            and --trace CSV. Summary (python3 over the trace): ms per decode step (rows == seqs)
#            per rank, throughput, and the TP collective share of the step: MEASURED from the
#            trace's tp_comm_s (each collective's span on the stream between CUDA events, the wait
#            for slower peers included: struct comm.busy_s) over compute_s, and beside it an
#            ESTIMATE = bench_nccl's medians (label "model") at the step's message sizes x their
#            count per step (isolated collectives, no skew).  -> $OUT/decode_trace.csv
#
# NVLink multicast (NVLS) must stay off on these machines: every run that can touch NCCL is
# started as `env NCCL_NVLS_ENABLE=0 mpirun -x NCCL_NVLS_ENABLE=0 ...` (the variable set for
# mpirun and exported to every rank explicitly); bench_nccl prints and records the value each rank
# saw, and the NCCL log excerpt shows NCCL's own reading of it.
#
# Results: at most 8 files come back from the device tool, so every text log is bundled into
# $OUT/multi_gpu.txt (also on stdout); tables are $OUT/nccl.csv and $OUT/decode_trace.csv, the
# summary $OUT/multi_gpu.json, and $OUT/topo.txt. Intermediate files live in WORK (/tmp/ds-multi).
# Time: the device tool allows 600 s per command; MULTI_BUDGET_S (default 540) bounds this script:
# a step that no longer fits is skipped with a line saying how to run it in a later call.
#
# Without a GPU the steps can run on the CPU backend to test this script (what was smoke-tested):
#   BACKEND=cpu NP=2 LAYOUTS="2x1 1x2" DECODE_LAYOUTS=2x1 NCCL_RANKS=2 BENCH_NCCL_ARGS=--cpu \
#   SYNTH_ARGS="--preset tiny" MODEL_PRESET_JSON=data/presets/tiny.json CONC="1 8" PLEN=32 NEW=8 \
#   OUT=/tmp/mg bash tests/gpu/multi_gpu.sh
# and `MULTI_DRY_RUN=1` prints the plan and the checkpoint size without running anything heavy.
set -u
cd "$(dirname "$0")/../.." || exit 1
DSBATCH=${DSBATCH:-build/dsbatch}
GOLDEN=${GOLDEN:-../shared/golden}
BENCH_NCCL=${BENCH_NCCL:-$(dirname "$DSBATCH")/bench/bench_nccl}
[ -x "$BENCH_NCCL" ] || BENCH_NCCL=build/bench/bench_nccl
OUT=${OUT:-/tmp/out}
WORK=${WORK:-/tmp/ds-multi}
STEPS=${MULTI_STEPS:-topo golden nccl mkmodel decode}
BUDGET=${MULTI_BUDGET_S:-540}
BACKEND=${BACKEND:-cuda}
NP=${NP:-8}
LAYOUTS=${LAYOUTS:-8x1 4x2}
DECODE_LAYOUTS=${DECODE_LAYOUTS:-8x1}
NCCL_RANKS=${NCCL_RANKS:-8 4 2}
BENCH_NCCL_ARGS=${BENCH_NCCL_ARGS:-}
SYNTH_DIR=${SYNTH_DIR:-/tmp/ds-v41-synth}
SYNTH_ARGS=${SYNTH_ARGS:---preset v41-flash --experts 128 --engram_vocab_size 500000 --seed 7}
MODEL_PRESET_JSON=${MODEL_PRESET_JSON:-data/presets/v41-flash.json}
CONC=${CONC:-1 8 64}
PLEN=${PLEN:-128}
NEW=${NEW:-32}
DECODE_ARGS=${DECODE_ARGS:-}
DRY=${MULTI_DRY_RUN:-0}
# keep every JIT-compiled kernel of the SM80 build in the driver's cache across the many processes
export CUDA_CACHE_MAXSIZE=${CUDA_CACHE_MAXSIZE:-4294967296}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# NVLS off, explicitly, for mpirun and for every rank (see the header)
MPIRUN=(env NCCL_NVLS_ENABLE=0 mpirun --allow-run-as-root --oversubscribe --bind-to none -x NCCL_NVLS_ENABLE=0)
[ -n "${LD_LIBRARY_PATH:-}" ] && MPIRUN+=(-x LD_LIBRARY_PATH)
[ -n "${CUDA_CACHE_MAXSIZE:-}" ] && MPIRUN+=(-x CUDA_CACHE_MAXSIZE)

mkdir -p "$OUT" "$WORK"
LOG=$OUT/multi_gpu.txt
TAP=$WORK/tap.txt
: > "$TAP"
exec > >(tee -a "$LOG") 2>&1
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(elapsed) )); }
ok() { echo "ok - $1"; echo "ok - $1" >> "$TAP"; }
nok() { echo "not ok - $1"; echo "not ok - $1" >> "$TAP"; }
skip() { echo "ok - $1 # SKIP $2"; echo "skip - $1 # $2" >> "$TAP"; }
section() { echo; echo "==== $1 ($(elapsed) s elapsed, $(left) s of MULTI_BUDGET_S left)"; }
# run a command with a limit of min(LIMIT, budget left) seconds; stdout to FILE, stderr to FILE.err
limited() {
  local limit=$1 file=$2; shift 2
  local l; l=$(left); [ "$l" -lt "$limit" ] && limit=$l
  : > "$file.err"
  [ "$limit" -lt 5 ] && { echo "# budget spent: not running $*" | tee "$file.err" > "$file"; return 124; }
  timeout "$limit" "$@" > "$file" 2> "$file.err"
}
# enough budget left for a step that needs about NEED seconds? otherwise say how to run it later
fits() {
  local name=$1 need=$2
  if [ "$(left)" -lt "$need" ]; then
    skip "$name" "about ${need} s needed, $(left) s left of MULTI_BUDGET_S=$BUDGET: run it in a later call with MULTI_STEPS=\"$name ...\""
    return 1
  fi
}
lay_tp() { echo "${1%x*}"; }
lay_pp() { echo "${1#*x}"; }

echo "# multi_gpu.sh $(date -u +%FT%TZ) host $(hostname) commit $(git rev-parse --short HEAD 2>/dev/null || echo ?)"
echo "# steps: $STEPS; backend $BACKEND; $NP ranks; layouts $LAYOUTS; decode $DECODE_LAYOUTS at concurrency $CONC"
echo "# DSBATCH=$DSBATCH BENCH_NCCL=$BENCH_NCCL GOLDEN=$GOLDEN SYNTH_DIR=$SYNTH_DIR"
echo "# NCCL_NVLS_ENABLE=0 for every mpirun and rank: ${MPIRUN[*]}"

# ---------------------------------------------------------------------------------------------
step_topo() {
  section "topo"
  {
    echo "## nvidia-smi topo -m"
    if command -v nvidia-smi > /dev/null; then
      nvidia-smi topo -m
      echo; echo "## GPUs"
      nvidia-smi --query-gpu=index,name,pci.bus_id,memory.total,driver_version --format=csv
      echo; echo "## NVLink"
      nvidia-smi nvlink -s 2>&1 | head -40
    else
      echo "nvidia-smi not found"
    fi
    echo; echo "## host"; nproc; free -g; df -h /tmp "$(dirname "$SYNTH_DIR")" 2>/dev/null
    echo; echo "## mpirun"; mpirun --version 2>&1 | head -2
  } > "$OUT/topo.txt" 2>&1
  head -30 "$OUT/topo.txt"
}

# ---------------------------------------------------------------------------------------------
# The fixture's prompts as generate input (max_new_tokens = len(greedy_tokens)), and its greedy
# tokens, read with the standard library only (safetensors: u64 header length, JSON, raw data).
golden_prompts() {
  python3 - "$GOLDEN/tp8pp2" "$WORK/golden_prompts.jsonl" "$WORK/golden_greedy.json" <<'EOF'
import glob, json, os, struct, sys, array
src, out, greedy = sys.argv[1:4]
def ints(path, name):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
        t = h[name]
        assert t["dtype"] == "I32", (path, name, t["dtype"])
        b, e = t["data_offsets"]
        f.seek(8 + n + b)
        a = array.array("i")
        a.frombytes(f.read(e - b))
        if sys.byteorder != "little": a.byteswap()
        return a.tolist()
files = sorted(glob.glob(os.path.join(src, "prompt*.safetensors")), key=lambda p: int(p.split("prompt")[-1].split(".")[0]))
g, lens = {}, []
with open(out, "w") as f:
    for p in files:
        k = os.path.basename(p).split(".")[0]
        ids, gt = ints(p, "prompt_ids"), ints(p, "greedy_tokens")
        g[k] = gt
        lens.append((k, len(ids)))
        f.write(json.dumps({"id": k, "tokens": ids, "max_new_tokens": len(gt)}) + "\n")
json.dump(g, open(greedy, "w"))
print("# golden prompts: %s" % ", ".join("%s (%d prompt + %d new tokens)" % (k, n, len(g[k])) for k, n in lens))
EOF
}

step_golden() {
  section "golden: verify and greedy tokens, 1 GPU rank vs $NP ranks"
  fits golden 60 || return 0
  if [ ! -d "$GOLDEN/tp8pp2" ]; then nok "golden: $GOLDEN/tp8pp2 missing"; return 0; fi
  golden_prompts || { nok "golden: reading the fixture's prompts"; return 0; }
  local t
  t=$(date +%s)
  limited 300 "$WORK/v1.txt" "$DSBATCH" verify --golden "$GOLDEN/tp8pp2" --backend "$BACKEND"
  if grep -q " 0 failed" "$WORK/v1.txt"; then ok "verify tp8pp2 on 1 $BACKEND rank: $(tail -1 "$WORK/v1.txt" | cut -c1-150)"
  else nok "verify tp8pp2 on 1 $BACKEND rank: $(tail -2 "$WORK/v1.txt") $(grep -m2 -i 'error' "$WORK/v1.txt.err")"; fi
  limited 300 "$WORK/g1.out" "$DSBATCH" generate --model "$GOLDEN/tp8pp2" --prompts "$WORK/golden_prompts.jsonl" \
    --out "$WORK/g1.jsonl" --max-seqs 4 --logprobs --backend "$BACKEND"
  [ -s "$WORK/g1.jsonl" ] || nok "generate on the fixture's prompts on 1 $BACKEND rank: $(grep -m2 -i 'error' "$WORK/g1.out.err")"
  echo "# 1 rank: verify + generate in $(( $(date +%s) - t )) s"
  for lay in $LAYOUTS; do
    local tp pp; tp=$(lay_tp "$lay"); pp=$(lay_pp "$lay")
    fits "golden TP$tp x PP$pp" 30 || continue
    t=$(date +%s)
    # only world rank 0 writes the report on stdout
    limited 300 "$WORK/v_$lay.txt" "${MPIRUN[@]}" --timeout 300 -np "$NP" "$DSBATCH" verify --golden "$GOLDEN/tp8pp2" \
      --tp "$tp" --pp "$pp" --backend "$BACKEND" --watchdog 240
    local err=$WORK/v_$lay.txt.err
    if grep -q " 0 failed" "$WORK/v_$lay.txt"; then ok "verify tp8pp2 on TP$tp x PP$pp ($NP ranks): $(tail -1 "$WORK/v_$lay.txt" | cut -c1-120)"
    else nok "verify tp8pp2 on TP$tp x PP$pp ($NP ranks): $(tail -2 "$WORK/v_$lay.txt") $(grep -m2 -i 'error\|watchdog' "$err")"; fi
    # the same lines as 1 rank's report, every per-layer error to the printed digit (under PP the
    # stages report in turn, so the order differs: compared sorted)
    sort "$WORK/v1.txt" > "$WORK/v1.sorted"; sort "$WORK/v_$lay.txt" > "$WORK/v_$lay.sorted"
    if [ -s "$WORK/v1.txt" ] && cmp -s "$WORK/v1.sorted" "$WORK/v_$lay.sorted"; then
      ok "verify report of TP$tp x PP$pp = 1 rank's ($(wc -l < "$WORK/v1.txt") lines, every per-layer error equal$(cmp -s "$WORK/v1.txt" "$WORK/v_$lay.txt" && echo ", same order"))"
    else
      nok "verify report of TP$tp x PP$pp differs from 1 rank's: $(diff "$WORK/v1.sorted" "$WORK/v_$lay.sorted" | grep -c '^[<>]') lines; first: $(diff "$WORK/v1.sorted" "$WORK/v_$lay.sorted" | grep -m2 '^[<>]' | tr '\n' ' ')"
    fi
    if [ "$BACKEND" = cuda ]; then
      if grep -q "host staging" "$err"; then nok "TP$tp x PP$pp: TP collectives fell back to MPI staging: $(grep -m1 'host staging' "$err")"
      else ok "TP$tp x PP$pp: TP collectives through NCCL (no staging fallback logged)"; fi
    fi
    echo "# rank table:"; sed -n '/^rank  dp/,/^rank  weight/p' "$err" | grep -v "^rank  weight" | head -$((NP + 1))
    limited 300 "$WORK/g_$lay.out" "${MPIRUN[@]}" --timeout 300 -np "$NP" "$DSBATCH" generate --model "$GOLDEN/tp8pp2" \
      --prompts "$WORK/golden_prompts.jsonl" --out "$WORK/g_$lay.jsonl" --max-seqs 4 --logprobs --tp "$tp" --pp "$pp" \
      --backend "$BACKEND" --quiet --watchdog 240
    if [ -s "$WORK/g1.jsonl" ] && cmp -s "$WORK/g1.jsonl" "$WORK/g_$lay.jsonl"; then
      ok "greedy tokens and logprobs on the fixture's prompts, TP$tp x PP$pp = 1 rank (byte-identical)"
    else
      nok "greedy tokens on the fixture's prompts, TP$tp x PP$pp differ from 1 rank's: $(grep -m2 -i 'error\|watchdog' "$WORK/g_$lay.out.err")"
    fi
    echo "# TP$tp x PP$pp: verify + generate in $(( $(date +%s) - t )) s"
  done
  [ -s "$WORK/g1.jsonl" ] && python3 - "$WORK/g1.jsonl" "$WORK/golden_greedy.json" <<'EOF'
import json, sys
out = {json.loads(l)["id"]: json.loads(l)["output_tokens"] for l in open(sys.argv[1])}
gold = json.load(open(sys.argv[2]))
for k, g in gold.items():
    o = out.get(k, [])
    pre = next((i for i, (a, b) in enumerate(zip(o, g)) if a != b), min(len(o), len(g)))
    same = sum(a == b for a, b in zip(o, g))
    print("# %s: 1-rank greedy agrees with the fixture's greedy_tokens for the first %d of %d tokens (%d equal overall)"
          " -- reported, not judged" % (k, pre, len(g), same))
EOF
}

# ---------------------------------------------------------------------------------------------
# Message sizes of one decode step at batch B on TP rank (model.c, attention.c): embed allreduce
# B*D bf16; per layer allgathers of the attention groups B*(o_groups/tp)*o_lora bf16, the attention
# output B*(D/tp) bf16 and the routed experts' outputs B*k*D bf16; the logits allgather B*(V/tp)
# fp32. (Engram rows: no collective, the node's Engram service holds whole rows.)
model_json() { if [ -s "$SYNTH_DIR/config.json" ]; then echo "$SYNTH_DIR/config.json"; else echo "$MODEL_PRESET_JSON"; fi; }
model_sizes() { # TP then the batches; prints the unique sizes, comma-separated
  python3 - "$(model_json)" "$@" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1])); c = c.get("text_config", c)
tp = int(sys.argv[2]); D, V, k = c["hidden_size"], c["vocab_size"], c["num_experts_per_tok"]
g, r = c["o_groups"], c["o_lora_rank"]
s = set()
for b in map(int, sys.argv[3:]):
    s |= {b * D * 2, b * (g // tp) * r * 2, b * (D // tp) * 2, b * k * D * 2, b * (V // tp) * 4}
print(",".join(str(x) for x in sorted(s)))
EOF
}

# "D,k" of the model: the experts' exchange shape (bench_nccl --moe-shape)
model_dk() {
  python3 -c "
import json,sys
c = json.load(open(sys.argv[1])); c = c.get('text_config', c)
print('%d,%d' % (c['hidden_size'], c['num_experts_per_tok']))" "$(model_json)"
}

step_nccl() {
  section "nccl: bench_nccl (comm table allgather / allreduce_sum), ranks: $NCCL_RANKS"
  rm -f "$WORK/nccl.csv"  # kept in WORK across calls (a later decode step estimates from it), copied to $OUT
  if [ ! -x "$BENCH_NCCL" ]; then nok "bench_nccl: $BENCH_NCCL missing (make builds it with CUDA; pack.sh carries build/bench/*)"; return 0; fi
  for n in $NCCL_RANKS; do
    fits "nccl $n ranks" 40 || continue
    limited 240 "$WORK/nccl_$n.txt" "${MPIRUN[@]}" --timeout 240 -np "$n" "$BENCH_NCCL" --mpi-staging --raw \
      --csv "$WORK/nccl.csv" --label "default" $BENCH_NCCL_ARGS
    local rc=$?
    cat "$WORK/nccl_$n.txt"
    [ $rc -eq 0 ] || tail -5 "$WORK/nccl_$n.txt.err"
    if [ $rc -eq 0 ]; then ok "bench_nccl at $n ranks: $(grep -c ' ok$' "$WORK/nccl_$n.txt") rows, every result checked"
    else nok "bench_nccl at $n ranks: rc=$rc $(grep -m1 -i error "$WORK/nccl_$n.txt.err")"; fi
  done
  local tp; tp=$(lay_tp "${DECODE_LAYOUTS%% *}")
  fits "nccl model sizes" 40 || return 0
  local sizes; sizes=$(model_sizes "$tp" $CONC)
  echo "# decode-step message sizes of $(model_json) at TP$tp, batch $CONC: $sizes"
  # NCCL's log (INIT, ENV, NVLS subsystems): its version, how it read NCCL_NVLS_ENABLE, transports,
  # and whether it created a multicast group (it must not)
  limited 240 "$WORK/nccl_model.txt" env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ENV,NVLS "${MPIRUN[@]}" -x NCCL_DEBUG \
    -x NCCL_DEBUG_SUBSYS --timeout 240 -np "$tp" "$BENCH_NCCL" --raw --sizes "$sizes" --csv "$WORK/nccl.csv" \
    --label model --moe "$(echo $CONC | tr ' ' ,)" --moe-shape "$(model_dk)" $BENCH_NCCL_ARGS
  local rc=$?
  grep -v "NCCL INFO" "$WORK/nccl_model.txt"  # NCCL logs to stdout
  local all="$WORK/nccl_model.txt $WORK/nccl_model.txt.err"
  echo "# NCCL INFO excerpt (version, NVLS, transports):"
  cat $all | grep "NCCL INFO" | grep -i "NCCL version\|NVLS\|set by environment\|P2P\|via \|Connected all\|CollNet\|Init COMPLETE" | head -40
  if cat $all | grep "NCCL INFO" | grep -q "NVLS Creat"; then
    nok "NCCL created an NVLS multicast group although NCCL_NVLS_ENABLE=0: $(cat $all | grep -m1 'NVLS Creat')"
  elif cat $all | grep -q "NCCL_NVLS_ENABLE set by environment to 0"; then
    ok "NCCL read NCCL_NVLS_ENABLE=0 from the environment and created no NVLS multicast group"
  else
    echo "# NCCL's log does not mention NCCL_NVLS_ENABLE (bench_nccl's nvls_env column records what each rank saw)"
  fi
  if [ $rc -eq 0 ]; then ok "bench_nccl at the model's decode message sizes ($tp ranks)"
  else nok "bench_nccl at the model's message sizes: rc=$rc $(grep -v 'NCCL INFO' "$WORK/nccl_model.txt.err" | grep -m1 -i error)"; fi
  cp "$WORK/nccl.csv" "$OUT/nccl.csv" 2>/dev/null
}

# ---------------------------------------------------------------------------------------------
# mkmodel runs in the background (MK_BACKGROUND=1, default) from the start of the script, while the
# golden and nccl steps use the GPUs: it needs only cores and disk (nice 10, MK_THREADS threads).
# The `mkmodel` step then waits for it within the budget. A writer still running when this call's
# budget ends is left running with its pid in $SYNTH_DIR.pid: a later call (MULTI_STEPS="mkmodel
# decode") waits for it, or starts it again if it is gone (mkmodel writes into DIR.tmp-* and
# renames at the end, so config.json in SYNTH_DIR means a complete checkpoint).
synth_ready() { [ -s "$SYNTH_DIR/config.json" ] && [ "$(cat "$SYNTH_DIR.args" 2>/dev/null)" = "$SYNTH_ARGS" ]; }
mk_pid() { # the pid of our running writer, if any
  local p; p=$(cat "$SYNTH_DIR.pid" 2>/dev/null) || return 1
  [ -n "$p" ] && kill -0 "$p" 2>/dev/null && tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | grep -q "mkmodel" && echo "$p"
}
mk_start() {
  section "mkmodel: synthetic checkpoint ($SYNTH_ARGS)"
  # shellcheck disable=SC2086
  "$DSBATCH" mkmodel $SYNTH_ARGS --out "$SYNTH_DIR" --dry-run
  df -h "$(dirname "$SYNTH_DIR")" | tail -1 | awk '{print "# disk free on " $6 ": " $4 " of " $2}'
  if synth_ready; then ok "synthetic checkpoint already in $SYNTH_DIR ($(du -sh "$SYNTH_DIR" | cut -f1)), reused"; return 0; fi
  [ "$DRY" = 1 ] && { echo "# MULTI_DRY_RUN: not writing it"; return 0; }
  local p; p=$(mk_pid) && { echo "# mkmodel already running (pid $p, started by an earlier call)"; return 0; }
  rm -rf "$SYNTH_DIR" "$SYNTH_DIR".tmp-* "$SYNTH_DIR.args" "$SYNTH_DIR.pid"
  local threads=${MK_THREADS:-$(( $(nproc) > 16 ? $(nproc) / 2 : $(nproc) ))}
  echo "# starting mkmodel with $threads threads$([ "${MK_BACKGROUND:-1}" = 1 ] && echo ' in the background'); log $SYNTH_DIR.log"
  # the wrapper stamps the arguments once the checkpoint is complete
  # shellcheck disable=SC2016
  setsid nohup nice -n 10 env OMP_NUM_THREADS="$threads" bash -c \
    's=$(date +%s); "$0" mkmodel $1 --out "$2" && echo "$1" > "$2.args" && echo "# mkmodel took $(( $(date +%s) - s )) s"' \
    "$DSBATCH" "$SYNTH_ARGS" "$SYNTH_DIR" > "$SYNTH_DIR.log" 2>&1 < /dev/null &
  echo $! > "$SYNTH_DIR.pid"
  MK_T0=$(date +%s)
  [ "${MK_BACKGROUND:-1}" = 1 ] || mk_wait
}
mk_wait() {
  section "mkmodel: waiting for the synthetic checkpoint"
  local p need=${DECODE_NEED_S:-150}
  while p=$(mk_pid); do
    if [ "$(left)" -le "$need" ]; then
      skip "mkmodel" "still writing (pid $p, $(du -sh "$SYNTH_DIR".tmp-* 2>/dev/null | cut -f1 | head -1) so far) with $(left) s left; it keeps running: a later call with MULTI_STEPS=\"mkmodel decode\" waits for it"
      return 0
    fi
    sleep 5
  done
  cat "$SYNTH_DIR.log" 2>/dev/null
  if synth_ready; then
    ok "mkmodel wrote $SYNTH_DIR: $(du -sh "$SYNTH_DIR" | cut -f1)$([ -n "${MK_T0:-}" ] && echo ", $(( $(date +%s) - MK_T0 )) s after its start")"
  elif [ "$DRY" != 1 ]; then
    rm -rf "$SYNTH_DIR".tmp-*
    nok "mkmodel did not finish: $(tail -2 "$SYNTH_DIR.log" 2>/dev/null | tr '\n' ' ')"
  fi
}

# ---------------------------------------------------------------------------------------------
step_decode() {
  section "decode: generate on the synthetic checkpoint, layouts $DECODE_LAYOUTS, concurrency $CONC"
  if [ ! -s "$SYNTH_DIR/config.json" ]; then
    skip decode "no synthetic checkpoint in $SYNTH_DIR: run the mkmodel step first"
    return 0
  fi
  local V; V=$(python3 -c "import json,sys; c=json.load(open(sys.argv[1])); print(c.get('text_config', c)['vocab_size'])" "$SYNTH_DIR/config.json")
  for lay in $DECODE_LAYOUTS; do
    local tp pp; tp=$(lay_tp "$lay"); pp=$(lay_pp "$lay")
    for c in $CONC; do
      fits "decode TP$tp x PP$pp c=$c" 45 || continue
      python3 -c "
import json, random, sys
r = random.Random(1000 + $c)
with open('$WORK/p$c.jsonl', 'w') as f:
    for i in range($c):
        f.write(json.dumps({'id': i, 'tokens': [r.randrange(3, $V - 16) for _ in range($PLEN)], 'max_new_tokens': $NEW}) + '\n')"
      rm -f "$WORK/d_${lay}_$c.h5" "$WORK/d_${lay}_$c.h5.journal" "$WORK/trace_${lay}_$c.csv"
      local t; t=$(date +%s)
      # shellcheck disable=SC2086
      limited 400 "$WORK/d_${lay}_$c.out" "${MPIRUN[@]}" --timeout 400 -np "$NP" "$DSBATCH" generate --model "$SYNTH_DIR" \
        --prompts "$WORK/p$c.jsonl" --out "$WORK/d_${lay}_$c.h5" --max-seqs "$c" --max-seq-len $((PLEN + NEW + 16)) \
        --tp "$tp" --pp "$pp" --backend "$BACKEND" --trace "$WORK/trace_${lay}_$c.csv" --watchdog 300 $DECODE_ARGS
      local rc=$? wall=$(( $(date +%s) - t ))
      grep -i "generated\|error\|warn\|watchdog\|layout\|engram service" "$WORK/d_${lay}_$c.out.err" | tail -6
      "$DSBATCH" inspect "$WORK/d_${lay}_$c.h5" > "$WORK/i_${lay}_$c.txt" 2>&1
      sed 's/^/#   /' "$WORK/i_${lay}_$c.txt" | grep -v "job \|versions\|compression"
      if [ $rc -eq 0 ] && [ -s "$WORK/trace_${lay}_$c.csv" ]; then ok "generate TP$tp x PP$pp at concurrency $c ($wall s with load)"
      else nok "generate TP$tp x PP$pp at concurrency $c: rc=$rc $(grep -m2 -i 'error\|watchdog' "$WORK/d_${lay}_$c.out.err")"; fi
    done
  done
  decode_summary
}

decode_summary() {
  python3 - "$WORK" "$OUT" "$DECODE_LAYOUTS" "$CONC" "$(model_json)" "$WORK/nccl.csv" "$PLEN" "$NEW" "$SYNTH_ARGS" <<'EOF'
import csv, json, os, re, statistics, sys
work, out, layouts, conc, model_json, nccl_csv, plen, new, synth = sys.argv[1:10]
c = json.load(open(model_json)); c = c.get("text_config", c)
D, V, k, L = c["hidden_size"], c["vocab_size"], c["num_experts_per_tok"], c["num_hidden_layers"]
g, r = c["o_groups"], c["o_lora_rank"]
# bench_nccl medians at the model's sizes, per comm: {(comm, op, size): us}
bench = {}
if os.path.exists(nccl_csv):
    for row in csv.DictReader(open(nccl_csv)):
        if row["label"] == "model" or row["label"].startswith("model moe "):
            bench[(row["comm"], row["op"], int(row["size_bytes"]), int(row["ranks"]))] = float(row["median_us"])
def moe_form(tp, b):
    """the experts' exchange the engine picks (--moe-exchange auto: model.h MOE_OWNER_MIN_BYTES)"""
    return "moe_owner" if D % tp == 0 and (tp - 1) * b * k * D * 2 >= 4 << 20 else "moe_gather"
def estimate(comm, tp, pp, b):
    """us of the TP collectives of one decode step on a stage of L/pp layers (None: sizes not timed)."""
    Ls = L // pp
    parts = [("allreduce_sum", b * D * 2, 1)]  # embed (first stage), counted once per step
    parts += [("allgather", b * (g // tp) * r * 2, Ls), ("allgather", b * (D // tp) * 2, Ls),
              (moe_form(tp, b), b * k * D * 2, Ls), ("allgather", b * (V // tp) * 4, 1)]
    tot = 0.0
    for op, size, n in parts:
        us = bench.get((comm, op, size, tp))
        if us is None:
            return None
        tot += n * us
    return tot
def q(v, p):
    v = sorted(v); return v[min(len(v) - 1, max(0, int(round(p * (len(v) - 1)))))] if v else float("nan")
summary = {"synthetic_checkpoint": synth, "model": model_json, "layers": L, "prompt_tokens": int(plen),
           "new_tokens": int(new), "runs": [],
           "comm_note": "tp_comm_share = MEASURED: the trace's tp_comm_s (every TP collective's span on the "
                        "stream, CUDA events, waits for slower peers included) / compute_s, median over rank 0's "
                        "full-batch decode steps; comm_share_est = ESTIMATE from bench_nccl medians (label "
                        "'model') at the step's message sizes x count per step, of isolated collectives (no skew)"}
merged = []
for lay in layouts.split():
    tp, pp = map(int, lay.split("x"))
    for cc in map(int, conc.split()):
        tr = os.path.join(work, "trace_%s_%d.csv" % (lay, cc))
        if not os.path.exists(tr):
            summary["runs"].append({"layout": lay, "concurrency": cc, "error": "no trace"}); continue
        rows = list(csv.DictReader(open(tr)))
        for x in rows:
            merged.append(dict(x, layout=lay, concurrency=cc))
        per_rank = {}
        for x in rows:
            if int(x["rows"]) == int(x["seqs"]):  # a pure decode step: one row per sequence
                per_rank.setdefault(int(x["rank"]), []).append(float(x["compute_s"]) * 1e3)
        r0 = [float(x["compute_s"]) * 1e3 for x in rows if x["rank"] == "0" and int(x["rows"]) == int(x["seqs"])]
        full = [float(x["compute_s"]) * 1e3 for x in rows if x["rank"] == "0" and int(x["rows"]) == int(x["seqs"]) == cc]
        other = [x for x in rows if x["rank"] == "0" and int(x["rows"]) != int(x["seqs"])]
        run = {"layout": "TP%d x PP%d" % (tp, pp), "concurrency": cc,
               "decode_steps_rank0": len(r0), "decode_steps_full_batch": len(full),
               "decode_ms_p50": round(q(r0, .5), 3), "decode_ms_p90": round(q(r0, .9), 3),
               "full_batch_decode_ms_p50": round(q(full, .5), 3) if full else None,
               "decode_ms_p50_per_rank_min_max": [round(min(statistics.median(v) for v in per_rank.values()), 3),
                                                  round(max(statistics.median(v) for v in per_rank.values()), 3)] if per_rank else None,
               "prefill_or_mixed_steps_rank0": len(other),
               "prefill_or_mixed_ms_total_rank0": round(sum(float(x["compute_s"]) for x in other) * 1e3, 1)}
        ins = os.path.join(work, "i_%s_%d.txt" % (lay, cc))
        if os.path.exists(ins):
            t = open(ins).read()
            m = re.search(r"ITL\s+p50 ([0-9.]+) s\s+p90 ([0-9.]+) s\s+p99 ([0-9.]+) s", t)
            if m: run["itl_ms_p50_p90_p99"] = [round(float(v) * 1e3, 3) for v in m.groups()]
            m = re.search(r"TTFT\s+p50 ([0-9.]+) s\s+p90 ([0-9.]+) s\s+p99 ([0-9.]+) s", t)
            if m: run["ttft_s_p50_p90_p99"] = [float(v) for v in m.groups()]
            m = re.search(r"throughput\s+([0-9.]+) s of requests in flight; ([0-9.]+) generated tok/s", t)
            if m: run["requests_in_flight_s"], run["generated_tok_per_s"] = float(m.group(1)), float(m.group(2))
            m = re.search(r"finish\s+length (\d+), stop \(EOS\) (\d+), stop id (\d+)", t)
            if m: run["finish_length_eos_stopid"] = list(map(int, m.groups()))
            m = re.search(r"tokens\s+(\d+) prompt, (\d+) generated", t)
            if m: run["generated_tokens"] = int(m.group(2))
        err = os.path.join(work, "d_%s_%d.out.err" % (lay, cc))
        if os.path.exists(err):
            m = re.search(r"generated (\d+) tokens for (\d+) prompts .* in ([0-9.]+) s: ([0-9.]+) tok/s", open(err).read())
            if m: run["generate_s"], run["generate_tok_per_s"] = float(m.group(3)), float(m.group(4))
        step = run["full_batch_decode_ms_p50"] or run["decode_ms_p50"]
        dec = [x for x in rows if x["rank"] == "0" and int(x["rows"]) == int(x["seqs"]) and float(x["compute_s"]) > 0
               and "tp_comm_s" in x]
        dec = [x for x in dec if int(x["rows"]) == cc] or dec
        if dec and tp > 1:
            run["tp_comm_ms_p50"] = round(q([float(x["tp_comm_s"]) * 1e3 for x in dec], .5), 3)
            run["tp_comm_share"] = round(q([float(x["tp_comm_s"]) / float(x["compute_s"]) for x in dec], .5), 4)
        run["moe_exchange"] = moe_form(tp, cc)
        for form in ("moe_gather", "moe_owner"):  # both forms of the experts' exchange, per layer
            us = bench.get(("nccl", form, cc * k * D * 2, tp))
            if us is not None: run[form + "_us_per_layer"] = us
        for comm in ("nccl", "nccl-raw", "mpi-staged"):
            est = estimate(comm, tp, pp, cc)
            if est is not None and step == step and step:
                run["comm_est_ms_" + comm] = round(est / 1e3, 3)
                run["comm_share_est_" + comm] = round(est / 1e3 / step, 4)
        if not any(key.startswith("comm_est") for key in run):
            run["comm_share_est"] = "not estimated: no bench_nccl 'model' rows at TP%d for batch %d (run the nccl step)" % (tp, cc)
        summary["runs"].append(run)
if merged:
    cols = ["layout", "concurrency"] + [k for k in merged[0] if k not in ("layout", "concurrency")]
    with open(os.path.join(out, "decode_trace.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols); w.writeheader(); w.writerows(merged)
json.dump(summary, open(os.path.join(out, "multi_gpu.json"), "w"), indent=1)
print("# %s" % summary["comm_note"])
print("%-12s %5s %8s %8s %8s %10s %9s %9s %11s %11s %11s" % ("layout", "conc", "steps", "ms_p50", "ms_p90",
      "full_p50", "ITL_p50", "tok/s", "tp_comm_ms", "tp_share", "est_share"))
for x in summary["runs"]:
    if "error" in x:
        print("%-12s %5d  %s" % (x["layout"], x["concurrency"], x["error"])); continue
    sh = x.get("comm_share_est_nccl", x.get("comm_share_est_mpi-staged"))
    tm, ts = x.get("tp_comm_ms_p50"), x.get("tp_comm_share")
    print("%-12s %5d %8d %8.2f %8.2f %10s %9s %9s %11s %11s %11s" % (x["layout"], x["concurrency"],
          x["decode_steps_rank0"], x["decode_ms_p50"], x["decode_ms_p90"], x["full_batch_decode_ms_p50"],
          (x.get("itl_ms_p50_p90_p99") or ["-"])[0], x.get("generate_tok_per_s", "-"),
          "-" if tm is None else "%.3f" % tm, "-" if ts is None else "%.1f %%" % (100 * ts),
          "-" if sh is None else "%.1f %%" % (100 * sh)))
    if x.get("finish_length_eos_stopid") and x["finish_length_eos_stopid"][1]:
        print("#   %d sequence(s) stopped at EOS early: fewer sequences in the later steps" % x["finish_length_eos_stopid"][1])
EOF
}

# ---------------------------------------------------------------------------------------------
if [ "$DRY" = 1 ]; then
  section "dry run: the plan, no GPU work"
  echo "# golden: 1 rank verify/generate, then layouts $LAYOUTS under: ${MPIRUN[*]} -np $NP"
  echo "# nccl: ranks $NCCL_RANKS; model sizes at TP$(lay_tp "${DECODE_LAYOUTS%% *}"), batch $CONC: $(model_sizes "$(lay_tp "${DECODE_LAYOUTS%% *}")" $CONC)"
  mk_start
  echo "# decode: $NP ranks, layouts $DECODE_LAYOUTS, concurrency $CONC, $PLEN prompt + $NEW new tokens each"
  exit 0
fi
case " $STEPS " in *" topo "*) step_topo ;; esac
# the checkpoint writer starts first and runs alongside the GPU steps (see mk_start)
case " $STEPS " in *" mkmodel "*) mk_start ;; esac
for s in $STEPS; do
  case $s in
    topo) ;;
    golden) step_golden ;;
    nccl)
      [ -n "$(mk_pid)" ] && echo "# note: mkmodel is writing in the background (nice 10) during the nccl step"
      step_nccl ;;
    mkmodel) mk_wait ;;
    decode) step_decode ;;
    *) nok "unknown step '$s' (topo golden nccl mkmodel decode)" ;;
  esac
done
section "done"
[ -s "$WORK/nccl.csv" ] && cp "$WORK/nccl.csv" "$OUT/nccl.csv"
# the TAP lines of this call go into the summary too
python3 - "$OUT/multi_gpu.json" "$TAP" "$STEPS" <<'EOF'
import json, os, sys
path, tap, steps = sys.argv[1:4]
j = json.load(open(path)) if os.path.exists(path) else {}
j["steps"] = steps.split()
j["tap"] = [l.rstrip("\n") for l in open(tap)]
json.dump(j, open(path, "w"), indent=1)
EOF
echo "# $(grep -c '^ok' "$TAP") ok, $(grep -c '^not ok' "$TAP") not ok, $(grep -c '^skip' "$TAP") skipped"
echo "# files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
grep -q '^not ok' "$TAP" && exit 1
exit 0
