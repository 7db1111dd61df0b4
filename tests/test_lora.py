"""
LoRA (lora.py) against its definition and against peft: every targeted weight the
forward reads gets a gradient and no base weight does; the merged weights are
base + scale * B @ A exactly; peft loads the exported adapter onto the transformers
model and gives our logits; LoRA runs resume exactly; bad settings are refused.

peft lives in the test venv (.ci/run installs it; `pip install peft` elsewhere), not in
requirements.txt: its test skips without it outside CI.
"""

import importlib.util
import os
import re
import shutil

import pytest
import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config,
                          Qwen3MoeConfig)

import checkpoint
import lora
import train_grpo
from conftest import logits_and_aux, write_hf_checkpoint
from engine import EngineConfig, InferenceEngine, SamplingParams
from tests.test_grpo import TINY, killed_at_3_then_resumed, metrics, tiny_config
from tokenizer import build_tokenizer

VOCAB = 96
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)
FAMILIES = {
    "qwen3_moe": Qwen3MoeConfig(**SHAPE, moe_intermediate_size=16, num_experts=4,
                                num_experts_per_tok=2, norm_topk_prob=True),
    "qwen3": Qwen3Config(**SHAPE),
    "qwen2": Qwen2Config(**SHAPE),
    "llama": LlamaConfig(**SHAPE),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, one_thread):
    """(name, the transformers model, its directory)"""
    name = request.param
    hf, path = write_hf_checkpoint(FAMILIES[name], str(tmp_path_factory.mktemp(name)))
    return name, hf, path


