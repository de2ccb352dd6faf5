"""The foreign-write guard: which blocks a step may write, and a device-side count of the
cache writes that land anywhere else.

The set comes from the scheduler (the blocks of the requests it scheduled, at the positions
they compute), not from the slot buffer, so a slot buffer that went stale -- a dummy or
padded batch replaying the previous step's slots -- shows up here even when its values look
like real keys and values. A dummy batch may write no block at all. The KV writer
(engine/ops/kv_writer.py) checks the slot mapping it is given once per step (every layer
writes the same slots) and, with --strict-kv-writes, turns foreign slots into PAD_SLOT_ID.
"""
from __future__ import annotations

import torch

from engine.paging import PAD_SLOT_ID, block_of_slot


class WriteGuard:
    def __init__(self, num_blocks: int, block_size: int, device: str | torch.device, strict: bool):
        self.block_size = block_size
        self.strict = strict
        device = torch.device(device)
        self._host = torch.zeros(num_blocks, dtype=torch.bool,  # [num_blocks] the step's writable blocks
                                 pin_memory=device.type == "cuda")
        self.allowed = self._host if device.type == "cpu" else torch.zeros(num_blocks, dtype=torch.bool, device=device)
        self.foreign_writes = torch.zeros(1, dtype=torch.int64, device=device)  # [1] since start-up
        self._marked: list[int] = []
        self._checked: tuple[torch.Tensor, torch.Tensor] | None = None

    def begin_step(self, block_ids: list[int]) -> None:
        """The blocks this step may write ([] for a dummy batch)."""
        if self._marked:
            self._host[self._marked] = False
        self._marked = block_ids
        if block_ids:
            self._host[block_ids] = True
        if self.allowed is not self._host:
            self.allowed.copy_(self._host, non_blocking=True)
        self._checked = None

    def check(self, slot_mapping: torch.Tensor) -> torch.Tensor:  # [num_tokens] int64 -> the slots to write
        if self._checked is not None and self._checked[0] is slot_mapping:
            return self._checked[1]  # later layers: counted once per step
        valid = slot_mapping >= 0
        foreign = valid & ~self.allowed[block_of_slot(slot_mapping.clamp(min=0), self.block_size)]
        self.foreign_writes += foreign.sum()
        slots = torch.where(foreign, PAD_SLOT_ID, slot_mapping) if self.strict else slot_mapping
        self._checked = (slot_mapping, slots)
        return slots
