"""The engine side of one HTTP request: validation, submission, merged outputs, abort.

A request with P prompts becomes P engine requests (each with its n samples).
`Generation.updates()` yields the index of the prompt whose `RequestState`
changed; `close()` aborts whatever is still running upstream (client gone,
error, shutdown) and records metrics and the one log line per request.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.core.validation import validate_api_request, validate_priority, validate_prompt
from engine.dp.client import RankDiedError
from engine.frontend.output_processor import RequestState
from engine.messages import EngineRequest, RequestTiming
from engine.sampling_params import SamplingParams
from engine.structured.spec import StructuredOutputs
from service import responses
from service.errors import APIError, bad_request, error_body, from_value_error
from service.logs import log_event
from service.protocol import ENGINE_SAMPLING_FIELDS, SamplingFields, UsageInfo
from service.sse import event
from service.state import AppState

logger = logging.getLogger("kvsentry.request")
TRACE_CONTEXT_HEADERS = ("traceparent", "tracestate")  # W3C trace context, continued by --otlp-traces-endpoint


class EngineFailed(Exception):
    """The engine could not finish this request (a rank died, or refused it)."""

    def __init__(self, message: str, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable  # its rank died and was replaced: the same request may be sent again


class RequestRefused(EngineFailed):
    """A rank refused the request before it ran (engine/messages.py: Refusal): a 400."""

    def __init__(self, error: APIError):
        super().__init__(error.message)
        self.error = error


@dataclass
class PromptInput:
    token_ids: list[int]
    text: str | None = None  # the prompt as the client sent it, when it was text


def new_request_id(prefix: str, client_id: str | None) -> str:
    return f"{prefix}-{client_id or uuid.uuid4().hex}"


def encode(state: AppState, text: str, param: str = "prompt", add_special_tokens: bool = True) -> list[int]:
    if len(text) > state.max_prompt_chars:
        raise bad_request(f"{param}: {len(text)} characters cannot fit in this model's maximum context "
                          f"length of {state.config.max_model_len} tokens", param, "context_length_exceeded")
    try:
        return state.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except Exception as exc:  # e.g. lone surrogates, which the tokenizer cannot take
        raise bad_request(f"{param}: cannot be tokenized ({type(exc).__name__})", param) from None


def request_params(state: AppState, req: SamplingFields, prompts: list[PromptInput], *, max_tokens: int | None,
                   logprobs: int | None, prompt_logprobs: int | None = None, param: str = "prompt",
                   structured: StructuredOutputs | None = None) -> SamplingParams:
    """Check `prompts` by the engine's rules and build the request's SamplingParams; any refusal
    is a 400 naming the field. `max_tokens` None: whatever room the longest prompt leaves."""
    config = state.config
    try:
        for prompt in prompts:
            validate_prompt(config, prompt.token_ids, param)
        longest = max(len(p.token_ids) for p in prompts)
        if max_tokens is None:
            max_tokens = max(1, config.max_model_len - longest)
        fields = {name: value for name in ENGINE_SAMPLING_FIELDS if (value := getattr(req, name)) is not None}
        if isinstance(fields.get("stop"), str):
            fields["stop"] = [fields["stop"]]
        params = SamplingParams(**fields, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                structured_outputs=structured)
        validate_api_request(config, longest, params)
    except ValueError as exc:
        raise from_value_error(exc) from None
    return params


class Generation:
    def __init__(self, state: AppState, request_id: str, route: str, prompts: list[PromptInput],
                 params: SamplingParams, client_request_id: str, scope_state: dict | None = None,
                 grammar_param: str | None = None, priority: int = 0):
        self.state = state
        self.grammar_param = grammar_param  # the field that asked for the grammar, named by its refusals
        self.request_id = request_id
        self.route = route
        self.prompts = prompts
        self.params = params
        self.client_request_id = client_request_id
        self.scope_state = scope_state if scope_state is not None else {}  # "logged" tells the middleware
        self.priority = priority  # the ranks' scheduling priority (--scheduling-policy priority)
        suffix = uuid.uuid4().hex[:8]
        self.engine_ids = [f"{request_id}-{i}-{suffix}" for i in range(len(prompts))]
        self.states = [RequestState(eid, p.token_ids, params, state.tokenizer)
                       for eid, p in zip(self.engine_ids, prompts)]
        self.arrival = time.monotonic()
        self._queues: list[asyncio.Queue] = []
        self._events: asyncio.Queue = asyncio.Queue()  # (prompt index, output) of every queue, P > 1
        self._forwarders: list[asyncio.Task] = []
        self._held: list[tuple[int, object]] = []  # (prompt index, output) read by started(), not yet handled
        self._submitted: list[str] = []
        self._first_output = [False] * len(prompts)
        self._first_token: float | None = None
        self._last_token: dict[tuple[int, int], float] = {}
        self._closed = False
        self.outcome = "ok"
        self.timings: list[RequestTiming] = []  # each sample's times on its rank, as samples finish
        self.trace_carrier: dict[str, str] = {}  # the client's W3C trace context (only read when tracing)

    # -- submission ---------------------------------------------------------------------------------
    def submit(self) -> None:
        state = self.state
        state.admit(len(self.prompts))
        try:
            for i, (engine_id, prompt) in enumerate(zip(self.engine_ids, self.prompts)):
                request = EngineRequest(engine_id, prompt.token_ids, self.params,
                                        eos_token_id=state.tokenizer.eos_token_id, arrival_time=time.time(),
                                        priority=self.priority)
                queue = state.client.add_request(request)
                self._submitted.append(engine_id)
                self._queues.append(queue)
                state.in_flight.add(engine_id)
                state.metrics.series.prompt_tokens.inc(len(prompt.token_ids))
                if len(self.prompts) > 1:
                    self._forwarders.append(asyncio.get_running_loop().create_task(self._forward(i, queue)))
        except ValueError as exc:
            self.close("rejected")
            raise from_value_error(exc, "prompt") from None
        except Exception as exc:  # the engine died between admission and submission
            self.close("engine_error")
            raise APIError(503, f"engine is not running: {exc}", None, "engine_dead",
                           headers={"Retry-After": "1"}) from None
        state.metrics.series.in_flight.set(len(state.in_flight))

    async def _forward(self, index: int, queue: asyncio.Queue) -> None:
        while True:
            item = await queue.get()
            self._events.put_nowait((index, item))
            if isinstance(item, Exception):
                return

    # -- outputs -------------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.states)

    async def _next(self) -> tuple[int, object]:
        if self._held:
            return self._held.pop(0)
        if len(self._queues) == 1:
            return 0, await self._queues[0].get()
        return await self._events.get()

    async def started(self) -> None:
        """Wait until every prompt has its first output (a constrained stream waits here for its
        grammar): a refusal raises the 400 before any response has begun."""
        seen: set[int] = set()
        while len(seen) < len(self.prompts):
            index, item = await self._next()
            self._held.append((index, item))
            self._check_refusal(item)
            if isinstance(item, Exception):
                return  # updates() raises it
            seen.add(index)

    def _check_refusal(self, item) -> None:
        refusal = getattr(item, "refusal", None)
        if refusal is None:
            return
        self.close("rejected")
        message, param = refusal.message, refusal.param
        if self.grammar_param and param and param.startswith("structured_outputs."):
            # The engine names the spec by its kind ("structured_outputs.json[.enum]"); the client
            # knows it by the field it used ("response_format.json_schema.schema[.enum]").
            rest = param.split(".", 2)[2:]
            client_param = ".".join([self.grammar_param, *rest])
            message = client_param + message[len(param):] if message.startswith(param) else message
            param = client_param
        raise RequestRefused(bad_request(message, param, refusal.code))

    async def updates(self) -> AsyncIterator[int]:
        """Yield the prompt index of each state change until every sample has finished."""
        while not self.finished:
            index, item = await self._next()
            if isinstance(item, Exception):
                raise EngineFailed(str(item) or type(item).__name__, isinstance(item, RankDiedError))
            self._check_refusal(item)
            request_state = self.states[index]
            if request_state.finished:
                continue
            self._observe(index, item)
            before = [s.finish_reason for s in request_state.samples]
            if request_state.process(item):  # a stop string ended this sample: stop it upstream too
                self.state.abort_soon(self.engine_ids[index], item.index)
            self._count_finishes(request_state, before)
            if request_state.finished:
                self._release(index, abort=False)
            yield index

    def _observe(self, index: int, out) -> None:
        now = time.monotonic()
        series = self.state.metrics.series
        if not self._first_output[index] and out.queue_seconds is not None:
            # Measured by the rank: arrival there -> first scheduled (excludes prefill time).
            self._first_output[index] = True
            series.queue_time.observe(out.queue_seconds)
        if out.timing is not None:
            self.timings.append(out.timing)
        if not out.new_token_ids:
            return
        series.generation_tokens.inc(len(out.new_token_ids))
        if self._first_token is None:
            self._first_token = now
            series.ttft.observe(now - self.arrival)
        key = (index, out.index)
        last = self._last_token.get(key)
        if last is not None:
            series.itl.observe((now - last) / len(out.new_token_ids))
        self._last_token[key] = now

    def _count_finishes(self, request_state: RequestState, before: list[str | None]) -> None:
        for sample, previous in zip(request_state.samples, before):
            if previous is None and sample.finish_reason is not None:
                self.state.metrics.count_finish(sample.finish_reason)

    def _release(self, index: int, abort: bool) -> None:
        engine_id = self.engine_ids[index]
        if engine_id not in self.state.in_flight:
            return
        self.state.in_flight.discard(engine_id)
        if abort:
            self.state.abort_soon(engine_id)
        self.state.metrics.series.in_flight.set(len(self.state.in_flight))

    # -- the end -------------------------------------------------------------------------------------
    def close(self, outcome: str | None = None) -> None:
        """Abort what still runs upstream and log the request. Idempotent; never awaits."""
        if self._closed:
            return
        self._closed = True
        if outcome and self.outcome == "ok":
            self.outcome = outcome
        for task in self._forwarders:
            task.cancel()
        for index, engine_id in enumerate(self.engine_ids):
            if engine_id not in self._submitted:
                continue
            request_state = self.states[index]
            before = [s.finish_reason for s in request_state.samples]
            for sample in request_state.samples:
                if sample.finish_reason is None:
                    sample.finish_reason = "abort"
            self._count_finishes(request_state, before)
            self._release(index, abort=engine_id in self.state.in_flight)
        now = time.monotonic()
        if self._submitted:
            self.state.metrics.series.e2e.observe(now - self.arrival)
        fields = {
            "id": self.client_request_id, "response_id": self.request_id, "route": self.route,
            "outcome": self.outcome, "prompts": len(self.prompts), "n": self.params.n,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "latency_s": round(now - self.arrival, 4),
            "ttft_s": round(self._first_token - self.arrival, 4) if self._first_token else None,
            "finish_reasons": sorted({s.finish_reason or "none" for rs in self.states for s in rs.samples}),
        }
        if self.state.settings.log_prompts:
            fields["prompts_text"] = [p.text if p.text is not None else p.token_ids for p in self.prompts]
        log_event(logger, "request", logging.INFO if self.state.settings.log_requests else logging.DEBUG, **fields)
        self.scope_state["logged"] = True
        if self.state.tracer is not None:
            self.state.tracer.record(self)

    def close_stream(self) -> None:
        self.close(None if self.finished else "client_disconnected")

    @property
    def first_token_at(self) -> float | None:
        """When the front end got the request's first token (monotonic), as the TTFT histogram sees it."""
        return self._first_token

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(len(s.token_ids) for rs in self.states for s in rs.samples)

    def usage(self) -> UsageInfo:
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                         total_tokens=self.prompt_tokens + self.completion_tokens)

    def stream_failure(self, failed_choices: str | None, exc: EngineFailed) -> list[str]:
        """How a stream ends when the engine failed under it: the unfinished choices (an
        already-encoded chunk with finish_reason "error", or None), then an error event."""
        self.outcome = "engine_error"
        error = event(error_body(500, f"the engine failed while serving this request: {exc}", None, "engine_error"))
        return [failed_choices, error] if failed_choices else [error]


