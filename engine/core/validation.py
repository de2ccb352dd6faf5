"""The rules a request must satisfy before a scheduler takes it, in one place.

Every rank, the offline `LLM` and the HTTP layer call these, so a request is refused
by the same rule, with the same message, wherever it enters. The bounds of each
sampling field are SamplingParams' own (engine/sampling_params.py).
"""
from __future__ import annotations

from collections.abc import Sequence

from engine.config import EngineConfig
from engine.messages import EngineRequest
from engine.sampling_params import SamplingParams


class InvalidRequest(ValueError):
    """Reads "field: why"; `code` is the machine-readable reason (the OpenAI error code)."""

    def __init__(self, field: str, why: str, code: str = "invalid_value"):
        super().__init__(f"{field}: {why}")
        self.field = field
        self.code = code


def validate_prompt(config: EngineConfig, token_ids: Sequence[int], field: str = "prompt") -> None:
    """A prompt the engine can serve: non-empty, in the vocabulary, with room for one token."""
    if not token_ids:
        raise InvalidRequest(field, "must contain at least one token")
    vocab = config.model.vocab_size
    if any(not 0 <= t < vocab for t in token_ids):
        raise InvalidRequest(field, f"token ids must be in [0, {vocab})", "invalid_token_id")
    limit = config.max_model_len
    if len(token_ids) >= limit:
        raise InvalidRequest(field, f"{len(token_ids)} tokens leave no room to generate: this model's maximum "
                                    f"context length is {limit} tokens (max_model_len)", "context_length_exceeded")


# A request's priority fits in 32 bits (vLLM sets no bound): the ranks' typed messages carry it
# as an integer, and the priority policy multiplies it by --priority-aging-steps.
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1


def validate_priority(config: EngineConfig, priority: int) -> None:
    """A priority other than 0 needs --scheduling-policy priority (vLLM refuses it under fcfs too)."""
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise InvalidRequest("priority", f"must be in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {priority}")
    if priority != 0 and config.scheduling_policy != "priority":
        raise InvalidRequest("priority", f"this server runs the {config.scheduling_policy} scheduling policy, so "
                                         f"priority must be 0 (got {priority}); priority scheduling needs "
                                         "--scheduling-policy priority")


def validate_request(config: EngineConfig, request: EngineRequest) -> None:
    validate_prompt(config, request.prompt_token_ids)
    validate_priority(config, request.priority)


def validate_api_request(config: EngineConfig, num_prompt_tokens: int, params: SamplingParams) -> None:
    """The OpenAI API's stricter rules, which the HTTP layer adds to validate_prompt: the whole
    completion must fit, and stop token ids must be tokens. (The engine itself would stop such a
    request at max_model_len with "length", and never match such an id.)"""
    limit = config.max_model_len
    total = num_prompt_tokens + params.max_tokens
    if total > limit:
        raise InvalidRequest("max_tokens", f"This model's maximum context length is {limit} tokens. However, you "
                                           f"requested {total} tokens ({num_prompt_tokens} in the prompt, "
                                           f"{params.max_tokens} in the completion). Please reduce the prompt "
                                           f"or max_tokens.", "context_length_exceeded")
    vocab = config.model.vocab_size
    if any(t >= vocab for t in params.stop_token_ids):
        raise InvalidRequest("stop_token_ids", f"must be in [0, {vocab})")
