"""
What the trainers share: one batch contract and one loss, packing and the data cursor,
AdamW and its schedule, one optimizer step, logging, one run setup, and the loop of a
fixed dataset (pretrain.py, sft.py).

    start = checkpoint.init_start(config, build_tokenizer)   # the weights; what resume restores
    run = setup_run(config, start, loader)                   # device, optimizer, restored state
    batch = pack_sequences([ids_a, ids_b], [weights_a, weights_b])   # a PackedBatch: no padding
    train_step(run.forward, run.optimizer, [batch], scheduled_lr(config, it))   # one step

The data sources differ only in the per-token weights they hand to pack_sequences, never
in the step (see unified_loss). train_grpo.py writes its own loop over these parts, and
train_grpo_async.py (its fork) the off-policy corrections it folds into the weights."""

import json
import math
import os
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

import lora
from checkpoint import (RunState, Start, clear_checkpoints, load_optimizer, save_checkpoint,
                        set_rng_state)
from checks import is_finite_number, require
from configurator import print0
from model import Transformer, train_flops
from scaleout import distributed


# -----------------------------------------------------------------------------
# the batch contract and the one loss


@dataclass(frozen=True)
class PackedBatch:
    """N sequences laid end to end in one row of T tokens. Everything per token is aligned
    with `labels`: row j of a sequence reads tokens[j] and is scored on predicting
    labels[j] = the sequence's next token."""
    tokens: torch.Tensor                     # [T] int64, the inputs
    labels: torch.Tensor                     # [T] int64, the next token (0 on a last row)
    position_ids: torch.Tensor               # [T] int64, from 0 in every sequence
    cu_seqlens: torch.Tensor                 # [N+1] int32, sequence i: rows cu[i]:cu[i+1]
    token_weights: torch.Tensor              # [T] float32, each row's weight (0 on last rows)
    log_probs: torch.Tensor | None = None    # [T] float32, the sampler's logprob of each label
    rewards: torch.Tensor | None = None      # [N] float32, one per sequence (optional)
    branch: torch.Tensor | None = None       # [T] int64, shared-prefix documents (pack_groups)
    loss_mask: torch.Tensor | None = None    # [T] bool, rows scored on a sampled token (GRPO)
    old_log_probs: torch.Tensor | None = None  # [T] float32, the trainer's pre-step (PPO)
    routes: torch.Tensor | None = None       # [T, M, k] int64, experts to replay (-1: none)

    @property
    def num_tokens(self):
        return self.tokens.numel()

    @property
    def num_seqs(self):
        return self.cu_seqlens.numel() - 1

    def seqlens(self):
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def to(self, device):
        return PackedBatch(*(None if v is None else v.to(device, non_blocking=True)
                             for v in (getattr(self, f.name) for f in fields(self))))


def token_logprobs(logits, labels):
    """log p(label) per row, in fp32 with log_softmax + gather (never log(softmax)):
    [T, V], [T] -> [T]. The same quantity the engine reports as a sample's logprob
    at temperature 1."""
    ok = logits.dim() == 2 and labels.shape == logits.shape[:1]
    require(ok, f"logits {tuple(logits.shape)}, labels {tuple(labels.shape)}: not T rows, T labels")
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)


def unified_loss(logits, batch, normalizer=None):
    """-(token_weights * log p(labels)).sum() / normalizer, the one loss of all three
    trainers. `logits` is [T, V], or the [T] log p(labels) themselves: what
    batch_logprobs returns (model.logprobs, a chunk of rows at a time so that no [T, V]
    tensor is ever whole: the trainers' path; the same numbers). The default normalizer
    is token_weights.abs().sum().clamp(min=1), which means:
      pretrain  weights 1         -> the mean next-token NLL (== F.cross_entropy's mean)
      SFT       weights 0/1 mask  -> the mean NLL over assistant tokens (== cross_entropy with
                                     ignore_index)
      GRPO      advantage x mask  -> sum_t A_t * (-log p_t) / sum_t |A_t| (clamped at 1);
                                     importance ratios and other per-token, no-grad factors are
                                     folded into the weights
    A constant denominator (Dr. GRPO's num_sequences * max_tokens) is passed as
    `normalizer`; train_step passes the whole step's sum over micro-batches. The weights
    are constants (no gradient flows into them)."""
    logp = logits if logits.dim() == 1 else token_logprobs(logits, batch.labels)
    w = batch.token_weights.detach().to(logp.dtype)
    if normalizer is None:
        normalizer = w.abs().sum().clamp(min=1)
    return -(w * logp).sum() / normalizer


