#!/usr/bin/env python3
"""Backend calls per decode step of one rank's shard, by kind, from bench_step --profile CSVs.

Every backend call is host work on a GPU step's critical path (a kernel launch, a copy, an upload,
a device wait), so their number per step, and how it grows with the batch, is what a decode step
costs the host before any kernel runs. The counts are the model code's and the same on every
backend, so a CPU run of bench_step gives them (tests/bench/host_calls.sh).

Usage: host_calls.py OUT.csv LABEL=PROFILE.csv [LABEL=PROFILE.csv ...]
Writes OUT.csv (label, batch, kind, calls_per_step) and OUT.png beside it.
Kinds: ops (compute ops of the table: one or more kernel launches each), copies (copy + copy_segs
calls: one cudaMemcpyAsync, or one upload and one launch), uploads, downloads (each waits for the
device), alloc (zero-filled: one memset on the CUDA backend), scratch (no CUDA call when a kept
block is reused). A profile that does not count a kind leaves it out.
"""
import csv
import os
import re
import sys

MEM = {"copy": "copies", "copy_segs": "copies", "upload": "uploads", "download": "downloads", "alloc": "alloc",
       "scratch": "scratch", "free": None}
KINDS = ["ops", "copies", "uploads", "downloads", "alloc", "scratch"]


def load(path):
    """Calls per step by batch and kind, from the plain decode runs (decode_bN; bench_step also
    profiles decode_bN_host, the same steps drawing on the host, which this leaves out)."""
    out = {}
    with open(path) as f:
        for r in csv.DictReader(f):
            m = re.fullmatch(r"decode_b(\d+)", r["run"])
            if not m or r["op"].startswith("_"):
                continue
            b = int(m.group(1))
            kind = MEM.get(r["op"], "ops")
            if kind is None:
                continue
            d = out.setdefault(b, {})
            d[kind] = d.get(kind, 0.0) + float(r["calls_per_step"])
    return out


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    dst = sys.argv[1]
    data = []
    for arg in sys.argv[2:]:
        label, path = arg.split("=", 1)
        data.append((label, load(path)))
    with open(dst, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "batch", "kind", "calls_per_step"])
        for label, d in data:
            for b in sorted(d):
                for k in KINDS:
                    if k in d[b]:
                        w.writerow([label, b, k, "%g" % d[b][k]])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    batches = sorted({b for _, d in data for b in d})
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.8), sharey=True)
    if len(batches) == 1:
        axes = [axes]
    for ax, b in zip(axes, batches):
        width = 0.8 / len(data)
        for i, (label, d) in enumerate(data):
            vals = [d.get(b, {}).get(k, 0) for k in KINDS]
            ax.bar([j + i * width for j in range(len(KINDS))], vals, width, label=label)
        ax.set_xticks([j + width * (len(data) - 1) / 2 for j in range(len(KINDS))])
        ax.set_xticklabels(KINDS, rotation=30, fontsize=8)
        ax.set_title("decode step, batch %d" % b)
        ax.set_yscale("log")
    axes[0].set_ylabel("backend calls per step (log)")
    axes[-1].legend(fontsize=8)
    fig.suptitle("TP8 x PP2 rank 0 shard (20 layers, V4.1-Flash dims): host calls per decode step", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.splitext(dst)[0] + ".png", dpi=110)


if __name__ == "__main__":
    main()
