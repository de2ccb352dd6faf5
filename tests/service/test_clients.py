"""The clients people point at an OpenAI-compatible server, unchanged, against `kvsentry serve`:
the `openai` client, LangChain's ChatOpenAI and LiteLLM (its `openai/` and `hosted_vllm/`
providers). Chat, streaming, tools and structured output each succeed, and every field each
client sends by default is one the server knows (protocol.py's allow-list), captured from the
request bodies the client really wrote."""
from __future__ import annotations

import json
import os

import httpx
import pydantic
import pytest

from service.protocol import ChatCompletionRequest
from tests.service.server_process import ServerProcess

MODEL = "tiny-llama"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["unit"]}}}
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
                 "required": ["answer"], "additionalProperties": False}


class Answer(pydantic.BaseModel):
    """Yes or no."""
    answer: str = pydantic.Field(json_schema_extra={"enum": ["yes", "no"]})


class GetWeather(pydantic.BaseModel):
    """Current weather of a city."""
    unit: str = pydantic.Field(json_schema_extra={"enum": ["celsius", "fahrenheit"]})


@pytest.fixture(scope="module")
def server(llama_path, tmp_path_factory):
    """tiny-llama behind a vLLM tool-calling command line."""
    proc = ServerProcess(llama_path, "--served-model-name", MODEL, "--threads", "1", "--max-model-len", "1024",
                         "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                         log_dir=tmp_path_factory.mktemp("logs"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture
def sent(server, monkeypatch) -> list[dict]:
    """The JSON bodies every client in this process POSTs to the server: the openai client (and
    LangChain through it) sends with httpx2, LiteLLM's own handlers with httpx."""
    bodies: list[dict] = []
    for module in (httpx, pytest.importorskip("httpx2")):
        def send(self, request, *args, _original=module.Client.send, **kwargs):
            if request.method == "POST" and str(request.url).startswith(server.url):
                bodies.append(json.loads(request.read() or b"{}"))
            return _original(self, request, *args, **kwargs)
        monkeypatch.setattr(module.Client, "send", send)
    return bodies


def known(bodies: list[dict]) -> set[str]:
    messages = {f"messages.{name}" for body in bodies for message in body.get("messages", []) for name in message}
    calls = {f"tool_calls.{name}" for body in bodies for message in body.get("messages", [])
             for call in message.get("tool_calls") or [] for name in call}
    print("message fields sent:", sorted(messages | calls))
    print("assistant turns sent back:", [m for body in bodies for m in body.get("messages", [])
                                         if m.get("role") == "assistant"])
    fields = {name for body in bodies for name in body}
    unknown = fields - set(ChatCompletionRequest.model_fields)
    assert not unknown, f"the server would refuse {unknown}"
    print("fields sent:", sorted(fields))  # shown with -rP: what the allow-list is based on
    return fields


# -- the openai client ---------------------------------------------------------------------------------
def test_openai_client(server, sent):
    client = server.openai()
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4)
    assert out.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 4
    named = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, tools=[WEATHER],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.choices[0].message.tool_calls[0].function.arguments)["unit"] in ("celsius", "fahrenheit")
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, tools=[WEATHER])  # auto
    # The agent loop of OpenAI's docs: the reply object goes back as it came, then the tool's result.
    call = named.choices[0].message.tool_calls[0]
    client.chat.completions.create(model=MODEL, max_tokens=4, tools=[WEATHER], messages=[
        *ASK, named.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
    parsed = client.chat.completions.parse(model=MODEL, messages=ASK, max_tokens=64, response_format=Answer)
    assert parsed.choices[0].message.parsed.answer in ("yes", "no")
    # What a user sets by hand and OpenAI documents: accepted, changes no token.
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, user="u", metadata={"k": "v"},
                                   store=False, service_tier="auto", safety_identifier="s", prompt_cache_key="p")
    assert known(sent) >= {"model", "messages", "max_tokens", "stream", "tools", "tool_choice", "response_format"}


def test_openai_client_gets_openais_error_for_an_unknown_field(server):
    import openai
    with pytest.raises(openai.BadRequestError) as error:
        server.openai().chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, extra_body={"foo": 1})
    assert error.value.status_code == 400 and error.value.param == "foo" and error.value.type == "invalid_request_error"
    assert "Unrecognized request argument supplied: foo" in error.value.message


# -- LangChain ---------------------------------------------------------------------------------------------
def test_langchain_chat_openai(server, sent):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0,
                     max_tokens=64, timeout=60)
    assert isinstance(llm.invoke("What is the weather in Paris?").content, str)
    pieces = list(llm.stream("What is the weather in Paris?"))
    assert len(pieces) > 1 and all(isinstance(piece.content, str) for piece in pieces)
    called = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke("Weather in Paris?")
    assert called.tool_calls[0]["name"] == "GetWeather" and called.tool_calls[0]["args"]["unit"] in (
        "celsius", "fahrenheit")
    llm.bind_tools([GetWeather]).invoke("Weather in Paris?")  # tool_choice left out: auto
    llm.bind_tools([GetWeather]).invoke([HumanMessage("Weather in Paris?"), called, ToolMessage(
        "sunny", tool_call_id=called.tool_calls[0]["id"])])  # the agent loop: the call and its result go back
    for method in ("json_schema", "function_calling", "json_mode"):
        structured = llm.with_structured_output(Answer if method != "json_mode" else ANSWER_SCHEMA, method=method)
        if method == "json_mode":  # json_mode constrains to any JSON: only its acceptance is checked
            llm.bind(response_format={"type": "json_object"}).invoke("Answer yes or no in JSON.")
            continue
        assert structured.invoke("Is Paris in France?").answer in ("yes", "no")
    assert known(sent) >= {"model", "messages", "stream", "tools", "tool_choice", "response_format"}


# -- LiteLLM -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def litellm():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the price list
    import litellm
    litellm.telemetry = False
    return litellm


@pytest.mark.parametrize("provider", ["openai", "hosted_vllm"])
def test_litellm(server, sent, litellm, provider):
    common = {"model": f"{provider}/{MODEL}", "api_base": f"{server.url}/v1", "api_key": server.api_key,
              "max_tokens": 64, "num_retries": 0, "timeout": 60}
    out = litellm.completion(messages=ASK, **common)
    assert out.choices[0].message.role == "assistant"
    chunks = list(litellm.completion(messages=ASK, stream=True, **common))
    assert chunks
    named = litellm.completion(messages=ASK, tools=[WEATHER], tool_choice={"type": "function",
                                                                           "function": {"name": "get_weather"}},
                               **common)
    assert json.loads(named.choices[0].message.tool_calls[0].function.arguments)["unit"] in ("celsius", "fahrenheit")
    litellm.completion(messages=ASK, tools=[WEATHER], **common)  # auto
    call = named.choices[0].message.tool_calls[0]
    litellm.completion(messages=[*ASK, named.choices[0].message, {
        "role": "tool", "tool_call_id": call.id, "content": "sunny"}], tools=[WEATHER], **common)
    answer = litellm.completion(messages=ASK, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}, **common)
    assert json.loads(answer.choices[0].message.content)["answer"] in ("yes", "no")
    assert known(sent) >= {"model", "messages", "max_tokens", "tools", "tool_choice", "response_format"}

