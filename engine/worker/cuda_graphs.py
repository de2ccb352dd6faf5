"""CUDA graphs for decode steps: the padding plan, the persistent device buffers, capture and
replay (docs/design.md, "CUDA graphs and the null block").

A decode step of B one-token rows (or a dummy batch of B tokens) runs the graph captured for
the next size S >= B in `cuda_graph_sizes`. A graph reads its inputs from persistent device
buffers, so every step first writes the whole of them: rows [0, B) from the step's batch (the
batch builder already gave its padded tokens PAD_SLOT_ID), and every row from B on -- not just
up to S -- slot PAD_SLOT_ID, table row all NULL_BLOCK_ID, length 0, token 0 at position 0. No
row keeps a slot, table or length from an earlier, larger step. The attention such a graph
replays is engine/ops/flex_attention.py over `AttentionMetadata.fixed_decode`: every row reads
the whole table width, padded rows read the null block with weight 0.

Capture runs the forward on all-padding buffers, which must write nothing; after it the null
block is checked bitwise zero on every layer (one host sync), and a capture that dirtied it
stops start-up naming the layers. With `cuda_graph_check_null_block` the runner repeats the
check after every dummy batch.

MoE and MLA models capture too: on a fixed-shape step their routed experts run every local
expert densely over the rows (StackedExperts.forward_fixed, no expert counts read back), MLA
decode is FlexAttention over the latent cache, and with expert parallelism (DP > 1) the
dispatch and combine collectives have the graph size's shape on every rank. That needs every
rank of the lockstep group to take the same path in the same step: the rank loop all-reduces
whether any rank must run eagerly (`could_run_scheduled`) with the step's token count and
sets `group_eager` before the step (engine/dp/rank.py).

The class works on any device: where no graph is captured (a CPU) `run` calls the same
fixed-shape forward over the same buffers eagerly, which is how tests/engine/test_cuda_graphs.py
and tests/engine/test_cuda_graphs_moe.py check the padding and the tokens on CPU.
"""
from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence

import torch

from engine.config import EngineConfig
from engine.models.layers import StepContext
from engine.ops import attention_backends, cuda_ops
from engine.ops.attention import AttentionMetadata
from engine.ops.checksum import block_words
from engine.integrity.write_guard import WriteGuard
from engine.paging import NULL_BLOCK_ID, PAD_SLOT_ID
from engine.worker.batch_builder import StepBatch
from engine.worker.kv_cache import block_axis

log = logging.getLogger(__name__)


class NullBlockDirtied(RuntimeError):
    """The null block holds a non-zero bit after a graph capture or a dummy replay."""


def graph_size(sizes: Sequence[int], num_tokens: int) -> int | None:
    """The captured size a step of `num_tokens` rows pads to (sizes ascending), or None: eager."""
    index = bisect.bisect_left(sizes, num_tokens)
    return sizes[index] if index < len(sizes) else None


def is_pure_decode(batch: StepBatch) -> bool:
    """Every request has one query token (a dummy batch has none): what a decode graph runs."""
    meta = batch.meta
    return meta.num_tokens == meta.num_reqs and meta.num_decodes == meta.num_reqs


def eager_reason(config: EngineConfig) -> str | None:
    """Why this configuration's decode steps run eagerly, or None when they replay CUDA graphs."""
    if not config.device.startswith("cuda"):
        return "not a CUDA device"
    if config.enforce_eager:
        return "--enforce-eager"
    if not attention_backends.select(config.device, config.model.dtype, config.model.dtype).fixed_shape_decode:
        return "torch has no FlexAttention"
    if not cuda_ops.available():
        return "the CUDA KV writers are not built (the torch reference writer cannot be captured)"
    return None


class DecodeBuffers:
    """The persistent inputs of every decode graph, sized for the largest one; a graph of size S
    reads their first S rows."""

    def __init__(self, max_size: int, max_blocks_per_seq: int, device: str | torch.device):
        self.input_ids = torch.zeros(max_size, dtype=torch.int64, device=device)               # [max_size]
        self.positions = torch.zeros(max_size, dtype=torch.int64, device=device)               # [max_size]
        self.slot_mapping = torch.full((max_size,), PAD_SLOT_ID, dtype=torch.int64, device=device)  # [max_size]
        self.seq_lens = torch.zeros(max_size, dtype=torch.int64, device=device)                # [max_size]
        self.block_tables = torch.full((max_size, max_blocks_per_seq), NULL_BLOCK_ID,          # [max_size, W]
                                       dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int64, device=device)    # one token a row

    def fill(self, batch: StepBatch) -> None:
        """Rows [0, num_padded) from the batch, padding in every row after them."""
        meta = batch.meta
        tokens, reqs = meta.num_padded_tokens, meta.num_reqs
        self.input_ids[:tokens].copy_(batch.input_ids, non_blocking=True)
        self.positions[:tokens].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:tokens].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:reqs].copy_(meta.seq_lens[:reqs], non_blocking=True)
        self.block_tables[:reqs].copy_(meta.block_tables[:reqs], non_blocking=True)
        self._pad(tokens, reqs)

    def fill_padding(self) -> None:
        """Every row padding: what a capture runs on."""
        self._pad(0, 0)

    def _pad(self, first_token: int, first_req: int) -> None:
        self.input_ids[first_token:] = 0
        self.positions[first_token:] = 0
        self.slot_mapping[first_token:] = PAD_SLOT_ID
        self.seq_lens[first_req:] = 0
        self.block_tables[first_req:] = NULL_BLOCK_ID

    def metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata.fixed_decode(self.slot_mapping[:size], self.query_start_loc[:size + 1],
                                              self.seq_lens[:size], self.block_tables[:size])


