#!/usr/bin/env python3
"""Summarizes Nsight Compute's per-instruction view of a kernel: where its issued instructions and
its warps' stalls go. A diagnosis aid for issue #6, not a test.

Input: the CSV that `ncu -i REPORT --page source --csv --print-source sass` prints (gzip or plain),
as tests/gpu/ncu_probe.sh keeps it with SOURCE=1 (KERNEL mode: $OUT/ncu_source_<i>.csv.gz). Such
a file holds one table per profiled kernel: a "Kernel Name" line, a header line, then one line per
SASS instruction with its execution count ("Instructions Executed", per warp) and its stall
samples ("Warp Stall Sampling (All Samples)" and one column per reason, "stall_*").

For each kernel it prints: the warp instructions executed and the stall samples in all; the opcode
mix (share of the executed instructions by opcode, predicates and modifiers dropped); the stall
reasons (share of the samples); and the --top instructions by stall samples and by execution count,
each with its index in the kernel's SASS, so a loop's body and the waits inside it can be read off.

Usage: sass_hotspots.py FILE [--top N]
"""
import argparse
import collections
import csv
import gzip
import sys


def tables(path):
    """Yields (kernel name, header, rows) for each kernel's table in the file."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        name, hdr, rows = None, None, []
        for rec in csv.reader(f):
            if not rec:
                continue
            if rec[0] == "Kernel Name":
                if hdr is not None:
                    yield name, hdr, rows
                name, hdr, rows = (rec[1] if len(rec) > 1 else "?"), None, []
            elif hdr is None and "Source" in rec:
                hdr = rec
            elif hdr is not None and len(rec) == len(hdr):
                rows.append(rec)
        if hdr is not None:
            yield name, hdr, rows


def opcode(src):
    tok = src.split()
    if tok and tok[0].startswith("@"):
        tok = tok[1:]
    return tok[0].split(".")[0] if tok else "?"


def summarize(name, hdr, rows, top):
    col = {h: i for i, h in enumerate(hdr)}
    for need in ("Source", "Instructions Executed", "Warp Stall Sampling (All Samples)"):
        if need not in col:
            sys.exit("sass_hotspots.py: no column '%s' (not an ncu --page source --csv table?)" % need)
    ex = [int(r[col["Instructions Executed"]] or 0) for r in rows]
    st = [int(r[col["Warp Stall Sampling (All Samples)"]] or 0) for r in rows]
    src = [r[col["Source"]].strip() for r in rows]
    tot_ex, tot_st = sum(ex), sum(st)
    print("%s\n  %d SASS instructions, %d warp instructions executed, %d stall samples" % (name[:160], len(rows), tot_ex, tot_st))
    if not tot_ex:
        return
    mix = collections.Counter()
    for s, n in zip(src, ex):
        mix[opcode(s)] += n
    print("  opcode mix: " + ", ".join("%s %.1f%%" % (op, 100.0 * n / tot_ex) for op, n in mix.most_common(14)))
    reasons = {h: sum(int(r[i] or 0) for r in rows) for h, i in col.items() if h.startswith("stall_") and "(Not Issued)" not in h}
    if tot_st:
        print("  stall samples: " + ", ".join("%s %.1f%%" % (h[6:], 100.0 * v / tot_st)
                                             for h, v in sorted(reasons.items(), key=lambda a: -a[1])[:8] if v))
    for title, key in (("by stall samples", st), ("by execution count", ex)):
        print("  top %d %s (index: executed, samples, instruction):" % (top, title))
        for i in sorted(range(len(rows)), key=lambda j: -key[j])[:top]:
            print("    %5d: %10d %6d  %s" % (i, ex[i], st[i], src[i][:100]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    n = 0
    for name, hdr, rows in tables(a.file):
        summarize(name, hdr, rows, a.top)
        n += 1
    if not n:
        sys.exit("sass_hotspots.py: %s holds no kernel table" % a.file)


if __name__ == "__main__":
    main()
