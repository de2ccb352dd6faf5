"""OpenTelemetry traces (--otlp-traces-endpoint): one `llm_request` span per generation request.

This module is imported only when the flag is set, so a server without it loads no part of the
OpenTelemetry SDK and pays nothing per request. The span is built when the request ends
(`Generation.close`) from times already measured: the front end's arrival, first token and end
(the same ones the Prometheus histograms observe) and the times the DP rank stamped on the
request (`RequestTiming`: queued, first and last token). `span.end()` only queues it; a
BatchSpanProcessor thread exports it, off the request path.

A client's W3C `traceparent` (and `tracestate`) is continued: the span is its child. No prompt
or output text is ever set on the span: only counts, times, ids and sampling parameters.
"""
from __future__ import annotations

import logging
import time
from typing import Protocol
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from engine.messages import RequestTiming
from engine.sampling_params import SamplingParams
from service import __version__

logger = logging.getLogger("kvsentry.server")

SPAN_NAME = "llm_request"  # vLLM's name, so its dashboards and queries carry over
GRPC_SCHEMES = frozenset({"grpc", "grpcs"})
HTTP_SCHEMES = frozenset({"http", "https"})
OTLP_HTTP_TRACES_PATH = "/v1/traces"
EXPORT_SHUTDOWN_SECONDS = 5.0

# OpenAI-style routes to the gen_ai.operation.name of the semantic conventions.
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}


class Generation(Protocol):
    """What a span is made of: service/generate.py's Generation (not imported: it imports this
    module's user, service/state.py)."""
    request_id: str
    route: str
    params: SamplingParams
    prompts: list
    states: list
    outcome: str
    arrival: float                 # monotonic
    timings: list[RequestTiming]
    trace_carrier: dict[str, str]

    @property
    def first_token_at(self) -> float | None: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...


def exporter_for(endpoint: str) -> SpanExporter:
    """OTLP over HTTP/protobuf for http(s)://host:port[/path] (the path defaults to /v1/traces),
    over gRPC for grpc://host:port (plaintext) or grpcs://host:port (TLS)."""
    url = urlsplit(endpoint)
    if url.scheme in GRPC_SCHEMES:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        return GrpcExporter(endpoint=url.netloc, insecure=url.scheme == "grpc")
    if url.scheme in HTTP_SCHEMES:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
        if url.path in ("", "/"):
            endpoint = f"{url.scheme}://{url.netloc}{OTLP_HTTP_TRACES_PATH}"
        return HttpExporter(endpoint=endpoint)
    raise ValueError(f"--otlp-traces-endpoint: scheme must be http, https, grpc or grpcs, got {endpoint!r}")


class RequestTracer:
    def __init__(self, endpoint: str, model_name: str):
        self.model_name = model_name
        self.provider = TracerProvider(resource=Resource.create({"service.name": "kvsentry",
                                                                 "service.version": __version__}))
        self.provider.add_span_processor(BatchSpanProcessor(exporter_for(endpoint)))
        self.tracer = self.provider.get_tracer("kvsentry.service", __version__)
        self.propagator = TraceContextTextMapPropagator()

    def shutdown(self) -> None:
        """Export what is still queued (bounded), then stop the export thread."""
        self.provider.force_flush(int(EXPORT_SHUTDOWN_SECONDS * 1000))
        self.provider.shutdown()

    def record(self, generation: Generation) -> None:
        """The span of a request that just ended. Never raises into the request's path."""
        try:
            self._record(generation)
        except Exception as exc:  # a tracing fault must not fail a served request
            logger.warning("trace of %s not recorded: %s: %s", generation.request_id, type(exc).__name__, exc)

    def _record(self, generation: Generation) -> None:
        end_ns = time.time_ns()
        e2e = time.monotonic() - generation.arrival
        start_ns = end_ns - int(e2e * 1e9)
        parent = self.propagator.extract(generation.trace_carrier) if generation.trace_carrier else None
        span = self.tracer.start_span(SPAN_NAME, context=parent, kind=SpanKind.SERVER, start_time=start_ns,
                                      attributes=self.attributes(generation, e2e))
        if generation.outcome in ("engine_error", "rejected"):
            span.set_status(Status(StatusCode.ERROR, generation.outcome))
        span.end(end_time=end_ns)

    def attributes(self, generation: Generation, e2e: float) -> dict:
        params = generation.params
        finish_reasons = sorted({s.finish_reason or "none" for rs in generation.states for s in rs.samples})
        attributes = {
            "gen_ai.operation.name": OPERATIONS.get(generation.route, generation.route),
            "gen_ai.request.model": self.model_name,
            "gen_ai.response.model": self.model_name,
            "gen_ai.request.id": generation.request_id,
            "gen_ai.response.id": generation.request_id,
            "gen_ai.request.n": params.n,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.usage.input_tokens": generation.prompt_tokens,
            "gen_ai.usage.output_tokens": generation.completion_tokens,
            "gen_ai.usage.prompt_tokens": generation.prompt_tokens,       # vLLM's names of the same two
            "gen_ai.usage.completion_tokens": generation.completion_tokens,
            "gen_ai.response.finish_reasons": finish_reasons,
            "gen_ai.latency.e2e": e2e,
            "kvsentry.route": generation.route,
            "kvsentry.outcome": generation.outcome,
            "kvsentry.prompts": len(generation.prompts),
        }
        if generation.first_token_at is not None:
            attributes["gen_ai.latency.time_to_first_token"] = generation.first_token_at - generation.arrival
        attributes.update(rank_attributes(generation.timings))
        return attributes


def rank_attributes(timings: list[RequestTiming]) -> dict:
    """Queue, prefill and decode times from the ranks' stamps. A request of several samples
    (n > 1, or several prompts) is measured as a whole: queued until its first sample was
    scheduled, prefilling until its first token, decoding until its last."""
    attributes: dict = {}
    ranks = sorted({t.rank for t in timings})
    if len(ranks) == 1:
        attributes["kvsentry.dp_rank"] = ranks[0]
    elif ranks:
        attributes["kvsentry.dp_ranks"] = ranks
    scheduled = min((t.scheduled for t in timings if t.scheduled is not None), default=None)
    first_token = min((t.first_token for t in timings if t.first_token is not None), default=None)
    last_token = max((t.last_token for t in timings if t.last_token is not None), default=None)
    if scheduled is not None:
        attributes["gen_ai.latency.time_in_queue"] = scheduled
    if scheduled is not None and first_token is not None:
        attributes["gen_ai.latency.time_in_model_prefill"] = first_token - scheduled
    if first_token is not None and last_token is not None:
        attributes["gen_ai.latency.time_in_model_decode"] = last_token - first_token
    if scheduled is not None and last_token is not None:
        attributes["gen_ai.latency.time_in_model_inference"] = last_token - scheduled
    return attributes