async def wait_for_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(receive, generation: Generation) -> bool:
    """Drive `generation` to the end; False when the client went away first (then it is aborted)."""
    async def drain() -> None:
        async for _ in generation.updates():
            pass

    work = asyncio.ensure_future(drain())
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watcher):
            if not task.done():
                task.cancel()
    if work in done:
        work.result()  # re-raise EngineFailed
        return True
    generation.close("client_disconnected")
    return False


async def complete(request, generation: Generation) -> bool:
    """A non-streaming request to its end: False if the client left (499, aborted upstream);
    an engine failure for this request alone becomes a 500."""
    try:
        return await run_unless_disconnected(request.receive, generation)
    except RequestRefused as exc:
        raise exc.error from None
    except EngineFailed as exc:
        generation.close("engine_error")
        if exc.retryable:  # its rank died under it and is being replaced: a retry is served
            raise APIError(503, f"the engine failed while serving this request: {exc}", None, "rank_died",
                           headers={"Retry-After": "1"})
        raise APIError(500, f"the engine failed while serving this request: {exc}", None, "engine_error")
    finally:
        generation.close()


def start_generation(state: AppState, request, prefix: str, route: str, prompts: list[PromptInput],
                     params, grammar_param: str | None = None, priority: int = 0) -> Generation:
    """Submit a validated request under a fresh id ("cmpl-…", "chatcmpl-…"), honouring X-Request-Id."""
    try:
        validate_priority(state.config, priority)
    except ValueError as exc:
        raise from_value_error(exc) from None
    client_id = responses.client_request_id(request)
    generation = Generation(state, new_request_id(prefix, client_id), route, prompts, params, client_id,
                            request.scope.get("state"), grammar_param, priority)
    if state.tracer is not None:
        generation.trace_carrier = {name: value for name in TRACE_CONTEXT_HEADERS
                                    if (value := request.headers.get(name))}
    generation.submit()
    return generation


async def start_stream(generation: Generation) -> None:
    """Before a stream's headers: a constrained request waits for its grammar, so that a spec the
    rank refuses (cannot compile, or not within the compile timeout) is a 400, not a broken stream."""
    if generation.params.structured_outputs is None:
        return
    try:
        await generation.started()
    except RequestRefused as exc:
        raise exc.error from None
    except BaseException:  # the client left while waiting (cancelled): abort upstream
        generation.close("client_disconnected")
        raise


def check_max_logprobs(state: AppState, value: int | None, param: str) -> None:
    """The server's --max-logprobs (vLLM's flag): a request asking for more is a 400."""
    limit = state.settings.max_logprobs
    if value is not None and value > limit:
        raise bad_request(f"{param}: at most {limit} (the server's --max-logprobs)", param)
