"""
Sampling, as pure functions: one token per row of logits, its logprob, and reproducible seeded draws.

    tokens, logprobs = sample_with_logprobs(logits, temperatures, top_k=None, top_p=None, seeds=None, positions=None)

The logprob is always log_softmax(logits / T) at the sampled token over the whole vocabulary (T = 1 when
greedy), computed with log_softmax, never log(softmax): the quantity the trainer's loss differentiates on the
same weights. top_k / top_p only shape which tokens can be drawn. A seeded draw is a pure function of
(seed, position), so a sample does not depend on what else is batched with it, and a preempted sequence
resumes with the very tokens it would have drawn.
"""

import torch
import xxhash


def _require(ok, message):
    if not ok:
        raise ValueError(message)


# -----------------------------------------------------------------------------
# seeded uniforms


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


def mix_seed(seed, k):
    """The k-th sub-seed of a seed (the k-th prompt of a call, the k-th sample of a group): distinct, reproducible."""
    return xxhash.xxh64_intdigest(int(seed).to_bytes(8, "little") + int(k).to_bytes(8, "little")) >> 1


def sample_with_logprobs(logits, temperatures, top_k=None, top_p=None, seeds=None, positions=None):
    """Sample one token per row of logits [N, V]; return (tokens [N] int64, logprobs [N] float32).

    temperatures [N]: 0 means greedy (argmax). top_k [N] ints (0 = off), top_p [N] floats (1.0 = off) shape
    what is *sampled*: tokens outside the top k / the top-p nucleus of softmax(logits / T) are never drawn.
    The returned logprob is always log_softmax(logits / T) at the sampled token, T = 1 for greedy rows, over the
    *whole* vocabulary, unfiltered: the quantity the trainer computes from the same weights.
    seeds / positions [N] int64 (optional): the draw is a pure function of them (sampling_uniforms); without
    them, torch's global generator draws it. Sampling inverts the CDF: one uniform per row, one cumsum."""
    _require((seeds is None) == (positions is None),
             "sample_with_logprobs: seeds and positions go together (the draw is a function of both)")
    logits = logits.float()
    N, V = logits.shape
    t = torch.as_tensor(temperatures, dtype=torch.float32, device=logits.device).reshape(N)
    greedy = t == 0
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, t)[:, None], dim=-1)
    tokens = logits.argmax(-1)
    if not bool(greedy.all()):
        probs = logp.exp()
        if top_k is not None or top_p is not None:
            probs = _filter_top_k_top_p(probs, top_k, top_p)
        cdf = probs.double().cumsum(-1)
        if seeds is not None:
            u = sampling_uniforms(torch.as_tensor(seeds, device=logits.device).reshape(N),
                                  torch.as_tensor(positions, device=logits.device).reshape(N))
        else:
            u = torch.rand(N, dtype=torch.float64, device=logits.device)
        sampled = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(1).clamp_(max=V - 1)
        tokens = torch.where(greedy, tokens, sampled)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def _filter_top_k_top_p(probs, top_k, top_p):
    # zero the probabilities outside each row's top k and its top-p nucleus (the smallest prefix of the sorted
    # tokens whose mass reaches p); rows with p = 1 skip top-p, where fp32 cumsum rounding could drop tail tokens
    N, V = probs.shape
    k = torch.zeros(N, dtype=torch.int64, device=probs.device) if top_k is None else \
        torch.as_tensor(top_k, device=probs.device).reshape(N)
    p = torch.ones(N, device=probs.device) if top_p is None else \
        torch.as_tensor(top_p, dtype=torch.float32, device=probs.device).reshape(N)
    sorted_probs, idx = probs.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=probs.device)[None, :]
    drop = rank >= torch.where(k > 0, k, V)[:, None]
    drop |= ((sorted_probs.cumsum(-1) - sorted_probs) >= p[:, None]) & (p < 1)[:, None]
    drop[:, 0] = False                                       # the most likely token always survives
    return probs.masked_fill(torch.zeros_like(drop).scatter(1, idx, drop), 0.0)


# -----------------------------------------------------------------------------
# one engine step: each sequence under its own SamplingParams


def sample_next(seqs, logits):
    """The next token of each sequence (one logits row each) under its own SamplingParams and seed."""
    params, dev = [s.params for s in seqs], logits.device
    meta = torch.tensor([[p.temperature, p.top_k, p.top_p] for p in params], dtype=torch.float64)
    use_k, use_p = any(p.top_k for p in params), any(p.top_p < 1.0 for p in params)
    return sample_with_logprobs(
        logits, meta[:, 0].float().to(dev), top_k=meta[:, 1].long().to(dev) if use_k else None,
        top_p=meta[:, 2].float().to(dev) if use_p else None,
        seeds=torch.tensor([s.seed for s in seqs], dtype=torch.int64).to(dev),
        positions=torch.tensor([s.num_tokens for s in seqs], dtype=torch.int64).to(dev))


def top_logprobs(seqs, logits):
    """Per sequence: None, or its params.top_logprobs most likely ((token, logprob), ...) under log_softmax(logits /
    T), T = 1 when greedy (the distribution the sampled token's logprob is read from)."""
    want = [i for i, s in enumerate(seqs) if s.params.top_logprobs > 0]
    out = [None] * len(seqs)
    if not want:
        return out
    t = torch.tensor([seqs[i].params.temperature or 1.0 for i in want], device=logits.device)
    k = min(max(seqs[i].params.top_logprobs for i in want), logits.shape[-1])
    values, ids = torch.log_softmax(logits[want].float() / t[:, None], dim=-1).topk(k, dim=-1)
    for row, i in enumerate(want):
        n = seqs[i].params.top_logprobs
        out[i] = tuple(zip(ids[row, :n].tolist(), values[row, :n].tolist()))
    return out
