"""Cache-write ops: the one place a token's K/V (or MLA latent) enters the paged cache.

Both ops skip `slot < 0` (PAD_SLOT_ID), so padded and dummy tokens write
nothing, and both count the writes whose slot falls in the null block (block
0), which must stay zero for the engine's whole life. Given the step's WriteGuard, they
also count the writes outside the blocks the step's requests own (engine/integrity/write_guard.py). On CUDA they dispatch to
the kernels in csrc/ (engine/ops/cuda_ops.py), on CPU to the same per-token code run on
the host; without a build, to the torch references below, which define the semantics the
kernels must match bit for bit.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.ops import cuda_ops, registry
from engine.paging import block_of_slot, null_block_hits, offset_in_block

if TYPE_CHECKING:  # a type only: the integrity unit imports these ops, not the reverse
    from engine.integrity.write_guard import WriteGuard


# float8_e4m3fn has no inf: the largest finite value, where overflow and +-inf saturate.
FP8_E4M3FN_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448.0


def _to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | float | None) -> torch.Tensor:
    if cache_dtype != torch.float8_e4m3fn:
        if scale is not None:
            raise ValueError(f"scale applies to a float8_e4m3fn cache only, got a {cache_dtype} cache")
        return x.to(cache_dtype)
    # fp8 caches may carry a per-tensor scale: stored = x / scale, divided in float32
    # (a tensor divisor, so CUDA divides too instead of multiplying by a reciprocal).
    # Then saturate, as vLLM's cache kernels do (__NV_SATFINITE): an overflowing K/V
    # must not become a NaN in the cache. torch's own .to() is no help here: 2.13
    # saturates, but 2.11 turns every |x| >= 464 and +-inf into NaN. clamp keeps NaN.
    x = x.to(torch.float32)
    if scale is not None:
        x = x / torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(1)
    return x.clamp(-FP8_E4M3FN_MAX, FP8_E4M3FN_MAX).to(cache_dtype)


def _scatter_rows(cache: torch.Tensor,  # [num_blocks, block_size, ...], any strides
                  slots: torch.Tensor,  # [n] int64, all >= 0
                  rows: torch.Tensor,   # [n, ...]
                  ) -> None:
    if cache.dtype == torch.float8_e4m3fn:  # no fp8 kernels for these on CPU: copy the bytes
        cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
    block_size = cache.shape[1]
    if cache.is_contiguous():
        cache.view(cache.shape[0] * block_size, *cache.shape[2:]).index_copy_(0, slots, rows)
    else:  # e.g. the head-major CPU layout (engine/worker/kv_cache.py): index by (block, offset)
        cache[block_of_slot(slots, block_size), offset_in_block(slots, block_size)] = rows


def write_kv_reference(key: torch.Tensor,          # [num_tokens, num_kv_heads, head_size]
                       value: torch.Tensor,        # [num_tokens, num_kv_heads, head_size]
                       k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_size]
                       v_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_size]
                       slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
                       null_block_writes: torch.Tensor | None = None,  # [1] int64 counter
                       scale: torch.Tensor | float | None = None,  # fp8 cache only: stored = x / scale
                       ) -> None:
    block_size = k_cache.shape[1]
    num_tokens = slot_mapping.shape[0]
    valid = slot_mapping[:num_tokens] >= 0
    slots = slot_mapping[valid]
    _scatter_rows(k_cache, slots, _to_cache_dtype(key[:num_tokens][valid], k_cache.dtype, scale))
    _scatter_rows(v_cache, slots, _to_cache_dtype(value[:num_tokens][valid], v_cache.dtype, scale))
    if null_block_writes is not None:
        null_block_writes += null_block_hits(slot_mapping, block_size).sum()


def write_mla_reference(kv_c: torch.Tensor,          # [num_tokens, kv_lora_rank]
                        k_pe: torch.Tensor,          # [num_tokens, rope_dim]
                        kv_cache: torch.Tensor,      # [num_blocks, block_size, kv_lora_rank + rope_dim]
                        slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
                        null_block_writes: torch.Tensor | None = None,
                        scale: torch.Tensor | float | None = None,
                        ) -> None:
    block_size = kv_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    latent = torch.cat([kv_c[valid], k_pe[valid]], dim=-1)  # compressed kv first, then rope
    _scatter_rows(kv_cache, slots, _to_cache_dtype(latent, kv_cache.dtype, scale))
    if null_block_writes is not None:
        null_block_writes += null_block_hits(slot_mapping, block_size).sum()


_CPU_WRITER = registry.kernel_for("kv_writer", "cpu")


def _host_kernel(cache: torch.Tensor) -> bool:
    """Whether a CPU cache's writes go through the csrc/ op (built, and not turned off)."""
    return cache.device.type == "cpu" and registry.runs(_CPU_WRITER)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, null_block_writes: torch.Tensor | None = None,
             scale: torch.Tensor | None = None, guard: WriteGuard | None = None) -> None:
    if guard is not None:  # count (and, strict, drop) writes outside the step's blocks, on the device
        slot_mapping = guard.check(slot_mapping)
    if k_cache.is_cuda:
        if cuda_ops.available():
            cuda_ops.reshape_and_cache_flash(key, value, k_cache, v_cache, slot_mapping, null_block_writes, scale)
            return
    elif _host_kernel(k_cache):
        # The kernels' per-token code run on the host (csrc/cpu/cache_kernels_host.cpp): one call
        # where the reference runs ~15 small ops per layer, bit for bit the same writes.
        registry.op("reshape_and_cache_flash")(cuda_ops.contiguous_rows(key), cuda_ops.contiguous_rows(value),
                                               k_cache, v_cache, slot_mapping, null_block_writes,
                                               cuda_ops.scale_tensor(scale, k_cache))
        return
    write_kv_reference(key, value, k_cache, v_cache, slot_mapping, null_block_writes, scale)


def write_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor, null_block_writes: torch.Tensor | None = None,
              scale: torch.Tensor | None = None, guard: WriteGuard | None = None) -> None:
    if guard is not None:
        slot_mapping = guard.check(slot_mapping)
    if kv_cache.is_cuda:
        if cuda_ops.available():
            cuda_ops.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, null_block_writes, scale)
            return
    elif _host_kernel(kv_cache):
        registry.op("concat_and_cache_mla")(cuda_ops.contiguous_rows(kv_c), cuda_ops.contiguous_rows(k_pe), kv_cache,
                                            slot_mapping, null_block_writes, cuda_ops.scale_tensor(scale, kv_cache))
        return
    write_mla_reference(kv_c, k_pe, kv_cache, slot_mapping, null_block_writes, scale)
