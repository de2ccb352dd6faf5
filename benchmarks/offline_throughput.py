"""Offline generation throughput: kvsentry's LLM vs transformers `generate`, same checkpoint,
same prompts, one run. 32 requests x 128-token prompts x 64 new tokens, greedy.

    .venv/bin/python benchmarks/offline_throughput.py [--model DIR] [--threads N]
"""
from __future__ import annotations

import statistics
import time

import torch

from common import bench_checkpoint, random_prompts, workload_parser


def main() -> None:
    parser = workload_parser()
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=3, help="alternating timed runs of each engine")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = bench_checkpoint(args.model)
    prompts = random_prompts(args.requests, args.prompt_len)
    generated = args.requests * args.new_tokens

    from engine import LLM, SamplingParams
    from transformers import AutoModelForCausalLM
    llm = LLM(path, max_model_len=1024, kv_cache_memory="1GiB", num_threads=args.threads)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = torch.tensor(prompts)  # equal lengths: no padding needed

    def run_ours() -> list:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    def run_theirs() -> list:
        with torch.inference_mode():
            out = model.generate(batch, max_new_tokens=args.new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        return out[:, args.prompt_len:].tolist()

    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    with torch.inference_mode():
        model.generate(batch[:2], max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    # Alternate the two engines, so a noisy neighbour on a shared machine hits both alike.
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    for _ in range(args.repeats):
        for name, fn in (("ours", run_ours), ("theirs", run_theirs)):
            start = time.perf_counter()
            tokens = fn()
            times[name].append(time.perf_counter() - start)
            if name == "ours":
                ours_tokens = tokens
                assert sum(len(t) for t in tokens) == generated
            else:
                ref_tokens = tokens
    same = sum(a == b for a, b in zip(ours_tokens, ref_tokens))

    print(f"workload: {args.requests} requests x {args.prompt_len} prompt tokens x {args.new_tokens} "
          f"new tokens, greedy, float32, {args.threads} threads, {args.repeats} alternating runs, model {path}")
    print(f"{'engine':<28}{'median s':>10}{'best s':>10}{'gen tok/s (median)':>20}")
    for label, name in (("kvsentry LLM.generate", "ours"), ("transformers generate", "theirs")):
        med, best = statistics.median(times[name]), min(times[name])
        print(f"{label:<28}{med:>10.2f}{best:>10.2f}{generated / med:>20.1f}")
    ratio = statistics.median(times["theirs"]) / statistics.median(times["ours"])
    best_ratio = min(times["theirs"]) / min(times["ours"])
    print(f"ratio kvsentry / transformers: {ratio:.2f}x median, {best_ratio:.2f}x best   "
          f"(greedy outputs identical for {same}/{args.requests} requests)")

if __name__ == "__main__":
    main()
