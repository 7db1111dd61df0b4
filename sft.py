"""
Supervised fine-tuning on chat conversations: the loss is on the assistant reply only (weights = loss mask).

    python sft.py config/qwen_small.py
    python sft.py config/qwen_small.py --init_from=out/qwen_small/pretrain --max_iters=100
    python sft.py config/qwen_small.py --init_from=resume           # continue a killed run exactly

The data is the embedded task's demonstrations (task.sft_examples: a minority of the training problems with
their preferred answer), each made by tokenizer.chat_example, the same chat template the engine's prompts use.
eval/loss is measured on demonstrations of the held-out problems; at the end the model answers every held-out
problem greedily and eval/accuracy is the share the task's exact reward accepts.
"""
import sys

import torch

import task
import training
from checkpoint import init_start
from configurator import configure, print0
from tokenizer import build_tokenizer, chat_example, chat_prompt_ids, completion_text

# -----------------------------------------------------------------------------
# settings (a config file, then --key=value, override these)
out_dir = "out/sft"
init_from = "out/pretrain"   # 'scratch' | 'resume' | a previous run's out_dir | a transformers model dir
model = dict()               # ModelConfig fields, used only with init_from='scratch'
seed = 1337
device = "cpu"
dtype = "float32"            # 'float32' | 'bfloat16' (autocast; master weights stay fp32)
compile = False
# optimization
max_iters = 200
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 10
lr_decay_iters = 0           # 0 = max_iters
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
aux_loss_coef = 0.01         # times the router's load-balancing loss
batch_tokens = 1024          # tokens per micro-batch (whole conversations, packed)
grad_accum = 1               # micro-batches per optimizer step
# evaluation
n_eval_problems = 0          # held-out problems answered greedily at the end (0 = all of them)
eval_max_tokens = 16         # generation budget per answer
eval_batch_size = 64         # prompts per forward in the greedy loop
# logging and checkpoints
log_interval = 10
eval_interval = 50
ckpt_interval = 100
wandb_log = False
wandb_project = "nano-rl"
wandb_run_name = ""
# -----------------------------------------------------------------------------
config = configure(globals(), sys.argv[1:], stage="sft")


def demonstrations(tokenizer, problems):
    """chat examples (ids, loss mask) of problems answered with their preferred solution"""
    return [chat_example(tokenizer, task.prompt_messages(p) + [{"role": "assistant", "content": task.solutions(p)[0]}])
            for p in problems]


@torch.no_grad()
def greedy_generate(model, prompts, max_new_tokens, stop_ids, device, batch_size):
    """Greedy completions of token-id prompts with the packed forward, no KV cache: every step re-reads each
    unfinished sequence whole and takes the logits at its last token. Slow but obviously right; the engine
    (engine.py) is the fast path. Completions include the stop token when one was emitted."""
    outs = [[] for _ in prompts]
    for lo in range(0, len(prompts), batch_size):
        active = list(range(lo, min(lo + batch_size, len(prompts))))
        for _ in range(max_new_tokens):
            if not active:
                break
            seqs = [prompts[i] + outs[i] for i in active]
            batch = training.pack_sequences(seqs, [[0.0] * len(s) for s in seqs]).to(device)
            logits, _ = model(batch.tokens, batch.position_ids, batch.cu_seqlens,
                              logits_indices=batch.cu_seqlens[1:].long() - 1)
            for i, t in zip(active, logits.argmax(-1).tolist()):
                outs[i].append(t)
            active = [i for i in active if outs[i][-1] not in stop_ids]
    return outs


def accuracy(model, tokenizer, problems):
    prompts = [chat_prompt_ids(tokenizer, task.prompt_messages(p)) for p in problems]
    outs = greedy_generate(model, prompts, eval_max_tokens, {tokenizer.eos_token_id}, device, eval_batch_size)
    texts = [completion_text(tokenizer, o) for o in outs]
    for p, t in list(zip(problems, texts))[:3]:
        print0(f"  digits {p.digits} target {p.target} -> {t!r} (reward {task.reward(p, t)})")
    return sum(task.reward(p, t) for p, t in zip(problems, texts)) / len(problems)


if __name__ == "__main__":
    start = init_start(config, build_tokenizer)
    tokenizer = start.tokenizer
    train_ex = [chat_example(tokenizer, m) for m in task.sft_examples(seed)]
    test_problems = task.make_problems("test", n_eval_problems or None)
    val_ex = demonstrations(tokenizer, test_problems)
    print0(f"{len(train_ex)} demonstrations ({sum(sum(m) for _, m in train_ex)} reply tokens), "
           f"{len(test_problems)} held-out problems")
    loader = training.PackedLoader([i for i, _ in train_ex], [[float(x) for x in m] for _, m in train_ex],
                                   batch_tokens, seed)
    val_batches = training.fixed_batches([i for i, _ in val_ex], [[float(x) for x in m] for _, m in val_ex],
                                         batch_tokens)

    def eval_fn(model):
        return {"eval/loss": training.evaluate_loss(model, val_batches, device)}

    def final_fn(model):
        return {"eval/accuracy": accuracy(model, tokenizer, test_problems)}

    final = training.train(config, start, loader, eval_fn=eval_fn, final_fn=final_fn)
    if "eval/accuracy" in final:
        print0(f"held-out accuracy (greedy, {len(test_problems)} problems): {final['eval/accuracy']:.3f}")