def batch_logprobs(model, batch, routes_out=None, temperature=1.0):
    """(log p(label) per row [T] at temperature, aux loss) of model on a packed batch, its
    shared prefixes included, routed by batch.routes when it carries them (routing
    replay); routes_out receives the experts each MoE layer used. model may be wrapped
    (DDP, torch.compile) or sharded (FSDP2): the blocks run through the wrapper, the head
    is the model's own (model.Transformer.logprobs; distributed.wrap says why that is
    right under each)."""
    extra = {} if batch.branch is None else {"branch": batch.branch}
    extra |= {} if batch.routes is None else {"routes": batch.routes}
    extra |= {} if routes_out is None else {"routes_out": routes_out}
    hidden, router_logits = model(batch.tokens, batch.position_ids, batch.cu_seqlens, **extra)
    head = distributed.unwrap(model)
    return (head.logprobs(hidden, batch.labels, temperature),
            head.aux_loss(router_logits, hidden))


def kl_k3(trainer_lp, engine_lp, mask):
    """sum over masked rows of r - 1 - log r, r = exp(trainer - engine): k3's estimate of
    KL(engine || trainer) times the number of rows (each term >= 0)."""
    d = torch.where(mask, trainer_lp - engine_lp, 0.0).double()
    return float((d.exp() - 1 - d).sum())


# -----------------------------------------------------------------------------
# packing, and the data cursor: endless epochs over a fixed list, its position the
# whole data state


