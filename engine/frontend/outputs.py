"""What the offline API returns, shaped like vLLM's RequestOutput."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.messages import TokenLogprob


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)


def logprob_dict(entry: TokenLogprob | None) -> dict[int, Logprob] | None:
    """{token id: Logprob} with the chosen token first, then the top-N."""
    if entry is None:
        return None
    result = {entry.token_id: Logprob(entry.logprob)}
    for rank, (token_id, value) in enumerate(entry.top, start=1):
        if token_id == entry.token_id:
            result[token_id].rank = rank
        else:
            result[token_id] = Logprob(value, rank)
    return result
