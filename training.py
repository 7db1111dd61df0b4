"""
What the three trainers share: one batch contract, one loss, packing, the optimizer and its schedule, one
optimizer step, checkpoints, logging, and the plain loop that pretrain.py and sft.py run.

    batch = pack_sequences([ids_a, ids_b], [weights_a, weights_b])     # a PackedBatch: no padding
    logits, aux = model(batch.tokens, batch.position_ids, batch.cu_seqlens)
    loss = unified_loss(logits, batch)                                   # the one loss

The data sources differ only in the per-token weights they hand to pack_sequences, never in the step:
    pretrain   1 on every token
    SFT        the chat loss mask (1 on the assistant reply and its closing <|im_end|>)
    GRPO       advantage x completion mask (an importance-ratio correction or any other per-token, no-grad
               factor is folded into the weight too)
train_grpo.py builds its own PackedBatches with pack_sequences and calls train_step, save_checkpoint, Logger
and friends; only `train` (the loop at the bottom) is specific to a fixed dataset.
"""

import json
import math
import os
import random
import shutil
import time
from contextlib import nullcontext
from dataclasses import dataclass, fields

import numpy as np
import torch
import xxhash

from configurator import print0
from model import ModelConfig, Transformer, load_hf_checkpoint, save_hf_checkpoint
from tokenizer import load_tokenizer, save_tokenizer

# -----------------------------------------------------------------------------
# the batch contract


@dataclass(frozen=True)
class PackedBatch:
    """N sequences laid end to end in one row of T tokens. Everything per token is aligned with `labels`:
    row j of a sequence reads tokens[j] and is scored on predicting labels[j] = the sequence's next token."""
    tokens: torch.Tensor          # [T] int64, the inputs
    labels: torch.Tensor          # [T] int64, next token within the sequence (0 on each sequence's last row)
    position_ids: torch.Tensor    # [T] int64, restarting at 0 for every sequence
    cu_seqlens: torch.Tensor      # [N+1] int32, sequence i is rows cu_seqlens[i]:cu_seqlens[i+1]
    token_weights: torch.Tensor   # [T] float32, the weight of each row's log-likelihood (0 on last rows)
    log_probs: torch.Tensor | None = None   # [T] float32, the sampler's logprob of each label (GRPO)
    rewards: torch.Tensor | None = None     # [N] float32, one per sequence (GRPO)

    @property
    def num_tokens(self):
        return self.tokens.numel()

    @property
    def num_seqs(self):
        return self.cu_seqlens.numel() - 1

    def seqlens(self):
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    def to(self, device):
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        return PackedBatch(**{k: None if v is None else v.to(device, non_blocking=True) for k, v in moved.items()})


# -----------------------------------------------------------------------------
# the loss


def token_logprobs(logits, labels):
    """log p(label) per row, in fp32 with log_softmax + gather (never log(softmax)): [T, V], [T] -> [T].
    The same quantity the engine reports as a sample's logprob at temperature 1."""
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"logits [T, V] and labels [T] expected, got {tuple(logits.shape)} and {tuple(labels.shape)}")
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)


def unified_loss(logits, batch, normalizer=None):
    """-(token_weights * log p(labels)).sum() / normalizer, the one loss of all three trainers.

    The default normalizer is token_weights.abs().sum().clamp(min=1), which means:
      pretrain  weights 1         -> the mean next-token NLL (== F.cross_entropy's mean)
      SFT       weights 0/1 mask  -> the mean NLL over assistant tokens (== cross_entropy with ignore_index)
      GRPO      advantage x mask  -> sum_t A_t * (-log p_t) / sum_t |A_t|: a weighted mean whose size does not
                                     depend on the scale of the advantages (note the clamp: when sum |A| < 1
                                     the denominator is 1)
    RL variants that want a constant denominator (e.g. Dr. GRPO's num_sequences * max_tokens) pass it as
    `normalizer` (a number or a 0-dim tensor); train_step passes the whole step's sum over micro-batches.
    The weights are treated as constants (no gradient flows into them)."""
    if logits.shape[0] != batch.num_tokens:
        raise ValueError(f"logits have {logits.shape[0]} rows but the batch has {batch.num_tokens} tokens")
    logp = token_logprobs(logits, batch.labels)
    w = batch.token_weights.detach().to(logp.dtype)
    if normalizer is None:
        normalizer = w.abs().sum().clamp(min=1)
    return -(w * logp).sum() / normalizer


