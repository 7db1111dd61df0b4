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
  5. engine.update_weights(policy.state_dict()): in place, version += 1, prefix cache flushed.

The trainer keeps fp32 master weights; the engine holds its own copy (its dtype) and never aliases them.
train/logprob_mismatch is the mean |engine logprob - trainer logprob| over the step's completion tokens, both
of the same weights: it should be ~1e-6 in fp32 (it grows with bf16 engines or stale weights, which is what
TIS corrects).
"""
import sys
import time

import numpy as np
import torch

import task
import training
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


def group_advantages(rewards, group_size, scale_rewards=False, eps=1e-6):
    """reward - mean of its group, for rewards laid out group by group ([num_groups * G] -> same shape).
    With scale_rewards the centred rewards are divided by the group's std (+eps), as in the GRPO paper."""
    r = torch.as_tensor(rewards, dtype=torch.float32)
    if r.dim() != 1 or r.numel() == 0 or r.numel() % group_size:
        raise ValueError(f"rewards must be a flat list of whole groups of {group_size}, got shape {tuple(r.shape)}")
    g = r.view(-1, group_size)
    adv = g - g.mean(dim=1, keepdim=True)
    if scale_rewards:
        adv = adv / (g.std(dim=1, keepdim=True, unbiased=False) + eps)
    return adv.view(-1)


def zero_variance_groups(rewards, group_size):
    """[num_groups] bool: True where every sample of the group got the same reward (nothing to learn)."""
    g = torch.as_tensor(rewards, dtype=torch.float32).view(-1, group_size)
    return (g == g[:, :1]).all(dim=1)


# -----------------------------------------------------------------------------
# the prompt stream: the training problems, reshuffled every epoch, position (epoch, cursor) is its whole state


class PromptStream:
    def __init__(self, problems, seed):
        self.problems, self.seed = problems, seed
        self.epoch, self.cursor = 0, 0
        self._order_epoch, self._order = None, None

    def order(self, epoch):   # this epoch's permutation, a function of (seed, epoch) only
        if self._order_epoch != epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.problems))
            self._order_epoch = epoch
        return self._order

    def take(self, n):
        out = []
        while len(out) < n:
            if self.cursor == len(self.problems):
                self.epoch, self.cursor = self.epoch + 1, 0
            order = self.order(self.epoch)
            take = min(n - len(out), len(self.problems) - self.cursor)
            out += [self.problems[i] for i in order[self.cursor:self.cursor + take]]
            self.cursor += take
        return out

    def state_dict(self):
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state):
        if (not isinstance(state, dict) or set(state) != {"epoch", "cursor"}
                or not all(type(v) is int and v >= 0 for v in state.values()) or state["cursor"] > len(self.problems)):
            raise ValueError(f"PromptStream: bad data state {state!r}")
        self.epoch, self.cursor = state["epoch"], state["cursor"]


# -----------------------------------------------------------------------------
# rollouts and the batch


