r"""
GRPO, the main job: the policy samples groups of answers (or multi-turn episodes) with
the in-process engine, the task's reward scores them, and the shared loss pushes up
those that beat their group's mean. On-policy: every step trains on samples of the
weights it updates, which the engine holds in this process.

    python train_grpo.py config/qwen_small.py
    python train_grpo.py config/qwen_small.py --max_iters=20 --out_dir=out/try
    python train_grpo.py config/qwen_small.py --init_from=resume     # continue a killed run exactly
    python train_grpo.py config/countdown_feedback.py                # a multi-turn task
    python train_grpo.py config/qwen_small.py --lora_rank=16         # LoRA (lora.py)
    # data-parallel, one engine each (--fsdp=True: parameters sharded, FSDP2)
    torchrun --standalone --nproc_per_node=2 train_grpo.py config/qwen_small.py
    # only evaluate init_from, on test
    python train_grpo.py config/qwen_small.py --max_iters=0 --out_dir=out/eval_sft \
        --eval_split=test --n_eval_problems=0

One iteration (grpo_step, a comment per phase), with config/qwen_small.py's numbers:

    problems = sampler.draw(96)                        # by p(1-p) of each one's record
    groups = env.episodes(engine, problems, 8)         # engine.generate: 8 per prompt, T = 1
    rewards = task.reward(problem, reply)              # exact: 1 right, 0 wrong or did not stop
    adv = (rewards - group mean) / group std           # a group whose rewards are equal is dropped
    weights = adv x loss mask                          # on sampled tokens only, packed per group
    loss = -(weights * log p(tokens)).sum() / C        # policy_loss; C = 96 x 8 x 48, constant
    optimizer step                                     # AdamW, warmup then cosine
    engine.update_weights(model.state_dict())          # in place: the next rollout is on-policy
    every 20 steps: greedy accuracy on validation      # the best model is kept

The prompts' chat-template ids are made once, and those exact ids go to the engine and
into the batch; a group's G samples share its prompt's KV blocks in the engine and its
rows in the batch (training.pack_groups); a multi-turn task's episodes go on, the
environment's answer appended by ids, until it says they are over. docs/pipeline.md
tells the whole step (the loss normalizers, train/logprob_mismatch, the metrics).

What this loop leaves out, and where it lives: sampling anywhere but here (rollout
ranks, scaleout/serve.py servers, vLLM, a verifiers environment), samples of older
weights (max_staleness) and the corrections they need (truncated or masked importance
sampling, at token or sequence level), PPO's clipped objective over several epochs, a
KL to the starting policy and MoE routing replay are train_grpo_async.py, a fork of
this file that imports its parts.

Three worked forks of this step: docs/forks.md.
"""
import dataclasses
import functools
import math
import os
import shutil
import time

import numpy as np
import torch

import lora
import training
from checkpoint import RunState, init_start, save_best
from checks import require
from configurator import print0, run_cli
from engine import EngineConfig, SamplingParams, sampled_mask
from model import train_flops
from scaleout import distributed
from tasks import evaluate
from tasks.environment import Environment, Group, load_task, solved
from tokenizer import build_tokenizer, check_template_kwargs

# -----------------------------------------------------------------------------
# settings (a config file, then --key=value, override these)
out_dir = "out/grpo"
task = "tasks.countdown"      # a module name or a .py path (tasks/environment.py)
init_from = "out/sft"         # 'resume' | a previous run's out_dir | a transformers model dir
model = dict()                # ModelConfig fields, used only with init_from='scratch'
seed = 1337
device = "cpu"
dtype = "float32"             # the trainer's autocast: 'float32' | 'bfloat16' (weights stay fp32)
compile = False
# rollouts
prompts_per_step = 16         # problems drawn per step, a group each (flat groups dropped)
group_size = 8                # samples per prompt (G)
temperature = 1.0             # of the rollouts; the trainer scores softmax(logits / T) too
top_p = 1.0                   # < 1: nucleus sampling (off-policy: train_grpo_async.py corrects)
top_k = 0                     # > 0: top-k sampling, likewise
max_new_tokens = 16           # reply budget; a reply that reaches it without stopping scores 0
max_turns = 1                 # replies per episode (> 1: the task's env_response between)
max_episode_tokens = 0        # multi-turn: every id after the first prompt, at most
chat_template_kwargs = dict() # to the chat template: Qwen3's dict(enable_thinking=False), ...
share_prompt = True           # train on a group's prompt once (training.pack_groups)
scale_rewards = False         # divide advantages by the group's std (GRPO), not only centre them
advantage_pass_k = 1          # > 1: advantages for the group's pass@k, not its mean reward
                              # (Chen et al. 2025; 0/1 rewards; below group_size)
