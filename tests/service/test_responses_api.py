"""POST /v1/responses with the official `openai` client against a real `kvsentry serve` (the
shared tiny-llama server): plain text, text.format json_schema, a named tool call and the
function_call_output that answers it, streamed events in OpenAI's order whose deltas equal the
whole response, previous_response_id, the stored responses, and the 4xx of what is not supported.
The store and the event builder are also checked on their own, without a server."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from service.cli import parse_args
from service.errors import APIError
from service.responses_api.protocol import ResponsesRequest
from service.responses_api.route import ROUTE, previous_messages
from service.responses_api.store import ResponseStore
from service.responses_api.stream import OutputEvents
from service.state import ServeSettings
from tests.service.conftest import MAIN_MODEL_NAME as MODEL
from tests.service.server_process import ServerProcess

ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "count": {"type": "integer"}},
          "required": ["answer", "count"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city", "strict": True,
           "parameters": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["unit"], "additionalProperties": False}}
NAMED = {"type": "function", "name": "get_weather"}
# One streamed output item of each kind, as OpenAI orders the events.
MESSAGE_EVENTS = (r"response\.output_item\.added response\.content_part\.added (response\.output_text\.delta )*"
                  r"response\.output_text\.done response\.content_part\.done response\.output_item\.done")
CALL_EVENTS = (r"response\.output_item\.added (response\.function_call_arguments\.delta )*"
               r"response\.function_call_arguments\.done response\.output_item\.done")


class Answer(pydantic.BaseModel):
    answer: str = pydantic.Field(json_schema_extra={"enum": ["yes", "no"]})


def greedy(**kwargs) -> dict:
    return {"model": MODEL, "temperature": 0.0, **kwargs}


def event_types(events) -> str:
    return " ".join(event.type for event in events) + " "


def tokens_of(http, messages: list[dict]) -> int:
    return http.post("/tokenize", json={"messages": messages}).json()["count"]


# -- against the server --------------------------------------------------------------------------
def test_plain_text_and_instructions(openai_client, http):
    out = openai_client.responses.create(input="Hello, my name is", max_output_tokens=6,
                                         **greedy(extra_body={"ignore_eos": True}))
    assert out.object == "response" and out.id.startswith("resp_") and out.model == MODEL
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    [message] = out.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert out.output_text == message.content[0].text and out.output_text
    assert out.usage.output_tokens == 6
    assert out.usage.input_tokens == tokens_of(http, [{"role": "user", "content": "Hello, my name is"}])
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    # instructions are the system turn in front of the input
    told = openai_client.responses.create(input="Hello, my name is", instructions="Answer in French.",
                                          max_output_tokens=2, **greedy())
    assert told.instructions == "Answer in French."
    assert told.usage.input_tokens == tokens_of(http, [{"role": "system", "content": "Answer in French."},
                                                       {"role": "user", "content": "Hello, my name is"}])
    # message items in, the short form and the typed form, with text parts
    items = openai_client.responses.create(input=[
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello, my name is"}]}],
        max_output_tokens=2, **greedy())
    assert items.usage.input_tokens == told.usage.input_tokens
    assert items.output_text == told.output_text


def test_text_format_json_schema(openai_client):
    out = openai_client.responses.create(input="Yes or no, and how many?", max_output_tokens=48, **greedy(
        text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}))
    jsonschema.validate(json.loads(out.output_text), ANSWER)
    assert out.status == "completed" and out.text.format.type == "json_schema"
    loose = openai_client.responses.create(input="A cat as JSON.", max_output_tokens=256,
                                           text={"format": {"type": "json_object"}}, **greedy())
    assert loose.status == "completed" and isinstance(json.loads(loose.output_text), dict)
    parsed = openai_client.responses.parse(model=MODEL, input="Yes or no?", max_output_tokens=48, text_format=Answer)
    assert parsed.output_parsed.answer in ("yes", "no")


def test_tool_call_and_its_output(openai_client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = openai_client.responses.create(input=ask, tools=[WEATHER], tool_choice=NAMED, max_output_tokens=48,
                                         **greedy())
    [call] = out.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id and call.status == "completed"
    assert json.loads(call.arguments)["unit"] in ("celsius", "fahrenheit")
    assert out.tools[0].name == "get_weather" and out.tool_choice.name == "get_weather"
    # The agent loop: the call goes back as it came, followed by its result.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    answered = openai_client.responses.create(input=[*ask, *out.output, result], tools=[WEATHER],
                                              tool_choice=NAMED, max_output_tokens=48, **greedy())
    assert answered.output[0].type == "function_call"
    assert answered.usage.input_tokens > out.usage.input_tokens + out.usage.output_tokens
    # The same turn through previous_response_id renders the same prompt and gives the same call.
    continued = openai_client.responses.create(previous_response_id=out.id, input=[result], tools=[WEATHER],
                                               tool_choice=NAMED, max_output_tokens=48, **greedy())
    assert continued.usage.input_tokens == answered.usage.input_tokens and continued.previous_response_id == out.id
    assert continued.output[0].arguments == answered.output[0].arguments
    # tool_choice "none": the tools leave the prompt, the answer is text
    plain = openai_client.responses.create(previous_response_id=out.id, input=[result], tools=[WEATHER],
                                           tool_choice="none", max_output_tokens=4, **greedy())
    assert plain.output[0].type == "message" and plain.usage.input_tokens < answered.usage.input_tokens
    required = openai_client.responses.create(input=ask, tools=[WEATHER], tool_choice="required",
                                              max_output_tokens=64, **greedy())
    assert required.output[0].type == "function_call" and required.output[0].name == "get_weather"
    parsed = openai_client.responses.parse(input=ask, tools=[WEATHER], tool_choice=NAMED, max_output_tokens=48,
                                           **greedy())
    assert parsed.output[0].parsed_arguments == json.loads(parsed.output[0].arguments)


def test_streamed_events_in_order_equal_the_whole_response(openai_client):
    kwargs = greedy(input="Hello, my name is", max_output_tokens=10, extra_body={"ignore_eos": True})
    whole = openai_client.responses.create(**kwargs)
    events = list(openai_client.responses.create(stream=True, **kwargs))
    assert re.fullmatch(rf"response\.created response\.in_progress {MESSAGE_EVENTS} response\.completed ",
                        event_types(events)), event_types(events)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert deltas == done.text == final.output_text == whole.output_text
    assert final.status == "incomplete" and final.usage.output_tokens == 10 and final.id == events[0].response.id
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    with openai_client.responses.stream(**{k: v for k, v in kwargs.items()}) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        assert "".join(texts) == stream.get_final_response().output_text == whole.output_text
    stored = openai_client.responses.retrieve(final.id)
    assert stored.output_text == whole.output_text and stored.usage.output_tokens == 10


def test_streamed_function_call(openai_client):
    kwargs = greedy(input="What is the weather in Paris?", tools=[WEATHER], tool_choice=NAMED, max_output_tokens=48)
    whole = openai_client.responses.create(**kwargs)
    events = list(openai_client.responses.create(stream=True, **kwargs))
    assert re.fullmatch(rf"response\.created response\.in_progress {CALL_EVENTS} response\.completed ",
                        event_types(events)), event_types(events)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    [call] = events[-1].response.output
    assert deltas == done.arguments == call.arguments == whole.output[0].arguments
    with openai_client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert final.output[0].parsed_arguments == json.loads(whole.output[0].arguments)


def test_previous_response_id_continues_the_conversation(openai_client, http):
    first = openai_client.responses.create(input="My name is Ada.", instructions="Be brief.", max_output_tokens=5,
                                           **greedy())
    second = openai_client.responses.create(previous_response_id=first.id, input="What is my name?",
                                            max_output_tokens=3, **greedy())
    # The second prompt holds the first turn and its answer; the first turn's instructions are not
    # carried over (OpenAI's rule).
    assert second.usage.input_tokens == tokens_of(http, [
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    third = openai_client.responses.create(previous_response_id=second.id, input="And again?", max_output_tokens=2,
                                           **greedy())
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    assert openai_client.responses.retrieve(first.id).output_text == first.output_text


def test_unstored_unknown_and_deleted_ids_are_4xx(openai_client):
    kept = openai_client.responses.create(input="Hi", max_output_tokens=1, **greedy())
    unstored = openai_client.responses.create(input="Hi", max_output_tokens=1, store=False, **greedy())
    assert unstored.store is False and kept.store is True
    for missing in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.BadRequestError) as error:
            openai_client.responses.create(previous_response_id=missing, input="Hi", max_output_tokens=1, **greedy())
        assert error.value.body["param"] == "previous_response_id" and missing in error.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            openai_client.responses.retrieve(missing)
    with pytest.raises(openai.BadRequestError):
        openai_client.responses.cancel(kept.id)  # finished, not a background response
    openai_client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.delete(kept.id)


BAD = [  # (body fields over {"input": "Hi"}, the param the 400 names)
    ({"foo": 1}, "foo"),
    ({"": 1}, '""'),
    ({"input": [{"role": "user", "content": "Hi", "foo": 1}]}, "input.0.foo"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content.0"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "sunny"}]}, "input.0.call_id"),
    ({"input": [{"role": "tool", "content": "Hi"}]}, "input.0"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # the tiny model's template does not read it
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [WEATHER]}, "tool_choice"),  # "auto" needs --tool-call-parser, as in chat
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": NAMED, "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"previous_response_id": 5}, "previous_response_id"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=[param for _, param in BAD])
def test_unsupported_and_invalid_fields_are_400_naming_them(http, fields, param):
    reply = http.post(ROUTE, json={"model": MODEL, "input": "Hi", "max_output_tokens": 1, **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_other_bad_requests_are_4xx_never_5xx(server, http):
    assert http.post(ROUTE, json={"model": "nope", "input": "Hi"}).status_code == 404
    assert http.post(ROUTE, json={"model": MODEL}).status_code == 400
    assert http.post(ROUTE, content=b"{not json", headers={"Content-Type": "application/json"}).status_code == 400
    assert http.post(ROUTE, json=[1, 2]).status_code == 400
    assert httpx.post(f"{server.url}{ROUTE}", json={"model": MODEL, "input": "Hi"}).status_code == 401
    assert httpx.get(f"{server.url}{ROUTE}/resp_x").status_code == 401
    long = http.post(ROUTE, json={"model": MODEL, "input": "word " * 5000, "max_output_tokens": 1})
    assert long.status_code == 400 and long.json()["error"]["param"] == "input"
    server.wait_idle()


def test_langchain_through_the_responses_api(server):
    """LangChain's ChatOpenAI with use_responses_api: text, a forced tool call and its result sent
    back (the agent loop), streaming and structured output, with the fields it sends by default."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    class GetWeather(pydantic.BaseModel):
        """Current weather of a city."""
        unit: str = pydantic.Field(json_schema_extra={"enum": ["celsius", "fahrenheit"]})

    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key=server.api_key,
                                      use_responses_api=True, max_tokens=48, temperature=0, max_retries=0)
    assert llm.invoke("Hello").text
    tools = llm.bind_tools([GetWeather], tool_choice="GetWeather")
    ask = HumanMessage("Weather in Paris?")
    called = tools.invoke([ask])
    [call] = called.tool_calls
    assert call["name"] == "GetWeather" and call["args"]["unit"] in ("celsius", "fahrenheit")
    again = tools.invoke([ask, called, ToolMessage("sunny", tool_call_id=call["id"])])
    assert again.tool_calls[0]["name"] == "GetWeather"
    assert again.usage_metadata["input_tokens"] > called.usage_metadata["input_tokens"]
    assert "".join(chunk.text for chunk in llm.stream("Hello")) == llm.invoke("Hello").text
    assert llm.with_structured_output(GetWeather).invoke("Weather?").unit in ("celsius", "fahrenheit")


