r"""
The LoRA comparison's numbers (bench/lora_compare.sh): per seed the test accuracy of full
GRPO, LoRA GRPO and their common start, each arm's gain over the start, LoRA's mean gain
over full's, and the paired difference LoRA - full with two 95% intervals (over seeds, and
over the test's digit multisets by a cluster bootstrap of the per-problem mean over seeds);
then every per-problem outcome behind them into one compressed file.

    python -m bench.lora_report out/lora_compare [docs/results/lora_compare/outcomes.jsonl.gz]
"""
import gzip
import json
import os
import statistics
import sys

import numpy as np

from bench.report import cluster_bootstrap, paired_ci, read_rows

SEEDS, ARMS = (1, 2, 3), ("full", "lora")


def test_eval(path):
    """(greedy accuracy, pass@8, per-problem outcomes) of a test evaluation directory."""
    row = [r for r in read_rows(os.path.join(path, "metrics.jsonl")) if "eval/accuracy" in r][-1]
    return row["eval/accuracy"], row.get("eval/pass@8"), read_rows(
        os.path.join(path, "outcomes.jsonl"))


def main(out, archive=None):
    start, start_pass, start_rows = test_eval(os.path.join(out, "test_start"))
    runs = {(arm, s): test_eval(os.path.join(out, f"seed{s}", f"test_{arm}"))
            for arm in ARMS for s in SEEDS}
    print(f"start: test {start:.3f}, pass@8 {start_pass:.3f}")
    print("| seed | full test | LoRA test | full gain | LoRA gain | full pass@8 | LoRA pass@8 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for s in SEEDS:
        f, lo = runs["full", s], runs["lora", s]
        print(f"| {s} | {f[0]:.3f} | {lo[0]:.3f} | {f[0] - start:+.3f} | {lo[0] - start:+.3f} | "
              f"{f[1]:.3f} | {lo[1]:.3f} |")
    gains = {arm: [runs[arm, s][0] - start for s in SEEDS] for arm in ARMS}
    ratio = statistics.mean(gains["lora"]) / statistics.mean(gains["full"])
    print(f"mean gain: full {statistics.mean(gains['full']):+.3f}, LoRA "
          f"{statistics.mean(gains['lora']):+.3f}; LoRA's / full's {ratio:.2f}")
    mean, lo, hi = paired_ci([runs["lora", s][0] for s in SEEDS],
                             [runs["full", s][0] for s in SEEDS])
    per_problem = np.mean([[a["reward"] - b["reward"] for a, b in
                            zip(runs["lora", s][2], runs["full", s][2])] for s in SEEDS], axis=0)
    clusters = [tuple(sorted(o["digits"])) for o in start_rows]
    blo, bhi = cluster_bootstrap(per_problem, clusters)
    print(f"LoRA - full: {mean:+.3f}, 95% over seeds [{lo:+.3f}, {hi:+.3f}], over digit "
          f"multisets [{blo:+.3f}, {bhi:+.3f}]")
    if archive:
        os.makedirs(os.path.dirname(archive), exist_ok=True)
        with gzip.open(archive, "wt") as f:
            for o in start_rows:
                f.write(json.dumps({"arm": "start", "seed": None, **o}) + "\n")
            for (arm, s), (_, _, rows) in runs.items():
                for o in rows:
                    f.write(json.dumps({"arm": arm, "seed": s, **o}) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
