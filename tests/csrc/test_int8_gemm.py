"""csrc/cpu/cpu_int8_gemm.cpp against engine/models/int8_reference.py: the same bits for every
format (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K), batch sizes 1-100, odd shapes and partial groups of
16 outputs, K of one and several (K-quant super-)blocks, with and without a bias, float32 and bf16
inputs; a row's bits do not depend on its batch. Each on both vector kernels, the 512-bit
AVX512-VNNI one and the 256-bit AVX-VNNI one (cpu_int8_gemm_avx.cpp, chosen through the test
build's switch on CPUs that have both), and the registry's label names the one that runs. The
reference itself is checked against the dequantized weight (tests/engine/ggml_blocks.py, which
shares no code with it, and gguf's dequantize) within int8 rounding, and its values against
gguf's exactly. Skipped where the kernel does not run (neither AVX512-VNNI nor AVX-VNNI), where
the engine runs the reference, and each kernel where the CPU lacks it. Needs the ops built
(`kvsentry_ops`)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.models.int8_reference import int8_gemm_reference
from engine.ops import registry
from engine.ops.cpu_ops import cpu_flags
from engine.ops.implementations import op_implementations
from tests.engine import ggml_blocks
from tests.engine.int8_helpers import cpu_kernels

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K]
K_QUANTS = (Q.Q4_K, Q.Q6_K)
# Groups of 8 KiB and more (K = 2048 in every format, Q8_0 from K = 512) take batches of up to 8 rows
# one group at a time, in tiles of up to 8 rows; shorter ones in pairs of groups from 3 rows.
SHAPES = [(16, 32), (200, 96), (37, 64), (960, 576), (576, 1536), (40, 2048)]
# K-quants: K in super-blocks of 256.
K_SHAPES = [(16, 256), (200, 768), (37, 512), (960, 256), (576, 1536), (40, 2048)]
ROWS = [1, 2, 3, 4, 5, 7, 8, 13, 32, 64, 100]
# int8_gemm's vector kernels (kvsentry_debug.int8_gemm_isa), and "auto": the CPU's own choice.
ISAS = ["auto", "avx512_vnni", "avx_vnni"]


def blocks(qtype: Q, n: int, k: int, seed: int) -> torch.Tensor:
    """[n, k / values * block bytes] uint8: a random weight quantized by gguf (ggml's reference),
    or for the K-quants (which gguf does not quantize) random bytes with float16 scales of a
    weight's size: every bit pattern of the quants and the 6- or 8-bit scales is a valid block."""
    rng = np.random.default_rng(seed)
    if qtype not in K_QUANTS:
        values = rng.standard_normal((n, k)).astype(np.float32) * 0.1
        return torch.from_numpy(np.ascontiguousarray(gguf.quantize(values, qtype)))
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    scales = (0, 2) if qtype == Q.Q4_K else (208,)  # Q4_K: d, dmin; Q6_K: d
    for at in scales:
        d = (np.abs(rng.standard_normal((n, k // 256, 1))) * 2e-3).astype(np.float16)
        raw[..., at:at + 2] = d.view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def shapes(qtype: Q) -> list[tuple[int, int]]:
    return K_SHAPES if qtype in K_QUANTS else SHAPES


def supported(ops) -> None:
    if not ops.int8_gemm_supported():
        pytest.skip("neither AVX512-VNNI nor AVX-VNNI here: the engine runs the torch reference")


@pytest.fixture(params=ISAS)
def isa_ops(request, kvsentry_ops):
    """The ops with int8_gemm on one vector kernel (or the CPU's choice); the CPU's choice again after."""
    supported(kvsentry_ops)
    try:
        kvsentry_ops.int8_gemm_isa(request.param)
    except RuntimeError as exc:
        pytest.skip(f"{request.param} does not run here: {str(exc).splitlines()[0]}")
    yield kvsentry_ops
    kvsentry_ops.int8_gemm_isa("auto")


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_kernel_equals_reference_bit_for_bit(isa_ops, qtype, shape):
    kvsentry_ops = isa_ops
    n, k = shapes(qtype)[shape]
    raw = blocks(qtype, n, k, seed=n + k)
    packed = kvsentry_ops.int8_gemm_pack(raw, int(qtype), k)
    values = 256 if qtype in K_QUANTS else 32
    assert packed.shape[:2] == ((n + 15) // 16, k // values)
    # Bytes per weight as the file's (the last group's padding outputs aside).
    assert packed.numel() / (packed.shape[0] * 16 * k) <= 1.03 * raw.numel() / (n * k)
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


@pytest.mark.parametrize("m", [1, 3, 64])
def test_bf16_outputs_round_as_torch_does_nan_and_inf_included(isa_ops, m):
    # A bf16 caller's float32 sums are rounded inside the op: the bits of .to(torch.bfloat16),
    # whose NaN is 0xFFFF and which rounds past bf16's largest finite value to inf. The bias
    # puts those values into the outputs (it is added in float32 before the rounding).
    kvsentry_ops = isa_ops
    n, k = 40, 64
    raw = blocks(Q.Q4_0, n, k, seed=9)
    packed = kvsentry_ops.int8_gemm_pack(raw, int(Q.Q4_0), k)
    bias = torch.randn(n)
    bias[:8] = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 3.4e38, -3.4e38,
                             1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8])  # the last two: ties to even, down and up
    x = torch.zeros(m, k, dtype=torch.bfloat16)  # all-zero blocks sum to 0: each output is its bias exactly
    got = kvsentry_ops.int8_gemm(x, packed, bias, n)
    want = int8_gemm_reference(x, raw, int(Q.Q4_0), bias)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert (got.view(torch.int16)[:, :2] == -1).all()  # 0xFFFF
    assert torch.isinf(got[:, 2:6]).all()


@pytest.mark.parametrize("k", [768, 2048])
@pytest.mark.parametrize("qtype", TYPES)
def test_a_rows_bits_do_not_depend_on_its_batch(isa_ops, qtype, k):
    # K = 2048: one-group tiles up to 32 rows (every format's group is 16 KiB or more there),
    # pairs of groups above; K = 768: pairs from 3 rows for Q4_0,
    # Q4_1 and Q4_K (Q5_0's, Q8_0's and Q6_K's groups are 8 KiB or more there).
    kvsentry_ops = isa_ops
    n = 200
    raw = blocks(qtype, n, k, seed=5)
    packed = kvsentry_ops.int8_gemm_pack(raw, int(qtype), k)
    x = torch.randn(100, k)
    alone = torch.cat([kvsentry_ops.int8_gemm(x[i:i + 1], packed, None, n) for i in range(100)])
    for m in (2, 5, 8, 9, 20, 32, 33, 100):
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
    n, k = 64, 512
    raw = blocks(qtype, n, k, seed=11)
    if qtype.name in ggml_blocks.DECODERS:
        weight = torch.from_numpy(ggml_blocks.decode(qtype.name, raw.numpy(), (n, k)).astype(np.float32))
    else:
        weight = torch.from_numpy(gguf.dequantize(raw.numpy(), qtype).reshape(n, k))
    x = torch.randn(8, k)
    exact = x.double() @ weight.double().T
    got = int8_gemm_reference(x, raw, int(qtype)).double()
    # Each activation moves by at most half a step (max|x| / 254 of its block).
    steps = x.reshape(8, -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(8, k) / 254
    bound = steps.double() @ weight.double().abs().T
    assert bool(((got - exact).abs() <= bound * 1.01 + 1e-4).all())
    assert not torch.equal(got, exact)


@pytest.mark.parametrize("qtype", TYPES)
def test_reference_values_are_ggmls(qtype):
    """The reference's weight values (scales * quants + minima) are gguf.dequantize's, bit for bit."""
    from engine.models.int8_reference import weight_blocks
    n, k = 24, 512
    raw = blocks(qtype, n, k, seed=13)
    quants, scales, minima = weight_blocks(raw, int(qtype), k)
    values = scales[..., None] * quants
    if minima is not None:
        values = values + minima[..., None]
    want = torch.from_numpy(gguf.dequantize(raw.numpy(), qtype).reshape(n, k))
    assert torch.equal(values.reshape(n, k), want)


def test_bad_arguments_are_refused(kvsentry_ops):
    raw = blocks(Q.Q4_0, 8, 64, seed=3)
    with pytest.raises(RuntimeError, match="is not Q4_0"):
        kvsentry_ops.int8_gemm_pack(raw, int(Q.Q5_1), 64)
    with pytest.raises(RuntimeError, match="whole blocks of 256"):
        kvsentry_ops.int8_gemm_pack(blocks(Q.Q4_K, 8, 256, seed=3), int(Q.Q4_K), 128)
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
    n, k = 37, 512 if qtype in K_QUANTS else 96
    raw = blocks(qtype, n, k, seed=9)
    packed = kvsentry_ops.int8_gemm_pack(raw, int(qtype), k)
    ids = torch.tensor([0, 15, 16, 36, 5, 5])
    got, want = packed_blocks(packed, ids, int(qtype)), weight_blocks(raw[ids], int(qtype), k)
    for g, w in zip(got, want):
        assert (g is None and w is None) or torch.equal(g, w)


def test_a_call_past_the_kept_scratch_then_small_ones(isa_ops):
    # The op's per-thread scratch is kept between calls up to 16 MiB and released past it (a
    # logprobs-sized LM head): calls around that size and after it still give the reference's bits.
    kvsentry_ops = isa_ops
    k = 64
    for n, m in ((72000, 64), (40, 3), (72000, 1), (40, 64)):
        raw = blocks(Q.Q8_0, n, k, seed=n + m)
        packed = kvsentry_ops.int8_gemm_pack(raw, int(Q.Q8_0), k)
        x = torch.randn(m, k).to(torch.bfloat16)
        assert torch.equal(kvsentry_ops.int8_gemm(x, packed, None, n), int8_gemm_reference(x, raw, int(Q.Q8_0))), (n, m)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0])
def test_rows_op_gathers_the_values_the_torch_path_gives(kvsentry_ops, qtype):
    """int8_gemm_rows (csrc/cpu/cpu_int8_rows.cpp), the tied embedding's gather: the bits of
    block_values over packed_blocks, row for row, partial last group and repeats included."""
    from engine.models.block_embedding import packed_blocks
    from engine.models.int8_reference import block_values
    n, k = 37, 96
    raw = blocks(qtype, n, k, seed=11)
    packed = kvsentry_ops.int8_gemm_pack(raw, int(qtype), k)
    ids = torch.tensor([0, 15, 16, 36, 5, 5, 31])
    got = kvsentry_ops.int8_gemm_rows(packed, ids)
    want = block_values(*packed_blocks(packed, ids, int(qtype))).reshape(len(ids), k)
    assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert kvsentry_ops.int8_gemm_rows(packed, ids[:0]).shape == (0, k)
    with pytest.raises(RuntimeError, match="past the 48 rows"):
        kvsentry_ops.int8_gemm_rows(packed, torch.tensor([48]))
    with pytest.raises(RuntimeError, match="are not Q4_0"):
        kvsentry_ops.int8_gemm_rows(kvsentry_ops.int8_gemm_pack(blocks(Q.Q6_K, 16, 256, seed=1), int(Q.Q6_K), 256), ids)


def test_parts_of_several_types_are_their_parts_side_by_side(isa_ops):
    """A q|k|v of several GGML types (engine/models/int8_linear.py's Int8Parts, one vector behind a
    header): int8_gemm_parts gives each part's int8_gemm (so the reference's) bits in its columns."""
    from engine.gguf.weights import QuantRows
    from engine.models.int8_linear import Int8Parts
    kvsentry_ops = isa_ops
    k = 512
    rows = [QuantRows(int(t), k, blocks(t, n, k, seed=n), True) for t, n in ((Q.Q4_K, 37), (Q.Q6_K, 16), (Q.Q5_0, 21))]
    bias = torch.randn(74)
    parts = Int8Parts(rows, bias)
    assert parts.kernel and parts.blocks.dim() == 1 and parts.path.endswith("on q4_k+q6_k+q5_0 blocks")
    for m in (1, 5, 33):
        x = torch.randn(m, k)
        want = torch.cat([int8_gemm_reference(x, r.data, r.ggml_type, b)
                          for r, b in zip(rows, bias.split([37, 16, 21]))], 1)
        assert torch.equal(parts(x), want), m
        assert torch.equal(kvsentry_ops.int8_gemm_parts(x, parts.blocks, None, 74),
                           torch.cat([int8_gemm_reference(x, r.data, r.ggml_type) for r in rows], 1))
    with pytest.raises(RuntimeError, match="parts hold 74 outputs, not 75"):
        kvsentry_ops.int8_gemm_parts(torch.randn(2, k), parts.blocks, None, 75)
    with pytest.raises(RuntimeError, match="does not fit"):
        kvsentry_ops.int8_gemm_parts(torch.randn(2, k), parts.blocks[:-64].contiguous(), None, 74)


def test_the_label_names_the_vector_kernel_that_runs(kvsentry_ops):
    """The registry's label, the metric's value and a linear's path name the kernels this CPU
    picks from; on the 256-bit kernel (as on a CPU without AVX-512) "avx_vnni" alone, no tiles."""
    from engine.gguf.weights import QuantRows
    from engine.models.int8_linear import Int8Blocks
    supported(kvsentry_ops)
    kernel = registry.kernel_for("int8_gemm", "cpu")
    assert list(kvsentry_ops.int8_gemm_kernels()) == cpu_kernels()
    assert kvsentry_ops.int8_gemm_isa() == [k for k in cpu_kernels() if k != "amx_int8"][0]
    assert registry.label(kernel) == f"cpu_kernel({'+'.join(cpu_kernels())})"
    if "avx_vnni" not in cpu_flags():
        pytest.skip("no AVX-VNNI on this CPU: the 256-bit kernel cannot be chosen")
    try:
        assert kvsentry_ops.int8_gemm_isa("avx_vnni") == "avx_vnni"
        assert list(kvsentry_ops.int8_gemm_kernels()) == ["avx_vnni"]
        assert registry.label(kernel) == "cpu_kernel(avx_vnni)"
        assert op_implementations("cpu")["int8_gemm"] == "cpu_kernel(avx_vnni)"
        linear = Int8Blocks(QuantRows(int(Q.Q4_0), 64, blocks(Q.Q4_0, 16, 64, seed=1), True), None)
        assert linear.path == "int8_gemm(cpu_kernel(avx_vnni)) on q4_0 blocks"
        with pytest.raises(RuntimeError, match="is not avx512_vnni, avx_vnni or auto"):
            kvsentry_ops.int8_gemm_isa("avx10")
    finally:
        kvsentry_ops.int8_gemm_isa("auto")
    assert list(kvsentry_ops.int8_gemm_kernels()) == cpu_kernels()


def test_the_vnni_peak_counts_the_multiply_adds_it_timed(kvsentry_ops):
    """benchmarks/limits.py's int8 ceiling: 16 x 64 multiply-adds per iteration over its seconds. A
    run ten times longer takes about ten times the time (the loop is not folded away), so it
    reports a rate of the same order; on a CPU without AVX512-VNNI it refuses, by name."""
    if "avx512_vnni" not in cpu_kernels():
        with pytest.raises(RuntimeError, match="int8_vnni_peak"):
            kvsentry_ops.int8_vnni_peak(10)
        return
    # The best of three each: a run the OS preempts (the suite shares two cores) reports less.
    short = max(kvsentry_ops.int8_vnni_peak(200_000) for _ in range(3))
    long = max(kvsentry_ops.int8_vnni_peak(2_000_000) for _ in range(3))
    # One core issues at most 4 vpdpbusd (256 multiply-adds) a cycle at up to 6 GHz: a folded loop
    # would report a rate far above that.
    for rate in (short, long):
        assert 1e9 < rate < 6e9 * 64 * 4
    assert 0.2 < long / short < 5
