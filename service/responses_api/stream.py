"""The typed server-sent events of a streamed response, in OpenAI's order:

    response.created, response.in_progress,
    per output item: response.output_item.added,
      message:   response.content_part.added, response.output_text.delta..., response.output_text.done,
                 response.content_part.done
      reasoning: response.content_part.added, response.reasoning_text.delta..., response.reasoning_text.done,
                 response.content_part.done
      function_call: response.function_call_arguments.delta..., response.function_call_arguments.done
    response.output_item.done, ..., response.completed (or response.failed).

Each event is `event: <type>` and `data: <json>` with a growing sequence_number. One item is open
at a time; opening the next closes it, and the closed items are the response's output.
"""
from __future__ import annotations

import json

from service.responses_api.output import (function_call_item, message_item, new_id, output_text,
                                          reasoning_item)


class OutputEvents:
    def __init__(self):
        self.sequence = 0
        self.output: list[dict] = []   # closed items, in order
        self._kind: str | None = None  # "message" | "reasoning" | "function_call" while an item is open
        self._id = ""
        self._text = ""
        self._call: tuple[str, str] = ("", "")  # (call_id, name) of the open function_call

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    @property
    def _index(self) -> int:
        return len(self.output)

    def _where(self) -> dict:
        return {"item_id": self._id, "output_index": self._index}

    def _open(self, kind: str, item: dict) -> list[str]:
        self._kind, self._id, self._text = kind, item["id"], ""
        return [self.event("response.output_item.added", output_index=self._index, item=item)]

    # -- text and thinking ------------------------------------------------------------------------
    def text(self, delta: str) -> list[str]:
        if not delta:
            return []
        out = []
        if self._kind != "message":
            out += self.close()
            out += self._open("message", message_item(new_id("msg"), None, "in_progress"))
            out.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                  part=output_text("")))
        self._text += delta
        out.append(self.event("response.output_text.delta", **self._where(), content_index=0, delta=delta,
                              logprobs=[]))
        return out

    def reasoning(self, delta: str) -> list[str]:
        if not delta:
            return []
        out = []
        if self._kind != "reasoning":
            out += self.close()
            out += self._open("reasoning", reasoning_item(new_id("rs"), None, "in_progress"))
            out.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                  part={"type": "reasoning_text", "text": ""}))
        self._text += delta
        out.append(self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=delta))
        return out

    # -- function calls ---------------------------------------------------------------------------
    def open_call(self, call_id: str, name: str) -> list[str]:
        out = self.close()
        self._call = (call_id, name)
        return out + self._open("function_call", function_call_item(new_id("fc"), call_id, name, "", "in_progress"))

    @property
    def call_open(self) -> bool:
        return self._kind == "function_call"

    def arguments(self, delta: str) -> list[str]:
        if not delta:
            return []
        self._text += delta
        return [self.event("response.function_call_arguments.delta", **self._where(), delta=delta)]

    def whole_call(self, call_id: str, name: str, arguments: str) -> list[str]:
        return self.open_call(call_id, name) + self.arguments(arguments) + self.close()

    # -- the end of an item -----------------------------------------------------------------------
    def close(self, status: str = "completed") -> list[str]:
        kind, text, where = self._kind, self._text, self._where()
        if kind is None:
            return []
        if kind == "message":
            item = message_item(self._id, text, status)
            out = [self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]),
                   self.event("response.content_part.done", **where, content_index=0, part=output_text(text))]
        elif kind == "reasoning":
            item = reasoning_item(self._id, text, status)
            part = {"type": "reasoning_text", "text": text}
            out = [self.event("response.reasoning_text.done", **where, content_index=0, text=text),
                   self.event("response.content_part.done", **where, content_index=0, part=part)]
        else:
            call_id, name = self._call
            item = function_call_item(self._id, call_id, name, text, status)
            out = [self.event("response.function_call_arguments.done", **where, name=name, arguments=text)]
        out.append(self.event("response.output_item.done", output_index=self._index, item=item))
        self.output.append(item)
        self._kind = None
        return out

    def finish(self, status: str) -> list[str]:
        """Close the open item with `status` (the last item carries the response's incompleteness);
        an output with no item at all gets an empty message, as the whole response does."""
        if self._kind is None and not self.output:
            out = self._open("message", message_item(new_id("msg"), None, "in_progress"))
            out.append(self.event("response.content_part.added", **self._where(), content_index=0,
                                  part=output_text("")))
            return out + self.close(status)
        if self._kind is None:
            if status != "completed":
                self.output[-1] = {**self.output[-1], "status": status}
            return []
        return self.close(status)
