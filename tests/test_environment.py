"""
The task / environment interface (tasks/environment.py): tasks chosen by a setting,
multi-turn episodes built by ids with per-turn masks, their logprobs against the
trainer's, prefix reuse across turns, a user's JSONL task, and an environment that fails.

    python -m pytest -q tests/test_environment.py
"""

import hashlib
import json
import os

import pytest
import torch

import checkpoint
from tasks import countdown
from tasks import countdown_feedback
from tasks import countdown_full
from tasks import guess
from tasks import jsonl
import train_grpo
import training
from conftest import write_task
from engine import TrainingSample
from tasks.environment import Environment, Group, load_task
from tasks.evaluate import task_engine
from model import ModelConfig, Transformer
from test_grpo import metrics, tiny_config
from tokenizer import build_tokenizer, chat_ids


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: tiny models on one thread


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


# a multi-turn task a random model can play: every reply gets "again" until max_turns, and
# the episode scores the parity of its replies' total length (both rewards happen)
AGAIN_TASK = '''"""Countdown's prompts; the environment always answers "again"."""
from tasks.countdown import describe, kind, make_problems, prompt_messages


def reward(problem, completion_text):
    return float(len(completion_text) % 2 == 0)


def env_response(problem, messages):
    return [{"role": "user", "content": "again"}]


def episode_reward(problem, messages):
    return float(sum(len(m["content"]) for m in messages if m["role"] == "assistant") % 2 == 0)
'''


class Scripted:
    """An engine stand-in that returns replies written by the test, and records the
    prompts."""

    def __init__(self, tok, replies):
        self.tok, self.replies, self.prompts = tok, list(replies), []

    def generate(self, prompts, params, num_samples=1, first_index=0):
        out = []
        for p in prompts:
            self.prompts.append(list(p))
            for _ in range(num_samples):
                text, stopped = self.replies.pop(0)
                ids = self.tok.encode(text, add_special_tokens=False)
                ids += [self.tok.eos_token_id] if stopped else []
                out.append(TrainingSample(tuple(p), tuple(ids), tuple([-0.5] * len(ids)),
                                          finish_reason="stop" if stopped else "length",
                                          token_versions=(7,) * len(ids)))
        return out


# -----------------------------------------------------------------------------
# choosing a task


def test_a_task_is_a_setting_and_a_bad_one_is_refused(tmp_path):
    assert load_task("tasks.countdown") is countdown
    assert load_task("tasks.countdown_feedback") is countdown_feedback
    assert load_task("tasks.guess") is guess
    parity = load_task(write_task(str(tmp_path)))
    assert parity.reward(None, "ab") == 1.0 and parity.make_problems is countdown_full.make_problems
    with pytest.raises(ValueError, match="no module"):
        load_task("no_such_task")
    with pytest.raises(ValueError, match="no such file"):
        load_task(str(tmp_path / "missing.py"))
    half = write_task(str(tmp_path), "def make_problems(split, n=None):\n    return []\n",
                      "half.py")
    with pytest.raises(ValueError, match="lacks prompt_messages, reward"):
        load_task(half)
    no_env = "max_turns=3: the task 'tasks.countdown' has no env_response"
    with pytest.raises(ValueError, match=no_env):
        train_grpo.main(tiny_config(tmp_path / "x", "--task=tasks.countdown", "--max_turns=3",
                                    "--max_episode_tokens=64"))
    assert not (tmp_path / "x").exists()


# -----------------------------------------------------------------------------
# a multi-turn episode, by ids


