"""
The embedded default's task: mini-countdown, a verifiable synthetic task a tiny model can learn on a laptop CPU.

Given three or four digits (1-9, repeats allowed) and a target in 1..99, write an arithmetic expression that uses
exactly those digits, each once, in any order, with + - * and parentheses, and evaluates to the target.

The model has room to think: it answers with attempts, one per line, each an expression followed by its
evaluation one operation at a time, until an attempt reaches the target. The last attempt is the answer:

    user:      digits 2 4 6 9 target 30
    assistant: 9+4*6-2: 4*6=24 9+24=33 33-2=31
               (4*6-9)*2: 4*6=24 24-9=15 15*2=30

The reward checks the whole completion exactly: every line is an expression over exactly the problem's digits,
written with the evaluation steps the parser makes (arithmetic that does not hold is wrong), and the last one
equals the target; and the completion stopped by itself (evaluate.score). Anything else scores 0.

The problem space is every (digit multiset, reachable target) pair, split by digit multiset into train, val
and test: a multiset and every problem over it belong to one split only, picked by a hash of the multiset (never
by RNG state), so every run, machine and Python version agrees, and no validation or test multiset is ever seen
in training. The pretraining corpus only evaluates expressions over training multisets (and over pairs of
digits, which are never problems), with no target: it contains no validation or test answer. SFT demos cover
a fixed minority of the training problems; the reward is an exact checker, so GRPO can learn on the rest.

Expressions are parsed by a small recursive-descent parser (no eval): single digits, + - *, parentheses.
No unary minus, no multi-digit numbers (that would be concatenating digits).
"""

import functools
import hashlib
import itertools
import random
from dataclasses import dataclass

# -----------------------------------------------------------------------------
# settings (changing any of these changes the problem space or the split: bump them together with the tests)

NUM_DIGITS = (3, 4)  # a problem has this many digits
DIGITS = range(1, 10)
TARGETS = range(1, 100)
OPS = "+-*"
SPLITS = {"val": 0.1, "test": 0.1}  # share of the digit multisets held out for each; the rest is 'train'
SFT_FRACTION = 0.1  # share of the training problems that get a demonstration
MAX_ANSWER_CHARS = 64  # longer expressions are wrong without parsing (bounds the parser's recursion)
MAX_COMPLETION_CHARS = 1024  # longer completions are wrong without parsing
MAX_FAILED = 3  # wrong attempts a demonstration writes at most before the right one
NEAR = 8  # a demonstration's wrong attempts reach one of the NEAR values nearest the target
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


# -----------------------------------------------------------------------------
# expressions: build every one over a set of digits, printed with the fewest parentheses

_PREC = {"+": 1, "-": 1, "*": 2}
_ATOM = 3