def test_a_client_leaving_a_stream_frees_its_request(server):
    aborted = sum(server.metric("kvsentry_request_success_total", finished_reason="abort"))
    body = {"model": MODEL, "input": "Hello", "stream": True, "max_output_tokens": 3000, "ignore_eos": True}
    with server.client() as client, client.stream("POST", ROUTE, json=body) as reply:
        lines = reply.iter_lines()
        assert next(lines) == "event: response.created"
    server.wait_idle(timeout=30)
    assert sum(server.metric("kvsentry_request_success_total", finished_reason="abort")) == aborted + 1


def test_counted_in_the_http_metrics(server, openai_client):
    before = sum(server.metric("kvsentry_http_requests_total", route=ROUTE, status="200"))
    openai_client.responses.create(input="Hi", max_output_tokens=1, **greedy())
    assert sum(server.metric("kvsentry_http_requests_total", route=ROUTE, status="200")) == before + 1


@pytest.fixture(scope="module")
def thinking(llama_path, tmp_path_factory):
    """tiny-llama with the deepseek_r1 reasoning parser: it never writes </think>, so its whole
    output is thinking (a reasoning item and no message)."""
    proc = ServerProcess(llama_path, "--served-model-name", MODEL, "--threads", "1", "--max-model-len", "1024",
                         "--reasoning-parser", "deepseek_r1", log_dir=tmp_path_factory.mktemp("logs"))
    try:
        yield proc.wait_ready().openai()
    finally:
        proc.stop()


