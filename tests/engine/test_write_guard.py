"""The write guard's CPU path (numpy over the step's slots) against its torch path (what a GPU
runs): the same slots to write and the same count of foreign writes, strict or not."""
from __future__ import annotations

import random

import pytest
import torch

from engine.integrity.write_guard import WriteGuard
from engine.paging import PAD_SLOT_ID

BLOCKS, BLOCK_SIZE = 64, 16


def torch_path(strict: bool) -> WriteGuard:
    guard = WriteGuard(BLOCKS, BLOCK_SIZE, "cpu", strict)
    guard._np_allowed = None  # what a CUDA device runs, here on CPU tensors
    return guard


@pytest.mark.parametrize("strict", [False, True])
def test_numpy_and_torch_paths_agree(strict):
    rng = random.Random(7)
    host, reference = WriteGuard(BLOCKS, BLOCK_SIZE, "cpu", strict), torch_path(strict)
    assert host._np_allowed is not None
    foreign_steps = 0
    for _ in range(300):
        owned = rng.sample(range(1, BLOCKS), rng.randrange(0, 6))
        tokens = rng.randrange(1, 40)
        # Mostly slots in the owned blocks, some padding, now and then a foreign block's slot.
        slots = []
        for _ in range(tokens):
            kind = rng.random()
            if kind < 0.15 or not owned:
                slots.append(PAD_SLOT_ID if kind < 0.1 or not owned else rng.randrange(BLOCKS * BLOCK_SIZE))
            else:
                slots.append(rng.choice(owned) * BLOCK_SIZE + rng.randrange(BLOCK_SIZE))
        mapping = torch.tensor(slots, dtype=torch.int64)
        for guard in (host, reference):
            guard.begin_step(list(owned))
        got, want = host.check(mapping), reference.check(mapping)
        assert torch.equal(got, want), (slots, owned)
        assert host.check(mapping) is got  # later layers: the step's answer, counted once
        assert host.foreign_writes.item() == reference.foreign_writes.item()
        foreign_steps += any(s >= 0 and s // BLOCK_SIZE not in owned for s in slots)
    assert foreign_steps > 20 and host.foreign_writes.item() > 0  # the comparison saw foreign writes
    if strict:  # a foreign slot became padding; an owned one stayed
        host.begin_step([3])
        out = host.check(torch.tensor([3 * BLOCK_SIZE + 1, 9 * BLOCK_SIZE, PAD_SLOT_ID]))
        assert out.tolist() == [3 * BLOCK_SIZE + 1, PAD_SLOT_ID, PAD_SLOT_ID]


def test_a_dummy_step_owns_nothing():
    guard = WriteGuard(BLOCKS, BLOCK_SIZE, "cpu", strict=True)
    guard.begin_step([5, 6])
    guard.begin_step([])  # the previous step's blocks are not writable any more
    out = guard.check(torch.tensor([5 * BLOCK_SIZE, PAD_SLOT_ID]))
    assert out.tolist() == [PAD_SLOT_ID, PAD_SLOT_ID] and guard.foreign_writes.item() == 1
