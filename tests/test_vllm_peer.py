"""
vLLM's own trainer-side weight-transfer API driving scaleout/serve.py: its
HTTPVLLMWeightSyncClient and WeightTransferTrainerFactory (imported from vLLM 0.32.0, not
copied), with this project's gloo backend registered in that factory
(scaleout/vllm_gloo.py), push a checkpoint's weights to a running server through vLLM's
full cycle; the server then samples exactly what an engine on those weights samples. A
push whose shapes do not fit is refused with vLLM's 500 before any byte, nothing changed.

vLLM lives in its own venv (bash bench/peers/install.sh vllm: .peers/vllm; VLLM_PYTHON
names another interpreter), so the trainer's side runs there in a subprocess. Skipped
without it.
"""

import json
import os
import subprocess

import httpx
import pytest
import torch

from checkpoint import load_hf_checkpoint, ours_to_hf
from engine import EngineConfig, InferenceEngine, SamplingParams
from test_serve import Served, model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_PYTHON = os.environ.get("VLLM_PYTHON", os.path.join(ROOT, ".peers", "vllm", "bin", "python"))


def _vllm_version():
    if not os.path.isfile(VLLM_PYTHON):
        return None
    try:
        out = subprocess.run([VLLM_PYTHON, "-c", "import vllm; print(vllm.__version__)"],
                             capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 else None


VERSION = _vllm_version()
pytestmark = pytest.mark.skipif(VERSION != "0.32.0", reason=(
    f"needs vLLM 0.32.0 at {VLLM_PYTHON} (bash bench/peers/install.sh vllm), found {VERSION}"))

# the trainer's side, in vLLM's venv: argv = server url, a state dict saved by torch.save
TRAINER = """
import json, sys
import requests, torch
from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from scaleout import vllm_gloo
from scaleout.weight_sync import free_port

url, path = sys.argv[1:3]
state = torch.load(path)

class StateSource(WeightSource):
    def __init__(self, tensors):
        self.tensors = tensors
    def metadata(self):
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]
    def __iter__(self):
        return iter(self.tensors.items())

def push(tensors):
    init = vllm_gloo.GlooTrainerInitInfo("127.0.0.1", free_port(), world_size=2, rank=0,
                                         bucket_mb=0.01)
    engine = WeightTransferTrainerFactory.trainer_init(
        init, client=HTTPVLLMWeightSyncClient(url), source=StateSource(tensors))
    engine.send_weights()

vllm_gloo.register()
out = {}
embed = next(k for k in state if "embed" in k)
try:
    push({**state, embed: torch.zeros(7, 3)})
except requests.HTTPError as e:
    out["refused"] = [e.response.status_code, e.response.json()["error"]["message"]]
push(state)
client = HTTPVLLMWeightSyncClient(url)   # a label for the version, through vLLM's client
client.start_weight_update()
client.finish_weight_update("vllm-pushed")
print(json.dumps(out))
"""


def test_vllms_client_pushes_weights_that_the_server_then_samples_exactly(tmp_path):
    model_dir(tmp_path / "a", seed=1)
    model_dir(tmp_path / "b", seed=2)
    # what a trainer written for vLLM sends: the checkpoint's names (one tensor per expert)
    b = ours_to_hf(load_hf_checkpoint(str(tmp_path / "b")).state_dict())
    torch.save({k: v.contiguous() for k, v in b.items()}, tmp_path / "b.pt")
    server = Served(tmp_path / "a", "--enable_weight_updates=True")   # vLLM's routes: no key
    try:
        run = subprocess.run([VLLM_PYTHON, "-c", TRAINER, server.url, str(tmp_path / "b.pt")],
                             capture_output=True, text=True, timeout=600, cwd=ROOT,
                             env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
        assert run.returncode == 0, run.stderr[-3000:]
        out = json.loads(run.stdout.strip().splitlines()[-1])
        status, message = out["refused"]
        assert status == 500 and "has shape [7, 3]" in message
        assert httpx.get(server.url + "/weight_info").json() == {"weight_version": "vllm-pushed"}
        prompt = [1, 100, 4, 103, 5, 24]
        r = httpx.post(server.url + "/inference/v1/generate", timeout=60, json={
            "token_ids": prompt, "sampling_params": {"max_tokens": 12, "temperature": 0,
                                                     "ignore_eos": True, "logprobs": 0}})
        choice = r.json()["choices"][0]
    finally:
        assert server.stop() == 0
    ref = InferenceEngine(EngineConfig(model_path=str(tmp_path / "b"), max_model_len=256,
                                       num_blocks=64))
    want = ref.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert choice["token_ids"] == list(want.completion_tokens)
    got = [c["logprob"] for c in choice["logprobs"]["content"]]
    assert got == pytest.approx(list(want.logprobs), abs=1e-5)
    assert choice["weight_versions"] == [{"version": "vllm-pushed", "start": 0, "end": 12}]
