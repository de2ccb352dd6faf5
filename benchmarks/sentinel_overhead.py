"""Throughput cost of the NaN sentinel, off and in each mode, on the offline workload.

README rows (defaults: 32 x 128 prompt x 64 new tokens, 3 rounds):

    .venv/bin/python benchmarks/sentinel_overhead.py --threads 1                    # bench-llama
    .venv/bin/python benchmarks/sentinel_overhead.py --model default --dtype bfloat16  # the real model

One engine; the modes are interleaved over several rounds in one run (median per mode).
The sentinel only reads the cache, so every mode must give the greedy tokens of "off": the
run exits 1 when one does not. The table and that check go into a JSON in benchmarks/results/
(named by date, machine kind and commit).
"""
from __future__ import annotations

import statistics
import time

import torch

from common import OutputMismatch, bench_checkpoint, prompt_token_range, random_prompts, require_identical, \
    workload_parser
from results import write_result

MODES = ["off", "null-block", "rolling", "full"]


def main() -> None:
    parser = workload_parser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="auto", help="the model's dtype (auto: the checkpoint's)")
    parser.add_argument("--json", help="write the JSON here instead of benchmarks/results/")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = bench_checkpoint(args.model)
    from engine import LLM, SamplingParams
    low, vocab = prompt_token_range(path)
    # Every run: prefix caching is off.
    prompts = random_prompts(args.requests, args.prompt_len, vocab=vocab, low=low)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    # One engine, one cache allocation: only the sentinel's mode changes between runs, so
    # memory placement and allocator state cannot masquerade as sentinel cost.
    llm = LLM(path, max_model_len=1024, kv_cache_memory=args.kv_cache_memory, dtype=args.dtype,
              nan_sentinel="rolling", enable_prefix_caching=False, num_threads=args.threads)
    sentinel = llm.engine.integrity.sentinel
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    scanned: dict[str, list[float]] = {mode: [] for mode in MODES}  # the sentinel's own timings
    tokens: dict[str, list[list[int]]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            sentinel.mode = mode
            sentinel.take_scan_seconds()
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            seconds[mode].append(time.perf_counter() - start)
            scanned[mode] += sentinel.take_scan_seconds()
            tokens[mode] += [o.outputs[0].token_ids for o in outputs]
    generated = args.requests * args.new_tokens
    blocks = llm.config.num_blocks
    sentinel.mode = "rolling"
    coverage = sentinel.coverage_steps
    print(f"workload: {args.requests} x {args.prompt_len} prompt x {args.new_tokens} new tokens, "
          f"{blocks} KV blocks (rolling sweep covers all in {coverage} steps), {args.rounds} rounds")
    base = statistics.median(seconds["off"])
    # Wall-clock deltas on a shared machine are noisy at the 1% level; the scan time the
    # sentinel measures itself, as a share of the run, is the noise-free figure.
    print(f"{'sentinel':<12}{'median s':>10}{'tok/s':>10}{'vs off':>10}{'scan ms/step':>14}{'scan share':>12}")
    rows = []
    for mode in MODES:
        med = statistics.median(seconds[mode])
        per_step = statistics.mean(scanned[mode]) * 1e3 if scanned[mode] else 0.0
        share = sum(scanned[mode]) / sum(seconds[mode]) * 100
        print(f"{mode:<12}{med:>10.3f}{generated / med:>10.1f}{(base / med - 1) * 100:>+9.1f}%"
              f"{per_step:>14.3f}{share:>11.2f}%")
        rows.append({"mode": mode, "median_s": round(med, 4), "tok_s": round(generated / med, 1),
                     "vs_off_pct": round((base / med - 1) * 100, 2), "scan_ms_per_step": round(per_step, 4),
                     "scan_share_pct": round(share, 3), "seconds": seconds[mode]})
    labels = [f"round {r + 1} request {i}" for r in range(args.rounds) for i in range(args.requests)]
    verdicts, failed = {}, None
    for mode in MODES[1:]:
        try:
            verdicts[mode] = require_identical("greedy tokens", tokens[mode], tokens["off"],
                                               (f"sentinel {mode}", "sentinel off"), labels)
        except OutputMismatch as exc:
            verdicts[mode], failed = str(exc.code), exc
        print(verdicts[mode])
    write_result(f"sentinel-overhead-{args.dtype}", {
        "args": vars(args), "model": path, "kv_blocks": blocks, "rolling_coverage_steps": coverage, "rows": rows,
        "verdict": {"passed": failed is None, "tokens_vs_off": verdicts}}, args.json)
    if failed is not None:
        raise failed


if __name__ == "__main__":
    main()
