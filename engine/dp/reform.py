"""A surviving lockstep rank's side of re-forming its group after a peer died.

What a survivor keeps: its process, its weights, its compiled kernels. What it drops: every
request (the front end already re-queued or failed them, engine/dp/async_client.py), the
scheduler with its block pool and prefix cache, the integrity unit's seals and counters, and
the KV cache's contents (zeroed): engine/engine_core/reset.py. Why not keep the cache: a
peer's death interrupts a step part way through the layers, so some layers hold keys and
values of tokens that never became computed, and the prefix cache may index blocks whose
requests are gone; proving every block whole would cost more than the prefill the re-queued
requests redo.
"""
from __future__ import annotations

from engine.config import EngineConfig
from engine.dp.rendezvous import join_group, leave_group
from engine.engine_core.engine_core import EngineCore
from engine.engine_core.reset import recapture_graphs, reset_core


def rejoin(core: EngineCore, config: EngineConfig, rank: int, generation: int) -> None:
    """Leave the broken group, meet the others in `generation`, rebuild what held the old one."""
    leave_group()
    join_group(config, rank, generation)
    recapture_graphs(core)


__all__ = ["rejoin", "reset_core"]
