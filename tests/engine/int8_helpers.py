"""What the int8-path tests (test_int8_linear.py, test_int8_kquants.py) check alike."""
from __future__ import annotations

from typing import Callable

import pytest

from engine import LLM
from engine.ops import library, registry
from engine.ops.cpu_ops import cpu_flags


def assert_same_bits(want, got) -> None:
    """Two generate() results: the same tokens and the same log-probs, to the bit."""
    assert len(want) == len(got)
    for ref, out in zip(want, got):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].logprobs == ref.outputs[0].logprobs


def assert_fused_stack_matches_loop(make_llm: Callable[..., LLM], prompts, params) -> None:
    """The layers as one csrc op (engine/models/fused_stack.py) give the Python loop's bits."""
    fused = make_llm(quantized_activations="int8")
    assert fused.engine.runner.model.model.fused is not None
    got = fused.generate(prompts, params)
    fused.close()
    loop = make_llm(quantized_activations="int8", enforce_eager=True)
    assert loop.engine.runner.model.model.fused is None
    want = loop.generate(prompts, params)
    loop.close()
    assert_same_bits(want, got)


def cpu_kernels() -> list[str]:
    """The kernels int8_gemm picks from on this CPU and build, best first: AVX512-VNNI (with
    AMX-INT8 tiles where the CPU has them) in a build for AVX-512, else AVX-VNNI (256-bit)."""
    flags = cpu_flags()
    if library.cpu_capability() == "AVX512" and {"avx512bw", "avx512_vnni"} <= flags:
        return (["amx_int8"] if "amx_int8" in flags else []) + ["avx512_vnni"]
    return ["avx_vnni"] if "avx_vnni" in flags else []


@pytest.fixture(params=["best", "avx_vnni"])
def vector_kernels(request) -> list[str]:
    """The kernels int8_gemm runs for the test: the CPU's best, or the 256-bit AVX-VNNI one alone,
    as on a CPU without AVX-512 (the test build's switch, in this process where the engine runs);
    the best again after."""
    if request.param == "best":
        yield cpu_kernels()
        return
    if "avx_vnni" not in cpu_flags() or not registry.available("int8_gemm", "cpu"):
        pytest.skip("no AVX-VNNI on this CPU (or no int8 kernel): the 256-bit kernel cannot be chosen")
    debug = registry.debug_ops()
    debug.int8_gemm_isa("avx_vnni")
    try:
        yield ["avx_vnni"]
    finally:
        debug.int8_gemm_isa("auto")
