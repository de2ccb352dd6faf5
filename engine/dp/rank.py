"""One DP rank's process: its EngineCore, its sockets, and the lockstep wave loop.

MoE models with DP > 1 step in lockstep, because every MoE layer runs
collectives over the whole DP group: while any rank has work ("a wave"), every
rank steps, and ranks without requests run a dummy batch padded to the same
token count. Each step all ranks all-reduce (max) their token count, whether
they have work, and whether they must run the step eagerly (not a pure decode
or dummy batch, or no decode CUDA graphs): a step replays graphs on every rank
or on none, since the experts' collectives differ between the two paths
(engine/worker/cuda_graphs.py). When nobody has work the wave ends on every
rank at once and the ranks block on their input socket (no busy loop) until a
request or a Wake for the next wave arrives.

Stats (StepStats) go to the front end when the rank's integrity findings change, at most
every STATS_SECONDS while it is busy, and when it goes idle or a wave ends -- not with every
step: they carry per-layer counts, and reading the device counters behind them is a host sync
on CUDA. A scrape sees counters at most STATS_SECONDS old while a rank is busy, exact once
it is idle.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import signal
import sys
import time
import traceback

import msgspec
import torch
import torch.distributed as dist
import zmq

from engine.config import EngineConfig
from engine.dp.reform import rejoin, reset_core
from engine.dp.rendezvous import join_group, leave_group
from engine.engine_core.engine_core import EngineCore
from engine.placement import rank_device, visible_cuda_devices
from engine.messages import (Abort, EngineInput, EngineOutputs, EngineRequest, Fault, GroupBroken, RANK_FAULTS,
                             RankFailed, RankJoining, RankReady, Reform, Shutdown, Wake)

HEARTBEAT_SECONDS = 1.0
STATS_SECONDS = 0.5  # the longest a busy rank's stats go unreported


def new_incarnation() -> int:
    """Tags this process's outputs until its group re-forms (engine/dp/client.py drops older ones)."""
    return int.from_bytes(os.urandom(6), "little")
PREPARING_POLL_SECONDS = 0.01  # how often a rank with only grammars compiling looks for them ready


def endpoints(config: EngineConfig) -> tuple[str, str, str]:
    """(input ROUTER, output PULL, torch.distributed rendezvous) addresses of the group."""
    p = config.parallel
    host = p.data_parallel_address
    return (f"tcp://{host}:{p.data_parallel_rpc_port}", f"tcp://{host}:{p.data_parallel_rpc_port + 1}",
            f"tcp://{host}:{p.data_parallel_rpc_port + 2}")  # the last: the group's store (engine/dp/rendezvous.py)


def rank_identity(rank: int) -> bytes:
    return f"rank-{rank}".encode()


