"""
EngineConfig(cache_type='radix') (inference/radix.py): the same outputs as 'paged' and
as transformers, prefix hits at token granularity, and a property test of the tree.
Random tiny checkpoints written by transformers, CPU, fp32.

    python -m pytest -q tests/test_radix.py
"""

import itertools
import random
from collections import Counter

import pytest
import torch
from conftest import check_invariants
from hypothesis import given, settings, strategies as st

from engine import SamplingParams
from test_engine import PROMPTS, engine_for, hf_logprobs, make_checkpoint, outputs, rand_prompt
from inference.radix import RadixCache
from inference.scheduler import Sequence


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module", params=["moe", "dense"])
def checkpoint(request, tmp_path_factory):
    return (request.param, *make_checkpoint(request.param, tmp_path_factory))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_checkpoint("moe", tmp_path_factory)


def close(a, b, tol=1e-5):
    return all(max(abs(x - y) for x, y in zip(s.logprobs, t.logprobs)) < tol for s, t in zip(a, b))


# -----------------------------------------------------------------------------
# the same results as 'paged', and as transformers


@torch.no_grad()
def test_radix_greedy_matches_transformers_and_paged(checkpoint):
    name, hf, path = checkpoint
    params = SamplingParams(temperature=0, max_tokens=12)
    radix = engine_for(path, cache_type="radix")
    got = radix.generate(PROMPTS, params, num_samples_per_prompt=2)
    for i, s in enumerate(got):
        prompt = PROMPTS[i // 2]
        x = torch.tensor([prompt])
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=12,
                          min_new_tokens=12, eos_token_id=None, pad_token_id=0)
        ref = out[0, len(prompt):].tolist()
        assert list(s.completion_tokens) == ref, f"[{name}] prompt {i // 2}"
        want = hf_logprobs(hf, prompt, s.completion_tokens)
        assert (want - torch.tensor(s.logprobs)).abs().max() < 1e-3
    paged = engine_for(path).generate(PROMPTS, params, num_samples_per_prompt=2)
    assert outputs(got) == outputs(paged) and close(got, paged)
    # the same memory, one-token blocks
    assert radix.cache.num_free_blocks() == radix.cache.num_blocks == 64 * 16
    check_invariants(radix.cache)


def test_radix_seeded_sampling_equals_paged(checkpoint):
    _, _, path = checkpoint
    for params in (SamplingParams(temperature=1.0, max_tokens=10, seed=3),
                   SamplingParams(temperature=0.8, max_tokens=10, top_k=8, top_p=0.9, seed=4)):
        got = engine_for(path, cache_type="radix").generate(PROMPTS, params,
                                                            num_samples_per_prompt=3)
        ref = engine_for(path).generate(PROMPTS, params, num_samples_per_prompt=3)
        assert len({s.completion_tokens for s in got}) > len(PROMPTS)   # samples of a group differ
        assert outputs(got) == outputs(ref) and close(got, ref)


def test_radix_tiny_pool_preempts_evicts_and_still_matches_paged(moe):
    _, path = moe
    prompts = PROMPTS[:4] + [PROMPTS[3][:30] + rand_prompt(4, 7)]
    for params in (SamplingParams(temperature=0, max_tokens=20),
                   SamplingParams(temperature=1.0, max_tokens=20, seed=11)):
        ref = engine_for(path, num_blocks=256, seed=5).generate(prompts, params, 3)
        tiny = engine_for(path, cache_type="radix", num_blocks=5, seed=5)   # 80 one-token slots
        got = tiny.generate(prompts, params, 3)
        again = tiny.generate(prompts, params, 3)                         # now partly from the tree
        assert outputs(got) == outputs(ref) == outputs(again) and close(got, ref,
                                                                        1e-4) and close(again, ref,
                                                                                        1e-4)
        st = tiny.stats()
        assert (st["preemptions"] > 0 and tiny.cache.num_evicted > 0
                and st["prefix_cache_hit_tokens"] > 0)
        assert tiny.cache.num_free_blocks() == tiny.cache.num_blocks == 80
        check_invariants(tiny.cache)


# -----------------------------------------------------------------------------
# token-granular hits


