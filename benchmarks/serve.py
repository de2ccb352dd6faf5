"""HTTP load generator for any OpenAI-compatible server: output tokens/s, TTFT and ITL.

Streams greedy, ignore_eos completions of token-id prompts (exact lengths, the same bytes
for every server) at each concurrency level, for a fixed and a mixed prompt-length workload:

    # against a running server
    .venv/bin/python benchmarks/serve.py --url http://127.0.0.1:8000
    # start kvsentry, then vLLM (/work/shared/peers/vllm-cpu.sh), on the same checkpoint; print the ratios
    .venv/bin/python benchmarks/serve.py --start-kvsentry bench-llama --start-vllm bench-llama

MODEL for --start-* is a checkpoint directory or a preset name of service.demo.checkpoint
(written once into the kvsentry cache dir). ITL is each request's mean time between tokens
after the first, (t_last - t_first) / (tokens - 1); TTFT is the time to the first streamed token.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
VLLM_SCRIPT = Path("/work/shared/peers/vllm-cpu.sh")


@dataclass
class Workload:
    name: str
    prompt_lens: list[int]  # one per request slot, cycled


@dataclass
class RequestResult:
    ttft: float
    itl: float | None
    output_tokens: int


@dataclass
class RunResult:
    server: str
    workload: str
    concurrency: int
    requests: int
    seconds: float
    output_tokens: int
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    errors: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    def row(self) -> dict:
        return {"server": self.server, "workload": self.workload, "concurrency": self.concurrency,
                "requests": self.requests, "errors": self.errors, "seconds": round(self.seconds, 3),
                "output_tok_s": round(self.tokens_per_second, 1),
                "ttft_p50_ms": _ms(percentile(self.ttft, 50)), "ttft_p99_ms": _ms(percentile(self.ttft, 99)),
                "itl_p50_ms": _ms(percentile(self.itl, 50)), "itl_p99_ms": _ms(percentile(self.itl, 99))}


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 2)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = int(rank), min(int(rank) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


# -- load -----------------------------------------------------------------------------------------
async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                      output_len: int, headers: dict) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            if event.get("choices"):
                now = time.perf_counter()
                first = first or now
                last = now
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if first is None:
        raise RuntimeError("no tokens streamed")
    itl = (last - first) / (tokens - 1) if tokens > 1 else None
    return RequestResult(first - start, itl, tokens)


async def run_level(url: str, model: str, server: str, workload: Workload, concurrency: int, requests: int,
                    output_len: int, token_range: tuple[int, int], headers: dict, seed: int) -> RunResult:
    rng = random.Random(seed)
    prompts = [[rng.randrange(*token_range) for _ in range(workload.prompt_lens[i % len(workload.prompt_lens)])]
               for i in range(requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    result = RunResult(server, workload.name, concurrency, requests, 0.0, 0)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                try:
                    r = await one_request(client, url, model, prompt, output_len, headers)
                except Exception as exc:  # count and go on: a benchmark reports, it does not crash
                    result.errors += 1
                    print(f"  request failed: {exc}", file=sys.stderr)
                    continue
                result.ttft.append(r.ttft)
                if r.itl is not None:
                    result.itl.append(r.itl)
                result.output_tokens += r.output_tokens

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        result.seconds = time.perf_counter() - start
    return result


def workloads(args: argparse.Namespace) -> list[Workload]:
    rng = random.Random(args.seed)
    low, high = args.mixed_range
    return [Workload(f"fixed-{args.input_len}", [args.input_len]),
            Workload(f"mixed-{low}..{high}", [rng.randrange(low, high + 1) for _ in range(256)])]


def discover_model(url: str, headers: dict) -> str:
    return httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]


async def bench(url: str, server: str, args: argparse.Namespace) -> list[RunResult]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or discover_model(url, headers)
    results = []
    # Warm-up: the first requests pay for lazy initialisation on either server.
    await run_level(url, model, server, Workload("warmup", [16]), 2, 4, 8, tuple(args.token_range), headers, 0)
    for workload_index, workload in enumerate(workloads(args)):
        for concurrency in args.concurrency:
            requests = max(concurrency * args.requests_per_client, args.min_requests)
            # Fresh prompts per level (the same for every server): a prompt repeated from an
            # earlier level would measure the prefix cache instead of the engine.
            level_seed = (args.seed * 1_000_003 + workload_index) * 1_000_003 + concurrency
            result = await run_level(url, model, server, workload, concurrency, requests, args.output_len,
                                     tuple(args.token_range), headers, level_seed)
            print(format_row(result.row()), flush=True)
            results.append(result)
    return results


# -- servers ----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def resolve_model(model: str) -> str:
    if Path(model).is_dir():
        return str(Path(model).resolve())
    sys.path.insert(0, str(ROOT))
    from service.demo import default_demo_path
    return str(default_demo_path(model))


def wait_ready(url: str, proc: subprocess.Popen | None, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout}s")


class KvsentryServer:
    def __init__(self, model: str, args: argparse.Namespace):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        kvsentry = Path(sys.executable).with_name("kvsentry")
        command = [str(kvsentry)] if kvsentry.exists() else [sys.executable, "-m", "service.cli"]
        argv = [*command, "serve", model, "--port", str(self.port), "--max-model-len", str(args.max_model_len),
                "--dtype", "float32", "--log-level", "warning", *args.kvsentry_args.split()]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(argv, env=env, cwd=ROOT, start_new_session=True)

    def __enter__(self) -> "KvsentryServer":
        # Ranks must be loaded: /v1/models answers before that, /ready does not.
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvsentry exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("kvsentry not ready")
            time.sleep(0.5)

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class VllmServer:
    def __init__(self, model: str, args: argparse.Namespace):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "THREADS": str(args.vllm_threads)}
        subprocess.run(["bash", str(VLLM_SCRIPT), "serve", model, str(self.port), *args.vllm_args.split()],
                       env=env, check=True)

    def __enter__(self) -> "VllmServer":
        wait_ready(self.url, None)
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run(["bash", str(VLLM_SCRIPT), "stop", str(self.port)], check=False)
        time.sleep(3)


# -- report -----------------------------------------------------------------------------------------
COLUMNS = ("server", "workload", "concurrency", "requests", "errors", "output_tok_s", "ttft_p50_ms",
           "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def format_row(row: dict) -> str:
    return "  ".join(f"{str(row[c] if row[c] is not None else '-'):>{max(len(c), 10)}}" for c in COLUMNS)


def header() -> str:
    return "  ".join(f"{c:>{max(len(c), 10)}}" for c in COLUMNS)


def ratio_table(ours: list[RunResult], theirs: list[RunResult]) -> str:
    lines = ["", "kvsentry / vLLM (throughput: higher is better; latency: lower is better)",
             f"{'workload':>16}  {'conc':>5}  {'tok/s':>7}  {'ttft p50':>9}  {'ttft p99':>9}  {'itl p50':>8}  {'itl p99':>8}"]
    peers = {(r.workload, r.concurrency): r for r in theirs}

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a is not None and b else "-"

    for r in ours:
        v = peers.get((r.workload, r.concurrency))
        if v is None:
            continue
        lines.append(f"{r.workload:>16}  {r.concurrency:>5}  {ratio(r.tokens_per_second, v.tokens_per_second):>7}  "
                     f"{ratio(percentile(r.ttft, 50), percentile(v.ttft, 50)):>9}  "
                     f"{ratio(percentile(r.ttft, 99), percentile(v.ttft, 99)):>9}  "
                     f"{ratio(percentile(r.itl, 50), percentile(v.itl, 50)):>8}  "
                     f"{ratio(percentile(r.itl, 99), percentile(v.itl, 99)):>8}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="base URL of a running OpenAI-compatible server (no /v1)")
    p.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("KVSENTRY_API_KEY"), help="bearer token, if the server wants one")
    p.add_argument("--start-kvsentry", metavar="MODEL", help="start `kvsentry serve MODEL`, benchmark it, stop it")
    p.add_argument("--start-vllm", metavar="MODEL", help="start vLLM (peers/vllm-cpu.sh) on MODEL, benchmark, stop")
    p.add_argument("--kvsentry-args", default="", help="extra `kvsentry serve` flags, e.g. '--threads 2'")
    p.add_argument("--vllm-args", default="", help="extra vLLM server flags")
    p.add_argument("--vllm-threads", type=int, default=2, help="compute threads for vLLM (THREADS of the peer script)")
    p.add_argument("--max-model-len", type=int, default=1024, help="context length both servers are started with")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64],
                   help="comma-separated concurrency levels")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens of the fixed workload")
    p.add_argument("--mixed-range", type=int, nargs=2, default=[16, 512], metavar=("LOW", "HIGH"),
                   help="prompt length range of the mixed workload")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request (ignore_eos)")
    p.add_argument("--requests-per-client", type=int, default=2, help="requests per concurrent client per level")
    p.add_argument("--min-requests", type=int, default=8, help="at least this many requests per level")
    p.add_argument("--token-range", type=int, nargs=2, default=[5, 500], metavar=("LOW", "HIGH"),
                   help="prompt token ids are drawn from [LOW, HIGH) (must be inside every vocabulary)")
    p.add_argument("--seed", type=int, default=0, help="prompt sampling seed")
    p.add_argument("--json", help="also write all rows to this JSON file")
    args = p.parse_args(argv)
    if not (args.url or args.start_kvsentry or args.start_vllm):
        p.error("give --url, --start-kvsentry or --start-vllm")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(header(), flush=True)
    runs: dict[str, list[RunResult]] = {}
    if args.url:
        runs["url"] = asyncio.run(bench(args.url.rstrip("/"), "url", args))
    if args.start_kvsentry:
        with KvsentryServer(resolve_model(args.start_kvsentry), args) as server:
            runs["kvsentry"] = asyncio.run(bench(server.url, "kvsentry", args))
    if args.start_vllm:
        with VllmServer(resolve_model(args.start_vllm), args) as server:
            runs["vllm"] = asyncio.run(bench(server.url, "vllm", args))
    if "kvsentry" in runs and "vllm" in runs:
        print(ratio_table(runs["kvsentry"], runs["vllm"]))
    if args.json:
        Path(args.json).write_text(json.dumps([r.row() for rs in runs.values() for r in rs], indent=2))
    return 0 if not any(r.errors for rs in runs.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
