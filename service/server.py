"""Runs the service: uvicorn in this process, the DP ranks as child processes.

Signals: the first SIGTERM/SIGINT starts a drain (new requests get 503, /ready
fails, in-flight requests get up to --shutdown-timeout seconds, the rest are
aborted) and the process exits 0. A second SIGINT exits at once. A dead rank
fails the in-flight requests, turns /health to 503 and exits with code 1.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType

import uvicorn

from engine.config import EngineConfig
from service.app import build_app
from service.logs import log_event
from service.state import AppState, ServeSettings

logger = logging.getLogger("kvsentry.server")

FATAL_GRACE_SECONDS = 1.0    # lets failed requests get their error responses out
ABORT_FLUSH_SECONDS = 5.0    # after aborting at the drain deadline, wait for the final chunks


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: AppState):
        super().__init__(config)
        self.state = state
        self.exit_code = 0
        self.drain_started = False
        self.loop: asyncio.AbstractEventLoop | None = None
        state.on_fatal = self.fatal

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after serving and the
        # process would die of the signal instead of exiting 0 after a clean drain.
        if self.drain_started:
            if sig == signal.SIGINT:
                self.force_exit = self.should_exit = True
            return
        self.drain_started = True
        if self.loop is None or not self.state.client.ready:
            self.should_exit = True  # nothing is being served yet
            return
        self.loop.call_soon_threadsafe(lambda: self.state.spawn(self.drain(signal.Signals(sig).name)))

    async def drain(self, signal_name: str) -> None:
        state = self.state
        state.draining = True
        timeout = state.settings.shutdown_timeout
        log_event(logger, "draining", signal=signal_name, in_flight=len(state.in_flight), timeout_s=timeout)
        deadline = time.monotonic() + timeout
        while state.in_flight and time.monotonic() < deadline and not state.dead_reason:
            await asyncio.sleep(0.05)
        if state.in_flight:
            log_event(logger, "drain_timeout", logging.WARNING, aborting=len(state.in_flight))
            for request_id in list(state.in_flight):
                state.abort_soon(request_id)
            deadline = time.monotonic() + ABORT_FLUSH_SECONDS
            while state.in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        log_event(logger, "drained", left=len(state.in_flight))
        self.should_exit = True

    def fatal(self, reason: str) -> None:
        self.exit_code = 1
        self.config.timeout_graceful_shutdown = 2

        async def stop() -> None:
            await asyncio.sleep(FATAL_GRACE_SECONDS)
            self.should_exit = True
        self.state.spawn(stop())


def run(config: EngineConfig, client, settings: ServeSettings, host: str, port: int) -> int:
    state = AppState(config, client, settings)
    app = build_app(state)
    uv_config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False,
                               lifespan="on", timeout_graceful_shutdown=5, timeout_keep_alive=5,
                               server_header=False, log_level=settings.uvicorn_log_level)
    server = Server(uv_config, state)
    log_event(logger, "serving", host=host, port=port, model=config.model.path,
              served_model_names=list(settings.served_model_names),
              data_parallel_size=config.parallel.data_parallel_size)
    server.run()
    if not server.started and server.exit_code == 0:
        return 1  # could not bind, or the lifespan failed
    return server.exit_code


def run_headless(config: EngineConfig) -> int:
    """Worker node of a multi-node DP group: only this node's ranks, no HTTP."""
    from engine.dp.headless import run_headless as run_local_ranks

    def interrupt(sig: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)  # run_local_ranks stops its ranks on KeyboardInterrupt
    p = config.parallel
    log_event(logger, "headless", ranks=list(range(p.data_parallel_start_rank,
                                                   p.data_parallel_start_rank + p.data_parallel_size_local)),
              address=p.data_parallel_address, rpc_port=p.data_parallel_rpc_port)
    return run_local_ranks(config)
