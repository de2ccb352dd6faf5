"""A worker node of a multi-node DP group (`serve --headless`): this node's ranks, supervised."""
from __future__ import annotations

import time
from multiprocessing.connection import wait

from engine.config import EngineConfig
from engine.dp.client import local_ranks, spawn_local_ranks, spawn_rank, stop_processes
from engine.dp.supervision import CrashLoop


def run_headless(config: EngineConfig) -> int:
    """Worker node: run this node's ranks (no front end), respawning one that dies as the front
    end's supervisor would (engine/dp/supervision.py: same backoff, same crash-loop limit); the
    leader re-forms the group when the respawned rank announces itself. Returns on a crash loop
    (exit code 1) or an interrupt (0)."""
    crash_loop = CrashLoop.for_config(config)
    procs = dict(zip(local_ranks(config), spawn_local_ranks(config)))  # placement checked first
    try:
        while True:
            by_sentinel = {proc.sentinel: rank for rank, proc in procs.items()}
            for sentinel in wait(list(by_sentinel)):
                rank = by_sentinel[sentinel]
                proc = procs[rank]
                proc.join()
                print(f"DP rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}", flush=True)
                delay = crash_loop.record(rank, time.monotonic())
                if delay is None:
                    print(crash_loop.verdict(), flush=True)
                    stop_processes(list(procs.values()), timeout=2.0)
                    return 1
                time.sleep(delay)
                procs[rank] = spawn_rank(config, rank, generation=None)
    except KeyboardInterrupt:
        stop_processes(list(procs.values()), timeout=2.0)
        return 0
