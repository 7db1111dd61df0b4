"""
The off-policy corrections (train_grpo_async.py): each estimator against a hand computation,
the exact gradient left as it was when there is no mismatch, top-p's ratio, and routing
replay on an MoE model whose bf16 engine routes some tokens elsewhere.

    python -m pytest -q tests/test_off_policy.py
"""

import math

import pytest
import torch
from transformers import Qwen3MoeConfig

import train_grpo_async
import training
from checkpoint import load_hf_checkpoint
from conftest import logits_and_aux, write_hf_checkpoint
from engine import EngineConfig, InferenceEngine, SamplingParams
from tasks.environment import Group
from test_grpo import NO_CORRECTION

pytestmark = pytest.mark.usefixtures("one_thread")

MOE = Qwen3MoeConfig(vocab_size=105, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                     max_position_embeddings=256)
PROMPTS = [[1, 100, 4, 103, 5, 24, 5, 26], [7, 8, 9, 10], list(range(10, 40))]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe")
    write_hf_checkpoint(MOE, path, seed=5)
    return str(path)


# -----------------------------------------------------------------------------
# the estimators, by hand


def test_ratios_token_and_sequence_level_by_hand():
    mask = torch.tensor([False, True, True, True, False, True])
    trainer = torch.tensor([0.0, 0.2, -0.4, 0.5, 3.0, 0.0])
    engine = torch.zeros(6)
    token = train_grpo_async.importance_ratios(trainer, engine, mask)
    want = [1.0, math.exp(0.2), math.exp(-0.4), math.exp(0.5), 1.0, 1.0]
    assert token.tolist() == pytest.approx(want)
    # rows 0-3 are sample 0, rows 4-5 sample 1: the geometric mean of its
    # masked rows' ratios
    ids = torch.tensor([0, 0, 0, 0, 1, 1])
    seq = train_grpo_async.importance_ratios(trainer, engine, mask, ids)
    assert seq.tolist() == pytest.approx([1.0, math.exp(0.1), math.exp(0.1), math.exp(0.1), 1.0,
                                          1.0])
    r = torch.tensor([0.3, 0.9, 1.0, 1.7, 2.5])
    assert train_grpo_async.truncated(r, 2.0).tolist() == pytest.approx([0.3, 0.9, 1.0, 1.7, 2.0])
    assert train_grpo_async.masked(r, 0.5, 2.0).tolist() == pytest.approx([0.0, 0.9, 1.0, 1.7, 0.0])
    factor, changed = train_grpo_async.is_factor(r, tis_cap=0.0, mis_low=0.5, mis_high=2.0)
    assert changed.tolist() == [True, False, False, False, True]
    assert training.kl_k3(torch.log(r), torch.zeros(5), torch.ones(5, dtype=torch.bool)) == \
        pytest.approx(sum(x - 1 - math.log(x) for x in r.tolist()))


def test_sample_ids_follow_documents_and_branches():
    batch = training.pack_groups([[5, 6, 7], [9, 9]], [[[8, 9], [4]], [[1]]],
                                 [[[1.0, 1.0], [1.0]], [[1.0]]])
    # doc 0: prompt rows 5 6 (branch 0), branch 1: 7 8 9, branch 2: 7 4; doc 1: 9 | 9 1
    assert train_grpo_async.sample_ids(batch).tolist() == [0, 0, 1, 1, 1, 2, 2, 3, 4, 4]


