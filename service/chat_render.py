"""A chat request's messages through a chat template into a prompt, with vLLM's extensions:

- `chat_template`: the request's own template, only on a server started with
  --trust-request-chat-template (a template is code the server runs); else a 400, in vLLM's words.
- `chat_template_kwargs`: extra variables of the template (`enable_thinking`, ...). A name the
  template never reads would change nothing, so it is a 400 naming it, as is a name the
  server sets itself (messages, tools, add_generation_prompt, ...).
- `reasoning_effort`, `documents`: the template variables of those names, as vLLM passes
  them; a 400 where the template does not read them.
- `add_special_tokens`: the tokenizer's special tokens (BOS) on top of what the template writes.
- `continue_final_message`: the prompt ends inside the final message (a prefill the model
  continues); it excludes `add_generation_prompt`, with vLLM's error when both are set.

The template is the request's, else the server's --chat-template, else the checkpoint's.
"""
from __future__ import annotations

from typing import Any

import jinja2

from engine.chat_template import RESERVED_VARIABLES, ChatTemplate, compile_template
from service.errors import APIError, bad_request, from_value_error
from service.generate import PromptInput, encode
from service.protocol import ChatCompletionRequest, ChatMessage
from service.protocol_routes import TokenizeRequest
from service.state import AppState
from service.tools import tool_messages

UNTRUSTED_TEMPLATE = ("Chat template is passed with request, but --trust-request-chat-template is not set. "
                      "Refused request with untrusted chat template.")
BOTH_PROMPTS = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."

ChatRequest = ChatCompletionRequest | TokenizeRequest
_MEDIA_PAYLOADS = ("image_url", "input_audio", "file", "video_url")  # ContentPart's non-text fields


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    out = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            for part in content:
                payloads = [name for name in _MEDIA_PAYLOADS if getattr(part, name) is not None]
                if part.type != "text" or part.text is None or payloads:
                    raise bad_request(f"messages.{i}.content: only text parts are supported "
                                      f"(got type {part.type!r}{''.join(f' with {p}' for p in payloads)})",
                                      f"messages.{i}.content")
            content = [{"type": "text", "text": part.text} for part in content]
        entry = {"role": message.role, "content": content if content is not None else ""}
        if message.name is not None:
            entry["name"] = message.name
        thought = message.reasoning_content if message.reasoning_content is not None else message.reasoning
        if thought is not None:  # under both names, as vLLM passes it: templates read one or the other
            entry["reasoning_content"] = entry["reasoning"] = thought
        out.append(entry)
    return out


def choose_template(state: AppState, request: ChatRequest) -> ChatTemplate:
    source = request.chat_template
    if source is None and request.chat_template_kwargs:
        source = request.chat_template_kwargs.get("chat_template")
    if source is not None and not state.settings.trust_request_chat_template:
        raise bad_request(UNTRUSTED_TEMPLATE, "chat_template")
    source = source if source is not None else state.settings.chat_template
    if source is not None:
        return compile_template(source)
    if state.tokenizer.chat_template is None:
        raise bad_request("messages: this model has no chat template; use /v1/completions", "messages")
    return state.tokenizer.template


def template_variables(template: ChatTemplate, request: ChatRequest) -> dict[str, Any]:
    """The request's extra template variables; each must be one the template reads."""
    variables = {name: value for name, value in (request.chat_template_kwargs or {}).items()
                 if name != "chat_template"}
    for name in variables:
        if name in RESERVED_VARIABLES:
            raise bad_request(f"chat_template_kwargs: {name!r} is set by the server (use the request field "
                              "of that name where there is one)", "chat_template_kwargs")
        if name not in template.variables:
            raise bad_request(f"chat_template_kwargs: the chat template does not read {name!r}, so it would "
                              f"change nothing; it reads: {', '.join(sorted(template.variables))}",
                              "chat_template_kwargs")
    for name in ("reasoning_effort", "documents"):  # request fields that are template variables
        value = getattr(request, name, None)
        if value is None:
            continue
        if name not in template.variables:
            raise bad_request(f"{name}: this model's chat template does not read {name}, so it would change "
                              "nothing", name)
        variables[name] = value
    return variables


def render_chat(state: AppState, request: ChatRequest) -> PromptInput:
    if request.continue_final_message and request.add_generation_prompt:
        raise bad_request(BOTH_PROMPTS, "continue_final_message")
    try:
        template = choose_template(state, request)
        variables = template_variables(template, request)
        rendered = template_messages(request.messages)
        if isinstance(request, ChatCompletionRequest):
            rendered, tools = tool_messages(request.messages, rendered, request, template.source)
            variables.update(tools)
        text = state.tokenizer.apply_chat_template(
            rendered, add_generation_prompt=request.add_generation_prompt, template=template,
            continue_final_message=request.continue_final_message, **variables)
    except APIError:
        raise
    except ValueError as exc:
        raise from_value_error(exc, "messages") from None
    except jinja2.TemplateError as exc:
        raise bad_request(f"messages: the chat template failed: {exc}", "messages") from None
    # The template writes the BOS token itself; vLLM's add_special_tokens adds the tokenizer's on top.
    return PromptInput(encode(state, text, "messages", add_special_tokens=_add_special_tokens(request)), text)


def _add_special_tokens(request: ChatRequest) -> bool:
    if isinstance(request, ChatCompletionRequest):
        return request.add_special_tokens
    # /tokenize's field defaults to true for a prompt; for messages only an explicit true counts.
    return "add_special_tokens" in request.model_fields_set and request.add_special_tokens


def echoed_text(request: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the reply is prefixed with the last message's content when that
    message has the role the reply takes (the assistant's after a generation prompt, else the
    last message's own: a continued final message)."""
    last = request.messages[-1]
    role = "assistant" if request.add_generation_prompt else last.role
    if not request.echo or last.role != role or last.content is None:
        return ""
    if isinstance(last.content, list):
        return "\n".join(part.text or "" for part in last.content)
    return last.content
