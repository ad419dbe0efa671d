#!/usr/bin/env python3
"""Prompts for the full-row temperature draw tests (test_distributed.sh, test_cuda_engine.sh) on a
model with a vocabulary of 4,096: N prompts of 3..39 random ids, 10 new tokens each, cycling through
T 1.0 + top-p 0.9 (a random model's flat rows: their nucleus lies past the 1,024-entry list, so
those draws take the whole row), T 0.05 and T 0.3 + top-p 0.5 (decided by the list).
Usage: full_row_prompts.py OUT.jsonl N"""
import json
import random
import sys

KINDS = [{"temperature": 1.0, "top_p": 0.9, "seed": 5}, {"temperature": 0.05, "seed": 6},
         {"temperature": 0.3, "top_p": 0.5, "seed": 7}]

r = random.Random(11)
with open(sys.argv[1], "w") as f:
    for i in range(int(sys.argv[2])):
        j = {"id": i, "tokens": [r.randrange(3, 4000) for _ in range(r.randrange(3, 40))], "max_new_tokens": 10}
        j.update(KINDS[i % 3])
        f.write(json.dumps(j) + "\n")