turn_baseline = False         # multi-turn: reply k against the episodes that reached reply k
loss_norm = "constant"        # 'constant' | 'tokens' | 'weights' (docs/pipeline.md)
engine_dtype = "float32"      # the engine's copy of the weights ('bfloat16' on a GPU)
engine_block_size = 16
engine_compile = False        # decode steps as one graph (engine.py; compiled once at start)
engine_sleep = False          # free the engine's weights and KV pool during each step (memory.md)
# LoRA (lora.py): 0 trains every weight; r > 0 trains a rank-r update of each targeted
# weight, the base frozen (no gradient, no optimizer state)
lora_rank = 0
lora_alpha = 16.0             # the update is scaled by lora_alpha / lora_rank
lora_targets = "all"          # 'all', or some of q_proj,k_proj,v_proj,o_proj (attention),
                              # gate_proj,up_proj,down_proj (dense MLP), experts
# torchrun: shard parameters, gradients and AdamW state per block (FSDP2) instead of DDP's
# whole copy per rank (each rank's engine still holds whole weights)
fsdp = False
# optimization
max_iters = 100
learning_rate = 1e-4
min_lr = 1e-5
warmup_iters = 5
lr_decay_iters = 0            # 0 = max_iters
weight_decay = 0.0
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
aux_loss_coef = 0.01          # times the router's load-balancing loss
batch_tokens = 4096           # tokens per micro-batch; a step takes as many as its samples need
dist_timeout_s = 300          # torchrun: a collective waiting longer than this ends the job
# evaluation (with the engine; 'test' and 'confirm' are for the final comparison only)
eval_split = "val"            # 'val' | 'test' | 'confirm' (a task's confirmatory split)
n_eval_problems = 500         # the first n of the split (0 = all of it)
keep_best = False             # keep the best eval/accuracy's model in {out_dir}/best
pass_k = 8                    # samples per problem for eval/pass@1 and pass@k at T (0 = none)
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
    """reward - mean of its group, for rewards laid out group by group
    ([num_groups * G] -> same shape). With scale_rewards the centred rewards are
    divided by the group's std (+eps), as in the GRPO paper."""
    r = torch.as_tensor(rewards, dtype=torch.float32)
    whole = r.dim() == 1 and r.numel() > 0 and r.numel() % group_size == 0
    require(whole, f"rewards {tuple(r.shape)}: not a flat list of whole groups of {group_size}")
    g = r.view(-1, group_size)
    adv = g - g.mean(dim=1, keepdim=True)
    if scale_rewards:
        adv = adv / (g.std(dim=1, keepdim=True, unbiased=False) + eps)
    return adv.view(-1)


