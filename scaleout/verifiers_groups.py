"""
verifiers episodes as GRPO groups: what a verifiers environment records of an episode
(its trace's branch: one token sequence, the mask of the tokens the model sampled, their
logprobs; and the reward) becomes a TrainingSample, and the episodes of one task a group,
which train_grpo.build_batches turns into the step's batches like any rollout's:

    episodes = [json.loads(line) for line in lines]   # verifiers_countdown.py --json
    groups = episode_groups(episodes, group_size=8)
    batches = train_grpo.build_batches(groups, config)

An episode is {"task": name, "reward": float, "branch": {"token_ids": [...],
"sampled_mask": [...], "logprobs": [...]}}. The prompt is the branch's ids before the
first sampled one; the rest is the completion, the environment's ids in it (a later
turn's user message) with mask 0 and logprob 0, as train_grpo's own multi-turn episodes
have them. Episodes are grouped by task in the order they come; each task's episodes
share one prompt. The wiring of a verifiers run into train_grpo's loop is not written
yet (issue 65).
"""

from engine import TrainingSample


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
    """[(task, prompt ids, [TrainingSample], [reward])]: the episodes grouped by task, in
    the order the tasks first come, group_size each, one prompt each."""
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
        groups.append((task, samples[0].prompt_tokens, samples, rewards))
    return groups
