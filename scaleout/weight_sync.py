"""
New weights from a trainer rank to rollout ranks: one broadcast over torch.distributed
in buckets, in the manner of MoonshotAI's checkpoint-engine (NCCL on GPU, gloo on CPU).

    # every rank of the group, the same order
    sync = WeightSync(model.state_dict(), src=0, bucket_mb=64)
    sync.connect()        # once: the workers check every name, shape and dtype against the sender's
    # the sender, after each optimizer step (returns seconds, bytes)
    sync.send(model.state_dict())
    # a worker: the whole new version, or an error; never half of one
    tensors = sync.receive()
    engine.update_weights(dict(zip(sync.names, tensors)))

How it works: the state is one stream of bytes (every tensor flattened, in order), cut
into buckets of at most bucket_mb, so a tensor larger than a bucket is simply split
across two. The sender packs bucket k + 1 into one of two flat buffers while bucket k is
on the wire (async broadcast), and waits for a buffer's previous broadcast before
packing into it again. A worker receives straight into its own flat buffer of the whole
state; only when the last bucket has arrived does it hand out views of it, so a version
is applied whole or not at all.
"""

import functools
import socket
import time
from dataclasses import dataclass
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, ThreadPoolExecutor, wait
from datetime import timedelta

import httpx
import torch
import torch.distributed as dist

from checkpoint import ours_to_hf

MB = 1 << 20


def manifest(state):
    """(name, shape, dtype) of each tensor, in order: what both sides must agree on."""
    return [(name, tuple(t.shape), str(t.dtype).replace("torch.", "")) for name, t in state.items()]


class WeightSync:
    """One sender (src) and every other rank of group as receivers, for a fixed
    manifest of tensors."""

    def __init__(self, state, src=0, bucket_mb=64, group=None, device=None):
        if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
            raise ValueError(f"bucket_mb must be a number > 0, got {bucket_mb!r}")
        self.src, self.group = src, group
        self.manifest = manifest(state)
        self.names = [name for name, _, _ in self.manifest]
        self.sizes = [t.numel() * t.element_size() for t in state.values()]
        self.total = sum(self.sizes)
        self.bucket = max(1, int(bucket_mb * MB))
        # state may be on 'meta'
        self.device = device or next(iter(state.values())).device
        self._buffers = None   # the sender's two bucket buffers, made on first send
        self._flat = None      # a receiver's buffer of the whole state

    def is_sender(self):
        return dist.get_rank() == self.src

    def connect(self):
        """The sender's manifest to every receiver, which compares it with its own; any
        mismatch raises on every rank (ValueError naming the first tensor that differs),
        so nobody waits on a transfer that cannot fit."""
        theirs = [self.manifest]
        dist.broadcast_object_list(theirs, src=self.src, group=self.group)
        error = "" if self.is_sender() else first_difference(theirs[0], self.manifest)
        errors = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(errors, error, group=self.group)
        bad = [e for e in errors if e]
        if bad:
            raise ValueError(f"weight sync refused at connect: {bad[0]}")

    def send(self, state):
        """Broadcast every tensor of state (the sender). Returns (seconds, bytes)."""
        t0 = time.perf_counter()
        if self._buffers is None:
            n = min(self.bucket, self.total)
            self._buffers = [torch.empty(n, dtype=torch.uint8, device=self.device)
                             for _ in range(2)]
        pending = [None, None]
        stream = ByteStream(state.values())
        for k, (start, end) in enumerate(spans(self.total, self.bucket)):
            i = k % 2
            if pending[i] is not None:
                pending[i].wait()                 # this buffer's previous bucket has left
            buf = self._buffers[i][:end - start]
            stream.fill(buf)
            pending[i] = self.broadcast(buf, async_op=True)
        for work in pending:
            if work is not None:
                work.wait()
        return time.perf_counter() - t0, self.total

    def receive(self):
        """The sender's next version, as tensors shaped like the manifest (views of one
        flat buffer, valid until the next receive). Returns (tensors, seconds, bytes)."""
        t0 = time.perf_counter()
        if self._flat is None:
            self._flat = torch.empty(self.total, dtype=torch.uint8, device=self.device)
        for start, end in spans(self.total, self.bucket):
            self.broadcast(self._flat[start:end])
        tensors, offset = [], 0
        for (_, shape, dtype), size in zip(self.manifest, self.sizes):
            tensors.append(self._flat[offset:offset + size].view(getattr(torch, dtype)).view(shape))
            offset += size
        return tensors, time.perf_counter() - t0, self.total


    def broadcast(self, buf, async_op=False):
        if isinstance(self.group, PeerGroup):
            # a group of its own, outside torchrun's world
            return self.group.broadcast(buf, self.src, async_op)
        return dist.broadcast(buf, src=self.src, group=self.group, async_op=async_op)