def adapted(path, targets=lora.TARGETS, seed=1):
    """Our model of path with rank-4 adapters whose B is random (a fresh B is 0, which
    would hide a wrong merge)."""
    model = checkpoint.load_hf_checkpoint(path)
    lora.add_lora(model, lora.LoRASpec(4, 8.0, targets), seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for adapter in lora.adapters(model).values():
            adapter.B.copy_(0.1 * torch.randn(adapter.B.shape, generator=g))
    return model


def test_every_targeted_weight_gets_a_gradient_and_no_base_weight_does(family):
    name, _, path = family
    model = adapted(path)
    x = torch.randint(0, VOCAB, (29,), generator=torch.Generator().manual_seed(0))
    hidden, router_logits = model(x, torch.arange(29))
    logp, aux = model.logprobs(hidden, torch.roll(x, -1)), model.aux_loss(router_logits, hidden)
    (logp.sum() + aux).backward()
    # the base is frozen: nothing but the adapters' factors can get a gradient (or AdamW state)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {n for n, _ in model.named_parameters() if lora.is_adapter_key(n)}
    # each adapted weight, by the name the forward reads it under, and both its factors
    adapted_names = set(lora.adapters(model))
    expected = {f"layers.{i}.self_attn.{p}.weight" for i in range(2)
                for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    if name == "qwen3_moe":
        expected |= {f"layers.{i}.mlp.experts.{p}" for i in range(2)
                     for p in ("gate_up_proj", "down_proj")}
    else:
        expected |= {f"layers.{i}.mlp.{p}.weight" for i in range(2)
                     for p in ("gate_proj", "up_proj", "down_proj")}
    assert adapted_names == expected
    for key, adapter in lora.adapters(model).items():
        for factor in (adapter.A, adapter.B):
            assert factor.grad is not None and factor.grad.abs().sum() > 0, key


def test_merged_weights_are_the_base_plus_scaled_B_A_exactly(family):
    _, _, path = family
    base = checkpoint.load_hf_checkpoint(path).state_dict()
    model = adapted(path)
    merged = model.state_dict()
    assert sorted(merged) == sorted(base)     # the base names
    adapters = lora.adapters(model)
    for name, t in merged.items():
        if name in adapters:
            a = adapters[name]
            assert torch.equal(t, base[name] + 2.0 * (a.B @ a.A)), name
            assert not torch.equal(t, base[name])
        else:
            assert torch.equal(t, base[name]), name
    # the forward reads what the state_dict says
    plain = checkpoint.load_hf_checkpoint(path)
    plain.load_state_dict(merged)
    x = torch.arange(VOCAB)[:31]
    with torch.no_grad():   # (to rounding: the forward adds (x A^T) B^T beside x W^T)
        gap = logits_and_aux(plain, x, torch.arange(31))[0] - logits_and_aux(model, x,
                                                                            torch.arange(31))[0]
    assert gap.abs().max().item() < 1e-5


needs_peft = pytest.mark.skipif(
    importlib.util.find_spec("peft") is None and not os.environ.get("CI"),
    reason="no peft in this venv (pip install peft; .ci/run installs it)")


@needs_peft
@torch.no_grad()
def test_peft_loads_the_exported_adapter_onto_the_transformers_model(family, tmp_path):
    from peft import PeftModel
    _, hf, path = family
    model = adapted(path)
    lora.save_peft_adapter(model, str(tmp_path / "adapter"), base=path)
    theirs = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path),
                                       str(tmp_path / "adapter")).eval()
    x = torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(2))
    ours, _ = logits_and_aux(model, x, torch.arange(37))
    assert (theirs(x[None]).logits[0] - ours).abs().max().item() < 1e-4
    # and the merged model, saved as a plain transformers checkpoint
    checkpoint.save_hf_checkpoint(model, str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    assert (merged(x[None]).logits[0] - ours).abs().max().item() < 1e-4
    # our reader of the folder gives back the same adapters
    again = checkpoint.load_hf_checkpoint(path)
    lora.add_lora(again, model.lora_spec, seed=9)
    lora.load_peft_adapter(again, str(tmp_path / "adapter"))
    mine, theirs = again.state_dict(), model.state_dict()
    assert all(torch.equal(mine[n], theirs[n]) for n in theirs)


def test_some_targets_only(family):
    _, _, path = family
    model = adapted(path, targets=lora.parse_targets("q_proj,v_proj"))
    assert {k.split(".")[-2] for k in lora.adapters(model)} == {"q_proj", "v_proj"}
    base, merged = checkpoint.load_hf_checkpoint(path).state_dict(), model.state_dict()
    changed = {n for n in base if not torch.equal(base[n], merged[n])}
    assert changed == {f"layers.{i}.self_attn.{p}.weight" for i in range(2)
                       for p in ("q_proj", "v_proj")}


def test_the_engine_shares_the_frozen_base_and_samples_as_a_merged_copy_does(family):
    # a colocated LoRA engine reads the trainer's base tensors themselves (no copy of the
    # weights) and applies the adapters as the trainer does; its greedy tokens and
    # logprobs equal those of an engine holding its own merged copy
    _, _, path = family
    model = adapted(path)
    shared = InferenceEngine(EngineConfig(num_blocks=64, max_model_len=96), model=model)
    assert shared.shares_base and set(shared._params) == set(lora.adapter_state(model))
    ours = {t.data_ptr() for t in lora.base_weights(model).values()}
    theirs = {t.data_ptr() for k, t in shared.model.state_dict().items()
              if not lora.is_adapter_key(k)}
    assert theirs == ours
    plain = checkpoint.load_hf_checkpoint(path)
    merged = InferenceEngine(EngineConfig(num_blocks=64, max_model_len=96), model=plain)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11]]

    def same_samples():
        merged.update_weights(model.state_dict())   # the merged weights, a copy of its own
        a, b = shared.generate(prompts, greedy), merged.generate(prompts, greedy)
        for x, y in zip(a, b):
            assert x.completion_tokens == y.completion_tokens
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-5
    same_samples()
    # a step later: the engine follows the adapters alone, the trainer's base untouched
    with torch.no_grad():
        for adapter in lora.adapters(model).values():
            adapter.B.mul_(-2.0)
    before = {k: t.clone() for k, t in lora.base_weights(model).items()}
    shared.update_from(model)
    same_samples()
    assert all(torch.equal(t, before[k]) for k, t in lora.base_weights(model).items())
    # whole (merged) weights cannot go into an engine whose base is the trainer's
    with pytest.raises(ValueError, match="shares its LoRA model's base"):
        shared.update_weights(model.state_dict())


def test_a_frozen_head_gets_no_gradient_and_the_hidden_states_the_same():
    # model.head_logprobs skips the [V, D] weight gradient when the head is frozen (LoRA)
    from model import head_logprobs
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(9, 16, generator=g), torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (9,), generator=g)
    grads = []
    for frozen in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(not frozen)
        head_logprobs(h, w, labels, chunk_bytes=4 * 50 * 4).sum().backward()
        assert (w.grad is None) == frozen
        grads.append(h.grad)
    assert torch.equal(*grads)


