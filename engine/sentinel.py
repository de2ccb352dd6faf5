"""The NaN sentinel: finds non-finite values in a rank's KV cache.

Every step it checks the null block (block 0) of every layer -- small, and it
must stay zero -- plus, in rolling mode, the blocks the step wrote and the next
`nan_scan_blocks_per_step` blocks of a sweep over the whole pool, so every
block is seen at least once every `coverage_steps` steps. `full` scans every
block every step. Scans are tensor reductions on the cache's own device,
reduced to one count per (layer, block); Python only sees the few blocks that
are poisoned.
"""
from __future__ import annotations

import time

import torch

from engine.config import EngineConfig, NULL_BLOCK_ID
from engine.kv_cache import layer_tensors


class NaNSentinel:
    def __init__(self, config: EngineConfig, kv_caches: list):
        self.mode = config.nan_sentinel
        self.kv_caches = kv_caches
        self.num_blocks = config.num_blocks
        self.num_layers = len(kv_caches)
        self.budget = max(1, config.nan_scan_blocks_per_step)
        self.cursor = 1
        # Non-finite values per (layer, block) as of the last time the block was scanned.
        self.counts = torch.zeros(self.num_layers, self.num_blocks, dtype=torch.int64)
        self.detections = {"null_block": 0, "allocated": 0}
        self.scan_seconds: list[float] = []

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def coverage_steps(self) -> int:
        """Steps within which every block is scanned at least once."""
        if self.mode == "full":
            return 1
        if self.mode == "rolling":
            return -(-(self.num_blocks - 1) // self.budget)
        return 0

    def _scan(self, block_ids: torch.Tensor) -> torch.Tensor:  # [num_layers, len(block_ids)]
        """Non-finite values per (layer, block). A block's float sum is non-finite iff the
        block holds a NaN or Inf (cache values are far from overflow), so one cheap pass
        flags blocks and only flagged blocks get an exact count."""
        counts = torch.zeros(self.num_layers, len(block_ids), dtype=torch.int64)
        first, last = int(block_ids[0]), int(block_ids[-1])
        contiguous = last - first + 1 == len(block_ids)
        for layer, entry in enumerate(self.kv_caches):
            for cache in layer_tensors(entry):
                blocks = cache[first:last + 1] if contiguous else cache.index_select(0, block_ids.to(cache.device))
                sums = blocks.flatten(1).sum(1, dtype=torch.float32)        # [len(block_ids)]
                flagged = torch.nonzero(~torch.isfinite(sums)).flatten()
                if flagged.numel():
                    exact = (~torch.isfinite(blocks[flagged])).flatten(1).sum(1).cpu()
                    counts[layer, flagged.cpu()] += exact
        return counts

    def step(self, written_slots: torch.Tensor | None = None, block_size: int = 1) -> list[int]:
        """Scan for this step; returns the non-null blocks newly found poisoned."""
        if not self.enabled:
            return []
        start = time.perf_counter()
        groups = [[NULL_BLOCK_ID]]  # each group is scanned as one (contiguous where possible) slice
        if self.mode == "full":
            groups = [list(range(self.num_blocks))]
        elif self.mode == "rolling":
            end = min(self.cursor + self.budget, self.num_blocks)
            groups.append(list(range(self.cursor, end)))
            if written_slots is not None and written_slots.numel():
                written = set(torch.unique(written_slots[written_slots >= 0] // block_size).tolist())
                written -= {NULL_BLOCK_ID, *groups[1]}
                if written:
                    groups.append(sorted(written))
            self.cursor = 1 if end >= self.num_blocks else end
        ids = [b for group in groups for b in group]
        index = torch.tensor(ids, dtype=torch.int64)
        counts = torch.cat([self._scan(torch.tensor(g, dtype=torch.int64)) for g in groups], dim=1)
        previous = self.counts[:, index]
        self.counts[:, index] = counts
        newly = ((counts.sum(0) > 0) & (previous.sum(0) == 0)).tolist()
        poisoned = [b for b, new in zip(ids, newly) if new]
        for block in poisoned:
            self.detections["null_block" if block == NULL_BLOCK_ID else "allocated"] += 1
        self.scan_seconds.append(time.perf_counter() - start)
        return [b for b in poisoned if b != NULL_BLOCK_ID]

    @property
    def null_block_poisoned(self) -> bool:
        return bool(self.counts[:, NULL_BLOCK_ID].any())

    def poisoned_blocks(self) -> list[int]:
        return torch.nonzero(self.counts[:, 1:].sum(0)).flatten().add(1).tolist()

    def values(self) -> list[tuple[int, str, int]]:
        """(layer, region, non-finite values present at the last scan) for the gauge."""
        null = self.counts[:, NULL_BLOCK_ID].tolist()
        allocated = self.counts[:, 1:].sum(1).tolist()
        return ([(layer, "null_block", v) for layer, v in enumerate(null)]
                + [(layer, "allocated", v) for layer, v in enumerate(allocated)])

    def zero_block(self, block_id: int) -> None:
        for entry in self.kv_caches:
            for cache in layer_tensors(entry):
                cache[block_id].zero_()
        self.counts[:, block_id] = 0

    def take_scan_seconds(self) -> list[float]:
        seconds, self.scan_seconds = self.scan_seconds, []
        return seconds
