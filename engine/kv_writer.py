"""Cache-write ops: the one place a token's K/V (or MLA latent) enters the paged cache.

Both ops skip `slot < 0` (PAD_SLOT_ID), so padded and dummy tokens write
nothing, and both count the writes whose slot falls in the null block (block
0), which must stay zero for the engine's whole life. On CUDA they dispatch to
the kernels in csrc/ (engine/cuda_ops.py); everywhere else to the torch
references below, which define the semantics the kernels must match bit for bit.
"""
from __future__ import annotations

import torch

from engine.config import NULL_BLOCK_ID


def _null_block_hits(slot_mapping: torch.Tensor, block_size: int) -> torch.Tensor:
    # [num_tokens] bool: real slots inside block 0
    return (slot_mapping >= 0) & (slot_mapping // block_size == NULL_BLOCK_ID)


def write_kv_reference(key: torch.Tensor,          # [num_tokens, num_kv_heads, head_size]
                       value: torch.Tensor,        # [num_tokens, num_kv_heads, head_size]
                       k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_size]
                       v_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_size]
                       slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
                       null_block_writes: torch.Tensor | None = None,  # [1] int64 counter
                       ) -> None:
    num_blocks, block_size = k_cache.shape[:2]
    num_tokens = slot_mapping.shape[0]
    valid = slot_mapping[:num_tokens] >= 0
    slots = slot_mapping[valid]
    flat_k = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    flat_v = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    flat_k.index_copy_(0, slots, key[:num_tokens][valid].to(k_cache.dtype))
    flat_v.index_copy_(0, slots, value[:num_tokens][valid].to(v_cache.dtype))
    if null_block_writes is not None:
        null_block_writes += _null_block_hits(slot_mapping, block_size).sum()


def write_mla_reference(kv_c: torch.Tensor,          # [num_tokens, kv_lora_rank]
                        k_pe: torch.Tensor,          # [num_tokens, rope_dim]
                        kv_cache: torch.Tensor,      # [num_blocks, block_size, kv_lora_rank + rope_dim]
                        slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
                        null_block_writes: torch.Tensor | None = None,
                        ) -> None:
    num_blocks, block_size, width = kv_cache.shape
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    latent = torch.cat([kv_c[valid], k_pe[valid]], dim=-1).to(kv_cache.dtype)  # compressed kv first, then rope
    kv_cache.view(num_blocks * block_size, width).index_copy_(0, slots, latent)
    if null_block_writes is not None:
        null_block_writes += _null_block_hits(slot_mapping, block_size).sum()


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, null_block_writes: torch.Tensor | None = None) -> None:
    if k_cache.is_cuda:
        from engine import cuda_ops
        if cuda_ops.available():
            cuda_ops.reshape_and_cache_flash(key, value, k_cache, v_cache, slot_mapping, null_block_writes)
            return
    write_kv_reference(key, value, k_cache, v_cache, slot_mapping, null_block_writes)


def write_mla(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
              slot_mapping: torch.Tensor, null_block_writes: torch.Tensor | None = None) -> None:
    if kv_cache.is_cuda:
        from engine import cuda_ops
        if cuda_ops.available():
            cuda_ops.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, null_block_writes)
            return
    write_mla_reference(kv_c, k_pe, kv_cache, slot_mapping, null_block_writes)
