"""
The CUDA paths, on a machine with a GPU (skipped elsewhere, CI included): the engine on
the GPU against transformers on the same GPU, the engine's logprobs against the
trainer's (fp32 and bf16), the packed training forward and backward against transformers
and our CPU path, the engine's recorded experts and top-p logprobs (training.py), a
GRPO run on the GPU, and the trainer's weights pushed to a scaleout/serve.py on the GPU
over NCCL. bash bench/gpu_check.sh runs these and bench/bench.py's CUDA rows.

    python -m pytest -q tests/test_cuda.py
"""
import pytest
import torch

import train_grpo
import train_grpo_async
from engine import EngineConfig, InferenceEngine, SamplingParams
from checkpoint import load_hf_checkpoint
from conftest import logits_and_aux
from test_engine import PROMPTS, make_checkpoint
from test_grpo import metrics, tiny_config
from test_rollout_servers import MODEL, assert_same
from test_serve import Served

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module", autouse=True)
def _full_fp32():
    # fp32 matmuls in full precision (no TF32) on both sides, so the comparisons are fp32's
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(scope="module", params=["moe", "dense"])
def checkpoint(request, tmp_path_factory):
    hf, path = make_checkpoint(request.param, tmp_path_factory)
    return request.param, hf.cuda(), path


def cuda_engine(path, **kw):
    kw = dict(model_path=path, device="cuda", block_size=16, num_blocks=64, max_model_len=128) | kw
    return InferenceEngine(EngineConfig(**kw))


@torch.no_grad()
def logprobs_of(model, sample, temperature=1.0):
    """log_softmax(logits / T) of each completion token, teacher-forced on the GPU;
    model is transformers' (returns .logits) or ours"""
    seq = torch.tensor(sample.prompt_tokens + sample.completion_tokens, device="cuda")
    if isinstance(model, torch.nn.Module) and hasattr(model, "generate"):
        logits = model(seq[None]).logits[0]
    else:
        logits, _ = logits_and_aux(model, seq, torch.arange(len(seq), device="cuda"))
    P, C = len(sample.prompt_tokens), len(sample.completion_tokens)
    rows = torch.log_softmax(logits[P - 1:P + C - 1].float() / temperature, -1)
    return rows.gather(1, seq[P:, None])[:, 0].cpu()


@torch.no_grad()
def test_cuda_greedy_matches_transformers(checkpoint):
    name, hf, path = checkpoint
    engine = cuda_engine(path)
    samples = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), 2)
    for i, s in enumerate(samples):
        prompt = PROMPTS[i // 2]
        x = torch.tensor([prompt], device="cuda")
        ref = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=12,
                          min_new_tokens=12, eos_token_id=None, pad_token_id=0)[0, len(prompt):]
        assert list(s.completion_tokens) == ref.tolist(), f"[{name}] prompt {i // 2}"
        err = (logprobs_of(hf, s) - torch.tensor(s.logprobs)).abs().max().item()
        assert err < 1e-4, f"[{name}] logprob error {err}"


@torch.no_grad()
def test_cuda_engine_logprobs_equal_the_trainers(checkpoint):
    name, _, path = checkpoint
    engine = cuda_engine(path)
    model = load_hf_checkpoint(path, device="cuda")
    for s in engine.generate(PROMPTS, SamplingParams(temperature=0.7, max_tokens=9, seed=3), 2):
        err = (logprobs_of(model, s, 0.7) - torch.tensor(s.logprobs)).abs().max().item()
        assert err < 1e-5, f"[{name}] engine vs trainer logprob {err}"


@torch.no_grad()
def test_bfloat16_engine_samples_what_it_scores(checkpoint):
    # bf16 weights on the GPU: the logprobs the engine reports are those of the
    # distribution it sampled from, which a bf16 trainer recomputes closely
    name, _, path = checkpoint
    engine = cuda_engine(path, dtype="bfloat16")
    model = load_hf_checkpoint(path, device="cuda", dtype=torch.bfloat16)
    for s in engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=8, seed=5), 2):
        err = (logprobs_of(model, s) - torch.tensor(s.logprobs)).abs().max().item()
        assert err < 0.1, f"[{name}] bf16 engine vs trainer logprob {err}"


@torch.no_grad()
def test_cuda_routes_and_truncated_logprobs(checkpoint):
    # the off-policy corrections on the GPU: the engine's recorded experts are the fp32
    # trainer's own, and a top-p sample's logprob is the nucleus's (at most the full
    # one's, its ratio the mass kept)
    name, _, path = checkpoint
    engine = cuda_engine(path, record_routes=True)
    model = load_hf_checkpoint(path, device="cuda")
    for s in engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=8, seed=7,
                                                     top_p=0.8), 2):
        full = logprobs_of(model, s)
        assert (full <= torch.tensor(s.logprobs) + 1e-5).all(), f"[{name}] nucleus logprob"
        if name == "moe":
            seq = torch.tensor(s.prompt_tokens + s.completion_tokens, device="cuda")
            used = []
            model(seq, torch.arange(len(seq), device="cuda"), routes_out=used)
            own = torch.stack(used, 1)[:-1].sort(-1).values.cpu()
            assert torch.equal(own, s.routes.long().sort(-1).values), f"[{name}] routes"
        else:
            assert s.routes is None


