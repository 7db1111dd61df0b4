"""
The rollout engine: a paged KV cache with prefix caching, continuous batching, per-token logprobs, weight hot-swap.

    from engine import InferenceEngine, EngineConfig, SamplingParams
    engine = InferenceEngine(EngineConfig(model_path="path/to/hf_dir"))          # or model=policy, in-process
    samples = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=256,
                                                      stop_token_ids=frozenset({eos})), num_samples_per_prompt=8)
    engine.update_weights(policy.state_dict())                                   # after each optimizer step

How it works, top to bottom:
  - the KV of every sequence lives in fixed-size pages ("blocks") of model.PagedKVCache; the BlockAllocator
    below decides which page is whose, with refcounts so that sequences can share pages;
  - a full page is named by a hash of its tokens and of the hash of the page before it (the whole prefix), so
    a new request whose prefix was computed before finds its pages and skips that prefill ("prefix caching");
    a freed page keeps its name until it is evicted (LRU), and every name is forgotten when the weights change;
  - schedule() is a pure function: each step it picks which sequences run and how many new tokens each feeds
    (decodes first, then prefill chunks), under a batch size and a token budget, and preempts the newest
    sequences when pages run out (they are freed and recomputed later, mostly from the prefix cache);
  - one step = one forward of the model over a flat batch of all scheduled tokens (model.PagedAttention), then
    sample_with_logprobs() at the last token of each sequence that has caught up;
  - a GRPO group of G samples is one request: its prompt is prefilled once, then it forks into G sequences that
    share the prompt's pages (the last, partial page is copied so that each sample writes its own).
"""

import math
import os
import random
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from model import PagedAttention, PagedGroup, PagedKVCache, Transformer, _as_dtype, load_hf_checkpoint

