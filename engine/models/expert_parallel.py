"""Expert parallelism over the data-parallel group.

Rank r of N owns experts [r*E/N, (r+1)*E/N); everything else is replicated.
Each MoE layer routes its own tokens, all-gathers (hidden, weights, ids) from
every rank, runs its local experts on all gathered tokens, and sends each
rank back the sum over all ranks' experts for that rank's tokens.

Every rank must enter every collective of every step, padded and dummy tokens
included -- that is why a busy DP group makes idle ranks run dummy batches.

On NCCL (ranks on GPUs) the dispatch gathers into one device tensor and the combine is a
reduce-scatter; on gloo (CPU) both keep the list all-gather and the all-reduce + slice. The
token counts are read back once per step (in `step`), never per layer.

A fixed-shape step (`step(..., fixed_shape=True)`: a decode CUDA graph, captured or replayed)
exchanges no counts: the lockstep group agreed before the step that every rank runs the same
graph size (engine/dp/rank.py), so every rank has the same number of rows and each collective
has a shape known when it is captured -- nothing is read back to the host. On gloo the same
fixed-shape collectives run eagerly.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from engine.config import EngineConfig

# [num_tokens, hidden], [num_tokens, top_k] int64, [num_tokens, top_k] float32 -> [num_tokens, hidden]
ExpertFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ExpertParallel:
    """The expert shard of one rank and the collectives that feed it."""

    def __init__(self, world_size: int = 1, rank: int = 0):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"expert parallel: rank {rank} out of range for world size {world_size}")
        self.world_size = world_size
        self.rank = rank
        self._step_counts: list[int] | None = None  # every rank's token count, fixed within a step
        self.fixed_shape = False  # inside a fixed-shape (graph) step: no host read-back, equal counts

    @classmethod
    def from_config(cls, config: EngineConfig) -> "ExpertParallel":
        return cls(config.parallel.data_parallel_size, config.parallel.data_parallel_rank)

    def expert_range(self, num_experts: int) -> range:
        """The global ids of the experts this rank owns."""
        if num_experts % self.world_size:
            raise ValueError(f"expert parallel: {num_experts} experts cannot be split evenly over "
                             f"data_parallel_size={self.world_size}; choose a size that divides {num_experts}")
        per_rank = num_experts // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    @contextmanager
    def step(self, num_tokens: int, fixed_shape: bool = False) -> Iterator[None]:
        """Exchange token counts once per forward step instead of once per MoE layer. A
        fixed-shape step exchanges none: every rank runs `num_tokens` rows (see the module doc)."""
        if fixed_shape:
            self.fixed_shape = True
            try:
                yield
            finally:
                self.fixed_shape = False
            return
        if self.world_size == 1:
            yield
            return
        self._step_counts = self._exchange_counts(num_tokens)
        try:
            yield
        finally:
            self._step_counts = None

    def run_experts(self, experts: ExpertFn, hidden: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor) -> torch.Tensor:
        """Routed-expert output for this rank's tokens, summed over every rank's experts."""
        if self.world_size == 1:
            return experts(hidden, topk_ids, topk_weights)
        self._check_group()
        num_tokens = hidden.shape[0]
        if self.fixed_shape:  # every rank replays the same size: counts known without asking
            counts = [num_tokens] * self.world_size
        else:
            counts = self._step_counts
            if counts is None or counts[self.rank] != num_tokens:
                counts = self._exchange_counts(num_tokens)
            if max(counts) == 0:
                return torch.zeros_like(hidden)
        all_hidden, all_ids, all_weights = self._dispatch(hidden, topk_ids, topk_weights, counts)
        partial = experts(all_hidden, all_ids, all_weights)  # [sum(counts), hidden], local experts only
        return self._combine(partial, counts)

    # -- collectives ------------------------------------------------------

    def _check_group(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("expert parallel: data_parallel_size > 1 needs torch.distributed "
                               "initialised (one process per DP rank) before the first step")
        if dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
            raise RuntimeError(f"expert parallel: process group is rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, config says {self.rank} of {self.world_size}")

    def _exchange_counts(self, num_tokens: int) -> list[int]:
        self._check_group()
        local = torch.tensor([num_tokens], dtype=torch.int64, device=self._device())
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local)
        return torch.cat(gathered).tolist()  # one read-back for all ranks' counts

    def _dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  counts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # One collective instead of three: ids and weights ride along as raw bits
        # reinterpreted in the hidden dtype (a byte copy, so nothing is rounded).
        width, top_k = hidden.shape[1], topk_ids.shape[1]
        packed = torch.cat([hidden,
                            topk_weights.float().contiguous().view(hidden.dtype),
                            topk_ids.to(torch.int32).contiguous().view(hidden.dtype)], dim=1)
        rows = gather_rows(packed, counts, single_tensor=_nccl())  # [sum(counts), packed width]
        all_hidden = rows[:, :width]
        rest = rows[:, width:].contiguous()
        weight_width = rest.shape[1] // 2
        all_weights = rest[:, :weight_width].contiguous().view(torch.float32)
        all_ids = rest[:, weight_width:].contiguous().view(torch.int32).long()
        assert all_ids.shape[1] == top_k
        return all_hidden, all_ids, all_weights

    def _combine(self, partial: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if _nccl():
            return combine_reduce_scatter(partial, counts, self.rank)
        return combine_all_reduce(partial, counts, self.rank)

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if _nccl() else torch.device("cpu")


def _nccl() -> bool:
    return dist.get_backend() == "nccl"


def combine_reduce_scatter(partial: torch.Tensor, counts: list[int], rank: int) -> torch.Tensor:
    """This rank's rows of the sum over ranks of `partial` ([sum(counts), hidden], rank order):
    one reduce-scatter of the rows padded to the largest count (the NCCL path)."""
    max_count = max(counts)
    chunks = _pad_chunks(partial, counts, max_count)  # [world * max_count, hidden]
    out = partial.new_empty(max_count, partial.shape[1])
    dist.reduce_scatter_tensor(out, chunks)
    return out[:counts[rank]]


def combine_all_reduce(partial: torch.Tensor, counts: list[int], rank: int) -> torch.Tensor:
    """The same rows by all-reducing everything and keeping this rank's slice (the gloo path:
    world_size x the bytes, which is fine on the CPU path this backend serves). In place."""
    dist.all_reduce(partial)
    start = sum(counts[:rank])
    return partial[start:start + counts[rank]]


def gather_rows(local: torch.Tensor, counts: list[int], single_tensor: bool = False) -> torch.Tensor:
    """All ranks' rows concatenated in rank order; pads to the largest count for the collective.
    `single_tensor`: gather straight into one [world * max_count, width] tensor (NCCL), instead
    of a list of per-rank tensors joined afterwards (gloo)."""
    max_count = max(counts)
    padded = local
    if local.shape[0] < max_count:
        padded = torch.cat([local, local.new_zeros(max_count - local.shape[0], local.shape[1])])
    if single_tensor:
        joined = padded.new_empty(len(counts) * max_count, padded.shape[1])
        _all_gather_single(joined, padded.contiguous())
        gathered = list(joined.split(max_count))
        if all(c == max_count for c in counts):
            return joined
    else:
        gathered = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(gathered, padded.contiguous())
        if all(c == max_count for c in counts):
            return torch.cat(gathered)
    return torch.cat([g[:c] for g, c in zip(gathered, counts)])


def _all_gather_single(output: torch.Tensor, local: torch.Tensor) -> None:
    # all_gather_single is the newer name (torch >= 2.13 deprecates all_gather_into_tensor).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, local)


def _pad_chunks(rows: torch.Tensor, counts: list[int], max_count: int) -> torch.Tensor:
    if all(c == max_count for c in counts):
        return rows
    out = rows.new_zeros(len(counts) * max_count, rows.shape[1])
    start = 0
    for i, c in enumerate(counts):
        out[i * max_count:i * max_count + c] = rows[start:start + c]
        start += c
    return out
