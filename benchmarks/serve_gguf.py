"""kvsentry against llama.cpp's `llama-server` on one GGUF file: output tokens/s, TTFT and ITL per
concurrency level, each server's resident memory, and greedy agreement on 32 prompts.

    python benchmarks/serve_gguf.py --model default --threads 1 --dtype bfloat16
    python benchmarks/serve_gguf.py --model q4_0 --threads 2           # the default model, requantized by llama-quantize
    python benchmarks/serve_gguf.py --model 1b-q4_0 --concurrency 1,8  # the TinyLlama-shaped 1B (make_1b_gguf.py)

MODEL: "default" (SmolLM2-135M-Instruct Q4_1), "q4_0" (that file requantized to Q4_0 by the peer's
llama-quantize, cached: the format llama.cpp repacks at load on x86), "1b-q4_0", "1b-q4_1", "1b-q8_0",
or a .gguf path. Both servers read the same file.

How it measures (as a user runs each): llama.cpp with -t/-tb = --threads, -np = the level's
concurrency (a fresh llama-server per level, as slots are fixed at start, idle while kvsentry is
measured), -c = slots x --max-model-len, every request with "cache_prompt": false; kvsentry with
`--threads`, prefix caching off, started once (its batch is not fixed at start) and idle while
llama.cpp is measured. Levels alternate which server goes first (A B, B A, ...). With --rounds N
each level measures both servers N times in A B B A order, fresh prompts each round, and its
ratio is the median of kvsentry's rounds over the median of llama.cpp's: on a shared 2-core
machine one round of each moves by 10-20%. Prompts are text:
consecutive words of Newton's Opticks (perplexity.py's text) from seeded offsets, fresh per level
and round and the same for both servers, about --input-words words (~100 tokens); greedy,
`ignore_eos`, --output-len new tokens, streamed. Each level is warmed up on prompts of its own first.

Outputs are compared loosely: llama.cpp's numerics differ (its own quantized dot products), so the
report is greedy agreement (identical completions) and the first divergent token position per prompt
on 32 prompts of 32 new tokens, never a failure. RSS: VmRSS and VmHWM of llama-server, and of
kvsentry's front end (the `kvsentry serve` process) and its rank (the other processes of its tree),
read after the last level. The machine's load average is recorded before each level: on a shared
machine the numbers are only as good as the quiet they were measured in.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from llamacpp_peer import LlamaCppServer, quantize, version
from perplexity import text_source
from results import provenance, write_result
from serve import RequestResult, percentile, stream_events
from servers import KvsentryServer, process_tree, thread_cpu_seconds

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from engine import envs  # noqa: E402

AGREEMENT_PROMPTS, AGREEMENT_TOKENS = 32, 32
WARMUP_TOKENS = 8


def round_order(level: int, rounds: int) -> list[str]:
    """Which server each measurement of level `level` goes to: A B, B A, A B, ... over the rounds,
    A being kvsentry on even levels and llama.cpp on odd ones (A B B A for two rounds)."""
    pair = ["kvsentry", "llama.cpp"] if level % 2 == 0 else ["llama.cpp", "kvsentry"]
    return [name for r in range(rounds) for name in (pair if r % 2 == 0 else pair[::-1])]


def level_ratio(rows: list[dict], concurrency: int) -> dict:
    """kvsentry's median output tokens/s over llama.cpp's at one level, and each round's own ratio."""
    rates = {name: [r["output_tok_s"] for r in rows if r["server"] == name and r["concurrency"] == concurrency]
             for name in ("kvsentry", "llama.cpp")}
    ours, theirs = statistics.median(rates["kvsentry"]), statistics.median(rates["llama.cpp"])
    return {"concurrency": concurrency, "output_tok_s": round(ours / theirs, 3) if theirs else None,
            "rounds": [round(a / b, 3) if b else None for a, b in zip(rates["kvsentry"], rates["llama.cpp"])]}


def model_file(name: str) -> str:
    from engine.gguf.default_model import default_model_path
    if name == "default":
        return default_model_path()
    if name == "q4_0":
        target = envs.cache_dir() / "models" / "SmolLM2-135M-Instruct.Q4_0-requantized.gguf"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            quantize(Path(default_model_path()), target, "Q4_0")
        return str(target)
    if name.startswith("1b-"):
        from make_1b_gguf import model_paths
        return str(model_paths(formats=(name[3:].upper(),))[name[3:].upper()])
    return name


