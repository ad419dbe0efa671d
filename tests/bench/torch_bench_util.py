"""What the PyTorch baselines (torch_attn_baseline.py, torch_moe_baseline.py) share: the CSV they
append to the benchmark's own, the timing of a pass of calls (a CUDA graph replayed, and eagerly),
and the bf16 files of the dumps their --check reads (numpy only)."""


def open_csv(path, header):
    """path opened for the rows: appended when it is the benchmark's CSV (same header), else new."""
    try:
        with open(path) as f:
            append = f.readline() == header
    except OSError:
        append = False
    out = open(path, "a" if append else "w")
    if not append:
        out.write(header)
    return out


def time_pass(torch, run, calls, iters):
    """ms per call of run() (one pass of `calls` calls): (replayed from a CUDA graph, eager), each
    after a warm pass, timed by CUDA events over iters passes."""
    run()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(iters):
        run()
    e1.record()
    torch.cuda.synchronize()
    ms_eager = e0.elapsed_time(e1) / (iters * calls)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    g.replay()
    torch.cuda.synchronize()
    e0.record()
    for _ in range(iters):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    ms_graph = e0.elapsed_time(e1) / (iters * calls)
    del g
    return ms_graph, ms_eager


def bf16_load(np, path, shape):
    """a file of bf16 values -> float64 array of the shape"""
    return (np.fromfile(path, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64).reshape(shape)