def test_a_moe_models_dense_layers_are_refused_as_targets(tmp_path):
    # peft 0.21 maps a qwen3_moe model's dense-MLP targets to its experts: refused before
    # a run starts, not at its first checkpoint
    cfg = Qwen3MoeConfig(**SHAPE, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                         mlp_only_layers=[1])
    _, path = write_hf_checkpoint(cfg, str(tmp_path / "mixed"))
    start = checkpoint.Start(checkpoint.load_hf_checkpoint(path), None, {}, source=path)
    config = {"init_from": path, "seed": 0, "lora_rank": 2, "lora_alpha": 4.0}
    with pytest.raises(ValueError, match="dense layers' .'down_proj', 'gate_proj', 'up_proj'."):
        checkpoint.with_lora({**config, "lora_targets": "all"}, start)
    ok = checkpoint.with_lora({**config, "lora_targets": "q_proj,experts"}, start)
    assert lora.has_adapters(ok.model)


# -----------------------------------------------------------------------------
# LoRA runs


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    """A tiny embedded-tokenizer model directory, what a LoRA run adapts."""
    path = str(tmp_path_factory.mktemp("base") / "model")
    start = checkpoint.init_start({"init_from": "scratch", "model": TINY, "seed": 0},
                                  build_tokenizer)
    checkpoint.save_best(os.path.dirname(path), start.model, start)
    return os.path.join(os.path.dirname(path), "best")


LORA = ["--lora_rank=2", "--lora_alpha=4", "--learning_rate=3e-2"]


def test_killed_lora_run_resumes_exactly(tmp_path, monkeypatch, tiny_base):
    common = ["--max_iters=4", "--lr_decay_iters=4", "--ckpt_interval=2", "--keep_best=True",
              "--eval_interval=2", f"--init_from={tiny_base}", *LORA]
    whole = tmp_path / "whole"
    train_grpo.main(tiny_config(whole, *common))
    killed = tmp_path / "killed"
    # (its --init_from=resume comes last, over the base's)
    killed_at_3_then_resumed(monkeypatch, killed, common)
    a, b = metrics(whole), metrics(killed)
    assert [r["iter"] for r in a] == [r["iter"] for r in b]
    steps = [r for r in a if "train/loss" in r]
    assert steps and all(r["train/logprob_mismatch"] < 1e-4 for r in steps)
    for ra, rb in zip(a, b):
        for k in ("train/loss", "train/grad_norm", "rollout/reward_mean", "eval/accuracy"):
            if k in ra:
                assert ra[k] == rb[k], (ra["iter"], k, ra[k], rb[k])
    # the checkpoint: the merged model (it moved), its adapter, the base untouched
    base = checkpoint.load_hf_checkpoint(tiny_base).state_dict()
    wa = checkpoint.load_hf_checkpoint(str(whole / "ckpt")).state_dict()
    wb = checkpoint.load_hf_checkpoint(str(killed / "ckpt")).state_dict()
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    moved = {n for n in wa if not torch.equal(wa[n], base[n])}
    assert moved and all(n.endswith(("_proj.weight", "_proj")) for n in moved)
    meta = checkpoint.read_checkpoint_meta(str(whole / "ckpt"))
    assert meta["lora"]["rank"] == 2 and "adapter/adapter_model.safetensors" in meta["files"]
    # the best model on validation: merged, with its adapter beside it
    best = checkpoint.load_hf_checkpoint(str(whole / "best"))
    rebuilt = checkpoint.load_hf_checkpoint(tiny_base)
    lora.add_lora(rebuilt, lora.LoRASpec(2, 4.0, lora.TARGETS))
    lora.load_peft_adapter(rebuilt, str(whole / "best" / "adapter"))
    merged = rebuilt.state_dict()
    assert all(torch.equal(merged[n], t) for n, t in best.state_dict().items())


