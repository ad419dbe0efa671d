#!/usr/bin/env python3
"""Where a decode step's wall time goes, from a kernel timeline (tests/gpu/cupti_trace.c's
kernel_trace.csv, as tests/gpu/step_timeline.sh makes it on the GPU machine).

Nsight Compute's per-kernel durations (kernel_times.sh) add up the kernels run one at a time; a
step runs them on two streams at once, with gaps between dependent ones. Here, per timed window
(bench_step --profiler-range: one window per batch size, in the order of --batch), each step is cut
at its first kernel (the embedding, FIRST) and its time split into
  - idle: no kernel running (launch latency between dependent kernels, host work in front of them),
  - one: exactly one kernel running (the chain the step waits on, exposed),
  - overlap: two or more at once;
and each kernel name is charged its exposed time (running alone; a kernel on the step's critical
chain that nothing overlaps is all exposed) and the idle gap in front of it (the wait before it
started with the GPU empty). Writes SUMMARY (a row per batch size) and KERNELS (a row per batch and
kernel name), and with --gaps GAPS a row per batch and pair (kernel, the kernel whose end left the
GPU empty before it): where the step waits on the host; prints them. With --lanes LANES, the
lanes of a graph segment's branches: every span from a kernel named --lane-from to the next one
named --lane-to (the last such start before each end; default: the attention input, from the
collapse + norm to the attention's index lists), its kernels grouped by stream (lane 0 the stream
of the span's first kernel, and so on), a row per batch, lane and position in the lane with the
kernel's medians over the spans: the wait before it (after the lane's kernel before it, or the
span's start), its duration (and its least and greatest: a kernel held by another lane's shows
two modes), its end after the span's start, and the other lanes' kernel that most often ended
last before it ended, with the median time between the two ends: which lane the segment waits
for, and what slows it.

  step_timeline.py --trace kernel_trace.csv --batches 1,64 --steps 5 --summary s.csv --kernels k.csv
"""
import argparse
import csv
import re
import subprocess
import statistics
import sys
from collections import Counter

FIRST = "embed_kernel"


