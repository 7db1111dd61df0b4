"""
Pretraining: next-token prediction on packed documents, every token weighted 1.

    python pretrain.py config/qwen_small.py
    python pretrain.py config/qwen_small.py --max_iters=50 --out_dir=out/try
    python pretrain.py config/qwen_small.py --init_from=resume      # continue a killed run exactly
    # data-parallel
    torchrun --standalone --nproc_per_node=2 pretrain.py config/qwen_small.py --grad_accum=2

The data is the task's corpus (its pretrain_corpus; the embedded countdown's: blind
attempts of steps over some digits, dead ends included), each document tokenized and
closed with <|endoftext|>. The tokenizer is saved into every checkpoint, so
{out_dir}/ckpt is a self-contained transformers directory and sft.py can start from
--init_from={out_dir}.
"""

from scaleout import distributed
import training
from checkpoint import init_start
from configurator import print0, run_cli
from tasks.environment import load_task, offers
from tokenizer import ENDOFTEXT as _ENDOFTEXT, build_tokenizer

# -----------------------------------------------------------------------------
# settings (a config file, then --key=value, override these)
out_dir = "out/pretrain"
task = "tasks.countdown"     # the task whose corpus to learn (a module or a .py path)
# 'scratch' | 'resume' | a previous run's out_dir | a transformers model dir
init_from = "scratch"
model = dict()    # ModelConfig fields for init_from='scratch' (vocab_size comes from the tokenizer)
seed = 1337
device = "cpu"
dtype = "float32"            # 'float32' | 'bfloat16' (autocast; master weights stay fp32)
compile = False
# torchrun: shard parameters, gradients and AdamW state per block (FSDP2) instead of DDP's
# whole copy per rank
fsdp = False
# optimization
max_iters = 300
max_flops = 0.0             # > 0: stop once the run has spent this many FLOPs
learning_rate = 3e-3
min_lr = 3e-4
warmup_iters = 20
lr_decay_iters = 0           # 0 = max_iters
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
aux_loss_coef = 0.01         # times the router's load-balancing loss
batch_tokens = 2048          # tokens per micro-batch (whole documents, packed)
grad_accum = 1               # micro-batches per optimizer step, over all ranks (a multiple of them)
dist_timeout_s = 300         # torchrun: a collective waiting longer than this ends the job
# data
n_docs = 20000               # training documents
n_val_docs = 200             # held-out documents (another seed) for eval/loss
# logging and checkpoints
log_interval = 10
eval_interval = 100
ckpt_interval = 100
wandb_log = False
wandb_project = "nano-rl"
wandb_run_name = ""
# -----------------------------------------------------------------------------


def documents(tokenizer, the_task, n, seed):
    """token ids of n corpus documents, each closed with <|endoftext|> so the model learns
    where one ends"""
    eot = tokenizer.convert_tokens_to_ids(_ENDOFTEXT)
    return [tokenizer.encode(d, add_special_tokens=False) + [eot]
            for d in the_task.pretrain_corpus(n, seed)]


def main(config):
    config["device"] = distributed.setup(config["device"], config["dist_timeout_s"])
    the_task = load_task(config["task"])
    if not offers(the_task, "pretrain_corpus"):
        raise ValueError(f"task={config['task']!r} has no pretrain_corpus(n_docs, seed)")
    start = init_start(config, build_tokenizer)
    seed, batch_tokens = config["seed"], config["batch_tokens"]
    train_docs = documents(start.tokenizer, the_task, config["n_docs"], seed)
    val_docs = documents(start.tokenizer, the_task, config["n_val_docs"], seed + 1)
    print0(f"{len(train_docs)} documents, {sum(map(len, train_docs))} tokens")

    def ones(docs):   # every token weighs the same
        return [[1.0] * len(d) for d in docs]
    loader = training.PackedLoader(train_docs, ones(train_docs), batch_tokens, seed)
    val_batches = training.fixed_batches(val_docs, ones(val_docs), batch_tokens)

    def eval_fn(model):
        return {"eval/loss": training.evaluate_loss(model, val_batches, config["device"])}

    final = training.train(config, start, loader, eval_fn=eval_fn)
    distributed.teardown()
    return final


if __name__ == "__main__":
    run_cli(main, globals(), "pretrain")
