#!/usr/bin/env bash
# The countdown example learning through verifiers, against the same GRPO colocated
# (docs/results/verifiers/protocol.md, protocol 2; about 30 minutes on two cores):
#
#   bash scaleout/install_verifiers.sh && bash bench/verifiers_learn.sh
#
# needs the speedrun's SFT model (out/qwen_small/sft/best). Writes out/verifiers_learn/:
# start/ (the SFT model on validation), verifiers/ and colocated/ (each arm's run, its
# outcomes.jsonl the last evaluation's), and prints the protocol's paired intervals.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/verifiers_learn}
VF_PYTHON=${VF_PYTHON:-/tmp/vf_venv/bin/python}
PORT=${PORT:-8131}
SFT=out/qwen_small/sft/best
COMMON=(--max_iters=40 --eval_interval=20 --n_eval_problems=0 --ckpt_interval=40
        --keep_best=False --seed=1337)
mkdir -p "$OUT"
.venv/bin/python train_grpo.py config/qwen_small.py --init_from=$SFT --out_dir="$OUT/start" \
    --max_iters=0 --n_eval_problems=0 --keep_best=False
.venv/bin/python -m scaleout.serve --model_path=$SFT --port="$PORT" \
    --enable_weight_updates=True > "$OUT/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do sleep 2; done
.venv/bin/python train_grpo_async.py config/qwen_small.py "${COMMON[@]}" \
    --out_dir="$OUT/verifiers" \
    --rollout_urls="http://127.0.0.1:$PORT" \
    --verifiers_cmd="$VF_PYTHON scaleout/verifiers_countdown.py"
kill $server
.venv/bin/python train_grpo.py config/qwen_small.py "${COMMON[@]}" --out_dir="$OUT/colocated"
.venv/bin/python - "$OUT" <<'PY'
import json, sys
from bench.report import paired_ci
out = sys.argv[1]
rows = {arm: [json.loads(line) for line in open(f"{out}/{arm}/outcomes.jsonl")]
        for arm in ("start", "verifiers", "colocated")}
problems = {arm: [(r["digits"], r["target"]) for r in rows[arm]] for arm in rows}
assert problems["start"] == problems["verifiers"] == problems["colocated"], "unpaired outcomes"
reward = {arm: [r["reward"] for r in rows[arm]] for arm in rows}
for a, b in [("verifiers", "start"), ("colocated", "start"), ("verifiers", "colocated")]:
    mean, lo, hi = paired_ci(reward[a], reward[b])
    print(f"{a} - {b}: {mean:+.4f} [{lo:+.4f}, {hi:+.4f}] over {len(reward[a])} problems")
PY