def test_reasoning_items_whole_and_streamed(thinking):
    kwargs = greedy(input="Hello, my name is", max_output_tokens=8, extra_body={"ignore_eos": True})
    whole = thinking.responses.create(**kwargs)
    [item] = whole.output
    assert item.type == "reasoning" and item.content[0].type == "reasoning_text" and item.content[0].text
    assert whole.output_text == "" and whole.status == "incomplete"
    assert whole.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens == 8
    events = list(thinking.responses.create(stream=True, **kwargs))
    assert re.fullmatch(r"response\.created response\.in_progress response\.output_item\.added "
                        r"response\.content_part\.added (response\.reasoning_text\.delta )+"
                        r"response\.reasoning_text\.done response\.content_part\.done response\.output_item\.done "
                        r"response\.completed ", event_types(events)), event_types(events)
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == events[-1].response.output[0].content[0].text == item.content[0].text
    with thinking.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert final.output[0].content[0].text == item.content[0].text
    # The reasoning item goes back as it came: it is the thinking of the assistant turn after it.
    again = thinking.responses.create(input=[{"role": "user", "content": "Hi"}, *whole.output,
                                             {"role": "assistant", "content": "Hello"},
                                             {"role": "user", "content": "Bye"}], max_output_tokens=1, **greedy())
    assert again.status == "incomplete"


