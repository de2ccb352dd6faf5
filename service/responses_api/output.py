"""The response object and its output items, in the shapes of `openai.types.responses`.

Both the streamed and the whole response are built from these, by one rule: a reasoning item
when there is thinking, a message item when there is text, a function_call item per call, and
an empty message when there is nothing else; the last item is "incomplete" when
max_output_tokens cut the output short.
"""
from __future__ import annotations

import uuid
from collections.abc import Sequence

from service.protocol import UsageInfo
from service.reasoning import split_reasoning
from service.responses_api.protocol import ResponsesRequest
from service.tools import ToolPlan


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [output_text(text)] if text is not None else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict:
    content = [{"type": "reasoning_text", "text": text}] if text is not None else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def final_status(finish_reason: str | None) -> tuple[str, dict | None]:
    """(response status, incomplete_details) of a finished sample."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def output_items(text: str, reasoning: bool, plan: ToolPlan | None, finish_reason: str | None) -> list[dict]:
    """The output items of a whole sample's text."""
    thought, content = split_reasoning(text) if reasoning else (None, text)
    calls = []
    if plan is not None and content:
        content, calls = plan.calls(content)
    items = []
    if thought:
        items.append(reasoning_item(new_id("rs"), thought, "completed"))
    if content:
        items.append(message_item(new_id("msg"), content, "completed"))
    items += [function_call_item(new_id("fc"), call.id, call.function.name, call.function.arguments, "completed")
              for call in calls]
    if not items:
        items.append(message_item(new_id("msg"), "", "completed"))
    if final_status(finish_reason)[0] == "incomplete":
        items[-1]["status"] = "incomplete"
    return items


def usage(counts: UsageInfo, reasoning_tokens: int = 0) -> dict:
    return {"input_tokens": counts.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": counts.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": counts.total_tokens}


def reasoning_tokens(items: list[dict], token_ids: Sequence[int], end_ids: Sequence[int]) -> int:
    """The output tokens of the thinking: up to and including the first closing tag (`end_ids`,
    its encoding), or all of them when the model never closed it; 0 without a reasoning item."""
    if not any(item["type"] == "reasoning" for item in items):
        return 0
    end, width = tuple(end_ids), len(end_ids)
    for start in range(len(token_ids) - width + 1):
        if tuple(token_ids[start:start + width]) == end:
            return start + width
    return len(token_ids)


def response_object(body: ResponsesRequest, response_id: str, created: int, model: str, stored: bool, status: str,
                    output: list[dict], usage_out: dict | None = None, incomplete: dict | None = None,
                    error: dict | None = None) -> dict:
    """The response object: the request's settings echoed back, as OpenAI's does; `stored`: kept
    for previous_response_id and GET."""
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    text = {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}}
    choice = body.tool_choice or ("auto" if body.tools else "none")
    return {
        "id": response_id, "object": "response", "created_at": created, "model": model, "status": status,
        "output": output, "usage": usage_out, "error": error, "incomplete_details": incomplete,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id, "temperature": body.temperature, "top_p": body.top_p,
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
        "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
        "reasoning": body.reasoning.model_dump(exclude_none=True) if body.reasoning else None,
        "text": text, "truncation": "disabled", "metadata": body.metadata or {}, "user": body.user,
        "store": stored, "background": False, "service_tier": body.service_tier or "default",
    }
