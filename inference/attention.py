"""
The paged KV cache and the attention that reads it, as the small objects the engine
hands to model.Transformer's forward (`attention=`), called by every layer as
attention(layer_idx, q, k, v) -> [T, heads, head_dim]:

  PagedKVCache      each sequence's past keys and values, in blocks; the engine (engine.py)
                    decides which block is whose
  paged_step        turns those decisions into the step's slots, padded calls and masks
  PagedAttention    writes the step's keys and values into their slots and attends over
                    each sequence's blocks (SDPA, or FlexAttention reading them in place)
  decode_kernel     on the CPU, decodes' attention reading the blocks in place: a short
                    C++ loop (inference/paged_attention.cpp), built on first use
  DecodeAttention   the same, for a step where every sequence decodes, as one graph sees it
                    (EngineConfig(compile=True), inference/decode.py)

Training's attention over packed documents is model.DocumentCausalAttention. Both compute
exactly what transformers' eager attention computes (the tests compare).
"""

import functools
import math
import os
import platform
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from inference.sampling import scratch
from model import compile_once


# -----------------------------------------------------------------------------
# the paged KV cache and the attention that reads it


@functools.cache
def decode_kernel():
    """The C++ decode attention (inference/paged_attention.cpp) as a module with one
    function, decode_attention(q [B, heads, D], k_pool, v_pool, block_tables, positions
    [B], scale); loading it also registers the decode graph's op paged_decode_cpp (see
    DecodeAttention). None, with the reason printed, where it cannot be built (no C++
    compiler or ninja). Built by torch's extension builder on first use (tens of
    seconds), then loaded from its folder under ~/.cache/torch_extensions, which is
    named by the source's path, contents and flags and the CPU's instruction sets: one
    build per checkout and kind of CPU (-march=native code may not run on another, and
    a home directory may be shared by machines with different CPUs)."""
    from torch.utils.cpp_extension import get_default_build_root, load
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "paged_attention.cpp")
    # -ffast-math for the compile only: vectorised expf and sums (see the source)
    flags = ["-O3", "-march=native", "-ffast-math"]
    with open(source, "rb") as f:
        digest = zlib.crc32(f.read() + source.encode() + " ".join(flags).encode()
                            + _cpu_features().encode())
    name = f"nanorl_paged_attention_{digest:08x}"
    folder = os.path.join(get_default_build_root(), name)
    if not os.path.exists(os.path.join(folder, f"{name}.so")):
        print(f"building inference/paged_attention.cpp into {folder} (tens of seconds, once)")
    os.makedirs(folder, exist_ok=True)
    try:
        return load(name, [source], extra_cflags=flags, build_directory=folder)
    except Exception as e:   # what the builder raises varies: compiler, ninja, linker
        print(f"inference/paged_attention.cpp could not be built: {str(e)[:300]}")
        return None


def _cpu_features():
    # what -march=native compiles for: on Linux the instruction sets /proc/cpuinfo lists
    # (x86's "flags", ARM's "Features")
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.machine() + platform.processor()


