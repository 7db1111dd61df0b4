"""
Shared test fixtures. The reference for correctness is always transformers: tests build
random tiny checkpoints with transformers itself (its own classes, its own
save_pretrained) and compare our code against them.
"""

import os
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference.radix import RadixCache


def randomise(hf_model, seed=0):
    """Perturb every parameter: all-zero routers and all-one norms hide bugs (a wrong norm
    or router path still "matches")."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif "mlp.gate.weight" in name or name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return hf_model.eval()


def logits_and_aux(model, *args, temperature=1.0, **kwargs):
    """The whole model on a batch, as transformers' forward gives it: (logits [T, V],
    the load-balancing loss): model's blocks (forward), then its head and its aux loss."""
    hidden, router_logits = model(*args, **kwargs)
    return model.logits(hidden, temperature), model.aux_loss(router_logits, hidden)


def write_hf_checkpoint(hf_config, path, seed=0):
    """(hf_model, path): a randomised transformers model of hf_config (Qwen3, Qwen3-MoE,
    Qwen2, Llama), written to path by transformers' own save_pretrained."""
    torch.manual_seed(seed)
    hf = randomise(AutoModelForCausalLM.from_config(hf_config), seed)
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module")
def one_thread():
    # tiny models gain nothing from a second thread, and on a shared 2-core machine an
    # oversubscribed OpenMP pool makes each small op far slower
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# gloo's exit race (torch 2.13 on CPU, once in about 150 two-rank runs here): a rank can
# abort at the very end, "terminate called without an active exception", after the
# script's last output. A run counts as passed when every rank had written its finish
# marker (FINISHED, the last line of each script, after destroy_process_group) before one
# died that way: nothing of the job's work was left. Any other failure, or that abort
# before a marker, still fails.
GLOO_EXIT_ABORT = "terminate called without an active exception"
FINISHED = ("import os as _os; open(_os.path.join(_os.environ['FINISH_DIR'], 'finished.' + "
            "_os.environ.get('RANK', '0')), " "'w').close()\n")


def run_ranks(argv, nproc, env, **kwargs):
    """Run `python argv` (under torchrun --standalone when nproc > 1; the script ends with
    FINISHED) with capture_output=True, text=True; a run that failed only by gloo's exit
    race comes back with returncode 0."""
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [sys.executable] + (torchrun if nproc > 1 else []) + [str(a) for a in argv]
    with tempfile.TemporaryDirectory() as finish_dir:
        done = subprocess.run(cmd, env=dict(env, FINISH_DIR=finish_dir), capture_output=True,
                              text=True, **kwargs)
        finished = all(os.path.exists(os.path.join(finish_dir, f"finished.{r}"))
                       for r in range(nproc))
    if done.returncode != 0 and finished and GLOO_EXIT_ABORT in done.stdout + done.stderr:
        warnings.warn(
            f"every rank finished, then one aborted at exit (gloo's exit race): {' '.join(cmd)}"
        )
        done.returncode = 0
    return done


PARITY_TASK = '''"""Countdown's problems, scored by the parity of the reply's length: a tiny
random model gets both rewards, so its groups have variance (the real one would be 0 everywhere)."""
from tasks.countdown_full import describe, kind, make_problems, prompt_messages


def reward(problem, completion_text):
    return float(len(completion_text) % 2 == 0)
'''


def write_task(directory, source=PARITY_TASK, name="parity_task.py"):
    """A task file (tasks/environment.py's interface) in directory; returns its path
    (for --task=)."""
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write(source)
    return path


# -----------------------------------------------------------------------------
# the prefix caches' invariants, checked by the tests after every operation


def check_invariants(cache):
    """The invariants of an engine's cache (scheduler.BlockAllocator or
    radix.RadixCache)."""
    (radix_invariants if isinstance(cache, RadixCache) else allocator_invariants)(cache)


def allocator_invariants(alloc):
    """A BlockAllocator's: refcounts >= 0, free + used = total, free means refcount 0,
    names and the table agree."""
    free = alloc.free_plain + list(alloc.free_cached)
    assert len(free) == len(set(free)), "a block is free twice"
    assert all(r >= 0 for r in alloc.refcount)
    assert all(alloc.refcount[b] == 0 for b in free)
    used = sum(r > 0 for r in alloc.refcount)
    assert used + len(free) == alloc.num_blocks, (used, len(free), alloc.num_blocks)
    assert all(alloc.block_hash[b] is not None for b in alloc.free_cached)
    assert all(alloc.block_hash[b] is None for b in alloc.free_plain)
    assert all(alloc.block_hash[b] == h for h, b in alloc.cached.items())
    assert sum(h is not None for h in alloc.block_hash) == len(alloc.cached)


def radix_invariants(cache):
    """A RadixCache's: refcounts >= 0, free means refcount 0 and not in the tree, each
    slot in at most one edge, the tree's counts agree, every edge non-empty and filed
    under its first token."""
    assert all(r >= 0 for r in cache.refcount)
    assert len(cache.free) == len(set(cache.free)), "a slot is free twice"
    assert all(cache.refcount[s] == 0 and not cache.in_tree[s] for s in cache.free)
    assert sum(r > 0 for r in cache.refcount) + len(cache.free) == cache.num_blocks
    nodes = cache._nodes()
    owned = [s for n in nodes for s in n.slots]
    assert len(owned) == len(set(owned)), "a slot is in two edges"
    assert set(owned) == {s for s in range(cache.num_blocks) if cache.in_tree[s]}
    assert all(cache.refcount[s] >= 1 for s in owned)
    assert cache.num_evictable == sum(cache.refcount[s] == 1 for s in owned)
    for n in nodes:
        assert n.key and len(n.key) == len(n.slots) and n.parent.children[n.key[0]] is n
