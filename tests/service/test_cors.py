"""CORS in a real browser: headless Chromium loads a page served on another 127.0.0.1 port and
calls a real `kvsentry serve` (with an API key) with `fetch`. From an allowed origin the call
succeeds with the key (its preflight reached the server without one and got 2xx) and a wrong
key is a readable 401; from any other origin the browser blocks it. Without --allowed-origins
no response carries CORS headers."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from engine.config import EngineConfig
from fastapi.testclient import TestClient
from service.app import build_app
from service.cli import parse_args
from service.state import AppState, ServeSettings
from tests.service.browser import Browser, chromium_binary
from tests.service.server_process import API_KEY, ServerProcess

MODEL = "tiny-llama"
PAGE = b"<!doctype html><html><head><title>kvsentry CORS test</title></head><body>page</body></html>"


class PageServer:
    """Serves PAGE on its own 127.0.0.1 port: a page of origin http://127.0.0.1:<port>."""

    def __init__(self):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(PAGE)))
                self.end_headers()
                self.wfile.write(PAGE)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def pages():
    allowed, other = PageServer(), PageServer()
    yield allowed, other
    allowed.close()
    other.close()


@pytest.fixture(scope="module")
def cors_server(llama_path, pages, tmp_path_factory):
    allowed, _ = pages
    proc = ServerProcess(llama_path, "--served-model-name", MODEL, "--threads", "1", "--max-model-len", "512",
                         "--allowed-origins", json.dumps([allowed.origin]),
                         log_dir=tmp_path_factory.mktemp("cors-logs"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if chromium_binary() is None:
        pytest.skip("chromium is not installed (scripts/install_ci_tools.sh installs it)")
    root = tmp_path_factory.mktemp("chromium")
    b = Browser(root / "profile", root / "chromium.log")
    yield b
    b.close()


def fetch_script(api: str, key: str) -> str:
    """A page's fetch of the chat API with a bearer key and a JSON body (a non-simple request:
    the browser sends a preflight first). Resolves to what the page could see."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    return f"""
        try {{
            const r = await fetch({json.dumps(api + "/v1/chat/completions")}, {{
                method: "POST", body: {json.dumps(body)},
                headers: {{"Authorization": "Bearer " + {json.dumps(key)}, "Content-Type": "application/json"}}}});
            return {{status: r.status, body: await r.json(), requestId: r.headers.get("x-request-id")}};
        }} catch (e) {{
            return {{error: e.name, message: e.message}};
        }}"""


def network_events(browser: Browser, url: str) -> tuple[list[dict], list[dict]]:
    """(requests sent, responses received) to `url`, preflights included, from the DevTools events."""
    sent = [e["params"] for e in browser.events
            if e.get("method") == "Network.requestWillBeSent" and e["params"]["request"]["url"] == url]
    received = [e["params"] for e in browser.events
                if e.get("method") == "Network.responseReceived" and e["params"]["response"]["url"] == url]
    return sent, received


def test_an_allowed_origin_calls_the_api_with_the_key(cors_server, pages, browser):
    allowed, _ = pages
    browser.open(allowed.origin + "/")
    result = browser.run(fetch_script(cors_server.url, API_KEY))
    assert result.get("status") == 200, result
    assert result["body"]["object"] == "chat.completion"
    assert result["body"]["usage"]["completion_tokens"] > 0
    assert result["requestId"], "X-Request-Id is exposed to the page"
    sent, received = network_events(browser, cors_server.url + "/v1/chat/completions")
    preflights = [r for r in received if r["type"] == "Preflight"]
    assert preflights, f"no preflight seen: {[r['type'] for r in received]}"
    assert all(200 <= r["response"]["status"] < 300 for r in preflights)
    preflight_requests = [s for s in sent if s["request"]["method"] == "OPTIONS"]
    assert preflight_requests and all("authorization" not in {k.lower() for k in s["request"]["headers"]}
                                      for s in preflight_requests)


def test_the_actual_request_still_needs_the_key(cors_server, pages, browser):
    allowed, _ = pages
    browser.open(allowed.origin + "/")
    result = browser.run(fetch_script(cors_server.url, "wrong-key"))
    # Readable by the page (the 401 carries the CORS headers), and refused.
    assert result.get("status") == 401, result
    assert result["body"]["error"]["code"] == "invalid_api_key"


def test_another_origin_is_blocked_by_the_browser(cors_server, pages, browser):
    _, other = pages
    browser.open(other.origin + "/")
    result = browser.run(fetch_script(cors_server.url, API_KEY))
    assert result == {"error": "TypeError", "message": "Failed to fetch"}


def test_a_preflight_needs_no_key_and_an_other_origin_gets_no_cors_headers(cors_server, pages):
    allowed, other = pages
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(f"{cors_server.url}/v1/completions", headers={"Origin": allowed.origin, **preflight})
    assert ok.status_code in (200, 204)
    assert ok.headers["access-control-allow-origin"] == allowed.origin
    assert "access-control-allow-credentials" not in ok.headers  # no --allow-credentials
    refused = httpx.options(f"{cors_server.url}/v1/completions", headers={"Origin": other.origin, **preflight})
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers


class IdleEngine:
    """Enough of an engine client for routes that never reach a rank (/v1/models, refusals)."""
    ready, dead_reason, num_unfinished, last_progress = True, None, 0, 0.0
    stats: dict = {}
    op_implementations: dict = {}


def test_cors_is_off_by_default(llama_path):
    """No --allowed-origins: no CORS headers, and a preflight gets the route's 405 without
    being asked for the key (never 401); the request itself still needs it."""
    config = EngineConfig.create(llama_path, max_model_len=64, kv_cache_memory="4MiB")
    app = build_app(AppState(config, IdleEngine(), ServeSettings(served_model_names=(MODEL,), api_key=API_KEY)))
    http = TestClient(app)
    origin = {"Origin": "http://127.0.0.1:9"}
    response = http.get("/v1/models", headers={**origin, "Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200
    assert not [h for h in response.headers if h.startswith("access-control-")]
    preflight = http.options("/v1/completions", headers={**origin, "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 405
    assert not [h for h in preflight.headers if h.startswith("access-control-")]
    assert http.options("/v1/completions", headers=origin).status_code == 401  # not a preflight
    assert http.post("/v1/completions", headers=origin, json={}).status_code == 401


@pytest.mark.parametrize("argv, message", [
    (["--allowed-origins", "http://a"], "JSON list"),
    (["--allowed-origins", '["http://a", 3]'], "JSON list"),
    (["--allowed-methods", '["GET"]'], "need --allowed-origins"),
    (["--allow-credentials"], "need --allowed-origins"),
    (["--otlp-traces-endpoint", "localhost:4317"], "grpc(s)://host:port"),
])
def test_bad_flags_stop_the_command_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["serve", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_flags_parse_vllm_syntax():
    args = parse_args(["serve", "--allowed-origins", '["http://a:1"]', "--allowed-methods", '["GET", "POST"]',
                       "--allow-credentials", "--otlp-traces-endpoint", "grpc://127.0.0.1:4317"])
    assert args.allowed_origins == ("http://a:1",) and args.allowed_methods == ("GET", "POST")
    assert args.allowed_headers is None and args.allow_credentials
    assert args.otlp_traces_endpoint == "grpc://127.0.0.1:4317"