class DecodeGraphs:
    """Runs pure-decode steps of up to max(sizes) rows through fixed-shape forwards over
    DecodeBuffers: replayed CUDA graphs once `capture` ran on a GPU, eager calls elsewhere."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, kv_storage: torch.Tensor, kv_caches: list,
                 null_block_writes: torch.Tensor, write_guard: WriteGuard):
        self.sizes = tuple(sorted(config.cuda_graph_sizes))
        self.model = model
        self.kv_caches = kv_caches
        self.null_block_writes = null_block_writes
        self.write_guard = write_guard
        self.buffers = DecodeBuffers(self.sizes[-1], config.max_blocks_per_seq, kv_storage.device)
        self.null_words = block_words(kv_storage, block_axis(config))[NULL_BLOCK_ID]  # [num_layers, chunks, words]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # size -> [size, hidden], what its graph writes
        self.replays = 0
        # In a lockstep DP group (MoE with EP): whether some rank runs this step eagerly, agreed
        # by all ranks before the step (engine/dp/rank.py); None outside one. Ranks must agree,
        # since a fixed-shape step's expert collectives differ from an eager step's.
        self.group_eager: bool | None = None

    def could_run_scheduled(self, num_reqs: int, num_tokens: int) -> bool:
        """Before the batch is built: whether this rank's step could run through the buffers
        (pure decode or a dummy batch, no hook set); the size check is left to the caller, whose
        padded token count every rank of the group shares."""
        return num_tokens == num_reqs and not self._hooked()

    def can_run(self, batch: StepBatch) -> bool:
        if not is_pure_decode(batch) or graph_size(self.sizes, batch.meta.num_padded_tokens) is None:
            return False
        if self.group_eager is not None:  # what the group agreed, even if a hook was set since
            return not self.group_eager
        return not self._hooked()

    def _hooked(self) -> bool:
        """A forward hook (the fault injector's NaN activations) would not run inside a replayed
        graph, and would fire at the next eager step instead: while one is set, steps run eagerly."""
        return any(module._forward_hooks or module._forward_pre_hooks for module in self.model.modules())

    def forward(self, size: int) -> torch.Tensor:  # [size, hidden]
        """The fixed-shape forward a graph captures: the first `size` rows of the buffers."""
        buffers = self.buffers
        ctx = StepContext(meta=buffers.metadata(size), kv_caches=self.kv_caches,
                          null_block_writes=self.null_block_writes, write_guard=self.write_guard)
        return self.model(buffers.input_ids[:size], buffers.positions[:size], ctx)

    def run(self, batch: StepBatch) -> torch.Tensor:  # [num_padded_tokens, hidden]
        """The caller has begun the step on the write guard (its writable blocks)."""
        size = graph_size(self.sizes, batch.meta.num_padded_tokens)
        self.buffers.fill(batch)
        graph = self.graphs.get(size)
        if graph is None or (self.group_eager is not None and self._hooked()):
            # (a hook set after the group agreed on the fixed-shape path: run it, do not replay)
            hidden = self.forward(size)
        else:
            graph.replay()
            hidden = self.outputs[size]
        self.replays += 1
        return hidden[:batch.meta.num_padded_tokens]

    def capture(self) -> None:
        """Capture every size (largest first, sharing one memory pool), each after a warm-up run,
        all on padding buffers; then check that none of it touched the null block. Without
        CUDA the warm-up runs alone: the same forwards and the same check, no graph."""
        self.buffers.fill_padding()
        self.write_guard.begin_step([])  # capture writes nothing: no block is writable
        on_cuda = self.buffers.input_ids.is_cuda
        pool = torch.cuda.graph_pool_handle() if on_cuda else None
        for size in reversed(self.sizes):
            if not on_cuda:
                self.forward(size)
                continue
            warmup = torch.cuda.Stream()
            warmup.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(warmup):
                self.forward(size)  # first call: lazy inits and FlexAttention's trace, outside the graph
            torch.cuda.current_stream().wait_stream(warmup)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.forward(size)
            self.graphs[size] = graph
        if on_cuda:
            torch.cuda.synchronize()
            log.info("captured decode CUDA graphs for batch sizes %s", ",".join(map(str, self.sizes)))
        self.check_null_block("CUDA graph capture")

    def null_block_dirty_layers(self) -> list[int]:
        """Layers whose null block holds any non-zero bit: one reduction, one host sync."""
        dirty = (self.null_words != 0).flatten(1).any(dim=1)  # [num_layers] bool
        return [layer for layer, bad in enumerate(dirty.tolist()) if bad]

    def check_null_block(self, after: str) -> None:
        layers = self.null_block_dirty_layers()
        if layers:
            raise NullBlockDirtied(f"the null block (block {NULL_BLOCK_ID}) is not zero after {after}: "
                                   f"layer(s) {', '.join(map(str, layers))} were written; padded and dummy "
                                   "rows must carry PAD_SLOT_ID (docs/design.md)")
