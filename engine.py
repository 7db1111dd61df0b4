"""
The rollout engine: a paged KV cache with prefix caching, continuous batching, per-token
logprobs, weight hot-swap.

    from engine import InferenceEngine, EngineConfig, SamplingParams
    engine = InferenceEngine(EngineConfig(model_path="path/to/hf_dir"))   # or model=policy
    params = SamplingParams(temperature=1.0, max_tokens=256, stop_token_ids=frozenset({eos}))
    samples = engine.generate(prompts, params, num_samples_per_prompt=8)
    engine.update_weights(policy.state_dict())                   # after each optimizer step
    engine.update_from(policy)      # the same, or the adapters alone with a shared LoRA base
    engine.sleep(); ...; engine.wake_up(); engine.update_from(policy)   # memory freed meanwhile

One step() = schedule (inference/scheduler.py: who runs, which block is whose) ->
preempt -> admit -> allocate -> forward (one model call over a flat batch of every
scheduled token, inference/attention.py's PagedAttention reading the paged KV cache) ->
postprocess: sample_with_logprobs() at the last token of each sequence that has caught
up, finish the ones that stopped. With compile=True a step in which every sequence
decodes runs as one graph, the sampler inside (decode.StaticDecode). A GRPO group of G
samples is one request: its prompt is prefilled once, then it forks into G sequences
that share the prompt's blocks (the last, partial block is copied so that each sample
writes its own).
"""

import functools
import itertools
import math
import os
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from inference.attention import PagedAttention, PagedKVCache, decode_kernel, paged_step
import lora
from checkpoint import first_five, load_hf_checkpoint
from scaleout.distributed import full_tensors, is_sharded
from checks import is_int, is_number, require, require_field
from inference.decode import StaticDecode
from inference.radix import RadixCache
# schedule, sample_with_logprobs, compute_block_hash and SchedulerConfig: the low-level pure
# functions, importable from here too
from inference.sampling import mix_seed, sample_next, sample_with_logprobs, top_logprobs
from inference.scheduler import (BlockAllocator, SchedulerConfig, Sequence, check_fits,
                                 compute_block_hash, schedule)
from model import Transformer, as_dtype, grouped_experts

