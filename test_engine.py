"""
engine.py against transformers: random tiny checkpoints written by transformers
itself, CPU, fp32.

    python -m pytest -q test_engine.py
"""

import pytest
import torch
from transformers import Qwen3Config, Qwen3MoeConfig

from inference.attention import PagedAttention, PaddedCall, PagedKVCache, decode_kernel
from conftest import check_invariants, logits_and_aux, write_hf_checkpoint
from engine import EngineConfig, InferenceEngine, SamplingParams
from checkpoint import load_hf_checkpoint
from model import DocumentCausalAttention, ModelConfig

# the CPU's decode attention (inference/paged_attention.cpp) needs a C++ compiler and ninja
NEEDS_KERNEL = pytest.mark.skipif(decode_kernel() is None, reason="no C++ decode kernel built")
VOCAB = 96
BLOCK = 16

HF_CONFIGS = {"moe": lambda: Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            moe_intermediate_size=16, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=8, num_experts=8, num_experts_per_tok=2,
                                            norm_topk_prob=True, tie_word_embeddings=False),
              "dense": lambda: Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=80,
                                           num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=1, head_dim=16,
                                           tie_word_embeddings=True),}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def make_checkpoint(name, tmp_path_factory, seed=0):
    return write_hf_checkpoint(HF_CONFIGS[name](), str(tmp_path_factory.mktemp(f"{name}{seed}")),
                               seed)


@pytest.fixture(scope="module", params=list(HF_CONFIGS))
def checkpoint(request, tmp_path_factory):
    return (request.param, *make_checkpoint(request.param, tmp_path_factory))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_checkpoint("moe", tmp_path_factory)


