"""POST /v1/completions."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.messages import TokenLogprob
from service.errors import bad_request
from service.generate import (EngineFailed, Generation, PromptInput, check_max_logprobs, complete, encode,
                              request_params, start_generation, start_stream)
from service.logprobs import merge
from service.protocol import (MAX_CHOICES, CompletionChoice, CompletionLogprobs, CompletionRequest,
                              CompletionResponse, UsageInfo)
from service.responses import ERROR_RESPONSES, STREAM_RESPONSE
from service.sse import DONE, SSEResponse, event
from service.state import AppState
from service.structured import request_grammar
from service.vllm_fields import prompt_logprob_maps

router = APIRouter()
ROUTE = "/v1/completions"


def completion_prompts(state: AppState, prompt: str | list) -> list[PromptInput]:
    if isinstance(prompt, str):
        return [PromptInput(encode(state, prompt), prompt)]
    if not prompt:
        raise bad_request("prompt: must not be empty", "prompt")
    if isinstance(prompt[0], str):
        return [PromptInput(encode(state, p), p) for p in prompt]
    if isinstance(prompt[0], int):
        return [PromptInput(list(prompt))]
    return [PromptInput(list(p)) for p in prompt]


def echo_text(state: AppState, prompt: PromptInput, skip_special: bool) -> str:
    if prompt.text is not None:
        return prompt.text
    return state.tokenizer.decode(prompt.token_ids, skip_special)


def prompt_logprobs(state: AppState, gen: Generation, index: int, num_top: int) -> CompletionLogprobs:
    """echo with logprobs: the prompt's tokens in OpenAI's parallel lists, top `num_top` each."""
    ids = gen.prompts[index].token_ids
    entries = list(gen.states[index].prompt_logprobs)[:len(ids)]
    entries += [None] * (len(ids) - len(entries))
    entries = [e if e is None else TokenLogprob(e.token_id, e.logprob, e.top[:num_top], e.rank) for e in entries]
    return state.formatter.completion(entries, ids, 0)


def engine_prompt_logprobs(body: CompletionRequest) -> int | None:
    """How many top logprobs the engine computes per prompt token: enough for vLLM's
    prompt_logprobs and for echo with logprobs (OpenAI's), whichever asks more."""
    wanted = [n for n in (body.prompt_logprobs, body.logprobs if body.echo else None) if n is not None]
    return max(wanted) if wanted else None


@router.post(ROUTE, response_model=CompletionResponse, responses={**ERROR_RESPONSES, **STREAM_RESPONSE})
async def create_completion(body: CompletionRequest, request: Request) -> Response | CompletionResponse:
    state: AppState = request.app.state.kvsentry
    state.check_model(body.model)
    prompts = await asyncio.to_thread(completion_prompts, state, body.prompt)  # tokenizing: off the event loop
    if len(prompts) * body.n > MAX_CHOICES:
        raise bad_request(f"n: {len(prompts)} prompts x n={body.n} choices exceed the limit of "
                          f"{MAX_CHOICES} per request", "n")
    check_max_logprobs(state, body.logprobs, "logprobs")
    check_max_logprobs(state, body.prompt_logprobs, "prompt_logprobs")
    if body.stream and body.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs: not available when stream is true", "prompt_logprobs")
    structured, grammar_param = request_grammar(state, body)
    params = request_params(state, body, prompts, max_tokens=body.max_tokens, logprobs=body.logprobs,
                            prompt_logprobs=engine_prompt_logprobs(body), structured=structured)
    gen = start_generation(state, request, "cmpl", ROUTE, prompts, params, grammar_param, body.priority)
    created = int(time.time())
    if body.stream:
        await start_stream(gen)
        return SSEResponse(_stream(state, gen, body, created), on_close=gen.close_stream)
    if not await complete(request, gen):
        return Response(status_code=499)
    return _response(state, gen, body, created)


def _response(state: AppState, gen: Generation, body: CompletionRequest, created: int) -> CompletionResponse:
    choices = []
    for i, (prompt, request_state) in enumerate(zip(gen.prompts, gen.states)):
        prefix = echo_text(state, prompt, body.skip_special_tokens) if body.echo else ""
        prompt_maps = None
        if body.prompt_logprobs is not None:
            prompt_maps = prompt_logprob_maps(state.formatter.text, request_state.prompt_logprobs, prompt.token_ids,
                                              body.prompt_logprobs)
        for sample in request_state.samples:
            logprobs = None
            if body.logprobs is not None:
                logprobs = prompt_logprobs(state, gen, i, body.logprobs) if body.echo else CompletionLogprobs()
                merge(logprobs, state.formatter.completion(sample.logprobs, sample.token_ids, len(prefix)))
            choices.append(CompletionChoice(index=i * body.n + sample.index, text=prefix + sample.text,
                                            logprobs=logprobs, finish_reason=sample.finish_reason,
                                            stop_reason=sample.stop_reason, prompt_logprobs=prompt_maps,
                                            token_ids=list(sample.token_ids) if body.return_token_ids else None,
                                            prompt_token_ids=prompt.token_ids if body.return_token_ids else None))
    return CompletionResponse(id=gen.request_id, created=created, model=state.model_name, choices=choices,
                              usage=gen.usage())


async def _stream(state: AppState, gen: Generation, body: CompletionRequest, created: int) -> AsyncIterator[str]:
    n = body.n
    sent_chars: dict[int, int] = {}
    finished: set[int] = set()

    def chunk(choices: list[dict], usage: UsageInfo | None = None) -> str:
        # Plain dicts: a pydantic model per streamed token costs more than the token's other work.
        return event({"id": gen.request_id, "object": "text_completion", "created": created,
                      "model": state.model_name, "choices": choices,
                      "usage": usage.model_dump() if usage else None})

    try:
        async for i in gen.updates():
            request_state = gen.states[i]
            choices = []
            for sample in request_state.samples:
                index = i * n + sample.index
                if index in finished:
                    continue
                text, tokens, entries = request_state.unsent(sample)
                first = index not in sent_chars
                if not (text or sample.finish_reason or (tokens and (body.logprobs is not None
                                                                     or body.return_token_ids))):
                    continue
                prefix = echo_text(state, gen.prompts[i], body.skip_special_tokens) if body.echo and first else ""
                logprobs = None
                if body.logprobs is not None:
                    logprobs = (prompt_logprobs(state, gen, i, body.logprobs) if body.echo and first
                                else CompletionLogprobs())
                    offset = sent_chars.get(index, 0) + len(prefix)
                    merge(logprobs, state.formatter.completion(entries, tokens, offset))
                sent_chars[index] = sent_chars.get(index, 0) + len(prefix) + len(text)
                if sample.finish_reason is not None:
                    finished.add(index)
                choice = {"index": index, "text": prefix + text,
                          "logprobs": logprobs.model_dump() if logprobs else None,
                          "finish_reason": sample.finish_reason,
                          "stop_reason": sample.stop_reason if sample.finish_reason else None}
                if body.return_token_ids:  # as vLLM streams them: the prompt's once, then each chunk's new ones
                    choice["token_ids"] = tokens
                    if first:
                        choice["prompt_token_ids"] = gen.prompts[i].token_ids
                choices.append(choice)
            if choices:
                yield chunk(choices)
        if body.stream_options and body.stream_options.include_usage:
            yield chunk([], gen.usage())
    except EngineFailed as exc:
        failed = [{"index": i * n + j, "text": "", "logprobs": None, "finish_reason": "error", "stop_reason": None}
                  for i in range(len(gen.prompts)) for j in range(n) if i * n + j not in finished]
        for line in gen.stream_failure(chunk(failed) if failed else None, exc):
            yield line
    yield DONE
