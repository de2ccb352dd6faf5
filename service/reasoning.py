"""--reasoning-parser deepseek_r1: the text inside <think>...</think> is the reasoning
(`message.reasoning_content`, also `reasoning`), the rest the answer (`content`).

As DeepSeek-R1's own template may open the <think> in the prompt, the opening tag is optional;
without a closing tag the whole output is reasoning (the model was cut short while thinking).
"""
from __future__ import annotations

REASONING_PARSERS = ("deepseek_r1",)
THINK_START, THINK_END = "<think>", "</think>"


def split_reasoning(text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output."""
    body = text[len(THINK_START):] if text.startswith(THINK_START) else text
    reasoning, found, content = body.partition(THINK_END)
    if not found:
        return reasoning or None, None
    return reasoning or None, content.lstrip("\n") or None


class ReasoningStream:
    """Splits one sample's streamed text; holds back a tail that may be the start of a tag."""

    def __init__(self):
        self.pending = ""
        self.started = False   # past the optional opening tag
        self.thinking = True
        self.content = ""      # the answer so far (what a tool parser reads at the end)

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning delta, content delta) for the next piece of text."""
        if not self.thinking:
            text = self._answer(text)
            return "", text
        self.pending += text
        if not self.started:
            if THINK_START.startswith(self.pending) and not final:
                return "", ""
            if self.pending.startswith(THINK_START):
                self.pending = self.pending[len(THINK_START):]
            self.started = True
        before, found, after = self.pending.partition(THINK_END)
        if found:
            self.thinking, self.pending = False, ""
            return before, self._answer(after)
        hold = 0 if final else next((n for n in range(len(THINK_END) - 1, 0, -1)
                                     if self.pending.endswith(THINK_END[:n])), 0)
        reasoning = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        return reasoning, ""

    def _answer(self, text: str) -> str:
        if not self.content:  # the newlines after </think> separate, they are not the answer
            text = text.lstrip("\n")
        self.content += text
        return text
