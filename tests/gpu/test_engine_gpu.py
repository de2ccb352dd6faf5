"""The whole engine on CUDA: greedy tokens equal the CPU engine's for a short, ragged batch.

On CUDA the caches are written by the csrc/ kernels (the reference is patched to refuse CUDA
caches, so a silent fallback fails the test), on CPU by the torch reference; both run float32
with TF32 off, so the only difference left is the kernels themselves, which write the same bits.
"""
from __future__ import annotations

import pytest
import torch

from engine.ops import kv_writer

pytestmark = pytest.mark.gpu

PROMPTS = [list(range(5, 17)), [7, 8, 9], list(range(20, 61)), [3]]  # ragged: padded steps
MAX_TOKENS = 16


def greedy_tokens(path: str, device: str) -> tuple[list[list[int]], int | None]:
    from engine import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = LLM(model=path, device=device, kv_cache_memory="256MiB", dtype="float32")
    try:
        outputs = llm.generate(PROMPTS, params)
        runner = getattr(llm.engine, "runner", None)
        counter = getattr(runner, "null_block_writes", None)
        null_writes = int(counter.item()) if counter is not None else None
    finally:
        llm.close()
    return [list(o.outputs[0].token_ids) for o in outputs], null_writes


@pytest.fixture
def strict_fp32(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


@pytest.fixture
def no_reference_on_cuda(monkeypatch):
    for name in ("write_kv_reference", "write_mla_reference"):
        original = getattr(kv_writer, name)

        def guarded(*args, _original=original, _name=name, **kwargs):
            if any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
                raise AssertionError(f"{_name} ran on CUDA tensors: the engine did not use the kernels")
            return _original(*args, **kwargs)
        monkeypatch.setattr(kv_writer, name, guarded)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-deepseek-v3"])
def test_greedy_tokens_match_cpu(cuda_kernels, checkpoint, strict_fp32, no_reference_on_cuda, preset):
    path = checkpoint(preset)
    cpu_tokens, cpu_null = greedy_tokens(path, "cpu")
    gpu_tokens, gpu_null = greedy_tokens(path, "cuda")
    assert all(len(t) == MAX_TOKENS for t in gpu_tokens)
    assert gpu_tokens == cpu_tokens
    assert gpu_null in (0, None) and cpu_null in (0, None), "a real token was written into the null block"