@torch.no_grad()
def test_cuda_graph_decode_steps_equal_the_eager_ones(checkpoint):
    # compile=True on a GPU: every step in which all sequences decode replays a CUDA
    # graph of the whole step (inference/decode.py), padded to a bucket; the same seeded
    # tokens and logprobs within 1e-5 as the eager engine (greedy: equal to transformers,
    # test_cuda_greedy_matches_transformers), through chunked prefill, prefix hits,
    # preemptions and weight updates. An MoE layer's capture runs every expert on every
    # token (model.Experts: the eager loop's slice sizes wait on the host)
    name, hf, path = checkpoint
    kw = dict(num_blocks=12, max_num_batched_tokens=24, max_batch_size=6)
    engines = {c: cuda_engine(path, compile=c, **kw) for c in (True, False)}
    for params in (SamplingParams(temperature=1.0, max_tokens=12, seed=7),
                   SamplingParams(temperature=0, max_tokens=10)):
        for step in range(2):
            got = {c: e.generate(PROMPTS, params, 2) for c, e in engines.items()}
            for a, b in zip(got[True], got[False]):
                assert a.completion_tokens == b.completion_tokens, f"[{name}] tokens"
                assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
            new = {k: v * 1.01 for k, v in engines[False].model.state_dict().items()}
            for e in engines.values():
                e.update_weights(new)
    stats = engines[True].stats()
    assert stats["compiled_steps"] > 0 and stats["preemptions"] > 0, stats
    assert stats["prefix_cache_hit_tokens"] > 0, stats
    assert len(engines[True].static.graphs) >= 2, "captured more than one bucket"


def test_packed_training_forward_and_backward_match_transformers_and_the_cpu(checkpoint):
    # the trainer's path on a GPU: packed documents (forward and backward), against
    # transformers per document and against our CPU path's gradients
    name, hf, path = checkpoint
    docs = PROMPTS
    cu = torch.tensor([0] + [len(d) for d in docs]).cumsum(0).to(torch.int32)
    grads = {}
    for device in ("cuda", "cpu"):
        model = load_hf_checkpoint(path, device=device)
        tokens = torch.tensor([t for d in docs for t in d], device=device)
        pos = torch.cat([torch.arange(len(d)) for d in docs]).to(device)
        logits, aux = logits_and_aux(model, tokens, pos, cu)
        (logits.logsumexp(-1).mean() + aux).backward()
        grads[device] = {n: p.grad.cpu() for n, p in model.named_parameters()}
        if device == "cuda":
            with torch.no_grad():
                for d, start in zip(docs, cu[:-1].tolist()):
                    ref = hf(torch.tensor([d], device="cuda")).logits[0]
                    err = (logits[start:start + len(d)] - ref).abs().max().item()
                    assert err < 1e-4, f"[{name}] packed logits vs transformers {err}"
    for n, g in grads["cuda"].items():
        scale = grads["cpu"][n].abs().max().clamp_min(1e-8)
        err = ((g - grads["cpu"][n]).abs().max() / scale).item()
        assert err < 1e-4, f"[{name}] {n}: GPU vs CPU gradient, relative error {err}"


def test_grpo_on_the_gpu_trains_and_its_logprobs_agree(tmp_path):
    train_grpo.main(tiny_config(tmp_path / "gpu", "--device=cuda", "--max_iters=4"))
    rows = [r for r in metrics(tmp_path / "gpu") if "train/loss" in r]
    assert len(rows) == 4 and all(r["train/loss"] == r["train/loss"] for r in rows)
    assert max(r["train/logprob_mismatch"] for r in rows) < 1e-4


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one GPU "
                    "('Duplicate GPU detected'): the server needs a GPU of its own")
def test_weights_pushed_over_nccl_sample_what_the_colocated_gpu_run_samples(tmp_path, monkeypatch):
    args = [MODEL, "--max_iters=4", "--ckpt_interval=4", "--eval_interval=4", "--device=cuda"]
    train_grpo.main(tiny_config(tmp_path / "one", *args))
    with monkeypatch.context() as m:   # the server sees the second GPU as its cuda:0
        m.setenv("CUDA_VISIBLE_DEVICES", "1")
        server = Served(tmp_path / "one" / "ckpt", "--enable_weight_updates=True", "--device=cuda")
    try:
        served = tiny_config(tmp_path / "served", *args, f"--rollout_urls={server.url}",
                             "--weight_backend=nccl", script=train_grpo_async)
        train_grpo_async.main(served)
    finally:
        server.stop()
    assert_same(tmp_path / "one", tmp_path / "served", rel=1e-4, at_least=10)
    rows = [r for r in metrics(tmp_path / "served") if "train/loss" in r]
    assert all(r["perf/weight_sync_s"] > 0 for r in rows[1:])
