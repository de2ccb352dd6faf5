"""A Responses request as the chat request it means: `instructions`, the stored conversation of
`previous_response_id` and `input` become chat messages, the other fields their chat names, so
the chat path renders, constrains and parses it (template, grammar, tools, reasoning).

Item by item: a message is a chat message (`developer` is the system role); `function_call` items
are the assistant's tool_calls (merged into the assistant turn before them); a
`function_call_output` is a tool message answering a call made earlier in the conversation; a
`reasoning` item is the thinking of the assistant turn that follows it.
"""
from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError

from service.errors import APIError, bad_request
from service.protocol import ChatCompletionRequest
from service.responses_api.protocol import (ContentPart, FunctionCallItem, FunctionCallOutputItem, InputItem,
                                            MessageItem, ReasoningItem, ResponsesRequest)

TEXT_PARTS = ("input_text", "output_text", "text")
_ITEMS = TypeAdapter(list[InputItem])
# Chat parameters as the Responses request names them, for the 400s the chat path raises.
_PARAMS = (("messages", "input"), ("response_format.json_schema.schema", "text.format.schema"),
           ("response_format", "text.format"), ("reasoning_effort", "reasoning.effort"),
           ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"))


def part_text(parts: list[ContentPart], param: str) -> str:
    texts = []
    for i, part in enumerate(parts):
        media = [name for name in ("image_url", "file_id", "file_data", "file_url", "filename")
                 if getattr(part, name) is not None]
        if part.type in TEXT_PARTS and part.text is not None and not media:
            texts.append(part.text)
        elif part.type == "refusal" and part.refusal is not None:
            texts.append(part.refusal)
        else:
            raise bad_request(f"{param}.{i}: only text parts are supported (got type {part.type!r})",
                              f"{param}.{i}")
    return "\n".join(texts)


def _call_ids(messages: list[dict]) -> set[str]:
    return {call["id"] for message in messages for call in message.get("tool_calls") or []}


def conversation(items: list, history: list[dict], param: str = "input") -> list[dict]:
    """The chat messages of `items` (input items, or output items read back), after `history`."""
    out: list[dict] = []
    known_calls = _call_ids(history)
    thought: str | None = None  # a reasoning item's text, waiting for its assistant turn

    def assistant(entry: dict) -> dict:
        nonlocal thought
        if thought is not None:
            entry["reasoning_content"], thought = thought, None
        return entry

    for i, item in enumerate(items):
        where = f"{param}.{i}"
        if isinstance(item, MessageItem):
            text = item.content if isinstance(item.content, str) else part_text(item.content, f"{where}.content")
            role = "system" if item.role == "developer" else item.role
            entry = {"role": role, "content": text}
            out.append(assistant(entry) if role == "assistant" else entry)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            previous = out[-1] if out else None
            if previous is not None and previous["role"] == "assistant" and thought is None:
                previous.setdefault("tool_calls", []).append(call)
            else:
                out.append(assistant({"role": "assistant", "content": None, "tool_calls": [call]}))
            known_calls.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in known_calls:
                raise bad_request(f"{where}.call_id: no function_call with call_id {item.call_id!r} comes before "
                                  "this output in the conversation", f"{where}.call_id")
            text = item.output if isinstance(item.output, str) else part_text(item.output, f"{where}.output")
            out.append({"role": "tool", "content": text, "tool_call_id": item.call_id})
        elif isinstance(item, ReasoningItem):
            parts = item.content if item.content else item.summary
            thought = (thought or "") + "\n".join(part.text for part in parts)
    if thought is not None:  # thinking with no turn after it: a turn of its own
        out.append(assistant({"role": "assistant", "content": ""}))
    return out


def output_messages(output: list[dict], history: list[dict]) -> list[dict]:
    """The chat messages of a response's own output items (what the next turn continues)."""
    return conversation(_ITEMS.validate_python(output), history, "output")


def input_messages(body: ResponsesRequest, history: list[dict]) -> list[dict]:
    return conversation(body.input, history)


def chat_request(body: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    """The chat request of `messages` (instructions first) with the sampling, grammar and tool
    fields of `body`."""
    if body.instructions is not None:
        messages = [{"role": "system", "content": body.instructions}, *messages]
    data: dict[str, Any] = {"messages": messages}
    for name in ("temperature", "top_p", "top_k", "seed", "repetition_penalty", "stop", "structured_outputs"):
        if (value := getattr(body, name)) is not None:
            data[name] = value
    for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
        data[name] = getattr(body, name)
    if body.max_output_tokens is not None:
        data["max_completion_tokens"] = body.max_output_tokens
    if body.tools:
        data["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                         for tool in body.tools]
    if body.tool_choice is not None:
        choice = body.tool_choice
        data["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    if body.parallel_tool_calls is not None:
        data["parallel_tool_calls"] = body.parallel_tool_calls
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise bad_request("text.format.schema: required when type is json_schema", "text.format.schema")
        schema = {"name": fmt.name or "response", "schema": fmt.schema_}
        schema.update({k: v for k, v in (("description", fmt.description), ("strict", fmt.strict)) if v is not None})
        data["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None:
        data["response_format"] = {"type": fmt.type}
    if body.reasoning is not None and body.reasoning.effort is not None:
        data["reasoning_effort"] = body.reasoning.effort
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as exc:  # a value the Responses fields took and the chat fields do not
        error = exc.errors()[0]
        param = renamed(".".join(str(part) for part in error["loc"]))
        raise bad_request(f"{param}: {error['msg']}", param) from None


def renamed(param: str | None) -> str | None:
    for chat, responses in _PARAMS:
        if param is not None and (param == chat or param.startswith(chat + ".")):
            return responses if chat == "messages" else responses + param[len(chat):]
    return param


def in_responses_terms(exc: APIError) -> APIError:
    """A 400 of the chat path, naming the Responses field."""
    param = renamed(exc.param)
    if param == exc.param:
        return exc
    message = exc.message
    if exc.param and message.startswith(exc.param):
        message = param + message[len(exc.param):]
    return APIError(exc.status, message, param, exc.code, exc.headers)
