"""csrc/cpu/cpu_quant_panels.h: GGUF Q4_1 / Q8_0 blocks as panels. Their dequantized values are
ggml's reference dequantization (gguf.dequantize) bit for bit, and the bf16 and float32 panel
GEMMs give bit for bit the results of their own panels packed from those values, on every row
path (one row, AMX tiles of up to 16 rows, chunked passes past 16, the vdpbf16ps tiles, and
the "avx512f" kernel, whose quantized panels go through the float32 GEMM on values rounded to
bf16). Skipped on CPUs without AVX-512, where the engine keeps the plain weights. The rows layout
of Q4_1 (quant_rows_pack: the AMX tiles' A operand, looked up per output and block) unpacks to
the same values and gives the panels' bits on every row path; skipped where the CPU lacks AMX-BF16
or AVX512-VBMI, where the engine keeps the panels. Needs the ops built (`kvsentry_ops`)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q4_1, Q.Q8_0]
DTYPES = [torch.float32, torch.bfloat16]


def blocks(qtype: Q, n: int, k: int, seed: int) -> np.ndarray:
    """[n, k / 32 * block bytes] of a random weight quantized by gguf (ggml's reference)."""
    values = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1
    return np.ascontiguousarray(gguf.quantize(values, qtype))


def dequantized(raw: np.ndarray, qtype: Q, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.dequantize(raw, qtype), dtype=np.float32).reshape(n, k))


