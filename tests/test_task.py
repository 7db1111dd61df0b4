# tests for countdown.py (mini-countdown) and tokenizer.py (the embedded ChatML
# tokenizer). CPU, a few seconds.

import ast
import collections
import functools
import hashlib
import itertools
import json
import operator
import os
import random
import re
import tarfile
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from tasks import evaluate
from tasks import countdown
from tasks import countdown_full
from tasks import guess
from tasks.countdown import (Problem, make_problems, parse_answer, pretrain_corpus,
                             prompt_messages, reward, sft_examples, solutions)
from tokenizer import (ENDOFTEXT, IM_END, IM_START, build_tokenizer, chat_example, chat_prompt_ids,
                       completion_text, load_tokenizer, save_tokenizer)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _trusted_eval(text: str) -> int:
    # reference evaluator for expressions the test itself generated: Python's own parser,
    # + - * on ints only
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}

    def ev(node):
        if isinstance(node, ast.BinOp):
            return ops[type(node.op)](ev(node.left), ev(node.right))
        assert isinstance(node, ast.Constant) and type(node.value) is int
        return node.value

    return ev(ast.parse(text, mode="eval").body)


# -----------------------------------------------------------------------------
# reward


P = Problem((3, 5, 7), 22)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3*5+7", 1.0),
        ("7+5*3", 1.0),
        ("(3*5)+7", 1.0),  # redundant parentheses are fine
        ("((3*5)+(7))", 1.0),
        (" 3 * 5 + 7 \n", 1.0),  # surrounding and inner spaces
        ("3*5+7<|im_end|>", 1.0),  # decoded with special tokens
        ("3*5+7\n<|im_end|>", 1.0),
        ("3*(5+7)", 0.0),  # wrong value (36)
        ("3+5+7", 0.0),  # wrong value (15)
        ("3*5+8", 0.0),  # wrong digit
        ("3*5+7-0", 0.0),  # extra digit (and 0 is not a digit of the task)
        ("5*5-3", 0.0),  # reused digit, missing 7 (value 22!)
        ("3*5", 0.0),  # missing digit
        ("35-13", 0.0),  # multi-digit numbers
        ("-3*5+37", 0.0),
        ("3*5+7=22", 0.0),  # extra text
        ("3*5+7 is the answer", 0.0),
        ("answer: 3*5+7", 0.0),
        ("3*5+7<|im_end|>3", 0.0),  # text after the end of turn
        ("3*5+7<|im_end|><|im_end|>", 0.0),
        ("3**5+7", 0.0),
        ("3*5++7", 0.0),
        ("(3*5+7", 0.0),
        ("3*5+7)", 0.0),
        ("()", 0.0),
        ("", 0.0),
        ("   ", 0.0),
        ("<|im_end|>", 0.0),
        ("3/5+7", 0.0),
        ("3×5+7", 0.0),
        ("(" * 5000 + "3*5+7" + ")" * 5000, 0.0),  # too long: no recursion error
    ],
)
def test_reward_hand_cases(text, expected):
    assert reward(P, text) == expected


def test_reward_negative_and_large_targets():
    assert reward(Problem((1, 8, 9), -71), "1-8*9") == 1.0
    assert reward(Problem((1, 8, 9), -71), "1-(8*9)") == 1.0
    assert reward(Problem((1, 8, 9), -71), "1-8-9") == 0.0
    assert reward(Problem((9, 9, 9), 729), "9*9*9") == 1.0
    assert reward(Problem((2, 3, 4), 2), "4-(3-2)") == 0.0  # 3, not 2: '-' is left-associative
    assert reward(Problem((2, 3, 4), 3), "4-(3-2)") == 1.0
    assert reward(Problem((2, 3, 4), -1), "4-3-2") == 1.0


