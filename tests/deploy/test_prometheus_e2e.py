"""End to end: a real Prometheus server scrapes a running `kvsentry serve`, evaluates the
project's own rule file, and fires KVCacheNaNDetected after a NaN is planted through
/debug/faults -- and not before."""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.service.server_process import ServerProcess, free_port

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yaml"


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    # A sweep of 1024 blocks per step covers the 64 MiB test cache in a few idle heartbeats.
    proc = ServerProcess(checkpoint("tiny-llama"), "--enable-fault-injection", "--nan-policy", "count",
                         "--nan-scan-blocks-per-step", "1024",
                         log_dir=tmp_path_factory.mktemp("kvsentry"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    binary = shutil.which("prometheus")
    assert binary, "prometheus is missing: run `bash scripts/install_ci_tools.sh`"
    workdir = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    (workdir / "prometheus.yml").write_text(f"""
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: ["{RULES}"]
scrape_configs:
  - job_name: kvsentry
    metrics_path: /metrics
    static_configs: [{{targets: ["127.0.0.1:{server.port}"]}}]
""")
    log = open(workdir / "prometheus.log", "wb")
    proc = subprocess.Popen([binary, f"--config.file={workdir / 'prometheus.yml'}",
                             f"--storage.tsdb.path={workdir / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (workdir / "prometheus.log").read_text()
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


def alert_states(prom: str, name: str) -> list[dict]:
    alerts = httpx.get(f"{prom}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == name]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}")


def test_nan_alert_fires_through_prometheus(server, prometheus):
    # Prometheus is scraping the real server and has loaded the project's rules.
    wait_for(lambda: any(t["health"] == "up" for t in
                         httpx.get(f"{prometheus}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]),
             30, "the kvsentry target to be up")
    groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=5).json()["data"]["groups"]
    assert any(r["name"] == "KVCacheNaNDetected" for g in groups for r in g["rules"])
    # Healthy traffic: some requests, several evaluations, no alert.
    with server.client() as client:
        for i in range(3):
            assert client.post("/v1/completions", json={"model": client.get("/v1/models").json()["data"][0]["id"],
                                                        "prompt": f"hello {i}", "max_tokens": 4}).status_code == 200
    wait_for(lambda: httpx.get(f"{prometheus}/api/v1/query", params={"query": "kvsentry_kv_cache_nan_values"},
                               timeout=5).json()["data"]["result"], 30, "the sentinel gauge to be scraped")
    time.sleep(3)
    assert alert_states(prometheus, "KVCacheNaNDetected") == []
    # Plant a NaN into an allocated block of layer 1 on rank 0.
    with server.client() as client:
        response = client.post("/debug/faults", json={"rank": 0, "kind": "nan", "layer": 1, "block": 3,
                                                      "target": "v"})
        assert response.status_code == 200, response.text
    firing = wait_for(lambda: [a for a in alert_states(prometheus, "KVCacheNaNDetected") if a["state"] == "firing"],
                      60, "KVCacheNaNDetected to fire")
    assert firing[0]["labels"]["severity"] == "critical"
    assert firing[0]["labels"].get("engine") == "0"