# -----------------------------------------------------------------------------
# packing


def pack_sequences(sequences, weights, log_probs=None, rewards=None):
    """Pack variable-length sequences into one PackedBatch (no padding).

    sequences: token-id lists. weights: same shapes; weights[i][t] weighs predicting sequences[i][t] from the
    tokens before it, so weights[i][0] is never used (nothing predicts a first token). log_probs: optional, same
    shapes and alignment as weights (the sampler's logprob of token t; put 0 where it did not sample).
    rewards: optional, one float per sequence.
    In the batch each sequence's row j reads token j and is labelled with token j+1 carrying weights[i][j+1];
    its last row has nothing to predict: label 0 (a placeholder), weight 0."""
    if len(sequences) == 0:
        raise ValueError("pack_sequences: no sequences")
    if len(weights) != len(sequences):
        raise ValueError(f"pack_sequences: {len(sequences)} sequences but {len(weights)} weight lists")
    if log_probs is not None and len(log_probs) != len(sequences):
        raise ValueError(f"pack_sequences: {len(sequences)} sequences but {len(log_probs)} log_probs lists")
    if rewards is not None and len(rewards) != len(sequences):
        raise ValueError(f"pack_sequences: {len(sequences)} sequences but {len(rewards)} rewards")
    for i, seq in enumerate(sequences):
        if len(seq) == 0:
            raise ValueError(f"pack_sequences: sequence {i} is empty")
        if len(weights[i]) != len(seq):
            raise ValueError(f"pack_sequences: sequence {i} has {len(seq)} tokens but {len(weights[i])} weights")
        if log_probs is not None and len(log_probs[i]) != len(seq):
            raise ValueError(f"pack_sequences: sequence {i} has {len(seq)} tokens but {len(log_probs[i])} log_probs")
    lengths = [len(s) for s in sequences]
    ids = torch.tensor([t for s in sequences for t in s])          # dtype inferred: floats / bools show up
    if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise TypeError(f"pack_sequences: token ids must be ints, got {ids.dtype} values")
    ids = ids.long()
    if ids.min() < 0:
        raise ValueError(f"pack_sequences: negative token id {int(ids.min())}")
    w = torch.tensor([x for ws in weights for x in ws], dtype=torch.float32)
    if not torch.isfinite(w).all():
        raise ValueError("pack_sequences: weights must be finite")
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    starts = torch.repeat_interleave(cu[:-1].long(), torch.tensor(lengths))
    position_ids = torch.arange(ids.numel()) - starts
    last = torch.zeros(ids.numel(), dtype=torch.bool)
    last[cu[1:].long() - 1] = True

    def shift(x):  # row j gets element j+1 of its own sequence; last rows get 0
        out = torch.zeros_like(x)
        out[:-1] = x[1:]
        return out.masked_fill(last, 0)

    lp = None
    if log_probs is not None:
        lp = torch.tensor([x for l in log_probs for x in l], dtype=torch.float32)
        if not torch.isfinite(lp).all():
            raise ValueError("pack_sequences: log_probs must be finite")
        lp = shift(lp)
    r = None if rewards is None else torch.tensor([float(x) for x in rewards], dtype=torch.float32)
    if r is not None and not torch.isfinite(r).all():
        raise ValueError("pack_sequences: rewards must be finite")
    return PackedBatch(tokens=ids, labels=shift(ids), position_ids=position_ids, cu_seqlens=cu,
                       token_weights=shift(w), log_probs=lp, rewards=r)


def budget_groups(lengths, max_tokens):
    """Split sequence indices, in order, into consecutive groups of at most max_tokens tokens each (greedy)."""
    groups, group, total = [], [], 0
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ValueError(f"sequence {i} has {n} tokens, more than the budget of {max_tokens}")
        if total + n > max_tokens:
            groups.append(group)
            group, total = [], 0
        group.append(i)
        total += n
    if group:
        groups.append(group)
    return groups


