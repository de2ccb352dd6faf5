"""int8_gemm's AMX-INT8 path (csrc/cpu/cpu_int8_gemm_amx.cpp) against engine/models/int8_reference.py:
the same bits for Q4_0, Q4_1 and Q8_0, batches on both sides of the dispatch threshold (and the
AMX kernel forced down to one row, for its tails), odd N, K of one to many blocks (chunk tails),
float32 and bf16 inputs, with and without a bias; a row's bits do not depend on its batch nor on
which path that batch takes, nor on the threads; with the AMX path switched off (as on a CPU
without AMX-INT8) the VNNI kernel gives those bits, and the registry's label names the kernels the
CPU has. Skipped, saying so, where the CPU has no AMX-INT8. Needs the ops built (`kvsentry_ops`)."""
from __future__ import annotations

import random

import gguf
import pytest
import torch

from engine.models.int8_reference import int8_gemm_reference
from engine.ops import registry
from tests.csrc.test_int8_gemm import blocks
from tests.engine.int8_helpers import cpu_kernels

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]  # the formats the tiles take (others run the VNNI kernel alone)
# (N, K): odd N and partial groups of 16, one pair of groups and a lone last group, K of 1, 3, 5
# and 48 blocks (the kernel takes K in chunks of 4 blocks).
SHAPES = [(16, 32), (37, 96), (200, 160), (576, 1536)]
ROWS = [1, 2, 7, 8, 9, 16, 17, 31, 32, 33, 64] + random.Random(40).sample(range(34, 101), 3)
OFF = 1 << 40  # a threshold past every batch: the VNNI kernel alone


@pytest.fixture
def amx(kvsentry_ops):
    """The ops, on a CPU with AMX-INT8; the threshold restored after the test."""
    if "amx_int8" not in kvsentry_ops.int8_gemm_kernels():
        pytest.skip("no AMX-INT8 on this CPU (or no tile permission): int8_gemm runs the VNNI kernel alone")
    threshold = kvsentry_ops.int8_gemm_amx_rows()
    yield kvsentry_ops
    kvsentry_ops.int8_gemm_amx_rows(threshold)


@pytest.mark.parametrize("qtype", TYPES)
def test_amx_path_equals_reference_bit_for_bit(amx, qtype):
    for n, k in SHAPES:
        raw = blocks(qtype, n, k, seed=n + 3 * k)
        packed = amx.int8_gemm_pack(raw, int(qtype), k)
        bias = torch.randn(n)
        for m in ROWS:
            if k == 1536 and m not in (1, 17, 64):
                continue  # the large K needs few batches: the chunks are the same at every m
            x = torch.randn(m, k) * 3
            x[0, :32] = 0  # an all-zero block: scale 0
            for threshold in (1, amx.int8_gemm_amx_rows()):  # the AMX kernel at every m, then the dispatch
                amx.int8_gemm_amx_rows(threshold)
                for b, dtype in ((None, torch.float32), (bias, torch.float32), (bias, torch.bfloat16)):
                    xd = x.to(dtype)
                    got = amx.int8_gemm(xd, packed, b, n)
                    want = int8_gemm_reference(xd, raw, int(qtype), b)
                    assert got.dtype == dtype and torch.equal(got, want), (n, k, m, threshold, b is not None, dtype)


@pytest.mark.parametrize("qtype", TYPES)
def test_a_rows_bits_do_not_depend_on_its_batch_nor_its_path(amx, qtype):
    """Rows alone (below the threshold: VNNI), then in batches that take the AMX path, on one
    thread and on two, and with the AMX path off: the same bits."""
    n, k = 200, 576
    raw = blocks(qtype, n, k, seed=6)
    packed = amx.int8_gemm_pack(raw, int(qtype), k)
    x = torch.randn(100, k)
    alone = torch.cat([amx.int8_gemm(x[i:i + 1], packed, None, n) for i in range(100)])
    assert amx.int8_gemm_amx_rows() > 1  # so `alone` ran the VNNI kernel
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for m in (amx.int8_gemm_amx_rows(), 17, 64, 100):
                assert torch.equal(amx.int8_gemm(x[:m], packed, None, n), alone[:m]), (count, m)
    finally:
        torch.set_num_threads(threads)
    amx.int8_gemm_amx_rows(OFF)
    for m in (17, 100):
        assert torch.equal(amx.int8_gemm(x[:m], packed, None, n), alone[:m]), m


def test_the_label_names_the_kernels_this_cpu_has(kvsentry_ops):
    """Where the CPU has AMX-INT8 the registry says "amx_int8+avx512_vnni", else "avx512_vnni"
    (or "avx_vnni" without AVX-512); the switch that turns the path off for a test does not
    change what the CPU has."""
    kernel = registry.kernel_for("int8_gemm", "cpu")
    if not registry.runs(kernel):
        pytest.skip("neither AVX512-VNNI nor AVX-VNNI here: int8_gemm runs the torch reference")
    want = cpu_kernels()
    threshold = kvsentry_ops.int8_gemm_amx_rows()
    try:
        kvsentry_ops.int8_gemm_amx_rows(OFF)
        assert list(kvsentry_ops.int8_gemm_kernels()) == want
        assert registry.label(kernel) == f"cpu_kernel({'+'.join(want)})"
    finally:
        kvsentry_ops.int8_gemm_amx_rows(threshold)
