#!/usr/bin/env bash
# The GPU checks in one script of at most 8 minutes, for a session that is lent a GPU: the CUDA
# tests (tests/test_cuda.py) and bench/bench.py's CUDA rows (ours against transformers, bf16, the
# decode step as CUDA graphs) at the embedded default and at Qwen3-0.6B's shape (dense, 28 layers,
# its vocabulary; 128 sequences of about 512 tokens), with the GPU named; then a bf16 FSDP2 step
# over NCCL and a LoRA merged hot-swap into the CUDA engine (bench/gpu_lora_fsdp.py). Each part
# has its own time limit, so a hang cannot eat the machine's budget.
#
#   bash bench/gpu_check.sh [OUT_DIR]   # default out/gpu_check: gpu.txt, tests.txt, bench*.txt,
#                                       # lora_fsdp.txt
#
# Needs .venv with the CUDA build of torch (requirements.txt says how) and the CI packages.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-out/gpu_check}"
PY="${PY:-.venv/bin/python}"
mkdir -p "$OUT"
{ nvidia-smi -L; $PY -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"; } \
    2>&1 | tee "$OUT/gpu.txt"
timeout 220 $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -n 25 \
    | tee "$OUT/tests.txt"
timeout 80 $PY -m bench.bench --device cuda --dtype bfloat16 --peers off --repeats 3 --swap_hidden 0 \
    2>&1 | tee "$OUT/bench.txt"
# its rollout and decode rows print first (a line before the table), should the limit stop it
timeout 140 $PY -m bench.bench --device cuda --dtype bfloat16 --peers off --repeats 2 --swap_hidden 0 \
    --layout dense --layers 28 --vocab 151936 --prefix_len 248 --question_len 8 \
    --max_new_tokens 256 --num_stop_ids 1 --train_steps 3 --turns 2 --turn_tokens 8 2>&1 \
    | tee "$OUT/bench_0.6b.txt"
timeout 40 $PY -m torch.distributed.run --standalone --nproc_per_node=1 -m bench.gpu_lora_fsdp \
    --device cuda 2>&1 | tee "$OUT/lora_fsdp.txt"