def pass_at_k_advantages(rewards, group_size, k, scale_rewards=False, eps=1e-6):
    """Advantages for pass@k (Chen et al. 2025, "Pass@k Training"), for 0/1 rewards laid
    out group by group: a k-subset of a group scores 1 if any of its samples is right,
    and a sample's advantage is the mean score of the subsets that hold it minus the
    mean over all subsets (divided by the subsets' std with scale_rewards). In closed
    form, n samples of which w are wrong: mean = 1 - C(w, k) / C(n, k); a right sample
    scores 1, a wrong one 1 - C(w-1, k-1) / C(n-1, k-1). Worked example, n = 4, k = 2,
    rewards 1, 0, 0, 0: mean 1 - 3/6 = 0.5; right +0.5, wrong 1 - 2/3 - 0.5 = -1/6.
    A wrong sample is pushed down less when the rest of its subsets can still win, and
    a group with fewer than k wrong samples (pass@k already 1) teaches nothing.
    k = 1 is group_advantages."""
    r = torch.as_tensor(rewards, dtype=torch.float32)
    whole = r.dim() == 1 and r.numel() > 0 and r.numel() % group_size == 0
    require(whole, f"rewards {tuple(r.shape)}: not a flat list of whole groups of {group_size}")
    require(bool(((r == 0) | (r == 1)).all()),
            f"advantage_pass_k={k}: needs 0/1 rewards, got {sorted(set(r.tolist()))}")
    adv = []
    for group in r.view(-1, group_size).tolist():
        n, w = group_size, group.count(0.0)
        mean = 1 - math.comb(w, k) / math.comb(n, k)
        wrong = 1 - math.comb(w - 1, k - 1) / math.comb(n - 1, k - 1) if w else 0.0
        std = math.sqrt(mean * (1 - mean)) + eps if scale_rewards else 1.0
        adv += [((1.0 if x == 1 else wrong) - mean) / std for x in group]
    return torch.tensor(adv)


def reply_index(mask):
    """Per token of an episode, 0 where it was not sampled, else which reply it belongs
    to: mask [1, 1, 0, 0, 1, 1] -> [1, 1, 0, 0, 2, 2]."""
    out, k, before = [], 0, 0
    for m in mask:
        k += bool(m and not before)
        out.append(k if m else 0)
        before = m
    return out


def token_advantages(masks, rewards, config):
    """Each sample's advantage on each of its tokens (masks: its sampled_mask), 0 where it
    was not sampled. By default (and for one-reply episodes) the sample's group
    advantage on every sampled token (with advantage_pass_k > 1, its pass@k one). With
    turn_baseline the tokens of reply k get the episode's reward minus the mean reward
    of the group's episodes that reached reply k:
    a reply after feedback competes with the other replies after feedback, not with
    first answers that were right. Worked example, one group: rewards 1, 0, 1, 0 from
    episodes of 1, 3, 2 and 3 replies. Reply 1 (all four): baseline 0.5. Reply 2
    (episodes 2, 3, 4): baseline 1/3, so episode 3's second reply, the one that
    recovered, gets +2/3 and episode 2's -1/3. Reply 3 (episodes 2 and 4, both failed):
    baseline 0, advantage 0."""
    if config["advantage_pass_k"] > 1:
        adv = pass_at_k_advantages(rewards, config["group_size"], config["advantage_pass_k"],
                                   config["scale_rewards"]).tolist()
        return [[a * m for m in mask] for a, mask in zip(adv, masks)]
    if not config["turn_baseline"]:
        adv = group_advantages(rewards, config["group_size"], config["scale_rewards"]).tolist()
        return [[a * m for m in mask] for a, mask in zip(adv, masks)]
    replies = [reply_index(mask) for mask in masks]
    reached = [max(r, default=0) for r in replies]
    out = [[0.0] * len(mask) for mask in masks]
    for k in range(1, max(reached) + 1):
        members = [i for i in range(len(masks)) if reached[i] >= k]
        adv = group_advantages([rewards[i] for i in members], len(members),
                               config["scale_rewards"]).tolist()
        for i, a in zip(members, adv):
            out[i] = [a if reply == k else w for reply, w in zip(replies[i], out[i])]
    return out


def zero_variance_groups(rewards, group_size):
    """[num_groups] bool: True where every sample of the group got the same reward
    (nothing to learn)."""
    g = torch.as_tensor(rewards, dtype=torch.float32).view(-1, group_size)
    return (g == g[:, :1]).all(dim=1)