# -----------------------------------------------------------------------------
# configs and results


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs. attention_backend='auto': SDPA over the gathered blocks (see
    attention_choice for why, and when FlexAttention is compiled)."""
    model_path: str | None = None       # an HF directory (unused when a model is handed over)
    cache_type: str = "paged"           # 'paged' (block hashes) | 'radix' (a radix tree)
    block_size: int = 16                # tokens per KV block
    num_blocks: int | None = None       # KV blocks in the pool; None = from memory (pool_size)
    max_batch_size: int = 256           # sequences in one step
    max_model_len: int | None = None    # prompt + completion; None = max_position_embeddings
    device: str = "cpu"
    dtype: str = "float32"
    max_num_batched_tokens: int = 2048  # new tokens in one step (prefill is chunked to fit)
    memory_fraction: float = 0.5        # of free memory, for the pool when num_blocks is None
    # 'paged' (CPU, float32: decodes read the cache in place) | 'sdpa' | 'flex' | 'auto'
    attention_backend: str = "auto"
    # True: with attention_backend 'auto', 'paged' or 'sdpa', a step where every sequence decodes
    # runs as one graph (inference/decode.py: compiled on the CPU in float32, tens of
    # seconds once per process; CUDA graphs on a GPU); with 'flex', FlexAttention through
    # torch.compile. None: flex on CUDA only
    compile: bool | None = None
    seed: int = 0                       # seeds the per-request sampling seeds
    weight_version: int = 0             # the version it starts at (a resumed trainer's)
    # an MoE model: record each token's experts per layer
    # (TrainingSample.routes; routing replay)
    record_routes: bool = False

    def __post_init__(self):
        need = functools.partial(require_field, self)
        need("cache_type", self.cache_type in ("paged", "radix"), "'paged' or 'radix'")
        need("attention_backend", self.attention_backend in ("auto", "sdpa", "flex", "paged"),
             "'auto', 'paged', 'sdpa' or 'flex'")
        need("compile", self.compile is None or isinstance(self.compile, bool),
             "True, False or None", TypeError)
        for name, low in (("block_size", 1), ("max_batch_size", 1),
                          ("max_num_batched_tokens", 1), ("weight_version", 0)):
            value = getattr(self, name)
            need(name, is_int(value) and value >= low, f"an int >= {low}")
        for name in ("num_blocks", "max_model_len"):
            value = getattr(self, name)
            need(name, value is None or is_int(value) and value >= 1, "an int >= 1 or None")
        frac = self.memory_fraction
        need("memory_fraction", is_number(frac) and 0 < frac <= 1, "in (0, 1]")
        as_dtype(self.dtype)
        torch.device(self.device)   # raises on a malformed device string
        # the CPU's decode graph (inference/decode.py) is compiled for float32
        cpu = torch.device(self.device).type == "cpu"
        graph = self.compile and self.attention_backend != "flex" and cpu
        need("dtype", not graph or self.dtype == "float32",
             "float32 for compile=True on the CPU (or leave compile off)")
        paged = self.attention_backend != "paged" or cpu and self.dtype == "float32"
        need("attention_backend", paged, "'auto', 'sdpa' or 'flex' unless on the CPU in float32")


# below this (and above 0) a temperature is greedy in all but name, and risks inf / NaN
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. top_k / top_p restrict what is drawn; the logprob recorded is that
    of the distribution drawn from: log_softmax(logits / T) over the whole vocabulary
    (T = 1 when greedy), renormalised over what top_k / top_p keep, see
    sample_with_logprobs."""
    temperature: float = 1.0            # 0 = greedy
    max_tokens: int = 256               # completion tokens at most
    stop_token_ids: frozenset = frozenset()
    top_k: int = 0                      # 0 = off
    top_p: float = 1.0                  # 1.0 = off
    seed: int | None = None             # the same tokens, whatever else is batched
    top_logprobs: int = 0               # record this many most likely tokens (OpenAI's)

    def __post_init__(self):
        t, stop, seed = self.temperature, self.stop_token_ids, self.seed
        need = functools.partial(require_field, self)
        need("temperature", is_number(t) and math.isfinite(t) and t >= 0,
             "a finite number >= 0")
        need("temperature", not 0 < t < MIN_TEMPERATURE,
             f"0 (greedy) or at least {MIN_TEMPERATURE}")
        need("max_tokens", is_int(self.max_tokens) and self.max_tokens >= 1, "an int >= 1")
        need("top_k", is_int(self.top_k) and self.top_k >= 0, "an int >= 0 (0 = off)")
        # a NaN top_p fails the comparison, as it should
        need("top_p", is_number(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]")
        need("stop_token_ids", hasattr(stop, "__iter__") and not isinstance(stop, (str, bytes)),
             "a set of ints", TypeError)
        need("stop_token_ids", all(is_int(s) and s >= 0 for s in stop), "ints >= 0")
        need("seed", seed is None or is_int(seed), "an int or None", TypeError)
        need("seed", seed is None or 0 <= seed < 2 ** 64, "in [0, 2**64)")
        need("top_logprobs", is_int(self.top_logprobs) and self.top_logprobs >= 0,
             "an int >= 0")
        object.__setattr__(self, "stop_token_ids", frozenset(stop))


@dataclass(frozen=True)
class TrainingSample:
    """One sample, as a trainer takes it. Per completion token: logprobs
    (log_softmax(logits / T) of the sampled token, T = 1 when greedy, renormalised over
    what top_k / top_p kept), token_versions (the weights that sampled it), top_logprobs
    (((token, logprob), ...) most likely first, when asked) and loss_mask (1 sampled, 0
    a multi-turn episode's environment id; () = all sampled)."""
    prompt_tokens: tuple
    # ends with the stop token when finish_reason == 'stop'
    completion_tokens: tuple
    logprobs: tuple
    ref_logprobs: tuple | None = None   # the engine never fills it; a trainer may
    weight_version: int = 0             # the oldest weights that produced one of its tokens
    finish_reason: str = "length"       # 'stop' | 'length'
    token_versions: tuple = ()
    request_id: int = -1                # what add_request returned
    sample_index: int = 0               # 0..num_samples-1 within its request
    top_logprobs: tuple = ()
    loss_mask: tuple = ()
    # EngineConfig(record_routes=True), an MoE model: the experts each position
    # 0 .. P + C - 2 was routed to in each MoE layer, int16 [P + C - 1, M, top_k] (routing
    # replay)
    routes: torch.Tensor | None = None


def sampled_mask(sample):
    """1 on the completion ids the engine sampled, 0 on a multi-turn
    episode's environment ids."""
    return sample.loss_mask or (1,) * len(sample.completion_tokens)


# -----------------------------------------------------------------------------
# the engine


class InferenceEngine:
    """Continuous batching over a paged KV cache. Single-threaded: every call runs on the
    caller's thread. self.cache is the block allocator (scheduler.BlockAllocator, or
    radix.RadixCache with cache_type='radix'), self.kv_cache the KV tensors
    (inference/attention.py's PagedKVCache)."""

    def __init__(self, config: EngineConfig, model: Transformer | None = None):
        require(isinstance(config, EngineConfig), f"config={config!r}: not EngineConfig", TypeError)
        given = model is not None or config.model_path is not None
        require(given, "no model given and EngineConfig.model_path is None")
        self.config = config
        self.device, self.dtype = torch.device(config.device), as_dtype(config.dtype)
        self.shares_base = model is not None and can_share_base(model, self.device, self.dtype)
        if model is None:
            model = load_hf_checkpoint(config.model_path, device=self.device,
                                       dtype=self.dtype)
        elif self.shares_base:
            model = lora.sharing_base(model)   # reads the trainer's frozen base, no copy
        else:
            model = own_copy(model, self.device, self.dtype)
        self.model = model.eval().requires_grad_(False)
        # name -> tensor sharing the parameter's storage (copy_ targets); with a shared
        # base (LoRA), the adapters only: the base is the trainer's, never written here
        self._params = model.state_dict()
        if self.shares_base:
            self._params = {k: t for k, t in self._params.items() if lora.is_adapter_key(k)}
        self.max_model_len = config.max_model_len or model.config.max_position_embeddings
        num_blocks = config.num_blocks or pool_size(config, model.config, self.max_model_len,
                                                    self.device, self.dtype)
        self.cache = make_cache(config, num_blocks)
        # one block more than the allocator hands out: the static decode
        # step's scratch block
        self.kv_cache = PagedKVCache(model.config, self.cache.num_blocks + 1,
                                     self.cache.block_size, self.device, self.dtype,
                                     routes=config.record_routes)
        self.scheduler_config = SchedulerConfig(config.max_batch_size,
                                                config.max_num_batched_tokens,
                                                self.cache.block_size)
        self.backend, self.compile = attention_choice(self.device.type, config.attention_backend,
                                                      config.compile, model.config.head_dim,
                                                      self.dtype)
        static = self.compile and self.backend in ("sdpa", "paged")
        ok, why = decode_graph_fits(model.config, self.device, self.dtype)
        require(ok or not static, f"compile=True on {self.device.type}: {why}; leave it off")
        self.static = StaticDecode(
            self.model, self.kv_cache, config.max_batch_size,
            -(-self.max_model_len // self.cache.block_size), self.cache.num_blocks,
            self.backend) if static else None
        self._version = config.weight_version
        self._staged = None                       # a non-blocking update (a Future)
        self._side = None                         # the thread that checks and copies it
        # update_weights calls not applied yet (staged, or replaced unapplied)
        self._updates_pending = 0
        self._rng = random.Random(config.seed)
        # per request, per sample
        self._request_ids, self._uids = itertools.count(), itertools.count(1)
        # Sequences; running in age order
        self.waiting, self.running = [], []
        self._undelivered = []  # finished samples generate() took from others' requests
        self._stats = dict(prefix_cache_hit_tokens=0, prefill_tokens=0, decode_tokens=0,
                           preemptions=0, steps=0, forks=0, generated_tokens=0, weight_updates=0,
                           compiled_steps=0)
        self._closed = False
        # sleep(): the freed storages and their sizes; the weights' values lost until the
        # next update (wake_up)
        self._asleep, self._weights_lost = [], False

    # ---- requests in

    def add_request(self, prompt, params: SamplingParams, num_samples: int = 1,
                    index: int = 0) -> int:
        """Queue a prompt (token ids) for num_samples samples; returns its request_id
        (TrainingSample.request_id). With params.seed, it draws as prompt `index` of
        a generate call."""
        self._check_request(params, num_samples, index, ("num_samples", "index"))
        prompt = check_prompt(prompt, self.model.config.vocab_size, self.max_model_len)
        check_fits(prompt, params, num_samples, self.cache, self.max_model_len, "prompt")
        return self._add(prompt, params, num_samples, index)

    def generate(self, prompts, sampling_params: SamplingParams, num_samples_per_prompt: int = 1,
                 first_index: int = 0) -> list:
        """Samples for every prompt, in request order: prompt 0 samples 0..G-1, prompt 1
        ... Each prompt is prefilled once and its blocks shared by its G samples. Every
        input is checked before anything is queued. With a seed, prompt i draws as
        prompt first_index + i of one big call would (a rank's slice of it)."""
        params = sampling_params
        self._check_request(params, num_samples_per_prompt, first_index,
                            ("num_samples_per_prompt", "first_index"))
        checked = check_prompts(prompts, self.model.config.vocab_size, self.max_model_len)
        for i, p in enumerate(checked):
            check_fits(p, params, num_samples_per_prompt, self.cache, self.max_model_len,
                       f"prompts[{i}]")
        ids = {self._add(p, params, num_samples_per_prompt, index=first_index + i)
               for i, p in enumerate(checked)}
        mine, others = [], []
        try:
            while any(s.request_id in ids for s in self.waiting + self.running):
                for s in self.step():
                    (mine if s.request_id in ids else others).append(s)
        except Exception:
            # a refused weight update, ...: this call's requests go, nothing else
            for request_id in ids:
                self.abort(request_id)
            raise
        finally:
            # another caller's samples: step() hands them out next
            self._undelivered += others
        # request_ids grow in request order
        return sorted(mine, key=lambda s: (s.request_id, s.sample_index))

    def has_pending(self) -> bool:
        return bool(self.waiting or self.running)

    def _check_request(self, params, num_samples, index, names):
        # names: what the caller calls num_samples and index
        self._check_open()
        lost = self._weights_lost and self._staged is None
        require(not self._asleep and not lost,
                "the engine is asleep, or awake without weights: wake_up(), then an update")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params={params!r}: not SamplingParams")
        n, limit, (name, index_name) = num_samples, self.config.max_batch_size, names
        require(is_int(n) and 0 < n <= limit, f"{name}={n!r}: not in [1, max_batch_size={limit}]")
        require(is_int(index) and 0 <= index < 2**63, f"{index_name}={index!r}: not in [0, 2**63)")

    def _add(self, prompt, params, num_samples, index=0):
        # a seeded request's draws depend on (its seed, its index in the generate call,
        # sample, position) only
        request_id = next(self._request_ids)
        seed = mix_seed(params.seed,
                        index) if params.seed is not None else self._rng.getrandbits(63)
        self.waiting.append(Sequence(next(self._uids), request_id, 0, prompt, params, num_samples,
                                     seed))
        return request_id

    # ---- one step: schedule, preempt, admit, allocate, forward, postprocess

    @torch.inference_mode()   # not just no_grad: no autograd dispatch or version counters
    def step(self) -> list:
        """One schedule and one forward. Returns the samples that finished in this step."""
        self._check_open()
        if self._staged is not None:  # a non-blocking update: applied whole, here
            staged, self._staged = self._staged, None
            try:
                tensors = staged.result()
            except Exception:
                self._updates_pending -= 1        # refused (or failed): nothing changed
                raise
            self._apply_weights(tensors)
        require(not self._asleep and not self._weights_lost,
                "step: the engine is asleep, or awake without weights: wake_up(), then an update")
        out, self._undelivered = self._undelivered, []
        if not self.has_pending():
            return out
        for seq in self.waiting[:max(self.config.max_batch_size - len(self.running), 0)]:
            self.cache.match_prefix(seq)
        sched = schedule(self.waiting, self.running, self.cache.num_free_blocks(),
                         self.scheduler_config)
        self._stats["steps"] += 1
        by_uid = {s.uid: s for s in self.running}
        self._preempt([by_uid[uid] for uid in sched.preempted])
        by_uid.update((s.uid, s) for s in self._admit(set(sched.admitted)))
        # decodes first
        batch = sorted(((by_uid[uid], n) for uid, n in sched.scheduled),
                       key=lambda x: x[1] > 1)
        if not batch:
            return out
        for seq, n in batch:
            # after the hits were taken: a fresh block may evict a named one
            self.cache.grow(seq, n)
        if self.static is not None and self.static.takes(batch):
            # one graph, sampler inside
            seqs = [seq for seq, _ in batch]
            tokens, logprobs = self.static(seqs)
            self._stats["compiled_steps"] += 1
            self._computed(batch)
            return out + self._append(seqs, tokens, logprobs, [None] * len(seqs))
        logits, ready = self._forward(batch)
        self._computed(batch)
        return out + self._sample(logits, [batch[b][0] for b in ready])

    def _preempt(self, victims):
        for seq in victims:
            self.cache.release(seq, cache=seq.kv_version == self._version)
        gone = {s.uid for s in victims}
        self.running = [s for s in self.running if s.uid not in gone]
        # the newest was preempted first: the oldest goes in front
        self.waiting[:0] = victims[::-1]
        self._stats["preemptions"] += len(victims)

    def _admit(self, uids):
        # schedule() admits a prefix of the waiting queue, in order
        seqs = [s for s in self.waiting[:len(uids)] if s.uid in uids]
        for seq in seqs:
            self.cache.take_prefix(seq)
            seq.kv_version = self._version
            self._stats["prefix_cache_hit_tokens"] += seq.num_cached_tokens
        self.waiting = self.waiting[len(seqs):]
        self.running += seqs
        return seqs

    def _forward(self, batch):
        """One model call over every scheduled token of the step (batch: (sequence, new
        tokens), decodes first), eager (with self.compile, FlexAttention through
        torch.compile). Returns the logits at the last token of each sequence that
        catches up in this step, and those sequences' indices in batch."""
        kv = self.kv_cache
        qlens = np.fromiter((n for _, n in batch), dtype=np.int64, count=len(batch))
        starts = np.fromiter((s.num_computed for s, _ in batch), dtype=np.int64,
                             count=len(batch))
        tokens = np.array([t for s, n in batch
                           for t in s.tokens[s.num_computed:s.num_computed + n]],
                          dtype=np.int64)
        ready = [b for b, (s, n) in enumerate(batch) if s.num_computed + n == s.num_tokens]
        last_rows = (np.cumsum(qlens) - 1)[ready]
        positions, slots, calls, (tokens, last_rows) = paged_step(
            kv, starts, qlens, [s.block_table for s, _ in batch], extras=(tokens, last_rows))
        attention = PagedAttention(kv, slots, calls, backend=self.backend,
                                   compiled=self.compile)
        # each MoE layer's experts, beside the K/V
        used = None if kv.routes is None else []
        hidden, _ = self.model(tokens, positions, attention=attention, routes_out=used)
        logits = self.model.logits(hidden[last_rows])
        if used is not None:
            routes = torch.stack(used, 1).to(torch.int16)
            kv.routes.view(-1, *kv.routes.shape[2:])[slots] = routes
        return logits, ready

    def _computed(self, batch):
        for seq, n in batch:  # what this step computed: prefill (catching up) or decode
            self._stats["prefill_tokens" if seq.catching_up else "decode_tokens"] += n
            seq.num_computed += n
            seq.catching_up = seq.num_computed < seq.num_tokens
            # name the newly full blocks (never those of older weights)
            if seq.kv_version == self._version:
                self.cache.name_computed(seq, n)

    def _sample(self, logits, ready):
        if not ready:
            return []
        # a group whose prompt just finished forks: one logits row each
        seqs, rows = [], []
        for j, seq in enumerate(ready):
            group = self._fork(seq) if seq.num_samples > 1 else [seq]
            seqs += group
            rows += [j] * len(group)
        if len(rows) != len(ready):
            logits = logits[torch.tensor(rows, device=logits.device)]
        tokens, logprobs = sample_next(seqs, logits)
        return self._append(seqs, tokens.tolist(), logprobs.tolist(),
                            top_logprobs(seqs, logits))

    def _append(self, seqs, tokens, logprobs, tops):
        """Each sequence's sampled token joins it; returns the samples that finished."""
        finished = []
        for seq, token, logprob, top in zip(seqs, tokens, logprobs, tops):
            reason = seq.append(token, logprob, self._version, self.max_model_len, top)
            if reason is not None:
                finished.append(self._finish(seq, reason))
        self._stats["generated_tokens"] += len(seqs)
        if finished:
            self.running = [s for s in self.running if s.finish_reason is None]
        return finished

    def _fork(self, seq):
        """The group's prompt is computed: seq becomes sample 0 and num_samples - 1
        siblings share its blocks (BlockAllocator.fork_table: a partial last block is
        copied for each)."""
        forks, copies = [seq], []
        base_seed, seq.seed = seq.seed, mix_seed(seq.seed, 0)
        for k in range(1, seq.num_samples):
            f = Sequence(next(self._uids), seq.request_id, k, seq.tokens, seq.params, 1,
                         mix_seed(base_seed, k))
            f.num_prompt, f.num_computed, f.kv_version = (seq.num_prompt, seq.num_computed,
                                                          seq.kv_version)
            f.catching_up, f.block_hashes = False, list(seq.block_hashes)
            f.block_table, copy = self.cache.fork_table(seq)
            copies += [copy] if copy else []
            forks.append(f)
        if copies:
            src, dst = zip(*copies)
            self.kv_cache.copy_blocks(torch.tensor(src, device=self.device),
                                     torch.tensor(dst, device=self.device))
        seq.num_samples = 1
        i = self.running.index(seq)
        self.running[i + 1:i + 1] = forks[1:]     # siblings are as old as their leader
        self._stats["forks"] += len(forks) - 1
        return forks

    def _finish(self, seq, reason):
        seq.finish_reason = reason
        routes = None if self.kv_cache.routes is None else \
            self.kv_cache.routes_of(seq.block_table, seq.num_tokens - 1)
        self.cache.release(seq, cache=seq.kv_version == self._version)
        return TrainingSample(prompt_tokens=tuple(seq.tokens[:seq.num_prompt]),
                              completion_tokens=tuple(seq.tokens[seq.num_prompt:]),
                              logprobs=tuple(seq.logprobs), weight_version=min(seq.versions),
                              finish_reason=reason, token_versions=tuple(seq.versions),
                              request_id=seq.request_id, sample_index=seq.sample_index,
                              top_logprobs=tuple(seq.top_logprobs), routes=routes)

    def recompute_running(self) -> int:
        """Send every running sample back to the waiting queue, its blocks freed, as
        preemption does: it goes on by prefilling its prompt and what it has sampled again,
        with the weights in then. After a weight update this makes a sample's later tokens
        the new weights' own (without it they attend to keys and values the old weights
        made). Returns how many went back."""
        self._check_open()
        victims = list(self.running)
        self._preempt(victims[::-1])
        return len(victims)

    def abort(self, request_id, sample_index=None) -> int:
        """Drop a request's samples (all, or the forked sample sample_index) wherever they
        are and free their blocks: they are never returned. Returns how many were
        dropped (0: finished or unknown)."""
        self._check_open()
        def hit(s):
            return s.request_id == request_id and (sample_index is None
                                                   or s.sample_index == sample_index
                                                   and s.num_samples == 1)
        gone = [s for s in self.waiting + self.running if hit(s)]
        for seq in gone:
            self.cache.release(seq, cache=seq.kv_version == self._version)
        self.waiting = [s for s in self.waiting if not hit(s)]
        self.running = [s for s in self.running if not hit(s)]
        self._undelivered = [s for s in self._undelivered if not hit(s)]
        return len(gone)

    # ---- weights

    def update_weights(self, state_dict, blocking: bool = True):
        """Load new weights, checked first (a bad state_dict is refused and changes
        nothing). blocking=True checks and copies now. blocking=False checks the layout
        now (names, shapes, dtypes: a ValueError / TypeError here) and returns: the
        value check and the copy into the engine's dtype and device run on a side
        thread, and the next step() applies the result whole (waiting for it if it is
        still going), or raises the refusal (non-finite values) with the engine
        unchanged. The tensors are the engine's to read until that step: do not change
        them in place before it (or pass a copy). A newer call replaces an unapplied
        one. Copies are in place: storage addresses and compiled graphs stay valid. The
        version goes up by one per call and the prefix cache is emptied, so no KV of
        older weights is ever served to a new request; running sequences keep theirs
        (each token records the version that sampled it)."""
        self._check_open()
        require(not self._asleep, "update_weights: the engine is asleep; wake_up() first")
        if self.shares_base and hasattr(state_dict, "keys"):
            whole = [k for k in state_dict.keys() if not lora.is_adapter_key(k)]
            require(not whole, f"state_dict: {first_five(whole)} are base weights; this engine "
                               f"shares its LoRA model's base: pass lora.adapter_state(model) "
                               f"(engine.update_from(model) does)")
        tensors = check_layout(state_dict, self._params)
        if blocking:
            check_values(tensors, self._params, self.dtype)
            self._staged = None
            # one version per call, even one a newer call superseded
            self._updates_pending += 1
            self._apply_weights(tensors)
            return
        if self._side is None:
            self._side = ThreadPoolExecutor(1, thread_name_prefix="engine-weights")
        if self._staged is not None:
            self._staged.cancel()                 # replaced before it was applied
        self._updates_pending += 1
        self._staged = self._side.submit(self._stage, tensors)

    def update_from(self, model):
        """update_weights with a trainer's model's current weights, however it holds
        them: the adapters alone (lora.adapter_state) when this engine shares the model's
        base; the whole weights one tensor at a time when it is sharded (FSDP2, each
        gathered) or has adapters (each merged), never all at once beside the engine's
        own; else its state_dict."""
        if self.shares_base:
            self.update_weights(lora.adapter_state(model))
        elif is_sharded(model) or lora.has_adapters(model):   # (merged one at a time)
            self.load_weights(full_tensors(lora.merged_items(model)))
        else:
            self.update_weights(model.state_dict())

    def load_weights(self, weights):
        """update_weights one tensor at a time, for a trainer whose model is sharded or
        adapted: weights yields (name, tensor) for every weight once (full_tensors
        gathers each as it goes, lora.merged_items merges it), and each is copied in as
        it comes, so the whole model never exists twice. Names and shapes are checked
        as they come (a trainer's own model: nothing to refuse but a bug); the version
        goes up once all are in."""
        self._check_open()
        require(not self._asleep, "load_weights: the engine is asleep; wake_up() first")
        seen = set()
        with torch.no_grad():   # (not inference_mode: the gathers and merges run in here)
            for name, t in weights:
                assert name in self._params and name not in seen, name
                assert t.shape == self._params[name].shape, (name, t.shape)
                self._params[name].copy_(t)
                seen.add(name)
        assert seen == set(self._params), sorted(set(self._params) - seen)[:3]
        self._updates_pending += 1
        self._applied()

    def _stage(self, tensors):
        # on the side thread: the value check, then a copy in the engine's dtype and device
        check_values(tensors, self._params, self.dtype)
        return [t.detach().to(self.device, self.dtype, copy=True) for t in tensors]

    def _apply_weights(self, tensors):
        # one fused copy of every tensor (casting dtypes and crossing devices like copy_),
        # in _params order
        with torch.inference_mode():
            torch._foreach_copy_(list(self._params.values()), tensors)
        self._applied()

    def _applied(self):
        # the pending updates are in: their versions counted, no KV of older weights served
        self._weights_lost = False
        self._version += self._updates_pending
        self._stats["weight_updates"] += self._updates_pending
        self._updates_pending = 0
        self.cache.invalidate()

    # ---- sleep: a colocated trainer's step needs neither the weights nor the KV pool

    def sleep(self):
        """Free the memory of the engine's own weights and of its KV pool until
        wake_up (vLLM's sleep mode, level 2: the values are dropped, not kept
        elsewhere), so a colocated trainer's optimizer step has it. Between rollouts
        only: nothing queued, running or staged. An engine sharing a LoRA base frees
        its adapters (the base is the trainer's)."""
        self._check_open()
        idle = not (self.waiting or self.running or self._staged or self._asleep)
        require(idle, "sleep: the engine is asleep, or has requests or an update pending")
        self.cache.invalidate()
        pools = [self.kv_cache.k, self.kv_cache.v]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage()
                    for t in [*self._params.values(), *pools]}
        for storage in storages.values():
            self._asleep.append((storage, storage.nbytes()))
            storage.resize_(0)
        if self.static is not None:   # a GPU's captured graphs read the old addresses
            self.static.graphs.clear()

    def wake_up(self):
        """Memory back for what sleep freed (new addresses: a GPU's decode graphs,
        dropped by sleep, are captured again on first use), the KV pool zeroed. The
        weights' values are gone: update_weights, load_weights or update_from before the
        next request or step."""
        self._check_open()
        require(self._asleep, "wake_up: the engine is not asleep")
        for storage, nbytes in self._asleep:
            storage.resize_(nbytes)
        self._asleep, self._weights_lost = [], True
        # paged attention reads the unwritten slots of a block (masked, but a NaN there
        # would still spread): the pool comes back as it started, zeros
        self.kv_cache.k.zero_(), self.kv_cache.v.zero_()

    def get_weight_version(self) -> int:
        return self._version

    # ---- housekeeping

    def flush_cache(self):
        """Forget the prefix cache (blocks in use are untouched)."""
        self._check_open()
        self.cache.invalidate()

    def stats(self) -> dict:
        return dict(self._stats, num_blocks=self.cache.num_blocks,
                    num_free_blocks=self.cache.num_free_blocks(),
                    cached_blocks=self.cache.num_cached_blocks(), waiting=len(self.waiting),
                    running=len(self.running), weight_version=self._version,
                    attention_backend=self.backend,
                    compile_seconds=self.static.compile_seconds if self.static else 0.0)

    def shutdown(self):
        """Drop the model and the KV pool; queued requests are abandoned. Later
        calls raise RuntimeError."""
        self._closed = True
        self.waiting, self.running, self._staged = [], [], None
        if self._side is not None:
            self._side.shutdown(wait=False)
        self.kv_cache = self.model = self.static = None

    def _check_open(self):
        if self._closed:
            raise RuntimeError("the engine was shut down")


# -----------------------------------------------------------------------------
# the engine's helpers: checks at its boundary (before anything is queued or
# copied), the pool's size, the block allocator, the attention, its own copy of a model


def check_prompt(prompt, vocab_size, max_model_len, where="prompt"):
    """A prompt as a list of ints, or a TypeError / ValueError naming what is wrong with
    it."""
    if isinstance(prompt, torch.Tensor):
        ints = prompt.dim() == 1 and not (prompt.is_floating_point() or prompt.dtype == torch.bool)
        require(ints, f"{where}: {prompt.dtype}{list(prompt.shape)}, not 1-D ints", TypeError)
    prompt = prompt.tolist() if isinstance(prompt, (torch.Tensor, np.ndarray)) else prompt
    listlike = hasattr(prompt, "__len__") and not isinstance(prompt, (str, bytes))
    require(listlike, f"{where}: a {type(prompt).__name__}, not a list of token ids", TypeError)
    require(len(prompt) > 0, f"{where} is empty: a prompt needs at least one token")
    # (a plain loop, not require: a message is formatted only when raised)
    for i, tok in enumerate(prompt):
        if not is_int(tok):
            raise TypeError(f"{where}[{i}] = {tok!r} is not an int token id")
        if not 0 <= tok < vocab_size:
            raise ValueError(f"{where}[{i}] = {tok} is outside the vocabulary [0, {vocab_size})")
    # at most max_model_len - 1 tokens: room for one new token
    n = len(prompt)
    require(n < max_model_len, f"{where} has {n} tokens, not below max_model_len={max_model_len}")
    return [int(t) for t in prompt]


def check_prompts(prompts, vocab_size, max_model_len):
    """A list of prompts (token-id lists), each checked by check_prompt; returns them as
    lists of ints."""
    listlike = hasattr(prompts, "__len__") and not isinstance(prompts, (str, bytes, torch.Tensor))
    flat = listlike and len(prompts) > 0 and is_int(prompts[0])
    got = "one list of ints (wrap it: [prompt])" if flat else type(prompts).__name__
    require(listlike and not flat, f"prompts: a list of token-id lists, not {got}", TypeError)
    return [check_prompt(p, vocab_size, max_model_len, f"prompts[{i}]")
            for i, p in enumerate(prompts)]


def check_layout(state_dict, params):
    """The tensors of state_dict in params' order, after checking names, shapes and dtypes
    (cheap: no value is read); otherwise a ValueError / TypeError naming the tensor."""
    mapping = hasattr(state_dict, "keys") and hasattr(state_dict, "__getitem__")
    require(mapping, f"state_dict: a {type(state_dict).__name__}, not a mapping", TypeError)
    names = set(state_dict.keys())   # (a mapping's keys() may be a list)
    if names != params.keys():
        missing = first_five(sorted(params.keys() - names))
        unknown = first_five(sorted(names - params.keys()))
        raise ValueError(f"state_dict: missing {missing}, unknown {unknown}")
    tensors = [state_dict[name] for name in params]
    # plain ifs: a message is formatted only when raised
    for (name, ours), t in zip(params.items(), tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(t).__name__}, not a tensor")
        if t.shape != ours.shape:
            raise ValueError(f"state_dict[{name!r}]: shape {list(t.shape)}, not {list(ours.shape)}")
        if not t.dtype.is_floating_point:
            raise ValueError(f"state_dict[{name!r}] has dtype {t.dtype}, expected a floating dtype")
    return tensors


def check_values(tensors, params, dtype):
    """tensors (check_layout's) when every value is finite once cast to the engine's
    dtype; otherwise a ValueError naming the tensor. It reads every value: the costly
    half of the check."""
    # one read of each tensor, one sync: a sum is non-finite when a value is NaN/inf;
    # where the cast to the engine's dtype could overflow (fp32 -> fp16), the largest
    # |value| must fit it. Only when that fails (or finite values overflow a sum) does an
    # exact check run, to name the tensor.
    limit = torch.finfo(dtype).max
    narrowing = [t.dtype != dtype and torch.finfo(t.dtype).max > limit for t in tensors]
    with torch.inference_mode():
        sums = [t.sum(dtype=torch.float32) for t, n in zip(tensors, narrowing) if not n]
        peaks = [torch.stack(torch.aminmax(t)).abs().max().float()
                 for t, n in zip(tensors, narrowing) if n]
        total, peak = _reduce(sums, torch.sum), _reduce(peaks, torch.max)
    if not (math.isfinite(total) and peak <= limit):     # a NaN peak fails the comparison
        for name, t, n in zip(params, tensors, narrowing):
            if not torch.isfinite(t.detach()).all():
                raise ValueError(f"state_dict[{name!r}] has non-finite values (NaN or inf)")
            if n and t.detach().abs().max() > limit:
                raise ValueError(f"state_dict[{name!r}]: values beyond {dtype}'s range {limit:g}")
    return tensors


def _reduce(scalars, fn):
    # a Python float from 0-d tensors, in one sync (one per device when they are
    # spread over several)
    if not scalars:
        return 0.0
    try:
        return fn(torch.stack(scalars)).item()
    except RuntimeError:
        return fn(torch.tensor([s.item() for s in scalars])).item()


def pool_size(config, model_config, max_model_len, device, dtype):
    """KV blocks for max_batch_size sequences at full length (what is left over serves the
    prefix cache), capped at memory_fraction of the device's free memory."""
    per_block = PagedKVCache.bytes_per_block(model_config, config.block_size, dtype)
    want = config.max_batch_size * -(-max_model_len // config.block_size)
    if device.type == "cuda":
        free_bytes = torch.cuda.mem_get_info(device)[0]
    else:
        free_bytes = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(1, min(want, int(free_bytes * config.memory_fraction) // per_block))


def make_cache(config, num_blocks):
    """'paged': block hashes over blocks of block_size tokens; 'radix': a radix tree
    over one-token blocks."""
    if config.cache_type == "radix":
        return RadixCache(num_blocks * config.block_size)
    return BlockAllocator(num_blocks, config.block_size)


def decode_graph_fits(cfg, device, dtype):
    """(whether a step of decodes can run as one graph for this model here, why not): on
    the CPU in float32 through the grouped expert matmul; on a GPU always (an MoE
    layer's capture runs every expert on every token: model.Experts)."""
    if torch.device(device).type != "cpu":
        return True, ""
    widths = f"{cfg.hidden_size} and {cfg.moe_intermediate_size}"
    return (dtype == torch.float32 and grouped_experts(cfg, device, dtype),
            f"float32, and hidden_size and moe_intermediate_size in multiples of 4, "
            f"got {widths}")


def attention_choice(device_type, backend, compile, head_dim, dtype=torch.float32):
    """(backend, compile) the engine runs. 'auto' is 'paged' on the CPU in float32 (SDPA
    for prefill, decodes reading the cache in place: attention.decode_kernel) and SDPA
    over the gathered blocks elsewhere, or where the kernel cannot be built (docs/speed.md
    says why). 'flex' stays selectable; compile=None compiles it on CUDA only, where it
    needs heads of at least 16 dims. With 'paged' or SDPA, compile=True runs the steps
    where every sequence decodes as one graph (decode.StaticDecode); None and False
    leave them eager."""
    if backend == "auto":
        cpu32 = device_type == "cpu" and dtype == torch.float32
        backend = "paged" if cpu32 and decode_kernel() else "sdpa"
    built = backend != "paged" or decode_kernel()   # decode_kernel printed why not
    require(built, "attention_backend='paged': its kernel could not be built", RuntimeError)
    if compile is None:
        compile = backend == "flex" and device_type == "cuda"
    flex_cuda = backend == "flex" and compile and device_type == "cuda"
    if flex_cuda and head_dim < 16:
        raise ValueError(f"compiled flex on CUDA needs head_dim >= 16, the model has {head_dim}: "
                         f"use attention_backend='sdpa'")
    return backend, compile


def can_share_base(model, device, dtype):
    """Whether an engine can read a trainer's model's frozen base itself: a LoRA model,
    whole (not sharded), on the engine's device and in its dtype."""
    if not isinstance(model, Transformer) or not lora.has_adapters(model) or is_sharded(model):
        return False
    weight = model.embed_tokens.weight   # ('cuda' is the current GPU: any index matches)
    same_device = weight.device.type == device.type and device.index in (None, weight.device.index)
    return same_device and weight.dtype == dtype


def own_copy(model, device, dtype):
    """The engine's own copy of a trainer's model, in its device and dtype: the trainer
    keeps stepping its parameters, and the engine must never alias them."""
    if not isinstance(model, Transformer):
        raise TypeError(f"model: a {type(model).__name__}, not a model.Transformer")
    with torch.device("meta"):
        own = Transformer(model.config)
    own = own.to_empty(device=device).to(dtype)
    mine = own.state_dict()
    with torch.no_grad():   # a sharded (FSDP2) model's tensors gathered one at a time
        for name, t in full_tensors(lora.merged_items(model)):
            mine[name].copy_(t)
    return own
