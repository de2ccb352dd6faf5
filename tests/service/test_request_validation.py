"""One validation path: the HTTP models take SamplingParams' bounds and defaults, every
sampling field reaches the engine under its own name, and a refusal names its field."""
from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest

from engine.config import EngineConfig
from engine.core.validation import InvalidRequest, validate_api_request, validate_prompt
from engine.sampling_params import LIMITS, SamplingParams
from service.errors import APIError, from_value_error
from service.generate import PromptInput, request_params
from service.protocol import (ENGINE_SAMPLING_FIELDS, GRAMMAR_FIELDS, TRANSPORT_FIELDS, ChatCompletionRequest,
                              CompletionRequest, SamplingFields, refused_fields)


def field_bounds(model: type, name: str) -> dict:
    bounds = {}
    for constraint in model.model_fields[name].metadata:
        bounds.update({key: getattr(constraint, key) for key in ("ge", "gt", "le", "lt") if hasattr(constraint, key)})
    return bounds


@pytest.fixture(scope="module")
def config(llama_path) -> EngineConfig:
    return EngineConfig.create(llama_path, max_model_len=64, kv_cache_memory="4MiB", dtype="float32")


def test_every_request_field_reaches_the_engine_or_changes_no_tokens():
    # A field is passed to the engine, turned into its grammar, changes no tokens, or is refused.
    refused = refused_fields(SamplingFields)
    assert refused >= {"logit_bias", "guided_json"}
    assert set(SamplingFields.model_fields) == set(ENGINE_SAMPLING_FIELDS) | TRANSPORT_FIELDS | GRAMMAR_FIELDS | refused
    assert not set(ENGINE_SAMPLING_FIELDS) & TRANSPORT_FIELDS
    engine_fields = {f.name for f in msgspec.structs.fields(SamplingParams)}
    # The rest of SamplingParams is what each endpoint passes itself.
    assert engine_fields - set(ENGINE_SAMPLING_FIELDS) == {"max_tokens", "logprobs", "prompt_logprobs",
                                                           "structured_outputs"}


@pytest.mark.parametrize("model, name, engine_name", [
    *[(CompletionRequest, name, name) for name in LIMITS if name in CompletionRequest.model_fields],
    (ChatCompletionRequest, "top_logprobs", "logprobs"),
    (ChatCompletionRequest, "max_completion_tokens", "max_tokens"),
])
def test_http_bounds_are_the_engines(model, name, engine_name):
    expected = LIMITS[engine_name].as_field()
    if name == "n":
        expected = {**expected, "le": field_bounds(model, name)["le"]}  # plus the per-request choice cap
    assert field_bounds(model, name) == expected


def test_http_defaults_are_the_engines():
    request, engine = CompletionRequest(prompt="x"), SamplingParams()
    for name in ENGINE_SAMPLING_FIELDS + ("max_tokens", "logprobs"):
        if name not in ("stop", "stop_token_ids"):  # None there: the engine's empty list
            assert getattr(request, name) == getattr(engine, name), name


def test_every_field_is_passed_through(config):
    body = {"prompt": "x", "n": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1, "seed": 11,
            "stop": "end", "stop_token_ids": [3], "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "repetition_penalty": 1.5, "ignore_eos": True, "min_tokens": 2, "include_stop_str_in_output": True,
            "skip_special_tokens": False, "max_tokens": 5, "logprobs": 3}
    request = CompletionRequest.model_validate(body)
    params = request_params(SimpleNamespace(config=config), request, [PromptInput([1, 2])],
                            max_tokens=request.max_tokens, logprobs=request.logprobs)
    del body["prompt"]
    assert params == SamplingParams(**{**body, "stop": ["end"]})


def test_unset_max_tokens_fills_the_context(config):
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    params = request_params(SimpleNamespace(config=config), request, [PromptInput([1] * 10)],
                            max_tokens=None, logprobs=None, param="messages")
    assert params.max_tokens == config.max_model_len - 10


@pytest.mark.parametrize("prompt, max_tokens, stop_ids, param, code", [
    ([], 1, [], "messages", "invalid_value"),
    ([1, 10**6], 1, [], "messages", "invalid_token_id"),
    ([1] * 64, 1, [], "messages", "context_length_exceeded"),
    ([1] * 60, 5, [], "max_tokens", "context_length_exceeded"),
    ([1], 1, [10**6], "stop_token_ids", "invalid_value"),
])
def test_refusals_name_the_field(config, prompt, max_tokens, stop_ids, param, code):
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                    "stop_token_ids": stop_ids})
    with pytest.raises(APIError) as caught:
        request_params(SimpleNamespace(config=config), request, [PromptInput(prompt)], max_tokens=max_tokens,
                       logprobs=None, param="messages")
    error = caught.value
    assert (error.status, error.param, error.code) == (400, param, code)
    assert error.message.startswith(f"{param}: ")


def test_the_engine_and_the_http_layer_refuse_a_prompt_with_one_rule(config):
    with pytest.raises(InvalidRequest) as caught:
        validate_prompt(config, [1] * config.max_model_len)
    assert str(caught.value).startswith("prompt: ") and "max_model_len" in str(caught.value)
    error = from_value_error(caught.value)
    assert (error.param, error.code, error.message) == ("prompt", "context_length_exceeded", str(caught.value))
    validate_api_request(config, 10, SamplingParams(max_tokens=config.max_model_len - 10))