def supported(ops, dtype: torch.dtype) -> None:
    if not ops.quant_panels_supported(dtype):
        pytest.skip(f"no {dtype} quantized panels on this CPU: the engine multiplies by the plain weights")


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(64, 32), (200, 96), (960, 576), (1, 64)])
def test_unpack_is_ggmls_dequantization(kvsentry_ops, qtype, dtype, n, k):
    """Every output, partial last panels included: d * q (+ m) in float32, rounded to nearest
    even for bf16, exactly as gguf's numpy reference and torch's cast."""
    supported(kvsentry_ops, dtype)
    raw = blocks(qtype, n, k, seed=n + k)
    packed = kvsentry_ops.quant_panels_pack(torch.from_numpy(raw), int(qtype), k)
    assert packed.dtype == torch.uint8 and packed.shape[:2] == ((n + 63) // 64, k // 32)
    got = kvsentry_ops.quant_panels_unpack(packed, n, dtype)
    assert torch.equal(got, dequantized(raw, qtype, n, k).to(dtype))


def extreme_q4_1(n: int, k: int, seed: int) -> np.ndarray:
    """Q4_1 rows whose float16 scales and minima take their extremes (largest, subnormal,
    negative, zero), and whose bytes run through every value (output o's from 17 o on), so both
    nibbles take every 4-bit value."""
    raw = blocks(Q.Q4_1, n, k, seed=1).reshape(n, k // 32, 20)
    specials = np.array([65504.0, -65504.0, 6e-8, -6e-8, 0.0, 1.0, -0.5, 3.1e-5], dtype=np.float16)
    rng = np.random.default_rng(seed)
    raw[..., 0:2] = rng.choice(specials, size=(n, k // 32)).view(np.uint8).reshape(n, k // 32, 2)
    raw[..., 2:4] = rng.choice(specials, size=(n, k // 32)).view(np.uint8).reshape(n, k // 32, 2)
    raw[..., 4:] = ((np.arange(16) * 17 + np.arange(n)[:, None, None]) % 256).astype(np.uint8)
    return np.ascontiguousarray(raw.reshape(n, -1))


def test_extreme_scales_and_minima(kvsentry_ops):
    """float16 scales and minima at their extremes and every 4-bit value: still the reference's values."""
    supported(kvsentry_ops, torch.float32)
    n, k = 64, 64
    raw = extreme_q4_1(n, k, seed=2)
    packed = kvsentry_ops.quant_panels_pack(torch.from_numpy(raw), int(Q.Q4_1), k)
    reference = dequantized(raw, Q.Q4_1, n, k)
    for dtype in DTYPES:
        if kvsentry_ops.quant_panels_supported(dtype):
            assert torch.equal(kvsentry_ops.quant_panels_unpack(packed, n, dtype), reference.to(dtype))


# Rows: one, the vdpbf16ps / float32 register tiles (2-6), AMX's single pass (16), chunked
# passes (17, 40, 64, with the L2 prefetch at 49-64), float32 block by block up to 32 and
# through L2 beyond (32, 33), past the 96-row chunk of the vector
# kernels (100), empty. Shapes: partial panels, K of 1 to 48 blocks (the default model's).
ROWS = [1, 2, 5, 16, 17, 32, 33, 40, 64, 100, 260, 0]  # 260: past a 256-row pass
SHAPES = [(200, 96), (960, 576), (576, 1536)]


def plain_and_quant(ops, qtype: Q, dtype: torch.dtype, n: int, k: int):
    raw = blocks(qtype, n, k, seed=7 * n + k)
    weight = dequantized(raw, qtype, n, k).to(dtype)
    pack = ops.f32_gemm_pack if dtype == torch.float32 else ops.bf16_gemm_pack
    return pack(weight), ops.quant_panels_pack(torch.from_numpy(raw), int(qtype), k)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemm_equals_the_plain_panels_bit_for_bit(kvsentry_ops, qtype, dtype, n, k):
    supported(kvsentry_ops, dtype)
    plain, quant = plain_and_quant(kvsentry_ops, qtype, dtype, n, k)
    bias = torch.randn(n).to(dtype)
    kernels = [None]
    if dtype == torch.bfloat16:
        gemm = kvsentry_ops.bf16_gemm
        kernels = list(kvsentry_ops.bf16_gemm_kernels())
    else:
        gemm = kvsentry_ops.f32_gemm
    for m in ROWS:
        x = torch.randn(m, k).to(dtype)
        for b in (None, bias):
            for kernel in kernels:
                if kernel is None:
                    want, got = gemm(x, plain, b, n), gemm(x, quant, b, n)
                else:
                    want = kvsentry_ops.bf16_gemm_with(x, plain, b, n, kernel)
                    got = kvsentry_ops.bf16_gemm_with(x, quant, b, n, kernel)
                assert torch.equal(got, want), (m, kernel, b is not None)


def test_bad_arguments_are_refused(kvsentry_ops):
    raw = torch.from_numpy(blocks(Q.Q4_1, 8, 64, seed=3))
    with pytest.raises(RuntimeError, match="has no panels"):
        kvsentry_ops.quant_panels_pack(raw, int(Q.Q4_0), 64)
    with pytest.raises(RuntimeError, match="whole blocks of 32"):
        kvsentry_ops.quant_panels_pack(raw, int(Q.Q4_1), 48)
    with pytest.raises(RuntimeError, match="raw must be"):
        kvsentry_ops.quant_panels_pack(raw, int(Q.Q4_1), 96)
    packed = kvsentry_ops.quant_panels_pack(raw, int(Q.Q4_1), 64)
    supported(kvsentry_ops, torch.float32)
    with pytest.raises(RuntimeError, match="do not fit"):
        kvsentry_ops.f32_gemm(torch.randn(2, 96), packed, None, 8)
    with pytest.raises(RuntimeError, match="does not fit"):
        kvsentry_ops.quant_panels_unpack(packed, 65, torch.float32)


def rows_supported(ops) -> None:
    if not ops.quant_rows_supported():
        pytest.skip("no rows layout on this CPU (AMX-BF16 and AVX512-VBMI): the engine keeps the panels")


@pytest.mark.parametrize("n,k", [(64, 32), (200, 96), (960, 576), (1, 64), (130, 1536)])
def test_rows_layout_unpacks_to_ggmls_dequantization(kvsentry_ops, n, k):
    """Every output of every block, partial last panels included, through the GEMM's lookups:
    d * q + m in float32 rounded to nearest even, as gguf's numpy reference and torch's cast."""
    rows_supported(kvsentry_ops)
    raw = blocks(Q.Q4_1, n, k, seed=3 * n + k)
    packed = kvsentry_ops.quant_rows_pack(torch.from_numpy(raw), int(Q.Q4_1), k)
    assert packed.dtype == torch.uint8 and packed.shape == ((n + 63) // 64, k // 32, 80, 16)
    got = kvsentry_ops.quant_panels_unpack(packed, n, torch.bfloat16)
    assert torch.equal(got, dequantized(raw, Q.Q4_1, n, k).bfloat16())


def test_rows_layout_keeps_extreme_scales_and_every_quant(kvsentry_ops):
    """float16 scales and minima at their extremes, both nibbles of every byte at every value:
    each output's 16-entry table holds exactly the reference's values."""
    rows_supported(kvsentry_ops)
    n, k = 64, 64
    raw = extreme_q4_1(n, k, seed=5)
    packed = kvsentry_ops.quant_rows_pack(torch.from_numpy(raw), int(Q.Q4_1), k)
    reference = dequantized(raw, Q.Q4_1, n, k).bfloat16()
    assert torch.equal(kvsentry_ops.quant_panels_unpack(packed, n, torch.bfloat16), reference)


@pytest.mark.parametrize("n,k", SHAPES + [(64, 32)])
def test_rows_layout_gives_the_panels_bits(kvsentry_ops, n, k):
    """Every row path of the rows layout (one tile of 1-16 rows over the whole K, chunked
    passes past 16, the L2 prefetch at 49-64, past a 256-row pass) against the AMX tiles on
    the panel layout of the same blocks, and against the dense panels: the tiles' sums do not
    depend on which operand is the weight."""
    rows_supported(kvsentry_ops)
    raw = blocks(Q.Q4_1, n, k, seed=11 * n + k)
    rows = kvsentry_ops.quant_rows_pack(torch.from_numpy(raw), int(Q.Q4_1), k)
    panels = kvsentry_ops.quant_panels_pack(torch.from_numpy(raw), int(Q.Q4_1), k)
    plain = kvsentry_ops.bf16_gemm_pack(dequantized(raw, Q.Q4_1, n, k).bfloat16())
    bias = torch.randn(n).bfloat16()
    for m in ROWS + [3, 7, 8, 15, 31, 49, 63, 65, 129]:
        x = torch.randn(m, k).bfloat16()
        for b in (None, bias):
            got = kvsentry_ops.bf16_gemm(x, rows, b, n)
            assert torch.equal(got, kvsentry_ops.bf16_gemm_with(x, panels, b, n, "amx")), (m, b is not None)
            assert torch.equal(got, kvsentry_ops.bf16_gemm_with(x, plain, b, n, "amx")), (m, b is not None)


def test_rows_layout_a_rows_bits_do_not_depend_on_its_batch(kvsentry_ops):
    """A row alone and in batches of every path (one tile, chunked passes, past 256 rows), on 1
    and 2 threads, and a row of x that is a strided view: the same bits."""
    rows_supported(kvsentry_ops)
    n, k = 200, 576
    raw = blocks(Q.Q4_1, n, k, seed=17)
    rows = kvsentry_ops.quant_rows_pack(torch.from_numpy(raw), int(Q.Q4_1), k)
    x = torch.randn(300, k).bfloat16()
    alone = torch.cat([kvsentry_ops.bf16_gemm(x[i:i + 1], rows, None, n) for i in range(0, 300, 7)])
    for m in (8, 16, 17, 64, 300):
        batch = kvsentry_ops.bf16_gemm(x[:m], rows, None, n)
        assert torch.equal(batch[0:m:7], alone[:len(range(0, m, 7))]), m
    wide = torch.randn(5, 2 * k).bfloat16()[:, :k]  # rows 2k apart
    assert torch.equal(kvsentry_ops.bf16_gemm(wide, rows, None, n), kvsentry_ops.bf16_gemm(wide.contiguous(), rows, None, n))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # threads split the panels, each with its own buffers
    try:
        for m in (1, 17, 300):
            assert torch.equal(kvsentry_ops.bf16_gemm(x[:m], rows, None, n)[0:m:7], alone[:len(range(0, m, 7))]), m
    finally:
        torch.set_num_threads(threads)


def test_rows_layout_is_refused_where_it_does_not_run(kvsentry_ops):
    raw = torch.from_numpy(blocks(Q.Q4_1, 8, 64, seed=3))
    with pytest.raises(RuntimeError, match="no rows layout"):
        kvsentry_ops.quant_rows_pack(torch.from_numpy(blocks(Q.Q8_0, 8, 64, seed=3)), int(Q.Q8_0), 64)
    with pytest.raises(RuntimeError, match="whole blocks of 32"):
        kvsentry_ops.quant_rows_pack(raw, int(Q.Q4_1), 48)
    with pytest.raises(RuntimeError, match="raw must be"):
        kvsentry_ops.quant_rows_pack(raw, int(Q.Q4_1), 96)
    rows = kvsentry_ops.quant_rows_pack(raw, int(Q.Q4_1), 64)
    if not kvsentry_ops.bf16_gemm_supported():
        return
    for kernel in kvsentry_ops.bf16_gemm_kernels():
        if kernel != "amx":
            with pytest.raises(RuntimeError, match="amx kernel only"):
                kvsentry_ops.bf16_gemm_with(torch.randn(2, 64).bfloat16(), rows, None, 8, kernel)
    if kvsentry_ops.quant_rows_supported():
        with pytest.raises(RuntimeError, match="do not fit"):
            kvsentry_ops.bf16_gemm(torch.randn(2, 96).bfloat16(), rows, None, 8)
        with pytest.raises(RuntimeError, match="does not fit"):
            kvsentry_ops.quant_panels_unpack(rows, 65, torch.bfloat16)
        with pytest.raises(RuntimeError, match="rows layout is bf16"):
            kvsentry_ops.quant_panels_unpack(rows, 8, torch.float32)
