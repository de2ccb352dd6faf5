"""Prefill chunks run through SDPA or through the C++ kernel's one row per token
(engine/ops/attention.py, prefill_in_kernel): both give the same greedy tokens and
near-equal prompt logprobs, with and without a cached prefix (chunked prefill)."""
from __future__ import annotations

import random

import pytest

import engine.ops.attention as attention
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.messages import EngineRequest
from engine.sampling_params import SamplingParams


def run(path: str, prompts: list[list[int]], chunk: int) -> list[tuple[list[int], list[float]]]:
    core = EngineCore(EngineConfig.create(path, max_model_len=512, block_size=16, num_gpu_blocks=64,
                                          max_num_batched_tokens=chunk))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    for i, prompt in enumerate(prompts):
        core.add_request(EngineRequest(f"r{i}", prompt, params))
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    logprobs = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished:
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [lp.logprob for lp in out.prompt_logprobs or [] if lp is not None]
    return [(tokens[k], logprobs[k]) for k in tokens]


@pytest.mark.parametrize("chunk", [512, 96])  # whole prompts, and chunks over a cached prefix
def test_sdpa_prefill_matches_the_kernel(checkpoint, monkeypatch, chunk):
    path = checkpoint("tiny-llama")
    rng = random.Random(chunk)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (200, 70, 130)]
    monkeypatch.setattr(attention, "PREFILL_KERNEL_MAX_LEN", 0)  # chunks of 64 tokens or more: SDPA
    sdpa = run(path, prompts, chunk)
    monkeypatch.setattr(attention, "PREFILL_SDPA_MIN_TOKENS", 10_000)  # every prefill row in the kernel
    kernel = run(path, prompts, chunk)
    for (tokens_a, lps_a), (tokens_b, lps_b) in zip(sdpa, kernel):
        assert tokens_a == tokens_b
        assert len(lps_a) == len(lps_b) > 60
        assert max(abs(a - b) for a, b in zip(lps_a, lps_b)) < 1e-3
