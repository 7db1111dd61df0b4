"""
Sampling, as pure functions: one token per row of logits, its logprob, and
reproducible seeded draws.

    tokens, logprobs = sample_with_logprobs(logits, temperatures, top_k=None, top_p=None,
                                            seeds=None, positions=None)

The logprob is that of the distribution the token was drawn from:
log_softmax(logits / T) at the sampled token over the whole vocabulary
(T = 1 when greedy), as log_softmax computes it
((x - max) / T - log sum exp((x - max) / T)), never log(softmax): the quantity the
trainer's loss differentiates on the same weights. With top_k / top_p a token is drawn
from the truncated distribution (the mass outside them zeroed, the rest renormalised),
so its logprob is that one's: the full one minus the log of the mass kept. A trainer
that scores the full distribution then sees the ratio full / truncated = the mass kept,
and an importance-sampling correction weighs by exactly that (training.py). A seeded
draw is a pure function of (seed, position), so a sample does not depend on what else is
batched with it, and a preempted sequence resumes with the very tokens it would have
drawn.

At a real vocabulary (151,936) the sampler could cost more than the head's matmul, so it
makes as few full passes over the [N, V] logits as it can: exp(x / T) into a reused
buffer (shifted by the row's max only in a row where that could overflow or vanish), and
sums over blocks of 1,024 entries. The draw then inverts the CDF in two levels: a cumsum
over the ~150 block sums finds the block, a cumsum over that block's entries the token.
"""

import threading

import torch
import xxhash


# -----------------------------------------------------------------------------
# seeded uniforms


def _hash32(x):
    # a 32-bit integer mixer (lowbias32) on int64 tensors: products wrap, and the mask
    # keeps the low 32 bits
    m = 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & m
    x = ((x ^ (x >> 15)) * 0x846CA68B) & m
    return x ^ (x >> 16)


def sampling_uniforms(seeds, positions):
    """One uniform in (0, 1) per row [N] (float64), a pure function of (seed, position): a
    sample's draws do not depend on what else is in the batch, so a seeded request is
    reproducible, and a preempted one resumes the same."""
    m = 0xFFFFFFFF
    key = _hash32((seeds & m) ^ _hash32(((seeds >> 32) & m) ^ _hash32(positions & m)))
    return (key.double() + 0.5) * 2.0 ** -32


def mix_seed(seed, k):
    """The k-th sub-seed of a seed (the k-th prompt of a call, the k-th sample of a
    group): distinct, reproducible."""
    key = int(seed).to_bytes(8, "little") + int(k).to_bytes(8, "little")
    return xxhash.xxh64_intdigest(key) >> 1


def sample_with_logprobs(logits, temperatures, top_k=None, top_p=None, seeds=None,
                         positions=None):
    """Sample one token per row of logits [N, V]; return (tokens [N] int64,
    logprobs [N] float32).

    temperatures [N]: 0 means greedy (argmax). top_k [N] ints (0 = off), top_p [N]
    floats (1.0 = off) shape what is *sampled*: tokens outside the top k / the top-p
    nucleus of softmax(logits / T) are never drawn. The returned logprob is
    log_softmax(logits / T) at the sampled token, T = 1 for greedy rows, over the whole
    vocabulary, minus (in a sampled row with top_k / top_p) the log of the mass they
    kept: the logprob of the distribution the token was drawn from, the behaviour
    policy. seeds / positions [N] int64 (optional): the draw is a pure function of them
    (sampling_uniforms); without them, torch's global generator draws it. Sampling
    inverts the CDF with one uniform per row."""
    if (seeds is None) != (positions is None):   # the draw is a function of both
        raise ValueError("sample_with_logprobs: seeds and positions go together")
    logits = logits.float()
    N, V = logits.shape
    t = torch.as_tensor(temperatures, dtype=torch.float32, device=logits.device).reshape(N)
    greedy = t == 0
    t = torch.where(greedy, 1.0, t)[:, None]
    # exp((logits - shift) / T), and its block sums
    e, block_sums, shift = _shifted_exp(logits, t)
    total = block_sums.sum(-1)
    tokens = torch.zeros(N, 1, dtype=torch.int64, device=logits.device)
    # the mass top-k / p keep
    kept = torch.ones(N, dtype=torch.float64, device=logits.device)
    if bool(greedy.any()):
        tokens[greedy] = logits[greedy].argmax(-1, keepdim=True)
    if not bool(greedy.all()):
        if seeds is not None:
            u = sampling_uniforms(torch.as_tensor(seeds, device=logits.device).reshape(N),
                                  torch.as_tensor(positions, device=logits.device).reshape(N))
        else:
            u = torch.rand(N, dtype=torch.float64, device=logits.device)
        if top_k is not None or top_p is not None:
            sampled, mass = _draw_filtered(e / total.float()[:, None], top_k, top_p, u)
            kept = torch.where(greedy, 1.0, mass)
        else:
            sampled = _draw(e, block_sums, u * total)
        tokens = torch.where(greedy[:, None], tokens, sampled.clamp_(max=V - 1)[:, None])
    # log_softmax(logits / T) at the token, from what is already here: (x - shift) / T -
    # log(sum exp((x - shift) / T)), in float64 so that the one rounding is the last
    logp = (logits.gather(1, tokens) - shift).double() / t.double() - total.log()[:, None]
    return tokens[:, 0], (logp[:, 0] - kept.log()).float()