def test_a_multi_turn_episode_is_the_template_rendering_of_its_conversation(tok):
    p = countdown.Problem((3, 5, 7), 22)
    env = Environment(countdown_feedback, tok, max_new_tokens=16, max_turns=3,
                      max_episode_tokens=96)
    engine = Scripted(tok, [("1+2", True), ("3+5+7", True), ("3*5+7", True)])
    (e,) = env.episodes(engine, [p])
    assert (e.turns, e.reward, e.finish_reason) == (3, 1.0, "stop")
    again = "\ndigits 3 5 7 target 22"
    assert [m["content"] for m in e.messages] == ["digits 3 5 7 target 22", "1+2",
                                                  "uses digits 1 2" + again, "3+5+7",
                                                  "= 15, target 22" + again, "3*5+7"]
    whole = chat_ids(tok, e.messages, False)   # the template's rendering of the whole conversation
    assert e.prompt + e.ids == whole[:-1]    # ... up to the template's newline after the last reply
    # each later turn's prompt is everything so far, by ids: the engine continues
    # from its cache
    assert engine.prompts[1] == (e.prompt + e.ids)[:len(engine.prompts[1])]
    assert engine.prompts[2] == (e.prompt + e.ids)[:len(engine.prompts[2])]
    # the mask is 1 exactly on the sampled ids: each reply and its closing <|im_end|>
    sampled = [i for i, m in zip(e.ids, e.mask) if m]
    replies = [tok.encode(r, add_special_tokens=False) + [tok.eos_token_id]
               for r in ("1+2", "3+5+7", "3*5+7")]
    assert sampled == [t for r in replies for t in r]
    runs = "".join(map(str, e.mask))
    assert runs.count("01") == 2 and runs.startswith("1") and runs.endswith("1")
    s = e.sample()
    assert s.loss_mask == tuple(e.mask) and s.prompt_tokens == tuple(e.prompt)
    assert all(lp == 0.0 for lp, m in zip(s.logprobs, e.mask) if not m)
    assert train_grpo.sampled_mask(s) == tuple(e.mask)


def test_an_episode_ends_on_a_cut_reply_on_none_and_on_its_token_budget(tok):
    p = countdown.Problem((3, 5, 7), 22)
    env = Environment(countdown_feedback, tok, max_new_tokens=16, max_turns=3,
                      max_episode_tokens=96)
    right, cut = env.episodes(Scripted(tok, [("3*5+7", True)]), [p])[0], \
        env.episodes(Scripted(tok, [("1+2", True), ("3*5+7", False)]), [p])[0]
    assert (right.turns, right.reward) == (1, 1.0)          # the environment answered None
    assert (cut.turns, cut.reward, cut.finish_reason) == (2, 0.0, "length")   # cut off: 0
    # a budget with no room for a second whole reply: the episode ends after one, scored
    # by the task
    tight = Environment(countdown_feedback, tok, max_new_tokens=16, max_turns=3,
                        max_episode_tokens=30)
    (e,) = tight.episodes(Scripted(tok, [("1+2", True)]), [p])
    assert (e.turns, e.reward, e.done) == (1, 0.0, True) and all(e.mask)
    # max_turns: the third wrong answer ends it, and the environment is not asked again
    (e,) = env.episodes(Scripted(tok, [("1+2", True)] * 3), [p])
    assert (e.turns, e.reward) == (3, 0.0) and len(e.messages) == 6


