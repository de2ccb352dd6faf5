"""Data-parallel scaling on an MoE model, and what a dummy batch costs.

The command (defaults: 64 x 64 prompt x 32 new tokens, 1 torch thread per rank):

    .venv/bin/python benchmarks/dp_scaling.py

1. The same greedy workload (default 64 requests x 64 prompt tokens x 32 new tokens) at DP=1
   (in-process engine) and DP=2 (two rank processes, expert parallel over gloo, lockstep
   waves), plus DP=2 with every request pinned to rank 0 (rank 1 only steps dummy batches):
   generated tokens/s and the ratio to DP=1.
2. In-process (one EngineCore, no collectives): the median time of a dummy step padded to B
   tokens vs a real decode step of B running requests (one new token each), many repetitions.

    .venv/bin/python benchmarks/dp_scaling.py [--model DIR | --preset tiny-deepseek-v3] [--small]

Without --model it writes a DeepSeek-V3-style MoE checkpoint (the tiny-deepseek-v3 preset,
widened unless --small). Every run's greedy tokens must equal DP=1's: the run exits 1 when not.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import tempfile
import time

import torch

from common import require_identical

BENCH_OVERRIDES = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, n_routed_experts=16,
                       moe_intermediate_size=128, num_attention_heads=8, vocab_size=4096)


def free_port_block(count: int = 3) -> int:
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(1000):
        base = rng.randrange(20000, 60000)
        try:
            socks = []
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")


def run_llm(path: str, prompts, params, dp: int, rank_of=None, **engine_args):
    from engine import LLM, SamplingParams
    extra = dict(data_parallel_size=dp, data_parallel_rpc_port=free_port_block()) if dp > 1 else {}
    llm = LLM(path, **engine_args, **extra)
    try:
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate(prompts[:2 * dp], warm, rank_of=[i % dp for i in range(2 * dp)] if dp > 1 else None)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, rank_of=rank_of)
        seconds = time.perf_counter() - start
        tokens = [o.outputs[0].token_ids for o in outs]
        stats = dict(llm.engine.stats) if dp > 1 else None
    finally:
        llm.close()
    return seconds, tokens, stats


def step_costs(path: str, batch_sizes, reps: int, threads: int, **engine_args):
    """{B: (median real decode step s, median dummy step s)} on one in-process EngineCore."""
    from engine.config import EngineConfig
    from engine.engine_core.engine_core import EngineCore
    from engine.messages import EngineRequest
    from engine.sampling_params import SamplingParams
    config = EngineConfig.create(path, num_threads=threads, **engine_args)
    core = EngineCore(config)
    rng = random.Random(1)
    vocab = config.model.vocab_size
    results = {}
    for b in batch_sizes:
        params = SamplingParams(temperature=0.0, max_tokens=reps + 8, ignore_eos=True)
        for i in range(b):
            core.add_request(EngineRequest(f"b{b}-{i}", [rng.randrange(3, vocab) for _ in range(32)], params))
        sched = core.schedule()
        while not (sched.num_tokens == b and sched.num_reqs == b):  # prefill every request first
            core.step(sched)
            sched = core.schedule()
        padded = config.padded_num_tokens(b)
        real, dummy = [], []
        for rep in range(reps):
            if rep:
                sched = core.schedule()
            assert sched.num_tokens == b == sched.num_reqs, "expected a pure decode step"
            start = time.perf_counter()
            core.step(sched)
            real.append(time.perf_counter() - start)
            start = time.perf_counter()
            core.run_dummy(padded)
            dummy.append(time.perf_counter() - start)
        while core.has_unfinished:
            core.step()
        results[b] = (padded, statistics.median(real), statistics.median(dummy))
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="checkpoint dir (default: write a DeepSeek-V3-style MoE)")
    parser.add_argument("--preset", default="tiny-deepseek-v3")
    parser.add_argument("--small", action="store_true", help="the preset as is, not widened")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="config override on top of the widened preset, e.g. hidden_size=512 "
                             "(VALUE is JSON); repeatable")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=200, help="repetitions per step-cost measurement")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per rank (DP=1, each DP=2 rank, the step-cost engine); "
                             "see --dp1-wide")
    parser.add_argument("--dp1-wide", action="store_true",
                        help="also run DP=1 with 2x the threads (the cores DP=2 uses); on a shared "
                             "2-core machine this oversubscribes and can be very slow")
    args = parser.parse_args()
    path = args.model
    if path is None:
        from service.demo.checkpoint import write_preset
        path = tempfile.mkdtemp(prefix="dp-scaling-")
        overrides = {} if args.small else dict(BENCH_OVERRIDES)
        for item in args.override:
            key, _, value = item.partition("=")
            overrides[key] = json.loads(value)
        write_preset(path, args.preset, init_scale=0.3, **overrides)
    cfg = json.load(open(os.path.join(path, "config.json")))
    vocab = cfg["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    generated = args.requests * args.new_tokens

    from engine import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    engine_args = dict(max_model_len=512, kv_cache_memory="256MiB")
    runs = {}
    t = args.threads
    runs["DP=1"] = run_llm(path, prompts, params, 1, num_threads=t, **engine_args)
    if args.dp1_wide:  # the same cores as DP=2, as intra-op threads of one process
        runs[f"DP=1 ({2 * t} threads)"] = run_llm(path, prompts, params, 1, num_threads=2 * t, **engine_args)
    runs["DP=2 (least-loaded)"] = run_llm(path, prompts, params, 2, num_threads=t, **engine_args)
    runs["DP=2 (all on rank 0)"] = run_llm(path, prompts, params, 2, rank_of=[0] * len(prompts),
                                          num_threads=t, **engine_args)
    reference = runs["DP=1"][1]

    costs = step_costs(path, [1, 8, 64], args.reps, args.threads, **engine_args)

    print(f"model: {path} ({cfg['architectures'][0]}, hidden {cfg['hidden_size']}, "
          f"{cfg['num_hidden_layers']} layers, {cfg.get('n_routed_experts')} routed experts, "
          f"top-{cfg.get('num_experts_per_tok')}); {os.cpu_count()} CPU cores")
    print(f"workload: {args.requests} requests x {args.prompt_len} prompt tokens x {args.new_tokens} new "
          f"tokens, greedy, float32; {t} torch thread(s) per rank unless noted")
    print()
    base = runs["DP=1"][0]
    print(f"{'run':<24}{'seconds':>9}{'gen tok/s':>11}{'vs DP=1':>9}  {'identical':>9}  rank steps/dummies")
    for name, (seconds, tokens, stats) in runs.items():
        same = sum(a == b for a, b in zip(tokens, reference))
        ranks = " ".join(f"r{r}:{s.steps}/{s.dummy_batches}" for r, s in sorted(stats.items())) if stats else "-"
        print(f"{name:<24}{seconds:>9.2f}{generated / seconds:>11.1f}{base / seconds:>8.2f}x"
              f"  {same:>4}/{len(tokens):<4}  {ranks}")
    print()
    print(f"in-process step cost (median of {args.reps}, {args.threads} threads, no collectives)")
    print(f"{'B':>4}{'padded':>8}{'decode step ms':>16}{'dummy step ms':>15}{'dummy/decode':>14}")
    for b, (padded, real, dummy) in costs.items():
        print(f"{b:>4}{padded:>8}{real * 1e3:>16.3f}{dummy * 1e3:>15.3f}{dummy / real:>14.2f}")
    print()
    for name, (_, tokens, _) in runs.items():
        if name != "DP=1":
            print(require_identical("greedy tokens", tokens, reference, (name, "DP=1")))


if __name__ == "__main__":
    main()