def test_ppo_loss_and_two_epochs_by_hand():
    # one row, advantage +1 then -1, eps 0.2: q = exp(logp - old)
    old = torch.zeros(2)
    mask = torch.ones(2, dtype=torch.bool)
    w = torch.tensor([1.0, -1.0])
    logp = torch.tensor([math.log(1.5), math.log(0.5)], requires_grad=True)
    loss, clipped = train_grpo_async.ppo_loss(logp, old, w, mask, 0.2, 2.0)
    # row 0: min(1.5, 1.2) * 1 = 1.2 (clipped); row 1: min(-0.5, -0.8) = -0.8 (clipped)
    assert loss.item() == pytest.approx(-(1.2 - 0.8) / 2) and clipped == 2
    loss.backward()
    assert logp.grad.tolist() == [0.0, 0.0]        # the clip holds both back: no gradient
    # two epochs of SGD on a 2-token policy (its logits), by hand: epoch 1 is
    # plain policy gradient (q = 1), epoch 2 stops where the ratio left [0.8, 1.2]
    # on the advantage's side
    logits = torch.zeros(2, requires_grad=True)
    old_lp = torch.log_softmax(logits, 0).detach()
    opt = torch.optim.SGD([logits], lr=1.0)
    for epoch in range(2):
        lp = torch.log_softmax(logits, 0)
        loss, clipped = train_grpo_async.ppo_loss(lp[:1], old_lp[:1], torch.ones(1),
                                          torch.ones(1, dtype=torch.bool), 0.2, 1.0)
        opt.zero_grad()
        loss.backward()
        if epoch == 0:   # d/dlogits of -q = -p0 / (1/2) at p = (1/2, 1/2): (-1/2, +1/2)
            assert clipped == 0 and logits.grad.tolist() == pytest.approx([-0.5, 0.5])
        else:            # logits (1/2, -1/2): p0 = sigmoid(1) = 0.731, q = 1.46 > 1.2: clipped
            assert clipped == 1 and logits.grad.tolist() == [0.0, 0.0]
        opt.step()


def test_expert_disagreement_counts_sets_not_orders():
    used = torch.tensor([[[0, 1]], [[2, 3]], [[1, 0]]])
    engine = torch.tensor([[[1, 0]], [[2, 4]], [[-1, -1]]])
    every = torch.ones(3, dtype=torch.bool)
    assert train_grpo_async.expert_disagreement(used, engine, every) == (1, 2)


# -----------------------------------------------------------------------------
# no mismatch: every correction leaves the gradient as it was


def rollout_batches(path, engine_dtype="float32", top_p=1.0, routes=True):
    """Two groups of four samples from the engine, packed as train_grpo_async packs them
    (advantages made up so every sample weighs)."""
    engine = InferenceEngine(EngineConfig(model_path=path, max_model_len=128, num_blocks=128,
                                          dtype=engine_dtype, record_routes=routes))
    samples = engine.generate(PROMPTS[:2], SamplingParams(temperature=1.0, max_tokens=10, seed=3,
                                                          top_p=top_p), 4)
    groups = [Group(None, samples[4 * g:4 * g + 4], [1.0, 0.0, 0.0, 1.0]) for g in range(2)]
    config = {**NO_CORRECTION, "group_size": 4, "scale_rewards": False, "advantage_pass_k": 1,
              "turn_baseline": False, "share_prompt": True, "batch_tokens": 4096,
              "prompts_per_step": 2, "max_new_tokens": 10, "max_turns": 1,
              "loss_norm": "constant", "tis_cap": 0.0, "kl_coef": 0.0, "temperature": 1.0}
    return train_grpo_async.build_batches(groups, config), config


def gradient(model, batches, config):
    """The flat gradient of the step's loss, after the configured corrections."""
    model.zero_grad()
    off = torch.autocast("cpu", enabled=False)
    batches, _ = train_grpo_async.apply_corrections(batches, model, None, off, config)
    for b in batches:
        logp, _ = training.batch_logprobs(model, b)
        train_grpo_async.policy_loss(logp, b, 100.0, config).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


CORRECTIONS = {"tis": dict(tis_cap=2.0), "mis": dict(mis_low=0.5, mis_high=2.0),
               "seq_tis": dict(tis_cap=2.0, is_level="sequence"),
               "seq_mis": dict(mis_low=0.5, mis_high=2.0, is_level="sequence"),
               "ppo": dict(ppo_clip=0.2), "replay": dict(routing_replay=True)}


def test_with_no_mismatch_every_correction_leaves_the_gradient_as_it_was(moe):
    batches, config = rollout_batches(moe)
    model = load_hf_checkpoint(moe)
    exact = gradient(model, [training.replace(b, routes=None) for b in batches], config)
    for name, settings in CORRECTIONS.items():
        got = gradient(model, batches, {**config, **settings})
        assert ((got - exact).norm() / exact.norm()).item() < 1e-6, name


