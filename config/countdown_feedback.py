# Multi-turn GRPO on countdown with feedback (task_feedback.py): the model answers, the environment
# says what the answer came to, and the model may try again, up to 3 answers. It starts from the
# speedrun's SFT model (bash speedrun.sh first):
#   python train_grpo.py config/countdown_feedback.py
#   python report.py --run out/countdown_feedback/grpo out/countdown_feedback/grpo.png
task = "task_feedback"
seed = 1337
device = "cpu"
wandb_log = False

grpo = dict(
    out_dir="out/countdown_feedback/grpo",
    init_from="out/qwen_small/sft/best",
    max_iters=300,
    prompts_per_step=32, group_size=8, temperature=0.7,
    max_new_tokens=40, max_turns=3, max_episode_tokens=160,
    learning_rate=2e-4, min_lr=2e-5, warmup_iters=5,
    n_eval_problems=500, pass_k=0,
    log_interval=10, eval_interval=25, ckpt_interval=50,
)
