"""
This project's weight-transfer backend, 'nanorl' (a process group of the trainer's over
torch.distributed's gloo, since the CPU has neither vLLM's NCCL nor its CUDA IPC; NCCL
between GPUs), in both of vLLM's registries, so that vLLM's API drives it as it drives
its own. The trainer's side:

    from vllm.distributed.weight_transfer import (HTTPVLLMWeightSyncClient,
                                                  WeightTransferTrainerFactory)
    from scaleout import vllm_gloo
    vllm_gloo.register()
    push = WeightTransferTrainerFactory.trainer_init(
        vllm_gloo.GlooTrainerInitInfo("127.0.0.1", port, world_size=2, rank=0),
        client=HTTPVLLMWeightSyncClient("http://127.0.0.1:8000"),
        source=vllm_gloo.CheckpointSource(model))
    push.send_weights()   # vLLM's cycle: start, update_weights (the bytes meanwhile), finish

(train_grpo_async.py's own trainer, weight_sync.ServerWeights, speaks the same protocol without
vLLM installed.) The server's side is either scaleout/serve.py started with
--enable_weight_updates=True, or `vllm serve` with this backend:

    pip install -e scaleout/vllm_plugin      # into vLLM's environment: its entry point
    VLLM_SERVER_DEV_MODE=1 vllm serve DIR --dtype float32 \\
        --logprobs-mode processed_logprobs --weight-transfer-config '{"backend": "nanorl"}'

where vLLM loads scaleout/vllm_plugin (the entry point group vllm.general_plugins) in
each of its processes, which calls register(): its workers then make
GlooWeightTransferEngine. On both servers the same data plane as weight_sync.py: before
any byte every rank says over the group whether the update fits, then the tensors go by
broadcast in buckets, under their checkpoint names (transformers', what vLLM's
load_weights takes). Needs vllm (pinned 0.32.0: bench/peers/install.sh); the project's
own code never imports this file.
"""

import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar

from vllm.distributed.weight_transfer import (WeightTransferEngineFactory,
                                              WeightTransferTrainerFactory)
from vllm.distributed.weight_transfer.base import (ParamMeta, TrainerInitInfo,
                                                   TrainerWeightTransferEngine,
                                                   WeightSource, WeightTransferEngine)

from checkpoint import config_from_hf, hf_weight_shapes, ours_to_hf
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
        """Rendezvous: the server's workers join the group this rank hosts."""
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
        join = functools.partial(client.init_weight_transfer_engine, worker)
        engine.group = weight_sync.form_group([join], init_info.master_address,
                                              init_info.master_port, init_info.world_size)
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


class CheckpointSource(WeightSource):
    """A model.py Transformer's weights as vLLM's WeightSource, under their checkpoint
    names (checkpoint.ours_to_hf: one tensor per expert), read afresh at each send."""

    def __init__(self, model):
        self.model = model

    def metadata(self):
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self]

    def __iter__(self):
        return iter(ours_to_hf(self.model.state_dict()).items())


# -----------------------------------------------------------------------------
# the worker's side, inside `vllm serve`


class GlooWeightTransferEngine(WeightTransferEngine):
    """A vLLM worker's side of the backend: it joins the trainer's group as rank
    rank_offset + its worker rank (weight_sync.TransferInit is the init_info); each
    update_weights gives its word on the fit (every name a tensor of the served model's
    checkpoint, each once, shapes equal), receives the bytes and hands the tensors to the
    model's own load_weights, between vLLM's layerwise reload start and finish (as its
    NCCL backend does), so vLLM fuses, shards and post-processes them itself."""
    init_info_cls = weight_sync.TransferInit
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.group = None        # the trainer's group, once initialized
        self.transfer = None     # its weight_sync.TransferInit
        self.received = set()    # the names the update under way has loaded
        self.reloading = False   # whether vLLM's layerwise reload is under way
        hf = self.model_config.hf_config.to_dict()
        self.layout = hf_weight_shapes(config_from_hf(hf))

    def parse_update_info(self, update_dict):
        return update_dict   # checked in receive_weights, where a refusal reaches the group

    def init_transfer_engine(self, init_info):
        if init_info.backend == "nccl" and self.device.type != "cuda":
            raise ValueError("backend='nccl' needs workers on CUDA; use 'gloo'")
        parallel = self.parallel_config
        rank = (parallel.data_parallel_index * parallel.world_size + parallel.rank
                + init_info.rank_offset)
        if rank >= init_info.world_size:
            raise ValueError(f"world_size={init_info.world_size} does not hold this worker, "
                             f"rank {rank} (rank_offset {init_info.rank_offset})")
        self.group = weight_sync.PeerGroup(init_info.master_address, init_info.master_port,
                                           rank, init_info.world_size, init_info.backend)
        self.transfer = init_info

    def start_weight_update(self):
        if self.group is None:
            raise RuntimeError("Weight transfer not initialized: POST "
                               "/init_weight_transfer_engine first")
        self.finish_weight_update()   # a reload that an error left under way
        self.received = set()

    def receive_weights(self, update_info):
        """The group's vote, then the bytes, then vLLM's layerwise reload (begun at the
        first tensors that arrive, so an update refused at its first call leaves the model
        as it was). A call that fails ends the reload at once (vLLM sends no finish after
        it): the layers it did not load go back as they were."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        problem = weight_sync.update_problem(update_info, self.layout, self.received)
        try:
            tensors = weight_sync.receive_update(self.group, self.transfer, update_info,
                                                 problem, self.device)
            if tensors is None:
                raise ValueError(f"Invalid update_info: {problem}" if problem else
                                 "another rank of the group refused this update")
            if not self.reloading:
                initialize_layerwise_reload(self.model)
                self.reloading = True
            self.model.load_weights(tensors.items())
        except BaseException:
            self.finish_weight_update()
            raise
        self.received.update(tensors)

    def finish_weight_update(self):
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        if self.reloading:
            finalize_layerwise_reload(self.model, self.model_config)
            if self.device.type == "cpu":
                redo_cpu_kernels(self.model, self.received)
            self.reloading = False

    def shutdown(self):
        self.group, self.transfer = None, None


def redo_cpu_kernels(model, received):
    """Work around vLLM 0.32.0 on the CPU, where its layerwise reload leaves two kernels
    made from the old weights (its own reload_weights from a checkpoint does the same;
    docs/scale_out.md): a MoE layer's processing runs again but skips its experts' own
    step, the CPU kernel's prepacking, so the new experts are read in the wrong layout
    (greedy tokens turn to garbage); and a tied lm_head, which loads nothing itself,
    keeps the oneDNN kernel packed from the old embedding. Here both steps run again, for
    what this update loaded."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    for name, layer in model.named_modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        block = name.removesuffix(".routed_experts") + "."   # e.g. model.layers.0.mlp.experts.
        if (isinstance(experts, CPUUnquantizedExperts)
                and any(n.startswith(block) for n in received)):
            experts.process_weights_after_loading(layer)
    head = getattr(model, "lm_head", None)
    if (model.config.tie_word_embeddings and "model.embed_tokens.weight" in received
            and hasattr(head, "cpu_linear")):
        head.quant_method.process_weights_after_loading(head)


def register():
    """Add the backend to both of vLLM's factories (once; a second call is a no-op, since
    vLLM may load its plugins more than once in a process)."""
    for factory, engine in ((WeightTransferEngineFactory, GlooWeightTransferEngine),
                            (WeightTransferTrainerFactory, GlooTrainerWeightTransferEngine)):
        try:
            factory.register_engine(weight_sync.BACKEND, engine)
        except ValueError as e:
            if "already registered" not in str(e):
                raise
