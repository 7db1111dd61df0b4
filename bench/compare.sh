#!/usr/bin/env bash
# The fair comparison: per seed, pretrain -> the start (the config's SFT, keeping its best model on
# validation), then from the start GRPO (the config's, keeping its best model on validation) and
# two baselines matched to it (sft_more: more SFT at GRPO's FLOPs; rft: rejection-sampling
# fine-tuning that samples every training problem twice, group-size samples each, then trains on
# the right ones until GRPO's FLOPs are spent; both early-stopped on val), the two no-learning
# rules (heuristic: the closest pair; chain_rule: the step that leaves the smallest need), and
# sft_all as a reference (the start's SFT with demo_fraction=1: a demonstration for every training
# problem the task's sft_examples cover, for countdown the full space's); every arm scored once on
# the test split, then once on the confirmatory split when the task has one (countdown's: five
# digits, which no run trains, tunes or tests on); then bench/report.py.
# The recipe is the speedrun's (config/qwen_small.py, chosen on validation: docs/results.md), so
# a seed's start and GRPO are what `bash speedrun.sh` makes with that seed.
#
#   bash bench/compare.sh        # seeds 1 2 3 4 5, JOBS=2 seeds at a time, the cores shared among them
#   bash bench/compare.sh 1 2    # these seeds; JOBS=1 one at a time; FORCE=1 redoes finished seeds
#   CONFIG=config/other.py bash bench/compare.sh
#
# Writes out/compare/seed<S>/ (log.txt, pretrain, sft, grpo, sft_more, rft, sft_all, test_<arm>,
# confirm_<arm>), then out/compare/results.json, results_confirm.json and val_accuracy.png
# (bench/report.py). Needs .venv (bash speedrun.sh makes it).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG="${CONFIG:-config/qwen_small.py}"
JOBS="${JOBS:-2}"
PY=.venv/bin/python
OUT="${OUT:-out/compare}"
TRAINED=(sft sft_more rft grpo sft_all)   # the arms with a model; the rules (below) have none
# the config's SFT and GRPO keep their best model on validation (early stopping), and so do the
# baselines below: each arm's best validation model is the one tested
SEEDS=("$@")
[ ${#SEEDS[@]} -gt 0 ] || SEEDS=(1 2 3 4 5)
for s in "${SEEDS[@]}"; do
    [[ $s =~ ^[0-9]+$ ]] ||
        { echo "bench/compare.sh: a seed is a non-negative integer, got '$s'" >&2; exit 2; }
done
[[ $JOBS =~ ^[1-9][0-9]*$ ]] ||
    { echo "bench/compare.sh: JOBS must be a positive integer, got '$JOBS'" >&2; exit 2; }

# each job gets its share of the cores (at least one thread): parallel seeds never oversubscribe
THREADS=$(( $(nproc) / JOBS ))
[ "$THREADS" -ge 1 ] || THREADS=1
export OMP_NUM_THREADS=$THREADS MKL_NUM_THREADS=$THREADS
export WANDB_MODE="${WANDB_MODE:-offline}"
# GRPO's samples per problem and rollout temperature (RFT samples the same way), the config's task,
# its number of training problems and the no-learning rules it offers (tasks/evaluate.py RULE)
GT=$($PY -c "exec(open('$CONFIG').read())
from tasks.environment import load_task
from tasks.evaluate import offered_rules
name = globals().get('task', 'tasks.countdown')
task = load_task(name)
try:
    task.make_problems('confirm', 1)
    splits = 'test,confirm'
except Exception:   # a task without a confirmatory split refuses the name
    splits = 'test'
print(int(grpo['group_size']), float(grpo.get('temperature', 1.0)), name,
      len(task.make_problems('train')), splits, *offered_rules(task))")
# (a failing python stops the script here)
read -r G T TASK N_TRAIN SPLIT_LIST RULE_LIST <<< "$GT"
IFS=, read -r -a SPLITS <<< "$SPLIT_LIST"   # the splits every arm is scored on, once
read -r -a RULES <<< "$RULE_LIST"
ARMS=("${RULES[@]}" "${TRAINED[@]}")

PROTOCOL="edge-3"   # bump when the task, recipe or arms change: older seeds are not mixed in
finished() {   # finished <seed>: every arm's evaluations are on disk, under this protocol
    local arm split
    grep -qsx "$PROTOCOL" "$OUT/seed$1/protocol" || return 1
    for arm in "${ARMS[@]}"; do
        for split in "${SPLITS[@]}"; do
            grep -qs '"eval/accuracy"' "$OUT/seed$1/${split}_$arm/metrics.jsonl" || return 1
        done
    done
}

step() {   # step <name> <command ...>: run it, saying what and how long it took
    local t0=$SECONDS name=$1
    shift
    echo "== $name: $*"
    "$@"
    echo "== $name done in $((SECONDS - t0)) s"
}

# grpo_budget <metrics.jsonl>: "F N", GRPO's total FLOPs and training problems consumed
grpo_budget() {
    $PY - "$1" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
last = [r for r in rows if "perf/flops_total" in r and "rollout/problems_total" in r]
if not last:
    sys.exit(f"{sys.argv[1]}: no perf/flops_total / rollout/problems_total rows")
print(int(last[-1]["perf/flops_total"]), int(last[-1]["rollout/problems_total"]))
PY
}

run_seed() {   # run_seed <seed>: the whole pipeline of one seed
    local s=$1 d=$OUT/seed$1 budget F N arm init baseline
    echo "$PROTOCOL" > "$d/protocol"
    step pretrain $PY pretrain.py "$CONFIG" --seed=$s --out_dir=$d/pretrain
    step sft $PY sft.py "$CONFIG" --seed=$s --init_from=$d/pretrain --out_dir=$d/sft
    step grpo $PY train_grpo.py "$CONFIG" --seed=$s --init_from=$d/sft/best --out_dir=$d/grpo
    budget=$(grpo_budget $d/grpo/metrics.jsonl)
    read -r F N <<< "$budget"
    echo "== GRPO used F=$F FLOPs on N=$N problems drawn, G=$G samples each: the baselines' budget"
    # the baselines continue from the start at a constant learning rate (chosen on validation,
    # docs/results.md), until they have spent GRPO's FLOPs; each keeps its best model on validation
    local baseline=(--max_iters=1000000 --max_flops=$F --keep_best=True --learning_rate=3e-4
                    --min_lr=3e-4 --eval_interval=200 --warmup_iters=0)
    step sft_more $PY sft.py "$CONFIG" --seed=$s --init_from=$d/sft/best --out_dir=$d/sft_more \
        "${baseline[@]}"
    # RFT samples each training problem twice (not GRPO's N draws; of half, once and twice,
    # twice scored best on validation: docs/results.md), then trains for the rest of F
    step rft $PY sft.py "$CONFIG" --seed=$s --init_from=$d/sft/best --out_dir=$d/rft \
        "${baseline[@]}" --rft_samples=$G --rft_problems=$((2 * N_TRAIN)) --rft_temperature=$T
    step sft_all $PY sft.py "$CONFIG" --seed=$s --init_from=$d/pretrain --out_dir=$d/sft_all \
        --demo_fraction=1.0
    for split in "${SPLITS[@]}"; do   # test, then the confirmatory split: once each
        for arm in "${RULES[@]}"; do
            step ${split}_$arm $PY -m tasks.evaluate $arm $split $d/${split}_$arm --task="$TASK"
        done
        for arm in "${TRAINED[@]}"; do   # one evaluation for each model
            # every arm is early-stopped on validation the same way: its best validation model
            # is the one tested
            step ${split}_$arm $PY train_grpo.py "$CONFIG" --seed=$s --init_from=$d/$arm/best \
                --out_dir=$d/${split}_$arm --max_iters=0 --eval_split=$split --n_eval_problems=0 \
                --pass_k=8
        done
    done
}

echo "bench/compare.sh: seeds ${SEEDS[*]}, $JOBS at a time, $THREADS thread(s) each, $CONFIG"
start=$SECONDS
for s in "${SEEDS[@]}"; do
    d=$OUT/seed$s
    if [ -z "${FORCE:-}" ] && finished "$s"; then
        echo "seed $s: finished before, skipped (FORCE=1 redoes it)"
        continue
    fi
    # a seed of an earlier protocol is never deleted unasked
    if [ -z "${FORCE:-}" ] && [ -d "$d/test_grpo" ]; then
        echo "bench/compare.sh: $d holds a finished GRPO run but not every arm of this protocol;" \
             "move it away or set FORCE=1 to redo the seed" >&2
        exit 2
    fi
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do
        wait -n || true   # a failed seed is found below, by its missing evaluations
    done
    # a seed runs from scratch: nothing of an earlier, unfinished or forced run is kept
    rm -rf "$d"
    mkdir -p "$d"
    echo "seed $s: started at +$((SECONDS - start)) s, log in $d/log.txt"
    run_seed "$s" > "$d/log.txt" 2>&1 &
done
wait

failed=()
for s in "${SEEDS[@]}"; do finished "$s" || failed+=("$s"); done
if [ ${#failed[@]} -gt 0 ]; then
    for s in "${failed[@]}"; do echo "seed $s: FAILED, see the end of $OUT/seed$s/log.txt" >&2; done
    exit 1
fi
echo "bench/compare.sh: all seeds done in $((SECONDS - start)) s"
$PY -m bench.report $OUT "${SEEDS[@]}"
if [[ " ${SPLITS[*]} " == *" confirm "* ]]; then
    $PY -m bench.report --confirm $OUT "${SEEDS[@]}"
fi