class ProblemSampler:
    """The training problems, drawn in proportion to how much each can teach now:
    p(1 - p), where p is the problem's success rate so far under a uniform prior,
    (successes + 1) / (samples + 2). An unseen problem weighs the most (1/4); one always
    or never solved sinks toward 0 as its samples grow, so the rollouts go to problems
    whose groups have reward variance. A step's problems are distinct.

    Worked example: a problem solved 4 of 8 times has p = 5/10 and weight 0.25, as an
    unseen one; 8 of 8 gives p = 9/10 and weight 0.09; 0 of 8 gives p = 1/10 and weight
    0.09, so it is drawn 0.09 / 0.25 as often.

    The record (successes and samples per problem) and the number of draws are the
    whole state: draw d is fixed by (seed, d), so a resumed run draws what the killed
    one would have."""

    def __init__(self, items, seed):
        self.items, self.seed = items, seed
        self.successes = np.zeros(len(items), dtype=np.int64)
        self.samples = np.zeros(len(items), dtype=np.int64)
        self.draws, self.taken = 0, 0
        self.last = None   # the last draw's (indices, successes): rollout ranks send it

    def weights(self):
        p = (self.successes + 1) / (self.samples + 2)
        return p * (1 - p)

    def draw(self, n):
        """The next draw: n distinct problem indices, by weight. The state changes only
        when its outcome is recorded, so a rollout that fails leaves the sampler as it
        was."""
        w = self.weights()
        rng = np.random.default_rng([self.seed, self.draws])
        return rng.choice(len(self.items), size=n, replace=False, p=w / w.sum()).tolist()

    def record(self, indices, successes, group_size):
        """Add a draw's outcome: successes[i] of group_size samples right for problem
        indices[i]."""
        np.add.at(self.successes, indices, successes)
        np.add.at(self.samples, indices, group_size)
        self.draws, self.taken = self.draws + 1, self.taken + len(indices)
        self.last = (list(indices), list(successes))

    def follow(self, indices, successes, group_size):
        """A trainer's copy of a rollout rank's sampler: it makes the same draw
        (checked: a trainer and a worker that disagree on the record stop here) and adds
        its outcome, so both hold the same state (the trainer's is what a checkpoint
        records)."""
        mine = self.draw(len(indices))
        if mine != list(indices):
            raise RuntimeError(f"draw {self.draws}: the rollout ranks drew {list(indices)[:4]}..., "
                               f"this trainer's sampler {mine[:4]}...: their records differ")
        self.record(indices, successes, group_size)

    def state_dict(self):
        return {"draws": self.draws, "taken": self.taken, "successes": self.successes.tolist(),
                "samples": self.samples.tolist()}

    def load_state_dict(self, state):
        n, keys = len(self.items), {"draws", "taken", "successes", "samples"}
        counts = ("successes", "samples")
        ok = (isinstance(state, dict) and set(state) == keys
              and all(type(state[k]) is int and state[k] >= 0 for k in ("draws", "taken"))
              and all(isinstance(state[k], list) and len(state[k]) == n for k in counts)
              and all(type(v) is int for k in counts for v in state[k])
              and all(0 <= s <= t for s, t in zip(state["successes"], state["samples"])))
        require(ok, f"ProblemSampler: bad data state, {n} problems {sorted(keys)}: {state!r:.80}")
        self.draws, self.taken = state["draws"], state["taken"]
        self.successes = np.array(state["successes"], dtype=np.int64)
        self.samples = np.array(state["samples"], dtype=np.int64)


# -----------------------------------------------------------------------------
# one iteration: rollout, build batches, normalizer, corrections, train step, hot-swap


