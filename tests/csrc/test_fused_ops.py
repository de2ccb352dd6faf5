"""csrc/cpu/cpu_fused_ops.cpp (RMSNorm, residual add + RMSNorm, rotary embedding, SiLU-and-multiply)
against the torch references of engine/ops/fused_ops.py, bit for bit in float32 and bfloat16;
and the dispatch that picks them."""
from __future__ import annotations

import pytest
import torch

from engine.ops import fused_ops
from engine.ops.fused_ops import rms_norm_reference, rotary_reference, silu_and_mul_reference

DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# Rows narrower than a vector (8, 12) are summed by at::sum in 256-row passes: 300 rows span
# two. Wider ones take the replica of torch's sum, a row at a time.
@pytest.mark.parametrize("rows,size", [(1, 576), (7, 576), (32, 576), (3, 64), (5, 17), (0, 576), (600, 576),
                                       (257, 17), (3, 8), (300, 12)])
def test_rms_norm_matches_reference_bitwise(kvsentry_ops, dtype, rows, size):
    for seed in range(3):
        x = randn(rows, size, dtype=dtype, seed=seed, scale=[1.0, 30.0, 1e-3][seed])
        weight = randn(size, dtype=dtype, seed=100 + seed) + 1
        for eps in (1e-5, 1e-6):
            got = kvsentry_ops.rms_norm(x, weight, eps)
            assert got.dtype == dtype and got.shape == x.shape
            assert torch.equal(got, rms_norm_reference(x, weight, eps))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,size", [(1, 576), (9, 576), (32, 576), (4, 40), (600, 576), (257, 40), (300, 12)])
def test_add_rms_norm_matches_reference_bitwise(kvsentry_ops, dtype, rows, size):
    x = randn(rows, size, dtype=dtype, seed=1, scale=4.0)
    residual = randn(rows, size, dtype=dtype, seed=2, scale=20.0)
    weight = randn(size, dtype=dtype, seed=3)
    out, hidden = kvsentry_ops.add_rms_norm(x, residual, weight, 1e-5)
    want_hidden = residual + x
    assert torch.equal(hidden, want_hidden)
    assert torch.equal(out, rms_norm_reference(want_hidden, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# Widths past one vector (16 or 8 lanes) take the kernel's replica of torch's row sum: 1043 and
# 4149 flush its cascade of levels and end in vectors past the last four and a scalar tail.
@pytest.mark.parametrize("size", [16, 100, 576, 1043, 4149, 8192])
def test_rms_norm_sums_squares_in_torchs_order(kvsentry_ops, dtype, size):
    """Squares spread over twelve orders of magnitude, so that another summation order would
    round the mean differently (checked below for a plain sequential float32 sum): the norm must
    still equal the reference bit for bit."""
    if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX2"):
        # torch sums with 16- or 8-lane vectors there: the norm must take its replica, not at::sum.
        assert kvsentry_ops.norm_sum_lanes(size) in (16, 8)
    g = torch.Generator().manual_seed(size)
    x = (torch.randn(8, size, generator=g) * 10.0 ** torch.randint(-3, 4, (8, size), generator=g)).to(dtype)
    weight = randn(size, dtype=dtype, seed=7) + 1
    assert torch.equal(kvsentry_ops.rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))
    out, hidden = kvsentry_ops.add_rms_norm(x, x.flip(0), weight, 1e-6)
    assert torch.equal(out, rms_norm_reference(x.flip(0) + x, weight, 1e-6))
    if size >= 576:  # the data is order-sensitive: a sequential float32 sum differs from torch's
        squares = x.float().pow(2)
        sequential = torch.zeros(8)
        for j in range(size):
            sequential += squares[:, j]
        assert not torch.equal(sequential, squares.sum(-1))


def rope_tables(positions: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * 1.25, emb.sin() * 1.25  # a yarn-like attention scaling, applied in float32


@pytest.mark.parametrize("dtype,table_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                               (torch.bfloat16, torch.bfloat16)], ids=str)
@pytest.mark.parametrize("tokens", [1, 5, 32])
@pytest.mark.parametrize("dim", [64, 40])
def test_rotary_matches_reference_bitwise_on_strided_views(kvsentry_ops, dtype, table_dtype, tokens, dim):
    """The model's tables are in its dtype (model.to(dtype) converts buffers); float32 ones also work.
    dim 40: a 16-lane vector and a scalar tail per half."""
    heads, kv_heads = 9, 3
    cos, sin = (t.to(table_dtype) for t in rope_tables(1024, dim))
    qkv = randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=tokens, scale=3.0)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.reshape(tokens, heads, dim), k.reshape(tokens, kv_heads, dim)  # views, as the model has them
    positions = torch.randint(0, 1024, (tokens,), generator=torch.Generator().manual_seed(7))
    got_q, got_k = kvsentry_ops.rotary(q, k, cos, sin, positions)
    want_q, want_k = rotary_reference(q, k, cos, sin, positions)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def assert_silu_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit (torch's own silu), NaNs compared by position: torch's vectorised bf16
    conversion stores a NaN as 0xFFFF, the kernel's narrowing as 0x7FC0."""
    assert torch.equal(got.isnan(), want.isnan())
    got, want = got.nan_to_num(7.0, 7.0, -7.0), want.nan_to_num(7.0, 7.0, -7.0)
    int_view = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got.view(int_view), want.view(int_view))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (32, 1536), (3, 20), (0, 8), (300, 1536)])