class PagedKVCache:
    """Every layer's keys and values, in blocks of `block_size` token slots.

    k[layer] and v[layer] are [num_blocks, block_size, kv_heads, head_dim]: a block is
    one contiguous chunk, so gathering a batch's blocks is one index_select of whole
    blocks, and [B * blocks, block_size, H, D] views as [B, L, H, D] -> transposed to
    [B, H, L, D] for attention, with no copy. Token p of a sequence lives in slot p %
    block_size of block block_table[p // block_size]. cfg is the model's ModelConfig.

    routes=True (an MoE model; EngineConfig.record_routes) keeps, beside each token's
    keys and values, the experts it was routed to in each MoE layer, [num_blocks,
    block_size, M, top_k] (-1: not computed yet): a sample's routes are read back by its
    block table, prefix-cache hits included (routing replay, training.py)."""

    def __init__(self, cfg, num_blocks, block_size, device="cpu", dtype=torch.float32,
                 routes=False):
        shape = (cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads,
                 cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        for pool in (self.k, self.v):
            # its sizes never change: compiled code (inference/decode.py) takes them as
            # constants, not as symbols that could be mistaken for other sizes that happen
            # to be equal
            torch._dynamo.mark_static(pool)
        moe_layers = sum(map(cfg.is_moe_layer, range(cfg.num_hidden_layers)))
        self.routes = None if not (routes and moe_layers) else torch.full(
            (num_blocks, block_size, moe_layers, cfg.num_experts_per_tok), -1, device=device,
            dtype=torch.int16)

    @property
    def block_size(self):
        return self.k.shape[2]

    @staticmethod
    def bytes_per_block(cfg, block_size, dtype):
        per_layer = block_size * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
        return 2 * cfg.num_hidden_layers * per_layer

    def copy_blocks(self, src, dst):
        """Copy blocks src -> dst (1-D index tensors) in every layer: a forked sequence's
        private copy of a shared block."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
        if self.routes is not None:
            self.routes[dst] = self.routes[src]

    def routes_of(self, block_table, num_positions):
        """The routes of positions 0 .. num_positions - 1 of a sequence, [P, M, top_k]
        int16."""
        pos = torch.arange(num_positions)
        table = torch.as_tensor(block_table, dtype=torch.int64)
        slots = (table[pos // self.block_size] * self.block_size + pos % self.block_size)
        return self.routes.view(-1, *self.routes.shape[2:])[slots.to(self.routes.device)].cpu()


@dataclass(frozen=True)
class PaddedCall:
    """Sequences that attend in one padded call: rows [start, start + num_tokens) of the
    step's flat batch. Sequence b's queries are the call's rows query_index[b]
    (padded to Qmax by repeating its last row), they sit at positions query_pos[b],
    and its blocks are block_tables[b]. query_index / token_row are None when every
    sequence of the call has Qmax new tokens (decodes: Qmax = 1): the rows are then
    already [B, Qmax] row-major."""
    start: int
    num_tokens: int
    block_tables: torch.Tensor              # [B, blocks] int64
    query_pos: torch.Tensor                 # [B, Qmax] int64
    # [B, Qmax] int64, rows within the call
    query_index: torch.Tensor | None = None
    # [num_tokens] int64: each row's place in the padded [B * Qmax]
    token_row: torch.Tensor | None = None


def paged_step(kv, starts, qlens, block_tables, extras=()):
    """A step's paged metadata from each sequence's (tokens already computed, new tokens,
    block table), with the sequences ordered decodes first (qlen 1), then prefill
    chunks: each kind becomes one PaddedCall. Built in numpy and moved to the device in
    one copy, with `extras` (more int64 arrays the caller wants on the device) riding
    along. Returns (positions [T], slot_mapping [T], the calls, extras as tensors).

    A worked example, block_size 4. Three sequences: A decodes its token 5 (blocks [3,
    7]), B runs a prefill chunk of 3 tokens from 0 (blocks [5]), C a chunk of 2 from 4
    (blocks [1, 6]):
      qlens [1, 3, 2] -> cu [0, 1, 4, 6]; row_of [0, 1, 1, 1, 2, 2]; positions [5, 0, 1, 2, 4, 5]
      slots = block * 4 + position % 4
            -> [7*4+1, 5*4+0, 5*4+1, 5*4+2, 6*4+0, 6*4+1] = [29, 20, 21, 22, 24, 25]
      decodes: rows [0, 1), Qmax 1, query_pos [[5]]
      prefills: rows [1, 6), Qmax 3, query_pos [[0, 1, 2], [4, 5, 5]]; C has 2 < Qmax rows, so
        query_index [[0, 1, 2], [3, 4, 4]] (C's last row repeated) and token_row [0, 1, 2, 3, 4]
        (row r of the call sits at place token_row[r] of the padded [B * Qmax] output)."""
    bs, B = kv.block_size, len(qlens)
    ends = starts + qlens
    cu = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(qlens, out=cu[1:])
    tables = np.zeros((B, int(-(-ends.max() // bs))), dtype=np.int64)
    for b, table in enumerate(block_tables):
        tables[b, :len(table)] = table
    row_of = np.repeat(np.arange(B), qlens)             # each new token's sequence,
    offset = np.arange(int(cu[-1])) - cu[:-1][row_of]   # and its place in that chunk
    pos = starts[row_of] + offset
    parts, specs = [pos, tables[row_of, pos // bs] * bs + pos % bs, *extras], []
    num_decodes = int((qlens == 1).sum())
    for lo, hi in ((0, num_decodes), (num_decodes, B)):
        if lo == hi:
            continue
        Qmax, n_blocks = int(qlens[lo:hi].max()), int(-(-ends[lo:hi].max() // bs))
        # pad by repeating the last
        within = np.minimum(np.arange(Qmax)[None, :], (qlens[lo:hi] - 1)[:, None])
        parts += [tables[lo:hi, :n_blocks].ravel(),
                  (starts[lo:hi, None] + within).ravel()]
        uniform = bool((qlens[lo:hi] == Qmax).all())
        if not uniform:
            rows = slice(cu[lo], cu[hi])
            parts += [(cu[lo:hi, None] - cu[lo] + within).ravel(),
                      (row_of[rows] - lo) * Qmax + offset[rows]]
        specs.append((int(cu[lo]), int(cu[hi] - cu[lo]), hi - lo, n_blocks, Qmax, uniform))
    flat = torch.from_numpy(np.concatenate(parts)).to(kv.k.device, non_blocking=True)
    views = iter(torch.split(flat, [p.size for p in parts]))
    positions, slots = next(views), next(views)
    extras = [next(views) for _ in extras]
    calls = []
    for start, num, nb, n_blocks, Qmax, uniform in specs:
        table, qpos = next(views).view(nb, n_blocks), next(views).view(nb, Qmax)
        qidx, row = (None, None) if uniform else (next(views).view(nb, Qmax), next(views))
        calls.append(PaddedCall(start, num, table, qpos, qidx, row))
    return positions, slots, calls, extras


def sdpa_mask(g: PaddedCall, block_size, dtype):
    """The call's mask for SDPA, kv_pos <= query_pos: additive (0 / -inf) [B, 1, Qmax, L],
    made once per step (a boolean mask is converted inside every layer's call)."""
    kv_pos = torch.arange(g.block_tables.shape[1] * block_size, device=g.query_pos.device)
    visible = kv_pos[None, None, None, :] <= g.query_pos[:, None, :, None]
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, float("-inf"))


class PagedAttention:
    """Attention for one engine step, built once and shared by every layer (the
    protocol of model.DocumentCausalAttention).

    The step's batch is a flat row of T new tokens in padded calls (paged_step
    above). Per layer:
      1. the new tokens' k/v are written into their slots (slot_mapping [T], slot =
         block * block_size + offset),
      2. per call, each sequence's blocks are gathered into a contiguous [B, kv_heads,
         L, D] view (L = blocks * block_size; one index_select, a memcpy per block),
      3. the padded queries [B, heads, Qmax, D] attend to it under the mask kv_pos <=
         query_pos: causal, and blind to whatever lies in a block past the sequence's
         length (masks are built here, once per step).
    Gathering afresh every step keeps K/V hot in cache for the attention call that
    reads it next.

    backend 'sdpa': torch's scaled_dot_product_attention with an additive mask, the
    query heads that share a kv head folded in as its extra queries. backend 'paged'
    (the default on the CPU in float32, engine.attention_choice): the same for prefill
    chunks, and decode_kernel for the decodes, which reads their blocks in place (steps
    2 and 3 in one loop). backend 'flex': FlexAttention with a BlockMask built directly
    from the positions (create_block_mask is slow on CPU); compiled=True runs it through
    torch.compile."""

    def __init__(self, cache: PagedKVCache, slot_mapping, calls, backend="sdpa",
                 compiled=False):
        self.cache, self.slot_mapping, self.backend = cache, slot_mapping, backend
        self.calls = list(calls)
        flex = compile_once(flex_attention) if compiled else flex_attention
        self.flex = flex if backend == "flex" else None
        # None: the decodes of backend 'paged', which need no mask
        self.masks = [None if backend == "paged" and g.query_pos.shape[1] == 1
                      else self._block_mask(g) if backend == "flex"
                      else sdpa_mask(g, cache.block_size, cache.k.dtype) for g in self.calls]

    def _block_mask(self, g, block=128):
        # the sparsity pattern straight from the positions: query tile j of sequence b
        # needs kv tiles up to the one holding its last query's position; every tile is
        # "partial" (mask_mod decides inside it)
        query_pos, L = g.query_pos, g.block_tables.shape[1] * self.cache.block_size
        B, Qmax = query_pos.shape
        n_q, n_kv = -(-Qmax // block), -(-L // block)
        last = torch.clamp(torch.arange(n_q, device=query_pos.device) * block + block - 1,
                           max=Qmax - 1)
        kv_num_blocks = (query_pos[:, last] // block + 1).to(torch.int32)   # [B, n_q]
        kv_num_blocks = kv_num_blocks[:, None, :]                            # [B, 1, n_q]
        kv_indices = torch.arange(n_kv, dtype=torch.int32, device=query_pos.device)
        kv_indices = kv_indices.expand(B, 1, n_q, n_kv)

        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= query_pos[b, q_idx]
        return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices.contiguous(),
                                        BLOCK_SIZE=(block, block), mask_mod=mask_mod,
                                        seq_lengths=(Qmax, L))

    def __call__(self, layer_idx, q, k, v):
        return paged_attention(q, k, v, self.cache.k[layer_idx], self.cache.v[layer_idx],
                               self.slot_mapping, self.calls, self.masks, self.flex)


def paged_attention(q, k, v, kc, vc, slot_mapping, calls, masks, flex=None):
    """One layer of PagedAttention, on tensors: kc, vc the layer's [num_blocks,
    block_size, Hkv, D] pool; flex None for SDPA (masks additive; a mask None: a call
    of decodes, for decode_kernel) or the flex function (masks BlockMasks)."""
    # the new tokens into their slots
    kc.view(-1, *kc.shape[2:]).index_copy_(0, slot_mapping, k)
    vc.view(-1, *vc.shape[2:]).index_copy_(0, slot_mapping, v)
    ys = [_attend(kc, vc, q[g.start:g.start + g.num_tokens], g, mask, flex)
          for g, mask in zip(calls, masks)]
    return ys[0] if len(ys) == 1 else torch.cat(ys)


def _gathered(i, num_blocks, pool):
    """Where a step's gathered K (i = 0) or V (1) blocks go: on the CPU a buffer reused
    from step to step (sampling.scratch: a fresh one of a few MB a layer would be
    page-faulted in anew each time and cost more than the copy); on a GPU a fresh tensor
    (the caching allocator keeps its memory, and a CUDA graph its addresses)."""
    shape = (num_blocks, *pool.shape[1:])
    if pool.device.type != "cpu":
        return pool.new_empty(shape)
    return scratch(("gathered", i), math.prod(shape), pool.device, pool.dtype).view(shape)


def _attend(kc, vc, q, g, mask, flex):
    T, Hq, D = q.shape
    if mask is None:    # decodes, their blocks read in place
        return decode_kernel().decode_attention(q.contiguous(), kc, vc, g.block_tables,
                                                g.query_pos.view(-1), D ** -0.5)
    Hkv = kc.shape[2]
    B, Qmax = g.query_pos.shape
    L = g.block_tables.shape[1] * kc.shape[1]
    # a view when contiguous; the decode graph's may not be
    blocks = g.block_tables.reshape(-1)
    k, v = (torch.index_select(c, 0, blocks, out=_gathered(i, blocks.numel(), c))
            .view(B, L, Hkv, D).transpose(1, 2) for i, c in enumerate((kc, vc)))  # [B, Hkv, L, D]
    q = q.view(B, Qmax, Hq, D) if g.query_index is None else q[g.query_index]
    if flex is None:
        # the heads that share a kv head ride along as extra queries: [B, Hkv, group * Qmax,
        # D] against [B, Hkv, L, D], each K/V read once per kv head (enable_gqa would read
        # it once per query head). Query head h uses kv head h // group, as in transformers.
        group = Hq // Hkv
        q = q.view(B, Qmax, Hkv, group, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, group * Qmax, D)
        mask = mask if Qmax == 1 else mask.repeat(1, 1, group, 1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.view(B, Hkv, group, Qmax, D).permute(0, 3, 1, 2, 4)   # [B, Qmax, Hkv, group, D]
    else:
        y = flex(q.transpose(1, 2), k, v, block_mask=mask, enable_gqa=True).transpose(1, 2)
    # y: [B, Qmax, Hq, D]
    return y.reshape(T, Hq, D) if g.token_row is None else y.reshape(B * Qmax, Hq, D)[g.token_row]


# -----------------------------------------------------------------------------
# a step of decodes as one graph (inference/decode.py): each layer's paged attention is
# one opaque op. Dynamo cannot follow an attention object made afresh each step, and an
# in-place write into the pool traced as such would copy the whole pool back per step.


class DecodeAttention:
    """PagedAttention for a step where every sequence decodes (one call), made inside
    the decode graph from plain tensors: k_cache / v_cache the whole pool [layers,
    blocks, block_size, Hkv, D], positions [B] each sequence's one query; slot_mapping
    and block_tables as in PagedAttention and PaddedCall; backend 'sdpa' or 'paged'.
    SDPA's mask is made here, once per step."""

    def __init__(self, k_cache, v_cache, slot_mapping, block_tables, positions, backend):
        self.k_cache, self.v_cache, self.slot_mapping = k_cache, v_cache, slot_mapping
        self.block_tables, self.query_pos = block_tables, positions[:, None]
        call = PaddedCall(0, len(positions), block_tables, self.query_pos)
        self.mask = None if backend == "paged" else sdpa_mask(call, k_cache.shape[2],
                                                              k_cache.dtype)

    def __call__(self, layer_idx, q, k, v):
        args = (q, k, v, self.k_cache, self.v_cache, layer_idx, self.slot_mapping,
                self.block_tables, self.query_pos)
        if self.mask is None:
            return torch.ops.nanorl.paged_decode_cpp(*args)
        return torch.ops.nanorl.paged_decode(*args, self.mask)


# two ops: the SDPA one takes the step's mask; the C++ one takes none, and its kernel
# (paged_decode in inference/paged_attention.cpp) is registered when decode_kernel() loads
_OPS = torch.library.Library("nanorl", "FRAGMENT")   # see model.py's grouped_mm
_ARGS = ("Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, int layer, "
         "Tensor slot_mapping, Tensor block_tables, Tensor query_pos")
_OPS.define(f"paged_decode({_ARGS}, Tensor mask) -> Tensor")
_OPS.define(f"paged_decode_cpp({_ARGS}) -> Tensor")


def _paged_decode(q, k, v, k_cache, v_cache, layer, slot_mapping, block_tables,
                  query_pos, mask):
    call = PaddedCall(0, q.shape[0], block_tables, query_pos)
    return paged_attention(q, k, v, k_cache[layer], v_cache[layer], slot_mapping,
                           [call], [mask])


_OPS.impl("paged_decode", _paged_decode, "CompositeExplicitAutograd")
for _name in ("paged_decode", "paged_decode_cpp"):
    torch.library.register_fake(f"nanorl::{_name}", lambda q, *args: torch.empty_like(q))
