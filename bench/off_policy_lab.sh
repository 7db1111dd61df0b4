#!/usr/bin/env bash
# The off-policy lab (bench/off_policy_lab.py) at three checkpoints of one GRPO run, a seed of
# bench/compare.sh: its start (the SFT model), step 50 and step 100; then the report.
#
#   bash bench/off_policy_lab.sh [RUN]     # default out/compare/seed1 (its sft/best, grpo/ckpt)
#
# Step 50 is that run's first 50 steps made again: the same seed, config, learning-rate schedule
# (lr_decay_iters=100) and thread count (compare.sh's one); their logged rewards are compared
# below. Writes out/off_policy_lab/seed<S>/{middle_run,early,middle,late}, its table.md and
# docs/off_policy_gradients.png. A checkpoint whose results.json exists is not measured again.
# Needs .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN="${1:-out/compare/seed1}"
PY=.venv/bin/python
seed=$(basename "$RUN")
seed=${seed#seed}
[[ $seed =~ ^[0-9]+$ ]] || { echo "bench/off_policy_lab.sh: RUN must be .../seed<S>" >&2; exit 2; }
[ -f "$RUN/grpo/ckpt/checkpoint.json" ] && [ -d "$RUN/sft/best" ] ||
    { echo "bench/off_policy_lab.sh: $RUN has no sft/best or grpo/ckpt (bench/compare.sh)" >&2
      exit 2; }
OUT="${OUT:-out/off_policy_lab/seed$seed}"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 WANDB_MODE="${WANDB_MODE:-offline}"
mkdir -p "$OUT"
if ! grep -qs '"iter": 50' "$OUT/middle_run/ckpt/checkpoint.json"; then
    $PY train_grpo.py config/qwen_small.py --seed="$seed" --init_from="$RUN/sft/best" \
        --out_dir="$OUT/middle_run" --max_iters=50 --lr_decay_iters=100 --ckpt_interval=50 \
        > "$OUT/middle_run.log" 2>&1 ||
        { echo "failed: the step-50 run (see $OUT/middle_run.log)" >&2; exit 1; }
fi
$PY - "$RUN/grpo/metrics.jsonl" "$OUT/middle_run/metrics.jsonl" <<'PY'
import json, sys
a, b = ({r["iter"]: r["rollout/reward_mean"] for r in map(json.loads, open(p))
         if "rollout/reward_mean" in r and r["iter"] <= 50} for p in sys.argv[1:])
same = sorted(set(a) & set(b))
gap = max(abs(a[i] - b[i]) for i in same)
print(f"the step-50 run against the run's first 50 steps: {len(same)} logged rewards, "
      f"largest gap {gap:.2e}")
PY
lab() {   # lab <name> <init_from>: one checkpoint, unless its results exist
    [ -f "$OUT/$1/results.json" ] || $PY -m bench.off_policy_lab gradients "$2" "$OUT/$1" \
        > "$OUT/$1.log" 2>&1
}
lab early "$RUN/sft/best" &
lab middle "$OUT/middle_run" &
wait || true
lab late "$RUN/grpo" || true
for name in early middle late; do   # a failed checkpoint shows here, with its log
    [ -f "$OUT/$name/results.json" ] || { echo "failed: $name (see $OUT/$name.log)" >&2; exit 1; }
done
$PY -m bench.off_policy_lab report "$OUT" docs/off_policy_gradients.png
