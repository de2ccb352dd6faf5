"""Whatever a client sends, it gets a proper error (status + OpenAI error shape), and the
server keeps serving with no KV blocks leaked."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx
import pytest

from tests.service.conftest import MAIN_MAX_MODEL_LEN, MAIN_MODEL_NAME

OK = {"prompt": "hello", "max_tokens": 2}
CHAT_OK = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@dataclass
class Case:
    name: str
    body: object = None                      # JSON body (merged into OK unless raw/replace)
    status: int = 400
    param: str | None = "?"                  # "?" = do not check
    path: str = "/v1/completions"
    raw: bytes | None = None                 # exact bytes to send instead of JSON
    headers: dict = field(default_factory=dict)
    method: str = "POST"
    auth: bool = True
    message: str | None = None               # substring the message must contain


def completion(name: str, status: int = 400, param: str | None = "?", message: str | None = None,
               **fields) -> Case:
    return Case(name, {**OK, **fields}, status, param, message=message)


def chat(name: str, status: int = 400, param: str | None = "?", message: str | None = None, **fields) -> Case:
    return Case(name, {**CHAT_OK, **fields}, status, param, path="/v1/chat/completions", message=message)


CASES = [
    # wrong types
    completion("max_tokens_string", max_tokens="abc", param="max_tokens"),
    completion("max_tokens_numeric_string", max_tokens="5", param="max_tokens"),
    completion("max_tokens_float", max_tokens=2.5, param="max_tokens"),
    completion("temperature_list", temperature=[1], param="temperature"),
    completion("prompt_number", prompt=5, param="prompt"),
    completion("prompt_mixed_list", prompt=[1, "a"], param="prompt"),
    completion("prompt_null", prompt=None, param="prompt"),
    completion("stream_string", stream="yes", param="stream"),
    completion("stop_number", stop=5, param="stop"),
    completion("stream_options_string", stream_options="usage", param="stream_options"),
    completion("n_bool", n=True, param="n"),
    # out of range
    completion("n_zero", n=0, param="n"),
    completion("n_negative", n=-1, param="n"),
    completion("n_huge", n=10**6, param="n"),
    completion("choices_over_limit", prompt=["a"] * 65, n=2, param="n"),
    completion("max_tokens_zero", max_tokens=0, param="max_tokens"),
    completion("max_tokens_negative", max_tokens=-5, param="max_tokens"),
    completion("max_tokens_huge", max_tokens=10**12, param="max_tokens", message=str(MAIN_MAX_MODEL_LEN)),
    completion("temperature_negative", temperature=-1.0, param="temperature"),
    completion("top_p_zero", top_p=0.0, param="top_p"),
    completion("top_p_above_one", top_p=1.5, param="top_p"),
    completion("top_k_negative", top_k=-5, param="top_k"),
    completion("min_p_above_one", min_p=2.0, param="min_p"),
    completion("logprobs_21", logprobs=21, param="logprobs"),
    completion("logprobs_negative", logprobs=-1, param="logprobs"),
    completion("presence_penalty_big", presence_penalty=5.0, param="presence_penalty"),
    completion("frequency_penalty_small", frequency_penalty=-3.0, param="frequency_penalty"),
    completion("repetition_penalty_zero", repetition_penalty=0.0, param="repetition_penalty"),
    completion("seed_over_64_bits", seed=2**70, param="seed"),
    completion("stop_empty_string", stop=[""], param="stop"),
    completion("stop_token_ids_negative", stop_token_ids=[-1], param="stop_token_ids"),
    completion("stop_token_ids_out_of_vocab", stop_token_ids=[10**6], param="stop_token_ids"),
    completion("min_tokens_over_max", min_tokens=10, max_tokens=2, param="min_tokens"),
    # prompts
    completion("prompt_empty_list", prompt=[], param="prompt"),
    completion("prompt_empty_token_list", prompt=[[]], param="prompt"),
    completion("prompt_over_long", prompt=[7] * MAIN_MAX_MODEL_LEN, param="prompt", message=str(MAIN_MAX_MODEL_LEN)),
    completion("prompt_plus_max_tokens_too_long", prompt=[7] * (MAIN_MAX_MODEL_LEN - 10), max_tokens=11,
               param="max_tokens", message=f"maximum context length is {MAIN_MAX_MODEL_LEN}"),
    completion("token_id_negative", prompt=[1, -1], param="prompt"),
    completion("token_id_out_of_vocab", prompt=[1, 512], param="prompt"),
    completion("token_id_huge", prompt=[[2**70]], param="prompt"),
    Case("lone_surrogate", raw=b'{"prompt": "\\ud800abc", "max_tokens": 2}', param="prompt"),
    # bodies
    Case("malformed_json", raw=b'{"prompt": "x", ', param=None),
    Case("bad_utf8", raw=b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}', param=None),
    Case("nan_literal", raw=b'{"prompt": "x", "temperature": NaN}', param="temperature"),
    Case("json_array_body", raw=b"[1, 2]", param=None),
    Case("empty_body", raw=b"", param=None),
    Case("missing_prompt", {"max_tokens": 2}, param="prompt"),
    Case("unknown_field_is_named", {**OK, "frobnicate": {"x": 1}}, param="frobnicate",
         message="Unrecognized request argument supplied: frobnicate"),
    Case("unknown_fields_are_all_named", {**OK, "frobnicate": 1, "logit_bias_v2": 3}, param="frobnicate",
         message="Unrecognized request arguments supplied: frobnicate, logit_bias_v2"),
    Case("harmless_fields_are_accepted", {**OK, "user": "u", "metadata": {"k": "v"}, "store": False,
                                          "service_tier": "auto", "safety_identifier": "s", "prompt_cache_key": "p"},
         status=200),
    completion("harmless_field_wrong_type", metadata={"k": 1}, param="metadata.k"),
    Case("wrong_content_type", raw=json.dumps(OK).encode(), headers={"Content-Type": "text/plain"}, status=415),
    Case("form_content_type", raw=b"prompt=x", headers={"Content-Type": "application/x-www-form-urlencoded"},
         status=415),
    completion("prompt_text_far_too_long", prompt="hello " * 400_000, param="prompt",
               message="cannot fit"),
    Case("oversized_body", {**OK, "prompt": "x" * (5 * 2**20)}, status=413),
    Case("missing_api_key", OK, status=401, auth=False),
    Case("wrong_api_key", OK, status=401, auth=False, headers={"Authorization": "Bearer nope"}),
    Case("unknown_model", {**OK, "model": "gpt-nope"}, status=404, param="model"),
    Case("get_on_post_route", method="GET", status=405, param=None),
    Case("unknown_route", OK, path="/v1/nothing", status=404, param=None),
    Case("fault_injection_disabled", {"kind": "nan"}, path="/debug/faults", status=404, param=None),
    # chat
    chat("chat_messages_empty", messages=[], param="messages"),
    chat("chat_role_missing", messages=[{"content": "hi"}], param="messages.0.role"),
    chat("chat_content_number", messages=[{"role": "user", "content": 5}], param="messages.0.content"),
    chat("chat_image_part", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
         param="messages.0.content", message="only text parts are supported"),
    chat("chat_top_logprobs_without_logprobs", top_logprobs=2, param="top_logprobs"),
    chat("chat_top_logprobs_21", logprobs=True, top_logprobs=21, param="top_logprobs"),
    chat("chat_max_completion_tokens_negative", max_completion_tokens=-1, param="max_completion_tokens"),
    chat("chat_logprobs_int", logprobs=3, param="logprobs"),
    chat("chat_unknown_field", foo=1, param="foo", message="Unrecognized request argument supplied: foo"),
    chat("chat_unknown_message_field", messages=[{"role": "user", "content": "hi", "foo": 1}],
         param="messages.0.foo", message="Unrecognized request argument supplied: messages.0.foo"),
    chat("chat_text_part_with_an_image", messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi", "image_url": {"url": "x"}}]}], param="messages.0.content",
         message="with image_url"),
    chat("chat_unknown_content_part_field", messages=[{"role": "user", "content": [{"type": "text", "text": "hi",
                                                                                   "foo": 1}]}],
         param="messages.0.content.0.foo"),
    chat("chat_unknown_tool_field", tools=[{"type": "function", "function": {"name": "f"}, "foo": 1}],
         param="tools.0.foo"),
    chat("chat_too_long", messages=[{"role": "user", "content": "word " * MAIN_MAX_MODEL_LEN}], param="messages"),
    # tokenizer routes
    Case("detokenize_bad_ids", {"tokens": [-1]}, path="/detokenize", param="tokens"),
    Case("detokenize_wrong_type", {"tokens": "abc"}, path="/detokenize", param="tokens"),
    Case("tokenize_nothing", {}, path="/tokenize", param="prompt"),
]


def send(server, case: Case) -> httpx.Response:
    headers = dict(case.headers)
    if case.auth:
        headers.setdefault("Authorization", f"Bearer {server.api_key}")
    url = server.url + case.path
    if case.method == "GET":
        return httpx.get(url, headers=headers, timeout=30)
    if case.raw is not None:
        headers.setdefault("Content-Type", "application/json")
        return httpx.post(url, content=case.raw, headers=headers, timeout=30)
    return httpx.post(url, json=case.body, headers=headers, timeout=30)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(server, case: Case):
    response = send(server, case)
    assert response.status_code == case.status, response.text
    body = response.json()
    if case.status == 200:
        assert body["choices"][0]["finish_reason"] in ("length", "stop")
        return
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    if case.param != "?":
        assert error["param"] == case.param, body
    if case.message:
        assert case.message in error["message"], body
    if error["message"].startswith("Unrecognized request argument"):  # OpenAI's words, type and code
        assert (error["type"], error["code"]) == ("invalid_request_error", "unknown_parameter"), body
    assert response.headers.get("x-request-id")


def test_no_content_type(server):
    response = httpx.post(server.url + "/v1/completions", content=json.dumps(OK).encode(),
                          headers={"Authorization": f"Bearer {server.api_key}", "Content-Type": ""}, timeout=30)
    assert response.status_code in (400, 415) and "error" in response.json()


def test_server_still_serves_and_leaks_nothing(server, openai_client):
    server.wait_idle()
    out = openai_client.completions.create(model=MAIN_MODEL_NAME, prompt="still alive", max_tokens=4)
    assert out.choices[0].finish_reason in ("length", "stop")
    server.wait_idle()
    assert server.metric("kvsentry_http_requests_total", route="/v1/completions", status="500") == []
    assert server.proc.poll() is None
