"""
GRPO, the main job: the policy samples groups of answers with the in-process engine, an exact reward scores
them, and the shared loss pushes up the answers that beat their group's mean.

    python train_grpo.py config/qwen_small.py
    python train_grpo.py config/qwen_small.py --max_iters=20 --out_dir=out/try
    python train_grpo.py config/qwen_small.py --init_from=resume          # continue a killed run exactly
    python train_grpo.py config/qwen_small.py --max_iters=0 --out_dir=out/eval_sft   # just evaluate init_from

One iteration:
  1. take prompts_per_step problems from the prompt stream; their chat-template ids are made once and those
     exact ids go to the engine and into the training batch (no re-tokenising on either side);
  2. engine.generate(prompt_ids, num_samples_per_prompt=group_size): each prompt is prefilled once, its G
     samples share its KV pages; every sample carries the weight version that produced it;
  3. rewards from task.reward; advantages = reward - group mean (divided by the group std only when
     scale_rewards=True: Dr. GRPO shows the division biases toward easy/hard groups); a group whose rewards
     are all equal has zero advantage everywhere and teaches nothing: it is dropped and counted, and more
     prompts are pulled, at most max_attempts rollouts per step;
  4. token_weights = advantage x completion mask (x a truncated importance ratio trainer/engine when
     tis_cap > 0), packed into PackedBatches; the shared training.train_step (unified_loss) takes one step;
  5. engine.update_weights(model.state_dict()): in place, version += 1, prefix cache flushed;
  then log, evaluate (every eval_interval) and checkpoint (every ckpt_interval, with the stream's position).

The trainer keeps fp32 master weights; the engine holds its own copy (its dtype) and never aliases them.
train/logprob_mismatch is the mean |engine logprob - trainer logprob| over the step's completion tokens, both
of the same weights: fp32 rounding when both are fp32 (it grows with bf16 engines or stale weights, which is
what TIS corrects).
"""
import sys
import time

import numpy as np
import torch

import task
import training
from checkpoint import init_start, save_checkpoint
from configurator import configure, print0
from engine import EngineConfig, InferenceEngine, SamplingParams
from tokenizer import build_tokenizer, chat_prompt_ids, completion_text

# -----------------------------------------------------------------------------
# settings (a config file, then --key=value, override these)
out_dir = "out/grpo"
init_from = "out/sft"        # 'resume' | a previous run's out_dir | a transformers model dir ('scratch' works too)
model = dict()               # ModelConfig fields, used only with init_from='scratch'
seed = 1337
device = "cpu"
dtype = "float32"            # the trainer's autocast: 'float32' | 'bfloat16' (master weights stay fp32)
compile = False
# rollouts
prompts_per_step = 16        # groups per optimizer step
group_size = 8               # samples per prompt (G)
max_attempts = 4             # rollouts per step at most while refilling dropped zero-variance groups
temperature = 1.0            # of the rollouts; the trainer scores softmax(logits / T) too (on-policy)
top_p = 1.0
max_new_tokens = 16          # completion budget (the task's answers are ~5 tokens + <|im_end|>)
scale_rewards = False        # divide advantages by the group std (GRPO) instead of only centring (Dr. GRPO)
tis_cap = 0.0                # > 0: weights *= min(exp(trainer - engine logprob), tis_cap), detached (TIS)
engine_dtype = "float32"     # the engine's copy of the weights ('bfloat16' on a GPU)
engine_block_size = 16
# optimization
max_iters = 100
learning_rate = 1e-4
min_lr = 1e-5
warmup_iters = 5
lr_decay_iters = 0           # 0 = max_iters
weight_decay = 0.0
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
aux_loss_coef = 0.01         # times the router's load-balancing loss
batch_tokens = 4096          # tokens per micro-batch; a step is however many micro-batches its samples need
# evaluation (held-out split, with the engine)
n_eval_problems = 0          # 0 = the whole held-out split
pass_k = 8                   # samples per problem for eval/pass@1 and eval/pass@{k} (temperature 1)
# logging and checkpoints
log_interval = 1
eval_interval = 25
ckpt_interval = 25
wandb_log = False
wandb_project = "nano-rl"
wandb_run_name = ""
# -----------------------------------------------------------------------------


# -----------------------------------------------------------------------------
# advantages: pure functions over a flat list of rewards, G consecutive samples per group


def _require(ok, message):
    # one line per input rule, at the entry point
    if not ok:
        raise ValueError(message)


