"""Streaming a tool-calling sample (tool_choice "auto" with the hermes parser, or "required"):
text that is not a call goes out as content as it is generated, and each tool call goes out as
one delta (id, name, whole arguments) as soon as the model has closed it -- not all at the end.
The concatenated stream carries the same calls as the non-streamed response."""
from __future__ import annotations

import json

from service.protocol import FunctionCall, ToolCall
from service.tools import HERMES_CALL, ToolPlan, complete_items, new_call_id, parse_hermes

TAG = "<tool_call>"


def _held_tail(text: str) -> int:
    """Characters at the end of `text` that may be the start of a tag still arriving."""
    return next((n for n in range(len(TAG) - 1, 0, -1) if text.endswith(TAG[:n])), 0)


class ToolCallStream:
    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.sent = 0          # characters of content already sent
        self.num_items = 0     # calls (valid or not) already looked at
        self.num_calls = 0     # calls sent

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """(content delta, completed calls) for the next piece of the sample's text."""
        self.text += text
        if self.plan.mode == "required":
            return self._required(final)
        start = self.text.find(TAG)
        if start < 0:  # no call yet: content, minus a tail that may open one
            end = len(self.text) if final else len(self.text) - _held_tail(self.text)
            content, self.sent = self.text[self.sent:end], end
            return content, []
        content = self.text[self.sent:start] if self.sent < start else ""
        self.sent = max(self.sent, start)
        calls = []
        for match in list(HERMES_CALL.finditer(self.text))[self.num_items:]:
            self.num_items += 1
            _, parsed = parse_hermes(match.group(0))
            calls += parsed
        self.num_calls += len(calls)
        if final and self.num_calls == 0:  # no well-formed call after all: the rest was content
            content += self.text[self.sent:]
            self.sent = len(self.text)
        return content, calls

    def _required(self, final: bool) -> tuple[str, list[ToolCall]]:
        items = complete_items(self.text)
        calls = [ToolCall(id=new_call_id(), function=FunctionCall(
            name=item["name"], arguments=json.dumps(item["arguments"], ensure_ascii=False)))
            for item in items[self.num_items:]]
        self.num_items = len(items)
        self.num_calls += len(calls)
        if final and self.num_calls == 0:
            return self.text, []
        return "", calls