@torch.no_grad()
def test_multi_turn_logprobs_match_the_trainer_and_later_turns_reuse_the_cache(tmp_path, tok):
    again = load_task(write_task(str(tmp_path), AGAIN_TASK, "again.py"))
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                    moe_intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                    num_experts=4, num_experts_per_tok=2,
                                    max_position_embeddings=512)).eval()
    env = Environment(again, tok, max_new_tokens=40, max_turns=3, max_episode_tokens=160)
    problems = countdown.make_problems("train", 6)
    engine = task_engine(model, env, problems)
    calls, real = [], engine.generate

    def spy(prompts, params, n=1, first_index=0):
        before = engine.stats()["prefix_cache_hit_tokens"]
        out = real(prompts, params, n, first_index)
        calls.append((prompts, out, engine.stats()["prefix_cache_hit_tokens"] - before))
        return out
    engine.generate = spy
    episodes = env.episodes(engine, problems, 4, temperature=1.0, seed=5)
    assert max(e.turns for e in episodes) >= 2       # some episodes got the environment's answer
    # turn 2 on: each prompt's earlier ids were computed in the last turn, so its
    # full blocks hit
    for prompts, _, hits in calls[1:]:
        assert hits >= sum((len(p) - 1) // 16 * 16 - 16 for p in prompts) > 0
    # the mask is 1 exactly on what the engine sampled, turn after turn
    for e in episodes:
        whole = e.prompt + e.ids
        mine = [s for _, out, _ in calls for s in out
                if whole[:len(s.prompt_tokens) + len(s.completion_tokens)] ==
                list(s.prompt_tokens + s.completion_tokens)]
        assert sum(e.mask) == sum(len(s.completion_tokens) for s in mine)
    # the trainer's logprobs of the packed episodes equal the engine's on
    # every sampled token
    groups = [Group(None, [e.sample() for e in episodes[i:i + 4]], [1.0, 0, 0, 0])
              for i in range(0, len(episodes), 4)]
    c = {"group_size": 4, "scale_rewards": False, "advantage_pass_k": 1,
         "turn_baseline": False, "share_prompt": True,
         "batch_tokens": 4096}
    batches = train_grpo.build_batches(groups, c)
    masks = [b.loss_mask for b in batches]
    assert sum(int(m.sum()) for m in masks) == sum(sum(e.mask) for e in episodes)
    for b, m in zip(batches, masks):
        lp = training.batch_logprobs(model, b)[0]
        assert (lp - b.log_probs)[m].abs().max().item() < 1e-5


def test_the_same_seed_gives_the_same_episodes(tmp_path, tok):
    again = load_task(write_task(str(tmp_path), AGAIN_TASK, "again.py"))
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                    moe_intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                    num_experts=4, num_experts_per_tok=2,
                                    max_position_embeddings=512)).eval()
    env = Environment(again, tok, max_new_tokens=40, max_turns=3, max_episode_tokens=160)
    problems = countdown.make_problems("train", 4)
    runs = [[e.ids for e in env.episodes(task_engine(model, env, problems), problems, 3, 1.0, 9)]
            for _ in range(2)]
    assert runs[0] == runs[1]


# -----------------------------------------------------------------------------
# GRPO on a multi-turn task, and an environment that fails


def multi_turn(tmp_path, out, *extra):
    again = write_task(str(tmp_path), AGAIN_TASK, "again.py")
    model = {**dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                    num_experts=4, num_experts_per_tok=2), "max_position_embeddings": 512}
    return tiny_config(out, f"--task={again}", "--prompts_per_step=8", "--max_turns=3",
                       "--max_new_tokens=40",
                       "--max_episode_tokens=160", f"--model={model!r}".replace(" ", ""), *extra)


def test_grpo_trains_on_multi_turn_episodes_and_an_environment_that_raises_loses_nothing(tmp_path):
    out = tmp_path / "run"
    train_grpo.main(multi_turn(tmp_path, out, "--max_iters=2", "--ckpt_interval=2"))
    rows = [r for r in metrics(out) if "train/loss" in r]
    assert len(rows) >= 1 and all(r["train/logprob_mismatch"] < 1e-5 for r in rows)
    assert max(r["rollout/turns_mean"] for r in rows) > 1
    evals = [r for r in metrics(out) if "eval/success_by_turn_3" in r]
    assert evals and all(r["eval/success_by_turn_1"] <= r["eval/success_by_turn_3"] for r in evals)
    # resumed with an environment that raises in its second turn: the step
    # fails naming it...
    broken = write_task(str(tmp_path), AGAIN_TASK.replace(
        '    return [{"role": "user", "content": "again"}]',
        '    if len(messages) > 2:\n        raise KeyError("the sandbox is gone")\n'
        '    return [{"role": "user", "content": "again"}]'), "broken.py")
    ckpt = checkpoint.find_checkpoint(str(out))
    digest = {f: hashlib.sha256(open(os.path.join(ckpt, f), "rb").read()).hexdigest()
              for f in os.listdir(ckpt)}
    named = "env_response raised .* at turn 2: KeyError: 'the sandbox"
    with pytest.raises(RuntimeError, match=named):
        train_grpo.main(multi_turn(tmp_path, out, "--init_from=resume", "--max_iters=4",
                                   f"--task={broken}"))
    # ... and the run is as it was: the same checkpoint, which resumes with
    # the working environment
    assert {f: hashlib.sha256(open(os.path.join(ckpt, f), "rb").read()).hexdigest()
            for f in os.listdir(ckpt)} == digest
    train_grpo.main(multi_turn(tmp_path, out, "--init_from=resume", "--max_iters=4"))
    assert [r["iter"] for r in metrics(out) if "rollout/reward_mean" in r] == [1, 2, 3, 4]