def test_shared_prefix_not_a_multiple_of_the_block_is_reused_in_full(moe):
    _, path = moe
    # 21 common tokens
    a, b = PROMPTS[3][:21] + rand_prompt(6, 1), PROMPTS[3][:21] + rand_prompt(9, 2)
    params = SamplingParams(temperature=0, max_tokens=5)
    hits = {}
    for cache_type in ("radix", "paged"):
        engine = engine_for(path, cache_type=cache_type)
        first = engine.generate([a], params)
        second = engine.generate([b], params)
        hits[cache_type] = engine.stats()["prefix_cache_hit_tokens"]
        assert engine.stats()["prefill_tokens"] == len(a) + len(b) - hits[cache_type]
        hits[cache_type, "out"] = outputs(first + second)
    assert hits["radix"] == 21 and hits["paged"] == 16
    assert hits["radix", "out"] == hits["paged", "out"]
    # a group of G: the prompt is prefilled once; a second request for it computes only
    # its last token
    engine = engine_for(path, cache_type="radix")
    engine.generate([a], SamplingParams(temperature=1.0, max_tokens=4), num_samples_per_prompt=4)
    assert engine.stats()["prefill_tokens"] == len(a) and engine.stats()["forks"] == 3
    engine.generate([a], SamplingParams(temperature=1.0, max_tokens=4), num_samples_per_prompt=4)
    assert engine.stats()["prefix_cache_hit_tokens"] == len(a) - 1


@torch.no_grad()
def test_second_turn_computes_only_the_tokens_it_never_had(moe):
    hf, path = moe
    user1, user2 = rand_prompt(19, 3), rand_prompt(5, 4)
    params = SamplingParams(temperature=0, max_tokens=7)
    for cache_type, extra in (("radix", 0), ("paged", None)):
        engine = engine_for(path, cache_type=cache_type)
        turn1 = engine.generate([user1], params)[0]
        before = engine.stats()["prefill_tokens"]
        prompt2 = user1 + list(turn1.completion_tokens) + user2   # 26 tokens of history, then 5 new
        turn2 = engine.generate([prompt2], params)[0]
        computed = engine.stats()["prefill_tokens"] - before
        if extra is not None:
            # the new tokens, and the last sampled token of turn 1 (sampled, but its
            # KV never computed)
            assert computed == len(user2) + 1
        else:
            assert computed == len(prompt2) - 16                # paged recomputes the partial block
        x = torch.tensor([prompt2])
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=7,
                          min_new_tokens=7, eos_token_id=None, pad_token_id=0)
        ref = out[0, len(prompt2):].tolist()
        assert list(turn2.completion_tokens) == ref


# -----------------------------------------------------------------------------
# weights, aborts, bad input: the same guarantees as 'paged'


def test_radix_update_weights_serves_no_stale_kv(moe, tmp_path_factory):
    _, path = moe
    _, new_path = make_checkpoint("moe", tmp_path_factory, seed=1)
    new_engine = engine_for(new_path)
    new_sd = new_engine.model.state_dict()
    params = SamplingParams(temperature=0, max_tokens=10)
    fresh = outputs(new_engine.generate(PROMPTS, params, 2))
    engine = engine_for(path, cache_type="radix")
    old = outputs(engine.generate(PROMPTS, params, 2))
    assert old != fresh and engine.stats()["cached_blocks"] > 0
    # a sequence running across the update keeps its old KV, and none of it enters
    # the new tree
    request_id = engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30))
    engine.step()
    engine.update_weights(new_sd)
    assert engine.stats()["cached_blocks"] == 0
    while engine.has_pending():
        engine.step()
    hits = engine.stats()["prefix_cache_hit_tokens"]
    samples = engine.generate(PROMPTS, params, 2)
    assert outputs(samples) == fresh and all(set(s.token_versions) == {1} for s in samples)
    assert engine.stats()["prefix_cache_hit_tokens"] == hits        # not one old token was served
    engine.generate(PROMPTS, params, 2)
    assert engine.stats()["prefix_cache_hit_tokens"] > hits         # ... though new ones are
    assert engine.cache.num_free_blocks() == engine.cache.num_blocks
    assert request_id == len(PROMPTS)
    check_invariants(engine.cache)


