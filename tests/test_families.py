"""
The model families users bring, as flags of the one Transformer (model.py): Qwen2 (q/k/v
biases, no q/k norm), Llama 3 (rope_scaling 'llama3', untied and tied head), Qwen3
(default RoPE and YaRN) and Qwen3-MoE with YaRN (plain Qwen3-MoE: test_model.py,
test_engine.py). Each against transformers on a random tiny checkpoint that transformers
writes: logits over a packed batch, the engine's greedy tokens against transformers'
generate, the engine's logprobs against the trainer's, scaleout/serve.py's against the
engine's, a save / load round trip transformers reads back, and one SFT step and one
GRPO iteration (the trainers are family-blind).

    python -m pytest -q tests/test_families.py
"""

import json
import math
import os
import runpy
import sys

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

import train_grpo
from checkpoint import load_hf_checkpoint, save_hf_checkpoint
from conftest import logits_and_aux, write_hf_checkpoint
from engine import EngineConfig, InferenceEngine, SamplingParams
from test_grpo import tiny_config
from tokenizer import build_tokenizer, save_tokenizer

SHAPE = dict(vocab_size=105, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
MOE = dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
           decoder_sparse_step=1, mlp_only_layers=[])
FAMILIES = {
    "qwen2": lambda: Qwen2Config(**SHAPE, tie_word_embeddings=True,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    "llama3": lambda: LlamaConfig(**SHAPE, tie_word_embeddings=False, attention_bias=False,
                                  eos_token_id=[3, 1, 2],   # Llama 3 Instruct has a list of three
                                  rope_parameters={"rope_type": "llama3", "rope_theta": 5e5,
                                                   "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 16}),
    "llama3_tied": lambda: LlamaConfig(**SHAPE, tie_word_embeddings=True,
                                       rope_parameters={"rope_type": "llama3", "rope_theta": 5e5,
                                                        "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 16}),
    "qwen3": lambda: Qwen3Config(**SHAPE, tie_word_embeddings=True,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    "qwen3_yarn": lambda: Qwen3Config(**SHAPE, tie_word_embeddings=False,
                                      rope_parameters={"rope_type": "yarn", "rope_theta": 1e4,
                                                       "factor": 4.0,
                                                       "original_max_position_embeddings": 64}),
    "qwen3_moe_yarn": lambda: Qwen3MoeConfig(**SHAPE, **MOE, tie_word_embeddings=False,
                                             rope_parameters={"rope_type": "yarn",
                                                              "rope_theta": 1e4, "factor": 4.0,
                                                              "original_max_position_embeddings":
                                                              64}),
}
PROMPTS = [[1, 100, 4, 103, 5, 24, 5, 26], [7, 8, 9], list(range(10, 70))]


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: tiny models on one thread


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf, _ = write_hf_checkpoint(FAMILIES[request.param](), path, seed=3)
    save_tokenizer(build_tokenizer(), path)
    return request.param, hf, str(path)


@torch.no_grad()
def test_logits_match_transformers_over_a_packed_batch(family):
    _, hf, path = family
    ours = load_hf_checkpoint(path)
    tokens = torch.tensor([t for p in PROMPTS for t in p])
    pos = torch.cat([torch.arange(len(p)) for p in PROMPTS])
    cu = torch.tensor([0] + [len(p) for p in PROMPTS]).cumsum(0).to(torch.int32)
    logits, _ = logits_and_aux(ours, tokens, pos, cu)
    for p, start in zip(PROMPTS, cu[:-1].tolist()):
        ref = hf(torch.tensor([p])).logits[0]
        assert (logits[start:start + len(p)] - ref).abs().max().item() < 1e-4


@torch.no_grad()
def test_engine_greedy_equals_generate_and_logprobs_equal_the_trainers(family):
    _, hf, path = family
    engine = InferenceEngine(EngineConfig(model_path=path, max_model_len=256, num_blocks=128))
    samples = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
    for p, s in zip(PROMPTS, samples):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(p):].tolist()
        assert list(s.completion_tokens) == ref
    model = load_hf_checkpoint(path)
    for s in engine.generate(PROMPTS, SamplingParams(temperature=0.8, max_tokens=12, seed=1), 2):
        seq = torch.tensor(list(s.prompt_tokens + s.completion_tokens))
        logits = logits_and_aux(model, seq, torch.arange(len(seq)))[0][len(s.prompt_tokens) - 1:-1]
        lp = torch.log_softmax(logits / 0.8, -1)
        got = lp.gather(1, torch.tensor(s.completion_tokens)[:, None])[:, 0]
        assert (got - torch.tensor(s.logprobs)).abs().max().item() < 1e-5


def test_serve_py_serves_each_family_as_the_engine_samples(family):
    from test_serve import Served
    _, _, path = family
    engine = InferenceEngine(EngineConfig(model_path=path, max_model_len=256, num_blocks=128))
    want = engine.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=8))
    server = Served(path)
    try:
        r = httpx.post(server.url + "/v1/completions", json={
            "prompt": PROMPTS[:2], "max_tokens": 8, "temperature": 0.0, "logprobs": 0,
            "ignore_eos": True, "return_token_ids": True}).json()
        for choice, s in zip(r["choices"], want):
            assert choice["token_ids"] == list(s.completion_tokens)
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(list(s.logprobs), abs=1e-5)
    finally:
        assert server.stop() == 0


def test_our_tokenizer_beside_a_family_config_keeps_its_spaces(family, tmp_path):
    # AutoTokenizer would pick the model_type's class (Qwen2Tokenizer, ...),
    # which drops spaces
    import shutil
    from tokenizer import load_tokenizer
    _, _, path = family
    text = "digits 1 4 7 8 target 83"
    assert load_tokenizer(path).decode(build_tokenizer().encode(text)) == text
    bare = shutil.copytree(path, tmp_path / "bare")
    (bare / "tokenizer_config.json").unlink()   # a directory with tokenizer.json alone
    assert load_tokenizer(bare).decode(build_tokenizer().encode(text)) == text


def test_save_and_load_round_trip_transformers_reads_back(family, tmp_path):
    name, hf, path = family
    ours = load_hf_checkpoint(path)
    save_hf_checkpoint(ours, str(tmp_path))
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert back.config.model_type == hf.config.model_type
    assert json.load(open(tmp_path / "config.json"))["model_type"] == hf.config.model_type
    ref, got = hf.state_dict(), back.state_dict()
    assert set(ref) == set(got) and all(torch.equal(ref[k], got[k]) for k in ref)
    if name == "llama3":
        assert back.config.rope_parameters["rope_type"] == "llama3"
        assert back.config.eos_token_id == [3, 1, 2]


def test_one_sft_step_and_one_grpo_iteration_on_each_family(family, tmp_path, monkeypatch):
    _, _, path = family
    train_grpo.main(tiny_config(tmp_path / "grpo", f"--init_from={path}", "--max_iters=1",
                                "--ckpt_interval=1", "--prompts_per_step=8", "--group_size=8"))
    rows = [json.loads(line) for line in open(tmp_path / "grpo" / "metrics.jsonl")]
    assert any(r.get("rollout/valid_groups", 0) > 0 and r["train/grad_norm"] > 0 for r in rows)
    assert load_hf_checkpoint(str(tmp_path / "grpo" / "ckpt")).config.family == \
        load_hf_checkpoint(path).config.family
    monkeypatch.setattr(sys, "argv", [
        "sft.py", f"--init_from={path}", f"--out_dir={tmp_path / 'sft'}", "--max_iters=1",
        "--ckpt_interval=1", "--n_eval_problems=2", "--eval_max_tokens=4", "--batch_tokens=256"])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runpy.run_path(os.path.join(root, "sft.py"), run_name="__main__")
    rows = [json.loads(line) for line in open(tmp_path / "sft" / "metrics.jsonl")]
    assert [r["iter"] for r in rows if "train/loss" in r] == [1]
    assert all(math.isfinite(r["train/loss"]) for r in rows if "train/loss" in r)
    trained = load_hf_checkpoint(str(tmp_path / "sft" / "ckpt"))
    assert trained.config == load_hf_checkpoint(path).config


def test_an_unsupported_family_or_variant_is_refused_naming_it(tmp_path):
    from checkpoint import config_from_hf
    base = Qwen3Config(**SHAPE).to_dict()
    for bad, named in (({"model_type": "mistral"}, "unsupported model_type 'mistral'"),
                       ({"use_sliding_window": True}, "sliding-window"),
                       ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
                        "qwen3: rope_type 'longrope'")):
        with pytest.raises(ValueError, match=named):
            config_from_hf({**base, **bad})
