"""POST /v1/chat/completions: the checkpoint's chat template, then the same engine path."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from service.chat_render import echoed_text, render_chat
from service.errors import bad_request
from service.generate import (EngineFailed, Generation, check_max_logprobs, complete, request_params,
                              start_generation, start_stream)
from service.protocol import (AssistantMessage, ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                              ChatLogprobs, UsageInfo)
from service.responses import ERROR_RESPONSES, STREAM_RESPONSE
from service.sse import DONE, SSEResponse, event
from service.state import AppState
from service.tool_stream import ToolCallStream
from service.structured import after_reasoning, check_limits_or_refuse, request_grammar
from service.reasoning import ReasoningStream, split_reasoning
from service.tools import ToolPlan, new_call_id, plan_tools
from service.vllm_fields import prompt_logprob_maps

router = APIRouter()
ROUTE = "/v1/chat/completions"


def output_plan(state: AppState, body: ChatCompletionRequest):
    """(tool plan, grammar, the field that asked for it, whether a reasoning parser runs) of a
    chat request; the Responses API decides its output the same way."""
    try:
        plan = plan_tools(body, state.settings.tool_call_parser)
    except RecursionError:  # a tool's parameters nested deeper than any schema bound
        raise bad_request("tools: parameters nested too deeply", "tools") from None
    if plan is not None and plan.grammar is not None:
        structured, grammar_param = plan.grammar, "tools"
        check_limits_or_refuse(state, structured, "tools")
    else:
        structured, grammar_param = request_grammar(state, body)
    reasoning = state.settings.reasoning_parser is not None
    if reasoning and structured is not None:  # the grammar constrains the answer, not the thinking
        structured = after_reasoning(state, structured)
    return plan, structured, grammar_param, reasoning


@router.post(ROUTE, response_model=ChatCompletionResponse, responses={**ERROR_RESPONSES, **STREAM_RESPONSE})
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response | ChatCompletionResponse:
    state: AppState = request.app.state.kvsentry
    state.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")
    check_max_logprobs(state, body.top_logprobs, "top_logprobs")
    check_max_logprobs(state, body.prompt_logprobs, "prompt_logprobs")
    if body.stream and body.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs: not available when stream is true", "prompt_logprobs")
    plan, structured, grammar_param, reasoning = output_plan(state, body)
    # Off the event loop: a template over thousands of messages or tools, and tokenizing what it
    # renders, take long enough to hold up every other request's streaming.
    prompt = await asyncio.to_thread(render_chat, state, body)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = request_params(state, body, [prompt], max_tokens=body.max_completion_tokens or body.max_tokens,
                            logprobs=logprobs, prompt_logprobs=body.prompt_logprobs, param="messages",
                            structured=structured)
    gen = start_generation(state, request, "chatcmpl", ROUTE, [prompt], params, grammar_param, body.priority)
    created = int(time.time())
    if body.stream:
        await start_stream(gen)
        return SSEResponse(_stream(state, gen, body, created, plan, reasoning), on_close=gen.close_stream)
    if not await complete(request, gen):
        return Response(status_code=499)
    echo = echoed_text(body)
    choices = []
    for sample in gen.states[0].samples:
        logprobs_out = ChatLogprobs(content=state.formatter.chat(sample.logprobs)) if body.logprobs else None
        thought, text = split_reasoning(sample.text) if reasoning else (None, sample.text)
        content, calls = plan.calls(text) if plan is not None and text else (text, [])
        if echo:
            content = echo + (content or "")
        message = AssistantMessage(content=content, tool_calls=calls, reasoning_content=thought, reasoning=thought)
        choices.append(ChatChoice(index=sample.index, message=message,
                                  logprobs=logprobs_out, finish_reason=_finish_reason(sample.finish_reason, calls),
                                  stop_reason=sample.stop_reason,
                                  token_ids=list(sample.token_ids) if body.return_token_ids else None))
    prompt_maps = None
    if body.prompt_logprobs is not None:
        prompt_maps = prompt_logprob_maps(state.formatter.text, gen.states[0].prompt_logprobs, prompt.token_ids,
                                          body.prompt_logprobs)
    return ChatCompletionResponse(id=gen.request_id, created=created, model=state.model_name,
                                  choices=choices, usage=gen.usage(), prompt_logprobs=prompt_maps,
                                  prompt_token_ids=prompt.token_ids if body.return_token_ids else None)


def _finish_reason(reason: str | None, calls: list) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def _tool_deltas(plan: ToolPlan, sample, text: str, call_ids: dict[int, str],
                 streams: dict[int, ToolCallStream]) -> dict:
    """The delta of one streamed piece of a tool-calling sample. named: the text is the
    arguments, streamed as it comes; required/auto: content as it comes, each call once the
    model has closed it (service/tool_stream.py)."""
    if plan.mode == "named":
        if not text:
            return {}
        if sample.index in call_ids:
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        call_ids[sample.index] = new_call_id()
        return {"tool_calls": [{"index": 0, "id": call_ids[sample.index], "type": "function",
                                "function": {"name": plan.name, "arguments": text}}]}
    stream = streams.setdefault(sample.index, ToolCallStream(plan))
    first = stream.num_calls
    content, calls = stream.feed(text, sample.finish_reason is not None)
    if stream.num_calls:
        call_ids[sample.index] = "called"
    delta: dict = {"content": content} if content else {}
    if calls:
        delta["tool_calls"] = [{"index": first + i, **call.model_dump()} for i, call in enumerate(calls)]
    return delta


async def _stream(state: AppState, gen: Generation, body: ChatCompletionRequest,
                  created: int, plan: ToolPlan | None, reasoning: bool) -> AsyncIterator[str]:
    finished: set[int] = set()
    call_ids: dict[int, str] = {}
    streams: dict[int, ToolCallStream] = {}
    reasoners = {j: ReasoningStream() for j in range(body.n)} if reasoning else {}

    def chunk(choices: list[dict], usage: UsageInfo | None = None, **extra) -> str:
        # Plain dicts: a pydantic model per streamed token costs more than the token's other work.
        return event({"id": gen.request_id, "object": "chat.completion.chunk", "created": created,
                      "model": state.model_name, "choices": choices,
                      "usage": usage.model_dump() if usage else None, **extra})

    def choice(index: int, delta: dict, logprobs: ChatLogprobs | None = None, finish_reason: str | None = None,
               stop_reason: int | str | None = None, token_ids: list[int] | None = None) -> dict:
        out = {"index": index, "delta": delta, "logprobs": logprobs.model_dump() if logprobs else None,
               "finish_reason": finish_reason, "stop_reason": stop_reason}
        if body.return_token_ids:  # as vLLM streams them: each chunk's new tokens
            out["token_ids"] = token_ids or []
        return out

    # return_token_ids: the prompt's tokens ride on the first chunk, as vLLM sends them.
    prompt_ids = {"prompt_token_ids": gen.prompts[0].token_ids} if body.return_token_ids else {}
    yield chunk([choice(j, {"role": "assistant", "content": ""}) for j in range(body.n)], **prompt_ids)
    echo = echoed_text(body)
    if echo:
        yield chunk([choice(j, {"content": echo}) for j in range(body.n)])
    try:
        async for _ in gen.updates():
            request_state = gen.states[0]
            choices = []
            for sample in request_state.samples:
                if sample.index in finished:
                    continue
                text, tokens, entries = request_state.unsent(sample)
                if not (text or sample.finish_reason or (tokens and (body.logprobs or body.return_token_ids))):
                    continue
                logprobs = ChatLogprobs(content=state.formatter.chat(entries)) if body.logprobs else None
                if sample.finish_reason is not None:
                    finished.add(sample.index)
                reason, thought = sample.finish_reason, ""
                if reasoning:
                    thought, text = reasoners[sample.index].feed(text, sample.finish_reason is not None)
                if plan is None:
                    delta = {"content": text} if text else {}
                else:
                    delta = _tool_deltas(plan, sample, text, call_ids, streams)
                    reason = _finish_reason(reason, [1] if call_ids.get(sample.index) else [])
                if thought:
                    delta = {"reasoning_content": thought, "reasoning": thought, **delta}
                if not (delta or sample.finish_reason or (tokens and (body.logprobs or body.return_token_ids))):
                    continue
                choices.append(choice(sample.index, delta, logprobs, reason,
                                      sample.stop_reason if sample.finish_reason else None, tokens))
            if choices:
                yield chunk(choices)
        if body.stream_options and body.stream_options.include_usage:
            yield chunk([], gen.usage())
    except EngineFailed as exc:
        failed = [choice(j, {}, finish_reason="error") for j in range(body.n) if j not in finished]
        for line in gen.stream_failure(chunk(failed) if failed else None, exc):
            yield line
    yield DONE
