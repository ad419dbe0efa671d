#!/usr/bin/env python3
"""Plots of the GPU benchmark results (make bench writes the CSVs; this draws the PNGs beside them).

cuda_linear_decode.csv   -> cuda_linear_decode.png: each FP8/FP4 linear at the per-rank decode shapes,
                            fraction of the device-to-device copy bandwidth, per T (graph replays).
cuda_step.csv            -> cuda_step.png: the decode step of one rank's shard (TP8 x PP2 rank 0) as
                            weight bytes / time against the copy bandwidth, per batch.
cuda_step_profile.csv    -> cuda_step_profile.png: where a decode step's (and a prefill's) time goes, per op family
                            (synchronized per-op times) next to the plain step time.
cuda_linear_prefill.csv  -> cuda_linear_prefill.png: each FP8/FP4 linear at prefill token counts
                            (bench_linear_cuda out.csv T,...), TFLOP/s against the cuBLAS bf16 rate
                            of cuda_gemm_ceiling.csv (its best row) and the 40 % prefill target.
cuda_linear_tiles_h100.csv -> cuda_linear_tiles_h100.png: each FP8 linear (and the shared expert's w1 | w3
                            pair call) on every tiling forced (bench_linear_cuda out.csv T,... --tiles):
                            µs a call per T, the data behind CUDA_MMA_AUTO's choice (fp8_tile).
cuda_step_alternated.csv -> cuda_step_alternated.png: two binaries' bench_step runs alternated in one device
                            call (step_alternated.py): decode % of copy bandwidth and prefill tokens/s per rev.
cuda_head_draw.csv       -> cuda_head_draw.png: the last stage's head, greedy draw and log-probabilities
                            (bench_head_draw), ms a step per row count: the head alone (tensor cores /
                            exact kernel), and head + draw or log-probability on the host (logits
                            downloaded) or where the logits are (argmax, row_lse, row_topk ops).
cuda_attn.csv            -> cuda_attn.png: the sparse attention op (bench_attn) next to PyTorch doing the
                            same op (torch_attn_baseline.py rows in the same file), ms a call per row
                            count (graph replays; our two forms forced too) and, at decode rows, %
                            of the copy bandwidth.
cuda_moe.csv             -> cuda_moe.png: the routed experts op (bench_moe) next to PyTorch's loop over the
                            experts (torch_moe_baseline.py rows in the same file), ms a call per token
                            count and % of the copy bandwidth (each side's own weight bytes).
cuda_step_timeline_*.csv -> the same name .png: where a decode step's wall time goes on the device's own
                            clock (tests/gpu/step_timeline.sh's LABEL_summary.csv, copied here with the
                            revision and card in its name): per batch, ms with no kernel running, with
                            one, with two or more, next to bench_step's untraced ms; files whose name
                            holds "_kernels", "_gaps" or "_lanes" are the per-kernel, per-gap and
                            per-lane tables and are not drawn.
Files that are missing are skipped. Usage: plot_results.py RESULTS_DIR [COPY_GBPS]
"""
import csv
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ALT_LAST = 10  # revisions shown in cuda_step_alternated.png


def rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else "results"
    copy_bw = float(sys.argv[2]) if len(sys.argv) > 2 else None
    lin = os.path.join(d, "cuda_linear_decode.csv")
    if os.path.exists(lin):
        r = rows(lin)
        copy_bw = copy_bw or float(r[0]["copy_gb_per_s"])
        ops = []
        for x in r:
            if x["op"] not in ops:
                ops.append(x["op"])
        ts = sorted({int(x["T"]) for x in r})
        paths = []
        for x in r:
            if x.get("path", "exact") not in paths:
                paths.append(x.get("path", "exact"))
        fig, axes = plt.subplots(1, len(paths), figsize=(9 * len(paths), 4), squeeze=False)
        w = 0.8 / len(ts)
        for ax, path in zip(axes[0], paths):
            for i, t in enumerate(ts):
                vals = [next((100 * float(x["graph_fraction_of_copy_bw"]) for x in r
                              if x.get("path", "exact") == path and x["op"] == o and int(x["T"]) == t), 0) for o in ops]
                ax.bar([j + i * w for j in range(len(ops))], vals, w, label="T=%d" % t)
            ax.axhline(70, color="k", ls="--", lw=0.8)
            ax.text(len(ops) - 0.5, 71, "target 70 %", ha="right", fontsize=8)
            ax.set_xticks([j + w * (len(ts) - 1) / 2 for j in range(len(ops))])
            ax.set_xticklabels(ops)
            ax.set_ylim(0, 100)
            ax.set_ylabel("%% of copy bandwidth (%.0f GB/s)" % copy_bw)
            ax.set_title("FP8/FP4 linears, %s path, per-rank V4.1-Flash shapes (%s)" % (path, r[0]["device"]), fontsize=9)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(d, "cuda_linear_decode.png"), dpi=110)
    step = os.path.join(d, "cuda_step.csv")
    if os.path.exists(step) and copy_bw:
        r = [x for x in rows(step) if x["kind"] == "decode"]
        fig, ax = plt.subplots(figsize=(6, 4))
        b = [int(x["batch_or_tokens"]) for x in r]
        frac = [100 * float(x["gbps"]) / copy_bw for x in r]
        ax.plot(b, frac, "o-", label="dsbatch decode step (CUDA graphs)")
        for name, lab in (("cuda_step_eager.csv", "--eager"), ("cuda_step_exact.csv", "--exact-linears")):
            p = os.path.join(d, name)
            if os.path.exists(p):
                e = [x for x in rows(p) if x["kind"] == "decode"]
                ax.plot([int(x["batch_or_tokens"]) for x in e], [100 * float(x["gbps"]) / copy_bw for x in e],
                        "x--", lw=0.8, label=lab)
        ax.axhline(70, color="k", ls="--", lw=0.8, label="target (batch >= 8)")
        ax.axhline(50, color="gray", ls=":", lw=0.8, label="target (batch 1)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch (sequences per step)")
        ax.set_ylabel("weight bytes / step time, % of copy bandwidth")
        ax.set_title("Decode step, TP8xPP2 rank 0 shard (20 layers)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(d, "cuda_step.png"), dpi=110)
    prof = os.path.join(d, "cuda_step_profile.csv")
    if os.path.exists(prof):
        # the *_host runs (host time inside the ops) are another measurement: the json and the
        # README quote them; the plot shows each op's device time (stream marks around it)
        r = [x for x in rows(prof) if not x["run"].endswith("_host")]
        runs = []
        for x in r:
            if x["run"] not in runs:
                runs.append(x["run"])
        ops = sorted({x["op"] for x in r if not x["op"].startswith("_")},
                     key=lambda o: -sum(float(x["ms_per_step"]) for x in r if x["op"] == o))
        # decode steps and prefills differ 100x in time: one panel each
        groups = [[x for x in runs if x.startswith("decode")], [x for x in runs if not x.startswith("decode")]]
        groups = [g for g in groups if g]
        fig, axes = plt.subplots(1, len(groups), figsize=(11, 4.8), squeeze=False)
        for gi, (ax, grp) in enumerate(zip(axes[0], groups)):
            for i, run in enumerate(grp):
                bottom = 0.0
                for j, o in enumerate(ops[:12]):
                    v = sum(float(x["ms_per_step"]) for x in r if x["run"] == run and x["op"] == o)
                    ax.bar(i - 0.2, v, 0.4, bottom=bottom, color=plt.cm.tab20(j),
                           label=o if i == 0 and gi == 0 else None)
                    bottom += v
                rest = sum(float(x["ms_per_step"]) for x in r if x["run"] == run and x["op"] in ops[12:])
                ax.bar(i - 0.2, rest, 0.4, bottom=bottom, color="lightgray",
                       label="other ops" if i == 0 and gi == 0 else None)
                plain = sum(float(x["ms_per_step"]) for x in r if x["run"] == run and x["op"] == "_step_plain")
                ax.bar(i + 0.2, plain, 0.4, color="black", label="plain step" if i == 0 and gi == 0 else None)
            ax.set_xticks(range(len(grp)))
            ax.set_xticklabels(grp)
            ax.set_ylabel("ms per step" if gi == 0 else "ms per prefill")
        fig.suptitle("Device time per op, eager, stream marks around each op (left bars) vs the plain run (right)",
                     fontsize=10)
        fig.legend(*axes[0][0].get_legend_handles_labels(), fontsize=7, ncol=7, loc="lower center")
        fig.tight_layout(rect=(0, 0.1, 1, 0.95))
        fig.savefig(os.path.join(d, "cuda_step_profile.png"), dpi=110)
    pre = os.path.join(d, "cuda_linear_prefill.csv")
    if os.path.exists(pre):
        r = rows(pre)
        ceil = os.path.join(d, "cuda_gemm_ceiling.csv")
        peak = max(float(x["tflops"]) for x in rows(ceil)) if os.path.exists(ceil) else None
        ts = sorted({int(x["T"]) for x in r})
        ops = []
        for x in r:
            if x["op"] not in ops:
                ops.append(x["op"])
        fig, ax = plt.subplots(figsize=(8, 4))
        w = 0.8 / len(ts)
        for i, t in enumerate(ts):
            vals = [next((float(x["tflops"]) for x in r if x["op"] == o and int(x["T"]) == t), 0) for o in ops]
            ax.bar([j + i * w for j in range(len(ops))], vals, w, label="T=%d" % t)
        if peak:
            ax.axhline(peak, color="k", lw=0.8)
            ax.text(len(ops) - 0.5, peak * 0.96, "cuBLAS bf16 %.0f TFLOP/s" % peak, ha="right", va="top", fontsize=8)
            ax.axhline(0.4 * peak, color="k", ls="--", lw=0.8)
            ax.text(len(ops) - 0.5, 0.4 * peak * 1.02, "prefill target 40 %", ha="right", fontsize=8)
        ax.set_xticks([j + w * (len(ts) - 1) / 2 for j in range(len(ops))])
        ax.set_xticklabels(ops)
        ax.set_ylabel("TFLOP/s (2·T·n·k per call, graph replays)")
        ax.set_title("FP8/FP4 tensor-core linears at prefill sizes, per-rank shapes (%s)" % r[0]["device"], fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(d, "cuda_linear_prefill.png"), dpi=110)
    til = os.path.join(d, "cuda_linear_tiles_h100.csv")
    if os.path.exists(til):
        r = [x for x in rows(til) if not x["op"].startswith("exp_")]
        ops, paths = [], []
        for x in r:
            if x["op"] not in ops:
                ops.append(x["op"])
            if x["path"] not in paths:
                paths.append(x["path"])
        cols = 4
        fig, axes = plt.subplots((len(ops) + cols - 1) // cols, cols, figsize=(14, 6.5), squeeze=False)
        for i, o in enumerate(ops):
            ax = axes[i // cols][i % cols]
            for pth in paths:
                pts = sorted((int(x["T"]), float(x["graph_us_per_call"])) for x in r if x["op"] == o and x["path"] == pth)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, lw=1, color="C%d" % paths.index(pth),
                            ls="--" if pth.startswith("tried") else "-", label=pth)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(o, fontsize=9)
            ax.set_xlabel("T (rows)", fontsize=8)
            ax.set_ylabel("µs a call (graph)", fontsize=8)
            ax.tick_params(labelsize=7)
        for j in range(len(ops), axes.shape[0] * cols):
            axes[j // cols][j % cols].axis("off")
        fig.suptitle("FP8 tensor-core linears on each tiling forced (%s)" % r[0]["device"], fontsize=10)
        fig.legend(*axes[0][0].get_legend_handles_labels(), fontsize=7, ncol=len(paths), loc="lower center")
        fig.tight_layout(rect=(0, 0.06, 1, 0.95))
        fig.savefig(os.path.join(d, "cuda_linear_tiles_h100.png"), dpi=110)
    alt = os.path.join(d, "cuda_step_alternated.csv")
    if os.path.exists(alt):
        r = rows(alt)
        # one series per binary and GPU: the device tool lends H200s and H100s, and a rev's numbers
        # compare only with those of the binaries alternated with it on the same card
        for x in r:
            x["series"] = "%s (%s)" % (x["rev"], x["device"].replace("NVIDIA ", "").split()[0])
        revs = []
        for x in r:
            if x["series"] not in revs:
                revs.append(x["series"])
        # the latest revisions only (the CSV keeps every one): beyond ~10 bars a batch size the
        # legend covers them
        revs = revs[-ALT_LAST:]
        r = [x for x in r if x["series"] in revs]
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
        for ax, kind in zip(axes, ("decode", "prefill")):
            ns = sorted({int(x["batch_or_tokens"]) for x in r if x["kind"] == kind})
            # decode bars are % of the copy bandwidth: rows of a call that measured none are left out
            has = lambda x: x["kind"] == kind and (kind != "decode" or x["fraction_of_copy"] != "")
            kr = [s for s in revs if any(x["series"] == s and has(x) for x in r)]
            if not kr:  # e.g. the latest revisions were timed without a prefill
                ax.text(0.5, 0.5, "no %s rows among the latest %d series" % (kind, len(revs)), ha="center",
                        transform=ax.transAxes, fontsize=9)
                ax.axis("off")
                continue
            w = 0.8 / len(kr)
            top = 0.0
            for i, rev in enumerate(kr):
                vals, errs = [], []
                for n in ns:
                    v = [100 * float(x["fraction_of_copy"]) if kind == "decode" else float(x["tokens_per_s"])
                         for x in r if x["series"] == rev and has(x) and int(x["batch_or_tokens"]) == n]
                    vals.append(sum(v) / len(v) if v else 0)
                    errs.append((max(v) - min(v)) / 2 if v else 0)
                top = max([top] + vals)
                ax.bar([j + i * w for j in range(len(ns))], vals, w, yerr=errs, capsize=2, label=rev,
                       color=plt.cm.tab20(revs.index(rev) % 20))
            ax.set_xticks([j + w * (len(kr) - 1) / 2 for j in range(len(ns))])
            ax.set_xticklabels([str(n) for n in ns])
            if kind == "decode":
                ax.axhline(70, color="k", ls="--", lw=0.8, label="target (batch >= 8)")
                ax.axhline(50, color="gray", ls=":", lw=0.8, label="target (batch 1)")
                ax.set_xlabel("batch (sequences per step)")
                ax.set_ylabel("weight bytes / step time, % of copy bandwidth")
            else:
                ax.set_xlabel("prompt tokens")
                ax.set_ylabel("tokens/s")
            ax.set_title("%s, binaries alternated in one run (mean, range)" % kind, fontsize=9)
            # many series: the legend in columns, above the bars (room made over the tallest)
            ax.legend(fontsize=6.5, ncol=3 if kind == "decode" else 2, loc="upper left")
            ax.set_ylim(0, 100 if kind == "decode" else 1.6 * top)
        fig.suptitle("bench_step, TP8xPP2 rank 0 shard (20 layers), the SM80 code JIT-compiled on the card named "
                     "in each label (%% of that card's copy bandwidth); the latest %d revisions, all in the CSV"
                     % ALT_LAST, fontsize=10)
        fig.tight_layout(rect=(0, 0, 1, 0.94))
        fig.savefig(os.path.join(d, "cuda_step_alternated.png"), dpi=110)

    hd = os.path.join(d, "cuda_head_draw.csv")
    if os.path.exists(hd):
        r = rows(hd)
        vs = sorted({int(x["v_local"]) for x in r})
        fig, axes = plt.subplots(1, len(vs), figsize=(6 * len(vs), 5.4), squeeze=False)
        styles = {"head": ("head (tensor cores)", "-", "o"), "head_exact": ("head (exact kernel)", ":", "s"),
                  "host": ("head + download + host draw", "--", "^"), "backend": ("head + argmax op", "-", "v"),
                  "host_lp": ("head + download + host log-probability", "--", "D"),
                  "backend_lp": ("head + row_lse op + merge", "-", "P"),
                  "host_topk": ("head + download + host top-k draw", "--", "x"),
                  "backend_topk": ("head + row_topk op + draw", "-", "*"),
                  "host_tp": ("head + download + host full-row draw (T 0.3, top-p 0.95)", "--", "<"),
                  "backend_tp": ("head + row_topk(1024) + row_lse(T) + draw", "-", ">")}
        for ax, v in zip(axes[0], vs):
            for path, (label, ls, mk) in styles.items():
                pts = sorted((int(x["rows"]), float(x["ms"])) for x in r if int(x["v_local"]) == v and x["path"] == path)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=ls, marker=mk, label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("rows (sequences drawn this step)")
            ax.set_ylabel("ms a step")
            ax.set_title("head [%d, 5120] bf16 (%s)" % (v, r[0]["device"]), fontsize=9)
        handles, labels = axes[0][0].get_legend_handles_labels()  # one legend for the panels, below them
        fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7.5)
        fig.suptitle("bench_head_draw: the last stage's head, its draws and log-probabilities", fontsize=10)
        fig.tight_layout(rect=(0, 0.16, 1, 0.93))
        fig.savefig(os.path.join(d, "cuda_head_draw.png"), dpi=110)

    at = os.path.join(d, "cuda_attn.csv")
    if os.path.exists(at):
        r = rows(at)
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
        styles = {"ours": ("ours (graph)", "-", "o"), "ours_eager": ("ours (eager)", ":", "o"),
                  "two_pass": ("ours, two passes forced (scores, then softmax + P·V)", ":", "x"),
                  "one_pass": ("ours, one pass forced (block by block)", ":", "+"),
                  "torch_eager": ("torch: gather + matmul + softmax with sink (graph)", "--", "s"),
                  "torch_sdpa": ("torch: gather + SDPA, no sink (graph)", "--", "^")}
        for path, (label, ls, mk) in styles.items():
            pts = sorted((int(x["rows"]), float(x["ms_per_call"])) for x in r if x["path"] == path)
            if pts:
                axes[0].plot([p[0] for p in pts], [1e3 * p[1] for p in pts], ls=ls, marker=mk, label=label)
            dec = [(int(x["rows"]), float(x["bytes"]) / (float(x["ms_per_call"]) * 1e-3) / 1e9) for x in r
                   if x["path"] == path and x["pattern"] == "decode"]
            cbw = next((float(x["copy_gb_per_s"]) for x in r if float(x["copy_gb_per_s"]) > 0), None)
            if dec and cbw:
                dec.sort()
                axes[1].plot([p[0] for p in dec], [100 * p[1] / cbw for p in dec], ls=ls, marker=mk, label=label)
        axes[0].set_xscale("log", base=2)
        axes[0].set_yscale("log")
        axes[0].set_xlabel("query rows (decode: one sequence each; 2,048: one prefill chunk)")
        axes[0].set_ylabel("µs a call")
        axes[0].legend(fontsize=7.5)
        axes[1].set_xscale("log", base=2)
        axes[1].set_xlabel("query rows (decode)")
        axes[1].set_ylabel("distinct bytes / time, % of copy bandwidth")
        axes[1].axhline(70, color="k", ls="--", lw=0.8)
        fig.suptitle("sparse attention, 8 heads x 512, 640 entries a row, sink (%s)" % r[0]["device"], fontsize=10)
        fig.tight_layout(rect=(0, 0, 1, 0.94))
        fig.savefig(os.path.join(d, "cuda_attn.png"), dpi=110)

    mo = os.path.join(d, "cuda_moe.csv")
    if os.path.exists(mo):
        r = rows(mo)
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
        styles = {"ours": ("ours: FP4 weights on the tensor cores (graph)", "-", "o"),
                  "ours_eager": ("ours (eager)", ":", "o"),
                  "torch_loop": ("torch: the reference's loop, bf16 weights (graph)", "--", "s"),
                  "torch_loop_nograph": ("torch loop (eager)", ":", "s")}
        cbw = next((float(x["copy_gb_per_s"]) for x in r if float(x["copy_gb_per_s"]) > 0), None)
        for path, (label, ls, mk) in styles.items():
            pts = sorted((int(x["tokens"]), float(x["ms_per_call"]), float(x["bytes"])) for x in r if x["path"] == path)
            if not pts:
                continue
            axes[0].plot([p[0] for p in pts], [1e3 * p[1] for p in pts], ls=ls, marker=mk, label=label)
            if cbw:
                axes[1].plot([p[0] for p in pts], [100 * p[2] / (p[1] * 1e-3) / 1e9 / cbw for p in pts], ls=ls, marker=mk,
                             label=label)
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens a call (top-6 of 384 experts, 48 on this rank)")
        axes[0].set_yscale("log")
        axes[0].set_ylabel("µs a call")
        axes[0].legend(fontsize=7.5)
        axes[1].set_ylabel("weight bytes read / time, % of copy bandwidth")
        axes[1].axhline(70, color="k", ls="--", lw=0.8)
        fig.suptitle("routed experts, w1/w3 [2304, 5120], w2 [5120, 2304] (%s)" % r[0]["device"], fontsize=10)
        fig.tight_layout(rect=(0, 0, 1, 0.94))
        fig.savefig(os.path.join(d, "cuda_moe.png"), dpi=110)

    for name in sorted(os.listdir(d)):
        tables = ("_kernels", "_gaps", "_lanes")  # the timelines' per-kernel, per-gap and per-lane rows
        if not (name.startswith("cuda_step_timeline_") and name.endswith(".csv")) or any(t in name for t in tables):
            continue
        r = rows(os.path.join(d, name))
        if not r:
            continue
        fig, ax = plt.subplots(figsize=(7.5, 4.4))
        xs = list(range(len(r)))
        bottom = [0.0] * len(r)
        for col, label, color in (("one_kernel_ms", "one kernel running (the chain waited on)", "tab:red"),
                                  ("overlap_ms", "two or more at once", "tab:green"),
                                  ("idle_ms", "no kernel running", "tab:gray")):
            v = [float(x[col]) for x in r]
            ax.bar(xs, v, bottom=bottom, color=color, label=label)
            bottom = [b0 + v0 for b0, v0 in zip(bottom, v)]
        bench = [(i, float(x["bench_ms"])) for i, x in enumerate(r) if x.get("bench_ms")]
        if bench:
            ax.plot([b[0] for b in bench], [b[1] for b in bench], "k_", ms=28, mew=2, label="bench_step, untraced")
        ax.set_xticks(xs)
        ax.set_xticklabels(["batch %s" % x["batch"] for x in r])
        ax.set_ylabel("ms a decode step")
        ax.legend(fontsize=8)
        ax.set_title("decode step timeline (%s)" % name[len("cuda_step_timeline_"):-4], fontsize=10)
        fig.tight_layout()
        fig.savefig(os.path.join(d, name[:-4] + ".png"), dpi=110)
        plt.close(fig)  # one figure a timeline: pyplot keeps every open one


if __name__ == "__main__":
    main()
