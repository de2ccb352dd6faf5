"""The OpenAI / vLLM wire format: request and response models (pydantic 2).

Requests are strict (no "5" for 5, no "yes" for true, no NaN) and refuse unknown
fields, as the OpenAI API does: `{"foo": 1}` is a 400 "Unrecognized request argument
supplied: foo" with `param` "foo" (service/errors.py), at any depth. A sampling field
takes its default and its bounds from `engine.SamplingParams` (`engine_field`), and
reaches it under its own name (`ENGINE_SAMPLING_FIELDS`), so the two layers cannot disagree.

Every field a request may carry is one of three kinds:
- implemented: it changes the output as OpenAI or vLLM define it;
- refused when set (`Unsupported`): it would change the output and kvsentry does not
  implement it, so a request that sets it is a 400 naming it;
- accepted and without effect (`HARMLESS_FIELDS`): bookkeeping that changes no token.
  The list is what the clients people use send (the `openai` client, LangChain's
  ChatOpenAI, LiteLLM; tests/service/test_clients.py drives each against a server):
  `user`, `metadata`, `store`, `service_tier`, `safety_identifier`, `prompt_cache_key`,
  `prompt_cache_retention`. Each is typed: a value of the wrong type is still a 400.
  In a message, an assistant turn sent back as the reply came (the openai and LiteLLM
  agent loops do) may carry `refusal`, `annotations` and LiteLLM's `provider_specific_fields`;
  its `reasoning_content` / `reasoning` reach the chat template, as in vLLM.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from engine.sampling_params import LIMITS, Bounds, SamplingParams
from service.vllm_fields import ChoiceTokenIds, PromptDetails, PromptTokenIds

MAX_CHOICES = 128  # n x prompts per request: more is a denial of service, not a use case
_ENGINE_DEFAULTS = SamplingParams()


def engine_field(name: str, default: Any = ..., **constraints: Any) -> Any:
    """A request field with SamplingParams' bounds for `name` and, unless given, its default."""
    if default is ...:
        default = getattr(_ENGINE_DEFAULTS, name)
    return Field(default, **LIMITS.get(name, Bounds()).as_field(), **constraints)


class StrictRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


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
def _refuse(value: Any) -> Any:
    if value not in (None, False, {}, []):
        raise ValueError("not supported by kvsentry (it would change the output); remove the field")
    return value


# A field that would change the output and that kvsentry does not implement: set, it is a 400
# naming it, never silently ignored (null, false or empty are the same as leaving it out).
UNSUPPORTED = "not supported: a request that sets it is refused with a 400"
Unsupported = Annotated[Any, AfterValidator(_refuse), Field(description=UNSUPPORTED)]


class StreamOptions(StrictRequest):
    include_usage: bool = False


class JsonSchemaFormat(StrictRequest):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class StructuralTagItem(StrictRequest):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)
    begin: str
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    end: str


class ResponseFormat(StrictRequest):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # type structural_tag (vLLM's form): free text until a trigger, then one of the structures.
    structures: list[StructuralTagItem] | None = None
    triggers: list[str] | None = None


