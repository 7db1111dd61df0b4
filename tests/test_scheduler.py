"""
The engine's pure parts, without a model: block hashing, the sampler (logprobs,
top-k / top-p, seeded draws), schedule() and the block allocator's invariants (a
hypothesis property test).

    python -m pytest -q tests/test_scheduler.py
"""

import math

import pytest
import torch
from conftest import check_invariants
from hypothesis import given, settings, strategies as st

from engine import (
    BlockAllocator,
    SchedulerConfig,
    compute_block_hash,
    sample_with_logprobs,
    schedule,
)


def test_compute_block_hash():
    h = compute_block_hash([1, 23], None)
    assert h != compute_block_hash([12, 3], None)                    # fixed width: no ambiguity
    # ids past 255
    assert compute_block_hash([300, 5], None) != compute_block_hash([44, 5], None)
    # the parent is in the name
    assert h == compute_block_hash([1, 23], None) != compute_block_hash([1, 23], h)
    assert isinstance(h, int)


def test_sample_with_logprobs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    T = torch.tensor([0.0, 1.0, 0.5, 2.0, 1.0, 1.0])
    tokens, lp = sample_with_logprobs(logits, T, seeds=torch.arange(6),
                                      positions=torch.zeros(6, dtype=torch.long))
    assert tokens[0] == logits[0].argmax()
    ref = torch.log_softmax(logits / torch.where(T == 0, 1.0, T)[:, None], -1).gather(
        1, tokens[:, None]
    )[:, 0]
    assert torch.allclose(lp, ref, atol=1e-6)
    # top_k=1 and a tiny top_p are greedy: the truncated distribution holds the
    # argmax alone, so its logprob there is 0; top_k=3 renormalises over the three
    # most likely tokens
    for kw in (dict(top_k=torch.full((6,), 1)), dict(top_p=torch.full((6,), 1e-4))):
        tk, lpk = sample_with_logprobs(logits, torch.ones(6), **kw)
        assert torch.equal(tk, logits.argmax(-1))
        assert torch.allclose(lpk, torch.zeros(6), atol=1e-6)
    tk, lpk = sample_with_logprobs(logits, torch.ones(6), top_k=torch.full((6,), 3))
    top3 = torch.log_softmax(logits.topk(3, -1).values, -1)   # the truncated distribution
    picked = (logits.topk(3, -1).indices == tk[:, None]).float().argmax(-1)
    assert torch.allclose(lpk, top3.gather(1, picked[:, None])[:, 0], atol=1e-6)
    # seeded draws are a function of (seed, position) only, and follow softmax(logits / T)
    one = torch.randn(1, 8, generator=g)
    n = 20000
    draws, _ = sample_with_logprobs(one.expand(n, 8), torch.full((n,), 0.8), seeds=torch.arange(n),
                                    positions=torch.full((n,), 3))
    freq = torch.bincount(draws, minlength=8).float() / n
    p = torch.softmax(one[0] / 0.8, -1)
    assert (freq - p).abs().max().item() < 4 * math.sqrt(0.25 / n)
    again, _ = sample_with_logprobs(one.expand(10, 8), torch.full((10,), 0.8),
                                    seeds=torch.arange(10), positions=torch.full((10,), 3))
    assert torch.equal(again, draws[:10])
    with pytest.raises(ValueError, match="positions"):
        sample_with_logprobs(one.expand(10, 8), torch.ones(10), seeds=torch.arange(10))


