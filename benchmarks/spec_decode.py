"""Speculative decoding by prompt lookup on the real default model: tokens/s with and without it,
at 1 and 8 clients, on an extraction-style workload (the answer quotes the prompt) and a free-text
workload (benchmarks/spec_workloads.py, 8 chat prompts each), greedy.

    .venv/bin/python benchmarks/spec_decode.py --threads 1

Both engines live in one process with the same threads and are timed alternately. "c clients":
the 8 prompts run c at a time (1: one request after another; 8: all together). tokens/s =
generated tokens / wall time, median of --repeats runs. The outputs with speculation must equal
those without (token ids); the free-text workload must not be slower by more than 5% with it.
The JSON, with the verdict, goes into benchmarks/results/; the run exits 1 when the verdict fails.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from results import provenance, write_result
from spec_workloads import FREE_TEXT_QUESTIONS, chat_prompts, extraction_messages

MAX_FREE_TEXT_SLOWDOWN = 0.05


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4, '
                                                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    parser.add_argument("--json", help="write the JSON here instead of benchmarks/results/")
    args = parser.parse_args()
    stamp = provenance()
    torch.set_num_threads(args.threads)
    from engine import LLM, SamplingParams
    from engine.gguf.default_model import default_model_path

    engine_args = dict(max_model_len=1024, kv_cache_memory="256MiB", num_threads=args.threads,
                       enable_prefix_caching=False)  # every timed run computes its prompts again
    engines = {"plain": LLM(default_model_path(), **engine_args),
               "spec": LLM(default_model_path(), speculative_config=args.speculative_config, **engine_args)}
    tokenizer = engines["plain"].tokenizer
    workloads = {"extraction": chat_prompts(tokenizer, extraction_messages()),
                 "free_text": chat_prompts(tokenizer, FREE_TEXT_QUESTIONS)}
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)
    for llm in engines.values():  # warm-up: kernels, allocator
        llm.generate(workloads["free_text"][:2], SamplingParams(temperature=0.0, max_tokens=8))

    def run(llm, prompts: list[list[int]], clients: int) -> tuple[float, int, list[list[int]]]:
        start = time.perf_counter()
        outputs = []
        for i in range(0, len(prompts), clients):
            outputs += [o.outputs[0].token_ids for o in llm.generate(prompts[i:i + clients], params)]
        return time.perf_counter() - start, sum(map(len, outputs)), outputs

    rows, identical = [], True
    for workload, prompts in workloads.items():
        for clients in (1, 8):
            seconds = {name: [] for name in engines}
            outputs, tokens = {}, {}
            for _ in range(args.repeats):
                for name, llm in engines.items():
                    before = llm.engine.stats().spec_decode.copy()
                    elapsed, tokens[name], outputs[name] = run(llm, prompts, clients)
                    seconds[name].append(elapsed)
                    after = llm.engine.stats().spec_decode
            same = outputs["spec"] == outputs["plain"]
            identical &= same
            row = {"workload": workload, "clients": clients, "generated_tokens": tokens["plain"],
                   "outputs_identical": same,
                   "seconds": seconds,
                   "tokens_per_s": {n: tokens[n] / statistics.median(s) for n, s in seconds.items()},
                   "draft_tokens_last_run": after.num_draft_tokens - before.num_draft_tokens,
                   "accepted_tokens_last_run": after.num_accepted_tokens - before.num_accepted_tokens}
            row["speedup"] = row["tokens_per_s"]["spec"] / row["tokens_per_s"]["plain"]
            rows.append(row)
            print(f"{workload:10s} {clients} client(s): plain {row['tokens_per_s']['plain']:7.1f} tok/s, "
                  f"spec {row['tokens_per_s']['spec']:7.1f} tok/s, x{row['speedup']:.2f}, "
                  f"accepted {row['accepted_tokens_last_run']}/{row['draft_tokens_last_run']} drafts, "
                  f"identical={same}", flush=True)
    for llm in engines.values():
        llm.close()
    free_text_ok = all(r["speedup"] >= 1 - MAX_FREE_TEXT_SLOWDOWN for r in rows if r["workload"] == "free_text")
    verdict = {"outputs_identical": identical, "free_text_within_5_percent": free_text_ok,
               "pass": identical and free_text_ok}
    write_result("spec-decode", {"threads": args.threads, "new_tokens": args.new_tokens, "repeats": args.repeats,
                                 "speculative_config": args.speculative_config, "rows": rows, "verdict": verdict},
                 args.json, stamp)
    print("verdict:", verdict)
    return 0 if verdict["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
