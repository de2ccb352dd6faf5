"""Server-sent events: `data: {...}\\n\\n` lines, closed by `data: [DONE]`."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def event(payload: BaseModel | dict) -> str:
    body = (payload.model_dump_json() if isinstance(payload, BaseModel)
            else json.dumps(payload, ensure_ascii=False, separators=(",", ":")))
    return f"data: {body}\n\n"


class SSEResponse(StreamingResponse):
    """A stream that runs `on_close` however it ends: finished, failed, or the client left
    (Starlette then cancels the body iterator, possibly before its first step)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