def test_silu_and_mul_matches_reference_bitwise(kvsentry_ops, dtype, rows, inter):
    gate_up = randn(rows, 2 * inter, dtype=dtype, seed=rows, scale=4.0)
    got = kvsentry_ops.silu_and_mul(gate_up)
    assert got.shape == (rows, inter) and got.is_contiguous()
    assert_silu_matches(got, silu_and_mul_reference(gate_up))
    wide = randn(rows, 2 * inter + 6, dtype=dtype, seed=9)[:, 3:3 + 2 * inter]  # a strided view
    assert_silu_matches(kvsentry_ops.silu_and_mul(wide), silu_and_mul_reference(wide))


@pytest.fixture(params=[True, False], ids=["table", "computed"])
def silu_path(request, kvsentry_ops):
    """The bf16 SiLU from its table (the gather Intel cores take) or computed (AMD's), whichever
    this CPU would pick; the CPU's choice again after."""
    if kvsentry_ops.silu_table(request.param) != request.param:
        pytest.skip("this build has no AVX-512 SiLU: the scalar formula runs")
    yield request.param
    kvsentry_ops.silu_table(None)


def test_silu_and_mul_every_bf16_gate(kvsentry_ops, silu_path):
    """All 65,536 bf16 gate values, in the vector body and (5 per row) the scalar tail, on
    either of the vector body's SiLUs: the kernel's SiLU is torch's formula with torch's exp, so
    nothing may differ, not one bit."""
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    for width in (128, 69):  # 69 = one 64-wide vector chunk + a 5-element scalar tail
        rows = -(-gate.numel() // width)
        g = torch.cat([gate, gate[:rows * width - gate.numel()]]).view(rows, width)
        up = randn(rows, width, dtype=torch.bfloat16, seed=width, scale=3.0)
        gate_up = torch.cat([g, up], dim=1)
        assert_silu_matches(kvsentry_ops.silu_and_mul(gate_up), silu_and_mul_reference(gate_up))


SPECIAL = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 3.0e38, -3.0e38, 1e-40, -100.0, 100.0, 88.5, -88.5]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values(kvsentry_ops, dtype):
    """NaN, infinities, signed zeros, the float range's ends and denormals, in the vector lanes
    and the scalar tails: bit for bit (a NaN's bits aside)."""
    values = torch.tensor(SPECIAL * 8)[torch.randperm(len(SPECIAL) * 8, generator=torch.Generator().manual_seed(1))]
    x = randn(4, 40, dtype=torch.float32, seed=4)
    x.view(-1)[::2] = values[:80]
    x = x.to(dtype)
    weight = randn(40, dtype=dtype, seed=5)
    assert torch.equal(kvsentry_ops.rms_norm(x, weight, 1e-6).view(-1).float().nan_to_num(7.0),
                       rms_norm_reference(x, weight, 1e-6).view(-1).float().nan_to_num(7.0))
    out, hidden = kvsentry_ops.add_rms_norm(x, x.flip(0), weight, 1e-6)
    assert torch.equal(hidden.float().nan_to_num(7.0), (x.flip(0) + x).float().nan_to_num(7.0))
    assert torch.equal(out.float().nan_to_num(7.0), rms_norm_reference(x.flip(0) + x, weight, 1e-6).float().nan_to_num(7.0))
    gate_up = x.reshape(2, 80)
    assert_silu_matches(kvsentry_ops.silu_and_mul(gate_up), silu_and_mul_reference(gate_up))
    cos, sin = rope_tables(64, 40)
    q, k = x.reshape(4, 1, 40), x.flip(0).reshape(4, 1, 40)
    positions = torch.tensor([0, 5, 63, 17])
    for got, want in zip(kvsentry_ops.rotary(q, k, cos.to(dtype), sin.to(dtype), positions),
                         rotary_reference(q, k, cos.to(dtype), sin.to(dtype), positions)):
        int_view = torch.int16 if dtype == torch.bfloat16 else torch.int32
        same = (got.view(int_view) == want.view(int_view)) | (got.isnan() & want.isnan())
        assert same.all()


