"""
The embedded default's task: mini-countdown, a verifiable synthetic task a tiny model
can learn on a laptop CPU.

Given three or four digits (1-9, repeats allowed) and a target in 1..99, reach the
target using each digit once with + - *. The model answers with a chain of steps back
from the target (below, "answers with room to think"), checked exactly; a one-line
expression is accepted too:

    user:      digits 3 5 7 target 22
    assistant: 22-7=15[35] 15=3*5           (22 is 15+7, 15 is 3*5; "3*5+7" is right too)
    user:      digits 1 4 7 8 target 83
    assistant: 83+1=84[478] 84/7=12[48] 12=4+8

The full problem space is every (digit multiset, reachable target) pair, split by digit
multiset into train, val and test: a multiset and every problem over it belong to one
split only, picked by a hash of the multiset (never by RNG state), so every run, machine
and Python version agrees, and no validation or test multiset is ever seen in training.
The pretraining corpus writes blind attempts over training multisets only: it contains
no validation or test answer. SFT demos cover a fixed minority of the training problems;
the reward is an exact checker, so GRPO can learn on the rest without demonstrations.

The main job's problems are the ones at the edge of a small model's competence: four
digits, and a reach (the exact chance that one blind attempt of the corpus's search
solves the problem, reach() below) of at least 1 in 20. Most of the full space lies
beyond that: on more than half of it a blind attempt succeeds less than 1 time in 20,
and there RL has nothing to sharpen. make_problems returns the edge;
tasks/countdown_full.py is the whole space (make_problems(split, full=True)). The edge's
splits are the full space's, filtered, and both tasks share one corpus and one set of
demonstrations (over the full space's training split): the edge opens no new leak.

The confirmatory split ('confirm') is five-digit problems in the edge's band: multisets
of a size no split holds, which no run has trained on, tuned on or been tested on. A
five-digit chain is a first step, then a four-digit chain; the model has seen none.

Expressions are parsed by a small recursive-descent parser (no eval): single
digits, + - *, parentheses, spaces. No unary minus, no multi-digit numbers (that
would be concatenating digits).
"""

import functools
import hashlib
import itertools
import math
import random
import re
from dataclasses import dataclass
from fractions import Fraction

# -----------------------------------------------------------------------------
# settings (changing any of these changes the problem space or the split: bump them
# together with the tests)

NUM_DIGITS = (3, 4)  # a problem has this many digits
DIGITS = range(1, 10)
TARGETS = range(1, 100)
OPS = "+-*"
# share of the digit multisets held out for each; the rest is 'train'
SPLITS = {"val": 0.1, "test": 0.1}
# the main job's problems (make_problems): four digits that one blind attempt solves at
# least 1 time in 20 (chosen on validation: docs/results.md)
EDGE_NUM_DIGITS = (4,)
MIN_REACH = Fraction(1, 20)
# the confirmatory split ('confirm'): five digits, a size no other split holds, so no run
# trained, tuned or was tested on one of its multisets; the edge's targets and reach band;
# the first CONFIRM_SIZE in a fixed hashed order. Fixed before any model scored it (chosen
# on the task's logic alone, docs/results.md): changing it voids the confirmation.
CONFIRM_NUM_DIGITS = 5
CONFIRM_SIZE = 640
SFT_FRACTION = 0.1  # share of the training problems that get a demonstration
MAX_ANSWER_CHARS = 64  # a longer answer line is wrong unparsed (bounds the parser's recursion)
# may close a completion decoded with special tokens; ignored by the reward
END_OF_TURN = "<|im_end|>"


