"""vLLM's return_token_ids and prompt_logprobs on a real `kvsentry serve`, through the official client:
the ids are the tokens the text came from, streamed as vLLM streams them, and the prompt's logprobs
are transformers' own, position by position (the first has none)."""
from __future__ import annotations

import pytest
import torch

from tests.service.conftest import MAIN_MODEL_NAME

PROMPT = "Hello, my name is"
MESSAGES = [{"role": "user", "content": "Say something about caches."}]


def greedy(**kwargs) -> dict:
    return {"model": MAIN_MODEL_NAME, "temperature": 0.0, **kwargs}


def tokenize(http, **body) -> list[int]:
    return http.post("/tokenize", json={"model": MAIN_MODEL_NAME, **body}).json()["tokens"]


def detokenize(http, tokens: list[int]) -> str:
    return http.post("/detokenize", json={"model": MAIN_MODEL_NAME, "tokens": tokens}).json()["prompt"]


@pytest.fixture(scope="module")
def hf_model(llama_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()


@torch.inference_mode()
def reference_logprobs(model, tokens: list[int]) -> torch.Tensor:  # [len(tokens), vocab]: row i predicts i + 1
    return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


# -- return_token_ids ----------------------------------------------------------------------------------
def test_completion_returns_the_ids_of_prompt_and_text(openai_client, http):
    out = openai_client.completions.create(prompt=PROMPT, max_tokens=10, **greedy(
        extra_body={"return_token_ids": True, "ignore_eos": True}))
    choice = out.choices[0]
    assert choice.prompt_token_ids == tokenize(http, prompt=PROMPT)
    assert len(choice.token_ids) == out.usage.completion_tokens == 10
    assert detokenize(http, choice.token_ids) == choice.text


def test_without_the_flag_no_ids_are_returned(openai_client):
    out = openai_client.completions.create(prompt=PROMPT, max_tokens=3, **greedy())
    assert out.choices[0].token_ids is None and out.choices[0].prompt_token_ids is None
    chat = openai_client.chat.completions.create(messages=MESSAGES, max_tokens=3, **greedy())
    assert chat.choices[0].token_ids is None and chat.prompt_token_ids is None


def test_completion_stream_sends_the_prompt_ids_once_then_each_chunks_new_ids(openai_client):
    kwargs = greedy(prompt=PROMPT, max_tokens=12, n=2, extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = openai_client.completions.create(**kwargs)
    chunks = list(openai_client.completions.create(stream=True, **kwargs))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        prompt_ids = [c.prompt_token_ids for c in mine if getattr(c, "prompt_token_ids", None) is not None]
        assert prompt_ids == [whole.choices[index].prompt_token_ids]
        assert [t for c in mine for t in c.token_ids] == whole.choices[index].token_ids


def test_chat_returns_the_ids_streamed_or_not(openai_client, http):
    kwargs = greedy(messages=MESSAGES, max_tokens=10, extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = openai_client.chat.completions.create(**kwargs)
    assert whole.prompt_token_ids == tokenize(http, messages=MESSAGES)
    assert len(whole.choices[0].token_ids) == whole.usage.completion_tokens == 10
    assert detokenize(http, whole.choices[0].token_ids) == whole.choices[0].message.content
    chunks = list(openai_client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].prompt_token_ids == whole.prompt_token_ids
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    assert [t for c in chunks for choice in c.choices for t in choice.token_ids] == whole.choices[0].token_ids


def test_ids_survive_a_stop_string_held_back_while_streaming(openai_client):
    """The stream holds back text that might start a stop string; the ids still arrive, each once."""
    plain = openai_client.completions.create(prompt=PROMPT, max_tokens=8, **greedy(
        extra_body={"return_token_ids": True, "ignore_eos": True}))
    stop = plain.choices[0].text[-3:]
    kwargs = greedy(prompt=PROMPT, max_tokens=8, stop=[stop], extra_body={"return_token_ids": True,
                                                                           "ignore_eos": True})
    whole = openai_client.completions.create(**kwargs).choices[0]
    streamed = [t for c in openai_client.completions.create(stream=True, **kwargs) for choice in c.choices
                for t in choice.token_ids]
    assert streamed == whole.token_ids and whole.token_ids == plain.choices[0].token_ids[:len(whole.token_ids)]


# -- prompt_logprobs ----------------------------------------------------------------------------------
def check_prompt_logprobs(maps: list, prompt_ids: list[int], reference: torch.Tensor, num_top: int) -> None:
    assert len(maps) == len(prompt_ids) and maps[0] is None
    for position in range(1, len(prompt_ids)):
        entry = {int(token): value for token, value in maps[position].items()}
        row = reference[position - 1]
        token = prompt_ids[position]
        assert entry[token]["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        # vLLM's rank: 1 + the tokens strictly more likely (within the tolerance of the two computations).
        more_likely = [int((row > row[token] + slack).sum()) + 1 for slack in (1e-4, -1e-4)]
        assert more_likely[0] <= entry[token]["rank"] <= more_likely[1]
        top = sorted((v["logprob"] for t, v in entry.items() if t != token or v["rank"] <= num_top), reverse=True)
        assert top == pytest.approx(row.topk(num_top).values.tolist(), abs=1e-4)
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())


def test_completion_prompt_logprobs_match_transformers(openai_client, http, hf_model):
    prompt_ids = tokenize(http, prompt=PROMPT)
    out = openai_client.completions.create(prompt=PROMPT, max_tokens=2, **greedy(
        extra_body={"prompt_logprobs": 3}))
    check_prompt_logprobs(out.choices[0].prompt_logprobs, prompt_ids, reference_logprobs(hf_model, prompt_ids), 3)
    assert out.choices[0].logprobs is None  # only the prompt's were asked for


def test_chat_prompt_logprobs_match_transformers(openai_client, http, hf_model):
    prompt_ids = tokenize(http, messages=MESSAGES)
    out = openai_client.chat.completions.create(messages=MESSAGES, max_tokens=2, **greedy(
        extra_body={"prompt_logprobs": 1}))
    check_prompt_logprobs(out.prompt_logprobs, prompt_ids, reference_logprobs(hf_model, prompt_ids), 1)


def test_prompt_logprobs_are_whole_when_the_prompt_is_in_the_prefix_cache(openai_client, http, hf_model):
    """A cached prefix has no hidden states to read logprobs from: such a request prefills its whole
    prompt (as vLLM does), so a cache full of its prefix changes nothing."""
    prompt = "The cache keeps every block it has seen, " * 6
    prompt_ids = tokenize(http, prompt=prompt)
    first = openai_client.completions.create(prompt=prompt, max_tokens=1, **greedy())
    again = openai_client.completions.create(prompt=prompt, max_tokens=1, **greedy())
    assert first.choices[0].text == again.choices[0].text
    out = openai_client.completions.create(prompt=prompt, max_tokens=1, **greedy(extra_body={"prompt_logprobs": 0}))
    check_prompt_logprobs(out.choices[0].prompt_logprobs, prompt_ids, reference_logprobs(hf_model, prompt_ids), 0)


def test_echo_logprobs_and_prompt_logprobs_together(openai_client, http):
    prompt_ids = tokenize(http, prompt=PROMPT)
    out = openai_client.completions.create(prompt=PROMPT, max_tokens=2, logprobs=1, echo=True, **greedy(
        extra_body={"prompt_logprobs": 4}))
    choice = out.choices[0]
    assert all(top is None or len(top) <= 2 for top in choice.logprobs.top_logprobs)  # echo keeps its own N
    for position in range(1, len(prompt_ids)):
        entry = choice.prompt_logprobs[position]
        assert entry[str(prompt_ids[position])]["logprob"] == pytest.approx(
            choice.logprobs.token_logprobs[position], abs=1e-6)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_prompt_logprobs_refused_when_streaming(http, route):
    body = ({"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES})
    response = http.post(f"/v1/{'chat/completions' if route == 'chat' else 'completions'}",
                         json={"model": MAIN_MODEL_NAME, "stream": True, "prompt_logprobs": 1, **body})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt_logprobs"
