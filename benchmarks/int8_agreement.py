"""Int8 activations against the exact dequantized weights on the default model (SmolLM2-135M Q4_1
GGUF): greedy agreement on 16 prompts (8 raw, 8 chat-templated, those of
tests/engine/test_gguf_real_model.py) x 64 new tokens, with the first divergence of each, and
the one-client decode step of each path (1 thread).

    .venv/bin/python benchmarks/int8_agreement.py --dtype float32

Writes a JSON to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from common import prompt_token_range
from limits import decode_seconds
from results import write_result

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import LLM, SamplingParams  # noqa: E402
from engine.gguf.default_model import default_model_path  # noqa: E402
from tests.engine.test_gguf_real_model import CHAT_QUESTIONS, NEW_TOKENS, RAW_PROMPTS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--json", help="write the JSON here instead of benchmarks/results/")
    args = parser.parse_args()
    torch.set_num_threads(1)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs, steps, paths = {}, {}, {}
    for mode in ("none", "int8"):
        llm = LLM(default_model_path(), dtype=args.dtype, max_model_len=1024, kv_cache_memory="256MiB",
                  num_threads=1, enable_prefix_caching=False, quantized_activations=mode)
        tokenizer = llm.tokenizer
        chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in CHAT_QUESTIONS]
        prompts = [tokenizer.encode(p) for p in RAW_PROMPTS + chats]
        outputs[mode] = [out.outputs[0].token_ids for out in llm.generate(prompts, greedy)]
        low, vocab = prompt_token_range(default_model_path())
        steps[mode] = decode_seconds(llm, 1, vocab, low, seed=1)
        from engine.models.cpu_gemm import linear_paths
        paths[mode] = linear_paths(llm.engine.runner.model)
        llm.close()
        print(f"{mode}: one-client decode step {steps[mode] * 1e3:.2f} ms; {paths[mode]}", flush=True)
    divergences = []
    for exact, int8 in zip(outputs["none"], outputs["int8"]):
        first = next((i for i, (a, b) in enumerate(zip(exact, int8)) if a != b), None)
        divergences.append(first)
    identical = sum(d is None for d in divergences)
    print(f"greedy: {identical}/{len(divergences)} prompts x {NEW_TOKENS} tokens identical; first divergence "
          f"per prompt: {divergences}")
    write_result(f"int8-agreement-{args.dtype}", {
        "args": vars(args), "model": default_model_path(), "threads": 1, "new_tokens": NEW_TOKENS,
        "identical_prompts": identical, "prompts": len(divergences), "first_divergence": divergences,
        "decode_step_ms": {mode: round(s * 1e3, 3) for mode, s in steps.items()}, "paths": paths}, args.json)


if __name__ == "__main__":
    main()
