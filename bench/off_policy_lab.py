"""
The off-policy lab: what each correction (training.py) buys against a known
mismatch, measured against the expected on-policy gradient, with the noise that any
such measurement carries beside it. Our engine and trainer share model.py and agree
to about 1e-7 in fp32, and a seeded sample is a pure function of (seed, position), so:

  1. the reference: the policy being trained, its expected on-policy gradient, estimated
     by the mean of n_reference batches (rollouts of its own weights by the fp32 engine,
     GRPO's loss, no correction), each on problems and seeds of its own; its noise: the
     floor (the cosine between two independent one-batch estimates) and the cosine of
     its two halves;
  2. the exact gradient of each of n_batches other batches: the same, one batch;
  3. a mismatch source at a strength: the same problems and the same seeds as (2)
     (common random numbers: where the two policies agree the very same tokens are
     drawn), sampled by
       bf16      the engine in bfloat16 (rounding, and for this MoE model other experts)
       stale k   the engine k optimizer steps behind the trainer (k GRPO steps taken here)
       top_p p   the fp32 engine sampling the nucleus p (the engine's logprob is the nucleus's)
       vllm      a `vllm serve` process (fp32) holding the checkpoint's weights, pushed to
                 it through vLLM's RL API (its own random numbers: not the same draws)
  4. the gradient from those samples under each correction: none, TIS (cap 2), masked IS
     ([0.5, 2]), both at the sequence level (the geometric mean ratio), routing replay;
  5. per (source, correction) and batch: the cosine with the reference, minus the exact
     batch's (what the mismatch costs) and minus the uncorrected batch's (what the
     correction buys), each with a 95% interval over the batches; the bias ratio (the
     mean difference from the exact gradients against its size with no bias).

Run at three checkpoints of one GRPO run (bench/off_policy_lab.sh: its start, step 50,
step 100), the report gives every row per checkpoint and over the checkpoints.
PPO's clip is not in the table: on a step's first epoch its ratio is 1 and its
gradient is the plain one (test_off_policy.py); what it does shows only over several
epochs, in training.

    bash bench/off_policy_lab.sh                  # the three checkpoints, then the report
    python -m bench.off_policy_lab gradients [INIT_FROM] [OUT_DIR]
        # one checkpoint: default out/qwen_small/sft/best and out/off_policy_lab/early;
        # writes OUT_DIR/results.json
    python -m bench.off_policy_lab vllm INIT_FROM OUT_DIR URL
        # the source 'vllm' alone, sampled by the vllm serve at URL (docs/scale_out.md):
        # writes OUT_DIR/vllm.json, which the report adds to that checkpoint's table
    python -m bench.off_policy_lab report OUT_DIR PNG   # OUT_DIR/{early,middle,late}: table.md
    bash bench/off_policy_curves.sh [INIT_FROM]   # learning curves: fp32 vs bf16, stale ranks
    python -m bench.off_policy_lab curves out/off_policy_curves docs/off_policy_curves.png
"""

import dataclasses
import functools
import json
import math
import os
import sys
import tarfile
import tempfile

import numpy as np
import torch

from bench.report import paired_ci, pyplot as report_pyplot, t975
from tasks import evaluate
import train_grpo
import train_grpo_async
import training
from checkpoint import META, init_start, load_trainer_state, read_checkpoint_meta
from configurator import configure
from engine import EngineConfig
from tasks.environment import Environment, Group, load_task
from tokenizer import build_tokenizer

# -----------------------------------------------------------------------------
# settings
n_reference = 64              # on-policy batches (problems and seeds of their own): the reference
n_batches = 16                # batches per row, problems of their own; intervals are over these
problems_per_batch = 32       # training problems per batch, group_size samples each
CHECKPOINTS = ("early", "middle", "late")   # the report's order of out_dir's checkpoints
# a checkpoint is pooled when its reference's two halves agree at least this much (set after
# the first run showed step 100's at 0.07: no gradient to measure against)
RELIABLE = 0.5
sources = [("exact", None), ("bf16", None), ("stale", 1), ("stale", 4), ("top_p", 0.9),
           ("top_p", 0.7)]
