"""
The embedded default's task: mini-countdown, a verifiable synthetic task a tiny model can learn on a laptop CPU.

Given three or four digits (1-9, repeats allowed) and a target in 1..99, reach the target by combining the
digits, each used once, with + - * (the problem space: every target an expression over the digits reaches).
The model has room to think: its answer is a trace of attempts, each combining two numbers at a time, one
line per attempt, until an attempt ends at the target:

    user:      digits 2 4 6 9 target 30
    assistant: 9+6=15 15*4=60 60-2=58
               6*4=24 24-9=15 15*2=30

The reward checks the whole trace exactly: every step's arithmetic holds, every attempt uses each number once,
the last attempt ends at the target, and the completion stopped by itself. Anything else scores 0.

The problem space is every (digit multiset, reachable target) pair, split by digit multiset into train, val
and test: a multiset and every problem over it belong to one split only, picked by a hash of the multiset (never
by RNG state), so every run, machine and Python version agrees, and no validation or test multiset is ever seen
in training. The pretraining corpus only writes random attempts over training multisets (and over pairs of
digits, which are never problems), with no target: it contains no validation or test answer. SFT's
demonstrations are the solver's traces for a fixed minority of the training problems; the reward is an exact
checker, so GRPO can learn on the rest without demonstrations.
"""

import functools
import hashlib
import itertools
import random
import re
from dataclasses import dataclass

# -----------------------------------------------------------------------------
# settings (changing any of these changes the problem space or the split: bump them together with the tests)

NUM_DIGITS = (3, 4)  # a problem has this many digits
DIGITS = range(1, 10)
TARGETS = range(1, 100)
OPS = "+-*"
SPLITS = {"val": 0.1, "test": 0.1}  # share of the digit multisets held out for each; the rest is 'train'
SFT_FRACTION = 0.1  # share of the training problems that get a demonstration (sft_examples' default)
SMALL = 99  # the solver's and the corpus's steps keep results at most this (unless a target needs more)
MAX_FAILED = 4  # failed attempts a demonstration writes at most before the one that reaches the target
END_OF_TURN = "<|im_end|>"  # may close a completion decoded with special tokens; ignored by the reward


@dataclass(frozen=True)
class Problem:
    digits: tuple[int, ...]  # sorted
    target: int

    def __post_init__(self):
        if not isinstance(self.digits, tuple) or not self.digits:
            raise TypeError(f"Problem.digits must be a non-empty tuple of ints, got {self.digits!r}")
        if any(type(d) is not int or d not in DIGITS for d in self.digits):
            raise ValueError(f"Problem.digits must be ints in 1..9, got {self.digits!r}")
        if type(self.target) is not int:
            raise TypeError(f"Problem.target must be an int, got {self.target!r}")


# the problem space's targets: every value an expression tree over the digits reaches (intermediate values
# may be negative here; the traces below never need one, test_task.py checks every problem has a trace)


