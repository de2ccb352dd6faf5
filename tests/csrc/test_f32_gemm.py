"""csrc/cpu/cpu_f32_gemm.cpp (the f32_gemm op) against a float64 reference and
against oneDNN, on CPUs with AVX-512F (skipped elsewhere: the engine keeps oneDNN there).

The reference: x @ w^T + b in float64 over the float32 inputs, which a float32 dot product
summed by fused multiply-adds must meet within its own rounding (K ulps of the largest
partial sum, plus the bias's addition). Needs the ops built (`kvsentry_ops`)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def ops(kvsentry_ops):
    if not kvsentry_ops.f32_gemm_supported():
        pytest.skip("no AVX-512F on this CPU: the engine uses oneDNN for every float32 linear")
    return kvsentry_ops


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out + b.double() if b is not None else out


def bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """float32 summation error bound per output: (K + 1) * eps32 * (sum |x_k w_k| + |b|)."""
    k = x.shape[1]
    mag = x.double().abs() @ w.double().abs().T
    if b is not None:
        mag = mag + b.double().abs()
    return (k + 1) * 2.0 ** -24 * mag + 1e-37


# Every row tile (1..6 rows and several), partial panels (N not a multiple of 64), odd K,
# M past a row chunk (96), the default model's shapes, empty M; one row over groups of four
# panels with a partial last panel inside a group (250) or after the groups (520).
SHAPES = [(1, 960, 576), (1, 250, 7), (1, 520, 33), (2, 576, 576), (3, 3072, 576), (4, 576, 1536), (5, 100, 33), (6, 64, 64),
          (7, 130, 17), (13, 1536, 96), (64, 576, 1536), (97, 70, 600), (200, 49, 1), (0, 64, 64)]


@pytest.mark.parametrize("m,n,k", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_matches_float64_within_float32_summation(ops, m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g) * 0.2
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    packed = ops.f32_gemm_pack(w)
    assert packed.shape == ((n + 63) // 64, k, 64)
    y = ops.f32_gemm(x, packed, b, n)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert bool(((y.double() - reference(x, w, b)).abs() <= bound(x, w, b)).all())


def test_agrees_with_onednn_on_the_default_models_shapes(ops):
    """oneDNN sums the same float32 products in another order: on the default model's layer
    shapes the two agree to a few float32 ulps of the outputs' scale."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch")
    g = torch.Generator().manual_seed(0)
    for m, n, k in [(1, 960, 576), (8, 3072, 576), (32, 576, 1536), (64, 960, 576)]:
        w = torch.randn(n, k, generator=g) * 0.1
        x = torch.randn(m, k, generator=g)
        ours = ops.f32_gemm(x, ops.f32_gemm_pack(w), None, n)
        theirs = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, None), None,
                                                    "none", [None], "")
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_non_finite_inputs_propagate(ops):
    """A NaN or inf in x reaches every output it multiplies (no masking), and no further."""
    w = torch.ones(64, 8)
    x = torch.zeros(3, 8)
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    y = ops.f32_gemm(x, ops.f32_gemm_pack(w), None, 64)
    assert bool(y[0].isnan().all()) and bool((y[1] == float("inf")).all()) and bool((y[2] == 0).all())


def test_strided_rows_and_checks(ops):
    w = torch.randn(70, 40)
    packed = ops.f32_gemm_pack(w)
    wide = torch.randn(5, 100)
    x = wide[:, 10:50]  # rows of 40 with a stride of 100
    assert torch.equal(ops.f32_gemm(x, packed, None, 70), ops.f32_gemm(x.contiguous(), packed, None, 70))
    column = torch.randn(40, 5).T  # stride 1 in M, not in K: copied first
    assert torch.equal(ops.f32_gemm(column, packed, None, 70), ops.f32_gemm(column.contiguous(), packed, None, 70))
    with pytest.raises(RuntimeError, match="do not fit"):
        ops.f32_gemm(torch.randn(2, 41), packed, None, 70)
    with pytest.raises(RuntimeError, match="do not fit"):
        ops.f32_gemm(torch.randn(2, 40), packed, None, 129)
    with pytest.raises(RuntimeError, match="float32"):
        ops.f32_gemm(torch.randn(2, 40).bfloat16(), packed, None, 70)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.f32_gemm(torch.randn(2, 40), packed, torch.randn(69), 70)
    with pytest.raises(RuntimeError, match="f32_gemm_pack"):
        ops.f32_gemm(torch.randn(2, 40), torch.randn(2, 40, 32), None, 70)
    with pytest.raises(RuntimeError, match="float32"):
        ops.f32_gemm_pack(torch.randn(4, 4).bfloat16())