@dataclass(frozen=True)
class Problem:
    digits: tuple[int, ...]  # sorted
    target: int

    def __post_init__(self):
        if not isinstance(self.digits, tuple) or not self.digits:
            raise TypeError(f"Problem.digits must be a non-empty tuple of ints: {self.digits!r}")
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
    # left/right are (text, value, precedence). Parenthesise a side only when dropping the
    # parentheses would change the value: a lower-precedence side, or a +/- right side
    # under '-' (a-(b+c) != a-b+c).
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
    """Every binary expression tree over the digits in this order, as (text, value,
    precedence)."""
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
def _reachable(digits: tuple[int, ...]) -> frozenset:
    """The values of _values(digits) without writing an expression (the split's fast path):
    an expression over a multiset is an operator over two expressions that split it,
    so the values are every a op b, a over one part and b over the rest."""
    if len(digits) == 1:
        return frozenset(digits)
    out = set()
    for k in range(1, len(digits)):
        for left in set(itertools.combinations(digits, k)):
            right = _without(digits, *left)
            out.update(f(a, b) for a in _reachable(left) for b in _reachable(right)
                       for f in (int.__add__, int.__sub__, int.__mul__))
    return frozenset(out)


def _without(digits: tuple[int, ...], *taken: int) -> tuple[int, ...]:
    """A sorted tuple with one of each taken digit removed."""
    rest = list(digits)
    for d in taken:
        rest.remove(d)
    return tuple(rest)


@functools.cache
def _values(digits: tuple[int, ...]) -> dict:
    """value -> sorted canonical texts, over every order of the digits."""
    by_value = {}
    for ordered in set(itertools.permutations(digits)):
        for text, value, _ in _expressions(ordered):
            by_value.setdefault(value, set()).add(text)
    return {v: sorted(ts, key=_preference) for v, ts in by_value.items()}


def _preference(text: str):
    # the order expression_answers() lists answers in: fewest parentheses, then plain
    # string order (small digit first, '*' before '+' before '-'). One consistent choice
    # is easier to imitate.
    return (text.count("("), text)


# -----------------------------------------------------------------------------
# the problem space and its fixed split


def _unit(key: str) -> float:
    """A uniform number in [0, 1) fixed by a string: stable across runs, machines,
    Pythons."""
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
            splits[split] += [Problem(digits, t) for t in _reachable(digits) if t in TARGETS]
    # a fixed pseudo-random order, so make_problems(split, n) is a representative sample,
    # not all the 1 1 1s
    return {s: tuple(sorted(ps, key=lambda p: _unit(_problem_key(p, "order"))))
            for s, ps in splits.items()}


@functools.cache
def _edge() -> dict:
    # the main job's problems: the full space's, in its order, filtered by size and reach
    def kept(p):
        return len(p.digits) in EDGE_NUM_DIGITS and reach(p) >= MIN_REACH
    return {s: tuple(filter(kept, ps)) for s, ps in _space().items()}


@functools.cache
def _confirm() -> tuple:
    # five-digit multisets are in no split of _space(): every one of them is unseen
    kept = [Problem(digits, t)
            for digits in itertools.combinations_with_replacement(DIGITS, CONFIRM_NUM_DIGITS)
            for t in TARGETS if _reach(t, digits) >= MIN_REACH]
    kept.sort(key=lambda p: _unit(_problem_key(p, "confirm")))
    return tuple(kept[:CONFIRM_SIZE])


def make_problems(split: str, n: int | None = None, full: bool = False) -> list[Problem]:
    """The first n problems (all if None) of the fixed 'train', 'val' or 'test' split,
    in a fixed shuffled order: the edge problems (EDGE_NUM_DIGITS digits, reach >=
    MIN_REACH), or with full=True every problem of the space. 'confirm' is the
    confirmatory split (CONFIRM_NUM_DIGITS digits, reach >= MIN_REACH), the edge's only:
    scored once per arm, after everything else (bench/compare.sh)."""
    if split not in ("train", "val", "test", "confirm"):
        raise ValueError(f"split must be 'train', 'val', 'test' or 'confirm', got {split!r}")
    if split == "confirm" and full:
        raise ValueError("the full space has no 'confirm' split: it is tasks.countdown's")
    problems = _confirm() if split == "confirm" else _space()[split] if full else _edge()[split]
    if n is not None:
        if type(n) is not int or n < 0 or n > len(problems):
            raise ValueError(f"n must be an int in [0, {len(problems)}] for {split!r}, got {n!r}")
        problems = problems[:n]
    return list(problems)