def pack_sequences(sequences, weights, log_probs=None, rewards=None, loss_masks=None):
    """Pack variable-length sequences into one PackedBatch (no padding).

    sequences: token-id lists. weights: same shapes; weights[i][t] weighs predicting
    sequences[i][t] from the tokens before it (weights[i][0] is never used). log_probs:
    optional, aligned like weights (the sampler's logprob of token t, 0 where it did not
    sample). rewards: optional, one float per sequence. loss_masks: optional, aligned
    like weights (1 where token t was sampled). Row j of a sequence reads token j and is
    labelled with token j+1, carrying weights[i][j+1]; its last row has nothing to
    predict: label 0 (a placeholder), weight 0."""
    n = len(sequences)
    require(n > 0, "pack_sequences: no sequences")
    check_aligned("pack_sequences:", n, "sequences", {
        "weight lists": weights, "log_probs lists": log_probs, "rewards": rewards,
        "loss_masks lists": loss_masks})
    aligned = {"weights": weights, "log_probs": log_probs, "loss_masks": loss_masks}
    for i, seq in enumerate(sequences):
        require(len(seq) > 0, f"pack_sequences: sequence {i} is empty")
        check_aligned(f"pack_sequences: sequence {i} has", len(seq), "tokens",
                      {name: rows[i] for name, rows in aligned.items() if rows is not None})
    # dtype inferred: floats / bools show up
    ids = torch.tensor([t for s in sequences for t in s])
    ints = not (ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex())
    require(ints, f"pack_sequences: token ids must be ints, not {ids.dtype}", TypeError)
    ids = ids.long()
    require(ids.min() >= 0, f"pack_sequences: negative token id {int(ids.min())}")
    w = _finite([x for row in weights for x in row], "weights")
    lp = None if log_probs is None else _finite([x for row in log_probs for x in row], "log_probs")
    r = None if rewards is None else _finite([float(x) for x in rewards], "rewards")
    m = None if loss_masks is None else torch.tensor([bool(x) for row in loss_masks for x in row])

    lengths = torch.tensor([len(s) for s in sequences])
    cu = torch.zeros(n + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    position_ids = torch.arange(ids.numel()) - torch.repeat_interleave(cu[:-1].long(), lengths)
    last = torch.zeros(ids.numel(), dtype=torch.bool)
    last[cu[1:].long() - 1] = True

    def shift(x):
        # row j gets element j+1 of its own sequence; a sequence's last row gets 0
        out = torch.zeros_like(x)
        out[:-1] = x[1:]
        return out.masked_fill(last, 0)
    return PackedBatch(tokens=ids, labels=shift(ids), position_ids=position_ids, cu_seqlens=cu,
                       token_weights=shift(w), log_probs=None if lp is None else shift(lp),
                       rewards=r, loss_mask=None if m is None else shift(m))


def pack_groups(prompts, completions, weights, log_probs=None, loss_masks=None):
    """Pack groups of completions that share a prompt (GRPO's G samples of one prompt)
    with each prompt once: the prompt's rows are computed once and every completion
    attends to them, so a group costs P - 1 + sum(len(completion) + 1) rows instead of
    sum(P + len(completion)), for the same logprobs.

    prompts[i]: token ids; completions[i]: its completions' ids; weights[i], log_probs[i]
    and loss_masks[i]: one list per completion, aligned with its tokens. Document i is
    branch 0, the prompt but its last token, then for every completion b = 1, 2, ...
    branch b: the prompt's last token again and the completion, at the positions it has
    after the prompt. A row attends to the rows before it in its document on branch 0 or
    on its own branch (model.py). The router's balancing loss sees each prompt once. On
    CPU a document's mask is dense (its L^2 scores), so with long completions plain
    packing may be faster. Prompt [5, 6, 7], completions [8, 9], [4]:
        tokens    5  6 | 7  8  9 | 7  4
        branch    0  0 | 1  1  1 | 2  2
        position  0  1 | 2  3  4 | 2  3
        labels    6* 7*| 8  9  7*| 4  0*     (* weight 0: a prompt token, or a placeholder)"""
    check_aligned("pack_groups:", len(prompts), "prompts", {
        "completion lists": completions, "weight lists": weights,
        "log_probs lists": log_probs, "loss_masks lists": loss_masks})
    docs, doc_weights, doc_logprobs, doc_masks, positions, branch = [], [], [], [], [], []
    for i, (prompt, comps) in enumerate(zip(prompts, completions)):
        lps = [[0.0] * len(c) for c in comps] if log_probs is None else log_probs[i]
        masks = [[1] * len(c) for c in comps] if loss_masks is None else loss_masks[i]
        require(len(prompt) > 0, f"pack_groups: prompt {i} is empty")
        check_aligned(f"pack_groups: group {i} has", len(comps), "completions", {
            "weight lists": weights[i], "log_probs lists": lps, "loss_mask lists": masks})
        n = len(prompt) - 1
        docs.append(list(prompt[:-1]))
        doc_weights.append([0.0] * n)
        doc_logprobs.append([0.0] * n)
        doc_masks.append([0] * n)
        positions += range(n)
        branch += [0] * n
        for b, (comp, w, lp, m) in enumerate(zip(comps, weights[i], lps, masks), start=1):
            check_aligned(f"pack_groups: group {i} completion {b - 1} has", len(comp), "tokens",
                          {"weights": w, "log_probs": lp, "loss_mask values": m})
            docs[-1] += [prompt[-1], *comp]
            doc_weights[-1] += [0.0, *w]
            doc_logprobs[-1] += [0.0, *lp]
            doc_masks[-1] += [0, *m]
            positions += range(n, n + len(comp) + 1)
            branch += [b] * (len(comp) + 1)
    packed = pack_sequences(docs, doc_weights, None if log_probs is None else doc_logprobs,
                            loss_masks=None if loss_masks is None else doc_masks)
    return replace(packed, position_ids=torch.tensor(positions),
                   branch=torch.tensor(branch))


def check_aligned(where, n, noun, lists):
    """A ValueError unless each list in lists (name -> a list, or None: not given) has n
    items: check_aligned("group 0 has", 2, "completions", {"weight lists": [[1.0]]})
    raises 'group 0 has 2 completions but 1 weight lists'."""
    for name, rows in lists.items():
        if rows is not None and len(rows) != n:
            raise ValueError(f"{where} {n} {noun} but {len(rows)} {name}")


def _finite(values, name):
    t = torch.tensor(values, dtype=torch.float32)
    require(torch.isfinite(t).all(), f"pack_sequences: {name} must be finite")
    return t


def split_under_budget(lengths, max_tokens):
    """Sequence indices, in order, split greedily into consecutive runs of at most
    max_tokens tokens each: [3, 4, 2, 5, 1] under 7 -> [[0, 1], [2, 3], [4]]."""
    runs, run, total = [], [], 0
    for i, n in enumerate(lengths):
        require(n <= max_tokens, f"sequence {i} has {n} tokens, over the budget of {max_tokens}")
        if total + n > max_tokens:
            runs.append(run)
            run, total = [], 0
        run.append(i)
        total += n
    if run:
        runs.append(run)
    return runs


def fixed_batches(sequences, weights, max_tokens):
    """The sequences packed in order under a token budget: an evaluation set's batches."""
    return [pack_sequences([sequences[i] for i in g], [weights[i] for i in g])
            for g in split_under_budget([len(s) for s in sequences], max_tokens)]


class EpochCursor:
    """Endless passes over a fixed list of items, in a new order every epoch.

    Each epoch's order is a permutation fixed by (seed, epoch), so the position (epoch,
    cursor) is the whole data state: a resumed run continues with exactly the items the
    killed one would have seen."""

    def __init__(self, items, seed):
        self.items, self.seed = items, seed
        self.epoch, self.cursor = 0, 0
        self._order_epoch, self._order = None, None

    def peek(self):
        """The next item, not taken yet (a finished epoch rolls over to the next one
        here)."""
        if self.cursor == len(self.items):
            self.epoch, self.cursor = self.epoch + 1, 0
        if self._order_epoch != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._order = rng.permutation(len(self.items)).tolist()
            self._order_epoch = self.epoch
        return self.items[self._order[self.cursor]]

    def take(self, n):
        out = []
        for _ in range(n):
            out.append(self.peek())
            self.cursor += 1
        return out

    def state_dict(self):
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state):
        n = len(self.items)
        ok = (isinstance(state, dict) and set(state) == {"epoch", "cursor"}
              and all(type(v) is int and v >= 0 for v in state.values())
              and state["cursor"] <= n)
        require(ok, f"{type(self).__name__}: bad data state {state!r} for {n} items")
        self.epoch, self.cursor = state["epoch"], state["cursor"]


