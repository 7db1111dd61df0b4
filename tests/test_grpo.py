"""
train_grpo.py: advantages and zero-variance filtering on hand-made groups, the batch it
trains on, a few-iteration run on a tiny model (weight versions advance, samples carry
them, the loss is finite, engine == trainer logprobs), the skip-the-step path when no
group has variance, and a run killed mid-way that resumes exactly.

The tiny model starts from scratch, so the task's real reward would be 0 everywhere;
these tests swap in a reward with variance (completion length parity), which exercises
the same loop.
"""
import dataclasses
import json
import math
import os

import numpy as np
import pytest
import torch

import checkpoint
from tasks import countdown
import train_grpo
import train_grpo_async
import training
from configurator import configure
from conftest import PARITY_TASK, write_task
from engine import TrainingSample
from tasks.environment import Environment, Episode, Group
from model import ModelConfig, Transformer
from tokenizer import build_tokenizer
from train_grpo import build_batches, group_advantages, zero_variance_groups


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: tiny models on one thread


# -----------------------------------------------------------------------------
# advantages


def test_group_advantages_centre_each_group():
    r = [1, 0, 0, 1, 1, 1, 1, 0]
    adv = group_advantages(r, 4)
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]))
    assert torch.allclose(adv.view(2, 4).sum(1), torch.zeros(2))


def test_group_advantages_scaled_by_group_std():
    adv = group_advantages([1, 0, 0, 1, 2, 2, 2, 2], 4, scale_rewards=True)
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(adv[4:], torch.zeros(4))   # a flat group stays 0 (eps keeps it finite)


def test_pass_at_k_advantages_against_every_subset():
    # each sample's advantage from the definition: the k-subsets of its group, each scoring
    # 1 if any member is right; the mean over the subsets that hold the sample minus the
    # mean over all, over the subsets' std
    import itertools
    from statistics import mean, pstdev
    rewards = [1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 1, 1]
    for k in (1, 2, 3, 5):
        want = []
        for g in range(3):
            group = rewards[8 * g:8 * (g + 1)]
            subsets = list(itertools.combinations(range(8), k))
            score = {s: max(group[i] for i in s) for s in subsets}
            all_mean, std = mean(score.values()), pstdev(score.values())
            for i in range(8):
                held = mean(score[s] for s in subsets if i in s)
                want.append((held - all_mean) / (std + 1e-6))
        got = train_grpo.pass_at_k_advantages(rewards, 8, k, scale_rewards=True)
        assert torch.allclose(got, torch.tensor(want), atol=1e-5), k
    # k = 1 is GRPO's group advantage, scaled or not; the docstring's worked example
    for scale in (False, True):
        assert torch.allclose(train_grpo.pass_at_k_advantages(rewards, 8, 1, scale),
                              group_advantages(rewards, 8, scale), atol=1e-6)
    assert torch.allclose(train_grpo.pass_at_k_advantages([1, 0, 0, 0], 4, 2),
                          torch.tensor([0.5, -1 / 6, -1 / 6, -1 / 6]))
    with pytest.raises(ValueError, match="0/1 rewards"):
        train_grpo.pass_at_k_advantages([1, 0.5, 0, 0], 4, 2)


def test_zero_variance_groups():
    flat = zero_variance_groups([1, 1, 1, 0, 0, 0, 1, 0, 0], 3)
    assert flat.tolist() == [True, True, False]


def test_turn_baseline_scores_each_reply_against_the_episodes_that_reached_it():
    # the docstring's example: rewards 1, 0, 1, 0 from episodes of 1, 3, 2 and 3 replies
    # (a reply is a run of sampled ids, mask 1; the environment's ids between replies
    # have mask 0)
    def mask(replies):
        return [1, 1] + [0, 0, 1, 1] * (replies - 1)
    masks = [mask(n) for n in (1, 3, 2, 3)]
    rewards = [1.0, 0.0, 1.0, 0.0]
    c = {"group_size": 4, "scale_rewards": False, "advantage_pass_k": 1, "turn_baseline": True}
    got = train_grpo.token_advantages(masks, rewards, c)
    third = 1 / 3
    assert got[0] == pytest.approx([0.5, 0.5])
    assert got[1] == pytest.approx([-0.5, -0.5, 0, 0, -third, -third, 0, 0, 0, 0])
    assert got[2] == pytest.approx([0.5, 0.5, 0, 0, 2 * third, 2 * third])
    assert got[3] == pytest.approx([-0.5, -0.5, 0, 0, -third, -third, 0, 0, 0, 0])
    # without it every sampled token carries the episode's group advantage
    plain = train_grpo.token_advantages(masks, rewards, {**c, "turn_baseline": False})
    assert plain[2] == pytest.approx([0.5, 0.5, 0, 0, 0.5, 0.5])
    # one-reply episodes: the same either way
    single = [mask(1) for _ in range(4)]
    assert train_grpo.token_advantages(single, rewards, c) == \
        train_grpo.token_advantages(single, rewards, {**c, "turn_baseline": False})


