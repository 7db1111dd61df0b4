# Your own task, the example: tasks/jsonl.py over tasks/arith.jsonl ("417-8" ->
# "417-8=409"). SFT on the answers of 30% of the training rows, then GRPO on all of them,
# from the speedrun's pretrained model (bash speedrun.sh first; or pretrain on countdown's
# corpus: python pretrain.py config/qwen_small.py):
#   python sft.py config/arith_jsonl.py && python train_grpo.py config/arith_jsonl.py
task = "tasks.jsonl"
seed = 1337
device = "cpu"
wandb_log = False

sft = dict(
    out_dir="out/arith_jsonl/sft",
    init_from="out/qwen_small/pretrain",
    max_iters=1000, demo_fraction=0.3,
    learning_rate=1e-3, min_lr=1e-4, warmup_iters=10,
    batch_tokens=1024, eval_max_tokens=12, n_eval_problems=0, keep_best=True,
    log_interval=10, eval_interval=100, ckpt_interval=100,
)

grpo = dict(
    out_dir="out/arith_jsonl/grpo",
    init_from="out/arith_jsonl/sft/best",   # the SFT run's best model on validation
    max_iters=300,
    prompts_per_step=64, group_size=8, temperature=1.0, max_new_tokens=12,
    learning_rate=5e-4, min_lr=5e-5, warmup_iters=5,
    n_eval_problems=0, pass_k=0,
    log_interval=10, eval_interval=25, ckpt_interval=50,
)