class PackedLoader(EpochCursor):
    """Endless shuffled batches of at most batch_tokens tokens from a fixed list of
    (ids, weights) examples."""

    def __init__(self, sequences, weights, batch_tokens, seed):
        require(len(sequences) > 0, "PackedLoader: no sequences")
        check_aligned("PackedLoader:", len(sequences), "sequences", {"weight lists": weights})
        # refuses a sequence over the budget
        split_under_budget([len(s) for s in sequences], batch_tokens)
        super().__init__(list(zip(sequences, weights)), seed)
        self.batch_tokens = batch_tokens

    def next_batch(self):
        picked, total = [], 0
        while total + len(self.peek()[0]) <= self.batch_tokens:
            picked += self.take(1)
            total += len(picked[-1][0])
        return pack_sequences([ids for ids, _ in picked], [w for _, w in picked])


# -----------------------------------------------------------------------------
# optimizer, schedule, one step, and its cost (FLOPs against this machine's
# matmul rate: MFU)


def configure_optimizer(model, learning_rate, weight_decay, betas, device_type):
    """AdamW; weight decay only on matrices (linear weights, experts, router), never on
    norms, biases or the embedding (decaying a tied embedding would also shrink rare
    tokens' rows that get no gradient)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=tuple(betas),
                             fused=device_type == "cuda")


def get_lr(it, learning_rate, min_lr, warmup_iters, lr_decay_iters):
    """Linear warmup for warmup_iters, cosine decay to min_lr at lr_decay_iters, then
    min_lr."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it >= lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def scheduled_lr(config, it):
    """get_lr with a run's settings (lr_decay_iters=0 means max_iters)."""
    return get_lr(it, config["learning_rate"], config["min_lr"], config["warmup_iters"],
                  config["lr_decay_iters"] or config["max_iters"])


