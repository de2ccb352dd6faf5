"""paged_prefill_attention's two kernels against their torch reference: engine/ops/attention.py's
SDPA over the gathered K/V (what prefill ran before), and a float64 softmax over the same inputs.
`amx`: csrc/cpu/cpu_prefill_attention_amx.cpp, bf16, skipped where the CPU has no AMX-BF16.
`vector`: csrc/cpu/cpu_prefill_attention.cpp's AVX-512F tiles, float32 and bf16, with the AMX path
turned off (cpu_attention_amx(False)) so AMX machines run them too; skipped without AVX-512F."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from engine.ops.attention import attend, gather_kv


@pytest.fixture
def amx(kvsentry_ops):
    if not kvsentry_ops.cpu_attention_amx(True):
        pytest.skip("no AMX-BF16 here: prefill attention runs through SDPA")
    return kvsentry_ops


@pytest.fixture
def vector(kvsentry_ops):
    if not re.search(r"\bavx512f\b", Path("/proc/cpuinfo").read_text()):
        pytest.skip("no AVX-512F here: prefill runs as one-query rows")
    kvsentry_ops.cpu_attention_amx(False)
    yield kvsentry_ops
    kvsentry_ops.cpu_attention_amx(True)


@pytest.fixture(params=["amx", "vector-bf16", "vector-bf16-widened", "vector-float32"])
def kernel(request):
    """(the ops with that kernel chosen, the dtype it runs). `vector-bf16` multiplies with
    AVX512-BF16 dot products where the CPU has them (skipped where not: it would rerun the
    widened path); `vector-bf16-widened` turns them off, widening bf16 to float32 FMAs."""
    name = request.param
    ops = request.getfixturevalue("amx" if name == "amx" else "vector")
    if name.startswith("vector-bf16"):
        dot = name == "vector-bf16"
        if ops.cpu_bf16_dot(dot) != dot:
            pytest.skip("no AVX512-BF16 on this CPU (or an AVX2 build): the bf16 dot products cannot run here")
        request.addfinalizer(lambda: ops.cpu_bf16_dot(True))
    return ops, torch.float32 if name.endswith("float32") else torch.bfloat16


def paged(num_blocks: int, block_size: int, kv_heads: int, dim: int, generator: torch.Generator,
          dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[num_blocks, block_size, Hkv, dim] in the CPU cache's head-major storage."""
    return torch.randn(kv_heads, num_blocks, block_size, dim, generator=generator).to(dtype).permute(1, 2, 0, 3)


