"""The responses kept for `previous_response_id` and GET /v1/responses/{id}: a bounded,
in-memory LRU (--responses-store-size entries; 0 keeps none). Each entry holds the response
object and the chat messages of its whole conversation (instructions left out: OpenAI does not
carry them over to the next turn), so a follow-up renders the earlier turns as they were."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    response: dict
    messages: tuple[dict, ...]  # the conversation up to and including this response's output


class ResponseStore:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, response: dict, messages: list[dict]) -> None:
        if self.capacity <= 0:
            return
        self._entries[response_id] = StoredResponse(response, tuple(messages))
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:  # the least recently used goes first
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
