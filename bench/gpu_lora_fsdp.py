r"""
The GPU half of LoRA and FSDP2 (bench/gpu_check.sh runs it; it runs on the CPU too, over
gloo): at Qwen3-0.6B's shape (4 layers),
  1. a bf16 FSDP2 step over NCCL: the model sharded by distributed.wrap(fsdp=True,
     bf16=True) (weights gathered and computed in bf16, gradients reduced in fp32), three
     training.train_step calls against the same steps unsharded under bf16 autocast; the
     losses' largest relative difference, and each step's time and peak memory;
  2. a LoRA merged hot-swap into the CUDA engine: engine.update_weights of the adapted
     model's state_dict (its merged weights) at engine_dtype bfloat16, timed, and the
     engine's greedy tokens against an engine built from the merged model itself.

    torchrun --standalone --nproc_per_node=1 -m bench.gpu_lora_fsdp --device cuda
    torchrun --standalone --nproc_per_node=2 -m bench.gpu_lora_fsdp --device cpu   # gloo
"""
import argparse
import copy
import time

import torch
import torch.distributed as dist

import lora
import training
from bench.memory import model_config
from configurator import print0
from engine import EngineConfig, InferenceEngine, SamplingParams
from model import Transformer
from scaleout import distributed


def peak_and_time(fn, device):
    """(seconds, peak bytes allocated on a GPU, or 0) of fn()."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0, torch.cuda.max_memory_allocated() if cuda else 0


def fsdp_step(device, layers, tokens):
    """bf16 FSDP2 against the same steps unsharded under autocast (every rank)."""
    torch.manual_seed(0)
    plain = Transformer(model_config(layers)).to(device)
    sharded = distributed.wrap(copy.deepcopy(plain), device, fsdp=True, bf16=True)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 151936, (tokens // 8,), generator=g).tolist() for _ in range(8)]
    batch = training.pack_sequences(seqs, [[1.0] * len(s) for s in seqs]).to(device)
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    losses = {}
    for name, model in (("unsharded", plain), ("fsdp2", sharded)):
        opt = training.configure_optimizer(model, 1e-4, 0.0, (0.9, 0.95),
                                           torch.device(device).type)
        for step in range(3):
            metrics, seconds, peak = peak_and_time(
                lambda: training.train_step(model, opt, [batch], 1e-4, 1.0, 0.0,
                                            autocast if name == "unsharded" else None), device)
            losses.setdefault(name, []).append(metrics["train/loss"])
            print0(f"{name} step {step}: loss {metrics['train/loss']:.5f}, "
                               f"{seconds * 1000:.0f} ms, peak {peak / 2 ** 30:.2f} GiB")
        del opt
    worst = max(abs(a - b) / abs(a) for a, b in zip(losses["unsharded"], losses["fsdp2"]))
    print0(f"bf16 FSDP2 against unsharded autocast: largest relative loss "
                       f"difference {worst:.2e} over 3 steps (bf16 rounding: ~1e-2 expected)")
    del sharded, plain


def lora_swap(device, layers):
    """update_weights of a LoRA model's merged weights into a bf16 engine: its time, and
    its greedy tokens against an engine of the merged model."""
    torch.manual_seed(0)
    model = Transformer(model_config(layers)).to(device)
    lora.add_lora(model, lora.LoRASpec(16, 32.0, lora.TARGETS))
    with torch.no_grad():
        for adapter in lora.adapters(model).values():
            adapter.B.normal_(0, 0.01)
    config = EngineConfig(device=device, dtype="bfloat16", num_blocks=64, max_model_len=256,
                          max_batch_size=8)
    engine = InferenceEngine(config, model=Transformer(model_config(layers)).to(device))
    _, seconds, _ = peak_and_time(lambda: engine.update_weights(model.state_dict()), device)
    merged = Transformer(model_config(layers)).to(device)
    merged.load_state_dict(model.state_dict())
    reference = InferenceEngine(config, model=merged)
    prompts = [[1 + i, 2 + i, 3 + i, 4 + i] for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    same = [a.completion_tokens == b.completion_tokens for a, b in
            zip(engine.generate(prompts, greedy), reference.generate(prompts, greedy))]
    print0(f"LoRA merged hot-swap into the {device} engine (bf16): "
                       f"{seconds * 1000:.0f} ms; greedy tokens equal on {sum(same)} of "
                       f"{len(same)} prompts")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    device = distributed.setup(args.device, 300)
    if not dist.is_initialized():   # one rank (one GPU): FSDP2 over a group of one
        cuda = torch.device(device).type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo")
    fsdp_step(device, args.layers, args.tokens)
    if distributed.is_main():
        lora_swap(device, args.layers)
    distributed.teardown()


if __name__ == "__main__":
    main()
