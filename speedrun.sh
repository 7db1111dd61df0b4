#!/usr/bin/env bash
# The main job on a fresh machine: a virtualenv, the requirements, then pretrain -> sft -> train_grpo on the
# embedded default (config/qwen_small.py), then one evaluation of the SFT and GRPO models on the test split;
# the README says how long it takes on 2 CPU cores.
#
#   bash speedrun.sh                          # the embedded default
#   bash speedrun.sh config/qwen_small.py     # or another experiment file (each stage reads its section)
#
# Outputs: out/qwen_small/{pretrain,sft,grpo}/ckpt (transformers model dirs) and metrics.jsonl beside each;
# out/qwen_small/test_{sft,grpo,heuristic}/ (the test evaluations: metrics.jsonl, and outcomes.jsonl
# with each problem's answer and reward); out/qwen_small/grpo.png (validation accuracy and
# completion length by step).
set -euo pipefail
cd "$(dirname "$0")"
CONFIG="${1:-config/qwen_small.py}"

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/pip install -q -r requirements.txt
export WANDB_MODE="${WANDB_MODE:-offline}"   # no network here: wandb (when wandb_log=True) writes locally
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
read -r SFT GRPO <<< "$($PY -c "exec(open('$CONFIG').read()); print(sft['out_dir'], grpo['out_dir'])")"
stage train_grpo.py --init_from="$SFT" --out_dir="$SFT/../test_sft" --max_iters=0 --eval_split=test --n_eval_problems=0
stage train_grpo.py --init_from="$GRPO" --out_dir="$GRPO/../test_grpo" --max_iters=0 --eval_split=test --n_eval_problems=0
$PY evaluate.py heuristic test "$GRPO/../test_heuristic"   # no learning, the same reward
$PY report.py --run "$GRPO" "$GRPO/../grpo.png"
$PY - "$SFT" "$GRPO" <<'PY'
import json, os, sys
def last_eval(path):
    rows = [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]
    return [r for r in rows if "eval/accuracy" in r][-1]
def by_size(row):
    three, four = row["eval/accuracy_3digits"], row["eval/accuracy_4digits"]
    return f"3 digits {three:.3f}, 4 digits {four:.3f}"
sft, grpo = sys.argv[1:]
tests = {}
for name, run in (("SFT", sft), ("GRPO", grpo)):
    val, tests[name] = last_eval(run), last_eval(os.path.join(run, "..", f"test_{name.lower()}"))
    test = tests[name]
    print(f"{name:5s} greedy accuracy: validation {val['eval/accuracy']:.3f}, test {test['eval/accuracy']:.3f} "
          f"(test pass@1 {test['eval/pass@1']:.3f}, pass@8 {test.get('eval/pass@8', float('nan')):.3f})")
heuristic = last_eval(os.path.join(grpo, "..", "test_heuristic"))
print(f"heuristic (closest pair, no learning) test accuracy {heuristic['eval/accuracy']:.3f}")
for name, row in (("SFT", tests["SFT"]), ("GRPO", tests["GRPO"]), ("heuristic", heuristic)):
    print(f"  by size, {name}: {by_size(row)}")
PY
echo "== speedrun done in $((SECONDS - start)) s"
