"""
Higher or lower, a multi-turn environment that needs its turns: the environment holds a
secret number from 1 to n, the model guesses, and the environment says whether the guess
was too high or too low and what range is left, up to max_turns guesses (train_grpo's
setting). The episode scores 1 if a guess is the secret; it ends at the first right one.

    # from the speedrun's pretrained model (out/qwen_small/pretrain)
    python sft.py config/guess.py && python train_grpo.py config/guess.py

    user:      guess 1 to 40
    assistant: 17
    user:      17 is too low: 18 to 40
    assistant: 30
    user:      30 is too high: 18 to 29
    assistant: 23                          (right: the episode ends, reward 1)

The first guess is right one time in n whatever the model does, so everything above that
is the feedback put to use. Halving the range each time finds any secret of 1..63 within
6 guesses; a guess drawn uniformly from the range left finds about 64% of these
problems. The demonstrations (sft.py) are such uniform guesses, so SFT teaches the
format and to stay in the range; what GRPO has to learn is where in the range to guess.

Problems are every (n, secret) pair, n from 10 to 63 (so a larger n has more of them):
400 for validation, 400 for test, the rest for training, split at random once (a fixed
seed). The prompt shows n only, so no split's secrets can be read off a prompt. The
episode's score is its last reply's (tasks/environment.py's default): it ends at the
first right guess.
"""

import random
import re
from dataclasses import dataclass

N_MIN, N_MAX = 10, 63
N_VAL = N_TEST = 400
SPLIT_SEED = 2026
DEMO_PLAYS = 4      # uniform-guess episodes played per training problem for sft_examples
DEMO_TURNS = 8      # guesses at most in one of them (a few go past GRPO's 6: harmless)


@dataclass(frozen=True)
class Problem:
    n: int          # the secret is in 1..n
    secret: int


def make_problems(split, n=None):
    """The problems of 'train', 'val' or 'test', in a fixed order (the first n of them)."""
    if split not in ("train", "val", "test"):
        raise ValueError(f"split must be 'train', 'val' or 'test', got {split!r}")
    pairs = [Problem(m, s) for m in range(N_MIN, N_MAX + 1) for s in range(1, m + 1)]
    random.Random(SPLIT_SEED).shuffle(pairs)
    problems = {"val": pairs[:N_VAL], "test": pairs[N_VAL:N_VAL + N_TEST],
                "train": pairs[N_VAL + N_TEST:]}[split]
    if n is not None and not (type(n) is int and 0 <= n <= len(problems)):
        raise ValueError(f"n must be an int in [0, {len(problems)}] for split {split!r}, got {n!r}")
    return problems if n is None else problems[:n]


def prompt_messages(problem):
    return [{"role": "user", "content": f"guess 1 to {problem.n}"}]


def guess(reply):
    """The number a reply names, or None when it is not a plain number."""
    text = reply.strip()
    return int(text) if re.fullmatch(r"[0-9]+", text) else None


def reward(problem, completion_text):
    """1.0 if the reply names the secret."""
    return float(guess(completion_text) == problem.secret)


def range_left(problem, replies):
    """(lo, hi): where the secret can still be after these replies' feedback."""
    lo, hi = 1, problem.n
    for g in map(guess, replies):
        if g is not None and g < problem.secret:
            lo = max(lo, g + 1)
        elif g is not None and g > problem.secret:
            hi = min(hi, g - 1)
    return lo, hi


def env_response(problem, messages):
    """None after a right guess (the episode is over), else how the last one missed and
    the range left."""
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    g = guess(replies[-1])
    if g == problem.secret:
        return None
    lo, hi = range_left(problem, replies)
    verdict = ("not a number" if g is None else
               f"{g} is too low" if g < problem.secret else f"{g} is too high")
    return [{"role": "user", "content": f"{verdict}: {lo} to {hi}"}]


def sft_examples(seed, fraction=1.0):
    """Episodes of uniform guesses in the range left, on a fraction of the training
    problems: one conversation per guess, ending with it (sft.py learns the last reply
    only)."""
    rng, out = random.Random(seed), []
    problems = make_problems("train")
    for problem in rng.sample(problems, round(fraction * len(problems))):
        for _ in range(DEMO_PLAYS):
            messages = prompt_messages(problem)
            for _ in range(DEMO_TURNS):
                replies = [m["content"] for m in messages if m["role"] == "assistant"]
                lo, hi = range_left(problem, replies)
                messages = messages + [{"role": "assistant", "content": str(rng.randint(lo, hi))}]
                out.append(messages)
                response = env_response(problem, messages)
                if response is None:
                    break
                messages = messages + response
    rng.shuffle(out)
    return out


def describe(problem):
    return {"n": problem.n, "secret": problem.secret}
