"""Front-end side of the DP ranks: spawning them, routing requests, waves.

`ClientState` is the transport-free bookkeeping (which rank holds which
request, least-loaded routing, the wave counter); `DPEngineClient` drives it
over blocking zmq for the offline `LLM`, engine/dp/async_client.py over asyncio
for the HTTP service (with the rank supervisor), and engine/dp/headless.py starts only local
ranks for a worker node of a multi-node group.
"""
from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import time
import weakref
from dataclasses import dataclass

import msgspec
import zmq

from engine.config import EngineConfig
from engine.placement import check_placement, visible_cuda_devices
from engine.dp.rank import endpoints, rank_identity, run_rank
from engine.dp.rendezvous import host_store
from engine.messages import (Abort, EngineCoreOutput, EngineMessage, EngineOutputs, EngineRequest,
                             Fault, GroupBroken, RankFailed, RankJoining, RankReady, Shutdown, StepStats, Wake)

RANK_SILENCE_SECONDS = 30.0  # a rank heartbeats every second while idle


class EngineDeadError(RuntimeError):
    pass


class RankDiedError(EngineDeadError):
    """The rank serving a request died after the request had produced output: it cannot be
    re-queued without the client seeing its output twice (engine/dp/supervision.py)."""


@dataclass
class _Tracked:
    rank: int
    samples_left: int
    request: EngineRequest       # kept to re-queue it, should its rank die before it produced output
    incarnation: int             # of the rank process it went to: outputs of another are stale
    started: bool = False


