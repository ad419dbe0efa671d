#!/usr/bin/env python3
"""Exit 0 when two generate outputs (JSONL) hold the same requests with the same output tokens in
the same order, and at least one; log-probabilities and other fields are not compared (one run may
have been made without --logprobs). Usage: same_tokens.py A.jsonl B.jsonl"""
import json
import sys


def tokens(path):
    with open(path) as f:
        return [(j["id"], j["output_tokens"]) for j in map(json.loads, f)]


try:
    a, b = tokens(sys.argv[1]), tokens(sys.argv[2])
except (OSError, ValueError, KeyError) as e:
    print("same_tokens: %s" % e, file=sys.stderr)
    sys.exit(2)
sys.exit(0 if a and a == b else 1)
