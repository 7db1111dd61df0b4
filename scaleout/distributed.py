"""
Data parallelism on torch.distributed: one process per device, launched by torchrun;
`python script.py` is the same code with one rank and no process group.

    torchrun --standalone --nproc_per_node=2 pretrain.py config/qwen_small.py --grad_accum=2

    # gloo on CPU, NCCL on CUDA (cuda:LOCAL_RANK)
    device = distributed.setup(config["device"], timeout_s)
    forward = distributed.wrap(model, device)    # DDP over the ranks (the model itself on one)
    mine = distributed.shard(micro_batches)      # this rank's share: items rank, rank + N, ...
    lo, hi = distributed.span(len(prompts))      # or a contiguous slice (rollouts keep their order)
    total, count = distributed.all_sum([total, count])   # sums over ranks
    samples = distributed.gather(my_samples)     # every rank's lists, joined in rank order
    roles = distributed.split_roles(k)           # the last k ranks only sample (train_grpo_async)

    forward = distributed.wrap(model, device, fsdp=True)   # or FSDP2: sharded per block
    for name, t in distributed.full_tensors(model.state_dict().items()): ...   # one at a time

Every rank runs the same script on the same data stream and takes the same decisions; what
differs is the share of the work each one computes. DDP by default: each rank holds the
whole model, and the bucketed gradient all-reduce overlaps the backward. With fsdp=True
(the trainers' setting) each block's parameters, gradients and AdamW state are sharded
over the ranks (torch's FSDP2, fully_shard): a rank holds 1/N of them and all-gathers a
block's weights for its forward and backward, for models that do not fit one device.
Under FSDP2 every forward is a collective, so every rank runs as many of them (padded()).
A rank that dies makes the others' next collective fail (or time out after timeout_s), so
the job ends.
"""

import datetime
import gc
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

# the DDP-wrapped model of this process (no_sync reaches it without being handed it)
_ddp = None
# this rank's data-parallel group when split_roles gave the world two roles (None:
# the whole world)
_group = None
# the FSDP2 mesh of the sharded model (None: no model is sharded)
_mesh = None


def setup(device, timeout_s=300):
    """Join torchrun's process group (once per process); returns the device this rank
    uses."""
    if not (type(timeout_s) in (int, float) and timeout_s > 0):
        raise ValueError(f"dist_timeout_s={timeout_s!r}: expected a number of seconds > 0")
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return device
    cuda = torch.device(device).type == "cuda"
    if cuda:   # one device per local rank
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
    return device


def rank():
    """This rank's index among the ranks that share its work (its role's
    group after split_roles)."""
    return dist.get_rank(_group) if dist.is_initialized() else 0


def world():
    """How many ranks share this rank's work (the trainers, or the rollout
    workers, after split_roles)."""
    return dist.get_world_size(_group) if dist.is_initialized() else 1


def is_main():
    """Global rank 0 (the first trainer): the only one that writes checkpoints,
    metrics.jsonl and wandb."""
    return not dist.is_initialized() or dist.get_rank() == 0


@dataclass
class Roles:
    """The world split in two: ranks 0 .. N-K-1 train, the last K sample. Each role is its
    own data-parallel group (what rank(), world(), all_sum, gather and wrap mean from
    then on); sync is trainer 0 plus the workers (the weight broadcast)."""
    is_worker: bool
    trainers: list
    workers: list
    sync: object


def split_roles(rollout_ranks):
    """Give the last rollout_ranks ranks to sampling (train_grpo_async --rollout_ranks); every
    rank must call it."""
    global _group
    n = world()
    if not (type(rollout_ranks) is int and 0 < rollout_ranks < n):
        raise ValueError(f"rollout_ranks={rollout_ranks!r}: expected an int >= 1 that leaves at "
                         f"least one of the job's {n} ranks to train (torchrun --nproc_per_node)")
    trainers, workers = list(range(n - rollout_ranks)), list(range(n - rollout_ranks, n))
    # same order on all
    groups = [dist.new_group(trainers), dist.new_group(workers),
              dist.new_group([0] + workers)]
    is_worker = dist.get_rank() in workers
    _group = groups[1] if is_worker else groups[0]
    return Roles(is_worker, trainers, workers, groups[2])


def shard(items):
    """This rank's share of a list, every world()-th item from rank()."""
    return items[rank()::world()]


def span(n):
    """(lo, hi): this rank's contiguous slice of n items; e.g. n = 5 on 2 ranks -> (0, 2)
    and (2, 5)."""
    return rank() * n // world(), (rank() + 1) * n // world()


def comm_device():
    """Where a tensor must be to go over the process group: NCCL moves only CUDA tensors,
    gloo CPU ones."""
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def all_sum(values):
    """The sum over ranks of each number in values (float64), as a list of floats."""
    if world() == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64,
                     device=comm_device())
    dist.all_reduce(t, group=_group)
    return t.tolist()


