"""The OpenAI protocol end to end: the official client against a real `kvsentry serve`."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.service.conftest import MAIN_MAX_MODEL_LEN, MAIN_MODEL_NAME

PROMPT = "Hello, my name is"


def greedy(**kwargs) -> dict:
    return {"model": MAIN_MODEL_NAME, "temperature": 0.0, **kwargs}


def test_completion(openai_client):
    out = openai_client.completions.create(prompt=PROMPT, max_tokens=8, **greedy())
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.model == MAIN_MODEL_NAME
    assert len(out.choices) == 1 and out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.prompt_tokens > 0 and out.usage.completion_tokens <= 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_default_max_tokens_is_16(openai_client):
    out = openai_client.completions.create(model=MAIN_MODEL_NAME, prompt=PROMPT,
                                           extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"


def test_streaming_matches_non_streaming(openai_client):
    kwargs = greedy(prompt=PROMPT, max_tokens=12, extra_body={"ignore_eos": True})
    whole = openai_client.completions.create(**kwargs).choices[0].text
    chunks = list(openai_client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-2].choices[0].finish_reason == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 12


def test_n_and_multiple_prompts_are_indexed_like_openai(openai_client):
    out = openai_client.completions.create(prompt=[PROMPT, "the model"], n=2, max_tokens=4, seed=7,
                                           model=MAIN_MODEL_NAME, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 16
    stream = openai_client.completions.create(prompt=[PROMPT, "the model"], n=2, max_tokens=4, seed=7,
                                              model=MAIN_MODEL_NAME, stream=True, extra_body={"ignore_eos": True})
    texts: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {c.index: c.text for c in out.choices}


def test_token_id_prompts(openai_client, http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = openai_client.completions.create(prompt=PROMPT, max_tokens=6, **greedy())
    by_ids = openai_client.completions.create(prompt=ids, max_tokens=6, **greedy())
    batch = openai_client.completions.create(prompt=[ids, ids], max_tokens=6, **greedy())
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert [c.text for c in batch.choices] == [by_text.choices[0].text] * 2


def test_stop_string_cuts_the_text(openai_client):
    full = openai_client.completions.create(prompt=PROMPT, max_tokens=24, **greedy(extra_body={"ignore_eos": True}))
    text = full.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), "need a non-blank stop string from the text"
    for stream in (False, True):
        out = openai_client.completions.create(prompt=PROMPT, max_tokens=24, stop=[stop], stream=stream,
                                               **greedy(extra_body={"ignore_eos": True}))
        got = "".join(c.choices[0].text for c in out if c.choices) if stream else out.choices[0].text
        assert got == text[:text.index(stop)]
        if not stream:
            assert out.choices[0].finish_reason == "stop" and out.choices[0].model_extra["stop_reason"] == stop


def test_stop_token_ids(openai_client, llama_path):
    from engine import LLM, SamplingParams
    with LLM(llama_path, kv_cache_memory="64MiB", dtype="float32") as llm:
        ids = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0].outputs[0].token_ids
    stop_id = ids[2]
    stopped = openai_client.completions.create(
        prompt=PROMPT, max_tokens=16, **greedy(extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]}))
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop_id
    assert stopped.usage.completion_tokens == ids.index(stop_id) + 1


def test_logprobs_and_echo(openai_client, http):
    out = openai_client.completions.create(prompt=PROMPT, max_tokens=5, logprobs=3, **greedy())
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    assert all(abs(max(top.values()) - v) < 1e-5 for top, v in zip(lp.top_logprobs, lp.token_logprobs))

    prompt_ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    echoed = openai_client.completions.create(prompt=PROMPT, max_tokens=5, logprobs=2, echo=True, **greedy())
    choice = echoed.choices[0]
    assert choice.text == PROMPT + out.choices[0].text
    elp = choice.logprobs
    assert len(elp.tokens) == len(prompt_ids) + 5
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in elp.token_logprobs[1:])
    assert elp.token_logprobs[len(prompt_ids):] == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_echo_streaming(openai_client):
    whole = openai_client.completions.create(prompt=PROMPT, max_tokens=6, echo=True, **greedy())
    chunks = openai_client.completions.create(prompt=PROMPT, max_tokens=6, echo=True, stream=True, **greedy())
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_seed_reproducibility(openai_client):
    kwargs = {"model": MAIN_MODEL_NAME, "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0,
              "extra_body": {"ignore_eos": True}}
    a = openai_client.completions.create(seed=1234, **kwargs).choices[0].text
    b = openai_client.completions.create(seed=1234, **kwargs).choices[0].text
    c = openai_client.completions.create(seed=4321, **kwargs).choices[0].text
    assert a == b
    assert a != c


def test_chat(openai_client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    out = openai_client.chat.completions.create(messages=messages, max_tokens=8, **greedy())
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason in ("stop", "length")
    chunks = list(openai_client.chat.completions.create(messages=messages, max_tokens=8, stream=True,
                                                        stream_options={"include_usage": True}, **greedy()))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_chat_n_logprobs_and_max_completion_tokens(openai_client):
    out = openai_client.chat.completions.create(
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello"}]}], n=2, seed=3,
        max_completion_tokens=6, logprobs=True, top_logprobs=2, model=MAIN_MODEL_NAME,
        extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    for choice in out.choices:
        content = choice.logprobs.content
        assert len(content) == 6
        assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 and entry.bytes for entry in content)


def test_chat_default_max_tokens_fills_the_context(http):
    # No max_tokens: generate up to max_model_len. A long prompt keeps that short.
    messages = [{"role": "user", "content": " ".join(["word"] * 4000)}]
    prompt_len = http.post("/tokenize", json={"messages": messages}).json()["count"]
    assert 4000 < prompt_len < MAIN_MAX_MODEL_LEN - 4
    out = http.post("/v1/chat/completions", json={"messages": messages, "temperature": 0, "ignore_eos": True}).json()
    assert out["usage"]["completion_tokens"] == MAIN_MAX_MODEL_LEN - prompt_len
    assert out["choices"][0]["finish_reason"] == "length"


def test_models_tokenize_detokenize_version(server, http, openai_client):
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [MAIN_MODEL_NAME, "alias"]
    tok = http.post("/tokenize", json={"prompt": PROMPT, "model": "alias"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAIN_MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == PROMPT
    chat_tok = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat_tok["count"] > 3
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_request_id_is_echoed_and_logged(server, http):
    response = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                         headers={"X-Request-Id": "trace-abc-123"})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "trace-abc-123"
    assert response.json()["id"] == "cmpl-trace-abc-123"
    assert http.get("/v1/models").headers["x-request-id"]  # one is made up when none is given
    lines = [json.loads(line) for line in server.log_text().splitlines() if line.startswith("{")]
    logged = [entry for entry in lines if entry.get("event") == "request" and entry.get("id") == "trace-abc-123"]
    assert logged and logged[0]["prompt_tokens"] > 0 and logged[0]["completion_tokens"] == 2
    assert "latency_s" in logged[0] and logged[0]["finish_reasons"] == ["length"]
    assert PROMPT not in server.log_text(), "prompt text is logged only with --log-prompts"


def metric_totals(server, series: dict[str, dict[str, str]]) -> dict[str, float]:
    return {name: sum(server.metric(name, **labels)) for name, labels in series.items()}


def test_request_metrics_count_one_completion(server, openai_client):
    model = {"model_name": MAIN_MODEL_NAME}
    series = {
        "kvsentry_prompt_tokens_total": model, "kvsentry_generation_tokens_total": model,
        "kvsentry_time_to_first_token_seconds_count": model, "kvsentry_e2e_request_latency_seconds_count": model,
        "kvsentry_inter_token_latency_seconds_count": model, "kvsentry_request_queue_time_seconds_count": model,
        "kvsentry_request_success_total": {**model, "finished_reason": "length"},
        "kvsentry_http_requests_total": {**model, "route": "/v1/completions", "status": "200"},
        "kvsentry_http_request_duration_seconds_count": {**model, "route": "/v1/completions"},
    }
    server.wait_idle()
    before = metric_totals(server, series)
    out = openai_client.completions.create(prompt=PROMPT, max_tokens=3, **greedy(extra_body={"ignore_eos": True}))
    assert out.usage.prompt_tokens > 0 and out.usage.completion_tokens == 3
    expected = {name: 1.0 for name in series}
    expected |= {"kvsentry_prompt_tokens_total": out.usage.prompt_tokens, "kvsentry_generation_tokens_total": 3,
                 "kvsentry_inter_token_latency_seconds_count": 2}  # one gap between each two of the 3 tokens
    # The HTTP series are counted after the response went out: give them a moment.
    deadline = time.monotonic() + 5
    while (added := {k: v - before[k] for k, v in metric_totals(server, series).items()}) != expected:
        assert time.monotonic() < deadline, f"metric increments {added}, expected {expected}"
        time.sleep(0.05)


def test_rank_gauges_follow_a_running_request(server, http):
    rank = {"model_name": MAIN_MODEL_NAME, "engine": "0"}

    def gauges() -> tuple[list[float], list[float], list[float]]:
        return tuple(server.metric(name, **rank) for name in (
            "kvsentry_num_requests_running", "kvsentry_num_requests_waiting", "kvsentry_kv_cache_usage_perc"))

    server.wait_idle()
    assert gauges() == ([0.0], [0.0], [0.0])
    body = {"model": MAIN_MODEL_NAME, "prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = (line for line in response.iter_lines() if line)  # kept: closing it hangs up
        assert next(events).startswith("data: {")
        deadline = time.monotonic() + 5
        while (running := gauges())[0] != [1.0]:
            assert time.monotonic() < deadline, f"running, waiting, kv usage: {running}"
            time.sleep(0.05)
        _, waiting, usage = running
        assert waiting == [0.0] and len(usage) == 1 and 0.0 < usage[0] <= 1.0, running
    server.wait_idle()  # hanging up aborted the request
    assert gauges() == ([0.0], [0.0], [0.0])


def test_health_and_ready(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/ready").status_code == 200


def test_greedy_text_matches_offline_llm(openai_client, llama_path):
    from engine import LLM, SamplingParams
    prompts = [PROMPT, "the model of a server", "1 2 3"]
    http_texts = [c.text for c in sorted(
        openai_client.completions.create(prompt=prompts, max_tokens=24,
                                         **greedy(extra_body={"ignore_eos": True})).choices,
        key=lambda c: c.index)]
    with LLM(llama_path, kv_cache_memory="64MiB", max_model_len=MAIN_MAX_MODEL_LEN, dtype="float32") as llm:
        offline = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert http_texts == [o.outputs[0].text for o in offline]


def test_unknown_model_is_404(openai_client):
    with pytest.raises(openai.NotFoundError) as info:
        openai_client.completions.create(model="gpt-nope", prompt=PROMPT, max_tokens=2)
    assert info.value.body["param"] == "model"


def test_stop_strings_with_n_stop_each_sample_upstream(server, openai_client):
    stops = [" ", "e", "a"]
    out = openai_client.completions.create(model=MAIN_MODEL_NAME, prompt=PROMPT, n=2, seed=11, max_tokens=3000,
                                           stop=stops, extra_body={"ignore_eos": True})
    assert len(out.choices) == 2
    for choice in out.choices:
        assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] in stops
        assert not any(s in choice.text for s in stops)
    server.wait_idle(timeout=3)  # both samples were stopped in the engine, not left to run 3000 tokens


def test_stream_chunks_match_the_protocol_models(http):
    from service.protocol import ChatCompletionChunk, CompletionResponse
    for path, body, model in (
            ("/v1/completions", {"prompt": [PROMPT, "x"], "n": 2, "logprobs": 2, "echo": True}, CompletionResponse),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2, "logprobs": True,
                                      "top_logprobs": 1}, ChatCompletionChunk)):
        stream_body = {**body, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", path, json=stream_body) as response:
            payloads = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert payloads[-1] == "[DONE]"
        chunks = [model.model_validate_json(p) for p in payloads[:-1]]
        assert chunks[-1].usage is not None and chunks[-1].choices == []
        finishes = [c for chunk in chunks for c in chunk.choices if c.finish_reason]
        assert sorted(c.index for c in finishes) == list(range(4 if path == "/v1/completions" else 2))
