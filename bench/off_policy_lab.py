"""
The off-policy lab: what each correction (training.py) buys against a known
mismatch, measured against the exact on-policy gradient. Our engine and trainer share
model.py and agree to about 1e-7 in fp32, and a seeded sample is a pure function of
(seed, position), so:

  1. the exact gradient: rollouts of the trainer's own weights by the fp32 engine (no
     truncation, no staleness), GRPO's loss, no correction;
  2. a mismatch source at a strength: the same problems and the same seeds (common random
     numbers: where the two policies agree the very same tokens are drawn), sampled by
       bf16      the engine in bfloat16 (rounding, and for this MoE model other experts)
       stale k   the engine k optimizer steps behind the trainer (k GRPO steps taken here)
       top_p p   the fp32 engine sampling the nucleus p (the engine's logprob is the nucleus's)
  3. the gradient from those samples under each correction: none, TIS (cap 2), masked IS
     ([0.5, 2]), both at the sequence level (the geometric mean ratio), routing replay;
  4. per (source, correction), over n_batches batches: the cosine of each batch's gradient
     with the same batch's exact one (paired), the cosine and norm ratio of the mean
     gradients, and the variance over batches (relative to the exact mean's squared norm).

PPO's clip is not in the table: on a step's first epoch its ratio is 1 and its
gradient is the plain one (test_off_policy.py); what it does shows only over several
epochs, in training.

    python -m bench.off_policy_lab gradients [INIT_FROM] [OUT_DIR]
        # default out/qwen_small/sft/best (bash speedrun.sh) and out/off_policy_lab:
        # writes table.md, results.json, gradients.png
    bash bench/off_policy_curves.sh [INIT_FROM]               # learning curves: fp32 vs bf16 arms
    python -m bench.off_policy_lab curves out/off_policy_curves docs/off_policy_curves.png
"""

import dataclasses
import json
import os
import sys

import numpy as np
import torch

from tasks import evaluate
import train_grpo
import training
from checkpoint import init_start
from configurator import configure
from tasks.environment import Environment, load_task
from tokenizer import build_tokenizer

# -----------------------------------------------------------------------------
# settings
n_batches = 4                 # batches of problems; every statistic is over these
problems_per_batch = 32       # training problems per batch, group_size samples each
sources = [("exact", None), ("bf16", None), ("stale", 1), ("stale", 4), ("top_p", 0.9),
           ("top_p", 0.7)]
corrections = {"none": {}, "tis": dict(tis_cap=2.0), "mis": dict(mis_low=0.5, mis_high=2.0),
               "seq_tis": dict(tis_cap=2.0, is_level="sequence"),
               "seq_mis": dict(mis_low=0.5, mis_high=2.0, is_level="sequence"),
               "replay": dict(routing_replay=True)}
# -----------------------------------------------------------------------------


def grpo_config(init_from):
    """train_grpo's settings under config/qwen_small.py (the main job's), quietly."""
    settings = {k: v for k, v in vars(train_grpo).items() if not k.startswith("_")}
    stdout, sys.stdout = sys.stdout, open(os.devnull, "w")
    try:
        config = configure(settings, ["config/qwen_small.py", f"--init_from={init_from}",
                                      "--record_routes=True"], stage="grpo")
    finally:
        sys.stdout = stdout
    return config


def batches_of(model, env, problems, config, seed, dtype="float32", top_p=1.0):
    """GRPO's packed batches (flat groups dropped) of one rollout by an engine holding
    model's weights in dtype, seeded."""
    engine = evaluate.task_engine(model, env, problems, dtype=dtype, seed=seed,
                                  record_routes=True)
    G = config["group_size"]
    episodes = env.episodes(engine, problems, G, config["temperature"],
                            seed=seed, top_p=top_p)
    engine.shutdown()
    rewards, samples = [e.reward for e in episodes], [e.sample() for e in episodes]
    flat = train_grpo.zero_variance_groups(rewards, G).tolist()
    groups = [(p, samples[j * G].prompt_tokens, samples[j * G:(j + 1) * G],
               rewards[j * G:(j + 1) * G]) for j, p in enumerate(problems) if not flat[j]]
    return train_grpo.build_batches(groups, config)


