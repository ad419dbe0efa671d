#!/usr/bin/env python3
"""Exit 0 when two generate outputs (JSONL) hold the same requests with the same output tokens in
the same order, and at least one; with --logprobs also the same log-probabilities, bit for bit (as
JSON writes them), which both runs must have. Other fields are not compared (one run may have been
made without --logprobs, or with --save-logits). Usage: same_tokens.py [--logprobs] A.jsonl B.jsonl"""
import json
import sys


def records(path, lp):
    with open(path) as f:
        return [(j["id"], j["output_tokens"], j["logprobs"] if lp else None) for j in map(json.loads, f)]


args = sys.argv[1:]
lp = bool(args) and args[0] == "--logprobs"
if lp:
    args = args[1:]
try:
    a, b = records(args[0], lp), records(args[1], lp)
except (OSError, ValueError, KeyError, IndexError) as e:
    print("same_tokens: %s" % e, file=sys.stderr)
    sys.exit(2)
sys.exit(0 if a and a == b else 1)