def describe(problem: Problem) -> dict:
    """The problem's fields in outcomes.jsonl (bench/report.py groups them by digit
    multiset and by reach)."""
    return {"digits": list(problem.digits), "target": problem.target,
            "reach": round(float(reach(problem)), 6)}


def kind(problem: Problem) -> str:
    """Accuracy is also reported by problem size: '3digits', '4digits' ('5digits':
    the confirmatory split)."""
    return f"{len(problem.digits)}digits"


def expression_answers(problem: Problem) -> list[str]:
    """Every right one-line expression with minimal parentheses, preferred first (empty if
    the problem is unsolvable)."""
    return list(_values(tuple(sorted(problem.digits))).get(problem.target, ()))


def heuristic_answer(problem: Problem) -> str:
    """The first no-learning baseline (closest pair): combine the two numbers whose result
    lands closest to the target, repeat until one number is left; that expression is the
    answer. Ties go to the first pair and operator in order. chain_rule_answer, below,
    is the second."""
    terms = [(str(d), d, _ATOM) for d in problem.digits]   # (text, value, precedence)

    def miss(choice):   # how far combining terms i and j with op lands from the target
        i, j, op = choice
        return abs(_apply(op, terms[i][1], terms[j][1]) - problem.target)

    while len(terms) > 1:
        pairs = itertools.permutations(range(len(terms)), 2)
        i, j, op = min(((i, j, op) for i, j in pairs for op in OPS), key=miss)
        combined = _combine(terms[i], op, terms[j])
        terms = [t for k, t in enumerate(terms) if k not in (i, j)] + [combined]
    return terms[0][0]


# -----------------------------------------------------------------------------
# the reward: a recursive-descent parser over the answer text, no eval
#   expr   := term (('+' | '-') term)*
#   term   := factor ('*' factor)*
#   factor := digit | '(' expr ')'


class _Parser:
    def __init__(self, text: str):
        self.text = text.replace(" ", "")
        self.pos = 0
        self.digits = []

    def peek(self):
        return self.text[self.pos] if self.pos < len(self.text) else None

    def parse(self):
        value = self.expr()
        # trailing text: not an expression
        return value if self.pos == len(self.text) else None

    def expr(self):
        value = self.term()
        while value is not None and self.peek() in ("+", "-"):
            op = self.text[self.pos]
            self.pos += 1
            right = self.term()
            value = None if right is None else _apply(op, value, right)
        return value

    def term(self):
        value = self.factor()
        while value is not None and self.peek() == "*":
            self.pos += 1
            right = self.factor()
            value = None if right is None else value * right
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


def parse_answer(text: str) -> tuple[int, list[int]] | None:
    """(value, digits used) of an answer expression, or None if it is not one. Never
    raises on a str."""
    if not isinstance(text, str):
        raise TypeError(f"answer must be a str, got {type(text).__name__}")
    text = text.strip()
    if text.endswith(END_OF_TURN):
        text = text[: -len(END_OF_TURN)].strip()
    return _parse_expression(text)


def _parse_expression(text: str) -> tuple[int, list[int]] | None:
    if not text or len(text) > MAX_ANSWER_CHARS:
        return None
    parser = _Parser(text)
    value = parser.parse()
    return None if value is None else (value, parser.digits)