# answers with room to think: the chain format (countdown.py), checked
# against hand-made completions
Q = Problem((1, 4, 7, 8), 83)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("83+1=84[478] 84/7=12[48] 12=4+8", 1.0),      # 83 = (4+8)*7 - 1
        ("83+1=84[478] 84/7=12[48] 12=8+4", 1.0),      # the pair either way round
        ("83+1=84[478] 84/7=12[48] 12=4+8<|im_end|>", 1.0),
        ("83+8=91[147] 91/7=13[14] 13=?\n83+1=84[478] 84/7=12[48] 12=4+8", 1.0),  # a retry
        ("83+1=84[478] 84/7=12[48] 12=4+8\n83+8=91[147] 91/7=13[14] 13=?", 0.0),  # last line
        ("83+8=91[147] 91/7=13[14] 13=?", 0.0),          # a dead end is no answer
        ("83+1=84[478] 84/7=13[48] 13=4+8", 0.0),      # wrong arithmetic inside the trace
        ("83+1=84[478] 84/7=12[48] 12=4*8", 0.0),      # a wrong last equation
        ("83+1=85[478] 85/7=12[48] 12=4+8", 0.0),      # a step that does not hold
        ("83+1=84[478] 84/8=12[47] 12=4+8", 0.0),      # 84/8 is not whole
        ("83+1=84[487] 84/7=12[48] 12=4+8", 0.0),      # digits left written out of order
        ("83+1=84[478] 84/7=12[47] 12=4+8", 0.0),      # wrong digits left
        ("83+1=84[478] 84/7=12[48] 12=4+4", 0.0),      # 4 spent twice, 8 never
        ("83+9=92[1478] 92/4=23[178] 23=?", 0.0),    # 9 is not a digit of the problem
        ("82+2=84[478] 84/7=12[48] 12=4+8", 0.0),      # does not start at the target
        ("83+1=84[478] 12=4+8", 0.0),                   # a need skipped
        ("83+1=84[478] 84/7=12[48]", 0.0),             # truncated: no last equation
        ("83+1=84[478] 84/7=12[48] 12=", 0.0),
        ("83+1=84[478]  84/7=12[48] 12=4+8", 0.0),     # malformed: two spaces
        ("83 + 1 = 84[478] 84/7=12[48] 12=4+8", 0.0),
        ("83+1=084[478] 084/7=12[48] 12=4+8", 0.0),    # a leading zero
        ("83-1=84[478] 84/7=12[48] 12=4+8", 0.0),      # the operator does not match the numbers
        ("83*1=83[478] 83-7=76[48] 76=?", 0.0),        # '*' is not a step
        ("(4+8)*7-1", 1.0),                               # an expression is an answer too
        ("83+8=91[147] 91/7=13[14] 13=?\n(4+8)*7-1", 1.0),
    ],
)
def test_chain_reward_hand_cases(text, expected):
    assert reward(Q, text) == expected


def test_chain_reward_three_digits_and_subtraction():
    p = Problem((2, 6, 9), 21)
    assert reward(p, "21-9=12[26] 12=2*6") == 1.0       # 2*6+9
    assert reward(p, "21+2=23[69] 23=?") == 0.0
    assert set(countdown.chain_answers(p)) == {"21-9=12[26] 12=2*6"}
    assert reward(Problem((3, 4, 9), 2), "2+3=5[49] 5=9-4") == 1.0      # (9-4)-3
    assert reward(Problem((3, 4, 9), 2), "2+3=5[49] 5=4-9") == 0.0      # 4-9 is -5
    assert reward(Problem((3, 4, 9), 2), "2+3=5[49] 5=9-4=5") == 0.0
    assert countdown.chain_answers(Problem((2, 6, 9), 8)) == ()                # no chain reaches 8


def _trusted_chain(problem, line):
    # an independent reading of a chain line: rebuild the expression it stands for and let
    # Python evaluate it; also return the digits it spends. None when the line is not
    # written as one.
    m = re.fullmatch(r"((?:[0-9]+[-+/][1-9]=[0-9]+\[[1-9]+\] )*)([0-9]+)=([1-9])([-+*])([1-9])",
                     line)
    if not m:
        return None
    steps = re.findall(r"([0-9]+)([-+/])([1-9])=([0-9]+)\[([1-9]+)\]", m[1])
    expr, used = f"({m[3]}{m[4]}{m[5]})", [int(m[3]), int(m[5])]
    for x, op, d, y, left in reversed(steps):
        expr = f"({expr}{ {'+': '-', '-': '+', '/': '*'}[op]}{d})"
        used.append(int(d))
    return _trusted_eval(expr), used, steps


def test_chain_reward_agrees_with_an_independent_reading():
    # every right chain evaluates, as an expression, to the target and spends exactly the
    # digits; every step's own equation holds; a line with one number changed scores 0
    rng = random.Random(1)
    for p in rng.sample(make_problems("train", full=True), 300):
        for line in countdown.chain_answers(p)[:5]:
            value, used, steps = _trusted_chain(p, line)
            assert value == p.target and sorted(used) == sorted(p.digits), (p, line)
            for x, op, d, y, _ in steps:
                assert (int(x) + int(d) == int(y)) if op == "+" else (int(x) - int(d) == int(y)) \
                    if op == "-" else (int(x) == int(y) * int(d)), (p, line)
            words = line.split(" ")
            i = rng.randrange(len(words))
            broken = " ".join(words[:i] + [re.sub(r"=([0-9]+)", lambda m: f"={int(m[1]) + 1}",
                                                   words[i], count=1)] + words[i + 1:])
            assert reward(p, broken) == 0.0, (p, broken)


def test_reward_bad_types():
    with pytest.raises(TypeError):
        reward(P, None)
    with pytest.raises(TypeError):
        reward(P, b"3*5+7")
    with pytest.raises(TypeError):
        reward((3, 5, 7), "3*5+7")


def test_problem_validation():
    with pytest.raises(ValueError, match="0"):
        Problem((0, 5, 7), 1)
    with pytest.raises(TypeError):
        Problem([3, 5, 7], 1)
    with pytest.raises(TypeError):
        Problem((3, 5, 7), 1.5)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789+-*() \n<|>imend_xé", max_size=80))
def test_reward_never_raises_on_text(text):
    assert reward(P, text) in (0.0, 1.0)