def rand_prompt(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# prompts at and around page boundaries, and two that share a 20-token prefix
PROMPTS = [rand_prompt(n, n) for n in (15, 16, 17, 33)]
PROMPTS += [PROMPTS[3][:20] + rand_prompt(5, 100), PROMPTS[3][:20] + rand_prompt(9, 101)]


def engine_for(path, **kw):
    kw = dict(model_path=path, block_size=BLOCK, num_blocks=64, max_model_len=128) | kw
    return InferenceEngine(EngineConfig(**kw))


@torch.no_grad()
def hf_logprobs(hf, prompt, completion, temperature=1.0):
    """transformers' log_softmax(logits / T) of each completion token, teacher-forced."""
    x = torch.tensor([prompt + list(completion)])
    logits = hf(x).logits[0, len(prompt) - 1:-1] / temperature
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


@torch.no_grad()
def hf_greedy(hf, prompt, n):
    """transformers' greedy completion of n tokens (no stop token)."""
    x = torch.tensor([prompt])
    out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                      min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def outputs(samples):
    return [(s.completion_tokens, s.finish_reason) for s in samples]


# -----------------------------------------------------------------------------
# parity with transformers


@torch.no_grad()
def test_greedy_matches_transformers_generate(checkpoint):
    name, hf, path = checkpoint
    engine = engine_for(path)
    G, N = 2, 12
    samples = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=N),
                              num_samples_per_prompt=G)
    assert len(samples) == G * len(PROMPTS)
    for i, s in enumerate(samples):
        prompt = PROMPTS[i // G]
        assert s.prompt_tokens == tuple(prompt) and s.sample_index == i % G
        ref = hf_greedy(hf, prompt, N)
        assert list(s.completion_tokens) == ref, f"[{name}] prompt {i // G} ({len(prompt)} tokens)"
        assert s.finish_reason == "length" and s.weight_version == 0
        want = hf_logprobs(hf, prompt, s.completion_tokens)
        err = (want - torch.tensor(s.logprobs)).abs().max().item()
        assert err < 1e-3, f"[{name}] logprob error {err}"
    stats = engine.stats()
    assert stats["prefill_tokens"] + stats["prefix_cache_hit_tokens"] == sum(map(len, PROMPTS))
    assert engine.cache.num_free_blocks() == engine.cache.num_blocks
    check_invariants(engine.cache)


@torch.no_grad()
def test_sampled_logprobs_match_transformers(checkpoint):
    name, hf, path = checkpoint
    engine = engine_for(path)
    for params in (SamplingParams(temperature=0.7, max_tokens=10, seed=1),
                   SamplingParams(temperature=1.3, max_tokens=10, top_k=5, top_p=0.9, seed=2)):
        samples = engine.generate(PROMPTS[:4], params, num_samples_per_prompt=3)
        assert len({s.completion_tokens for s in samples}) > 4        # samples of a group differ
        for i, s in enumerate(samples):
            prompt = PROMPTS[i // 3]
            ref = hf_logprobs(hf, prompt, s.completion_tokens, params.temperature)
            if params.top_k:   # the truncated distribution's: the full one over the mass kept
                x = torch.tensor([prompt + list(s.completion_tokens)])
                probs = torch.softmax(hf(x).logits[0, len(prompt) - 1:-1] / params.temperature, -1)
                top = probs.sort(-1, descending=True).values
                keep = (torch.arange(probs.shape[1]) < params.top_k) & \
                    (top.cumsum(-1) - top < params.top_p)
                ref = ref - (top * keep).sum(-1).log()
                # every sampled token is inside the top-k and the nucleus of its
                # distribution
                for row, tok in zip(probs, s.completion_tokens):
                    rank = (row > row[tok]).sum().item()
                    assert rank < params.top_k
                    assert row[row > row[tok]].sum().item() < params.top_p
            assert (ref - torch.tensor(s.logprobs)).abs().max().item() < 1e-3


@torch.no_grad()
def test_engine_logprobs_equal_trainer_logprobs(moe):
    _, path = moe
    engine = engine_for(path)
    model = load_hf_checkpoint(path)
    for T in (1.0, 0.6):
        samples = engine.generate(PROMPTS, SamplingParams(temperature=T, max_tokens=9, seed=3), 2)
        seqs = [list(s.prompt_tokens + s.completion_tokens) for s in samples]
        tokens = torch.tensor([t for s in seqs for t in s])
        pos = torch.cat([torch.arange(len(s)) for s in seqs])
        cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
        logits, _ = logits_and_aux(model, tokens, pos, cu)
        for s, start in zip(samples, cu[:-1].tolist()):
            P, C = len(s.prompt_tokens), len(s.completion_tokens)
            rows = logits[start + P - 1:start + P + C - 1] / T
            ref = torch.log_softmax(rows, -1).gather(1,
                                                     torch.tensor(s.completion_tokens)[:, None])[:,
                                                                                                 0]
            assert (ref - torch.tensor(s.logprobs)).abs().max().item() < 1e-4


# -----------------------------------------------------------------------------
# paged attention itself: mixed prefill chunks and decodes, every backend, against
# the training attention


@torch.no_grad()
@pytest.mark.parametrize("backend", ["sdpa", "flex", pytest.param("paged", marks=NEEDS_KERNEL)])
def test_paged_attention_mixed_batch_matches_document_attention(backend):
    g = torch.Generator().manual_seed(0)
    cfg = ModelConfig(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    cache = PagedKVCache(cfg, num_blocks=40, block_size=4)
    # total length / already cached: two decodes, then a whole prefill, a chunk after a
    # cached prefix, a 1-token one
    lens, done = [6, 9, 9, 7, 1], [5, 8, 0, 4, 0]
    perm = torch.randperm(40, generator=g).tolist()    # pages scattered over the pool
    tables = [perm[8 * b: 8 * b + 8] for b in range(5)]
    q, k, v = (torch.randn(sum(lens), n, 8, generator=g) for n in (4, 2, 2))
    cu = torch.tensor([0] + lens).cumsum(0)
    for b in range(5):                            # what is already cached goes into its slots first
        for p in range(done[b]):
            page, off = tables[b][p // 4], p % 4
            cache.k[0, page, off], cache.v[0, page, off] = k[cu[b] + p], v[cu[b] + p]
    flat = [i for b in range(5) for i in range(cu[b] + done[b], cu[b + 1])]
    slot_mapping = torch.tensor([tables[b][p // 4] * 4 + p % 4 for b in range(5)
                                 for p in range(done[b], lens[b])])
    decodes = PaddedCall(0, 2, torch.tensor(tables[:2]), torch.tensor([[5], [8]]))
    qlens, Qmax = [9, 3, 1], 9
    within = [[min(i, n - 1) for i in range(Qmax)] for n in qlens]
    starts = [0, 9, 12]
    prefills = PaddedCall(2, 13, torch.tensor(tables[2:]),
                          torch.tensor([[done[2 + b] + i for i in within[b]] for b in range(3)]),
                          torch.tensor([[starts[b] + i for i in within[b]] for b in range(3)]),
                          torch.tensor([b * Qmax + i for b in range(3) for i in range(qlens[b])]))
    attn = PagedAttention(cache, slot_mapping, [decodes, prefills], backend=backend)
    got = attn(0, q[flat], k[flat], v[flat])
    ref = DocumentCausalAttention(cu.to(torch.int32), sum(lens), "cpu")(0, q, k, v)[flat]
    assert (got - ref).abs().max().item() < 1e-5


@torch.no_grad()
@NEEDS_KERNEL
@pytest.mark.parametrize("head_dim", [8, 32, 64, 128])
def test_the_decode_kernel_reads_blocks_in_place_as_float64_attention_would(head_dim):
    # inference/paged_attention.cpp: each head size it unrolls (32, 64, 128), the heads
    # it fixes too (4 of 32 over 2) and the generic loop (8); 1, 2 and 4 query heads per
    # kv head; blocks scattered over the pool, lengths from 1 token to a full table,
    # against attention computed in float64
    g = torch.Generator().manual_seed(head_dim)
    bs, W, B = 4, 5, 6
    for heads, kv_heads in ((2, 2), (4, 2), (8, 2)):
        k_pool, v_pool = (torch.randn(40, bs, kv_heads, head_dim, generator=g) for _ in "kv")
        tables = torch.randperm(40, generator=g)[:B * W].view(B, W)
        positions = torch.tensor([0, 3, 4, 9, 17, W * bs - 1])
        q = torch.randn(B, heads, head_dim, generator=g)
        got = decode_kernel().decode_attention(q, k_pool, v_pool, tables, positions, 0.3)
        for b in range(B):
            n = int(positions[b]) + 1
            slots = tables[b, torch.arange(n) // bs] * bs + torch.arange(n) % bs
            k, v = (p.view(-1, kv_heads, head_dim)[slots].double() for p in (k_pool, v_pool))
            kv_of = torch.arange(heads) // (heads // kv_heads)
            scores = torch.einsum("hd,thd->ht", q[b].double(), k[:, kv_of]) * 0.3
            ref = torch.einsum("ht,thd->hd", scores.softmax(-1), v[:, kv_of])
            assert (got[b].double() - ref).abs().max().item() < 1e-5


@torch.no_grad()
@NEEDS_KERNEL
def test_the_decode_op_checks_every_index_before_it_writes():
    # nanorl::paged_decode_cpp, the decode graph's attention op (in C++): a slot or a
    # block outside the pool, or a position past the table, is refused, named, and the
    # pools are left as they were
    decode_kernel()   # registers the op
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache = (torch.randn(2, 6, 4, 2, 8, generator=g) for _ in "kv")   # 2 layers
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots, tables, positions = torch.tensor([1, 9, 22]), torch.tensor([[0, 5]] * 3), \
        torch.tensor([1, 5, 6])
    good = torch.ops.nanorl.paged_decode_cpp(q, k, v, k_cache, v_cache, 1, slots, tables,
                                             positions)
    assert good.shape == q.shape and torch.equal(k_cache[1].view(-1, 2, 8)[slots], k)
    bad = [(torch.tensor([1, 9, 24]), tables, positions, "slot 24 outside the pool"),
           (slots, torch.tensor([[0, 5], [0, 6], [0, 5]]), positions, "block 6 outside"),
           (slots, tables, torch.tensor([1, 8, 6]), "position 8 outside a table of 2")]
    for bad_slots, bad_tables, bad_positions, message in bad:
        before = k_cache.clone(), v_cache.clone()
        with pytest.raises(RuntimeError, match=message):
            torch.ops.nanorl.paged_decode_cpp(q, k + 1, v + 1, k_cache, v_cache, 1, bad_slots,
                                              bad_tables, bad_positions)
        assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@NEEDS_KERNEL
@pytest.mark.parametrize("compile", [False, True])
def test_decodes_read_in_place_draw_what_sdpa_draws(moe, compile):
    # attention_backend 'paged' (the CPU's default in float32): decodes read their blocks
    # in place (inference/paged_attention.cpp) where 'sdpa' gathers them; the same seeded
    # draws and logprobs within 1e-5, eager and in the static decode step, through
    # chunked prefill and prefix hits (the second call)
    _, path = moe
    kw = dict(max_num_batched_tokens=24, compile=compile)
    engines = {b: engine_for(path, attention_backend=b, **kw) for b in ("paged", "sdpa")}
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=7)
    got = {b: [e.generate(PROMPTS, params, 2) for _ in range(2)] for b, e in engines.items()}
    for a, b in zip(sum(got["paged"], []), sum(got["sdpa"], [])):
        assert a.completion_tokens == b.completion_tokens
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    stats = engines["paged"].stats()
    assert stats["attention_backend"] == "paged" and stats["prefix_cache_hit_tokens"] > 0
    assert (stats["compiled_steps"] > 0) == compile
    with pytest.raises(ValueError, match="unless on the CPU in float32, got 'paged'"):
        engine_for(path, attention_backend="paged", dtype="bfloat16")


def test_flex_backend_and_chunked_prefill_give_the_same_tokens(moe):
    hf, path = moe
    params = SamplingParams(temperature=0, max_tokens=8)
    ref = outputs(engine_for(path).generate(PROMPTS, params, 2))
    assert outputs(engine_for(path, attention_backend="flex").generate(PROMPTS, params, 2)) == ref
    # a token budget of 7: prompts are prefilled in chunks, mixed with other sequences'
    # decodes
    chunked = engine_for(path, max_num_batched_tokens=7)
    assert outputs(chunked.generate(PROMPTS, params, 2)) == ref
    assert chunked.stats()["steps"] > 20


# -----------------------------------------------------------------------------
# memory pressure, prefix caching, weight swaps


def test_tiny_pool_preempts_and_still_matches_roomy_pool(moe):
    _, path = moe
    prompts = PROMPTS[:4]
    for params in (SamplingParams(temperature=0, max_tokens=20),
                   SamplingParams(temperature=1.0, max_tokens=20)):
        roomy = engine_for(path, num_blocks=256, seed=5)
        ref = roomy.generate(prompts, params, 3)
        tiny = engine_for(path, num_blocks=5, seed=5)          # one 53-token sequence needs 4 pages
        got = tiny.generate(prompts, params, 3)
        # sampling noise is a function of (seed, position): same draws
        assert outputs(got) == outputs(ref)
        assert tiny.stats()["preemptions"] > 0 and roomy.stats()["preemptions"] == 0
        assert tiny.cache.num_free_blocks() == tiny.cache.num_blocks == 5
        check_invariants(tiny.cache)
        for a, b in zip(got, ref):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_request_that_can_never_fit_is_refused(moe):
    _, path = moe
    engine = engine_for(path, num_blocks=2)
    with pytest.raises(ValueError, match="num_blocks"):
        engine.add_request(rand_prompt(20, 0), SamplingParams(max_tokens=20))
    assert not engine.has_pending()


def test_group_prefills_once_and_second_generate_hits_cache(moe):
    _, path = moe
    engine = engine_for(path)
    prompt = rand_prompt(40, 7)                                      # 2 full pages + 8 tokens
    params = SamplingParams(temperature=1.0, max_tokens=6)
    first = engine.generate([prompt], params, num_samples_per_prompt=4)
    st = engine.stats()
    assert st["prefill_tokens"] == 40 and st["prefix_cache_hit_tokens"] == 0 and st["forks"] == 3
    assert len({s.completion_tokens for s in first}) > 1
    engine.generate([prompt], params, num_samples_per_prompt=4)
    st2 = engine.stats()
    assert st2["prefix_cache_hit_tokens"] == 32                       # both full prompt pages
    assert st2["prefill_tokens"] - st["prefill_tokens"] == 8
    assert engine.cache.num_free_blocks() == engine.cache.num_blocks
    engine.flush_cache()
    engine.generate([prompt], params, num_samples_per_prompt=4)
    assert engine.stats()["prefix_cache_hit_tokens"] == 32     # nothing more: the cache was flushed


def test_update_weights_serves_no_stale_kv(moe, tmp_path_factory):
    hf_old, path = moe
    hf_new, new_path = make_checkpoint("moe", tmp_path_factory, seed=1)
    new_sd = load_hf_checkpoint(new_path).state_dict()
    params = SamplingParams(temperature=0, max_tokens=10)
    fresh = outputs(engine_for(new_path).generate(PROMPTS, params, 2))
    for blocking in (True, False):
        engine = engine_for(path)
        old = outputs(engine.generate(PROMPTS, params, 2))      # fills the prefix cache with old KV
        assert old != fresh and engine.stats()["cached_blocks"] > 0
        engine.update_weights(new_sd, blocking=blocking)
        # non-blocking: at the next step boundary
        assert engine.get_weight_version() == (1 if blocking else 0)
        hits = engine.stats()["prefix_cache_hit_tokens"]
        samples = engine.generate(PROMPTS, params, 2)
        assert outputs(samples) == fresh
        assert engine.get_weight_version() == 1 and all(s.weight_version == 1 for s in samples)
        assert all(set(s.token_versions) == {1} for s in samples)
        assert engine.stats()["prefix_cache_hit_tokens"] == hits      # not one old page was served
        engine.generate(PROMPTS, params, 2)                            # ... though new ones are
        assert engine.stats()["prefix_cache_hit_tokens"] > hits
    # one version per call: a snapshot replaced before it was applied still counts, and
    # only the newest is served
    engine = engine_for(path)
    old_sd = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.update_weights(old_sd, blocking=False)
    engine.update_weights(new_sd, blocking=False)
    assert engine.get_weight_version() == 0
    samples = engine.generate(PROMPTS, params, 2)
    assert outputs(samples) == fresh and engine.get_weight_version() == 2
    assert all(set(s.token_versions) == {2} for s in samples)
    engine.update_weights(old_sd, blocking=False)
    engine.update_weights(new_sd)                                      # blocking, over a staged one
    assert engine.get_weight_version() == 4 and engine.stats()["weight_updates"] == 4
    assert outputs(engine.generate(PROMPTS, params, 2)) == fresh   # the staged snapshot was dropped


def test_update_weights_checks_finiteness_in_the_engine_dtype(moe):
    # an fp32 value that fits fp32 but not fp16 would be inf in an fp16 engine:
    # refused, nothing changes
    _, path = moe
    name = "layers.0.self_attn.q_proj.weight"
    for dtype, big in (("float16", 1e6), ("bfloat16", 3.4e38)):
        engine = engine_for(path, dtype=dtype)
        before = {k: v.clone() for k, v in engine.model.state_dict().items()}
        sd = {k: v.float() for k, v in before.items()}
        sd[name] = sd[name].clone().index_fill_(1, torch.tensor([2]), -big)
        with pytest.raises(ValueError, match=f"{name}.*range"):
            engine.update_weights(sd, blocking=True)
        engine.update_weights(sd, blocking=False)           # checked off the caller's path ...
        with pytest.raises(ValueError, match=f"{name}.*range"):
            engine.step()                                    # ... refused at the next step boundary
        assert engine.get_weight_version() == 0
        assert all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())
        sd[name].clamp_(-1.0, 1.0)                                   # in range: taken, cast exactly
        engine.update_weights(sd)
        assert engine.get_weight_version() == 1 and torch.equal(engine.model.state_dict()[name],
                                                                sd[name].to(getattr(torch, dtype)))


def test_in_process_engine_owns_its_weights(moe):
    _, path = moe
    policy = load_hf_checkpoint(path)
    engine = InferenceEngine(EngineConfig(block_size=BLOCK, num_blocks=64, max_model_len=128),
                             model=policy)
    params = SamplingParams(temperature=0, max_tokens=8)
    before = outputs(engine.generate(PROMPTS, params))
    with torch.no_grad():                            # the trainer steps: the engine must not see it
        for p in policy.parameters():
            p.mul_(1.5)
    assert outputs(engine.generate(PROMPTS, params)) == before
    engine.update_weights(policy.state_dict())                       # trainer names == engine names
    after = outputs(engine.generate(PROMPTS, params))
    ref = InferenceEngine(EngineConfig(block_size=BLOCK, num_blocks=64, max_model_len=128),
                          model=policy)
    assert after == outputs(ref.generate(PROMPTS, params)) and after != before
    # another dtype: cast on the way in
    half = {k: v.bfloat16() for k, v in policy.state_dict().items()}
    engine.update_weights(half)
    assert all(torch.equal(t, half[k].float()) for k, t in engine.model.state_dict().items())


def test_sleep_frees_the_weights_and_the_pool_and_an_update_brings_them_back(moe):
    # what a colocated trainer does around its step (train_grpo.py's engine_sleep): the
    # memory goes, the refusals say what to do, and once woken and updated the engine
    # samples exactly as before
    _, path = moe
    policy = load_hf_checkpoint(path)
    engine = InferenceEngine(EngineConfig(block_size=BLOCK, num_blocks=64, max_model_len=128),
                             model=policy)
    params = SamplingParams(temperature=0, max_tokens=8)
    before = engine.generate(PROMPTS, params, 2)
    engine.sleep()
    held = [*engine.model.parameters(), engine.kv_cache.k, engine.kv_cache.v]
    assert all(t.untyped_storage().nbytes() == 0 for t in held)
    for call in (lambda: engine.generate(PROMPTS, params), lambda: engine.sleep(),
                 lambda: engine.update_weights(policy.state_dict())):
        with pytest.raises(ValueError, match="asleep"):
            call()
    engine.wake_up()
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in held)
    assert not engine.kv_cache.k.any() and not engine.kv_cache.v.any()   # zeroed, as it began
    with pytest.raises(ValueError, match="without weights"):
        engine.step()
    with pytest.raises(ValueError, match="without weights"):
        engine.generate(PROMPTS, params)
    engine.update_from(policy)
    after = engine.generate(PROMPTS, params, 2)
    assert [s.logprobs for s in after] == [s.logprobs for s in before]
    assert outputs(after) == outputs(before) and engine.get_weight_version() == 1


def test_step_api_and_stop_tokens(moe):
    _, path = moe
    engine = engine_for(path)
    greedy = engine.generate([PROMPTS[0]],
                             SamplingParams(temperature=0, max_tokens=10))[0].completion_tokens
    stop = greedy[4]
    first = greedy.index(stop)
    request_id = engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10,
                                                               stop_token_ids={stop}))
    other = engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=3),
                               num_samples=2)
    done = []
    while engine.has_pending():
        done += engine.step()
    mine = [s for s in done if s.request_id == request_id]
    assert len(done) == 3 and len(mine) == 1 and {s.sample_index for s in done
                                                  if s.request_id == other} == {0, 1}
    assert mine[0].completion_tokens == greedy[:first + 1] and mine[0].finish_reason == "stop"
    # generate() while others' requests are queued: theirs are kept and handed out by
    # the next step()
    engine.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=30))
    assert len(engine.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=2))) == 1
    rest = []
    while engine.has_pending() or not rest:
        rest += engine.step()
    assert len(rest) == 1 and len(rest[0].completion_tokens) == 30
    engine.shutdown()
    with pytest.raises(RuntimeError):
        engine.generate([PROMPTS[0]], SamplingParams())


