"""HTTP load generator for any OpenAI-compatible server: output tokens/s, TTFT and ITL.

README rows, the real default model (SmolLM2-135M-Instruct: kvsentry serves its Q4_1 GGUF, vLLM
the same weights dequantized once into a float32 safetensors dir), fixed-128 and mixed 16..512 at concurrency
1/8/32/64, 1 compute thread each, float32 (~30 min) then bfloat16 (~25 min); about 15 min of
each are the 16 server starts (vLLM ~80 s each: it compiles its model at every start):

    .venv/bin/python benchmarks/serve.py --start-kvsentry default --start-vllm default --dtype float32
    .venv/bin/python benchmarks/serve.py --start-kvsentry default --start-vllm default --dtype bfloat16

and the tiny bench-llama preset, float32:

    .venv/bin/python benchmarks/serve.py --start-kvsentry bench-llama --start-vllm bench-llama

Streams greedy, ignore_eos completions of token-id prompts (exact lengths, the same bytes
for every server) at each concurrency level, for a fixed and a mixed prompt-length workload.
With both --start-* flags the two servers alternate level by level, each alone on the
machine: for every level one is started, warmed up, measured and stopped (with all its
processes) before the other starts, and the one that goes first alternates between levels.
Both get --threads compute threads (kvsentry `--threads`, vLLM's OpenMP threads bound to
cores 0..N-1); each row shows the CPU cores the server's processes used and how many of its
threads were busy (>= half the level's wall time). Both servers run in --dtype, with prefix
caching off. Both return the completions' token ids (vLLM's return_token_ids), and the two
servers' greedy ids on the same checkpoint are judged by judge.py: identical in float32 (where
kvsentry serves its exact path, --quantized-activations none: a GGUF's int8 default cannot be
identical); in bfloat16 a divergence passes as a near-tie, by kvsentry's exact float32 logprobs
of the two tokens at its first position (judge.NEAR_TIE_LOGPROB), or as the peer's rounding
where those rank kvsentry's token higher. After the comparison the run writes its JSON
(rows, ratios, the verdict's counts and every divergence) into benchmarks/results/, named by
date, machine kind and commit, and exits 1 when the verdict fails or a request failed.

    # against a running server (no comparison)
    .venv/bin/python benchmarks/serve.py --url http://127.0.0.1:8000

MODEL for --start-* is a checkpoint directory, "default" or a .gguf file, or a preset name of
service.demo.checkpoint (written once into the kvsentry cache dir). A GGUF file is dequantized
once into a cached checkpoint dir for vLLM, whose CPU build does not start on a GGUF; kvsentry
serves the file itself, as its users run it (--kvsentry-dequantized: the dir too). vLLM runs from
/work/shared/peers/vllm-cpu.sh. Prompt token ids are drawn from the started checkpoint's
vocabulary above its special tokens unless --token-range says otherwise.
ITL is each request's mean time between tokens after the first, (t_last - t_first) /
(tokens - 1); TTFT is the time to the first streamed token.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from common import DTYPES, prompt_token_range
from judge import EXACT_FLOAT32, Float32Scorer, Verdict, judge
from results import provenance, write_result
from servers import ROOT, KvsentryServer, VllmServer, kvsentry_model, peer_version, resolve_model, thread_cpu_seconds

sys.path.insert(0, str(ROOT))
from engine import envs  # noqa: E402

WARMUP_SEED = 7_777_777  # offsets a level's seed: warm-up prompts are never the measured ones
WARMUP_TOKENS = 8
URL_TOKEN_RANGE = (5, 500)  # inside every vocabulary
BUSY_SHARE = 0.5  # a thread busy for at least this share of a level's wall time counts as a compute thread


@dataclass
class Workload:
    name: str
    prompt_lens: list[int]  # one per request slot, cycled


@dataclass(frozen=True)
class Level:
    index: int
    workload: Workload
    concurrency: int
    requests: int
    seed: int  # fresh prompts per level, the same for every server

    def prompts(self, token_range: tuple[int, int]) -> list[list[int]]:
        rng = random.Random(self.seed)
        lens = self.workload.prompt_lens
        return [[rng.randrange(*token_range) for _ in range(lens[i % len(lens)])] for i in range(self.requests)]


@dataclass
class RequestResult:
    ttft: float
    itl: float | None
    output_tokens: int
    text: str
    token_ids: list[int] | None  # where the server sends them (vLLM's return_token_ids)


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
    outputs: list[RequestResult | None] = field(default_factory=list)  # per prompt; None where it failed
    errors: int = 0
    cpu_cores: float | None = None  # CPU seconds of the server's processes / wall seconds
    busy_threads: int | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    def row(self) -> dict:
        return {"server": self.server, "workload": self.workload, "concurrency": self.concurrency,
                "requests": self.requests, "errors": self.errors, "seconds": round(self.seconds, 3),
                "output_tok_s": round(self.tokens_per_second, 1),
                "ttft_p50_ms": _ms(percentile(self.ttft, 50)), "ttft_p99_ms": _ms(percentile(self.ttft, 99)),
                "itl_p50_ms": _ms(percentile(self.itl, 50)), "itl_p99_ms": _ms(percentile(self.itl, 99)),
                "cpu_cores": None if self.cpu_cores is None else round(self.cpu_cores, 2),
                "busy_threads": self.busy_threads}


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
async def stream_events(client: httpx.AsyncClient, url: str, body: dict, headers: dict | None = None):
    """The parsed events of one streamed completion (an error event or a non-200 raises)."""
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            yield event


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                      output_len: int, headers: dict) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    start = time.perf_counter()
    first = last = None
    tokens = 0
    text, token_ids = [], None
    async for event in stream_events(client, f"{url}/v1/completions", body, headers):
        if event.get("choices"):
            now = time.perf_counter()
            first = first or now
            last = now
            choice = event["choices"][0]
            text.append(choice.get("text") or "")
            if choice.get("token_ids") is not None:
                token_ids = (token_ids or []) + choice["token_ids"]
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    if first is None:
        raise RuntimeError("no tokens streamed")
    itl = (last - first) / (tokens - 1) if tokens > 1 else None
    return RequestResult(first - start, itl, tokens, "".join(text), token_ids)


async def run_level(url: str, model: str, server: str, level: Level, output_len: int,
                    token_range: tuple[int, int], headers: dict, pid: int | None = None) -> RunResult:
    """Send the level's prompts from `level.concurrency` clients; with `pid`, also measure the CPU
    its process tree used."""
    prompts = level.prompts(token_range)
    queue: asyncio.Queue = asyncio.Queue()
    for item in enumerate(prompts):
        queue.put_nowait(item)
    result = RunResult(server, level.workload.name, level.concurrency, level.requests, 0.0, 0,
                       outputs=[None] * len(prompts))
    limits = httpx.Limits(max_connections=level.concurrency + 4, max_keepalive_connections=level.concurrency + 4)

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                index, prompt = queue.get_nowait()
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
                result.outputs[index] = r

        cpu_before = thread_cpu_seconds(pid) if pid else {}
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(level.concurrency)))
        result.seconds = time.perf_counter() - start
    if pid:
        used = [seconds - cpu_before.get(tid, 0.0) for tid, seconds in thread_cpu_seconds(pid).items()]
        result.cpu_cores = sum(used) / result.seconds
        result.busy_threads = sum(u >= BUSY_SHARE * result.seconds for u in used)
    return result


def levels(args: argparse.Namespace) -> list[Level]:
    rng = random.Random(args.seed)
    low, high = args.mixed_range
    workloads = [Workload(f"fixed-{args.input_len}", [args.input_len]),
                 Workload(f"mixed-{low}..{high}", [rng.randrange(low, high + 1) for _ in range(256)])]
    out = []
    for w, workload in enumerate(workloads):
        for concurrency in args.concurrency:
            # Fresh prompts per level: a prompt repeated from an earlier level would measure
            # the prefix cache instead of the engine.
            seed = (args.seed * 1_000_003 + w) * 1_000_003 + concurrency
            out.append(Level(len(out), workload, concurrency,
                             max(concurrency * args.requests_per_client, args.min_requests), seed))
    return out


def discover_model(url: str, headers: dict) -> str:
    return httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]


async def measure(url: str, server: str, level: Level, args: argparse.Namespace, pid: int | None) -> RunResult:
    """Warm up on the level's prompt lengths and concurrency (a fresh server pays for lazy
    initialisation of each new shape), on prompts of its own, then measure the level."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or discover_model(url, headers)
    warmup = Level(-1, level.workload, level.concurrency, level.concurrency, seed=level.seed + WARMUP_SEED)
    token_range = tuple(args.token_range)
    await run_level(url, model, server, warmup, WARMUP_TOKENS, token_range, headers)
    result = await run_level(url, model, server, level, args.output_len, token_range, headers, pid)
    print(format_row(result.row()), flush=True)
    return result


