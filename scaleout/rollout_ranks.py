"""
Rollout ranks: the last K ranks of a torchrun job only sample, the others only train.

    torchrun --standalone --nproc_per_node=2 train_grpo_async.py config/qwen_small.py \
        --rollout_ranks=1 --max_staleness=1 --tis_cap=2

Who talks to whom (distributed.split_roles makes the groups):
  - the workers share every rollout among themselves (each samples its slice,
    environment.generate_sharded) and all compute the same kept groups; the first worker
    sends them to trainer 0 as three tensors (encode_rollout), and trainer 0 broadcasts
    them to the other trainers;
  - after every iteration trainer 0 broadcasts the new weights to the workers in buckets
    (weight_sync.WeightSync); a worker applies a version whole, between two rollouts,
    never inside one.

The schedule, with s = max_staleness: rollout j (what iteration j trains on) is sampled
with the weights after iteration j - s (the run's starting weights while j - s is before
the start). So a sample is at most s versions behind the weights that train on it, and
s = 0 is the colocated run exactly: the same weights, the same seeds, the same samples.
With s = 1 the worker samples rollout j + 1 while the trainer trains on rollout j:

    trainer   | wait r0 | train 0 | send w1 | wait r1 | train 1 | send w2 | train 2 ...
    worker    | r0 (w0) | r1 (w0)           | recv w1 | r2 (w1)           | recv w2 | r3 (w2) ...

The trainer corrects a stale sample's weight with TIS (train_grpo_async.apply_corrections: the
ratio of the trainer's to the engine's probability, capped at tis_cap). Nothing is dropped
for being stale: admission is the wait for the weights above. Every rollout carries its
iteration and its problems' outcomes (the sampler's draw): the trainer refuses a rollout
of another iteration and follows the draw with its own copy of the sampler, whose state it
checkpoints, so a resumed run draws what the killed one would have and never trains on a
sample twice. A resumed run restarts the schedule from its checkpoint's weights (with s >=
1 its first s rollouts are fresher than the killed run's were).
"""

import collections
import time

import numpy as np
import torch
import torch.distributed as dist

from scaleout import distributed
from engine import TrainingSample, sampled_mask
from tasks.environment import Group
from scaleout.weight_sync import WeightSync


# -----------------------------------------------------------------------------
# a rollout as tensors: its numbers in one float64 vector (token ids and versions are
# exact in float64, and so is a float32 logprob), and its metric names as utf-8 bytes


def encode_rollout(iteration, draw, groups, flops, metrics):
    """(data float64, names uint8); draw is the sampler's (problem indices, successes),
    flops what sampling cost. data, e.g. for a draw of n problems and one kept group of 2
    samples of a 3-token prompt:
        [iteration, flops, n, *indices, *successes, num_metrics, *metric values, num_groups,
         3, p0, p1, p2, 2,                       prompt length, prompt ids, group size
         r, stopped, n, *n token ids, *n logprobs, *n versions, *n mask,     sample 0
         r, stopped, n, ...]                                                 sample 1
    (r the reward, stopped 1 for finish reason 'stop'; the mask is 1 on sampled ids, 0
    on a multi-turn episode's environment ids)"""
    indices, successes = draw
    data = [iteration, flops, len(indices), *indices, *successes, len(metrics),
            *metrics.values(), len(groups)]
    for group in groups:
        data += [len(group.prompt), *group.prompt, len(group.samples)]
        for s, r in zip(group.samples, group.rewards):
            data += [r, s.finish_reason == "stop", len(s.completion_tokens), *s.completion_tokens,
                     *s.logprobs, *s.token_versions, *sampled_mask(s)]
    names = np.frombuffer("\n".join(metrics).encode(), dtype=np.uint8).copy()
    return torch.tensor(data, dtype=torch.float64), torch.from_numpy(names)


def decode_rollout(data, names):
    """(iteration, draw, groups, flops, metrics) from encode_rollout's tensors; a Group's
    problem is None (the trainer needs only the samples and their rewards)."""
    values, at = data.tolist(), 0

    def take(n):
        nonlocal at
        at += n
        return values[at - n:at]

    iteration, flops, n = take(3)
    iteration, n = int(iteration), int(n)
    draw = ([int(v) for v in take(n)], [int(v) for v in take(n)])
    num_metrics = int(take(1)[0])
    keys = bytes(names.tolist()).decode().split("\n") if num_metrics else []
    # counts stay ints
    metrics = {k: int(v) if v.is_integer() else v for k, v in zip(keys, take(num_metrics))}
    groups = []
    for _ in range(int(take(1)[0])):
        prompt = tuple(int(t) for t in take(int(take(1)[0])))
        samples, rewards = [], []
        for _ in range(int(take(1)[0])):
            reward, stopped, n = take(3)
            n = int(n)
            tokens, logprobs, versions, mask = take(n), take(n), take(n), take(n)
            samples.append(TrainingSample(prompt, tuple(int(t) for t in tokens), tuple(logprobs),
                                          weight_version=int(min(versions, default=0)),
                                          finish_reason="stop" if stopped else "length",
                                          token_versions=tuple(int(v) for v in versions),
                                          loss_mask=() if all(mask) else tuple(map(int, mask))))
            rewards.append(reward)
        groups.append(Group(None, samples, rewards))
    return iteration, draw, groups, flops, metrics


def send_rollout(tensors, dst):
    """Start sending (data, names) to global rank dst: a header of their lengths, then
    each. Returns the works, and the tensors on the wire (to keep alive until the
    works are done)."""
    data, names = (t.to(distributed.comm_device()) for t in tensors)
    header = torch.tensor([data.numel(), names.numel()], dtype=torch.int64,
                          device=data.device)
    works = [dist.isend(header, dst), dist.isend(data, dst), dist.isend(names, dst)]
    return works, (data, names, header)


