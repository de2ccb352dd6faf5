"""A chat template (jinja2, as Hugging Face writes them), compiled once in a sandbox, with the
names it reads and the two renderings a chat request asks for: a new turn, or the final
message continued (`continue_final_message`, as transformers and vLLM do it)."""
from __future__ import annotations

from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Variables the renderer itself sets; a caller's template variables may not replace them.
RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools",
                                "continue_final_message", "chat_template", "raise_exception"})


class ChatTemplate:
    def __init__(self, source: str):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_template_error
        parsed = env.parse(source)  # jinja2.TemplateSyntaxError on a broken template
        self.source = source
        self.variables = frozenset(meta.find_undeclared_variables(parsed))  # the names it reads
        self._template = env.from_string(parsed)

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, bos_token: str = "", eos_token: str = "",
               **variables: Any) -> str:
        """`variables`: extra names the template reads (tools, enable_thinking, ...).
        continue_final_message: the text ends inside the final message, which the model goes on
        writing (everything the template puts after its content, end-of-turn included, is cut)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message: cannot be set together with add_generation_prompt")
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=bos_token, eos_token=eos_token, **variables)
        return _cut_after_final_message(text, messages) if continue_final_message else text


@lru_cache(maxsize=16)
def compile_template(source: str) -> ChatTemplate:
    """Per-request templates are compiled once per distinct text (a client sends the same one)."""
    return ChatTemplate(source)


def _final_text(messages: list[dict[str, Any]]) -> str:
    if not messages:
        raise ValueError("continue_final_message: there is no final message to continue")
    content = messages[-1].get("content")
    if isinstance(content, list):  # the last text part is the one the template writes last
        texts = [part["text"] for part in content if isinstance(part, dict) and "text" in part]
        content = texts[-1] if texts else None
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message: the final message has no text to continue")
    return content


def _cut_after_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    final = _final_text(messages)
    # Templates may strip the message; find it without its outer spaces, keep what the template kept.
    start = text.rfind(final.strip())
    if start < 0:
        raise ValueError("continue_final_message: the chat template does not write the final message's "
                         "text as given, so it cannot be continued")
    if text[start:start + len(final.lstrip())] == final.lstrip():
        return text[:start + len(final.lstrip())]
    return text[:start + len(final.strip())]


def _raise_template_error(message: str) -> None:
    raise ValueError(f"messages: {message}")
