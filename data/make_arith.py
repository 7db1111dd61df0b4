"""
The example rows of task_jsonl.py: expressions of 2-3 digits and + - *, answered by their value.

    python data/make_arith.py data/arith.jsonl
"""

import hashlib
import json
import random
import sys


def _value(expr):
    """The value of digits joined by + - * (products first): "2+3*4-1" -> 2 + 12 - 1 = 13."""
    total, sign, product = 0, 1, 1
    for i in range(0, len(expr), 2):
        product *= int(expr[i])
        if i + 1 == len(expr) or expr[i + 1] in "+-":
            total, product = total + sign * product, 1
            sign = -1 if i + 1 < len(expr) and expr[i + 1] == "-" else 1
    return total


def make_example(path, n=3000, seed=0):
    """The example rows: expressions of 2-3 digits and + - *, answered by their value; the split is
    fixed by a hash of the prompt."""
    rng, seen = random.Random(seed), set()
    with open(path, "w") as f:
        while len(seen) < n:
            digits = [str(rng.randint(1, 9)) for _ in range(rng.choice((2, 3)))]
            expr = "".join(d + rng.choice("+-*") for d in digits[:-1]) + digits[-1]
            if expr in seen:
                continue
            seen.add(expr)
            u = int(hashlib.blake2b(expr.encode(), digest_size=4).hexdigest(), 16) / 2**32
            split = "val" if u < 0.1 else "test" if u < 0.2 else "train"
            value = _value(expr)
            f.write(json.dumps({"split": split, "prompt": expr + "=", "answer": str(value)}) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python data/make_arith.py OUT.jsonl")
    make_example(sys.argv[1])