def test_seeded_samples_do_not_depend_on_the_batch(moe):
    _, path = moe
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=7)
    alone = engine_for(path, seed=1).generate(PROMPTS[:1], params, 3)
    crowded = engine_for(path, seed=2).generate(PROMPTS, params, 3)[:3]
    assert outputs(alone) == outputs(crowded)
    assert len({s.completion_tokens for s in alone}) == 3
    assert outputs(engine_for(path).generate(PROMPTS[:1],
                                             SamplingParams(temperature=1.0, max_tokens=12, seed=8),
                                             3)) \
        != outputs(alone)


def test_top_logprobs_match_transformers(moe):
    hf, path = moe
    params = SamplingParams(temperature=0.8, max_tokens=6, seed=3, top_logprobs=5)
    s = engine_for(path).generate([PROMPTS[2]], params)[0]
    x = torch.tensor([PROMPTS[2] + list(s.completion_tokens)])
    with torch.no_grad():
        ref = torch.log_softmax(hf(x).logits[0, len(PROMPTS[2]) - 1:-1].float() / 0.8, -1)
    assert len(s.top_logprobs) == len(s.completion_tokens)
    for row, top in zip(ref, s.top_logprobs):
        values, ids = row.topk(5)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
    assert engine_for(path).generate([PROMPTS[2]],
                                     SamplingParams(max_tokens=3))[0].top_logprobs == ()


