#!/usr/bin/env bash
# The countdown example learning through verifiers, against the same GRPO colocated
# (docs/results/verifiers/protocol.md; about 30 minutes on two cores):
#
#   bash scaleout/install_verifiers.sh && bash bench/verifiers_learn.sh
#
# needs the speedrun's SFT model (out/qwen_small/sft/best). Writes out/verifiers_learn/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/verifiers_learn}
VF_PYTHON=${VF_PYTHON:-/tmp/vf_venv/bin/python}
PORT=${PORT:-8131}
COMMON=(--prompts_per_step=8 --group_size=8 --max_iters=24 --eval_interval=12 --n_eval_problems=0
        --ckpt_interval=24 --keep_best=False --seed=1337)
mkdir -p "$OUT"
.venv/bin/python -m scaleout.serve --model_path=out/qwen_small/sft/best --port="$PORT" \
    --enable_weight_updates=True > "$OUT/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do sleep 2; done
.venv/bin/python train_grpo.py config/qwen_small.py "${COMMON[@]}" --out_dir="$OUT/verifiers" \
    --rollout_urls="http://127.0.0.1:$PORT" \
    --verifiers_cmd="$VF_PYTHON scaleout/verifiers_countdown.py"
kill $server
.venv/bin/python train_grpo.py config/qwen_small.py "${COMMON[@]}" --out_dir="$OUT/colocated"
