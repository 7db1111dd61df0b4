"""
pass@k from 1 to 256: does GRPO narrow what the model can reach, or only sharpen it? Each
arm's model (bench/compare.sh's checkpoints) samples n answers to each of the first P test
problems at the rollouts' temperature; pass@k is the unbiased estimate from those n (Chen et
al. 2021: 1 - C(n - c, k) / C(n, k) for c right of n), read against the blind search's
exact curve on the same problems, 1 - (1 - reach)^k (countdown.blind_pass_at_k), by reach
band. A policy that only narrowed toward what it already solved falls below the blind search
at large k; one that widened stays above it.

    python -m bench.pass_at_k sample out/compare 1 sft grpo rft   # -> seed1/passk_<arm>/
    python -m bench.pass_at_k report out/compare docs/results/pass_at_k/pass_at_k.png

Each arm's counts (one line a problem: digits, target, reach, right of n) are written to
OUT/seed<S>/passk_<arm>/outcomes.jsonl; report reads them all and draws the plot.
"""

import contextlib
import io
import math
import os
import sys

import numpy as np

from bench import report as compare_report
from tasks import countdown, evaluate
import train_grpo
from checkpoint import init_start
from configurator import configure
from tasks.environment import Environment
from tokenizer import build_tokenizer

# -----------------------------------------------------------------------------
# settings
n_samples = 256               # answers sampled per problem: pass@k is estimated for k <= this
n_problems = 160              # the first P test problems (the split's fixed hashed order)
KS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# reach bands, [lo, hi): bench/report.py's three that the edge's test split holds
BANDS = compare_report.REACH_BANDS[2:]
SEED = 0                      # the sampling seed, the same for every arm
PAIRS = (("grpo", "sft"), ("rft", "sft"), ("grpo_pass4", "sft"), ("grpo_pass4", "grpo"))
# -----------------------------------------------------------------------------


def pass_at_k(n, c, k):
    """The unbiased estimate of pass@k from c right answers among n samples: the chance
    that k of them drawn without replacement hold at least one right one (k <= n)."""
    if n - c < k:   # every k of them hold a right one
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def sample_counts(model_dir, problems):
    """Per problem, how many of n_samples answers at the rollouts' temperature are right,
    for the model in model_dir, under the main job's settings (config/qwen_small.py)."""
    settings = {k: v for k, v in vars(train_grpo).items() if not k.startswith("_")}
    with contextlib.redirect_stdout(io.StringIO()):   # the config's echo, once per arm
        config = configure(settings, ["config/qwen_small.py", f"--init_from={model_dir}",
                                      f"--seed={SEED}"], stage="grpo")
    start = init_start(config, build_tokenizer)
    env = Environment(countdown, start.tokenizer, config["max_new_tokens"],
                      stop_ids=start.stop_ids)   # single-turn, as the evaluations
    # the evaluations' engine: the config's device, dtype and block size
    engine = evaluate.task_engine(start.model, env, problems,
                                  train_grpo.engine_config(config, start))
    counts = []
    for i in range(0, len(problems), 16):   # 4,096 episodes a call: the engine's queue stays short
        chunk = problems[i:i + 16]
        episodes = env.episodes(engine, chunk, n_samples, config["temperature"], seed=SEED + i)
        right = np.array([evaluate.solved(e.reward) for e in episodes])
        right = right.reshape(len(chunk), n_samples)
        counts += right.sum(axis=1).tolist()
    engine.shutdown()
    return counts


def sample(out_dir, seed, arms):
    problems = countdown.make_problems("test", n_problems)
    for arm in arms:
        counts = sample_counts(os.path.join(out_dir, f"seed{seed}", arm, "best"), problems)
        rows = [{**countdown.describe(p), "right": c, "n": n_samples}
                for p, c in zip(problems, counts)]
        evaluate.write_outcomes(os.path.join(out_dir, f"seed{seed}", f"passk_{arm}"), rows)
        print(f"seed {seed} {arm}: pass@1 {np.mean(counts) / n_samples:.3f}, pass@{n_samples} "
              f"{np.mean([c > 0 for c in counts]):.3f}")


