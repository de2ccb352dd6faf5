"""CORS (--allowed-origins and friends, vLLM's flags): off unless an origin is allowed.

Starlette's CORSMiddleware goes outside the front door (service/middleware.py): it answers a
preflight OPTIONS itself, before any API key check (a browser never sends credentials on a
preflight), and it adds the CORS headers to every response of an allowed origin, the front
door's own 401/413/415 included, so a page can read why it was refused. The actual request
still needs the key.
"""
from __future__ import annotations

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from service.state import ServeSettings

# Response headers a page may read besides the CORS-safelisted ones.
EXPOSED_HEADERS = ("X-Request-Id", "Retry-After")


def install_cors(app: FastAPI, settings: ServeSettings) -> None:
    """Add CORS when --allowed-origins is set. Call it after every other middleware: the last
    added is the outermost."""
    if settings.allowed_origins is None:
        return
    app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                       allow_methods=list(settings.allowed_methods), allow_headers=list(settings.allowed_headers),
                       allow_credentials=settings.allow_credentials, expose_headers=list(EXPOSED_HEADERS))