def fixed_batches(sequences, weights, max_tokens):
    """The sequences packed in order under a token budget: an evaluation set's batches."""
    return [pack_sequences([sequences[i] for i in g], [weights[i] for i in g])
            for g in budget_groups([len(s) for s in sequences], max_tokens)]


class PackedLoader:
    """Endless shuffled batches of at most batch_tokens tokens from a fixed list of (ids, weights) examples.

    Each epoch is a permutation fixed by (seed, epoch), so the position (epoch, cursor) is the whole data
    state: a resumed run continues with exactly the batches the killed one would have seen."""

    def __init__(self, sequences, weights, batch_tokens, seed):
        if len(sequences) == 0 or len(sequences) != len(weights):
            raise ValueError(f"PackedLoader: need a non-empty list of sequences with one weight list each, got "
                             f"{len(sequences)} sequences and {len(weights)} weight lists")
        budget_groups([len(s) for s in sequences], batch_tokens)  # refuses a sequence over the budget
        self.sequences, self.weights = sequences, weights
        self.batch_tokens, self.seed = batch_tokens, seed
        self.epoch, self.cursor = 0, 0
        self._order_epoch, self._order = None, None

    def order(self, epoch):
        if self._order_epoch != epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.sequences)).tolist()
            self._order_epoch = epoch
        return self._order

    def next_batch(self):
        picked, total = [], 0
        while True:
            if self.cursor == len(self.sequences):
                self.epoch, self.cursor = self.epoch + 1, 0
            i = self.order(self.epoch)[self.cursor]
            if total + len(self.sequences[i]) > self.batch_tokens:
                break
            picked.append(i)
            total += len(self.sequences[i])
            self.cursor += 1
        return pack_sequences([self.sequences[i] for i in picked], [self.weights[i] for i in picked])

    def state_dict(self):
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state):
        if (not isinstance(state, dict) or set(state) != {"epoch", "cursor"}
                or not all(type(v) is int and v >= 0 for v in state.values()) or state["cursor"] > len(self.sequences)):
            raise ValueError(f"PackedLoader: bad data state {state!r} for {len(self.sequences)} sequences")
        self.epoch, self.cursor = state["epoch"], state["cursor"]


# -----------------------------------------------------------------------------
# optimizer, schedule, one step


def configure_optimizer(model, learning_rate, weight_decay, betas, device_type):
    """AdamW; weight decay only on matrices (linear weights, experts, router), never on norms, biases or the
    embedding (decaying a tied embedding would also shrink rare tokens' rows that get no gradient)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=tuple(betas), fused=device_type == "cuda")


def get_lr(it, learning_rate, min_lr, warmup_iters, lr_decay_iters):
    """Linear warmup for warmup_iters, cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it >= lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def train_step(model, optimizer, batches, lr, grad_clip=1.0, aux_loss_coef=0.0, autocast=None, normalizer=None):
    """One optimizer step over one or more micro-batches (already on the model's device).

    The micro-batches share one normalizer (by default the sum of |weights| over all of them), so the step is
    the same as one big batch. The router's load-balancing loss (mean over micro-batches) is added with its
    coefficient. Returns the step's metrics as floats."""
    if isinstance(batches, PackedBatch):
        batches = [batches]
    if normalizer is None:
        normalizer = sum(b.token_weights.abs().sum() for b in batches).clamp(min=1)
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss_sum, aux_sum = 0.0, 0.0
    for b in batches:
        with autocast or nullcontext():
            logits, aux = model(b.tokens, b.position_ids, b.cu_seqlens)
        loss = unified_loss(logits, b, normalizer)
        aux = aux.float() / len(batches)
        (loss + aux_loss_coef * aux).backward()
        loss_sum += loss.item()
        aux_sum += aux.item()
    grad_norm = torch.nn.utils.clip_grad_norm_(
        [p for g in optimizer.param_groups for p in g["params"]], grad_clip if grad_clip > 0 else float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"train/loss": loss_sum, "train/aux_loss": aux_sum, "train/grad_norm": float(grad_norm),
            "train/lr": lr, "train/tokens": sum(b.num_tokens for b in batches),
            "train/weight_sum": float(sum(b.token_weights.abs().sum() for b in batches))}