@st.composite
def expressions(draw, depth=3):
    # random expressions with random (often redundant) parentheses, for the differential
    # test
    if depth == 0 or draw(st.booleans()):
        return str(draw(st.integers(1, 9)))
    left = draw(expressions(depth=depth - 1))
    right = draw(expressions(depth=depth - 1))
    text = f"{left}{draw(st.sampled_from('+-*'))}{right}"
    return f"({text})" if draw(st.booleans()) else text


@settings(max_examples=300, deadline=None)
@given(expressions())
def test_parser_matches_python(text):
    value, used = parse_answer(text)
    assert value == _trusted_eval(text)
    assert used == [int(c) for c in text if c.isdigit()]


# -----------------------------------------------------------------------------
# problem space, solutions, split


def _shape(text):
    # identifies an expression up to redundant parentheses: its digit order, and its value
    # with the k-th digit replaced by a large distinct number (so a coincidence like 5-7*1
    # == (5-7)*1 cannot hide a difference)
    big = iter([1009, 10007, 100003, 1000003])
    generic = re.sub(r"\d", lambda m: str(next(big)), text)
    return re.sub(r"\D", "", text), _trusted_eval(generic)


def _brute_force(digits):
    # every fully parenthesised expression over every order of the digits -> {value:
    # [texts]}
    out = {}
    for a, b, c in set(itertools.permutations(digits)):
        for o1, o2 in itertools.product("+-*", repeat=2):
            for text in (f"(({a}{o1}{b}){o2}{c})", f"({a}{o1}({b}{o2}{c}))"):
                out.setdefault(_trusted_eval(text), []).append(text)
    return out


@functools.cache
def _reachable(digits):
    """Every value an expression over exactly this multiset (a sorted tuple) reaches:
    split it into two non-empty parts every way, combine their values with + - * (an
    independent count, by values not texts)."""
    if len(digits) == 1:
        return frozenset(digits)
    out = set()
    for mask in range(1, 2 ** len(digits) - 1):
        left = tuple(d for i, d in enumerate(digits) if mask >> i & 1)
        right = tuple(d for i, d in enumerate(digits) if not mask >> i & 1)
        for a in _reachable(left):
            for b in _reachable(right):
                out |= {a + b, a - b, a * b}
    return frozenset(out)


def test_problem_space_is_every_reachable_target():
    splits = {s: make_problems(s, full=True) for s in ("train", "val", "test")}
    space = set().union(*map(set, splits.values()))
    assert sum(map(len, splits.values())) == len(space)            # no problem in two splits
    by_digits = {}
    for p in space:
        by_digits.setdefault(p.digits, set()).add(p.target)
    three = list(itertools.combinations_with_replacement(range(1, 10), 3))
    four = random.Random(0).sample(list(itertools.combinations_with_replacement(range(1, 10), 4)),
                                   40)
    for digits in three + four:
        assert by_digits.get(digits,
                             set()) == {v for v in _reachable(digits) if 1 <= v <= 99}, digits
    for digits in three:   # the two counts agree for three digits too (texts, by Python's own eval)
        assert {v for v in _brute_force(digits) if 1 <= v <= 99} == by_digits[digits]
    assert set(map(len, by_digits)) == {3, 4} and len(space) == 22251


def test_every_solution_is_rewarded_and_complete():
    rng = random.Random(0)
    problems = [p for s in ("train", "val", "test") for p in make_problems(s, full=True)
                if len(p.digits) == 3]
    four = rng.sample([p for p in make_problems("train", full=True) if len(p.digits) == 4], 200)
    for p in problems + four:
        sols = countdown.expression_answers(p)
        assert sols, p
        assert len(set(sols)) == len(sols)
        assert all(reward(p, s) == 1.0 for s in sols), p
    # every brute-force hit is accepted too, and the same expression (up to
    # parentheses) is listed
    for p in rng.sample(problems, 100):
        sols = countdown.expression_answers(p)
        listed = {_shape(s) for s in sols}
        for text in _brute_force(p.digits)[p.target]:
            assert reward(p, text) == 1.0
            assert _shape(text) in listed, (p, text)
        # solutions are minimal: removing any pair of parentheses changes the expression
        for s in sols:
            for i, c in enumerate(s):
                if c == "(":
                    depth, j = 0, i
                    while True:
                        depth += {"(": 1, ")": -1}.get(s[j], 0)
                        if depth == 0:
                            break
                        j += 1
                    stripped = s[:i] + s[i + 1 : j] + s[j + 1 :]
                    assert _shape(stripped) != _shape(s), (s, stripped)
    assert solutions(Problem((3, 5, 7), 1000)) == []
    assert countdown.expression_answers(P)[0] == "3*5+7"  # the preferred one-line answer
    # solutions: the demonstration first, then the other chains, then the expressions
    assert solutions(Q)[0] == countdown.demonstration(Q) and "(4+8)*7-1" in solutions(Q)
    for p in rng.sample(make_problems("train", full=True), 50):
        assert all(reward(p, s) == 1.0 for s in solutions(p))
        assert set(solutions(p)) >= (set(countdown.chain_answers(p))
                                     | set(countdown.expression_answers(p)))