def test_radix_abort_and_bad_input_leave_the_cache_whole(moe):
    _, path = moe
    engine = engine_for(path, cache_type="radix")
    keep = engine.add_request(PROMPTS[3], SamplingParams(temperature=1.0, max_tokens=50),
                              num_samples=4)
    drop = engine.add_request(PROMPTS[2], SamplingParams(temperature=1.0, max_tokens=50),
                              num_samples=4)
    for _ in range(3):
        engine.step()
    assert engine.abort(drop) == 4
    for bad in ([VOCAB_PLUS], [], "abc"):
        with pytest.raises((ValueError, TypeError)):
            engine.add_request(bad, SamplingParams())
    check_invariants(engine.cache)
    done = []
    while engine.has_pending():
        done += engine.step()
    assert {s.request_id for s in done} == {keep} and len(done) == 4
    assert engine.cache.num_free_blocks() == engine.cache.num_blocks
    check_invariants(engine.cache)


VOCAB_PLUS = 10 ** 6   # a token id outside any vocabulary here


# -----------------------------------------------------------------------------
# the tree alone: random sequences of admit / compute / release / evict / invalidate


def tree_paths(cache):
    """(prefix tokens up to and including each tree slot's token, slot) for every slot
    in the tree."""
    out, stack = [], [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for i, slot in enumerate(node.slots):
            out.append((prefix + tuple(node.key[:i + 1]), slot))
        stack += [(c, prefix + tuple(node.key)) for c in node.children.values()]
    return out


# weighted by repeats
OPS = ["add"] * 3 + ["compute"] * 5 + ["release", "keep", "keep", "evict", "invalidate"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 10 ** 6)), min_size=20,
                max_size=100))
def test_radix_tree_invariants(ops):
    S = 40
    cache, kv, running, stale, uids = RadixCache(S), {}, [], set(), itertools.count()
    for op, x in ops:
        rng = random.Random(x)
        # a prompt over 3 token ids, often a running one's start or copy:
        # prefixes get shared
        if op == "add":
            base = running[x % len(running)].tokens if running and x % 3 else []
            cut = len(base) if x % 3 == 1 else rng.randint(0, len(base))
            prompt = base[:cut] + [rng.randrange(3) for _ in range(rng.randint(0 if cut else 1, 8))]
            seq = Sequence(next(uids), 0, 0, prompt, None, 1, 0)
            cache.match_prefix(seq)
            assert seq.num_cached_tokens < seq.num_tokens
            if seq.num_cached_free_blocks <= cache.num_free_blocks():
                cache.take_prefix(seq)
                assert len(seq.block_table) == seq.num_computed == seq.num_cached_tokens
                running.append(seq)
        elif op == "compute" and running:  # a prefill chunk, or a decode (a new token, then its KV)
            seq = running[x % len(running)]
            if seq.num_computed == seq.num_tokens:
                seq.tokens.append(rng.randrange(3))
            n = rng.randint(1, seq.num_tokens - seq.num_computed)
            if n <= cache.num_free_blocks():
                cache.grow(seq, n)
                for p in range(seq.num_computed, seq.num_computed + n):
                    # "the KV" of token p: its prefix
                    kv[seq.block_table[p]] = tuple(seq.tokens[:p + 1])
                seq.num_computed += n
                if seq.uid not in stale:
                    cache.name_computed(seq, n)
        elif op in ("release", "keep") and running:
            seq = running.pop(x % len(running))
            cache.release(seq, cache=op == "keep" and seq.uid not in stale)
        elif op == "evict":
            free_before, need = cache.num_free_blocks(), x % (S + 1)
            cache.evict(need)
            # what is counted free can be reclaimed
            assert len(cache.free) >= min(need, free_before)
        elif op == "invalidate":
            cache.invalidate()
            stale |= {s.uid for s in running}
        check_invariants(cache)
        # refcounts are exactly the holders: so a held slot was never evicted, and none
        # is owned twice
        holders = Counter(slot for seq in running for slot in seq.block_table)
        assert all(cache.refcount[s] == holders[s] + cache.in_tree[s] for s in range(S))
        for seq in running:
            assert all(kv[slot] == tuple(seq.tokens[:p + 1])
                       for p, slot in enumerate(seq.block_table[:seq.num_computed]))
        paths = tree_paths(cache)                               # what a later match would hand out
        assert all(kv[slot] == prefix for prefix, slot in paths)
        assert len(paths) == cache.num_cached_blocks() == sum(len(n.key) for n in cache._nodes())
    for seq in running:
        cache.release(seq)
    cache.evict(S)
    assert len(cache.free) == S and cache.num_cached_blocks() == 0