@pytest.mark.parametrize("rewards,g", [([1, 0, 1], 2), ([], 2), ([[1, 0]], 2)])
def test_group_advantages_bad_shapes(rewards, g):
    with pytest.raises(ValueError, match="whole groups"):
        group_advantages(rewards, g)


def test_batch_weights_are_advantage_on_completion_only():
    def sample(comp, lps):
        return TrainingSample(prompt_tokens=(1, 5, 6), completion_tokens=comp, logprobs=lps)
    groups = [Group(None, [sample((7, 2), (-0.1, -0.2)), sample((8, 9, 2), (-0.3, -0.4, -0.5))],
                    [1.0, 0.0])]
    c = {"group_size": 2, "scale_rewards": False, "advantage_pass_k": 1,
         "turn_baseline": False, "share_prompt": False,
         "batch_tokens": 64}
    (b,) = build_batches(groups, c)
    assert b.tokens.tolist() == [1, 5, 6, 7, 2, 1, 5, 6, 8, 9, 2]
    # row j is scored on labels[j]: the prompt's last row predicts the first completion
    # token
    assert b.token_weights.tolist() == [0, 0, 0.5, 0.5, 0, 0, 0, -0.5, -0.5, -0.5, 0]
    assert b.labels.tolist() == [5, 6, 7, 2, 0, 5, 6, 8, 9, 2, 0]
    assert torch.allclose(b.log_probs,
                          torch.tensor([0, 0, -0.1, -0.2, 0, 0, 0, -0.3, -0.4, -0.5, 0]))
    assert b.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5] and b.seqlens() == [5, 6]
    # share_prompt: the prompt's rows once (but its last token, which starts
    # each sample's branch)
    (b,) = build_batches(groups, {**c, "share_prompt": True})
    assert b.tokens.tolist() == [1, 5, 6, 7, 2, 6, 8, 9, 2]
    assert b.branch.tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert b.position_ids.tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 5] and b.seqlens() == [9]
    # a branch's last row: a placeholder, weight 0
    assert b.labels.tolist() == [5, 6, 7, 2, 6, 8, 9, 2, 0]
    assert b.token_weights.tolist() == [0, 0, 0.5, 0.5, 0, -0.5, -0.5, -0.5, 0]
    assert torch.allclose(b.log_probs, torch.tensor([0, 0, -0.1, -0.2, 0, -0.3, -0.4, -0.5, 0]))


# -----------------------------------------------------------------------------
# tiny runs

TINY = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
            num_experts_per_tok=2, max_position_embeddings=128)


# the off-policy settings off (train_grpo_async's defaults) and the temperature the trainer
# scores at, for configs written out by hand
NO_CORRECTION = {"mis_low": 0.0, "mis_high": 0.0, "is_level": "token", "ppo_clip": 0.0,
                 "ppo_epochs": 1, "record_routes": False, "routing_replay": False,
                 "temperature": 1.0}


def tiny_config(out_dir, *extra, script=train_grpo):
    # the parity task (conftest.PARITY_TASK): countdown's problems, a reward a random
    # model can earn; script's settings (train_grpo or train_grpo_async)
    settings = {k: v for k, v in vars(script).items() if not k.startswith("_")}
    parity = write_task(os.path.dirname(str(out_dir)))
    args = [f"--task={parity}", "--init_from=scratch", f"--out_dir={out_dir}",
            f"--model={TINY!r}".replace(" ", ""), "--prompts_per_step=4", "--group_size=4",
            "--max_new_tokens=8", "--n_eval_problems=8", "--pass_k=2", "--learning_rate=3e-3",
            "--warmup_iters=0", "--eval_interval=100", "--log_interval=1", *extra]
    return configure(settings, args, stage="grpo")