@torch.no_grad()
def evaluate_loss(model, batches, device):
    """unified_loss over fixed batches, normalised over all of them together (run it under the autocast)."""
    total, norm = 0.0, 0.0
    for b in batches:
        b = b.to(device)
        logits, _ = model(b.tokens, b.position_ids, b.cu_seqlens)
        total += unified_loss(logits, b, normalizer=1.0).item()
        norm += b.token_weights.abs().sum().item()
    return total / max(norm, 1.0)


# -----------------------------------------------------------------------------
# perf: FLOPs of a step and the machine's measured matmul rate

_MATMUL_RATE = {}


def measure_matmul_flops(device="cpu", dtype=torch.float32):
    """FLOP/s of a square matmul on this machine, timed once per process (the MFU denominator).
    Uses its own generator, so measuring never shifts the training RNG."""
    key = (str(device), dtype)
    if key not in _MATMUL_RATE:
        n = 4096 if torch.device(device).type == "cuda" else 1024
        g = torch.Generator().manual_seed(0)
        a, b = (torch.randn(n, n, generator=g).to(device, dtype) for _ in range(2))
        sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
        a @ b
        sync()
        reps, t0 = 0, time.perf_counter()
        while reps < 3 or time.perf_counter() - t0 < 0.2:
            a @ b
            reps += 1
        sync()
        _MATMUL_RATE[key] = 2 * n ** 3 * reps / (time.perf_counter() - t0)
    return _MATMUL_RATE[key]