def gather(items):
    """Every rank's list of (picklable) items, joined in rank order: the same list
    on every rank."""
    if world() == 1:
        return list(items)
    out = [None] * world()
    dist.all_gather_object(out, list(items), group=_group)
    return [x for part in out for x in part]


def wrap(model, device, fsdp=False, bf16=False):
    """DDP over the ranks (gradients summed by the step, see training.train_step), or
    model itself on one. fsdp=True: model sharded in place by FSDP2, one unit per block
    and the rest (embedding, final norm, head) at the root; bf16 (on CUDA): the weights
    gathered and computed in bf16, the gradients reduced in fp32."""
    global _ddp, _mesh
    if world() == 1 and not (fsdp and dist.is_initialized()):   # (a group of one: sharded)
        return model
    if fsdp:
        kind = torch.device(device).type
        _mesh = init_device_mesh(kind, (world(),)) if _group is None else \
            DeviceMesh.from_group(_group, kind)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if bf16 and kind == "cuda" else MixedPrecisionPolicy()
        for block in model.layers:
            fully_shard(block, mesh=_mesh, mp_policy=policy)
        # the head (model.logprobs) is a call of its own after forward. It reads the root's
        # weights as forward left them: gathered, since FSDP2 keeps the root unsharded from
        # its forward to its backward (reshard_after_forward is False at the root), and the
        # head's gradient joins the root's one reduce-scatter. (Registered as a forward
        # method with register_fsdp_forward_method, the head would reduce-scatter and free
        # the root in backward right away, and the norm's backward would gather it again.)
        return fully_shard(model, mesh=_mesh, mp_policy=policy)
    cuda = torch.device(device).type == "cuda"
    # the head runs after DDP's forward (training.batch_logprobs): its weights' gradients
    # still join the step's all-reduce, through each parameter's own hook; with
    # find_unused_parameters or static_graph DDP would count them unused, so neither is set
    _ddp = DistributedDataParallel(model, device_ids=[torch.device(device).index] if cuda else None,
                                   # buffers: constants
                                   forward_sync_buffers=False, process_group=_group)
    return _ddp


def unwrap(model):
    """The model inside torch.compile's and DDP's wrappers (FSDP2 shards it in place):
    whose head (logits, logprobs) a trainer calls on what the wrapped forward returns."""
    model = getattr(model, "_orig_mod", model)
    return model.module if isinstance(model, DistributedDataParallel) else model


def no_sync(last):
    """DDP's no_sync for every micro-batch of a step but the last: one gradient
    all-reduce per step."""
    return _ddp.no_sync() if _ddp is not None and not last else nullcontext()


def is_sharded(model):
    """Whether model's parameters are FSDP2 shards (wrap(fsdp=True))."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def full_tensors(items):
    """(name, whole tensor) of each (name, tensor) of items (a state_dict's), one at a
    time: a shard all-gathered over the ranks (every rank iterates in step), anything
    else as it is. Never the whole model at once: the caller keeps or drops each."""
    for name, t in items:
        yield name, t.full_tensor() if isinstance(t, DTensor) else t


def all_max(n):
    """The largest of every rank's int n."""
    if world() == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_group)
    return int(t.item())


def missing(n):
    """How many more forwards this rank, with n to run, must join when a model is sharded
    (FSDP2: each forward and backward is a collective of every rank): as many as the rank
    with the most has over n. 0 when nothing is sharded."""
    return 0 if _mesh is None else all_max(n) - n


def padded(items, pad):
    """items, then pad() for each forward this rank is missing (missing())."""
    return list(items) + [pad() for _ in range(missing(len(items)))]


def check_in_sync(model):
    """Raise unless every rank holds bitwise the same parameters (called before rank 0
    writes a checkpoint). A sharded model holds one copy: nothing to compare."""
    if world() == 1 or is_sharded(model):
        return
    digests = gather([digest(model.named_parameters())])
    if len(set(digests)) != 1:
        raise RuntimeError(f"the ranks' parameters differ (digests by rank: {digests})")


def digest(named_tensors):
    """xxh64 of (name, tensor) pairs, names and bytes, in the order given."""
    h = xxhash.xxh64()
    for name, t in named_tensors:
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def broadcast(tensor):
    """The first rank's tensor (of this rank's group) into every rank's, in place."""
    if world() > 1:
        dist.broadcast(tensor, src=0 if _group is None else dist.get_global_rank(_group, 0),
                       group=_group)


def barrier():
    if world() > 1:
        dist.barrier(group=_group)


def teardown():
    """Leave the process group together: a rank that tears down while another still writes
    its checkpoint can make gloo abort at exit. The caller drops its sharded model and
    optimizer first (on torch 2.13 with gloo a rank can abort at exit if they outlive the
    group); the mesh and whatever cycles still hold them go here."""
    global _ddp, _group, _mesh
    _ddp = _mesh = None
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    _group = None

