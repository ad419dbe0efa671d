#!/usr/bin/env python3
"""Turn one GPU-machine run of tests/gpu/device_run.sh (test engine bench) into results/.

Copies the run's CSVs into results/ (cuda_step.csv, cuda_step_profile.csv, cuda_step_exact.csv,
cuda_step_eager.csv, cuda_step_ctx2048.csv, cuda_linear_decode.csv, cuda_gemm_ceiling.csv,
torch_linear_decode.csv), writes results/cuda_h200.json (the command, the tree,
the device, every test's summary line, the decode-step rows as fractions of the measured copy
bandwidth) and redraws the PNGs (plot_results.py).

Usage: gpu_results.py RUN --commit SHA --command "what ran" [--results results] [--ceilings RUN2]
RUN: the run's directory or its run.tgz (what device_run.sh leaves in $OUT). RUN2: an earlier run
on the same device for the copy bandwidth and the cuBLAS rate, where RUN has not got them; a RUN
without test_cuda.txt takes test_cuda_summary.txt (the summary lines the run printed).
"""
import argparse
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

CSVS = ["cuda_step.csv", "cuda_step_profile.csv", "cuda_step_exact.csv", "cuda_step_eager.csv",
        "cuda_step_ctx2048.csv", "cuda_linear_decode.csv", "cuda_gemm_ceiling.csv", "torch_linear_decode.csv"]
A800_GBPS = 1555.0  # the target part's HBM bandwidth, for the per-step floor of the same bytes


def read_rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("--commit", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--results", default="results")
    ap.add_argument("--ceilings", help="another run (directory or run.tgz) of the same device whose bench.txt "
                                       "and cuda_gemm_ceiling.csv give the copy bandwidth and the cuBLAS rate, "
                                       "for a RUN without them")
    a = ap.parse_args()

    def unpack(path):
        if os.path.isfile(path):  # run.tgz
            tmp = tempfile.mkdtemp()
            with tarfile.open(path) as t:
                t.extractall(tmp)
            return tmp
        return path

    a.run = unpack(a.run)
    ceil = unpack(a.ceilings) if a.ceilings else a.run
    for c in CSVS:
        src = os.path.join(a.run, c)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(a.results, c))
    bench = open(os.path.join(ceil, "bench.txt")).read()
    m = re.search(r"# (.+?), L2 .*?device-to-device copy (\d+) GB/s", bench)
    if not m:
        sys.exit("gpu_results: no copy bandwidth line in bench.txt")
    device, copy_gbps = m.group(1), float(m.group(2))
    gemm = os.path.join(ceil, "cuda_gemm_ceiling.csv")
    cublas = max((float(r["tflops"]) for r in read_rows(gemm)), default=0.0) if os.path.exists(gemm) else 0.0
    tests = {}
    cur = None
    tpath = os.path.join(a.run, "test_cuda.txt")
    if os.path.exists(tpath):
        for line in open(tpath):
            if line.startswith("== "):
                cur = os.path.basename(line[3:].strip())
            elif cur and ("PASSED" in line or "FAILED" in line):
                tests[cur] = line.strip()
    else:  # the log did not come back; the summary lines the run printed, as printed
        spath = os.path.join(a.run, "test_cuda_summary.txt")
        tests["summary lines printed (log not brought back)"] = [l.strip() for l in open(spath) if l.strip()]
    eng = [line.strip() for line in open(os.path.join(a.run, "test_cuda_engine.txt"))
           if line.startswith(("ok", "not ok", "verify", "# GPU vs CPU"))]
    steps = {}
    for name in ["cuda_step.csv", "cuda_step_exact.csv", "cuda_step_eager.csv", "cuda_step_ctx2048.csv"]:
        p = os.path.join(a.run, name)
        if not os.path.exists(p):
            continue
        out = []
        for r in read_rows(p):
            ms, b = float(r["ms"]), float(r["bytes"])
            row = {"kind": r["kind"], "batch_or_tokens": int(r["batch_or_tokens"]), "ctx": int(r["ctx"]),
                   "ms": ms, "weight_bytes": int(b), "gb_per_s": float(r["gbps"]),
                   "fraction_of_copy_bw": round(float(r["gbps"]) / copy_gbps, 4), "backend": r["backend"]}
            if r["kind"] == "decode":
                row["a800_floor_ms_for_these_bytes"] = round(b / (A800_GBPS * 1e9) * 1e3, 3)
            else:
                row["tokens_per_s"] = round(int(r["batch_or_tokens"]) / (ms * 1e-3), 1)
            if r.get("flops"):
                row["tflop_per_s"] = round(float(r["flops"]) / (ms * 1e-3) / 1e12, 2)
                if cublas and r["kind"] == "prefill":
                    row["fraction_of_cublas_bf16"] = round(row["tflop_per_s"] / cublas, 4)
            out.append(row)
        steps[name] = out
    doc = {
        "what": "Issue #6 on the device tool's H200 (SM80 code, -gencode arch=compute_80,code=[sm_80,compute_80], "
                "JIT-compiled by the driver): GPU tests, the whole model against the golden fixtures, one "
                "rank's decode step (TP8 x PP2 rank 0 shard, 20 layers at real dimensions, synthetic weights, "
                "TP collectives replaced by local copies) and the per-shape linears",
        "command": a.command,
        "tree": "commit %s" % a.commit,
        "device": "%s, device-to-device copy %.0f GB/s, cuBLAS bf16 GEMM %.0f TFLOP/s" % (device, copy_gbps, cublas),
        "tests": tests,
        "engine": eng,
        "steps": steps,
        "made_by": "python3 tests/bench/gpu_results.py RUN_DIR --commit %s --command ..." % a.commit,
    }
    with open(os.path.join(a.results, "cuda_h200.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    subprocess.check_call([sys.executable, os.path.join(os.path.dirname(__file__), "plot_results.py"), a.results])


if __name__ == "__main__":
    main()
