"""The paged KV cache's addressing, in one place: the null block, the padding slot, and
the slot <-> (block, offset) arithmetic every writer and reader of the cache agrees on.

Token `t` of a request lives at `slot = block_table[t // block_size] * block_size +
t % block_size`. Block NULL_BLOCK_ID is never handed to a request: unused block-table
entries and padded rows point at it, so it must stay bitwise zero. A token that must write
nothing (padding, dummy batches) carries PAD_SLOT_ID, and every cache writer skips
`slot < 0`. docs/design.md explains why.
"""
from __future__ import annotations

import numpy as np
import torch

PAD_SLOT_ID = -1
NULL_BLOCK_ID = 0
FIRST_USABLE_BLOCK_ID = NULL_BLOCK_ID + 1  # the pool hands out blocks from here on


def slots_for_positions(block_ids: np.ndarray | list[int],  # [num_blocks_of_request] int64
                        positions: np.ndarray | int,        # [n] int64, token positions in the request
                        block_size: int) -> np.ndarray | int:  # [n] int64
    """Also for one position (an int) over the block table as a list: the slot, an int (a
    decode row's, without building arrays)."""
    return block_ids[positions // block_size] * block_size + positions % block_size


def block_of_slot(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """[n] block ids of real slots (callers drop PAD_SLOT_ID first)."""
    return slots // block_size


def offset_in_block(slots: torch.Tensor, block_size: int) -> torch.Tensor:
    return slots % block_size


def real_slots(slot_mapping: torch.Tensor) -> torch.Tensor:
    """The slots that write: everything but PAD_SLOT_ID."""
    return slot_mapping[slot_mapping != PAD_SLOT_ID]


def null_block_hits(slot_mapping: torch.Tensor, block_size: int) -> torch.Tensor:
    """[n] bool: real slots that land in the null block (a bug, counted on the device)."""
    return (slot_mapping >= 0) & (block_of_slot(slot_mapping, block_size) == NULL_BLOCK_ID)


def blocks_written(slot_mapping: torch.Tensor, block_size: int) -> list[int]:
    """Sorted ids of the blocks a step's slot mapping writes."""
    return torch.unique(block_of_slot(real_slots(slot_mapping), block_size)).tolist()