def short(name):
    """the kernel's name without its argument list, return type and "(anonymous namespace)::"
    (templates kept; a template argument may itself hold parentheses, "(kfmt)0")"""
    n = name.replace("(anonymous namespace)::", "").strip()
    if n.endswith(")"):
        depth = 0
        for i in range(len(n) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(n[i], 0)
            if depth == 0:
                n = n[:i].strip()
                break
    return re.sub(r"^(void|auto)\s+", "", n)


def demangle(names):
    """CUPTI names kernels as the linker does (_Z12embed_kernelILi8EEv...): c++filt reads them back
    (one process for all); without it, a mangled name keeps only its first identifier"""
    names = sorted(set(names))
    mangled = [n for n in names if n.startswith("_Z")]
    out = {n: n for n in names}
    if not mangled:
        return out
    try:
        r = subprocess.run(["c++filt"], input="\n".join(mangled) + "\n", capture_output=True, text=True, check=True)
        lines = r.stdout.splitlines()
        if len(lines) == len(mangled):
            out.update(zip(mangled, lines))
            return out
    except (OSError, subprocess.CalledProcessError):
        pass
    for n in mangled:
        i = 3 if n.startswith("_ZN") else 2
        while (m := re.match(r"\d+", n[i:])):
            ident = n[i + m.end():i + m.end() + int(m.group())]
            i += m.end() + len(ident)
            if ident != "_GLOBAL__N_1":
                out[n] = ident
                break
    return out


def load(path):
    marks, raw = [], []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            s, e = int(r["start_ns"]), int(r["end_ns"])
            if r["kind"] == "kernel":
                raw.append((s, e, int(r["stream"]), r["name"]))
            else:
                marks.append((s, r["kind"] == "range_on"))
    names = demangle(k[3] for k in raw)
    kernels = sorted((s, e, st, short(names[n])) for s, e, st, n in raw)
    return marks, kernels


def windows(marks):
    out, on = [], None
    for t, is_on in sorted(marks):
        if is_on:
            on = t
        elif on is not None:
            out.append((on, t))
            on = None
    return out


def split_steps(ks, steps):
    """the window's kernels cut into steps at each FIRST kernel; the last step ends at the last kernel's end"""
    starts = [i for i, k in enumerate(ks) if k[3].startswith(FIRST)]
    if len(starts) != steps:
        raise SystemExit(f"step_timeline.py: {len(starts)} {FIRST} launches in a window, expected {steps} steps")
    out = []
    for j, i0 in enumerate(starts):
        i1 = starts[j + 1] if j + 1 < len(starts) else len(ks)
        t_end = ks[i1][0] if i1 < len(ks) else max(k[1] for k in ks[i0:])
        out.append((ks[i0][0], t_end, ks[i0:i1]))
    return out


def sweep(t0, t1, ks):
    """idle / one / overlap ns over [t0, t1); Counters by name: exposed ns, idle ns in front, launches, summed ns;
    and by (name, the kernel whose end left the GPU empty before it): idle ns and gaps"""
    ev = []
    for idx, (s, e, _, _) in enumerate(ks):
        ev.append((max(s, t0), 1, idx))
        ev.append((min(e, t1), -1, idx))
    ev.sort(key=lambda x: (x[0], x[1]))
    running, t_prev, last = set(), t0, None
    idle = one = over = 0
    exposed, before, pair_ns, pair_n = Counter(), Counter(), Counter(), Counter()
    for t, kind, idx in ev:
        dt = t - t_prev
        if dt > 0:
            if not running:
                idle += dt
                if kind == 1:
                    before[ks[idx][3]] += dt
                    if last is not None:
                        pair_ns[(ks[idx][3], last)] += dt
                        pair_n[(ks[idx][3], last)] += 1
            elif len(running) == 1:
                one += dt
                exposed[ks[next(iter(running))][3]] += dt
            else:
                over += dt
        if kind == 1:
            running.add(idx)
        else:
            running.discard(idx)
            if not running:
                last = ks[idx][3]
        t_prev = max(t_prev, t)
    tail = t1 - t_prev if t1 > t_prev else 0  # after the step's last kernel: the host's sync and next launch
    idle += tail
    launches, summed = Counter(), Counter()
    for s, e, _, n in ks:
        launches[n] += 1
        summed[n] += e - s
    return idle, tail, one, over, exposed, before, launches, summed, pair_ns, pair_n


def lane_spans(ks, first, last):
    """per span (the last kernel matching first before one matching last, both excluded): {(lane, pos):
    (name, wait ns, duration ns, end ns after the span's start, the other lanes' kernel that ended
    last before it ended, ns between the two ends (None: none did))}, lanes numbered by their first
    kernel"""
    out, i = [], 0
    while i < len(ks):
        if not re.search(first, ks[i][3]):
            i += 1
            continue
        j = next((j for j in range(i + 1, len(ks)) if re.search(last, ks[j][3])), None)
        if j is None:
            break
        i = max(x for x in range(i, j) if re.search(first, ks[x][3]))  # the last one before it
        t0, lanes, prev, count, span = ks[i][1], {}, {}, Counter(), {}
        inner = ks[i + 1:j]
        for s, e, st, n in inner:
            lane = lanes.setdefault(st, len(lanes))
            # the other lanes' kernel that ended last before this one ended (what it may have waited on)
            ends = [(e2, n2) for _, e2, st2, n2 in inner if st2 != st and e2 <= e]
            after = max(ends) if ends else (None, "")
            span[(lane, count[lane])] = (n, s - prev.get(lane, t0), e - s, e - t0, after[1],
                                         e - after[0] if after[0] is not None else None)
            count[lane] += 1
            prev[lane] = e
        out.append(span)
        i = j
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--batches", required=True, help="the batch sizes of bench_step's --batch, in order")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--bench-csv", help="bench_step's --csv of a plain run of the same binary: its untraced ms per "
                    "step, beside the traced one (the tracing's own cost)")
    ap.add_argument("--summary", required=True)
    ap.add_argument("--kernels", required=True)
    ap.add_argument("--gaps", help="also a row per batch and (kernel, the kernel whose end left the GPU empty "
                    "before it): the idle time between them, where the step waits on the host (a segment's "
                    "end, an upload, a collective)")
    ap.add_argument("--lanes", help="also a row per batch, lane and position of the spans --lane-from .. --lane-to")
    ap.add_argument("--lane-from", default="hc_collapse_norm_kernel")
    ap.add_argument("--lane-to", default="attn_index_kernel")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",") if b]
    marks, kernels = load(a.trace)
    win = windows(marks)
    if len(win) < len(batches):
        raise SystemExit(f"step_timeline.py: {len(win)} profiler windows in {a.trace}, expected one per batch "
                         f"({len(batches)}): bench_step --profiler-range?")
    bench_ms = {}
    if a.bench_csv:
        with open(a.bench_csv, newline="") as f:
            for r in csv.DictReader(f):
                if r.get("kind") == "decode":
                    bench_ms[int(r["batch_or_tokens"])] = float(r["ms"])
    srows, krows, grows, lrows = [], [], [], []
    for b, (w0, w1) in zip(batches, win):
        ks = [k for k in kernels if w0 <= k[0] < w1]
        steps = split_steps(ks, a.steps)
        # the first step pays the window's start (the host's first launches): the later steps are the steady state
        use = steps[1:] if len(steps) > 1 else steps
        tot = Counter()
        exp_all, bef_all, lau_all, sum_all, streams = Counter(), Counter(), Counter(), Counter(), Counter()
        gap_ns, gap_n = Counter(), Counter()
        for t0, t1, sk in use:
            idle, tail, one, over, exposed, before, launches, summed, pair_ns, pair_n = sweep(t0, t1, sk)
            gap_ns.update(pair_ns)
            gap_n.update(pair_n)
            tot.update(wall=t1 - t0, idle=idle, tail=tail, one=one, over=over, kernels=len(sk))
            exp_all.update(exposed)
            bef_all.update(before)
            lau_all.update(launches)
            sum_all.update(summed)
            for s, e, st, _ in sk:
                streams[st] += e - s
        if a.lanes:
            spans = [sp for _, _, sk in use for sp in lane_spans(sk, a.lane_from, a.lane_to)]
            for key in sorted({key for sp in spans for key in sp}):
                v = [sp[key] for sp in spans if key in sp]
                med = lambda i: round(statistics.median(x[i] for x in v) / 1e3, 2)
                name = Counter(x[0] for x in v).most_common(1)[0][0]
                after = Counter(x[4] for x in v).most_common(1)[0][0]
                gaps = [x[5] for x in v if x[4] == after and x[5] is not None]
                lrows.append({"batch": b, "lane": key[0], "pos": key[1], "kernel": name, "spans": len(v),
                              "wait_us": med(1), "dur_us": med(2), "end_us": med(3),
                              "dur_min_us": round(min(x[2] for x in v) / 1e3, 2),
                              "dur_max_us": round(max(x[2] for x in v) / 1e3, 2),
                              "ends_after": after,
                              "ends_after_us": round(statistics.median(gaps) / 1e3, 2) if gaps else ""})
        ns = len(use)
        ms = lambda v: v / ns / 1e6
        top_streams = sorted(streams.values(), reverse=True)
        srows.append({
            "batch": b, "steps_used": ns, "traced_ms": round(ms(tot["wall"]), 4),
            "bench_ms": bench_ms.get(b, ""), "kernels_per_step": round(tot["kernels"] / ns, 1),
            "kernel_sum_ms": round(ms(sum(sum_all.values())), 4), "idle_ms": round(ms(tot["idle"]), 4), "of_which_after_last_ms": round(ms(tot["tail"]), 4),
            "one_kernel_ms": round(ms(tot["one"]), 4), "overlap_ms": round(ms(tot["over"]), 4),
            "idle_pct": round(100 * tot["idle"] / tot["wall"], 1),
            "one_kernel_pct": round(100 * tot["one"] / tot["wall"], 1),
            "overlap_pct": round(100 * tot["over"] / tot["wall"], 1),
            "streams": len(streams), "busiest_stream_ms": round(ms(top_streams[0]), 4) if top_streams else 0,
            "second_stream_ms": round(ms(top_streams[1]), 4) if len(top_streams) > 1 else 0,
        })
        names = sorted(sum_all, key=lambda n: -(exp_all[n] + bef_all[n]))
        for n in names:
            krows.append({
                "batch": b, "kernel": n, "launches_per_step": round(lau_all[n] / ns, 1),
                "sum_us": round(sum_all[n] / ns / 1e3, 1), "exposed_us": round(exp_all[n] / ns / 1e3, 1),
                "idle_before_us": round(bef_all[n] / ns / 1e3, 1),
                "exposed_plus_idle_pct": round(100 * (exp_all[n] + bef_all[n]) / tot["wall"], 1),
            })
        for (n, after) in sorted(gap_ns, key=lambda p: -gap_ns[p]):
            grows.append({"batch": b, "kernel": n, "after": after,
                          "idle_us": round(gap_ns[(n, after)] / ns / 1e3, 1),
                          "gaps_per_step": round(gap_n[(n, after)] / ns, 1)})
    outs = [(a.summary, srows), (a.kernels, krows)] + ([(a.gaps, grows)] if a.gaps else [])
    if a.lanes and lrows:
        outs.append((a.lanes, lrows))
    for path, rows in outs:
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
    if a.lanes and not lrows:  # the other files are written: a revision without those kernels keeps its timeline
        raise SystemExit(f"step_timeline.py: no span from {a.lane_from} to {a.lane_to} in the steps")
    for r in srows:
        print(", ".join(f"{k} {v}" for k, v in r.items()))
    for b in batches:
        print(f"\nbatch {b}: kernel, launches/step, summed µs, exposed µs, idle in front µs, share of the step")
        for r in [r for r in krows if r["batch"] == b][: a.top]:
            print(f"  {r['kernel'][:60]:60s} {r['launches_per_step']:7} {r['sum_us']:9} {r['exposed_us']:9} "
                  f"{r['idle_before_us']:9} {r['exposed_plus_idle_pct']:6}%")
        if a.gaps:
            print(f"batch {b}: idle µs a step between a kernel and the one whose end left the GPU empty, gaps a step")
            for r in [r for r in grows if r["batch"] == b][:8]:
                print(f"  {r['idle_us']:9} {r['gaps_per_step']:6}  {r['kernel'][:45]:45s} after {r['after'][:45]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
