"""No request can stall a step: hostile requests of every kind the API takes, sent concurrently
with the official `openai` client while normal requests run beside them.

Every hostile request gets its 200 or 4xx (never a 5xx, never a hang) within a generous budget;
every normal request completes, loosely as fast as alone; /ready answers 200 throughout; and
afterwards the engine serves, with nothing left in flight or in the KV cache.

The server keeps the default size bounds but one: it lets choice lists up to 12,000 entries
through (--max-structured-outputs-choices), so that a 10,000-entry list -- on this tokenizer a
compile of ~10 s or more -- reaches the rank and meets a 2 s compile timeout: the typed refusal
path, a 400, while its compile runs on in its thread and everything else keeps stepping.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.service.server_process import ServerProcess

MODEL = "tiny-llama"
BUDGET_S = 60.0  # each hostile request's answer, generous: the wedge this guards against is unbounded
NORMAL_SLACK_S = 10.0  # normal latency may be 2x alone plus this (a shared 2-core machine is noisy)
ASK = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def server(llama_path, tmp_path_factory):
    proc = ServerProcess(llama_path, "--served-model-name", MODEL, "--max-model-len", "4096", "--threads", "1",
                         "--max-queued-requests", "64", "--structured-outputs-compile-timeout", "2",
                         "--max-structured-outputs-choices", "12000",
                         "--max-structured-outputs-spec-bytes", "400000",
                         log_dir=tmp_path_factory.mktemp("logs"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def schema(body: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": body}}}


def nested(depth: int) -> dict:
    body: dict = {"type": "string"}
    for _ in range(depth):
        body = {"type": "object", "properties": {"a": body}, "required": ["a"]}
    return body


def tool(i: int) -> dict:
    return {"type": "function", "function": {"name": f"tool_{i}", "description": f"tool number {i}",
                                             "parameters": {"type": "object",
                                                            "properties": {"x": {"type": "integer"}}}}}


TOOLS = [tool(i) for i in range(3000)]
LONG_TEXT = "the quick brown fox jumps over the lazy dog " * 2000  # ~90k characters, far past 4096 tokens

# (name, route, request body, expected status: 200, 400 or None for either, the 400's param when
# it must be that one)
HOSTILE = [
    ("enum 50000", "chat", schema({"type": "string", "enum": [f"value-{i}" for i in range(50000)]}), 400,
     "response_format.json_schema.schema"),
    ("enum 13000", "chat", schema({"type": "string", "enum": [f"v{i}" for i in range(13000)]}), 400,
     "response_format.json_schema.schema.enum"),
    ("choice 20000", "chat", {"structured_outputs": {"choice": [f"c{i}" for i in range(20000)]}}, 400,
     "structured_outputs.choice"),
    ("choice 12000 past the compile timeout", "chat",
     {"structured_outputs": {"choice": [f"choice-{i}" for i in range(12000)]}}, 400, "structured_outputs.choice"),
    ("nested 300", "chat", schema(nested(300)), 400, "response_format.json_schema.schema"),
    ("nested 20000 arrays", "raw", '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], '
     '"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"x": %s}}}}'
     % (MODEL, "[" * 20000 + "]" * 20000), 400, None),
    ("regex 500 KB", "chat", {"structured_outputs": {"regex": "(ab|cd)" * 75000}}, 400, "structured_outputs.regex"),
    ("grammar 500 KB", "completions", {"structured_outputs": {"grammar": 'root ::= "a" ' + '| "b" ' * 80000}},
     400, "structured_outputs.grammar"),
    ("regex repeat 100000", "chat", {"structured_outputs": {"regex": "(a|b){100000}"}}, 200, None),
    ("grammar repeat 100000", "completions", {"structured_outputs": {"grammar": 'root ::= "a"{100000}'}}, 200, None),
    ("minItems 100000", "chat", schema({"type": "array", "items": {"type": "integer"}, "minItems": 100000}), 200,
     None),
    ("3000 tools required", "chat", {"tools": TOOLS, "tool_choice": "required"}, 400, "tools"),
    ("3000 tools, none", "chat", {"tools": TOOLS, "tool_choice": "none"}, None, None),  # rendered, then judged
    ("300 tools required", "chat", {"tools": TOOLS[:300], "tool_choice": "required"}, None, None),
    ("huge prompt", "completions", {"prompt": LONG_TEXT * 10}, 400, "prompt"),
    ("long prompt", "completions", {"prompt": LONG_TEXT}, 400, "prompt"),
    ("5000 messages", "chat", {"messages": [{"role": "user", "content": f"message {i}"} for i in range(5000)]},
     400, "messages"),
    ("n 1000", "completions", {"n": 1000}, 400, "n"),
    ("best_of 50", "completions", {"best_of": 50}, 400, "best_of"),
    ("logprobs 10000", "completions", {"logprobs": 10000}, 400, "logprobs"),
    ("top_logprobs 10000", "chat", {"logprobs": True, "top_logprobs": 10000}, 400, "top_logprobs"),
    ("10000 stop strings", "completions", {"stop": [f"stop{i}" for i in range(10000)]}, 400, "stop"),
    ("logit_bias 10000", "chat", {"logit_bias": {str(i): 1 for i in range(10000)}}, 400, "logit_bias"),
    ("max_tokens 10**9", "completions", {"max_tokens": 10**9}, 400, "max_tokens"),
    ("streamed enum 50000", "chat-stream", schema({"type": "string", "enum": [f"value-{i}" for i in range(50000)]}),
     400, "response_format.json_schema.schema"),
    ("streamed bad regex", "chat-stream", {"structured_outputs": {"regex": "[a-"}}, 400, "structured_outputs.regex"),
]


# The error codes that say which guard answered (engine/structured/limits.py, compile_pool.py).
CODES = {"enum 50000": "structured_outputs_too_large", "enum 13000": "structured_outputs_too_large",
         "choice 12000 past the compile timeout": "structured_outputs_compile_timeout",
         "nested 300": "structured_outputs_too_large", "streamed enum 50000": "structured_outputs_too_large"}


def send(client: openai.OpenAI, route: str, body: dict) -> tuple[int, str | None, str | None]:
    """(status, the error's param, its code) of one request through the official client ("raw": a body
    too deeply nested for any JSON encoder of Python, sent as bytes)."""
    if route == "raw":
        response = httpx.post(f"{client.base_url}chat/completions", content=body, timeout=BUDGET_S + 30,
                              headers={"Authorization": f"Bearer {client.api_key}", "Content-Type": "application/json"})
        error = response.json().get("error") or {}
        return response.status_code, error.get("param"), error.get("code")
    try:
        if route.startswith("chat"):
            body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **body}
            extra = {k: body.pop(k) for k in list(body) if k in ("structured_outputs",)}
            stream = route == "chat-stream"
            response = client.chat.completions.create(**body, stream=stream, extra_body=extra or None)
            if stream:
                for _ in response:
                    pass
        else:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **body}
            extra = {k: body.pop(k) for k in list(body) if k in ("structured_outputs",)}
            client.completions.create(**body, extra_body=extra or None)
        return 200, None, None
    except openai.APIStatusError as exc:
        error = exc.body.get("error", exc.body) if isinstance(exc.body, dict) else {}
        return exc.status_code, error.get("param"), error.get("code")


def normal(client: openai.OpenAI) -> float:
    started = time.monotonic()
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")
    return time.monotonic() - started


def test_hostile_requests_cannot_stall_the_server(server):
    client = server.openai(timeout=BUDGET_S + 30)
    alone = sorted(normal(client) for _ in range(3))[1]

    stop = threading.Event()
    readiness: list[int | str] = []
    normal_latencies: list[float] = []

    def watch_ready() -> None:
        while not stop.is_set():
            try:
                readiness.append(httpx.get(f"{server.url}/ready", timeout=10).status_code)
            except httpx.HTTPError as exc:
                readiness.append(type(exc).__name__)
            stop.wait(0.25)

    def run_normal() -> None:
        while not stop.is_set():
            normal_latencies.append(normal(client))

    def run_hostile(case) -> tuple[str, int, str | None, str | None, float]:
        name, route, body, _, _ = case
        started = time.monotonic()
        status, param, code = send(client, route, body)
        return name, status, param, code, time.monotonic() - started

    watcher = threading.Thread(target=watch_ready)
    normals = [threading.Thread(target=run_normal) for _ in range(2)]
    for thread in (watcher, *normals):
        thread.start()
    try:
        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(run_hostile, HOSTILE))
    finally:
        stop.set()
        for thread in (watcher, *normals):
            thread.join(BUDGET_S)

    for (name, status, param, code, elapsed), (_, _, _, want, want_param) in zip(results, HOSTILE):
        print(f"{name}: {status} {param} {code} in {elapsed:.2f}s")
        assert elapsed < BUDGET_S, (name, elapsed)
        assert code == CODES.get(name, code), (name, code)
        if want == 200:
            assert status == 200, (name, status, param)
        elif want is None:
            assert status == 200 or 400 <= status < 500, (name, status, param)
        else:
            assert 400 <= status < 500, (name, status, param)
            if want_param is not None:
                assert param == want_param, (name, param)
    assert normal_latencies, "no normal request completed while the hostile ones ran"
    assert max(normal_latencies) <= 2 * alone + NORMAL_SLACK_S, (alone, normal_latencies)
    print(f"normal alone {alone:.2f}s; beside the hostile ones: {len(normal_latencies)} requests, "
          f"max {max(normal_latencies):.2f}s; /ready probes {len(readiness)}")
    assert readiness and all(status == 200 for status in readiness), readiness

    # Afterwards: healthy, serving, nothing leaked.
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    normal(client)
    server.wait_idle(timeout=30)