class ClientState:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.size = config.parallel.data_parallel_size
        self.lockstep = config.lockstep
        self.wave = 0
        self.generation = 0  # of the lockstep group (engine/dp/async_client.py re-forms it)
        self.tracked: dict[str, _Tracked] = {}
        self.waiting = [0] * self.size
        self.running = [0] * self.size
        self.rotation = itertools.count()
        self.ready_ranks: set[int] = set()  # ranks that take requests now
        self.incarnations: dict[int, int] = {}  # rank -> incarnation of its live process (RankReady)
        self.lifecycle: list[RankJoining | GroupBroken | RankFailed] = []  # for a supervisor to act on
        self.op_implementations: dict[int, dict[str, str]] = {}  # rank -> {op: implementation}
        self.last_seen = [time.monotonic()] * self.size
        self.last_progress = time.monotonic()
        self.stats: dict[int, StepStats] = {}
        self.dead_reason: str | None = None
        self.supervised = False  # a rank's death is the supervisor's to handle, not the end
        self.last_stats: StepStats | None = None  # the stats carried by the last handled message
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineMessage)

    @property
    def ready(self) -> bool:
        return len(self.ready_ranks) == self.size

    def pick_rank(self) -> int:
        ranks = sorted(self.ready_ranks) or list(range(self.size))
        loads = {r: self.waiting[r] * 4 + self.running[r] for r in ranks}
        best = min(loads.values())
        candidates = [r for r in ranks if loads[r] == best]
        return candidates[next(self.rotation) % len(candidates)]

    def route(self, request: EngineRequest, rank: int | None = None) -> list[tuple[int, bytes]]:
        """Messages (rank, payload) that submit `request`; also wakes the other ranks."""
        if request.request_id in self.tracked:
            raise ValueError(f"request_id: {request.request_id!r} is already in flight")
        rank = self.pick_rank() if rank is None else rank
        if not 0 <= rank < self.size:
            raise ValueError(f"rank: must be in [0, {self.size})")
        request.wave = self.wave
        try:  # before it is tracked: a request that cannot be sent leaves nothing behind
            payload = self.encoder.encode(request)
        except (msgspec.EncodeError, OverflowError) as exc:
            raise ValueError(f"request: a value the engine cannot take ({exc})") from None
        self.tracked[request.request_id] = _Tracked(rank, request.params.n, request, self.incarnations.get(rank, 0))
        self.waiting[rank] += 1
        messages = [(rank, payload)]
        if self.lockstep:
            wake = self.encoder.encode(Wake(self.wave, self.generation))
            messages += [(r, wake) for r in range(self.size) if r != rank]
        return messages

    def abort(self, request_id: str, index: int | None = None) -> list[tuple[int, bytes]]:
        tracked = self.tracked.get(request_id)
        if tracked is None:
            return []
        return [(tracked.rank, self.encoder.encode(Abort([request_id], index)))]

    def broadcast(self, message) -> list[tuple[int, bytes]]:
        payload = self.encoder.encode(message)
        return [(r, payload) for r in range(self.size)]

    def handle(self, raw: bytes) -> tuple[list[EngineCoreOutput], list[tuple[int, bytes]]]:
        """Decode one rank message: (outputs for requests, messages to send back)."""
        msg = self.decoder.decode(raw)
        now = time.monotonic()
        self.last_stats = msg.stats if isinstance(msg, EngineOutputs) else None
        if isinstance(msg, RankReady):
            self.ready_ranks.add(msg.rank)
            self.incarnations[msg.rank] = msg.incarnation
            self.op_implementations[msg.rank] = msg.op_implementations
            self.last_seen[msg.rank] = now
            return [], []
        if isinstance(msg, (RankJoining, GroupBroken)):
            if self.supervised:
                self.lifecycle.append(msg)
            return [], []
        if isinstance(msg, RankFailed):
            if self.supervised:
                self.lifecycle.append(msg)
            else:  # else a supervisor replaces the rank (engine/dp/async_client.py)
                self.dead_reason = f"DP rank {msg.rank} failed: {msg.reason}"
            return [], []
        assert isinstance(msg, EngineOutputs)
        if self.incarnations.get(msg.rank) != msg.incarnation:
            return [], []  # sent by a process that has died or left its group since
        self.last_seen[msg.rank] = now
        if msg.stats is not None:
            previous = self.stats.get(msg.rank)
            # A rank waiting only for grammars to compile (bounded by their timeout) is making progress.
            if previous is None or msg.stats.steps != previous.steps or msg.stats.num_preparing:
                self.last_progress = now
            self.stats[msg.rank] = msg.stats
        replies: list[tuple[int, bytes]] = []
        if msg.wave_complete is not None:
            self.wave = max(self.wave, msg.wave_complete + 1)
        if msg.start_wave is not None:
            self.wave = max(self.wave, msg.start_wave)
            replies = self.broadcast(Wake(msg.start_wave, self.generation))
        outputs = []
        for out in msg.outputs:
            tracked = self.tracked.get(out.request_id)
            if tracked is None or tracked.rank != msg.rank or tracked.incarnation != msg.incarnation:
                continue
            outputs.append(out)
            if not tracked.started:
                tracked.started = True
                self.waiting[tracked.rank] -= 1
                self.running[tracked.rank] += 1
            if out.finish_reason is not None:
                tracked.samples_left -= 1
                if tracked.samples_left == 0:
                    self.running[tracked.rank] -= 1
                    del self.tracked[out.request_id]
        return outputs, replies

    def take_requests(self, ranks: set[int]) -> tuple[list[EngineRequest], list[str]]:
        """Stop tracking every request on `ranks`: (those that produced no output yet, to re-queue,
        oldest first; the ids of those that did)."""
        unstarted, started = [], []
        for request_id, tracked in list(self.tracked.items()):
            if tracked.rank not in ranks:
                continue
            del self.tracked[request_id]
            if tracked.started:
                self.running[tracked.rank] -= 1
                started.append(request_id)
            else:
                self.waiting[tracked.rank] -= 1
                unstarted.append(tracked.request)
        unstarted.sort(key=lambda request: request.arrival_time)
        return unstarted, started

    def rank_down(self, rank: int) -> None:
        """`rank` takes no requests, and whatever its process sends from now on is stale."""
        self.ready_ranks.discard(rank)
        self.incarnations.pop(rank, None)
        self.stats.pop(rank, None)

    def silent_ranks(self) -> list[int]:
        now = time.monotonic()
        return [r for r in range(self.size) if now - self.last_seen[r] > RANK_SILENCE_SECONDS]


