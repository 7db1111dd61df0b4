"""
A verifiers trace converted to GRPO batches (scaleout/verifiers_groups.py) against a
hand-built expectation: two tasks of two episodes each, one a two-turn episode whose
second user message sits inside its completion (mask 0, no weight).
"""

import pytest
import torch

import train_grpo_async
from scaleout.verifiers_groups import branch_sample, episode_groups

# task "a": episode 1 one reply (right), episode 2 two replies around the environment's
# ids 7 7 (wrong); task "b": two one-reply episodes, both wrong (a flat group)
EPISODES = [
    {"task": "a", "reward": 1.0, "branch": {"token_ids": [1, 2, 3, 10, 11],
                                            "sampled_mask": [0, 0, 0, 1, 1],
                                            "logprobs": [0, 0, 0, -0.5, -0.25]}},
    {"task": "b", "reward": 0.0, "branch": {"token_ids": [4, 5, 20],
                                            "sampled_mask": [0, 0, 1],
                                            "logprobs": [0, 0, -1.0]}},
    {"task": "a", "reward": 0.0, "branch": {"token_ids": [1, 2, 3, 12, 7, 7, 13],
                                            "sampled_mask": [0, 0, 0, 1, 0, 0, 1],
                                            "logprobs": [0, 0, 0, -2.0, -9.0, -9.0, -0.75]}},
    {"task": "b", "reward": 0.0, "branch": {"token_ids": [4, 5, 21],
                                            "sampled_mask": [0, 0, 1],
                                            "logprobs": [0, 0, -3.0]}},
]
CONFIG = {"group_size": 2, "scale_rewards": False, "advantage_pass_k": 1,
          "turn_baseline": False, "share_prompt": False, "batch_tokens": 4096}


def test_episodes_become_groups_and_batches_as_built_by_hand():
    groups = episode_groups(EPISODES, group_size=2)
    assert [(g.problem, g.prompt, g.rewards) for g in groups] == [
        ("a", (1, 2, 3), [1.0, 0.0]), ("b", (4, 5), [0.0, 0.0])]
    two_turn = groups[0].samples[1]
    assert two_turn.completion_tokens == (12, 7, 7, 13)
    assert two_turn.loss_mask == (1, 0, 0, 1)
    assert two_turn.logprobs == (-2.0, 0.0, 0.0, -0.75)   # the environment's ids: 0
    # task a's group: advantages +0.5 and -0.5 (reward - group mean) on sampled tokens only
    (batch,) = train_grpo_async.build_batches(groups[:1], CONFIG)
    weighted = {int(t): float(w) for t, w, m in zip(batch.labels, batch.token_weights,
                                                   batch.loss_mask) if m}
    assert weighted == {10: 0.5, 11: 0.5, 12: -0.5, 13: -0.5}
    assert float(batch.token_weights[~batch.loss_mask].abs().sum()) == 0.0
    sampled = batch.log_probs[batch.loss_mask]
    assert torch.equal(sampled, torch.tensor([-0.5, -0.25, -2.0, -0.75]))


def test_bad_episodes_are_refused_naming_what_is_wrong():
    def one(**branch):
        return [{"task": "t", "reward": 1.0, "branch": branch}]
    with pytest.raises(ValueError, match="lists of one length"):
        branch_sample({"token_ids": [1, 2], "sampled_mask": [0], "logprobs": [0, 0]})
    with pytest.raises(ValueError, match="start with a prompt"):
        episode_groups(one(token_ids=[1, 2], sampled_mask=[1, 1], logprobs=[0, 0]), 1)
    with pytest.raises(ValueError, match="start with a prompt"):
        episode_groups(one(token_ids=[1, 2], sampled_mask=[0, 0], logprobs=[0, 0]), 1)
    with pytest.raises(ValueError, match="not a number"):
        episode_groups([dict(EPISODES[0], reward=None)], 1)
    with pytest.raises(ValueError, match="3 episodes, not group_size=2"):
        episode_groups(EPISODES[:1] * 3, 2)
    other = dict(EPISODES[2], branch=dict(EPISODES[2]["branch"], token_ids=[9, 2, 3, 12, 7, 7,
                                                                             13]))
    with pytest.raises(ValueError, match="different prompts"):
        episode_groups([EPISODES[0], other], 2)


def test_bad_verifiers_settings_are_refused_before_any_work(tmp_path):
    from test_grpo import tiny_config
    cmd = "--verifiers_cmd=python env.py"
    for args, says in (((cmd,), "set rollout_urls"),
                       (("--verifiers_cmd=python 'env.py", "--rollout_urls=http://h:1"),
                        "No closing quotation"),
                       ((cmd, "--rollout_urls=http://h:1", "--top_p=0.9"), "top_p=0.9")):
        with pytest.raises(ValueError, match=says):
            train_grpo_async.check_settings(tiny_config(tmp_path, *args, script=train_grpo_async))
