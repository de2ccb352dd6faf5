"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it), GET and DELETE
/v1/responses/{id}, and POST /v1/responses/{id}/cancel.

A request becomes the chat request it means (convert.py) and runs the chat path: the chat
template, the grammar of `text.format` or of a named / required tool_choice, the tool-call and
reasoning parsers. Its output comes back as output items (output.py), whole or as typed events
(stream.py), and is kept for `previous_response_id` unless `store` is false (store.py).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine.core.validation import validate_priority
from service.chat import output_plan
from service.chat_render import render_chat
from service.errors import APIError, bad_request, from_value_error
from service.generate import EngineFailed, Generation, complete, request_params, start_stream
from service.reasoning import THINK_END, ReasoningStream
from service.responses import ERROR_RESPONSES, STREAM_RESPONSE, client_request_id
from service.responses_api.convert import chat_request, in_responses_terms, input_messages, output_messages
from service.responses_api.output import (final_status, new_id, output_items, reasoning_tokens, response_object,
                                          usage)
from service.responses_api.protocol import DeletedResponse, ResponseObject, ResponsesRequest
from service.responses_api.store import ResponseStore
from service.responses_api.stream import OutputEvents
from service.sse import SSEResponse
from service.state import AppState
from service.tool_stream import ToolCallStream
from service.tools import ToolPlan, new_call_id

router = APIRouter()
ROUTE = "/v1/responses"
NOT_FOUND = {404: ERROR_RESPONSES[404]}


def install(app: FastAPI, state: AppState) -> None:
    app.state.responses_store = ResponseStore(state.settings.responses_store_size)
    app.include_router(router)


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses_store


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found.", "response_id", "response_not_found")


def previous_messages(store: ResponseStore, body: ResponsesRequest) -> list[dict]:
    """The conversation `previous_response_id` continues ([] without one)."""
    previous = body.previous_response_id
    if previous is None:
        return []
    if store.capacity <= 0:
        raise bad_request("previous_response_id: this server keeps no responses (--responses-store-size 0)",
                          "previous_response_id", "previous_response_not_found")
    entry = store.get(previous)
    if entry is None:
        raise bad_request(f"previous_response_id: no stored response with id {previous!r} (a response made with "
                          f"store: false is not kept, and the server keeps the {store.capacity} most recent)",
                          "previous_response_id", "previous_response_not_found")
    return list(entry.messages)


@router.post(ROUTE, response_model=ResponseObject, responses={**ERROR_RESPONSES, **STREAM_RESPONSE})
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state: AppState = request.app.state.kvsentry
    store = _store(request)
    state.check_model(body.model)
    history = previous_messages(store, body)
    try:
        conversation = history + input_messages(body, history)
        chat = chat_request(body, conversation)
        plan, structured, grammar_param, reasoning = output_plan(state, chat)
        prompt = await asyncio.to_thread(render_chat, state, chat)
        params = request_params(state, chat, [prompt], max_tokens=chat.max_completion_tokens, logprobs=None,
                                param="messages", structured=structured)
    except APIError as exc:
        raise in_responses_terms(exc) from None
    try:
        validate_priority(state.config, body.priority)
    except ValueError as exc:
        raise from_value_error(exc) from None
    generation = Generation(state, new_id("resp"), ROUTE, [prompt], params, client_request_id(request),
                            request.scope.get("state"), grammar_param, body.priority)
    generation.submit()
    created = int(time.time())
    kept = body.store is not False and store.capacity > 0

    def finished(response: dict) -> dict:
        if kept:
            messages = conversation + output_messages(response["output"], conversation)
            store.put(response["id"], response, messages)
        return response

    if body.stream:
        try:
            await start_stream(generation)
        except APIError as exc:
            raise in_responses_terms(exc) from None
        events = _stream(state, generation, body, created, kept, plan, reasoning, finished)
        return SSEResponse(events, on_close=generation.close_stream)
    try:
        if not await complete(request, generation):
            return Response(status_code=499)
    except APIError as exc:
        raise in_responses_terms(exc) from None
    sample = generation.states[0].samples[0]
    items = output_items(sample.text, reasoning, plan, sample.finish_reason)
    status, incomplete = final_status(sample.finish_reason)
    thinking = reasoning_tokens(items, sample.token_ids, _think_end(state))
    response = response_object(body, generation.request_id, created, state.model_name, kept, status, items,
                               usage(generation.usage(), thinking), incomplete)
    return JSONResponse(finished(response))


def _think_end(state: AppState) -> list[int]:
    return state.tokenizer.encode(THINK_END, add_special_tokens=False)


async def _stream(state: AppState, generation: Generation, body: ResponsesRequest, created: int, kept: bool,
                  plan: ToolPlan | None, reasoning: bool, finished: Callable[[dict], dict]) -> AsyncIterator[str]:
    events = OutputEvents()

    def snapshot(status: str, **extra) -> dict:
        return response_object(body, generation.request_id, created, state.model_name, kept, status,
                               list(events.output), **extra)

    yield events.event("response.created", response=snapshot("in_progress"))
    yield events.event("response.in_progress", response=snapshot("in_progress"))
    thinking = ReasoningStream() if reasoning else None
    calls = ToolCallStream(plan) if plan is not None and plan.mode != "named" else None
    request_state = generation.states[0]
    sample = request_state.samples[0]
    try:
        async for _ in generation.updates():
            text, _, _ = request_state.unsent(sample)
            final = sample.finish_reason is not None
            out: list[str] = []
            if thinking is not None:
                thought, text = thinking.feed(text, final)
                out += events.reasoning(thought)
            if plan is None:
                out += events.text(text)
            elif calls is None:  # a named tool: the text is the call's arguments, streamed as they come
                if text and not events.call_open:
                    out += events.open_call(new_call_id(), plan.name)
                out += events.arguments(text)
            else:
                content, done = calls.feed(text, final)
                out += events.text(content)
                for call in done:
                    out += events.whole_call(call.id, call.function.name, call.function.arguments)
            if out:
                yield "".join(out)
        status, incomplete = final_status(sample.finish_reason)
        yield "".join(events.finish(status))
        tokens = reasoning_tokens(events.output, sample.token_ids, _think_end(state))
        response = finished(snapshot(status, usage_out=usage(generation.usage(), tokens), incomplete=incomplete))
        yield events.event("response.completed", response=response)
    except EngineFailed as exc:
        generation.outcome = "engine_error"
        error = {"code": "server_error", "message": f"the engine failed while serving this request: {exc}"}
        yield events.event("response.failed", response=snapshot("failed", error=error))


@router.get(ROUTE + "/{response_id}", response_model=ResponseObject, responses={**ERROR_RESPONSES, **NOT_FOUND})
async def get_response(response_id: str, request: Request) -> JSONResponse:
    entry = _store(request).get(response_id)
    if entry is None:
        raise _not_found(response_id)
    return JSONResponse(entry.response)


@router.delete(ROUTE + "/{response_id}", response_model=DeletedResponse,
               responses={**ERROR_RESPONSES, **NOT_FOUND})
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    if not _store(request).delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.post(ROUTE + "/{response_id}/cancel", response_model=ResponseObject,
             responses={**ERROR_RESPONSES, **NOT_FOUND})
async def cancel_response(response_id: str, request: Request) -> JSONResponse:
    """Only a background response can be cancelled (OpenAI's rule), and kvsentry runs none: a stored
    response has finished."""
    if _store(request).get(response_id) is None:
        raise _not_found(response_id)
    raise bad_request("Cannot cancel a synchronous response: only background responses can be cancelled, and "
                      "kvsentry runs none", "response_id", "response_not_cancellable")