def test_abort_drops_samples_and_frees_their_blocks(moe):
    _, path = moe
    engine = engine_for(path)
    free = engine.cache.num_free_blocks()
    keep = engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8))
    group = engine.add_request(PROMPTS[3], SamplingParams(temperature=1.0, max_tokens=40),
                               num_samples=3)
    engine.step()
    engine.step()                                 # the group has forked: three samples running
    assert engine.abort(group, sample_index=1) == 1
    assert {(s.request_id, s.sample_index) for s in engine.running} >= {(group, 0), (group, 2)}
    assert engine.abort(group) == 2 and engine.abort(group) == 0
    done = []
    while engine.has_pending():
        done += engine.step()
    assert [s.request_id for s in done] == [keep]
    # every block is back (some still named: the prefix cache)
    assert engine.cache.num_free_blocks() == free


def test_max_model_len_ends_with_length(moe):
    _, path = moe
    engine = engine_for(path, max_model_len=20)
    s = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=50))[0]
    assert len(s.prompt_tokens) + len(s.completion_tokens) == 20 and s.finish_reason == "length"


# -----------------------------------------------------------------------------
# bad input: refused at the boundary, naming the bad value, and the engine is unchanged


def test_bad_inputs_are_refused_and_change_nothing(moe):
    _, path = moe
    engine = engine_for(path, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=6)
    before = outputs(engine.generate(PROMPTS[:3], params, 2))
    good = PROMPTS[0]
    bad_generate = [
        (([[]], params), "empty"),
        (([good + [VOCAB]], params), str(VOCAB)),
        (([good[:3] + [-1]], params), "-1"),
        (([rand_prompt(64, 1)], params), "max_model_len"),
        (([good, good + [VOCAB + 5]], params), r"prompts\[1\]"),    # one bad prompt: none is queued
        (([good], params, 0), "num_samples_per_prompt"),
        (([good], params, -2), "num_samples_per_prompt"),
        ((good, params), "list of token-id lists"),
        (([good], "greedy"), "SamplingParams"),
        (([[1.5, 2]], params), "1.5"),
    ]
    for args, match in bad_generate:
        with pytest.raises((ValueError, TypeError), match=match):
            engine.generate(*args)
        assert not engine.has_pending()
    with pytest.raises((ValueError, TypeError), match="empty"):
        engine.add_request([], params)
    bad_params = [dict(max_tokens=0), dict(max_tokens=-3), dict(temperature=-0.5),
                  dict(temperature=float("nan")), dict(temperature=1e-40), dict(top_p=0.0),
                  dict(top_p=1.5), dict(top_p=float("nan")), dict(top_k=-1),
                  dict(stop_token_ids={-4}), dict(seed=-1), dict(seed=2 ** 64)]
    for kw in bad_params:
        with pytest.raises((ValueError, TypeError), match=list(kw)[0]):
            SamplingParams(**kw)
    sd = {k: v.clone() for k, v in engine.model.state_dict().items()}
    name = "layers.0.self_attn.q_proj.weight"
    nan = dict(sd, **{name: torch.full_like(sd[name], float("nan"))})
    inf = dict(sd, **{name: sd[name].clone().index_fill_(0, torch.tensor([3]), float("inf"))})
    neg_inf = dict(sd, **{name: sd[name].clone().index_fill_(1, torch.tensor([0]), -float("inf"))})
    bad_sd = [({k: v for k, v in sd.items() if k != name}, name),
              (dict(sd, extra=sd[name]), "extra"), (dict(sd, **{name: sd[name][:-1]}), name),
              (nan, name), (inf, name), (neg_inf, name),
              (dict(sd, **{name: sd[name].long()}), name), (dict(sd, **{name: [1.0]}), name),
              ([1, 2], "mapping")]
    for bad, match in bad_sd:
        for blocking in (True, False):
            with pytest.raises((ValueError, TypeError), match=match):
                engine.update_weights(bad, blocking=blocking)
                engine.step()      # non-finite values: refused at the step boundary, not the call
    assert engine.get_weight_version() == 0
    for kw, match in [(dict(cache_type="hash"), "cache_type"),
                      (dict(block_size=0), "block_size"), (dict(dtype="float33"), "float33"),
                      (dict(attention_backend="xformers"), "xformers")]:
        with pytest.raises((ValueError, TypeError), match=match):
            EngineConfig(model_path=path, **kw)
    assert outputs(engine.generate(PROMPTS[:3], params, 2)) == before
    assert engine.cache.num_free_blocks() == engine.cache.num_blocks


