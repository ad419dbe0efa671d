#!/usr/bin/env python3
"""Collects alternated bench_step runs (two binaries run in turn in one device call, so that they see
the same machine state) into one CSV: each run's printed table, decode and prefill rows alike.

Usage: step_alternated.py --copy-gbps GBPS --device NAME --out results/cuda_step_alternated.csv [--append] REV=STDOUT [REV=STDOUT ...]

STDOUT is what one `bench_step` run printed; REV names the binary (a commit); the runs of one REV
are numbered in the order given, decode and prefill separately. Columns: device (the GPU the call
ran on, as nvidia-smi names it: the device tool lends H200s and H100s, whose bandwidths differ), rev, run, kind,
batch_or_tokens, ctx, ms, weight_mb, gbps, fraction_of_copy (gbps / GBPS, the device-to-device copy bandwidth measured on the same machine),
tokens_per_s and tflops (prefill rows: bench_step's own figures); --copy-gbps 0 (a call that measured no
copy bandwidth) leaves fraction_of_copy empty. plot_results.py draws
cuda_step_alternated.png from it. --append keeps the rows already in --out (an earlier device call's
pair of binaries, with its own GBPS) and adds these after them.
"""
import argparse
import csv
import re
import sys


def parse(path):
    out = []
    with open(path) as f:
        for line in f:
            tok = line.split()
            if not tok or tok[0] not in ("decode", "prefill"):
                continue
            row = {"kind": tok[0], "batch_or_tokens": int(tok[1]), "ctx": int(tok[2]), "ms": float(tok[3]),
                   "weight_mb": float(tok[5]), "gbps": float(tok[6]), "tokens_per_s": "", "tflops": ""}
            m = re.search(r"(\d+) tokens/s", line)
            if m:
                row["tokens_per_s"] = int(m.group(1))
            m = re.search(r"([\d.]+) TFLOP/s", line)
            if m:
                row["tflops"] = float(m.group(1))
            out.append(row)
    if not out:
        sys.exit("step_alternated.py: %s has no decode or prefill rows (not a bench_step output?)" % path)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--copy-gbps", type=float, required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--append", action="store_true")
    ap.add_argument("runs", nargs="+", metavar="REV=STDOUT")
    a = ap.parse_args()
    cols = ["device", "rev", "run", "kind", "batch_or_tokens", "ctx", "ms", "weight_mb", "gbps", "fraction_of_copy",
            "tokens_per_s", "tflops"]
    rows = []
    if a.append:
        with open(a.out, newline="") as f:
            rows = list(csv.DictReader(f))
        if rows and list(rows[0].keys()) != cols:
            sys.exit("step_alternated.py: %s has other columns than %s" % (a.out, cols))
    seen = {}
    for r in rows:
        k = (r["device"], r["rev"], r["kind"])
        seen[k] = max(seen.get(k, 0), int(r["run"]))
    for spec in a.runs:
        if "=" not in spec:
            sys.exit("step_alternated.py: '%s' is not REV=STDOUT" % spec)
        rev, path = spec.split("=", 1)
        got = parse(path)
        for kind in sorted({r["kind"] for r in got}):
            seen[(a.device, rev, kind)] = seen.get((a.device, rev, kind), 0) + 1
        for r in got:
            r.update(device=a.device, rev=rev, run=seen[(a.device, rev, r["kind"])], fraction_of_copy="%.4f" % (r["gbps"] / a.copy_gbps) if a.copy_gbps > 0 else "")
            rows.append(r)
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, lineterminator="\n")  # the file in git has Unix line ends
        w.writeheader()
        for r in rows:
            w.writerow({c: r[c] for c in cols})


if __name__ == "__main__":
    main()
