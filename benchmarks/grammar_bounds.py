"""How long the largest structured-output specs the default size bounds let through take to
compile, against the compile timeout: the evidence behind the bounds' defaults
(engine/structured/limits.py, --max-structured-outputs-*).

    .venv/bin/python benchmarks/grammar_bounds.py               # the default model's tokenizer
    .venv/bin/python benchmarks/grammar_bounds.py --model DIR   # another checkpoint's

Each spec sits at one bound (an enum and a choice list of max_structured_outputs_choices entries,
an object nested to max_structured_outputs_depth, an object with as many properties as
max_structured_outputs_spec_bytes holds) and passes check_spec_limits; each is compiled cold by a
fresh compiler. Verdict: pass when every one compiles within a quarter of the default
--structured-outputs-compile-timeout. Writes benchmarks/results/grammar-bounds_<date>_<machine>_<commit>.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import write_result  # noqa: E402

SHARE_OF_TIMEOUT = 0.25


def edge_specs(config) -> dict:
    from engine.structured.spec import StructuredOutputs
    entries, depth, size = (config.max_structured_outputs_choices, config.max_structured_outputs_depth,
                            config.max_structured_outputs_spec_bytes)

    def json_spec(schema) -> StructuredOutputs:
        return StructuredOutputs(kind="json", spec=json.dumps(schema))

    nested: dict = {"type": "string"}
    for _ in range((depth - 1) // 2):  # each object level is two JSON levels (the object, its properties)
        nested = {"type": "object", "properties": {"a": nested}, "required": ["a"]}
    properties, width = {}, 0
    while width < size - 200:
        name = f"property_{len(properties)}"
        properties[name] = {"type": "integer"}
        width += len(json.dumps({name: properties[name]})) + len(name) + 4  # and its place in "required"
    return {
        f"enum of {entries} strings": json_spec({"type": "string", "enum": [f"v{i}" for i in range(entries)]}),
        f"choice of {entries} strings": StructuredOutputs.choice([f"c{i}" for i in range(entries)]),
        f"object nested to {depth} JSON levels": json_spec(nested),
        f"object of {len(properties)} properties": json_spec({"type": "object", "properties": properties,
                                                             "required": list(properties)}),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="checkpoint dir or .gguf file (default: the default model)")
    args = parser.parse_args()
    from engine.config import EngineConfig
    from engine.gguf.default_model import default_model_path
    from engine.structured.grammar import build_compiler
    from engine.structured.limits import check_spec_limits
    from engine.tokenizer import Tokenizer

    config = EngineConfig.create(args.model or default_model_path(), num_gpu_blocks=8)
    model = config.model
    budget = SHARE_OF_TIMEOUT * config.structured_outputs_compile_timeout
    seconds = {}
    for name, spec in edge_specs(config).items():
        check_spec_limits(config, spec)  # at the bound, not over it
        compiler = build_compiler(Tokenizer(model.tokenizer).backend, model.vocab_size,
                                  sorted(set(model.eos_token_ids)))
        start = time.perf_counter()
        compiler.compile(spec)
        seconds[name] = round(time.perf_counter() - start, 4)
        print(f"{name}: {seconds[name]:.3f} s", flush=True)
    verdict = "pass" if max(seconds.values()) <= budget else "fail"
    payload = {"model": model.path, "vocab_size": model.vocab_size, "compile_seconds": seconds,
               "budget_seconds": budget, "compile_timeout": config.structured_outputs_compile_timeout,
               "bounds": {"choices": config.max_structured_outputs_choices,
                          "depth": config.max_structured_outputs_depth,
                          "spec_bytes": config.max_structured_outputs_spec_bytes},
               "verdict": verdict}
    path = write_result("grammar-bounds", payload)
    print(f"{verdict}: slowest {max(seconds.values()):.3f} s against {budget:g} s; {path}")
    sys.exit(0 if verdict == "pass" else 1)


if __name__ == "__main__":
    main()
