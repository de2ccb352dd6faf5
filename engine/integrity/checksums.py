"""Sealed-block checksums: finite corruption of the KV cache, found at run time.

A block is *sealed* once every slot of it is written: from then on it is only read (prefix
cache blocks are sealed blocks). When blocks seal, one batched op records their checksums
(engine/ops/checksum.py), per layer, on the cache's device. A verification sweep recomputes
them: in rolling mode over a window of `kv_checksum_blocks_per_step` block ids per step that
cycles through the pool (the NaN sweep's budget model), so a sealed block is verified at
least once every `coverage_steps` steps; in full mode every sealed block every step. One
host sync per step tells "all equal"; only a mismatch is looked at in Python.

A block that is recycled (handed out again) or freed without a cached copy loses its
checksum before anyone may write it (the block pool lists those: BlockPool.take_unsealed),
so legitimate writes never count.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from engine.config import EngineConfig
from engine.ops.checksum import block_checksums, block_words, make_multipliers
from engine.integrity.sweep import RollingSweep


class BlockChecksums:
    def __init__(self, config: EngineConfig, storage: torch.Tensor, axis: int):
        """`axis`: the dimension of `storage` that indexes blocks (engine/worker/kv_cache.py)."""
        self.mode = config.kv_checksums
        self.words = block_words(storage, axis)  # [num_blocks, num_layers, chunks, words] int32
        self.multipliers = make_multipliers(self.words)          # [2, chunks, words] int32
        self.num_blocks = config.num_blocks
        self.sweep = RollingSweep(self.num_blocks, config.kv_checksum_blocks_per_step)
        # [num_blocks, num_layers, 2] int64: each sealed block's checksum lanes per layer.
        self.sums = torch.zeros(self.num_blocks, self.words.shape[1], 2, dtype=torch.int64, device=storage.device)
        self.sealed = np.zeros(self.num_blocks, dtype=bool)
        self.latest_sealed: int | None = None
        self.seal_seconds: list[float] = []
        self.verify_seconds: list[float] = []

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def num_sealed(self) -> int:
        return int(self.sealed.sum())

    @property
    def coverage_steps(self) -> int:
        """Steps within which every sealed block is verified at least once."""
        return self.sweep.coverage_steps(self.mode)

    def seal(self, block_ids: list[int]) -> None:
        """Record the checksums of blocks that just became full (already sealed ones keep theirs:
        re-hashing a shared prefix block would launder a corruption)."""
        if not self.enabled or not block_ids:
            return
        new = sorted({b for b in block_ids if not self.sealed[b]})
        if not new:
            return
        start = time.perf_counter()
        index = torch.tensor(new, dtype=torch.int64, device=self.sums.device)
        self.sums.index_copy_(0, index, block_checksums(self.words, index, self.multipliers))
        self.sealed[new] = True
        self.latest_sealed = new[-1]
        self.seal_seconds.append(time.perf_counter() - start)

    def unseal(self, block_ids: list[int]) -> None:
        if block_ids:
            self.sealed[block_ids] = False
            if self.latest_sealed in block_ids:
                self.latest_sealed = None

    def _window(self) -> list[int]:
        if self.mode == "full":
            return np.flatnonzero(self.sealed).tolist()
        window = self.sweep.next_window()
        return (np.flatnonzero(self.sealed[window.start:window.stop]) + window.start).tolist()

    def verify(self) -> list[tuple[int, list[int]]]:
        """This step's sweep: (block, mismatching layers) for every sealed block whose bytes
        changed. A block found is unsealed, so it is reported once."""
        if not self.enabled:
            return []
        start = time.perf_counter()
        ids = self._window()
        found: list[tuple[int, list[int]]] = []
        if ids:
            index = torch.tensor(ids, dtype=torch.int64, device=self.sums.device)
            differs = (block_checksums(self.words, index, self.multipliers) != self.sums[index]).any(-1)  # [n, layers]
            if bool(differs.any()):
                rows = differs.cpu()
                found = [(ids[i], torch.nonzero(rows[i]).flatten().tolist()) for i in range(len(ids)) if rows[i].any()]
                self.unseal([block for block, _ in found])
        self.verify_seconds.append(time.perf_counter() - start)
        return found

    def take_seconds(self) -> tuple[list[float], list[float]]:
        seal, verify = self.seal_seconds, self.verify_seconds
        self.seal_seconds, self.verify_seconds = [], []
        return seal, verify
