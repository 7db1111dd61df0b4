"""
How well a model does a task, measured the same way for every stage and every baseline,
through the inference engine, with the episodes of tasks/environment.py:

    env = Environment(load_task("tasks.countdown"), tokenizer, max_new_tokens=48)
    engine = task_engine(model, env, problems)
    metrics, outcomes = evaluate(engine, env, problems, pass_k=8, temperature=1.0, seed=0)
    # {"eval/accuracy": mean greedy reward, "eval/accuracy_<kind>": the same by the task's
    #  kind of problem (countdown: _4digits, its confirm split _5digits; countdown_full:
    #  _3digits and _4digits),
    #  "eval/pass@1": mean of k sampled episodes, "eval/pass@8": any of k right (pass_k=0:
    #  none); multi-turn: "eval/success_by_turn_1".., right within that many turns}
    # outcomes: one dict per problem (the task's describe(problem), greedy reward and replies)

A task's hand-written baselines, when it offers them, are scored by the same reward,
with no model (RULE names the task's function RULE_answer; countdown has heuristic, the
closest pair, and chain_rule):

    python -m tasks.evaluate heuristic test out/heuristic   # -> {metrics,outcomes}.jsonl there
    python -m tasks.evaluate chain_rule test out/chain_rule --task=tasks.countdown

A reply scores only if it stopped by itself: one cut off at max_new_tokens scores 0
whatever its text (tasks/environment.py), in training and in evaluation alike. pass@k is
sampled at the temperature the policy is trained at (the rollouts'), so it measures the
distribution GRPO shapes.
"""

import dataclasses
import json
import os
import sys

import numpy as np

from tasks.environment import load_task, offers, solved
from engine import EngineConfig, InferenceEngine
from model import train_flops


def task_engine(model, env, problems, config=EngineConfig()):
    """An in-process engine over model's weights (its own copy, or a LoRA model's frozen
    base shared: engine.can_share_base) with config's settings (device, dtype, seed, ...),
    sized for the longest episode over these problems (env.max_len), for up to 1,024
    sequences at a time, its KV pool capped at a quarter of the memory free when it starts
    (a trainer's optimizer state and activations come after it, on the same device). A
    GRPO step's 768 samples so run as one batch: fewer, fuller steps (docs/speed.md
    measures it against 256 at a time)."""
    return InferenceEngine(dataclasses.replace(
        config, max_model_len=env.max_len(problems), max_batch_size=1024,
        memory_fraction=0.25), model=model)


def described(task, problem):
    """The problem's fields in outcomes.jsonl: the task's describe(problem), or its text."""
    return task.describe(problem) if offers(task, "describe") else {"problem": str(problem)}


def outcome(env, episode):
    """One line of outcomes.jsonl: what bench/report.py's per-problem analysis reads."""
    fields = described(env.task, episode.problem)
    replies = episode.replies()
    multi = {"replies": replies} if env.max_turns > 1 else {}
    return {**fields, "reward": episode.reward, "turns": episode.turns,
            "completion": replies[-1] if replies else "", **multi}


def greedy_outcomes(engine, env, problems):
    """Each problem's greedy episode, as outcome dicts (and the episodes)."""
    episodes = env.episodes(engine, problems)
    return [outcome(env, e) for e in episodes], episodes


def accuracy_metrics(task, problems, rewards):
    """eval/accuracy, the mean reward, and the same by the task's kind of problem
    (eval/accuracy_<kind>) when it names kinds."""
    metrics = {"eval/accuracy": float(np.mean(rewards))}
    if offers(task, "kind"):
        kinds = [task.kind(p) for p in problems]
        for k in sorted(set(kinds)):
            metrics[f"eval/accuracy_{k}"] = float(np.mean([r for r, x in zip(rewards, kinds)
                                                           if x == k]))
    return metrics


