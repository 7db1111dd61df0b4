"""
model.py against transformers: random tiny checkpoints written by transformers itself,
logits compared in fp32.

    python -m pytest -q tests/test_model.py
"""

import json
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig, Qwen3MoeForCausalLM

from conftest import logits_and_aux, randomise, write_hf_checkpoint
from checkpoint import config_from_hf, config_to_hf
import training
from checkpoint import load_hf_checkpoint, save_hf_checkpoint
from model import (DocumentCausalAttention, ModelConfig, Transformer, head_logprobs,
                   train_flops)

VOCAB = 96

# three shapes of Qwen3-MoE and one dense Qwen3; "awkward" bends every rule a lazy port
# would get wrong
HF_CONFIGS = {
    "moe": lambda: Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                  num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
                                  num_experts_per_tok=2,
        norm_topk_prob=True, tie_word_embeddings=False),
    "awkward": lambda: Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=40, moe_intermediate_size=24,
                                      num_hidden_layers=4,
        num_attention_heads=3, num_key_value_heads=1, head_dim=20,         # MQA, head_dim != 48 / 3
        num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
        mlp_only_layers=[0], decoder_sparse_step=2,              # layers 0 and 2 dense, 1 and 3 MoE
        tie_word_embeddings=True, rms_norm_eps=1e-5,
                                      rope_parameters={"rope_type": "default",
                                                       "rope_theta": 500.0}),
    "moe_bias": lambda: Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=8,
                                       num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=8, head_dim=4, num_experts=4,
                                       num_experts_per_tok=1,
        norm_topk_prob=True, attention_bias=True,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "dense": lambda: Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=80, num_hidden_layers=3,
                                 num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=list(HF_CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(name, hf_model, path) for a random tiny checkpoint that transformers itself
    wrote to disk."""
    return request.param, *write_hf_checkpoint(HF_CONFIGS[request.param](),
                                               str(tmp_path_factory.mktemp(request.param)))


def packed(seqs):
    tokens = torch.cat(seqs)
    position_ids = torch.cat([torch.arange(len(s)) for s in seqs])
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    return tokens, position_ids, cu


# -----------------------------------------------------------------------------
# parity


@torch.no_grad()
def test_logits_match_transformers(checkpoint):
    name, hf, path = checkpoint
    ours = load_hf_checkpoint(path)
    x = torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(1))
    ref = hf(x[None]).logits[0]
    got, _ = logits_and_aux(ours, x, torch.arange(len(x)))
    err = (ref - got).abs().max().item()
    print(f"[{name}] max |dlogit| = {err:.2e}")
    assert err < 1e-4
    assert torch.equal(ref.argmax(-1), got.argmax(-1))


def test_cpu_padded_path_matches_flex_path(checkpoint):
    # on CPU the document-causal attention runs as padded causal SDPA (flex has no CPU
    # backward and is slow eagerly); the flex path (CUDA's) must give the same logits on
    # the same mask, and the CPU path trains
    _, hf, path = checkpoint
    ours = load_hf_checkpoint(path)
    tokens, pos, cu = packed([torch.randint(0, VOCAB, (n,)) for n in (5, 19, 1, 12)])
    with torch.no_grad():
        flex, _ = logits_and_aux(
            ours, tokens, pos, cu,
            attention=DocumentCausalAttention(cu, len(tokens), "cpu", flex=True))
    padded, aux = logits_and_aux(ours, tokens, pos, cu)
    assert padded.requires_grad
    assert (flex - padded).abs().max().item() < 1e-5
    (padded.logsumexp(-1).mean() + aux).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in ours.parameters())


@torch.no_grad()
def test_packed_batch_equals_each_sequence_alone(checkpoint):
    _, hf, path = checkpoint
    ours = load_hf_checkpoint(path)
    seqs = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n))
            for n in (7, 1, 30, 16)]
    tokens, pos, cu = packed(seqs)
    together, _ = logits_and_aux(ours, tokens, pos, cu)
    for s, start in zip(seqs, cu[:-1].tolist()):
        alone, _ = logits_and_aux(ours, s, torch.arange(len(s)))
        assert (together[start:start + len(s)] - alone).abs().max().item() < 1e-5
        assert (alone - hf(s[None]).logits[0]).abs().max().item() < 1e-4


def test_completions_sharing_their_prompt_score_as_transformers_does_alone(checkpoint):
    # training.pack_groups: each prompt's rows once, its completions on branches that
    # attend to them; every completion token's logprob must be what transformers gives the
    # prompt + completion alone, on the CPU path and on flex's mask, and the weighted
    # loss's gradient must equal the one of the plain packing
    _, hf, path = checkpoint
    ours = load_hf_checkpoint(path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 1, 9)]
    comps = [[torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lens]
             for lens in ((3, 1, 5), (2, 2), (4,))]
    weights = [[[0.5 + j] * len(c) for j, c in enumerate(cs)] for cs in comps]
    shared = training.pack_groups(prompts, comps, weights)
    plain = training.pack_sequences([p + c for p, cs in zip(prompts, comps) for c in cs],
                                    [[0.0] * len(p) + w for p, ws in zip(prompts, weights)
                                     for w in ws])
    with torch.no_grad():
        want = torch.cat([torch.log_softmax(hf(torch.tensor(p + c)[None]).logits[0],
                                            -1)[len(p) - 1:-1]
                          .gather(-1, torch.tensor(c)[:, None])[:, 0]
                          for p, cs in zip(prompts, comps) for c in cs])
        flex = DocumentCausalAttention(shared.cu_seqlens, shared.num_tokens, "cpu", flex=True,
                                       branch=shared.branch)
        logits, _ = logits_and_aux(ours, shared.tokens, shared.position_ids, shared.cu_seqlens,
                                   attention=flex)
        got_flex = torch.log_softmax(logits, -1).gather(-1, shared.labels[:, None])[:, 0]
    got, _ = training.batch_logprobs(ours, shared)
    scored = shared.token_weights != 0
    assert (got[scored] - want).abs().max().item() < 1e-4 and (
        got_flex[scored] - want
    ).abs().max().item() < 1e-4
    assert (
        shared.num_tokens
        == (5 + 4 + 2 + 6) + (0 + 3 + 3) + (8 + 5)
        < plain.num_tokens
        == (9 + 7 + 11) + 6 + 13
    )
    grads = []
    for batch in (shared, plain):
        ours.zero_grad()
        training.unified_loss(training.batch_logprobs(ours, batch)[0], batch,
                              normalizer=10.0).backward()
        grads.append(torch.cat([p.grad.flatten() for p in ours.parameters() if p.grad is not None]))
    assert (grads[0] - grads[1]).abs().max().item() < 1e-5
    # FLOPs: the causal query-key pairs of the shared layout are the position_ids + 1
    # of its rows
    cfg = ours.config
    assert train_flops(cfg, [shared.num_tokens],
                       pairs=int((shared.position_ids + 1).sum())) < train_flops(
        cfg, plain.seqlens()) == train_flops(cfg, [plain.num_tokens],
                                             pairs=int((plain.position_ids + 1).sum()))


@torch.no_grad()
def test_aux_loss_matches_transformers_on_padded_batch(checkpoint):
    # transformers' load_balancing_loss_func over a right-padded batch with its
    # attention mask must equal ours over the same sequences packed (padding rows
    # excluded on both sides)
    name, hf, path = checkpoint
    ours = load_hf_checkpoint(path)
    if name == "dense":   # no router, no aux loss: transformers' dense Qwen3 has none either
        assert logits_and_aux(ours, torch.arange(5), torch.arange(5))[1].item() == 0.0
        return
    seqs = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(10 + n))
            for n in (9, 23, 4)]
    S = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), S, dtype=torch.long)
    mask = torch.zeros(len(seqs), S, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    ref = hf(ids, attention_mask=mask, output_router_logits=True).aux_loss
    _, aux = logits_and_aux(ours, *packed(seqs))
    print(f"[{name}] aux loss ours {aux.item():.6f} transformers {ref.item():.6f}")
    assert abs(aux.item() - ref.item()) < 1e-5


@torch.no_grad()
def test_save_then_transformers_load_gives_identical_logits(checkpoint, tmp_path):
    name, hf, path = checkpoint
    ours = load_hf_checkpoint(path)
    save_hf_checkpoint(ours, str(tmp_path))
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(back) is type(hf)
    x = torch.randint(0, VOCAB, (21,))
    got, aux = logits_and_aux(ours, x, torch.arange(len(x)))
    out = back(x[None], output_router_logits=name != "dense")
    assert (out.logits[0] - got).abs().max().item() < 1e-4
    if name != "dense":
        assert abs(out.aux_loss.item() - aux.item()) < 1e-5
    # and our own loader reads our own files back to the same model
    again = load_hf_checkpoint(str(tmp_path))
    assert all(torch.equal(a, b)
               for a, b in zip(ours.state_dict().values(), again.state_dict().values()))


@torch.no_grad()
def test_sharded_checkpoint_loads(tmp_path):
    hf = randomise(Qwen3MoeForCausalLM(HF_CONFIGS["moe"]())).eval()
    hf.save_pretrained(str(tmp_path), max_shard_size="20KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    ours = load_hf_checkpoint(str(tmp_path))
    x = torch.randint(0, VOCAB, (11,))
    got, _ = logits_and_aux(ours, x, torch.arange(11))
    assert (hf(x[None]).logits[0] - got).abs().max().item() < 1e-4


@torch.no_grad()
def test_bfloat16(checkpoint):
    name, hf, path = checkpoint
    ours = load_hf_checkpoint(path, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    x = torch.randint(0, VOCAB, (17,), generator=torch.Generator().manual_seed(3))
    got, aux = logits_and_aux(ours, x, torch.arange(len(x)))
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all() and torch.isfinite(aux)
    ref32 = hf(x[None]).logits[0]
    # bf16 has ~3 significant digits: close to fp32, not equal
    assert (got.float() - ref32).abs().max().item() < 0.05 * ref32.abs().max().item() + 0.05


def test_model_config_round_trips_through_transformers(checkpoint):
    _, hf, path = checkpoint
    cfg = config_from_hf(json.load(open(os.path.join(path, "config.json"))))
    assert config_from_hf(config_to_hf(cfg)) == cfg
    assert cfg.head_dim == hf.config.head_dim


def test_embedded_default_shape_builds():
    cfg = ModelConfig()       # the dataclass defaults: an 8-expert top-2 Qwen3-MoE shape
    model = Transformer(cfg)
    hidden, router_logits = model(torch.tensor([1, 2, 3]), torch.arange(3))
    logits, aux = model.logits(hidden), model.aux_loss(router_logits, hidden)
    assert hidden.shape == (3, cfg.hidden_size) and len(router_logits) == cfg.num_hidden_layers
    assert logits.shape == (3, cfg.vocab_size) and aux.item() > 0
    # the engine's head: the logits of the rows it asks for (one row's matmul rounds apart)
    assert torch.allclose(model.logits(hidden[[2]]), logits[[2]], atol=1e-6)
    # a branch beside a ready attention would be silently ignored: refused
    attention = DocumentCausalAttention(torch.tensor([0, 3], dtype=torch.int32), 3, "cpu")
    with pytest.raises(ValueError, match="branch or attention, not both"):
        model(torch.tensor([1, 2, 3]), torch.arange(3), attention=attention,
              branch=torch.zeros(3, dtype=torch.long))


# -----------------------------------------------------------------------------
# bad checkpoints get errors that name the problem


@pytest.fixture
def moe_dir(tmp_path):
    Qwen3MoeForCausalLM(HF_CONFIGS["moe"]()).save_pretrained(str(tmp_path))
    return tmp_path


def _rewrite_tensors(path, edit):
    from safetensors.torch import load_file, save_file
    f = str(path / "model.safetensors")
    t = load_file(f)
    edit(t)
    save_file(t, f, metadata={"format": "pt"})


def test_missing_directory_or_file(tmp_path, moe_dir):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(str(tmp_path / "nope"))
    os.remove(moe_dir / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_checkpoint(str(moe_dir))


def test_wrong_shape_is_named(moe_dir):
    _rewrite_tensors(moe_dir,
                     lambda t: t.__setitem__("model.layers.1.self_attn.k_proj.weight",
                                             torch.zeros(3, 32)))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*\(3, 32\)"):
        load_hf_checkpoint(str(moe_dir))


def test_unknown_and_missing_keys_are_named(moe_dir):
    _rewrite_tensors(moe_dir,
                     lambda t: t.__setitem__("model.layers.0.mystery.weight", torch.zeros(2)))
    with pytest.raises(ValueError, match=r"unknown.*mystery"):
        load_hf_checkpoint(str(moe_dir))
    _rewrite_tensors(moe_dir, lambda t: (t.pop("model.layers.0.mystery.weight"),
                                         t.pop("model.layers.0.mlp.experts.3.up_proj.weight")))
    with pytest.raises(ValueError, match=r"missing.*experts\.3\.up_proj"):
        load_hf_checkpoint(str(moe_dir))


def test_unsupported_model_type_and_corrupt_files(moe_dir):
    cfg = json.load(open(moe_dir / "config.json"))
    json.dump({**cfg, "model_type": "mistral"}, open(moe_dir / "config.json", "w"))
    with pytest.raises(ValueError, match="mistral"):
        load_hf_checkpoint(str(moe_dir))
    json.dump(cfg, open(moe_dir / "config.json", "w"))
    with open(moe_dir / "model.safetensors", "r+b") as f:   # truncate the weights: a crash mid-copy
        f.truncate(100)
    with pytest.raises(ValueError, match="corrupt"):
        load_hf_checkpoint(str(moe_dir))
    (moe_dir / "config.json").write_text("{ not json")
    with pytest.raises(ValueError, match="config.json"):
        load_hf_checkpoint(str(moe_dir))


def test_bad_dtype_and_config_values():
    with pytest.raises(ValueError, match="float31"):
        load_hf_checkpoint("unused", dtype="float31")
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        ModelConfig(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        ModelConfig(num_experts=8, num_experts_per_tok=9)


@torch.no_grad()
@pytest.mark.parametrize("adapters", [False, True], ids=["plain", "lora"])
def test_grouped_gemm_experts_equal_the_loop(monkeypatch, adapters):
    # inference on CPU takes torch._grouped_mm; training (and GROUPED_MM=False)
    # the per-expert loop; a CUDA graph's capture every expert on every token. With LoRA
    # adapters (model.LoRA, one per expert) each path adds x A_e^T B_e^T: the definition
    # reads the merged W_e + scale B_e A_e
    import model
    torch.manual_seed(0)
    experts = model.Experts(8, 32, 24)
    gate_up, down = experts.gate_up_proj, experts.down_proj
    if adapters:
        for name in ("gate_up_proj", "down_proj"):
            lora = model.LoRA(getattr(experts, name).shape, 4, 0.5)
            lora.A.normal_(), lora.B.normal_(0, 0.1)
            setattr(experts, name + "_lora", lora)
        gate_up = gate_up + experts.gate_up_proj_lora.delta()
        down = down + experts.down_proj_lora.delta()
    x = torch.randn(50, 32)
    top_w, top_idx = torch.topk(torch.randn(50, 8).softmax(-1), 2)
    top_idx[:5] = torch.tensor([0, 7])        # some experts crowded, some (maybe) empty
    assert model._use_grouped_mm(x, experts) == model.GROUPED_MM
    fast = experts(x, top_idx, top_w)
    monkeypatch.setattr(model, "GROUPED_MM", False)
    slow = experts(x, top_idx, top_w)
    ref = torch.zeros_like(x)                 # the definition, token by token
    for t in range(50):
        for j in range(2):
            e = top_idx[t, j]
            g, up = (gate_up[e] @ x[t]).chunk(2)
            ref[t] += top_w[t, j] * (down[e] @ (F.silu(g) * up))
    every = experts._every_expert(x, top_idx, top_w)
    assert (slow - ref).abs().max().item() < 1e-5
    assert (fast - ref).abs().max().item() < 1e-5
    assert (every - ref).abs().max().item() < 1e-5


def test_grouped_gemm_path_is_the_inference_default_and_equals_the_loop(checkpoint, monkeypatch):
    # the whole model, both expert paths, against each other and transformers; and widths
    # torch's grouped GEMM cannot take (row strides not 16-byte multiples) fall back to
    # the loop instead of raising
    import model
    name, hf, path = checkpoint
    ours = load_hf_checkpoint(path)
    x = torch.randint(0, VOCAB, (41,), generator=torch.Generator().manual_seed(3))
    moe = [layer.mlp.experts for layer in ours.layers if layer.is_moe]
    with torch.no_grad():   # inference's choice
        grouped = [model._use_grouped_mm(torch.zeros(1), e) for e in moe]
    assert all(g == model.GROUPED_MM for g in grouped)
    fast, _ = logits_and_aux(ours, x, torch.arange(len(x)))
    monkeypatch.setattr(model, "GROUPED_MM", False)
    slow, _ = logits_and_aux(ours, x, torch.arange(len(x)))
    assert (fast - slow).abs().max().item() < 1e-5
    assert (fast - hf(x[None]).logits[0]).abs().max().item() < 1e-4
    monkeypatch.setattr(model, "GROUPED_MM", hasattr(torch, "_grouped_mm"))
    torch.manual_seed(0)
    odd = model.Experts(4, 30, 6)
    assert not model._use_grouped_mm(torch.zeros(1, 30), odd)
    h = torch.randn(9, 30)
    top_w, top_idx = torch.topk(torch.randn(9, 4).softmax(-1), 2)
    ref = torch.stack([sum(top_w[t, j] * (odd.down_proj[e] @ (F.silu(g) * u))
                           for j, e in enumerate(top_idx[t].tolist())
                           for g, u in [(odd.gate_up_proj[e] @ h[t]).chunk(2)]) for t in range(9)])
    assert (odd(h, top_idx, top_w) - ref).abs().max().item() < 1e-5


# -----------------------------------------------------------------------------
# the head's logprobs a chunk of rows at a time (model.logprobs): the same
# numbers, no [T, V] tensor


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_logprobs_equal_the_whole_computation(temperature):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (37,), generator=g)
    upstream = torch.randn(37, generator=g)
    whole = torch.log_softmax(F.linear(hidden, weight) / temperature, -1).gather(1,
                                                                                 labels[:, None])[:,
                                                                                                  0]
    want = torch.autograd.grad((whole * upstream).sum(), (hidden, weight))
    # 5 rows a chunk
    chunked = head_logprobs(hidden, weight, labels, temperature, chunk_bytes=4 * 50 * 5)
    got = torch.autograd.grad((chunked * upstream).sum(), (hidden, weight))
    assert torch.allclose(chunked, whole, atol=1e-6, rtol=1e-6)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-6)


def test_model_logprobs_equal_its_logits():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = Transformer(cfg)
    tokens = torch.randint(0, 64, (24,))
    position_ids, cu = (torch.cat([torch.arange(10), torch.arange(14)]),
                        torch.tensor([0, 10, 24], dtype=torch.int32))
    labels = torch.randint(0, 64, (24,))
    logits, _ = logits_and_aux(model, tokens, position_ids, cu, temperature=0.5)
    whole = torch.log_softmax(logits, -1).gather(1, labels[:, None])[:, 0]
    want = torch.autograd.grad(whole.sum(), list(model.parameters()), allow_unused=True)
    logp = model.logprobs(model(tokens, position_ids, cu)[0], labels, temperature=0.5)
    got = torch.autograd.grad(logp.sum(), list(model.parameters()), allow_unused=True)
    assert torch.allclose(logp, whole, atol=1e-6, rtol=1e-6)
    for a, b in zip(got, want):   # fp32 rounding: up to ~5e-7 relative on an AMD EPYC CPU
        assert (a is None and b is None) or torch.allclose(a, b, atol=1e-5, rtol=1e-5)