def metrics(out_dir):
    with open(out_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_tiny_run_versions_advance_and_loss_is_finite(tmp_path, monkeypatch):
    seen = []
    real_rollout = train_grpo.rollout

    def spy(engine, tok, sampler, c, it):
        groups, flops, m = real_rollout(engine, tok, sampler, c, it)
        seen.append((it, engine.get_weight_version(), [s for g in groups for s in g.samples]))
        return groups, flops, m

    monkeypatch.setattr(train_grpo, "rollout", spy)
    out = tmp_path / "run"
    final = train_grpo.main(tiny_config(out, "--max_iters=3", "--ckpt_interval=100"))

    # one hot-swap per optimizer step
    assert [(it, v) for it, v, _ in seen] == [(0, 0), (1, 1), (2, 2)]
    for it, v, samples in seen:
        assert samples, "the parity reward must leave groups with variance"
        assert all(s.weight_version == v and set(s.token_versions) == {v} for s in samples)
    rows = [r for r in metrics(out) if "train/loss" in r]
    assert [r["iter"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"])
        assert r["train/logprob_mismatch"] < 1e-4    # fp32 engine and trainer hold the same weights
        drawn = r["rollout/valid_groups"] + r["rollout/zero_var_groups"]
        assert drawn == 4 == r["rollout/problems"]
        assert 0 <= r["rollout/reward_mean"] <= 1
    assert [r["rollout/weight_version"] for r in rows] == [0, 1, 2]
    evals = [r for r in metrics(out) if "eval/accuracy" in r]
    assert [r["iter"] for r in evals] == [0, 3]
    assert set(final) == {"eval/accuracy", "eval/accuracy_3digits", "eval/accuracy_4digits",
                          "eval/pass@1", "eval/pass@2"}
    assert all(0 <= v <= 1 for v in final.values())
    meta = checkpoint.read_checkpoint_meta(checkpoint.find_checkpoint(str(out)))
    assert meta["iter"] == 3 and meta["extra"]["weight_version"] == 3


@pytest.mark.parametrize("script, extra", [(train_grpo, []), (train_grpo_async, ["--tis_cap=2.0"])],
                         ids=["on_policy", "async_tis"])
def test_rollouts_at_another_temperature_are_trained_on_policy(tmp_path, script, extra):
    # the engine's logprobs are log_softmax(logits / T): the trainer must score the same
    # distribution (scoring it at T = 1 measured a mismatch of ~0.1 at T = 0.5, and TIS
    # would then correct by p_1 / p_T). With TIS the mismatch is the logprob pass's
    out = tmp_path / "cool"
    script.main(tiny_config(out, "--max_iters=2", "--temperature=0.5", "--ckpt_interval=100",
                            *extra, script=script))
    rows = [r for r in metrics(out) if "train/loss" in r]
    assert len(rows) == 2 and all(r["train/logprob_mismatch"] < 1e-4 for r in rows)
    assert all(math.isfinite(r["train/loss"]) for r in rows)


def test_no_variance_skips_the_step_and_the_sampler_turns_away(tmp_path, monkeypatch):
    never = write_task(str(tmp_path), PARITY_TASK.replace("len(completion_text) % 2 == 0", "False"),
                       "never_right.py")
    out = tmp_path / "flat"
    train_grpo.main(tiny_config(out, "--max_iters=2", "--ckpt_interval=1", f"--task={never}"))
    rows = [r for r in metrics(out) if "rollout/reward_mean" in r]
    # one rollout call of 4 prompts a step, all flat
    assert [r["rollout/zero_var_groups"] for r in rows] == [4, 4]
    assert all(r["rollout/valid_groups"] == 0 and "train/loss" not in r for r in rows)
    state = checkpoint.read_checkpoint_meta(checkpoint.find_checkpoint(str(out)))["data_state"]
    sampler = train_grpo.ProblemSampler(countdown.make_problems("train", full=True), seed=0)
    sampler.load_state_dict(state)   # 8 problems solved 0 of 4 times: weight (1/6)(5/6), others 1/4
    assert state["taken"] == 8 and sum(state["samples"]) == 32
    assert sum(state["successes"]) == 0
    assert sorted(set(sampler.weights().round(4).tolist())) == [round(5 / 36, 4), 0.25]
    # no step, but a version per iteration (the same weights): rollout ranks count on
    # one per iteration
    assert [r["rollout/weight_version"] for r in rows] == [0, 1]


# the off-policy corrections at once (training.py): routes recorded and replayed,
# masked IS of the sequence ratio, PPO's clip over two epochs: resume and torchrun carry
# their new fields
CORRECTED = ["--routing_replay=True", "--mis_low=0.5", "--mis_high=2.0", "--is_level=sequence",
             "--ppo_clip=0.2", "--ppo_epochs=2"]


def killed_at_3_then_resumed(monkeypatch, out, settings, script=train_grpo):
    """Run script with tiny_config(out, *settings), killed during iteration 4 (after the
    checkpoint at 2 and iteration 3's log line), then resumed to its end
    (init_from='resume')."""
    real_rollout = train_grpo.rollout

    class Killed(Exception):
        pass

    def dies_at_3(engine, env, sampler, c, it):
        if it == 3:
            raise Killed
        return real_rollout(engine, env, sampler, c, it)

    monkeypatch.setattr(train_grpo, "rollout", dies_at_3)
    with pytest.raises(Killed):
        script.main(tiny_config(out, *settings, script=script))
    assert checkpoint.read_checkpoint_meta(checkpoint.find_checkpoint(str(out)))["iter"] == 2
    monkeypatch.setattr(train_grpo, "rollout", real_rollout)
    script.main(tiny_config(out, *settings, "--init_from=resume", script=script))


@pytest.mark.parametrize("corrections", [[], CORRECTED], ids=["plain", "corrected"])
def test_killed_run_resumes_exactly(tmp_path, monkeypatch, corrections):
    # the corrections are train_grpo_async.py's
    script = train_grpo_async if corrections else train_grpo
    common = ["--max_iters=4", "--lr_decay_iters=4", "--ckpt_interval=2", *corrections]
    whole = tmp_path / "whole"
    script.main(tiny_config(whole, *common, script=script))
    killed = tmp_path / "killed"
    killed_at_3_then_resumed(monkeypatch, killed, common, script)

    a, b = metrics(whole), metrics(killed)
    assert [r["iter"] for r in a] == [r["iter"] for r in b]
    if corrections:   # the corrections ran: routes replayed, PPO's second epoch clipped some
        steps = [r for r in a if "train/loss" in r]
        assert all(r["offpolicy/expert_disagreement"] == 0.0 for r in steps)
        assert all("offpolicy/corrected" in r for r in steps)
        assert any(r["offpolicy/ppo_clipped"] > 0 for r in steps)
    for ra, rb in zip(a, b):
        for k in ("train/loss", "rollout/reward_mean", "rollout/weight_version", "eval/accuracy",
                  "eval/pass@1"):
            if k in ra:
                assert abs(ra[k] - rb[k]) <= 1e-5, (ra["iter"], k, ra[k], rb[k])
    wa = checkpoint.load_hf_checkpoint(str(whole / "ckpt")).state_dict()
    wb = checkpoint.load_hf_checkpoint(str(killed / "ckpt")).state_dict()
    assert all(torch.allclose(wa[n], wb[n], atol=1e-6) for n in wa)


def test_an_engine_asleep_through_each_step_changes_nothing(tmp_path):
    # engine_sleep frees the engine's weights and KV pool for the step, and the update
    # after it brings them back: the same run, number for number
    runs = []
    for sleep in (False, True):
        out = tmp_path / f"sleep_{sleep}"
        train_grpo.main(tiny_config(out, "--max_iters=2", "--ckpt_interval=2",
                                    "--eval_interval=2", f"--engine_sleep={sleep}"))
        runs.append(out)
    a, b = (metrics(out) for out in runs)
    assert len(a) == len(b) and any("eval/accuracy" in r for r in a)
    for ra, rb in zip(a, b):
        for k in ("train/loss", "rollout/reward_mean", "rollout/weight_version",
                  "eval/accuracy", "eval/pass@1"):
            assert ra.get(k) == rb.get(k), (ra["iter"], k)
    wa, wb = (checkpoint.load_hf_checkpoint(str(out / "ckpt")).state_dict() for out in runs)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="prompts_per_stepp"):
        tiny_config(tmp_path, "--prompts_per_stepp=3")
    with pytest.raises((TypeError, ValueError), match="group_size"):
        tiny_config(tmp_path, "--group_size=abc")
    for bad in ("--group_size=1", "--prompts_per_step=0", "--tis_cap=-1", "--temperature=-0.5",
                "--temperature=0",
                "--eval_interval=0", "--ckpt_interval=0", "--min_lr=-0.5"):
        script = train_grpo_async if bad == "--tis_cap=-1" else train_grpo
        with pytest.raises(ValueError, match=bad[2:].split("=")[0]):
            script.check_settings(tiny_config(tmp_path, bad, script=script))


def test_bad_rollout_rank_settings_are_refused_before_any_work(tmp_path):
    def config(*bad, out=tmp_path):   # train_grpo_async.py's settings
        return tiny_config(out, *bad, script=train_grpo_async)
    for bad, says in (("--rollout_ranks=-1", "rollout_ranks=-1"),
                      ("--max_staleness=1", "set rollout_ranks"),
                      ("--weight_bucket_mb=0", "weight_bucket_mb=0")):
        with pytest.raises(ValueError, match=says):
            train_grpo_async.check_settings(config(bad))
    with pytest.raises(ValueError, match="engine_sleep is the colocated engine's"):
        train_grpo_async.check_settings(config("--rollout_ranks=1", "--engine_sleep=True"))
    with pytest.raises(ValueError,
                       match="max_staleness=2 trains on samples of older weights: set tis_cap"):
        train_grpo_async.check_settings(config("--rollout_ranks=1", "--max_staleness=2"))
    # one process has no rank to spare for sampling: refused before out_dir exists
    with pytest.raises(ValueError,
                       match="rollout_ranks=1: expected an int >= 1 that leaves at least one of "
                       "the job's 1 ranks"):
        train_grpo_async.main(config("--rollout_ranks=1", out=tmp_path / "none"))
    assert not (tmp_path / "none").exists()


def test_problem_sampler_weighs_a_hand_made_record_by_p_times_1_minus_p():
    problems = countdown.make_problems("train")[:4]
    sampler = train_grpo.ProblemSampler(problems, seed=3)
    # problem 0: never sampled; 1: 4 of 8 right; 2: 8 of 8; 3: 0 of 8
    sampler.record([1, 2, 3], [4, 8, 0], 8)
    assert sampler.weights().tolist() == pytest.approx([0.25, 0.25, 0.09, 0.09])
    counts = np.zeros(4)
    for _ in range(4000):
        drawn = sampler.draw(1)
        sampler.record(drawn, [0], 0)
        counts[drawn] += 1
    expected = np.array([0.25, 0.25, 0.09, 0.09]) / 0.68
    assert counts / counts.sum() == pytest.approx(expected, abs=0.02)
    assert sampler.draws == 4001 and sampler.taken == 4003   # the hand-made record was a draw too
    pair = sampler.draw(4)
    assert sorted(pair) == [0, 1, 2, 3]               # a step's problems are distinct
    assert sampler.draw(4) == pair and sampler.draws == 4001   # only recording an outcome moves on
    # the state is the record and the draw count: a copy draws the same problems

    def draws(s):
        out = []
        for _ in range(5):
            out.append(s.draw(2))
            s.record(out[-1], [1, 0], 8)
        return out
    copy = train_grpo.ProblemSampler(problems, seed=3)
    copy.load_state_dict(json.loads(json.dumps(sampler.state_dict())))
    assert draws(copy) == draws(sampler)
    # a trainer that follows a worker's draws holds the worker's state
    follower = train_grpo.ProblemSampler(problems, seed=3)
    follower.load_state_dict(sampler.state_dict())
    drawn = sampler.draw(2)
    sampler.record(drawn, [1, 2], 8)
    follower.follow(drawn, [1, 2], 8)
    assert follower.state_dict() == sampler.state_dict()
    with pytest.raises(RuntimeError, match="records differ"):   # a draw this record never makes
        follower.follow([3, 2] if sampler.draw(2) != [3, 2] else [2, 3], [0, 0], 8)
    for bad in ({"draws": -1}, {**sampler.state_dict(), "samples": [0] * 3},
                {**sampler.state_dict(), "successes": [9, 0, 0, 0], "samples": [8, 0, 0, 0]},
                {**sampler.state_dict(), "samples": [8.5, 0, 0, 0]}):
        with pytest.raises(ValueError, match="bad data state"):
            copy.load_state_dict(bad)


# -----------------------------------------------------------------------------
# the reward of a truncated completion, the loss normalizers, TIS and the KL term,
# on hand-made numbers


def test_a_truncated_completion_scores_zero():
    tok = build_tokenizer()
    p = countdown.Problem((3, 5, 7), 22)
    ids = tok.encode("3*5+7", add_special_tokens=False)
    stopped = TrainingSample(prompt_tokens=(1,), completion_tokens=tuple(ids + [tok.eos_token_id]),
                             logprobs=(0.0,) * (len(ids) + 1), finish_reason="stop")
    cut = TrainingSample(prompt_tokens=(1,), completion_tokens=tuple(ids),
                         logprobs=(0.0,) * len(ids), finish_reason="length")
    env = Environment(countdown, tok, max_new_tokens=16)

    def scored(sample):
        episode = Episode(p, countdown.prompt_messages(p), [1])
        env.take_reply(episode, sample, 1)
        return episode.done, episode.reward
    assert scored(stopped) == (True, 1.0)
    assert scored(cut) == (True, 0.0)      # the right text, but it never stopped


def two_groups(engine_logprob=None):
    # two groups of 2; sample completions of 2, 3, 1 and 2 tokens after a 3-token prompt
    def sample(comp, lps):
        lps = lps if engine_logprob is None else (engine_logprob,) * len(lps)
        return TrainingSample(prompt_tokens=(1, 5, 6), completion_tokens=comp, logprobs=lps,
                              finish_reason="stop")
    return [Group(None, [sample((7, 2), (-0.1, -0.2)), sample((8, 9, 2), (-0.3, -0.4, -0.5))],
                  [1.0, 0.0]),
            Group(None, [sample((2,), (-0.6,)), sample((9, 2), (-0.7, -0.8))], [0.0, 1.0])]


def test_loss_normalizers_on_hand_made_batches():
    groups = two_groups()
    c = {"group_size": 2, "scale_rewards": False, "advantage_pass_k": 1,
         "turn_baseline": False, "share_prompt": True,
         "batch_tokens": 8, "prompts_per_step": 4, "max_new_tokens": 16, "max_turns": 1}
    batches = build_batches(groups, c)
    assert len(batches) > 1                                     # the normalizer spans micro-batches
    masks = [b.loss_mask for b in batches]
    assert sum(int(m.sum()) for m in masks) == 2 + 3 + 1 + 2      # the completion tokens
    assert train_grpo.loss_normalizer(batches, {**c, "loss_norm": "constant"}) == 4 * 2 * 16
    assert train_grpo.loss_normalizer(batches, {**c, "loss_norm": "tokens"}) == 8
    assert train_grpo.loss_normalizer(batches,
                                      {**c, "loss_norm": "weights"}) == pytest.approx(8 * 0.5)
    # the constant normalizer does not move with the batch: a step with fewer samples keeps
    # the same denominator
    one = build_batches(groups[:1], c)
    assert train_grpo.loss_normalizer(one, {**c, "loss_norm": "constant"}) == 4 * 2 * 16


class FixedLogits:
    """A stand-in model whose next-token log-probabilities are given per row (vocab of
    16): row t puts logprob_of_label[t] on its label batch_labels[t] and spreads the
    rest of the mass evenly. Its "hidden states" are those logits, and its head reads
    them, as Transformer's logprobs reads its own."""

    def __init__(self, logprob_of_label, batch_labels):
        self.logprob_of_label, self.batch_labels = logprob_of_label, batch_labels

    def __call__(self, tokens, position_ids, cu_seqlens, branch=None):
        T = tokens.numel()
        p = torch.exp(self.logprob_of_label)
        rest = ((1 - p) / 15).clamp(min=1e-12).log()
        logits = rest[:, None].repeat(1, 16)
        logits[torch.arange(T), self.batch_labels] = self.logprob_of_label
        return logits, []

    def logprobs(self, hidden, labels, temperature=1.0):
        return torch.log_softmax(hidden / temperature, -1).gather(1, labels[:, None])[:, 0]

    def aux_loss(self, router_logits, like):
        return torch.zeros(())


def test_tis_is_the_papers_estimator_outside_the_normalizer():
    groups = two_groups(engine_logprob=-2.0)
    c = {"group_size": 2, "scale_rewards": False, "advantage_pass_k": 1,
         "turn_baseline": False, "share_prompt": True,
         "batch_tokens": 64, "prompts_per_step": 2, "max_new_tokens": 4, "max_turns": 1,
         "loss_norm": "weights", "tis_cap": 2.0, "kl_coef": 0.0, **NO_CORRECTION}
    (b,) = build_batches(groups, c)
    masks = [b.loss_mask]
    normalizer = train_grpo.loss_normalizer([b], c)
    # the trainer's logprob of each label: the engine's + log(3) on the first completion
    # row (ratio 3, capped at 2), - log(2) on every other completion row (ratio 0.5)
    trainer = b.log_probs.clone()
    rows = masks[0].nonzero().flatten()
    trainer[rows] += torch.log(torch.tensor(0.5))
    trainer[rows[0]] = b.log_probs[rows[0]] + torch.log(torch.tensor(3.0))
    model = FixedLogits(trainer, b.labels)
    (out,), _ = train_grpo_async.apply_corrections([b], model, None,
                                             torch.autocast("cpu", enabled=False), c)
    ratio = torch.where(masks[0], torch.full_like(trainer, 0.5), torch.ones_like(trainer))
    ratio[rows[0]] = 2.0
    assert torch.allclose(out.token_weights, b.token_weights * ratio, atol=1e-5)
    assert normalizer == pytest.approx(8 * 0.5)          # computed before: the ratios are not in it


def test_the_steps_own_forward_measures_the_mismatch_and_no_logprob_pass_runs_without_corrections():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, num_experts=4)
    model = Transformer(cfg)
    groups = two_groups()
    c = {"group_size": 2, "scale_rewards": False, "advantage_pass_k": 1,
         "turn_baseline": False, "share_prompt": True,
         "batch_tokens": 64, "prompts_per_step": 2, "max_new_tokens": 4, "max_turns": 1,
         "loss_norm": "constant", "tis_cap": 0.0, "kl_coef": 0.0, **NO_CORRECTION}
    (b,) = build_batches(groups, c)
    masks = [b.loss_mask]

    def no_pass(*args, **kwargs):
        raise AssertionError("a logprob pass ran with nothing to fold")
    assert train_grpo_async.apply_corrections([b], no_pass, None, None, c) == ([b], {})
    # the sampler's logprobs: the model's own, off by 0.3 on the first completion row and
    # by 0.1 on the others
    off = torch.where(masks[0], torch.full_like(b.log_probs, 0.1), torch.zeros_like(b.log_probs))
    off[masks[0].nonzero().flatten()[0]] = 0.3
    own = train_grpo_async.trainer_logprobs(model, b, torch.autocast("cpu", enabled=False), 1.0)
    b = dataclasses.replace(b, log_probs=own + off)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    metrics = training.train_step(model, optimizer, [b], 1e-3, normalizer=16.0)
    assert metrics["train/logprob_mismatch"] == pytest.approx((0.3 + 7 * 0.1) / 8, rel=1e-4)
    sft_like = dataclasses.replace(b, log_probs=None)
    assert "train/logprob_mismatch" not in training.train_step(model, optimizer, [sft_like], 1e-3)


def test_kl_coef_pulls_the_policy_back_toward_the_reference():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, num_experts=4)
    reference = Transformer(cfg).eval()
    policy = Transformer(cfg)
    policy.load_state_dict(reference.state_dict())
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    groups = two_groups()
    c = {"group_size": 2, "scale_rewards": False, "advantage_pass_k": 1,
         "turn_baseline": False, "share_prompt": True,
         "batch_tokens": 64, "prompts_per_step": 2, "max_new_tokens": 4, "max_turns": 1,
         "loss_norm": "tokens", "tis_cap": 0.0, "kl_coef": 1.0, **NO_CORRECTION}
    (b,) = build_batches(groups, c)
    # no advantage: the KL term alone
    b = dataclasses.replace(b, token_weights=torch.zeros_like(b.token_weights))
    masks = [b.loss_mask]
    off = torch.autocast("cpu", enabled=False)

    def gap():
        # the weights -(log p - log p_ref) make the step a gradient step on
        # 1/2 sum (log p - log p_ref)^2 over these tokens (and, over tokens sampled from the
        # policy, on the KL to the reference)
        lp = train_grpo_async.trainer_logprobs(policy, b, off, 1.0)
        ref = train_grpo_async.trainer_logprobs(reference, b, off, 1.0)
        return float(((lp - ref)[masks[0]] ** 2).sum() / 2)

    before = gap()
    assert before > 0
    (weighted,), _ = train_grpo_async.apply_corrections([b], policy, reference, off, c)
    lp = train_grpo_async.trainer_logprobs(policy, b, off, 1.0)
    ref = train_grpo_async.trainer_logprobs(reference, b, off, 1.0)
    assert torch.allclose(weighted.token_weights, torch.where(masks[0], -(lp - ref), 0.0),
                          atol=1e-6)
    optimizer = torch.optim.SGD(policy.parameters(), lr=1e-3)
    training.train_step(policy, optimizer, [weighted], lr=1e-3, grad_clip=0.0, normalizer=1.0)
    assert gap() < before                                 # one step toward the reference