def test_a_failing_rollout_leaves_the_sampler_as_it_was(tmp_path, tok):
    broken = load_task(write_task(str(tmp_path), AGAIN_TASK.replace(
        '    return [{"role": "user", "content": "again"}]', '    raise ValueError("boom")'),
        "boom.py"))
    env = Environment(broken, tok, max_new_tokens=8, max_turns=2, max_episode_tokens=40)
    engine = Scripted(tok, [("1+2", True)] * 8)
    sampler = train_grpo.ProblemSampler(countdown.make_problems("train", 10), seed=0)
    before = json.dumps(sampler.state_dict())
    config = {"group_size": 4, "prompts_per_step": 2, "temperature": 1.0, "seed": 0, "top_p": 1.0,
              "top_k": 0}
    with pytest.raises(RuntimeError, match="env_response raised on problem .* ValueError: boom"):
        train_grpo.rollout(engine, env, sampler, config, 0)
    assert json.dumps(sampler.state_dict()) == before


# -----------------------------------------------------------------------------
# a user's JSONL task


@pytest.mark.parametrize("reply, said", [
    ("83+1=84[478] 84/8=?", "84/8 is not a whole number of 1 or more"),
    ("83+1=84[478] 84/7=12[47]", "the step from 84 should be 84/7=12[48]"),
    ("83+1=84[478] 84/7=<|im_start|>", "the step from 84 should be 84/7=12[48]"),
    ("83-1=82[478] 82+4=86[78] 86=?", "7 and 8 make 1, 15, 56, not 86"),
    ("83+1=84[478] 84/7=12[48] 12=4+7", "4 and 8 do make 12, but not as the last word says"),
    ("84+1=85[478]", "the next word is a step from 83; the digits left are 1 4 7 8"),
    ("83+9=92[478]", "9 is not left: the digits left are 1 4 7 8"),
    ("83+1=84[478]", "the next word is a step from 84; the digits left are 4 7 8"),
    ("83+1=84[478]  84/7=12[48] 12=4+8",   # a double space: an empty word where a step is due
     "the next word is a step from 84; the digits left are 4 7 8"),
    ("83+1=84[478] 84/7=12[48]", "the line ends before the pair of 4 and 8"),
    ("83+1=84[478] 84/7=12[48] 12-4=8[8] 8=?", "with 4 and 8 left, the line ends with their pair"),
    ("=", "the next word is a step from 83; the digits left are 1 4 7 8"),
    ("83+1=84[478] 84/7=12[48] 12=4+8 ok", "the line goes on after its pair"),
    ("think\n(4+8)*7+1", "= 85, target 83"),
    ("4+8", "uses digits 4 8"),
])
def test_countdown_feedback_names_the_first_broken_step_of_a_chain(reply, said):
    problem = countdown.Problem(digits=(1, 4, 7, 8), target=83)
    assert countdown.reward(problem, reply) == 0.0
    assert countdown_feedback.feedback(problem, reply) == said
    messages = countdown.prompt_messages(problem) + [{"role": "assistant", "content": reply}]
    again = f"{said}\ndigits 1 4 7 8 target 83"
    assert countdown_feedback.env_response(problem, messages) == [{"role": "user",
                                                                    "content": again}]
    right = "83+1=84[478] 84/7=12[48] 12=4+8"
    assert countdown_feedback.env_response(problem, messages[:-1] + [
        {"role": "assistant", "content": right}]) is None


