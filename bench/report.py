"""The fair comparison (bench/compare.sh) read back from disk: tables with paired
95% intervals, plots.

bench/compare.sh trains, per seed, arms from one SFT checkpoint and scores each once on
the test split:
  heuristic the closest-pair rule, no learning (countdown.heuristic_answer)
  chain_rule the chain that takes the step leaving the smallest need, no learning
            (countdown.chain_rule_answer)
  sft       the SFT checkpoint itself (the start)
  sft_more  more SFT on the demonstrations, matched to GRPO's FLOPs, early-stopped on validation
  rft       rejection-sampling fine-tuning, same FLOPs, early-stopped on validation
  grpo      GRPO
  sft_all   SFT on a demonstration for every training problem (a reference: a full solver's worth)
  grpo_pass4 GRPO with pass@4 advantages (advantage_pass_k=4): the coverage arm, bench/coverage.sh
An arm missing from every seed is left out (older comparisons have no heuristic or
sft_all). This script reads those evaluations (OUT_DIR/seed<S>/test_<arm>/metrics.jsonl,
the last row, and outcomes.jsonl beside it), writes OUT_DIR/results.json, prints
markdown tables (each arm's test metrics, mean ± std over seeds; accuracy by problem
size and by reach band, where the outcomes carry a reach; the paired differences of
greedy accuracy with their 95% intervals, by seed and by a cluster bootstrap over digit
multisets, and of pass@k by seed) and plots validation accuracy against wall-clock time
and against FLOPs spent (OUT_DIR/val_accuracy.png, when matplotlib is installed).

    python -m bench.report out/compare 1 2 3 4 5   # the seeds to read (none: every seed<S>)
    python -m bench.report --confirm out/compare   # the confirmatory split's (confirm_<arm>)
    python -m bench.report --run out/qwen_small/grpo out/qwen_small/grpo.png   # one run
    python -m bench.report --run RUN PNG out/qwen_small/val_heuristic ...   # + a rule

A difference is paired by seed (both arms start from the same pretrain and SFT
checkpoint): with d_s = a_s - b_s over n seeds, the interval is
mean(d) ± t_{0.975, n-1} * std(d, ddof=1) / sqrt(n) (Student's t). It covers the
seed-to-seed variation of everything after the shared checkpoint, test-split noise
included in each d_s. The cluster bootstrap covers the other source, which problems
the test split happens to hold: each problem's difference is averaged over seeds,
digit multisets (a split's unit) are resampled with replacement, and the interval is
the 2.5th and 97.5th percentile of the mean difference over 2,000 resamples."""
import json
import math
import os
import re
import sys

import numpy as np

ARMS = ("heuristic", "chain_rule", "sft", "sft_more", "rft", "grpo", "sft_all", "grpo_pass4")
COMPARISONS = (("grpo", "heuristic"), ("grpo", "chain_rule"), ("grpo", "sft"),
               ("grpo", "sft_more"), ("grpo", "rft"), ("grpo", "sft_all"),
               ("sft_more", "sft"), ("rft", "sft"),
               ("grpo_pass4", "grpo"), ("grpo_pass4", "sft"), ("grpo_pass4", "rft"))
SIZES = ("3digits", "4digits", "5digits")
# reach bands (countdown.reach: the chance one blind attempt solves a problem), [lo, hi)
REACH_BANDS = ((0.0, 0.02), (0.02, 0.05), (0.05, 0.1), (0.1, 0.2), (0.2, 1.01))
BOOTSTRAP = 2000
# the arms that train from the SFT checkpoint: the plot's curves
CURVE_ARMS = ("grpo", "sft_more", "rft")

# t_{0.975, df}, the two-sided 95% quantile of Student's t for df = 1..30 (standard
# tables, 3 decimals)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
        2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
        2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


# -----------------------------------------------------------------------------
# statistics


def t975(df):
    """t_{0.975, df}. Past df = 30 the table's last value, which is slightly wide (t
    tends to 1.960)."""
    if df < 1:
        raise ValueError(f"df={df}: a t interval needs at least 2 paired values")
    return T975[min(df, len(T975)) - 1]


def std(values):
    """The sample standard deviation (ddof=1) of values; None for fewer than two
    (undefined)."""
    return float(np.std(values, ddof=1)) if len(values) > 1 else None