def test_heuristic_is_the_greedy_closest_pair_rule():
    p = Problem((2, 4, 6, 9), 30)
    # 4*6=24 and 4*9=36 are both 6 away: the first pair in order wins; then
    # 9+24=33, then 33-2=31
    assert countdown.heuristic_answer(p) == "9+4*6-2"
    assert reward(p, countdown.heuristic_answer(p)) == 0.0
    # 21 first (1 away), then 26
    assert countdown.heuristic_answer(Problem((3, 5, 7), 22)) == "5+3*7"
    q = Problem((2, 3, 9), 29)
    assert countdown.heuristic_answer(q) == "2+3*9"
    assert reward(q, countdown.heuristic_answer(q)) == 1.0
    # 7-4=3 hits the target at once, and the last number must still be used: 8-3=5
    # is closest then
    assert countdown.heuristic_answer(Problem((4, 7, 8), 3)) == "8-(7-4)"
    test = make_problems("test", full=True)
    by_size = {k: [reward(p, countdown.heuristic_answer(p)) for p in test if len(p.digits) == k]
               for k in (3, 4)}
    accuracy = sum(map(sum, by_size.values())) / len(test)
    assert 0.20 < accuracy < 0.22   # the README's numbers, on the whole test split
    assert 0.44 < sum(by_size[3]) / len(by_size[3]) < 0.48
    assert 0.17 < sum(by_size[4]) / len(by_size[4]) < 0.19


def test_reach_hand_cases():
    # 22-7=15[35] 15=3*5 is the one landing choice of nine (the docstring's worked example)
    assert countdown.reach(Problem((3, 5, 7), 22)) == Fraction(1, 9)
    # two digits left: the pair makes the need or not, nothing in between
    assert countdown._reach(15, (3, 5)) == 1 and countdown._reach(16, (3, 5)) == 0
    # 4*7-2*3 is a tree, no chain's: no blind attempt lands, though the problem is solvable
    tree = Problem((2, 3, 4, 7), 22)
    assert countdown.expression_answers(tree) and countdown.chain_answers(tree) == ()
    assert countdown.reach(tree) == 0
    # a problem is reachable exactly when some chain reaches it
    rng = random.Random(0)
    for p in rng.sample(make_problems("train", full=True), 300):
        assert (countdown.reach(p) > 0) == bool(countdown.chain_answers(p)), p


@pytest.mark.parametrize("digits,target", [((3, 5, 7), 22), ((1, 4, 7, 8), 83),
                                           ((2, 3, 6, 8), 24), ((1, 2, 5, 9), 40)])
def test_reach_equals_a_monte_carlo_of_the_blind_search(digits, target):
    p, n = Problem(digits, target), 20_000
    rng = random.Random(f"{digits}:{target}")
    hits = sum(countdown._attempt(rng, target, digits)[1] for _ in range(n))
    exact = float(countdown.reach(p))
    assert 0 < exact < 1
    assert abs(hits / n - exact) < 4 * (exact * (1 - exact) / n) ** 0.5 + 1e-9, (hits / n, exact)


def test_the_fast_paths_agree_with_writing_every_expression_and_pin_reach():
    # _reachable (the split's targets) against the keys of _values, which writes every
    # expression over every order of the digits
    rng = random.Random(0)
    multisets = list(itertools.combinations_with_replacement(range(1, 10), 4))
    for digits in rng.sample(multisets, 40) + [(3, 5, 7), (1, 1, 1)]:
        assert countdown._reachable(digits) == set(countdown._values(digits)), digits
    # reach summed exactly over the edge's test split (as the Fraction recursion before
    # the whole-number count gave it)
    assert sum(countdown.reach(p) for p in make_problems("test")) == Fraction(20641, 324)


def test_the_edge_split_is_the_full_split_filtered_by_reach():
    for split in ("train", "val", "test"):
        full, edge = make_problems(split, full=True), make_problems(split)
        want = [p for p in full if len(p.digits) == 4 and countdown.reach(p) >= Fraction(1, 20)]
        assert edge == want   # the full space's fixed order, filtered
    train, val, test = (make_problems(s) for s in ("train", "val", "test"))
    assert (len(train), len(val), len(test)) == (4483, 718, 639)
    multisets = [{p.digits for p in split} for split in (train, val, test)]
    assert not (multisets[0] & multisets[1] or multisets[0] & multisets[2]
                or multisets[1] & multisets[2])
    assert make_problems("test", 5) == test[:5] and countdown_full.make_problems("test") == \
        make_problems("test", full=True)


