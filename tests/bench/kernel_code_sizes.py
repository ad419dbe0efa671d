#!/usr/bin/env python3
"""The SASS size of every kernel of the SM80 suite: each kernels/cuda/*.cu compiled to a cubin for
one architecture (nvcc -cubin -arch=sm_SM, the Makefile's -O3 -std=c++17 and include paths), each
kernel's .text section size read from it (readelf), its name demangled (c++filt). Why it matters: a
decode step streams ~2 GB of weights through L2 between two calls of a layer's kernel, so a
kernel's code is fetched cold on every call, and straight-line code run once a call (an unrolled
output pass) costs its fetch: rmsnorm_post_pair_kernel at 140 KB took 12.3 µs in a batch-1 step and
7.1 µs as a 76 KB loop (results/PERFORMANCE_HISTORY.md, "98886b5..HEAD"). With --timeline (a
step_timeline.sh LABEL_kernels.csv, e.g. results/cuda_step_timeline_kernels_lean-norm_h200.csv)
each of its kernels gets its size beside its launches and time a step, largest exposed time first.

  kernel_code_sizes.py --out results/cuda_kernel_code_sizes_sm80.csv [--sm 80] [--timeline CSV --batch 1]
      [--files kernels/cuda/a.cu,...]   (default: every kernels/cuda/*.cu)
"""
import argparse
import csv
import glob
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_timeline import demangle, short  # noqa: E402

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
SECTION = re.compile(r"\]\s+\.text\.(\S+)\s+\S+\s+\S+\s+\S+\s+([0-9a-fA-F]+)\s")


def nvcc_path():
    for p in (os.environ.get("NVCC"), "/usr/local/cuda/bin/nvcc"):
        if p and os.access(p, os.X_OK):
            return p
    sys.exit("kernel_code_sizes.py: no nvcc (NVCC, or /usr/local/cuda/bin/nvcc)")


def cubin_sizes(nvcc, src, sm, tmp):
    """[(mangled name, bytes)] of one source file's kernels"""
    out = os.path.join(tmp, os.path.basename(src) + ".cubin")
    cmd = [nvcc, "-cubin", f"-arch=sm_{sm}", "-O3", "-std=c++17", "-Ikernels", "-Isrc", "-Ikernels/cuda", "-o", out, src]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"kernel_code_sizes.py: {' '.join(cmd)} failed:\n{r.stderr}")
    r = subprocess.run(["readelf", "-SW", out], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"kernel_code_sizes.py: readelf -SW {out} failed:\n{r.stderr}")
    return [(m.group(1), int(m.group(2), 16)) for m in SECTION.finditer(r.stdout)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sm", default="80")
    ap.add_argument("--timeline")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--files", help="comma-separated sources, relative to the repository root")
    a = ap.parse_args()
    nvcc = nvcc_path()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        srcs = a.files.split(",") if a.files else sorted(glob.glob(os.path.join(ROOT, "kernels", "cuda", "*.cu")))
        for src in srcs:
            rel = os.path.relpath(os.path.join(ROOT, src), ROOT)
            if not os.path.isfile(os.path.join(ROOT, rel)):
                sys.exit(f"kernel_code_sizes.py: no source {src}")
            rows += [(rel, name, size) for name, size in cubin_sizes(nvcc, rel, a.sm, tmp)]
    if not rows:
        sys.exit("kernel_code_sizes.py: no kernel sections found (readelf's layout?)")
    names = demangle(n for _, n, _ in rows)
    rows = sorted(((f, short(names[n]), s) for f, n, s in rows), key=lambda r: -r[2])
    with open(a.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["file", "kernel", "code_bytes", "sm"])
        for r in rows:
            w.writerow([*r, a.sm])
    print(f"{len(rows)} kernels, {sum(r[2] for r in rows) / 1024:.0f} KB of code; the largest:")
    for f, k, s in rows[:10]:
        print(f"  {s / 1024:7.1f} KB  {k}  ({f})")
    if a.timeline:
        size = {}
        for _, k, s in rows:
            size.setdefault(k, s)
        with open(a.timeline, newline="") as f:
            tl = [r for r in csv.DictReader(f) if r["batch"] == a.batch]
        if not tl:
            sys.exit(f"kernel_code_sizes.py: {a.timeline} has no rows of batch {a.batch}")
        print(f"\n{a.timeline}, batch {a.batch}: kernel, code KB, launches a step, µs a launch, exposed µs a step")
        for r in sorted(tl, key=lambda r: -float(r["exposed_us"])):
            n = float(r["launches_per_step"])
            kb = f"{size[r['kernel']] / 1024:6.1f}" if r["kernel"] in size else "     ?"
            print(f"  {r['kernel'][:48]:48s} {kb} {n:7.1f} {float(r['sum_us']) / n if n else 0:7.2f} {float(r['exposed_us']):8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
