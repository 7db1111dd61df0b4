# The embedded default experiment: a small Qwen3-MoE-shaped model learns mini-countdown
# (tasks/countdown.py) on a CPU, on the problems at the edge of its competence: four
# digits that one blind attempt of the corpus's search solves at least 1 time in 20.
# One file for every stage, each stage's output feeding the next:
#   python pretrain.py config/qwen_small.py      # -> out/qwen_small/pretrain
#   python sft.py config/qwen_small.py           # init_from the pretrain run -> out/qwen_small/sft
#   python train_grpo.py config/qwen_small.py    # init_from the sft run
# Top-level names are shared by every stage (each script declares them); the dicts below
# are per stage.

# the model, for init_from='scratch' (vocab_size comes from the tokenizer)
model = dict(
    hidden_size=128, intermediate_size=384, moe_intermediate_size=128,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
    rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=1024,
)
# countdown at the edge (tasks/countdown.py); "tasks.countdown_full": every problem
# of the space
task = "tasks.countdown"
seed = 1337
device = "cpu"
dtype = "float32"
compile = False
wandb_log = False
wandb_project = "nano-rl"

pretrain = dict(
    out_dir="out/qwen_small/pretrain",
    init_from="scratch",
    max_iters=900,
    learning_rate=3e-3, min_lr=3e-4, warmup_iters=20,
    batch_tokens=2048,
    log_interval=10, eval_interval=100, ckpt_interval=100,
)

sft = dict(
    out_dir="out/qwen_small/sft",
    init_from="out/qwen_small/pretrain",
    max_iters=1200,
    demo_fraction=0.3,
    learning_rate=1e-3, min_lr=1e-4, warmup_iters=10,
    batch_tokens=1024, eval_max_tokens=48, n_eval_problems=0, keep_best=True,
    log_interval=10, eval_interval=200, ckpt_interval=200,
)

# chosen on the validation split (docs/results.md): 96 problems per step drawn by p(1 - p)
# in one rollout call, 8 samples each at temperature 1; advantages divided by the group's
# std (the few right answers of a hard problem weigh as much as an easy problem's); the
# loss normalizer is the constant one (Dr. GRPO); no KL term; 100 steps fill the rest of
# the speedrun's 10 minutes; every validation problem (718) scored every 20 steps
grpo = dict(
    out_dir="out/qwen_small/grpo",
    init_from="out/qwen_small/sft/best",   # the SFT run's best model on validation
    max_iters=100,
    prompts_per_step=96, group_size=8, max_new_tokens=48, temperature=1.0,
    scale_rewards=True, loss_norm="constant",
    learning_rate=6e-4, min_lr=6e-5, warmup_iters=5,
    n_eval_problems=0, pass_k=0, keep_best=True,
    log_interval=10, eval_interval=20, ckpt_interval=40,
)
