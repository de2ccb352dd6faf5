"""The servers benchmarks/serve.py measures: start one, wait until it serves, stop it with all
its processes, and read how much CPU its process tree used. Both run with prefix caching off
(PREFIX_CACHING_OFF): serve.py's prompts are fresh per level, and a cache hit would measure the
cache, not the engine."""
from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from common import DEFAULT_MODEL, bench_checkpoint, hf_checkpoint

ROOT = Path(__file__).resolve().parents[1]
VLLM_SCRIPT = Path("/work/shared/peers/vllm-cpu.sh")
VLLM_DIR = Path(os.environ.get("PEER_DIR", Path.home() / ".cache/kvsentry-peers/vllm-cpu"))  # the script's PEER_DIR
# The same flag in both servers' CLIs (kvsentry's engine_args, vLLM's EngineArgs: BooleanOptionalAction).
PREFIX_CACHING_OFF = "--no-enable-prefix-caching"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def resolve_model(model: str) -> str:
    """A checkpoint dir both servers load: `model` itself; for "default" or a .gguf file, the
    file dequantized into a cached safetensors dir (vLLM's CPU build does not start on a GGUF);
    else a preset name of service.demo.checkpoint, written once into the kvsentry cache dir."""
    if model == DEFAULT_MODEL or model.endswith(".gguf"):
        return hf_checkpoint(bench_checkpoint(model))
    if Path(model).is_dir():
        return str(Path(model).resolve())
    from service.demo import default_demo_path
    return str(default_demo_path(model))


def kvsentry_model(model: str, dequantized: bool) -> str:
    """What kvsentry serves: "default" or a .gguf file as the file itself, as `kvsentry serve`
    runs it (its Q4_1 and Q8_0 linears multiplied from their own blocks, which dequantize to
    exactly the weights of resolve_model's dir); that dir with `dequantized`; else resolve_model."""
    if (model == DEFAULT_MODEL or model.endswith(".gguf")) and not dequantized:
        return bench_checkpoint(model)
    return resolve_model(model)


def wait_ready(endpoint: str, proc: subprocess.Popen | None = None, timeout: float = 600.0) -> None:
    """Until GET `endpoint` answers 200; fails early when `proc` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(endpoint, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{endpoint} not ready after {timeout}s")


class KvsentryServer:
    """`kvsentry serve` in its own session; leaving stops every process of that session."""

    def __init__(self, model: str, args: argparse.Namespace):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.threads = args.kvsentry_threads
        kvsentry = Path(sys.executable).with_name("kvsentry")
        command = [str(kvsentry)] if kvsentry.exists() else [sys.executable, "-m", "service.cli"]
        argv = [*command, "serve", model, "--port", str(self.port), "--max-model-len", str(args.max_model_len),
                "--dtype", args.dtype, "--threads", str(self.threads), "--log-level", "warning",
                PREFIX_CACHING_OFF, *args.kvsentry_args.split()]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(argv, env=env, cwd=ROOT, start_new_session=True)
        self.pid = self.proc.pid

    def threads_note(self) -> str:
        return (f"kvsentry: --threads {self.threads} (torch threads of its engine rank; not pinned), "
                f"{PREFIX_CACHING_OFF}")

    def __enter__(self) -> "KvsentryServer":
        try:
            wait_ready(f"{self.url}/ready", self.proc)  # ranks loaded: /v1/models answers before that
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        # The next server must find the cores free: wait for the ranks too, then kill what is left.
        deadline = time.monotonic() + 30
        try:
            while time.monotonic() < deadline:
                os.killpg(self.pid, 0)
                time.sleep(0.2)
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def vllm_cores(threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `threads` compute threads: cores 0..threads-1."""
    return "0" if threads == 1 else f"0-{threads - 1}"


class VllmServer:
    """vLLM's CPU build through the peer script, its OpenMP threads bound to cores 0..N-1."""

    def __init__(self, model: str, args: argparse.Namespace):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        n = args.vllm_threads
        env = {**os.environ, "THREADS": str(n), "VLLM_CPU_OMP_THREADS_BIND": vllm_cores(n)}
        # The script passes --dtype float32 before these arguments; the later --dtype wins.
        subprocess.run(["bash", str(VLLM_SCRIPT), "serve", model, str(self.port), "--dtype", args.dtype,
                        PREFIX_CACHING_OFF, *args.vllm_args.split()],
                       env=env, check=True)
        self.pid = int((VLLM_DIR / f"serve-{self.port}.pid").read_text())

    def threads_note(self) -> str:
        log = (VLLM_DIR / f"serve-{self.port}.log").read_text(errors="replace").splitlines()
        binding = [line.strip() for line in log if "VLLM_CPU_OMP_THREADS_BIND=" in line or "core ids=" in line]
        # Its config line says whether the prefix cache is really off.
        prefix = sorted({m for line in log for m in re.findall(r"enable_prefix_caching=\w+", line)})
        return "vLLM: " + ("; ".join(binding) or "no OpenMP binding line in its log") + \
            f"; {', '.join(prefix) or 'no enable_prefix_caching in its log'}"

    def __enter__(self) -> "VllmServer":
        wait_ready(f"{self.url}/v1/models")
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run(["bash", str(VLLM_SCRIPT), "stop", str(self.port)], check=False)  # waits until gone


def peer_version() -> str:
    """The vLLM version installed in the peer venv (its distribution is vllm-cpu)."""
    for metadata in sorted(VLLM_DIR.glob("venv/lib/python*/site-packages/vllm*.dist-info/METADATA")):
        for line in metadata.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def _stat_fields(path: Path) -> list[str] | None:
    try:  # fields after "(comm)": [0] state, [1] ppid, [11] utime, [12] stime
        return path.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        if (fields := _stat_fields(stat)) is not None:
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def thread_cpu_seconds(root: int) -> dict[int, float]:
    """CPU seconds so far of every thread (by tid) of `root` and its descendants."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for pid in process_tree(root):
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            if (fields := _stat_fields(stat)) is not None:
                seconds[int(stat.parent.name)] = (int(fields[11]) + int(fields[12])) / tick
    return seconds