def test_bad_grpo_settings_are_refused(tmp_path):
    for bad, named in (("--top_p=0", "top_p"), ("--top_k=-1", "top_k")):
        with pytest.raises(ValueError, match=named):
            train_grpo.check_settings(tiny_config(tmp_path, bad))
    # the corrections' settings: train_grpo_async.py's
    for bad, named in (("--tis_cap=2", "truncated and masked"), ("--mis_low=1.5", "must hold 1"),
                       ("--is_level=episode", "is_level"), ("--ppo_epochs=2", "ppo_clip"),
                       ("--ppo_clip=1.5", "ppo_clip")):
        extra = ("--mis_high=2",) if bad in ("--tis_cap=2", "--mis_low=1.5") else ()
        with pytest.raises(ValueError, match=named):
            train_grpo_async.check_settings(
                tiny_config(tmp_path, bad, *extra, script=train_grpo_async))
    with pytest.raises(ValueError, match="loss_norm"):
        train_grpo.check_settings(tiny_config(tmp_path, "--loss_norm=mean"))
    for bad in (("--advantage_pass_k=0",), ("--advantage_pass_k=4",),   # group_size=4
                ("--advantage_pass_k=2", "--turn_baseline=True")):
        with pytest.raises(ValueError, match="advantage_pass_k"):
            train_grpo.check_settings(tiny_config(tmp_path, *bad))
    with pytest.raises(ValueError, match="kl_coef"):
        # tiny_config starts from scratch
        train_grpo_async.check_settings(
            tiny_config(tmp_path, "--kl_coef=0.1", script=train_grpo_async))