# -- the pieces, without a server ------------------------------------------------------------------
def test_store_keeps_the_most_recently_used():
    store = ResponseStore(2)
    for name in ("a", "b"):
        store.put(name, {"id": name}, [{"role": "user", "content": name}])
    assert store.get("a") is not None  # a is now the most recent
    store.put("c", {"id": "c"}, [])
    assert store.get("b") is None and store.get("a").response == {"id": "a"} and len(store) == 2
    off = ResponseStore(0)
    off.put("a", {"id": "a"}, [])
    assert off.get("a") is None


def test_events_of_reasoning_text_and_calls_parse_as_openai_events():
    """Every event is an `openai` event type, and the client's own accumulator turns them into the
    same output items the response lists."""
    events = OutputEvents()
    response = {"id": "resp_1", "object": "response", "created_at": 0, "model": MODEL, "output": [],
                "status": "in_progress", "tools": [], "tool_choice": "auto", "parallel_tool_calls": True}
    raw = [events.event("response.created", response=response)]
    raw += events.reasoning("Think") + events.reasoning("ing.") + events.text("Hel") + events.text("lo")
    raw += events.whole_call("call_1", "get_weather", '{"unit": "celsius"}') + events.finish("completed")
    raw.append(events.event("response.completed", response={**response, "status": "completed",
                                                             "output": events.output}))
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    parsed = [adapter.validate_python(json.loads(line.split("data: ", 1)[1])) for line in "".join(raw).split("\n\n")
              if line]
    state = ResponseStreamState(input_tools=[WEATHER], text_format=openai.omit)
    for event in parsed:
        state.handle_event(event)
    final = state._completed_response
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "Thinking." and final.output_text == "Hello"
    assert final.output[2].parsed_arguments == {"unit": "celsius"}
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))


def test_a_server_that_keeps_nothing_says_so():
    body = ResponsesRequest.model_validate({"input": "Hi", "previous_response_id": "resp_1"})
    with pytest.raises(APIError) as error:
        previous_messages(ResponseStore(0), body)
    assert error.value.status == 400 and "--responses-store-size 0" in error.value.message
    assert error.value.param == "previous_response_id"
    assert parse_args(["serve", "--responses-store-size", "0"]).responses_store_size == 0
    assert parse_args(["serve"]).responses_store_size == ServeSettings.responses_store_size
    with pytest.raises(SystemExit):
        parse_args(["serve", "--responses-store-size", "-1"])


def test_request_model_refuses_what_it_does_not_take():
    ResponsesRequest.model_validate({"input": [{"type": "reasoning", "id": "rs_1", "summary": [],
                                                "content": [{"type": "reasoning_text", "text": "hm"}]}]})
    with pytest.raises(pydantic.ValidationError):
        ResponsesRequest.model_validate({"input": "Hi", "background": True})