# -----------------------------------------------------------------------------
# answers with room to think: work back from the target, one digit a step
#
#   user:      digits 1 4 7 8 target 83
#   assistant: 83+1=84[478] 84/7=12[48] 12=4+8    right: 83 is 84-1, 84 is 12*7, 12 is 4+8
#              83+8=91[147] 91/7=13[14] 13=?      (a dead end: 1 and 4 do not make 13)
#              83/7=?                             (a dead end: 83 is not a multiple of 7)
#
# A line is one attempt. A step "x+d=y[...]" says: to make x, make y and take d away
# (x-d=y: make y and add d; x/d=y: make y and multiply by d); the brackets hold the digits
# still unspent. So each step spends a digit and leaves a smaller need, and every choice
# is made on numbers in view: the step's operator and digit come before its number, the
# digits left stand right before the next step. With two digits left the line ends:
# "y=a+b" (or a-b, a*b) when they make y, "y=?" when they cannot. The answer is a reply's
# last line (a reply may search over several lines if its token budget allows; the
# demonstrations show one line, and the embedded config's budget fits one). A chain cannot
# write every answer: not a tree like 6*7+8*9, not "d minus the rest" (9-2*4), not a need
# of 0 (3-3=0 then 0=5-5); an expression ("(4+8)*7-1") is an answer too, so the heuristic
# is scored by the same reward.

STEP_OPS = "+-/"   # undo "-d", undo "+d", undo "*d"


def _moves(pool: list[int]) -> list[tuple[str, int]]:
    """The (operator, digit) choices of a step, in the fixed order every search here uses."""
    return [(op, d) for d in sorted(set(pool)) for op in STEP_OPS]


def _undo(op: str, x: int, d: int) -> int | None:
    """y of the step x op d = y, or None when it is not a step (y must be a whole
    number >= 1)."""
    y = x + d if op == "+" else x - d if op == "-" else x // d if x % d == 0 else None
    return y if y is not None and y >= 1 else None


def _step(need: int, op: str, d: int, pool: list[int]) -> tuple[str, int, list[int]]:
    """(text, new need, digits left) of a step: '83+1=84[478]'."""
    y, rest = _undo(op, need, d), list(pool)
    rest.remove(d)
    return f"{need}{op}{d}={y}[{''.join(map(str, rest))}]", y, rest


def _pair_equation(y: int, a: int, b: int) -> str | None:
    """A line's last word when a and b make y ('y=a+b', the larger first for '-'), else
    None."""
    a, b = min(a, b), max(a, b)
    for op, (l, r) in (("+", (a, b)), ("-", (b, a)), ("*", (a, b))):
        if _apply(op, l, r) == y:
            return f"{y}={l}{op}{r}"
    return None


_STEP = re.compile(r"([1-9][0-9]{0,3})([-+/])([1-9])=")   # the head of a step word: "83+1="


def chain_fault(problem: Problem, line: str) -> str | None:
    """None for a right chain: steps from the target, each written exactly as _step writes
    it (so its arithmetic and the digits left are true), then the two digits left
    making the last need ('12=4+8' or '12=8+4'), and nothing after. Else the first
    thing wrong, in words that never echo the line's own (they may hold any token).
    digits 1 4 7 8, target 83:

        '83+1=84[478] 84/8=?'           ->  '84/8 is not a whole number of 1 or more'
        '83+1=84[478] 84/7=12[47]'      ->  'the step from 84 should be 84/7=12[48]'
        '83-1=82[478] 82+4=86[78] 86=?' ->  '7 and 8 make 1, 15, 56, not 86'
    """
    need, pool, words = problem.target, sorted(problem.digits), line.split(" ")
    while len(pool) > 2:   # a step is due
        word = words.pop(0) if words else ""
        head = _STEP.match(word)
        if not head or int(head[1]) != need:
            return f"the next word is a step from {need}; the digits left are {_spaced(pool)}"
        op, d = head[2], int(head[3])
        if d not in pool:
            return f"{d} is not left: the digits left are {_spaced(pool)}"
        if _undo(op, need, d) is None:
            return f"{need}{op}{d} is not a whole number of 1 or more"
        start = need
        text, need, pool = _step(need, op, d, pool)
        if word != text:
            return f"the step from {start} should be {text}"
    a, b = pool
    if not words:
        return f"the line ends before the pair of {a} and {b}"
    if _STEP.match(words[0]):
        return f"with {a} and {b} left, the line ends with their pair"
    if words[0] in {f"{need}={x}{op}{y}" for x, y in ((a, b), (b, a))
                    for op in OPS if _apply(op, x, y) == need}:
        return None if len(words) == 1 else "the line goes on after its pair"
    if _pair_equation(need, a, b):  # the pair makes the need, but the line says otherwise
        return f"{a} and {b} do make {need}, but not as the last word says"
    return f"{a} and {b} make {_spaced(sorted({a + b, abs(a - b), a * b}), ', ')}, not {need}"


