"""The CPU fast paths against their plain torch references: the oneDNN-packed linear
(engine/models/cpu_gemm.py) and the blocked row argmax (engine/worker/sampler.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from engine.ops import registry
from engine.models.cpu_gemm import PackedLinear, fused_linear
from engine.models.layers import Linear
from engine.worker.sampler import row_argmax


@pytest.mark.parametrize("tokens", [0, 1, 7, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_float32(tokens, bias):
    gen = torch.Generator().manual_seed(tokens)
    weight = torch.randn(96, 64, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(tokens, 64, generator=gen)
    packed = PackedLinear(weight, b)
    assert packed.onednn == torch.backends.mkldnn.is_available()  # the oneDNN path is the one under test
    out = packed(x)
    assert out.shape == (tokens, 96)
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_packed_linear_bfloat16_and_non_contiguous_input():
    weight = torch.randn(48, 32).bfloat16()
    x = torch.randn(5, 64).bfloat16()[:, ::2]  # strided rows
    out = PackedLinear(weight)(x)
    torch.testing.assert_close(out.float(), F.linear(x, weight).float(), rtol=2e-2, atol=2e-2)


def test_fallback_without_onednn_matches(monkeypatch):
    monkeypatch.setattr("engine.models.cpu_gemm.onednn_supports", lambda w: False)
    weight, bias, x = torch.randn(10, 6), torch.randn(10), torch.randn(2, 3, 6)
    packed = PackedLinear(weight, bias)
    assert not packed.onednn
    torch.testing.assert_close(packed(x), F.linear(x, weight, bias))


def test_fused_linear_is_the_concatenation():
    q, k = Linear(16, 8, bias=True), Linear(16, 4, bias=False)
    x = torch.randn(3, 16)
    expect = torch.cat([q(x), k(x)], dim=-1)
    torch.testing.assert_close(fused_linear(q, k)(x), expect, rtol=1e-5, atol=1e-5)


def test_linear_pack_drops_the_plain_weight_unless_kept():
    layer, kept = Linear(8, 4, bias=False), Linear(8, 4, bias=False, keep_weight=True)
    x = torch.randn(2, 8)
    before, before_kept = layer(x), kept(x)
    layer.pack()
    kept.pack()
    assert layer.weight.numel() == 0 and kept.weight.shape == (4, 8)
    torch.testing.assert_close(layer(x), before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kept(x), before_kept, rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 5), vocab=st.sampled_from([1, 7, 255, 256, 257, 512, 1000, 32000]),
       ties=st.booleans(), nans=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_row_argmax_equals_torch_argmax(rows, vocab, ties, nans, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen)
    if ties:  # coarse values: many exact ties, the first index must win
        logits = (logits * 2).round()
    for _ in range(nans):
        if rows:
            r, c = (int(torch.randint(n, (1,), generator=gen)) for n in (rows, vocab))
            logits[r, c] = float("nan")
    assert torch.equal(row_argmax(logits), logits.argmax(dim=-1))


def test_row_argmax_all_masked_row():
    logits = torch.full((2, 600), float("-inf"))
    logits[1, 599] = 0.0
    assert row_argmax(logits).tolist() == logits.argmax(dim=-1).tolist() == [0, 599]


def _panels_and_onednn() -> bool:
    from engine.models import cpu_gemm
    weight = torch.zeros(64, 32, dtype=torch.bfloat16)
    return cpu_gemm.panels_supported(weight) and cpu_gemm.onednn_supports(weight)


def test_bf16_linear_with_both_copies_picks_by_rows(monkeypatch):
    """Panels up to panel_max_rows rows, oneDNN's weight beyond: each bit for bit what that
    kernel computes alone, both near F.linear. The limit is set here (AMX CPUs set
    cpu_gemm.AMX_PANEL_MAX_ROWS) so that the policy runs on any CPU with the panels."""
    from engine.models import cpu_gemm
    if not _panels_and_onednn():
        pytest.skip("no bf16 panels or no oneDNN bf16 here: a linear holds one copy")
    monkeypatch.setattr(cpu_gemm, "panel_max_rows", lambda dtype, quantized=False: 8)
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(96, 80, generator=gen) * 0.2).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    packed = PackedLinear(weight, bias)
    assert packed.onednn and packed.panels is not None and packed.panel_max_rows == 8
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    for rows in (1, 8, 9, 40):
        x = torch.randn(rows, 80, generator=gen).bfloat16()
        out = packed(x)
        if rows <= 8:
            assert packed.uses_panels(rows)
            assert torch.equal(out, registry.op("bf16_gemm")(x, packed.panels, bias, 96))
        else:
            assert not packed.uses_panels(rows)
            assert torch.equal(out, torch.ops.mkldnn._linear_pointwise(x, onednn, bias, "none", [None], ""))
        torch.testing.assert_close(out.float(), F.linear(x, weight, bias).float(), rtol=2e-2, atol=2e-2)


def test_panel_copies_follow_the_cpu_and_the_switch(monkeypatch):
    """AMX CPUs keep both copies (panels up to AMX_PANEL_MAX_ROWS rows) unless
    KVSENTRY_DISABLE_AMX_PANELS=1 (oneDNN alone); other CPUs with the panels keep them alone."""
    from engine.models import cpu_gemm
    if not _panels_and_onednn():
        pytest.skip("no bf16 panels or no oneDNN bf16 here")
    weight = torch.randn(64, 32).bfloat16()
    amx = "amx" in registry.op("bf16_gemm_kernels")()
    packed = PackedLinear(weight)
    if amx:
        assert packed.panels is not None and packed.onednn and packed.panel_max_rows == cpu_gemm.AMX_PANEL_MAX_ROWS
        monkeypatch.setenv("KVSENTRY_DISABLE_AMX_PANELS", "1")
        alone = PackedLinear(weight)
        assert alone.panels is None and alone.onednn
    else:
        assert packed.panels is not None and not packed.onednn and packed.panel_max_rows is None
        assert packed.uses_panels(4096)


def test_float32_linear_keeps_both_copies_and_picks_by_rows(monkeypatch):
    """float32 on CPUs with AVX-512F: panels (csrc/cpu/cpu_f32_gemm.cpp) up to F32_PANEL_MAX_ROWS
    rows, oneDNN's weight beyond, each bit for bit what that kernel computes alone and both
    near F.linear; KVSENTRY_DISABLE_F32_PANELS=1 keeps oneDNN's weight alone."""
    from engine.models import cpu_gemm
    weight = torch.zeros(64, 32)
    if not (cpu_gemm.panels_supported(weight) and cpu_gemm.onednn_supports(weight)):
        pytest.skip("no float32 panels (AVX-512F) or no oneDNN here: a linear holds one copy")
    limit = cpu_gemm.F32_PANEL_MAX_ROWS
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(96, 80, generator=gen) * 0.2
    bias = torch.randn(96, generator=gen)
    packed = PackedLinear(weight, bias)
    assert packed.onednn and packed.panels is not None and packed.panel_max_rows == limit
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    for rows in (1, 5, limit, limit + 1, 200):
        x = torch.randn(rows, 80, generator=gen)
        out = packed(x)
        if rows <= limit:
            assert packed.uses_panels(rows)
            assert torch.equal(out, registry.op("f32_gemm")(x, packed.panels, bias, 96))
        else:
            assert not packed.uses_panels(rows)
            assert torch.equal(out, torch.ops.mkldnn._linear_pointwise(x, onednn, bias, "none", [None], ""))
        torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("KVSENTRY_DISABLE_F32_PANELS", "1")
    alone = PackedLinear(weight, bias)
    assert alone.panels is None and alone.onednn and not alone.uses_panels(1)