def first_difference(sender, mine):
    """'' when two manifests agree, else what differs first, naming the tensor."""
    for i, (a, b) in enumerate(zip(sender, mine)):
        if a != b:
            return (f"tensor {i} {a[0]!r}: the sender has shape {a[1]} {a[2]}, "
                    f"this model has {b[0]!r} {b[1]} {b[2]}")
    if len(sender) != len(mine):
        extra = sender[len(mine)] if len(sender) > len(mine) else mine[len(sender)]
        return (f"the sender has {len(sender)} tensors, this model {len(mine)} "
                f"(first unmatched: {extra[0]!r})")
    return ""


def spans(total, bucket):
    """[start, end) of each bucket; e.g. total 10, bucket 4 -> (0, 4), (4, 8), (8, 10)."""
    return [(s, min(s + bucket, total)) for s in range(0, total, bucket)]


class ByteStream:
    """Tensors as one stream of bytes (each flattened, in order); fill(buf) copies the
    next buf.numel() bytes, so a tensor cut by one bucket's end continues at the start
    of the next."""

    def __init__(self, tensors):
        self.parts = (t.detach().contiguous().view(-1).view(torch.uint8) for t in tensors)
        self.rest = None

    def fill(self, buf):
        done, n = 0, buf.numel()
        while done < n:
            if self.rest is None or self.rest.numel() == 0:
                self.rest = next(self.parts)
            take = min(n - done, self.rest.numel())
            buf[done:done + take].copy_(self.rest[:take])
            self.rest, done = self.rest[take:], done + take


# -----------------------------------------------------------------------------
# a trainer and running scaleout/serve.py processes: a process group of their own, set
# up over HTTP


class PeerGroup:
    """A process group outside torchrun's world, met at a TCPStore that rank 0 (the
    trainer) hosts at master_address:master_port: the trainer is rank 0, the servers
    ranks 1..world_size - 1. Making one blocks until every rank has made its own (gloo
    on CPU, NCCL on CUDA)."""

    def __init__(self, master_address, master_port, rank, world_size, backend="gloo",
                 timeout_s=300):
        timeout = timedelta(seconds=timeout_s)
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else \
            torch.device("cpu")          # where NCCL wants even its small tensors
        store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                              timeout=timeout)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        else:
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size)

    def broadcast(self, tensor, src, async_op=False):
        work = self.pg.broadcast(tensor, src)
        return work if async_op else work.wait()

    def gather_ints(self, value):
        """value of every rank (one int each), in rank order: every rank calls it."""
        out = [torch.zeros(1, dtype=torch.int64, device=self.device)
               for _ in range(self.world_size)]
        mine = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.pg.allgather([out], [mine]).wait()
        return [int(t) for t in out]


def form_group(joins, master_address, master_port, world_size, backend="gloo", timeout_s=300):
    """This rank as rank 0 of a PeerGroup whose other ranks the calls in joins make (each
    a server's POST /init_weight_transfer_engine). A call returns once the group has
    formed, which needs this rank too, so all run on threads; a refused join fails at
    once instead of after the group's timeout."""
    pool = ThreadPoolExecutor(len(joins) + 1)
    calls = [pool.submit(join) for join in joins]
    mine = pool.submit(PeerGroup, master_address, master_port, 0, world_size, backend,
                       timeout_s)
    wait(calls + [mine], return_when=FIRST_EXCEPTION)
    pool.shutdown(wait=False)
    for call in calls:
        call.result()
    return mine.result()


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# -----------------------------------------------------------------------------
# weights to servers through vLLM's (0.32.0) RL weight-transfer API


BACKEND = "nanorl"   # this project's backend in vLLM's registries (scaleout/vllm_gloo.py)


