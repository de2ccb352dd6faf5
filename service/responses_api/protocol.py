"""The Responses API's request (POST /v1/responses), as OpenAI defines it and vLLM serves it.

Strict like the chat request (service/protocol.py): an unknown field, at any depth, is a 400
"Unrecognized request argument supplied: ..."; a field that would change the output and is not
implemented is `Unsupported` (a 400 naming it when set); the bookkeeping fields clients send
(`user`, `metadata`, `service_tier`, ...) are accepted and change no token.

`input` is a string or a list of items: messages (the short form without `type` too), the
`function_call` / `function_call_output` items of the tool loop, and `reasoning` items sent back
as they came. Any other item type is a 400 naming it.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag

from service.protocol import (ReasoningEffort, Response, StrictRequest, StructuredOutputsRequest, Unsupported,
                              engine_field)

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class ContentPart(StrictRequest):
    """A part of a message's content. Text parts (input_text, and output_text / refusal in an
    assistant reply sent back) are rendered; the others are typed so that they are refused by
    their type ("only text parts are supported"), not as unknown keys."""
    type: str
    text: str | None = None
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None  # output_text sent back as it came
    logprobs: list[dict[str, Any]] | None = None
    image_url: Any = None
    file_id: Any = None
    file_data: Any = None
    file_url: Any = None
    filename: Any = None
    detail: Any = None


class MessageItem(StrictRequest):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None
    phase: str | None = None  # OpenAI's marker of commentary vs final answer: bookkeeping


class FunctionCallItem(StrictRequest):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None
    namespace: Unsupported = None


class FunctionCallOutputItem(StrictRequest):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class ReasoningText(StrictRequest):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(StrictRequest):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    status: str | None = None
    encrypted_content: Unsupported = None


_TAGS = {"message": "MessageItem", "function_call": "FunctionCallItem",
         "function_call_output": "FunctionCallOutputItem", "reasoning": "ReasoningItem"}


def _item_type(value: Any) -> str | None:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return _TAGS.get(kind)


# The tags are the models' names, so that a 400 names the field by its path alone (input.0.foo).
InputItem = Annotated[
    Annotated[MessageItem, Tag("MessageItem")] | Annotated[FunctionCallItem, Tag("FunctionCallItem")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")] | Annotated[ReasoningItem, Tag("ReasoningItem")],
    Discriminator(_item_type, custom_error_type="item_type",
                  custom_error_message=f"unsupported input item type; kvsentry takes {', '.join(ITEM_TYPES)}"),
]


def _as_items(value: Any) -> Any:
    """A string input is one user message. An item of a type kvsentry does not take is named by
    its index and type (the union's own error would list the models instead)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of input items")
    for i, item in enumerate(value):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind is not None and kind not in ITEM_TYPES:
            raise ValueError(f"item {i} has type {kind!r}, which kvsentry does not take "
                             f"(it takes {', '.join(ITEM_TYPES)})")
    return value


class FunctionTool(StrictRequest):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(StrictRequest):
    type: Literal["function"]
    name: str


class TextFormat(StrictRequest):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = Field(None, min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictRequest):
    format: TextFormat | None = None
    verbosity: Unsupported = None


class Reasoning(StrictRequest):
    effort: ReasoningEffort | None = None  # the chat template's reasoning_effort, as vLLM passes it
    summary: Unsupported = None
    generate_summary: Unsupported = None


class ResponsesStreamOptions(StrictRequest):
    include_obfuscation: bool | None = None  # OpenAI pads events against side channels; nothing to pad here


def _refuse_auto_truncation(value: str | None) -> str | None:
    if value == "auto":
        raise ValueError("only \"disabled\" is supported: a prompt longer than the context is refused, "
                         "never truncated")
    return value


class ResponsesRequest(StrictRequest):
    model: str | None = None
    input: Annotated[list[InputItem], BeforeValidator(_as_items, json_schema_input_type=str | list[InputItem])]
    instructions: str | None = None
    max_output_tokens: int | None = engine_field("max_tokens", None)
    temperature: float | None = engine_field("temperature")
    top_p: float | None = engine_field("top_p")
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # true unless false: kept for previous_response_id and GET
    truncation: Annotated[Literal["auto", "disabled"] | None, AfterValidator(_refuse_auto_truncation)] = None
    # vLLM's extensions of the request.
    top_k: int | None = engine_field("top_k")
    seed: int | None = engine_field("seed")
    repetition_penalty: float | None = engine_field("repetition_penalty")
    stop: str | list[str] | None = None
    ignore_eos: bool = engine_field("ignore_eos")
    skip_special_tokens: bool = engine_field("skip_special_tokens")
    include_stop_str_in_output: bool = engine_field("include_stop_str_in_output")
    structured_outputs: StructuredOutputsRequest | None = None
    priority: int = 0  # vLLM's: lower is scheduled first; not 0 needs --scheduling-policy priority
    # Accepted, without effect on the tokens (service/protocol.py's allow-list).
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # Would change the output (or need a server that runs in the background): refused when set.
    background: Unsupported = None
    include: Unsupported = None
    max_tool_calls: Unsupported = None
    top_logprobs: Unsupported = None
    logit_bias: Unsupported = None
    prompt: Unsupported = None
    conversation: Unsupported = None
    context_management: Unsupported = None


# -- what comes back (documented for the OpenAPI schema; output.py builds the objects) ------------
class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]   # cached_tokens
    output_tokens: int
    output_tokens_details: dict[str, int]  # reasoning_tokens
    total_tokens: int


class ResponseObject(Response):
    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    output: list[dict[str, Any]]  # message, reasoning and function_call items
    usage: ResponseUsage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"]
    deleted: bool
