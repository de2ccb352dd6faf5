"""The NaN sentinel: finds non-finite values in a rank's KV cache.

It checks the null block (block 0) of every layer -- small, and it must stay zero -- every
`nan_scan_null_every` steps, plus, in rolling mode, the next blocks of a sweep over the whole
pool every step (and, with `nan_scan_written_blocks`, the blocks the step wrote), so every
block is seen at least once every `coverage_steps` steps. The sweep's window is what
`nan_scan_budget` (a share of wall time) pays for, up to `nan_scan_blocks_per_step` blocks;
with a budget of 0, exactly that many. `full` scans every block every step. Scans are tensor
reductions on the cache's own device, reduced to one count per (layer, block); Python only
sees the few blocks that are poisoned.

Why the null block is not scanned every step on CPU (every 4th by default; every step on
CUDA, where it is one launch): after a forward pass has streamed the weights through the
caches, the scan call and the null block are both cold -- ~50 us for the call (dispatch, code
and data structures out of cache) plus ~50 us for the block (~180 runs of 2 KB, megabytes
apart, a miss and a page walk each), 0.1 ms whatever the batch, 0.7% of a batch-1 bf16 step of
the default model on a Zen 4 core. A scan of part of the layers each step would still pay the
call every step. The KV writer is the one path that writes the cache, and it counts its writes
into block 0 (the counter lives on the host on CPU: reading it is free), so a step whose writer
wrote there has the null block scanned that same step; the periodic scan is the backstop for
anything else (a stray kernel), found within `nan_scan_null_every` steps.
"""
from __future__ import annotations

import functools
import math
import time

import torch

from engine.config import EngineConfig
from engine.paging import FIRST_USABLE_BLOCK_ID, NULL_BLOCK_ID, blocks_written
from engine.ops import cpu_ops
from engine.ops.checksum import block_words
from engine.ops.nonfinite import KINDS, nonfinite_counts_into
from engine.integrity.regions import Region
from engine.integrity.sweep import RollingSweep, ScanBudget


