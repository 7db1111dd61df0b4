# A real checkpoint on GSM8K-shaped data (tasks/gsm8k.py): SFT on the rows' worked
# solutions, then GRPO, on one GPU. Point init_from at a local Qwen3 / Qwen2.5 / Llama 3
# directory (config.json, safetensors, tokenizer files, generation_config.json) and
# GSM8K_DIR at train.jsonl / test.jsonl (docs/models.md):
#   GSM8K_DIR=/data/gsm8k python sft.py config/gsm8k.py --init_from=/models/Qwen3-0.6B
#   GSM8K_DIR=/data/gsm8k python train_grpo.py config/gsm8k.py
# Memory, Qwen3-0.6B (0.6B parameters): the trainer keeps fp32 master weights, gradients
# and AdamW's two moments (16 bytes a parameter, about 10 GB), the engine a bf16 copy
# (1.2 GB) and its KV cache (the longest episode for up to 1,024 sequences at a time, at
# most a quarter of the memory free when the engine starts); activations follow
# batch_tokens. Halve batch_tokens when it does not fit; a 1.7B model needs about 3x that.
# Tried here end to end on random checkpoints of each family and tiny generated data
# (test_templates.py), never on real weights.
task = "tasks.gsm8k"
seed = 1337
device = "cuda"
dtype = "bfloat16"         # autocast; master weights stay fp32
wandb_log = False

sft = dict(
    out_dir="out/gsm8k/sft",
    init_from="/path/to/model",          # a local model directory: --init_from=DIR
    max_iters=200, demo_fraction=1.0,
    learning_rate=1e-5, min_lr=1e-6, warmup_iters=10,
    batch_tokens=8192, eval_max_tokens=512, n_eval_problems=200, keep_best=True,
    log_interval=10, eval_interval=50, ckpt_interval=50,
    # Qwen3: uncomment, or its thinking replies run past max_new_tokens and score 0
    # (Llama 3's template has no such variable and refuses the setting)
    # chat_template_kwargs=dict(enable_thinking=False),
)

grpo = dict(
    out_dir="out/gsm8k/grpo",
    init_from="out/gsm8k/sft/best",
    max_iters=200,
    prompts_per_step=32, group_size=8, temperature=1.0, max_new_tokens=512,
    engine_dtype="bfloat16",
    scale_rewards=False, loss_norm="constant",
    learning_rate=1e-6, min_lr=1e-7, warmup_iters=5,
    batch_tokens=8192, n_eval_problems=200, pass_k=0, keep_best=True,
    log_interval=1, eval_interval=25, ckpt_interval=25,
    # chat_template_kwargs=dict(enable_thinking=False),   # as SFT's, when set there
)
