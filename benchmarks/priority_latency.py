"""Time to first token of an interactive request behind a batch job, fcfs against priority.

    .venv/bin/python benchmarks/priority_latency.py --model default --threads 1

One rank (an EngineCore stepped here). A batch job of --requests requests at priority 10 fills a
KV cache sized for --fit of them at once (the rest wait, some are preempted); after the first
step one interactive request arrives at priority 0. The same workload runs under
--scheduling-policy fcfs (priorities ignored) and priority. Reported per policy: the interactive
request's time to first token (seconds and steps after it arrived) and end to end, the batch's
median time to first token, the whole run's tokens/s, steps and preemptions (on a shared machine
the seconds move with the load, the step counts do not). The order changes no token:
every request's greedy output must be the same under both policies (exit 1 if not). The verdict
passes when, besides, the interactive request's first token comes sooner under priority.
"""
from __future__ import annotations

import statistics
import time

import torch

from common import bench_checkpoint, prompt_token_range, random_prompts, require_identical, workload_parser
from results import provenance, write_result

BATCH_PRIORITY, INTERACTIVE_PRIORITY = 10, 0
INTERACTIVE = "interactive"


def run(path: str, policy: str, batch: list[list[int]], interactive: list[int], args) -> dict:
    from engine.config import EngineConfig
    from engine.engine_core.engine_core import EngineCore
    from engine.messages import EngineRequest
    from engine.sampling_params import SamplingParams
    block_size = 16
    per_request = -(-(args.prompt_len + args.new_tokens) // block_size)
    config = EngineConfig.create(path, max_model_len=1024, block_size=block_size, dtype=args.dtype,
                                 num_gpu_blocks=args.fit * per_request + 1, enable_prefix_caching=False,
                                 num_threads=args.threads, scheduling_policy=policy)
    core = EngineCore(config)
    batch_params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    interactive_params = SamplingParams(temperature=0.0, max_tokens=args.interactive_tokens, ignore_eos=True)
    priority = policy == "priority"
    for i, prompt in enumerate(batch):
        core.add_request(EngineRequest(f"batch{i}", prompt, batch_params,
                                       priority=BATCH_PRIORITY if priority else 0))
    tokens: dict[str, list[int]] = {}
    arrived: dict[str, tuple[float, int]] = {f"batch{i}": (time.perf_counter(), 0) for i in range(len(batch))}
    first: dict[str, tuple[float, int]] = {}
    done: dict[str, float] = {}
    start = time.perf_counter()
    steps = 0
    while core.has_unfinished or INTERACTIVE not in arrived:
        if steps == 1:
            arrived[INTERACTIVE] = (time.perf_counter(), steps)
            core.add_request(EngineRequest(INTERACTIVE, interactive, interactive_params,
                                           priority=INTERACTIVE_PRIORITY))
        outputs = core.step()
        steps += 1
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = (now, steps)
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                done[out.request_id] = now
    seconds = time.perf_counter() - start
    ttft = {rid: first[rid][0] - arrived[rid][0] for rid in first}
    return {
        "interactive_ttft_s": round(ttft[INTERACTIVE], 3),
        "interactive_ttft_steps": first[INTERACTIVE][1] - arrived[INTERACTIVE][1],
        "interactive_e2e_s": round(done[INTERACTIVE] - arrived[INTERACTIVE][0], 3),
        "batch_median_ttft_s": round(statistics.median(v for k, v in ttft.items() if k != INTERACTIVE), 3),
        "batch_ahead_of_interactive": sum(1 for k, v in first.items() if k != INTERACTIVE
                                          and v[1] < first[INTERACTIVE][1]),
        "seconds": round(seconds, 2),
        "tokens_per_s": round(sum(len(t) for t in tokens.values()) / seconds, 1),
        "steps": steps,
        "preemptions": core.scheduler.num_preemptions,
        "num_blocks": config.num_blocks,
        "tokens": tokens,
    }


def main() -> None:
    parser = workload_parser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--fit", type=int, default=8, help="batch requests the KV cache holds at once")
    parser.add_argument("--interactive-tokens", type=int, default=16)
    parser.add_argument("--out", help="result JSON path (default: benchmarks/results/)")
    args = parser.parse_args()
    stamp = provenance()
    torch.set_num_threads(args.threads)
    path = bench_checkpoint(args.model)
    low, vocab = prompt_token_range(path)
    batch = random_prompts(args.requests, args.prompt_len, vocab=vocab, seed=1, low=low)
    [interactive] = random_prompts(1, args.prompt_len, vocab=vocab, seed=2, low=low)
    results = {policy: run(path, policy, batch, interactive, args) for policy in ("fcfs", "priority")}
    ids = sorted(results["fcfs"]["tokens"])
    identical = require_identical("greedy tokens", [results["priority"]["tokens"].get(i) for i in ids],
                                  [results["fcfs"]["tokens"][i] for i in ids], ("priority", "fcfs"), ids)
    print(identical)
    print(f"{args.requests} batch requests (priority {BATCH_PRIORITY}) x {args.prompt_len} prompt x "
          f"{args.new_tokens} new tokens, cache for {args.fit}; 1 interactive (priority {INTERACTIVE_PRIORITY}) "
          f"x {args.interactive_tokens} new tokens after step 1; {args.threads} thread(s), {args.dtype}")
    columns = {"interactive_ttft_s": "ttft s", "interactive_ttft_steps": "ttft steps", "interactive_e2e_s": "e2e s",
               "batch_median_ttft_s": "batch ttft s", "batch_ahead_of_interactive": "batch ahead",
               "tokens_per_s": "tok/s", "steps": "steps", "preemptions": "preempted"}
    print(f"{'policy':<9}" + "".join(f"{label:>13}" for label in columns.values()) + "   (ttft, e2e, ahead: interactive)")
    for policy, r in results.items():
        print(f"{policy:<9}" + "".join(f"{r[c]:>13}" for c in columns))
    for r in results.values():
        del r["tokens"]
    sooner = results["priority"]["interactive_ttft_steps"] < results["fcfs"]["interactive_ttft_steps"]
    verdict = "pass" if sooner else "fail"
    write_result(f"priority-latency-{args.dtype}",
                 {"workload": {"model": args.model or "bench-llama", "requests": args.requests,
                               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "fit": args.fit,
                               "interactive_tokens": args.interactive_tokens, "threads": args.threads,
                               "dtype": args.dtype},
                  "results": results, "greedy_tokens": identical, "verdict": verdict},
                 args.out, stamp)
    raise SystemExit(0 if sooner else 1)


if __name__ == "__main__":
    main()
