#!/usr/bin/env bash
# The main job on a fresh machine: a virtualenv, the requirements, then pretrain -> sft ->
# train_grpo on the embedded default (config/qwen_small.py), then one evaluation of the SFT and GRPO
# models on the test split; the README says how long it takes on 2 CPU cores.
#
#   bash speedrun.sh                          # the embedded default
#   bash speedrun.sh config/qwen_small.py     # or another experiment file (each stage: its section)
#
# Outputs: out/qwen_small/{pretrain,sft,grpo}/ckpt (transformers model dirs) and metrics.jsonl
# beside each; out/qwen_small/test_{sft,grpo,heuristic,chain_rule}/ (the test evaluations:
# metrics.jsonl, and outcomes.jsonl with each problem's answer and reward) and
# out/qwen_small/val_{heuristic,chain_rule}/ (the rules on validation, for the plot);
# out/qwen_small/grpo.png (validation accuracy and the rollouts' mean reward by step, against the
# SFT start and the better no-learning rule on validation; completion length by step).
set -euo pipefail
cd "$(dirname "$0")"
CONFIG="${1:-config/qwen_small.py}"

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/pip install -q -r requirements.txt
# no network here: wandb (when wandb_log=True) writes locally
export WANDB_MODE="${WANDB_MODE:-offline}"
PY=.venv/bin/python

stage() {   # stage <script> [args]: run it on the config, say how long it took
    local t0=$SECONDS script=$1
    shift
    echo "== $script $CONFIG $*"
    $PY "$script" "$CONFIG" "$@"
    echo "== $script done in $((SECONDS - t0)) s"
}
start=$SECONDS
stage pretrain.py
stage sft.py
stage train_grpo.py
# the test split is read once, at the end, by the same evaluation for both models
# the SFT model is GRPO's start (the SFT run's best on validation)
# the config's SFT and GRPO directories, its task and the no-learning rules that task offers
info=$($PY -c "exec(open('$CONFIG').read())
from tasks.environment import load_task
from tasks.evaluate import offered_rules
task = globals().get('task', 'tasks.countdown')
print(grpo['init_from'], grpo['out_dir'], task, *offered_rules(load_task(task)))")
read -r SFT GRPO TASK RULES <<< "$info"   # (a failing python stops the script on the line above)
# evaluations only: no training, and no copy of the model kept
TEST=(--max_iters=0 --eval_split=test --n_eval_problems=0 --pass_k=8 --keep_best=False)
stage train_grpo.py --init_from="$SFT" --out_dir="$GRPO/../test_sft" "${TEST[@]}"
stage train_grpo.py --init_from="$GRPO/best" --out_dir="$GRPO/../test_grpo" "${TEST[@]}"
VAL_RULES=()
for rule in $RULES; do   # no learning, the same reward; validation for the plot
    for split in val test; do
        $PY -m tasks.evaluate "$rule" $split "$GRPO/../${split}_$rule" --task="$TASK"
    done
    VAL_RULES+=("$GRPO/../val_$rule")
done
$PY -m bench.report --run "$GRPO" "$GRPO/../grpo.png" "${VAL_RULES[@]}"
$PY - "$GRPO" $RULES <<'PY'
import json, os, sys
from tasks.evaluate import RULES
def evals(path):
    rows = [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]
    return [r for r in rows if "eval/accuracy" in r]
grpo, rules = sys.argv[1], sys.argv[2:]
# validation: GRPO's first evaluation (iteration 0) is its start, the SFT model; its best is the
# GRPO model kept (keep_best) and tested
val = {"SFT": evals(grpo)[0], "GRPO": max(evals(grpo), key=lambda r: r["eval/accuracy"])}
tests = {name: evals(os.path.join(grpo, "..", f"test_{name.lower()}"))[-1] for name in val}
for name, test in tests.items():
    print(f"{name:5s} greedy accuracy: validation {val[name]['eval/accuracy']:.3f}, "
          f"test {test['eval/accuracy']:.3f} (test pass@1 {test['eval/pass@1']:.3f}, "
          f"pass@8 {test.get('eval/pass@8', float('nan')):.3f})")
for rule in rules:
    row = {s: evals(os.path.join(grpo, "..", f"{s}_{rule}"))[-1] for s in ("val", "test")}
    print(f"rule  {rule} ({RULES[rule]}, no learning): validation "
          f"{row['val']['eval/accuracy']:.3f}, test {row['test']['eval/accuracy']:.3f}")
PY
echo "== speedrun done in $((SECONDS - start)) s"