def train_flops(cfg: ModelConfig, seqlens):
    """FLOPs of one forward+backward over packed sequences of these lengths: 6 per active matmul weight per
    token (experts count top_k of E, the router and the head count, the embedding lookup doesn't) plus
    attention's QK^T and AV over the causal pairs within each sequence (3 x 4 x heads x head_dim per pair)."""
    H, D = cfg.hidden_size, cfg.head_dim
    per_token = cfg.vocab_size * H
    for i in range(cfg.num_hidden_layers):
        per_token += H * D * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
        if cfg.is_moe_layer(i):
            per_token += cfg.num_experts * H + cfg.num_experts_per_tok * 3 * H * cfg.moe_intermediate_size
        else:
            per_token += 3 * H * cfg.intermediate_size
    pairs = sum(n * (n + 1) // 2 for n in seqlens)
    return 6 * per_token * sum(seqlens) + 12 * cfg.num_hidden_layers * cfg.num_attention_heads * D * pairs


# -----------------------------------------------------------------------------
# checkpoints
#
# {out_dir}/ckpt is a complete transformers model directory (config.json, model.safetensors, the tokenizer)
# plus trainer_state.pt (optimizer, RNG states) and checkpoint.json (iteration, config, data state, and the size
# and xxh64 of every file, written last). It is built in ckpt.tmp and swapped in by two renames; a run killed
# between them leaves ckpt.old, which resume falls back to. The next stage's init_from is the out_dir itself.

CKPT, CKPT_TMP, CKPT_OLD = "ckpt", "ckpt.tmp", "ckpt.old"
META = "checkpoint.json"
TRAINER_STATE = "trainer_state.pt"


def _file_digest(path):
    h = xxhash.xxh64()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def rng_state():
    """python, numpy, torch (and CUDA) RNG states, in a form torch.load(weights_only=True) reads back."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": (kind, torch.from_numpy(keys.copy()), pos, has_gauss, gauss),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state):
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out_dir, model, optimizer, tokenizer, iter_num, config, data_state=None, extra=None):
    """Write {out_dir}/ckpt atomically (see above). data_state and extra must be JSON-serialisable."""
    final, tmp, old = (os.path.join(out_dir, n) for n in (CKPT, CKPT_TMP, CKPT_OLD))
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_hf_checkpoint(model, tmp)
    save_tokenizer(tokenizer, tmp)
    torch.save({"optimizer": optimizer.state_dict(), "rng": rng_state()}, os.path.join(tmp, TRAINER_STATE))
    files = {}
    for name in sorted(os.listdir(tmp)):
        path = os.path.join(tmp, name)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        files[name] = {"size": os.path.getsize(path), "xxh64": _file_digest(path)}
    meta = {"iter": iter_num, "config": config, "data_state": data_state, "extra": extra, "files": files}
    with open(os.path.join(tmp, META), "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if os.path.isdir(final):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(out_dir)           # the renames themselves reach the disk (a power cut, not just a kill)
    shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)   # POSIX: a directory's entries are made durable by fsyncing the directory
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def find_checkpoint(out_dir):
    """The checkpoint directory to resume from in out_dir (ckpt, else ckpt.old), or None."""
    for name in (CKPT, CKPT_OLD):
        path = os.path.join(out_dir, name)
        if os.path.isfile(os.path.join(path, META)):
            return path
    return None


def read_checkpoint_meta(path):
    """checkpoint.json of a checkpoint dir, after checking every file it lists is there, whole and unchanged."""
    meta_path = os.path.join(path, META)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        files, it = meta["files"], meta["iter"]
    except FileNotFoundError:
        raise ValueError(f"missing checkpoint: no {META} in {path!r}") from None
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"corrupt checkpoint {path!r}: unreadable {META} ({e!r})") from None
    if type(it) is not int or it < 0 or not isinstance(files, dict):
        raise ValueError(f"corrupt checkpoint {path!r}: bad {META} (iter={it!r})")
    for name, info in files.items():
        fpath = os.path.join(path, name)
        if not os.path.isfile(fpath):
            raise ValueError(f"corrupt checkpoint {path!r}: {name} is missing")
        if os.path.getsize(fpath) != info["size"] or _file_digest(fpath) != info["xxh64"]:
            raise ValueError(f"corrupt checkpoint {path!r}: {name} does not match its recorded size/xxh64 "
                             f"(truncated or modified)")
    return meta


def model_dir_of(path):
    """init_from=path accepts a previous stage's out_dir (its ckpt, or ckpt.old) or a transformers model dir."""
    if not isinstance(path, str) or not os.path.isdir(path):
        raise ValueError(f"init_from={path!r}: expected 'scratch', 'resume' or an existing directory")
    found = find_checkpoint(path)
    if found:
        return found
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    raise ValueError(f"init_from={path!r}: neither a run directory (no {CKPT}/{META}) nor a transformers model "
                     f"directory (no config.json)")


# -----------------------------------------------------------------------------
# run setup: seeds, precision, and where the model starts from


@dataclass(frozen=True)
class Start:
    """What a run starts from: the model (fp32 master weights, on cpu), its tokenizer, and when resuming the
    completed iteration count, the data state and the trainer state (optimizer + RNG) to restore."""
    model: Transformer
    tokenizer: object
    iter_num: int = 0
    data_state: dict | None = None
    trainer_state: dict | None = None
    source: str = "scratch"


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def precision(config):
    """(device_type, autocast context) for config's device and dtype; bf16 is autocast over fp32 weights."""
    device_type = torch.device(config["device"]).type
    if config["dtype"] not in ("float32", "bfloat16"):
        raise ValueError(f"dtype={config['dtype']!r}: use 'float32' or 'bfloat16' (float16 needs a grad scaler, "
                         f"which this loop does not have)")
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if config["dtype"] == "float32":
        return device_type, nullcontext()
    return device_type, torch.autocast(device_type=device_type, dtype=torch.bfloat16)


def _model_config(model_kw, tokenizer):
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(model_kw) - known)
    if unknown:
        raise ValueError(f"model: unknown ModelConfig field(s) {unknown}")
    kw = {"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
          "pad_token_id": tokenizer.pad_token_id, **model_kw}
    if kw["vocab_size"] < len(tokenizer):
        raise ValueError(f"model: vocab_size={kw['vocab_size']} is smaller than the tokenizer ({len(tokenizer)} ids)")
    try:
        return ModelConfig(**kw)
    except TypeError as e:
        raise TypeError(f"model: {e}") from None