def test_rotary_rejects_out_of_range_positions(kvsentry_ops):
    cos, sin = rope_tables(16, 8)
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        kvsentry_ops.rotary(q, k, cos, sin, torch.tensor([3, 16]))


def test_meta_shapes(kvsentry_ops):
    x = torch.empty(4, 32, device="meta")
    out, hidden = kvsentry_ops.add_rms_norm(x, x, torch.empty(32, device="meta"), 1e-6)
    assert out.shape == hidden.shape == (4, 32)
    q, k = kvsentry_ops.rotary(torch.empty(4, 3, 8, device="meta"), torch.empty(4, 1, 8, device="meta"),
                               torch.empty(16, 8, device="meta"), torch.empty(16, 8, device="meta"),
                               torch.empty(4, dtype=torch.int64, device="meta"))
    assert q.shape == (4, 3, 8) and k.shape == (4, 1, 8)


def counting_kernels(monkeypatch) -> list[str]:
    """Count the fused kernels' calls through engine/ops/fused_ops.py (by op name)."""
    from types import SimpleNamespace
    calls: list[str] = []
    real = fused_ops._ops()

    def counted(name):
        return lambda *args: (calls.append(name), getattr(real, name)(*args))[1]
    monkeypatch.setattr(fused_ops, "_ops", lambda: SimpleNamespace(**{n: counted(n) for n in vars(real)}))
    return calls


@pytest.mark.parametrize("disabled", [False, True])
def test_dispatch_runs_the_kernels_and_matches_the_references(kvsentry_ops, monkeypatch, disabled):
    """The wrappers call the kernels for CPU bf16 tensors under inference mode, and give the
    references' bits (computed here, apart from the wrappers); with KVSENTRY_DISABLE_CPU_OPS=1
    they call none of them."""
    calls = counting_kernels(monkeypatch)
    if disabled:
        monkeypatch.setenv("KVSENTRY_DISABLE_CPU_OPS", "1")
    x, residual = randn(3, 64, dtype=torch.bfloat16, seed=5), randn(3, 64, dtype=torch.bfloat16, seed=6)
    weight = randn(64, dtype=torch.bfloat16, seed=8)
    cos, sin = rope_tables(8, 64)
    positions = torch.tensor([0, 5, 7])
    with torch.inference_mode():
        out, hidden = fused_ops.add_rms_norm(x, residual, weight, 1e-6)
        normed = fused_ops.rms_norm(x, weight, 1e-6)
        q, k = fused_ops.rotary(x.view(3, 1, 64), residual.view(3, 1, 64), cos, sin, positions)
        gated = fused_ops.silu_and_mul(torch.cat([x, residual], dim=-1))
    assert calls == ([] if disabled else ["add_rms_norm", "rms_norm", "rotary", "silu_and_mul"])
    assert torch.equal(q, rotary_reference(x.view(3, 1, 64), residual.view(3, 1, 64), cos, sin, positions)[0])
    assert torch.equal(hidden, residual + x)
    assert torch.equal(out, rms_norm_reference(residual + x, weight, 1e-6))
    assert torch.equal(normed, rms_norm_reference(x, weight, 1e-6))
    assert_silu_matches(gated, silu_and_mul_reference(torch.cat([x, residual], dim=-1)))


def test_calls_the_kernels_do_not_take_run_the_reference(kvsentry_ops, monkeypatch):
    calls = counting_kernels(monkeypatch)
    x, weight = randn(3, 64, dtype=torch.bfloat16, seed=5), randn(64, dtype=torch.bfloat16, seed=8)
    # Non-contiguous input, another weight dtype, autograd: the reference runs.
    strided = x.float().t().contiguous().t()
    assert torch.equal(fused_ops.rms_norm(strided, weight, 1e-6), rms_norm_reference(strided, weight, 1e-6))
    w = weight.float().requires_grad_()
    assert fused_ops.rms_norm(x.float(), w, 1e-6).requires_grad
    assert calls == []
