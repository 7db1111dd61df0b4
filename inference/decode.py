"""
The decode step at static shapes: a step in which every running sequence decodes one
token, run as one function whose input shapes repeat, so that the host only fills
buffers and launches it.

    decode = StaticDecode(model, kv_cache, max_batch_size, max_blocks, scratch_block, backend)
    if decode.takes(batch):                 # the engine's (sequence, new tokens) pairs
        tokens, logprobs = decode(seqs)     # lists, one per sequence

The function (decode_graph) is the whole step: the embedding, every layer (each
layer's paged attention one opaque op: write the new K/V into their slots, then attend
over the blocks, read in place (backend 'paged', the CPU's) or gathered for SDPA), the
head and the sampler (sampling.sample_in_graph: the engine's seeded draw, without
data-dependent branches). Its inputs live in buffers made once and
filled in place:

    tokens [B], positions [B], slots [B], temperatures [B], seeds [B], block_tables [B, W]

B is the batch padded to a bucket and W the block-table width padded likewise; a
padded row feeds token 0 at position 0 through the scratch block, a KV block the
allocator never hands out, so it writes and reads nothing of anyone's. On the CPU the
function is compiled once per process with dynamic sizes: one graph serves every
bucket and width (torch.compile specialises sizes 0 and 1, so the smallest bucket is
2). On a GPU each (bucket, width) is captured as a CUDA graph on first use, as vLLM
and nano-vllm do: buckets 1, 2, 4, 8 and then multiples of 8 (vLLM's), widths powers
of 2. Steps with prefill chunks, forks, top_k / top_p / top_logprobs or recorded
routes stay eager (InferenceEngine._forward).
"""

import bisect
import time

import numpy as np
import torch

from inference.attention import DecodeAttention, decode_kernel
from inference.sampling import sample_in_graph
from model import compile_once


def decode_graph(model, k_cache, v_cache, tokens, positions, slots, block_tables, temperatures,
                 seeds, backend):
    """One decode step, tensors in, tensors out: each row's next token and its logprob.
    backend: the engine's attention, 'sdpa' or 'paged'."""
    attention = DecodeAttention(k_cache, v_cache, slots, block_tables, positions, backend)
    hidden, _ = model(tokens, positions, attention=attention)
    logits = model.logits(hidden)
    # the draw for the token at position p + 1 (sampling.sample_next: a sequence's length)
    return sample_in_graph(logits, temperatures, seeds, positions + 1)


def shapes_of(max_batch_size, max_blocks, device_type):
    """(batch sizes, block-table widths) a step is padded to, each ascending. CPU: one
    dynamic graph, so no padding past 2. GPU: a CUDA graph per pair, so few of each:
    batches 1, 2, 4, 8, multiples of 8 and max_batch_size (vLLM's sizes), widths powers
    of 2 and max_blocks."""
    width = max(max_blocks, 2)
    if device_type == "cpu":
        return list(range(2, max(max_batch_size, 2) + 1)), list(range(2, width + 1))
    sizes = {1, 2, 4, *range(8, max_batch_size, 8), max_batch_size}
    widths = {2 ** i for i in range(1, width.bit_length())} | {width}
    return ([b for b in sorted(sizes) if b <= max_batch_size],
            [w for w in sorted(widths) if w <= width])


def padded(n, sizes):
    """The smallest of sizes (ascending) that holds n."""
    return sizes[bisect.bisect_left(sizes, n)]