def paired_ci(a, b):
    """(mean, lo, hi) of a - b, paired by position: the mean difference and its 95%
    Student-t interval. One pair has no spread to estimate: lo and hi are then nan."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.ndim != 1 or a.shape != b.shape or len(a) == 0:
        raise ValueError(f"paired_ci: shapes {a.shape} and {b.shape}, not one length, non-empty")
    d = a - b
    mean = float(d.mean())
    if len(d) == 1:
        return mean, math.nan, math.nan
    half = t975(len(d) - 1) * std(d) / math.sqrt(len(d))
    return mean, mean - half, mean + half


# -----------------------------------------------------------------------------
# the evaluations on disk -> results.json


def read_rows(path):
    """The JSON rows of a metrics.jsonl, in file order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def arms_present(out_dir, seeds, split="test"):
    """The arms with an evaluation on split in some seed; each must then have one in
    every seed."""
    def evaluated(arm, seed):
        return os.path.isdir(os.path.join(out_dir, f"seed{seed}", f"{split}_{arm}"))
    present = [a for a in ARMS if any(evaluated(a, s) for s in seeds)]
    if "grpo" not in present:
        raise FileNotFoundError(f"{out_dir}: no seed has {split}_grpo "
                                "(run bash bench/compare.sh)")
    return present


def load(out_dir, seeds, split="test"):
    """Each seed's evaluation of each arm on split ('test', or 'confirm': the
    confirmatory split): {"split": split, "arms": [...], "per_seed": {seed: {arm: greedy
    accuracy}}, "pass@1": {...}, "pass@<k>": {...}, "accuracy_3digits": {...},
    "accuracy_4digits": {...}}, seeds as strings. A missing or unfinished evaluation of
    a present arm is an error that names its file."""
    results = {"split": split, "arms": arms_present(out_dir, seeds, split), "per_seed": {}}
    for seed in map(str, seeds):
        for arm in results["arms"]:
            path = os.path.join(out_dir, f"seed{seed}", f"{split}_{arm}", "metrics.jsonl")
            if not os.path.exists(path):
                raise FileNotFoundError(f"{path} is missing (run bash bench/compare.sh {seed})")
            rows = read_rows(path)
            if not rows or "eval/accuracy" not in rows[-1]:
                raise ValueError(f"{path}: its last row has no eval/accuracy (unfinished?)")
            row = rows[-1]
            results["per_seed"].setdefault(seed, {})[arm] = row["eval/accuracy"]
            for key in row:
                if key.startswith("eval/pass@") or key.startswith("eval/accuracy_"):
                    results.setdefault(key[len("eval/"):], {}).setdefault(seed, {})[arm] = row[key]
    return results


def read_outcomes(out_dir, seeds, arm, split="test"):
    """[seed][problem] outcomes of an arm's evaluation on split, problems in file order
    (the split's), or None when a seed has no outcomes.jsonl (an evaluation older than
    them)."""
    per_seed = []
    for seed in map(str, seeds):
        path = os.path.join(out_dir, f"seed{seed}", f"{split}_{arm}", "outcomes.jsonl")
        if not os.path.exists(path):
            return None
        per_seed.append(read_rows(path))
    return per_seed


