"""
train_grpo_async --rollout_ranks on 2 gloo ranks under real torchrun (rank 0 trains, rank 1 only
samples): with max_staleness=0 the colocated single process's samples and steps exactly
(also on 3 ranks split either way), a resumed run that trains no sample twice, and with
max_staleness=1 sampling overlapped with training, no sample more than one version stale.

    python -m pytest -q tests/test_rollout_ranks.py
"""

import json

import numpy as np
import pytest

from scaleout import rollout_ranks
import test_distributed as td
from conftest import write_task
from test_environment import AGAIN_TASK
from engine import TrainingSample
from tasks.environment import Group

ARGS = ["--init_from=scratch", f"--model={td.TINY}", "--prompts_per_step=5", "--group_size=4",
        "--max_new_tokens=8",
        "--n_eval_problems=6", "--pass_k=2", "--learning_rate=3e-3", "--warmup_iters=0",
        "--log_interval=1",
        # buckets of 10 KiB: smaller than the embedding matrix
        "--batch_tokens=128", "--weight_bucket_mb=0.01"]
SAME = ("train/loss", "train/grad_norm", "train/tokens", "rollout/reward_mean", "rollout/problems",
        "rollout/problems_total", "eval/accuracy", "eval/pass@1")


def on_policy(args):
    """args without train_grpo_async.py's settings: the main job, train_grpo.py's."""
    return [a for a in args if not a.startswith("--weight_bucket_mb=")]


def steps(out_dir):
    return [r for r in td.rows(out_dir) if "train/loss" in r]


@pytest.fixture(scope="module")
def synchronous(tmp_path_factory):
    """5 GRPO iterations of train_grpo.py (colocated, in one process), and the same with
    rank 1 as a rollout rank (staleness 0)."""
    tmp = tmp_path_factory.mktemp("rollout_ranks")
    args = ARGS + ["--max_iters=5", "--eval_interval=5"]
    td.launch(tmp, "train_grpo.py", tmp / "one", on_policy(args))
    td.launch(tmp, "train_grpo_async.py", tmp / "split",
              args + ["--rollout_ranks=1", "--max_staleness=0"], nproc=2)
    return tmp, args


def test_a_rollout_rank_without_staleness_samples_and_steps_like_the_colocated_run(synchronous):
    tmp, _ = synchronous
    td.assert_same_run(tmp / "one", tmp / "split", SAME)
    # the worker (rank 1) sampled exactly the single process's groups: the same tokens,
    # logprobs within 1e-5
    single = json.loads((tmp / "one.samples.0.json").read_text())
    worker = json.loads((tmp / "split.samples.1.json").read_text())
    assert [[s[0] for s in step] for step in worker] == [[s[0] for s in step] for step in single]
    assert max(abs(x - y) for a, b in zip(worker, single) for s, t in zip(a, b)
               for x, y in zip(s[1], t[1])) < 1e-5
    rows = steps(tmp / "split")
    assert all(r["rollout/staleness_max"] == 0 for r in rows)
    # the trainer scores the worker's tokens with the weights that sampled them: nothing
    # stale, nothing half-applied
    assert all(r["train/logprob_mismatch"] < 1e-5 for r in rows)
    # a broadcast after every iteration whose weights a later rollout samples with (not
    # after the last)
    assert [r["iter"] for r in rows if "perf/weight_sync_s" in r] == [1, 2, 3, 4]
    assert all(r["perf/weight_sync_GBps"] > 0 and 0 <= r["perf/trainer_idle_frac"] <= 1
               for r in rows[:4])
    assert all(0 <= r["perf/worker_idle_frac"] <= 1 for r in rows)


def test_multi_turn_episodes_on_a_rollout_rank_step_like_the_colocated_run(tmp_path):
    # the multi-turn task of test_environment (the environment answers "again"): the
    # rollout tensors carry each episode's mask: the trainer weighs the sampled ids only,
    # as the colocated run does
    again = write_task(str(tmp_path), AGAIN_TASK, "again.py")
    model = td.TINY.replace("'max_position_embeddings':128", "'max_position_embeddings':512")
    args = ARGS + ["--max_iters=5", "--eval_interval=5", f"--model={model}", f"--task={again}",
                   "--max_turns=3", "--max_new_tokens=40", "--max_episode_tokens=160",
                   "--prompts_per_step=8", "--batch_tokens=1024"]
    td.launch(tmp_path, "train_grpo.py", tmp_path / "one", on_policy(args))
    td.launch(tmp_path, "train_grpo_async.py", tmp_path / "split", args + ["--rollout_ranks=1",
                                                                     "--max_staleness=0"], nproc=2)
    td.assert_same_run(tmp_path / "one", tmp_path / "split", SAME + ("rollout/turns_mean",
                                                                     "eval/success_by_turn_3"))
    rows = steps(tmp_path / "split")
    assert rows and all(r["train/logprob_mismatch"] < 1e-5 for r in rows)
    assert max(r["rollout/turns_mean"] for r in td.rows(tmp_path / "split")
               if "rollout/turns_mean" in r) > 1