def init_start(config, new_tokenizer):
    """Where the run starts, per config['init_from']:
      'scratch'   a fresh model shaped by config['model'] (vocab from new_tokenizer()), iteration 0
      'resume'    {out_dir}/ckpt: weights, optimizer, RNG, iteration, data state
      a path      a previous stage's out_dir or a transformers model dir: weights (and its tokenizer), iteration 0.
                  A transformers dir without a tokenizer gets new_tokenizer() if its vocabulary fits."""
    init_from = config["init_from"]
    if init_from == "scratch":
        tok = new_tokenizer()
        model_cfg = _model_config(config["model"], tok)
        torch.manual_seed(config["seed"])
        return Start(Transformer(model_cfg), tok)
    if init_from == "resume":
        path = find_checkpoint(config["out_dir"])
        if path is None:
            raise ValueError(f"init_from='resume': no checkpoint in out_dir={config['out_dir']!r} "
                             f"(expected {CKPT}/{META})")
        meta = read_checkpoint_meta(path)
        model = _load_model(path)
        state = _load_trainer_state(path)
        return Start(model, load_tokenizer(path), meta["iter"], meta["data_state"], state, source=path)
    path = model_dir_of(init_from)
    if os.path.isfile(os.path.join(path, META)):
        read_checkpoint_meta(path)
    model = _load_model(path)
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        tok = load_tokenizer(path)
    else:
        tok = new_tokenizer()
        if len(tok) > model.config.vocab_size:
            raise ValueError(f"init_from={init_from!r} has no tokenizer and its vocab_size={model.config.vocab_size} "
                             f"is smaller than the embedded tokenizer's {len(tok)} ids")
        print0(f"init_from={init_from!r} has no tokenizer: using the embedded one ({len(tok)} ids)")
    return Start(model, tok, source=path)


def _load_model(path):
    try:
        return load_hf_checkpoint(path, device="cpu", dtype=torch.float32)
    except FileNotFoundError as e:
        raise ValueError(f"missing checkpoint files in {path!r}: {e}") from None


def _load_trainer_state(path):
    try:
        state = torch.load(os.path.join(path, TRAINER_STATE), map_location="cpu", weights_only=True)
    except Exception as e:  # pickle/zip errors of all kinds mean one thing here
        raise ValueError(f"corrupt checkpoint {path!r}: cannot read {TRAINER_STATE} ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not {"optimizer", "rng"} <= set(state):
        raise ValueError(f"corrupt checkpoint {path!r}: {TRAINER_STATE} lacks optimizer/rng")
    return state


# -----------------------------------------------------------------------------
# logging: stdout, {out_dir}/metrics.jsonl, wandb


class Logger:
    """One JSON object per log call in {out_dir}/metrics.jsonl ({"iter": ..., metrics}), and wandb when asked.

    A resumed run first drops the lines after its checkpoint's iteration (the killed run may have logged past
    it), so the file reads as one uninterrupted run. A fresh run (resume_iter None) starts out_dir over: an empty
    metrics.jsonl and no checkpoint of an earlier run, so that a later init_from='resume' finds this run's or
    none (never the earlier run's, which it would silently continue)."""

    def __init__(self, out_dir, config, resume_iter=None):
        os.makedirs(out_dir, exist_ok=True)
        if resume_iter is None:
            stale = [n for n in (CKPT, CKPT_OLD, CKPT_TMP) if os.path.exists(os.path.join(out_dir, n))]
            for name in stale:
                shutil.rmtree(os.path.join(out_dir, name))
            if stale:
                print0(f"fresh start in {out_dir}: removed an earlier run's {', '.join(stale)}")
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
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)
        self.file = open(self.path, "a")
        self.wandb = None
        if config.get("wandb_log"):
            import wandb  # only when asked: it is slow to import
            # there is no network on these machines: offline unless WANDB_MODE says otherwise
            self.wandb = wandb.init(project=config["wandb_project"], name=config.get("wandb_run_name") or None,
                                    config=config, dir=out_dir, mode=os.environ.get("WANDB_MODE", "offline"))

    def log(self, iter_num, metrics):
        metrics = {k: float(v) for k, v in metrics.items()}
        self.file.write(json.dumps({"iter": iter_num, **metrics}) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=iter_num)

    def close(self):
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


# -----------------------------------------------------------------------------
# the loop of pretrain.py and sft.py: a fixed dataset, one PackedLoader


