"""Per-request sampling parameters, validated once and immutable afterwards.

A msgspec Struct so the same object crosses the front-end -> rank IPC boundary
without a hand-written codec.
"""
from __future__ import annotations

import msgspec

MAX_LOGPROBS = 20


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

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> None:
            raise ValueError(f"{field}: {why}")

        if self.n < 1:
            bad("n", f"must be >= 1, got {self.n}")
        if not self.temperature >= 0.0:
            bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad("top_k", f"must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            bad("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                bad(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        if any(not s for s in self.stop):
            bad("stop", "stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "token ids must be >= 0")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            bad("seed", "must fit in 64 bits")

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