def rollout(engine, tok, stream, c, it):
    """Sample groups until prompts_per_step of them have reward variance (or max_attempts rollouts ran).
    Returns (kept groups as (problem, prompt_ids, samples, rewards)), rollout metrics)."""
    stop = frozenset({tok.eos_token_id})
    kept, all_rewards, lens, zero_var, attempts, gen_time = [], [], [], 0, 0, 0.0
    while len(kept) < c["prompts_per_step"] and attempts < c["max_attempts"]:
        problems = stream.take(c["prompts_per_step"] - len(kept))
        prompts = [chat_prompt_ids(tok, task.prompt_messages(p)) for p in problems]
        # the seed is a function of (run seed, iteration, attempt): a resumed run draws the same samples
        params = SamplingParams(temperature=c["temperature"], top_p=c["top_p"], max_tokens=c["max_new_tokens"],
                                stop_token_ids=stop, seed=c["seed"] * 1_000_003 + it * 101 + attempts)
        t0 = time.perf_counter()
        samples = engine.generate(prompts, params, num_samples_per_prompt=c["group_size"])
        gen_time += time.perf_counter() - t0
        attempts += 1
        G = c["group_size"]
        rewards = [task.reward(problems[i // G], completion_text(tok, s.completion_tokens))
                   for i, s in enumerate(samples)]
        flat = zero_variance_groups(rewards, G).tolist()
        for j, p in enumerate(problems):
            if flat[j]:
                zero_var += 1
            else:
                kept.append((p, prompts[j], samples[j * G:(j + 1) * G], rewards[j * G:(j + 1) * G]))
        all_rewards += rewards
        lens += [len(s.completion_tokens) for s in samples]
    metrics = {"rollout/reward_mean": float(np.mean(all_rewards)), "rollout/zero_var_groups": zero_var,
               "rollout/valid_groups": len(kept), "rollout/attempts_per_batch": attempts,
               "rollout/completion_len": float(np.mean(lens)), "rollout/tokens_per_s": sum(lens) / gen_time,
               "rollout/weight_version": engine.get_weight_version(), "perf/rollout_time_s": gen_time}
    return kept, metrics


def build_batches(groups, c):
    """Packed batches of prompt + completion with token_weights = advantage on completion tokens, 0 on the
    prompt; log_probs = the engine's logprob of each completion token. Split under batch_tokens."""
    seqs, weights, logps, rewards = [], [], [], []
    for _, prompt, samples, r in groups:
        adv = group_advantages(r, c["group_size"], c["scale_rewards"]).tolist()
        for s, a, ri in zip(samples, adv, r):
            n = len(s.completion_tokens)
            seqs.append(list(prompt) + list(s.completion_tokens))
            weights.append([0.0] * len(prompt) + [a] * n)
            logps.append([0.0] * len(prompt) + list(s.logprobs))
            rewards.append(ri)
    return [training.pack_sequences([seqs[i] for i in g], [weights[i] for i in g], [logps[i] for i in g],
                                    [rewards[i] for i in g])
            for g in training.budget_groups([len(s) for s in seqs], c["batch_tokens"])]


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


def apply_tis(batches, model, autocast, c):
    """train/logprob_mismatch over completion tokens; with tis_cap > 0, fold the truncated importance ratio
    min(exp(trainer - engine), tis_cap) into the weights (a no-grad factor, as the loss contract asks)."""
    out, diff, count = [], 0.0, 0
    for b in batches:
        lp = trainer_logprobs(model, b, autocast)
        mask = b.token_weights != 0
        diff += (lp - b.log_probs).abs()[mask].sum().item()
        count += int(mask.sum())
        if c["tis_cap"] > 0:
            ratio = torch.exp(lp - b.log_probs).clamp(max=c["tis_cap"])
            b = training.PackedBatch(b.tokens, b.labels, b.position_ids, b.cu_seqlens,
                                     b.token_weights * torch.where(mask, ratio, torch.ones_like(ratio)),
                                     b.log_probs, b.rewards)
        out.append(b)
    return out, diff / max(count, 1)


# -----------------------------------------------------------------------------
# evaluation: held-out greedy accuracy, and pass@1 / pass@k from sampled completions, all through the engine


def evaluate(engine, tok, problems, c):
    stop = frozenset({tok.eos_token_id})
    prompts = [chat_prompt_ids(tok, task.prompt_messages(p)) for p in problems]
    greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=c["max_new_tokens"],
                                                     stop_token_ids=stop))
    acc = np.mean([task.reward(p, completion_text(tok, s.completion_tokens))
                   for p, s in zip(problems, greedy)])
    k = c["pass_k"]
    sampled = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=c["max_new_tokens"],
                                                      stop_token_ids=stop, seed=c["seed"]), num_samples_per_prompt=k)
    right = np.array([task.reward(problems[i // k], completion_text(tok, s.completion_tokens))
                      for i, s in enumerate(sampled)]).reshape(len(problems), k)
    return {"eval/accuracy": float(acc), "eval/pass@1": float(right.mean()),
            f"eval/pass@{k}": float(right.max(axis=1).mean())}


# -----------------------------------------------------------------------------
# the loop


def check_settings(c):
    for name, low in (("prompts_per_step", 1), ("group_size", 2), ("max_attempts", 1), ("max_new_tokens", 1),
                      ("pass_k", 1), ("n_eval_problems", 0)):      # the loop's own (max_iters, ...): below
        if isinstance(c[name], bool) or not isinstance(c[name], int) or c[name] < low:
            raise ValueError(f"{name}={c[name]!r}: expected an int >= {low}")
    if c["max_attempts"] > 101:   # attempt a of iteration i samples with seed * 1_000_003 + i * 101 + a: no repeats
        raise ValueError(f"max_attempts={c['max_attempts']!r}: expected at most 101")
    if isinstance(c["tis_cap"], bool) or not isinstance(c["tis_cap"], (int, float)) or not c["tis_cap"] >= 0:
        raise ValueError(f"tis_cap={c['tis_cap']!r}: expected a number >= 0 (0 = off)")
    SamplingParams(temperature=c["temperature"], top_p=c["top_p"])   # refuses a bad temperature / top_p now
    if c["temperature"] == 0:
        raise ValueError("temperature=0: GRPO needs sampled groups (greedy samples of a prompt are all the same)")
    training.check_loop_settings(c)


def main(c):
    check_settings(c)
    start = training.init_start(c, build_tokenizer)
    tok = start.tokenizer
    training.seed_everything(c["seed"])
    device_type, autocast = training.precision(c)
    resumed = c["init_from"] == "resume"
    policy = start.model.to(c["device"])
    forward = tempered(torch.compile(policy) if c["compile"] else policy, c["temperature"])
    optimizer = training.configure_optimizer(policy, c["learning_rate"], c["weight_decay"], (c["beta1"], c["beta2"]),
                                             device_type)
    stream = PromptStream(task.make_problems("train"), c["seed"])
    version = 0
    if resumed:
        version = training.read_checkpoint_meta(start.source)["extra"]["weight_version"]
        optimizer.load_state_dict(start.trainer_state["optimizer"])
        stream.load_state_dict(start.data_state)
        training.set_rng_state(start.trainer_state["rng"])
    eval_problems = task.make_problems("test", c["n_eval_problems"] or None)
    # the engine is sized for the task's longest prompt (a 3-digit target) plus the completion budget
    prompt_len = max(len(chat_prompt_ids(tok, task.prompt_messages(p))) for p in stream.problems + eval_problems)
    max_len = prompt_len + c["max_new_tokens"]
    blocks_per_seq = -(-max_len // c["engine_block_size"]) + 1
    engine = InferenceEngine(EngineConfig(
        device=c["device"], dtype=c["engine_dtype"], block_size=c["engine_block_size"], max_model_len=max_len,
        max_batch_size=256, num_blocks=256 * blocks_per_seq, seed=c["seed"],
        weight_version=version), model=policy)
    logger = training.Logger(c["out_dir"], c, resume_iter=start.iter_num if resumed else None)
    peak = training.measure_matmul_flops(c["device"], torch.float32 if c["dtype"] == "float32" else torch.bfloat16)
    lr_decay_iters = c["lr_decay_iters"] or c["max_iters"]
    print0(f"{policy.num_params() / 1e6:.2f}M parameters ({policy.num_active_params() / 1e6:.2f}M active), from "
           f"{start.source}, iter {start.iter_num} -> {c['max_iters']}, {c['prompts_per_step']} prompts x "
           f"{c['group_size']} samples per step, {len(eval_problems)} held-out problems")

    def run_eval(it):
        t0 = time.perf_counter()
        e = evaluate(engine, tok, eval_problems, c)
        logger.log(it, e)
        print0(f"eval iter {it}: " + ", ".join(f"{k} {v:.4f}" for k, v in e.items()) +
               f" ({time.perf_counter() - t0:.1f} s)")
        return e

    it, final = start.iter_num, {}
    if not resumed:
        final = run_eval(0)
    while it < c["max_iters"]:
        t0 = time.perf_counter()
        groups, m = rollout(engine, tok, stream, c, it)
        lr = training.get_lr(it, c["learning_rate"], c["min_lr"], c["warmup_iters"], lr_decay_iters)
        if groups:
            t1 = time.perf_counter()
            batches = [b.to(c["device"]) for b in build_batches(groups, c)]
            batches, m["train/logprob_mismatch"] = apply_tis(batches, forward, autocast, c)
            t2 = time.perf_counter()   # the optimizer step alone from here: tokens/s and MFU measure it
            m.update(training.train_step(forward, optimizer, batches, lr, c["grad_clip"], c["aux_loss_coef"],
                                         autocast))
            t3 = time.perf_counter()
            engine.update_weights(policy.state_dict())
            t4 = time.perf_counter()
            flops = sum(training.train_flops(policy.config, b.seqlens()) for b in batches)
            m.update({"perf/logprob_pass_s": t2 - t1, "perf/train_time_s": t3 - t2, "perf/update_weights_s": t4 - t3,
                      "perf/tokens_per_sec": m["train/tokens"] / (t3 - t2), "perf/mfu": flops / (t3 - t2) / peak})
        else:  # every group had zero variance max_attempts times: no gradient this step, the weights stay
            print0(f"iter {it + 1}: no group with reward variance in {m['rollout/attempts_per_batch']} attempts")
        it += 1
        m["perf/step_time_s"] = time.perf_counter() - t0
        last = it == c["max_iters"]
        if it % c["log_interval"] == 0 or last:
            logger.log(it, m)
            print0(f"iter {it}: reward {m['rollout/reward_mean']:.3f}, groups {m['rollout/valid_groups']}"
                   f"/{m['rollout/valid_groups'] + m['rollout/zero_var_groups']}, loss {m.get('train/loss', 0):.4f}, "
                   f"mismatch {m.get('train/logprob_mismatch', 0):.1e}, len {m['rollout/completion_len']:.1f}, "
                   f"{m['perf/step_time_s'] * 1000:.0f} ms, rollout {m['rollout/tokens_per_s']:.0f} tok/s")
        if it % c["eval_interval"] == 0 or last:
            final = run_eval(it)
        if it % c["ckpt_interval"] == 0 or last:
            training.save_checkpoint(c["out_dir"], policy, optimizer, tok, it, c, stream.state_dict(),
                                     extra={"weight_version": engine.get_weight_version()})
    logger.close()
    engine.shutdown()
    return final


if __name__ == "__main__":
    config = configure(globals(), sys.argv[1:], stage="grpo")
    main(config)
