# tests for task.py (mini-countdown) and tokenizer.py (the embedded ChatML tokenizer). CPU, a few seconds.

import ast
import functools
import itertools
import json
import operator
import os
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

import task
from task import Problem, make_problems, pretrain_corpus, prompt_messages, reward, sft_examples
from tokenizer import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    build_tokenizer,
    chat_example,
    chat_prompt_ids,
    completion_text,
    load_tokenizer,
    save_tokenizer,
)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _trusted_eval(text: str) -> int:
    # reference evaluator for expressions the test itself generated: Python's own parser, + - * on ints only
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}

    def ev(node):
        if isinstance(node, ast.BinOp):
            return ops[type(node.op)](ev(node.left), ev(node.right))
        assert isinstance(node, ast.Constant) and type(node.value) is int
        return node.value

    return ev(ast.parse(text, mode="eval").body)


# -----------------------------------------------------------------------------
# reward: a trace of attempts, checked exactly


P = Problem((3, 5, 7), 22)   # the tokenizer tests' prompt
P4 = Problem((2, 4, 6, 9), 30)
RIGHT = "6*4=24 (2 9 24) 24-9=15 (2 15) 15*2=30"
MISS = "9+6=15 (2 4 15) 15*4=60 (2 60) 60-2=58"


@pytest.mark.parametrize(
    "text, expected",
    [
        (RIGHT, 1.0),
        (MISS + "\n" + RIGHT, 1.0),                       # a failed attempt, then the answer
        (MISS + "\n" + MISS + "\n" + RIGHT, 1.0),          # the same failed attempt twice is still true
        (RIGHT + "<|im_end|>", 1.0),                      # decoded with special tokens
        ("4*6=24 (2 9 24) 24-9=15 (2 15) 2*15=30", 1.0),  # the smaller number first, where the value allows
        ("6*4=24 (24 9 2) 24-9=15 (15 2) 15*2=30", 1.0),  # a pool is a multiset: any order
        ("9-2=7 (4 6 7) 7*6=42 (4 42) 42-4=38\n" + RIGHT, 1.0),
        (MISS, 0.0),                                      # the last attempt is the answer: 58, not 30
        (RIGHT + "\n" + MISS, 0.0),
        ("6*4=25 (2 9 25) 25-9=16 (2 16) 16*2=32\n" + RIGHT, 0.0),   # wrong arithmetic in a failed attempt
        ("6*4=24 (2 9 24) 24-9=16 (2 16) 16*2=30", 0.0),   # wrong arithmetic that claims the target
        ("6*4=24 (2 9 24) 24-9=15 (2 15) 15*2=32", 0.0),   # right arithmetic, wrong claim of nothing: not 30
        ("9-24=15 (2 15) 15*2=30", 0.0),                  # takes 24 that the pool lacks
        ("6*4=24 (2 9 24) 24*4=96 (2 9 96) 96-9=87", 0.0),  # uses 4 twice
        ("6*4=24 (2 24) 24+2=26", 0.0),                   # the written pool drops the 9
        ("6*4=24 (2 9 24) 24-9=15 (2 16) 15*2=30", 0.0),   # the written pool is not the pool left
        ("6*4=24 24-9=15 (2 15) 15*2=30", 0.0),           # a pool is missing
        ("6*4=24 (2 9 24) 24-9=15 (2 15) 15*2=30 (30)", 0.0),   # the last step leaves one number, unwritten
        ("6*4=24 (2 9 24) 24+9=33 (2 33)", 0.0),          # does not use every number
        ("6*5=30 (2 4 9 30)", 0.0),                       # 5 is not a digit of the problem
        ("6*4=24 (2 9 24) 24-9=15 (2 15) 15*2=30\n", 0.0),   # an empty line
        ("6*4=24 (2 9 24) 24-9=15 (2", 0.0),              # truncated
        ("6 * 4 = 24 (2 9 24) 24-9=15 (2 15) 15*2=30", 0.0),   # spaces inside a step
        ("6*4=24  (2 9 24) 24-9=15 (2 15) 15*2=30", 0.0),  # two spaces
        ("6*4=024 (2 9 24) 24-9=15 (2 15) 15*2=30", 0.0),  # a leading zero
        ("9-24=-15 (2 4 6 -15)", 0.0),                    # no signs
        ("(6*4-9)*2", 0.0),                               # an expression is not a trace
        ("30", 0.0),
        ("answer: " + RIGHT, 0.0),
        (RIGHT + "<|im_end|>3", 0.0),                     # text after the end of turn
        (RIGHT + "<|im_end|><|im_end|>", 0.0),
        ("", 0.0),
        ("<|im_end|>", 0.0),
        ("\n".join([MISS] * 60 + [RIGHT]), 0.0),         # longer than MAX_TRACE_CHARS
    ],
)
def test_reward_hand_cases(text, expected):
    assert reward(P4, text) == expected