# -----------------------------------------------------------------------------
# configs and results


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs. attention_backend='auto' picks by measurement: on CPU 'sdpa' (SDPA over each
    sequence's gathered pages). Measured on this project's CPU box (2026-11-23, 1 thread, bench.py's GRPO-shaped
    run: 16 prompts x 8 samples, <= 100 new tokens, hidden 128, 4 layers, 8 experts, one process, interleaved):
    sdpa 4,116 tok/s, compiled flex 3,468 tok/s (after a 25 s first call), eager flex 921 tok/s. On CUDA 'auto'
    is FlexAttention, compiled when compile=True (the design's path), else sdpa."""
    model_path: str | None = None        # a local HF directory; unused when a model is handed to InferenceEngine
    cache_type: str = "paged"            # 'paged' | 'radix' (radix: not built yet)
    block_size: int = 16                 # tokens per KV page
    num_blocks: int | None = None        # KV pages in the pool; None = size from memory (see _size_pool)
    max_batch_size: int = 256            # sequences in one step
    max_model_len: int | None = None     # prompt + completion; None = the model's max_position_embeddings
    device: str = "cpu"
    dtype: str = "float32"
    max_num_batched_tokens: int = 2048   # new tokens in one step (prefill is chunked to fit)
    memory_fraction: float = 0.5         # of free memory for the KV pool when num_blocks is None
    attention_backend: str = "auto"      # 'sdpa' | 'flex' | 'auto' (see above)
    compile: bool = False                # run FlexAttention through torch.compile (the CUDA path)
    seed: int = 0                        # seeds the per-request sampling seeds
    weight_version: int = 0              # the version of the weights it starts with (a resumed trainer's)

    def __post_init__(self):
        if self.cache_type == "radix":
            raise ValueError("cache_type='radix' is not implemented yet: use cache_type='paged'")
        if self.cache_type != "paged":
            raise ValueError(f"unknown cache_type {self.cache_type!r}: expected 'paged' or 'radix'")
        for name in ("block_size", "max_batch_size", "max_num_batched_tokens"):
            _check_positive_int(f"EngineConfig.{name}", getattr(self, name))
        if isinstance(self.weight_version, bool) or not isinstance(self.weight_version, int) or self.weight_version < 0:
            raise ValueError(f"EngineConfig.weight_version must be an int >= 0, got {self.weight_version!r}")
        for name in ("num_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                _check_positive_int(f"EngineConfig.{name}", getattr(self, name))
        if not (isinstance(self.memory_fraction, (int, float)) and 0 < self.memory_fraction <= 1):
            raise ValueError(f"EngineConfig.memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        if self.attention_backend not in ("auto", "sdpa", "flex"):
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}: expected 'auto', 'sdpa' or 'flex'")
        _as_dtype(self.dtype)
        torch.device(self.device)   # raises on a malformed device string


MIN_TEMPERATURE = 1e-5   # below this (and above 0) a temperature is refused: it is greedy, and risks inf / NaN


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. top_k / top_p restrict what is drawn; the logprob recorded is always log_softmax(logits / T)
    over the whole vocabulary (T = 1 when greedy), see sample_with_logprobs."""
    temperature: float = 1.0             # 0 = greedy
    max_tokens: int = 256                # completion tokens at most
    stop_token_ids: frozenset = frozenset()
    top_k: int = 0                       # 0 = off
    top_p: float = 1.0                   # 1.0 = off
    seed: int | None = None              # a request with a seed samples the same tokens whatever else is batched

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {t!r}")
        if 0 < t < MIN_TEMPERATURE:   # logits / T overflows fp32 near 1e-37 and T underflows to 0 below 1e-45
            raise ValueError(f"SamplingParams.temperature {t!r} is greedy in all but name: use 0 for greedy, "
                             f"or at least {MIN_TEMPERATURE}")
        _check_positive_int("SamplingParams.max_tokens", self.max_tokens)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p <= 1):   # NaN fails too
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {p!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise TypeError(f"SamplingParams.stop_token_ids must be a set of ints, got {self.stop_token_ids!r}")
        stop = frozenset(self.stop_token_ids)
        bad = [s for s in stop if isinstance(s, bool) or not isinstance(s, int) or s < 0]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids must be ints >= 0, got {bad[0]!r}")
        object.__setattr__(self, "stop_token_ids", stop)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")
        if self.seed is not None and not 0 <= self.seed < 2 ** 64:
            raise ValueError(f"SamplingParams.seed must be in [0, 2**64), got {self.seed!r}")


@dataclass(frozen=True)
class TrainingSample:
    prompt_tokens: tuple
    completion_tokens: tuple             # ends with the stop token when finish_reason == 'stop'
    logprobs: tuple                      # log_softmax(logits / T) at each completion token (T = 1 when greedy)
    ref_logprobs: tuple | None = None    # the engine never fills it; a trainer may (dataclasses.replace)
    weight_version: int = 0              # the oldest weights that produced a token of this sample
    finish_reason: str = "length"        # 'stop' | 'length'
    token_versions: tuple = ()           # the weight version that sampled each completion token
    seq_id: int = -1                     # what add_request returned
    sample_index: int = 0                # 0..num_samples-1 within its request


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value!r}")


# -----------------------------------------------------------------------------
# prefix hashing and the block allocator


def compute_block_hash(block_token_ids, parent_hash):
    """The name of a full KV page: xxh64 over the parent page's hash (0 for the first page) and the page's token
    ids as little-endian int64 (fixed width: ids go past 255, and [1, 23] must not read like [12, 3])."""
    h = xxhash.xxh64()
    h.update(int(parent_hash or 0).to_bytes(8, "little"))
    h.update(np.asarray(block_token_ids, dtype="<i8").tobytes())
    return h.intdigest()


class BlockAllocator:
    """Which KV page is whose. Refcounted pages (sequences share prefix pages); a full page may carry a hash,
    and the hash -> page table is the prefix cache. A page whose refcount drops to 0 is free but keeps its hash,
    so it can still be hit, until a fresh page is needed and nothing unnamed is free: then the least recently
    freed named page is evicted (LRU) and loses its name."""

    def __init__(self, num_blocks, block_size):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refcount = [0] * num_blocks
        self.block_hash = [None] * num_blocks
        self.cached = {}                          # hash -> page, for every named page (free or in use)
        self.free_plain = list(range(num_blocks - 1, -1, -1))   # free, unnamed: handed out first (a stack)
        self.free_cached = OrderedDict()          # free, named: oldest first (the LRU eviction order)

    def num_free_blocks(self):
        return len(self.free_plain) + len(self.free_cached)

    def allocate(self):
        """A fresh page with refcount 1 (evicting the least recently freed named page if it must)."""
        if self.free_plain:
            block = self.free_plain.pop()
        elif self.free_cached:
            block, _ = self.free_cached.popitem(last=False)
            del self.cached[self.block_hash[block]]
            self.block_hash[block] = None
        else:
            raise RuntimeError("out of KV pages: the scheduler should have preempted")
        self.refcount[block] = 1
        return block

    def share(self, block):
        """One more holder of a page (a prefix-cache hit, or a forked sample); revives a free named page."""
        if self.refcount[block] == 0:
            del self.free_cached[block]           # only named pages can be hit while free
        self.refcount[block] += 1

    def free(self, block):
        assert self.refcount[block] > 0, f"page {block} freed more often than held"
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            if self.block_hash[block] is None:
                self.free_plain.append(block)
            else:
                self.free_cached[block] = None    # most recently freed last

    def lookup(self, block_hash):
        return self.cached.get(block_hash)

    def register(self, block, block_hash):
        """Name a full page whose KV is computed, unless that name is already taken (then this page stays
        unnamed: two sequences computed the same prefix at once, and one copy is enough)."""
        if self.block_hash[block] is None and block_hash not in self.cached:
            self.block_hash[block] = block_hash
            self.cached[block_hash] = block

    def invalidate(self):
        """Forget every name (new weights: no old KV may be served again). Free named pages become plain free."""
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self.free_plain.extend(self.free_cached)
        self.free_cached.clear()

    def check(self):
        """The invariants (tests call this): refcounts >= 0, free + used = total, free means refcount 0,
        names and the table agree."""
        free = self.free_plain + list(self.free_cached)
        assert len(free) == len(set(free)), "a page is free twice"
        assert all(r >= 0 for r in self.refcount)
        assert all(self.refcount[b] == 0 for b in free)
        used = sum(r > 0 for r in self.refcount)
        assert used + len(free) == self.num_blocks, (used, len(free), self.num_blocks)
        assert all(self.block_hash[b] is not None for b in self.free_cached)
        assert all(self.block_hash[b] is None for b in self.free_plain)
        assert all(self.block_hash[b] == h for h, b in self.cached.items())
        assert sum(h is not None for h in self.block_hash) == len(self.cached)


# -----------------------------------------------------------------------------
# a sequence: one sample's lifecycle


class Sequence:
    """One sample being generated (or, before its prompt is prefilled, a whole group of num_samples)."""

    def __init__(self, uid, seq_id, sample_index, prompt, params, num_samples, seed):
        self.uid = uid                            # unique per sample: what schedule() names it by
        self.seq_id, self.sample_index, self.params = seq_id, sample_index, params
        self.tokens = list(prompt)                # prompt + completion so far
        self.num_prompt = len(prompt)
        self.num_samples = num_samples            # > 1: fork into this many samples when the prompt is done
        self.seed = seed                          # this sample's sampling noise is a function of it
        self.num_computed = 0                     # tokens whose KV is in this sequence's pages
        self.block_table = []                     # page of tokens[i] = block_table[i // block_size]
        self.block_hashes = []                    # hash of each full page of tokens (a chain)
        self.num_cached_tokens = 0                # set before schedule(): prefix-cache hit if admitted now
        self.num_cached_free_blocks = 0           #   ... of which pages that are free (admitting revives them)
        self.kv_version = None                    # the weights that computed this sequence's KV
        self.logprobs, self.versions = [], []
        self.finish_reason = None
        self.catching_up = True                   # computing tokens it already has (prefill or recompute)

    @property
    def num_tokens(self):
        return len(self.tokens)

    def extend_hashes(self, block_size):
        # hash every full page of tokens, once: the chain only ever grows (tokens are only appended)
        n_full = len(self.tokens) // block_size
        for i in range(len(self.block_hashes), n_full):
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(compute_block_hash(self.tokens[i * block_size:(i + 1) * block_size], parent))


# -----------------------------------------------------------------------------
# scheduling: a pure function of the queues and the free pages


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int
    max_num_batched_tokens: int
    block_size: int


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple    # ((uid, num_new_tokens), ...): this step's batch, in order
    admitted: tuple     # uids taken from the waiting queue (they are in scheduled too)
    preempted: tuple    # uids to free and send back to the front of the waiting queue, in this order


def blocks_needed(seq, num_new_tokens, block_size, num_computed=None):
    """Fresh pages a sequence needs to compute num_new_tokens more tokens. A group whose prompt completes in this
    step also needs num_samples - 1 private copies of the prompt's last page when that page is partial."""
    done = seq.num_computed if num_computed is None else num_computed
    end = done + num_new_tokens
    need = -(-end // block_size) - -(-done // block_size)
    if seq.num_samples > 1 and end == seq.num_tokens and seq.num_tokens % block_size:
        need += seq.num_samples - 1
    return need


def schedule(waiting, running, num_free_blocks, scheduler_config) -> SchedulerOutput:
    """Pick this step's batch. Reads the sequences (num_tokens, num_computed, block_table, num_samples, and for
    waiting ones num_cached_tokens / num_cached_free_blocks), never writes them.

    1. Running sequences, oldest first, each as many new tokens as it has (a prefill is chunked to the token
       budget). The engine admits in order and a prefill finishes before anything admitted after it starts, so
       the prefilling sequences are the newest: in practice this is decodes first, then prefill chunks. When the
       free pages don't cover one, the newest running sequence is preempted (its pages counted free once no other
       running sequence holds them) until they do; if that newest one is the sequence itself, it is preempted and
       the step stops there.
    2. Only if nothing was preempted: waiting sequences in order (no skipping ahead), each starting after its
       prefix-cache hit, while the batch has room (a group counts as its num_samples sequences), the token
       budget lasts and the pages suffice.
    Every request finishes: the oldest running sequence is never preempted while another exists, and
    add_request refuses what could not fit the pool alone."""
    bs = scheduler_config.block_size
    budget, free = scheduler_config.max_num_batched_tokens, num_free_blocks
    order = list(running)     # oldest first: the last one is the newest, the first to be preempted
    scheduled, preempted, holders = [], [], None
    i = 0
    while i < len(order) and budget > 0 and len(scheduled) < scheduler_config.max_batch_size:
        seq = order[i]
        n = min(seq.num_tokens - seq.num_computed, budget)
        need = blocks_needed(seq, n, bs)
        while need > free:
            if holders is None:   # who holds each page: only running sequences hold pages
                holders = {}
                for s in order:
                    for b in s.block_table:
                        holders[b] = holders.get(b, 0) + 1
            victim = order.pop()
            preempted.append(victim.uid)
            for b in victim.block_table:
                holders[b] -= 1
                free += holders[b] == 0
            if victim is seq:
                break
        else:
            scheduled.append((seq.uid, n))
            budget -= n
            free -= need
            i += 1
            continue
        break
    admitted = []
    if not preempted:
        num_seqs = len(running)
        for seq in waiting:
            if budget == 0 or num_seqs + seq.num_samples > scheduler_config.max_batch_size:
                break
            n = min(seq.num_tokens - seq.num_cached_tokens, budget)
            need = blocks_needed(seq, n, bs, num_computed=seq.num_cached_tokens) + seq.num_cached_free_blocks
            if need > free:
                break
            scheduled.append((seq.uid, n))
            admitted.append(seq.uid)
            budget -= n
            free -= need
            num_seqs += seq.num_samples
    return SchedulerOutput(tuple(scheduled), tuple(admitted), tuple(preempted))


# -----------------------------------------------------------------------------
# sampling


def _hash32(x):
    # a 32-bit integer mixer (lowbias32) on int64 tensors: products wrap, and the mask keeps the low 32 bits
    m = 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & m
    x = ((x ^ (x >> 15)) * 0x846CA68B) & m
    return x ^ (x >> 16)


def sampling_uniforms(seeds, positions):
    """One uniform in (0, 1) per row [N] (float64), a pure function of (seed, position): a sample's draws do not
    depend on what else is in the batch, so a seeded request is reproducible, and a preempted one resumes the same."""
    m = 0xFFFFFFFF
    key = _hash32((seeds & m) ^ _hash32(((seeds >> 32) & m) ^ _hash32(positions & m)))
    return (key.double() + 0.5) * 2.0 ** -32


def sample_with_logprobs(logits, temperatures, top_k=None, top_p=None, seeds=None, positions=None):
    """Sample one token per row of logits [N, V]; return (tokens [N] int64, logprobs [N] float32).

    temperatures [N]: 0 means greedy (argmax). top_k [N] ints (0 = off), top_p [N] floats (1.0 = off) shape
    what is *sampled*: tokens outside the top k / the top-p nucleus of softmax(logits / T) are never drawn.
    The returned logprob is always log_softmax(logits / T) at the sampled token, T = 1 for greedy rows, over the
    *whole* vocabulary, unfiltered: the quantity the trainer computes from the same weights.
    seeds / positions [N] int64 (optional): the draw is a pure function of them (sampling_uniforms); without
    them, torch's global generator draws it. Sampling inverts the CDF: one uniform per row, one cumsum."""
    if (seeds is None) != (positions is None):
        raise ValueError("sample_with_logprobs: seeds and positions go together (the draw is a function of both)")
    logits = logits.float()
    N, V = logits.shape
    t = torch.as_tensor(temperatures, dtype=torch.float32, device=logits.device).reshape(N)
    greedy = t == 0
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, t)[:, None], dim=-1)
    tokens = logits.argmax(-1)
    if not bool(greedy.all()):
        probs = logp.exp()
        if top_k is not None or top_p is not None:
            k = torch.zeros(N, dtype=torch.int64, device=logits.device) if top_k is None else \
                torch.as_tensor(top_k, device=logits.device).reshape(N)
            p = torch.ones(N, device=logits.device) if top_p is None else \
                torch.as_tensor(top_p, dtype=torch.float32, device=logits.device).reshape(N)
            sorted_probs, idx = probs.sort(dim=-1, descending=True)
            rank = torch.arange(V, device=logits.device)[None, :]
            drop = rank >= torch.where(k > 0, k, V)[:, None]
            # top-p: keep the smallest prefix of the sorted tokens whose mass reaches p
            # (rows with p = 1 skip it: fp32 rounding of the cumsum could otherwise drop their tail tokens)
            drop |= ((sorted_probs.cumsum(-1) - sorted_probs) >= p[:, None]) & (p < 1)[:, None]
            drop[:, 0] = False                                       # the most likely token always survives
            probs = probs.masked_fill(torch.zeros_like(drop).scatter(1, idx, drop), 0.0)
        cdf = probs.double().cumsum(-1)
        if seeds is not None:
            u = sampling_uniforms(torch.as_tensor(seeds, device=logits.device).reshape(N),
                                  torch.as_tensor(positions, device=logits.device).reshape(N))
        else:
            u = torch.rand(N, dtype=torch.float64, device=logits.device)
        sampled = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(1).clamp_(max=V - 1)
        tokens = torch.where(greedy, tokens, sampled)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


# -----------------------------------------------------------------------------
# the engine


class InferenceEngine:
    """Continuous batching over a paged KV cache. Single-threaded: every call runs on the caller's thread."""

    def __init__(self, config: EngineConfig, model: Transformer | None = None):
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.config = config
        self.device, self.dtype = torch.device(config.device), _as_dtype(config.dtype)
        if model is None:
            if config.model_path is None:
                raise ValueError("EngineConfig.model_path is None and no model was given")
            model = load_hf_checkpoint(config.model_path, device=self.device, dtype=self.dtype)
        else:
            if not isinstance(model, Transformer):
                raise TypeError(f"model must be a model.Transformer, got {type(model).__name__}")
            # our own copy in our dtype/device: the trainer's parameters are never aliased (it keeps stepping)
            with torch.device("meta"):
                own = Transformer(model.config)
            own = own.to_empty(device=self.device).to(self.dtype)
            theirs = model.state_dict()
            with torch.no_grad():
                for name, t in own.state_dict().items():
                    t.copy_(theirs[name])
            model = own
        self.model = model.eval().requires_grad_(False)
        self._params = model.state_dict()         # name -> tensor sharing the parameter's storage (copy_ targets)
        self.model_config = mc = model.config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.block_size = config.block_size
        num_blocks = config.num_blocks or self._size_pool()
        self.kv_cache = PagedKVCache(mc, num_blocks, config.block_size, self.device, self.dtype)
        self.cache = BlockAllocator(num_blocks, config.block_size)
        self.backend = config.attention_backend
        if self.backend == "auto":
            self.backend = "flex" if self.device.type == "cuda" and config.compile else "sdpa"
        self.scheduler_config = SchedulerConfig(config.max_batch_size, config.max_num_batched_tokens, config.block_size)
        self.version = config.weight_version
        self._staged = None                       # a non-blocking update waiting for the next step boundary
        self._updates_pending = 0                 # update_weights calls not applied yet (staged, or replaced unapplied)
        self._rng = random.Random(config.seed)
        self._next_id = self._next_uid = 0
        self.waiting, self.running = [], []       # Sequences; running in age order
        self._undelivered = []                    # finished samples generate() took from others' requests
        self._stats = dict(prefix_cache_hit_tokens=0, prefill_tokens=0, decode_tokens=0, preemptions=0,
                           steps=0, forks=0, generated_tokens=0, weight_updates=0)
        self._closed = False

    def _size_pool(self):
        # enough pages for max_batch_size sequences at full length (what is left over serves the prefix cache),
        # capped at memory_fraction of the device's free memory
        cfg, bs = self.config, self.config.block_size
        per_block = PagedKVCache.bytes_per_block(self.model_config, bs, self.dtype)
        want = cfg.max_batch_size * -(-self.max_model_len // bs)
        if self.device.type == "cuda":
            free_bytes = torch.cuda.mem_get_info(self.device)[0]
        else:
            free_bytes = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return max(1, min(want, int(free_bytes * cfg.memory_fraction) // per_block))

    # ---- requests in

    def _check_open(self):
        if self._closed:
            raise RuntimeError("the engine was shut down")

    def _validate_prompt(self, prompt, where="prompt"):
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
                raise TypeError(f"{where} must be a 1-D integer tensor or a list of ints, got {prompt.dtype} "
                                f"of shape {tuple(prompt.shape)}")
            prompt = prompt.tolist()
        elif isinstance(prompt, np.ndarray):
            prompt = prompt.tolist()
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
            raise TypeError(f"{where} must be a list of token ids, got {type(prompt).__name__}")
        prompt = list(prompt)
        if not prompt:
            raise ValueError(f"{where} is empty: a prompt needs at least one token")
        vocab = self.model_config.vocab_size
        for i, tok in enumerate(prompt):
            if isinstance(tok, bool) or not isinstance(tok, (int, np.integer)):
                raise TypeError(f"{where}[{i}] = {tok!r} is not an int token id")
            if not 0 <= tok < vocab:
                raise ValueError(f"{where}[{i}] = {tok} is outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"{where} has {len(prompt)} tokens: longer than max_model_len={self.max_model_len} "
                             f"allows (at most {self.max_model_len - 1}, to leave room for one new token)")
        return [int(t) for t in prompt]

    def _check_fits(self, prompt, params, num_samples, where):
        # a request that could never fit the pool, even alone, is refused now rather than starve later
        bs, P = self.block_size, len(prompt)
        longest = min(P + params.max_tokens - 1, self.max_model_len)
        need = max(-(-longest // bs), -(-P // bs) + (num_samples - 1 if P % bs else 0))
        if need > self.cache.num_blocks:
            raise ValueError(f"{where} needs {need} KV pages but the pool has num_blocks={self.cache.num_blocks}")
        if num_samples > self.config.max_batch_size:
            raise ValueError(f"num_samples={num_samples} exceeds max_batch_size={self.config.max_batch_size}")

    def _new_uid(self):
        self._next_uid += 1
        return self._next_uid

    def _add(self, prompt, params, num_samples, index=0):
        # a seeded request's draws depend on (its seed, its index in the generate call, sample, position) only
        seq_id = self._next_id
        self._next_id += 1
        seed = _mix_seed(params.seed, index) if params.seed is not None else self._rng.getrandbits(63)
        self.waiting.append(Sequence(self._new_uid(), seq_id, 0, prompt, params, num_samples, seed))
        return seq_id

    def add_request(self, prompt, params: SamplingParams, num_samples: int = 1) -> int:
        """Queue a prompt (token ids) for num_samples samples; returns its seq_id (TrainingSample.seq_id)."""
        self._check_open()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        _check_positive_int("num_samples", num_samples)
        prompt = self._validate_prompt(prompt)
        self._check_fits(prompt, params, num_samples, "prompt")
        return self._add(prompt, params, num_samples)

    def has_pending(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(self, prompts, params: SamplingParams, num_samples_per_prompt: int = 1) -> list:
        """Samples for every prompt, in request order: prompt 0 samples 0..G-1, prompt 1 ... Each prompt is
        prefilled once and its pages shared by its G samples. Every input is checked before anything is queued."""
        self._check_open()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        _check_positive_int("num_samples_per_prompt", num_samples_per_prompt)
        if isinstance(prompts, (str, bytes, torch.Tensor)) or not hasattr(prompts, "__len__"):
            raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
        if len(prompts) and isinstance(prompts[0], (int, np.integer)):
            raise TypeError("prompts must be a list of token-id lists, got a flat list of ints (wrap it: [prompt])")
        checked = [self._validate_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        for i, p in enumerate(checked):
            self._check_fits(p, params, num_samples_per_prompt, f"prompts[{i}]")
        ids = {self._add(p, params, num_samples_per_prompt, index=i) for i, p in enumerate(checked)}
        mine, others = [], []
        while any(s.seq_id in ids for s in self.waiting + self.running):
            for s in self.step():
                (mine if s.seq_id in ids else others).append(s)
        self._undelivered += others               # another caller's samples: step() hands them out next
        return sorted(mine, key=lambda s: (s.seq_id, s.sample_index))   # seq_ids grow in request order

    # ---- one step

    def _prefix_hits(self, seq):
        # how much of the sequence's prefix is already in named pages (keeping >= 1 token to compute: its logits)
        bs = self.block_size
        seq.extend_hashes(bs)
        n, free_hits = 0, 0
        for h in seq.block_hashes[: (seq.num_tokens - 1) // bs]:
            block = self.cache.lookup(h)
            if block is None:
                break
            n += 1
            free_hits += self.cache.refcount[block] == 0
        seq.num_cached_tokens, seq.num_cached_free_blocks = n * bs, free_hits

    def _free(self, seq):
        for b in reversed(seq.block_table):        # the tail first, so LRU evicts suffixes before prefixes
            self.cache.free(b)
        seq.block_table = []
        seq.num_computed = 0
        seq.kv_version = None
        seq.catching_up = True

    @torch.inference_mode()   # not just no_grad: no autograd dispatch or version counters (measured ~1.08x)
    def step(self) -> list:
        """One schedule and one forward. Returns the samples that finished in this step."""
        self._check_open()
        if self._staged is not None:
            self._apply_weights(self._staged)
            self._staged = None
        out, self._undelivered = self._undelivered, []
        if not self.has_pending():
            return out
        bs, cache = self.block_size, self.cache
        room = self.config.max_batch_size - len(self.running)
        for seq in self.waiting[:max(room, 0)]:
            self._prefix_hits(seq)
        sched = schedule(self.waiting, self.running, cache.num_free_blocks(), self.scheduler_config)
        self._stats["steps"] += 1

        # apply the decisions: free the preempted, take hits, then fresh pages (hits first: a fresh page may evict)
        by_id = {s.uid: s for s in self.running}
        if sched.preempted:
            gone = set(sched.preempted)
            victims = [by_id[i] for i in sched.preempted]
            for seq in victims:
                self._free(seq)
            self.running = [s for s in self.running if s.uid not in gone]
            self.waiting[:0] = victims[::-1]      # the newest was preempted first: oldest goes in front
            self._stats["preemptions"] += len(victims)
        if sched.admitted:
            admitted = set(sched.admitted)
            for seq in self.waiting:
                if seq.uid in admitted:
                    by_id[seq.uid] = seq
                    hits = seq.num_cached_tokens // bs
                    for h in seq.block_hashes[:hits]:
                        block = cache.lookup(h)
                        cache.share(block)
                        seq.block_table.append(block)
                    seq.num_computed = seq.num_cached_tokens
                    seq.kv_version = self.version
                    self._stats["prefix_cache_hit_tokens"] += seq.num_cached_tokens
            self.waiting = [s for s in self.waiting if s.uid not in admitted]
            self.running += [by_id[i] for i in sched.admitted]
        batch = sorted(((by_id[i], n) for i, n in sched.scheduled), key=lambda x: x[1] > 1)   # decodes first
        if not batch:
            return out
        for seq, n in batch:
            for _ in range(-(-(seq.num_computed + n) // bs) - len(seq.block_table)):
                seq.block_table.append(cache.allocate())
        logits, samplers = self._forward(batch)
        return out + self._postprocess(batch, logits, samplers)

    def _forward(self, batch):
        """Build the step's metadata (numpy, then one host -> device transfer), run the model, return the logits of
        the sequences that caught up (they sample) and which ones they are. batch is ordered decodes first: they
        attend as one group, prefill chunks as another (PagedGroup)."""
        bs = self.block_size
        B = len(batch)
        qlens = np.fromiter((n for _, n in batch), dtype=np.int64, count=B)
        starts = np.fromiter((s.num_computed for s, _ in batch), dtype=np.int64, count=B)
        ends = starts + qlens
        cu = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(qlens, out=cu[1:])
        T = int(cu[-1])
        tables = np.zeros((B, int(-(-ends.max() // bs))), dtype=np.int64)
        tokens = []
        for b, (seq, n) in enumerate(batch):
            tables[b, :len(seq.block_table)] = seq.block_table
            tokens += seq.tokens[seq.num_computed:seq.num_computed + n]
        row_of = np.repeat(np.arange(B), qlens)                       # each token's sequence
        offset = np.arange(T) - cu[:-1][row_of]                        # ... and place in its chunk
        pos = starts[row_of] + offset
        samplers = [b for b, (seq, n) in enumerate(batch) if ends[b] == seq.num_tokens]
        parts = [np.asarray(tokens, dtype=np.int64), pos, tables[row_of, pos // bs] * bs + pos % bs,
                 cu[1:][samplers] - 1]
        num_decodes = int((qlens == 1).sum())                          # batch order: decodes first
        specs = []
        for lo, hi in ((0, num_decodes), (num_decodes, B)):
            if lo == hi:
                continue
            Qmax = int(qlens[lo:hi].max())
            n_pages = int(-(-ends[lo:hi].max() // bs))
            within = np.minimum(np.arange(Qmax)[None, :], (qlens[lo:hi] - 1)[:, None])
            parts += [tables[lo:hi, :n_pages].ravel(), (starts[lo:hi, None] + within).ravel()]
            uniform = bool((qlens[lo:hi] == Qmax).all())
            if not uniform:
                rows = slice(cu[lo], cu[hi])
                parts += [(cu[lo:hi, None] - cu[lo] + within).ravel(), (row_of[rows] - lo) * Qmax + offset[rows]]
            specs.append((int(cu[lo]), int(cu[hi] - cu[lo]), hi - lo, n_pages, Qmax, uniform))
        flat = torch.from_numpy(np.concatenate(parts)).to(self.device, non_blocking=True)
        views = iter(torch.split(flat, [p.size for p in parts]))
        tok_t, pos_t, slot_t, logit_idx = (next(views) for _ in range(4))
        groups = []
        for start, num, nb, n_pages, Qmax, uniform in specs:
            tab, qpos = next(views).view(nb, n_pages), next(views).view(nb, Qmax)
            qidx, row = (None, None) if uniform else (next(views).view(nb, Qmax), next(views))
            groups.append(PagedGroup(start, num, tab, qpos, qidx, row))
        attention = PagedAttention(self.kv_cache, slot_t, groups, backend=self.backend, compiled=self.config.compile)
        logits, _ = self.model(tok_t, pos_t, attention=attention, logits_indices=logit_idx, aux_loss=False)
        for seq, n in batch:                      # what this step computed: prefill (catching up) or decode
            self._stats["prefill_tokens" if seq.catching_up else "decode_tokens"] += n
        return logits, samplers

    def _postprocess(self, batch, logits, samplers):
        bs, cache = self.block_size, self.cache
        for seq, n in batch:
            seq.num_computed += n
            seq.catching_up = seq.num_computed < seq.num_tokens
            if seq.kv_version == self.version:    # name the newly full pages (never those of older weights)
                seq.extend_hashes(bs)
                for i in range((seq.num_computed - n) // bs, seq.num_computed // bs):
                    cache.register(seq.block_table[i], seq.block_hashes[i])
        if not samplers:
            return []
        # a group whose prompt just finished forks into its samples: one logits row each
        rows, seqs = [], []
        for j, b in enumerate(samplers):
            seq = batch[b][0]
            if seq.num_samples > 1:
                forks = self._fork(seq)
                seqs += forks
                rows += [j] * len(forks)
            else:
                seqs.append(seq)
                rows.append(j)
        if len(rows) != len(samplers):
            logits = logits[torch.tensor(rows, device=logits.device)]
        params = [s.params for s in seqs]
        use_k = any(p.top_k for p in params)
        use_p = any(p.top_p < 1.0 for p in params)
        meta = torch.tensor([[p.temperature, p.top_k, p.top_p] for p in params], dtype=torch.float64)
        seeds = torch.tensor([s.seed for s in seqs], dtype=torch.int64)
        positions = torch.tensor([s.num_tokens for s in seqs], dtype=torch.int64)
        tokens, logprobs = sample_with_logprobs(
            logits, meta[:, 0].float().to(logits.device),
            top_k=meta[:, 1].long().to(logits.device) if use_k else None,
            top_p=meta[:, 2].float().to(logits.device) if use_p else None,
            seeds=seeds.to(logits.device), positions=positions.to(logits.device))
        finished = []
        for seq, tok, lp in zip(seqs, tokens.tolist(), logprobs.tolist()):
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(self.version)
            self._stats["generated_tokens"] += 1
            p = seq.params
            n_out = seq.num_tokens - seq.num_prompt
            reason = "stop" if tok in p.stop_token_ids else \
                "length" if n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len else None
            if reason is not None:
                finished.append(self._finish(seq, reason))
        if finished:
            self.running = [s for s in self.running if s.finish_reason is None]
        return finished

    def _fork(self, seq):
        """The group's prompt is computed: seq becomes sample 0 and num_samples - 1 siblings share its pages.
        The last page, if partial, gets a private copy for each sibling (each will write its own tokens there)."""
        bs, cache = self.block_size, self.cache
        forks = [seq]
        base_seed = seq.seed
        seq.seed = _mix_seed(base_seed, 0)
        partial = seq.num_tokens % bs != 0
        copies_src, copies_dst = [], []
        for k in range(1, seq.num_samples):
            f = Sequence(self._new_uid(), seq.seq_id, k, seq.tokens, seq.params, 1, _mix_seed(base_seed, k))
            f.num_prompt, f.num_computed, f.kv_version = seq.num_prompt, seq.num_computed, seq.kv_version
            f.catching_up = False
            f.block_hashes = list(seq.block_hashes)
            shared = seq.block_table[:-1] if partial else seq.block_table
            for b in shared:
                cache.share(b)
            f.block_table = list(shared)
            if partial:
                new = cache.allocate()
                copies_src.append(seq.block_table[-1])
                copies_dst.append(new)
                f.block_table.append(new)
            forks.append(f)
        if copies_src:
            self.kv_cache.copy_blocks(torch.tensor(copies_src, device=self.device),
                                      torch.tensor(copies_dst, device=self.device))
        seq.num_samples = 1
        i = self.running.index(seq)
        self.running[i + 1:i + 1] = forks[1:]     # siblings are as old as their leader
        self._stats["forks"] += len(forks) - 1
        return forks

    def _finish(self, seq, reason):
        seq.finish_reason = reason
        self._free(seq)
        return TrainingSample(
            prompt_tokens=tuple(seq.tokens[:seq.num_prompt]), completion_tokens=tuple(seq.tokens[seq.num_prompt:]),
            logprobs=tuple(seq.logprobs), weight_version=min(seq.versions), finish_reason=reason,
            token_versions=tuple(seq.versions), seq_id=seq.seq_id, sample_index=seq.sample_index)

    # ---- weights

    def _check_state_dict(self, state_dict):
        if not hasattr(state_dict, "keys") or not hasattr(state_dict, "__getitem__"):
            raise TypeError(f"state_dict must be a mapping of name -> tensor, got {type(state_dict).__name__}")
        expected = self._params
        if state_dict.keys() != expected.keys():
            missing, unknown = sorted(set(expected) - set(state_dict)), sorted(set(state_dict) - set(expected))
            if missing:
                raise ValueError(f"state_dict is missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
            raise ValueError(f"state_dict has unknown tensor(s) {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
        tensors = []
        for name, ours in expected.items():
            t = state_dict[name]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"state_dict[{name!r}] is a {type(t).__name__}, not a tensor")
            if t.shape != ours.shape:
                raise ValueError(f"state_dict[{name!r}] has shape {tuple(t.shape)}, expected {tuple(ours.shape)}")
            if not t.dtype.is_floating_point:
                raise ValueError(f"state_dict[{name!r}] has dtype {t.dtype}, expected a floating dtype")
            tensors.append(t)
        # one read of each tensor, one sync. Where the engine's dtype holds every value of the tensor's dtype, a sum
        # (NaN/inf make it, and the total, non-finite); where the cast could overflow (fp32 -> fp16), the largest
        # |value|, which must fit the engine's dtype. Only when that fails (or finite values overflow a sum) does
        # an exact check run, to name the tensor. This read is the price of refusing before touching anything:
        # about half a copy (bench.py prints that floor). A sum is cheaper than torch._foreach_norm on CPU.
        limit = torch.finfo(self.dtype).max
        narrowing = [t.dtype != self.dtype and torch.finfo(t.dtype).max > limit for t in tensors]
        with torch.inference_mode():
            sums = [t.sum(dtype=torch.float32) for t, n in zip(tensors, narrowing) if not n]
            peaks = [torch.stack(torch.aminmax(t)).abs().max().float() for t, n in zip(tensors, narrowing) if n]
            total, peak = _reduce(sums, torch.sum), _reduce(peaks, torch.max)
        if not (math.isfinite(total) and peak <= limit):     # a NaN peak fails the comparison
            for name, t, n in zip(expected, tensors, narrowing):
                if not torch.isfinite(t.detach()).all():
                    raise ValueError(f"state_dict[{name!r}] has non-finite values (NaN or inf)")
                if n and t.detach().abs().max() > limit:
                    raise ValueError(f"state_dict[{name!r}] has values beyond {self.dtype}'s range "
                                     f"(|x| <= {limit:g}): they would be inf in the engine")
        return tensors

    def update_weights(self, state_dict, blocking: bool = True):
        """Load new weights (names, shapes, dtypes and finiteness checked first, finiteness as the engine's dtype
        will hold them: a bad state_dict raises and changes nothing). blocking=True copies now; False takes a
        snapshot now and copies it in at the next step boundary (a newer call replaces a snapshot not yet applied).
        Copies are in place (param.copy_), so storage addresses and compiled graphs stay valid. The version goes
        up by one per call and the prefix cache is emptied: no KV of older weights is ever served to a new
        request. Sequences already running keep their KV (and each token records the version that sampled it)."""
        self._check_open()
        tensors = self._check_state_dict(state_dict)
        self._updates_pending += 1      # one version per call, even when a newer call supersedes it unapplied
        if blocking:
            self._staged = None
            self._apply_weights(tensors)
        else:
            self._staged = [t.detach().to(self.device, self.dtype, copy=True) for t in tensors]

    def _apply_weights(self, tensors):
        # tensors in self._params order. One fused call, not a loop of copy_: it saves the per-tensor dispatch
        # (~10% at the embedded size); it casts dtypes and crosses devices like copy_ does.
        with torch.inference_mode():
            torch._foreach_copy_(list(self._params.values()), tensors)
        self.version += self._updates_pending
        self._stats["weight_updates"] += self._updates_pending
        self._updates_pending = 0
        self.cache.invalidate()

    def get_weight_version(self) -> int:
        return self.version

    # ---- housekeeping

    def flush_cache(self):
        """Forget the prefix cache (pages in use are untouched)."""
        self._check_open()
        self.cache.invalidate()

    def stats(self) -> dict:
        return dict(self._stats, num_blocks=self.cache.num_blocks, num_free_blocks=self.cache.num_free_blocks(),
                    cached_blocks=len(self.cache.cached), waiting=len(self.waiting), running=len(self.running),
                    weight_version=self.version, attention_backend=self.backend)

    def shutdown(self):
        """Drop the model and the KV pool; queued requests are abandoned. Later calls raise RuntimeError."""
        self._closed = True
        self.waiting, self.running, self._staged = [], [], None
        self.kv_cache = self.model = None


def _reduce(scalars, fn):
    # a Python float from 0-d tensors, in one sync (one per device when they are spread over several)
    if not scalars:
        return 0.0
    try:
        return fn(torch.stack(scalars)).item()
    except RuntimeError:
        return fn(torch.tensor([s.item() for s in scalars])).item()


def _mix_seed(seed, k):
    # the k-th sample of a group: a distinct, reproducible seed
    return xxhash.xxh64_intdigest(int(seed).to_bytes(8, "little") + int(k).to_bytes(8, "little")) >> 1