def test_the_design_documents_usage_block_runs_as_written(moe):
    # DESIGN.md's usage code line for line, the model path aside and the names it leaves
    # to the reader filled in first; shutdown moves after the mid and low levels, which
    # need the engine
    _, path = moe
    import torch
    prompts, eos, prompt = PROMPTS[:2], 2, PROMPTS[0]
    tokens, position_ids = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 0, 1])
    cu_seqlens = torch.tensor([0, 2, 4], dtype=torch.int32)
    temperatures = torch.tensor([0.0, 1.0, 1.0, 1.0])     # a row each of the packed batch
    block_token_ids, parent_hash = [1, 2, 3], 0

    from checkpoint import load_hf_checkpoint, save_hf_checkpoint
    from model import ModelConfig, Transformer
    from engine import InferenceEngine, EngineConfig, SamplingParams
    from engine import schedule, sample_with_logprobs, compute_block_hash, SchedulerConfig
    model = load_hf_checkpoint(path, device="cpu", dtype=torch.float32)   # -> Transformer
    with torch.no_grad():
        logits, aux_loss = logits_and_aux(model, tokens, position_ids, cu_seqlens)
    save_hf_checkpoint(model, str(path) + "_saved")
    assert isinstance(model, Transformer) and isinstance(model.config, ModelConfig)

    engine = InferenceEngine(EngineConfig(model_path=path, cache_type="paged", block_size=16))
    samples = engine.generate(prompts=prompts,
                              sampling_params=SamplingParams(temperature=1.0, max_tokens=256,
                                                             stop_token_ids=frozenset({eos})),
                              num_samples_per_prompt=8)
    for s in samples:
        s.prompt_tokens, s.completion_tokens, s.logprobs, s.weight_version, s.finish_reason
    assert len(samples) == 16 and [s.prompt_tokens for s in samples[:8]] == [tuple(prompts[0])] * 8
    by_position = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=256, seed=3,
                                                          stop_token_ids=frozenset({eos})), 8)
    assert len(by_position) == 16

    params = SamplingParams(temperature=0.0, max_tokens=4)
    waiting, running, num_free_blocks = [], [], 8
    scheduler_config = SchedulerConfig(max_batch_size=4, max_num_batched_tokens=64, block_size=16)

    trainer_model = model
    state_dict = trainer_model.state_dict()
    engine.update_weights(trainer_model.state_dict(), blocking=True)
    engine.update_weights(state_dict, blocking=False)
    engine.get_weight_version(); engine.flush_cache(); engine.stats()

    seq_id = engine.add_request(prompt, params)
    while engine.has_pending():
        for s in engine.step():
            assert s.request_id == seq_id
    assert engine.get_weight_version() == 2
    out = schedule(waiting, running, num_free_blocks, scheduler_config)
    tokens, logprobs = sample_with_logprobs(logits, temperatures)
    h = compute_block_hash(block_token_ids, parent_hash)
    assert out.scheduled == () and tokens[0] == logits[0].argmax() and isinstance(h, int)
    engine.shutdown()


