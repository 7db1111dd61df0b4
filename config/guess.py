# Multi-turn GRPO on higher or lower (tasks/guess.py): the environment holds a secret
# number from 1 to n (10..63), the model guesses, and the environment says too high or too
# low and what range is left, up to 6 guesses. SFT from the speedrun's pretrained model
# (bash speedrun.sh first) on uniform guesses in the range left, then GRPO:
#   python sft.py config/guess.py
#   python train_grpo.py config/guess.py
#   python -m bench.report --run out/guess/grpo out/guess/grpo.png
task = "tasks.guess"
seed = 1337
device = "cpu"
wandb_log = False

# SFT: the format and staying in the range (its first-guess accuracy is 1/n
# whatever it learns)
sft = dict(
    out_dir="out/guess/sft",
    init_from="out/qwen_small/pretrain",
    max_iters=400, demo_fraction=1.0,
    learning_rate=1e-3, min_lr=1e-4, warmup_iters=10,
    batch_tokens=2048, eval_max_tokens=4, max_turns=6, max_episode_tokens=256,
    n_eval_problems=100,
    log_interval=20, eval_interval=400, ckpt_interval=200,
)

grpo = dict(
    out_dir="out/guess/grpo",
    init_from="out/guess/sft",
    max_iters=100,
    prompts_per_step=64, group_size=8, temperature=1.0,
    max_new_tokens=4, max_turns=6, max_episode_tokens=256,
    scale_rewards=True, loss_norm="constant",
    learning_rate=3e-4, min_lr=3e-5, warmup_iters=5,
    n_eval_problems=400, pass_k=0,
    log_interval=10, eval_interval=10, ckpt_interval=50,
)
