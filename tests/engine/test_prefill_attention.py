"""Prefill chunks run through SDPA, through the C++ kernel's one row per token
(engine/ops/attention.py, prefill_in_kernel) or, for bf16 on AMX CPUs, through the AMX prefill
kernel (prefill_on_amx): all give the same greedy tokens and near-equal prompt logprobs, with
and without a cached prefix (chunked prefill)."""
from __future__ import annotations

import random

import pytest

import engine.ops.attention as attention
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.messages import EngineRequest
from engine.sampling_params import SamplingParams


def run(path: str, prompts: list[list[int]], chunk: int, **config) -> list[tuple[list[int], list[float]]]:
    core = EngineCore(EngineConfig.create(path, max_model_len=512, block_size=16, num_gpu_blocks=64,
                                          max_num_batched_tokens=chunk, **config))
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


@pytest.mark.parametrize("chunk", [512, 96])
def test_amx_prefill_matches_sdpa_in_bf16(checkpoint, monkeypatch, chunk):
    from engine.ops import cpu_ops
    if not (cpu_ops.available() and "amx_bf16" in cpu_ops.cpu_flags()):
        pytest.skip("no AMX-BF16 here: bf16 prefill runs through SDPA")
    # head_dim 32, group 2: shapes the AMX tiles take (the default tiny model's head_dim is 16)
    path = checkpoint("tiny-llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, init_scale=0.1)
    rng = random.Random(chunk + 1)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (200, 70, 130)]
    monkeypatch.setattr(attention, "PREFILL_KERNEL_MAX_LEN", 0)  # chunks of 64 tokens or more: not the rows
    calls = []
    real = cpu_ops.paged_prefill_attention
    monkeypatch.setattr(cpu_ops, "paged_prefill_attention", lambda *a: calls.append(1) or real(*a))
    # enforce_eager: the Python loop, where the call can be counted (the fused stack makes the
    # same call from C++: tests/csrc/test_decoder_layers.py holds the two bitwise equal).
    amx = run(path, prompts, chunk, dtype="bfloat16", enforce_eager=True)
    assert calls, "the AMX prefill kernel never ran"
    monkeypatch.setenv("KVSENTRY_DISABLE_AMX_PREFILL", "1")
    calls.clear()
    sdpa = run(path, prompts, chunk, dtype="bfloat16", enforce_eager=True)
    assert not calls
    exact = run(path, prompts, chunk, dtype="float32")  # bf16's error, measured against float32
    # Prompt logprobs: the same inputs through both paths. (Generated tokens are not compared:
    # this random tiny model's bf16 noise alone flips its near-ties.)
    for (_, lps_a), (_, lps_b), (_, lps_f) in zip(amx, sdpa, exact):
        assert len(lps_a) == len(lps_b) == len(lps_f) > 60
        amx_error = max(abs(a - f) for a, f in zip(lps_a, lps_f))
        sdpa_error = max(abs(b - f) for b, f in zip(lps_b, lps_f))
        assert amx_error <= 1.5 * sdpa_error + 0.02, (amx_error, sdpa_error)