corrections = {"none": {}, "tis": dict(tis_cap=2.0), "mis": dict(mis_low=0.5, mis_high=2.0),
               "seq_tis": dict(tis_cap=2.0, is_level="sequence"),
               "seq_mis": dict(mis_low=0.5, mis_high=2.0, is_level="sequence"),
               "replay": dict(routing_replay=True)}
# -----------------------------------------------------------------------------


def grpo_config(init_from):
    """train_grpo_async's settings under config/qwen_small.py (the main job's), quietly."""
    settings = {k: v for k, v in vars(train_grpo_async).items() if not k.startswith("_")}
    stdout, sys.stdout = sys.stdout, open(os.devnull, "w")
    try:
        config = configure(settings, ["config/qwen_small.py", f"--init_from={init_from}",
                                      "--record_routes=True"], stage="grpo")
    finally:
        sys.stdout = stdout
    return config


def batches_of(model, env, problems, config, seed, dtype="float32", top_p=1.0, remote=None):
    """GRPO's packed batches (flat groups dropped) of one rollout by an engine holding
    model's weights in dtype, seeded; or by remote (a RemoteEngine on servers that hold
    them)."""
    engine = remote or evaluate.task_engine(
        model, env, problems, EngineConfig(dtype=dtype, seed=seed, record_routes=True))
    G = config["group_size"]
    episodes = env.episodes(engine, problems, G, config["temperature"],
                            seed=seed, top_p=top_p)
    if remote is None:
        engine.shutdown()
    rewards, samples = [e.reward for e in episodes], [e.sample() for e in episodes]
    flat = train_grpo.zero_variance_groups(rewards, G).tolist()
    groups = [Group(p, samples[j * G:(j + 1) * G], rewards[j * G:(j + 1) * G])
              for j, p in enumerate(problems) if not flat[j]]
    return train_grpo_async.build_batches(groups, config)


def gradient(model, batches, config, normalizer):
    """The flat gradient of GRPO's loss on the batches after the configured correction."""
    model.zero_grad()
    off = torch.autocast("cpu", enabled=False)
    batches, _ = train_grpo_async.apply_corrections(batches, model, None, off, config)
    for b in batches:
        logp, _ = training.batch_logprobs(model, b, temperature=config["temperature"])
        train_grpo_async.policy_loss(logp, b, normalizer, config).backward()
    # a parameter no token reached (an expert with none routed to it) has no gradient: 0
    return torch.cat([torch.zeros(p.numel()) if p.grad is None else p.grad.flatten()
                      for p in model.parameters()]).clone()


def advance(model, env, problems, config, steps, start):
    """A copy of model after `steps` on-policy GRPO steps taken as the run takes them
    (prompts_per_step problems each, GRPO's normalizer, the run's AdamW, gradient
    clipping, the learning rate of its schedule from the checkpoint's step on): the
    trainer that a rollout of model is `steps` behind. The AdamW state is the
    checkpoint's when it has one (a fresh one's first steps move every weight by about
    the learning rate, as they do at a run's start)."""
    ahead = type(model)(model.config)
    ahead.load_state_dict(model.state_dict())
    opt = training.configure_optimizer(ahead, config["learning_rate"], config["weight_decay"],
                                       (config["beta1"], config["beta2"]), "cpu")
    if start.trainer_state is not None:
        opt.load_state_dict(start.trainer_state["optimizer"])
    plain = {**config, "record_routes": False}
    P, first = config["prompts_per_step"], start.meta.get("iter", 0) if start.meta else 0
    normalizer = train_grpo.loss_normalizer([], config)
    loss_fn = functools.partial(train_grpo_async.policy_loss, config=plain)
    for k in range(steps):
        batches = batches_of(ahead, env, problems[k * P:(k + 1) * P], plain, seed=10_000 + k)
        batches = [dataclasses.replace(b, routes=None) for b in batches]
        training.train_step(ahead, opt, batches, training.scheduled_lr(config, first + k),
                            config["grad_clip"], config["aux_loss_coef"], None, normalizer,
                            loss_fn, config["temperature"])
    return ahead