def test_bad_lora_settings_are_refused_before_anything_is_written(tmp_path, tiny_base):
    for bad, says in (("--lora_rank=-1", "lora_rank=-1"), ("--lora_alpha=0", "lora_alpha=0"),
                      ("--lora_targets=q_proj,gate", "unknown ['gate']")):
        with pytest.raises(ValueError, match=re.escape(says)) as e:
            train_grpo.check_settings(tiny_config(tmp_path, f"--init_from={tiny_base}",
                                                  "--lora_rank=2", bad))
    assert "experts" in str(e.value)     # the known targets are listed
    with pytest.raises(ValueError, match="init_from='scratch'"):
        train_grpo.main(tiny_config(tmp_path / "scratch", "--lora_rank=2"))
    assert not os.path.exists(tmp_path / "scratch")
    # resuming with other LoRA settings (or none) than the run's
    out = tmp_path / "run"
    train_grpo.main(tiny_config(out, "--max_iters=1", f"--init_from={tiny_base}", *LORA))
    before = sorted(os.listdir(out))
    for other in (["--lora_rank=4"], ["--lora_rank=0"], [*LORA, "--lora_targets=q_proj"]):
        with pytest.raises(ValueError, match="the run being resumed had"):
            train_grpo.main(tiny_config(out, "--init_from=resume", "--max_iters=2",
                                        *LORA, *other))
    assert sorted(os.listdir(out)) == before
    # a base that changed since the run started: its digest no longer matches
    base_copy = tmp_path / "base_copy"
    shutil.copytree(tiny_base, base_copy)
    moved = tmp_path / "moved"
    train_grpo.main(tiny_config(moved, "--max_iters=1", f"--init_from={base_copy}", *LORA))
    weights = checkpoint.load_hf_checkpoint(str(base_copy))
    with torch.no_grad():
        weights.norm.weight.add_(1e-3)
    checkpoint.save_hf_checkpoint(weights, str(base_copy))
    with pytest.raises(ValueError, match="changed since the run started"):
        train_grpo.main(tiny_config(moved, "--init_from=resume", "--max_iters=2", *LORA))


def test_sft_with_lora_trains_the_adapters_only(tmp_path, tiny_base):
    # sft.py's LoRA: the loss falls, the base under the merged model's adapted weights is
    # the start's to the bit, every other weight unchanged, the adapter in its checkpoint
    import sft
    from configurator import configure
    settings = {k: v for k, v in vars(sft).items() if not k.startswith("_")}
    out = tmp_path / "sft"
    config = configure(settings, [f"--init_from={tiny_base}", f"--out_dir={out}", "--max_iters=12",
                                  "--lora_rank=4", "--lora_alpha=8", "--learning_rate=1e-2",
                                  "--n_eval_problems=4", "--eval_max_tokens=4", "--log_interval=1",
                                  "--eval_interval=100", "--ckpt_interval=100",
                                  "--batch_tokens=256"], stage="sft")
    sft.main(config)
    losses = [r["train/loss"] for r in metrics(out) if "train/loss" in r]
    assert len(losses) == 12 and losses[-1] < losses[0]
    base = checkpoint.load_hf_checkpoint(tiny_base).state_dict()
    after = checkpoint.load_hf_checkpoint(str(out / "ckpt"))
    rebuilt = checkpoint.load_hf_checkpoint(tiny_base)
    lora.add_lora(rebuilt, lora.LoRASpec(4, 8.0, lora.TARGETS))
    lora.load_peft_adapter(rebuilt, str(out / "ckpt" / "adapter"))
    merged, saved = rebuilt.state_dict(), after.state_dict()
    assert all(torch.equal(merged[n], saved[n]) for n in saved)
    unchanged = [n for n, t in after.state_dict().items() if torch.equal(t, base[n])]
    assert set(unchanged) == set(base) - set(lora.adapters(rebuilt))


def test_a_target_the_model_lacks_is_refused_naming_those_it_has(tmp_path):
    _, path = write_hf_checkpoint(FAMILIES["qwen3_moe"], str(tmp_path / "moe"))
    model = checkpoint.load_hf_checkpoint(path)
    with pytest.raises(ValueError, match="'gate_proj': no such weight in this model; it has "
                                         "q_proj,k_proj,v_proj,o_proj,experts"):
        lora.add_lora(model, lora.LoRASpec(2, 4.0, ("gate_proj",)))
    assert all(p.requires_grad for p in model.parameters())   # untouched