def train_step(model, optimizer, batches, lr, grad_clip=1.0, aux_loss_coef=0.0, autocast=None,
               normalizer=None, loss_fn=unified_loss, temperature=1.0):
    """One optimizer step of loss_fn(log p(labels) [T], batch, normalizer) (unified_loss
    unless a trainer passes its own objective; log p at temperature: GRPO scores the
    distribution its engine sampled) over one or more micro-batches (already
    on the model's device). They share one normalizer (by default the sum of |weights|
    over all of them), so the step is the same as one big batch; the router's
    load-balancing loss (mean over micro-batches) is added with its coefficient. Returns
    metrics. Under torchrun, batches are this rank's share and model is DDP-wrapped:
    normalizer, aux mean and metrics are over every rank's micro-batches and the
    gradients summed (DDP averages: each loss is taken world() times), so N ranks step
    as one process would on all of them. A rank with no micro-batch joins with a
    zero-weight one. Batches that carry the sampler's log_probs (GRPO) also give
    train/logprob_mismatch, the mean |sampler - trainer logprob| over the rows with a
    weight, from this forward, on the weights before the step, and offpolicy/kl_k3, the
    k3 estimate of KL(sampler || trainer) over them (the tokens the loss weighs: those
    masked IS dropped are not in it)."""
    if isinstance(batches, PackedBatch):
        batches = [batches]
    device = next(p.device for g in optimizer.param_groups for p in g["params"])
    weight_sum, count = distributed.all_sum([sum(b.token_weights.abs().sum().item()
                                                 for b in batches), len(batches)])
    normalizer = max(weight_sum, 1.0) if normalizer is None else normalizer
    for group in optimizer.param_groups:
        group["lr"] = lr
    # a rank with no micro-batch joins with one of zero weight (DDP's all-reduce), and
    # under FSDP2 each rank with as many as the rank with the most
    passes = distributed.padded(batches, lambda: empty_batch(device)) or [empty_batch(device)]
    loss_sum, aux_sum, diff, kl, scored = 0.0, 0.0, 0.0, 0.0, 0
    for i, b in enumerate(passes):
        with distributed.no_sync(last=i == len(passes) - 1):
            with autocast or nullcontext():
                logp, aux = batch_logprobs(model, b, temperature=temperature)
            loss = loss_fn(logp, b, normalizer)
            aux = aux.float() * (i < len(batches)) / max(count, 1)
            ((loss + aux_loss_coef * aux) * distributed.world()).backward()
        loss_sum += loss.item()
        aux_sum += aux.item()
        # the sampler's logprobs against these, on the rows the loss weighs
        if b.log_probs is not None:
            weighed = b.token_weights != 0
            diff += (logp.detach().float() - b.log_probs).abs()[weighed].sum().item()
            kl += kl_k3(logp.detach().float(), b.log_probs, weighed)
            scored += int(weighed.sum())
    grad_norm = torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups
                                                for p in g["params"]],
                                               grad_clip if grad_clip > 0 else float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss_sum, aux_sum, tokens, diff, kl, scored = distributed.all_sum(
        [loss_sum, aux_sum, sum(b.num_tokens for b in batches), diff, kl, scored])
    metrics = {"train/loss": loss_sum, "train/aux_loss": aux_sum,
               "train/grad_norm": float(grad_norm), "train/lr": lr, "train/tokens": int(tokens),
               "train/weight_sum": weight_sum}
    if scored:
        metrics["train/logprob_mismatch"] = diff / scored
        metrics["offpolicy/kl_k3"] = kl / scored
    return metrics