@dataclass(kw_only=True)
class TransferInit:
    """The init_info of this project's weight transfer: the trainer is rank 0 of a group
    of world_size met at master_address:master_port, a server's first worker is rank
    rank_offset; the group's backend ('gloo', or 'nccl' between CUDA devices), the bytes
    in buckets of bucket_mb."""
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str = "gloo"
    bucket_mb: float = 64.0

    def __post_init__(self):
        checks = (("master_address", isinstance(self.master_address, str)
                   and self.master_address),
                  ("master_port", isinstance(self.master_port, int)
                   and 0 < self.master_port < 65536),
                  ("rank_offset", isinstance(self.rank_offset, int) and self.rank_offset >= 1),
                  ("world_size", isinstance(self.world_size, int)
                   and self.world_size > self.rank_offset),
                  ("backend", self.backend in ("gloo", "nccl")),
                  ("bucket_mb", isinstance(self.bucket_mb, (int, float)) and self.bucket_mb > 0))
        for name, ok in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} (rank_offset >= 1, "
                                 "world_size > rank_offset, a port in (0, 65536), backend "
                                 "'gloo' or 'nccl', bucket_mb > 0)")


def update_info(tensors):
    """vLLM's update_info of a manifest [(name, shape, dtype)]: {names, dtype_names, shapes}."""
    names, shapes, dtypes = zip(*tensors)
    return {"names": list(names), "dtype_names": list(dtypes), "shapes": [list(s) for s in shapes]}


