"""The front door, as one pure ASGI middleware (no BaseHTTPMiddleware: it would buffer
streams and hide client disconnects from the handlers).

Per request: takes or makes the request id (X-Request-Id, echoed back), checks
the API key, the body's content type and size, and records the HTTP metrics.
"""
from __future__ import annotations

import hmac
import json
import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import error_body
from service.logs import log_event
from service.state import AppState

# Probes and scrapes stay open when an API key is set.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/version", "/openapi.json", "/docs",
                        "/docs/oauth2-redirect", "/redoc"})
ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize",
                    "/debug/faults"}) | OPEN_PATHS | {"/v1/responses"}
GENERATION_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"}) | {"/v1/responses"}
PROBES = frozenset({"/health", "/ready", "/metrics"})
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=@-]{1,128}$")
_JSON_TYPE = re.compile(r"^application/([a-z0-9.+-]*\+)?json\s*(;.*)?$", re.IGNORECASE)
logger = logging.getLogger("kvsentry.http")


class FrontDoor:
    def __init__(self, app: ASGIApp, state: AppState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get("x-request-id", "")
        request_id = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        path = scope.get("path", "")
        route = path if path in ROUTES else "other"
        status = [500]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = list(message.get("headers", [])) + [(b"x-request-id", request_id.encode())]
            await send(message)

        try:
            refusal = self._refusal(scope, headers)
            if refusal is not None:
                await _reply(send_with_id, *refusal)
                return
            if scope.get("method") in ("POST", "PUT", "PATCH"):
                body = await self._read_body(receive, headers)
                if body is None:
                    limit = self.state.settings.max_body_bytes
                    await _reply(send_with_id, 413, f"request body exceeds the limit of {limit} bytes",
                                 None, "request_too_large")
                    return
                receive = _replay(body, receive)
            await self.app(scope, receive, send_with_id)
        finally:
            seconds = time.perf_counter() - started
            self.state.metrics.observe_http(route, status[0], seconds)
            # Served generations log their own line (with token counts); everything else logs here,
            # errors at info, routine traffic (probes, scrapes, 200s) at debug.
            logged = scope["state"].get("logged")
            if not logged and (status[0] >= 400 or route not in GENERATION_ROUTES):
                quiet = status[0] < 400 or route in PROBES
                log_event(logger, "http", logging.DEBUG if quiet else logging.INFO, id=request_id,
                          method=scope.get("method"), route=route, status=status[0],
                          latency_s=round(seconds, 4))

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> tuple | None:
        key = self.state.settings.api_key
        # A CORS preflight never carries credentials: without --allowed-origins it gets the route's
        # own answer (405), never 401. With it, CORSMiddleware answers preflights before this runs.
        preflight = scope.get("method") == "OPTIONS" and "access-control-request-method" in headers
        if key and scope.get("path") not in OPEN_PATHS and not preflight:
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            token = token.strip() if scheme.lower() == "bearer" else headers.get("x-api-key", "")
            if not hmac.compare_digest(token.encode(), key.encode()):
                return (401, "missing or invalid API key (send 'Authorization: Bearer <key>')", None,
                        "invalid_api_key", {"www-authenticate": "Bearer"})
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            has_body = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
            content_type = headers.get("content-type")
            if has_body and not (content_type and _JSON_TYPE.match(content_type)):
                return (415, f"Content-Type must be application/json, got {content_type or 'none'}", None,
                        "unsupported_media_type")
            length = headers.get("content-length", "0")
            if not length.isdigit():
                return 400, "invalid Content-Length header", None, "invalid_request"
            if int(length) > self.state.settings.max_body_bytes:
                return (413, f"request body exceeds the limit of {self.state.settings.max_body_bytes} bytes",
                        None, "request_too_large")
        return None

    async def _read_body(self, receive: Receive, headers: dict[str, str]) -> bytes | None:
        """The whole body, or None once it passes the size limit."""
        limit = self.state.settings.max_body_bytes
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands over the buffered body once, then the real channel (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


async def _reply(send: Send, status: int, message: str, param: str | None, code: str | None,
                 headers: dict[str, str] | None = None) -> None:
    payload = json.dumps(error_body(status, message, param, code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})
