"""What the HTTP layer knows about the running server: engine client, tokenizer,
settings, admission control and the health / readiness verdicts."""
from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from engine.config import EngineConfig
from engine.messages import EngineCoreOutput, EngineRequest, Fault, StepStats
from engine.tokenizer import Tokenizer
from engine.ops.implementations import describe, falling_back
from service.errors import APIError
from service.logprobs import TokenFormatter
from service.logs import log_event
from service.metrics import Metrics

logger = logging.getLogger("kvsentry.server")

DEFAULT_MAX_BODY_BYTES = 4 * 2**20


class EngineClient(Protocol):
    """The surface of engine.dp.async_client.AsyncEngineClient the service uses."""
    ready: bool
    dead_reason: str | None
    last_progress: float
    num_unfinished: int
    stats: dict[int, StepStats]
    op_implementations: dict[int, dict[str, str]]  # rank -> {op: implementation}, once the rank is ready

    async def start(self) -> None: ...
    def add_request(self, request: EngineRequest) -> "asyncio.Queue[EngineCoreOutput | Exception]": ...
    async def abort(self, request_id: str, index: int | None = None) -> None: ...
    async def inject_fault(self, rank: int, fault: Fault) -> None: ...
    async def shutdown(self) -> None: ...


@dataclass(frozen=True)
class ServeSettings:
    served_model_names: tuple[str, ...]
    api_key: str | None = None
    max_queued_requests: int = 512
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    health_stall_timeout: float = 60.0
    shutdown_timeout: float = 30.0
    log_prompts: bool = False
    enable_fault_injection: bool = False
    tool_call_parser: str | None = None  # parses tool calls out of free text for tool_choice "auto"
    reasoning_parser: str | None = None  # splits the model's thinking into reasoning_content
    chat_template: str | None = None     # --chat-template: replaces the checkpoint's
    trust_request_chat_template: bool = False  # a request may bring its own template (code the server runs)
    max_logprobs: int = 20               # --max-logprobs: the most logprobs a request may ask for
    log_requests: bool = True            # the per-request log line at info (--disable-log-requests: debug)
    uvicorn_log_level: str | None = None  # uvicorn's own loggers; None: left as they are
    responses_store_size: int = 1000     # --responses-store-size: responses kept for previous_response_id
    allowed_origins: tuple[str, ...] | None = None  # --allowed-origins: CORS answers only when set
    allowed_methods: tuple[str, ...] = ("*",)       # --allowed-methods (CORS)
    allowed_headers: tuple[str, ...] = ("*",)       # --allowed-headers (CORS)
    allow_credentials: bool = False                 # --allow-credentials (CORS)
    otlp_traces_endpoint: str | None = None         # --otlp-traces-endpoint: a span per request when set


