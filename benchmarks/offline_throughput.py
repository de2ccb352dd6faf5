"""Offline generation throughput: kvsentry's LLM vs transformers `generate`.

The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF, loaded by both engines
from the file), 32 requests at once, 1 thread, float32 then bfloat16 (~5 min each):

    .venv/bin/python benchmarks/offline_throughput.py --model default --dtype float32 --threads 1
    .venv/bin/python benchmarks/offline_throughput.py --model default --dtype bfloat16 --threads 1

and the tiny bench-llama preset (1 thread, then 2 threads):

    .venv/bin/python benchmarks/offline_throughput.py --threads 1
    .venv/bin/python benchmarks/offline_throughput.py --threads 2

Same checkpoint (bench-llama unless --model: a checkpoint dir, a .gguf file or "default"), same
prompts, the same dtype on both sides, alternating timed runs in one process; defaults: 32
requests x 128-token prompts x 64 new tokens, 3 timed runs of each engine, greedy, ignore_eos.
Prompt ids are drawn at random from the checkpoint's vocabulary above its special tokens.
The greedy token ids are judged by judge.py: identical in float32; in bfloat16 each divergence
a near-tie by the float32 transformers model's logprobs at its first position. The JSON, with
the verdict, goes into benchmarks/results/ (named by date, machine kind and commit); the run
exits 1 when the verdict fails.
Every timed run gets a fresh prompt set (run k: the same set k for both engines, drawn from
its own seed), so kvsentry's prefix cache, which stays on, never serves a prompt it has
seen; the cached-token count of the timed runs is printed, and must be 0.
"""
from __future__ import annotations

import copy
import statistics
import time

import torch

from common import DTYPES, OFFLINE_WARMUP_SEED, bench_checkpoint, load_transformers, prompt_token_range, \
    random_prompts, workload_parser
from judge import judge, transformers_scorer
from results import write_result

def main() -> None:
    parser = workload_parser()
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and activations, both engines")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=3, help="alternating timed runs of each engine")
    parser.add_argument("--json", help="write the JSON here instead of benchmarks/results/")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = bench_checkpoint(args.model)
    generated = args.requests * args.new_tokens
    low, vocab = prompt_token_range(path)

    def prompt_set(seed: int) -> list[list[int]]:
        return random_prompts(args.requests, args.prompt_len, vocab=vocab, seed=seed, low=low)

    from engine import LLM, SamplingParams
    llm = LLM(path, max_model_len=1024, kv_cache_memory="1GiB", num_threads=args.threads, dtype=args.dtype)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    reference = load_transformers(path, "float32")  # bfloat16: also the judge of near-ties
    model = reference if args.dtype == "float32" else copy.deepcopy(reference).to(getattr(torch, args.dtype))

    def run_ours(prompts: list[list[int]]) -> tuple[list, int]:
        outputs = llm.generate(prompts, params)
        return [o.outputs[0].token_ids for o in outputs], sum(o.num_cached_tokens for o in outputs)

    def run_theirs(prompts: list[list[int]], new_tokens: int = args.new_tokens) -> list:
        with torch.inference_mode():  # equal lengths: no padding needed; no EOS, so every request runs to the end
            out = model.generate(torch.tensor(prompts), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[:, args.prompt_len:].tolist()

    # Warm-up at the timed shapes (the whole batch's prefill, then decode steps), on prompts of its own.
    warm = prompt_set(OFFLINE_WARMUP_SEED)
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    run_theirs(warm, 4)
    # Alternate the two engines, so a noisy neighbour on a shared machine hits both alike.
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    all_prompts, ours_tokens, ref_tokens, labels = [], [], [], []
    cached_tokens = 0
    for run in range(args.repeats):
        prompts = prompt_set(run + 1)
        start = time.perf_counter()
        tokens, cached = run_ours(prompts)
        times["ours"].append(time.perf_counter() - start)
        assert sum(len(t) for t in tokens) == generated
        start = time.perf_counter()
        reference_tokens = run_theirs(prompts)
        times["theirs"].append(time.perf_counter() - start)
        assert sum(len(t) for t in reference_tokens) == generated
        all_prompts += prompts
        ours_tokens += tokens
        ref_tokens += reference_tokens
        labels += [f"run {run + 1} request {i}" for i in range(args.requests)]
        cached_tokens += cached

    print(f"workload: {args.requests} requests x {args.prompt_len} prompt tokens x {args.new_tokens} "
          f"new tokens, greedy, {args.dtype}, {args.threads} threads, {args.repeats} alternating runs, model {path}")
    print(f"prompts: random ids in [{low}, {vocab}), a fresh set per timed run (the same set for both engines "
          f"in a run); prefix caching on, prefix-cache hits in the timed runs: {cached_tokens} tokens")
    print(f"{'engine':<28}{'median s':>10}{'best s':>10}{'gen tok/s (median)':>20}")
    for label, name in (("kvsentry LLM.generate", "ours"), ("transformers generate", "theirs")):
        med, best = statistics.median(times[name]), min(times[name])
        runs = " ".join(f"{t:.2f}" for t in times[name])
        print(f"{label:<28}{med:>10.2f}{best:>10.2f}{generated / med:>20.1f}   runs: {runs}")
    ratio = statistics.median(times["theirs"]) / statistics.median(times["ours"])
    best_ratio = min(times["theirs"]) / min(times["ours"])
    print(f"ratio kvsentry / transformers: {ratio:.2f}x median, {best_ratio:.2f}x best")
    verdict = judge("greedy token ids", args.dtype, ours_tokens, ref_tokens, all_prompts, ("kvsentry", "transformers"),
                    labels, transformers_scorer(reference))
    print(verdict.summary())
    rates = {name: generated / statistics.median(t) for name, t in times.items()}
    write_result(f"offline-throughput-{args.dtype}", {
        "args": vars(args), "model": path, "seconds": times, "tok_s": {"kvsentry": rates["ours"],
                                                                       "transformers": rates["theirs"]},
        "ratio": ratio, "prefix_cache_hit_tokens": cached_tokens, "verdict": verdict.as_json()}, args.json)
    if cached_tokens:
        raise SystemExit(f"FAIL: {cached_tokens} prompt tokens came from the prefix cache; "
                         f"the timed runs were meant to be all fresh prefills")
    if not verdict.passed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
