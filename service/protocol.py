"""The OpenAI / vLLM wire format: request and response models (pydantic 2).

Requests are strict (no "5" for 5, no "yes" for true, no NaN) and ignore
unknown fields, as the OpenAI API does. A sampling field takes its default and
its bounds from `engine.SamplingParams` (`engine_field`), and reaches it under its
own name (`ENGINE_SAMPLING_FIELDS`), so the two layers cannot disagree.
"""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.sampling_params import LIMITS, Bounds, SamplingParams

MAX_CHOICES = 128  # n x prompts per request: more is a denial of service, not a use case
_ENGINE_DEFAULTS = SamplingParams()


def engine_field(name: str, default: Any = ..., **constraints: Any) -> Any:
    """A request field with SamplingParams' bounds for `name` and, unless given, its default."""
    if default is ...:
        default = getattr(_ENGINE_DEFAULTS, name)
    return Field(default, **LIMITS.get(name, Bounds()).as_field(), **constraints)


class StrictRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- errors -----------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# -- shared sampling fields ---------------------------------------------------------------------
class StreamOptions(StrictRequest):
    include_usage: bool = False


class SamplingFields(StrictRequest):
    model: str | None = None
    n: int = engine_field("n", le=MAX_CHOICES)
    temperature: float | None = engine_field("temperature")
    top_p: float | None = engine_field("top_p")
    top_k: int | None = engine_field("top_k")
    min_p: float | None = engine_field("min_p")
    seed: int | None = engine_field("seed")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = engine_field("presence_penalty")
    frequency_penalty: float | None = engine_field("frequency_penalty")
    repetition_penalty: float | None = engine_field("repetition_penalty")
    ignore_eos: bool = engine_field("ignore_eos")
    min_tokens: int = engine_field("min_tokens")
    include_stop_str_in_output: bool = engine_field("include_stop_str_in_output")
    skip_special_tokens: bool = engine_field("skip_special_tokens")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


# The fields above that SamplingParams takes as they are: same name, same meaning. max_tokens
# and logprobs mean something else on each endpoint, so the handlers pass those themselves.
ENGINE_SAMPLING_FIELDS = tuple(name for name in SamplingFields.model_fields
                               if name in SamplingParams.__struct_fields__)
# The fields that do not change which tokens come out.
TRANSPORT_FIELDS = frozenset({"model", "stream", "stream_options", "user"})


# -- /v1/completions ------------------------------------------------------------------------------
class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = engine_field("max_tokens")
    logprobs: int | None = engine_field("logprobs")
    echo: bool = False


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionResponse(Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# -- /v1/chat/completions --------------------------------------------------------------------------
class ContentPart(StrictRequest):
    type: str
    text: str | None = None


class ChatMessage(StrictRequest):
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = engine_field("max_tokens", None)
    max_completion_tokens: int | None = engine_field("max_tokens", None)
    logprobs: bool = False
    top_logprobs: int | None = engine_field("logprobs")
    add_generation_prompt: bool = True


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None = None


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


# -- models, tokenizer, operations ------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvsentry"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(StrictRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(StrictRequest):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class StatusResponse(BaseModel):
    status: str
    detail: dict[str, Any] | None = None


class FaultRequest(StrictRequest):
    rank: int = Field(0, ge=0)
    kind: Literal["nan", "inf", "legacy_dummy"]
    layer: int = Field(0, ge=0)
    block: int = Field(0, ge=0)
    target: Literal["k", "v", "latent"] = "k"