class RankLoop:
    def __init__(self, core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket, lockstep: bool,
                 incarnation: int = 0, generation: int = 0):
        self.core = core
        self.incarnation = incarnation
        self.generation = generation  # of the lockstep group it steps with
        self.broken = False  # lockstep: a collective failed; no step until a Reform
        self.rank = core.rank
        self.inputs, self.outputs = inputs, outputs
        self.lockstep = lockstep
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineInput)
        self.wave = 0            # waves completed so far; the same number on every rank
        self.in_wave = False
        self.stale_request = False
        self.running = True
        self.parent = os.getppid()
        self.armed: tuple[str, int] | None = None  # a rank fault's kind and the own steps it waits for
        self._reported_at = 0.0     # time.monotonic() of the last stats sent
        self._reported_findings = 0  # the integrity unit's findings as last sent

    def send(self, **fields) -> None:
        msg = EngineOutputs(rank=self.rank, outputs=fields.pop("outputs", []), incarnation=self.incarnation, **fields)
        if not msg.outputs and msg.stats is None and msg.wave_complete is None and msg.start_wave is None:
            return  # a step that produced nothing to tell (a dummy batch between reports)
        self.outputs.send(self.encoder.encode(msg), copy=False)

    def stats_due(self, now: bool = False):
        """The rank's stats when a report is due (findings moved, the timer ran out, or `now`),
        else None."""
        at, findings = time.monotonic(), self.core.integrity.findings
        if now or findings != self._reported_findings or at - self._reported_at >= STATS_SECONDS:
            self._reported_at, self._reported_findings = at, findings
            return self.core.stats()
        return None

    def run(self) -> None:
        while self.running:
            busy = not self.broken and (self.in_wave or self.core.has_unfinished)
            # Nothing to step but grammars compiling (on their threads): wait a little, not spin.
            wait = PREPARING_POLL_SECONDS if busy and not self.in_wave and self.core.only_preparing else 0
            if self.inputs.poll(int(1000 * (wait if busy else HEARTBEAT_SECONDS))):
                self.drain()
            elif not busy:
                self.heartbeat()
                continue
            if not self.running:
                break
            if self.lockstep:
                if not self.broken:
                    self.guarded_lockstep_step()
            elif self.core.has_unfinished:
                outputs = self.core.step()
                self.send(outputs=outputs, stats=self.stats_due(now=not self.core.has_unfinished))
                self.count_down()

    def count_down(self) -> None:
        """One step of the rank's own work ran: an armed rank fault acts once its count is spent."""
        if self.armed is not None:
            kind, left = self.armed
            if left <= 1:
                act_out(kind, self.parent)
            self.armed = (kind, left - 1)

    def heartbeat(self) -> None:
        if os.getppid() != self.parent:  # our launcher died: do not linger as an orphan
            self.running = False
            return
        # An idle rank still watches its cache: poison that arrives while nothing runs
        # (a stray write, an injected fault) is found within one heartbeat.
        self.core.idle_scan()
        self.send(outputs=self.core.take_pending(), stats=self.stats_due(now=True))

    def drain(self) -> None:
        while self.running and self.inputs.poll(0):
            msg = self.decoder.decode(self.inputs.recv())
            if isinstance(msg, EngineRequest):
                try:
                    self.core.add_request(msg)
                except ValueError as exc:
                    self.send(outputs=self.core.refused(msg, exc))
                    continue
                if not self.in_wave and msg.wave < self.wave:
                    self.stale_request = True
            elif isinstance(msg, Abort):
                self.core.abort(msg.request_ids, msg.index)
                self.send(outputs=self.core.take_pending(), stats=self.stats_due(now=not self.core.has_unfinished))
            elif isinstance(msg, Wake):
                if self.lockstep and not self.in_wave and msg.wave >= self.wave and msg.generation == self.generation:
                    self.in_wave = True
            elif isinstance(msg, Reform) and msg.generation != self.generation:  # else a repeat: already in it
                self.reform(msg.generation)
            elif isinstance(msg, Fault) and msg.kind in RANK_FAULTS:
                if msg.after_steps <= 0:
                    act_out(msg.kind, self.parent)  # never returns
                self.armed = (msg.kind, msg.after_steps)
            elif isinstance(msg, Fault):
                try:
                    self.core.inject_fault(msg)
                except ValueError as exc:  # a bad fault must not take the rank down
                    print(f"rank {self.rank}: fault ignored: {exc}", file=sys.stderr, flush=True)
            elif isinstance(msg, Shutdown):
                self.running = False

    def guarded_lockstep_step(self) -> None:
        try:
            self.lockstep_step()
        except RuntimeError as exc:  # a peer died under a collective (gloo/NCCL report it so)
            if not self.running:
                raise
            self.break_group(f"{type(exc).__name__}: {exc}")

    def break_group(self, reason: str) -> None:
        """Drop every request and wait, heartbeating, for the front end's Reform."""
        reset_core(self.core)
        self.broken, self.in_wave, self.stale_request, self.wave = True, False, False, 0
        self.outputs.send(self.encoder.encode(GroupBroken(self.rank, self.incarnation, reason[:500])))

    def reform(self, generation: int) -> None:
        """Join group `generation` (engine/dp/reform.py), then report ready under a new incarnation."""
        reset_core(self.core)
        rejoin(self.core, self.core.config, self.rank, generation)
        self.generation = generation
        self.broken, self.in_wave, self.stale_request, self.wave = False, False, False, 0
        self.incarnation = new_incarnation()
        self.inputs.send(self.encoder.encode(ready_message(self.core, self.incarnation)))

    def lockstep_step(self) -> None:
        core = self.core
        if not self.in_wave and core.has_unfinished:
            self.in_wave = True
            if self.stale_request:
                # The front end woke the others for a wave that had already ended;
                # ask it to wake everyone for the current one.
                self.send(start_wave=self.wave)
        self.stale_request = False
        if not self.in_wave:
            return
        sched = core.schedule()
        graphs = core.runner.graphs
        eager = graphs is None or not graphs.could_run_scheduled(sched.num_reqs, sched.num_tokens)
        # On the rank's device: NCCL reduces only device tensors (gloo on CPU: a CPU tensor).
        flags = torch.tensor([sched.num_tokens, int(core.has_unfinished), int(eager)], dtype=torch.int64,
                             device=core.config.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        max_tokens, anyone_busy, anyone_eager = flags.tolist()  # the step's one read-back
        if graphs is not None:
            graphs.group_eager = bool(anyone_eager)
        if not anyone_busy and max_tokens == 0:
            self.in_wave = False
            self.wave += 1
            self.send(stats=self.stats_due(now=True), wave_complete=self.wave - 1 if self.rank == 0 else None)
            return
        num_padded = core.config.padded_num_tokens(max(max_tokens, 1))
        outputs = core.step(sched, num_padded)
        self.send(outputs=outputs, stats=self.stats_due())
        if sched.num_tokens:  # a dummy batch is not the rank's own work
            self.count_down()


def _shutdown_pending(inputs: zmq.Socket) -> bool:
    decoder = msgspec.msgpack.Decoder(EngineInput)
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        if inputs.poll(50):
            try:
                if isinstance(decoder.decode(inputs.recv()), Shutdown):
                    return True
            except (zmq.ZMQError, msgspec.DecodeError):
                return False
    return False


def default_threads(config: EngineConfig) -> int:
    """Cores per local rank, keeping one core for the front end (tokenizing, streaming) when
    there are cores to spare: on a 2-core box two ranks then get one thread each."""
    cores, local = os.cpu_count() or 1, max(1, config.parallel.data_parallel_size_local)
    return max(1, (cores - 1) // local if cores > local else 1)


def place_rank(config: EngineConfig, rank: int) -> EngineConfig:
    """`config` as DP rank `rank` sees it, on its own device (engine/placement.py)."""
    p = config.parallel
    device = rank_device(config.device, rank - p.data_parallel_start_rank, p.data_parallel_size_local,
                         visible_cuda_devices() if config.device != "cpu" else 0)
    return dataclasses.replace(config.for_rank(rank), device=device)


def act_out(kind: str, launcher: int) -> None:
    """kill_rank: SIGKILL to this process (no clean-up, as the OOM killer would). hang_rank: stop
    stepping and reporting for good, as a wedged device would; the front end's wedge detection
    must find it. A hung rank still leaves when its launcher does, so it cannot be orphaned."""
    if kind == "kill_rank":
        os.kill(os.getpid(), signal.SIGKILL)
    while os.getppid() == launcher:
        time.sleep(HEARTBEAT_SECONDS)
    os._exit(1)


def ready_message(core: EngineCore, incarnation: int) -> RankReady:
    return RankReady(core.rank, core.config.num_blocks, os.getpid(), core.runner.implementations(), incarnation)


def wait_for_reform(inputs: zmq.Socket) -> int:
    """A respawned lockstep rank's first message: the generation of the group it joins."""
    decoder = msgspec.msgpack.Decoder(EngineInput)
    parent = os.getppid()
    while True:
        if inputs.poll(int(HEARTBEAT_SECONDS * 1000)):
            msg = decoder.decode(inputs.recv())
            if isinstance(msg, Reform):
                return msg.generation
            if isinstance(msg, Shutdown):
                raise SystemExit(0)
        elif os.getppid() != parent:
            raise SystemExit(0)


def run_rank(config: EngineConfig, rank: int, generation: int | None = 0) -> None:
    """Entry point of a rank process. `generation`: the lockstep group it joins at once (start-up);
    None for a respawned rank, which asks the front end (RankJoining) and waits for a Reform."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when ranks stop
    config = config.for_rank(rank)
    torch.set_num_threads(config.num_threads or default_threads(config))
    ctx = zmq.Context()
    input_addr, output_addr, _ = endpoints(config)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 2000)
    outputs.connect(output_addr)
    inputs = None
    incarnation = new_incarnation()
    try:
        config = place_rank(config, rank)  # refused here too, reported as RankFailed
        if config.device != "cpu":
            torch.cuda.set_device(config.device)  # kernels, NCCL and current_device() follow it
        inputs = ctx.socket(zmq.DEALER)
        inputs.setsockopt(zmq.IDENTITY, rank_identity(rank))
        inputs.setsockopt(zmq.LINGER, 0)
        inputs.connect(input_addr)
        if config.lockstep:
            if generation is None:
                inputs.send(msgspec.msgpack.encode(RankJoining(rank, incarnation)))
                generation = wait_for_reform(inputs)
            join_group(config, rank, generation)
        core = EngineCore(config)
        # Everything built so far (model, torch and library objects) lives as long as the
        # process: freeze it, so the collector stops re-walking it in every full
        # collection (seen at ~5% of a busy rank's time), as vLLM does.
        gc.collect()
        gc.freeze()
        # Sent on the DEALER so that, once the front end sees it, its ROUTER can route to us.
        inputs.send(msgspec.msgpack.encode(ready_message(core, incarnation)))
        RankLoop(core, inputs, outputs, lockstep=config.lockstep, incarnation=incarnation,
                 generation=generation or 0).run()
    except SystemExit:
        os._exit(0)
    except BaseException as exc:  # report why, then die: the group must not hang on us
        if inputs is not None and _shutdown_pending(inputs):
            os._exit(0)  # a peer left first because the front end is stopping us all
        reason = f"{type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
        try:
            outputs.send(msgspec.msgpack.encode(RankFailed(rank, reason)))
            time.sleep(0.2)
        finally:
            os._exit(1)
    finally:
        leave_group()
