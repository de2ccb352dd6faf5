"""A rank's integrity unit: what watches its KV cache and what follows from a finding.

It owns the NaN sentinel (sentinel.py), the sealed-block checksums (checksums.py) and the
NaN/mismatch policy (policy.py), and reads the two device counters the KV writer keeps (writes
into block 0, writes outside the step's own blocks: write_guard.py). The engine core calls it
around each step and acts on what it returns; the unit knows no scheduler: it is told which
blocks the pool handed out or freed, and asked back which blocks to quarantine.

Its counters reach the front end as one IntegrityStats, only when the rank reports (on a
change, a timer or going idle: engine/dp/rank.py): reading the device counters is a host
sync on CUDA, paid once a report, never once a step.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.config import EngineConfig
from engine.integrity.checksums import BlockChecksums
from engine.integrity.policy import NaNPolicy
from engine.integrity.regions import Region
from engine.integrity.sentinel import NaNSentinel
from engine.integrity.stats import IntegrityStats
from engine.paging import NULL_BLOCK_ID

log = logging.getLogger(__name__)


class CacheIntegrity:
    def __init__(self, config: EngineConfig, storage: torch.Tensor, axis: int,
                 null_block_writes: torch.Tensor,  # [1] int64, the KV writer's count of block-0 writes
                 foreign_writes: torch.Tensor):    # [1] int64, the write guard's count
        """`storage`: every layer's cache in one tensor; `axis`: its dimension that indexes blocks."""
        self.rank = config.parallel.data_parallel_rank
        self.policy = NaNPolicy(config.nan_policy)
        self.sentinel = NaNSentinel(config, storage, axis, null_block_writes)
        self.checksums = BlockChecksums(config, storage, axis)
        self._device_counters = (null_block_writes, foreign_writes)
        self.checksum_mismatches = {Region.PREFIX_CACHE: 0, Region.RUNNING: 0}
        self.heals = 0
        self.corrupted_requests = 0
        self.tripped = False
        self._sealing: list[int] = []  # blocks the current step filled, sealed once it is done

    # -- around a step ---------------------------------------------------------------------------
    def before_step(self, handed_out: list[int]) -> None:
        """Blocks the scheduler just handed out lose their checksums before the step rewrites them."""
        self.checksums.unseal(handed_out)

    def filled(self, block_ids: list[int]) -> None:
        """Blocks the step wrote their last slot of: sealed once the step is done."""
        self._sealing += block_ids

    def after_step(self, written_slots: torch.Tensor | None, block_size: int, freed: list[int],
                   is_cached: Callable[[int], bool]) -> list[tuple[int, str]]:
        """The NaN sentinel over what the step wrote (None: nothing), the seals of the blocks
        it filled, the checksum sweep; then the policy. `freed`: blocks the step released
        (finished, aborted); `is_cached`: whether a block is in the prefix cache. Returns the
        blocks to quarantine under --nan-policy heal, with why: the caller ends the requests
        that read them and drops them from the prefix cache, then calls `quarantined`."""
        poisoned = self.sentinel.step(written_slots, block_size)
        self.checksums.seal(self._sealing)
        self._sealing = []
        self.checksums.unseal(freed)
        mismatched = self.checksums.verify()
        for block, layers in mismatched:
            region = Region.PREFIX_CACHE if is_cached(block) else Region.RUNNING
            self.checksum_mismatches[region] += 1
            log.warning("rank %d: KV block %d (%s) changed after it was sealed, in layers %s",
                        self.rank, block, region.value, layers)
        null_poisoned = self.sentinel.null_block_poisoned
        if self.policy.trips and (poisoned or mismatched or null_poisoned):
            self.tripped = True
        if not self.policy.heals:
            return []
        if null_poisoned:  # nobody owns block 0: zero it in place
            self.sentinel.zero_block(NULL_BLOCK_ID)
            self.heals += 1
        return ([(block, "kv cache block poisoned") for block in self.sentinel.poisoned_blocks()]
                + [(block, "kv cache block checksum mismatch") for block, _ in mismatched])

    def quarantined(self, block: int, readers: int) -> None:
        """`block`'s `readers` requests were ended and the block left the prefix cache: zero it."""
        self.corrupted_requests += readers
        self.sentinel.zero_block(block)
        self.checksums.unseal([block])
        self.heals += 1

    def bad_logits(self) -> bool:
        """A request's logits were not finite: count it; whether the request ends with "error"."""
        self.corrupted_requests += 1
        return self.policy.ends_requests_on_bad_logits

    # -- reporting -------------------------------------------------------------------------------
    @property
    def findings(self) -> int:
        """Grows with every new detection, mismatch, heal, corrupted request or trip (never
        with time): a report is due when it moved."""
        return (sum(self.sentinel.detections.values()) + sum(self.checksum_mismatches.values())
                + self.heals + self.corrupted_requests + int(self.tripped))

    def stats(self) -> IntegrityStats:
        # Both device counters in one read-back: one host sync on CUDA (none on CPU).
        null_block_writes, foreign_writes = torch.cat(self._device_counters).tolist()
        sentinel, checksums = self.sentinel, self.checksums
        seal_seconds, verify_seconds = checksums.take_seconds()
        return IntegrityStats(
            null_block_writes=null_block_writes, foreign_writes=foreign_writes,
            corrupted_requests=self.corrupted_requests, heals=self.heals, nan_policy_tripped=self.tripped,
            nan_values=sentinel.values() if sentinel.enabled else [],
            nan_detections=[(region.value, n) for region, n in sentinel.detections.items()],
            scan_coverage_steps=sentinel.coverage_steps,
            checksum_mismatches=[(region.value, n) for region, n in self.checksum_mismatches.items()],
            sealed_blocks=checksums.num_sealed, checksum_coverage_steps=checksums.coverage_steps,
            scan_seconds=sentinel.take_scan_seconds(), seal_seconds=seal_seconds, verify_seconds=verify_seconds)
