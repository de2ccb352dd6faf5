"""Inputs for the KV-writer tests, shared by tests/csrc (CPU) and tests/gpu (CUDA).

Layouts matter as much as values: the kernels pick their unit width from
strides and pointer alignment, so each case names how its tensors are laid out.
Random data is drawn on the CPU from a seeded generator, so a case is the same
on every device.
"""
from __future__ import annotations

import torch

from engine.paging import PAD_SLOT_ID
from engine.ops.kv_writer import write_kv_reference, write_mla_reference

FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["f32", "f16", "bf16"]
SPECIALS = [float("nan"), float("inf"), float("-inf"), -0.0, 1e4, -3e5, 1e-6, -2e-9]


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of t in logical order (NaN-safe, bitwise comparison)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def randn(shape, g: torch.Generator, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(dtype=dtype, device=device)


def fill_random_bits(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Random (finite) bytes, so unwritten cache rows are told apart from written ones."""
    data = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=g)
    values = data.view(t.dtype).view(t.shape)
    if t.dtype != FP8:
        values = torch.where(torch.isfinite(values.float()), values, torch.zeros((), dtype=t.dtype))
    t.copy_(values.to(t.device))
    return t


def make_slots(num_tokens: int, num_slots: int, g: torch.Generator, block_size: int, device="cpu",
               pad_every: int = 5, in_null_block: int = 2) -> torch.Tensor:
    """Distinct slots, a few in block 0, PAD_SLOT_ID scattered and at the end (padding)."""
    slots = torch.randperm(num_slots, generator=g)[:num_tokens].clone()
    slots[1:1 + in_null_block] = torch.arange(in_null_block) % block_size
    slots[3::pad_every] = PAD_SLOT_ID
    slots[-2:] = PAD_SLOT_ID
    return slots.to(device)


def kv_case(dtype, cache_dtype, *, layout="contiguous", cache_layout="contiguous", num_tokens=29,
            num_heads=4, head_size=64, num_blocks=9, block_size=8, seed=0, device="cpu"):
    """(key, value, k_cache, v_cache, slot_mapping) for reshape_and_cache_flash."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_tokens, num_heads, head_size)
    if layout == "contiguous":
        key, value = randn(shape, g, dtype, device), randn(shape, g, dtype, device)
    elif layout == "qkv_slice":  # k and v are views into a fused qkv projection: token stride 3 * H * D
        qkv = randn((num_tokens, 3 * num_heads * head_size), g, dtype, device)
        _, key, value = (t.view(shape) for t in qkv.split(num_heads * head_size, dim=-1))
    elif layout == "misaligned":  # storage offset of one element: no wide units possible
        buf = randn((2 * num_tokens * num_heads * head_size + 1,), g, dtype, device)
        key, value = buf[1:].view(2, *shape).unbind(0)
    else:
        raise ValueError(layout)
    n = min(head_size, len(SPECIALS))  # NaN, +-inf, -0, fp8 overflow and fp8 subnormals
    for t in (key, value):
        t[0, 0, :n] = torch.tensor(SPECIALS[:n]).to(dtype)
    cache_shape = (num_blocks, block_size, num_heads, head_size)
    if cache_layout == "contiguous":
        k_cache = torch.empty(cache_shape, dtype=cache_dtype, device=device)
        v_cache = torch.empty(cache_shape, dtype=cache_dtype, device=device)
    elif cache_layout == "kv_interleaved":  # one allocation [num_blocks, 2, ...]: block stride doubles
        kv = torch.empty(num_blocks, 2, block_size, num_heads, head_size, dtype=cache_dtype, device=device)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
    elif cache_layout == "head_major":  # [num_blocks, num_heads, block_size, head_size] seen permuted
        k_cache, v_cache = (torch.empty(num_blocks, num_heads, block_size, head_size, dtype=cache_dtype,
                                        device=device).permute(0, 2, 1, 3) for _ in range(2))
    else:
        raise ValueError(cache_layout)
    fill_random_bits(k_cache, g)
    fill_random_bits(v_cache, g)
    slots = make_slots(num_tokens, num_blocks * block_size, g, block_size, device)
    return key, value, k_cache, v_cache, slots


def mla_case(dtype, cache_dtype, *, layout="split", kv_lora_rank=64, rope_dim=16, num_tokens=23,
             num_blocks=7, block_size=8, cache_pad=0, seed=1, device="cpu"):
    """(kv_c, k_pe, kv_cache, slot_mapping) for concat_and_cache_mla. cache_pad > 0 leaves a gap
    after each row (page stride > width); the gap must never be written."""
    g = torch.Generator().manual_seed(seed)
    if layout == "split":  # both halves of kv_a_proj's output: token stride rank + rope
        kv_a = randn((num_tokens, kv_lora_rank + rope_dim), g, dtype, device)
        kv_c, k_pe = kv_a.split([kv_lora_rank, rope_dim], dim=-1)
    elif layout == "contiguous":
        kv_c = randn((num_tokens, kv_lora_rank), g, dtype, device)
        k_pe = randn((num_tokens, rope_dim), g, dtype, device)
    elif layout == "misaligned":
        buf = randn((num_tokens * (kv_lora_rank + rope_dim) + 1,), g, dtype, device)
        kv_c = buf[1:1 + num_tokens * kv_lora_rank].view(num_tokens, kv_lora_rank)
        k_pe = buf[1 + num_tokens * kv_lora_rank:].view(num_tokens, rope_dim)
    else:
        raise ValueError(layout)
    for t in (kv_c, k_pe):  # NaN, +-inf, -0, fp8 overflow and fp8 subnormals
        n = min(t.shape[1], len(SPECIALS))
        t[0, :n] = torch.tensor(SPECIALS[:n]).to(dtype)
    width = kv_lora_rank + rope_dim
    cache = fill_random_bits(torch.empty(num_blocks, block_size, width + cache_pad, dtype=cache_dtype,
                                         device=device), g)
    return kv_c, k_pe, cache[..., :width], make_slots(num_tokens, num_blocks * block_size, g, block_size, device)


def expected_null_block_hits(slots: torch.Tensor, block_size: int) -> int:
    return int(((slots >= 0) & (slots < block_size)).sum())


def check_kv_write(write, key, value, k_cache, v_cache, slots, scale=None) -> None:
    """write (the op or its wrapper) against write_kv_reference on copies of the caches:
    caches bitwise equal, null-block counter exact (and added to, not overwritten)."""
    device = k_cache.device
    ref_k, ref_v = k_cache.contiguous().clone(), v_cache.contiguous().clone()
    counter = torch.tensor([3], dtype=torch.int64, device=device)
    ref_counter = counter.clone()
    scale_t = None if scale is None else torch.tensor([scale], device=device)
    write(key, value, k_cache, v_cache, slots, counter, scale_t)
    write_kv_reference(key, value, ref_k, ref_v, slots, ref_counter, scale_t)
    assert torch.equal(raw(k_cache), raw(ref_k)), "k_cache differs from the reference"
    assert torch.equal(raw(v_cache), raw(ref_v)), "v_cache differs from the reference"
    assert counter.item() == ref_counter.item() == 3 + expected_null_block_hits(slots, k_cache.shape[1])


def check_mla_write(write, kv_c, k_pe, cache, slots, scale=None) -> None:
    """write against write_mla_reference; with a padded cache row, the gap stays untouched."""
    device = cache.device
    full = cache._base if cache._base is not None else cache
    ref_full = full.clone()
    ref = ref_full[..., :cache.shape[-1]].contiguous()
    counter = torch.tensor([5], dtype=torch.int64, device=device)
    ref_counter = counter.clone()
    scale_t = None if scale is None else torch.tensor([scale], device=device)
    write(kv_c, k_pe, cache, slots, counter, scale_t)
    write_mla_reference(kv_c, k_pe, ref, slots, ref_counter, scale_t)
    assert torch.equal(raw(cache), raw(ref)), "kv_cache differs from the reference"
    if full is not cache:
        assert torch.equal(raw(full[..., cache.shape[-1]:]), raw(ref_full[..., cache.shape[-1]:])), "gap written"
    assert counter.item() == ref_counter.item() == 5 + expected_null_block_hits(slots, cache.shape[1])