class AppState:
    def __init__(self, config: EngineConfig, client: EngineClient, settings: ServeSettings,
                 tokenizer: Tokenizer | None = None):
        self.config = config
        self.client = client
        self.settings = settings
        self.tokenizer = tokenizer or Tokenizer(config.model.tokenizer)
        self.formatter = TokenFormatter(self.tokenizer)
        # Every token covers at most this many characters of text, so a longer text cannot fit in
        # max_model_len tokens: it is refused before tokenizing (seconds of CPU for a 4 MiB body).
        longest_piece = max((len(piece) for piece in self.tokenizer.backend.get_vocab(with_added_tokens=True)),
                            default=1)
        self.max_prompt_chars = config.max_model_len * max(1, longest_piece)
        self.metrics = Metrics(self.model_name, lambda: self.client.stats, lambda: self.client.op_implementations)
        self.metrics.watch_supervision(lambda: getattr(self.client, "supervision", None))
        listeners = getattr(self.client, "stats_listeners", None)
        if listeners is not None:
            listeners.append(self.metrics.observe_stats)
        self.created = int(time.time())
        self.draining = False
        self.start_error: str | None = None
        self.in_flight: set[str] = set()  # engine request ids submitted and not yet released
        # Called once when the engine dies; server.py makes the process exit non-zero.
        self.on_fatal: Callable[[str], None] = lambda reason: None
        self._fatal_reported = False
        self._tasks: set[asyncio.Task] = set()
        self.tracer = None  # service/tracing.py's RequestTracer; imported only when tracing is on
        if settings.otlp_traces_endpoint:
            from service.tracing import RequestTracer
            self.tracer = RequestTracer(settings.otlp_traces_endpoint, self.model_name)

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    @property
    def dead_reason(self) -> str | None:
        return self.start_error or self.client.dead_reason

    # -- lifecycle (driven by the app's lifespan) ---------------------------------------------------
    async def startup(self) -> None:
        self.spawn(self._start_client())
        self.spawn(self._watch())

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await self.client.shutdown()
        except Exception as exc:  # e.g. it never started; the process is exiting either way
            log_event(logger, "engine_shutdown_failed", logging.WARNING, error=f"{type(exc).__name__}: {exc}")
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)  # the spans still queued go out before exit

    async def _start_client(self) -> None:
        if self.client.ready:
            return
        started = time.monotonic()
        try:
            await self.client.start()
        except Exception as exc:  # the process cannot serve: report and exit non-zero
            self.start_error = f"engine failed to start: {type(exc).__name__}: {exc}"
            return
        gc.collect()
        gc.freeze()  # startup's objects live as long as the server: keep them out of collections
        log_event(logger, "engine_ready", load_s=round(time.monotonic() - started, 3),
                  data_parallel_size=self.config.parallel.data_parallel_size,
                  num_blocks=self.config.num_blocks, max_model_len=self.config.max_model_len,
                  dtype=str(self.config.model.dtype).removeprefix("torch."), dtype_reason=self.config.dtype_reason)
        for rank, implementations in sorted(self.client.op_implementations.items()):
            # A kernel that is off or failed to build runs its fallback (engine/ops/registry.py):
            # slower, and for attention and the GEMMs equal only within a tolerance.
            fallbacks = falling_back(implementations, self.config.device)
            log_event(logger, "rank_ops", logging.WARNING if fallbacks else logging.INFO, rank=rank,
                      ops=describe(implementations), fallbacks=fallbacks)

    async def _watch(self) -> None:
        while True:
            reason = self.dead_reason
            if reason and not self._fatal_reported:
                self._fatal_reported = True
                log_event(logger, "engine_dead", logging.ERROR, reason=reason,
                          in_flight=len(self.in_flight))
                self.on_fatal(reason)
            await asyncio.sleep(0.2)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Fire-and-forget a coroutine (kept referenced until done). Safe in cancelled scopes."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def abort_soon(self, request_id: str, index: int | None = None) -> None:
        """Abort a request (or one sample of it) upstream without waiting."""
        async def abort() -> None:
            try:
                await self.client.abort(request_id, index)
            except Exception as exc:  # the engine may be gone; nothing left to abort then
                logger.debug("abort of %s failed: %s", request_id, exc)
        self.spawn(abort())

    # -- verdicts -------------------------------------------------------------------------------
    def health(self) -> tuple[bool, str]:
        reason = self.dead_reason
        if reason:
            return False, reason
        stalled = time.monotonic() - self.client.last_progress
        if (self.client.ready and self.client.num_unfinished > 0
                and stalled > self.settings.health_stall_timeout):
            return False, (f"engine made no progress for {stalled:.0f}s with "
                           f"{self.client.num_unfinished} requests in flight")
        return True, "ok"

    def readiness(self) -> tuple[bool, str]:
        healthy, reason = self.health()
        if not healthy:
            return False, reason
        if self.draining:
            return False, "draining"
        if not self.client.ready:
            return False, getattr(self.client, "unready_reason", "loading")
        tripped = sorted(r for r, s in self.client.stats.items() if s.integrity.nan_policy_tripped)
        if tripped:
            return False, f"NaN policy tripped on DP rank(s) {tripped}"
        return True, "ok"

    # -- admission --------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.settings.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist.", "model", "model_not_found")

    def admit(self, count: int) -> None:
        """Raise 503 unless `count` more engine requests may be submitted now."""
        reason = None
        if self.dead_reason:
            reason, why = "engine_dead", f"engine is not running: {self.dead_reason}"
        elif self.draining:
            reason, why = "draining", "server is shutting down"
        elif not self.client.ready:
            reason, why = "loading", "model is still loading"
        elif len(self.in_flight) + count > self.settings.max_queued_requests:
            reason, why = "queue_full", (f"too many requests in flight (limit "
                                         f"{self.settings.max_queued_requests}); retry later")
        if reason:
            self.metrics.rejected.labels(self.model_name, reason).inc()
            raise APIError(503, why, None, reason, headers={"Retry-After": "1"})
