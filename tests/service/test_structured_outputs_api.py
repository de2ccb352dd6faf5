"""Structured outputs and tool calls over HTTP on the real default model: response_format,
vLLM's structured_outputs, the openai client's parse(), named / required / auto tool_choice
(streamed deltas concatenate to the non-streamed arguments), and the 400s naming the field."""
from __future__ import annotations

import json
import re

import jsonschema
import pydantic
import pytest

from engine.gguf.default_model import DEFAULT_MODEL_NAME as MODEL
from benchmarks.structured_schemas import SCHEMAS
from tests.service.server_process import ServerProcess

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}},
                   "required": ["timezone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=120)


def start(tmp_path_factory, *flags: str):
    # The exact dequantized weights: the answers asserted here are theirs (int8 activations, the
    # default on VNNI CPUs, change the default model's greedy output).
    proc = ServerProcess(None, "--threads", "1", "--max-model-len", "1024", "--quantized-activations", "none", *flags,
                         log_dir=tmp_path_factory.mktemp("logs"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from start(tmp_path_factory, "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """A server that splits <think>...</think> off (the default model does not think: its whole
    output is reasoning, and a grammar waits for a closing tag that never comes)."""
    for server in start(tmp_path_factory, "--reasoning-parser", "deepseek_r1"):
        yield server.openai()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


def test_response_format_json_schema(client):
    for question, schema in SCHEMAS[:6]:
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=96,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                     "strict": True}})
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)
        assert out.choices[0].finish_reason == "stop"


def test_json_object_and_completions(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A cat as JSON."}],
                                         max_tokens=120, temperature=1, seed=3,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    text = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=8, temperature=0,
                                     extra_body={"structured_outputs": {"choice": ["yes", "no"]}}).choices[0].text
    assert text in ("yes", "no")


def test_vllm_structured_outputs(client):
    messages = [{"role": "user", "content": "Give me a code."}]
    for so, check in (({"regex": r"[A-Z]{2}-[0-9]{3}"}, lambda t: re.fullmatch(r"[A-Z]{2}-[0-9]{3}", t)),
                      ({"choice": ["red", "blue"]}, lambda t: t in ("red", "blue")),
                      ({"grammar": 'root ::= "x" [0-9]'}, lambda t: re.fullmatch(r"x[0-9]", t)),
                      ({"json": SCHEMAS[2][1]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[2][1]) or True)):
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, n=2, temperature=1,
                                             seed=11, extra_body={"structured_outputs": so})
        for choice in out.choices:
            assert check(choice.message.content), (so, choice.message.content)


def test_openai_parse_returns_the_object(client):
    out = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Describe a person."}],
                                        response_format=Person, temperature=0, max_tokens=64)
    assert isinstance(out.choices[0].message.parsed, Person)


def test_named_tool_choice_and_streaming_deltas(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named,
                                         temperature=0, max_tokens=64)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call, = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=named,
                                            temperature=0, max_tokens=64, stream=True)
    pieces, names, reasons = [], [], []
    for chunk in stream:
        for c in chunk.choices:
            for delta in c.delta.tool_calls or []:
                names += [delta.function.name] if delta.function.name else []
                pieces.append(delta.function.arguments or "")
            reasons += [c.finish_reason] if c.finish_reason else []
    assert names == ["get_weather"] and "".join(pieces) == call.function.arguments
    assert reasons == ["tool_calls"]


def test_required_with_two_tools(client):
    for parallel in (True, False):
        out = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                             parallel_tool_calls=parallel, temperature=0, max_tokens=96)
        calls = out.choices[0].message.tool_calls
        # In parallel the small model may repeat calls until max_tokens: the finished ones count.
        assert calls
        assert out.choices[0].finish_reason in (("tool_calls", "length") if parallel else ("tool_calls",))
        for call in calls:
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
        stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                                tool_choice="required", parallel_tool_calls=parallel,
                                                temperature=0, max_tokens=96, stream=True)
        streamed = [d.function.arguments for chunk in stream for c in chunk.choices for d in c.delta.tool_calls or []]
        assert streamed == [call.function.arguments for call in calls]


def test_auto_parses_hermes_and_tool_results_render(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=48)
    message = out.choices[0].message
    # The tool result rendered through the template; the model answers in text (no <tool_call>).
    assert message.content and message.reasoning_content is None and not message.tool_calls
    assert out.choices[0].finish_reason in ("stop", "length")
    from service.tools import parse_hermes
    content, calls = parse_hermes('Sure. <tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n'
                                  '</tool_call>')
    assert content == "Sure." and calls[0].function.name == "get_time"
    assert json.loads(calls[0].function.arguments) == {"timezone": "UTC"}


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"structural_tag": {"structures": [], "triggers": []}}},
     "structured_outputs.structural_tag"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f"]}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"logit_bias": {"50256": -100}}, "logit_bias"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
])
def test_refused_fields_name_themselves(http, extra, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_completions_refuse_suffix_and_best_of(http):
    for extra, param in (({"suffix": "x"}, "suffix"), ({"best_of": 2}, "best_of")):
        response = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **extra})
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_reasoning_content_streams_as_it_is_returned(thinking):
    client = thinking
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    message = out.choices[0].message
    assert message.reasoning_content and message.model_extra["reasoning"] == message.reasoning_content
    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24, stream=True)
    deltas = [c.delta for chunk in stream for c in chunk.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == message.reasoning_content
    assert not any(d.content for d in deltas)


def test_reasoning_split_whole_and_streamed():
    from service.reasoning import ReasoningStream, split_reasoning
    for text, expected in (("<think>a\nb</think>\n\nAnswer", ("a\nb", "Answer")), ("x</think>y", ("x", "y")),
                           ("<think>cut", ("cut", None)), ("x</th", ("x</th", None))):
        assert split_reasoning(text) == expected
        for step in (1, 2, 5):
            stream, thought, answer = ReasoningStream(), "", ""
            pieces = [text[i:i + step] for i in range(0, len(text), step)]
            for i, piece in enumerate(pieces):
                r, c = stream.feed(piece, i == len(pieces) - 1)
                thought, answer = thought + r, answer + c
            assert (thought or None, answer or None) == expected


def test_with_a_reasoning_parser_the_grammar_waits_for_the_end_of_thinking(thinking):
    # The default model never closes a <think>: all of its output is thinking, which the JSON
    # schema must not constrain (engine-level, tests/engine/test_structured_outputs.py shows the
    # grammar taking over right after the closing tokens).
    messages = [{"role": "user", "content": "Describe a person."}]
    free = thinking.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMAS[0][1]}}
    gated = thinking.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24,
                                             response_format=fmt)
    assert gated.choices[0].message.reasoning_content == free.choices[0].message.reasoning_content
    assert gated.choices[0].message.content is None


def test_structural_tag_both_forms(client):
    # Free text until a trigger, then the structure. The default model is too small to emit a
    # <function=...> tag of its own, so the trigger is a word it does write first ("Paris"):
    # from there on it must write the tool's JSON and the end marker.
    params = WEATHER["function"]["parameters"]
    tag = {"structures": [{"begin": "Paris", "schema": params, "end": "."}], "triggers": ["Paris"]}
    for extra in ({"response_format": {"type": "structural_tag", **tag}},
                  {"extra_body": {"structured_outputs": {"structural_tag": json.dumps(tag)}}}):
        out = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=64, **extra)
        text = out.choices[0].message.content
        found = re.match(r"(.*?)Paris(\{.*?\})\.", text, flags=re.S)
        assert found and "Paris" not in found.group(1), text
        jsonschema.validate(json.loads(found.group(2)), params)
