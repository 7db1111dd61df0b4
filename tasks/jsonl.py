"""
Your own task over a JSONL file: one row per problem, {"split": "train" | "val" |
"test", "prompt": ..., "answer": ...}, and a scoring function. Copy this file, point
DATA at your rows, change score().

    python tasks/make_arith.py tasks/arith.jsonl         # the example rows: "417-8" -> "417-8=409"
    # from the speedrun's pretrained model (out/qwen_small/pretrain)
    python sft.py config/arith_jsonl.py && python train_grpo.py config/arith_jsonl.py

It implements tasks/environment.py's interface (make_problems, prompt_messages, reward)
and two extras: sft_examples (the answers of some training rows as demonstrations) and
solutions. A bad row is refused when the file is first read, naming the file, the line
and the field.
"""

import functools
import json
import os
import random
from dataclasses import dataclass

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "arith.jsonl")
SPLITS = ("train", "val", "test")
END_OF_TURN = "<|im_end|>"   # may close a reply decoded with its special tokens


@dataclass(frozen=True)
class Row:
    prompt: str
    answer: str


def score(answer: str, reply: str) -> float:
    """1.0 if the reply is the answer (surrounding spaces aside), else 0.0: make
    it your task's."""
    return float(reply.strip() == answer.strip())


def load_rows(path):
    """split -> [Row], in file order; a ValueError names the file, line and field of
    a bad row."""
    rows = {s: [] for s in SPLITS}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {n}: not JSON ({e})") from e
            for field in ("split", "prompt", "answer"):
                if not isinstance(row, dict) or field not in row:
                    raise ValueError(f"{path}, line {n}: missing field {field!r}")
                if not isinstance(row[field], str) or not row[field].strip():
                    raise ValueError(f"{path}, line {n}: field {field!r} must be non-empty text")
            if row["split"] not in SPLITS:
                raise ValueError(f"{path}, line {n}: field 'split' must be one of {SPLITS}")
            rows[row["split"]].append(Row(row["prompt"], row["answer"]))
    return rows


@functools.cache
def _rows():
    return load_rows(DATA)


def make_problems(split, n=None):
    rows = _rows()[split] if split in SPLITS else None
    if rows is None or (n is not None and not (type(n) is int and 0 <= n <= len(rows))):
        raise ValueError(f"make_problems({split!r}, {n!r}): not a split of {SPLITS}, n <= its size")
    return list(rows if n is None else rows[:n])


def prompt_messages(row):
    return [{"role": "user", "content": row.prompt}]


def reward(row, completion_text):
    text = completion_text.removesuffix(END_OF_TURN)
    return score(row.answer, text)


def solutions(row):
    return [row.answer]


def sft_examples(seed, fraction=0.1):
    """Demonstrations (prompt + answer) of the first `fraction` of the training rows,
    shuffled by seed."""
    rows = make_problems("train")[:int(fraction * len(_rows()["train"]))]
    random.Random(seed).shuffle(rows)
    return [prompt_messages(r) + [{"role": "assistant", "content": r.answer}] for r in rows]
