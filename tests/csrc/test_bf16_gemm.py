"""csrc/cpu/cpu_bf16_gemm.cpp (the bf16_gemm op) against a float64 reference and
against oneDNN, on CPUs with AVX-512F (skipped elsewhere: the engine keeps oneDNN there).
Every kernel this CPU runs is tested on its own (bf16_gemm_with): the float32-FMA panels
("avx512f") everywhere, the vdpbf16ps panels where the CPU has AVX512-BF16, and the AMX tiles
where it has AMX.

The reference: x @ w^T + b in float64 over the bf16 inputs, which float32 accumulation of
exact bf16 products must meet within its own rounding (K ulps of the largest partial sum),
and the result rounded to bf16 once. Needs the ops built (`kvsentry_ops`)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def ops(kvsentry_ops):
    if not kvsentry_ops.bf16_gemm_supported():
        pytest.skip("no AVX-512F on this CPU: the engine uses oneDNN for every bf16 linear")
    return kvsentry_ops


def kernels() -> list[str]:
    """The kernels of this CPU, known at collection time (the ops load in the fixture)."""
    from engine.ops import cpu_ops, registry
    if not cpu_ops.available() or not registry.op("bf16_gemm_supported")():
        return ["avx512_bf16"]  # the fixture skips
    return list(registry.op("bf16_gemm_kernels")())


KERNELS = kernels()


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out + b.double() if b is not None else out


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 summation error bound per output: K * eps32 * sum |x_k w_k| (+ the bf16 rounding)."""
    k = x.shape[1]
    return k * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T) + 1e-30


SHAPES = [(1, 960, 576), (2, 576, 576), (5, 3072, 576), (6, 64, 64), (7, 100, 33), (8, 96, 64), (13, 1536, 96),
          (16, 64, 1536), (17, 200, 40), (64, 576, 1536), (97, 130, 64), (200, 49, 1), (300, 70, 600),
          (0, 64, 64)]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_matches_float64_within_float32_summation(ops, kernel, m, n, k, with_bias):
    """Every row tile (1..7 rows; one AMX block of 16 and a partial one), partial panels (N not
    a multiple of 64), K not a multiple of 32 (or odd), M past a row chunk (96; AMX: 256), K
    in several chunks of 6 AMX blocks (1536, 600), empty M: within float32 summation error of
    the exact result, then rounded to bf16 (one bf16 ulp at most beyond it)."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = (torch.randn(n, k, generator=g) * 0.2).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if with_bias else None
    y = ops.bf16_gemm_with(x, ops.bf16_gemm_pack(w), b, n, kernel)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    exact = reference(x, w, b)
    slack = bound(x, w) + exact.abs() * 2.0 ** -8  # the final rounding to bf16: half an ulp, with margin
    assert bool(((y.double() - exact).abs() <= slack).all())


@pytest.mark.parametrize("kernel", KERNELS)
def test_agrees_with_onednn_on_the_default_models_shapes(ops, kernel):
    """oneDNN's kernels also sum bf16 pairs in float32 (vdpbf16ps, or AMX tiles): on the
    default model's layer shapes the two agree on (nearly) every output bit."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bf16 path here")
    g = torch.Generator().manual_seed(0)
    for m, n, k in [(1, 960, 576), (8, 3072, 576), (32, 576, 1536)]:
        w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
        x = torch.randn(m, k, generator=g).bfloat16()
        ours = ops.bf16_gemm_with(x, ops.bf16_gemm_pack(w), None, n, kernel)
        theirs = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, None), None,
                                                    "none", [None], "")
        assert (ours != theirs).float().mean().item() < 0.01
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kernel", KERNELS)
def test_non_finite_inputs_propagate(ops, kernel):
    """A NaN or inf in x reaches every output it multiplies (no masking, no saturation), and
    no further: the padding past K (8 -> 32) never reads another row's NaN."""
    w = torch.ones(64, 8).bfloat16()
    x = torch.zeros(3, 8).bfloat16()
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    y = ops.bf16_gemm_with(x, ops.bf16_gemm_pack(w), None, 64, kernel)
    assert bool(y[0].isnan().all()) and bool((y[1] == float("inf")).all()) and bool((y[2] == 0).all())


def test_default_kernel_and_names(ops):
    """bf16_gemm runs the first kernel of bf16_gemm_kernels (AMX where there is AMX), bit for
    bit; an unknown name is an error."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(200, 80, generator=g).bfloat16()
    x = torch.randn(9, 80, generator=g).bfloat16()
    packed = ops.bf16_gemm_pack(w)
    assert packed.shape == (4, 48, 64, 2)  # 80 in K -> 40 pairs -> padded to 48 (3 AMX blocks)
    assert torch.equal(ops.bf16_gemm(x, packed, None, 200), ops.bf16_gemm_with(x, packed, None, 200, KERNELS[0]))
    with pytest.raises(RuntimeError, match="unknown kernel"):
        ops.bf16_gemm_with(x, packed, None, 200, "sse")


def test_strided_rows_and_checks(ops):
    w = torch.randn(70, 40).bfloat16()
    packed = ops.bf16_gemm_pack(w)
    wide = torch.randn(5, 100).bfloat16()
    x = wide[:, 10:50]  # rows of 40 with a stride of 100
    torch.testing.assert_close(ops.bf16_gemm(x, packed, None, 70), ops.bf16_gemm(x.contiguous(), packed, None, 70),
                               rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="do not fit"):  # K 72 needs 48 pairs; 40 was padded to 32
        ops.bf16_gemm(torch.randn(2, 72).bfloat16(), packed, None, 70)
    with pytest.raises(RuntimeError, match="do not fit"):
        ops.bf16_gemm(torch.randn(2, 40).bfloat16(), packed, None, 129)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.bf16_gemm(torch.randn(2, 40), packed, None, 70)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_rows_result_does_not_depend_on_its_batch(ops, kernel):
    """Each row's outputs are its bits alone, whichever row tile and pass of the panel it lands
    in (vdpbf16ps: 7-row tiles, the first streaming the panel and the others reading it from L2;
    a batch past a row chunk of 96): a decode's tokens do not depend on its batch's size."""
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(200, 576, generator=g) * 0.2).bfloat16()
    b = torch.randn(200, generator=g)
    packed = ops.bf16_gemm_pack(w)
    x = torch.randn(100, 576, generator=g).bfloat16()
    alone = torch.cat([ops.bf16_gemm_with(x[i:i + 1], packed, b, 200, kernel) for i in range(100)])
    for m in (2, 6, 7, 8, 13, 14, 15, 97, 100):
        assert torch.equal(ops.bf16_gemm_with(x[:m], packed, b, 200, kernel), alone[:m]), m