def cosine(a, b):
    a, b = a.double(), b.double()
    return float(torch.dot(a, b) / (a.norm() * b.norm()).clamp(min=1e-300))


def on_policy_reference(trainer, env, problems, config, normalizer):
    """trainer's expected on-policy gradient, estimated by the mean of n_reference
    batches (problems[i], seed 20_000 + i), with what tells its noise: the floor (the
    cosine between two independent one-batch estimates, over n_reference / 2 disjoint
    pairs), the cosine between the means of its two halves, and from it (Spearman-Brown)
    the mean's own expected cosine with the true gradient: with halves at cosine h,
    sqrt(2h / (1 + h))."""
    plain = {**config, "record_routes": False}
    grads = torch.stack([gradient(trainer, batches_of(trainer, env, p, plain, 20_000 + i),
                                  plain, normalizer) for i, p in enumerate(problems)])
    halves = cosine(grads[0::2].mean(0), grads[1::2].mean(0))
    return {"mean": grads.mean(0),
            "floor": [cosine(grads[i], grads[i + 1]) for i in range(0, len(grads) - 1, 2)],
            "split_half": halves,
            "reliability": math.sqrt(max(2 * halves / (1 + halves), 0.0))}


def kl_of(trainer, batches, temperature):
    """k3's KL(sampler || trainer) per sampled token of the batches, the trainer scoring at
    the sampler's temperature."""
    total, tokens = 0.0, 0
    with torch.no_grad():
        for b in batches:
            logp, _ = training.batch_logprobs(trainer, dataclasses.replace(b, routes=None),
                                              temperature=temperature)
            total += training.kl_k3(logp.float(), b.log_probs, b.loss_mask)
            tokens += int(b.loss_mask.sum())
    return total / max(tokens, 1)


