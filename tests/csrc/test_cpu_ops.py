"""The KV writer ops on CPU: the kernels' own per-token code (csrc/common/cache_kernels.cuh), run on the
host with the GPU launch plan, against the torch reference, bit for bit; plus the op checks,
the Meta (fake) implementation and torch.compile.

These need the ops built (the `kvsentry_ops` fixture, ~30 s once per session).
"""
from __future__ import annotations

import re

import pytest
import torch

from engine.paging import PAD_SLOT_ID
from engine.ops.kv_writer import write_mla_reference

from tests.csrc.cases import DTYPE_IDS, DTYPES, FP8, check_kv_write, check_mla_write, kv_case, mla_case, raw

SCALE = 0.37


# --- reshape_and_cache_flash -----------------------------------------------------------------

def kv_plan(ops, key, value, k_cache, v_cache, slots, scale=None):
    supported, fp8, width, threads = ops.plan_reshape_and_cache_flash(
        key, value, k_cache, v_cache, slots, None if scale is None else torch.tensor([scale]))
    assert supported and threads % 32 == 0 and 32 <= threads <= 512
    return bool(fp8), width


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout, cache_layout", [
    ("contiguous", "contiguous"), ("qkv_slice", "kv_interleaved"), ("qkv_slice", "head_major"),
    ("misaligned", "contiguous"),
])
def test_kv_same_dtype_bitwise(kvsentry_ops, dtype, layout, cache_layout):
    case = kv_case(dtype, dtype, layout=layout, cache_layout=cache_layout)
    fp8, width = kv_plan(kvsentry_ops, *case)
    assert not fp8 and width == (dtype.itemsize if layout == "misaligned" else 16)
    check_kv_write(kvsentry_ops.reshape_and_cache_flash, *case)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("scale", [None, SCALE], ids=["noscale", "scale"])