def text_prompts(count: int, words: int, seed: int) -> list[str]:
    corpus = text_source()[0].split()
    rng = random.Random(seed)
    return [" ".join(corpus[(s := rng.randrange(len(corpus) - words)):s + words]) for _ in range(count)]


def rss(pid: int) -> dict:
    """kB of VmRSS and VmHWM of `pid` alone."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1])
    except OSError:
        pass
    return out


def tree_rss(root: int) -> dict:
    """MiB: the root process's RSS/HWM and the rest of its tree's (kvsentry: front end and rank)."""
    rest = [rss(pid) for pid in process_tree(root) if pid != root]
    top = rss(root)
    return {"root_rss_mib": round(top.get("VmRSS", 0) / 1024, 1), "root_hwm_mib": round(top.get("VmHWM", 0) / 1024, 1),
            "children_rss_mib": round(sum(r.get("VmRSS", 0) for r in rest) / 1024, 1),
            "children_hwm_mib": round(sum(r.get("VmHWM", 0) for r in rest) / 1024, 1)}


def free_port_run(count: int = 3) -> int:
    """The first of `count` consecutive free ports: kvsentry's --data-parallel-rpc-port (its default
    29550 may be taken by another server on a shared machine)."""
    import socket
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(30000, 60000)
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no run of free ports")


def served_name(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


served_name.cache = {}  # url -> name, read once per server


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, llama: bool) -> RequestResult:
    body = {"model": served_name.cache[url], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    if llama:
        body["cache_prompt"] = False
    start, first, last, chunks, text = time.perf_counter(), None, None, 0, []
    async for event in stream_events(client, f"{url}/v1/completions", body):
        if event.get("choices") and event["choices"][0].get("text"):
            last = time.perf_counter()
            first = first or last
            chunks += 1
            text.append(event["choices"][0]["text"])
    if first is None:
        raise RuntimeError("no tokens streamed")
    # ignore_eos: every request makes max_tokens tokens (a chunk may carry several when they join into one character).
    return RequestResult(first - start, (last - first) / (max_tokens - 1) if max_tokens > 1 else None,
                         max_tokens, "".join(text), None)


async def run_level(url: str, prompts: list[str], concurrency: int, max_tokens: int, llama: bool,
                    pid: int | None = None) -> dict:
    served_name.cache.setdefault(url, served_name(url))
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results, errors = [], 0
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:
        async def worker() -> None:
            nonlocal errors
            while not queue.empty():
                prompt = queue.get_nowait()
                try:
                    try:
                        results.append(await one_request(client, url, prompt, max_tokens, llama))
                    except httpx.RemoteProtocolError:  # llama-server closed a kept-alive connection: once more
                        results.append(await one_request(client, url, prompt, max_tokens, llama))
                except Exception as exc:  # a benchmark reports, it does not crash
                    errors += 1
                    print(f"  request failed: {exc}", file=sys.stderr)
        cpu_before = thread_cpu_seconds(pid) if pid else {}
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    # Cores the server's process tree kept busy: its CPU seconds over the level's wall seconds.
    cores = (sum(thread_cpu_seconds(pid).values()) - sum(cpu_before.values())) / seconds if pid else None
    tokens = sum(r.output_tokens for r in results)
    ms = lambda v: None if v is None else round(1000 * v, 1)  # noqa: E731
    return {"concurrency": concurrency, "requests": len(prompts), "errors": errors, "seconds": round(seconds, 2),
            "output_tok_s": round(tokens / seconds, 1), "ttft_p50_ms": ms(percentile([r.ttft for r in results], 50)),
            "itl_p50_ms": ms(percentile([r.itl for r in results if r.itl is not None], 50)),
            "cpu_cores": None if cores is None else round(cores, 2)}


def greedy_ids(url: str, prompts: list[str], llama: bool) -> list[list[int]]:
    """Greedy completions' token ids: kvsentry's return_token_ids, llama.cpp's /completion return_tokens."""
    out = []
    with httpx.Client(timeout=900) as client:
        for prompt in prompts:
            if llama:
                r = client.post(f"{url}/completion", json={"prompt": prompt, "n_predict": AGREEMENT_TOKENS,
                                                            "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                                                            "cache_prompt": False, "return_tokens": True}).json()
                out.append(r["tokens"])
            else:
                r = client.post(f"{url}/v1/completions", json={"model": served_name(url), "prompt": prompt, "temperature": 0.0,
                                                               "max_tokens": AGREEMENT_TOKENS, "ignore_eos": True,
                                                               "return_token_ids": True}).json()
                out.append(r["choices"][0]["token_ids"])
    return out


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y))) for x, y in zip(ours, theirs)]
    same = sum(x == y for x, y in zip(ours, theirs))
    return {"prompts": len(ours), "new_tokens": AGREEMENT_TOKENS, "identical": same,
            "first_divergence": [f if x != y else None for f, x, y in zip(firsts, ours, theirs)],
            "mean_agreeing_prefix": round(sum(firsts) / len(firsts), 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="auto", help="kvsentry's --dtype")
    p.add_argument("--kvsentry-args", default="", help="extra `kvsentry serve` flags (e.g. the int8 path's)")
    p.add_argument("--llama-args", default="", help="extra llama-server flags (e.g. --no-repack: see docs)")
    p.add_argument("--llama-no-amx", action="store_true",
                   help="llama-server with its ggml-cpu built without AMX (its AMX matmul crashes on some Xeons)")
    p.add_argument("--label", default="", help="names kvsentry's path in the result (e.g. int8)")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64])
    p.add_argument("--input-words", type=int, default=75)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--no-agreement", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="measurements of each server per level, A B B A (medians)")
    args = p.parse_args()
    stamp = provenance()
    gguf = model_file(args.model)
    print(f"serving {gguf}; {version()}; load {os.getloadavg()}", flush=True)
    kv_args = argparse.Namespace(kvsentry_threads=args.threads, max_model_len=args.max_model_len, dtype=args.dtype,
                                 kvsentry_args=f"{args.kvsentry_args} --data-parallel-rpc-port {free_port_run()}")
    rows, memory, agree = [], {}, None
    with KvsentryServer(gguf, kv_args) as kv:
        for index, concurrency in enumerate(args.concurrency):
            requests = max(concurrency * args.requests_per_client, args.min_requests)
            seed = args.seed * 1_000_003 + concurrency
            warmup = text_prompts(concurrency, args.input_words, ~seed)
            order = round_order(index, args.rounds)
            with LlamaCppServer(gguf, args.threads, concurrency, args.max_model_len, args.llama_args,
                                args.llama_no_amx) as llama:
                asyncio.run(run_level(llama.url, warmup, concurrency, WARMUP_TOKENS, True))
                asyncio.run(run_level(kv.url, warmup, concurrency, WARMUP_TOKENS, False))
                for turn, name in enumerate(order):
                    # Fresh prompts each round, the same for both servers within it.
                    prompts = text_prompts(requests, args.input_words, seed + 7919 * (turn // 2))
                    load = os.getloadavg()[0]
                    if name == "kvsentry":
                        row = asyncio.run(run_level(kv.url, prompts, concurrency, args.output_len, False, kv.pid))
                    else:
                        row = asyncio.run(run_level(llama.url, prompts, concurrency, args.output_len, True, llama.pid))
                    row = {"server": name, **row, "round": turn // 2, "load_avg_1m_before": round(load, 2)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                memory[f"llama.cpp -np {concurrency}"] = tree_rss(llama.pid)
        memory["kvsentry"] = tree_rss(kv.pid)
        if not args.no_agreement:
            prompts = text_prompts(AGREEMENT_PROMPTS, args.input_words, args.seed + 424242)
            ours = greedy_ids(kv.url, prompts, False)
            with LlamaCppServer(gguf, args.threads, 1, args.max_model_len, args.llama_args, args.llama_no_amx) as llama:
                agree = agreement(ours, greedy_ids(llama.url, prompts, True))
            print("agreement", json.dumps(agree), flush=True)
    ratios = [level_ratio(rows, concurrency) for concurrency in args.concurrency]
    print("ratios", json.dumps(ratios), "\nmemory", json.dumps(memory), flush=True)
    label = f"-{args.label}" if args.label else ""
    write_result(f"serve-gguf-{Path(gguf).stem}-{args.dtype}{label}-t{args.threads}",
                 {"args": vars(args), "llama_args": args.llama_args, "file": gguf, "file_bytes": Path(gguf).stat().st_size, "peer": version(),
                  "rows": rows, "ratios": ratios, "memory_mib": memory, "greedy_agreement": agree,
                  "note": "2 cores shared with other users of the machine: see load_avg_1m_before per row"}, stamp=stamp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