def rollout(engine, env, sampler, config, it):
    """One rollout call: prompts_per_step problems drawn by the sampler, group_size
    episodes each, scored, and the outcome added to the sampler's record. A group whose
    rewards are all equal teaches nothing and is dropped (counted). Returns the kept
    groups ([Group]), the FLOPs sampling them took and the rollout metrics."""
    G = config["group_size"]
    indices = sampler.draw(config["prompts_per_step"])
    problems = [sampler.items[i] for i in indices]
    t0 = time.perf_counter()
    # under torchrun each rank samples its slice; all get every episode. The seed is a
    # function of (run seed, iteration): a resumed run draws the same samples
    episodes = env.episodes(engine, problems, G, config["temperature"],
                            seed=config["seed"] * 1_000_003 + it, top_p=config["top_p"],
                            top_k=config["top_k"])
    gen_time = time.perf_counter() - t0
    rewards = [e.reward for e in episodes]
    samples = [e.sample() for e in episodes]
    successes = [sum(map(solved, rewards[j * G:(j + 1) * G])) for j in range(len(problems))]
    sampler.record(indices, successes, G)
    flat = zero_variance_groups(rewards, G).tolist()
    kept = [Group(problems[j], samples[j * G:(j + 1) * G], rewards[j * G:(j + 1) * G])
            for j in range(len(problems)) if not flat[j]]
    sampled = [sum(e.mask) for e in episodes]
    metrics = {"rollout/reward_mean": float(np.mean(rewards)), "rollout/zero_var_groups": sum(flat),
               "rollout/valid_groups": len(kept), "rollout/problems": len(problems),
               "rollout/problems_total": sampler.taken,
               "rollout/completion_len": float(np.mean(sampled)),
               "rollout/truncated": float(np.mean([e.finish_reason != "stop" for e in episodes])),
               "rollout/tokens_per_s": sum(sampled) / gen_time, "perf/rollout_time_s": gen_time,
               "rollout/weight_version": engine.get_weight_version(),
               # the behaviour policy's entropy, estimated on its own samples: mean -log p
               "offpolicy/entropy": -sum(lp for e in episodes for lp, m in zip(e.logprobs, e.mask)
                                         if m) / max(sum(sampled), 1)}
    if env.max_turns > 1:
        metrics["rollout/turns_mean"] = float(np.mean([e.turns for e in episodes]))
    return kept, evaluate.sampling_flops(engine.model.config, samples, G), metrics


@dataclasses.dataclass(frozen=True)
class Document:
    """What training.pack_groups packs as one document: a prompt and samples that
    continue it (one sample, or a group's samples sharing the prompt's rows), with each
    sample's token weights and loss mask."""
    prompt: list
    samples: list       # [engine.TrainingSample]
    weights: list       # per sample: a weight per completion token
    masks: list         # per sample: 1 per sampled completion token

    @property
    def num_tokens(self):
        # the prompt's rows but its last, then each sample's from the prompt's last token on
        return len(self.prompt) - 1 + sum(len(s.completion_tokens) + 1 for s in self.samples)


def documents(groups, config):
    """The step's documents: token_weights = the sample's advantage on its sampled
    tokens, 0 on the prompt (and on a multi-turn episode's environment tokens). With
    share_prompt a group is one document (training.pack_groups; a group longer than
    batch_tokens is split into several such documents), else each sample is one."""
    docs = []
    for group in groups:
        masks = [list(sampled_mask(s)) for s in group.samples]
        weights = token_advantages(masks, group.rewards, config)
        parts = [[i] for i in range(len(group.samples))]
        if config["share_prompt"]:
            lengths = [len(s.completion_tokens) + 1 for s in group.samples]
            parts = training.split_under_budget(lengths,
                                                config["batch_tokens"] - len(group.prompt) + 1)
        for part in parts:
            docs.append(Document(list(group.prompt), [group.samples[i] for i in part],
                                 [weights[i] for i in part], [masks[i] for i in part]))
    return docs


def pack(docs):
    """One PackedBatch of whole documents; log_probs = the engine's logprob of each
    sampled token, loss_mask = 1 on them."""
    return training.pack_groups(
        [d.prompt for d in docs],
        [[list(s.completion_tokens) for s in d.samples] for d in docs],
        [d.weights for d in docs], [[list(s.logprobs) for s in d.samples] for d in docs],
        [d.masks for d in docs])