# -- report -----------------------------------------------------------------------------------------
COLUMNS = ("server", "workload", "concurrency", "requests", "errors", "output_tok_s", "ttft_p50_ms",
           "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "cpu_cores", "busy_threads")


def format_row(row: dict) -> str:
    return "  ".join(f"{str(row[c] if row[c] is not None else '-'):>{max(len(c), 10)}}" for c in COLUMNS)


def header() -> str:
    return "  ".join(f"{c:>{max(len(c), 10)}}" for c in COLUMNS)


def ratios(ours: list[RunResult], theirs: list[RunResult]) -> list[dict]:
    """kvsentry / vLLM per level: throughput (higher is better) and latency percentiles (lower is better)."""
    peers = {(r.workload, r.concurrency): r for r in theirs}

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    return [{"workload": r.workload, "concurrency": r.concurrency,
             "output_tok_s": ratio(r.tokens_per_second, v.tokens_per_second),
             "ttft_p50": ratio(percentile(r.ttft, 50), percentile(v.ttft, 50)),
             "ttft_p99": ratio(percentile(r.ttft, 99), percentile(v.ttft, 99)),
             "itl_p50": ratio(percentile(r.itl, 50), percentile(v.itl, 50)),
             "itl_p99": ratio(percentile(r.itl, 99), percentile(v.itl, 99))}
            for r in ours if (v := peers.get((r.workload, r.concurrency))) is not None]


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


def compare_outputs(ours: list[RunResult], theirs: list[RunResult], args: argparse.Namespace,
                    score=None) -> Verdict:
    """judge.py's verdict on the two servers' greedy token ids, request by request; `score` (a
    float32 kvsentry) judges bfloat16 divergences. A server that sent no ids fails it."""
    labels = [f"{r.workload} c{r.concurrency} request {i}" for r in ours for i in range(r.requests)]
    prompts = [p for level in levels(args) for p in level.prompts(tuple(args.token_range))]
    a, b = ([None if o is None else o.token_ids for run in side for o in run.outputs] for side in (ours, theirs))
    return judge("greedy token ids", args.dtype, a, b, prompts, ("kvsentry", "vLLM"), labels, score)


FLOAT32_EXACT = ["--quantized-activations", EXACT_FLOAT32["quantized_activations"]]  # for the float32 gate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="base URL of a running OpenAI-compatible server (no /v1)")
    p.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=envs.api_key(), help="bearer token, if the server wants one")
    p.add_argument("--start-kvsentry", metavar="MODEL", help="start `kvsentry serve MODEL` for each level")
    p.add_argument("--start-vllm", metavar="MODEL", help="start vLLM (peers/vllm-cpu.sh) on MODEL for each level")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and activations of started servers")
    p.add_argument("--threads", type=int, default=1, help="compute threads of each started server")
    p.add_argument("--kvsentry-threads", type=int, help="kvsentry's alone (default: --threads)")
    p.add_argument("--vllm-threads", type=int, help="vLLM's alone (default: --threads)")
    p.add_argument("--kvsentry-args", default="", help="extra `kvsentry serve` flags")
    p.add_argument("--kvsentry-dequantized", action="store_true",
                   help="kvsentry serves a GGUF's dequantized dir, as vLLM does, not the file")
    p.add_argument("--vllm-args", default="", help="extra vLLM server flags")
    p.add_argument("--max-model-len", type=int, default=1024, help="context length both servers are started with")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64],
                   help="comma-separated concurrency levels")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens of the fixed workload")
    p.add_argument("--mixed-range", type=int, nargs=2, default=[16, 512], metavar=("LOW", "HIGH"),
                   help="prompt length range of the mixed workload")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request (ignore_eos)")
    p.add_argument("--requests-per-client", type=int, default=2, help="requests per concurrent client per level")
    p.add_argument("--min-requests", type=int, default=8, help="at least this many requests per level")
    p.add_argument("--token-range", type=int, nargs=2, metavar=("LOW", "HIGH"),
                   help="prompt token ids are drawn from [LOW, HIGH) (default: the started checkpoint's "
                        f"vocabulary above its special tokens; with --url only, {URL_TOKEN_RANGE})")
    p.add_argument("--seed", type=int, default=0, help="prompt sampling seed")
    p.add_argument("--json", help="write the JSON here instead of benchmarks/results/")
    args = p.parse_args(argv)
    if not (args.url or args.start_kvsentry or args.start_vllm):
        p.error("give --url, --start-kvsentry or --start-vllm")
    args.kvsentry_threads = args.kvsentry_threads or args.threads
    args.vllm_threads = args.vllm_threads or args.threads
    if args.dtype == "float32":
        # float32 is judged by identical ids, which a GGUF's default (int8 activations on a VNNI
        # CPU, in float32 too) cannot give: the exact weights, unless --kvsentry-args says otherwise
        # (it comes after, and wins).
        args.kvsentry_args = " ".join([*FLOAT32_EXACT, args.kvsentry_args]).strip()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = provenance()  # the commit and time the run starts at
    runs: dict[str, list[RunResult]] = {}
    notes: dict[str, str] = {}
    started = {}
    if args.start_kvsentry:
        started["kvsentry"] = (KvsentryServer, kvsentry_model(args.start_kvsentry, args.kvsentry_dequantized))
    if args.start_vllm:
        started["vllm"] = (VllmServer, resolve_model(args.start_vllm))
    if args.token_range is None:
        args.token_range = prompt_token_range(next(iter(started.values()))[1]) if started else URL_TOKEN_RANGE
    for name, (_, model) in started.items():
        print(f"{name} serves {model}", flush=True)
    print(f"prompt token ids from [{args.token_range[0]}, {args.token_range[1]}), {args.dtype}", flush=True)
    print(header(), flush=True)
    if args.url:
        runs["url"] = [asyncio.run(measure(args.url.rstrip("/"), "url", level, args, None)) for level in levels(args)]
    for level in levels(args):
        # Each server alone on the machine while measured; which goes first alternates by level.
        for name in (list(started) if level.index % 2 == 0 else list(started)[::-1]):
            server_class, model = started[name]
            with server_class(model, args) as server:
                if name not in runs:
                    notes[name] = server.threads_note()
                    print(f"  {notes[name]}", flush=True)
                runs.setdefault(name, []).append(asyncio.run(measure(server.url, name, level, args, server.pid)))
    errors = sum(r.errors for rs in runs.values() for r in rs)
    result = {"args": vars(args), "servers": {name: model for name, (_, model) in started.items()},
              "threads": notes, "rows": [r.row() for rs in runs.values() for r in rs], "errors": errors}
    verdict = None
    if "kvsentry" in runs and "vllm" in runs:
        print(ratio_table(runs["kvsentry"], runs["vllm"]))
        result["peer"] = f"vLLM {peer_version()}"
        result["ratios"] = ratios(runs["kvsentry"], runs["vllm"])
        score = Float32Scorer(started["kvsentry"][1]) if args.dtype != "float32" else None
        try:
            verdict = compare_outputs(runs["kvsentry"], runs["vllm"], args, score)
        finally:
            if score is not None:
                score.close()
        print(verdict.summary())
        result["verdict"] = verdict.as_json()
    write_result(f"serve-{args.dtype}", result, args.json, stamp)
    if errors:
        print(f"FAIL: {errors} requests failed", file=sys.stderr)
    return 1 if errors or (verdict is not None and not verdict.passed) else 0


if __name__ == "__main__":
    sys.exit(main())