def test_reward_three_digits_zero_and_large_numbers():
    assert reward(Problem((3, 5, 7), 22), "5*3=15 (7 15) 15+7=22") == 1.0
    assert reward(Problem((3, 5, 7), 22), "7*5=35 (3 35) 35-3=32\n5*3=15 (7 15) 15+7=22") == 1.0
    assert reward(Problem((2, 2, 7), 7), "2-2=0 (7 0) 7+0=7") == 1.0      # 0 is a number like any other
    assert reward(Problem((7, 8, 9), 1), "9*8=72 (7 72) 72*7=504\n9-8=1 (7 1) 7*1=7\n8-7=1 (9 1) 9-1=8") == 0.0
    assert reward(Problem((7, 8, 9), 504), "9*8=72 (7 72) 72*7=504") == 1.0


def test_reward_bad_types():
    with pytest.raises(TypeError):
        reward(P4, None)
    with pytest.raises(TypeError):
        reward(P4, RIGHT.encode())
    with pytest.raises(TypeError):
        reward((2, 4, 6, 9), RIGHT)


def test_problem_validation():
    with pytest.raises(ValueError, match="0"):
        Problem((0, 5, 7), 1)
    with pytest.raises(TypeError):
        Problem([3, 5, 7], 1)
    with pytest.raises(TypeError):
        Problem((3, 5, 7), 1.5)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789+-*=() \n<|>imend_xé", max_size=80))
def test_reward_never_raises_on_text(text):
    assert reward(P4, text) in (0.0, 1.0)


@st.composite
def attempts(draw):
    # a random attempt, by an independent simulation: a multiset of digits, steps on random pairs of the pool
    digits = draw(st.lists(st.integers(1, 9), min_size=2, max_size=4))
    pool, steps = list(digits), []
    while len(pool) > 1:
        i, j = draw(st.permutations(range(len(pool))))[:2]
        a, b = max(pool[i], pool[j]), min(pool[i], pool[j])
        op = draw(st.sampled_from("+-*"))
        c = {"+": a + b, "-": a - b, "*": a * b}[op]
        pool = [n for k, n in enumerate(pool) if k not in (i, j)] + [c]
        steps.append(f"{a}{op}{b}={c}" + (f" ({' '.join(map(str, pool))})" if len(pool) > 1 else ""))
    return tuple(sorted(digits)), " ".join(steps), pool[0]


@settings(max_examples=300, deadline=None)
@given(attempts(), st.integers(-5, 5))
def test_reward_matches_an_independent_simulation(attempt, off):
    digits, text, value = attempt
    assert task.attempt_result(digits, task.parse_trace(text)[0]) == value
    assert reward(Problem(digits, value + off), text) == float(off == 0)
    assert task.format_trace(task.parse_trace(text)) == text


# -----------------------------------------------------------------------------
# problem space, solutions, split


def _brute_force(digits):
    # every fully parenthesised expression over every order of the digits -> {value: [texts]}
    out = {}
    for a, b, c in set(itertools.permutations(digits)):
        for o1, o2 in itertools.product("+-*", repeat=2):
            for text in (f"(({a}{o1}{b}){o2}{c})", f"({a}{o1}({b}{o2}{c}))"):
                out.setdefault(_trusted_eval(text), []).append(text)
    return out


@functools.cache
def _reachable(digits):
    """Every value an expression over exactly this multiset (a sorted tuple) reaches: split it into two
    non-empty parts every way, combine their values with + - * (an independent count, by values not texts)."""
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
    splits = {s: make_problems(s) for s in ("train", "val", "test")}
    space = set().union(*map(set, splits.values()))
    assert sum(map(len, splits.values())) == len(space)            # no problem in two splits
    by_digits = {}
    for p in space:
        by_digits.setdefault(p.digits, set()).add(p.target)
    three = list(itertools.combinations_with_replacement(range(1, 10), 3))
    four = random.Random(0).sample(list(itertools.combinations_with_replacement(range(1, 10), 4)), 40)
    for digits in three + four:
        assert by_digits.get(digits, set()) == {v for v in _reachable(digits) if 1 <= v <= 99}, digits
    for digits in three:   # the two counts agree for three digits too (texts, by Python's own eval)
        assert {v for v in _brute_force(digits) if 1 <= v <= 99} == by_digits[digits]
    assert set(map(len, by_digits)) == {3, 4} and len(space) == 22251


