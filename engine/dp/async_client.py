"""asyncio client of the DP ranks, for the HTTP front end.

One background task reads every rank's outputs and fans them out to
per-request queues; another watches the rank processes, so a dead rank fails
in-flight requests at once (an exception on their queues) instead of hanging.
"""
from __future__ import annotations

import asyncio
import time
import weakref

import zmq
import zmq.asyncio

from engine.config import EngineConfig
from engine.dp.client import (ClientResources, ClientState, EngineDeadError, check_local_placement,
                              dead_process_reason, killed_process_reason, send_now, send_shutdown, spawn_local_ranks,
                              stop_processes)
from engine.dp.rank import endpoints
from engine.messages import EngineRequest, Fault, StepStats



class AsyncEngineClient:
    def __init__(self, config: EngineConfig, *, headless: bool = False):
        check_local_placement(config)  # a bad placement fails here, before the server starts
        self.config = config
        self.state = ClientState(config)
        self.queues: dict[str, asyncio.Queue] = {}
        self.procs = []
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        # Called with every StepStats as it arrives (e.g. to feed histograms that must see
        # each observation, like the sentinel's scan durations).
        self.stats_listeners: list = []

    # -- what the service reads ------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.state.ready and self.dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        return self.state.dead_reason

    @property
    def last_progress(self) -> float:
        return self.state.last_progress

    @property
    def num_unfinished(self) -> int:
        return len(self.state.tracked)

    @property
    def stats(self) -> dict[int, StepStats]:
        return self.state.stats

    @property
    def op_implementations(self) -> dict[int, dict[str, str]]:
        return self.state.op_implementations

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, ready_timeout: float = 600.0) -> None:
        # Released by shutdown(), or by the finalizer if this client is dropped without it
        # (engine/dp/client.py: ClientResources says why not __del__).
        self.resources = ClientResources(zmq.asyncio.Context(), self.state)
        self._release = weakref.finalize(self, self.resources.release)
        input_addr, output_addr, _ = endpoints(self.config)
        self.inputs = self.resources.socket(zmq.ROUTER)
        self.inputs.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.inputs.bind(input_addr)
        self.outputs = self.resources.socket(zmq.PULL)
        self.outputs.bind(output_addr)
        self.procs = self.resources.procs = spawn_local_ranks(self.config)
        self._tasks = [asyncio.create_task(self._read(self.outputs)),
                       asyncio.create_task(self._read(self.inputs)),
                       asyncio.create_task(self._watch())]
        deadline = time.monotonic() + ready_timeout
        while not self.state.ready:
            if self.dead_reason:
                raise EngineDeadError(self.dead_reason)
            if time.monotonic() > deadline:
                raise EngineDeadError("DP ranks did not become ready in time")
            await asyncio.sleep(0.05)

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        # start() may have failed part way (a port in use): close what it got to.
        if self.procs and hasattr(self, "inputs"):
            send_shutdown(self.inputs, self.state)
        for task in self._tasks:
            task.cancel()
        await _stop(self.procs)  # off the event loop; release() then finds them stopped
        if hasattr(self, "_release"):
            self._release()

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> asyncio.Queue:
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        queue: asyncio.Queue = asyncio.Queue()
        messages = self.state.route(request)
        self.queues[request.request_id] = queue
        for rank, payload in messages:
            self._send_now(rank, payload)
        return queue

    async def abort(self, request_id: str, index: int | None = None) -> None:
        if self.dead_reason:
            return
        await self._send(self.state.abort(request_id, index))

    async def inject_fault(self, rank: int, fault: Fault) -> None:
        if not 0 <= rank < self.state.size:
            raise ValueError(f"rank: must be in [0, {self.state.size})")
        await self._send([(rank, self.state.encoder.encode(fault))])

    # -- internals -----------------------------------------------------------------------------
    def _send_now(self, rank: int, payload: bytes) -> None:
        try:
            send_now(self.inputs, rank, payload)
        except zmq.ZMQError as exc:
            self._die(f"DP rank {rank} is unreachable: {exc}")
            raise EngineDeadError(self.dead_reason) from exc

    async def _send(self, messages: list[tuple[int, bytes]]) -> None:
        for rank, payload in messages:
            self._send_now(rank, payload)

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            outputs, replies = self.state.handle(frames[-1])
            if self.state.last_stats is not None:
                for listener in self.stats_listeners:
                    listener(self.state.last_stats)
            for out in outputs:
                queue = self.queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            for rid in [rid for rid in self.queues if rid not in self.state.tracked]:
                self.queues.pop(rid, None)
            if replies:
                await self._send(replies)
            if self.dead_reason:
                self._die(killed_process_reason(self.procs, self.config) or self.dead_reason)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            reason = killed_process_reason(self.procs, self.config) or dead_process_reason(self.procs, self.config)
            if reason is None and self.state.ready:
                silent = self.state.silent_ranks()
                if silent:
                    reason = f"DP rank {silent[0]} sent nothing for too long"
            if reason:
                self._die(reason)
                return

    def _die(self, reason: str) -> None:
        killed = killed_process_reason(self.procs, self.config)
        if self.state.dead_reason is None or killed:
            self.state.dead_reason = killed or reason
        error = EngineDeadError(self.state.dead_reason)
        for queue in self.queues.values():
            queue.put_nowait(error)
        self.queues.clear()


async def _stop(procs) -> None:
    """Join the rank processes off the event loop; inline when the interpreter is already
    exiting (no executor threads may start then)."""
    try:
        await asyncio.to_thread(stop_processes, procs)
    except RuntimeError:
        stop_processes(procs)
