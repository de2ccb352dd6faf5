"""The lockstep group's rendezvous: one TCPStore hosted by the front end, one key prefix per
group generation.

The store lives in the front end's process, not in rank 0's, so it outlives any rank. Every
time the group re-forms (engine/dp/reform.py) its members meet under a new prefix
(`kvsentry/generation-N/`): the keys of an older generation (rank addresses, barrier counters
of a process that is dead now) are never read again, so a re-formed group cannot reuse them.
Ranks that do not step in lockstep (dense models) have no collectives and no group.
"""
from __future__ import annotations

import datetime

import torch.distributed as dist

from engine.config import EngineConfig
from engine.placement import process_group_backend

GROUP_TIMEOUT = datetime.timedelta(seconds=120)  # a collective (or the meeting) with a silent peer fails after this


def store_address(config: EngineConfig) -> tuple[str, int]:
    p = config.parallel
    return p.data_parallel_address, p.data_parallel_rpc_port + 2


def host_store(config: EngineConfig) -> dist.TCPStore | None:
    """The group's store, on the third rpc port; None when the ranks need no group."""
    if not config.lockstep:
        return None
    host, port = store_address(config)
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=GROUP_TIMEOUT)


def generation_prefix(generation: int) -> str:
    return f"kvsentry/generation-{generation}/"


def join_group(config: EngineConfig, rank: int, generation: int) -> None:
    """Meet the other ranks of group `generation`; returns when all of them have joined."""
    host, port = store_address(config)
    store = dist.TCPStore(host, port, is_master=False, timeout=GROUP_TIMEOUT)
    dist.init_process_group(process_group_backend(config.device),
                            store=dist.PrefixStore(generation_prefix(generation), store), rank=rank,
                            world_size=config.parallel.data_parallel_size, timeout=GROUP_TIMEOUT)


def leave_group() -> None:
    """Drop this process's group (a peer may be dead: nothing here may wait on it)."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a group whose peer died can fail to tear down cleanly; it is unused from here on
            pass