def layout(lens: list[int], news: list[int], block_size: int, num_blocks: int, generator: torch.Generator):
    starts = [0]
    for n in news:
        starts.append(starts[-1] + n)
    width = max(-(-n // block_size) for n in lens)
    tables = torch.zeros(len(lens), width + 1, dtype=torch.int32)  # a spare column: tables may be wider
    free = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()  # never the null block
    for i, n in enumerate(lens):
        for j in range(-(-n // block_size)):
            tables[i, j] = free.pop()
    return starts, tables


def sdpa_reference(query, key_cache, value_cache, tables, lens, starts, scale):
    out = torch.zeros(query.shape[0], query.shape[1], value_cache.shape[-1], dtype=query.dtype)
    for i, n in enumerate(lens):
        first, last = starts[i], starts[i + 1]
        num_read = -(-n // key_cache.shape[1])
        k = gather_kv(key_cache, tables[i:i + 1, :num_read]).transpose(1, 2)[:, :, :n]
        v = gather_kv(value_cache, tables[i:i + 1, :num_read]).transpose(1, 2)[:, :, :n]
        q = query[first:last].transpose(0, 1).unsqueeze(0)
        allowed = None
        if last - first != n:
            positions = torch.arange(n - (last - first), n)
            allowed = (torch.arange(n)[None, :] <= positions[:, None]).view(1, 1, last - first, n)
        out[first:last] = attend(q, k, v, allowed, scale)[0].transpose(0, 1)
    return out


def float64_reference(query, key_cache, value_cache, tables, lens, starts, scale):
    out = torch.zeros(query.shape[0], query.shape[1], value_cache.shape[-1], dtype=torch.float64)
    group = query.shape[1] // key_cache.shape[2]
    for i, n in enumerate(lens):
        first, last = starts[i], starts[i + 1]
        num_read = -(-n // key_cache.shape[1])
        k = gather_kv(key_cache, tables[i:i + 1, :num_read])[0, :n].double()  # [n, Hkv, D]
        v = gather_kv(value_cache, tables[i:i + 1, :num_read])[0, :n].double()
        q = query[first:last].double()  # [new, Hq, D]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("thd,khd->htk", q, k) * scale
        positions = torch.arange(n - (last - first), n)
        scores = scores.masked_fill(torch.arange(n)[None, None, :] > positions[None, :, None], float("-inf"))
        out[first:last] = torch.einsum("htk,khd->thd", torch.softmax(scores, -1), v)
    return out


@pytest.mark.parametrize("heads, head_dim, v_dim, block_size, lens, news", [
    ((9, 3), 64, 64, 16, [37, 100, 5, 64, 129], [37, 20, 5, 64, 1]),    # the default model; a cached prefix, a decode-like row
    ((32, 8), 128, 128, 32, [300, 47], [300, 47]),                        # Llama-8B-like: 4 query tiles of dims
    ((8, 1), 32, 32, 16, [16, 17, 33], [16, 1, 30]),                       # tile edges, 8 heads on one KV head
    ((4, 2), 96, 64, 64, [200, 70], [130, 70]),                            # v_dim != head_dim, big blocks
    ((6, 6), 64, 32, 16, [48], [48]),                                      # MHA, v_dim 32
])
def test_matches_sdpa_and_the_float64_softmax(kernel, heads, head_dim, v_dim, block_size, lens, news):
    ops, dtype = kernel
    generator = torch.Generator().manual_seed(sum(lens))
    num_heads, kv_heads = heads
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    key_cache = paged(num_blocks, block_size, kv_heads, head_dim, generator, dtype)
    value_cache = paged(num_blocks, block_size, kv_heads, v_dim, generator, dtype)
    starts, tables = layout(lens, news, block_size, num_blocks, generator)
    query = torch.randn(starts[-1], num_heads, head_dim, generator=generator).to(dtype)
    scale = head_dim ** -0.5
    out = torch.full((starts[-1], num_heads, v_dim), float("nan"), dtype=dtype)
    ops.paged_prefill_attention(out, query, key_cache, value_cache, tables, lens, starts, scale)
    exact = float64_reference(query, key_cache, value_cache, tables, lens, starts, scale)
    sdpa = sdpa_reference(query, key_cache, value_cache, tables, lens, starts, scale)
    kernel_error = (out.double() - exact).abs().max().item()
    sdpa_error = (sdpa.double() - exact).abs().max().item()
    if dtype == torch.bfloat16:
        # bf16 output rounding (2^-8 relative) and bf16 probabilities, as SDPA's own error.
        assert kernel_error <= max(2 * sdpa_error, 2e-2), (kernel_error, sdpa_error)
        assert (out.float() - sdpa.float()).abs().max().item() <= 3e-2
    else:  # float32 sums in another order than SDPA: a few ulps of the outputs (|out| < ~4)
        assert kernel_error <= max(4 * sdpa_error, 2e-6), (kernel_error, sdpa_error)
        assert (out - sdpa).abs().max().item() <= 4e-6


@pytest.mark.parametrize("group", [1, 2, 3, 5, 16])
def test_every_group_size_the_lanes_take(vector, group):
    """The vector tiles put (token, head) pairs in 16 lanes, 16 // group tokens a tile: group
    sizes that leave lanes over, one token a tile, and ragged last tiles."""
    generator = torch.Generator().manual_seed(group)
    lens, news = [41, 19], [41, 7]
    key_cache = paged(12, 16, 2, 32, generator, torch.float32)
    value_cache = paged(12, 16, 2, 48, generator, torch.float32)
    starts, tables = layout(lens, news, 16, 12, generator)
    query = torch.randn(starts[-1], 2 * group, 32, generator=generator)
    out = torch.full((starts[-1], 2 * group, 48), float("nan"))
    vector.paged_prefill_attention(out, query, key_cache, value_cache, tables, lens, starts, 0.2)
    exact = float64_reference(query, key_cache, value_cache, tables, lens, starts, 0.2)
    sdpa = sdpa_reference(query, key_cache, value_cache, tables, lens, starts, 0.2)
    kernel_error = (out.double() - exact).abs().max().item()
    assert kernel_error <= max(4 * (sdpa.double() - exact).abs().max().item(), 4e-6), kernel_error


def test_a_nan_past_the_length_is_never_read_and_one_a_token_sees_spreads(kernel):
    ops, dtype = kernel
    generator = torch.Generator().manual_seed(7)
    key_cache = paged(8, 16, 1, 64, generator, dtype)
    value_cache = paged(8, 16, 1, 64, generator, dtype)
    tables = torch.tensor([[3, 5]], dtype=torch.int32)
    query = torch.randn(20, 2, 64, generator=generator).to(dtype)
    out = torch.zeros(20, 2, 64, dtype=dtype)
    # Positions 20.. of block 5 (rows 4..) lie past the length of 20: stale values, never read.
    value_cache[5, 8, 0, 0] = float("nan")
    key_cache[5, 15, 0, 3] = float("inf")
    ops.paged_prefill_attention(out, query, key_cache, value_cache, tables, [20], [0, 20], 0.125)
    assert bool(torch.isfinite(out).all())
    # Position 10 (block 3, row 10): every token from 10 on sees it. (Tokens before it may too:
    # a causally masked key in a token's tile is multiplied by probability 0, and
    # 0 x NaN = NaN, as in SDPA's own tiles.)
    value_cache[3, 10, 0, 7] = float("nan")
    ops.paged_prefill_attention(out, query, key_cache, value_cache, tables, [20], [0, 20], 0.125)
    assert bool(torch.isnan(out[10:]).any(-1).all())


def test_a_nan_no_lane_of_a_tile_sees_stays_out_of_it(kernel, request):
    """Three query heads on one KV head: 16 // 3 = 5 tokens a vector tile, so the first tile
    sees keys 0-4, an odd count. A NaN at position 5 reaches tokens 5 on and none of 0-4: the
    bf16 dot products multiply keys in pairs, and the pair (4, 5) must leave key 5 out. (The AMX
    kernel's 16-key tiles multiply causally masked keys by 0, as SDPA's do: not asked of it.)"""
    ops, dtype = kernel
    if request.node.callspec.params["kernel"] == "amx":
        pytest.skip("the AMX kernel multiplies masked keys of its tiles by 0 (0 x NaN = NaN), as SDPA does")
    generator = torch.Generator().manual_seed(11)
    key_cache = paged(4, 16, 1, 64, generator, dtype)
    value_cache = paged(4, 16, 1, 64, generator, dtype)
    tables = torch.tensor([[2]], dtype=torch.int32)
    query = torch.randn(12, 3, 64, generator=generator).to(dtype)
    out = torch.zeros(12, 3, 64, dtype=dtype)
    value_cache[2, 5, 0, 9] = float("nan")
    ops.paged_prefill_attention(out, query, key_cache, value_cache, tables, [12], [0, 12], 0.125)
    assert bool(torch.isfinite(out[:5]).all())
    assert bool(torch.isnan(out[5:]).any(-1).all())


def test_checks(kvsentry_ops):
    cache = torch.zeros(4, 16, 1, 64, dtype=torch.bfloat16)
    query = torch.zeros(8, 1, 64, dtype=torch.bfloat16)
    out = torch.zeros(8, 1, 64, dtype=torch.bfloat16)
    tables = torch.tensor([[1]], dtype=torch.int32)
    fits = kvsentry_ops.paged_prefill_attention_fits(query, cache, cache)
    if not fits:
        pytest.skip("neither kernel runs on this CPU")
    with pytest.raises(RuntimeError, match="more new tokens than its length"):
        kvsentry_ops.paged_prefill_attention(out, query, cache, cache, tables, [4], [0, 8], 1.0)
    with pytest.raises(RuntimeError, match="past its block table"):
        kvsentry_ops.paged_prefill_attention(out, query, cache, cache, tables, [17], [0, 8], 1.0)
    with pytest.raises(RuntimeError, match=r"entries must lie in \[0, 4\)"):
        kvsentry_ops.paged_prefill_attention(out, query, cache, cache, torch.tensor([[9]], dtype=torch.int32),
                                             [8], [0, 8], 1.0)
    with pytest.raises(RuntimeError, match="needs AVX-512F"):
        kvsentry_ops.paged_prefill_attention(out.half(), query.half(), cache.half(), cache.half(), tables, [8],
                                             [0, 8], 1.0)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kvsentry_ops.paged_prefill_attention(out.float(), query, cache, cache, tables, [8], [0, 8], 1.0)
    assert not kvsentry_ops.paged_prefill_attention_fits(query[..., :40], cache[..., :40], cache[..., :40])
    assert not kvsentry_ops.paged_prefill_attention_fits(query.float(), cache, cache)
