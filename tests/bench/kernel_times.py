#!/usr/bin/env python3
"""Per-kernel breakdown of a decode step from Nsight Compute CSVs (tests/gpu/kernel_times.sh).

Each input is BATCH=PATH: ncu --csv output of bench_step --profiler-range over --steps timed decode
steps, metric gpu__time_duration.sum. Kernels are grouped by name with their template arguments
(without namespaces and parameters); per group: launches per step, µs per step, mean µs per launch, share of the step's
kernel time, and the spread of its launches (min, median, max µs: a data-dependent kernel, e.g. the
routed experts' with or without a local pair in a layer, shows its cases there). Writes --out (CSV:
batch,kernel,launches_per_step,us_per_step,mean_us,share_pct,min_us,median_us,max_us) and prints the
top rows per batch.

Usage: kernel_times.py --steps N --out OUT.csv 1=ncu_b1.csv 8=ncu_b8.csv ..."""
import argparse
import csv
import io
import re
import statistics
import sys


def base_name(k):
    """The kernel's name with its template arguments, without return type, namespaces or parameters."""
    k = k.replace("(anonymous namespace)::", "").replace("<unnamed>::", "")
    depth, end = 0, len(k)
    for i, ch in enumerate(k):  # the parameter list: the first '(' outside template brackets
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            end = i
            break
    name = k[:end].strip()
    if name.startswith("void "):
        name = name[5:]
    lt = name.find("<")
    cut = (name if lt < 0 else name[:lt]).rfind("::")  # namespaces before the template arguments
    return name[cut + 2:] if cut >= 0 else name


def read_ncu(path):
    text = open(path, errors="replace").read()
    start = text.find('"ID"')
    if start < 0:
        sys.exit("kernel_times: no ncu CSV table in %s" % path)
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    out = []
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "nsecond")
        us = v / 1e3 if unit.startswith("n") else (v if unit.startswith("u") else v * 1e3)
        out.append((base_name(r["Kernel Name"]), us))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("inputs", nargs="+")
    a = ap.parse_args()
    with open(a.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["batch", "kernel", "launches_per_step", "us_per_step", "mean_us", "share_pct", "min_us",
                    "median_us", "max_us"])
        for spec in a.inputs:
            batch, path = spec.split("=", 1)
            ks = read_ncu(path)
            total = sum(us for _, us in ks)
            agg, each = {}, {}
            for name, us in ks:
                n, t = agg.get(name, (0, 0.0))
                agg[name] = (n + 1, t + us)
                each.setdefault(name, []).append(us)
            rows = sorted(agg.items(), key=lambda kv: -kv[1][1])
            print("# batch %s: %d kernels per step, %.1f us of kernel time per step" %
                  (batch, round(len(ks) / a.steps), total / a.steps))
            for name, (n, t) in rows:
                v = each[name]
                w.writerow([batch, name, round(n / a.steps, 1), round(t / a.steps, 1), round(t / n, 2),
                            round(100 * t / total, 1) if total else 0, round(min(v), 2),
                            round(statistics.median(v), 2), round(max(v), 2)])
            for name, (n, t) in rows[:12]:
                print("  %-34s %6.1f launches %9.1f us/step %7.2f us each %5.1f %%" %
                      (name, n / a.steps, t / a.steps, t / n, 100 * t / total))


if __name__ == "__main__":
    main()