def test_the_confirmatory_split_is_scored_with_its_outcomes_and_other_splits_refused(tmp_path):
    out = tmp_path / "confirm"
    final = train_grpo.main(tiny_config(out, "--task=tasks.countdown", "--max_iters=0",
                                        "--eval_split=confirm", "--n_eval_problems=6"))
    with open(out / "outcomes.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [(tuple(r["digits"]), r["target"]) for r in rows] == \
        [(p.digits, p.target) for p in countdown.make_problems("confirm", 6)]
    assert final["eval/accuracy_5digits"] == final["eval/accuracy"]
    with pytest.raises(ValueError, match="eval_split='train'"):
        train_grpo.check_settings(tiny_config(tmp_path, "--eval_split=train"))


def test_keep_best_saves_the_best_validation_model_and_survives_resume(tmp_path, monkeypatch):
    out = tmp_path / "es"
    train_grpo.main(tiny_config(out, "--max_iters=4", "--eval_interval=1", "--ckpt_interval=2",
                                "--keep_best=True"))
    evals = [r for r in metrics(out) if "eval/accuracy" in r]
    top = max(r["eval/accuracy"] for r in evals)
    meta = checkpoint.read_checkpoint_meta(checkpoint.find_checkpoint(str(out)))
    assert meta["extra"]["best"] == {"accuracy": top,
                                     "iter": min(r["iter"] for r in evals
                                                 if r["eval/accuracy"] == top)}
    best = checkpoint.load_hf_checkpoint(str(out / "best"))
    assert best.config.vocab_size > 0 and (out / "best" / "tokenizer.json").exists()
    # the best model is the one of its iteration: scored again, it gets the logged accuracy
    again = train_grpo.main(tiny_config(tmp_path / "again", f"--init_from={out / 'best'}",
                                        "--max_iters=0", "--n_eval_problems=8"))
    assert again["eval/accuracy"] == top