def _spaced(numbers, sep=" "):
    return sep.join(map(str, numbers))


def final_line(text: str) -> str:
    """The answer of a completion: its last line, without the closing end-of-turn and
    spaces."""
    text = text.strip()
    if text.endswith(END_OF_TURN):
        text = text[: -len(END_OF_TURN)].strip()
    return text.split("\n")[-1].strip()


def reward(problem: Problem, completion_text: str) -> float:
    """1.0 iff the completion's last line is a right answer: a right chain from the target
    (every step's arithmetic and digits left true) that spends exactly the problem's
    digits, or an expression over exactly those digits that equals the target. Earlier
    lines are the search."""
    if not isinstance(problem, Problem):
        raise TypeError(f"expected a Problem, got {problem!r}")
    if not isinstance(completion_text, str):
        raise TypeError(f"completion_text must be a str, got {type(completion_text).__name__}")
    line = final_line(completion_text)
    if "=" in line:
        return 1.0 if len(line) <= MAX_ANSWER_CHARS and chain_fault(problem, line) is None else 0.0
    parsed = _parse_expression(line)
    right = parsed is not None and parsed[0] == problem.target
    return 1.0 if right and sorted(parsed[1]) == sorted(problem.digits) else 0.0


def _attempt(rng: random.Random, target: int, digits: tuple[int, ...]) -> tuple[str, bool]:
    """One attempt of the blind search, (line, solved): a uniformly random operator and
    digit until two digits are left. A step that is not one (83/7 is not whole, 5-8 is
    not positive) ends the line there, 'x/d=?', so the corpus shows which divisions are
    whole as well as their results."""
    need, pool, words = target, sorted(digits), []
    while len(pool) > 2:
        op, d = rng.choice(_moves(pool))
        if _undo(op, need, d) is None:
            return " ".join(words + [f"{need}{op}{d}=?"]), False
        word, need, pool = _step(need, op, d, pool)
        words.append(word)
    last = _pair_equation(need, *pool)
    return " ".join(words + [last or f"{need}=?"]), last is not None


def reach(problem: Problem) -> Fraction:
    """The exact chance that one blind attempt (_attempt) solves the problem: at each step
    every (operator, digit) choice has the same chance, a step that is not one ends the
    line, and two digits left either make the need or not. digits 3 5 7 target 22, nine
    choices at the first step:

        22+3=25[57] 22-3=19[57] 22+5=27[37] 22-5=17[37] 22+7=29[35]   5 and 7, 3 and 7, 3 and 5
                                                                     make none of these
        22/3 22/5 22/7                                               not whole: the line ends
        22-7=15[35]                                                  15=3*5: solved
        reach = 1/9

    A property of the problem, no model involved: tasks/countdown.py's main split keeps
    reach >= MIN_REACH.
    """
    return _reach(problem.target, tuple(sorted(problem.digits)))


def blind_pass_at_k(problem: Problem, k: int) -> float:
    """The exact pass@k of the blind search: the chance that at least one of k independent
    blind attempts solves the problem, 1 - (1 - reach)^k. The curve a model's sampled
    pass@k is read against: a policy that only narrowed toward what it already solved
    could fall below it at large k."""
    return float(1 - (1 - reach(problem)) ** k)