def test_countdown_feedback_demonstrations_answer_right_after_their_misses():
    demos = countdown_feedback.sft_examples(0, 0.05)
    assert {len(m) for m in demos} == {2, 4, 6}   # after 0, 1 or 2 misses
    problems = [p for p, _ in countdown.demonstrations(0, 0.05)]
    assert [countdown.prompt_messages(p) for p in problems] == [m[:1] for m in demos]
    for problem, messages in zip(problems, demos):
        assert countdown.reward(problem, messages[-1]["content"]) == 1.0
        for i in range(1, len(messages) - 1, 2):   # each miss, then what the environment said
            assert countdown.reward(problem, messages[i]["content"]) == 0.0
            assert countdown_feedback.env_response(problem, messages[:i + 1]) == [messages[i + 1]]


def test_higher_or_lower_says_which_way_and_the_range_left(tok):
    problem = guess.Problem(n=40, secret=23)
    messages = guess.prompt_messages(problem)
    assert messages == [{"role": "user", "content": "guess 1 to 40"}]
    for reply, said in [("17", "17 is too low: 18 to 40"), ("30", "30 is too high: 18 to 29"),
                        ("3", "3 is too low: 18 to 29"),      # a guess out of range narrows nothing
                        ("2x", "not a number: 18 to 29"), ("", "not a number: 18 to 29")]:
        messages = messages + [{"role": "assistant", "content": reply}]
        assert guess.reward(problem, reply) == 0.0
        response = guess.env_response(problem, messages)
        assert response == [{"role": "user", "content": said}]
        messages = messages + response
    messages = messages + [{"role": "assistant", "content": " 23 "}]
    assert guess.env_response(problem, messages) is None
    # as an episode: it ends at the right guess, scored by it; max_turns ends a miss
    env = Environment(guess, tok, max_new_tokens=4, max_turns=6, max_episode_tokens=256)
    (e,) = env.episodes(Scripted(tok, [("17", True), ("30", True), ("23", True)]), [problem])
    assert (e.turns, e.reward) == (3, 1.0)
    assert [m["content"] for m in e.messages[1:4]] == ["17", "17 is too low: 18 to 40", "30"]
    (e,) = env.episodes(Scripted(tok, [("20", True)] * 6), [problem])
    assert (e.turns, e.reward) == (6, 0.0)


def test_higher_or_lower_splits_are_disjoint_and_demonstrations_stay_in_range():
    splits = {s: guess.make_problems(s) for s in ("train", "val", "test")}
    assert [len(splits[s]) for s in ("val", "test")] == [guess.N_VAL, guess.N_TEST]
    everything = [p for ps in splits.values() for p in ps]
    assert len(set(everything)) == len(everything) == sum(range(10, 64))
    assert guess.make_problems("val", 3) == splits["val"][:3]
    for n in (401, -1, 2.0):
        with pytest.raises(ValueError, match=f"got {n}"):
            guess.make_problems("val", n)
    for messages in guess.sft_examples(0, 0.05):
        problem = next(p for p in splits["train"] if messages[0] == guess.prompt_messages(p)[0]
                       and all(guess.env_response(p, messages[:i + 1]) == [messages[i + 1]]
                               for i in range(1, len(messages) - 1, 2)))
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        lo, hi = guess.range_left(problem, replies[:-1])
        assert lo <= int(replies[-1]) <= hi      # each demonstrated guess is in the range left


