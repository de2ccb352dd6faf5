"""asyncio client of the DP ranks, for the HTTP front end, with their supervisor.

One background task reads every rank's outputs and fans them out to per-request queues. The
event loop watches each local rank's process sentinel (an fd readable once it exits), so a
death is seen at once, without polling; a timer finds wedged (silent) ranks and kills them,
which ends the same way. What a rank's death does (engine/dp/supervision.py decides when):

- its requests that produced no output yet are re-queued on a live rank (the client sees only
  latency); those that did end at once with a RankDiedError on their queue;
- independent ranks (no collectives): the others keep serving, the dead one is respawned and
  rejoins the load balancer when it reports ready;
- a lockstep group: every rank's requests are taken as above, the survivors drop their state
  and wait, the dead rank is respawned, and once every rank is heard from, all get a Reform
  naming a new generation: a fresh rendezvous (engine/dp/rendezvous.py). Not ready meanwhile.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import weakref

import zmq
import zmq.asyncio

from engine.config import EngineConfig
from engine.dp.client import (RANK_SILENCE_SECONDS, ClientResources, ClientState, EngineDeadError, RankDiedError,
                              check_local_placement, dead_process_reason, killed_process_reason, local_ranks,
                              send_now, send_shutdown, spawn_rank, stop_processes_off_loop)
from engine.dp.rank import endpoints
from engine.dp.rendezvous import host_store
from engine.dp.supervision import WATCH_SECONDS, CrashLoop, SupervisionCounters, silent_ranks
from engine.messages import EngineRequest, Fault, GroupBroken, RankFailed, RankJoining, Reform, StepStats

logger = logging.getLogger("kvsentry.supervisor")

REFORM_RESEND_SECONDS = 5.0


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, *, headless: bool = False,
                 wedge_timeout: float = RANK_SILENCE_SECONDS):
        check_local_placement(config)  # a bad placement fails here, before the server starts
        self.config = config
        self.state = ClientState(config)
        self.queues: dict[str, asyncio.Queue] = {}
        self.procs = []
        self.local: dict[int, object] = {}  # local rank -> its current process
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        self._started = False
        # Called with every StepStats as it arrives (e.g. to feed histograms that must see
        # each observation, like the sentinel's scan durations).
        self.stats_listeners: list = []
        self.wedge_timeout = wedge_timeout
        self.supervision = SupervisionCounters(ranks=tuple(local_ranks(config)))
        self.crash_loop = CrashLoop.for_config(config)
        self.pending: list[EngineRequest] = []  # re-queued, waiting for a rank that takes them
        self.death_reasons: dict[int, str] = {}  # local rank -> why it is being replaced
        self.generation = 0                      # of the lockstep group
        self.reforming = False
        self.reform_sent = False
        self.reform_sent_at = 0.0
        self.broken_at = 0.0
        self.joining: set[int] = set()
        self.spawned_at: dict[int, float] = {}  # local rank -> when its current process started

    # -- what the service reads ------------------------------------------------------------
    @property
    def ready(self) -> bool:
        if self.dead_reason is not None:
            return False
        if not self._started or self.state.lockstep:
            return self.state.ready and not self.reforming
        return bool(self.state.ready_ranks)

    @property
    def unready_reason(self) -> str:
        if self.reforming:
            return f"re-forming the DP group (generation {self.generation})"
        return "respawning DP ranks" if self._started else "loading"

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
        self.inputs.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a respawned rank takes over its identity
        self.inputs.bind(input_addr)
        self.outputs = self.resources.socket(zmq.PULL)
        self.outputs.bind(output_addr)
        self.resources.store = host_store(self.config)
        check_local_placement(self.config)
        for rank in local_ranks(self.config):
            self._launch(rank, generation=0)
        self._tasks = [asyncio.create_task(self._read(self.outputs)),
                       asyncio.create_task(self._read(self.inputs)),
                       asyncio.create_task(self._watch())]
        deadline = time.monotonic() + ready_timeout
        while not self.state.ready:
            reason = self.dead_reason or killed_process_reason(self.procs, self.config) \
                or dead_process_reason(self.procs, self.config)
            if reason:
                self.state.dead_reason = self.state.dead_reason or reason
                raise EngineDeadError(reason)
            if time.monotonic() > deadline:
                raise EngineDeadError("DP ranks did not become ready in time")
            await asyncio.sleep(0.05)
        self._started = True
        self.state.supervised = True
        self.supervision.live_ranks = len(self.state.ready_ranks)

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for proc in self.local.values():
            self._unwatch(proc)
        # start() may have failed part way (a port in use): close what it got to.
        if self.procs and hasattr(self, "inputs"):
            send_shutdown(self.inputs, self.state)
        for task in self._tasks:
            task.cancel()
        await stop_processes_off_loop(self.procs)  # off the event loop; release() then finds them stopped
        if hasattr(self, "_release"):
            self._release()

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> asyncio.Queue:
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request.request_id] = queue
        if self.ready:
            self._submit(request)
        else:  # between a death and the respawn: it waits with the re-queued ones
            self.pending.append(request)
        return queue

    async def abort(self, request_id: str, index: int | None = None) -> None:
        if self.dead_reason:
            return
        if index is None and any(r.request_id == request_id for r in self.pending):
            self.pending = [r for r in self.pending if r.request_id != request_id]
            self.queues.pop(request_id, None)
            return
        await self._send(self.state.abort(request_id, index))

    async def inject_fault(self, rank: int, fault: Fault) -> None:
        if not 0 <= rank < self.state.size:
            raise ValueError(f"rank: must be in [0, {self.state.size})")
        await self._send([(rank, self.state.encoder.encode(fault))])

    # -- internals -----------------------------------------------------------------------------
    def _submit(self, request: EngineRequest) -> None:
        for rank, payload in self.state.route(request):
            self._send_now(rank, payload)

    def _send_now(self, rank: int, payload: bytes) -> None:
        try:
            send_now(self.inputs, rank, payload)
        except zmq.ZMQError as exc:  # the rank is gone: its death, seen by the supervisor, settles its requests
            logger.info("DP rank %d is unreachable: %s", rank, exc)

    async def _send(self, messages: list[tuple[int, bytes]]) -> None:
        for rank, payload in messages:
            self._send_now(rank, payload)

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            ready_before = len(self.state.ready_ranks)
            outputs, replies = self.state.handle(frames[-1])
            if self.state.last_stats is not None:
                for listener in self.stats_listeners:
                    listener(self.state.last_stats)
            for out in outputs:
                queue = self.queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            for out in outputs:
                if out.finish_reason is not None and out.request_id not in self.state.tracked:
                    self.queues.pop(out.request_id, None)
            if replies and not self.reforming:
                await self._send(replies)
            self._lifecycle()
            if len(self.state.ready_ranks) != ready_before:
                self._ranks_changed()
            if self.dead_reason:
                self._die(killed_process_reason(self.procs, self.config) or self.dead_reason)

    def _lifecycle(self) -> None:
        """Act on what the ranks said about themselves (RankJoining, GroupBroken, RankFailed)."""
        events, self.state.lifecycle = self.state.lifecycle, []
        if not self._started:
            return
        for event in events:
            if isinstance(event, RankFailed) and event.rank not in self.local:
                self._rank_lost(event.rank, f"DP rank {event.rank} failed: {event.reason}")
            elif isinstance(event, RankJoining):
                self.joining.add(event.rank)
                if not self.reforming:  # a remote rank respawned by its own node
                    self._break_group(f"DP rank {event.rank} rejoined")
            elif isinstance(event, GroupBroken) and not self.reforming:
                self._break_group(f"DP rank {event.rank} lost its group: {event.reason}")
        self._maybe_reform()

    def _ranks_changed(self) -> None:
        state = self.state
        self.supervision.live_ranks = len(state.ready_ranks)
        if self.reforming and self.reform_sent and state.ready:
            self.reforming = self.reform_sent = False
            state.wave, state.generation = 0, self.generation
            state.last_progress = time.monotonic()
            logger.warning("DP group re-formed (generation %d)", self.generation)
        if self.ready and self.pending:
            pending, self.pending = self.pending, []
            for request in pending:
                if request.request_id in self.queues:
                    self._submit(request)

    # -- supervision ---------------------------------------------------------------------------
    def _launch(self, rank: int, generation: int | None) -> None:
        proc = spawn_rank(self.config, rank, generation)
        self.local[rank] = proc
        self.spawned_at[rank] = time.monotonic()
        self.procs = self.resources.procs = list(self.local.values())
        asyncio.get_running_loop().add_reader(proc.sentinel, self._exited, rank, proc)

    def _unwatch(self, proc) -> None:
        try:
            asyncio.get_running_loop().remove_reader(proc.sentinel)
        except (RuntimeError, ValueError, OSError):
            pass

    def _exited(self, rank: int, proc) -> None:
        self._unwatch(proc)
        proc.join(1.0)  # the sentinel can close a moment before the exit status is there to reap
        if self._closed or not self._started or self.local.get(rank) is not proc:
            return  # start-up failures are start()'s; a replaced process was already settled
        code = proc.exitcode
        reason = self.death_reasons.pop(rank, None) or ("killed" if code is not None and code < 0 else "exited")
        detail = f"DP rank {rank} (pid {proc.pid}) " + \
            (f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}")
        logger.warning("%s; supervising (%s)", detail, reason)
        delay = self.crash_loop.record(rank, time.monotonic())
        self._rank_lost(rank, detail)
        if self.dead_reason:
            return
        if delay is None:
            self.state.dead_reason = f"{self.crash_loop.verdict()}; last: {detail}"
            self._die(self.state.dead_reason)
            return
        asyncio.get_running_loop().call_later(delay, self._respawn, rank, reason)

    def _respawn(self, rank: int, reason: str) -> None:
        if self._closed or self.dead_reason:
            return
        self.supervision.restarts[(rank, reason)] += 1
        self._launch(rank, generation=None)

    def _rank_lost(self, rank: int, detail: str) -> None:
        """Settle the requests of a rank that is gone (or, in lockstep, of its whole group)."""
        self.state.rank_down(rank)
        self.supervision.live_ranks = len(self.state.ready_ranks)
        if self.state.lockstep:
            self._break_group(detail)
            self.joining.discard(rank)
        else:
            self._settle(self.state.take_requests({rank}), detail)
        self.state.last_progress = time.monotonic()

    def _break_group(self, detail: str) -> None:
        """Lockstep: the group is gone; take every request, wait for all ranks, then re-form."""
        state = self.state
        self.generation += 1
        self.reform_sent = False
        if not self.reforming:
            self.reforming = True
            self.broken_at = time.monotonic()
            logger.warning("DP group broken (%s): re-forming as generation %d", detail, self.generation)
        state.ready_ranks.clear()
        self.supervision.live_ranks = 0
        self._settle(state.take_requests(set(range(state.size))), detail)

    def _settle(self, taken: tuple[list[EngineRequest], list[str]], detail: str) -> None:
        unstarted, started = taken
        self.pending = sorted(self.pending + unstarted, key=lambda request: request.arrival_time)
        self.supervision.requeued += len(unstarted)
        for request_id in started:
            queue = self.queues.pop(request_id, None)
            if queue is not None:
                self.supervision.failed_by_rank_death += 1
                queue.put_nowait(RankDiedError(f"{detail} while serving this request"))
        self._ranks_changed()

    def _maybe_reform(self) -> None:
        """Send the Reform once every rank is heard from: survivors heartbeat (or said GroupBroken)
        since the break, respawned ranks said RankJoining."""
        state = self.state
        if not self.reforming or self.reform_sent:
            return
        heard = [r in self.joining or (r in state.incarnations and state.last_seen[r] > self.broken_at)
                 for r in range(state.size)]
        if all(heard):
            self.reform_sent = True
            self.joining.clear()
            logger.warning("DP group: every rank is back; re-forming as generation %d", self.generation)
            self._send_reform()

    def _send_reform(self) -> None:
        """To every rank not in the new group yet; repeated while the group forms (a rank that
        already joined ignores a repeat), so one message lost to a reconnecting socket cannot stall it."""
        self.reform_sent_at = time.monotonic()
        payload = self.state.encoder.encode(Reform(self.generation))
        for rank in range(self.state.size):
            if rank not in self.state.ready_ranks:
                self._send_now(rank, payload)

    async def _watch(self) -> None:
        """The wedge detector: a ready rank silent for wedge_timeout is killed (remote: dropped),
        and replaced like any dead rank. In a lockstep group, whose members all fall silent
        when one stops (they wait on it in a collective), only the longest-silent one."""
        woke, late = time.monotonic(), False
        while True:
            await asyncio.sleep(WATCH_SECONDS)
            # A late round judges nobody; never two in a row (a saturated loop still finds wedges).
            late = not late and time.monotonic() - woke > 2 * WATCH_SECONDS
            woke = time.monotonic()
            if not self._started or self._closed or self.dead_reason:
                continue
            self._maybe_reform()
            now = time.monotonic()
            if self.reforming and self.reform_sent and now - self.reform_sent_at > REFORM_RESEND_SECONDS:
                self._send_reform()
            if not late and self._silent_ranks(now):
                await asyncio.sleep(WATCH_SECONDS / 5)  # the readers go first
                if self._closed or self.dead_reason:
                    continue
                now = time.monotonic()
                silent = self._silent_ranks(now)
                for _, rank in silent[:1] if self.state.lockstep else silent:
                    self._wedged(rank, now - self.state.last_seen[rank])
            if self.reforming and not self.reform_sent and now - self.broken_at > self.wedge_timeout:
                # A survivor unheard since the break is the hung one (the longest-silent pick
                # above can hit a peer that was only waiting on it).
                for rank, proc in list(self.local.items()):
                    if (proc.is_alive() and self.spawned_at[rank] < self.broken_at and rank not in self.joining
                            and self.state.last_seen[rank] <= self.broken_at and rank not in self.death_reasons):
                        self._wedged(rank, now - self.state.last_seen[rank])

    def _silent_ranks(self, now: float) -> list[tuple[float, int]]:
        return silent_ranks(self.state.last_seen, self.state.ready_ranks, now, self.wedge_timeout)

    def _wedged(self, rank: int, silent_for: float) -> None:
        logger.warning("DP rank %d sent nothing for %.0f s: wedged", rank, silent_for)
        proc = self.local.get(rank)
        if proc is not None and proc.is_alive():
            self.death_reasons[rank] = "wedged"
            self.state.ready_ranks.discard(rank)
            os.kill(proc.pid, signal.SIGKILL)  # its sentinel does the rest
        else:
            self._rank_lost(rank, f"DP rank {rank} (on another node) sent nothing for too long")

    def _die(self, reason: str) -> None:
        killed = killed_process_reason(self.procs, self.config) if not self._started else None
        if self.state.dead_reason is None or killed:
            self.state.dead_reason = killed or reason
        error = EngineDeadError(self.state.dead_reason)
        for queue in self.queues.values():
            queue.put_nowait(error)
        self.queues.clear()
        self.pending.clear()

