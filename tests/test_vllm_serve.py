"""
The trainer driving a real `vllm serve` process (vLLM 0.32.0's CPU build) through vLLM's
RL API, with this project's weight-transfer backend on vLLM's worker side
(scaleout/vllm_gloo.py, loaded by vLLM through scaleout/vllm_plugin's entry point):

- weights pushed by weight_sync.ServerWeights round-trip: vLLM then samples the greedy
  tokens of our engine on those weights, its logprobs within 1e-4 of ours; a push whose
  shapes do not fit is refused with vLLM's 500 before any byte, nothing changed;
- a request in flight across an update, with vLLM's pause mode=keep, finishes, its tokens'
  versions in vLLM's weight_versions spans: the old version's, then the new one's;
- train_grpo_async --rollout_urls=<the vLLM server> trains: rewards and logprobs reach the
  trainer, and the logprob mismatch between vLLM's sampler and the trainer stays at the
  fp32 noise level at every step (the trainer's weights are the ones vLLM samples with).

Needs vLLM's venv with the plugin (bash bench/peers/install.sh vllm: .peers/vllm, which
installs scaleout/vllm_plugin into it; VLLM_PYTHON names another interpreter); skipped
without them. Each server takes about a minute to start on two cores.

    python -m pytest -q tests/test_vllm_serve.py
"""

import os
import subprocess
import time

import httpx
import pytest
import torch

import train_grpo
import train_grpo_async
from checkpoint import load_hf_checkpoint, ours_to_hf
from engine import EngineConfig, InferenceEngine, SamplingParams
from test_grpo import TINY, metrics, tiny_config
from test_serve import free_port
from test_vllm_peer import ROOT, VERSION, VLLM_PYTHON


def _has_plugin():
    if VERSION != "0.32.0":
        return False
    out = subprocess.run([VLLM_PYTHON, "-c", "from importlib.metadata import entry_points; "
                          "print([e.name for e in entry_points(group='vllm.general_plugins')])"],
                         capture_output=True, text=True, timeout=120)
    return "'nanorl'" in out.stdout


pytestmark = pytest.mark.skipif(not _has_plugin(), reason=(
    f"needs vLLM 0.32.0 at {VLLM_PYTHON} with scaleout/vllm_plugin installed "
    "(bash bench/peers/install.sh vllm)"))

# head_dim 32 and widths of 64: the smallest vLLM's CPU attention and MoE kernels take;
# tied embeddings, as the embedded default's
SHAPE = dict(TINY, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
             head_dim=32, max_position_embeddings=1024, tie_word_embeddings=True)
MODEL = f"--model={SHAPE!r}".replace(" ", "")
PROMPTS = [[1, 100, 4, 103, 5, 24], [1, 20, 21, 22], [1, 5, 6, 7, 8, 9, 10]]


class VllmServed:
    """`vllm serve` (its OpenAI server module: the CPU wheel's `vllm` command looks for
    the distribution 'vllm') on model_dir, in dev mode (the RL routes), the weight
    transfer backend 'nanorl', fp32, logprobs after temperature (as ours), its
    token-in / token-out /inference/v1/generate on."""

    def __init__(self, model_dir, log_path):
        self.url = f"http://127.0.0.1:{free_port()}"
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1",
                   OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="WARNING")
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
             "--port", self.url.rsplit(":", 1)[1], "--dtype", "float32",
             "--max-model-len", "1024", "--block-size", "32", "--enable-scale-out",
             "--logprobs-mode", "processed_logprobs",
             "--weight-transfer-config", '{"backend": "nanorl"}'],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.time() + 400
        while time.time() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        self.stop()
        with open(log_path) as f:
            raise RuntimeError("vllm serve did not come up:\n" + f.read()[-3000:])

    def greedy(self, prompts, max_tokens=12):
        r = httpx.post(self.url + "/v1/completions", timeout=120, json={
            "model": httpx.get(self.url + "/v1/models").json()["data"][0]["id"],
            "prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 0,
            "return_token_ids": True, "ignore_eos": True})
        r.raise_for_status()
        return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in r.json()["choices"]]

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def ours(model_dir, prompts, max_tokens=12):
    engine = InferenceEngine(EngineConfig(model_path=str(model_dir), max_model_len=256,
                                          num_blocks=64))
    return engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    """3 colocated iterations; its checkpoint is what vLLM serves (the trainer then pushes
    its own weights to it), and a second model of the same shape to push."""
    tmp = tmp_path_factory.mktemp("vllm")
    args = [MODEL, "--max_iters=3", "--ckpt_interval=3", "--eval_interval=100"]
    train_grpo.main(tiny_config(tmp / "one", *args))
    train_grpo.main(tiny_config(tmp / "other", *args, "--seed=7", "--max_iters=1",
                                "--ckpt_interval=1"))
    server = VllmServed(tmp / "one" / "ckpt", tmp / "vllm.log")
    yield tmp, args, server
    server.stop()