def test_top_p_logprobs_are_the_truncated_distributions_and_the_ratio_is_the_mass_kept(moe):
    batches, config = rollout_batches(moe, top_p=0.7, routes=False)
    model = load_hf_checkpoint(moe)
    for b in batches:
        with torch.no_grad():
            hidden_logp, _ = training.batch_logprobs(model, b)
            logits, _ = logits_and_aux(model, b.tokens, b.position_ids, b.cu_seqlens,
                                       branch=b.branch)
        probs = torch.softmax(logits, -1)
        top = probs.sort(-1, descending=True).values
        kept = (top * ((top.cumsum(-1) - top) < 0.7)).sum(-1)   # the nucleus's mass, per row
        m = b.loss_mask
        ratio = train_grpo_async.importance_ratios(hidden_logp, b.log_probs, m)
        assert (ratio[m] - kept[m]).abs().max().item() < 1e-5
        assert (ratio[m] < 1 + 1e-6).all() and (ratio[m] < 0.999).any()


# -----------------------------------------------------------------------------
# routing replay


def test_routing_replay_makes_the_trainer_route_as_the_bf16_engine_did(moe):
    model = load_hf_checkpoint(moe)
    off = torch.autocast("cpu", enabled=False)
    measure = {**NO_CORRECTION, "tis_cap": 0.0, "kl_coef": 0.0, "record_routes": True}
    for dtype, differs in (("bfloat16", True), ("float32", False)):
        batches, config = rollout_batches(moe, engine_dtype=dtype)
        _, own = train_grpo_async.apply_corrections(batches, model, None, off,
                                                    {**config, **measure})
        replay = {**config, **measure, "routing_replay": True}
        replayed, same = train_grpo_async.apply_corrections(batches, model, None, off, replay)
        assert same["offpolicy/expert_disagreement"] == 0.0
        assert (own["offpolicy/expert_disagreement"] > 0) == differs, dtype
        gap = {"own": 0.0, "replayed": 0.0}   # mean |trainer - engine logprob|, sampled tokens
        for b, r in zip(batches, replayed):
            plain = train_grpo_async.trainer_logprobs(model, training.replace(b, routes=None), off,
                                                      1.0)
            if not differs:   # fp32: the engine's routes are the trainer's own, the logprobs too
                assert torch.equal(plain, r.old_log_probs)
            gap["own"] += (plain - b.log_probs)[b.loss_mask].abs().sum().item()
            gap["replayed"] += (r.old_log_probs - b.log_probs)[b.loss_mask].abs().sum().item()
        if differs:   # bf16: routing as the engine did brings the trainer's logprobs closer
            assert gap["replayed"] < gap["own"]


def test_the_labs_row_tells_a_bias_from_noise():
    # bench/off_policy_lab.row on synthetic gradients: 16 batches around a true gradient
    from bench.off_policy_lab import interval, row
    gen = torch.Generator().manual_seed(0)
    true = torch.randn(4000, generator=gen)
    exact = [true + 3 * torch.randn(4000, generator=gen) for _ in range(16)]
    reference = true + 0.3 * torch.randn(4000, generator=gen)
    same = row(exact, exact, exact, reference)
    assert same["minus_exact"] == [0.0] * 16 and same["norm"] == pytest.approx(1.0)
    assert all(c == pytest.approx(1.0) for c in same["cos_paired"])
    assert same["bias"] == (0.0, 0.0, 0.0)
    # independent noise on each batch, no bias: the estimate's interval holds 0
    noisy = [g + 0.5 * torch.randn(4000, generator=gen) for g in exact]
    _, lo, hi = row(noisy, exact, noisy, reference)["bias"]
    assert lo < 0 < hi
    # the same noise plus a shift of 8 against the true gradient (the mean of the 16
    # batches' noise has norm about 0.5 * sqrt(4000) / 4 = 8): the bias^2 is estimated
    # (64 / |reference|^2, within its interval) and the cosine falls on every batch
    shift = -8 * true / true.norm()
    r = row([g + shift for g in noisy], exact, noisy, reference)
    estimate, lo, hi = r["bias"]
    assert 0 < lo < 64 / float(reference.norm() ** 2) < hi
    assert interval(r["minus_none"])[2] < 0 and interval(r["minus_exact"])[2] < 0
