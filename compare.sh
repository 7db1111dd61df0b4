#!/usr/bin/env bash
# Does GRPO beat more SFT? For each seed: pretrain -> sft, then from that SFT checkpoint either the same number
# of extra SFT steps (the control) or GRPO steps; every checkpoint is scored by the same evaluation
# (train_grpo.py --max_iters=0: held-out greedy accuracy, pass@1 and pass@8 at temperature 1).
#
#   bash compare.sh                  # seeds 1 2 3, prints the markdown table of README's "Results"
#   SEEDS="1" bash compare.sh        # one seed (run seeds in parallel, then TABLE_ONLY=1 bash compare.sh)
#
# Needs .venv (bash speedrun.sh makes it). About 5-7 minutes a seed on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")"
CONFIG=config/qwen_small.py
SEEDS="${SEEDS:-1 2 3}"
STEPS="${STEPS:-$(.venv/bin/python -c "exec(open('$CONFIG').read()); print(grpo['max_iters'])")}"
PY=.venv/bin/python
for s in $SEEDS; do
    [ -n "${TABLE_ONLY:-}" ] && break   # TABLE_ONLY=1: just print the table of finished seeds
    d=out/compare/seed$s
    $PY pretrain.py $CONFIG --seed=$s --out_dir=$d/pretrain
    $PY sft.py $CONFIG --seed=$s --init_from=$d/pretrain --out_dir=$d/sft
    $PY sft.py $CONFIG --seed=$s --init_from=$d/sft --out_dir=$d/sft_more --max_iters=$STEPS
    $PY train_grpo.py $CONFIG --seed=$s --init_from=$d/sft --out_dir=$d/grpo --max_iters=$STEPS
    for run in sft sft_more grpo; do   # one evaluation for all three
        $PY train_grpo.py $CONFIG --seed=$s --init_from=$d/$run --out_dir=$d/eval_$run --max_iters=0
    done
done
$PY - "$SEEDS" "$STEPS" <<'PY'
import json, sys
import numpy as np
seeds, steps = sys.argv[1].split(), sys.argv[2]
keys = ["eval/accuracy", "eval/pass@1", "eval/pass@8"]
rows = {"SFT": "sft", f"SFT + {steps} more SFT steps (control)": "sft_more", f"SFT + {steps} GRPO steps": "grpo"}
print(f"held-out problems, mean ± std over seeds {' '.join(seeds)} (per-seed values):\n")
print("| start | greedy accuracy | pass@1 | pass@8 |")
print("| --- | --- | --- | --- |")
for name, run in rows.items():
    vals = []
    for s in seeds:
        with open(f"out/compare/seed{s}/eval_{run}/metrics.jsonl") as f:
            last = [json.loads(l) for l in f][-1]
        vals.append([last[k] for k in keys])
    v = np.array(vals)
    cells = [f"{m:.3f} ± {sd:.3f} ({', '.join(f'{x:.3f}' for x in col)})" for m, sd, col in zip(v.mean(0), v.std(0), v.T)]
    print(f"| {name} | " + " | ".join(cells) + " |")
PY
