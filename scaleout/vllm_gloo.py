"""
This project's weight-transfer backend ('nanorl': a process group of the trainer's over
torch.distributed's gloo, since the CPU has neither vLLM's NCCL nor its CUDA IPC) in
vLLM's own trainer-side registry, so that vLLM's API drives it as it drives its own:

    from vllm.distributed.weight_transfer import (HTTPVLLMWeightSyncClient, ModuleSource,
                                                  WeightTransferTrainerFactory)
    from scaleout import vllm_gloo
    vllm_gloo.register()
    push = WeightTransferTrainerFactory.trainer_init(
        vllm_gloo.GlooTrainerInitInfo("127.0.0.1", port, world_size=2, rank=0),
        client=HTTPVLLMWeightSyncClient("http://127.0.0.1:8000"), source=ModuleSource(model))
    push.send_weights()   # vLLM's cycle: start, update_weights (the bytes meanwhile), finish

The server side is scaleout/serve.py started with --enable_weight_updates=True (the same
data plane as weight_sync.ServerWeights: before any byte every rank says over the group
whether the update fits, then the tensors go by broadcast in buckets). One server, whose
one worker is rank 1; a `vllm serve` worker side is not written yet. Needs vllm (pinned
0.32.0: bench/peers/install.sh); the project's own code never imports this file.
"""

from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import ClassVar

from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from scaleout import weight_sync


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The trainer's side: rank 0 of world_size (itself and the server's workers), met at
    master_address:master_port; buckets of bucket_mb."""
    backend: ClassVar[str] = weight_sync.BACKEND
    master_address: str
    master_port: int
    world_size: int
    bucket_mb: float = 64.0


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        """Rendezvous: the server joins (its init call returns once the group has formed,
        which needs this rank too, so the call runs on a side thread)."""
        if source is None:
            raise ValueError("the gloo weight transfer sends a WeightSource's tensors: give one")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        engine.init_info, engine.group = init_info, None
        if not engine.is_sender:
            return engine
        worker = {"master_address": init_info.master_address,
                  "master_port": init_info.master_port, "rank_offset": 1,
                  "world_size": init_info.world_size, "backend": "gloo",
                  "bucket_mb": init_info.bucket_mb}
        pool = ThreadPoolExecutor(max_workers=2)   # a refused init fails at once
        joined = pool.submit(client.init_weight_transfer_engine, worker)
        mine = pool.submit(weight_sync.PeerGroup, init_info.master_address,
                           init_info.master_port, 0, init_info.world_size, "gloo")
        wait([joined, mine], return_when=FIRST_EXCEPTION)
        pool.shutdown(wait=False)
        joined.result()
        engine.group = mine.result()
        return engine

    def send_weights(self):
        """One update: start, update_weights on a side thread while this rank says the
        update fits and broadcasts it (not if a worker said it does not: its
        update_weights then raises), finish."""
        state = dict(iter(self.source))
        if not self.is_sender:
            return
        declared = [(m.name, tuple(m.shape), str(m.dtype).split(".")[-1])
                    for m in self.source.metadata()]
        if declared != weight_sync.manifest(state):   # the bytes go in the tensors' order
            raise ValueError("the WeightSource's metadata does not match its tensors "
                             "(names, order, shapes, dtypes)")
        info = weight_sync.update_info(declared)
        self.client.start_weight_update()
        with ThreadPoolExecutor(max_workers=1) as pool:
            received = pool.submit(self.client.update_weights, info)
            if all(self.group.gather_ints(1)):
                weight_sync.WeightSync(state, src=0, bucket_mb=self.init_info.bucket_mb,
                                       group=self.group).send(state)
            received.result()
        self.client.finish_weight_update()


def register():
    """Add the backend to vLLM's trainer factory (once; a second call is a no-op)."""
    try:
        WeightTransferTrainerFactory.register_engine(weight_sync.BACKEND,
                                                     GlooTrainerWeightTransferEngine)
    except ValueError as e:
        if "already registered" not in str(e):
            raise
