# Multi-turn GRPO on countdown with feedback (tasks/countdown_feedback.py): the model
# answers, the environment names the first broken step of a wrong answer and gives the
# problem again, and the model may try again, up to 3 answers. SFT from the speedrun's
# pretrained model (bash speedrun.sh first), then GRPO:
#   python sft.py config/countdown_feedback.py
#   python train_grpo.py config/countdown_feedback.py
#   python -m bench.report --run out/countdown_feedback/grpo out/countdown_feedback/grpo.png
task = "tasks.countdown_feedback"
seed = 1337
device = "cpu"
wandb_log = False

# SFT: countdown's demonstrations, two thirds of them after misses and feedback; sft.py
# evaluates whole episodes of up to 3 answers, as GRPO does, so keep_best picks on those
sft = dict(
    out_dir="out/countdown_feedback/sft",
    init_from="out/qwen_small/pretrain",
    max_iters=1200, demo_fraction=0.3,
    learning_rate=1e-3, min_lr=1e-4, warmup_iters=10,
    batch_tokens=2048, eval_max_tokens=48, max_turns=3, max_episode_tokens=240, keep_best=True,
    log_interval=10, eval_interval=200, ckpt_interval=200,
)

grpo = dict(
    out_dir="out/countdown_feedback/grpo",
    init_from="out/countdown_feedback/sft/best",
    max_iters=120,
    prompts_per_step=32, group_size=8, temperature=1.0,
    max_new_tokens=48, max_turns=3, max_episode_tokens=240,
    learning_rate=1e-4, min_lr=1e-5, warmup_iters=5,
    n_eval_problems=500, pass_k=0,
    log_interval=10, eval_interval=20, ckpt_interval=40,
)
