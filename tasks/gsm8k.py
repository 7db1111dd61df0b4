"""
Grade-school math word problems with a numeric answer, over local JSONL files shaped
like GSM8K's own: {"question": ..., "answer": "...worked solution...\\n#### 42"}, one
file per split. Point GSM8K_DIR at a folder with train.jsonl and test.jsonl (GSM8K's
main/ files as they ship; no download here); validation is the last N_VAL rows of
train.jsonl, so it is never trained on.

    GSM8K_DIR=/data/gsm8k python sft.py config/gsm8k.py --init_from=/models/Qwen3-0.6B
    GSM8K_DIR=/data/gsm8k python train_grpo.py config/gsm8k.py
    python tasks/make_gsm8k_like.py /tmp/gsm8k_like     # tiny generated files of the same shape

A reply scores 1 when the number it ends on equals the answer's: its last \\boxed{...},
else what follows its last ####, else its last number; "1,234", "$12" and "12.50" are
numbers. The prompt asks for \\boxed{} as Qwen's math prompts do; demonstrations
(sft_examples) are the rows' own worked solutions, calculator notes <<...>> removed,
ending with "#### N".
"""

import functools
import json
import os
import random
import re
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
N_VAL = 200          # the last rows of train.jsonl, held out for validation
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"


@dataclass(frozen=True)
class Problem:
    question: str
    solution: str      # the worked solution, ending with "#### N"
    answer: float


def data_dir():
    return os.environ.get("GSM8K_DIR",
                          os.path.join(os.path.dirname(HERE), "data", "gsm8k"))


def number(text):
    """The float a number's text means ('1,234' -> 1234.0, '$12' -> 12.0), or None."""
    try:
        return float(text.replace(",", "").replace("$", "").rstrip("."))
    except ValueError:
        return None


def final_number(reply):
    """The number a reply ends on: its last \\boxed{...}, else after its last ####, else
    its last number; None when it names none."""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", reply)
    if boxed:
        found = re.findall(NUMBER, boxed[-1])
    elif "####" in reply:
        found = re.findall(NUMBER, reply.rsplit("####", 1)[1])[:1]
    else:
        found = re.findall(NUMBER, reply)
    return number(found[-1]) if found else None


def read_rows(path):
    """The Problems of one JSONL file; a bad row is refused naming the file, line and
    field."""
    problems = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {n}: not JSON ({e})") from None
            for field in ("question", "answer"):
                if not isinstance(row, dict) or not isinstance(row.get(field), str):
                    raise ValueError(f"{path}, line {n}: field {field!r} must be a string")
            answer = row["answer"]
            if "####" not in answer or final_number(answer) is None:
                raise ValueError(f"{path}, line {n}: answer {answer[-30:]!r} must end in '#### N'")
            solution = re.sub(r"<<[^>]*>>", "", answer).strip()
            problems.append(Problem(row["question"].strip(), solution, final_number(answer)))
    return problems


@functools.cache
def _splits(folder):
    for name in ("train.jsonl", "test.jsonl"):
        if not os.path.isfile(os.path.join(folder, name)):
            raise ValueError(f"GSM8K_DIR={folder!r} has no {name} (it needs train and test.jsonl)")
    train = read_rows(os.path.join(folder, "train.jsonl"))
    if len(train) <= N_VAL:   # the last N_VAL rows are validation
        raise ValueError(f"{folder}/train.jsonl has {len(train)} rows, not more than N_VAL={N_VAL}")
    return {"train": train[:-N_VAL], "val": train[-N_VAL:],
            "test": read_rows(os.path.join(folder, "test.jsonl"))}


def make_problems(split, n=None):
    problems = _splits(data_dir()).get(split)
    if problems is None or (n is not None and not (type(n) is int and 0 <= n <= len(problems))):
        raise ValueError(f"make_problems({split!r}, {n!r}): expected train/val/test, n <= its size")
    return list(problems if n is None else problems[:n])


def prompt_messages(problem):
    return [{"role": "user", "content": f"{problem.question}\n{INSTRUCTION}"}]


def reward(problem, completion_text):
    """1.0 if the reply's final number is the answer (to a millionth), else 0.0."""
    got = final_number(completion_text)
    return float(got is not None and abs(got - problem.answer) <= 1e-6 * max(1.0, abs(got)))


def solutions(problem):
    return [problem.solution]


def sft_examples(seed, fraction=1.0):
    """The worked solutions of a fraction of the training problems, shuffled by seed."""
    problems = make_problems("train")
    rng = random.Random(seed)
    chosen = rng.sample(problems, round(fraction * len(problems)))
    return [prompt_messages(p) + [{"role": "assistant", "content": p.solution}] for p in chosen]


def describe(problem):
    return {"question": problem.question, "answer": problem.answer}
