r"""
What fits where: the peak memory of one GRPO step at a real model's shape, per mode, each
in a fresh process (its VmHWM less the process's own before the model exists), against
the formula docs/memory.md gives, and the ratios between modes.

    python -m bench.memory                       # Qwen3-0.6B's shape, 8 of its 28 layers
    python -m bench.memory --layers 4 --tokens 512 --modes full lora

A step here is what a colocated train_grpo.py iteration holds at once: the trainer's fp32
model, the engine's own copy (fp32, a few KV blocks: the rollout's KV cache is sized
separately), one packed batch of --tokens tokens through training.train_step (AdamW),
then engine.update_weights(model.state_dict()). The rollout itself is left out: its
memory is the KV pool, which EngineConfig sizes (memory_fraction) whatever the mode.

The formula (bytes), for a run's steady state (the second step: AdamW's moments exist):
    4 P (weights) + 4 P (engine copy) + 12 T' (trained: gradient and two AdamW moments)
    + 8 P_adapted (LoRA: the merged weights the backward keeps, and their full-size
    gradients on the way to A and B) + activations (T tokens x layers x per-token bytes,
    plus the head's two [rows, V] chunks)
with P every parameter, T' the trained ones (P in full fine-tuning, the adapters in
LoRA), P_adapted the weights LoRA adapts.
"""
import argparse
import json
import os
import subprocess
import sys

import torch

# the Qwen3 dense models' config.json fields this needs: (hidden, intermediate, layers,
# heads, kv heads, tied embeddings); every one has head_dim 128 and vocabulary 151,936
QWEN3 = {"0.6B": (1024, 3072, 28, 16, 8, True), "1.7B": (2048, 6144, 28, 16, 8, True),
         "4B": (2560, 9728, 36, 32, 8, True), "8B": (4096, 12288, 36, 32, 8, False)}
GPUS_GB = (24, 80, 141)
# Qwen3-0.6B's config.json, but the number of layers
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_experts=0,
                 tie_word_embeddings=True, rope_theta=1_000_000.0, max_position_embeddings=4096)
GiB = 2 ** 30


def vm_hwm():
    """This process's peak resident memory (bytes) since it started."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def one_step(mode, layers, tokens, rank):
    """(peak bytes above the bare process, parameter counts) of one GRPO step in mode."""
    import lora
    import training
    from engine import EngineConfig, InferenceEngine
    from model import ModelConfig, Transformer
    torch.manual_seed(0)
    before = vm_hwm()
    with torch.device("meta"):
        model = Transformer(ModelConfig(**QWEN3_06B, num_hidden_layers=layers))
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    if mode == "lora":
        lora.add_lora(model, lora.LoRASpec(rank, 2.0 * rank, lora.TARGETS))
    engine = InferenceEngine(EngineConfig(device="cpu", num_blocks=8, max_model_len=tokens,
                                          max_batch_size=8), model=model)
    optimizer = training.configure_optimizer(model, 1e-5, 0.0, (0.9, 0.95), "cpu")
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 151936, (tokens // 8,), generator=g).tolist() for _ in range(8)]
    adv = [[float(torch.randn(1, generator=g))] * len(s) for s in seqs]
    batch = training.pack_sequences(seqs, adv)
    for _ in range(2):   # the second step is a run's steady state: AdamW's moments exist
        training.train_step(model, optimizer, [batch], 1e-5)
        engine.update_weights(model.state_dict())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    adapted = 0 if mode != "lora" else sum(getattr(m, n).numel() for _, m, n in
                                           lora.targeted(model, lora.TARGETS))
    return vm_hwm() - before, {"params": model.num_params() if mode != "lora" else
                               sum(t.numel() for t in lora.base_weights(model).values()),
                               "trained": trained, "adapted": adapted}


def activation_bytes(cfg, layers, tokens):
    """What the backward keeps per token and layer (fp32), plus the head's chunks: the
    residual stream and each norm's input and output, q/k/v and the attention's output,
    the MLP's gate, up and their product (a count of the tensors the forward saves)."""
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * cfg["head_dim"]
    attn = cfg["num_attention_heads"] * cfg["head_dim"]
    per_token_layer = 4 * (6 * H + 2 * qkv + 2 * attn + 4 * I)
    head = 2 * 256 * 2 ** 20     # two [rows, V] fp32 chunks (model.head_logprobs)
    return tokens * layers * per_token_layer + head