def gradient(model, batches, config, normalizer):
    """The flat gradient of GRPO's loss on the batches after the configured correction."""
    model.zero_grad()
    off = torch.autocast("cpu", enabled=False)
    batches, _ = train_grpo.apply_corrections(batches, model, None, off, config)
    for b in batches:
        logp, _ = training.batch_logprobs(model, b)
        train_grpo.policy_loss(logp, b, normalizer, config).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()]).clone()


def advance(model, env, problems, config, steps, normalizer):
    """A copy of model after `steps` on-policy GRPO steps (AdamW at the config's learning
    rate): the trainer that a rollout of model is `steps` behind."""
    ahead = type(model)(model.config)
    ahead.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(ahead.parameters(), lr=config["learning_rate"], betas=(0.9, 0.95),
                            weight_decay=0.0)
    plain = {**config, "record_routes": False}
    for k in range(steps):
        batches = batches_of(ahead, env, problems[k::steps], config, seed=10_000 + k)
        batches = [dataclasses.replace(b, routes=None) for b in batches]
        gradient(ahead, batches, plain, normalizer)
        opt.step()
    return ahead


def cosine(a, b):
    a, b = a.double(), b.double()
    return float(torch.dot(a, b) / (a.norm() * b.norm()).clamp(min=1e-300))


def measure(model, env, config):
    """{source: {correction: statistics}} over n_batches batches, and the exact
    gradients'."""
    task = env.task
    train = task.make_problems("train")
    normalizer = problems_per_batch * config["group_size"] * config["max_new_tokens"]
    batch_problems = [train[b * problems_per_batch:(b + 1) * problems_per_batch]
                      for b in range(n_batches)]
    spare = train[n_batches * problems_per_batch:][:8 * problems_per_batch]
    results, on_policy = {}, {}  # the exact gradients of the checkpoint itself, made once
    for kind, strength in sources:
        name = kind if strength is None else f"{kind} {strength}"
        trainer, behaviour = model, model
        if kind == "stale":
            # the trainer is ahead; the engine samples with the older weights
            trainer = advance(model, env, spare, config, strength, normalizer)
        dtype, top_p = ("bfloat16" if kind == "bf16" else "float32",
                        strength if kind == "top_p" else 1.0)
        exact, got = [], {c: [] for c in corrections}
        for b, problems in enumerate(batch_problems):
            seed = 1_000 + b
            if trainer is not model or b not in on_policy:
                on = batches_of(trainer, env, problems, config, seed)
                g = gradient(trainer, on, {**config, "record_routes": False}, normalizer)
                on_policy[b] = g if trainer is model else on_policy.get(b)
            exact.append(g if trainer is not model else on_policy[b])
            off = batches_of(behaviour, env, problems, config, seed, dtype, top_p)
            for c, settings in corrections.items():
                got[c].append(gradient(trainer, off, {**config, **settings}, normalizer))
        results[name] = {c: statistics(g, exact) for c, g in got.items()}
        print(f"{name}: " + ", ".join(f"{c} {s['cos_paired']:.4f}"
                                      for c, s in results[name].items()), flush=True)
    return results


def statistics(grads, exact):
    """Paired cosine (mean over batches), the mean gradients' cosine and norm ratio, and
    the variance over batches relative to the exact mean's squared norm."""
    g, e = torch.stack(grads), torch.stack(exact)
    mean, exact_mean = g.mean(0), e.mean(0)
    return {"cos_paired": float(np.mean([cosine(a, b) for a, b in zip(g, e)])),
            "cos_mean": cosine(mean, exact_mean),
            "norm": float(mean.norm() / exact_mean.norm()),
            "variance": float(((g - mean) ** 2).sum(1).mean() / exact_mean.norm() ** 2),
            "exact_variance": float(((e - exact_mean) ** 2).sum(1).mean()
                                    / exact_mean.norm() ** 2)}


def write_table(results, out_dir):
    lines = ["| source | correction | cos (paired) | cos (mean) | norm ratio | variance |",
             "| --- | --- | --- | --- | --- | --- |"]
    for source, by in results.items():
        for c, s in by.items():
            lines.append(f"| {source} | {c} | {s['cos_paired']:.4f} | {s['cos_mean']:.4f} | "
                         f"{s['norm']:.3f} | {s['variance']:.3f} |")
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\n".join(lines))