def test_attention_choice_is_paged_on_the_cpu_sdpa_elsewhere_unless_flex_is_asked_for():
    from engine import attention_choice
    assert attention_choice("cuda", "auto", None, 32) == ("sdpa", False)
    cpu = "paged" if decode_kernel() else "sdpa"    # where no C++ compiler builds it: SDPA
    assert attention_choice("cpu", "auto", None, 32) == (cpu, False)
    assert attention_choice("cpu", "auto", None, 32, torch.bfloat16) == ("sdpa", False)
    assert attention_choice("cuda", "flex", None, 32) == ("flex", True)    # compiled on CUDA
    assert attention_choice("cpu", "flex", None, 32) == ("flex", False)    # eager on CPU
    assert attention_choice("cpu", "flex", True, 32) == ("flex", True)
    # torch's compiled flex kernel on CUDA takes heads of 16 dims and more
    assert attention_choice("cpu", "flex", True, 8) == ("flex", True)
    with pytest.raises(ValueError, match="head_dim >= 16, the model has 8"):
        attention_choice("cuda", "flex", None, 8)


def test_compiled_paged_flex_attention_on_cpu_matches_transformers(moe):
    # the compiled kernel GPU users run, here on CPU: chunked prefill, decode, a prefix hit
    # and a preemption (a pool too small for every sample at once), against transformers
    hf, path = moe
    engine = engine_for(path, attention_backend="flex", compile=True, num_blocks=12,
                        max_num_batched_tokens=24)
    params = SamplingParams(temperature=0, max_tokens=10)
    for _ in range(2):                                    # the second pass hits the prefix cache
        samples = engine.generate(PROMPTS, params, 2)
    stats = engine.stats()
    assert stats["prefix_cache_hit_tokens"] > 0 and stats["preemptions"] > 0, stats
    assert stats["attention_backend"] == "flex"
    for s in samples:
        prompt, done = list(s.prompt_tokens), list(s.completion_tokens)
        assert done == hf_greedy(hf, prompt, len(done))
        ref = hf_logprobs(hf, prompt, done)
        assert (ref - torch.tensor(s.logprobs)).abs().max().item() < 1e-4


