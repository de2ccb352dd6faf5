"""Chat tools: the grammar a named or `required` tool_choice enforces, the Hermes parser for
`auto`, and the tool turns the chat template renders.

named: the output *is* the arguments object (the tool's parameters schema);
required: a JSON array of {"name", "arguments"} objects, one of the tools' schemas each;
auto: free text, from which the parser picks `<tool_call>{"name", "arguments"}</tool_call>` blocks.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from engine.structured.spec import StructuredOutputs
from service.errors import bad_request
from service.protocol import ChatCompletionRequest, ChatMessage, ChatTool, FunctionCall, ToolCall

TOOL_CALL_PARSERS = ("hermes",)
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_HERMES_SYSTEM = ("You may call one or more functions to assist with the user query. Function signatures are "
                  "within <tools></tools>:\n<tools>\n{tools}\n</tools>\nFor each function call, return a JSON "
                  "object with the function name and arguments within <tool_call></tool_call> tags:\n"
                  '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _parameters(tool: ChatTool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    mode: str                    # "named" | "required" | "auto"
    name: str | None = None      # the named tool
    grammar: StructuredOutputs | None = None

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of one finished sample's text."""
        if self.mode == "named":
            return None, [ToolCall(id=new_call_id(), function=FunctionCall(name=self.name, arguments=text))]
        if self.mode == "required":
            items = complete_items(text)
            if not items:
                return text, []
            return None, [ToolCall(id=new_call_id(), function=FunctionCall(
                name=item["name"], arguments=json.dumps(item["arguments"], ensure_ascii=False))) for item in items]
        return parse_hermes(text)


def complete_items(text: str) -> list[dict]:
    """The whole objects of a JSON array, even when max_tokens cut the array short (a small
    model may repeat calls until then): the calls it finished are still calls."""
    decoder, items, pos = json.JSONDecoder(), [], 1
    if not text.startswith("["):
        return []
    while pos < len(text):
        try:
            item, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break
        if isinstance(item, dict) and "name" in item and "arguments" in item:
            items.append(item)
        while pos < len(text) and text[pos] in ", ]":
            pos += 1
    return items


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    calls = []
    for match in HERMES_CALL.finditer(text):
        try:
            item = json.loads(match.group(1))
            name, arguments = item["name"], item.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            continue
        if not isinstance(name, str):
            continue
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=arguments)))
    if not calls:
        return text, []
    content = text[:text.find("<tool_call>")].strip()
    return content or None, calls


def plan_tools(body: ChatCompletionRequest, tool_call_parser: str | None) -> ToolPlan | None:
    """None: the output is not tool calls (no tools, or tool_choice "none")."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice: requires tools", "tool_choice")
        return None
    choice = choice or "auto"
    if choice == "none":
        return None
    if body.response_format is not None and body.response_format.type != "text" and choice != "auto":
        raise bad_request("response_format: cannot be combined with a named or required tool_choice",
                          "response_format")
    tools = {tool.function.name: tool for tool in body.tools}
    if choice == "auto":
        if tool_call_parser is None:
            raise bad_request('tool_choice: "auto" needs the server started with --tool-call-parser '
                              f'({", ".join(TOOL_CALL_PARSERS)}); use "required" or a named tool', "tool_choice")
        return ToolPlan("auto")
    if choice == "required":
        variants = [{"type": "object", "properties": {"name": {"const": name}, "arguments": _parameters(tool)},
                     "required": ["name", "arguments"], "additionalProperties": False}
                    for name, tool in tools.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
        if not body.parallel_tool_calls:
            schema["maxItems"] = 1
        return ToolPlan("required", grammar=StructuredOutputs(kind="json", spec=json.dumps(schema)))
    name = choice.function.name
    if name not in tools:
        raise bad_request(f"tool_choice: no tool named {name!r} in tools", "tool_choice", "unknown_tool")
    return ToolPlan("named", name, StructuredOutputs(kind="json", spec=json.dumps(_parameters(tools[name]))))


def tool_messages(messages: list[ChatMessage], rendered: list[dict], body: ChatCompletionRequest,
                  template: str) -> tuple[list[dict], dict]:
    """Tool calls and tool results in the shape chat templates read; for a template that knows
    no tools (ChatML), the Hermes system prompt and <tool_call> blocks in the assistant's text.
    Returns the messages and the template's extra variables."""
    knows_tools = "tools" in template
    out = []
    for message, entry in zip(messages, rendered):
        if message.tool_calls:
            calls = [{"id": c.id, "type": "function",
                      "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                     for c in message.tool_calls]
            if "tool_calls" in template:
                entry["tool_calls"] = calls
            else:
                blocks = "\n".join(f"<tool_call>\n{json.dumps(c['function'])}\n</tool_call>" for c in calls)
                entry["content"] = f"{entry['content']}\n{blocks}".strip() if entry["content"] else blocks
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    extra: dict = {}
    if body.tools and body.tool_choice != "none":
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
        if knows_tools:
            extra["tools"] = tools
        else:
            system = _HERMES_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
            if out and out[0]["role"] == "system" and isinstance(out[0]["content"], str):
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
            else:
                out.insert(0, {"role": "system", "content": system})
    return out, extra


def _arguments(text: str) -> dict | str:
    try:
        return json.loads(text)
    except ValueError:
        return text