def turn_metrics(episodes, max_turns):
    """eval/success_by_turn_k: the share of episodes that ended right within k turns."""
    right = np.array([solved(e.reward) for e in episodes])
    turns = np.array([e.turns for e in episodes])
    return {f"eval/success_by_turn_{t}": float((right & (turns <= t)).mean())
            for t in range(1, max_turns + 1)}


def greedy_accuracy(engine, env, problems):
    """The mean greedy reward over the problems."""
    outcomes, _ = greedy_outcomes(engine, env, problems)
    return float(np.mean([o["reward"] for o in outcomes]))


def evaluate(engine, env, problems, pass_k, temperature, seed):
    """(metrics, outcomes): greedy accuracy (overall, by kind, by turn) and, with
    pass_k > 0, pass@1 and pass@k over pass_k episodes at temperature; the
    per-problem greedy outcomes."""
    outcomes, episodes = greedy_outcomes(engine, env, problems)
    metrics = accuracy_metrics(env.task, problems, [o["reward"] for o in outcomes])
    if env.max_turns > 1:
        metrics.update(turn_metrics(episodes, env.max_turns))
    if pass_k > 0:
        sampled = env.episodes(engine, problems, pass_k, temperature, seed)
        right = np.array([solved(e.reward) for e in sampled]).reshape(len(problems), pass_k)
        metrics["eval/pass@1"] = float(right.mean())
        metrics[f"eval/pass@{pass_k}"] = float(right.max(axis=1).mean())
    return metrics, outcomes


def write_outcomes(out_dir, outcomes):
    """{out_dir}/outcomes.jsonl, one problem a line (written whole, then renamed into
    place)."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "outcomes.jsonl")
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(o) + "\n" for o in outcomes)
    os.replace(path + ".tmp", path)


# the no-learning baselines a task may offer (its RULE_answer), and what each one does
RULES = {"heuristic": "closest pair", "chain_rule": "smallest need"}


def offered_rules(task):
    """The RULES this task offers, in order: what speedrun.sh and bench/compare.sh score."""
    return [rule for rule in RULES if offers(task, f"{rule}_answer")]


def rule_metrics(task, problems, rule="heuristic"):
    """(metrics, outcomes) of one of the task's no-learning baselines (its {rule}_answer),
    scored by the same reward."""
    if not offers(task, f"{rule}_answer"):
        raise ValueError(f"the task {task.__name__} offers no {rule}_answer(problem)")
    answer_of = getattr(task, f"{rule}_answer")
    outcomes = []
    for p in problems:
        answer = answer_of(p)
        outcomes.append({**described(task, p), "reward": float(task.reward(p, answer)), "turns": 1,
                         "completion": answer})
    return accuracy_metrics(task, problems, [o["reward"] for o in outcomes]), outcomes


def sampling_flops(model_config, samples, num_samples_per_prompt):
    """Forward FLOPs the engine spent on these samples (num_samples_per_prompt consecutive
    ones per prompt): each prompt is prefilled once for its group (its blocks are
    shared), each completion token is computed once."""
    prompts = [len(s.prompt_tokens) for s in samples[::num_samples_per_prompt]]
    return train_flops(model_config, prompts + [len(s.completion_tokens) for s in samples]) / 3


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__.strip())
        sys.exit(0)
    args = [a for a in sys.argv[1:] if not a.startswith("--task=")]
    specs = [a[len("--task="):] for a in sys.argv[1:] if a.startswith("--task=")]
    if (len(args) != 3 or not args[0].isidentifier() or args[1] not in ("val", "test", "confirm")
            or len(specs) > 1):
        sys.exit("usage: python -m tasks.evaluate RULE val|test|confirm OUT_DIR "
                 "[--task=tasks.countdown]\n"
                 "  RULE: the task's RULE_answer (heuristic, chain_rule)")
    the_task = load_task(specs[0] if specs else "tasks.countdown")
    rule, split, out_dir = args
    metrics, outcomes = rule_metrics(the_task, the_task.make_problems(split), rule)
    write_outcomes(out_dir, outcomes)
    with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"iter": 0, **metrics}) + "\n")
    print(f"{rule} on {split}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
