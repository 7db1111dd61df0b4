r"""
What fits where: the peak memory of a GRPO step at a real model's shape, per mode and per
rank, each mode in fresh processes, against the formula below, as ratios to one process
of full fine-tuning; and the formula's table for the Qwen3 models on common GPUs.

    python -m bench.memory                       # Qwen3-0.6B's shape, 8 of its 28 layers
    python -m bench.memory --layers 4 --tokens 512 --modes full lora
    python -m bench.memory --table               # the formula for Qwen3 0.6B..8B, 24/80/141 GB

A step here is what a colocated train_grpo.py iteration holds at once: the trainer's fp32
model, the engine (fp32, a few KV blocks: the rollout's KV pool is sized apart,
EngineConfig.memory_fraction) with its own whole copy of the weights, or, for LoRA in one
process, reading the trainer's frozen base itself (lora.sharing_base), one packed batch of
--tokens tokens through training.train_step (AdamW), then the new weights into the engine
(engine.update_from: the adapters alone when shared, gathered one tensor at a time when
sharded). Two steps, the second a run's steady state (AdamW's moments exist); the peak is
resident memory (VmHWM, reset once the model, engine and optimizer exist) over the process
before the model. Modes: full (one process), lora (rank --rank, alpha 2 x rank, every
linear), fsdp and lora_fsdp (2 gloo ranks under torchrun, the larger rank's).

The formula (bytes per rank), N ranks:
    4 P / N (weights) + 4 P (the engine's whole copy; 0 when it shares a LoRA base; with
    --sleep, outside the step: the larger of the two phases counts)
    + 12 T' / N (trained: gradient and two AdamW moments)
    + activations (T tokens x layers x per-token bytes, plus the head's two [rows, V]
    chunks) + one gathered block and the gathered root (FSDP2), and the root's whole
    gradient (FSDP2, the root trained)
with P every parameter, T' the trained ones (P in full fine-tuning, the adapters in
LoRA). docs/memory.md has the measurements.
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
MODES = ("full", "lora", "fsdp", "lora_fsdp")
GiB = 2 ** 30


def model_config(layers):
    """Qwen3-0.6B's config.json, but the number of layers."""
    from model import ModelConfig
    return ModelConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       num_experts=0, tie_word_embeddings=True, rope_theta=1_000_000.0,
                       max_position_embeddings=4096, num_hidden_layers=layers)