def _apply(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


@functools.cache
def _tree_values(ordered: tuple[int, ...]) -> frozenset:
    """Every value of a binary expression tree over the digits in this order."""
    if len(ordered) == 1:
        return frozenset(ordered)
    return frozenset(_apply(op, x, y) for k in range(1, len(ordered)) for x in _tree_values(ordered[:k])
                     for y in _tree_values(ordered[k:]) for op in OPS)


@functools.cache
def _values(digits: tuple[int, ...]) -> frozenset:
    """Every value an expression over these digits (in any order) reaches."""
    return frozenset().union(*(_tree_values(o) for o in set(itertools.permutations(digits))))


# -----------------------------------------------------------------------------
# the problem space and its fixed split


def _unit(key: str) -> float:
    """A uniform number in [0, 1) fixed by a string: stable across runs, machines, Pythons."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") / 2**64


def _problem_key(problem: Problem, salt: str) -> str:
    return f"{salt}:{','.join(map(str, problem.digits))}:{problem.target}"


def split_of(digits: tuple[int, ...]) -> str:
    """'train', 'val' or 'test': the split of every problem over this digit multiset."""
    u = _unit(f"split:{','.join(map(str, sorted(digits)))}")
    for split, share in SPLITS.items():
        if u < share:
            return split
        u -= share
    return "train"


@functools.cache
def _space() -> dict:
    splits = {"train": [], "val": [], "test": []}
    for k in NUM_DIGITS:
        for digits in itertools.combinations_with_replacement(DIGITS, k):
            split = split_of(digits)
            splits[split] += [Problem(digits, t) for t in _values(digits) if t in TARGETS]
    # a fixed pseudo-random order, so make_problems(split, n) is a representative sample, not all the 1 1 1s
    return {s: tuple(sorted(ps, key=lambda p: _unit(_problem_key(p, "order")))) for s, ps in splits.items()}


def make_problems(split: str, n: int | None = None) -> list[Problem]:
    """The first n problems (all if None) of the fixed 'train', 'val' or 'test' split, in a fixed shuffled order."""
    if split not in ("train", "val", "test"):
        raise ValueError(f"split must be 'train', 'val' or 'test', got {split!r}")
    problems = _space()[split]
    if n is not None:
        if type(n) is not int or n < 0 or n > len(problems):
            raise ValueError(f"n must be an int in [0, {len(problems)}] for split {split!r}, got {n!r}")
        problems = problems[:n]
    return list(problems)


# -----------------------------------------------------------------------------
# the answer: a trace of attempts, each combining two numbers at a time until one number is left
#
#     user:      digits 2 4 6 9 target 30
#     assistant: 9+6=15 (2 4 15) 15*4=60 (2 60) 60-2=58      an attempt that ends at 58, not the target
#                6*4=24 (2 9 24) 24-9=15 (2 15) 15*2=30      the last attempt ends at the target: the answer
#
# A step "a op b=c" takes two numbers of the attempt's pool (the problem's digits, then what the steps left),
# puts c back, and c must be a op b exactly; numbers are written without sign, so a - b needs a >= b. Each
# step but the last writes the pool it leaves in parentheses (the numbers not taken, in order, then c), so the
# model reads its state instead of recomputing it. One attempt per line, steps separated by single spaces.

NUMBER = "(?:0|[1-9][0-9]*)"
STEP = re.compile(rf"({NUMBER})([-+*])({NUMBER})=({NUMBER})(?: \(({NUMBER}(?: {NUMBER})+)\))?")
MAX_TRACE_CHARS = 2048  # longer completions are wrong without parsing


@dataclass(frozen=True)
class Step:
    a: int
    op: str
    b: int
    c: int
    left: tuple[int, ...]   # the pool after the step, written unless it is one number (the attempt's end)

    def __str__(self):
        pool = f" ({' '.join(map(str, self.left))})" if len(self.left) > 1 else ""
        return f"{self.a}{self.op}{self.b}={self.c}{pool}"


def _moves(pool: tuple[int, ...], cap: int | None = None) -> list[Step]:
    """Every distinct step on a pool, larger number first, each with the pool it leaves (order kept); with a
    cap, only the steps whose result is at most cap."""
    out = {}
    for i, j in itertools.combinations(range(len(pool)), 2):
        a, b = max(pool[i], pool[j]), min(pool[i], pool[j])
        rest = pool[:i] + pool[i + 1 : j] + pool[j + 1 :]
        for op in OPS:
            c = _apply(op, a, b)
            if cap is None or c <= cap:
                out.setdefault((a, op, b), Step(a, op, b, c, rest + (c,)))
    return list(out.values())


@functools.cache
def _reach_sorted(pool: tuple[int, ...], cap: int | None) -> frozenset:
    if len(pool) == 1:
        return frozenset(pool)
    return frozenset().union(*(_reach(s.left, cap) for s in _moves(pool, cap)))


def _reach(pool: tuple[int, ...], cap: int | None = None) -> frozenset:
    """Every number an attempt can end at from this pool (through results of at most cap)."""
    return _reach_sorted(tuple(sorted(pool)), cap)


def _closest(pool: tuple[int, ...], target: int, cap: int | None) -> int:
    # how near to the target the best way on from this pool ends (0: the target is reachable)
    return min(abs(v - target) for v in _reach(pool, cap))


def parse_trace(text: str) -> list[list[Step]] | None:
    """The attempts of a completion, or None if it is not a trace. Never raises on a str. Only the form is
    checked here: the arithmetic and the pools are attempt_result's."""
    if not isinstance(text, str):
        raise TypeError(f"trace must be a str, got {type(text).__name__}")
    if text.endswith(END_OF_TURN):
        text = text[: -len(END_OF_TURN)]
    if not text or len(text) > MAX_TRACE_CHARS:
        return None
    attempts = []
    for line in text.split("\n"):
        steps, pos = [], 0
        while True:
            m = STEP.match(line, pos)
            if m is None:
                return None
            left = tuple(map(int, m[5].split())) if m[5] else ()
            steps.append(Step(int(m[1]), m[2], int(m[3]), int(m[4]), left))
            pos = m.end()
            if pos == len(line):
                break
            if line[pos] != " ":
                return None
            pos += 1
        attempts.append(steps)
    return attempts


def attempt_result(digits: tuple[int, ...], steps: list[Step]) -> int | None:
    """The number an attempt ends at, or None when a step takes a number the pool lacks, its arithmetic does
    not hold, the pool it writes is not the pool it leaves (as a multiset), or the attempt does not end at
    one number (only the last step leaves one, and writes no pool)."""
    pool = list(digits)
    for i, s in enumerate(steps):
        if s.c != _apply(s.op, s.a, s.b):
            return None
        for n in (s.a, s.b):
            if n not in pool:
                return None
            pool.remove(n)
        pool.append(s.c)
        last = i == len(steps) - 1
        if (len(pool) == 1) != last or (not last and sorted(s.left) != sorted(pool)) or (last and s.left):
            return None
    return pool[0]


def reward(problem: Problem, completion_text: str) -> float:
    """1.0 iff the completion is a trace whose every attempt is whole and right in its arithmetic and pools,
    and whose last attempt ends at the target; 0.0 otherwise (the answer is the last attempt)."""
    if not isinstance(problem, Problem):
        raise TypeError(f"expected a Problem, got {problem!r}")
    attempts = parse_trace(completion_text)
    if attempts is None:
        return 0.0
    results = [attempt_result(problem.digits, steps) for steps in attempts]
    return 1.0 if None not in results and results[-1] == problem.target else 0.0


def format_trace(attempts: list[list[Step]]) -> str:
    return "\n".join(" ".join(map(str, steps)) for steps in attempts)


# -----------------------------------------------------------------------------
# the solver, which writes SFT's demonstrations, and the hand-written heuristic baseline


def _finish(step: Step, target: int, rng: random.Random, cap: int | None) -> list[Step]:
    """An attempt that starts with step: each next step keeps the best reachable end nearest the target (the
    target itself when it can be reached), ties broken at random."""
    steps = [step]
    while len(steps[-1].left) > 1:
        moves = _moves(steps[-1].left, cap)
        best = min(_closest(s.left, target, cap) for s in moves)
        steps.append(rng.choice([s for s in moves if _closest(s.left, target, cap) == best]))
    return steps


def solver_trace(problem: Problem, rng: random.Random) -> str:
    """A trace as a search that guesses the first step writes it: a few first steps that cannot reach the
    target (as many as a fair coin takes to come up heads, at most MAX_FAILED), each finished as near the
    target as it gets, then a first step that can, finished at the target. The count says nothing about the
    problem, so the model must learn to stop on reaching the target, not after a number of lines."""
    # small numbers are easier arithmetic: results stay at most SMALL unless the target needs more
    cap = SMALL if problem.target in _reach(problem.digits, SMALL) else None
    firsts = _moves(problem.digits, cap)
    good = [s for s in firsts if problem.target in _reach(s.left, cap)]
    bad = [s for s in firsts if problem.target not in _reach(s.left, cap)]
    assert good, f"unsolvable problem {problem}"
    n_failed = 0
    while n_failed < min(MAX_FAILED, len(bad)) and rng.random() < 0.5:
        n_failed += 1
    attempts = [_finish(s, problem.target, rng, cap) for s in rng.sample(bad, n_failed)]
    return format_trace(attempts + [_finish(rng.choice(good), problem.target, rng, cap)])


def heuristic_trace(problem: Problem) -> str:
    """The no-learning baseline: combine the two numbers whose result lands closest to the target, repeat.
    One attempt (ties go to the first step in _moves' order)."""
    steps = [min(_moves(problem.digits), key=lambda s: abs(s.c - problem.target))]
    while len(steps[-1].left) > 1:
        steps.append(min(_moves(steps[-1].left), key=lambda s: abs(s.c - problem.target)))
    return format_trace([steps])


# -----------------------------------------------------------------------------
# data for the three stages


def prompt_messages(problem: Problem) -> list[dict]:
    """The chat prompt: one short user turn (about 20 tokens with the template)."""
    if not isinstance(problem, Problem):
        raise TypeError(f"expected a Problem, got {problem!r}")
    digits = " ".join(map(str, problem.digits))
    return [{"role": "user", "content": f"digits {digits} target {problem.target}"}]


def _train_subset(fraction: float, salt: str) -> list[Problem]:
    # a fixed subset of the training problems picked by hash: a smaller fraction gives a subset of a larger one
    if not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    return [p for p in make_problems("train") if _unit(_problem_key(p, salt)) < fraction]


def demonstration(problem: Problem) -> list[dict]:
    """The conversation SFT learns from: the prompt and the solver's trace, fixed per problem."""
    rng = random.Random(_problem_key(problem, "trace"))
    return prompt_messages(problem) + [{"role": "assistant", "content": solver_trace(problem, rng)}]


def sft_examples(seed: int, fraction: float = SFT_FRACTION) -> list[list[dict]]:
    """Demonstrations for a fixed subset of the training problems, shuffled by seed.

    The subset is picked by the problem's hash, not by seed: seeds change the order only, and a smaller
    fraction gives a subset of a larger one. The rest of the training problems are GRPO's to learn.
    """
    chosen = _train_subset(fraction, "sft")
    random.Random(seed).shuffle(chosen)
    return [demonstration(p) for p in chosen]


def _random_attempt(rng: random.Random, digits: tuple[int, ...]) -> list[Step]:
    # the steps the solver's traces take: results of at most SMALL (a - b always is one)
    steps = [rng.choice(_moves(digits, SMALL))]
    while len(steps[-1].left) > 1:
        steps.append(rng.choice(_moves(steps[-1].left, SMALL)))
    return steps


@functools.cache
def _training_multisets() -> dict:
    # k -> the digit multisets of k digits the corpus may use: every pair (never a problem), and for problem
    # sizes only the training split's
    return {k: [d for d in itertools.combinations_with_replacement(DIGITS, k) if k not in NUM_DIGITS
                or split_of(d) == "train"] for k in (2, *NUM_DIGITS)}


def pretrain_corpus(n_docs: int, seed: int) -> list[str]:
    """n_docs documents that teach the arithmetic of traces, deterministic by seed.

    A document names a few digits and lists random attempts over exactly those digits, one per line:

        digits 2 4 6 9
        9+6=15 15*4=60 60-2=58
        9-2=7 6*4=24 24+7=31
        ...

    It teaches the steps and the "use every number once" rule, never the task's direction (which attempt
    reaches a given target: there is no target): that is what SFT demonstrates on a few problems and GRPO
    learns. Its multisets of three or four digits are training ones only, so no line answers a validation or
    test problem.
    """
    if type(n_docs) is not int or n_docs < 0:
        raise ValueError(f"n_docs must be a non-negative int, got {n_docs!r}")
    rng, multisets = random.Random(seed), _training_multisets()
    docs = []
    for _ in range(n_docs):
        k = rng.choice((2, *NUM_DIGITS))   # pairs too: the last step of every attempt
        digits = rng.choice(multisets[k])
        attempts = [_random_attempt(rng, digits) for _ in range(rng.randint(4, 8))]
        docs.append(f"digits {' '.join(map(str, digits))}\n" + format_trace(attempts))
    return docs
