"""The rolling sweep both cache watchers use (the NaN sentinel, the sealed-block checksums): a
window of block ids per step that cycles through the pool past the null block, so every block
is visited at least once every `coverage_steps` steps.

The window is `budget` blocks, or, with a ScanBudget, as many blocks (up to `budget`) as the
time the budget has earned pays for: a cold KV block costs the same ~0.1 ms to scan whatever
the step, so a fixed window is a larger share of a short (batch 1) step than of a long one."""
from __future__ import annotations

from engine.paging import FIRST_USABLE_BLOCK_ID


class ScanBudget:
    """Scan time earned as a share of wall time (a token bucket), spent block by block.

    Every call to `blocks(now)` credits `share` x the time since the previous call and answers
    how many blocks the credit pays for at the measured cost of one; `spent` debits what the
    scan took. Over any stretch the sweep's time stays within `share` of the elapsed time plus
    one window's cost. Credit is capped at one full window, so idle time buys no burst larger
    than `max_blocks`."""

    EMA = 0.2  # weight of the newest per-block cost: the cost moves with what else the machine runs

    def __init__(self, share: float, max_blocks: int):
        self.share = share
        self.max_blocks = max_blocks
        self.credit = 0.0        # seconds of scan time earned and not spent
        self.block_seconds = 0.0  # the measured cost of one block (0: not measured yet)
        self.blocks_per_step = 0.0  # EMA of the windows granted: the sweep's rate
        self._last: float | None = None

    def blocks(self, now: float) -> int:
        if self._last is not None:
            self.credit += self.share * (now - self._last)
        self._last = now
        if self.block_seconds <= 0.0:  # nothing measured yet: one block tells what a block costs
            granted = 1
        else:
            self.credit = min(self.credit, self.max_blocks * self.block_seconds)
            granted = max(0, min(self.max_blocks, int(self.credit / self.block_seconds)))
        self.blocks_per_step += self.EMA * (granted - self.blocks_per_step)
        return granted

    def spent(self, seconds: float, blocks: int) -> None:
        if blocks <= 0:
            return
        self.credit -= seconds
        per_block = seconds / blocks
        self.block_seconds = per_block if self.block_seconds <= 0.0 else (
            self.block_seconds + self.EMA * (per_block - self.block_seconds))


class RollingSweep:
    def __init__(self, num_blocks: int, budget: int, time_budget: ScanBudget | None = None):
        self.num_blocks = num_blocks
        self.budget = max(1, budget)
        self.time_budget = time_budget
        self.cursor = FIRST_USABLE_BLOCK_ID

    def coverage_steps(self, mode: str) -> int:
        """Steps within which mode "rolling" visits every block ("full": every step; else 0).
        Under a time budget, the steps at the sweep's current rate (an estimate)."""
        if mode == "full":
            return 1
        if mode == "rolling":
            rate = float(self.budget)
            if self.time_budget is not None and self.time_budget.block_seconds > 0.0:
                rate = max(self.time_budget.blocks_per_step, 1e-3)
            return -int(-(self.num_blocks - FIRST_USABLE_BLOCK_ID) // rate)
        return 0

    def next_window(self, now: float | None = None) -> range:
        """This step's block ids, and the cursor moved past them (back to the start at the end).
        `now` (time.perf_counter()) is required under a time budget."""
        size = self.budget if self.time_budget is None else self.time_budget.blocks(now)
        end = min(self.cursor + size, self.num_blocks)
        window = range(self.cursor, end)
        if size:
            self.cursor = FIRST_USABLE_BLOCK_ID if end >= self.num_blocks else end
        return window
