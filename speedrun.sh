#!/usr/bin/env bash
# The main job on a fresh machine: a virtualenv, the requirements, then pretrain -> sft -> train_grpo on the
# embedded default (config/qwen_small.py); the README says how long it takes on 2 CPU cores.
#
#   bash speedrun.sh                          # the embedded default
#   bash speedrun.sh config/qwen_small.py     # or another experiment file (each stage reads its section)
#
# Outputs: out/qwen_small/{pretrain,sft,grpo}/ckpt (transformers model dirs) and metrics.jsonl beside each.
set -euo pipefail
cd "$(dirname "$0")"
CONFIG="${1:-config/qwen_small.py}"

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/pip install -q -r requirements.txt
export WANDB_MODE="${WANDB_MODE:-offline}"   # no network here: wandb (when wandb_log=True) writes locally

stage() {   # stage <script>: run it on the config, say how long it took
    local t0=$SECONDS
    echo "== $1 $CONFIG"
    .venv/bin/python "$1" "$CONFIG"
    echo "== $1 done in $((SECONDS - t0)) s"
}
start=$SECONDS
stage pretrain.py
stage sft.py
stage train_grpo.py
echo "== speedrun done in $((SECONDS - start)) s"