def send_now(router: zmq.Socket, rank: int, payload: bytes) -> None:
    """Non-blocking send to `rank`; raises zmq.ZMQError (EHOSTUNREACH) if it is gone.

    On a zmq.asyncio socket a NOBLOCK send completes at once but reports through a
    Future: unwrap it, so both kinds of socket fail the same way."""
    result = router.send_multipart([rank_identity(rank), payload], flags=zmq.NOBLOCK)
    if hasattr(result, "exception") and result.done():
        error = result.exception()
        if error is not None:
            raise error


def send_shutdown(router: zmq.Socket, state: ClientState) -> None:
    """Tell every rank to stop; a rank that is already gone must not stop the others hearing it."""
    for rank, payload in state.broadcast(Shutdown()):
        try:
            send_now(router, rank, payload)
        except zmq.ZMQError:
            pass


def check_local_placement(config: EngineConfig) -> None:
    """ValueError, before anything is bound or spawned, when this node's ranks cannot each
    have a GPU of their own (two on one device, more ranks than visible devices)."""
    if config.device != "cpu":
        check_placement(config.device, config.parallel.data_parallel_size_local, visible_cuda_devices())


def spawn_rank(config: EngineConfig, rank: int, generation: int | None = 0) -> mp.Process:
    """One rank process; `generation` None: a respawn, which asks which group to join."""
    proc = mp.get_context("spawn").Process(target=run_rank, args=(config, rank, generation),
                                           name=f"kvsentry-dp-rank-{rank}", daemon=True)
    proc.start()
    return proc


def local_ranks(config: EngineConfig) -> range:
    p = config.parallel
    return range(p.data_parallel_start_rank, p.data_parallel_start_rank + p.data_parallel_size_local)


def spawn_local_ranks(config: EngineConfig) -> list[mp.Process]:
    check_local_placement(config)
    return [spawn_rank(config, rank) for rank in local_ranks(config)]


def killed_process_reason(procs: list[mp.Process], config: EngineConfig) -> str | None:
    """A local rank killed by a signal: the root cause, even when a survivor reported first
    (its collective failed because of the kill)."""
    for i, proc in enumerate(procs):
        if proc.exitcode is not None and proc.exitcode < 0:
            rank = config.parallel.data_parallel_start_rank + i
            return f"DP rank {rank} (pid {proc.pid}) was killed by signal {-proc.exitcode}"
    return None


def dead_process_reason(procs: list[mp.Process], config: EngineConfig) -> str | None:
    for i, proc in enumerate(procs):
        if proc.exitcode is not None:
            rank = config.parallel.data_parallel_start_rank + i
            return f"DP rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
    return None


def stop_processes(procs: list[mp.Process], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)


class ClientResources:
    """What a client must let go however it ends: its zmq context and sockets, its rank
    processes. `release` runs once: from the client's close()/shutdown(), or, for a client
    dropped without either, from a weakref finalizer -- not __del__. pyzmq terminates a collected
    context from its own __del__, and zmq_ctx_term waits for every socket of the context to
    close; a socket in the same garbage cycle, not finalised yet, never does (a suite run hung
    so in an unrelated test's gc). The finalizer holds the context and sockets, so they cannot be
    garbage before it has closed them."""

    def __init__(self, ctx: zmq.Context, state: ClientState):
        self.ctx = ctx
        self.state = state
        self.router: zmq.Socket | None = None  # the ROUTER the ranks hear Shutdown on
        self.sockets: list[zmq.Socket] = []
        self.procs: list[mp.Process] = []
        self.store = None  # the lockstep group's rendezvous store (engine/dp/rendezvous.py), if any

    def socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        self.sockets.append(sock)
        if kind == zmq.ROUTER:
            self.router = sock
        return sock

    def release(self) -> None:
        # Ranks still running hear Shutdown (the async client's shutdown() stops its own first).
        if self.router is not None and any(proc.is_alive() for proc in self.procs):
            send_shutdown(self.router, self.state)
        stop_processes(self.procs)
        for sock in self.sockets:
            try:
                sock.close(0)
            except Exception:  # an asyncio socket whose event loop is gone: close it plainly
                zmq.Socket.close(sock, 0)
        self.ctx.term()
        self.store = None


