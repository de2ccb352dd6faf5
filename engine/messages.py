"""Typed messages that cross process boundaries (front end <-> DP ranks).

msgspec Structs: encoded with msgpack on the wire, validated on decode.
"""
from __future__ import annotations

import msgspec

from engine.integrity.stats import IntegrityStats
from engine.sampling_params import SamplingParams
from engine.spec_decode.stats import SpecDecodeStats


class EngineRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    wave: int = 0
    priority: int = 0  # lower runs first; anything but 0 needs --scheduling-policy priority


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-N (token id, logprob), best first
    rank: int | None = None  # the token's place in the vocabulary by logprob, 1 = the best


class RequestTiming(msgspec.Struct, array_like=True):
    """A sample's times on the rank that served it, sent with its finishing output (traces read
    them). Seconds since the sample reached the rank, on that rank's monotonic clock; None when
    the sample never got that far (aborted while waiting)."""
    rank: int
    scheduled: float | None = None    # first scheduled: the time it queued
    first_token: float | None = None  # its first token sampled
    last_token: float | None = None   # its last token sampled


class Refusal(msgspec.Struct, array_like=True):
    """Why a rank refused a request before its first token: the front end answers 400 with it.
    `param`: the field at fault as the engine names it ("structured_outputs.json", "prompt")."""
    param: str | None
    message: str                 # "param: why", like every request refusal
    code: str = "invalid_value"  # the OpenAI error code


class EngineCoreOutput(msgspec.Struct, array_like=True):
    request_id: str           # the id the client used (n > 1 children share it)
    index: int                # which of the n samples
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first prompt token has none
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    queue_seconds: float | None = None  # on a sample's first output: rank arrival -> first scheduled
    timing: RequestTiming | None = None  # on a sample's finishing output
    refusal: Refusal | None = None  # with finish_reason "error": the request was refused, never ran


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]
    index: int | None = None  # one sample of an n > 1 request (a stop string ended it)


class Wake(msgspec.Struct, tag=True):
    """Starts wave `wave` on an idle rank (ignored when that wave already ended, or when it was
    sent to an earlier generation of the group: wave numbers start again at each re-forming)."""
    wave: int
    generation: int = 0


class Shutdown(msgspec.Struct, tag=True):
    pass


class Fault(msgspec.Struct, tag=True):
    """Operator fault injection (only honoured with --enable-fault-injection)."""
    kind: str  # "nan" | "inf" | "legacy_dummy" | "bitflip" | "stale_slot_dummy" | "kill_rank" | "hang_rank"
    layer: int = 0
    block: int = 0  # bitflip: -1 = a sealed block of the rank's choosing (the latest sealed)
    target: str = "k"  # k | v | latent
    after_steps: int = 0  # RANK_FAULTS: once the rank has run this many steps of its own work


RANK_FAULTS = ("kill_rank", "hang_rank")  # faults the rank's loop acts out itself, not its engine


class Reform(msgspec.Struct, tag=True):
    """Join lockstep group `generation` (a fresh rendezvous: engine/dp/rendezvous.py), leaving the
    old one with every request and the KV cache dropped (engine/dp/reform.py)."""
    generation: int


EngineInput = EngineRequest | Abort | Wake | Shutdown | Fault | Reform


class StepStats(msgspec.Struct, array_like=True):
    """Per-rank counters and gauges. A rank sends them when its integrity findings change, on a
    timer while busy, and when it goes idle (engine/dp/rank.py), never once per step."""
    rank: int
    steps: int
    dummy_batches: int
    padded_tokens: int
    num_running: int
    num_waiting: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    integrity: IntegrityStats = msgspec.field(default_factory=IntegrityStats)  # engine/integrity/
    spec_decode: SpecDecodeStats = msgspec.field(default_factory=SpecDecodeStats)  # engine/spec_decode/
    num_preparing: int = 0  # of num_waiting: requests whose grammar is still compiling


class RankReady(msgspec.Struct, tag=True):
    rank: int
    num_blocks: int
    pid: int
    op_implementations: dict[str, str] = {}  # op -> kernel or torch reference (engine/ops/implementations.py)
    incarnation: int = 0  # new for every process and every re-formed group: older outputs are stale


class RankFailed(msgspec.Struct, tag=True):
    rank: int
    reason: str


class EngineOutputs(msgspec.Struct, tag=True):
    rank: int
    outputs: list[EngineCoreOutput]
    stats: StepStats | None = None
    wave_complete: int | None = None   # set by rank 0 when a wave ends
    start_wave: int | None = None      # a rank got a request for an ended wave
    incarnation: int = 0               # the sender's, as in its RankReady


class RankJoining(msgspec.Struct, tag=True):
    """A respawned lockstep rank, weights not loaded yet, waits for a Reform naming its group."""
    rank: int
    incarnation: int


class GroupBroken(msgspec.Struct, tag=True):
    """A lockstep rank's collective failed (a peer died): it dropped its requests and waits for a Reform."""
    rank: int
    incarnation: int
    reason: str


EngineMessage = EngineOutputs | RankReady | RankFailed | RankJoining | GroupBroken
