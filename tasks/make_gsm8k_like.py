"""
Tiny JSONL files shaped like GSM8K's (train.jsonl, test.jsonl: {"question", "answer"},
the answer a worked solution with <<calculator>> notes ending "#### N"), for trying
tasks/gsm8k.py and config/gsm8k.py end to end with no download:

    python tasks/make_gsm8k_like.py /tmp/gsm8k_like [--train=400 --test=50]
    GSM8K_DIR=/tmp/gsm8k_like python sft.py config/gsm8k.py --init_from=DIR
"""

import json
import os
import random
import sys

NAMES = ["Ann", "Ben", "Cy", "Dee"]
THINGS = ["apples", "pens", "cards", "stamps"]


def row(rng):
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 40), rng.randint(2, 9)
    if rng.random() < 0.5:
        question = f"{name} has {a} {thing} and gets {b} more. How many {thing} now?"
        answer = f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {thing}.\n#### {a + b}"
    else:
        question = f"{name} buys {b} boxes of {a} {thing}. How many {thing} is that?"
        answer = f"That is {b} * {a} = <<{b}*{a}={a * b}>>{a * b} {thing}.\n#### {a * b}"
    return {"question": question, "answer": answer}


def main(out, n_train=400, n_test=50, seed=0):
    rng = random.Random(seed)
    os.makedirs(out, exist_ok=True)
    for name, n in (("train.jsonl", n_train), ("test.jsonl", n_test)):
        with open(os.path.join(out, name), "w") as f:
            f.writelines(json.dumps(row(rng)) + "\n" for _ in range(n))


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    opts = dict(a.lstrip("-").partition("=")[::2] for a in sys.argv[1:] if a.startswith("-"))
    if len(args) != 1 or set(opts) - {"train", "test"}:
        sys.exit("usage: python tasks/make_gsm8k_like.py OUT_DIR [--train=400 --test=50]")
    main(args[0], int(opts.get("train", 400)), int(opts.get("test", 50)))