def plot_gradients(results, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names, width = list(corrections), 0.8 / len(corrections)
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, c in enumerate(names):
        ys = [max(1 - results[s][c]["cos_paired"], 1e-8) for s in results]
        ax.bar(np.arange(len(results)) + i * width, ys, width, label=c)
    ax.set_xticks(np.arange(len(results)) + 0.4 - width / 2, list(results))
    ax.set_yscale("log")
    ax.set_ylabel("1 - cosine with the exact gradient (paired)")
    ax.legend(ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def gradients_main(init_from, out_dir):
    torch.manual_seed(0)
    config = grpo_config(init_from)
    start = init_start(config, build_tokenizer)
    env = Environment(load_task(config["task"]), start.tokenizer, config["max_new_tokens"],
                      stop_ids=start.stop_ids)
    os.makedirs(out_dir, exist_ok=True)
    results = measure(start.model, env, config)
    write_table(results, out_dir)
    plot_gradients(results, os.path.join(out_dir, "gradients.png"))


# -----------------------------------------------------------------------------
# the learning curves of bench/off_policy_curves.sh


def curves_main(out_dir, png):
    runs = {}
    for name in sorted(os.listdir(out_dir)):
        path = os.path.join(out_dir, name, "metrics.jsonl")
        if os.path.isfile(path):
            arm, seed = name.rsplit("_seed", 1)
            runs.setdefault(arm, {})[seed] = [json.loads(line) for line in open(path)]
    keys = ("train/logprob_mismatch", "offpolicy/kl_k3", "offpolicy/corrected",
            "offpolicy/expert_disagreement")
    print("| arm | seeds | val accuracy, last (mean ± std) | best | " +
          " | ".join(keys) + " |")
    print("| --- " * (4 + len(keys)) + "|")
    curves = {}
    for arm, seeds in runs.items():
        evals = [[(r["iter"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
                 for rows in seeds.values()]
        steps = sorted(set.intersection(*(set(i for i, _ in e) for e in evals)))
        acc = np.array([[dict(e)[s] for s in steps] for e in evals])
        curves[arm] = (steps, acc.mean(0))
        means = [np.mean([r[k] for rows in seeds.values() for r in rows if k in r] or [np.nan])
                 for k in keys]
        print(f"| {arm} | {len(evals)} | {acc[:, -1].mean():.3f} ± {acc[:, -1].std(ddof=1):.3f} "
              f"| {acc.max(1).mean():.3f} | " + " | ".join(f"{m:.2e}" for m in means) + " |")
    paired_differences(runs)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, (steps, acc) in curves.items():
        ax.plot(steps, acc, marker="o", label=arm,
                linestyle="--" if arm == "fp32" else "-")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("validation accuracy (mean over seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def paired_differences(runs):
    """The last validation accuracy of each arm minus fp32's and minus bf16's, paired by
    seed, with a 95% Student-t interval."""
    from statistics import mean, stdev
    t975 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776}   # t quantiles by number of seeds
    last = {arm: {s: [r["eval/accuracy"] for r in rows if "eval/accuracy" in r][-1]
                  for s, rows in seeds.items()} for arm, seeds in runs.items()}
    print("\n| comparison | mean | 95% CI | per seed |\n| --- | --- | --- | --- |")
    for base in ("fp32", "bf16"):
        for arm in last:
            seeds = sorted(set(last[arm]) & set(last.get(base, {})))
            if arm == base or (base == "bf16" and not arm.startswith("bf16_")) or len(seeds) < 2:
                continue
            d = [last[arm][s] - last[base][s] for s in seeds]
            h = t975.get(len(d), 2.0) * stdev(d) / len(d) ** 0.5
            print(f"| {arm} - {base} | {mean(d):+.3f} | [{mean(d) - h:+.3f}, {mean(d) + h:+.3f}] "
                  f"| {', '.join(f'{x:+.3f}' for x in d)} |")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["gradients"] and len(args) <= 3:
        gradients_main(*(args[1:] + ["out/qwen_small/sft/best", "out/off_policy_lab"][
            len(args) - 1:]))
    elif args[:1] == ["curves"] and len(args) == 3:
        curves_main(args[1], args[2])
    else:
        sys.exit("usage: python -m bench.off_policy_lab gradients [INIT_FROM] [OUT_DIR]\n"
                 "       python -m bench.off_policy_lab curves RUNS_DIR PNG")