def test_every_problem_has_a_trace_and_the_solver_writes_a_right_one():
    problems = make_problems("train") + make_problems("val") + make_problems("test")
    assert all(p.target in task._reach(p.digits) for p in problems)   # subtraction never needs a sign
    rng = random.Random(0)
    for p in rng.sample(problems, 400) + [p for p in problems if p.target not in task._reach(p.digits, task.SMALL)]:
        text = task.solver_trace(p, random.Random(str(p)))
        assert text == task.solver_trace(p, random.Random(str(p)))     # fixed by its rng
        assert reward(p, text) == 1.0, (p, text)
        attempts = task.parse_trace(text)
        assert len(attempts) <= task.MAX_FAILED + 1
        results = [task.attempt_result(p.digits, a) for a in attempts]
        assert all(r != p.target for r in results[:-1]) and results[-1] == p.target
    # how often a demonstration fails first: a fair coin per failed attempt
    failed = [len(task.parse_trace(task.solver_trace(p, rng))) - 1 for p in rng.sample(problems, 2000)]
    assert 0.85 < sum(failed) / len(failed) < 1.1 and max(failed) == task.MAX_FAILED


def test_heuristic_is_the_greedy_closest_step_rule():
    p = Problem((2, 4, 6, 9), 30)
    # 6*4=24 is closest to 30 of all first steps; then 24+9=33 (3 away); then 33-2=31
    assert task.heuristic_trace(p) == "6*4=24 (2 9 24) 24+9=33 (2 33) 33-2=31"
    assert reward(p, task.heuristic_trace(p)) == 0.0
    assert task.heuristic_trace(Problem((3, 5, 7), 22)) == "7*3=21 (5 21) 21+5=26"   # 4 away beats 6
    q = Problem((2, 3, 9), 29)
    assert task.heuristic_trace(q) == "9*3=27 (2 27) 27+2=29" and reward(q, task.heuristic_trace(q)) == 1.0
    test = make_problems("test")
    accuracy = sum(reward(p, task.heuristic_trace(p)) for p in test) / len(test)
    assert 0.20 < accuracy < 0.22     # the rule the README quotes, on the whole test split


TEST_HEAD = [Problem((3, 5, 6), 27), Problem((1, 3, 8, 9), 49), Problem((3, 3, 5), 18)]


def test_split_is_fixed_and_disjoint_by_digit_multiset():
    train, val, test = (make_problems(s) for s in ("train", "val", "test"))
    # changing these changes the held-out sets: don't
    assert (len(train), len(val), len(test)) == (17465, 2503, 2283)
    assert test[:3] == TEST_HEAD
    multisets = [{p.digits for p in split} for split in (train, val, test)]
    assert not multisets[0] & multisets[1] and not multisets[0] & multisets[2] and not multisets[1] & multisets[2]
    assert all(task.split_of(p.digits) == name for name, split in (("train", train), ("val", val), ("test", test))
               for p in split)
    for split in (val, test):
        assert len(split) >= 1500 and {len(p.digits) for p in split} == {3, 4}
    assert make_problems("test") == test and make_problems("val") == val and make_problems("train") == train
    assert make_problems("train", 10) == train[:10]
    assert make_problems("test", 0) == []


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


def test_pretrain_corpus_is_deterministic_and_correct():
    docs = pretrain_corpus(50, seed=0)
    assert docs == pretrain_corpus(50, seed=0)
    assert docs != pretrain_corpus(50, seed=1)
    assert pretrain_corpus(0, seed=0) == []
    for doc in docs:
        header, *lines = doc.split("\n")
        assert header.startswith("digits ") and "target" not in doc and 4 <= len(lines) <= 8
        digits = tuple(int(d) for d in header.split()[1:])
        for attempt in task.parse_trace("\n".join(lines)):
            assert task.attempt_result(digits, attempt) is not None, doc
            assert all(s.c <= task.SMALL for s in attempt)
    with pytest.raises(ValueError):
        pretrain_corpus(-1, seed=0)