def check_loop_settings(c):
    """The settings every training loop reads, refused with a ValueError naming the value before any work (those
    of them that config c has: GRPO has no grad_accum)."""
    def number(name):
        v = c[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name}={v!r}: expected a finite number")
        return v
    for name, low in (("max_iters", 0), ("warmup_iters", 0), ("lr_decay_iters", 0), ("grad_accum", 1),
                      ("batch_tokens", 1), ("log_interval", 1), ("eval_interval", 1), ("ckpt_interval", 1)):
        if name in c and (isinstance(c[name], bool) or not isinstance(c[name], int) or c[name] < low):
            raise ValueError(f"{name}={c[name]!r}: expected an int >= {low}")
    if not number("learning_rate") > 0:
        raise ValueError(f"learning_rate={c['learning_rate']!r}: expected > 0")
    if not 0 <= number("min_lr") <= c["learning_rate"]:
        raise ValueError(f"min_lr={c['min_lr']!r}: expected 0 <= min_lr <= learning_rate={c['learning_rate']!r}")
    for name in ("weight_decay", "grad_clip", "aux_loss_coef"):
        if name in c and not number(name) >= 0:
            raise ValueError(f"{name}={c[name]!r}: expected >= 0")


def train(config, start, loader, eval_fn=None, final_fn=None):
    """Train start.model on loader's batches per config; eval_fn(model) -> metrics every eval_interval and at the
    end; final_fn(model) -> metrics once at the very end (e.g. held-out accuracy). Checkpoints every
    ckpt_interval and at the end. Returns the final metrics."""
    c = config
    check_loop_settings(c)
    seed_everything(c["seed"])
    device_type, autocast = precision(c)
    out_dir = c["out_dir"]
    resumed = c["init_from"] == "resume"
    model = start.model.to(c["device"])
    forward = torch.compile(model) if c["compile"] else model
    optimizer = configure_optimizer(model, c["learning_rate"], c["weight_decay"], (c["beta1"], c["beta2"]), device_type)
    if resumed:
        optimizer.load_state_dict(start.trainer_state["optimizer"])
        loader.load_state_dict(start.data_state)
        set_rng_state(start.trainer_state["rng"])
    logger = Logger(out_dir, c, resume_iter=start.iter_num if resumed else None)
    peak = measure_matmul_flops(c["device"], torch.float32 if c["dtype"] == "float32" else torch.bfloat16)
    lr_decay_iters = c["lr_decay_iters"] or c["max_iters"]
    print0(f"{model.num_params() / 1e6:.2f}M parameters ({model.num_active_params() / 1e6:.2f}M active), "
           f"from {start.source}, iter {start.iter_num} -> {c['max_iters']}, matmul peak {peak / 1e9:.1f} GFLOP/s")

    it, final = start.iter_num, {}
    while it < c["max_iters"]:
        t0 = time.perf_counter()
        batches = [loader.next_batch().to(c["device"]) for _ in range(c["grad_accum"])]
        lr = get_lr(it, c["learning_rate"], c["min_lr"], c["warmup_iters"], lr_decay_iters)
        m = train_step(forward, optimizer, batches, lr, c["grad_clip"], c["aux_loss_coef"], autocast)
        if device_type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        it += 1
        last = it == c["max_iters"]
        if it % c["log_interval"] == 0 or last:
            flops = sum(train_flops(model.config, b.seqlens()) for b in batches)
            m.update({"perf/step_time_s": dt, "perf/tokens_per_sec": m["train/tokens"] / dt,
                      "perf/mfu": flops / dt / peak})
            logger.log(it, m)
            print0(f"iter {it}: loss {m['train/loss']:.4f}, aux {m['train/aux_loss']:.3f}, lr {lr:.2e}, "
                   f"{dt * 1000:.0f} ms, {m['perf/tokens_per_sec']:.0f} tok/s, mfu {100 * m['perf/mfu']:.1f}%")
        if eval_fn is not None and (it % c["eval_interval"] == 0 or last):
            model.eval()
            with autocast:
                e = eval_fn(model)
            model.train()
            logger.log(it, e)
            print0(f"eval iter {it}: " + ", ".join(f"{k} {v:.4f}" for k, v in e.items()))
            final.update(e)
        if last and final_fn is not None:
            model.eval()
            with autocast:
                e = final_fn(model)
            model.train()
            logger.log(it, e)
            print0(f"final iter {it}: " + ", ".join(f"{k} {v:.4f}" for k, v in e.items()))
            final.update(e)
        if it % c["ckpt_interval"] == 0 or last:
            save_checkpoint(out_dir, model, optimizer, start.tokenizer, it, c, loader.state_dict())
    logger.close()
    return final