def predicted(counts, layers, tokens, cfg=QWEN3_06B):
    """The formula's bytes for a step (see the top of this file)."""
    P, trained, adapted = counts["params"], counts["trained"], counts["adapted"]
    return (4 * P + 4 * P + 12 * trained + 8 * adapted
            + activation_bytes(cfg, layers, tokens))


def counts_of(name, rank):
    """(every parameter, LoRA's trained ones at rank, the weights it adapts) of a Qwen3
    model, from its shape alone."""
    H, I, L, Hq, Hkv, tied = QWEN3[name]
    D, V = 128, 151936
    linears = [(H, Hq * D), (H, Hkv * D), (H, Hkv * D), (Hq * D, H), (H, I), (H, I), (I, H)]
    adapted = L * sum(i * o for i, o in linears)
    params = V * H * (1 if tied else 2) + adapted + L * (2 * H + 2 * D) + H
    return {"params": params, "trained": L * sum(rank * (i + o) for i, o in linears),
            "adapted": adapted, "layers": L, "hidden": H, "intermediate": I}


def gpu_bytes(c, mode, tokens):
    """The formula on a GPU: fp32 master weights, gradients and AdamW, the engine's copy
    in bf16 (engine_dtype), activations under bf16 autocast (half the fp32 count)."""
    trained = c["params"] if mode == "full" else c["trained"]
    adapted = c["adapted"] if mode == "lora" else 0
    cfg = dict(QWEN3_06B, hidden_size=c["hidden"], intermediate_size=c["intermediate"])
    return (4 * c["params"] + 2 * c["params"] + 12 * trained + 8 * adapted
            + activation_bytes(cfg, c["layers"], tokens) / 2)


def table(rank, tokens):
    """What fits: the formula's GiB per model and mode, and which GPUs hold it."""
    print(f"| model | mode | GiB (formula, {tokens} tokens a micro-batch) | fits "
          f"{' / '.join(f'{g} GB' for g in GPUS_GB)} |")
    print("| --- | --- | --- | --- |")
    for name in QWEN3:
        c = counts_of(name, rank)
        for mode in ("full", "lora"):
            need = gpu_bytes(c, mode, tokens)
            fits = " / ".join("yes" if need < 0.9 * g * 1e9 else "no" for g in GPUS_GB)
            label = "full" if mode == "full" else f"LoRA r={rank}"
            print(f"| Qwen3-{name} ({c['params'] / 1e9:.2f}B) | {label} | {need / GiB:.1f} | "
                  f"{fits} |")


def child(args):
    peak, counts = one_step(args.mode, args.layers, args.tokens, args.rank)
    print(json.dumps({"peak": peak, **counts}))


def measure(mode, args):
    """One mode's step in a fresh process: its peak is its own."""
    cmd = [sys.executable, "-m", "bench.memory", "--child", mode, "--layers", str(args.layers),
           "--tokens", str(args.tokens), "--rank", str(args.rank)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    parser.add_argument("--child", choices=["full", "lora"])
    parser.add_argument("--table", action="store_true", help="only the formula's table")
    args = parser.parse_args()
    if args.child:
        args.mode = args.child
        return child(args)
    if args.table:
        return table(args.rank, args.tokens)
    print(f"Qwen3-0.6B's shape, {args.layers} layers, {args.tokens} tokens a step, LoRA rank "
          f"{args.rank} on every linear")
    print("| mode | parameters | trained | measured GiB | formula GiB | formula / measured |"
          " vs full |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rows = {mode: measure(mode, args) for mode in args.modes}
    for mode, r in rows.items():
        formula = predicted(r, args.layers, args.tokens)
        vs_full = f"{r['peak'] / rows['full']['peak']:.2f}x" if "full" in rows else ""
        print(f"| {mode} | {r['params'] / 1e6:.1f}M | {r['trained'] / 1e6:.2f}M | "
              f"{r['peak'] / GiB:.2f} | {formula / GiB:.2f} | {formula / r['peak']:.2f} | "
              f"{vs_full} |")


if __name__ == "__main__":
    main()
