"""End to end: a real Prometheus server scrapes a running `kvsentry serve`, evaluates the
project's own rule file, and fires KVCacheNaNDetected after a NaN is planted through
/debug/faults -- and not before. A second server, which never gets a NaN, shows the
integrity alerts beyond NaN: KVCacheChecksumMismatch after a bit flip in a sealed block
and KVCacheForeignWrite after a dummy batch with a stale slot buffer, both with the NaN
metrics still at 0."""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.service.server_process import ServerProcess, free_port

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yaml"


def run_server(checkpoint, tmp_path_factory, *flags: str):
    # A sweep of 1024 blocks every step (no time budget) covers the 64 MiB test cache in a few
    # idle heartbeats.
    proc = ServerProcess(checkpoint("tiny-llama"), "--enable-fault-injection", "--nan-policy", "count",
                         "--nan-scan-budget", "0", "--nan-scan-blocks-per-step", "1024", *flags, log_dir=tmp_path_factory.mktemp("kvsentry"))
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    yield from run_server(checkpoint, tmp_path_factory)


@pytest.fixture(scope="module")
def integrity_server(checkpoint, tmp_path_factory):
    # Never gets a NaN: its NaN metrics must stay 0 through the bit flip and the stale dummy
    # batch. The checksum sweep, like the NaN scan, covers the test cache within a step or two.
    yield from run_server(checkpoint, tmp_path_factory, "--kv-checksums", "rolling",
                          "--kv-checksum-blocks-per-step", "1024")


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    yield from run_prometheus(server, tmp_path_factory)


@pytest.fixture(scope="module")
def integrity_prometheus(integrity_server, tmp_path_factory):
    yield from run_prometheus(integrity_server, tmp_path_factory)


def run_prometheus(server: ServerProcess, tmp_path_factory):
    """A Prometheus that scrapes `server` every second and evaluates alerts.yaml every second."""
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


def wait_for_target_and_rules(prom: str, *alerts: str) -> None:
    """Prometheus is scraping the real server and has loaded the project's rules."""
    wait_for(lambda: any(t["health"] == "up" for t in
                         httpx.get(f"{prom}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]),
             30, "the kvsentry target to be up")
    groups = httpx.get(f"{prom}/api/v1/rules", timeout=5).json()["data"]["groups"]
    loaded = {r["name"] for g in groups for r in g["rules"]}
    assert set(alerts) <= loaded, f"rules not loaded: {set(alerts) - loaded}"


def query(prom: str, promql: str) -> list[dict]:
    return httpx.get(f"{prom}/api/v1/query", params={"query": promql}, timeout=5).json()["data"]["result"]


def test_nan_alert_fires_through_prometheus(server, prometheus):
    wait_for_target_and_rules(prometheus, "KVCacheNaNDetected")
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


# ---- beyond NaN: sealed-block checksums and foreign writes --------------------------------

INTEGRITY_ALERTS = ("KVCacheChecksumMismatch", "KVCacheForeignWrite")
BLOCK_SIZE = 16  # the engine's default --block-size
LONG_PROMPT = " ".join(f"word{i}" for i in range(24))  # several blocks of tokens: full blocks seal


def complete(server: ServerProcess, prompt: str, max_tokens: int = 4) -> dict:
    with server.client() as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        response = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens})
        assert response.status_code == 200, response.text
        return response.json()


def inject(server: ServerProcess, fault: dict) -> None:
    with server.client() as client:
        response = client.post("/debug/faults", json={"rank": 0, **fault})
        assert response.status_code == 200, response.text


def firing(prom: str, name: str) -> list[dict]:
    return [a for a in alert_states(prom, name) if a["state"] == "firing"]


def assert_no_nan(server: ServerProcess, prom: str) -> None:
    """The NaN sentinel saw nothing: the corruption was finite."""
    values = server.metric("kvsentry_kv_cache_nan_values", engine="0")
    detections = server.metric("kvsentry_kv_cache_nan_detections_total", engine="0")
    assert values and not any(values), f"kvsentry_kv_cache_nan_values: {values}"
    assert detections and not any(detections), f"kvsentry_kv_cache_nan_detections_total: {detections}"
    assert server.metric("kvsentry_null_block_writes_total", engine="0") == [0.0]
    assert alert_states(prom, "KVCacheNaNDetected") == []
    assert alert_states(prom, "KVCacheNullBlockWritten") == []


