#!/usr/bin/env bash
# tests/bench/host_calls.py on a hand-made bench_step --profile CSV (TAP lines): the plain decode
# runs (decode_bN) are folded by kind, bench_step's decode_bN_host runs (the same steps drawing on
# the host) and the "_" summary rows are left out, and a profile with a run name it does not know
# does not stop it. The numbers are chosen so that counting a _host row, a summary row, or a free
# as a kind changes a sum.
set -u
TMP=$(mktemp -d "${TMPDIR:-/tmp}/dsbatch_host_calls.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
ok() { echo "ok - $1"; }
not_ok() { echo "not ok - $1"; [ -n "${2:-}" ] && printf '%s\n' "$2" | head -20 | sed 's/^/#   /'; return 0; }
cat > "$TMP/a.prof.csv" <<'EOF'
run,op,calls_per_step,ms_per_step,share_of_op_time_pct
decode_b1,linear,25.0,1.0,10
decode_b1,rmsnorm,3.0,1.0,10
decode_b1,copy_segs,63.0,1.0,10
decode_b1,upload,7.0,1.0,10
decode_b1,download,2.0,1.0,10
decode_b1,alloc,20.0,1.0,10
decode_b1,scratch,382.0,1.0,10
decode_b1,free,402.0,1.0,10
decode_b1,_ops_total,1000,1.0,10
decode_b1_host,linear,25.0,1.0,10
decode_b1_host,download,5.0,1.0,10
decode_b8,linear,30.0,1.0,10
decode_b8,copy,4.0,1.0,10
decode_b8_host,copy,100.0,1.0,10
prefill_t512,linear,40.0,1.0,10
EOF
out=$(python3 tests/bench/host_calls.py "$TMP/per_step.csv" a="$TMP/a.prof.csv" 2>&1)
rc=$?
if [ $rc -eq 0 ] && [ -s "$TMP/per_step.csv" ]; then ok "host_calls.py folds a profile with _host runs"
else not_ok "host_calls.py folds a profile with _host runs" "$out"; fi
want="label,batch,kind,calls_per_step
a,1,ops,28
a,1,copies,63
a,1,uploads,7
a,1,downloads,2
a,1,alloc,20
a,1,scratch,382
a,8,ops,30
a,8,copies,4"
got=$(cat "$TMP/per_step.csv" 2>/dev/null | tr -d '\r')
if [ "$got" = "$want" ]; then ok "calls per step by kind: the plain decode runs only, frees and summaries left out"
else not_ok "calls per step by kind: the plain decode runs only, frees and summaries left out" "$got"; fi