@pytest.mark.parametrize("V", [2 * 1024 + 300, 105])
def test_two_level_draw_is_the_inverse_cdf_over_the_whole_vocabulary(V):
    # several blocks and a partial one, or a vocabulary under one block (the main job's):
    # the same token as one cumsum over all V, and the exact logprob
    g = torch.Generator().manual_seed(1)
    N = 64
    logits = torch.randn(N, V, generator=g) * 4
    # rows whose exp would overflow or vanish
    logits[:4] += torch.tensor([300.0, -300.0, 80.0, -90.0])[:, None]
    T = torch.rand(N, generator=g) + 0.3
    seeds, positions = torch.arange(N), torch.full((N,), 7)
    tokens, lp = sample_with_logprobs(logits, T, seeds=seeds, positions=positions)
    from inference.sampling import sampling_uniforms
    probs = torch.softmax(logits / T[:, None], -1).double()
    cdf = probs.cumsum(-1)
    u = sampling_uniforms(seeds, positions)
    want = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None])[:, 0]
    assert torch.equal(tokens, want)
    ref = torch.log_softmax(logits / T[:, None], -1).gather(1, tokens[:, None])[:, 0]
    assert torch.allclose(lp, ref, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("V", [2 * 1024 + 300, 105])
def test_the_graphs_sampler_draws_what_the_engines_draws(V):
    # sampling.sample_in_graph (inference/decode.py's step) against
    # sample_with_logprobs: several blocks and a partial one (or one short block),
    # greedy rows among sampled ones, rows shifted by their max (both rules shift these),
    # eager and compiled: the same tokens, logprobs within 1e-6
    from inference.sampling import sample_in_graph
    g = torch.Generator().manual_seed(2)
    N = 48
    logits = torch.randn(N, V, generator=g) * 4
    logits[:4] += torch.tensor([300.0, -300.0, 100.0, -200.0])[:, None]
    T = (torch.rand(N, generator=g) + 0.3).masked_fill(torch.arange(N) % 5 == 0, 0.0)
    seeds, positions = torch.arange(N) * 7919, torch.arange(N) + 3
    want, want_lp = sample_with_logprobs(logits, T, seeds=seeds, positions=positions)
    for fn in (sample_in_graph, torch.compile(sample_in_graph, dynamic=True)):
        tokens, lp = fn(logits, T, seeds, positions)
        assert torch.equal(tokens, want)
        assert (lp - want_lp).abs().max().item() < 1e-6


class FakeSeq:
    def __init__(self, uid, num_tokens, num_computed, block_table=(), num_samples=1, cached=0,
                 cached_free=0):
        self.uid, self.num_tokens, self.num_computed = uid, num_tokens, num_computed
        self.block_table, self.num_samples = list(block_table), num_samples
        self.num_cached_tokens, self.num_cached_free_blocks = cached, cached_free


def test_schedule_oldest_first_chunks_prefill_and_preempts_newest():
    cfg = SchedulerConfig(max_batch_size=8, max_num_batched_tokens=10, block_size=4)
    prefill = FakeSeq(1, 9, 4, [0, 1])                     # running, mid-prefill (chunked)
    dec = FakeSeq(2, 6, 5, [2, 3])                         # decode: position 5 fits page 3
    dec_new_page = FakeSeq(3, 9, 8, [4, 5])                # decode at position 8: needs a page
    waiting = [FakeSeq(4, 12, 0), FakeSeq(5, 3, 0)]
    out = schedule(waiting, [dec, dec_new_page, prefill], 10, cfg)
    assert (
        out.scheduled == ((2, 1), (3, 1), (1, 5), (4, 3))
        and out.admitted == (4,)
        and out.preempted == ()
    )
    # the oldest is never preempted while another runs, even mid-prefill with a newer
    # decode wanting a page
    out = schedule([], [FakeSeq(1, 12, 4, [0]), FakeSeq(2, 9, 8, [1, 2])], 0,
                   SchedulerConfig(max_batch_size=8, max_num_batched_tokens=4, block_size=4))
    assert out.preempted == (2,) and out.scheduled == ((1, 4),)       # its pages went to the oldest
    # no free page: the newest running sequence is preempted (its pages count once nobody
    # else holds them)
    out = schedule(waiting, [dec, dec_new_page, FakeSeq(6, 6, 5, [6, 7])], 0, cfg)
    assert out.preempted == (6,) and out.scheduled == ((2, 1), (3, 1)) and out.admitted == ()
    shared = FakeSeq(7, 6, 5, [4, 8])                      # shares page 4 with dec_new_page
    out = schedule([], [dec_new_page, shared], 0, cfg)
    assert out.preempted == (7,) and out.scheduled == ((3, 1),)
    # a group counts as num_samples sequences, and reserves pages for its copies of a
    # partial last page
    out = schedule([FakeSeq(8, 6, 0, num_samples=9)], [], 100, cfg)
    assert out.scheduled == ()                            # 9 samples > max_batch_size
    out = schedule([FakeSeq(8, 6, 0, num_samples=4)], [], 4, cfg)
    assert out.scheduled == ()                            # 2 pages + 3 copies > 4
    out = schedule([FakeSeq(8, 6, 4, num_samples=4, cached=4, cached_free=1)], [], 6, cfg)
    assert out.scheduled == ((8, 2),)                     # prefix hit: only 2 tokens to compute


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "share", "free", "register", "hit",
                                           "invalidate"]), st.integers(0, 1000)), max_size=80))
def test_allocator_invariants(ops):
    alloc = BlockAllocator(num_blocks=6, block_size=4)
    held = []                                              # one entry per reference we hold
    for op, x in ops:
        if op == "alloc" and alloc.num_free_blocks():
            b = alloc.allocate()
            assert b not in held, "a page handed out while held"
            held.append(b)
        elif op == "share" and held:
            b = held[x % len(held)]
            alloc.share(b)
            held.append(b)
        elif op == "free" and held:
            alloc.free(held.pop(x % len(held)))
        elif op == "register" and held:
            alloc.register(held[x % len(held)], x % 7)
        elif op == "hit":
            b = alloc.lookup(x % 7)
            if b is not None:
                alloc.share(b)
                held.append(b)
        elif op == "invalidate":
            alloc.invalidate()
        check_invariants(alloc)
        assert all(alloc.refcount[b] == held.count(b) for b in range(6))
        assert alloc.num_free_blocks() + len(set(held)) == 6
    for b in list(held):
        alloc.free(b)
    check_invariants(alloc)
    assert alloc.num_free_blocks() == 6