BLOCK = 1024   # vocabulary entries per block of the two-level CDF


def _shifted_exp(logits, t):
    """(e, block sums, shift): e = exp((logits - shift) / t) [N, V] and the sums of its
    blocks of BLOCK entries [N, B] (the last block may be shorter; summed in fp32, as
    a float64 reduction costs ten times more here). shift is 0 in every row where that
    is safe (no entry overflows, the row's mass does not vanish), so the common case
    reads the logits once for exp and once for the sums; other rows are redone shifted
    by their max."""
    N, V = logits.shape
    e = scratch("exp", N * V, logits.device).view(N, V)
    tempered = bool((t != 1).any())
    torch.div(logits, t, out=e).exp_() if tempered else torch.exp(logits, out=e)
    sums = _block_sums(e)
    shift = torch.zeros(N, 1, device=logits.device)
    total = sums.sum(-1)
    # a row whose sum is tiny has its max far below 0: entries that underflow could then
    # carry real mass
    redo = (~torch.isfinite(total) | (total < 1e-10)).nonzero()[:, 0]
    if len(redo):
        shift[redo] = logits[redo].amax(-1, keepdim=True)
        e[redo] = ((logits[redo] - shift[redo]) / t[redo]).exp()
        sums[redo] = _block_sums(e[redo])
    return e, sums.double(), shift


def _block_sums(e):
    N, V = e.shape
    whole = V // BLOCK  # row n's block k: e[n, k * BLOCK:(k + 1) * BLOCK]
    sums = e.as_strided((N, whole, BLOCK), (V, BLOCK, 1)).sum(-1)
    return torch.cat([sums, e[:, whole * BLOCK:].sum(-1, keepdim=True)], 1) if V % BLOCK else sums


_SCRATCH = threading.local()   # per thread: (use, device, dtype) -> a flat buffer, grown


def scratch(use, numel, device, dtype=torch.float32):
    """A buffer reused from call to call, one per use (any hashable name), whose contents
    live only until the next call for the same use: a fresh tensor of many MB (the [N, V]
    exponentials here, the engine's gathered K/V in attention.py) is handed back to the
    OS by glibc when freed and page-faulted in anew the next time, which costs more than
    the arithmetic it holds."""
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    key = (use, torch.device(device), dtype)
    if key not in buffers or buffers[key].numel() < numel:
        # a normal tensor: usable in and out of the engine's inference mode
        with torch.inference_mode(False):
            buffers[key] = torch.empty(numel, device=device, dtype=dtype)
    return buffers[key][:numel]


def _draw(e, block_sums, target):
    """The token where the CDF of e first reaches target, per row, in two levels: the
    block whose running sum reaches it (a cumsum over B block sums), then the entry
    inside that block (a cumsum over its min(BLOCK, V) entries). Example: block sums
    [2, 5, 3], target 6 -> block 1 (running sums 2, 7, 10), 4 left to find inside it."""
    N, V = e.shape
    width = min(BLOCK, V)   # a vocabulary under one block is one block of V entries
    running = block_sums.cumsum(-1)
    b = torch.searchsorted(running, target[:, None]).clamp_(max=block_sums.shape[1] - 1)
    left = target[:, None] - (running.gather(1, b) - block_sums.gather(1, b))
    # the block's columns (past V in a short last one)
    cols = b * BLOCK + torch.arange(width, device=e.device)
    inside = e.gather(1, cols.clamp(max=V - 1)).masked_fill_(cols >= V, 0.0).double().cumsum(-1)
    return b[:, 0] * BLOCK + torch.searchsorted(inside, left).clamp_(max=width - 1)[:, 0]


def _draw_filtered(e, top_k, top_p, u):
    """(tokens, the mass kept): top-k / top-p on the probabilities, the mass outside them
    zeroed, then one cumsum over the vocabulary."""
    probs = _filter_top_k_top_p(e, top_k, top_p)
    cdf = probs.double().cumsum(-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(1), cdf[:, -1]


def _filter_top_k_top_p(probs, top_k, top_p):
    # zero the probabilities outside each row's top k and its top-p nucleus (the smallest
    # prefix of the sorted tokens whose mass reaches p); rows with p = 1 skip top-p, where
    # fp32 cumsum rounding could drop tail tokens
    N, V = probs.shape
    k = torch.zeros(N, dtype=torch.int64, device=probs.device) if top_k is None else \
        torch.as_tensor(top_k, device=probs.device).reshape(N)
    p = torch.ones(N, device=probs.device) if top_p is None else \
        torch.as_tensor(top_p, dtype=torch.float32, device=probs.device).reshape(N)
    sorted_probs, idx = probs.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=probs.device)[None, :]
    drop = rank >= torch.where(k > 0, k, V)[:, None]
    drop |= ((sorted_probs.cumsum(-1) - sorted_probs) >= p[:, None]) & (p < 1)[:, None]
    drop[:, 0] = False  # the most likely token always survives
    return probs.masked_fill(torch.zeros_like(drop).scatter(1, idx, drop), 0.0)


