"""Offline generation throughput: kvsentry's LLM vs transformers `generate`, same checkpoint,
same prompts, one run. 32 requests x 128-token prompts x 64 new tokens, greedy.

    .venv/bin/python benchmarks/offline_throughput.py [--model DIR] [--threads N]
"""
from __future__ import annotations

import argparse
import time

import torch

from common import bench_checkpoint, random_prompts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="checkpoint dir (default: write the bench-llama preset)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = bench_checkpoint(args.model)
    prompts = random_prompts(args.requests, args.prompt_len)
    generated = args.requests * args.new_tokens

    from engine import LLM, SamplingParams
    llm = LLM(path, max_model_len=1024, kv_cache_memory="1GiB", num_threads=args.threads)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    ours = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outs) == generated

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = torch.tensor(prompts)  # equal lengths: no padding needed
    with torch.inference_mode():
        model.generate(batch[:2], max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
        start = time.perf_counter()
        ref = model.generate(batch, max_new_tokens=args.new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        theirs = time.perf_counter() - start
    same = sum(o.outputs[0].token_ids == ref[i, args.prompt_len:].tolist() for i, o in enumerate(outs))

    print(f"workload: {args.requests} requests x {args.prompt_len} prompt tokens x {args.new_tokens} "
          f"new tokens, greedy, float32, {args.threads} threads, model {path}")
    print(f"{'engine':<28}{'seconds':>10}{'gen tok/s':>12}")
    print(f"{'kvsentry LLM.generate':<28}{ours:>10.2f}{generated / ours:>12.1f}")
    print(f"{'transformers generate':<28}{theirs:>10.2f}{generated / theirs:>12.1f}")
    print(f"ratio kvsentry / transformers: {theirs / ours:.2f}x   "
          f"(greedy outputs identical for {same}/{args.requests} requests)")


if __name__ == "__main__":
    main()
