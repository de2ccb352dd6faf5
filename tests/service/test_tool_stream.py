"""Streaming tool calls (auto/hermes and required): content goes out as it is generated, each call
as soon as it is closed, and the pieces add up to what the non-streamed parser returns."""
from __future__ import annotations

import json

import pytest

from service.tool_stream import ToolCallStream
from service.tools import ToolPlan, parse_hermes

HERMES = ('Let me check both. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
          '\n<tool_call>{"name": "get_time", "arguments": {"timezone": "UTC"}}</tool_call>')


def run(plan: ToolPlan, text: str, step: int) -> tuple[list[str], list[tuple[int, str, str]]]:
    stream, contents, calls = ToolCallStream(plan), [], []
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        content, new = stream.feed(piece, i == len(pieces) - 1)
        contents.append(content)
        calls += [(i, c.function.name, c.function.arguments) for c in new]
    return contents, calls


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_auto_streams_content_then_each_call_when_it_closes(step):
    contents, calls = run(ToolPlan("auto"), HERMES, step)
    content, parsed = parse_hermes(HERMES)
    assert "".join(contents).strip() == content
    assert [(name, args) for _, name, args in calls] == [(c.function.name, c.function.arguments) for c in parsed]
    if step < 10:
        first_close = HERMES.find("</tool_call>") + len("</tool_call>")
        assert calls[0][0] == (first_close - 1) // step  # sent in the piece that closed it
        assert contents[0] != "" or step == 1 and contents[1] != ""  # content before the end


@pytest.mark.parametrize("step", [1, 4])
def test_auto_without_a_call_is_all_content_and_holds_back_a_partial_tag(step):
    text = "Plain answer <tool_ca"
    contents, calls = run(ToolPlan("auto"), text, step)
    assert "".join(contents) == text and not calls
    stream = ToolCallStream(ToolPlan("auto"))
    assert stream.feed("Hi <tool_", False) == ("Hi ", [])  # may be a tag: held
    assert stream.feed("call> {broken", True) == ("<tool_call> {broken", [])  # never closed: content


@pytest.mark.parametrize("step", [1, 5])
def test_required_streams_each_finished_item(step):
    text = json.dumps([{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}])
    contents, calls = run(ToolPlan("required"), text, step)
    assert [(n, json.loads(a)) for _, n, a in calls] == [("a", {"x": 1}), ("b", {})]
    assert calls[0][0] < calls[1][0] or step > len(text) // 2
    assert not "".join(contents)
