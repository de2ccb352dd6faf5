"""Per-request sampling parameters, validated once and immutable afterwards.

A msgspec Struct so the same object crosses the front-end -> rank IPC boundary
without a hand-written codec. `LIMITS` holds every bound a field must respect: the
struct checks them here, and the HTTP layer's request models take the same bounds
(service/protocol.py), so the two can never disagree.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgspec

from engine.structured.spec import StructuredOutputs

MAX_LOGPROBS = 20  # top logprobs per token, as the OpenAI API allows
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY]
MAX_REPETITION_PENALTY = 10.0
# Every new piece of text is searched for every stop string, on the front end's event loop:
# more than this many would make each token of the request cost as much as thousands.
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 1024


@dataclass(frozen=True)
class Bounds:
    """An interval, spelled the way pydantic's Field(ge=, gt=, le=, lt=) takes it."""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def contains(self, value: float) -> bool:
        # Written so that NaN is outside every interval.
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def as_field(self) -> dict[str, float]:
        return {name: value for name, value in vars(self).items() if value is not None}

    def __str__(self) -> str:
        low = f"[{_number(self.ge)}" if self.ge is not None else (
            f"({_number(self.gt)}" if self.gt is not None else None)
        high = f"{_number(self.le)}]" if self.le is not None else (
            f"{_number(self.lt)})" if self.lt is not None else None)
        if low and high:
            return f"in {low}, {high}"
        return f">= {_number(self.ge)}" if self.ge is not None else f"> {_number(self.gt)}"


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


LIMITS: dict[str, Bounds] = {
    # Integers cross to the ranks as msgpack (at most 64 bits): each has an upper bound too, so an
    # absurd value is the client's 400, never a message the engine cannot send.
    "n": Bounds(ge=1, lt=2**31),
    "temperature": Bounds(ge=0.0),
    "top_p": Bounds(gt=0.0, le=1.0),
    "top_k": Bounds(ge=-1, lt=2**31),  # -1 and 0 disable it
    "min_p": Bounds(ge=0.0, le=1.0),
    "max_tokens": Bounds(ge=1),  # checked against the context window before it is sent
    "min_tokens": Bounds(ge=0, lt=2**31),
    "logprobs": Bounds(ge=0, le=MAX_LOGPROBS),
    "prompt_logprobs": Bounds(ge=0, le=MAX_LOGPROBS),
    "presence_penalty": Bounds(ge=-MAX_PENALTY, le=MAX_PENALTY),
    "frequency_penalty": Bounds(ge=-MAX_PENALTY, le=MAX_PENALTY),
    "repetition_penalty": Bounds(gt=0.0, le=MAX_REPETITION_PENALTY),
    "seed": Bounds(ge=-(2**63), lt=2**63),  # 64 bits
}


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token
    prompt_logprobs: int | None = None  # number of top logprobs per prompt token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None  # the grammar the output must match

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> None:
            raise ValueError(f"{field}: {why}")

        for name, bounds in LIMITS.items():
            value = getattr(self, name)
            if value is not None and not bounds.contains(value):
                bad(name, f"must be {bounds}, got {value}")
        if self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(self.stop_token_ids)}")
        if any(not s for s in self.stop):
            bad("stop", "stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "token ids must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def num_logprobs(self) -> int:
        return self.logprobs if self.logprobs is not None else -1