def test_pretrain_corpus_holds_no_validation_or_test_answer():
    held_out = {(p.digits, p.target) for s in ("val", "test") for p in make_problems(s)}
    sizes = set()
    for seed in (0, 1, 2, 1337):
        for doc in pretrain_corpus(2000, seed):
            header, *lines = doc.split("\n")
            digits = tuple(int(d) for d in header.split()[1:])
            sizes.add(len(digits))
            assert len(digits) == 2 or task.split_of(digits) == "train", (seed, doc)
            for attempt in task.parse_trace("\n".join(lines)):
                assert (digits, task.attempt_result(digits, attempt)) not in held_out, (seed, doc)
    assert sizes == {2, 3, 4}


def test_sft_examples_are_a_fixed_minority_of_train():
    a, b = sft_examples(seed=0), sft_examples(seed=1)
    assert a == sft_examples(seed=0)
    assert a != b  # order depends on seed
    key = lambda conv: (conv[0]["content"], conv[1]["content"])
    assert sorted(map(key, a)) == sorted(map(key, b))  # the subset does not
    n_train = len(make_problems("train"))
    assert 0.07 * n_train < len(a) < 0.13 * n_train
    small = sft_examples(seed=0, fraction=0.05)
    assert set(map(key, small)) < set(map(key, a))  # nested
    by_prompt = {prompt_messages(p)[0]["content"]: p for p in make_problems("train")}
    held_out = {prompt_messages(p)[0]["content"] for s in ("val", "test") for p in make_problems(s)}
    for conv in a:
        assert [m["role"] for m in conv] == ["user", "assistant"]
        assert conv[0]["content"] not in held_out
        assert conv == task.demonstration(by_prompt[conv[0]["content"]])
        assert reward(by_prompt[conv[0]["content"]], conv[1]["content"]) == 1.0
    for bad in (0, 1.5, -0.1, "0.2"):
        with pytest.raises(ValueError):
            sft_examples(seed=0, fraction=bad)


def test_prompt_messages():
    assert prompt_messages(Problem((3, 5, 7), 22)) == [{"role": "user", "content": "digits 3 5 7 target 22"}]
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
    assert tok.decode(ids) == f"{IM_START}user\ndigits 3 5 7 target 22{IM_END}\n{IM_START}assistant\n"
    lengths = [len(chat_prompt_ids(tok, prompt_messages(p))) for p in make_problems("test")]
    assert 15 <= min(lengths) and max(lengths) <= 25


def test_chat_example_mask_covers_exactly_the_reply(tok):
    convs = sft_examples(0)[:100] + [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}, {"role": "assistant", "content": "3*5+7"}],
        [{"role": "assistant", "content": "7+5*3"}],
    ]
    im_end = tok.convert_tokens_to_ids(IM_END)
    for conv in convs:
        ids, mask = chat_example(tok, conv)
        assert len(ids) == len(mask) and set(mask) == {0, 1}
        assert all(0 <= i < len(tok) for i in ids)
        if len(conv) > 1:
            prompt = chat_prompt_ids(tok, conv[:-1])
            assert ids[: len(prompt)] == prompt
            assert not any(mask[: len(prompt)])
        learned = [t for t, m in zip(ids, mask) if m]
        assert tok.decode(learned) == conv[-1]["content"] + IM_END
        first = mask.index(1)
        assert all(mask[first : first + len(learned)])  # one contiguous span
        assert ids[first + len(learned) - 1] == im_end
        assert tok.decode(ids[first + len(learned) :]) == "\n" and mask[-1] == 0
        assert tok.decode(ids) == tok.apply_chat_template(conv, tokenize=False)
    # the learned span is what the engine would generate: the reward accepts it, as the trainers decode it
    conv = sft_examples(0)[0]
    ids, mask = chat_example(tok, conv)
    completion = [t for t, m in zip(ids, mask) if m]
    by_prompt = {prompt_messages(p)[0]["content"]: p for p in make_problems("train")}
    p = by_prompt[conv[0]["content"]]
    assert reward(p, completion_text(tok, completion)) == 1.0
    # ... but not with a special token inside it (skipping special tokens when decoding would hide them)
    for name in (IM_START, ENDOFTEXT, IM_END):
        special = tok.convert_tokens_to_ids(name)
        assert reward(p, completion_text(tok, completion[:1] + [special] + completion[1:])) == 0.0


def test_chat_bad_input(tok):
    with pytest.raises(ValueError, match="assistant"):
        chat_example(tok, [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="tool"):
        chat_prompt_ids(tok, [{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="im_end"):
        chat_example(tok, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "1<|im_end|>2"}])
    with pytest.raises(ValueError, match="round-trip"):
        chat_example(tok, [{"role": "user", "content": "x"}, {"role": "assistant", "content": "café"}])
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
