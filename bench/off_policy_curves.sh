#!/usr/bin/env bash
# Learning curves of off_policy.md: GRPO on the main task from one SFT model, the engine in fp32
# (the reference: no mismatch) or in bf16 (the trainer stays fp32) with no correction, TIS, masked
# IS, sequence-level IS or routing replay; three seeds each, two runs at a time on one thread each.
#
#   bash bench/off_policy_curves.sh [INIT_FROM]     # default out/qwen_small/sft/best (bash speedrun.sh)
#   python -m bench.off_policy_lab curves out/off_policy_curves docs/off_policy_curves.png
#
# 60 steps of 64 problems (a shorter run than the speedrun's 100 x 96), validation every 10 steps.
# Writes out/off_policy_curves/<arm>_seed<S>/. Needs .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
INIT="${1:-out/qwen_small/sft/best}"
OUT="${OUT:-out/off_policy_curves}"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 WANDB_MODE="${WANDB_MODE:-offline}"
declare -A ARMS=(
    [fp32]="--engine_dtype=float32"
    [bf16]="--engine_dtype=bfloat16"
    [bf16_tis]="--engine_dtype=bfloat16 --tis_cap=2"
    [bf16_mis]="--engine_dtype=bfloat16 --mis_low=0.5 --mis_high=2"
    [bf16_seq_tis]="--engine_dtype=bfloat16 --tis_cap=2 --is_level=sequence"
    [bf16_replay]="--engine_dtype=bfloat16 --routing_replay=True"
)
run() {   # run <arm> <seed>
    local d="$OUT/$1_seed$2"
    grep -qs '"eval/accuracy"' "$d/metrics.jsonl" && [ -d "$d/ckpt" ] && return 0
    # shellcheck disable=SC2086
    .venv/bin/python train_grpo.py config/qwen_small.py --init_from="$INIT" --out_dir="$d" \
        --seed="$2" --max_iters=60 --prompts_per_step=64 --eval_interval=10 --ckpt_interval=60 \
        --log_interval=10 --keep_best=False --record_routes=True ${ARMS[$1]} > "$d.log" 2>&1
}
mkdir -p "$OUT"
jobs=()
for seed in 1 2 3; do
    for arm in fp32 bf16 bf16_tis bf16_mis bf16_seq_tis bf16_replay; do
        jobs+=("$arm $seed")
    done
done
for ((i = 0; i < ${#jobs[@]}; i += 2)); do
    run ${jobs[i]} &
    [ $((i + 1)) -lt ${#jobs[@]} ] && run ${jobs[i + 1]} &
    wait
done
missing=0
for job in "${jobs[@]}"; do   # a failed run shows here, with its log
    read -r arm seed <<< "$job"
    grep -qs '"eval/accuracy"' "$OUT/${arm}_seed$seed/metrics.jsonl" ||
        { echo "failed: $arm seed $seed (see $OUT/${arm}_seed$seed.log)"; missing=1; }
done
[ "$missing" = 0 ] || exit 1
echo "bench/off_policy_curves.sh: done, $OUT"
