r"""
Supervised fine-tuning on chat conversations: the loss is on the assistant reply only
(weights = loss mask).

    python sft.py config/qwen_small.py
    python sft.py config/qwen_small.py --init_from=out/qwen_small/pretrain --max_iters=100
    python sft.py config/qwen_small.py --init_from=resume           # continue a killed run exactly
    # data-parallel
    torchrun --standalone --nproc_per_node=2 sft.py config/qwen_small.py --grad_accum=2
    python sft.py config/qwen_small.py --init_from=out/qwen_small/sft --out_dir=out/rft \
        --rft_samples=8 --rft_problems=2000 --max_flops=1e13 --keep_best=True --max_iters=1000000

The data is the task's demonstrations (its sft_examples: for the embedded countdown a
minority of the training problems, each with one right chain of steps), each made by
tokenizer.chat_example, the same chat template the engine's prompts use. With
rft_samples > 0 it is rejection-sampling fine-tuning instead: the starting model answers
rft_problems training problems (the ones GRPO's prompt stream would take first, same
seed) rft_samples times each at rft_temperature, and the distinct correct answers, token
for token as sampled, are the data.

Every eval_interval: eval/loss on demonstrations of validation problems, and
eval/accuracy, the greedy accuracy on n_eval_problems validation problems, over whole
episodes as tasks/evaluate.py and train_grpo.py run them (max_turns > 1: the task's
multi-turn episodes). keep_best=True keeps the model of the best eval/accuracy in
{out_dir}/best (early stopping on validation); max_flops > 0 stops once the run
(sampling included) has spent that many FLOPs (a compute-matched baseline). The test
split is never read here.
"""
import json
import os
import shutil

import torch

import training
from checkpoint import init_start, save_best
from checks import require
from configurator import print0, run_cli
from engine import EngineConfig, sampled_mask
from scaleout import distributed
from tasks import evaluate
from tasks.environment import Environment, load_task, offers, solved
from tokenizer import build_tokenizer, chat_example, check_template_kwargs

# -----------------------------------------------------------------------------
# settings (a config file, then --key=value, override these)
out_dir = "out/sft"
task = "tasks.countdown"      # a module name or a .py path (tasks/environment.py)
# 'scratch' | 'resume' | a previous run's out_dir | a transformers model dir
init_from = "out/pretrain"
model = dict()               # ModelConfig fields, used only with init_from='scratch'
seed = 1337
device = "cpu"
dtype = "float32"            # 'float32' | 'bfloat16' (autocast; master weights stay fp32)
compile = False
# data: demonstrations, or the model's own correct answers (rejection-sampling fine-tuning)
demo_fraction = 0.1       # share of the training problems with a demonstration (task.sft_examples)
rft_samples = 0           # > 0: answers sampled per training problem, the correct ones kept as data
rft_problems = 0          # training problems to sample (the first of GRPO's prompt stream)
rft_temperature = 1.0
# LoRA (lora.py): 0 trains every weight; r > 0 trains a rank-r update of each targeted
# weight, the base frozen (no gradient, no optimizer state)
lora_rank = 0
lora_alpha = 16.0             # the update is scaled by lora_alpha / lora_rank
lora_targets = "all"          # 'all', or some of q_proj,k_proj,v_proj,o_proj (attention),
                              # gate_proj,up_proj,down_proj (dense MLP), experts
# torchrun: shard parameters, gradients and AdamW state per block (FSDP2) instead of DDP's
# whole copy per rank
fsdp = False
# optimization
max_iters = 200
max_flops = 0.0       # > 0: stop once the run has spent this many FLOPs (compute-matched baselines)
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 10
lr_decay_iters = 0           # 0 = max_iters
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
aux_loss_coef = 0.01         # times the router's load-balancing loss
batch_tokens = 1024          # tokens per micro-batch (whole conversations, packed)
grad_accum = 1               # micro-batches per optimizer step, over all ranks (a multiple of them)
dist_timeout_s = 300         # torchrun: a collective waiting longer than this ends the job
# evaluation (validation split only)
n_eval_problems = 500        # validation problems answered greedily every eval_interval (0 = all)
eval_max_tokens = 16         # generation budget per answer
max_turns = 1                # replies per episode, as in train_grpo.py (> 1: the task's turns)
max_episode_tokens = 0       # multi-turn: every id after the first prompt, at most
chat_template_kwargs = dict()   # to the chat template: Qwen3's dict(enable_thinking=False), ...
keep_best = False            # keep the model of the best eval/accuracy in {out_dir}/best
# logging and checkpoints
log_interval = 10
eval_interval = 50
ckpt_interval = 100
wandb_log = False
wandb_project = "nano-rl"
wandb_run_name = ""
# -----------------------------------------------------------------------------


def demonstrations(env, problems):
    """chat examples (ids, loss mask) of problems answered with their preferred solution"""
    return [chat_example(env.tokenizer, env.task.prompt_messages(p) +
                         [{"role": "assistant", "content": env.task.solutions(p)[0]}],
                         env.stop, **env.template_kwargs)
            for p in problems]