@pytest.mark.parametrize("padding", ["cpu", "cuda"])
def test_static_decode_steps_equal_the_eager_ones_and_transformers(moe, monkeypatch, padding):
    # compile=True with SDPA: every step in which all sequences decode runs as one
    # compiled graph, sampler included (inference/decode.py). The same seeded draws and
    # logprobs within 1e-5 as the eager engine through chunked prefill, prefix hits (the
    # second call), preemptions and a weight update; greedy tokens equal to transformers'.
    # padding='cuda': batches and block tables padded to a GPU's buckets (1, 2, 4, 8, 16
    # rows; 2, 4, 8 blocks), the padded rows through the scratch block, across bucket
    # boundaries as samples finish
    from inference import decode
    hf, path = moe
    shapes = decode.shapes_of
    monkeypatch.setattr(decode, "shapes_of", lambda b, w, _: shapes(b, w, padding))
    kw = dict(num_blocks=12, max_num_batched_tokens=24, max_batch_size=16)
    engines = {c: engine_for(path, compile=c, **kw) for c in (True, False)}
    static, padded = engines[True].static, set()      # (rows, padded rows, padded width)
    inputs_of = static._inputs

    def recorded(seqs):
        shape, inputs = inputs_of(seqs)
        padded.add((len(seqs), *shape))
        return shape, inputs
    static._inputs = recorded
    for params in (SamplingParams(temperature=1.0, max_tokens=12, seed=7),
                   SamplingParams(temperature=0, max_tokens=10)):
        got = {c: [e.generate(PROMPTS, params, 2) for _ in range(2)] for c, e in engines.items()}
        for a, b in zip(sum(got[True], []), sum(got[False], [])):
            assert a.completion_tokens == b.completion_tokens
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    for s in got[True][0]:
        done = list(s.completion_tokens)
        assert done == hf_greedy(hf, list(s.prompt_tokens), len(done))
    new = {k: v * 1.01 for k, v in engines[False].model.state_dict().items()}
    got = {c: (e.update_weights(new), e.generate(PROMPTS, params, 2))[1]
           for c, e in engines.items()}
    for a, b in zip(got[True], got[False]):
        assert a.completion_tokens == b.completion_tokens and a.weight_version == 1
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    stats = engines[True].stats()
    assert stats["compiled_steps"] > 0 and stats["preemptions"] > 0, stats
    assert stats["prefix_cache_hit_tokens"] > 0 and engines[False].stats()["compiled_steps"] == 0
    if padding == "cuda":    # rows and widths padded, across a boundary between buckets of each
        assert any(n < B for n, B, _ in padded), padded
        assert len({B for _, B, _ in padded}) > 1 and len({W for *_, W in padded}) > 1, padded


