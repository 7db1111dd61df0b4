#!/usr/bin/env bash
# LoRA GRPO against full GRPO from the same SFT start (issue 63). The protocol, fixed before
# any run was scored (docs/results.md, "LoRA against full fine-tuning"):
#   start    the config's SFT best model (GRPO's init_from), made by pretrain.py + sft.py
#   choose   on validation, seed 1337: rank 1 and rank 8 (lora_alpha 32, learning rate 6e-3,
#            ten times full GRPO's, as "LoRA Without Regret" finds LoRA's best rate), the
#            config's recipe otherwise; the rank whose best validation accuracy is higher
#            (the smaller on a tie) is the LoRA arm. Nothing else is tuned.
#   compare  seeds 1, 2, 3: full GRPO (the config's) and LoRA GRPO, each keeping its best
#            validation model; every such model and the start scored once on the test split
#   read     per seed, each arm's test gain over the start; LoRA's mean gain over full's
#
#   bash bench/lora_compare.sh            # -> out/lora_compare/{choose_r*,seed*/{full,lora}}
#   (needs out/qwen_small/sft/best: `bash speedrun.sh`, or pretrain.py + sft.py)
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG="${CONFIG:-config/qwen_small.py}"
PY=.venv/bin/python
OUT="${OUT:-out/lora_compare}"
START=$($PY -c "exec(open('$CONFIG').read()); print(grpo['init_from'])")
LORA=(--lora_alpha=32 --learning_rate=6e-3 --min_lr=6e-4)
export WANDB_MODE="${WANDB_MODE:-offline}"
mkdir -p "$OUT"

grpo() {   # grpo <out_dir> [settings]: a GRPO run from the start, once
    local out=$1
    shift
    [ -f "$out/best/config.json" ] && [ -f "$out/done" ] && return 0
    $PY train_grpo.py "$CONFIG" --init_from="$START" --out_dir="$out" "$@" > "$out.log" 2>&1
    touch "$out/done"
}
test_of() {   # test_of <model dir> <out_dir>: greedy test accuracy, read once
    local out=$2
    [ -f "$out/outcomes.jsonl" ] && return 0
    $PY train_grpo.py "$CONFIG" --init_from="$1" --out_dir="$out" --max_iters=0 \
        --eval_split=test --n_eval_problems=0 --pass_k=8 --keep_best=False > "$out.log" 2>&1
}
best_val() {   # the best eval/accuracy a run logged
    $PY -c "import json,sys; print(max(json.loads(l).get('eval/accuracy', -1)
                                       for l in open(sys.argv[1] + '/metrics.jsonl')))" "$1"
}

# 1. choose the rank on validation (seed 1337)
for r in 1 8; do
    grpo "$OUT/choose_r$r" --seed=1337 --lora_rank=$r "${LORA[@]}"
done
v1=$(best_val "$OUT/choose_r1"); v8=$(best_val "$OUT/choose_r8")
RANK=$($PY -c "print(8 if $v8 > $v1 else 1)")
echo "validation: rank 1 $v1, rank 8 $v8 -> rank $RANK" | tee "$OUT/chosen.txt"

# 2. three seeds, both arms; 3. the test split, once per model
test_of "$START" "$OUT/test_start"
for s in 1 2 3; do
    mkdir -p "$OUT/seed$s"
    grpo "$OUT/seed$s/full" --seed=$s
    grpo "$OUT/seed$s/lora" --seed=$s --lora_rank=$RANK "${LORA[@]}"
    for arm in full lora; do
        test_of "$OUT/seed$s/$arm/best" "$OUT/seed$s/test_$arm"
    done
done
$PY - "$OUT" <<'PY'
import json, os, statistics, sys
out = sys.argv[1]
def acc(path):
    rows = [json.loads(l) for l in open(os.path.join(path, "metrics.jsonl"))]
    return [r for r in rows if "eval/accuracy" in r][-1]["eval/accuracy"]
start = acc(f"{out}/test_start")
gains = {arm: [acc(f"{out}/seed{s}/test_{arm}") - start for s in (1, 2, 3)] for arm in ("full", "lora")}
print(f"start test {start:.3f}")
for arm, g in gains.items():
    print(f"{arm:5s} test gain per seed {['%.3f' % x for x in g]}, mean {statistics.mean(g):.3f}")
print(f"LoRA's mean gain / full's: {statistics.mean(gains['lora']) / statistics.mean(gains['full']):.2f}")
PY