# -----------------------------------------------------------------------------
# the same draw at static shapes: no branch on the data, no shape that depends on it


def sample_in_graph(logits, temperatures, seeds, positions):
    """sample_with_logprobs's seeded draw (no top_k / top_p) as one compiled graph or CUDA
    graph can hold it (inference/decode.py): every row takes every path and torch.where
    picks. Its tokens are the same draws (the same uniforms, the same two-level CDF) and
    its logprobs the same up to rounding. The one difference: a row is shifted by its
    max when max / T lies outside [-23, 76], where exp(x / T) could vanish or its sum
    overflow at a 151,936 vocabulary (sample_with_logprobs decides from the sums it has
    already made; here that would take a second pass of exp)."""
    logits = logits.float()
    N, V = logits.shape
    block = min(BLOCK, V)
    num_blocks = -(-V // block)
    greedy = temperatures == 0
    t = torch.where(greedy, 1.0, temperatures)[:, None]
    top = logits.amax(-1, keepdim=True)
    safe = ((top / t) >= -23) & ((top / t) <= 76)
    shift = torch.where(safe, 0.0, top)
    e = torch.exp((logits - shift) / t)
    # a short last block: zeros
    e = torch.nn.functional.pad(e, (0, num_blocks * block - V))
    block_sums = e.view(N, num_blocks, block).sum(-1).double()
    total = block_sums.sum(-1, keepdim=True)
    target = sampling_uniforms(seeds, positions)[:, None] * total
    # searchsorted(sorted, x) = how many entries are < x
    running = block_sums.cumsum(-1)
    b = (running < target).sum(-1, keepdim=True).clamp_(max=num_blocks - 1)
    left = target - (running.gather(1, b) - block_sums.gather(1, b))
    cols = b * block + torch.arange(block, device=logits.device)
    inside = torch.exp((logits.gather(1, cols.clamp(max=V - 1)) - shift) / t)
    inside = inside.masked_fill(cols >= V, 0.0).double().cumsum(-1)
    within = (inside < left).sum(-1, keepdim=True).clamp_(max=block - 1)
    sampled = (b * block + within).clamp_(max=V - 1)
    tokens = torch.where(greedy[:, None], logits.argmax(-1, keepdim=True), sampled)
    logp = (logits.gather(1, tokens) - shift).double() / t.double() - total.log()
    return tokens[:, 0], logp[:, 0].float()


# -----------------------------------------------------------------------------
# one engine step: each sequence under its own SamplingParams


def sample_next(seqs, logits):
    """The next token of each sequence (one logits row each) under its own
    SamplingParams and seed."""
    params, dev = [s.params for s in seqs], logits.device
    meta = torch.tensor([[p.temperature, p.top_k, p.top_p] for p in params],
                        dtype=torch.float64)
    use_k, use_p = any(p.top_k for p in params), any(p.top_p < 1.0 for p in params)
    return sample_with_logprobs(
        logits, meta[:, 0].float().to(dev), top_k=meta[:, 1].long().to(dev) if use_k else None,
        top_p=meta[:, 2].float().to(dev) if use_p else None,
        seeds=torch.tensor([s.seed for s in seqs], dtype=torch.int64).to(dev),
        positions=torch.tensor([s.num_tokens for s in seqs], dtype=torch.int64).to(dev))


def top_logprobs(seqs, logits):
    """Per sequence: None, or its params.top_logprobs most likely ((token, logprob),
    ...) under log_softmax(logits / T), T = 1 when greedy: the whole
    distribution, not renormalised by top_k / top_p (the sampled token's logprob
    is, see sample_with_logprobs)."""
    want = [i for i, s in enumerate(seqs) if s.params.top_logprobs > 0]
    out = [None] * len(seqs)
    if not want:
        return out
    t = torch.tensor([seqs[i].params.temperature or 1.0 for i in want],
                     device=logits.device)
    k = min(max(seqs[i].params.top_logprobs for i in want), logits.shape[-1])
    values, ids = torch.log_softmax(logits[want].float() / t[:, None], dim=-1).topk(k, dim=-1)
    for row, i in enumerate(want):
        n = seqs[i].params.top_logprobs
        out[i] = tuple(zip(ids[row, :n].tolist(), values[row, :n].tolist()))
    return out
