"""Bits every route shares: documented error responses and the client's request id."""
from __future__ import annotations

from fastapi import Request

from service.protocol import ErrorResponse

ERROR_RESPONSES: dict = {status: {"model": ErrorResponse, "description": why} for status, why in (
    (400, "Invalid request (the field is named in `param`)"),
    (401, "Missing or wrong API key"),
    (404, "Unknown model or route"),
    (413, "Request body too large"),
    (415, "Content-Type is not application/json"),
    (500, "The engine failed while serving the request"),
    (503, "Loading, draining, engine down, or too many requests in flight (see Retry-After)"),
)}

# Each server-sent event, as OpenAPI 3.2 describes an SSE item: `data` holds one JSON chunk,
# or the literal [DONE] at the end.
SSE_EVENT_SCHEMA: dict = {"type": "object", "required": ["data"],
                          "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                                         "id": {"type": "string"}, "retry": {"type": "integer"}}}
STREAM_RESPONSE: dict = {200: {"content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
                               "description": "JSON, or server-sent events when `stream` is true"}}


def client_request_id(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id") or ""