def test_clean_traffic_exports_the_integrity_metrics_at_zero_and_fires_nothing(integrity_server,
                                                                              integrity_prometheus):
    server, prom = integrity_server, integrity_prometheus
    wait_for_target_and_rules(prom, *INTEGRITY_ALERTS)
    # Exported from start-up, both regions, so that increase() sees the first mismatch.
    for region in ("prefix_cache", "running"):
        assert server.metric("kvsentry_kv_cache_checksum_mismatches_total", engine="0", region=region) == [0.0]
    assert server.metric("kvsentry_kv_foreign_writes_total", engine="0") == [0.0]
    # Healthy traffic whose prompts fill whole blocks: they seal, the sweep verifies them.
    for i in range(3):
        usage = complete(server, f"{LONG_PROMPT} {i}")["usage"]
        assert usage["prompt_tokens"] > 2 * BLOCK_SIZE, usage
    wait_for(lambda: server.metric("kvsentry_kv_cache_sealed_blocks", engine="0")[0] > 0, 30,
             "sealed blocks after prompts longer than a block")
    assert server.metric("kvsentry_kv_cache_checksum_coverage_steps", engine="0")[0] >= 1
    wait_for(lambda: len(query(prom, "kvsentry_kv_cache_checksum_mismatches_total")) == 2
             and query(prom, "kvsentry_kv_foreign_writes_total"), 30, "the integrity counters to be scraped")
    time.sleep(4)  # several sweeps, scrapes and rule evaluations
    for name in INTEGRITY_ALERTS:
        assert alert_states(prom, name) == [], name
    assert all(float(r["value"][1]) == 0 for r in query(prom, "kvsentry_kv_cache_checksum_mismatches_total"))
    assert all(float(r["value"][1]) == 0 for r in query(prom, "kvsentry_kv_foreign_writes_total"))
    assert_no_nan(server, prom)


def test_a_bit_flip_in_a_sealed_block_fires_checksum_mismatch_and_no_nan(integrity_server, integrity_prometheus):
    server, prom = integrity_server, integrity_prometheus
    wait_for_target_and_rules(prom, *INTEGRITY_ALERTS)
    complete(server, f"{LONG_PROMPT} flip")
    wait_for(lambda: server.metric("kvsentry_kv_cache_sealed_blocks", engine="0")[0] > 0, 30, "a sealed block")
    assert alert_states(prom, "KVCacheChecksumMismatch") == []
    # No block: the rank flips a bit of its most recently sealed block. Its request has
    # finished, so the block is kept for reuse: region prefix_cache.
    inject(server, {"kind": "bitflip"})
    alerts = wait_for(lambda: firing(prom, "KVCacheChecksumMismatch"), 60, "KVCacheChecksumMismatch to fire")
    assert alerts[0]["labels"]["severity"] == "critical"
    assert alerts[0]["labels"].get("engine") == "0"
    assert alerts[0]["labels"].get("region") == "prefix_cache", alerts
    assert server.metric("kvsentry_kv_cache_checksum_mismatches_total", engine="0", region="prefix_cache")[0] >= 1
    # The point of checksums: the corruption is finite, so the NaN sentinel (1024 blocks a
    # step: the whole cache) sees nothing.
    assert_no_nan(server, prom)


def test_a_stale_slot_dummy_batch_fires_foreign_write_and_no_nan(integrity_server, integrity_prometheus):
    server, prom = integrity_server, integrity_prometheus
    wait_for_target_and_rules(prom, *INTEGRITY_ALERTS)
    assert server.metric("kvsentry_kv_foreign_writes_total", engine="0") == [0.0]
    assert alert_states(prom, "KVCacheForeignWrite") == []
    # Right after a real step: the slot buffer still holds that step's (real) slots, and
    # the replayed dummy batch writes them although it owns no block.
    complete(server, f"{LONG_PROMPT} stale")
    inject(server, {"kind": "stale_slot_dummy"})
    alerts = wait_for(lambda: firing(prom, "KVCacheForeignWrite"), 60, "KVCacheForeignWrite to fire")
    assert alerts[0]["labels"]["severity"] == "critical"
    assert alerts[0]["labels"].get("engine") == "0"
    assert server.metric("kvsentry_kv_foreign_writes_total", engine="0")[0] > 0
    # Finite values into real blocks: no NaN, and not the null block either.
    assert_no_nan(server, prom)