def build_batches(groups, config):
    """The step's packed batches: its documents, whole, split under batch_tokens."""
    docs = documents(groups, config)
    split = training.split_under_budget([d.num_tokens for d in docs], config["batch_tokens"])
    return [pack([docs[i] for i in part]) for part in split]


def loss_normalizer(batches, config):
    """The denominator of the step's loss (loss_norm in docs/pipeline.md), fixed before any
    correction is folded into the weights (so train_grpo_async.py's TIS is the paper's
    estimator, its ratio outside the normalizer)."""
    if config["loss_norm"] == "constant":
        return float(config["prompts_per_step"] * config["group_size"] * config["max_new_tokens"]
                     * config["max_turns"])
    if config["loss_norm"] == "tokens":
        return float(max(sum(int(b.loss_mask.sum()) for b in batches), 1))
    return float(max(sum(b.token_weights.abs().sum().item() for b in batches), 1.0))


def policy_loss(logp, batch, normalizer, config):
    """GRPO's objective on a batch: the shared unified_loss,
    -(token_weights * log p).sum() / normalizer, with token_weights = advantage x
    loss mask. A fork changes the objective here, reading its settings from config
    (docs/forks.md)."""
    return training.unified_loss(logp, batch, normalizer)


def grpo_step(engine, env, sampler, run, config, it):
    """One GRPO iteration, top to bottom. Returns its metrics and the FLOPs it spent."""
    clock = {"start": time.perf_counter()}
    # 1. sample group_size episodes for each drawn problem, score them, drop the flat groups
    groups, flops, metrics = rollout(engine, env, sampler, config, it)
    if config["engine_sleep"]:   # the step needs neither the engine's weights nor its KV pool
        engine.sleep()
    clock["rollout"] = time.perf_counter()
    batches = []
    if not groups:   # every group had zero reward variance: no step, the weights stay
        print0(f"iter {it + 1}: no group with reward variance")
    else:
        # 2. advantages x loss mask as token weights, packed; the normalizer, fixed first
        batches = build_batches(groups, config)
        normalizer = loss_normalizer(batches, config)
        # 3. this rank's share
        mine = [b.to(config["device"]) for b in distributed.shard(batches)]
        clock["batches"] = time.perf_counter()
        # 4. one optimizer step on policy_loss, scoring log_softmax(logits / temperature):
        # the distribution the engine sampled (as TRL's GRPOTrainer does)
        loss_fn = functools.partial(policy_loss, config=config)
        metrics.update(training.train_step(run.forward, run.optimizer, mine,
                                           training.scheduled_lr(config, it), config["grad_clip"],
                                           config["aux_loss_coef"], run.autocast, normalizer,
                                           loss_fn, config["temperature"]))
        metrics["train/normalizer"] = normalizer
        clock["step"] = time.perf_counter()
    # 5. publish the new weights in place, so the next rollout is on-policy
    metrics.update(publish(engine, run.model, config))
    clock["end"] = time.perf_counter()
    flops += step_bookkeeping(metrics, clock, batches, run)
    return metrics, flops


def publish(engine, model, config):
    """The engine's weights swapped for model's in place (engine.update_from: version += 1,
    prefix cache flushed), an engine asleep through the step woken first."""
    t0 = time.perf_counter()
    if config["engine_sleep"]:
        engine.wake_up()
    engine.update_from(model)
    return {"perf/update_weights_s": time.perf_counter() - t0}