@pytest.mark.parametrize("layout, cache_layout", [
    ("contiguous", "contiguous"), ("qkv_slice", "head_major"), ("misaligned", "kv_interleaved"),
])
def test_kv_fp8_bitwise(kvsentry_ops, dtype, scale, layout, cache_layout):
    case = kv_case(dtype, FP8, layout=layout, cache_layout=cache_layout)
    fp8, width = kv_plan(kvsentry_ops, *case, scale=scale)
    assert fp8 and width == (1 if layout == "misaligned" else 16 // dtype.itemsize)
    check_kv_write(kvsentry_ops.reshape_and_cache_flash, *case, scale=scale)


@pytest.mark.parametrize("head_size, dtype, width", [(5, torch.float16, 2), (6, torch.float16, 4),
                                                     (3, torch.float32, 4), (12, torch.bfloat16, 8)])
def test_kv_narrow_units(kvsentry_ops, head_size, dtype, width):
    case = kv_case(dtype, dtype, head_size=head_size, num_heads=3)
    assert kv_plan(kvsentry_ops, *case) == (False, width)
    check_kv_write(kvsentry_ops.reshape_and_cache_flash, *case)


def test_kv_many_heads_loop_over_units(kvsentry_ops):
    """More units than the 512 threads a token gets: each thread takes several."""
    case = kv_case(torch.float32, torch.float32, num_heads=40, head_size=128, num_tokens=7)
    assert kv_plan(kvsentry_ops, *case) == (False, 16)
    check_kv_write(kvsentry_ops.reshape_and_cache_flash, *case)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_kv_dummy_batch_changes_no_byte(kvsentry_ops, cache_dtype):
    key, value, k_cache, v_cache, slots = kv_case(torch.bfloat16, cache_dtype)
    key.fill_(float("nan"))
    value.fill_(float("nan"))
    before_k, before_v = raw(k_cache).clone(), raw(v_cache).clone()
    counter = torch.zeros(1, dtype=torch.int64)
    kvsentry_ops.reshape_and_cache_flash(key, value, k_cache, v_cache, torch.full_like(slots, PAD_SLOT_ID), counter)
    assert torch.equal(raw(k_cache), before_k) and torch.equal(raw(v_cache), before_v)
    assert counter.item() == 0


def test_kv_zero_tokens_and_extra_rows(kvsentry_ops):
    key, value, k_cache, v_cache, slots = kv_case(torch.float16, torch.float16)
    before = raw(k_cache).clone()
    kvsentry_ops.reshape_and_cache_flash(key, value, k_cache, v_cache, slots[:0])
    assert torch.equal(raw(k_cache), before)
    # key has more rows than slot_mapping (a padded batch): only the first len(slot_mapping) rows count
    check_kv_write(kvsentry_ops.reshape_and_cache_flash, key, value, k_cache, v_cache, slots[:11])


def test_kv_out_of_range_slot_is_skipped(kvsentry_ops):
    key, value, k_cache, v_cache, _ = kv_case(torch.float32, torch.float32, num_tokens=3)
    before = raw(k_cache).clone()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    kvsentry_ops.reshape_and_cache_flash(key, value, k_cache, v_cache, torch.tensor([num_slots, 10**12, -7]))
    assert torch.equal(raw(k_cache), before)


def test_kv_null_block_counter_is_exact(kvsentry_ops):
    key, value, k_cache, v_cache, _ = kv_case(torch.float16, torch.float16, num_tokens=8, block_size=4)
    counter = torch.tensor([100], dtype=torch.int64)
    # slots 0..3 are block 0; 4 is block 1; -1 is padding
    kvsentry_ops.reshape_and_cache_flash(key, value, k_cache, v_cache,
                                         torch.tensor([3, 4, -1, 0, 1, 2, 17, -1]), counter)
    assert counter.item() == 104


# --- concat_and_cache_mla --------------------------------------------------------------------

def mla_plan(ops, kv_c, k_pe, cache, slots, scale=None):
    supported, fp8, width, threads = ops.plan_concat_and_cache_mla(
        kv_c, k_pe, cache, slots, None if scale is None else torch.tensor([scale]))
    assert supported and threads % 32 == 0 and 32 <= threads <= 512
    return bool(fp8), width


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout, cache_pad", [("split", 0), ("contiguous", 8), ("misaligned", 0)])
def test_mla_same_dtype_bitwise(kvsentry_ops, dtype, layout, cache_pad):
    case = mla_case(dtype, dtype, layout=layout, cache_pad=cache_pad)
    fp8, width = mla_plan(kvsentry_ops, *case)
    assert not fp8 and width == (dtype.itemsize if layout == "misaligned" else 16)
    check_mla_write(kvsentry_ops.concat_and_cache_mla, *case)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("scale", [None, SCALE], ids=["noscale", "scale"])
@pytest.mark.parametrize("layout", ["split", "misaligned"])
def test_mla_fp8_bitwise(kvsentry_ops, dtype, scale, layout):
    case = mla_case(dtype, FP8, layout=layout, cache_pad=16)
    fp8, width = mla_plan(kvsentry_ops, *case, scale=scale)
    assert fp8 and width == (1 if layout == "misaligned" else 16 // dtype.itemsize)
    check_mla_write(kvsentry_ops.concat_and_cache_mla, *case, scale=scale)


def test_mla_deepseek_shape_and_odd_shape(kvsentry_ops):
    case = mla_case(torch.bfloat16, torch.bfloat16, kv_lora_rank=512, rope_dim=64, num_tokens=9)
    assert mla_plan(kvsentry_ops, *case) == (False, 16)
    check_mla_write(kvsentry_ops.concat_and_cache_mla, *case)
    case = mla_case(torch.float16, torch.float16, kv_lora_rank=7, rope_dim=3)
    assert mla_plan(kvsentry_ops, *case) == (False, 2)
    check_mla_write(kvsentry_ops.concat_and_cache_mla, *case)


def test_mla_layout_is_compressed_then_rope(kvsentry_ops):
    kv_c = torch.arange(2 * 8, dtype=torch.float32).view(2, 8)
    k_pe = -1 - torch.arange(2 * 4, dtype=torch.float32).view(2, 4)
    cache = torch.zeros(2, 4, 12)
    kvsentry_ops.concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([5, 2]))
    assert torch.equal(cache.view(8, 12)[5], torch.cat([kv_c[0], k_pe[0]]))
    assert torch.equal(cache.view(8, 12)[2], torch.cat([kv_c[1], k_pe[1]]))


@pytest.mark.parametrize("cache_dtype", [torch.float16, FP8], ids=["f16", "fp8"])
def test_mla_dummy_batch_changes_no_byte(kvsentry_ops, cache_dtype):
    kv_c, k_pe, cache, slots = mla_case(torch.float16, cache_dtype)
    kv_c.fill_(float("nan"))
    before = raw(cache).clone()
    counter = torch.zeros(1, dtype=torch.int64)
    kvsentry_ops.concat_and_cache_mla(kv_c, k_pe, cache, torch.full_like(slots, PAD_SLOT_ID), counter)
    assert torch.equal(raw(cache), before) and counter.item() == 0


# --- fp8 rounding, every half / bfloat16 value ----------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("scale", [None, SCALE, 3e-3], ids=["noscale", "scale", "tinyscale"])
def test_fp8_conversion_matches_torch_on_every_value(kvsentry_ops, dtype, scale):
    """All 65536 bit patterns of half / bfloat16 (random bit patterns and edge values for float32)."""
    if dtype == torch.float32:
        g = torch.Generator().manual_seed(2)
        bits = torch.randint(-2**31, 2**31, (1 << 16,), dtype=torch.int64, generator=g).to(torch.int32)
        edges = torch.tensor([448.0, 464.0, 464.00003, 479.99997, 480.0, 2.0**-6, 2.0**-7 * 1.5, 2.0**-10,
                              2.0**-10 * 1.0000001, 1e-45, 0.0, -0.0, float("inf"), float("nan")])
        values = torch.cat([bits.view(torch.float32), edges, -edges])
        values = torch.cat([values, torch.zeros(-values.numel() % 256)])
    else:
        values = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    rank = 240  # + rope 16 = 256 elements a token
    rows = values.view(-1, 256)
    kv_c, k_pe = rows[:, :rank], rows[:, rank:]
    num_tokens = rows.shape[0]
    cache = torch.zeros(num_tokens, 1, 256, dtype=FP8)
    ref = cache.clone()
    scale_t = None if scale is None else torch.tensor([scale])
    kvsentry_ops.concat_and_cache_mla(kv_c, k_pe, cache, torch.arange(num_tokens), None, scale_t)
    write_mla_reference(kv_c, k_pe, ref, torch.arange(num_tokens), None, scale_t)
    mismatch = (raw(cache) != raw(ref)).nonzero().flatten()
    assert mismatch.numel() == 0, (f"{mismatch.numel()} values differ, e.g. input "
                                   f"{values[mismatch[:5]].tolist()} -> {raw(cache)[mismatch[:5]].tolist()} "
                                   f"vs torch {raw(ref)[mismatch[:5]].tolist()}")


# --- checks, Meta, torch.compile -------------------------------------------------------------

def good_kv(device="cpu"):
    key = torch.zeros(4, 2, 8, device=device)
    cache = torch.zeros(3, 4, 2, 8, device=device)
    return dict(key=key, value=key.clone(), k_cache=cache, v_cache=cache.clone(),
                slot_mapping=torch.arange(4, device=device),
                null_block_writes=torch.zeros(1, dtype=torch.int64, device=device), scale=None)


KV_ERRORS = [
    (dict(key=torch.zeros(4, 16)), "key must be [num_tokens, num_kv_heads, head_size]"),
    (dict(value=torch.zeros(4, 2, 4)), "value shape"),
    (dict(key=torch.zeros(4, 2, 8, dtype=torch.float64), value=torch.zeros(4, 2, 8, dtype=torch.float64)),
     "key must be float32, float16 or bfloat16"),
    (dict(value=torch.zeros(4, 2, 8, dtype=torch.float16)), "value dtype"),
    (dict(k_cache=torch.zeros(3, 4, 2, 8, dtype=torch.float16), v_cache=torch.zeros(3, 4, 2, 8, dtype=torch.float16)),
     "must equal key dtype"),
    (dict(k_cache=torch.zeros(3, 4, 16), v_cache=torch.zeros(3, 4, 16)), "k_cache must be [num_blocks"),
    (dict(v_cache=torch.zeros(3, 4, 2, 4)), "must match k_cache"),
    (dict(k_cache=torch.zeros(3, 4, 4, 8), v_cache=torch.zeros(3, 4, 4, 8)), "does not fit key"),
    (dict(key=torch.zeros(4, 8, 2).transpose(1, 2)), "key must have a contiguous last dimension"),
    (dict(k_cache=torch.zeros(3, 4, 8, 2).transpose(2, 3), v_cache=torch.zeros(3, 4, 8, 2).transpose(2, 3)),
     "k_cache must have a contiguous last dimension"),
    (dict(slot_mapping=torch.arange(4, dtype=torch.int32)), "slot_mapping must be a 1-d int64"),
    (dict(slot_mapping=lambda device: torch.arange(8, device=device)[::2]), "slot_mapping must be contiguous"),
    (dict(slot_mapping=torch.arange(5)), "slot_mapping has 5 tokens but key only 4"),
    (dict(null_block_writes=torch.zeros(1, dtype=torch.int32)), "null_block_writes must be an int64"),
    (dict(null_block_writes=torch.zeros(2, dtype=torch.int64)), "null_block_writes must be an int64"),
    (dict(scale=torch.ones(1)), "scale applies to a float8_e4m3fn k_cache only"),
    (dict(k_cache=torch.zeros(3, 4, 2, 8, dtype=FP8), v_cache=torch.zeros(3, 4, 2, 8, dtype=FP8),
          scale=torch.ones(1, dtype=torch.float64)), "scale must be a float32"),
]


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("bad, message", KV_ERRORS, ids=[m for _, m in KV_ERRORS])
def test_kv_checks(kvsentry_ops, device, bad, message):
    args = good_kv(device)
    args.update({k: v(device) if callable(v) else v.to(device) for k, v in bad.items()})  # .to keeps dense strides
    with pytest.raises(RuntimeError, match=re.escape(message)):
        kvsentry_ops.reshape_and_cache_flash(**args)


def test_kv_checks_mixed_devices(kvsentry_ops):
    args = good_kv("cpu")
    args["slot_mapping"] = args["slot_mapping"].to("meta")
    with pytest.raises(RuntimeError, match="all tensors must be on one device"):
        kvsentry_ops.reshape_and_cache_flash(**args)


MLA_ERRORS = [
    (dict(kv_c=torch.zeros(4, 2, 8)), "kv_c must be [num_tokens, kv_lora_rank]"),
    (dict(k_pe=torch.zeros(4, 4, dtype=torch.float16)), "k_pe dtype"),
    (dict(kv_cache=torch.zeros(3, 4, 10)), "kv_cache width 10 must be kv_lora_rank + rope_dim = 8 + 4"),
    (dict(kv_cache=torch.zeros(3, 48)), "kv_cache must be [num_blocks, block_size"),
    (dict(k_pe=lambda device: torch.zeros(4, 8, device=device)[:, ::2]), "k_pe must have a contiguous last dimension"),
    (dict(slot_mapping=torch.arange(6)), "slot_mapping has 6 tokens but kv_c has 4"),
    (dict(scale=torch.ones(1)), "scale applies to a float8_e4m3fn kv_cache only"),
]


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("bad, message", MLA_ERRORS, ids=[m for _, m in MLA_ERRORS])
def test_mla_checks(kvsentry_ops, device, bad, message):
    args = dict(kv_c=torch.zeros(4, 8), k_pe=torch.zeros(4, 4), kv_cache=torch.zeros(3, 4, 12),
                slot_mapping=torch.arange(4), null_block_writes=None, scale=None)
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    args.update({k: v(device) if callable(v) else v.to(device) for k, v in bad.items()})
    with pytest.raises(RuntimeError, match=re.escape(message)):
        kvsentry_ops.concat_and_cache_mla(**args)


def test_meta_accepts_good_inputs(kvsentry_ops):
    kvsentry_ops.reshape_and_cache_flash(**good_kv("meta"))
    kvsentry_ops.concat_and_cache_mla(torch.zeros(4, 8, device="meta"), torch.zeros(4, 4, device="meta"),
                                      torch.zeros(3, 4, 12, device="meta"), torch.arange(4, device="meta"))


def test_schemas_declare_the_mutations(kvsentry_ops):
    kv = str(kvsentry_ops.reshape_and_cache_flash.default._schema)
    mla = str(kvsentry_ops.concat_and_cache_mla.default._schema)
    assert "Tensor(a!) k_cache, Tensor(b!) v_cache" in kv and "Tensor(c!)? null_block_writes" in kv
    assert "Tensor(a!) kv_cache" in mla and "Tensor(b!)? null_block_writes" in mla
    assert kv.endswith("-> ()") and mla.endswith("-> ()")


def test_torch_compile_traces_the_ops_with_dynamic_shapes(kvsentry_ops):
    """Fake tensors (the Meta implementation, symbolic sizes), functionalization of the mutations."""
    write_kv, write_mla = kvsentry_ops.reshape_and_cache_flash, kvsentry_ops.concat_and_cache_mla

    def step(key, value, k_cache, v_cache, kv_c, k_pe, mla_cache, slots, counter):
        write_kv(key * 2, value, k_cache, v_cache, slots, counter)
        write_mla(kv_c, k_pe + 1, mla_cache, slots, counter)
        return counter + 0

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    for num_tokens in (13, 21):
        key, value, k_cache, v_cache, slots = kv_case(torch.float16, torch.float16, num_tokens=num_tokens)
        kv_c, k_pe, mla_cache, _ = mla_case(torch.float16, torch.float16, num_tokens=num_tokens, num_blocks=9)
        eager = [t.clone() for t in (k_cache, v_cache, mla_cache)]
        eager_counter, counter = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        step(key, value, *eager[:2], kv_c, k_pe, eager[2], slots, eager_counter)
        out = compiled(key, value, k_cache, v_cache, kv_c, k_pe, mla_cache, slots, counter)
        for got, want in zip((k_cache, v_cache, mla_cache), eager):
            assert torch.equal(raw(got), raw(want))
        assert counter.item() == eager_counter.item() == out.item() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_engine_writes_cpu_caches_through_the_host_kernel(kvsentry_ops, monkeypatch, dtype):
    """kv_writer.write_kv / write_mla on CPU caches run the csrc/ op when it is built, with the
    reference's bytes and null-block count (the head-major layout, a strict guard's PAD slots)."""
    from engine.ops import kv_writer, registry
    from engine.paging import PAD_SLOT_ID
    g = torch.Generator().manual_seed(3)
    key, value = torch.randn(7, 3, 64, generator=g).to(dtype), torch.randn(7, 3, 64, generator=g).to(dtype)
    storage = torch.zeros(2, 3, 10, 16, 64, dtype=dtype)  # [K|V, Hkv, NB, bs, D]: the CPU layout
    slots = torch.tensor([17, PAD_SLOT_ID, 40, 3, 159, PAD_SLOT_ID, 100])
    calls = []
    real, real_op = kvsentry_ops.reshape_and_cache_flash, registry.op
    counted = lambda *a: (calls.append(1), real(*a))[1]  # noqa: E731
    monkeypatch.setattr(registry, "op", lambda name: counted if name == "reshape_and_cache_flash" else real_op(name))
    results = []
    for use_kernel in (True, False):
        if not use_kernel:
            monkeypatch.setenv("KVSENTRY_DISABLE_CPU_OPS", "1")
        cache = storage.clone()
        counter = torch.zeros(1, dtype=torch.int64)
        kv_writer.write_kv(key, value, cache[0].permute(1, 2, 0, 3), cache[1].permute(1, 2, 0, 3), slots, counter)
        latent = torch.zeros(10, 16, 96, dtype=dtype)
        kv_writer.write_mla(key[:, 0], value[:, 0, :32], latent, slots, counter)
        results.append((cache, latent, counter.item()))
    assert calls == [1]  # the kernel once, then the reference with the ops turned off
    (cache_k, latent_k, count_k), (cache_r, latent_r, count_r) = results
    assert torch.equal(cache_k.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       cache_r.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert torch.equal(latent_k, latent_r) and count_k == count_r == 2  # slot 3, twice (K/V and MLA)
    assert cache_k.count_nonzero() > 0
