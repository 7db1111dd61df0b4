"""
scaleout/weight_sync.py on 2 gloo ranks under real torchrun: rank 0 sends, rank 1's
engine receives and serves the new weights exactly; buckets smaller than a tensor; a
mismatched model refused at connect.

    python -m pytest -q tests/test_weight_sync.py
"""

import json
import os

import pytest
import torch

from conftest import FINISHED, run_ranks
from scaleout.weight_sync import ByteStream, first_difference, manifest, spans

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r'''
import json, os, sys
import torch, torch.distributed as dist
from model import ModelConfig, Transformer
from engine import EngineConfig, InferenceEngine, SamplingParams
from scaleout.weight_sync import WeightSync

bucket_mb, hidden_on_1, out = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
rank = dist.get_rank()
def make(seed, hidden=32):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=64, hidden_size=hidden, intermediate_size=64,
                                   moe_intermediate_size=16, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   num_experts=4, num_experts_per_tok=2,
                                   max_position_embeddings=64))
# the trainer holds weights "new"; the worker's engine starts from other weights
model = make(1) if rank == 0 else make(2, hidden_on_1)
engine = InferenceEngine(EngineConfig(num_blocks=32, max_model_len=64), model=model)
sync = WeightSync(model.state_dict(), src=0, bucket_mb=bucket_mb)
try:
    sync.connect()
except ValueError as e:
    print(f"refused: {e}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    FINISHED
    sys.exit(0)
params = SamplingParams(temperature=0, max_tokens=12)
prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
if rank == 0:
    seconds, nbytes = sync.send(model.state_dict())
else:
    tensors, seconds, nbytes = sync.receive()
    engine.update_weights(dict(zip(sync.names, tensors)))
    # bitwise
    assert all(torch.equal(a, b) for a, b in zip(tensors, make(1).state_dict().values()))
samples = engine.generate(prompts, params)
with open(f"{out}.{rank}.json", "w") as f:
    json.dump({"tokens": [s.completion_tokens for s in samples],
               "logprobs": [s.logprobs for s in samples],
               "version": engine.get_weight_version(), "bytes": nbytes}, f)
dist.destroy_process_group()
FINISHED
'''.replace("FINISHED", FINISHED.strip())


def run(tmp_path, bucket_mb, hidden_on_1=32):
    script = tmp_path / "sync.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    done = run_ranks([script, bucket_mb, hidden_on_1, out], 2, env, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout, out


# one bucket; 2 KiB buckets, smaller than most tensors
@pytest.mark.parametrize("bucket_mb", [64, 0.002])
def test_worker_serves_exactly_the_senders_weights(tmp_path, bucket_mb):
    _, out = run(tmp_path, bucket_mb)
    sender, worker = (json.loads((tmp_path / f"out.{r}.json").read_text()) for r in (0, 1))
    assert worker["tokens"] == sender["tokens"] and worker["version"] == 1
    assert max(abs(a - b) for x, y in zip(worker["logprobs"], sender["logprobs"])
               for a, b in zip(x, y)) < 1e-5
    assert worker["bytes"] == sender["bytes"] > 2 * 1024 * 20


def test_a_mismatched_model_is_refused_at_connect_naming_the_tensor(tmp_path):
    stdout, _ = run(tmp_path, 64, hidden_on_1=48)
    assert stdout.count("refused: weight sync refused at connect: tensor 0 "
                        "'embed_tokens.weight'") == 2, stdout


def test_buckets_cut_tensors_and_join_them_again():
    tensors = [torch.arange(10, dtype=torch.float32), torch.ones(3, dtype=torch.bfloat16),
               torch.zeros(0), torch.tensor([7], dtype=torch.int64)]
    total = sum(t.numel() * t.element_size() for t in tensors)
    assert spans(10, 4) == [(0, 4), (4, 8), (8, 10)]
    stream, flat = ByteStream(tensors), torch.empty(total, dtype=torch.uint8)
    for start, end in spans(total, 7):                # 7-byte buckets: every float is cut somewhere
        stream.fill(flat[start:end])
    joined = torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])
    assert torch.equal(flat, joined)


def test_first_difference_names_what_differs():
    a = manifest({"x": torch.zeros(2, 3), "y": torch.zeros(4)})
    assert first_difference(a, a) == ""
    assert "'y'" in first_difference(a, manifest({"x": torch.zeros(2, 3), "y": torch.zeros(5)}))
    assert "'z'" in first_difference(a + [("z", (1,), "float32")], a)
