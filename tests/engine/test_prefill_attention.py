"""Prefill chunks run through SDPA, through the C++ kernel's one row per token
(engine/ops/attention.py, prefill_in_kernel) or through the tiled prefill kernel
(prefill_in_tiles: AMX tiles for bf16 on AMX CPUs, AVX-512F vectors for float32 and bf16
elsewhere): all give the same greedy tokens (float32) and near-equal prompt logprobs, with and
without a cached prefix (chunked prefill)."""
from __future__ import annotations

import random

import pytest
import torch

import engine.ops.attention_backends as attention
from engine.config import EngineConfig
from engine.engine_core.engine_core import EngineCore
from engine.messages import EngineRequest
from engine.sampling_params import SamplingParams


def run(path: str, prompts: list[list[int]], chunk: int, **config) -> list[tuple[list[int], list[float]]]:
    core = EngineCore(EngineConfig.create(path, max_model_len=512, block_size=16, num_gpu_blocks=64,
                                          max_num_batched_tokens=chunk, **{"dtype": "float32", **config}))
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
    monkeypatch.setenv("KVSENTRY_DISABLE_PREFILL_TILES", "1")  # neither run takes the tiles
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
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiled_prefill_matches_sdpa(checkpoint, monkeypatch, chunk, dtype):
    from engine.ops import cpu_ops
    # head_dim 32, group 2: shapes both tile kernels take (the default tiny model's head_dim is 16)
    path = checkpoint("tiny-llama", hidden_size=128, num_attention_heads=4, num_key_value_heads=2, init_scale=0.1)
    if not attention.prefill_in_tiles(getattr(torch, dtype), 4, 32, torch.empty(1, 16, 2, 32, dtype=getattr(torch, dtype)),
                                      torch.empty(1, 16, 2, 32, dtype=getattr(torch, dtype))):
        pytest.skip(f"no tiled prefill kernel for {dtype} on this CPU (needs AVX-512F, or AMX-BF16)")
    rng = random.Random(chunk + 1)
    prompts = [[rng.randrange(5, 500) for _ in range(n)] for n in (200, 70, 130)]
    monkeypatch.setattr(attention, "PREFILL_KERNEL_MAX_LEN", 0)  # chunks of 64 tokens or more: not the rows
    calls = []
    real = cpu_ops.paged_prefill_attention
    monkeypatch.setattr(cpu_ops, "paged_prefill_attention", lambda *a: calls.append(1) or real(*a))
    # enforce_eager: the Python loop, where the call can be counted (the fused stack makes the
    # same call from C++: tests/csrc/test_decoder_layers.py holds the two bitwise equal).
    tiles = run(path, prompts, chunk, dtype=dtype, enforce_eager=True)
    assert calls, "the tiled prefill kernel never ran"
    monkeypatch.setenv("KVSENTRY_DISABLE_PREFILL_TILES", "1")
    calls.clear()
    sdpa = run(path, prompts, chunk, dtype=dtype, enforce_eager=True)
    assert not calls
    if dtype == "float32":  # sums in another order: a few ulps, the same greedy tokens
        for (tokens_a, lps_a), (tokens_b, lps_b) in zip(tiles, sdpa):
            assert tokens_a == tokens_b
            assert len(lps_a) == len(lps_b) > 60
            assert max(abs(a - b) for a, b in zip(lps_a, lps_b)) < 1e-3
        return
    exact = run(path, prompts, chunk, dtype="float32")  # bf16's error, measured against float32
    # Prompt logprobs: the same inputs through both paths. (Generated tokens are not compared:
    # this random tiny model's bf16 noise alone flips its near-ties.)
    for (_, lps_a), (_, lps_b), (_, lps_f) in zip(tiles, sdpa, exact):
        assert len(lps_a) == len(lps_b) == len(lps_f) > 60
        tiles_error = max(abs(a - f) for a, f in zip(lps_a, lps_f))
        sdpa_error = max(abs(b - f) for b, f in zip(lps_b, lps_f))
        assert tiles_error <= 1.5 * sdpa_error + 0.02, (tiles_error, sdpa_error)
