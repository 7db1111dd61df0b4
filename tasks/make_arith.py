"""
The example rows of tasks/jsonl.py: one step of arithmetic, a number and a digit, answered
with the step written out ("417-8" -> "417-8=409"), the way the countdown chains that the
speedrun's model was pretrained on write their steps; a division is always whole.

    python tasks/make_arith.py tasks/arith.jsonl
"""

import hashlib
import json
import random
import sys


def make_example(path, n=4000, seed=0):
    """n distinct rows of x op d (x in 10..999, d in 1..9, op + - /); the split is fixed
    by a hash of the prompt."""
    rng, seen = random.Random(seed), set()
    with open(path, "w") as f:
        while len(seen) < n:
            x, d, op = rng.randint(10, 999), rng.randint(1, 9), rng.choice("+-/")
            prompt = f"{x}{op}{d}"
            if (op == "/" and x % d) or prompt in seen:
                continue
            seen.add(prompt)
            value = x + d if op == "+" else x - d if op == "-" else x // d
            u = int(hashlib.blake2b(prompt.encode(), digest_size=4).hexdigest(), 16) / 2**32
            split = "val" if u < 0.1 else "test" if u < 0.2 else "train"
            f.write(json.dumps({"split": split, "prompt": prompt, "answer": f"{prompt}={value}"})
                    + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):   # -h is not a file to write
        sys.exit("usage: python tasks/make_arith.py OUT.jsonl")
    make_example(sys.argv[1])
