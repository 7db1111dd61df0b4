"""
How well a model solves the embedded task, measured the same way for every stage and every baseline, through
the inference engine:

    engine = task_engine(model, tokenizer, problems, max_new_tokens=16)
    metrics, outcomes = evaluate(engine, tokenizer, problems, max_new_tokens=16, pass_k=8,
                                 temperature=1.0, seed=0)
    # {"eval/accuracy": greedy accuracy, "eval/accuracy_3digits" and "_4digits": the same by size,
    #  "eval/pass@1": mean of k sampled answers, "eval/pass@8": any of k right (pass_k=0: none)}
    # outcomes: one dict per problem (digits, target, greedy reward and completion)

The hand-written baseline is scored by the same reward, with no model:

    python evaluate.py heuristic test out/heuristic    # -> out/heuristic/{metrics,outcomes}.jsonl

A completion scores only if it stopped by itself: one cut off at max_new_tokens scores 0 whatever its text
(score), in training and in evaluation alike. pass@k is sampled at the temperature the policy is trained at
(the rollouts'), so it measures the distribution GRPO shapes.
"""

import json
import os
import sys

import numpy as np

import distributed
import task
from model import train_flops
from engine import EngineConfig, InferenceEngine, SamplingParams
from tokenizer import chat_prompt_ids, completion_text


def prompt_ids(tokenizer, problems):
    """The chat-template ids of each problem's prompt, made once: these exact ids go to the engine and the batch."""
    return [chat_prompt_ids(tokenizer, task.prompt_messages(p)) for p in problems]


def score(problem, tokenizer, sample):
    """The task's exact reward of a finished sample; 0 when it did not stop (truncated at max_tokens)."""
    if sample.finish_reason != "stop":
        return 0.0
    return task.reward(problem, completion_text(tokenizer, sample.completion_tokens))


def task_engine(model, tokenizer, problems, max_new_tokens, block_size=16, dtype="float32", device="cpu",
                seed=0, weight_version=0):
    """An in-process engine over a copy of model, sized for the longest prompt of these problems plus the
    completion budget, for 256 sequences at a time."""
    longest = max(problems, key=lambda p: len(task.prompt_messages(p)[0]["content"]))   # its ids are the longest
    max_len = len(prompt_ids(tokenizer, [longest])[0]) + max_new_tokens
    blocks_per_seq = -(-max_len // block_size) + 1
    return InferenceEngine(EngineConfig(
        device=device, dtype=dtype, block_size=block_size, max_model_len=max_len, max_batch_size=256,
        num_blocks=256 * blocks_per_seq, seed=seed, weight_version=weight_version), model=model)


def generate_sharded(engine, prompts, params, num_samples=1):
    """engine.generate over the prompts, each rank (torchrun) sampling its contiguous slice, gathered in order:
    the same samples as one process sampling them all (a seeded draw depends on the prompt's index)."""
    lo, hi = distributed.span(len(prompts))
    return distributed.gather(engine.generate(prompts[lo:hi], params, num_samples, first_index=lo))


def greedy_outcomes(engine, tokenizer, problems, max_new_tokens):
    """Each problem's greedy answer and its reward, as outcome dicts."""
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=frozenset({tokenizer.eos_token_id}))
    greedy = generate_sharded(engine, prompt_ids(tokenizer, problems), params)
    return [outcome(p, score(p, tokenizer, s), completion_text(tokenizer, s.completion_tokens))
            for p, s in zip(problems, greedy)]


def outcome(problem, reward, completion):
    """One line of outcomes.jsonl: what report.py's per-problem analysis reads."""
    return {"digits": list(problem.digits), "target": problem.target, "reward": reward,
            "completion": completion}


def accuracy_metrics(outcomes):
    """eval/accuracy over the outcomes, and by problem size (eval/accuracy_3digits, _4digits)."""
    metrics = {"eval/accuracy": float(np.mean([o["reward"] for o in outcomes]))}
    for k in sorted({len(o["digits"]) for o in outcomes}):
        sized = [o["reward"] for o in outcomes if len(o["digits"]) == k]
        metrics[f"eval/accuracy_{k}digits"] = float(np.mean(sized))
    return metrics


def greedy_accuracy(engine, tokenizer, problems, max_new_tokens):
    """The share of problems whose greedy answer is right."""
    outcomes = greedy_outcomes(engine, tokenizer, problems, max_new_tokens)
    return accuracy_metrics(outcomes)["eval/accuracy"]


def evaluate(engine, tokenizer, problems, max_new_tokens, pass_k, temperature, seed):
    """(metrics, outcomes): greedy accuracy (overall and by size) and, with pass_k > 0, pass@1 and
    pass@k over pass_k samples at temperature; the per-problem greedy outcomes."""
    outcomes = greedy_outcomes(engine, tokenizer, problems, max_new_tokens)
    metrics = accuracy_metrics(outcomes)
    if pass_k > 0:
        params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens,
                                stop_token_ids=frozenset({tokenizer.eos_token_id}), seed=seed)
        sampled = generate_sharded(engine, prompt_ids(tokenizer, problems), params, pass_k)
        right = np.array([score(problems[i // pass_k], tokenizer, s)
                          for i, s in enumerate(sampled)])
        right = right.reshape(len(problems), pass_k)
        metrics["eval/pass@1"] = float(right.mean())
        metrics[f"eval/pass@{pass_k}"] = float(right.max(axis=1).mean())
    return metrics, outcomes


def write_outcomes(out_dir, outcomes):
    """{out_dir}/outcomes.jsonl, one problem a line (written whole, then renamed into place)."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "outcomes.jsonl")
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(o) + "\n" for o in outcomes)
    os.replace(path + ".tmp", path)


def heuristic_outcomes(problems):
    """The no-learning baseline's answers (task.heuristic_answer), scored by the same reward."""
    answers = [task.heuristic_answer(p) for p in problems]
    return [outcome(p, task.reward(p, a), a) for p, a in zip(problems, answers)]


def sampling_flops(model_config, samples, num_samples_per_prompt):
    """Forward FLOPs the engine spent on these samples (num_samples_per_prompt consecutive ones per prompt): each
    prompt is prefilled once for its group (its blocks are shared), each completion token is computed once."""
    prompts = [len(s.prompt_tokens) for s in samples[::num_samples_per_prompt]]
    return train_flops(model_config, prompts + [len(s.completion_tokens) for s in samples]) / 3


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "heuristic" or sys.argv[2] not in ("val", "test"):
        sys.exit("usage: python evaluate.py heuristic val|test OUT_DIR")
    outcomes = heuristic_outcomes(task.make_problems(sys.argv[2]))
    write_outcomes(sys.argv[3], outcomes)
    metrics = accuracy_metrics(outcomes)
    with open(os.path.join(sys.argv[3], "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"iter": 0, **metrics}) + "\n")
    print(f"heuristic on {sys.argv[2]}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