def group_advantages(rewards, group_size, scale_rewards=False, eps=1e-6):
    """reward - mean of its group, for rewards laid out group by group ([num_groups * G] -> same shape).
    With scale_rewards the centred rewards are divided by the group's std (+eps), as in the GRPO paper."""
    r = torch.as_tensor(rewards, dtype=torch.float32)
    _require(r.dim() == 1 and r.numel() > 0 and r.numel() % group_size == 0,
             f"rewards must be a flat list of whole groups of {group_size}, got shape {tuple(r.shape)}")
    g = r.view(-1, group_size)
    adv = g - g.mean(dim=1, keepdim=True)
    if scale_rewards:
        adv = adv / (g.std(dim=1, keepdim=True, unbiased=False) + eps)
    return adv.view(-1)


def zero_variance_groups(rewards, group_size):
    """[num_groups] bool: True where every sample of the group got the same reward (nothing to learn)."""
    g = torch.as_tensor(rewards, dtype=torch.float32).view(-1, group_size)
    return (g == g[:, :1]).all(dim=1)


# the training problems, reshuffled every epoch; the position (epoch, cursor) goes into every checkpoint
PromptStream = training.EpochCursor


# -----------------------------------------------------------------------------
# one iteration: rollout, build batches, tis / mismatch, train step, hot-swap