class StaticDecode:
    """The engine's static decode step (see the module docstring). max_blocks: the
    block-table width of a sequence at max_model_len; scratch_block: the pool's block
    that padded rows use; backend: the engine's attention, 'sdpa' or 'paged'."""

    def __init__(self, model, kv, max_batch_size, max_blocks, scratch_block, backend):
        self.model, self.kv, self.scratch, self.backend = model, kv, scratch_block, backend
        if backend == "paged":   # the engine chose it: the kernel is built
            decode_kernel()   # loading it registers the graph's attention op
        self.device = kv.k.device
        model.rope(self.device)  # made before the graph: its making would be a guard
        self.cuda = self.device.type == "cuda"
        self.batch_sizes, self.widths = shapes_of(max_batch_size, max_blocks, self.device.type)
        if self.cuda:                  # the CUDA graphs' inputs, at their largest
            B, W = self.batch_sizes[-1], self.widths[-1]
            self.ints = torch.zeros(4, B, dtype=torch.int64, device=self.device)
            self.tables = torch.zeros(B, W, dtype=torch.int64, device=self.device)
            self.temperatures = torch.ones(B, device=self.device)
        # CUDA: a step's shape (_inputs) -> (graph, its output tensors), all graphs sharing
        # one memory pool
        self.graphs = {}
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self.compile_seconds = 0.0   # the CPU's first call (the compile), the GPU's captures

    def takes(self, batch):
        """Whether a step's batch is one this step runs: every sequence decodes, with
        plain sampling (no top_k / top_p / top_logprobs), and no routes are recorded."""
        return self.kv.routes is None and all(
            n == 1 and not s.catching_up and not s.params.top_k and s.params.top_p == 1.0
            and not s.params.top_logprobs for s, n in batch)

    @torch.inference_mode()
    def warm_up(self):
        """Compile now (on the CPU), not in the first rollout: one step of two padded
        rows, which write and read only the scratch block. Returns the seconds it took
        (about nothing once this process has compiled). On a GPU each shape is captured
        on first use instead."""
        if not self.cuda and not self.compile_seconds:
            W, zeros = self.widths[0], torch.zeros(2, dtype=torch.int64)
            slots = torch.full((2,), self.scratch * self.kv.block_size)
            tables = torch.full((2, W), self.scratch)
            self._run((2, W), (self.model, self.kv.k, self.kv.v, zeros, zeros.clone(), slots,
                               tables, torch.ones(2), zeros.clone(), self.backend))
        return self.compile_seconds

    @torch.inference_mode()
    def __call__(self, seqs):
        n = len(seqs)
        shape, inputs = self._inputs(seqs)
        tokens, logprobs = self._run(shape, inputs)
        # read at once: a later capture may reuse this graph's memory for its own
        return tokens[:n].tolist(), logprobs[:n].tolist()

    def _inputs(self, seqs):
        """The step's shape (padded batch, padded width) and decode_graph's tensors: on a
        GPU views of the buffers, filled in place (a CUDA graph reads fixed addresses);
        on the CPU tensors of their own (views of one buffer would have the compiled
        graph guard on, and recompile for, how their sizes relate to the buffer's)."""
        n, bs = len(seqs), self.kv.block_size
        widest = max(len(s.block_table) for s in seqs)
        B, W = padded(n, self.batch_sizes), padded(widest, self.widths)
        # tokens, positions, slots, seeds; padded rows: token 0 at position 0 of
        # the scratch block
        ints = np.zeros((4, B), dtype=np.int64)
        ints[:, :n] = np.array([(s.tokens[s.num_computed], s.num_computed,
                                 s.block_table[s.num_computed // bs] * bs + s.num_computed % bs,
                                 s.seed) for s in seqs], dtype=np.int64).T
        ints[2, n:] = self.scratch * bs
        tables = np.full((B, W), self.scratch, dtype=np.int64)
        for i, s in enumerate(seqs):
            tables[i, :len(s.block_table)] = s.block_table
        temperatures = np.ones(B, dtype=np.float32)
        temperatures[:n] = [s.params.temperature for s in seqs]
        if self.cuda:
            self.ints[:, :B].copy_(torch.from_numpy(ints), non_blocking=True)
            self.tables[:B, :W].copy_(torch.from_numpy(tables), non_blocking=True)
            self.temperatures[:B].copy_(torch.from_numpy(temperatures), non_blocking=True)
            (tokens, positions, slots, seeds), tables = self.ints[:, :B], self.tables[:B, :W]
            temperatures = self.temperatures[:B]
        else:
            tokens, positions, slots, seeds = (torch.from_numpy(row.copy()) for row in ints)
            tables, temperatures = torch.from_numpy(tables), torch.from_numpy(temperatures)
        return (B, W), (self.model, self.kv.k, self.kv.v, tokens, positions, slots, tables,
                        temperatures, seeds, self.backend)

    def _run(self, shape, inputs):
        t0 = time.perf_counter()
        if not self.cuda:
            # no duck sizing: a first step whose batch equals its width would tie the two
            # sizes to one symbol, and the first step where they differ would compile again.
            # The kernels are called from C++: the Python wrapper's allocations, views
            # and size checks were a measurable share of a rollout (docs/speed.md)
            with torch.fx.experimental._config.patch(use_duck_shape=False):
                out = compile_once(decode_graph, dynamic=True, cpp_wrapper=True)(*inputs)
            if not self.compile_seconds:  # the first call compiles (once per process)
                self.compile_seconds = time.perf_counter() - t0
            return out
        if shape not in self.graphs:
            self.graphs[shape] = self._capture(inputs)
            self.compile_seconds += time.perf_counter() - t0
        graph, out = self.graphs[shape]
        graph.replay()
        return out

    def _capture(self, inputs):
        """A CUDA graph of decode_graph on the buffers' views. The warm-up runs the step
        for real on a side stream (it writes the same K/V the replay will write again)."""
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                decode_graph(*inputs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a weight update's side thread may copy to the GPU meanwhile
            with torch.cuda.graph(graph, pool=self.pool,
                                  capture_error_mode="thread_local"):
                out = decode_graph(*inputs)
        return graph, out
