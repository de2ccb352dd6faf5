"""The rolling sweep both cache watchers use (the NaN sentinel, the sealed-block checksums): a
window of `budget` block ids per step that cycles through the pool past the null block, so
every block is visited at least once every `coverage_steps` steps."""
from __future__ import annotations

from engine.paging import FIRST_USABLE_BLOCK_ID


class RollingSweep:
    def __init__(self, num_blocks: int, budget: int):
        self.num_blocks = num_blocks
        self.budget = max(1, budget)
        self.cursor = FIRST_USABLE_BLOCK_ID

    def coverage_steps(self, mode: str) -> int:
        """Steps within which mode "rolling" visits every block ("full": every step; else 0)."""
        if mode == "full":
            return 1
        if mode == "rolling":
            return -(-(self.num_blocks - FIRST_USABLE_BLOCK_ID) // self.budget)
        return 0

    def next_window(self) -> range:
        """This step's block ids, and the cursor moved past them (back to the start at the end)."""
        end = min(self.cursor + self.budget, self.num_blocks)
        window = range(self.cursor, end)
        self.cursor = FIRST_USABLE_BLOCK_ID if end >= self.num_blocks else end
        return window
