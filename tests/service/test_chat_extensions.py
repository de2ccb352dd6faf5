"""vLLM's chat extensions over HTTP, on a server started with vLLM's flags (--chat-template,
--trust-request-chat-template, --disable-log-requests, --max-logprobs): chat_template_kwargs,
reasoning_effort and documents reach the template,
continue_final_message continues the last turn, echo prefixes the reply as vLLM does, a request's
own chat_template needs --trust-request-chat-template, and --chat-template replaces the
checkpoint's. What a request renders is read back through /tokenize, and a completion's
prompt_tokens show the generation used that same prompt."""
from __future__ import annotations

import json

import pytest

from tests.service.server_process import ServerProcess

# Reads enable_thinking and reasoning_effort, as Qwen3's and gpt-oss's templates do.
TEMPLATE = (
    "{{ bos_token }}"
    "{% if reasoning_effort is defined %}<|im_start|>system\nReasoning: {{ reasoning_effort }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
ASK = [{"role": "user", "content": "Name a colour."}]
PREFILL = [*ASK, {"role": "assistant", "content": "My favourite colour is"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}
GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def trusting(llama_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    template = logs / "template.jinja"
    template.write_text(TEMPLATE)
    proc = ServerProcess(llama_path, "--threads", "1", "--max-model-len", "1024", "--chat-template", str(template),
                         "--trust-request-chat-template", "--disable-log-requests", "--max-logprobs", "2", log_dir=logs)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def http(trusting):
    with trusting.client() as client:
        yield client


def rendered(http, **body) -> str:
    """The prompt text a chat request renders (through /tokenize and back)."""
    out = http.post("/tokenize", json=body)
    assert out.status_code == 200, out.text
    return http.post("/detokenize", json={"tokens": out.json()["tokens"]}).json()["prompt"]


def chat(http, **body) -> dict:
    out = http.post("/v1/chat/completions", json={**GREEDY, **body})
    assert out.status_code == 200, out.text
    return out.json()


def refused(http, path: str = "/v1/chat/completions", **body) -> dict:
    out = http.post(path, json={**({"max_tokens": 2} if path.startswith("/v1") else {}), **body})
    assert out.status_code == 400, out.text
    return out.json()["error"]


def prompt_tokens(http, **body) -> int:
    return http.post("/tokenize", json=body).json()["count"]


def test_server_chat_template_replaces_the_checkpoints(http):
    assert rendered(http, messages=ASK).endswith("user\nName a colour.\nassistant\n")


def test_chat_template_kwargs_reach_the_template(http):
    plain = rendered(http, messages=ASK)
    no_thinking = rendered(http, messages=ASK, chat_template_kwargs={"enable_thinking": False})
    assert "<think>" not in plain and no_thinking == plain + "<think>\n\n</think>\n\n"
    # The generation runs on that prompt.
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    assert chat(http, messages=ASK, **kwargs)["usage"]["prompt_tokens"] == \
        prompt_tokens(http, messages=ASK, **kwargs) > prompt_tokens(http, messages=ASK)


def test_chat_template_kwargs_the_template_does_not_read_are_refused(http):
    error = refused(http, messages=ASK, chat_template_kwargs={"enable_thinkin": False})
    assert error["param"] == "chat_template_kwargs" and "enable_thinkin" in error["message"]
    error = refused(http, messages=ASK, chat_template_kwargs={"add_generation_prompt": False})
    assert error["param"] == "chat_template_kwargs" and "set by the server" in error["message"]


def test_reasoning_effort_reaches_a_template_that_reads_it(http):
    assert "Reasoning: high" in rendered(http, messages=ASK, chat_template_kwargs={"reasoning_effort": "high"})
    assert chat(http, messages=ASK, reasoning_effort="low")["usage"]["prompt_tokens"] == \
        prompt_tokens(http, messages=ASK, chat_template_kwargs={"reasoning_effort": "low"})
    assert refused(http, messages=ASK, reasoning_effort="extreme")["param"] == "reasoning_effort"


def test_reasoning_effort_is_refused_where_the_template_does_not_read_it(http):
    error = refused(http, messages=ASK, reasoning_effort="high", chat_template="{{ messages[0]['content'] }}")
    assert error["param"] == "reasoning_effort"


def test_continue_final_message_ends_inside_the_last_turn(http):
    text = rendered(http, messages=PREFILL, **CONTINUE)
    assert text.endswith("assistant\nMy favourite colour is")
    closed = rendered(http, messages=PREFILL, add_generation_prompt=False)
    assert closed.startswith(text) and closed != text  # without it, the turn is closed
    error = refused(http, messages=PREFILL, continue_final_message=True)  # add_generation_prompt defaults to true
    assert error["message"] == "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    assert error["param"] == "continue_final_message"


def test_echo_prefixes_the_continued_message(http):
    plain = chat(http, messages=PREFILL, **CONTINUE)["choices"][0]["message"]["content"]
    echoed = chat(http, messages=PREFILL, echo=True, **CONTINUE)["choices"][0]["message"]["content"]
    assert echoed == "My favourite colour is" + plain
    # After a generation prompt the reply is the assistant's and the last turn the user's: no echo.
    assert chat(http, messages=ASK, echo=True)["choices"][0]["message"]["content"] == \
        chat(http, messages=ASK)["choices"][0]["message"]["content"]


def test_echo_streams_the_prefix_first(trusting):
    client = trusting.openai()
    model = client.models.list().data[0].id
    body = {"echo": True, **CONTINUE, "ignore_eos": True}
    chunks = list(client.chat.completions.create(model=model, messages=PREFILL, stream=True, temperature=0,
                                                 max_tokens=6, extra_body=body))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert pieces[0] == "My favourite colour is"
    whole = client.chat.completions.create(model=model, messages=PREFILL, temperature=0, max_tokens=6, extra_body=body)
    assert "".join(pieces) == whole.choices[0].message.content


def test_request_chat_template_on_a_trusting_server(http):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert rendered(http, messages=ASK, chat_template=template) == "[user] Name a colour.\n"
    assert chat(http, messages=ASK, chat_template=template)["usage"]["prompt_tokens"] == \
        prompt_tokens(http, messages=ASK, chat_template=template)
    assert refused(http, messages=ASK, chat_template="{% for %}")["param"] == "messages"



def test_request_chat_template_needs_the_flag(server):
    """The session's server runs without --trust-request-chat-template: vLLM's refusal, by either way in."""
    with server.client() as plain:
        for body in ({"chat_template": "{{ 'x' }}"}, {"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}):
            for path in ("/v1/chat/completions", "/tokenize"):
                error = refused(plain, path, messages=ASK, **body)
                assert error["message"].startswith("Chat template is passed with request, but "
                                                   "--trust-request-chat-template is not set"), error
        # The checkpoint's template reads no reasoning_effort: refused rather than dropped.
        assert refused(plain, messages=ASK, reasoning_effort="high")["param"] == "reasoning_effort"


def test_add_special_tokens_puts_the_tokenizers_own_on_top(http):
    plain = http.post("/tokenize", json={"messages": ASK}).json()["tokens"]
    special = http.post("/tokenize", json={"messages": ASK, "add_special_tokens": True}).json()["tokens"]
    assert len(special) > len(plain) and special[-len(plain):] == plain
    assert chat(http, messages=ASK)["usage"]["prompt_tokens"] == len(plain)  # vLLM's default: the template's only
    assert chat(http, messages=ASK, add_special_tokens=True)["usage"]["prompt_tokens"] == len(special)


def test_documents_reach_a_template_that_reads_them(http):
    template = "{% for d in documents %}<doc>{{ d['text'] }}</doc>{% endfor %}{{ messages[-1]['content'] }}"
    docs = [{"title": "Paris", "text": "Paris is in France."}]
    assert rendered(http, messages=ASK, chat_template=template, chat_template_kwargs={"documents": docs}) == \
        "<doc>Paris is in France.</doc>Name a colour."
    assert chat(http, messages=ASK, chat_template=template, documents=docs)["usage"]["prompt_tokens"] == \
        prompt_tokens(http, messages=ASK, chat_template=template, chat_template_kwargs={"documents": docs})
    assert refused(http, messages=ASK, documents=docs)["param"] == "documents"


def test_disable_log_requests_drops_the_per_request_line(trusting, http):
    """vLLM's --disable-log-requests (this server's): the served request leaves no info line."""
    chat(http, messages=ASK)
    events = [json.loads(line) for line in trusting.log_text().splitlines() if line.startswith("{")]
    assert any(e.get("event") == "serving" for e in events)  # the log is there, at info
    assert not [e for e in events if e.get("event") == "request"]


def test_max_logprobs_caps_what_a_request_may_ask(http):
    """vLLM's --max-logprobs (2 on this server), on both endpoints."""
    error = refused(http, messages=ASK, logprobs=True, top_logprobs=3)
    assert error["param"] == "top_logprobs" and "--max-logprobs" in error["message"]
    error = refused(http, "/v1/completions", prompt="hi", logprobs=3)
    assert error["param"] == "logprobs" and "--max-logprobs" in error["message"]
    out = chat(http, messages=ASK, logprobs=True, top_logprobs=2)
    assert all(len(entry["top_logprobs"]) == 2 for entry in out["choices"][0]["logprobs"]["content"])


def test_continue_final_message_through_templates_that_reshape_the_text(http):
    trims = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</{{ m['role'] }}>{% endfor %}"
    spaced = [*ASK, {"role": "assistant", "content": "My favourite colour is "}]
    assert rendered(http, messages=spaced, chat_template=trims, **CONTINUE) == \
        "<user>Name a colour.</user><assistant>My favourite colour is"
    shouts = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    error = refused(http, messages=PREFILL, chat_template=shouts, **CONTINUE)
    assert error["param"] == "continue_final_message" and "cannot be continued" in error["message"]
