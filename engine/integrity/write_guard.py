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

import numpy as np
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
        # On CPU the same checks in numpy over the step's few slots: ~3 us a step where torch's
        # six small ops took ~15 (the counter stays a tensor: the integrity unit reads it).
        self._np_allowed = self._host.numpy() if self.allowed is self._host else None
        self._np_foreign = self.foreign_writes.numpy() if self._np_allowed is not None else None

    def begin_step(self, block_ids: list[int]) -> None:
        """The blocks this step may write ([] for a dummy batch)."""
        host = self._np_allowed if self._np_allowed is not None else self._host
        if self._marked:
            host[self._marked] = False
        self._marked = block_ids
        if block_ids:
            host[block_ids] = True
        if self.allowed is not self._host:
            self.allowed.copy_(self._host, non_blocking=True)
        self._checked = None

    def check(self, slot_mapping: torch.Tensor) -> torch.Tensor:  # [num_tokens] int64 -> the slots to write
        if self._checked is not None and self._checked[0] is slot_mapping:
            return self._checked[1]  # later layers: counted once per step
        if self._np_allowed is not None and slot_mapping.device.type == "cpu":
            slots = self._check_on_host(slot_mapping)
            self._checked = (slot_mapping, slots)
            return slots
        valid = slot_mapping >= 0
        foreign = valid & ~self.allowed[block_of_slot(slot_mapping.clamp(min=0), self.block_size)]
        self.foreign_writes += foreign.sum()
        slots = torch.where(foreign, PAD_SLOT_ID, slot_mapping) if self.strict else slot_mapping
        self._checked = (slot_mapping, slots)
        return slots

    def _check_on_host(self, slot_mapping: torch.Tensor) -> torch.Tensor:  # check()'s arithmetic in numpy
        mapping = slot_mapping.numpy()
        valid = mapping >= 0
        foreign = valid & ~self._np_allowed[np.where(valid, mapping, 0) // self.block_size]
        count = int(np.count_nonzero(foreign))
        if count == 0:
            return slot_mapping
        self._np_foreign[0] += count
        return torch.from_numpy(np.where(foreign, PAD_SLOT_ID, mapping)) if self.strict else slot_mapping
