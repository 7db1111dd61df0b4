#!/usr/bin/env bash
# Learning curves of off_policy.md: GRPO on the main task from one SFT model, the engine in fp32
# (the reference: no mismatch) or in bf16 (the trainer stays fp32), eight seeds each (enough for
# a +-0.03 interval on their paired difference); and staleness through real rollout ranks
# (torchrun, rank 1 sampling max_staleness steps behind rank 0's training, TIS cap 2), seed 1,
# for the mismatch metrics a real stale run logs. Two runs at a time on one thread each (a
# rollout-rank run is two processes: alone).
#
#   bash bench/off_policy_curves.sh [INIT_FROM]   # default out/qwen_small/sft/best (speedrun.sh)
#   ARMS="bf16_tis bf16_replay" SEEDS="1 2 3" bash bench/off_policy_curves.sh   # arms (FLAGS below)
#   python -m bench.off_policy_lab curves out/off_policy_curves docs/off_policy_curves.png
#
# 60 steps of 64 problems (a shorter run than the speedrun's 100 x 96), validation every 10 steps.
# Writes out/off_policy_curves/<arm>_seed<S>/. Needs .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
INIT="${1:-out/qwen_small/sft/best}"
OUT="${OUT:-out/off_policy_curves}"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 WANDB_MODE="${WANDB_MODE:-offline}"
declare -A FLAGS=(
    [fp32]="--engine_dtype=float32"
    [bf16]="--engine_dtype=bfloat16"
    [bf16_tis]="--engine_dtype=bfloat16 --tis_cap=2"
    [bf16_mis]="--engine_dtype=bfloat16 --mis_low=0.5 --mis_high=2"
    [bf16_seq_tis]="--engine_dtype=bfloat16 --tis_cap=2 --is_level=sequence"
    [bf16_replay]="--engine_dtype=bfloat16 --routing_replay=True"
    [ranks_stale1_tis]="--rollout_ranks=1 --max_staleness=1 --tis_cap=2"
    [ranks_stale4_tis]="--rollout_ranks=1 --max_staleness=4 --tis_cap=2"
)
run() {   # run <arm> <seed>
    local d="$OUT/$1_seed$2" launch=(.venv/bin/python) routes=--record_routes=True
    done_run "$1" "$2" && return 0
    if [[ $1 == ranks_* ]]; then   # routes are recorded only by a colocated engine
        launch=(.venv/bin/torchrun --standalone --nproc_per_node=2) routes=
    fi
    # shellcheck disable=SC2086
    "${launch[@]}" train_grpo_async.py config/qwen_small.py --init_from="$INIT" --out_dir="$d" \
        --seed="$2" --max_iters=60 --prompts_per_step=64 --eval_interval=10 --ckpt_interval=60 \
        --log_interval=10 --keep_best=False $routes ${FLAGS[$1]} > "$d.log" 2>&1
}
mkdir -p "$OUT"
done_run() {   # done_run <arm> <seed>: finished, its step-60 checkpoint written
    grep -qs '"iter": 60,' "$OUT/$1_seed$2/ckpt/checkpoint.json"
}
jobs=()
for seed in ${SEEDS:-1 2 3 4 5 6 7 8}; do
    for arm in ${ARMS:-fp32 bf16}; do
        [ -n "${FLAGS[$arm]:-}" ] || { echo "unknown arm '$arm': ${!FLAGS[*]}" >&2; exit 2; }
        jobs+=("$arm $seed")
    done
done
[ -n "${ARMS:-}" ] || jobs+=("ranks_stale1_tis 1" "ranks_stale4_tis 1")
pending=()
for job in "${jobs[@]}"; do   # two at a time; a rollout-rank run takes both cores, alone
    if [[ $job == ranks_* ]]; then
        wait "${pending[@]}" 2>/dev/null || true
        pending=()
        run $job || true   # a failed run is named below, with its log
    else
        run $job &
        pending+=($!)
        if [ ${#pending[@]} -eq 2 ]; then wait "${pending[@]}" || true; pending=(); fi
    fi
done
wait || true
missing=0
for job in "${jobs[@]}"; do   # a failed run shows here, with its log
    read -r arm seed <<< "$job"
    done_run "$arm" "$seed" || { echo "failed: $arm seed $seed (see $OUT/${arm}_seed$seed.log)"
                                 missing=1; }
done
[ "$missing" = 0 ] || exit 1
echo "bench/off_policy_curves.sh: done, $OUT"