def lab_problems(env, config):
    """The training problems, cut into batches: the reference's, the rows' (disjoint
    from them, at the end) and, between, the stale trainers' steps' (prompts_per_step
    problems a step)."""
    train, size = env.task.make_problems("train"), problems_per_batch
    chunks = [train[i * size:(i + 1) * size] for i in range(len(train) // size)]
    steps = max((s for kind, s in sources if kind == "stale"), default=0)
    spare = train[n_reference * size:][:steps * config["prompts_per_step"]]
    if n_reference * size + len(spare) > (len(chunks) - n_batches) * size:
        raise ValueError(f"{len(train)} training problems: too few for the lab's batches")
    return chunks[:n_reference], chunks[-n_batches:], spare


def trained_policy(start, env, config, kind, strength, problems):
    """(trainer, its reference, its exact gradient of each row batch): the checkpoint
    itself, or for 'stale k' the checkpoint k steps on."""
    reference_problems, batch_problems, spare = problems
    trainer = start.model if kind != "stale" else advance(start.model, env, spare, config,
                                                          strength, start)
    normalizer = problems_per_batch * config["group_size"] * config["max_new_tokens"]
    plain = {**config, "record_routes": False}
    reference = on_policy_reference(trainer, env, reference_problems, config, normalizer)
    exact = [gradient(trainer, batches_of(trainer, env, p, plain, 1_000 + b), plain, normalizer)
             for b, p in enumerate(batch_problems)]
    reference["exact_cos"] = [cosine(e, reference["mean"]) for e in exact]
    return trainer, reference, exact


def measure(start, env, config, sources=sources, remote=None):
    """{"sources": {source: {"trainer", "kl_k3", "rows": {correction: row}}}, "references":
    {trainer: its reference's noise}}: every source and correction on n_batches batches
    against the on-policy reference of the policy being trained (the source 'vllm': remote
    samples, no routes, so no routing replay)."""
    problems = lab_problems(env, config)
    normalizer = problems_per_batch * config["group_size"] * config["max_new_tokens"]
    out, trainers = {"sources": {}, "references": {}}, {}
    for kind, strength in sources:
        name = kind if strength is None else f"{kind} {strength}"
        trainer_name = name if kind == "stale" else "checkpoint"
        if trainer_name not in trainers:
            trainers[trainer_name] = trained_policy(start, env, config, kind, strength, problems)
            out["references"][trainer_name] = {
                k: v for k, v in trainers[trainer_name][1].items() if k != "mean"}
        trainer, reference, exact = trainers[trainer_name]
        dtype = "bfloat16" if kind == "bf16" else "float32"
        top_p = strength if kind == "top_p" else 1.0
        here = {c: v for c, v in corrections.items() if kind != "vllm" or c != "replay"}
        sampled_with = {**config, "record_routes": False} if kind == "vllm" else config
        got, kl = {c: [] for c in here}, []
        for b, batch in enumerate(problems[1]):   # the same problems and seeds as exact
            off = batches_of(start.model, env, batch, sampled_with, 1_000 + b, dtype, top_p,
                             remote if kind == "vllm" else None)
            kl.append(kl_of(trainer, off, config["temperature"]))
            for c, settings in here.items():
                got[c].append(gradient(trainer, off, {**config, **settings}, normalizer))
        rows = {c: row(g, exact, got["none"], reference["mean"]) for c, g in got.items()}
        out["sources"][name] = {"trainer": trainer_name, "kl_k3": float(np.mean(kl)),
                                "rows": rows}
        print(f"{name}: " + ", ".join(f"{c} {np.mean(r['minus_exact']):+.4f}"
                                      for c, r in rows.items()), flush=True)
    return out


def row(grads, exact, uncorrected, reference):
    """One (source, correction) row, per batch (so that each has an interval over the
    batches): the cosine with the reference ("cos_ref"); that minus the batch's exact
    gradient's cosine with it ("minus_exact": what the mismatch costs, paired by batch)
    and minus the uncorrected gradient's ("minus_none": what the correction buys); the
    cosine with the batch's exact gradient ("cos_paired"). Over the batches: the bias,
    |E[g - exact]|^2 / |reference|^2, estimated without the noise's own share (the mean
    of <d_i, d_j> over pairs i != j of the batches' differences d, unbiased: about 0 when
    there is none) with a jackknife 95% interval; and the mean gradient's norm over the
    exact one's."""
    g, e = torch.stack(grads).double(), torch.stack(exact).double()
    cos_ref = [cosine(x, reference) for x in g]
    return {"cos_ref": cos_ref,
            "minus_exact": [c - cosine(x, reference) for c, x in zip(cos_ref, e)],
            "minus_none": [c - cosine(x, reference) for c, x in zip(cos_ref, uncorrected)],
            "cos_paired": [cosine(x, y) for x, y in zip(g, e)],
            "bias": bias_squared(g - e, reference.double()),
            "norm": float(g.mean(0).norm() / e.mean(0).norm())}


def bias_squared(d, reference):
    """(estimate, lo, hi) of |E[d]|^2 / |reference|^2 from the rows of d, one per batch:
    (|sum d|^2 - sum |d_i|^2) / (n (n - 1)), the mean of <d_i, d_j> over i != j (its
    expectation is |E[d]|^2 exactly), and a jackknife 95% t interval."""
    n, scale = len(d), float(reference.norm() ** 2)
    total, squares = d.sum(0), (d * d).sum(1)
    def estimate(s, sq, m):
        return float((s.dot(s) - sq) / (m * (m - 1))) / scale
    full = estimate(total, squares.sum(), n)
    leave_one_out = np.array([estimate(total - d[i], squares.sum() - squares[i], n - 1)
                              for i in range(n)])
    half = t975(n - 1) * math.sqrt((n - 1) / n * ((leave_one_out - leave_one_out.mean()) ** 2)
                                   .sum())
    return full, full - half, full + half


def interval(values):
    """(mean, lo, hi): values' mean and 95% Student-t interval."""
    return paired_ci(values, [0.0] * len(values))


def gradients_main(init_from, out_dir, vllm_url=None):
    """Every source at one checkpoint (results.json); with vllm_url the source 'vllm' alone
    (vllm.json), the checkpoint's weights pushed to that server first."""
    torch.manual_seed(0)
    config = grpo_config(init_from)
    start = init_start(config, build_tokenizer)
    if os.path.isfile(os.path.join(start.source, META)):   # a training checkpoint: its step
        start = dataclasses.replace(start, meta=read_checkpoint_meta(start.source),   # and AdamW
                                    trainer_state=load_trainer_state(start.source))
    env = Environment(load_task(config["task"]), start.tokenizer, config["max_new_tokens"],
                      stop_ids=start.stop_ids)
    os.makedirs(out_dir, exist_ok=True)
    if vllm_url is None:
        measured, name = measure(start, env, config), "results.json"
    else:
        from scaleout.rollout_servers import RemoteEngine
        from scaleout.weight_sync import ServerWeights
        ServerWeights([vllm_url], start.model.state_dict()).send(start.model.state_dict(), "lab")
        remote = RemoteEngine([vllm_url], start.model.config)
        measured = measure(start, env, config, [("vllm", None)], remote)
        name = "vllm.json"
    results = {"init_from": init_from, "iter": start.iter_num, **measured}
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {out_dir}/{name}")


# -----------------------------------------------------------------------------
# the report: every checkpoint's rows, with their intervals


def ci_cell(stats, digits=3):
    """'mean [lo, hi]' of a (mean, lo, hi), signed."""
    mean, lo, hi = stats
    return f"{mean:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]"


def report_main(out_dir, png):
    """table.md from out_dir/<checkpoint>/results.json (checkpoints in CHECKPOINTS order):
    the references' noise, then per checkpoint every row with its trainer's floor and 95%
    intervals over its batches, then each row pooled over the checkpoints; and the
    figure."""
    runs = {c: json.load(open(os.path.join(out_dir, c, "results.json")))
            for c in CHECKPOINTS if os.path.isfile(os.path.join(out_dir, c, "results.json"))}
    if not runs:
        sys.exit(f"{out_dir}: no <checkpoint>/results.json ({', '.join(CHECKPOINTS)})")
    lines = reference_table(runs)
    for c, r in with_vllm(out_dir, runs).items():
        lines += ["", f"**{c}** ({r['init_from']}, step {r['iter']}); 95% intervals over "
                  f"{n_of(r)} batches", "",
                  "| source | k3 KL | correction | floor | cos with the reference | minus exact | "
                  "minus no correction | cos with the batch's exact | bias^2 / ref^2 | "
                  "norm ratio |", "| --- " * 10 + "|"]
        for source, by in r["sources"].items():
            floor = np.mean(r["references"][by["trainer"]]["floor"])
            for corr, x in by["rows"].items():
                lines.append(
                    f"| {source} | {by['kl_k3']:.1e} | {corr} | {floor:+.3f} | "
                    f"{ci_cell(interval(x['cos_ref']))} "
                    f"| {ci_cell(interval(x['minus_exact']))} | "
                    f"{ci_cell(interval(x['minus_none']))} | "
                    f"{ci_cell(interval(x['cos_paired']))} | {ci_cell(x['bias'], 4)} | "
                    f"{x['norm']:.3f} |")
    lines += pooled_table(runs)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot_gradients(runs, png)


def with_vllm(out_dir, runs):
    """runs, each checkpoint's sources with its vllm.json's (the source 'vllm') added where
    it has one."""
    out = {}
    for c, r in runs.items():
        path = os.path.join(out_dir, c, "vllm.json")
        extra = json.load(open(path))["sources"] if os.path.isfile(path) else {}
        out[c] = {**r, "sources": {**r["sources"], **extra}}
    return out


def reference_table(runs):
    """Per checkpoint and policy trained: the floor, the reference's split halves and its
    estimated cosine with the true gradient, and the exact batches' cosine with the
    reference (what an unbiased one-batch estimate scores)."""
    lines = ["| checkpoint | trainer | floor: cos of two one-batch estimates | reference's "
             "halves | reference vs truth (est.) | exact batch vs reference |",
             "| --- " * 6 + "|"]
    for c, r in runs.items():
        for trainer, ref in r["references"].items():
            lines.append(f"| {c} | {trainer} | {ci_cell(interval(ref['floor']))} | "
                         f"{ref['split_half']:.3f} | {ref['reliability']:.3f} | "
                         f"{ci_cell(interval(ref['exact_cos']))} |")
    return lines


def pooled(means_and_halves):
    """The mean of the checkpoints' means, with a 95% interval from their own intervals'
    half widths (sqrt of the summed squares, over their number): the checkpoints are
    three fixed points of one run, not a sample of runs."""
    means = [m for m, _ in means_and_halves]
    half = math.sqrt(sum(h * h for _, h in means_and_halves)) / len(means_and_halves)
    return float(np.mean(means)), float(np.mean(means)) - half, float(np.mean(means)) + half


def reliable(run):
    """Whether a checkpoint's references hold a gradient: every one's two halves at a
    cosine of RELIABLE or more (else every cosine with it is noise)."""
    return all(ref["split_half"] >= RELIABLE for ref in run["references"].values())


def pooled_table(runs):
    """Each row's minus-exact and minus-no-correction: every checkpoint's mean, and the
    pool of the reliable ones' with its interval."""
    kept = [c for c, r in runs.items() if reliable(r)]
    lines = ["", f"**Pooled over the checkpoints whose reference holds a gradient** "
             f"({', '.join(kept)}; halves at cosine >= {RELIABLE}): each checkpoint's mean, "
             "then the pool's with a 95% interval from the checkpoints' own", "",
             "| source | correction | minus exact | minus no correction |", "| --- " * 4 + "|"]
    first = next(iter(runs.values()))
    for source, by in first["sources"].items():
        for corr in by["rows"]:
            cols = []
            for stat in ("minus_exact", "minus_none"):
                each = [interval(r["sources"][source]["rows"][corr][stat]) for r in runs.values()]
                pool = pooled([(m, (hi - lo) / 2) for (m, lo, hi), c in zip(each, runs)
                               if c in kept] or [(math.nan, math.nan)])
                cols.append(" / ".join(f"{m:+.3f}" for m, _, _ in each) + f"; {ci_cell(pool)}")
            lines.append(f"| {source} | {corr} | {cols[0]} | {cols[1]} |")
    return lines


def n_of(results):
    return len(next(iter(results["sources"].values()))["rows"]["none"]["cos_ref"])


def plot_gradients(runs, png):
    """Per source, per correction: what the mismatch costs (cosine with the reference
    minus the exact batch's), one marker per checkpoint with its interval over batches."""
    plt = report_pyplot()
    if plt is None:
        return
    first = next(iter(runs.values()))
    names, width = list(corrections), 0.8 / len(corrections)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, corr in enumerate(names):
        for j, r in enumerate(runs.values()):
            x = np.arange(len(first["sources"])) + i * width + (j - 1) * width / 4
            stats = [interval(by["rows"][corr]["minus_exact"]) for by in r["sources"].values()]
            means = np.array([m for m, _, _ in stats])
            err = np.array([[m - lo, hi - m] for m, lo, hi in stats]).T
            ax.errorbar(x, means, yerr=err, fmt="os^"[j % 3], ms=3, color=f"C{i}",
                        label=corr if j == 0 else None)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(np.arange(len(first["sources"])) + 0.4 - width / 2, list(first["sources"]))
    ax.set_ylabel("cos with the reference, minus the exact batch's")
    ax.set_title(f"checkpoints {', '.join(runs)} (o s ^); 95% intervals over batches",
                 fontsize=9)
    ax.legend(ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


# -----------------------------------------------------------------------------
# the learning curves of bench/off_policy_curves.sh


def curves_main(out_dir, png):
    """The arms' table (validation at the last step, mean ± std over seeds; the mismatch
    metrics' means over every logged step, the k3 KL's median too), their paired
    differences and the plot, from out_dir/<arm>_seed<S>/metrics.jsonl (out_dir may be a
    .tar.gz of one such folder, as docs/results keeps them)."""
    if out_dir.endswith(".tar.gz"):
        with tempfile.TemporaryDirectory() as tmp:
            with tarfile.open(out_dir) as tar:
                tar.extractall(tmp, filter="data")
            (inner,) = os.listdir(tmp)
            return curves_main(os.path.join(tmp, inner), png)
    runs = {}
    for name in sorted(os.listdir(out_dir)):
        path = os.path.join(out_dir, name, "metrics.jsonl")
        if os.path.isfile(path):
            arm, seed = name.rsplit("_seed", 1)
            runs.setdefault(arm, {})[seed] = [json.loads(line) for line in open(path)]
    keys = ("train/logprob_mismatch", "offpolicy/kl_k3", "offpolicy/corrected",
            "offpolicy/expert_disagreement")
    print("| arm | seeds | val accuracy, last (mean ± std) | best | " +
          " | ".join(keys) + " | k3 KL, median |")
    print("| --- " * (5 + len(keys)) + "|")
    curves = {}
    for arm, seeds in runs.items():
        evals = [[(r["iter"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
                 for rows in seeds.values()]
        steps = sorted(set.intersection(*(set(i for i, _ in e) for e in evals)))
        acc = np.array([[dict(e)[s] for s in steps] for e in evals])
        curves[arm] = (steps, acc.mean(0))
        logged = {k: [r[k] for rows in seeds.values() for r in rows if k in r] for k in keys}
        means = [f"{np.mean(v):.2e}" if v else "n/a" for v in logged.values()]
        kl = logged["offpolicy/kl_k3"]
        spread = f"{acc[:, -1].std(ddof=1):.3f}" if len(acc) > 1 else "n/a"
        print(f"| {arm} | {len(evals)} | {acc[:, -1].mean():.3f} ± {spread} "
              f"| {acc.max(1).mean():.3f} | " + " | ".join(means) +
              f" | {f'{np.median(kl):.2e}' if kl else 'n/a'} |")
    paired_differences(runs)
    plt = report_pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, (steps, acc) in curves.items():
        ax.plot(steps, acc, marker="o", label=f"{arm} ({len(runs[arm])} seeds)",
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
    last = {arm: {s: [r["eval/accuracy"] for r in rows if "eval/accuracy" in r][-1]
                  for s, rows in seeds.items()} for arm, seeds in runs.items()}
    print("\n| comparison | seeds | mean | 95% CI | per seed |\n| --- | --- | --- | --- | --- |")
    for base in ("fp32", "bf16"):
        for arm in last:
            seeds = sorted(set(last[arm]) & set(last.get(base, {})), key=int)
            if arm == base or (base == "bf16" and not arm.startswith("bf16_")) or len(seeds) < 2:
                continue
            a, b = [last[arm][s] for s in seeds], [last[base][s] for s in seeds]
            mean, lo, hi = paired_ci(a, b)
            print(f"| {arm} - {base} | {len(seeds)} | {mean:+.3f} | [{lo:+.3f}, {hi:+.3f}] | "
                  f"{', '.join(f'{x - y:+.3f}' for x, y in zip(a, b))} |")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["gradients"] and len(args) <= 3:
        gradients_main(*(args[1:] + ["out/qwen_small/sft/best", "out/off_policy_lab/early"][
            len(args) - 1:]))
    elif args[:1] == ["vllm"] and len(args) == 4:
        gradients_main(args[1], args[2], args[3])
    elif args[:1] == ["report"] and len(args) == 3:
        report_main(args[1], args[2])
    elif args[:1] == ["curves"] and len(args) == 3:
        curves_main(args[1], args[2])
    else:
        sys.exit("usage: python -m bench.off_policy_lab gradients [INIT_FROM] [OUT_DIR]\n"
                 "       python -m bench.off_policy_lab vllm INIT_FROM OUT_DIR URL\n"
                 "       python -m bench.off_policy_lab report OUT_DIR PNG\n"
                 "       python -m bench.off_policy_lab curves RUNS_DIR PNG")
