"""
The radix prefix cache (EngineConfig(cache_type='radix')): token-granular prefix
sharing, in the manner of SGLang's RadixAttention, behind the same interface as
scheduler.BlockAllocator so that the engine and schedule() do not care which one
they run on.

    # the KV pool is attention.PagedKVCache with block_size = 1
    cache = RadixCache(num_slots=1024)
    cache.match_prefix(seq)          # seq.num_cached_tokens: its longest cached prefix, in tokens
    cache.take_prefix(seq)           # admit it: share the slots of its cached prefix
    cache.grow(seq, n)               # then fresh slots for n new tokens
    cache.release(seq, cache=True)   # done: its computed tokens join the tree, its slots are let go

How it works:
  - the KV pool is one-token blocks ("slots"), so a sequence's block_table holds one
    slot per token and any prefix, whatever its length, can be shared;
  - a tree over token ids names computed KV: each edge is a run of token ids and owns
    their slots, and the path from the root to a point spells a prefix. A new request
    walks it and takes the longest match;
  - a slot's refcount counts its holders: the running sequences whose block_table has
    it, plus one if it is in the tree. Free = refcount 0. A tree slot that only the tree
    holds can be evicted, and counts as free;
  - when a sequence's computed tokens are inserted and part of them is already in the
    tree (two requests computed the same prefix at once), the sequence switches to the
    tree's slots and lets its own copies go. So the tree slots a sequence holds always
    form one path from the root, and a tree slot that only the tree holds has no holder
    anywhere below it: evicting least recently used leaves (their unheld tails) reclaims
    exactly the slots counted free;
  - what is inserted: a prompt as soon as it is computed (the G samples of a group and
    concurrent requests share it), and a sample's whole computed sequence when it
    finishes or is preempted (the engine says whether its KV is of the current weights);
    new weights forget the whole tree (invalidate).

The cost against 'paged': block tables and the attention gather go one token at a time
instead of one block_size-token block at a time, and each lookup walks the tree in
Python (bench/bench.py's multi-turn row).
"""

import heapq
import itertools


class Node:
    """An edge of the tree and the point it leads to: key = the edge's token ids, slots =
    their KV slots."""
    __slots__ = ("key", "slots", "parent", "children", "last_used")

    def __init__(self, key, slots, parent, last_used=0):
        self.key, self.slots, self.parent = key, slots, parent
        self.children = {}           # first token id of the child's edge -> child
        self.last_used = last_used   # the LRU clock when a request last walked through it