def test_the_jsonl_task_reads_its_rows_and_scores_replies():
    train = jsonl.make_problems("train")
    assert len(train) > 1000
    assert jsonl.make_problems("val", 3) == jsonl.make_problems("val")[:3]
    row = jsonl.Row("417-8", "417-8=409")
    assert jsonl.reward(row, "417-8=409<|im_end|>") == 1.0
    assert jsonl.reward(row, " 417-8=409 ") == 1.0
    assert jsonl.reward(row, "417-8=408") == 0.0 and jsonl.reward(row, "409") == 0.0
    demos = jsonl.sft_examples(0, 0.1)
    assert len(demos) == int(0.1 * len(train)) and demos[0][1]["role"] == "assistant"
    prompts = {r.prompt for s in jsonl.SPLITS for r in jsonl.make_problems(s)}
    assert len(prompts) == sum(len(jsonl.make_problems(s)) for s in jsonl.SPLITS)


@pytest.mark.parametrize("line,named", [
    ('{"split": "train", "answer": "3"}', "line 2: missing field 'prompt'"),
    ('{"split": "train", "prompt": "  ", "answer": "3"}', "line 2: field 'prompt' must be"),
    ('{"split": "dev", "prompt": "1+2=", "answer": "3"}', "line 2: field 'split' must be one of"),
    ('{"split": "train", "prompt": "1+2=", "answer": 3}', "line 2: field 'answer' must be"),
    ('{"split": "train", "prompt": "1+2="', "line 2: not JSON"),
])
def test_a_bad_jsonl_row_is_refused_naming_file_line_and_field(tmp_path, line, named):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"split": "train", "prompt": "1+1=", "answer": "2"}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"{path}, {named}"):
        jsonl.load_rows(str(path))


def test_a_task_file_imports_its_neighbours_and_bad_returns_are_named(tmp_path, tok):
    # a task file next to a module of its own, with a dataclass under postponed annotations
    (tmp_path / "my_rows.py").write_text("ROWS = {'train': ['ab', 'cd']}\n")
    path = write_task(str(tmp_path), '''from __future__ import annotations
from dataclasses import dataclass
from my_rows import ROWS


@dataclass(frozen=True)
class Item:
    text: str


def make_problems(split, n=None):
    return [Item(t) for t in ROWS[split]][:n]


def prompt_messages(item):
    return [{"role": "user", "content": item.text}]


def reward(item, completion_text):
    return BAD if item.text == "cd" else float(completion_text == item.text[::-1])
''', "rev.py")
    rev = load_task(path)
    assert rev.make_problems("train")[0] == rev.Item("ab")
    env = Environment(rev, tok, max_new_tokens=8)
    # the reward reads the reply without its closing <|im_end|>
    (e,) = env.episodes(Scripted(tok, [("ba", True)]), rev.make_problems("train", 1))
    assert e.reward == 1.0
    for bad in ("float('nan')", "None", "'1'"):
        rev.BAD = eval(bad)
        named = r"reward raised on problem Item\(text='cd'\) at turn 1: ValueError: returned"
        with pytest.raises(RuntimeError, match=named + " .*finite number"):
            env.episodes(Scripted(tok, [("dc", True)]), rev.make_problems("train")[1:])
    # an environment that answers [] (neither messages nor None) is named too
    silent = load_task(write_task(str(tmp_path), AGAIN_TASK.replace(
        '[{"role": "user", "content": "again"}]', '[]'), "silent.py"))
    env = Environment(silent, tok, max_new_tokens=8, max_turns=2, max_episode_tokens=40)
    with pytest.raises(RuntimeError, match="env_response raised .* at turn 1: ValueError: returned "
                                           r"\[\]"):
        env.episodes(Scripted(tok, [("1+2", True)]), countdown.make_problems("train", 1))
    with pytest.raises(ValueError, match="max_episode_tokens=0: a multi-turn episode"):
        Environment(silent, tok, max_new_tokens=8, max_turns=2)
    with pytest.raises(ValueError, match="raised while loading: ModuleNotFoundError"):
        load_task(write_task(str(tmp_path), "import no_such_thing\n", "broken_import.py"))