def test_static_decode_compiles_once_for_every_batch_size(moe):
    # one graph for every batch size and context length (dynamic sizes, no duck sizing):
    # from the warm-up's step of 2 rows and 2 blocks, batches of 2 to 30 rows and contexts
    # to 53 tokens add no graph (dynamo's count, from a reset)
    from model import compile_once
    from torch._dynamo.utils import counters
    _, path = moe
    torch._dynamo.reset()
    compile_once.cache_clear()
    graphs = counters["stats"]["unique_graphs"]
    engine = engine_for(path, compile=True, max_batch_size=32)
    assert engine.static.warm_up() > 0                  # two rows, two blocks: the compile
    assert counters["stats"]["unique_graphs"] == graphs + 1
    params = SamplingParams(temperature=1.0, max_tokens=20)
    engine.generate([PROMPTS[0][:10]], params, 2)
    for n, g in ((2, 3), (6, 4), (3, 1), (6, 5)):
        engine.generate(PROMPTS[:n], params, g)
    assert counters["stats"]["unique_graphs"] == graphs + 1
    assert engine.stats()["compiled_steps"] > 40 and engine.stats()["compile_seconds"] > 0


def test_static_decode_steps_are_refused_where_they_are_not_built(moe, tmp_path):
    # the experts' loop (widths not multiples of 4) would break the compiled graph, and
    # bf16 on the CPU is not built: refused up front, named (a GPU's MoE: test_cuda.py)
    _, path = moe
    cfg = HF_CONFIGS["moe"]()
    cfg.moe_intermediate_size = 10
    odd = write_hf_checkpoint(cfg, str(tmp_path))[1]
    with pytest.raises(ValueError, match="got 32 and 10"):
        engine_for(odd, compile=True)
    with pytest.raises(ValueError, match="'bfloat16'"):
        engine_for(path, compile=True, dtype="bfloat16")
    with pytest.raises(TypeError, match="'yes'"):
        engine_for(path, compile="yes")
    engine_for(odd, compile=True, attention_backend="flex").shutdown()   # compiled flex: its own


def test_a_non_blocking_update_returns_before_its_copy_and_the_next_step_applies_it_whole():
    # 19M parameters: the check and copy take long enough to time against the hand-over
    import time
    from model import ModelConfig, Transformer
    cfg = ModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=0,
                      max_position_embeddings=128)
    torch.manual_seed(0)
    engine = InferenceEngine(EngineConfig(block_size=BLOCK, num_blocks=32, max_model_len=128),
                             model=Transformer(cfg))
    new = {k: v + 0.01 for k, v in engine.model.state_dict().items()}
    waits = {True: [], False: []}
    for _ in range(3):
        for blocking in (True, False):
            t0 = time.perf_counter()
            engine.update_weights(new, blocking=blocking)
            waits[blocking].append(time.perf_counter() - t0)
            engine.step()                                        # applies the non-blocking one
    blocking_wait, hand_over = sorted(waits[True])[1], sorted(waits[False])[1]
    assert hand_over * 5 < blocking_wait, (hand_over, blocking_wait)
    assert engine.get_weight_version() == 6
    assert all(torch.equal(v, new[k]) for k, v in engine.model.state_dict().items())
    # the next step after the call samples with the new weights, whole: every token says so
    newer = {k: v * 1.01 for k, v in new.items()}
    engine.update_weights(newer, blocking=False)
    (s,) = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))
    assert set(s.token_versions) == {7}
    assert all(torch.equal(v, newer[k]) for k, v in engine.model.state_dict().items())
