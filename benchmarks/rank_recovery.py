"""Rank recovery: the time from a rank's SIGKILL to full capacity again, and the requests lost,
on the demo MoE (DP=2, expert parallel, lockstep: a death re-forms the whole group).

    .venv/bin/python benchmarks/rank_recovery.py [--clients 16] [--kills 2] [--max-tokens 64]

A load of --clients concurrent `openai` clients (every other one streaming) runs throughout;
every --interval seconds a `kill_rank` fault (POST /debug/faults, a SIGKILL inside the rank)
goes to rank 1, then rank 0, ... For each kill: seconds until /ready is 200 again with every
rank live (kvsentry_live_ranks), and how the requests in flight ended: re-queued (finished,
unseen by the client) or failed (had streamed; an error in the stream or a 503). For
comparison, the server's own start-up (what a pod restart costs at least) is timed too.
Verdict: every kill recovers to full capacity, every request ends (none hangs), and the
failed ones are exactly the server's kvsentry_requests_failed_by_rank_death_total.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai

from results import write_result

ROOT = Path(__file__).resolve().parents[1]


def free_port(count: int = 1) -> int:
    for _ in range(500):
        base = random.randrange(20000, 60000)
        try:
            for offset in range(count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", base + offset))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


def metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        total += sum(s.value for s in family.samples if s.name == name)
    return total


class Load:
    """--clients threads sending greedy completions until stopped; each outcome with its times."""

    def __init__(self, url: str, clients: int, max_tokens: int):
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
        self.model = self.client.models.list().data[0].id
        self.max_tokens = max_tokens
        self.stop = threading.Event()
        self.records: list[tuple[float, float, str, int]] = []  # (start, end, outcome, tokens)
        self.threads = [threading.Thread(target=self.run, args=(i % 2 == 0, i), daemon=True) for i in range(clients)]

    def one(self, stream: bool, seed: int) -> tuple[str, int]:
        params = dict(model=self.model, prompt=f"client {seed}: the key value cache", temperature=0.0,
                      max_tokens=self.max_tokens, extra_body={"ignore_eos": True})
        try:
            if not stream:
                return "ok", self.client.completions.create(**params).usage.completion_tokens
            tokens, finish = 0, None
            for chunk in self.client.completions.create(**params, stream=True):
                if chunk.choices:
                    tokens += 1 if chunk.choices[0].text else 0
                    finish = chunk.choices[0].finish_reason or finish
            return ("ok" if finish == "length" else f"finish_{finish}"), tokens
        except openai.APIStatusError as exc:  # rank_died: had output when its rank died; else e.g. re-forming
            code = exc.body.get("code") if isinstance(exc.body, dict) else None
            return f"http_{exc.status_code}_{code}", 0
        except openai.APIError:
            return "stream_error", 0

    def run(self, stream: bool, seed: int) -> None:
        while not self.stop.is_set():
            start = time.monotonic()
            outcome, tokens = self.one(stream, seed)
            self.records.append((start, time.monotonic(), outcome, tokens))
            if outcome.startswith("http_"):
                time.sleep(0.2)  # a 503 while the group re-forms asks for a retry after a while


def recover(url: str, size: int, restarts_before: float, timeout: float) -> float:
    """Seconds until every rank is live again and /ready is 200, after a restart was counted."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if (metric(url, "kvsentry_rank_restarts_total") > restarts_before
                and metric(url, "kvsentry_live_ranks") == size
                and httpx.get(f"{url}/ready", timeout=5).status_code == 200):
            return time.monotonic() - start
        time.sleep(0.05)
    raise TimeoutError(f"not back at full capacity after {timeout} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--interval", type=float, default=10.0, help="seconds of load between kills")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--output", help="result JSON path (default: benchmarks/results/rank-recovery_...)")
    args = parser.parse_args()

    load_start = round(os.getloadavg()[0], 2)  # other work on the machine slows the respawn's imports
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    kvsentry = Path(sys.executable).with_name("kvsentry")
    command = [str(kvsentry)] if kvsentry.exists() else [sys.executable, "-m", "service.cli"]
    argv = [*command, "serve", "--demo", "moe", "--port", str(port), "--data-parallel-rpc-port", str(free_port(3)),
            "--threads", str(args.threads), "--enable-fault-injection", "--log-level", "warning",
            "--max-rank-restarts", str(args.kills + 5)]
    started = time.monotonic()
    proc = subprocess.Popen(argv, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, start_new_session=True)
    try:
        while not _ready(url):
            if proc.poll() is not None:
                raise SystemExit(f"server exited with {proc.returncode}")
            time.sleep(0.2)
        startup = time.monotonic() - started
        size = int(metric(url, "kvsentry_live_ranks"))
        load = Load(url, args.clients, args.max_tokens)
        for thread in load.threads:
            thread.start()
        kills = []
        for k in range(args.kills):
            time.sleep(args.interval)
            rank = (1 + k) % size
            restarts = metric(url, "kvsentry_rank_restarts_total")
            httpx.post(f"{url}/debug/faults", json={"rank": rank, "kind": "kill_rank"}, timeout=10).raise_for_status()
            kills.append({"rank": rank, "to_full_capacity_s": round(recover(url, size, restarts, 300), 3)})
        time.sleep(args.interval)
        load.stop.set()
        for thread in load.threads:
            thread.join(300)
        hung = sum(thread.is_alive() for thread in load.threads)
        failed_metric = metric(url, "kvsentry_requests_failed_by_rank_death_total")
        requeued = metric(url, "kvsentry_requests_requeued_total")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    outcomes: dict[str, int] = {}
    for _, _, outcome, _ in load.records:
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    # Allowed: served, failed by a rank's death (error in the stream, or a 503 for a non-streamed
    # one that had output, or for a new one while the group re-forms).
    unexpected = {o: n for o, n in outcomes.items()
                  if o not in ("ok", "stream_error", "finish_error") and not o.startswith("http_503")}
    recoveries = [k["to_full_capacity_s"] for k in kills]
    passed = (hung == 0 and len(recoveries) == args.kills and not unexpected and outcomes.get("ok", 0) > 0
              and outcomes.get("stream_error", 0) + outcomes.get("finish_error", 0)
              + outcomes.get("http_503_rank_died", 0) == failed_metric)
    payload = {
        "benchmark": "rank_recovery",
        "model": "demo moe (tiny DeepSeek-V3-style MoE + MLA), DP=2 expert parallel, lockstep",
        "load_average_1m": {"start": load_start, "end": round(os.getloadavg()[0], 2)},
        "clients": args.clients, "max_tokens": args.max_tokens, "threads_per_rank": args.threads,
        "server_startup_s": round(startup, 3), "kills": kills,
        "median_kill_to_full_capacity_s": round(statistics.median(recoveries), 3),
        "requests": {"total": len(load.records), "outcomes": outcomes, "requeued": int(requeued),
                     "failed_by_rank_death": int(failed_metric), "hung": hung},
        "verdict": {"passed": passed, "rule": "every kill back to full capacity, no request hung, requests "
                    "served, none ended any other way than served, failed by a rank's death or 503 while re-forming, "
                    "every failed request counted by kvsentry_requests_failed_by_rank_death_total"},
    }
    print(f"startup {startup:.1f} s; kill -> full capacity {recoveries} s; requests {outcomes}, "
          f"re-queued {int(requeued)}, failed by rank death {int(failed_metric)}, hung {hung}")
    write_result("rank-recovery", payload, args.output)
    return 0 if passed else 1


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    sys.exit(main())