def _apply(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _combine(left, op, right):
    # left/right are (text, value, precedence). Parenthesise a side only when dropping the parentheses would
    # change the value: a lower-precedence side, or a +/- right side under '-' (a-(b+c) != a-b+c).
    ls, lv, lp = left
    rs, rv, rp = right
    p = _PREC[op]
    if lp < p:
        ls = f"({ls})"
    if rp < p or (rp == p and op == "-"):
        rs = f"({rs})"
    return (f"{ls}{op}{rs}", _apply(op, lv, rv), p)


@functools.cache
def _expressions(ordered: tuple[int, ...]) -> tuple:
    """Every binary expression tree over the digits in this order, as (text, value, precedence)."""
    if len(ordered) == 1:
        return ((str(ordered[0]), ordered[0], _ATOM),)
    out = []
    for k in range(1, len(ordered)):
        for left in _expressions(ordered[:k]):
            for right in _expressions(ordered[k:]):
                for op in OPS:
                    out.append(_combine(left, op, right))
    return tuple(out)


@functools.cache
def _values(digits: tuple[int, ...]) -> dict:
    """value -> sorted canonical texts, over every order of the digits."""
    by_value = {}
    for ordered in set(itertools.permutations(digits)):
        for text, value, _ in _expressions(ordered):
            by_value.setdefault(value, set()).add(text)
    return {v: sorted(ts, key=_preference) for v, ts in by_value.items()}


def _preference(text: str):
    # the order solutions() lists answers in, and SFT demonstrates the first: fewest parentheses, then plain
    # string order (small digit first, '*' before '+' before '-'). One consistent choice is easier to imitate.
    return (text.count("("), text)


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


def solutions(problem: Problem) -> list[str]:
    """Every valid answer with minimal parentheses, preferred first (empty if the problem is unsolvable)."""
    if not isinstance(problem, Problem):
        raise TypeError(f"expected a Problem, got {problem!r}")
    return list(_values(tuple(sorted(problem.digits))).get(problem.target, ()))


def heuristic_answer(problem: Problem) -> str:
    """The no-learning baseline: combine the two numbers whose result lands closest to the target, repeat until
    one number is left; that expression, as one attempt line, is the answer. Ties go to the first pair and
    operator in order."""
    if not isinstance(problem, Problem):
        raise TypeError(f"expected a Problem, got {problem!r}")
    terms = [(str(d), d, _ATOM) for d in problem.digits]   # (text, value, precedence), as _expressions builds
    while len(terms) > 1:
        i, j, op = min(((i, j, op) for i, j in itertools.permutations(range(len(terms)), 2) for op in OPS),
                       key=lambda c: abs(_apply(c[2], terms[c[0]][1], terms[c[1]][1]) - problem.target))
        combined = _combine(terms[i], op, terms[j])
        terms = [t for k, t in enumerate(terms) if k not in (i, j)] + [combined]
    return attempt(terms[0][0])


# -----------------------------------------------------------------------------
# the reward: a recursive-descent parser over the answer text, no eval
#   expr   := term (('+' | '-') term)*
#   term   := factor ('*' factor)*
#   factor := digit | '(' expr ')'


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.pos = 0
        self.digits = []
        self.steps = []   # "a op b=c" for every operation, in the order the parser evaluates them

    def combine(self, op, a, b):
        c = _apply(op, a, b)
        self.steps.append(f"{a}{op}{b}={c}")
        return c

    def peek(self):
        return self.text[self.pos] if self.pos < len(self.text) else None

    def parse(self):
        value = self.expr()
        return value if self.pos == len(self.text) else None  # trailing text: not an expression

    def expr(self):
        value = self.term()
        while value is not None and self.peek() in ("+", "-"):
            op = self.text[self.pos]
            self.pos += 1
            right = self.term()
            value = None if right is None else self.combine(op, value, right)
        return value

    def term(self):
        value = self.factor()
        while value is not None and self.peek() == "*":
            self.pos += 1
            right = self.factor()
            value = None if right is None else self.combine("*", value, right)
        return value

    def factor(self):
        c = self.peek()
        if c is not None and c in "123456789":
            self.pos += 1
            self.digits.append(int(c))
            return int(c)
        if c == "(":
            self.pos += 1
            value = self.expr()
            if value is None or self.peek() != ")":
                return None
            self.pos += 1
            return value
        return None  # end of text, an operator, '0', a letter...


def parse_answer(text: str) -> tuple[int, list[int], list[str]] | None:
    """(value, digits used, evaluation steps) of an expression, or None if it is not one. Never raises on a str.
    The steps are "a op b=c" in the order the parser evaluates: "9+4*6-2" -> 4*6=24, 9+24=33, 33-2=31."""
    if not isinstance(text, str):
        raise TypeError(f"answer must be a str, got {type(text).__name__}")
    if not text or len(text) > MAX_ANSWER_CHARS:
        return None
    parser = _Parser(text)
    value = parser.parse()
    return None if value is None else (value, parser.digits, parser.steps)


def attempt(expression: str) -> str:
    """The line the model writes for an expression: the expression, then its evaluation steps."""
    parsed = parse_answer(expression)
    assert parsed is not None and parsed[2], f"not an expression of two digits or more: {expression!r}"
    return f"{expression}: {' '.join(parsed[2])}"


def attempt_value(digits: tuple[int, ...], line: str) -> int | None:
    """The value of one attempt line, or None unless it is an expression over exactly these digits followed by
    ': ' and exactly its evaluation steps (so every step's arithmetic holds)."""
    expression, sep, steps = line.partition(": ")
    parsed = parse_answer(expression)
    if not sep or parsed is None or sorted(parsed[1]) != sorted(digits) or steps != " ".join(parsed[2]):
        return None
    return parsed[0]


def reward(problem: Problem, completion_text: str) -> float:
    """1.0 iff every line of the completion is a right attempt over the problem's digits and the last one
    equals the target; 0.0 otherwise. A closing <|im_end|> (decoded with special tokens) is dropped first."""
    if not isinstance(problem, Problem):
        raise TypeError(f"expected a Problem, got {problem!r}")
    if not isinstance(completion_text, str):
        raise TypeError(f"completion must be a str, got {type(completion_text).__name__}")
    text = completion_text.removesuffix(END_OF_TURN)
    if not text or len(text) > MAX_COMPLETION_CHARS:
        return 0.0
    values = [attempt_value(problem.digits, line) for line in text.split("\n")]
    return 1.0 if None not in values and values[-1] == problem.target else 0.0


# -----------------------------------------------------------------------------
# data for the three stages


def prompt_messages(problem: Problem) -> list[dict]:
    """The chat prompt: one short user turn (about 20 tokens with the template)."""
    if not isinstance(problem, Problem):
        raise TypeError(f"expected a Problem, got {problem!r}")
    digits = " ".join(map(str, problem.digits))
    return [{"role": "user", "content": f"digits {digits} target {problem.target}"}]


def demonstration(problem: Problem) -> list[dict]:
    """The conversation SFT learns from, fixed per problem: as many wrong attempts as a fair coin takes to come
    up heads (at most MAX_FAILED), each an expression that reaches one of the NEAR values nearest the target,
    then the preferred solution. The count says nothing about the problem, so the model must learn to stop on
    reaching the target, not after some number of lines."""
    rng = random.Random(_problem_key(problem, "demo"))
    by_value = _values(tuple(sorted(problem.digits)))
    near = sorted((v for v in by_value if v != problem.target), key=lambda v: (abs(v - problem.target), v))[:NEAR]
    n_failed = 0
    while n_failed < MAX_FAILED and rng.random() < 0.5:
        n_failed += 1
    lines = [attempt(by_value[v][0]) for v in rng.sample(near, min(n_failed, len(near)))]
    lines.append(attempt(solutions(problem)[0]))
    return prompt_messages(problem) + [{"role": "assistant", "content": "\n".join(lines)}]


def sft_examples(seed: int, fraction: float = SFT_FRACTION) -> list[list[dict]]:
    """Demonstrations for a fixed subset of the training problems, shuffled by seed.

    The subset is picked by the problem's hash, not by seed: seeds change the order only, and a smaller
    fraction gives a subset of a larger one. The rest of the training problems are GRPO's to learn.
    """
    if not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    chosen = [p for p in make_problems("train") if _unit(_problem_key(p, "sft")) < fraction]
    random.Random(seed).shuffle(chosen)
    return [demonstration(p) for p in chosen]


def _random_expression(rng: random.Random, digits: tuple[int, ...]) -> tuple[str, int]:
    # a uniformly random tree over a random order of the digits (from the cached enumeration)
    ordered = tuple(rng.sample(digits, len(digits)))
    text, value, _ = rng.choice(_expressions(ordered))
    return text, value


@functools.cache
def _training_multisets() -> dict:
    # k -> the digit multisets of k digits the corpus may use: every pair (never a problem), and for problem
    # sizes only the training split's
    return {k: [d for d in itertools.combinations_with_replacement(DIGITS, k) if k not in NUM_DIGITS
                or split_of(d) == "train"] for k in (2, *NUM_DIGITS)}


def pretrain_corpus(n_docs: int, seed: int) -> list[str]:
    """n_docs documents that teach the evaluation of attempts, deterministic by seed.

    A document names a few digits and lists random expressions using exactly those digits, each evaluated
    one operation at a time as an attempt line:

        digits 3 5 7
        3*5+7: 3*5=15 15+7=22
        7-(3+5): 3+5=8 7-8=-1
        ...

    It teaches evaluation and the "use exactly these digits" rule, never the task's inverse direction (which
    expression reaches a given target): that is what SFT demonstrates on a few problems and GRPO learns. Its
    multisets of three or four digits are training ones only, so no line answers a validation or test problem.
    """
    if type(n_docs) is not int or n_docs < 0:
        raise ValueError(f"n_docs must be a non-negative int, got {n_docs!r}")
    rng, multisets = random.Random(seed), _training_multisets()
    docs = []
    for _ in range(n_docs):
        k = rng.choice((2, *NUM_DIGITS))   # pairs too: the sub-steps of every answer
        digits = rng.choice(multisets[k])
        lines = [f"digits {' '.join(map(str, digits))}"]
        for _ in range(rng.randint(4, 8)):
            text, _ = _random_expression(rng, digits)
            lines.append(attempt(text))
        docs.append("\n".join(lines))
    return docs
