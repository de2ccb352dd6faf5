"""Lifecycle with real processes: client disconnects abort upstream, a full queue answers
503, SIGTERM drains and exits 0."""
from __future__ import annotations

import json
import os
import signal
import socket
import time

import httpx
import psutil
import pytest

from tests.service.conftest import MAIN_MAX_QUEUED, main_server
from tests.service.server_process import free_port_run, ServerProcess

LONG = {"prompt": "a long one", "max_tokens": 3000, "ignore_eos": True}
WEDGE_STALL_TIMEOUT = 4  # --health-stall-timeout of the wedge tests' server: a rank silent for 2 s is wedged


@pytest.fixture(scope="module")
def wedge_server(llama_path, tmp_path_factory):
    """The shared server's twin with a tight stall timeout, for the wedge detector's tests alone."""
    yield from main_server(llama_path, tmp_path_factory.mktemp("wedge-logs"), WEDGE_STALL_TIMEOUT)


def open_stream(server: ServerProcess, client: httpx.Client, body: dict):
    """Start a streaming completion and read its first event; returns (context, line iterator)."""
    context = client.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                            headers=server.headers)
    response = context.__enter__()
    assert response.status_code == 200
    lines = (line for line in response.iter_lines() if line)
    assert next(lines).startswith("data: {")
    return context, lines


def aborts(server: ServerProcess) -> float:
    return sum(server.metric("kvsentry_request_success_total", finished_reason="abort"))


def test_streaming_disconnect_aborts_upstream(server):
    server.wait_idle()
    before = aborts(server)
    with httpx.Client(timeout=30) as client:
        context, _ = open_stream(server, client, LONG)
        context.__exit__(None, None, None)  # hang up mid-stream
    started = time.monotonic()
    server.wait_idle(timeout=5)
    assert time.monotonic() - started < 5
    assert aborts(server) == before + 1


def test_non_streaming_disconnect_aborts_upstream(server):
    server.wait_idle()
    before = aborts(server)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", json=LONG, headers=server.headers, timeout=1.0)
    server.wait_idle(timeout=5)
    assert aborts(server) == before + 1
    log = [json.loads(line) for line in server.log_text().splitlines() if line.startswith("{")]
    assert any(e.get("outcome") == "client_disconnected" for e in log if e.get("event") == "request")


def test_full_queue_answers_503_with_retry_after(server):
    server.wait_idle()
    rejected = sum(server.metric("kvsentry_requests_rejected_total", reason="queue_full"))
    with httpx.Client(timeout=30) as client:
        streams = [open_stream(server, client, LONG) for _ in range(MAIN_MAX_QUEUED)]
        try:
            response = client.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                   headers=server.headers)
            assert response.status_code == 503
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["code"] == "queue_full"
            assert httpx.get(f"{server.url}/health").status_code == 200  # busy is not unhealthy
        finally:
            for context, _ in streams:
                context.__exit__(None, None, None)
    server.wait_idle(timeout=10)
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=server.headers,
                    timeout=30)
    assert ok.status_code == 200
    assert sum(server.metric("kvsentry_requests_rejected_total", reason="queue_full")) == rejected + 1


def wait_status(url: str, status: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (got := httpx.get(url, timeout=5).status_code) != status:
        assert time.monotonic() < deadline, f"{url} stayed {got}, wanted {status}"
        time.sleep(0.1)


def test_wedged_rank_is_replaced(wedge_server):
    """A rank alive but making no progress (SIGSTOP) is found by the wedge detector (silent for
    half of --health-stall-timeout), killed and respawned; the stream it was serving ends with
    an error, /health stays 200, and the server serves again from the new rank."""
    server = wedge_server
    server.wait_idle()
    [rank] = server.rank_pids()
    with httpx.Client(timeout=60) as client:
        context, lines = open_stream(server, client, LONG)
        os.kill(rank, signal.SIGSTOP)
        events = read_events(lines)
        context.__exit__(None, None, None)
    assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    assert not psutil.pid_exists(rank) or psutil.Process(rank).status() == psutil.STATUS_ZOMBIE
    deadline = time.monotonic() + 120
    while httpx.get(f"{server.url}/ready", timeout=5).status_code != 200:
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.1)
    [new_rank] = server.rank_pids()
    assert new_rank != rank
    assert server.metric("kvsentry_rank_restarts_total", engine="0", reason="wedged") == [1.0]
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=server.headers,
                    timeout=30)
    assert ok.status_code == 200, ok.text
    server.wait_idle(timeout=10)


