"""csrc/cpu/cpu_int8_gemm.cpp against engine/models/int8_reference.py: the same bits for every
format (Q4_0, Q4_1, Q8_0), batch sizes 1-100, odd shapes and partial groups of 16 outputs, with
and without a bias, float32 and bf16 inputs; a row's bits do not depend on its batch. The
reference itself is checked against the dequantized weight (tests/engine/ggml_blocks.py, which
shares no code with it) within int8 rounding. Skipped where the kernel does not run (no
AVX512-VNNI), where the engine runs the reference. Needs the ops built (`kvsentry_ops`)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.models.int8_reference import int8_gemm_reference
from tests.engine import ggml_blocks

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]
SHAPES = [(16, 32), (200, 96), (37, 64), (960, 576), (576, 1536)]
ROWS = [1, 2, 3, 4, 5, 7, 8, 13, 32, 64, 100]


def blocks(qtype: Q, n: int, k: int, seed: int) -> torch.Tensor:
    """[n, k / 32 * block bytes] uint8 of a random weight quantized by gguf (ggml's reference)."""
    values = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1
    return torch.from_numpy(np.ascontiguousarray(gguf.quantize(values, qtype)))


def supported(ops) -> None:
    if not ops.int8_gemm_supported():
        pytest.skip("no AVX512-VNNI here: the engine runs the torch reference")


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_kernel_equals_reference_bit_for_bit(kvsentry_ops, qtype, n, k):
    supported(kvsentry_ops)
    raw = blocks(qtype, n, k, seed=n + k)
    packed = kvsentry_ops.int8_gemm_pack(raw, int(qtype), k)
    assert packed.shape[:2] == ((n + 15) // 16, k // 32)
    bias = torch.randn(n)
    for m in ROWS:
        x = torch.randn(m, k) * 3
        x[0, :32] = 0  # an all-zero block: scale 0
        for b in (None, bias):
            for dtype in (torch.float32, torch.bfloat16):
                xd = x.to(dtype)
                got = kvsentry_ops.int8_gemm(xd, packed, b, n)
                want = int8_gemm_reference(xd, raw, int(qtype), b)
                assert got.dtype == dtype and torch.equal(got, want), (m, b is not None, dtype)


@pytest.mark.parametrize("qtype", TYPES)
def test_a_rows_bits_do_not_depend_on_its_batch(kvsentry_ops, qtype):
    supported(kvsentry_ops)
    n, k = 200, 576
    raw = blocks(qtype, n, k, seed=5)
    packed = kvsentry_ops.int8_gemm_pack(raw, int(qtype), k)
    x = torch.randn(100, k)
    alone = torch.cat([kvsentry_ops.int8_gemm(x[i:i + 1], packed, None, n) for i in range(100)])
    for m in (2, 5, 33, 100):
        assert torch.equal(kvsentry_ops.int8_gemm(x[:m], packed, None, n), alone[:m]), m
    with torch.no_grad():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert torch.equal(kvsentry_ops.int8_gemm(x, packed, None, n), alone)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", TYPES)
def test_reference_is_close_to_the_dequantized_product(qtype):
    """The reference's integer arithmetic is the dequantized weight's product, up to the int8
    rounding of the activations (an independent decoder of the blocks: ggml_blocks)."""
    n, k = 64, 256
    raw = blocks(qtype, n, k, seed=11)
    weight = torch.from_numpy(ggml_blocks.decode(qtype.name, raw.numpy(), (n, k)).astype(np.float32))
    x = torch.randn(8, k)
    exact = x.double() @ weight.double().T
    got = int8_gemm_reference(x, raw, int(qtype)).double()
    # Each activation moves by at most half a step (max|x| / 254 of its block).
    steps = x.reshape(8, -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(8, k) / 254
    bound = steps.double() @ weight.double().abs().T
    assert bool(((got - exact).abs() <= bound * 1.01 + 1e-4).all())
    assert not torch.equal(got, exact)


def test_bad_arguments_are_refused(kvsentry_ops):
    raw = blocks(Q.Q4_0, 8, 64, seed=3)
    with pytest.raises(RuntimeError, match="is not Q4_0"):
        kvsentry_ops.int8_gemm_pack(raw, int(Q.Q5_0), 64)
    with pytest.raises(RuntimeError, match="whole blocks of 32"):
        kvsentry_ops.int8_gemm_pack(raw, int(Q.Q4_0), 48)
    with pytest.raises(RuntimeError, match="raw must be"):
        kvsentry_ops.int8_gemm_pack(raw, int(Q.Q4_0), 96)
    supported(kvsentry_ops)
    packed = kvsentry_ops.int8_gemm_pack(raw, int(Q.Q4_0), 64)
    with pytest.raises(RuntimeError, match="x must be"):
        kvsentry_ops.int8_gemm(torch.randn(2, 96), packed, None, 8)
    with pytest.raises(RuntimeError, match="does not fit"):
        kvsentry_ops.int8_gemm(torch.randn(2, 64), packed, None, 17)


@pytest.mark.parametrize("qtype", TYPES)
def test_packed_rows_read_back_as_their_gguf_rows(kvsentry_ops, qtype):
    """A tied embedding gathers from the LM head's packed blocks (engine/models/block_embedding.py):
    every row, partial last group included, reads back as the file's row."""
    from engine.models.block_embedding import packed_blocks
    from engine.models.int8_reference import weight_blocks
    n, k = 37, 96
    raw = blocks(qtype, n, k, seed=9)
    packed = kvsentry_ops.int8_gemm_pack(raw, int(qtype), k)
    ids = torch.tensor([0, 15, 16, 36, 5, 5])
    got, want = packed_blocks(packed, ids, int(qtype)), weight_blocks(raw[ids], int(qtype), k)
    for g, w in zip(got, want):
        assert (g is None and w is None) or torch.equal(g, w)