def rejection_samples(model, env, problems, config):
    """(examples, flops): the distinct correct answers of model to each problem, as chat
    examples made of the exact prompt and completion ids that were sampled (mask on the
    completion), and the FLOPs sampling them cost."""
    n = config["rft_samples"]
    engine = evaluate.task_engine(model, env, problems, EngineConfig(seed=config["seed"]))
    episodes = env.episodes(engine, problems, n, config["rft_temperature"], config["seed"])
    engine.shutdown()
    samples, kept = [e.sample() for e in episodes], {}
    for i, (e, s) in enumerate(zip(episodes, samples)):
        if solved(e.reward):
            kept.setdefault((i // n, s.completion_tokens), s)
    examples = [(list(s.prompt_tokens) + list(s.completion_tokens),
                 [0] * len(s.prompt_tokens) + list(sampled_mask(s))) for s in kept.values()]
    flops = evaluate.sampling_flops(model.config, samples, n)
    print0(f"rejection sampling: {len(examples)} distinct correct answers from {len(samples)} "
           f"samples of {len(problems)} training problems")
    return examples, flops


def rft_data(start, env, config):
    """The rejection-sampled data, sampled by the starting model once and kept in
    {out_dir}/rft_data.json, so that a resumed run trains on the very same data."""
    path = os.path.join(config["out_dir"], "rft_data.json")
    if start.meta is None:
        problems = training.EpochCursor(env.task.make_problems("train"),
                                        config["seed"]).take(config["rft_problems"])
        examples, flops = rejection_samples(start.model, env, problems, config)
        if distributed.is_main():
            os.makedirs(config["out_dir"], exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump({"examples": examples, "flops": flops}, f)
            os.replace(path + ".tmp", path)
        distributed.barrier()   # the file is there before any rank reads it
    with open(path) as f:
        data = json.load(f)
    return [tuple(e) for e in data["examples"]], data["flops"]


def make_eval_fn(env, val_problems, val_batches, start, config):
    best = {"accuracy": -1.0}

    @torch.no_grad()
    def eval_fn(model):
        engine = evaluate.task_engine(model, env, val_problems,
                                      EngineConfig(seed=config["seed"]))
        accuracy = evaluate.greedy_accuracy(engine, env, val_problems)
        engine.shutdown()
        if config["keep_best"] and accuracy > best["accuracy"]:
            best["accuracy"] = accuracy
            save_best(config["out_dir"], model, start)   # rank 0 writes
        metrics = {"eval/accuracy": accuracy}
        if val_batches is not None:
            loss = training.evaluate_loss(model, val_batches, config["device"])
            metrics["eval/loss"] = loss
        return metrics
    return eval_fn


def check_settings(config):
    """sft.py's own settings, refused before anything in out_dir changes (the loop's are
    checked by training; their types by the configurator)."""
    for name, low in (("rft_samples", 0), ("rft_problems", 0), ("eval_max_tokens", 1),
                      ("max_turns", 1), ("max_episode_tokens", 0)):
        require(config[name] >= low, f"{name}={config[name]!r}: expected an int >= {low}")
    samples, problems = config["rft_samples"], config["rft_problems"]
    temperature = config["rft_temperature"]
    # rejection sampling (rft_samples > 0) needs problems to sample
    require(not samples or problems > 0, f"rft_samples={samples} needs rft_problems > 0")
    require(temperature > 0, f"rft_temperature={temperature!r}: expected > 0")
    training.check_loop_settings(config)


def training_examples(the_task, env, start, config):
    """(examples, FLOPs spent making them): the task's demonstrations, or with rft_samples
    > 0 the starting model's correct answers (rejection sampling)."""
    if config["rft_samples"] > 0:
        return rft_data(start, env, config)
    return [chat_example(env.tokenizer, m, env.stop, **env.template_kwargs)
            for m in the_task.sft_examples(config["seed"], config["demo_fraction"])], 0.0


def main(config):
    config["device"] = distributed.setup(config["device"], config["dist_timeout_s"])
    check_settings(config)
    the_task = load_task(config["task"])
    if config["rft_samples"] == 0 and not offers(the_task, "sft_examples"):
        # (rejection sampling needs none)
        raise ValueError(f"task={config['task']!r} has no sft_examples: set rft_samples > 0")
    val_problems = the_task.make_problems("val", config["n_eval_problems"] or None)
    start = init_start(config, build_tokenizer)
    tokenizer = start.tokenizer
    # the episodes tasks/evaluate.py and train_grpo.py run: stop ids, turns, template
    env = Environment(the_task, tokenizer, config["eval_max_tokens"], config["max_turns"],
                      config["max_episode_tokens"], start.stop_ids,
                      check_template_kwargs(tokenizer, config["chat_template_kwargs"]))
    # a fresh run: no best model of an earlier run in out_dir
    if start.meta is None and distributed.is_main():
        shutil.rmtree(os.path.join(config["out_dir"], "best"), ignore_errors=True)
    examples, spent = training_examples(the_task, env, start, config)
    # validation loss on the task's own answers, when it has them
    val = demonstrations(env, val_problems) if offers(the_task, "solutions") else None
    print0(f"{len(examples)} training conversations ({sum(sum(m) for _, m in examples)} reply "
           f"tokens), {len(val_problems)} validation problems")
    batch_tokens, seed = config["batch_tokens"], config["seed"]
    loader = training.PackedLoader([i for i, _ in examples],
                                   [[float(x) for x in m] for _, m in examples], batch_tokens, seed)
    val_batches = None if val is None else training.fixed_batches(
        [i for i, _ in val], [[float(x) for x in m] for _, m in val], batch_tokens)
    eval_fn = make_eval_fn(env, val_problems, val_batches, start, config)
    final = training.train(config, start, loader, eval_fn, spent)
    if "eval/accuracy" in final:
        print0(f"validation accuracy (greedy, {len(val_problems)} problems): "
               f"{final['eval/accuracy']:.3f}")
    distributed.teardown()
    return final


if __name__ == "__main__":
    run_cli(main, globals(), "sft")
