"""The integrity unit's counters, as one typed struct: it crosses to the front end inside
StepStats (engine/messages.py) and feeds the kvsentry_kv_* metrics (service/metrics.py)."""
from __future__ import annotations

import msgspec


class IntegrityStats(msgspec.Struct, array_like=True):
    null_block_writes: int = 0                       # cache writes whose slot fell in block 0
    foreign_writes: int = 0                          # cache writes outside the step's own blocks
    corrupted_requests: int = 0                      # non-finite logits, or aborted for a poisoned block
    heals: int = 0                                   # blocks zeroed by --nan-policy heal
    nan_policy_tripped: bool = False                 # --nan-policy fail tripped (a NaN or a mismatch)
    nan_values: list[tuple[int, str, int]] = []      # (layer, region, count) at the last scan
    nan_detections: list[tuple[str, int]] = []       # (region, total): blocks found newly poisoned
    scan_coverage_steps: int = 0                     # steps within which every block is scanned
    checksum_mismatches: list[tuple[str, int]] = []  # (region, total): prefix_cache | running
    sealed_blocks: int = 0                           # blocks holding a checksum now
    checksum_coverage_steps: int = 0                 # steps within which every sealed block is verified
    scan_seconds: list[float] = []                   # per scan since the last report
    seal_seconds: list[float] = []                   # per step since the last report: hashing new seals
    verify_seconds: list[float] = []                 # per step since the last report: the verification sweep