def test_weights_pushed_to_vllm_round_trip(colocated):
    from scaleout.weight_sync import ServerWeights
    tmp, _, server = colocated
    other = load_hf_checkpoint(str(tmp / "other" / "ckpt"))
    push = ServerWeights([server.url], other.state_dict(), bucket_mb=0.01)
    embed = next(k for k in other.state_dict() if "embed" in k)
    with pytest.raises(ValueError, match=r"refused \(500\).*embed_tokens.* has shape \[7, 3\]"):
        push.send({**other.state_dict(), embed: torch.zeros(7, 3)})
    assert httpx.get(server.url + "/weight_info").json() == {"weight_version": "default"}
    push.send(other.state_dict(), "pushed")
    assert httpx.get(server.url + "/weight_info").json() == {"weight_version": "pushed"}
    got = server.greedy(PROMPTS)
    want = ours(tmp / "other" / "ckpt", PROMPTS)
    for (ids, logprobs), w in zip(got, want):
        assert ids == list(w.completion_tokens)
        assert logprobs == pytest.approx(list(w.logprobs), abs=1e-4)
    mine = load_hf_checkpoint(str(tmp / "one" / "ckpt")).state_dict()
    push.send(mine, "back")                      # and back, as vLLM's own load served it
    want = ours(tmp / "one" / "ckpt", PROMPTS)
    assert [ids for ids, _ in server.greedy(PROMPTS)] == [list(w.completion_tokens)
                                                          for w in want]


def test_a_request_in_flight_across_an_update_finishes_under_both_versions(colocated):
    # PipelineRL's in-flight update through vLLM: a long request is running when the
    # trainer pauses vLLM with mode=keep, pushes new weights (start, update, finish with a
    # label) and resumes; the request finishes, its first tokens the old version's, the
    # rest the new one's (vLLM's weight_versions spans, by label)
    from concurrent.futures import ThreadPoolExecutor
    from scaleout.weight_sync import ServerWeights
    tmp, _, server = colocated
    other = load_hf_checkpoint(str(tmp / "other" / "ckpt")).state_dict()
    push = ServerWeights([server.url], other)
    push.cycle(ours_to_hf(other), "before")           # a label for the weights it samples with
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(httpx.post, server.url + "/inference/v1/generate", timeout=300,
                              json={"token_ids": PROMPTS[0], "sampling_params": {
                                  "max_tokens": 900, "temperature": 1.0, "ignore_eos": True,
                                  "logprobs": 0}})
        time.sleep(1.0)
        assert httpx.post(server.url + "/pause?mode=keep", timeout=60).status_code == 200
        mine = load_hf_checkpoint(str(tmp / "one" / "ckpt")).state_dict()
        push.cycle(ours_to_hf(mine), "after")
        assert httpx.post(server.url + "/resume", timeout=60).status_code == 200
        choice = running.result().json()["choices"][0]
    spans = choice["weight_versions"]
    assert [s["version"] for s in spans] == ["before", "after"], spans
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0
    assert spans[1]["end"] == len(choice["token_ids"]) == 900


def test_grpo_trains_through_a_vllm_server(colocated):
    tmp, args, server = colocated
    train_grpo_async.main(tiny_config(tmp / "served", *args, f"--rollout_urls={server.url}",
                                      script=train_grpo_async))
    rows = [r for r in metrics(tmp / "served") if "train/loss" in r]
    assert len(rows) == 3
    for r in rows:   # vLLM's samples and logprobs reached the trainer
        assert r["rollout/completion_len"] > 0 and 0.0 <= r["rollout/reward_mean"] <= 1.0
        # vLLM sampled with the trainer's weights: its logprobs are the trainer's, to fp32
        # noise (a stale or half-applied push reads 1e-2 and more here)
        assert r["train/logprob_mismatch"] < 1e-4, r
        assert abs(r["offpolicy/kl_k3"]) < 1e-6, r
    assert [r["perf/weight_sync_s"] > 0 for r in rows] == [False, True, True]
    assert httpx.get(server.url + "/weight_info").json() == {"weight_version": "2"}
