"""The FastAPI application: `build_app(state)`.

The engine client starts in the lifespan, in the background: the HTTP server
answers (/health 200, /ready 503) while the ranks load.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from service import __version__
from service.chat_render import render_chat
from service.chat import router as chat_router
from service.completions import router as completions_router
from service.cors import install_cors
from service.errors import bad_request, error_response, install_error_handlers
from service.faults import router as faults_router
from service.generate import encode
from service.metrics import CONTENT_TYPE
from service.middleware import FrontDoor
from service.protocol import ErrorResponse
from service.protocol_routes import (DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList, StatusResponse,
                                     TokenizeRequest, TokenizeResponse, VersionResponse)
from service.responses import ERROR_RESPONSES
from service.responses_api.route import install as install_responses_api
from service.state import AppState

_UNAVAILABLE = {503: {"model": ErrorResponse, "description": "Not healthy / not ready (reason in message)"}}


def build_app(state: AppState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.startup()
        try:
            yield
        finally:
            await state.close()

    app = FastAPI(title="kvsentry", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible LLM inference with a dummy-run-safe paged KV cache.")
    app.state.kvsentry = state
    install_error_handlers(app)
    app.add_middleware(FrontDoor, state=state)
    install_cors(app, state.settings)  # outermost: preflights are answered before the API key check
    app.include_router(completions_router)
    app.include_router(chat_router)
    install_responses_api(app, state)
    if state.settings.enable_fault_injection:
        app.include_router(faults_router)

    @app.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, created=state.created, root=state.config.model.path,
                                         max_model_len=state.config.max_model_len)
                               for name in state.settings.served_model_names])

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("prompt: give exactly one of prompt or messages", "prompt")
        if body.messages is not None:
            if not body.messages:
                raise bad_request("messages: must not be empty", "messages")
            ids = (await asyncio.to_thread(render_chat, state, body)).token_ids  # off the event loop
        else:
            ids = await asyncio.to_thread(encode, state, body.prompt, add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=state.config.max_model_len, tokens=ids,
                                token_strs=[state.formatter.text(t) for t in ids])

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        state.check_model(body.model)
        vocab = state.config.model.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise bad_request(f"tokens: token ids must be in [0, {vocab})", "tokens", "invalid_token_id")
        return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/health", response_model=StatusResponse, responses=_UNAVAILABLE)
    async def health() -> JSONResponse:
        ok, reason = state.health()
        if not ok:
            return error_response(503, reason, None, "unhealthy")
        return JSONResponse({"status": "ok"})

    @app.get("/ready", response_model=StatusResponse, responses=_UNAVAILABLE)
    async def ready() -> JSONResponse:
        ok, reason = state.readiness()
        if not ok:
            return error_response(503, reason, None, "not_ready", {"Retry-After": "5"})
        return JSONResponse({"status": "ok"})

    return app
