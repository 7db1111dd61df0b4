"""
New weights from a trainer rank to rollout ranks: one broadcast over torch.distributed in buckets, in the manner
of MoonshotAI's checkpoint-engine (NCCL on GPU, gloo on CPU).

    sync = WeightSync(model.state_dict(), src=0, bucket_mb=64)   # every rank of the group, the same order
    sync.connect()                    # once: the workers check every name, shape and dtype against the sender's
    sync.send(model.state_dict())     # the sender, after each optimizer step (returns seconds, bytes)
    tensors = sync.receive()          # a worker: the whole new version, or an error; never half of one
    engine.update_weights(dict(zip(sync.names, tensors)))

How it works: the state is one stream of bytes (every tensor flattened, in order), cut into buckets of at most
bucket_mb, so a tensor larger than a bucket is simply split across two. The sender packs bucket k + 1 into one
of two flat buffers while bucket k is on the wire (async broadcast), and waits for a buffer's previous broadcast
before packing into it again. A worker receives straight into its own flat buffer of the whole state; only when
the last bucket has arrived does it hand out views of it, so a version is applied whole or not at all.
"""

import time

import torch
import torch.distributed as dist

MB = 1 << 20


def manifest(state):
    """(name, shape, dtype) of each tensor, in order: what both sides must agree on."""
    return [(name, tuple(t.shape), str(t.dtype).replace("torch.", "")) for name, t in state.items()]


class WeightSync:
    """One sender (src) and every other rank of group as receivers, for a fixed manifest of tensors."""

    def __init__(self, state, src=0, bucket_mb=64, group=None):
        if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
            raise ValueError(f"bucket_mb must be a number > 0, got {bucket_mb!r}")
        self.src, self.group = src, group
        self.manifest = manifest(state)
        self.names = [name for name, _, _ in self.manifest]
        self.sizes = [t.numel() * t.element_size() for t in state.values()]
        self.total = sum(self.sizes)
        self.bucket = max(1, int(bucket_mb * MB))
        self.device = next(iter(state.values())).device
        self._buffers = None                      # the sender's two bucket buffers, made on first send
        self._flat = None                         # a receiver's buffer of the whole state

    def is_sender(self):
        return dist.get_rank() == self.src

    def connect(self):
        """The sender's manifest to every receiver, which compares it with its own; any mismatch raises on every
        rank (ValueError naming the first tensor that differs), so nobody waits on a transfer that cannot fit."""
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
            self._buffers = [torch.empty(n, dtype=torch.uint8, device=self.device) for _ in range(2)]
        pending = [None, None]
        stream = ByteStream(state.values())
        for k, (start, end) in enumerate(spans(self.total, self.bucket)):
            i = k % 2
            if pending[i] is not None:
                pending[i].wait()                 # this buffer's previous bucket has left
            buf = self._buffers[i][:end - start]
            stream.fill(buf)
            pending[i] = dist.broadcast(buf, src=self.src, group=self.group, async_op=True)
        for work in pending:
            if work is not None:
                work.wait()
        return time.perf_counter() - t0, self.total

    def receive(self):
        """The sender's next version, as tensors shaped like the manifest (views of one flat buffer, valid until
        the next receive). Returns (tensors, seconds, bytes)."""
        t0 = time.perf_counter()
        if self._flat is None:
            self._flat = torch.empty(self.total, dtype=torch.uint8, device=self.device)
        for start, end in spans(self.total, self.bucket):
            dist.broadcast(self._flat[start:end], src=self.src, group=self.group)
        tensors, offset = [], 0
        for (_, shape, dtype), size in zip(self.manifest, self.sizes):
            tensors.append(self._flat[offset:offset + size].view(getattr(torch, dtype)).view(shape))
            offset += size
        return tensors, time.perf_counter() - t0, self.total


def first_difference(sender, mine):
    """'' when two manifests agree, else what differs first, naming the tensor."""
    for i, (a, b) in enumerate(zip(sender, mine)):
        if a != b:
            return f"tensor {i} {a[0]!r}: the sender has shape {a[1]} {a[2]}, this model has {b[0]!r} {b[1]} {b[2]}"
    if len(sender) != len(mine):
        extra = sender[len(mine)] if len(sender) > len(mine) else mine[len(sender)]
        return f"the sender has {len(sender)} tensors, this model {len(mine)} (first unmatched: {extra[0]!r})"
    return ""


def spans(total, bucket):
    """[start, end) of each bucket; e.g. total 10, bucket 4 -> (0, 4), (4, 8), (8, 10)."""
    return [(s, min(s + bucket, total)) for s in range(0, total, bucket)]


class ByteStream:
    """Tensors as one stream of bytes (each flattened, in order); fill(buf) copies the next buf.numel() bytes, so a
    tensor cut by one bucket's end continues at the start of the next."""

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