class StructuredOutputsRequest(StrictRequest):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar."""
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True  # kvsentry's JSON is compact unless this is false
    structural_tag: str | dict[str, Any] | None = None  # xgrammar's structural tag (JSON)


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
    # HARMLESS_FIELDS: accepted, change no token (the module docstring says why each is here).
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    logit_bias: Unsupported = None
    allowed_token_ids: Unsupported = None
    bad_words: Unsupported = None
    logits_processors: Unsupported = None
    use_beam_search: Unsupported = None
    guided_json: Unsupported = None
    guided_regex: Unsupported = None
    guided_choice: Unsupported = None
    guided_grammar: Unsupported = None
    guided_json_object: Unsupported = None
    truncate_prompt_tokens: Unsupported = None


# The fields above that SamplingParams takes as they are: same name, same meaning. max_tokens
# and logprobs mean something else on each endpoint, so the handlers pass those themselves.
# structured_outputs is vLLM's request object; service/structured.py turns it into the engine's spec.
ENGINE_SAMPLING_FIELDS = tuple(name for name in SamplingFields.model_fields
                               if name in SamplingParams.__struct_fields__ and name != "structured_outputs")
# Accepted and without effect on the tokens: what clients send for their own bookkeeping.
HARMLESS_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier",
                             "prompt_cache_key", "prompt_cache_retention"})
# The fields that do not change which tokens come out.
TRANSPORT_FIELDS = frozenset({"model", "stream", "stream_options"}) | HARMLESS_FIELDS
# The fields that become the engine's grammar (service/structured.py).
GRAMMAR_FIELDS = frozenset({"response_format", "structured_outputs"})


def refused_fields(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(name for name, info in model.model_fields.items() if info.description == UNSUPPORTED)


def _refuse_best_of(value: int | None) -> int | None:
    if value not in (None, 1):
        raise ValueError("not supported by kvsentry (only 1); use n")
    return value


# -- /v1/completions ------------------------------------------------------------------------------
class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = engine_field("max_tokens")
    logprobs: int | None = engine_field("logprobs")
    prompt_logprobs: int | None = engine_field("prompt_logprobs", None)  # vLLM's: top-N per prompt token
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and each choice's token_ids in the response
    echo: bool = False
    suffix: Unsupported = None
    best_of: Annotated[int | None, AfterValidator(_refuse_best_of)] = None
    priority: int = 0  # vLLM's: lower is scheduled first; not 0 needs --scheduling-policy priority


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class CompletionChoice(ChoiceTokenIds, PromptDetails):
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
    # The other part types' payloads: typed so that the renderer refuses the part by its type
    # ("only text parts are supported"), not by an unknown key.
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    video_url: Any = None


class FunctionCall(StrictRequest):
    name: str
    arguments: str  # a JSON object, as a string


class ToolCall(StrictRequest):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictRequest):
    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None           # a tool turn: the call it answers
    # An assistant turn sent back as it came: its thinking reaches the template (which may show or
    # drop it, as Qwen3's does); a refusal and annotations are the reply's bookkeeping.
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    provider_specific_fields: dict[str, Any] | None = None  # LiteLLM's copy of the reply's extra fields
    function_call: Unsupported = None
    audio: Unsupported = None


class FunctionDefinition(StrictRequest):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(StrictRequest):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictRequest):
    name: str


class NamedToolChoice(StrictRequest):
    type: Literal["function"]
    function: NamedFunction


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


def _refuse_modalities(value: list[str] | None) -> list[str] | None:
    if value not in (None, ["text"]):
        raise ValueError("only [\"text\"] is supported")
    return value


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: Unsupported = None
    function_call: Unsupported = None
    audio: Unsupported = None
    prediction: Unsupported = None
    web_search_options: Unsupported = None
    modalities: Annotated[list[str] | None, AfterValidator(_refuse_modalities)] = None
    max_tokens: int | None = engine_field("max_tokens", None)
    max_completion_tokens: int | None = engine_field("max_tokens", None)
    logprobs: bool = False
    top_logprobs: int | None = engine_field("logprobs")
    prompt_logprobs: int | None = engine_field("prompt_logprobs", None)  # vLLM's: top-N per prompt token
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and each choice's token_ids in the response
    add_generation_prompt: bool = True
    # vLLM's chat extensions (service/chat_render.py says how each reaches the template).
    continue_final_message: bool = False
    echo: bool = False
    chat_template: str | None = None  # needs --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None
    documents: list[dict[str, str]] | None = None  # RAG templates' `documents` variable
    add_special_tokens: bool = False  # BOS etc. on top of what the template writes
    priority: int = 0  # vLLM's: lower is scheduled first; not 0 needs --scheduling-policy priority


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
    tool_calls: list[ToolCall] = []
    reasoning_content: str | None = None  # --reasoning-parser: the model's thinking
    reasoning: str | None = None          # the same, under the name newer clients read


class ChatChoice(ChoiceTokenIds):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(Response, PromptDetails):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(ChoiceTokenIds):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(Response, PromptTokenIds):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