def read_counts(out_dir):
    """{arm: [seed's rows]} of every passk_<arm>/outcomes.jsonl under out_dir/seed<S>."""
    found = {}
    for seed in compare_report.find_seeds(out_dir):
        seed_dir = os.path.join(out_dir, f"seed{seed}")
        for arm_dir in sorted(os.listdir(seed_dir)):
            path = os.path.join(seed_dir, arm_dir, "outcomes.jsonl")
            if arm_dir.startswith("passk_") and os.path.exists(path):
                found.setdefault(arm_dir[len("passk_"):], []).append(
                    compare_report.read_rows(path))
    return found


def curves(found):
    """{band: {"k": [...], "problems": count, arm or 'blind search': [mean pass@k over the
    band's problems (and the seeds) for each k]}}, the band 'all' first, then the reach
    bands that hold a problem; k in KS up to the fewest samples of a problem."""
    rows = next(iter(found.values()))[0]
    problems = [countdown.Problem(tuple(r["digits"]), r["target"]) for r in rows]
    for seeds in found.values():   # every arm and seed on the same problems, in one order
        for seed_rows in seeds:
            assert [(tuple(r["digits"]), r["target"]) for r in seed_rows] == \
                [(p.digits, p.target) for p in problems], "pass@k outcomes on other problems"
    reach = np.array([float(countdown.reach(p)) for p in problems])
    ks = [k for k in KS if k <= min(r["n"] for seeds in found.values() for s in seeds
                                    for r in s)]
    masks = {"all": np.ones(len(rows), bool),
             **{f"reach {lo:.2f}-{min(hi, 1):.2f}": (lo <= reach) & (reach < hi)
                for lo, hi in BANDS}}
    out = {}
    for band, mask in masks.items():
        if not mask.any():
            continue
        blind = [float(np.mean([countdown.blind_pass_at_k(p, k)
                                for p, m in zip(problems, mask) if m])) for k in ks]
        out[band] = {"k": ks, "problems": int(mask.sum()), "blind search": blind}
        for arm, seeds in found.items():
            per_seed = [[np.mean([pass_at_k(r["n"], r["right"], k)
                                  for r, m in zip(seed_rows, mask) if m]) for k in ks]
                        for seed_rows in seeds]
            out[band][arm] = np.mean(per_seed, axis=0).tolist()
    return out


def paired(found, ks):
    """Per pair in PAIRS whose arms both have counts: each k's difference of the arms'
    pass@k over all the problems, paired by seed (mean, 95% t interval)."""
    def per_seed(arm, k):
        return [np.mean([pass_at_k(r["n"], r["right"], k) for r in rows]) for rows in found[arm]]
    return {(a, b): [compare_report.paired_ci(per_seed(a, k), per_seed(b, k)) for k in ks]
            for a, b in PAIRS if a in found and b in found}


def curve_lines(lines):
    """A band's (name, values) curves: the blind search's, then each arm's."""
    return [(name, v) for name, v in lines.items() if name not in ("k", "problems")]


def report(out_dir, png):
    found = read_counts(out_dir)
    table = curves(found)
    for band, lines in table.items():
        print(f"\n{band} ({lines['problems']} problems, {len(next(iter(found.values())))} "
              f"seed(s)): pass@k for k = {', '.join(map(str, lines['k']))}")
        for name, values in curve_lines(lines):
            print(f"  {name:13s} " + " ".join(f"{v:.3f}" for v in values))
    ks = table["all"]["k"]
    print(f"\npaired by seed, all {table['all']['problems']} problems: the difference of pass@k "
          "and its 95% t interval")
    for (a, b), stats in paired(found, ks).items():
        print(f"  {a} - {b}")
        for k, (mean, lo, hi) in zip(ks, stats):
            print(f"    k = {k:3d}: {mean:+.3f} [{lo:+.3f}, {hi:+.3f}]")
    plt = compare_report.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(table), figsize=(4 * len(table), 3.6), sharey=True)
    for ax, (band, lines) in zip(axes, table.items()):
        for name, values in curve_lines(lines):
            ax.plot(lines["k"], values, "k--" if name == "blind search" else "-o", label=name,
                    markersize=3)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{band} ({lines['problems']})")
        ax.set_xlabel("k")
    axes[0].set_ylabel("pass@k")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    args = sys.argv[1:]
    if {"-h", "--help"} & set(args):
        print(__doc__.strip())
    elif args[:1] == ["sample"] and len(args) >= 4:
        sample(args[1], args[2], args[3:])
    elif args[:1] == ["report"] and len(args) == 3:
        report(args[1], args[2])
    else:
        sys.exit(__doc__.strip())
