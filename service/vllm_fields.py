"""vLLM's additions to the OpenAI responses, which clients written for vLLM read: the token ids
(the request's return_token_ids) and the prompt's logprobs (prompt_logprobs). The response
models of service/protocol.py take them as bases."""
from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel

from engine.messages import TokenLogprob


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one entry of a prompt position's {token id: ...} map."""
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# Per prompt token, None for the first (nothing predicts it): {token id: PromptLogprob} holding the
# prompt's own token and the top-N. JSON writes the token ids as strings, as vLLM's do.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class ChoiceTokenIds(BaseModel):
    token_ids: list[int] | None = None  # return_token_ids: the choice's tokens (streamed: each chunk's new ones)


class PromptTokenIds(BaseModel):
    prompt_token_ids: list[int] | None = None  # return_token_ids (streamed: on the first chunk)


class PromptDetails(PromptTokenIds):
    prompt_logprobs: PromptLogprobs | None = None


def prompt_logprob_maps(token_text: Callable[[int], str], entries: list[TokenLogprob | None],
                        token_ids: list[int], num_top: int) -> PromptLogprobs:
    """vLLM's prompt_logprobs from the engine's entries: per prompt token {token id: logprob, rank,
    decoded token (`token_text`)} with the prompt's own token and the top `num_top`."""
    entries = list(entries[:len(token_ids)]) + [None] * (len(token_ids) - len(entries))
    out: PromptLogprobs = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        position = {entry.token_id: PromptLogprob(logprob=entry.logprob, rank=entry.rank,
                                                  decoded_token=token_text(entry.token_id))}
        for rank, (token_id, value) in enumerate(entry.top[:num_top], start=1):
            position.setdefault(token_id, PromptLogprob(logprob=value, rank=rank,
                                                        decoded_token=token_text(token_id)))
        out.append(position)
    return out