def step_bookkeeping(metrics, clock, batches, run, passes=0, epochs=1):
    """The FLOPs of the step's training (epochs optimizer steps, and passes forward-only
    logprob passes: train_grpo_async.py's); adds its timings, throughput and MFU (of the
    optimizer step alone) to metrics. clock: the step's time marks."""
    flops = 0.0
    if batches:
        sizes = [(b.num_tokens, int((b.position_ids + 1).sum())) for b in batches]

        def counted(frozen):
            return sum(train_flops(run.model.config, [n], pairs=p, frozen=frozen)
                       for n, p in sizes)
        forward_backward = counted(lora.has_adapters(run.model))
        flops = forward_backward * epochs + counted(False) / 3 * passes
        train_s = clock["step"] - clock["batches"]
        metrics.update({"perf/train_time_s": train_s,
                        "perf/tokens_per_sec": metrics["train/tokens"] / train_s,
                        "perf/mfu": forward_backward / train_s / run.peak_flops})
    metrics["perf/step_time_s"] = clock["end"] - clock["start"]
    return flops


# -----------------------------------------------------------------------------
# setup and the loop


def check_settings(config):
    """GRPO's settings, then the loop's, each refused with a ValueError naming it before
    any work (the configurator has checked every setting's type against its default)."""
    at_least = dict(prompts_per_step=1, group_size=2, max_new_tokens=1, max_turns=1,
                    max_episode_tokens=0, pass_k=0, n_eval_problems=0)
    for name, low in at_least.items():
        require(config[name] >= low, f"{name}={config[name]!r}: expected >= {low}")
    for name, allowed in (("loss_norm", ("constant", "tokens", "weights")),
                          ("eval_split", ("val", "test", "confirm"))):
        require(config[name] in allowed, f"{name}={config[name]!r}: expected one of {allowed}")
    # a bad temperature / top_p / top_k, engine dtype or block size is refused by its owner
    SamplingParams(temperature=config["temperature"], top_p=config["top_p"],
                   top_k=config["top_k"])
    # greedy samples of a prompt are all the same
    require(config["temperature"] != 0, "temperature=0: GRPO needs sampled groups")
    k, G = config["advantage_pass_k"], config["group_size"]
    require(1 <= k < G, f"advantage_pass_k={k}: expected 1 <= k < group_size={G} (with k = G "
            "a group with any right sample has pass@k 1, and nothing to learn)")
    require(k == 1 or not config["turn_baseline"],
            f"advantage_pass_k={k} with turn_baseline=True: one at a time")
    EngineConfig(device=config["device"], dtype=config["engine_dtype"],
                 block_size=config["engine_block_size"], compile=config["engine_compile"])
    training.check_loop_settings(config)


@dataclasses.dataclass(frozen=True)
class Problems:
    """What a run samples and evaluates: the task's environment (episodes, rewards), the
    training problems' sampler and the evaluation split's first n_eval_problems."""
    env: Environment
    sampler: ProblemSampler
    eval: list

    def engine(self, model, config):
        """An engine of model's weights (engine.EngineConfig config), sized for every
        problem's episodes (tasks/evaluate.task_engine)."""
        return evaluate.task_engine(model, self.env, self.sampler.items + self.eval, config)


def load_problems(the_task, start, config):
    """The run's Problems, made without touching out_dir: a prompts_per_step larger than
    the training split is refused before any state changes."""
    env = Environment(the_task, start.tokenizer, config["max_new_tokens"], config["max_turns"],
                      config["max_episode_tokens"], start.stop_ids,
                      check_template_kwargs(start.tokenizer, config["chat_template_kwargs"]))
    eval_problems = the_task.make_problems(config["eval_split"],
                                           config["n_eval_problems"] or None)
    sampler = ProblemSampler(the_task.make_problems("train"), config["seed"])
    # a step's problems are distinct
    n, available = config["prompts_per_step"], len(sampler.items)
    require(n <= available, f"prompts_per_step={n}: more than the {available} problems")
    return Problems(env, sampler, eval_problems)


