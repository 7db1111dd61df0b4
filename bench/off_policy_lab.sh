#!/usr/bin/env bash
# The off-policy lab (bench/off_policy_lab.py) at three checkpoints of one GRPO run, seed 1 of
# bench/compare.sh: its start (the SFT model), step 50 and step 100; then the report.
#
#   bash bench/off_policy_lab.sh [RUN]     # default out/compare/seed1 (sft/best, grpo/ckpt)
#
# Step 50 is that run's first 50 steps made again: the same seed, config and learning-rate
# schedule (lr_decay_iters=100). Writes out/off_policy_lab/{middle_run,early,middle,late} and
# out/off_policy_lab/table.md, docs/off_policy_gradients.png. Needs .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN="${1:-out/compare/seed1}"
OUT="${OUT:-out/off_policy_lab}"
PY=.venv/bin/python
seed=$(basename "$RUN")
seed=${seed#seed}
[[ $seed =~ ^[0-9]+$ ]] || { echo "bench/off_policy_lab.sh: RUN must be .../seed<S>" >&2; exit 2; }
export WANDB_MODE="${WANDB_MODE:-offline}"
mkdir -p "$OUT"
if [ ! -f "$OUT/middle_run/ckpt/checkpoint.json" ]; then
    $PY train_grpo.py config/qwen_small.py --seed="$seed" --init_from="$RUN/sft/best" \
        --out_dir="$OUT/middle_run" --max_iters=50 --lr_decay_iters=100 > "$OUT/middle_run.log" 2>&1
fi
# the three checkpoints two at a time, one thread each
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
lab() {   # lab <name> <init_from>
    [ -f "$OUT/$1/results.json" ] || $PY -m bench.off_policy_lab gradients "$2" "$OUT/$1" \
        > "$OUT/$1.log" 2>&1
}
lab early "$RUN/sft/best" &
lab middle "$OUT/middle_run" &
wait
lab late "$RUN/grpo"
for name in early middle late; do   # a failed checkpoint shows here, with its log
    [ -f "$OUT/$name/results.json" ] || { echo "failed: $name (see $OUT/$name.log)" >&2; exit 1; }
done
$PY -m bench.off_policy_lab report "$OUT" docs/off_policy_gradients.png