def rollout(engine, tokenizer, stream, config, it):
    """Sample groups until prompts_per_step of them have reward variance (or max_attempts rollouts ran).
    Returns (the kept groups as (problem, prompt_ids, samples, rewards), rollout metrics)."""
    G, stop = config["group_size"], frozenset({tokenizer.eos_token_id})
    kept, all_rewards, lengths, zero_var, attempts, gen_time = [], [], [], 0, 0, 0.0
    while len(kept) < config["prompts_per_step"] and attempts < config["max_attempts"]:
        problems = stream.take(config["prompts_per_step"] - len(kept))
        prompts = [chat_prompt_ids(tokenizer, task.prompt_messages(p)) for p in problems]
        # the seed is a function of (run seed, iteration, attempt): a resumed run draws the same samples
        params = SamplingParams(temperature=config["temperature"], top_p=config["top_p"],
                                max_tokens=config["max_new_tokens"], stop_token_ids=stop,
                                seed=config["seed"] * 1_000_003 + it * 101 + attempts)
        t0 = time.perf_counter()
        samples = engine.generate(prompts, params, num_samples_per_prompt=G)
        gen_time += time.perf_counter() - t0
        attempts += 1
        rewards = [task.reward(problems[i // G], completion_text(tokenizer, s.completion_tokens))
                   for i, s in enumerate(samples)]
        for j, flat in enumerate(zero_variance_groups(rewards, G).tolist()):
            if flat:
                zero_var += 1
            else:
                kept.append((problems[j], prompts[j], samples[j * G:(j + 1) * G], rewards[j * G:(j + 1) * G]))
        all_rewards += rewards
        lengths += [len(s.completion_tokens) for s in samples]
    metrics = {"rollout/reward_mean": float(np.mean(all_rewards)), "rollout/zero_var_groups": zero_var,
               "rollout/valid_groups": len(kept), "rollout/attempts_per_batch": attempts,
               "rollout/completion_len": float(np.mean(lengths)), "rollout/tokens_per_s": sum(lengths) / gen_time,
               "rollout/weight_version": engine.get_weight_version(), "perf/rollout_time_s": gen_time}
    return kept, metrics


def build_batches(groups, config):
    """Packed batches of prompt + completion with token_weights = advantage on completion tokens, 0 on the
    prompt; log_probs = the engine's logprob of each completion token. Split under batch_tokens."""
    seqs, weights, logps, rewards = [], [], [], []
    for _, prompt, samples, group_rewards in groups:
        adv = group_advantages(group_rewards, config["group_size"], config["scale_rewards"]).tolist()
        for s, a, r in zip(samples, adv, group_rewards):
            seqs.append(list(prompt) + list(s.completion_tokens))
            weights.append([0.0] * len(prompt) + [a] * len(s.completion_tokens))
            logps.append([0.0] * len(prompt) + list(s.logprobs))
            rewards.append(r)
    return [training.pack_sequences([seqs[i] for i in g], [weights[i] for i in g], [logps[i] for i in g],
                                    [rewards[i] for i in g])
            for g in training.budget_groups([len(s) for s in seqs], config["batch_tokens"])]


def tempered(model, temperature):
    """model with its logits divided by temperature: the policy the engine samples from at that temperature
    (its logprobs are log_softmax(logits / T)), so the loss, train/logprob_mismatch and TIS all score the
    distribution that was sampled, as TRL's GRPOTrainer does. T = 1 returns model itself."""
    if temperature == 1.0:
        return model

    def forward(*args, **kwargs):
        logits, aux = model(*args, **kwargs)
        return logits / temperature, aux
    return forward


@torch.no_grad()
def trainer_logprobs(model, batch, autocast):
    """log p(label) of every row under the trainer's current weights (before the step)."""
    with autocast:
        logits, _ = model(batch.tokens, batch.position_ids, batch.cu_seqlens)
    return training.token_logprobs(logits, batch.labels)


def apply_tis(batches, model, autocast, config):
    """train/logprob_mismatch over completion tokens; with tis_cap > 0, fold the truncated importance ratio
    min(exp(trainer - engine), tis_cap) into the weights (a no-grad factor, as the loss contract asks)."""
    out, diff, count = [], 0.0, 0
    for b in batches:
        lp = trainer_logprobs(model, b, autocast)
        mask = b.token_weights != 0
        diff += (lp - b.log_probs).abs()[mask].sum().item()
        count += int(mask.sum())
        if config["tis_cap"] > 0:
            ratio = torch.exp(lp - b.log_probs).clamp(max=config["tis_cap"])
            b = training.PackedBatch(b.tokens, b.labels, b.position_ids, b.cu_seqlens,
                                     b.token_weights * torch.where(mask, ratio, torch.ones_like(ratio)),
                                     b.log_probs, b.rewards)
        out.append(b)
    return out, diff / max(count, 1)


def grpo_step(engine, run, stream, config, it):
    """Iteration it: rollout, build batches, tis / mismatch, one optimizer step, hot-swap into the engine.
    Returns the iteration's metrics (no step and no swap when no group had reward variance)."""
    t0 = time.perf_counter()
    groups, metrics = rollout(engine, run.start.tokenizer, stream, config, it)
    if not groups:  # every group had zero variance max_attempts times: no gradient this step, the weights stay
        print0(f"iter {it + 1}: no group with reward variance in {metrics['rollout/attempts_per_batch']} attempts")
    else:
        forward = tempered(run.forward, config["temperature"])
        t1 = time.perf_counter()
        batches = [b.to(config["device"]) for b in build_batches(groups, config)]
        batches, metrics["train/logprob_mismatch"] = apply_tis(batches, forward, run.autocast, config)
        t2 = time.perf_counter()   # the optimizer step alone from here: tokens/s and MFU measure it
        metrics.update(training.train_step(forward, run.optimizer, batches, training.scheduled_lr(config, it),
                                           config["grad_clip"], config["aux_loss_coef"], run.autocast))
        t3 = time.perf_counter()
        engine.update_weights(run.model.state_dict())
        t4 = time.perf_counter()
        flops = sum(training.train_flops(run.model.config, b.seqlens()) for b in batches)
        metrics.update({"perf/logprob_pass_s": t2 - t1, "perf/train_time_s": t3 - t2,
                        "perf/update_weights_s": t4 - t3, "perf/tokens_per_sec": metrics["train/tokens"] / (t3 - t2),
                        "perf/mfu": flops / (t3 - t2) / run.peak_flops})
    metrics["perf/step_time_s"] = time.perf_counter() - t0
    return metrics


# -----------------------------------------------------------------------------
# evaluation: held-out greedy accuracy, and pass@1 / pass@k from sampled completions, all through the engine


def evaluate(engine, tokenizer, problems, config):
    """Greedy accuracy, and pass@1 / pass@k over pass_k samples at temperature 1, of these problems."""
    stop = frozenset({tokenizer.eos_token_id})
    prompts = [chat_prompt_ids(tokenizer, task.prompt_messages(p)) for p in problems]
    greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=config["max_new_tokens"],
                                                     stop_token_ids=stop))
    acc = np.mean([task.reward(p, completion_text(tokenizer, s.completion_tokens))
                   for p, s in zip(problems, greedy)])
    k = config["pass_k"]
    sampled = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=config["max_new_tokens"],
                                                      stop_token_ids=stop, seed=config["seed"]),
                              num_samples_per_prompt=k)
    right = np.array([task.reward(problems[i // k], completion_text(tokenizer, s.completion_tokens))
                      for i, s in enumerate(sampled)]).reshape(len(problems), k)
    return {"eval/accuracy": float(acc), "eval/pass@1": float(right.mean()),
            f"eval/pass@{k}": float(right.max(axis=1).mean())}


def evaluate_and_log(engine, run, problems, config, done):
    t0 = time.perf_counter()
    metrics = evaluate(engine, run.start.tokenizer, problems, config)
    run.logger.log(done, metrics)
    print0(f"eval iter {done}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()) +
           f" ({time.perf_counter() - t0:.1f} s)")
    return metrics


# -----------------------------------------------------------------------------
# the loop


def check_settings(config):
    """GRPO's own settings, then the loop's, each refused with a ValueError naming it before any work."""
    for name, low in (("prompts_per_step", 1), ("group_size", 2), ("max_attempts", 1), ("max_new_tokens", 1),
                      ("pass_k", 1), ("n_eval_problems", 0)):
        _require(type(config[name]) is int and config[name] >= low, f"{name}={config[name]!r}: expected an int "
                                                                     f">= {low}")
    # attempt a of iteration i samples with seed * 1_000_003 + i * 101 + a: more attempts would repeat seeds
    _require(config["max_attempts"] <= 101, f"max_attempts={config['max_attempts']!r}: expected at most 101")
    tis_cap = config["tis_cap"]
    _require(type(tis_cap) in (int, float) and tis_cap >= 0, f"tis_cap={tis_cap!r}: expected a number >= 0 "
                                                             f"(0 = off)")
    SamplingParams(temperature=config["temperature"], top_p=config["top_p"])   # refuses a bad temperature / top_p
    _require(config["temperature"] != 0, "temperature=0: GRPO needs sampled groups (greedy samples of a prompt "
                                         "are all the same)")
    # a bad engine dtype or page size is refused here, before the run setup touches out_dir
    EngineConfig(device=config["device"], dtype=config["engine_dtype"], block_size=config["engine_block_size"])
    training.check_loop_settings(config)


def make_engine(config, run, problems):
    """The in-process engine over a copy of the policy, sized for the longest prompt of these problems plus the
    completion budget, starting at the resumed run's weight version."""
    prompt_len = max(len(chat_prompt_ids(run.start.tokenizer, task.prompt_messages(p))) for p in problems)
    max_len = prompt_len + config["max_new_tokens"]
    blocks_per_seq = -(-max_len // config["engine_block_size"]) + 1
    version = 0 if run.start.meta is None else run.start.meta["extra"]["weight_version"]
    return InferenceEngine(EngineConfig(
        device=config["device"], dtype=config["engine_dtype"], block_size=config["engine_block_size"],
        max_model_len=max_len, max_batch_size=256, num_blocks=256 * blocks_per_seq, seed=config["seed"],
        weight_version=version), model=run.model)


def log_iteration(logger, done, metrics):
    logger.log(done, metrics)
    valid, flat = metrics["rollout/valid_groups"], metrics["rollout/zero_var_groups"]
    print0(f"iter {done}: reward {metrics['rollout/reward_mean']:.3f}, groups {valid}/{valid + flat}, "
           f"loss {metrics.get('train/loss', 0):.4f}, mismatch {metrics.get('train/logprob_mismatch', 0):.1e}, "
           f"len {metrics['rollout/completion_len']:.1f}, {metrics['perf/step_time_s'] * 1000:.0f} ms, "
           f"rollout {metrics['rollout/tokens_per_s']:.0f} tok/s")


def main(config):
    check_settings(config)
    start = init_start(config, build_tokenizer)
    stream = PromptStream(task.make_problems("train"), config["seed"])
    run = training.setup_run(config, start, stream)
    eval_problems = task.make_problems("test", config["n_eval_problems"] or None)
    engine = make_engine(config, run, stream.items + eval_problems)
    print0(f"{config['prompts_per_step']} prompts x {config['group_size']} samples per step, "
           f"{len(eval_problems)} held-out problems")
    final = {} if start.meta is not None else evaluate_and_log(engine, run, eval_problems, config, 0)
    for it in range(start.iter_num, config["max_iters"]):
        metrics = grpo_step(engine, run, stream, config, it)   # rollout, batches, tis, train step, hot-swap
        done = it + 1
        if training.due(config, "log_interval", done):
            log_iteration(run.logger, done, metrics)
        if training.due(config, "eval_interval", done):
            final = evaluate_and_log(engine, run, eval_problems, config, done)
        if training.due(config, "ckpt_interval", done):
            save_checkpoint(config["out_dir"], run.model, run.optimizer, run.start.tokenizer, done, config,
                            stream.state_dict(), extra={"weight_version": engine.get_weight_version()})
    run.logger.close()
    engine.shutdown()
    return final


if __name__ == "__main__":
    config = configure(globals(), sys.argv[1:], stage="grpo")
    main(config)