class NaNSentinel:
    def __init__(self, config: EngineConfig, storage: torch.Tensor, axis: int,
                 null_block_writes: torch.Tensor | None = None):  # [1] int64, the KV writer's counter
        """`axis`: the dimension of `storage` that indexes blocks (engine/worker/kv_cache.py)."""
        self.mode = config.nan_sentinel
        self.is_mla = config.model.is_mla
        self.axis = axis
        # [num_blocks, num_layers, (2,) block_size, ...]: blocks first, so a block range is one slice.
        self.by_block = storage.movedim(self.axis, 0)
        # The same bytes as int32 words, for the scan kernel (csrc/cpu/cpu_nonfinite.cpp).
        self.words = block_words(storage, self.axis)
        self.dtype = storage.dtype
        self.num_blocks = config.num_blocks
        self.num_layers = config.model.num_layers
        budget = ScanBudget(config.nan_scan_budget, config.nan_scan_blocks_per_step) if config.nan_scan_budget > 0 else None
        self.sweep = RollingSweep(self.num_blocks, config.nan_scan_blocks_per_step, budget)
        self.scan_written = config.nan_scan_written_blocks
        self.null_every = config.nan_scan_null_every or (1 if storage.device.type == "cuda" else 4)
        self._null_phase = 0  # steps since the null block's last scan
        # Read only where it lives on the host (on CUDA it would cost a sync a step), through a
        # numpy view: indexing it costs ~0.1 us where int(tensor) goes through the dispatcher.
        self._null_writes = (null_block_writes.numpy() if null_block_writes is not None
                             and null_block_writes.device.type == "cpu" else None)
        self._null_writes_seen = 0
        # Non-finite values per (layer, block) as of the last time the block was scanned.
        self.counts = torch.zeros(self.num_layers, self.num_blocks, dtype=torch.int64)
        # The kernel's outputs, one per group of _targets, reused: [blocks, num_layers] int64 each.
        self._outs: list[torch.Tensor] = []
        self._window = 0  # blocks in this step's sweep window
        self.any_counted = False
        self.detections = {Region.NULL_BLOCK: 0, Region.ALLOCATED: 0}
        self.scan_seconds: list[float] = []

    @functools.cached_property
    def uses_kernel(self) -> bool:
        # 16- and 8-bit caches: torch's float32 sum of a strided window copies it to float32
        # first (33 bf16 blocks of the default model: 5.4 ms vs the kernel's 1.3 ms). A float32
        # cache sums in place, faster than the kernel (1.0 vs 2.1 ms): that path stays.
        return (self.words.device.type == "cpu" and self.dtype in KINDS and self.dtype != torch.float32
                and cpu_ops.available())

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def coverage_steps(self) -> int:
        """Steps within which every block is scanned at least once."""
        steps = self.sweep.coverage_steps(self.mode)
        return max(steps, self.null_block_steps) if steps else 0

    @property
    def null_block_steps(self) -> int:
        """Steps within which the null block is scanned at least once (0: never)."""
        if self.mode == "full":
            return 1
        return self.null_every if self.enabled else 0

    def _null_block_due(self) -> bool:
        """Whether this step scans the null block: every null_every-th step, and any step after
        the KV writer counted a write into it."""
        written = False
        if self._null_writes is not None:
            writes = int(self._null_writes[0])
            written, self._null_writes_seen = writes != self._null_writes_seen, writes
        self._null_phase += 1
        if written or self._null_phase >= self.null_every:
            self._null_phase = 0
            return True
        return False

    def _scan(self, ids: list[int]) -> torch.Tensor | None:
        """[num_layers, len(ids)] non-finite counts, or None when all clean.

        A block's float sum is non-finite iff it holds a NaN or Inf (cache values are far
        from overflow), so one reduction over every layer with a single host sync clears
        the common all-clean case; only a dirty scan counts values exactly. A contiguous
        id range is a slice of the storage, anything else an index_select."""
        blocks = self._group_blocks(ids)
        inner = tuple(range(2, blocks.dim()))  # reduce in place: the block-major view is strided
        sums = blocks.sum(dim=inner, dtype=torch.float32)  # [n, num_layers]
        if bool(torch.isfinite(sums).all()):
            return None
        return (~torch.isfinite(blocks)).sum(dim=inner).t().cpu()

    def _targets(self, written_slots: torch.Tensor | None, block_size: int, now: float) -> list[list[int]]:
        """This step's groups of block ids: the sweep window (self._window blocks, the first
        group when any), the null block when due, written blocks."""
        self._window = 0
        if self.mode == "full":
            return [list(range(self.num_blocks))]
        groups = []
        if self.mode == "rolling":
            window = self.sweep.next_window(now)
            self._window = len(window)
            if window:
                groups.append(list(window))
        if self._null_block_due():
            groups.append([NULL_BLOCK_ID])
        if self.mode == "rolling" and self.scan_written and written_slots is not None and written_slots.numel():
            seen = {b for g in groups for b in g}
            written = set(blocks_written(written_slots, block_size)) - seen
            if written:
                groups.append(sorted(written))
        return groups

    def _each_group(self, groups: list[list[int]], scan) -> tuple[list, float | None]:
        """scan(i, group) for each group; returns the results and the sweep window's own scan
        time (the first group's, None without a window) for the time budget."""
        results, window_seconds = [], None
        for i, group in enumerate(groups):
            start = time.perf_counter()
            results.append(scan(i, group))
            if i == 0 and self._window:
                window_seconds = time.perf_counter() - start
        return results, window_seconds

    def _kernel_counts(self, i: int, group: list[int]) -> int:
        """Group i's counts into its reused output (self._outs[i][:len(group)]); their total."""
        if i == len(self._outs):
            self._outs.append(torch.zeros(0, self.num_layers, dtype=torch.int64))
        if len(group) > self._outs[i].shape[0]:
            self._outs[i] = torch.zeros(len(group), self.num_layers, dtype=torch.int64)
        return nonfinite_counts_into(self.words, group, self.dtype, self._outs[i])

    def _group_blocks(self, ids: list[int]) -> torch.Tensor:  # [n, num_layers, ...]
        if ids[-1] - ids[0] + 1 == len(ids):
            return self.by_block[ids[0]:ids[-1] + 1]
        return self.by_block.index_select(0, torch.tensor(ids, device=self.by_block.device))

    def step(self, written_slots: torch.Tensor | None = None, block_size: int = 1) -> list[int]:
        """Scan for this step; returns the non-null blocks newly found poisoned."""
        if not self.enabled:
            return []
        start = time.perf_counter()
        groups = self._targets(written_slots, block_size, start)
        if not groups:  # nothing due this step (the null block between its scans)
            self.scan_seconds.append(time.perf_counter() - start)
            return []
        poisoned: list[int] = []
        counts = None
        if self.uses_kernel:  # exact counts in one pass over the raw words: no float copy of the window
            found, window_seconds = self._each_group(groups, self._kernel_counts)
            dirty = self.any_counted or sum(found) > 0
            if dirty:
                counts = torch.cat([out[:len(g)] for g, out in zip(groups, self._outs)]).t()
        else:  # fast path: one scalar float sum per group (a NaN or Inf anywhere makes it non-finite),
            # read back once for the step: one host sync on a GPU (where the window's time is then
            # its launches only, and the budget lets the window grow to its cap)
            sums, window_seconds = self._each_group(
                groups, lambda i, group: self._group_blocks(group).sum(dtype=torch.float32))
            dirty = self.any_counted or not math.isfinite(float(sum(sums)))
        if dirty:
            ids = [b for g in groups for b in g]
            if counts is None:
                results = [self._scan(g) for g in groups]
                counts = torch.cat([r if r is not None else torch.zeros(self.num_layers, len(g), dtype=torch.int64)
                                    for g, r in zip(groups, results)], dim=1)
            index = torch.tensor(ids, dtype=torch.int64)
            previous = self.counts[:, index]
            self.counts[:, index] = counts
            newly = ((counts.sum(0) > 0) & (previous.sum(0) == 0)).tolist()
            poisoned = [b for b, new in zip(ids, newly) if new]
            for block in poisoned:
                self.detections[Region.NULL_BLOCK if block == NULL_BLOCK_ID else Region.ALLOCATED] += 1
            self.any_counted = bool(self.counts.any())
        self.scan_seconds.append(time.perf_counter() - start)
        if self.sweep.time_budget is not None and window_seconds is not None:
            self.sweep.time_budget.spent(window_seconds, self._window)
        return [b for b in poisoned if b != NULL_BLOCK_ID]

    @property
    def null_block_poisoned(self) -> bool:
        return self.any_counted and bool(self.counts[:, NULL_BLOCK_ID].any())

    def poisoned_blocks(self) -> list[int]:
        if not self.any_counted:
            return []
        return torch.nonzero(self.counts[:, FIRST_USABLE_BLOCK_ID:].sum(0)).flatten().add(FIRST_USABLE_BLOCK_ID).tolist()

    def values(self) -> list[tuple[int, str, int]]:
        """(layer, region, non-finite values present at the last scan) for the gauge."""
        null = self.counts[:, NULL_BLOCK_ID].tolist()
        allocated = self.counts[:, FIRST_USABLE_BLOCK_ID:].sum(1).tolist()
        return ([(layer, Region.NULL_BLOCK.value, v) for layer, v in enumerate(null)]
                + [(layer, Region.ALLOCATED.value, v) for layer, v in enumerate(allocated)])

    def zero_block(self, block_id: int) -> None:
        self.by_block[block_id].zero_()
        self.counts[:, block_id] = 0
        self.any_counted = bool(self.counts.any())

    def take_scan_seconds(self) -> list[float]:
        seconds, self.scan_seconds = self.scan_seconds, []
        return seconds
