"""--otlp-traces-endpoint against a real OTLP/HTTP receiver started here: a real `kvsentry serve`
(two DP ranks) exports one `llm_request` span per request, which the receiver decodes with the
`opentelemetry-proto` messages. Checks the trace context (a client's traceparent is continued),
the attributes against the response's usage, the times against each other, and that neither
the prompt nor the output text leaves the server."""
from __future__ import annotations

import gzip
from concurrent import futures
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.service.server_process import ServerProcess

trace_service_pb2 = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

MODEL = "tiny-llama"
PROMPT = "zebra quartz harmonica lighthouse"  # no attribute may contain it
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
SPAN_WAIT_SECONDS = 60.0


class SpanSink:
    """The spans an OTLP receiver got, as (resource, span) pairs."""

    def __init__(self):
        self.spans: list = []
        self.lock = threading.Lock()

    def add(self, request) -> None:
        with self.lock:
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    self.spans += [(resource_spans.resource, span) for span in scope_spans.spans]

    def span_of(self, request_id: str):
        """(resource, span) whose gen_ai.request.id is `request_id`, once it arrives."""
        deadline = time.monotonic() + SPAN_WAIT_SECONDS
        while time.monotonic() < deadline:
            with self.lock:
                found = [(r, s) for r, s in self.spans if attributes(s).get("gen_ai.request.id") == request_id]
            if found:
                assert len(found) == 1, f"{len(found)} spans for {request_id}"
                return found[0]
            time.sleep(0.1)
        raise AssertionError(f"no span for {request_id} within {SPAN_WAIT_SECONDS}s; got {len(self.spans)} spans")


class Receiver(SpanSink):
    """An OTLP/HTTP trace receiver on 127.0.0.1: POST /v1/traces, protobuf bodies."""

    def __init__(self):
        super().__init__()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver.add(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class GrpcReceiver(SpanSink):
    """An OTLP/gRPC trace receiver on 127.0.0.1 (the collector's TraceService)."""

    def __init__(self):
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        super().__init__()
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                receiver.add(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def close(self) -> None:
        self.server.stop(grace=None)


def value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind)


def attributes(span) -> dict:
    return {kv.key: value(kv.value) for kv in span.attributes}


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def traced_server(llama_path, receiver, tmp_path_factory):
    # OTEL_BSP_SCHEDULE_DELAY (the SDK's own variable) only makes the batch go out sooner than 5 s.
    proc = ServerProcess(llama_path, "--served-model-name", MODEL, "--threads", "1", "--max-model-len", "512",
                         "--data-parallel-size", "2", "--otlp-traces-endpoint", receiver.url,
                         log_dir=tmp_path_factory.mktemp("tracing-logs"), env={"OTEL_BSP_SCHEDULE_DELAY": "200"})
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def check_span(span, resource, request_id: str, usage, finish_reason: str, texts: list[str]) -> dict:
    attrs = attributes(span)
    assert span.name == "llm_request"
    assert span.kind == span.SPAN_KIND_SERVER
    assert {kv.key: value(kv.value) for kv in resource.attributes}["service.name"] == "kvsentry"
    assert attrs["gen_ai.request.model"] == attrs["gen_ai.response.model"] == MODEL
    assert attrs["gen_ai.response.id"] == request_id
    assert attrs["gen_ai.usage.input_tokens"] == attrs["gen_ai.usage.prompt_tokens"] == usage.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == attrs["gen_ai.usage.completion_tokens"] == usage.completion_tokens
    assert attrs["gen_ai.response.finish_reasons"] == [finish_reason]
    assert attrs["kvsentry.dp_rank"] in (0, 1)
    queue, ttft = attrs["gen_ai.latency.time_in_queue"], attrs["gen_ai.latency.time_to_first_token"]
    prefill, decode = attrs["gen_ai.latency.time_in_model_prefill"], attrs["gen_ai.latency.time_in_model_decode"]
    e2e = attrs["gen_ai.latency.e2e"]
    assert 0 <= queue and 0 < prefill and 0 <= decode
    # The rank's stamps lie inside the front end's: it received the request after the front end
    # did, and sampled the first token before the front end saw it.
    assert queue + prefill <= ttft <= e2e
    assert decode <= e2e
    assert attrs["gen_ai.latency.time_in_model_inference"] == pytest.approx(prefill + decode)
    assert abs((span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 - e2e) < 1e-3
    for key, attr in attrs.items():  # the prompt and the output never leave the server
        for text in texts:
            if len(text.strip()) >= 8:  # a shorter output could occur in any string by chance
                assert text.strip() not in str(attr), f"{key} carries request text"
    return attrs


def test_a_completion_is_one_root_span_with_the_engine_times(traced_server, receiver):
    client = traced_server.openai()
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0.0,
                                         extra_body={"ignore_eos": True})
    resource, span = receiver.span_of(response.id)
    assert len(span.trace_id) == 16 and any(span.trace_id)
    assert span.parent_span_id == b""  # no traceparent sent: a new trace
    attrs = check_span(span, resource, response.id, response.usage, "length", [PROMPT, response.choices[0].text])
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.max_tokens"] == 6
    assert attrs["gen_ai.request.temperature"] == 0.0
    assert attrs["gen_ai.request.n"] == 1
    assert response.usage.completion_tokens == 6


def test_a_client_traceparent_is_continued_on_a_stream(traced_server, receiver):
    client = traced_server.openai()
    traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=5, temperature=0.7, seed=3,
        stream=True, stream_options={"include_usage": True}, extra_headers={"traceparent": traceparent})
    chunks = list(stream)
    usage = chunks[-1].usage
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
    resource, span = receiver.span_of(chunks[0].id)
    assert span.trace_id.hex() == CLIENT_TRACE_ID
    assert span.parent_span_id.hex() == CLIENT_SPAN_ID
    attrs = check_span(span, resource, chunks[0].id, usage, finish, [PROMPT, text])
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.temperature"] == pytest.approx(0.7)