def evaluate_and_log(engine, problems, run, config, done, meter, best):
    """Evaluate, log, and with keep_best save the model to {out_dir}/best when its
    accuracy beats best["accuracy"]. Each problem's outcome goes to
    {out_dir}/outcomes.jsonl (the latest evaluation's)."""
    t0 = time.perf_counter()
    metrics, outcomes = evaluate.evaluate(engine, problems.env, problems.eval, config["pass_k"],
                                          config["temperature"], config["seed"])
    run.logger.log(done, {**metrics, "perf/elapsed_s": meter.seconds})
    if distributed.is_main():
        evaluate.write_outcomes(config["out_dir"], outcomes)
    if config["keep_best"] and metrics["eval/accuracy"] > best["accuracy"]:
        best.update(accuracy=metrics["eval/accuracy"], iter=done)
        save_best(config["out_dir"], run.model, run.start)   # rank 0 writes
    values = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())
    print0(f"eval iter {done} ({config['eval_split']}): {values} "
           f"({time.perf_counter() - t0:.1f} s)")
    return metrics


def log_iteration(logger, done, metrics):
    logger.log(done, metrics)
    valid, flat = metrics["rollout/valid_groups"], metrics["rollout/zero_var_groups"]
    print0(f"iter {done}: reward {metrics['rollout/reward_mean']:.3f}, "
           f"groups {valid}/{valid + flat}, loss {metrics.get('train/loss', 0):.4f}, "
           f"mismatch {metrics.get('train/logprob_mismatch', 0):.1e}, "
           f"len {metrics['rollout/completion_len']:.1f}, "
           f"{metrics['perf/step_time_s'] * 1000:.0f} ms, "
           f"rollout {metrics['rollout/tokens_per_s']:.0f} tok/s")


def engine_config(config, start):
    """The settings of the engine that samples and evaluates (tasks/evaluate.task_engine
    sizes it for the run's problems), at the run's weight version."""
    return EngineConfig(device=config["device"], dtype=config["engine_dtype"],
                        block_size=config["engine_block_size"], seed=config["seed"],
                        weight_version=start.run_state.weight_version,
                        compile=config["engine_compile"])


def best_so_far(config, start):
    """The best evaluation so far, for keep_best: a resumed run's, or none (a fresh run
    deletes an earlier run's best model in out_dir)."""
    if start.meta is not None:
        return start.run_state.best
    if distributed.is_main():
        shutil.rmtree(os.path.join(config["out_dir"], "best"), ignore_errors=True)
    return {"accuracy": -1.0, "iter": None}


def main(config):
    config["device"] = distributed.setup(config["device"], config["dist_timeout_s"])
    check_settings(config)
    the_task = load_task(config["task"])
    start = init_start(config, build_tokenizer)
    problems = load_problems(the_task, start, config)
    run = training.setup_run(config, start, problems.sampler)
    engine = problems.engine(run.model, engine_config(config, start))
    if engine.static is not None:
        print0(f"engine: decode step compiled in {engine.static.warm_up():.1f} s (once a process)")
    meter = training.Meter(run.start)
    best = best_so_far(config, start)
    print0(f"{config['prompts_per_step']} prompts x {config['group_size']} samples per step, "
           f"{len(problems.eval)} {config['eval_split']} problems")
    final = {} if start.meta is not None else \
        evaluate_and_log(engine, problems, run, config, 0, meter, best)
    for it in range(start.iter_num, config["max_iters"]):
        metrics, flops = grpo_step(engine, problems.env, problems.sampler, run, config, it)
        metrics.update(meter.add(flops, metrics["perf/step_time_s"]))
        done = it + 1
        last = done == config["max_iters"]
        if training.due(config, "log_interval", done, last):
            log_iteration(run.logger, done, metrics)
        if training.due(config, "eval_interval", done, last):
            final = evaluate_and_log(engine, problems, run, config, done, meter, best)
        if training.due(config, "ckpt_interval", done, last):
            training.save(run, config, done, problems.sampler.state_dict(),
                          RunState(meter=meter.state_dict(),
                                   weight_version=engine.get_weight_version(), best=best))
    run.logger.close()
    engine.shutdown()
    del run, engine   # a sharded model and its optimizer go before the process group
    distributed.teardown()
    return final


if __name__ == "__main__":
    run_cli(main, globals(), "grpo")