@pytest.mark.parametrize("rollout_ranks", [1, 2])
def test_three_ranks_split_either_way_step_like_the_colocated_run(synchronous, rollout_ranks):
    # 2 trainers (DDP over their own group) + 1 worker, or 1 trainer + 2 workers (each
    # sampling half of a rollout)
    tmp, args = synchronous
    out = tmp / f"three_{rollout_ranks}"
    td.launch(tmp, "train_grpo_async.py", out, args + [f"--rollout_ranks={rollout_ranks}"], nproc=3)
    td.assert_same_run(tmp / "one", out, SAME)


def test_a_resumed_rollout_ranks_run_trains_no_sample_twice(synchronous):
    tmp, args = synchronous
    half = tmp / "half"
    split = ["--rollout_ranks=1", "--max_staleness=0"]
    first = ["--max_iters=3", "--lr_decay_iters=5", "--ckpt_interval=3", "--eval_interval=5"]
    td.launch(tmp, "train_grpo_async.py", half, args[:-2] + first + split, nproc=2)
    td.launch(tmp, "train_grpo_async.py", half,
              args + ["--init_from=resume", "--lr_decay_iters=5"] + split, nproc=2)
    # iterations 4 and 5 draw from the checkpoint's sampler record and step as
    # the uninterrupted run
    full, resumed = steps(tmp / "one"), steps(half)
    assert [r["iter"] for r in resumed] == [1, 2, 3, 4, 5]
    for a, b in zip(full, resumed):
        for k in ("train/loss", "rollout/problems_total", "rollout/reward_mean"):
            assert abs(a[k] - b[k]) <= 1e-5 * max(abs(a[k]), 1e-3), (a["iter"], k)


def test_staleness_one_overlaps_sampling_with_training(tmp_path):
    args = ARGS + ["--max_iters=8", "--eval_interval=8", "--prompts_per_step=16", "--group_size=8",
                   "--max_new_tokens=16", "--batch_tokens=512", "--tis_cap=2", "--rollout_ranks=1",
                   "--max_staleness=1"]
    td.launch(tmp_path, "train_grpo_async.py", tmp_path / "async", args, nproc=2)
    rows = steps(tmp_path / "async")
    assert [r["iter"] for r in rows] == list(range(1, 9))
    # rollout 0 and 1 sample with the starting weights, rollout j >= 1 with those after
    # iteration j - 1
    assert [r["rollout/staleness_max"] for r in rows] == [0] + [1] * 7
    assert all(r["rollout/staleness_mean"] <= r["rollout/staleness_max"] for r in rows)
    # the step is shorter than sampling plus training one after the other: they ran at once
    later = rows[2:]
    step = np.median([r["perf/step_time_s"] for r in later])
    serial = np.median(
        [
            r["perf/rollout_time_s"] + r["perf/logprob_pass_s"] + r["perf/train_time_s"]
            for r in later
        ]
    )
    assert step < 0.9 * serial, (step, serial)


def test_staleness_three_runs_with_rollouts_in_flight(tmp_path):
    # the worker runs three rollouts ahead: it must not wait for one the trainer takes only
    # after the barrier of a weight publish that waits for the worker (a deadlock once)
    args = ARGS + ["--max_iters=7", "--eval_interval=7", "--prompts_per_step=8", "--group_size=4",
                   "--max_new_tokens=8", "--batch_tokens=512", "--tis_cap=2", "--rollout_ranks=1",
                   "--max_staleness=3", "--dist_timeout_s=60"]
    td.launch(tmp_path, "train_grpo_async.py", tmp_path / "async3", args, nproc=2)
    rows = steps(tmp_path / "async3")
    assert [r["iter"] for r in rows] == list(range(1, 8))
    # rollouts 0-3 sample with the starting weights, rollout j >= 3 with those after j - 3
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 2, 3, 3, 3, 3]


def test_a_rollout_crosses_as_tensors_and_comes_back_whole():
    prompt = (5, 6, 7)
    # sample 0 is a multi-turn episode: its id 2 is the environment's (mask 0)
    samples = [TrainingSample(prompt, (1, 2, 9), (-0.5, 0.0, -0.125), weight_version=3,
                              finish_reason="stop", token_versions=(3, 3, 4), loss_mask=(1, 0, 1)),
               TrainingSample(prompt, (4,), (-2.0,), weight_version=4, finish_reason="length",
                              token_versions=(4,))]
    groups = [Group("problem", samples, [1.0, 0.0])]
    metrics = {"rollout/reward_mean": 0.5, "rollout/valid_groups": 1, "perf/rollout_time_s": 0.25}
    data, names = rollout_ranks.encode_rollout(7, ([12, 3, 17464], [8, 0, 5]), groups, 1.5e9,
                                               metrics)
    it, draw, back, flops, got = rollout_ranks.decode_rollout(data, names)
    assert (it, draw, flops, got) == (7, ([12, 3, 17464], [8, 0, 5]), 1.5e9, metrics)
    assert type(got["rollout/valid_groups"]) is int
    assert back == [Group(None, samples, [1.0, 0.0])]
    empty = rollout_ranks.encode_rollout(0, ([], []), [], 0.0, {})
    assert rollout_ranks.decode_rollout(*empty)[1:3] == (([], []), [])