def test_the_dp_rank_is_the_rank_that_served(traced_server, receiver):
    """Requests one after another alternate over the two idle ranks (engine/dp/client.py)."""
    client = traced_server.openai()
    ids = [client.completions.create(model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=2).id for i in range(4)]
    ranks = {attributes(receiver.span_of(request_id)[1])["kvsentry.dp_rank"] for request_id in ids}
    assert ranks == {0, 1}


def test_grpc_endpoints_export_over_grpc(llama_path, tmp_path_factory):
    receiver = GrpcReceiver()
    proc = ServerProcess(llama_path, "--served-model-name", MODEL, "--threads", "1", "--max-model-len", "512",
                         "--otlp-traces-endpoint", f"grpc://127.0.0.1:{receiver.port}",
                         log_dir=tmp_path_factory.mktemp("tracing-grpc-logs"), env={"OTEL_BSP_SCHEDULE_DELAY": "200"})
    try:
        proc.wait_ready()
        client = proc.openai()
        # A client that chose not to sample its trace (flags 00) gets no span from the server either.
        unsampled = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_headers={
            "traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-00"})
        response = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, n=2, temperature=1.0, seed=5,
            extra_headers={"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"})
        resource, span = receiver.span_of(response.id)
        # Spans are exported in the order they ended: the unsampled one would have come first.
        assert not [s for _, s in receiver.spans if attributes(s)["gen_ai.request.id"] == unsampled.id]
    finally:
        proc.stop()
        receiver.close()
    assert span.trace_id.hex() == CLIENT_TRACE_ID and span.parent_span_id.hex() == CLIENT_SPAN_ID
    finish = {c.finish_reason for c in response.choices}
    assert len(finish) == 1
    attrs = check_span(span, resource, response.id, response.usage, finish.pop(), [PROMPT])
    assert attrs["gen_ai.request.n"] == 2 and attrs["kvsentry.dp_rank"] == 0


def test_without_the_flag_the_sdk_is_never_imported():
    """Zero cost when off: the server's modules load no part of the OpenTelemetry SDK."""
    code = ("import sys, service.cli, service.server, service.app, service.generate, service.state; "
            "from service.cli import parse_args; parse_args(['serve']); "
            "loaded = [m for m in sys.modules if m.startswith('opentelemetry.sdk')]; "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ}, timeout=120)