class DPEngineClient:
    """Blocking client for the offline LLM: same surface as EngineCore (add_request/step/abort)."""

    def __init__(self, config: EngineConfig, ready_timeout: float = 300.0):
        check_local_placement(config)
        self.config = config
        self.state = ClientState(config)
        self.resources = ClientResources(zmq.Context(), self.state)
        self._release = weakref.finalize(self, self.resources.release)
        input_addr, output_addr, _ = endpoints(config)
        self.inputs = self.resources.socket(zmq.ROUTER)
        self.inputs.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.inputs.bind(input_addr)
        self.outputs = self.resources.socket(zmq.PULL)
        self.outputs.bind(output_addr)
        self.resources.store = host_store(config)
        self.procs = self.resources.procs = spawn_local_ranks(config)
        poller = zmq.Poller()
        poller.register(self.inputs, zmq.POLLIN)
        poller.register(self.outputs, zmq.POLLIN)
        deadline = time.monotonic() + ready_timeout
        while not self.state.ready:
            self._check_alive()
            if time.monotonic() > deadline:
                self.close()
                raise EngineDeadError("DP ranks did not become ready in time")
            for sock, _ in poller.poll(200):
                raw = sock.recv_multipart()[-1]
                self.state.handle(raw)

    def _send(self, messages: list[tuple[int, bytes]]) -> None:
        for rank, payload in messages:
            try:
                send_now(self.inputs, rank, payload)
            except zmq.ZMQError as exc:  # EHOSTUNREACH: the rank is gone
                self._check_alive()
                raise EngineDeadError(f"DP rank {rank} is unreachable: {exc}") from exc

    def _check_alive(self) -> None:
        reason = (killed_process_reason(self.procs, self.config) or self.state.dead_reason
                  or dead_process_reason(self.procs, self.config))
        if reason:
            self.close()
            raise EngineDeadError(reason)

    def add_request(self, request: EngineRequest, rank: int | None = None) -> None:
        self._send(self.state.route(request, rank))

    def abort(self, request_ids: list[str], index: int | None = None) -> None:
        for request_id in request_ids:
            self._send(self.state.abort(request_id, index))

    def inject_fault(self, rank: int, fault: Fault) -> None:
        self._send([(rank, self.state.encoder.encode(fault))])

    def step(self, timeout: float = 1.0) -> list[EngineCoreOutput]:
        """Outputs that arrived within `timeout` seconds (at least one message when busy)."""
        outputs: list[EngineCoreOutput] = []
        if self.outputs.poll(int(timeout * 1000)):
            while True:
                outs, replies = self.state.handle(self.outputs.recv())
                outputs += outs
                self._send(replies)
                if not self.outputs.poll(0):
                    break
        self._check_alive()
        return outputs

    @property
    def stats(self) -> dict[int, StepStats]:
        return self.state.stats

    def close(self) -> None:
        self._release()  # once: later calls, and the finalizer, do nothing


async def stop_processes_off_loop(procs) -> None:
    """Join the rank processes off the event loop; inline when the interpreter is already
    exiting (no executor threads may start then)."""
    try:
        await asyncio.to_thread(stop_processes, procs)
    except RuntimeError:
        stop_processes(procs)
