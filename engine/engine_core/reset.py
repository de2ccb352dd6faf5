"""Putting a live EngineCore back to its state after loading, weights kept: what a surviving rank
of a lockstep group does when the group re-forms (engine/dp/reform.py says why it must)."""
from __future__ import annotations

import torch

from engine.core.scheduler import Scheduler
from engine.engine_core.engine_core import EngineCore
from engine.integrity.unit import CacheIntegrity
from engine.worker.cuda_graphs import DecodeGraphs
from engine.worker.kv_cache import block_axis


def reset_core(core: EngineCore) -> None:
    """Drop every request, the prefix cache, the seals and integrity counters, and zero the KV
    cache; keep the weights and the compiled kernels."""
    config, runner = core.config, core.runner
    core.take_pending()  # outputs for requests the front end no longer tracks
    core.scheduler = Scheduler(config)
    runner.kv_storage.zero_()
    runner.null_block_writes.zero_()
    runner.write_guard.foreign_writes.zero_()
    core.integrity = CacheIntegrity(config, runner.kv_storage, block_axis(config), runner.null_block_writes,
                                    runner.write_guard.foreign_writes)


def recapture_graphs(core: EngineCore) -> None:
    """Captured CUDA graphs replay the collectives of the group they were captured in (its NCCL
    communicator): after joining a new group, capture again -- in step with the other ranks,
    which capture as they load or as they re-form too."""
    runner = core.runner
    if runner.graphs is None:
        return
    runner.graphs = DecodeGraphs(core.config, runner.model, runner.kv_storage, runner.kv_caches,
                                 runner.null_block_writes, runner.write_guard)
    with torch.inference_mode():
        runner.graphs.capture()
