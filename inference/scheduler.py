"""
The engine's bookkeeping, no tensors: which KV block is whose (BlockAllocator, with
prefix caching), one sample's lifecycle (Sequence), and which sequences run in a step
(schedule, a pure function).

    alloc = BlockAllocator(num_blocks=64, block_size=16)
    out = schedule(waiting, running, alloc.num_free_blocks(), SchedulerConfig(256, 2048, 16))
    out.scheduled    # ((uid, num_new_tokens), ...): this step's batch
    out.admitted     # uids taken from the waiting queue
    out.preempted    # uids to free and recompute later

How it works:
  - the KV of every sequence lives in fixed-size blocks of attention.PagedKVCache; the
    allocator hands them out with refcounts, so that sequences can share blocks (a GRPO
    group shares its prompt's);
  - a full block is named by a hash of its tokens and of the hash of the block before it
    (the whole prefix), so a new request whose prefix was computed before finds its
    blocks and skips that prefill ("prefix caching"); a freed block keeps its name until
    it is evicted (LRU), and every name is forgotten when the weights change;
  - each step, schedule() picks which sequences run and how many new tokens each feeds
    (decodes first, then prefill chunks) under a batch size and a token budget, and
    preempts the newest sequences when blocks run out (they are freed and recomputed
    later, mostly from the prefix cache).
"""

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import xxhash

# -----------------------------------------------------------------------------
# a sequence: one sample's lifecycle


