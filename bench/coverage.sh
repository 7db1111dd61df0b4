#!/usr/bin/env bash
# The coverage arm of docs/results.md (issue 64): GRPO with pass@k advantages
# (advantage_pass_k=4, chosen on validation over k=2 and a KL to the start: docs/results.md) from
# each bench/compare.sh seed's start, under the same recipe otherwise; scored once on the test
# split and once on the confirmatory split, like compare.sh's arms, and sampled for pass@k
# (bench/pass_at_k.py). Then bench/report.py (its arm grpo_pass4) and pass_at_k's report.
#
#   bash bench/coverage.sh          # seeds 1-5 of out/compare, two at a time, one thread each
#   bash bench/coverage.sh 2 3      # these seeds
#
# Writes out/compare/seed<S>/{grpo_pass4,test_grpo_pass4,confirm_grpo_pass4,passk_grpo_pass4}.
# Needs bench/compare.sh's seeds (their sft/best) and .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-out/compare}"
PY=.venv/bin/python
ARM=grpo_pass4
SEEDS=("$@")
[ ${#SEEDS[@]} -gt 0 ] || SEEDS=(1 2 3 4 5)
for s in "${SEEDS[@]}"; do   # the arms it joins must be compare.sh's of today's protocol
    grep -qsx edge-3 "$OUT/seed$s/protocol" && [ -d "$OUT/seed$s/sft/best" ] ||
        { echo "bench/coverage.sh: $OUT/seed$s is not a finished edge-3 seed" \
               "(bash bench/compare.sh $s)" >&2; exit 2; }
done
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 WANDB_MODE="${WANDB_MODE:-offline}"
run_seed() {   # run_seed <seed>: train, score on test and confirm, sample for pass@k
    local s=$1 d=$OUT/seed$1 split
    $PY train_grpo.py config/qwen_small.py --seed="$s" --init_from="$d/sft/best" \
        --out_dir="$d/$ARM" --advantage_pass_k=4
    for split in test confirm; do   # once each, the best validation model, as compare.sh does
        $PY train_grpo.py config/qwen_small.py --seed="$s" --init_from="$d/$ARM/best" \
            --out_dir="$d/${split}_$ARM" --max_iters=0 --eval_split=$split --n_eval_problems=0 \
            --pass_k=8
    done
    $PY -m bench.pass_at_k sample "$OUT" "$s" $ARM
}
for s in "${SEEDS[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge 2 ]; do wait -n || true; done
    rm -rf "$OUT/seed$s/$ARM" "$OUT/seed$s/test_$ARM" "$OUT/seed$s/confirm_$ARM" \
        "$OUT/seed$s/passk_$ARM"
    run_seed "$s" > "$OUT/seed$s/$ARM.log" 2>&1 &
done
wait || true
missing=0
for s in "${SEEDS[@]}"; do   # a failed seed shows here, with its log
    grep -qs '"eval/accuracy"' "$OUT/seed$s/confirm_$ARM/metrics.jsonl" &&
        [ -f "$OUT/seed$s/passk_$ARM/outcomes.jsonl" ] ||
        { echo "failed: seed $s (see $OUT/seed$s/$ARM.log)" >&2; missing=1; }
done
[ "$missing" = 0 ] || exit 1
# (the report of these seeds: with fewer than compare.sh's, results.json holds only them)
$PY -m bench.report "$OUT" "${SEEDS[@]}"
$PY -m bench.report --confirm "$OUT" "${SEEDS[@]}"
echo "bench/coverage.sh: done; python -m bench.pass_at_k report $OUT PNG draws pass@k"