def empty_batch(device):
    """A batch of zero weight with every field a loss may read: what a rank runs when it
    has no share of the work but must join the collectives."""
    return pack_sequences([[0, 0]], [[0.0, 0.0]], log_probs=[[0.0, 0.0]],
                          loss_masks=[[0, 0]]).to(device)


@torch.no_grad()
def evaluate_loss(model, batches, device):
    """unified_loss over fixed batches, normalised over all of them together (run it under
    the autocast); under torchrun each rank scores its share of the batches and the sums
    are added up."""
    total, norm = 0.0, 0.0
    for b in distributed.padded(distributed.shard(batches), lambda: empty_batch(device)):
        b = b.to(device)
        logp, _ = batch_logprobs(model, b)
        total += unified_loss(logp, b, normalizer=1.0).item()
        norm += b.token_weights.abs().sum().item()
    total, norm = distributed.all_sum([total, norm])
    return total / max(norm, 1.0)


# -----------------------------------------------------------------------------
# what a run spends and where its metrics go

_MATMUL_RATE = {}


def measure_matmul_flops(device="cpu", dtype=torch.float32):
    """FLOP/s of a square matmul on this machine, timed once per process (the MFU
    denominator)."""
    key = (str(device), dtype)
    if key not in _MATMUL_RATE:
        _MATMUL_RATE[key] = matmul_flops_now(device, dtype)
    return _MATMUL_RATE[key]


def matmul_flops_now(device="cpu", dtype=torch.float32):
    """FLOP/s of a square matmul, timed now (at least 0.2 s of them). Uses its own
    generator, so measuring never shifts the training RNG."""
    n = 4096 if torch.device(device).type == "cuda" else 1024
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(device, dtype) for _ in range(2))
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    (a @ b, sync())
    reps, t0 = 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - t0 < 0.2:
        a @ b
        reps += 1
    sync()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