def cluster_bootstrap(diff, clusters, resamples=BOOTSTRAP, seed=0):
    """(lo, hi), the 95% percentile interval of mean(diff) when whole clusters are
    resampled with replacement. diff: one value per problem; clusters: one hashable
    label per problem (its digit multiset)."""
    diff = np.asarray(diff, dtype=float)
    labels = {c: i for i, c in enumerate(dict.fromkeys(clusters))}
    index = np.array([labels[c] for c in clusters])
    sums, counts = np.bincount(index, weights=diff), np.bincount(index)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(sums), size=(resamples, len(sums)))
    means = sums[picks].sum(axis=1) / counts[picks].sum(axis=1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def pass_keys(results):
    """The pass@k entries of results, by k (pass@1 first)."""
    return sorted((k for k in results if k.startswith("pass@")),
                  key=lambda k: int(k.split("@")[1]))


def summarize(results, out_dir=None):
    """results plus "summary" (each arm's greedy accuracy: mean, std with ddof=1),
    "paired" (each comparison a - b of present arms: mean difference, ci95 = [lo, hi]
    over seeds, n seeds, and, with out_dir and outcomes on disk, bootstrap95, the
    cluster bootstrap interval) and "paired_pass" (the same by seed for each pass@k,
    where every seed has both arms'). None where one seed leaves a value undefined."""
    seeds, arms = list(results["per_seed"]), results.get("arms", ARMS)
    split = results.get("split", "test")
    acc = {arm: [results["per_seed"][s][arm] for s in seeds] for arm in arms}
    summary = {arm: {"mean": float(np.mean(v)), "std": std(v)} for arm, v in acc.items()}
    paired = {}
    for a, b in COMPARISONS:
        if a in arms and b in arms:
            paired[f"{a}-{b}"] = {
                **paired_entry(acc[a], acc[b]),
                "bootstrap95": bootstrap_pair(out_dir, seeds, a, b, split) if out_dir else None}
    paired_pass = {}   # the same comparisons of each pass@k, by seed
    for key in pass_keys(results):
        value = {s: results[key].get(s, {}) for s in seeds}
        for a, b in COMPARISONS:
            if all(a in value[s] and b in value[s] for s in seeds):
                paired_pass.setdefault(key, {})[f"{a}-{b}"] = paired_entry(
                    [value[s][a] for s in seeds], [value[s][b] for s in seeds])
    by_reach = reach_bands(out_dir, seeds, arms, split) if out_dir else None
    return {**results, "summary": summary, "paired": paired, "paired_pass": paired_pass,
            **({"accuracy_by_reach": by_reach} if by_reach else {})}


def paired_entry(a, b):
    """{"mean", "ci95" ([lo, hi], None for one seed), "n"} of a - b paired by seed."""
    mean, lo, hi = paired_ci(a, b)
    return {"mean": mean, "ci95": None if math.isnan(lo) else [lo, hi], "n": len(a)}


def reach_bands(out_dir, seeds, arms, split="test"):
    """{"bands": [[lo, hi], ...], "problems": [count per band], arm: [mean greedy
    accuracy over seeds per band]}, from the outcomes' reach field; None when an arm's
    outcomes lack it."""
    per_arm = {arm: read_outcomes(out_dir, seeds, arm, split) for arm in arms}
    if any(o is None or not o[0] or "reach" not in o[0][0] for o in per_arm.values()):
        return None
    reach = np.array([o["reach"] for o in next(iter(per_arm.values()))[0]])
    masks = [(lo <= reach) & (reach < hi) for lo, hi in REACH_BANDS]
    out = {"bands": [list(b) for b in REACH_BANDS],
           "problems": [int(m.sum()) for m in masks]}
    for arm, rows in per_arm.items():
        right = np.array([[o["reward"] for o in seed_rows] for seed_rows in rows])
        out[arm] = [float(right[:, m].mean()) if m.any() else None for m in masks]
    return out


def bootstrap_pair(out_dir, seeds, a, b, split="test"):
    """The cluster bootstrap interval of a - b over digit multisets; None
    without both outcomes."""
    oa, ob = read_outcomes(out_dir, seeds, a, split), read_outcomes(out_dir, seeds, b, split)
    if oa is None or ob is None:
        return None
    problems = [(tuple(o["digits"]), o["target"]) for o in oa[0]]
    for rows in oa + ob:
        if [(tuple(o["digits"]), o["target"]) for o in rows] != problems:
            raise ValueError(f"{out_dir}: the outcomes of {a} and {b} are not on the same problems")
    per_seed = [[x["reward"] - y["reward"] for x, y in zip(ra, rb)] for ra, rb in zip(oa, ob)]
    diff = np.mean(per_seed, axis=0)
    return list(cluster_bootstrap(diff, [tuple(sorted(d)) for d, _ in problems]))


# -----------------------------------------------------------------------------
# the tables


def cell(values):
    """'mean ± std (v1, v2, ...)' of one arm's per-seed values; std is n/a for one seed."""
    if any(v is None for v in values):
        return "n/a"
    sd = std(values)
    per_seed = ", ".join(f"{v:.3f}" for v in values)
    return f"{np.mean(values):.3f} ± {'n/a' if sd is None else f'{sd:.3f}'} ({per_seed})"


def ci_text(ci95):
    """'[lo, hi]' of an interval, signed; n/a for none."""
    return "n/a" if ci95 is None else "[{:+.3f}, {:+.3f}]".format(*ci95)


def verdict(ci95):
    """Whether a 95% interval excludes 0, and on which side."""
    if ci95 is None:
        return "n/a"
    lo, hi = ci95
    return "yes, above 0" if lo > 0 else "yes, below 0" if hi < 0 else "no"


def tables(results):
    """The markdown tables, as text: each arm's metrics on the split over seeds, accuracy
    by problem size, and the paired differences."""
    seeds, arms = list(results["per_seed"]), results.get("arms", ARMS)
    split = results.get("split", "test")
    metrics = [("greedy accuracy", "per_seed")] + [(k, k) for k in pass_keys(results)]
    lines = [f"{split} split, mean ± std (ddof=1) over seeds {', '.join(seeds)} "
             "(per-seed values):",
             "", "| arm | " + " | ".join(name for name, _ in metrics) + " |",
             "|" + " --- |" * (len(metrics) + 1)]
    for arm in arms:
        cells = [cell([results[key].get(s, {}).get(arm) for s in seeds]) for _, key in metrics]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    sized = [k for k in SIZES if f"accuracy_{k}" in results]
    if sized:
        lines += ["", f"greedy {split} accuracy by problem size, mean over seeds:", "",
                  "| arm | " + " | ".join(k.replace("digits", " digits") for k in sized) + " |",
                  "|" + " --- |" * (len(sized) + 1)]
        for arm in arms:
            values = [[results[f"accuracy_{k}"].get(s, {}).get(arm) for s in seeds] for k in sized]
            cells = ["n/a" if None in v else f"{np.mean(v):.3f}" for v in values]
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines += reach_table(results.get("accuracy_by_reach"), arms, split)
    lines += ["", f"paired differences of greedy {split} accuracy: 95% Student-t interval over "
              f"{len(seeds)} seeds, and a cluster bootstrap over digit multisets:", "",
              "| comparison | mean difference | 95% CI (seeds) | excludes 0? | 95% CI (bootstrap) "
              "| excludes 0? |", "| --- | --- | --- | --- | --- | --- |"]
    for name, p in results["paired"].items():
        boot = p.get("bootstrap95")
        lines.append(f"| {name.replace('-', ' - ')} | {p['mean']:+.3f} | {ci_text(p['ci95'])} | "
                     f"{verdict(p['ci95'])} | {ci_text(boot)} | {verdict(boot)} |")
    for key, by in results.get("paired_pass", {}).items():
        lines += ["", f"paired differences of {split} {key} (at the rollouts' temperature): 95% "
                  f"Student-t interval over {len(seeds)} seeds:", "",
                  "| comparison | mean difference | 95% CI (seeds) | excludes 0? |",
                  "| --- | --- | --- | --- |"]
        for name, p in by.items():
            lines.append(f"| {name.replace('-', ' - ')} | {p['mean']:+.3f} | "
                         f"{ci_text(p['ci95'])} | {verdict(p['ci95'])} |")
    return "\n".join(lines)


def reach_table(by_reach, arms, split="test"):
    """The lines of the greedy accuracy on split by reach band, empty bands left out (none
    without reach in the outcomes)."""
    if not by_reach:
        return []
    kept = [i for i, n in enumerate(by_reach["problems"]) if n]
    heads = [f"reach {lo:.2f}-{min(hi, 1):.2f} ({n})"
             for (lo, hi), n in zip(by_reach["bands"], by_reach["problems"])]
    heads = [heads[i] for i in kept]
    lines = ["", f"greedy {split} accuracy by reach band (problems in the band), mean over seeds:",
             "",
             "| arm | " + " | ".join(heads) + " |", "|" + " --- |" * (len(heads) + 1)]
    for arm in arms:
        cells = [f"{by_reach[arm][i]:.3f}" for i in kept]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines


# -----------------------------------------------------------------------------
# the plot: validation accuracy against wall-clock time, and against the FLOPs
# the budgets match


def val_curve(path):
    """(seconds, accuracies) of a run's validation evaluations, in file order: the rows of
    its metrics.jsonl that carry both eval/accuracy and perf/elapsed_s. Empty lists when
    the file is missing."""
    if not os.path.exists(path):
        return [], []
    rows = [r for r in read_rows(path) if "eval/accuracy" in r and "perf/elapsed_s" in r]
    return [r["perf/elapsed_s"] for r in rows], [r["eval/accuracy"] for r in rows]


def flops_curve(path):
    """(FLOPs spent, accuracies) of a run's validation evaluations: the budget the arms
    are matched on, RFT's sampling and GRPO's rollouts included. An evaluation row has
    no perf/flops_total, so an evaluation at iteration k is placed on the line through
    the training rows' (iter, perf/flops_total), extended back from the first two before
    the first log: rows (10, 5.0) and (20, 6.0) put iteration 0 at 4.0 (RFT's sampling,
    spent before its first step). Empty lists when the file is missing or logs no FLOPs."""
    if not os.path.exists(path):
        return [], []
    rows = read_rows(path)
    spent = [(r["iter"], r["perf/flops_total"]) for r in rows if "perf/flops_total" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    if len(spent) < 2 or not evals:
        return [], []
    (i0, f0), (i1, f1) = spent[:2]
    iters, flops = [i for i, _ in spent], [f for _, f in spent]
    slope = (f1 - f0) / (i1 - i0)
    x = [float(np.interp(r["iter"], iters, flops)) if r["iter"] >= i0
         else f0 - (i0 - r["iter"]) * slope for r in evals]
    return x, [r["eval/accuracy"] for r in evals]


def mean_curve(curves, points=200):
    """(grid, mean) of piecewise-linear curves over seeds, on the range of x that every
    one of them covers; None when there is no such range (no curves, or one eval point
    each)."""
    curves = [(t, a) for t, a in curves if len(t) > 0]
    if not curves:
        return None
    lo, hi = max(t[0] for t, _ in curves), min(t[-1] for t, _ in curves)
    if hi <= lo:
        return None
    grid = np.linspace(lo, hi, points)
    return grid, np.mean([np.interp(grid, t, a) for t, a in curves], axis=0)


def draw(ax, out_dir, seeds, curve, xlabel):
    """One panel: curve(metrics path) -> (x, accuracies) for each trained arm and
    seed, a thin line per seed, the mean over seeds in bold, and the SFT
    checkpoint's own validation accuracy (the GRPO run's first evaluation, at
    iteration 0) as a dashed line."""
    for arm, color in zip(CURVE_ARMS, ("C3", "C0", "C2")):
        curves = [curve(os.path.join(out_dir, f"seed{s}", arm, "metrics.jsonl")) for s in seeds]
        for t, a in curves:
            ax.plot(t, a, color=color, lw=0.8, alpha=0.35, marker=".", ms=3)
        n = sum(1 for t, _ in curves if t)
        mean = mean_curve(curves)
        if mean is not None:
            ax.plot(*mean, color=color, lw=2.5,
                    label=f"{arm}: mean of {n} seeds (thin: each seed)")
        elif n:
            ax.plot([], [], color=color, lw=0.8, label=f"{arm}: {n} seeds")
    start = [a[0] for _, a in (val_curve(os.path.join(out_dir, f"seed{s}", "grpo", "metrics.jsonl"))
                               for s in seeds) if a]
    if start:
        ax.axhline(np.mean(start), color="gray", ls="--", lw=1.5,
                   label=f"sft (the start): mean of {len(start)} seeds")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation greedy accuracy")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)


def pyplot():
    """matplotlib.pyplot on a file backend, or None (said once) when matplotlib
    is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (.venv/bin/pip install matplotlib): no plot")
        return None
    return plt


def plot(out_dir, seeds, path):
    """Validation accuracy of each arm from the SFT checkpoint on, against its own
    training seconds (left) and against the FLOPs it has spent (right). Returns the path
    written, or None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    draw(left, out_dir, seeds, val_curve,
         "wall-clock seconds of training since the SFT checkpoint")
    draw(right, out_dir, seeds, flops_curve,
         "FLOPs spent since the SFT checkpoint (RFT's sampling included)")
    fig.suptitle(
        f"validation accuracy against time and compute, seeds {', '.join(map(str, seeds))}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_run(run_dir, path, rule_dirs=()):
    """One GRPO run against its steps, two panels: what speedrun.sh shows. Top:
    validation accuracy (of a multi-turn run: right within 1, 2, ... turns) and the
    rollouts' mean reward, with the SFT start (the first evaluation) and the best of
    the no-learning rules (rule_dirs: tasks/evaluate.py's outputs on validation) as
    horizontal lines. Bottom: mean completion length of the rollouts. Returns the path
    written (None without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return None
    rows = read_rows(os.path.join(run_dir, "metrics.jsonl"))
    evals = [r for r in rows if "eval/accuracy" in r]
    # multi-turn runs: success within each number of turns, turn 1 first
    # (eval/success_by_turn_k)
    keys = evals[0] if evals else {}
    turns = sorted((k for k in keys if k.startswith("eval/success_by_turn_")),
                   key=lambda k: int(k.rsplit("_", 1)[1]))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9 if turns else 7, 6.5), sharex=True)
    for i, key in enumerate(turns or ["eval/accuracy"]):
        label = f"right within {key.rsplit('_', 1)[1]} turn(s)" if turns else "validation accuracy"
        top.plot([r["iter"] for r in evals], [r[key] for r in evals], marker="o",
                 color=f"C{3 + i}", label=label)
    draw_references(top, rows, evals, rule_dirs)
    # beside the panel when the curves fill it
    where = dict(loc="center left", bbox_to_anchor=(1.01, 0.5)) if turns else dict(loc="best")
    top.legend(fontsize="small", **where)
    top.set_ylabel("greedy accuracy / mean reward")
    lengths = [(r["iter"], r["rollout/completion_len"]) for r in rows
               if "rollout/completion_len" in r]
    if lengths:
        bottom.plot(*zip(*lengths), color="C0", marker="o" if len(lengths) < 2 else None)
    bottom.set_ylabel("mean sampled tokens per episode")
    bottom.set_xlabel("GRPO step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.suptitle(f"GRPO from its SFT start: {run_dir}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_references(ax, rows, evals, rule_dirs):
    """The rollouts' mean reward by step (sampled, on the training problems the sampler
    drew), the SFT start and the best rule on validation (a rule's name: its
    directory's, less 'val_')."""
    rewards = [(r["iter"], r["rollout/reward_mean"])
               for r in rows if "rollout/reward_mean" in r]
    if rewards:
        ax.plot(*zip(*rewards), color="C0", alpha=0.7,
                label="rollouts' mean reward (sampled, training problems)")
    if evals:
        ax.axhline(evals[0]["eval/accuracy"], color="gray", linestyle="--",
                   label=f"SFT start {evals[0]['eval/accuracy']:.3f}")
    rules = {os.path.basename(os.path.normpath(d)).removeprefix("val_"):
             read_rows(os.path.join(d, "metrics.jsonl"))[-1]["eval/accuracy"] for d in rule_dirs}
    if rules:
        name, best = max(rules.items(), key=lambda kv: kv[1])
        ax.axhline(best, color="black", linestyle=":",
                   label=f"best rule ({name}) {best:.3f}")


# -----------------------------------------------------------------------------
# main


def find_seeds(out_dir):
    """The seeds that have a seed<S> directory under out_dir, in numeric order."""
    names = os.listdir(out_dir) if os.path.isdir(out_dir) else []
    return sorted((m.group(1) for m in map(re.compile(r"seed(\d+)$").match, names) if m), key=int)


def main(argv):
    """bench/report.py [--confirm] OUT_DIR [SEED ...]: load, summarize, print the tables,
    write results.json (--confirm: the confirmatory split's, results_confirm.json), plot.
    bench/report.py --run RUN_DIR PNG [RULE_DIR ...]: plot one GRPO run (plot_run)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    if argv[0] == "--run":
        if len(argv) < 3:
            raise SystemExit("usage: python -m bench.report --run RUN_DIR PNG [RULE_DIR ...]")
        png = plot_run(argv[1], argv[2], argv[3:])
        if png is not None:
            print(f"wrote {png}")
        return 0
    split = "confirm" if argv[0] == "--confirm" else "test"
    argv = argv[1:] if split == "confirm" else argv
    if not argv or not all(s.isdigit() for s in argv[1:]):
        raise SystemExit("usage: python -m bench.report [--confirm] OUT_DIR [SEED ...]")
    out_dir, seeds = argv[0], [str(s) for s in argv[1:]] or find_seeds(argv[0])
    try:   # (no seed<S> directory at all: no seed has <split>_grpo)
        results = summarize(load(out_dir, seeds, split), out_dir)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"bench/report.py: {e}") from None
    path = os.path.join(out_dir, "results.json" if split == "test" else f"results_{split}.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2, allow_nan=False)
    print(tables(results))
    print(f"\nwrote {path}")
    png = None if split != "test" else plot(out_dir, seeds, os.path.join(out_dir,
                                                                          "val_accuracy.png"))
    if png is not None:
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
