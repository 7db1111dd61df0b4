"""
verifiers episodes as GRPO groups: what a verifiers environment records of an episode
(its trace's branch: one token sequence, the mask of the tokens the model sampled, their
logprobs; and the reward) becomes a TrainingSample, and the episodes of one task a group,
which train_grpo_async.build_batches turns into the step's batches like any rollout's:

    episodes = [json.loads(line) for line in lines]   # verifiers_countdown.py --json
    groups = episode_groups(episodes, group_size=8)
    batches = train_grpo_async.build_batches(groups, config)

An episode is {"task": name, "reward": float, "branch": {"token_ids": [...],
"sampled_mask": [...], "logprobs": [...]}}. The prompt is the branch's ids before the
first sampled one; the rest is the completion, the environment's ids in it (a later
turn's user message) with mask 0 and logprob 0, as train_grpo's own multi-turn episodes
have them. Episodes are grouped by task in the order they come; each task's episodes
share one prompt.

train_grpo_async trains on a verifiers environment through rollout() below, in place of its
own: the servers of --rollout_urls sample, the trainer pushes its weights to them after
each step, and each iteration runs --verifiers_cmd, a program in verifiers' venv that
plays the environment against a server and prints its episodes as JSON lines, for each
server's share of the step's tasks:

    python -m scaleout.serve --model_path=out/qwen_small/sft/best --port=8123 \\
        --enable_weight_updates=True &
    python train_grpo_async.py config/qwen_small.py --rollout_urls=http://127.0.0.1:8123 \\
        --verifiers_cmd="/tmp/vf_venv/bin/python scaleout/verifiers_countdown.py"

The command is called with --base_url, --json, --split=train, --offset (its first task:
iteration * prompts_per_step + its share's start), --num_tasks, --group_size,
--max_tokens and --temperature (the key of --rollout_api_key in NANORL_API_KEY);
scaleout/verifiers_countdown.py is the example, and another environment plugs in by a
program that takes the same arguments. verifiers' client sends no seed, so these rollouts
are unseeded, and it takes no top_p / top_k from here (refused with verifiers_cmd).
"""

import json
import os
import shlex
import subprocess
import time
from dataclasses import replace

import numpy as np

from engine import TrainingSample
from tasks.environment import Group
from tasks.evaluate import sampling_flops


def branch_sample(branch):
    """A TrainingSample of one branch {token_ids, sampled_mask, logprobs}; ValueError
    naming what is wrong with it."""
    ids, mask, logprobs = (branch.get(k) for k in ("token_ids", "sampled_mask", "logprobs"))
    if not (isinstance(ids, list) and isinstance(mask, list) and isinstance(logprobs, list)
            and len(ids) == len(mask) == len(logprobs)):
        raise ValueError("a branch needs token_ids, sampled_mask and logprobs: lists of one "
                         "length")
    first = next((i for i, m in enumerate(mask) if m), None)
    if not first:   # None: nothing sampled; 0: no prompt before the first sampled token
        raise ValueError(f"a branch must start with a prompt and sample after it (the first "
                         f"sampled token is at {first})")
    sampled = [int(bool(m)) for m in mask[first:]]
    # the environment's ids carry logprob 0, as the engine's multi-turn episodes do
    logprobs = [float(lp) if m else 0.0 for lp, m in zip(logprobs[first:], sampled)]
    return TrainingSample(tuple(ids[:first]), tuple(ids[first:]), tuple(logprobs),
                          finish_reason="stop", loss_mask=tuple(sampled))


def episode_groups(episodes, group_size):
    """[Group] (its problem the task's name): the episodes grouped by task, in the order
    the tasks first come, group_size each, one prompt each."""
    by_task = {}
    for episode in episodes:
        reward = episode.get("reward")
        if not isinstance(reward, (int, float)) or isinstance(reward, bool):
            raise ValueError(f"task {episode.get('task')!r}: reward {reward!r} is not a number")
        by_task.setdefault(episode.get("task"), []).append(
            (branch_sample(episode.get("branch") or {}), float(reward)))
    groups = []
    for task, members in by_task.items():
        samples, rewards = [s for s, _ in members], [r for _, r in members]
        if len(samples) != group_size:
            raise ValueError(f"task {task!r}: {len(samples)} episodes, not group_size="
                             f"{group_size}")
        if len({s.prompt_tokens for s in samples}) != 1:
            raise ValueError(f"task {task!r}: its episodes start from different prompts")
        groups.append(Group(task, samples, rewards))
    return groups


# -----------------------------------------------------------------------------
# a verifiers environment as train_grpo_async's rollout


def collect(config, url, offset, num_tasks):
    """The episodes of verifiers_cmd on one server: num_tasks tasks of the train split
    from offset on, group_size episodes each."""
    cmd = shlex.split(config["verifiers_cmd"]) + [
        f"--base_url={url}", "--json", "--split=train", f"--offset={offset}",
        f"--num_tasks={num_tasks}", f"--group_size={config['group_size']}",
        f"--max_tokens={config['max_new_tokens']}", f"--temperature={config['temperature']}"]
    # the server's key reaches verifiers' client by the variable it reads; an environment
    # that hangs fails the step after an hour
    env = dict(os.environ, NANORL_API_KEY=config["rollout_api_key"])
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    episodes = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    failed = [e.get("why") for e in episodes if not e.get("ok")]
    if run.returncode != 0 or failed or len(episodes) != num_tasks * config["group_size"]:
        raise RuntimeError(f"verifiers_cmd on {url} (exit {run.returncode}, "
                           f"{len(episodes)} episodes, failed: {failed[:2]}): "
                           f"{run.stderr[-1500:]}")
    return episodes


def rollout(remote, env, sampler, config, it):
    """train_grpo.rollout for a verifiers environment: prompts_per_step tasks (the next
    ones of the train split, in the environment's order) split across the servers of
    remote (rollout_servers.RemoteEngine), group_size episodes each, through
    verifiers_cmd; the groups with reward variance kept. env and sampler are train_grpo's
    (the environment chooses the tasks here, so the sampler records nothing)."""
    P, G = config["prompts_per_step"], config["group_size"]
    t0 = time.perf_counter()
    episodes = remote.fan_out(P, lambda url, lo, hi: collect(config, url, it * P + lo, hi - lo))
    gen_time = time.perf_counter() - t0
    groups = []
    for g in episode_groups(episodes, G):
        # sampled by the weights the servers hold (the trainer's count of versions)
        samples = [replace(s, weight_version=remote.version,
                           token_versions=(remote.version,) * len(s.completion_tokens))
                   for s in g.samples]
        groups.append(replace(g, samples=samples))
    kept = [g for g in groups if len(set(g.rewards)) > 1]
    rewards = [r for g in groups for r in g.rewards]
    sampled = [sum(s.loss_mask) for g in groups for s in g.samples]
    metrics = {"rollout/reward_mean": float(np.mean(rewards)),
               "rollout/zero_var_groups": len(groups) - len(kept),
               "rollout/valid_groups": len(kept), "rollout/problems": len(groups),
               "rollout/completion_len": float(np.mean(sampled)),
               "rollout/tokens_per_s": sum(sampled) / gen_time, "perf/rollout_time_s": gen_time,
               "rollout/weight_version": remote.version}
    samples = [s for g in groups for s in g.samples]
    return kept, sampling_flops(remote.model.config, samples, G), metrics