def common_length(a, b):
    """How many leading items a and b share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


class RadixCache:
    """Which KV slot is whose, with a radix tree as the prefix cache. The interface of
    scheduler.BlockAllocator with block_size = 1 (a "block" is one token's slot)."""

    block_size = 1

    def __init__(self, num_slots):
        self.num_blocks = num_slots
        # holders: running sequences, + 1 while the slot is in the tree
        self.refcount = [0] * num_slots
        self.in_tree = [False] * num_slots
        # refcount 0, handed out from the end
        self.free = list(range(num_slots - 1, -1, -1))
        self.num_evictable = 0   # tree slots whose only holder is the tree
        self.num_evicted = 0     # slots evicted so far (tests read it)
        self.root = Node([], [], None)
        self._clock = itertools.count(1)

    def num_free_blocks(self):
        return len(self.free) + self.num_evictable

    def num_cached_blocks(self):
        return sum(self.in_tree)

    # ---- one slot

    def _hold(self, slot):
        self.refcount[slot] += 1
        if self.in_tree[slot] and self.refcount[slot] == 2:
            self.num_evictable -= 1

    def _drop(self, slot):
        assert self.refcount[slot] > 0, f"slot {slot} let go more often than held"
        self.refcount[slot] -= 1
        if self.refcount[slot] == 0:
            self.free.append(slot)
        elif self.in_tree[slot] and self.refcount[slot] == 1:
            self.num_evictable += 1

    def _take_into_tree(self, slot):
        # a held slot joins the tree: one more holder, and not evictable while the
        # sequence holds it
        self.in_tree[slot] = True
        self.refcount[slot] += 1

    # ---- the tree

    def _lookup(self, tokens):
        """The slots of the longest cached prefix of tokens, and the nodes walked (for
        the LRU clock)."""
        node, n, slots, path = self.root, 0, [], []
        while n < len(tokens):
            child = node.children.get(tokens[n])
            if child is None:
                break
            k = common_length(child.key, tokens[n:n + len(child.key)])
            slots += child.slots[:k]
            path.append(child)
            if k < len(child.key):
                break
            node, n = child, n + k
        return slots, path

    def _split(self, node, k):
        """Cut node's edge after k tokens: a new node takes the first k and becomes node's
        parent. Example: edge [5, 6, 7] (slots [40, 41, 42]) cut at 1 -> parent edge [5]
        ([40]), child edge [6, 7]."""
        top = Node(node.key[:k], node.slots[:k], node.parent, node.last_used)
        node.parent.children[node.key[0]] = top
        node.key, node.slots, node.parent = node.key[k:], node.slots[k:], top
        top.children[node.key[0]] = node
        return top

    def _insert(self, seq):
        """Put a sequence's computed tokens in the tree. Where the tree has them already,
        the sequence switches to the tree's slots (and lets its own go); the rest become
        a new leaf that owns the sequence's slots."""
        tokens, table, now = seq.tokens[:seq.num_computed], seq.block_table, next(self._clock)
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = Node(tokens[i:], table[i:len(tokens)], node, now)
                node.children[tokens[i]] = leaf
                for slot in table[i:len(tokens)]:
                    self._take_into_tree(slot)
                return
            k = common_length(child.key, tokens[i:i + len(child.key)])
            for j, theirs in enumerate(child.slots[:k]):
                if table[i + j] != theirs:
                    self._hold(theirs)
                    self._drop(table[i + j])
                    table[i + j] = theirs
            child.last_used = now
            if k < len(child.key):
                if i + k == len(tokens):
                    return  # the sequence ends inside this edge: nothing new to add
                child = self._split(child, k)
            node, i = child, i + k

    def evict(self, need):
        """Free slots until `need` are free, evicting the unheld tails of least
        recently used leaves."""
        leaves = [(n.last_used, id(n), n) for n in self._nodes() if not n.children
                  and self._unheld_tail(n)]
        heapq.heapify(leaves)
        while len(self.free) < need and leaves:
            _, _, leaf = heapq.heappop(leaves)
            k = len(leaf.slots) - self._unheld_tail(leaf)
            for slot in leaf.slots[k:]:
                self.in_tree[slot], self.refcount[slot] = False, 0
                self.free.append(slot)
            self.num_evictable -= len(leaf.slots) - k
            self.num_evicted += len(leaf.slots) - k
            if k:   # part of the edge is still held: it stays, shortened
                leaf.key, leaf.slots = leaf.key[:k], leaf.slots[:k]
                continue
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and self._unheld_tail(parent):
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))

    def _unheld_tail(self, node):
        # how many of the edge's last slots only the tree holds (refcounts never grow
        # along an edge)
        n = 0
        while n < len(node.slots) and self.refcount[node.slots[-1 - n]] == 1:
            n += 1
        return n

    def _nodes(self):
        stack, out = [self.root], []
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out[1:]

    def invalidate(self):
        """Forget the tree (new weights: no old KV may be served again); slots running
        sequences hold stay theirs."""
        for node in self._nodes():
            for slot in node.slots:
                self.in_tree[slot] = False
                self._drop(slot)
        self.num_evictable = 0
        self.root = Node([], [], None)

    # ---- a sequence's slots (what the engine calls, as on BlockAllocator)

    def match_prefix(self, seq):
        """How much of a waiting sequence's prefix is cached (keeping >= 1 token to
        compute: its logits), written to seq.num_cached_tokens / num_cached_free_blocks
        for schedule() to read."""
        slots, _ = self._lookup(seq.tokens[:seq.num_tokens - 1])
        seq.num_cached_tokens = len(slots)
        seq.num_cached_free_blocks = sum(self.refcount[s] == 1 for s in slots)

    def take_prefix(self, seq):
        """Admit a sequence: hold the slots of its matched prefix (match_prefix
        ran this step)."""
        slots, path = self._lookup(seq.tokens[:seq.num_cached_tokens])
        now = next(self._clock)
        for node in path:
            node.last_used = now
        for slot in slots:
            self._hold(slot)
        seq.block_table = slots
        seq.num_computed = seq.num_cached_tokens

    def grow(self, seq, num_new_tokens):
        """Fresh slots until the sequence's table covers num_computed + num_new_tokens
        tokens."""
        need = seq.num_computed + num_new_tokens - len(seq.block_table)
        if need > len(self.free):
            self.evict(need)
        if need > len(self.free):
            raise RuntimeError("out of KV slots: the scheduler should have preempted")
        for _ in range(need):
            slot = self.free.pop()
            self.refcount[slot] = 1
            seq.block_table.append(slot)

    def name_computed(self, seq, num_new_tokens):
        """After a step: a prompt whose tokens were computed goes into the tree at
        once (decoded tokens wait for release). The caller checks the KV is of
        the current weights."""
        if seq.num_computed - num_new_tokens < seq.num_prompt:
            self._insert(seq)

    def fork_table(self, seq):
        """A sibling's block table: every slot shared (one-token blocks are never
        partial, so nothing is copied)."""
        for slot in seq.block_table:
            self._hold(slot)
        return list(seq.block_table), None

    def release(self, seq, cache=False):
        """Let go of a sequence's slots and forget its KV; cache=True (its KV is of the
        current weights) first puts its computed tokens in the tree."""
        if cache and seq.num_computed:
            self._insert(seq)
        for slot in reversed(seq.block_table):
            self._drop(slot)
        seq.block_table, seq.num_computed, seq.kv_version, seq.catching_up = [], 0, None, True