def update_manifest(info):
    """[(name, shape, dtype)] of an update_info {names, dtype_names, shapes}, or of a list
    of them (vLLM indexes the list by worker: a server here is one worker, the first)."""
    if isinstance(info, list):
        if not info:
            raise ValueError("an empty list of update_infos")
        info = info[0]
    if not isinstance(info, dict):
        raise ValueError(f"update_info must be an object, got {type(info).__name__}")
    names, dtypes, shapes = (info.get(k) for k in ("names", "dtype_names", "shapes"))
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)):
        raise ValueError("names, dtype_names and shapes must be lists of one length")
    for name, dtype, shape in zip(names, dtypes, shapes):
        ok_dtype = isinstance(dtype, str) and isinstance(getattr(torch, dtype, None),
                                                         torch.dtype)
        if not (isinstance(name, str) and ok_dtype and isinstance(shape, list)
                and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise ValueError(f"tensor {name!r}: dtype {dtype!r}, shape {shape!r}")
    return [(n, tuple(sh), d) for n, sh, d in zip(names, shapes, dtypes)]


def update_problem(info, ours, received=()):
    """Why update_info does not fit a model whose tensors are ours ({name: shape}), some
    already received in this update: '' when it does (tensors of the model, each once in
    the update, shapes equal, float dtypes; an update may come in several calls)."""
    try:
        got = update_manifest(info)
    except ValueError as e:
        return str(e)
    names = [n for n, _, _ in got]
    unknown = sorted(set(names) - set(ours))[:3]
    again = sorted(n for n in set(names) if names.count(n) > 1 or n in received)[:3]
    if unknown or again:
        return (f"names must be tensors of the served model, each once per update (unknown: "
                f"{unknown}, sent twice: {again})")
    for name, shape, dtype in got:
        if shape != ours[name]:
            return f"tensor {name!r} has shape {list(shape)}, not {list(ours[name])}"
        if not getattr(torch, dtype).is_floating_point:
            return f"tensor {name!r}: {dtype!r} is not a float dtype"
    return ""


def receive_update(group, transfer, info, problem, device="cpu"):
    """A server's side of one update: every rank says over group whether the update fits
    (problem: why this one does not, '' if it does); if all do, the tensors arrive by
    broadcast in buckets: {name: tensor}; else None, nothing received."""
    if not all(group.gather_ints(0 if problem else 1)):
        return None
    manifest = update_manifest(info)
    state = {n: torch.empty(sh, dtype=getattr(torch, d), device="meta") for n, sh, d in manifest}
    sync = WeightSync(state, src=0, bucket_mb=transfer.bucket_mb, group=group,
                      device=torch.device(device))
    tensors, _, _ = sync.receive()
    bad = [n for n, t in zip(state, tensors) if not torch.isfinite(t).all()]
    if bad:
        raise ValueError(f"{len(bad)} tensors are not finite, e.g. {bad[:3]}")
    return dict(zip(state, tensors))


class ServerWeights:
    """A trainer's new weights to running servers through vLLM's RL weight-transfer API
    (scaleout/serve.py started with --enable_weight_updates=True, or `vllm serve` with this
    project's backend: scaleout/vllm_gloo.py), over a process group of their own, in
    buckets:

        push = ServerWeights(["http://127.0.0.1:8000"], model.state_dict())   # they join
        push.send(model.state_dict(), "3")   # after each step; "3" labels the version

    One send is vLLM's cycle: POST /start_weight_update to every server; then each gets POST
    /update_weights {names, dtype_names, shapes} on a thread of its own while this rank
    broadcasts. Before any byte, every rank says over the group whether that fits its
    model, so a server that does not match refuses (its /update_weights answers 500) and
    send raises ValueError naming it, the weights unchanged everywhere and nobody waiting
    for bytes; then POST /finish_weight_update {weight_version} applies them. The tensors
    travel under their checkpoint names (transformers', one tensor per expert), as vLLM's
    trainers send them and its load_weights takes them."""

    def __init__(self, urls, state, bucket_mb=64, backend="gloo", master_address="127.0.0.1",
                 api_key="", timeout_s=300):
        self.urls, self.timeout_s = list(urls), timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # every worker of every server is a rank of the group (vLLM: one per device of its
        # tensor, pipeline and data parallelism; ours: one), a server's first at its
        # rank_offset: servers of 2 and 1 workers -> offsets 1 and 3, world 4
        sizes = [self.get(url, "/get_world_size").get("world_size") for url in self.urls]
        for url, size in zip(self.urls, sizes):
            if not (isinstance(size, int) and size >= 1):
                raise ValueError(f"{url}/get_world_size answered world_size={size!r}")
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        port, world = free_port(), 1 + sum(sizes)
        joins = [functools.partial(self.post, url, "/init_weight_transfer_engine", {
            "init_info": {"master_address": master_address, "master_port": port,
                          "rank_offset": offset, "world_size": world, "backend": backend,
                          "bucket_mb": bucket_mb}})
            for url, offset in zip(self.urls, offsets)]
        self.group = form_group(joins, master_address, port, world, backend, timeout_s)
        self.sync = WeightSync(ours_to_hf(state), src=0, bucket_mb=bucket_mb, group=self.group)

    def get(self, url, path):
        return self.call("GET", url, path)

    def post(self, url, path, body=None):
        return self.call("POST", url, path, body)

    def call(self, method, url, path, body=None):
        """method url + path with body (none: no body); its JSON answer. A refusal raises
        ValueError naming the url and the reason."""
        try:
            r = httpx.request(method, url + path, json=body, headers=self.headers,
                              timeout=self.timeout_s)
        except httpx.HTTPError as e:
            raise RuntimeError(f"{url}{path}: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            raise ValueError(f"{url}{path} refused ({r.status_code}): {r.text[:300]}")
        return r.json()

    def send(self, state, version=None):
        """Every server's weights become state (the trainer's state_dict), labelled
        version (a str, or none). The servers are paused meanwhile, as vLLM's examples do
        (mode=keep: a sample in flight waits and goes on under the new weights; the prefix
        cache, made by the old ones, is cleared)."""
        paused = []
        try:
            for url in self.urls:
                self.post(url, "/pause?mode=keep")
                paused.append(url)
            self.cycle(ours_to_hf(state), version)
        finally:   # every server paused is resumed, whatever failed
            failed = []
            for url in paused:
                try:
                    self.post(url, "/resume")
                except (ValueError, RuntimeError) as e:
                    failed.append(str(e))
            if failed:
                raise RuntimeError("servers left paused: " + "; ".join(failed))

    def cycle(self, state, version):
        """vLLM's start, update_weights (the bytes meanwhile), finish, for tensors under
        their checkpoint names."""
        info = update_info(manifest(state))
        for url in self.urls:
            self.post(url, "/start_weight_update")
        pool = ThreadPoolExecutor(len(self.urls) + 1)
        posts = [pool.submit(self.post, url, "/update_weights", {"update_info": info})
                 for url in self.urls]
        # every rank's word on the fit; a server that answers before giving it (out of the
        # protocol's step) fails the send at once instead of after the group's timeout
        fits = pool.submit(self.group.gather_ints, 1)
        while not fits.done():
            wait([fits] + posts, return_when=FIRST_COMPLETED)
            early = [url for url, p in zip(self.urls, posts) if p.done()]
            if early:   # a refusal after its word comes a moment after the word: wait for it
                wait([fits], timeout=10)
            if early and not fits.done():
                pool.shutdown(wait=False)
                raise RuntimeError(f"{early[0]} answered /update_weights without giving the "
                                   "group its word: the group is out of step; make a new "
                                   "ServerWeights")
        if all(fits.result()):
            self.sync.send(state)
        wait(posts)
        pool.shutdown(wait=False)
        refused = [f"{url}: {p.exception()}" for url, p in zip(self.urls, posts) if p.exception()]
        if refused:
            raise ValueError("the servers did not take the weights: " + "; ".join(refused))
        for url in self.urls:
            self.post(url, "/finish_weight_update",
                      None if version is None else {"weight_version": str(version)})