class Sequence:
    """One sample being generated (or, before its prompt is prefilled, a whole
    group of num_samples)."""

    def __init__(self, uid, request_id, sample_index, prompt, params, num_samples, seed):
        self.uid = uid                     # unique per sample: schedule()'s name for it
        self.request_id, self.sample_index, self.params = request_id, sample_index, params
        self.tokens = list(prompt)         # prompt + completion so far
        self.num_prompt = len(prompt)
        self.num_samples = num_samples     # > 1: forks into this many after its prompt
        self.seed = seed                   # this sample's sampling noise is a function of it
        self.num_computed = 0              # tokens whose KV is in this sequence's blocks
        self.block_table = []              # block of tokens[i] = block_table[i // block_size]
        self.block_hashes = []             # hash of each full block of tokens (a chain)
        self.num_cached_tokens = 0         # hit if admitted now (set before schedule())
        self.num_cached_free_blocks = 0    # ... its free blocks (admitting revives them)
        self.kv_version = None             # the weights that computed this sequence's KV
        # per completion token: its logprob, the weights that sampled it
        self.logprobs, self.versions = [], []
        self.top_logprobs = []             # per new token, when params.top_logprobs > 0
        self.finish_reason = None
        self.catching_up = True            # computing known tokens (prefill or recompute)

    @property
    def num_tokens(self):
        return len(self.tokens)

    def append(self, token, logprob, version, max_model_len, top=None):
        """A sampled token joins the sequence; returns why that finished it ('stop' |
        'length'), or None."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if top is not None:
            self.top_logprobs.append(top)
        if token in self.params.stop_token_ids:
            return "stop"
        if (
            self.num_tokens - self.num_prompt >= self.params.max_tokens
            or self.num_tokens >= max_model_len
        ):
            return "length"
        return None


# -----------------------------------------------------------------------------
# prefix hashing and the block allocator


def compute_block_hash(block_token_ids, parent_hash):
    """The name of a full KV block: xxh64 over the parent block's hash (0 for the first
    block) and the block's token ids as little-endian int64 (fixed width: ids go past
    255, and [1, 23] must not read like [12, 3])."""
    h = xxhash.xxh64()
    h.update(int(parent_hash or 0).to_bytes(8, "little"))
    h.update(np.asarray(block_token_ids, dtype="<i8").tobytes())
    return h.intdigest()


class BlockAllocator:
    """Which KV block is whose. Refcounted blocks (sequences share prefix blocks); a full
    block may carry a hash, and the hash -> block table is the prefix cache. A block
    whose refcount drops to 0 is free but keeps its hash, so it can still be hit, until
    a fresh block is needed and nothing unnamed is free: then the least recently freed
    named block is evicted (LRU) and loses its name."""

    def __init__(self, num_blocks, block_size):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refcount = [0] * num_blocks
        self.block_hash = [None] * num_blocks
        self.cached = {}  # hash -> block, for every named block (free or in use)
        # free, unnamed: handed out first (a stack)
        self.free_plain = list(range(num_blocks - 1, -1, -1))
        # free, named: oldest first (the LRU eviction order)
        self.free_cached = OrderedDict()

    def num_free_blocks(self):
        return len(self.free_plain) + len(self.free_cached)

    def num_cached_blocks(self):
        return len(self.cached)

    # ---- one block

    def allocate(self):
        """A fresh block with refcount 1 (evicting the least recently freed named block
        if it must)."""
        if self.free_plain:
            block = self.free_plain.pop()
        elif self.free_cached:
            block, _ = self.free_cached.popitem(last=False)
            del self.cached[self.block_hash[block]]
            self.block_hash[block] = None
        else:
            raise RuntimeError("out of KV blocks: the scheduler should have preempted")
        self.refcount[block] = 1
        return block

    def share(self, block):
        """One more holder of a block (a prefix-cache hit, or a forked sample); revives a
        free named block."""
        if self.refcount[block] == 0:
            del self.free_cached[block]  # only named blocks can be hit while free
        self.refcount[block] += 1

    def free(self, block):
        assert self.refcount[block] > 0, f"block {block} freed more often than held"
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            if self.block_hash[block] is None:
                self.free_plain.append(block)
            else:
                self.free_cached[block] = None    # most recently freed last

    def lookup(self, block_hash):
        return self.cached.get(block_hash)

    def register(self, block, block_hash):
        """Name a full block whose KV is computed, unless that name is already taken (then
        this block stays unnamed: two sequences computed the same prefix at once, and
        one copy is enough)."""
        if self.block_hash[block] is None and block_hash not in self.cached:
            self.block_hash[block] = block_hash
            self.cached[block_hash] = block

    def invalidate(self):
        """Forget every name (new weights: no old KV may be served again). Free named
        blocks become plain free."""
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self.free_plain.extend(self.free_cached)
        self.free_cached.clear()

    # ---- a sequence's blocks

    def hash_blocks(self, seq):
        # hash every full block of the sequence's tokens, once: the chain only grows
        # (tokens are only appended)
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(compute_block_hash(seq.tokens[i * bs:(i + 1) * bs], parent))

    def match_prefix(self, seq):
        """How much of a waiting sequence's prefix is in named blocks (keeping >= 1 token
        to compute: its logits), written to seq.num_cached_tokens /
        num_cached_free_blocks for schedule() to read."""
        self.hash_blocks(seq)
        n, free_hits = 0, 0
        for h in seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]:
            block = self.lookup(h)
            if block is None:
                break
            n += 1
            free_hits += self.refcount[block] == 0
        seq.num_cached_tokens, seq.num_cached_free_blocks = n * self.block_size, free_hits

    def take_prefix(self, seq):
        """Admit a sequence: share its matched prefix blocks (match_prefix ran this step)."""
        for h in seq.block_hashes[:seq.num_cached_tokens // self.block_size]:
            block = self.lookup(h)
            self.share(block)
            seq.block_table.append(block)
        seq.num_computed = seq.num_cached_tokens

    def grow(self, seq, num_new_tokens):
        """Fresh blocks until the sequence's table covers num_computed + num_new_tokens
        tokens."""
        for _ in range(
            -(-(seq.num_computed + num_new_tokens) // self.block_size) - len(seq.block_table)
        ):
            seq.block_table.append(self.allocate())

    def name_computed(self, seq, num_new_tokens):
        """Name the blocks that the last num_new_tokens tokens filled (the caller checks
        they are of the current weights: a block computed by older weights is never
        named)."""
        self.hash_blocks(seq)
        for i in range((seq.num_computed - num_new_tokens) // self.block_size,
                       seq.num_computed // self.block_size):
            self.register(seq.block_table[i], seq.block_hashes[i])

    def fork_table(self, seq):
        """A sibling's block table: the sequence's blocks shared, but a partial last block
        gets a fresh private block (each sample writes its own tokens there). Returns
        (table, (src, dst) of the copy or None)."""
        partial = seq.num_tokens % self.block_size != 0
        shared = seq.block_table[:-1] if partial else seq.block_table
        for b in shared:
            self.share(b)
        if not partial:
            return list(shared), None
        private = self.allocate()
        return shared + [private], (seq.block_table[-1], private)

    def release(self, seq, cache=False):
        """Free a sequence's blocks (tail first, so LRU evicts suffixes before prefixes)
        and forget its KV. Its full blocks were named as they were computed
        (name_computed), so `cache` (RadixCache's flag) changes nothing."""
        for b in reversed(seq.block_table):
            self.free(b)
        seq.block_table, seq.num_computed, seq.kv_version, seq.catching_up = [], 0, None, True


# -----------------------------------------------------------------------------
# scheduling: a pure function of the queues and the free blocks


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int
    max_num_batched_tokens: int
    block_size: int


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple   # ((uid, num_new_tokens), ...): this step's batch, in order
    admitted: tuple    # uids taken from the waiting queue (they are in scheduled too)
    preempted: tuple   # uids to free and send back to the front of the waiting queue, in this order


def check_fits(prompt, params, num_samples, blocks, max_model_len, where):
    """Refuse now a request that could never fit the block pool, even alone, rather than
    let it starve later."""
    bs, P = blocks.block_size, len(prompt)
    longest = min(P + params.max_tokens - 1, max_model_len)
    need = max(-(-longest // bs), -(-P // bs) + (num_samples - 1 if P % bs else 0))
    if need > blocks.num_blocks:
        raise ValueError(f"{where} needs {need} KV blocks > num_blocks={blocks.num_blocks}")


def blocks_needed(seq, num_new_tokens, block_size, num_computed=None):
    """Fresh blocks a sequence needs to compute num_new_tokens more tokens. A group whose
    prompt completes in this step also needs num_samples - 1 private copies of the
    prompt's last block when that block is partial."""
    done = seq.num_computed if num_computed is None else num_computed
    end = done + num_new_tokens
    need = -(-end // block_size) - -(-done // block_size)
    if seq.num_samples > 1 and end == seq.num_tokens and seq.num_tokens % block_size:
        need += seq.num_samples - 1
    return need


def schedule(waiting, running, num_free_blocks, scheduler_config) -> SchedulerOutput:
    """Pick this step's batch. Reads the sequences (num_tokens, num_computed, block_table,
    num_samples, and for waiting ones num_cached_tokens / num_cached_free_blocks),
    never writes them.

    1. Running sequences, oldest first, each as many new tokens as it has (a prefill
       is chunked to the token budget). The engine admits in order and a prefill
       finishes before anything admitted after it starts, so the prefilling sequences
       are the newest: in practice this is decodes first, then prefill chunks. When the
       free blocks don't cover one, the newest running sequence is preempted (its
       blocks counted free once no other running sequence holds them) until they do; if
       that newest one is the sequence itself, it is preempted and the step stops there.
    2. Only if nothing was preempted: waiting sequences in order (no skipping ahead),
       each starting after its prefix-cache hit, while the batch has room (a group
       counts as its num_samples sequences), the token budget lasts and the blocks
       suffice.
    Every request finishes: the oldest running sequence is never preempted while another
    exists, and the engine refuses a request that could not fit the pool alone."""
    budget, free = scheduler_config.max_num_batched_tokens, num_free_blocks
    scheduled, preempted, budget, free = _schedule_running(list(running), budget, free,
                                                           scheduler_config)
    admitted = []
    if not preempted:
        num_seqs = len(running)
        for seq in waiting:
            if budget == 0 or num_seqs + seq.num_samples > scheduler_config.max_batch_size:
                break
            n = min(seq.num_tokens - seq.num_cached_tokens, budget)
            need = blocks_needed(seq, n, scheduler_config.block_size,
                                 num_computed=seq.num_cached_tokens)
            if need + seq.num_cached_free_blocks > free:
                break
            scheduled.append((seq.uid, n))
            admitted.append(seq.uid)
            budget -= n
            free -= need + seq.num_cached_free_blocks
            num_seqs += seq.num_samples
    return SchedulerOutput(tuple(scheduled), tuple(admitted), tuple(preempted))


def _schedule_running(order, budget, free, scheduler_config):
    # step 1 of schedule(): order is oldest first, so its last sequence is the newest, the
    # first to be preempted
    scheduled, preempted, holders = [], [], None
    i = 0
    while i < len(order) and budget > 0 and len(scheduled) < scheduler_config.max_batch_size:
        seq = order[i]
        n = min(seq.num_tokens - seq.num_computed, budget)
        need = blocks_needed(seq, n, scheduler_config.block_size)
        while need > free:
            if holders is None:
                # who holds each block: only running sequences hold blocks
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
                return scheduled, preempted, budget, free
        scheduled.append((seq.uid, n))
        budget -= n
        free -= need
        i += 1
    return scheduled, preempted, budget, free