def recv_rollout(src):
    """What send_rollout sent from global rank src: trainer 0 receives it, and broadcasts
    it to the other trainers."""
    first = distributed.rank() == 0

    def fill(t):
        if first:
            dist.recv(t, src)
        distributed.broadcast(t)
        return t
    device = distributed.comm_device()
    header = fill(torch.zeros(2, dtype=torch.int64, device=device)).tolist()
    data = fill(torch.empty(header[0], dtype=torch.float64, device=device))
    return data.cpu(), fill(torch.empty(header[1], dtype=torch.uint8, device=device)).cpu()


# -----------------------------------------------------------------------------
# the worker's side


def run_worker(config, roles, start, env, sampler, engine, rollout):
    """A rollout rank's whole job: for each iteration, take the weights its rollout is due
    (admission), sample it with rollout(engine, env, sampler, config, it) and hand it to
    trainer 0 (the first worker does)."""
    sync = WeightSync(start.model.state_dict(), src=0, bucket_mb=config["weight_bucket_mb"],
                      group=roles.sync)
    # a model that does not match the trainer's is refused here, on every rank of the group
    sync.connect()
    weights_of, t_last = start.iter_num, time.perf_counter()
    # rollouts sent and not yet received: (iteration, sends, tensors kept alive until they
    # have left). Trainer 0 takes rollout j only after publishing the weights of step j - 1,
    # which waits for this rank at the rollout those weights are due (j - 1 + s + 1): so up
    # to s = max_staleness rollouts may be in flight, and waiting for an earlier one than
    # rollout it - s (it - 1 at s = 0) would wait for a trainer that waits for this rank
    window, in_flight = max(config["max_staleness"], 1), collections.deque()
    for it in range(start.iter_num, config["max_iters"]):
        t0 = time.perf_counter()
        received = 0.0
        # rollout it is sampled with the weights after it - s
        while weights_of < it - config["max_staleness"]:
            # both sides ready: the transfer is timed alone
            dist.barrier(group=roles.sync)
            tensors, seconds, _ = sync.receive()
            engine.update_weights(dict(zip(sync.names, tensors)))
            weights_of, received = weights_of + 1, received + seconds
        waited = time.perf_counter() - t0
        groups, flops, metrics = rollout(engine, env, sampler, config, it)
        t1 = time.perf_counter()
        while in_flight and in_flight[0][0] <= it - window:
            for work in in_flight.popleft()[1]:
                work.wait()                   # that rollout has reached trainer 0
        waited += time.perf_counter() - t1
        now = time.perf_counter()
        metrics.update({"perf/worker_idle_frac": waited / (now - t_last),
                        "perf/weight_receive_s": received})
        t_last = now
        if distributed.rank() == 0:
            # every worker holds the same groups; the first one sends them
            tensors = encode_rollout(it, sampler.last, groups, flops, metrics)
            in_flight.append((it, *send_rollout(tensors, roles.trainers[0])))
    for _, works, _ in in_flight:
        for work in works:
            work.wait()


# -----------------------------------------------------------------------------
# the trainers' side: where train_grpo_async's loop gets its groups and puts its weights


class RolloutRanks:
    """train_grpo_async's rollout source when rollout ranks sample: groups(it) receives
    rollout it, publish(model) broadcasts the new weights (trainer 0). The same
    interface as train_grpo_async.Colocated."""

    def __init__(self, config, roles, model, sampler, engine, version):
        self.config, self.roles, self.sampler = config, roles, sampler
        self.engine, self.version = engine, version
        self.sync, self._evaluated = None, version
        if dist.get_rank() == roles.trainers[0]:
            self.sync = WeightSync(model.state_dict(), src=0, bucket_mb=config["weight_bucket_mb"],
                                   group=roles.sync)
            self.sync.connect()

    def groups(self, it):
        """Rollout it from the workers (the trainer waits for it) and its staleness; the
        sampler follows its draw."""
        t0 = time.perf_counter()
        iteration, draw, groups, flops, metrics = decode_rollout(
            *recv_rollout(self.roles.workers[0]))
        if iteration != it:
            raise RuntimeError(f"iteration {it} received iteration {iteration}'s rollout: the "
                               f"trainer and the workers resumed from different checkpoints?")
        self.sampler.follow(*draw, self.config["group_size"])  # what a checkpoint records
        lags = [self.version - v for g in groups for s in g.samples
                for v, m in zip(s.token_versions, sampled_mask(s)) if m] or [0]
        metrics.update({"rollout/staleness_mean": float(np.mean(lags)),
                        "rollout/staleness_max": max(lags),
                        "perf/rollout_wait_s": time.perf_counter() - t0})
        return groups, flops, metrics

    def publish(self, model, it):
        """After iteration it: the new weights to the workers, if a later rollout
        is due them."""
        self.version += 1
        if self.sync is None or it + 1 + self.config["max_staleness"] >= self.config["max_iters"]:
            return {}
        t0 = time.perf_counter()
        # the workers are done sampling what they sample meanwhile
        dist.barrier(group=self.roles.sync)
        waited = time.perf_counter() - t0
        seconds, nbytes = self.sync.send(model.state_dict())
        return {"perf/weight_sync_wait_s": waited, "perf/weight_sync_s": seconds,
                "perf/weight_sync_GBps": nbytes / seconds / 1e9}

    def data_state(self):
        return self.sampler.state_dict()   # it follows every rollout it takes

    def eval_engine(self, model):
        """The trainers' own engine (for evaluation only), brought up to the trainer's
        weights."""
        if self._evaluated != self.version:
            self.engine.update_from(model)
            self._evaluated = self.version
        return self.engine
