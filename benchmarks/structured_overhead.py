"""Grammar-constrained decoding's cost: 32 requests at once, every one constrained by a JSON
schema, vs the same requests unconstrained, in one run, on the real default model.

    .venv/bin/python benchmarks/structured_overhead.py --dtype float32 --threads 1
    .venv/bin/python benchmarks/structured_overhead.py --dtype bfloat16 --threads 1

The unconstrained side generates, per request, exactly as many tokens as its constrained twin
did (ignore_eos, max_tokens = that count), so both sides step the same batch shapes and the
ratio is the grammar's cost: compiling its spec when the request arrives, filling its bitmask
row each step, masking the logits, and advancing the matcher. Prefix caching is off on both
sides and every timed run gets its own prompts. The run exits 1 if a constrained output that
finished on its own does not parse and validate against its schema.

Also printed: the cold compile time of the 20+ test schemas (a fresh grammar compiler, the
tokenizer's vocabulary analysis timed apart).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import DTYPES, bench_checkpoint  # noqa: E402


def compile_times(model) -> tuple[float, list[float]]:
    """(seconds to build a fresh compiler, seconds per schema compiled cold)."""
    from engine.tokenizer import Tokenizer
    from engine.structured.grammar import build_compiler
    from engine.structured.spec import StructuredOutputs
    from structured_schemas import SCHEMAS
    start = time.perf_counter()
    compiler = build_compiler(Tokenizer(model.tokenizer).backend, model.vocab_size, sorted(set(model.eos_token_ids)))
    setup = time.perf_counter() - start
    per_schema = []
    for _, schema in SCHEMAS:
        start = time.perf_counter()
        compiler.matcher(StructuredOutputs(kind="json", spec=json.dumps(schema)))
        per_schema.append(time.perf_counter() - start)
    return setup, per_schema


def main() -> None:
    import argparse
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default", help="checkpoint dir, .gguf file, or 'default'")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import jsonschema

    from engine import LLM, SamplingParams
    from engine.structured.spec import StructuredOutputs
    from structured_schemas import SCHEMAS

    llm = LLM(bench_checkpoint(args.model), num_threads=args.threads, dtype=args.dtype,
              enable_prefix_caching=False, max_num_seqs=args.requests, max_model_len=1024)
    setup, per_schema = compile_times(llm.config.model)
    print(f"grammar compiler: vocabulary analysis {setup * 1e3:.0f} ms once; {len(per_schema)} schemas compiled "
          f"cold in {sum(per_schema) * 1e3:.0f} ms (median {statistics.median(per_schema) * 1e3:.1f} ms, "
          f"max {max(per_schema) * 1e3:.1f} ms)")

    def workload(run: int) -> tuple[list[list[int]], list[dict]]:
        prompts, schemas = [], []
        for i in range(args.requests):
            question, schema = SCHEMAS[i % len(SCHEMAS)]
            text = llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Request {run}.{i}. {question} Answer in JSON."}])
            prompts.append(llm.tokenizer.encode(text, add_special_tokens=False))
            schemas.append(schema)
        return prompts, schemas

    def timed(prompts, params) -> tuple[float, list]:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        return time.perf_counter() - start, outputs

    results = {"constrained": [], "unconstrained": []}
    invalid, truncated = 0, 0
    for run in range(args.repeats + 1):  # run 0 warms both paths up
        prompts, schemas = workload(run)
        constrained = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_outputs=StructuredOutputs(
            kind="json", spec=json.dumps(s))) for s in schemas]
        seconds, outputs = timed(prompts, constrained)
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        for out, schema in zip(outputs, schemas):
            if out.outputs[0].finish_reason != "stop":
                truncated += run > 0
                continue
            try:
                jsonschema.validate(json.loads(out.outputs[0].text), schema)
            except (ValueError, jsonschema.ValidationError) as exc:
                invalid += 1
                print(f"INVALID: {out.outputs[0].text!r}: {exc}", file=sys.stderr)
        free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
        free_seconds, free_outputs = timed(prompts, free)
        if [len(o.outputs[0].token_ids) for o in free_outputs] != lengths:
            raise SystemExit("the unconstrained side did not generate the constrained side's token counts")
        if run == 0:
            continue
        results["constrained"].append(sum(lengths) / seconds)
        results["unconstrained"].append(sum(lengths) / free_seconds)
        print(f"run {run}: {sum(lengths)} tokens (mean {sum(lengths) / len(lengths):.1f}/request): "
              f"constrained {results['constrained'][-1]:.1f} tok/s, "
              f"unconstrained {results['unconstrained'][-1]:.1f} tok/s", flush=True)

    ours, free = statistics.median(results["constrained"]), statistics.median(results["unconstrained"])
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"\n{cpu}, {args.threads} thread(s), {args.dtype}, {args.requests} requests at once, "
          f"median of {args.repeats}:")
    print(f"  constrained   {ours:8.1f} tok/s")
    print(f"  unconstrained {free:8.1f} tok/s")
    print(f"  overhead      {100 * (1 - ours / free):8.1f} %  (target <= 10 %)")
    print(f"  constrained outputs that ended on their own: all validated; {truncated} hit max_tokens "
          f"(not judged) of {args.requests * args.repeats}")
    llm.close()
    if invalid:
        raise SystemExit(f"{invalid} constrained outputs did not validate against their schema")


if __name__ == "__main__":
    main()