def test_a_held_up_front_end_wedges_no_rank(wedge_server):
    """The wedge detector judges silence on what the front end has read: a front end stopped
    for longer than the wedge timeout (a busy host) finds the heartbeats its rank sent
    meanwhile waiting in the socket, and kills nobody."""
    server = wedge_server
    server.wait_idle()
    wait_status(f"{server.url}/ready", 200, timeout=60)
    [rank] = server.rank_pids()
    before = sum(server.metric("kvsentry_rank_restarts_total"))
    verdicts = server.log_text().count(": wedged")
    server.signal(signal.SIGSTOP)
    try:
        time.sleep(WEDGE_STALL_TIMEOUT)  # twice the wedge timeout; the rank heartbeats every second
    finally:
        server.signal(signal.SIGCONT)
    time.sleep(1.0)  # a few rounds of the detector
    assert server.log_text().count(": wedged") == verdicts, server.log_tail()
    assert server.rank_pids() == [rank]
    assert sum(server.metric("kvsentry_rank_restarts_total")) == before
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=server.headers,
                    timeout=30)
    assert ok.status_code == 200, ok.text


def read_events(lines) -> list:
    events = []
    for line in lines:
        payload = line.removeprefix("data: ")
        if payload == "[DONE]":
            events.append("[DONE]")
            break
        events.append(json.loads(payload))
    return events


def _alive(process: psutil.Process) -> bool:
    """Running, not a zombie (is_running also tells a reused pid apart by its start time)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_sigterm_drains_then_exits_zero(checkpoint, tmp_path):
    # Long context so the "slow" request cannot finish within the drain timeout, however fast the CPU.
    model = checkpoint("tiny-llama", max_position_embeddings=32768)
    proc = ServerProcess(model, "--max-model-len", "32768", "--shutdown-timeout", "8", "--log-prompts",
                         log_dir=tmp_path)
    try:
        proc.wait_ready()
        children = psutil.Process(proc.proc.pid).children(recursive=True)
        ranks = [child for child in children if child.pid in proc.rank_pids()]
        assert len(ranks) == 1, f"expected the one DP rank among the server's children {children}"
        with httpx.Client(timeout=60) as client:
            short_ctx, short = open_stream(proc, client, {"prompt": "short", "max_tokens": 20, "ignore_eos": True})
            long_ctx, long = open_stream(proc, client, {"prompt": "long", "max_tokens": 30000, "ignore_eos": True})
            proc.signal(signal.SIGTERM)
            deadline = time.monotonic() + 5
            while httpx.get(f"{proc.url}/ready").status_code != 503:
                assert time.monotonic() < deadline, "/ready did not fail while draining"
                time.sleep(0.05)
            refused = httpx.post(f"{proc.url}/v1/completions", json={"prompt": "x", "max_tokens": 2},
                                 headers=proc.headers, timeout=10)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
            assert httpx.get(f"{proc.url}/health").status_code == 200

            finished = read_events(short)
            assert finished[-1] == "[DONE]"
            assert finished[-2]["choices"][0]["finish_reason"] == "length"  # in flight: allowed to finish
            aborted = read_events(long)
            assert aborted[-1] == "[DONE]"
            assert aborted[-2]["choices"][0]["finish_reason"] == "abort"  # past --shutdown-timeout
            short_ctx.__exit__(None, None, None)
            long_ctx.__exit__(None, None, None)
        assert proc.wait(timeout=30) == 0
        # Collected while the server ran, so its own exit cannot make these checks pass. The
        # server joins its ranks before it exits; the resource tracker leaves when its pipe closes.
        assert not [rank for rank in ranks if _alive(rank)], "a DP rank outlived the server"
        deadline = time.monotonic() + 5
        while stray := [child for child in children if _alive(child)]:
            assert time.monotonic() < deadline, f"children of the server still running: {stray}"
            time.sleep(0.1)
        log = [json.loads(line) for line in proc.log_text().splitlines() if line.startswith("{")]
        events = [entry.get("event") for entry in log]
        assert "draining" in events and "drain_timeout" in events
        assert ["short"] in [entry.get("prompts_text") for entry in log]  # --log-prompts
    finally:
        proc.stop()


@pytest.mark.parametrize("taken_offset", [0, 1], ids=["requests-port", "outputs-port"])
def test_engine_that_cannot_start_exits_nonzero(llama_path, tmp_path, taken_offset):
    base = free_port_run()
    with socket.socket() as taken:  # one of the ranks' ports is already in use
        taken.bind(("127.0.0.1", base + taken_offset))
        taken.listen()
        proc = ServerProcess(llama_path, "--data-parallel-rpc-port", str(base), log_dir=tmp_path)
        try:
            assert proc.wait(timeout=60) == 1
        finally:
            proc.stop()
    events = [json.loads(line) for line in proc.log_text().splitlines() if line.startswith("{")]
    dead = [e for e in events if e.get("event") == "engine_dead"]
    assert dead and "failed to start" in dead[0]["reason"]
    # A start that failed half way still shuts down cleanly.
    assert not [e for e in events if e.get("event") == "engine_shutdown_failed"]
