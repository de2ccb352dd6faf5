"""A real `kvsentry serve` process on 127.0.0.1, for end-to-end tests."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

API_KEY = "test-key"


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_run(count: int = 3) -> int:
    """First of `count` consecutive free ports (the DP rpc ports)."""
    for _ in range(200):
        # Below Linux's ephemeral range (32768+), where the OS picks any outgoing connection's port.
        base = random.randrange(20000, 32700)
        if all(_bindable(base + i) for i in range(count)):
            return base
    raise RuntimeError("no run of free ports")


def kvsentry_command() -> list[str]:
    script = Path(sys.executable).with_name("kvsentry")
    return [str(script)] if script.exists() else [sys.executable, "-m", "service.cli"]


class ServerProcess:
    def __init__(self, model: str | None, *flags: str, log_dir: Path, api_key: str | None = API_KEY,
                 env: dict[str, str] | None = None):
        self.port = free_port()
        self.api_key = api_key
        argv = [*kvsentry_command(), "serve", *([model] if model else []), "--port", str(self.port),
                "--data-parallel-rpc-port", str(free_port_run()), "--kv-cache-memory", "64MiB", *flags]
        if "--dtype" not in flags:  # the exact path the tests compare with transformers in float32
            argv += ["--dtype", "float32"]
        if api_key:
            argv += ["--api-key", api_key]
        self.log_path = log_dir / f"kvsentry-{self.port}.log"
        self._log = open(self.log_path, "wb")
        root = Path(__file__).resolve().parents[2]
        full_env = {**os.environ, "PYTHONPATH": str(root), **(env or {})}
        # Own session: cleanup can signal exactly the processes this server started.
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                     cwd=root, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kwargs.pop("timeout", 60), **kwargs)

    def openai(self, **kwargs):
        import openai
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=kwargs.pop("timeout", 60), **kwargs)

    def wait_ready(self, timeout: float = 300.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvsentry exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"kvsentry not ready after {timeout}s:\n{self.log_tail()}")

    def rank_pids(self) -> list[int]:
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return [c.pid for c in children if "multiprocessing" in " ".join(c.cmdline())
                and "resource_tracker" not in " ".join(c.cmdline())]

    def metric(self, name: str, **labels: str) -> list[float]:
        """Values of the samples of `name` whose labels include `labels`."""
        from prometheus_client.parser import text_string_to_metric_families
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        values = []
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    values.append(sample.value)
        return values

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until every rank reports no running/waiting request and an empty KV cache."""
        deadline = time.monotonic() + timeout
        while True:
            usage = self.metric("kvsentry_kv_cache_usage_perc")
            busy = self.metric("kvsentry_num_requests_running") + self.metric("kvsentry_num_requests_waiting")
            in_flight = self.metric("kvsentry_frontend_requests_in_flight")
            if usage and not any(usage) and not any(busy) and not any(in_flight):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not idle: kv usage {usage}, running+waiting {busy}, "
                                     f"in flight {in_flight}")
            time.sleep(0.1)

    def log_tail(self, lines: int = 40) -> str:
        if not self._log.closed:
            self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def log_text(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stray ranks of this server, if any
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait(5)
        self._log.close()