def status(key):
    """A /proc/self/status size in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def reset_peak():
    # Linux: writing 5 to clear_refs sets VmHWM back to the current VmRSS
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def build(mode, layers, tokens, rank):
    """(model, engine, optimizer) of a mode, the model sharded over the ranks for fsdp."""
    import lora
    import training
    from engine import EngineConfig, InferenceEngine
    from model import Transformer
    from scaleout import distributed
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(model_config(layers))
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    if mode.startswith("lora"):
        lora.add_lora(model, lora.LoRASpec(rank, 2.0 * rank, lora.TARGETS))
    if mode.endswith("fsdp"):
        distributed.setup("cpu", 600)
        distributed.wrap(model, "cpu", fsdp=True)
    engine = InferenceEngine(EngineConfig(device="cpu", num_blocks=8, max_model_len=tokens,
                                          max_batch_size=8), model=model)
    optimizer = training.configure_optimizer(model, 1e-5, 0.0, (0.9, 0.95), "cpu")
    return model, engine, optimizer


def steps(model, engine, optimizer, tokens, sleep=False):
    """Two GRPO-shaped steps: a packed batch of tokens with an advantage per sequence,
    then the weights into the engine; sleep: the engine asleep during each step
    (train_grpo.py's engine_sleep)."""
    import training
    from scaleout import distributed
    g = torch.Generator().manual_seed(1 + distributed.rank())
    seqs = [torch.randint(0, 151936, (tokens // 8,), generator=g).tolist() for _ in range(8)]
    adv = [[float(torch.randn(1, generator=g))] * len(s) for s in seqs]
    batch = training.pack_sequences(seqs, adv)
    for _ in range(2):
        if sleep:
            engine.sleep()
        training.train_step(model, optimizer, [batch], 1e-5)
        if sleep:
            engine.wake_up()
        engine.update_from(model)


def counts(model):
    """Every parameter (the base's, under LoRA), the trained ones, the adapted ones (a
    shard's numel() is its whole tensor's)."""
    import lora
    if not lora.has_adapters(model):
        n = sum(p.numel() for p in model.parameters())
        return {"params": n, "trained": n, "adapted": 0}
    return {"params": sum(t.numel() for t in lora.base_weights(model).values()),
            "trained": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "adapted": sum(getattr(m, n).numel() for _, m, n in
                           lora.targeted(model, model.lora_spec.targets))}


def child(mode, layers, tokens, rank, sleep):
    """Print this process's peak (JSON) over the steps of mode."""
    from scaleout import distributed
    bare = status("VmRSS")
    model, engine, optimizer = build(mode, layers, tokens, rank)
    reset_peak()
    steps(model, engine, optimizer, tokens, sleep)
    peak = status("VmHWM") - bare
    row = json.dumps({"rank": distributed.rank(), "peak": peak, **counts(model)})
    for r in range(distributed.world()):   # one rank at a time: lines never interleave
        if r == distributed.rank():
            print(row, flush=True)
        distributed.barrier()
    del model, engine, optimizer
    distributed.teardown()


def measure(mode, args):
    """A mode's steps in fresh processes (2 ranks for fsdp): its largest rank's row."""
    ranks = 2 if mode.endswith("fsdp") else 1
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] \
        if ranks == 2 else []
    cmd = [sys.executable, *launcher, "-m", "bench.memory", "--child", mode,
           "--layers", str(args.layers), "--tokens", str(args.tokens), "--rank", str(args.rank),
           *(["--sleep"] if args.sleep else [])]
    threads = max(1, args.threads // ranks)
    # glibc keeps freed heap memory once its mmap threshold has risen (to 32 MiB, after
    # the first big free), so resident memory would count a step's freed activations
    # again in the next: a fixed threshold maps every tensor of 64 KiB or more on its own
    # and unmaps it when freed, and the peak is that of live tensors (a GPU's
    # max_memory_allocated, not its allocator's reserve)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == ranks, out.stdout[-2000:] + out.stderr[-2000:]
    return dict(max(rows, key=lambda r: r["peak"]), ranks=ranks)


# -----------------------------------------------------------------------------
# the formula


def activation_bytes(hidden, intermediate, layers, tokens, qkv=4096, attn=2048):
    """What the backward keeps per token and layer (fp32), plus the head's chunks: the
    residual stream and each norm's input and output, q/k/v and the attention's output,
    the MLP's gate, up and their product (a count of the tensors the forward saves)."""
    per_token_layer = 4 * (6 * hidden + 2 * qkv + 2 * attn + 4 * intermediate)
    head = 2 * 256 * 2 ** 20     # two [rows, V] fp32 chunks (model.head_logprobs)
    return tokens * layers * per_token_layer + head


def predicted(c, layers, tokens, ranks, hidden=1024, intermediate=3072, engine_bytes=4,
              sleep=False):
    """The formula's bytes per rank (the top of this file); c: counts(). A LoRA model in
    one process shares its base with the engine when their dtypes agree (engine_bytes =
    4: the fp32 engine here), so its engine holds no copy."""
    P, trained, adapted = c["params"], c["trained"], c["adapted"]
    gathered, root = 0, 151936 * hidden
    if ranks > 1:   # one block's weights and the root's (embedding), whole while computed,
        block = (P - root) / layers
        gathered = 4 * (block + root) * (ranks - 1) / ranks
        if trained == P:   # and the root's gradient, whole until the backward's last reduce
            gathered += 4 * root
    held = 4 * P / ranks + 12 * trained / ranks      # weights, gradients, AdamW
    engine = 0 if adapted and ranks == 1 and engine_bytes == 4 else engine_bytes * P
    step = activation_bytes(hidden, intermediate, layers, tokens) + gathered
    if sleep:   # the engine's weights are back only once the step is over
        return held + max(step, engine)
    return held + engine + step


def qwen3_counts(name, rank):
    """counts() of a Qwen3 model from its shape alone, at LoRA rank."""
    H, I, L, Hq, Hkv, tied = QWEN3[name]
    D, V = 128, 151936
    linears = [(H, Hq * D), (H, Hkv * D), (H, Hkv * D), (Hq * D, H), (H, I), (H, I), (I, H)]
    adapted = L * sum(i * o for i, o in linears)
    params = V * H * (1 if tied else 2) + adapted + L * (2 * H + 2 * D) + H
    return {"params": params, "lora": L * sum(rank * (i + o) for i, o in linears),
            "adapted": adapted}


def table(rank, tokens, ranks=8, sleep=False):
    """The formula's GiB per rank for each Qwen3 model and mode, on a GPU: fp32 master
    weights, gradients and AdamW, the engine's copy in bf16 (engine_dtype), activations
    under bf16 autocast (half the fp32 count); FSDP2 over `ranks` GPUs; sleep: the engine
    asleep through the step."""
    print(f"| model | full | LoRA r={rank} | FSDP2 x{ranks} | LoRA + FSDP2 x{ranks} |")
    print("| --- | --- | --- | --- | --- |")
    for name, (H, I, L, *_) in QWEN3.items():
        c = qwen3_counts(name, rank)
        cells = []
        for lora_on, n in ((False, 1), (True, 1), (False, ranks), (True, ranks)):
            mode = {"params": c["params"], "trained": c["lora"] if lora_on else c["params"],
                    "adapted": c["adapted"] if lora_on else 0}
            act = activation_bytes(H, I, L, tokens, qkv=(QWEN3[name][3] + 2 * QWEN3[name][4])
                                   * 128, attn=QWEN3[name][3] * 128) / 2
            need = predicted(mode, L, 0, n, H, I, engine_bytes=2, sleep=sleep) + act
            fits = "/".join("y" if need < 0.9 * g * 1e9 else "n" for g in GPUS_GB)
            cells.append(f"{need / GiB:.0f} ({fits})")
        print(f"| Qwen3-{name} ({c['params'] / 1e9:.2f}B) | " + " | ".join(cells) + " |")
    print(f"(GiB per GPU, {tokens} tokens a micro-batch; fits 24/80/141 GB: y or n at 90%)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--sleep", action="store_true",
                        help="the engine asleep during each step (engine_sleep)")
    parser.add_argument("--child", choices=MODES)
    parser.add_argument("--table", action="store_true", help="only the formula's table")
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.layers, args.tokens, args.rank, args.sleep)
    if args.table:
        return table(args.rank, args.tokens, sleep=args.sleep)
    print(f"Qwen3-0.6B's shape, {args.layers} layers, {args.tokens} tokens a step, LoRA rank "
          f"{args.rank} on every linear" + (", the engine asleep during the step" * args.sleep))
    print("| mode | ranks | parameters | trained | peak GiB per rank | formula GiB | "
          "formula / measured | vs full |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = {}
    for mode in args.modes:   # each row as soon as it is measured
        rows[mode] = r = measure(mode, args)
        formula = predicted(r, args.layers, args.tokens, r["ranks"], sleep=args.sleep)
        vs_full = f"{r['peak'] / rows['full']['peak']:.2f}x" if "full" in rows else ""
        print(f"| {mode} | {r['ranks']} | {r['params'] / 1e6:.1f}M | {r['trained'] / 1e6:.2f}M | "
              f"{r['peak'] / GiB:.2f} | {formula / GiB:.2f} | {formula / r['peak']:.2f} | "
              f"{vs_full} |", flush=True)


if __name__ == "__main__":
    main()