def _reach(need: int, pool: tuple[int, ...]) -> Fraction:
    """reach() of (need, pool), counted in whole numbers (exact, and a few times faster
    than summing Fractions): a blind step from n digits draws one of _slots(n) equally
    likely slots, each of its m moves holding _slots(n) / m of them, so every sequence of
    slots is equally likely and reach is the share of them that solve. digits 3 5 7
    target 22: 18 slots, 2 for each of the 9 moves; only 22-7 leads on to a pair that
    makes its need: 2 of 18 sequences, 1/9."""
    sequences = math.prod(_slots(n) for n in range(3, len(pool) + 1))
    return Fraction(_solving_sequences(need, pool), sequences)


def _slots(n: int) -> int:
    """A number every move count from n digits divides: each step offers len(STEP_OPS)
    operators for each distinct digit left (1 to n of them)."""
    return math.lcm(*(len(STEP_OPS) * k for k in range(1, n + 1)))


@functools.cache
def _solving_sequences(need: int, pool: tuple[int, ...]) -> int:
    """How many of the equally likely slot sequences from (need, pool) solve it."""
    if len(pool) <= 2:   # the last pair makes the need or not (fewer digits: no chain)
        return int(len(pool) == 2 and _pair_equation(need, *pool) is not None)
    moves = _moves(pool)
    solved = sum(_solving_sequences(y, _without(pool, d)) for op, d in moves
                 if (y := _undo(op, need, d)) is not None)
    return solved * (_slots(len(pool)) // len(moves))


def chain_rule_answer(problem: Problem) -> str:
    """The second no-learning baseline, a chain written greedily: from the target, take
    the step that leaves the smallest need (ties: the first in _moves' order), until two
    digits are left; then their pair, or 'y=?' when they cannot make y (a claim of no
    answer). A line that ends on a pair is right. digits 1 4 7 8 target 83:
    '83-8=75[147] 75-7=68[14] 68=?' (of the needs 83+d, 83-d and 83/1 the least is 75;
    then 75-7 leaves 68, which 1 and 4 do not make)."""
    need, pool, words = problem.target, sorted(problem.digits), []
    while len(pool) > 2:   # a step is always possible: '+d' is one
        steps = [(_undo(op, need, d), op, d) for op, d in _moves(pool)]
        steps = [s for s in steps if s[0] is not None]
        _, op, d = min(steps, key=lambda s: s[0])   # min keeps the first of equal needs
        word, need, pool = _step(need, op, d, pool)
        words.append(word)
    last = _pair_equation(need, *pool) if len(pool) == 2 else None
    return " ".join(words + [last or f"{need}=?"])


@functools.cache
def _held_out() -> frozenset:
    return frozenset((p.digits, p.target) for s in ("val", "test")
                     for p in make_problems(s, full=True))


def _answers_held_out(line: str) -> bool:
    """Whether a right line holds the answer to a validation or test problem in its tail:
    after the first step of a four-digit chain the rest is, word for word, a chain over
    the three digits left, and those may be a held-out multiset ('30/2=15[469]
    15+9=24[46] 24=4*6' answers 4 6 9 -> 15)."""
    first, *rest = line.split(" ")
    if len(rest) < 2:   # a three-digit chain's tail is a pair, never a problem
        return False
    need, left = first.split("=")[1].rstrip("]").split("[")
    return (tuple(sorted(map(int, left))), int(need)) in _held_out()


@functools.cache
def chain_answers(problem: Problem) -> tuple[str, ...]:
    """The problem's right chain lines as _attempt writes them (empty if no chain
    reaches its target); the reward also takes the last pair either way round."""
    def lines(need, pool):
        if len(pool) == 2:
            last = _pair_equation(need, *pool)
            return [last] if last else []
        out = []
        for op, d in _moves(pool):
            if _undo(op, need, d) is not None:
                word, y, rest = _step(need, op, d, pool)
                out += [f"{word} {tail}" for tail in lines(y, rest)]
        return out
    return tuple(lines(problem.target, sorted(problem.digits)))


@functools.cache
def demonstration(problem: Problem) -> str | None:
    """What SFT shows for a problem: the first right chain a blind search (_attempt, again
    and again) lands on, so each right chain is shown about as often as blind search
    finds it. Fixed by the problem, not by a seed. Never a line whose tail answers a
    held-out problem (_answers_held_out); None if no other chain reaches the target."""
    answers = [line for line in chain_answers(problem) if not _answers_held_out(line)]
    if not answers:
        return None
    rng = random.Random(_problem_key(problem, "demo"))
    for _ in range(10_000):   # bounded: a few problems have one right chain in thousands
        line, solved = _attempt(rng, problem.target, problem.digits)
        if solved and not _answers_held_out(line):
            return line
    return rng.choice(answers)


def solutions(problem: Problem) -> list[str]:
    """The right answers, the demonstrated one first: its demonstration, the other chains,
    then the one-line expressions (empty if the problem is unsolvable)."""
    first = demonstration(problem)
    chains = [line for line in chain_answers(problem) if line != first]
    return ([first] if first else []) + chains + expression_answers(problem)


# -----------------------------------------------------------------------------
# data for the three stages


def prompt_messages(problem: Problem) -> list[dict]:
    """The chat prompt: one short user turn (about 20 tokens with the template)."""
    digits = " ".join(map(str, problem.digits))
    return [{"role": "user", "content": f"digits {digits} target {problem.target}"}]


def sft_examples(seed: int, fraction: float = SFT_FRACTION) -> list[list[dict]]:
    """Conversations (prompt + its demonstration) for a fixed subset of the full space's
    training problems that a chain reaches, three and four digits, shuffled by seed.

    The subset is picked by the problem's hash, not by seed: seeds change the order
    only, and a smaller fraction gives a subset of a larger one. SFT learns the format,
    the steps' arithmetic and a first sense of which steps land; GRPO learns the rest
    from the reward, on every training problem of the task (the edge's, or the full
    space's in tasks/countdown_full.py).
    """
    return [prompt_messages(p) + [{"role": "assistant", "content": line}]
            for p, line in demonstrations(seed, fraction)]


def demonstrations(seed: int, fraction: float) -> list[tuple[Problem, str]]:
    """sft_examples' (problem, demonstration) pairs, in its order."""
    if not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    chosen = [(p, demonstration(p)) for p in make_problems("train", full=True)
              if _unit(_problem_key(p, "sft")) < fraction]
    chosen = [(p, line) for p, line in chosen if line is not None]
    random.Random(seed).shuffle(chosen)
    return chosen


@functools.cache
def _training_multisets() -> dict:
    # k -> the digit multisets of k digits the corpus may use: the training split's only
    return {k: [d for d in itertools.combinations_with_replacement(DIGITS, k)
                if split_of(d) == "train"] for k in NUM_DIGITS}


def pretrain_corpus(n_docs: int, seed: int) -> list[str]:
    """n_docs documents that teach the arithmetic of the search, deterministic by seed.

    A document names some digits and lists blind attempts (_attempt) from random
    starting numbers, spending those digits:

        digits 2 7 7 9
        63+9=72[277] 72/2=36[77] 36=?
        62/7=?
        75+7=82[279] 82/9=?

    It teaches the steps' arithmetic, which divisions are whole, which digits are left
    and which pairs make which numbers; never where to look (every choice is a coin
    flip, and no document stops on a hit). Its multisets are training ones only, and a
    line whose tail answers a held-out three-digit problem is drawn again, so no line
    answers a validation or test problem.
    """
    if type(n_docs) is not int or n_docs < 0:
        raise ValueError(f"n_docs must be a non-negative int, got {n_docs!r}")
    rng, multisets = random.Random(seed), _training_multisets()
    docs = []
    for _ in range(n_docs):
        digits = rng.choice(multisets[rng.choice(NUM_DIGITS)])
        lines, n_lines = [f"digits {' '.join(map(str, digits))}"], rng.randint(4, 8)
        while len(lines) <= n_lines:
            line, solved = _attempt(rng, rng.choice(TARGETS), digits)
            if not (solved and _answers_held_out(line)):
                # no held-out answer, even in a tail
                lines.append(line)
        docs.append("\n".join(lines))
    return docs