def test_chain_rule_takes_the_smallest_need_at_every_step():
    for p in random.Random(1).sample(make_problems("train", full=True), 300):
        need, pool = p.target, sorted(p.digits)
        for word in countdown.chain_rule_answer(p).split(" ")[:-1]:   # the steps, not the last pair
            op, d = word[len(str(need))], int(word[len(str(need)) + 1])
            options = [x for o in "+-/" for e in set(pool)
                       if (x := {"+": need + e, "-": need - e,
                                 "/": need // e if need % e == 0 else 0}[o]) >= 1]
            y = int(word.split("=")[1].split("[")[0])
            assert y == min(options) and word.startswith(f"{need}{op}{d}="), (p, word)
            need = y
            pool.remove(d)


def test_rules_are_scored_by_evaluate_and_outcomes_carry_reach():
    problems = make_problems("val", 40)
    metrics, outcomes = evaluate.rule_metrics(countdown, problems, "chain_rule")
    right = [reward(p, countdown.chain_rule_answer(p)) for p in problems]
    assert metrics["eval/accuracy"] == pytest.approx(sum(right) / len(right))
    assert [o["reach"] for o in outcomes] == [round(float(countdown.reach(p)), 6) for p in problems]
    assert all(o["reach"] >= 0.05 for o in outcomes)
    assert evaluate.offered_rules(countdown) == ["heuristic", "chain_rule"]
    assert evaluate.offered_rules(guess) == []
    with pytest.raises(ValueError, match="offers no chain_rule_answer"):
        evaluate.rule_metrics(guess, [], "chain_rule")


def test_chain_rule_is_right_whenever_it_claims_an_answer():
    assert countdown.chain_rule_answer(Problem((3, 5, 7), 22)) == "22-7=15[35] 15=3*5"
    assert countdown.chain_rule_answer(Problem((1, 4, 7, 8), 83)) == "83-8=75[147] 75-7=68[14] 68=?"
    test = make_problems("test", full=True)
    right = []
    for p in test:
        line = countdown.chain_rule_answer(p)
        claims = not line.endswith("=?")
        assert reward(p, line) == (1.0 if claims else 0.0), (p, line)
        right.append(claims)
    assert 0.24 < sum(right) / len(test) < 0.25   # 0.244 on the full test split


TEST_HEAD = [Problem((3, 5, 6), 27), Problem((1, 3, 8, 9), 49), Problem((3, 3, 5), 18)]


def test_split_is_fixed_and_disjoint_by_digit_multiset():
    train, val, test = (make_problems(s, full=True) for s in ("train", "val", "test"))
    # changing these changes the held-out sets: don't
    assert (len(train), len(val), len(test)) == (17465, 2503, 2283)
    assert test[:3] == TEST_HEAD
    multisets = [{p.digits for p in split} for split in (train, val, test)]
    assert (not multisets[0] & multisets[1] and not multisets[0] & multisets[2]
            and not multisets[1] & multisets[2])
    assert all(countdown.split_of(p.digits) == name
               for name, split in (("train", train), ("val", val), ("test", test)) for p in split)
    for split in (val, test):
        assert len(split) >= 1500 and {len(p.digits) for p in split} == {3, 4}
    assert (make_problems("test", full=True) == test and make_problems("val", full=True) == val
            and make_problems("train", full=True) == train)
    assert make_problems("train", 10, full=True) == train[:10]
    assert make_problems("test", 0) == []


@pytest.mark.parametrize("digits,target,k", [((1, 4, 7, 8), 83, 8), ((2, 3, 6, 8), 24, 4),
                                             ((1, 2, 5, 9), 40, 64), ((1, 3, 5, 6, 6), 15, 16)])
def test_blind_pass_at_k_equals_a_monte_carlo_of_k_blind_attempts(digits, target, k):
    p, groups = Problem(digits, target), 4_000
    rng = random.Random(f"pass@{k}:{digits}:{target}")
    hits = sum(any(countdown._attempt(rng, target, digits)[1] for _ in range(k))
               for _ in range(groups))
    exact = countdown.blind_pass_at_k(p, k)
    assert 0.05 < exact < 0.999 and countdown.blind_pass_at_k(p, 1) == float(countdown.reach(p))
    assert abs(hits / groups - exact) < 4 * (exact * (1 - exact) / groups) ** 0.5, (hits, exact)


CONFIRM_HEAD = [Problem((1, 3, 5, 6, 6), 15), Problem((2, 2, 3, 7, 7), 21),
                Problem((1, 1, 3, 3, 8), 7)]


def scored_multisets():
    """Every digit multiset in a split a run has scored: the full space's three (train,
    val, test: the edge's are theirs, filtered) and those of every committed
    outcomes.jsonl, loose or in a runs.tar.gz (a guard on a run of another split ever
    committed)."""
    scored = {p.digits for s in ("train", "val", "test") for p in make_problems(s, full=True)}

    def add(folder, lines):
        if not os.path.basename(folder).startswith("confirm_"):
            rows = [json.loads(line) for line in lines]
            scored.update(tuple(sorted(row["digits"])) for row in rows if "digits" in row)

    results = os.path.join(os.path.dirname(__file__), "..", "docs", "results")
    for folder, _, names in os.walk(results):
        if "outcomes.jsonl" in names:
            with open(os.path.join(folder, "outcomes.jsonl")) as f:
                add(folder, f)
        for name in (n for n in names if n.endswith(".tar.gz")):
            with tarfile.open(os.path.join(folder, name)) as tar:
                for member in tar.getmembers():
                    if os.path.basename(member.name) == "outcomes.jsonl":
                        add(os.path.dirname(member.name), tar.extractfile(member))
    return scored


def test_the_confirmatory_split_is_fixed_and_disjoint_from_every_scored_split():
    confirm = make_problems("confirm")
    # fixed before any model scored it (docs/results.md): changing it voids the confirmation
    assert len(confirm) == 640 and confirm[:3] == CONFIRM_HEAD
    digest = hashlib.blake2b(repr([(p.digits, p.target) for p in confirm]).encode(),
                             digest_size=8).hexdigest()
    assert digest == "84427cc84d63390c"   # every problem, in order
    # a size no split holds: no run can have scored one of its multisets
    assert countdown.CONFIRM_NUM_DIGITS not in countdown.NUM_DIGITS
    assert all(len(p.digits) == 5 and 1 <= p.target <= 99 and countdown.reach(p) >= Fraction(1, 20)
               for p in confirm)
    assert len(set(confirm)) == 640 and make_problems("confirm", 3) == CONFIRM_HEAD
    assert not {p.digits for p in confirm} & scored_multisets()
    assert all(countdown.solutions(p) for p in confirm[:50])   # solvable, as reach says
    with pytest.raises(ValueError, match="no 'confirm' split"):
        countdown_full.make_problems("confirm")


@pytest.mark.parametrize("split", ["validation", "Train", "", None])
def test_bad_split(split):
    with pytest.raises(ValueError, match="split"):
        make_problems(split)


@pytest.mark.parametrize("n", [-1, 17466, 1.5, "3"])
def test_bad_n(n):
    with pytest.raises(ValueError, match="n must be"):
        make_problems("train", n)


# -----------------------------------------------------------------------------
# data for the stages


def _honest_attempt(digits, line):
    # (start, landed) of a line that is an honest attempt over these digits: every step
    # true, the digits left right, and it ends in a right pair equation, in 'y=?' when
    # the two digits left cannot make y (checked by brute force), or in 'x/d=?' at a
    # step that is not one (a division that is not whole, a difference below 1); fails
    # an assert otherwise
    *steps, last = line.split(" ")
    pool = sorted(digits)
    start = need = int(re.match(r"[0-9]+", line)[0])
    for word in steps:
        x, op, d, y, left = re.fullmatch(r"([0-9]+)([-+/])([1-9])=([0-9]+)\[([1-9]+)\]",
                                         word).groups()
        x, d, y = int(x), int(d), int(y)
        assert x == need and d in pool and y >= 1
        assert y == {"+": x + d, "-": x - d, "/": x // d}[op] and (op != "/" or x % d == 0)
        pool.remove(d)
        assert left == "".join(map(str, pool))
        need = y
    bad = re.fullmatch(r"([0-9]+)([-+/])([1-9])=\?", last)
    if bad:
        x, op, d = int(bad[1]), bad[2], int(bad[3])
        assert x == need and d in pool and len(pool) > 2
        assert x % d != 0 if op == "/" else (op == "-" and x - d < 1)
        return start, False
    assert len(pool) == 2
    a, b = pool
    makes = {a + b, a - b, b - a, a * b}
    if last == f"{need}=?":
        assert need not in makes
        return start, False
    assert last in (f"{need}={a}{o}{b}" for o in "+-*") or last in (f"{need}={b}{o}{a}"
                                                                    for o in "+-*")
    assert need in makes and _trusted_eval(last.split("=")[1]) == need
    return start, True


def test_demonstrations_are_right_chains_drawn_like_a_blind_search():
    rng = random.Random(0)
    problems = (rng.sample(make_problems("train", full=True), 400)
                + make_problems("val", 50, full=True))
    for p in problems:
        line = countdown.demonstration(p)
        if not countdown.chain_answers(p):
            assert line is None   # no chain reaches the target: no demonstration
        if line is None:          # (or each chain's tail answers a held-out problem)
            assert all(_tail_problem(c) for c in countdown.chain_answers(p))
            continue
        start, landed = _honest_attempt(p.digits, line)
        assert start == p.target and landed and line in countdown.chain_answers(p)
        # fixed by the problem
        assert reward(p, line) == 1.0 and line == countdown.demonstration(p)
    assert countdown.demonstration(Problem((2, 6, 9), 8)) is None
    # a problem with two right chains shows both, each about as often as blind search
    # finds it: over many problems of that kind the first step's operator is spread, not
    # one fixed rule
    firsts = collections.Counter(countdown.demonstration(p).split("=")[0][-2]
                                 for p in problems if countdown.demonstration(p))
    assert set(firsts) == {"+", "-", "/"}


def test_pretrain_corpus_is_deterministic_and_correct():
    docs = pretrain_corpus(50, seed=0)
    assert docs == pretrain_corpus(50, seed=0)
    assert docs != pretrain_corpus(50, seed=1)
    assert pretrain_corpus(0, seed=0) == []
    ops = collections.Counter()
    for doc in docs:
        header, *lines = doc.split("\n")
        assert header.startswith("digits ") and lines
        digits = tuple(int(d) for d in header.split()[1:])
        for line in lines:
            _honest_attempt(digits, line)
            ops.update(re.findall(r"[0-9]([-+/])[1-9]=", line))
    assert set(ops) == {"+", "-", "/"}   # every kind of step, divisions included
    with pytest.raises(ValueError):
        pretrain_corpus(-1, seed=0)


def test_pretrain_corpus_holds_no_validation_or_test_answer():
    # a line spends exactly its document's digits, whose multiset is a training one: no
    # line can answer a validation or test problem, whatever its start
    held_out = {(p.digits, p.target) for s in ("val", "test") for p in make_problems(s, full=True)}
    sizes = set()
    for seed in (0, 1, 2, 1337):
        for doc in pretrain_corpus(2000, seed):
            header, *lines = doc.split("\n")
            digits = tuple(sorted(int(d) for d in header.split()[1:]))
            sizes.add(len(digits))
            assert countdown.split_of(digits) == "train", (seed, header)
            for line in lines:
                start, landed = _honest_attempt(digits, line)
                assert (digits, start) not in held_out
                assert not (landed and _tail_problem(line) in held_out), (seed, line)
    assert sizes == {3, 4}


def _tail_problem(line):
    # the problem a right four-digit line's tail answers, word for word: after its first
    # step, the rest is a chain from that step's need over the three digits it leaves
    m = re.match(r"[0-9]+[-+/][1-9]=([0-9]+)\[([1-9]{3})\] ", line)
    return (tuple(sorted(map(int, m[2]))), int(m[1])) if m else None


def test_no_demonstration_answers_a_held_out_problem_even_in_its_tail():
    held_out = {(p.digits, p.target) for s in ("val", "test") for p in make_problems(s, full=True)}
    tails = 0
    for conv in sft_examples(seed=0, fraction=1.0):
        tail = _tail_problem(conv[1]["content"])
        tails += tail is not None
        assert tail not in held_out, conv
    assert tails > 5000   # the check saw four-digit chains
    # without the filter, tails would answer held-out problems: a training problem's chain
    # whose tail answers 5 9 9 -> 76 (a held-out problem), which no demonstration may show
    spoiled = "76/1=76[599] 76+5=81[99] 81=9*9"
    assert spoiled in countdown.chain_answers(Problem((1, 5, 9, 9), 76))
    assert _tail_problem(spoiled) in held_out and countdown.demonstration(Problem((1, 5, 9, 9),
                                                                             76)) != spoiled


def test_sft_examples_are_a_fixed_minority_of_train():
    a, b = sft_examples(seed=0), sft_examples(seed=1)
    assert a == sft_examples(seed=0)
    assert a != b  # order depends on seed
    key = lambda conv: (conv[0]["content"], conv[1]["content"])
    assert sorted(map(key, a)) == sorted(map(key, b))  # the subset does not
    n_train = len(make_problems("train", full=True))
    assert 0.07 * n_train < len(a) < 0.13 * n_train
    small = sft_examples(seed=0, fraction=0.05)
    assert set(map(key, small)) < set(map(key, a))  # nested
    by_prompt = {prompt_messages(p)[0]["content"]: p for p in make_problems("train", full=True)}
    held_out = {prompt_messages(p)[0]["content"] for s in ("val", "test")
                for p in make_problems(s, full=True)}
    for conv in a:
        assert [m["role"] for m in conv] == ["user", "assistant"]
        assert conv[0]["content"] not in held_out
        assert reward(by_prompt[conv[0]["content"]], conv[1]["content"]) == 1.0
    for bad in (0, 1.5, -0.1, "0.2"):
        with pytest.raises(ValueError):
            sft_examples(seed=0, fraction=bad)


def test_prompt_messages():
    assert prompt_messages(Problem((3, 5, 7), 22)) == [{"role": "user",
                                                        "content": "digits 3 5 7 target 22"}]
    assert prompt_messages(Problem((1, 8, 9), -71))[0]["content"] == "digits 1 8 9 target -71"


# -----------------------------------------------------------------------------
# tokenizer


def test_vocab_is_small_and_stable(tok):
    assert len(tok) < 128
    assert tok.get_vocab() == build_tokenizer().get_vocab()
    # the ids others may hard-code or see in checkpoints: never move them
    assert [tok.convert_tokens_to_ids(t) for t in (ENDOFTEXT, IM_START, IM_END)] == [0, 1, 2]
    assert tok.eos_token == IM_END and tok.pad_token == ENDOFTEXT
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0


def test_text_round_trips(tok):
    texts = pretrain_corpus(20, seed=3) + [m["content"] for c in sft_examples(0)[:50] for m in c]
    texts += ["Hello, world! systematic users ~{}[]\n\tTAB".replace("\t", " ")]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.unk_token_id not in ids
        assert all(0 <= i < len(tok) for i in ids)
        assert tok.decode(ids) == text
    assert tok.unk_token_id in tok.encode("é", add_special_tokens=False)


def test_chat_prompt_ids(tok):
    ids = chat_prompt_ids(tok, prompt_messages(P))
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert (
        tok.decode(ids) == f"{IM_START}user\ndigits 3 5 7 target 22{IM_END}\n{IM_START}assistant\n"
    )
    lengths = [len(chat_prompt_ids(tok, prompt_messages(p)))
               for p in make_problems("test", full=True)]
    assert 15 <= min(lengths) and max(lengths) <= 25


def test_chat_example_mask_covers_exactly_the_reply(tok):
    convs = sft_examples(0)[:100] + [[{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": "hello there"}],
                                     [{"role": "user", "content": "a"},
                                      {"role": "assistant", "content": "b"},
                                      {"role": "user", "content": "c"},
                                      {"role": "assistant", "content": "3*5+7"}]]
    im_end = tok.convert_tokens_to_ids(IM_END)
    for conv in convs:
        ids, mask = chat_example(tok, conv)
        assert len(ids) == len(mask) and set(mask) == {0, 1}
        assert all(0 <= i < len(tok) for i in ids)
        prompt = chat_prompt_ids(tok, conv[:-1])
        assert ids[: len(prompt)] == prompt
        assert not any(mask[: len(prompt)])
        learned = [t for t, m in zip(ids, mask) if m]
        assert tok.decode(learned) == conv[-1]["content"] + IM_END
        first = mask.index(1)
        assert all(mask[first : first + len(learned)])  # one contiguous span
        assert ids[first + len(learned) - 1] == im_end
        assert tok.decode(ids[first + len(learned):]) == "\n" and mask[-1] == 0
        assert tok.decode(ids) == tok.apply_chat_template(conv, tokenize=False)
    # the learned span is what the engine would generate: the reward accepts it, as the
    # trainers decode it
    conv = sft_examples(0)[0]
    ids, mask = chat_example(tok, conv)
    completion = [t for t, m in zip(ids, mask) if m]
    by_prompt = {prompt_messages(p)[0]["content"]: p for p in make_problems("train", full=True)}
    p = by_prompt[conv[0]["content"]]
    assert reward(p, completion_text(tok, completion)) == 1.0
    # ... but not with a special token inside it (skipping special tokens when decoding
    # would hide them)
    for name in (IM_START, ENDOFTEXT, IM_END):
        special = tok.convert_tokens_to_ids(name)
        assert reward(p, completion_text(tok, completion[:1] + [special] + completion[1:])) == 0.0


def test_chat_bad_input(tok):
    with pytest.raises(ValueError, match="assistant"):
        chat_example(tok, [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="after at least one message"):   # no prompt to learn after
        chat_example(tok, [{"role": "assistant", "content": "7+5*3"}])
    with pytest.raises(ValueError, match="tool"):
        chat_prompt_ids(tok, [{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="im_end"):
        chat_example(tok,
                     [{"role": "user", "content": "x"},
                      {"role": "assistant", "content": "1<|im_end|>2"}])
    with pytest.raises(ValueError, match="round-trip"):
        chat_example(tok,
                     [{"role": "user", "content": "x"}, {"role": "assistant", "content": "café"}])
    with pytest.raises(ValueError):
        chat_prompt_ids(tok, [])
    with pytest.raises(TypeError):
        chat_prompt_ids(tok, [{"role": "user"}])


def test_save_load_round_trip(tok, tmp_path):
    path = tmp_path / "tok"
    save_tokenizer(tok, path)
    assert sorted(os.listdir(tmp_path)) == ["tok"]  # no temp dir left behind
    for loaded in (load_tokenizer(path), AutoTokenizer.from_pretrained(path)):
        assert loaded.get_vocab() == tok.get_vocab()
        assert loaded.chat_template == tok.chat_template
        assert (loaded.eos_token, loaded.pad_token) == (IM_END, ENDOFTEXT)
        for conv in sft_examples(0)[:20]:
            assert chat_example(loaded, conv) == chat_example(tok, conv)
            assert chat_prompt_ids(loaded, conv[:1]) == chat_prompt_ids(tok, conv[:1])
    # saving into an existing directory (a checkpoint dir) keeps its other files
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    save_tokenizer(tok, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "config.json").read_text() == "{}"
    assert load_tokenizer(tmp_path / "ckpt").get_vocab() == tok.get_vocab()


def test_load_errors(tok, tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        load_tokenizer(empty)
    corrupt = tmp_path / "corrupt"
    save_tokenizer(tok, corrupt)
    (corrupt / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        load_tokenizer(corrupt)
    truncated = tmp_path / "truncated"
    save_tokenizer(tok, truncated)
    data = json.loads((truncated / "tokenizer.json").read_text())
    del data["model"]
    (truncated / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="truncated"):
        load_tokenizer(truncated)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="a_file"):
        save_tokenizer(tok, a_file)
    assert a_file.read_text() == "x"