class Logger:
    """One JSON object per log call in {out_dir}/metrics.jsonl ({"iter": ..., metrics}),
    and wandb when asked. A resumed run first drops the lines after its checkpoint's
    iteration (the killed run may have logged past it), so the file reads as one
    uninterrupted run; a fresh run (resume_iter None) starts an empty file."""

    def __init__(self, out_dir, config, resume_iter=None):
        self.file = self.wandb = None
        if not distributed.is_main():   # rank 0 alone writes
            return
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, "metrics.jsonl")
        kept = []
        if resume_iter is not None and os.path.exists(self.path):
            with open(self.path) as f:
                for line in f:
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line cut short by the kill
                    if row.get("iter", math.inf) <= resume_iter:
                        kept.append(line if line.endswith("\n") else line + "\n")
        with open(self.path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(self.path + ".tmp", self.path)
        self.file = open(self.path, "a")
        if config.get("wandb_log"):
            # only when asked: it is slow to import; offline unless
            # WANDB_MODE says otherwise
            import wandb
            self.wandb = wandb.init(project=config["wandb_project"],
                                    name=config.get("wandb_run_name") or None, config=config,
                                    dir=out_dir, mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, iter_num, metrics):
        if self.file is None:
            return
        metrics = {k: float(v) for k, v in metrics.items()}
        self.file.write(json.dumps({"iter": iter_num, **metrics}) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=iter_num)

    def close(self):
        if self.file is not None:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


class Meter:
    """What a run has spent: FLOPs (training steps, plus any sampling the caller adds) and
    seconds of training (evaluation excluded), kept in every checkpoint; max_flops > 0
    ends a run once spent (compute-matched arms)."""

    def __init__(self, start, flops=0.0):
        state = start.run_state.meter or {"flops": flops, "seconds": 0.0}
        self.flops, self.seconds = float(state["flops"]), float(state["seconds"])

    def add(self, flops, seconds):
        self.flops, self.seconds = self.flops + flops, self.seconds + seconds
        return {"perf/flops_total": self.flops, "perf/elapsed_s": self.seconds}

    def state_dict(self):
        return {"flops": self.flops, "seconds": self.seconds}


# -----------------------------------------------------------------------------
# the run: its log, the one setup every trainer shares, and the loop of a fixed
# dataset (pretrain, sft)


def precision(config):
    """(device_type, autocast context) for config's device and dtype; bf16 is autocast
    over fp32 weights."""
    device_type = torch.device(config["device"]).type
    # float16 would need a grad scaler, which these loops do not have
    dtype = config["dtype"]
    require(dtype in ("float32", "bfloat16"), f"dtype={dtype!r}: expected 'float32' or 'bfloat16'")
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if dtype == "float32":
        return device_type, nullcontext()
    return device_type, torch.autocast(device_type=device_type, dtype=torch.bfloat16)


@dataclass(frozen=True)
class Run:
    """A run ready for its first step, built once by setup_run."""
    model: Transformer       # fp32 master weights, on the device
    forward: object          # the model, or its compiled self: what the steps call
    optimizer: torch.optim.Optimizer
    autocast: object         # the precision context of every forward
    device_type: str
    logger: Logger
    peak_flops: float        # the matmul rate: the MFU denominator
    start: Start             # where it came from: tokenizer, iter_num, a resumed checkpoint's meta


def setup_run(config, start, data):
    """Everything between a Start and the first step, in the one order every trainer
    shares (it fixes the RNG stream): seeds, precision, the model on its device
    (compiled when asked), AdamW; on resume the optimizer, the data position
    (data.load_state_dict) and the RNG states; the log; the matmul rate."""
    random.seed(config["seed"])
    np.random.seed(config["seed"])
    torch.manual_seed(config["seed"])
    device_type, autocast = precision(config)
    model = start.model.to(config["device"])
    # DDP under torchrun, or the model sharded in place (fsdp)
    forward = distributed.wrap(model, config["device"], config.get("fsdp", False),
                               bf16=config["dtype"] == "bfloat16")
    forward = torch.compile(forward) if config["compile"] else forward
    optimizer = configure_optimizer(model, config["learning_rate"], config["weight_decay"],
                                    (config["beta1"], config["beta2"]), device_type)
    if start.meta is not None:
        load_optimizer(model, optimizer, start)
        data.load_state_dict(start.meta["data_state"])
        set_rng_state(start.trainer_state["rng"])
    elif distributed.is_main():
        # a later init_from='resume' must find this run's checkpoint, never an earlier's
        removed = clear_checkpoints(config["out_dir"])
        if removed:
            print0(
                f"fresh start in {config['out_dir']}: removed an earlier run's {', '.join(removed)}"
            )
    logger = Logger(config["out_dir"], config,
                    resume_iter=None if start.meta is None else start.iter_num)
    peak = measure_matmul_flops(config["device"],
                                torch.float32 if config["dtype"] == "float32" else torch.bfloat16)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print0(f"{model.num_params() / 1e6:.2f}M parameters ({model.num_active_params() / 1e6:.2f}M "
           f"active, {trained / 1e6:.3f}M trained), from {start.source}, iter {start.iter_num} -> "
           f"{config['max_iters']}, matmul peak {peak / 1e9:.1f} GFLOP/s")
    return Run(model, forward, optimizer, autocast, device_type, logger, peak, start)


def check_loop_settings(config):
    """The settings every training loop reads, each refused with a ValueError naming it
    before any work (those of them that config has: GRPO has no grad_accum)."""
    for name, low in (("max_iters", 0), ("warmup_iters", 0), ("lr_decay_iters", 0),
                      ("grad_accum", 1), ("batch_tokens", 1), ("log_interval", 1),
                      ("eval_interval", 1), ("ckpt_interval", 1)):
        value = config.get(name, low)
        require(type(value) is int and value >= low, f"{name}={value!r}: expected an int >= {low}")
    # each rank takes its share of every step
    accum, ranks = config.get("grad_accum", 0), distributed.world()
    require(accum % ranks == 0, f"grad_accum={accum}: expected a multiple of the {ranks} ranks")
    lr, min_lr = config["learning_rate"], config["min_lr"]
    require(is_finite_number(lr) and lr > 0, f"learning_rate={lr!r}: expected a finite number > 0")
    require(is_finite_number(min_lr) and 0 <= min_lr <= lr, f"min_lr={min_lr!r}: not in [0, {lr}]")
    for name in ("weight_decay", "grad_clip", "aux_loss_coef", "max_flops"):
        value = config.get(name, 0)
        require(is_finite_number(value) and value >= 0, f"{name}={value!r}: expected a number >= 0")
    lora.spec_of(config)   # lora_rank, lora_alpha, lora_targets
    fsdp = config.get("fsdp", False)
    require(not fsdp or distributed.world() > 1,
            "fsdp=True outside torchrun (or with one rank): sharding needs ranks "
            "(torchrun --nproc_per_node=N, N >= 2)")


def due(config, interval, done, last):
    """Whether the iteration that makes `done` logs / evaluates / checkpoints: every
    config[interval], and last."""
    return done % config[interval] == 0 or last


def train(config, start, loader, eval_fn=None, spent_flops=0.0):
    """Train start.model on loader's batches per config, for max_iters steps or until
    max_flops are spent (with spent_flops already counted); eval_fn(model) -> metrics
    every eval_interval and at the end. Checkpoints every ckpt_interval and at the end.
    Returns the last evaluation's metrics."""
    check_loop_settings(config)
    run = setup_run(config, start, loader)
    meter, final = Meter(run.start, spent_flops), {}
    for it in range(run.start.iter_num, config["max_iters"]):
        t0 = time.perf_counter()
        # every rank reads the whole step
        batches = [loader.next_batch() for _ in range(config["grad_accum"])]
        # ... and trains on its share
        mine = [b.to(config["device"]) for b in distributed.shard(batches)]
        metrics = train_step(run.forward, run.optimizer, mine, scheduled_lr(config, it),
                             config["grad_clip"], config["aux_loss_coef"], run.autocast)
        if run.device_type == "cuda":
            torch.cuda.synchronize()
        seconds, done = time.perf_counter() - t0, it + 1
        frozen = lora.has_adapters(run.model)
        flops = sum(train_flops(run.model.config, b.seqlens(), frozen=frozen) for b in batches)
        metrics.update(meter.add(flops, seconds))
        last = done == config["max_iters"] or 0 < config.get("max_flops", 0) <= meter.flops
        if due(config, "log_interval", done, last):
            metrics.update({"perf/step_time_s": seconds,
                            "perf/tokens_per_sec": metrics["train/tokens"] / seconds,
                            "perf/mfu": flops / seconds / run.peak_flops})
            run.logger.log(done, metrics)
            print0(f"iter {done}: loss {metrics['train/loss']:.4f}, "
                   f"aux {metrics['train/aux_loss']:.3f}, lr {metrics['train/lr']:.2e}, "
                   f"{seconds * 1000:.0f} ms, {metrics['perf/tokens_per_sec']:.0f} tok/s, "
                   f"mfu {100 * metrics['perf/mfu']:.1f}%")
        if eval_fn is not None and due(config, "eval_interval", done, last):
            final = _evaluate(run, done, eval_fn, {"perf/elapsed_s": meter.seconds})
        if due(config, "ckpt_interval", done, last):
            save(run, config, done, loader.state_dict(), RunState(meter=meter.state_dict()))
        if last:
            break
    run.logger.close()
    return final


def save(run, config, done, data_state, state):
    """{out_dir}/ckpt (checkpoint.save_checkpoint) with the run's RunState, written by rank
    0: under DDP from its parameters, checked equal to every rank's first; from a sharded
    model's, gathered."""
    distributed.check_in_sync(run.model)
    save_checkpoint(config["out_dir"], run.model, run.optimizer, run.start.tokenizer, done,
                    config, data_state, extra=state, generation=run.start.generation)


def _evaluate(run, done, fn, extra):
    # fn(model) in eval mode under the run's precision, then logged (with extra) and printed
    run.model.eval()
    with run.autocast:
        metrics = fn(run.model)
    run.model.train()
    run.logger.log(done, {**metrics, **extra})
    print0(f"eval iter {done}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return metrics
