"""Cost of the sealed-block checksums on the real default model at 32 requests at once.

    .venv/bin/python benchmarks/checksum_overhead.py --model default --threads 1
    .venv/bin/python benchmarks/checksum_overhead.py --model default --threads 1 --dtype bfloat16

One engine; three configurations interleaved over rounds in one run (median per configuration):
`off` (no checksums, no NaN sentinel), `checksums` (default rolling checksums, NaN sentinel off)
and `default` (rolling checksums and the rolling NaN sentinel, as `kvsentry serve` runs). The
engine times its own seal-time hashing and verification sweep, so their share of the run is
printed apart from the noisy wall-clock delta. Target: checksums <= 1% of step time. Checksums
only read the cache, so every configuration must give the greedy tokens of `off` (exit 1 if not).
Prefix caching is off; each round draws fresh prompts, shared by its three runs.
"""
from __future__ import annotations

import statistics
import time

import torch

from common import DTYPES, bench_checkpoint, prompt_token_range, random_prompts, require_identical, workload_parser

CONFIGS = {"off": ("off", "off"), "checksums": ("rolling", "off"), "default": ("rolling", "rolling")}


def main() -> None:
    parser = workload_parser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--kv-cache-memory", default="1GiB")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = bench_checkpoint(args.model)
    low, vocab = prompt_token_range(path)
    from engine import LLM, SamplingParams
    llm = LLM(path, max_model_len=1024, kv_cache_memory=args.kv_cache_memory, dtype=args.dtype,
              enable_prefix_caching=False, num_threads=args.threads)
    core = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(random_prompts(2, 16, vocab=vocab, seed=10_000, low=low),
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    seconds = {name: [] for name in CONFIGS}
    seal = {name: [] for name in CONFIGS}
    verify = {name: [] for name in CONFIGS}
    steps = {name: 0 for name in CONFIGS}
    tokens = {name: [] for name in CONFIGS}
    for round_ in range(args.rounds):
        prompts = random_prompts(args.requests, args.prompt_len, vocab=vocab, seed=round_ + 1, low=low)
        for name, (checksums, sentinel) in CONFIGS.items():
            core.integrity.checksums.mode, core.integrity.sentinel.mode = checksums, sentinel
            core.integrity.checksums.take_seconds()
            first_step = core.steps
            start = time.perf_counter()
            outputs = llm.generate(prompts, params)
            seconds[name].append(time.perf_counter() - start)
            steps[name] += core.steps - first_step
            sealed, swept = core.integrity.checksums.take_seconds()
            seal[name] += sealed
            verify[name] += swept
            tokens[name] += [o.outputs[0].token_ids for o in outputs]
    generated = args.requests * args.new_tokens
    core.integrity.checksums.mode = "rolling"
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"{cpu}, {args.threads} thread(s), {args.dtype}; {args.requests} x {args.prompt_len} prompt x "
          f"{args.new_tokens} new tokens, {llm.config.num_blocks} KV blocks, rolling sweep "
          f"{llm.config.kv_checksum_blocks_per_step} blocks/step (all within {core.integrity.checksums.coverage_steps} "
          f"steps), {args.rounds} rounds")
    base = statistics.median(seconds["off"])
    print(f"{'config':<11}{'median s':>9}{'tok/s':>8}{'vs off':>8}{'seal ms/step':>14}{'sweep ms/step':>15}"
          f"{'seal share':>12}{'sweep share':>13}")
    for name in CONFIGS:
        med = statistics.median(seconds[name])
        total = sum(seconds[name])
        per_step = max(steps[name], 1)
        print(f"{name:<11}{med:>9.2f}{generated / med:>8.1f}{(base / med - 1) * 100:>+7.1f}%"
              f"{sum(seal[name]) / per_step * 1e3:>14.3f}{sum(verify[name]) / per_step * 1e3:>15.3f}"
              f"{sum(seal[name]) / total * 100:>11.2f}%{sum(verify[name]) / total * 100:>12.2f}%")
    labels = [f"round {r + 1} request {i}" for r in range(args.rounds) for i in range(args.requests)]
    for name in list(CONFIGS)[1:]:
        print(require_identical("greedy tokens", tokens[name], tokens["off"], (name, "off"), labels))
    llm.close()


if __name__ == "__main__":
    main()
