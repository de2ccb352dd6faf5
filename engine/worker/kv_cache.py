"""Allocation of the paged KV cache (all zeros; block 0 stays that way).

All layers live in one tensor so the sentinel can reduce over every layer in a
single op; each layer gets views into it, always shaped
[num_blocks, block_size, num_kv_heads, head_dim] (dense K and V) or
[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] (MLA latent).

Physically, a dense cache on CPU is head-major:
  storage [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]
so that gathering a batch's blocks for one layer yields [Hkv, B, L, D] contiguous, ready
for the decode matmuls without another copy (about 2x faster decode attention on CPU).
On CUDA it is the usual block-major [num_layers, 2, num_blocks, block_size, Hkv, D], the
layout the csrc kernels are tuned for.
"""
from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.memory.huge_pages import huge_page_zeros

KVCache = list  # per layer: (k_cache, v_cache) or one MLA latent tensor


def allocate_kv_storage(config: EngineConfig) -> torch.Tensor:
    mc = config.model
    if mc.is_mla:
        shape = (mc.num_layers, config.num_blocks, config.block_size, mc.kv_lora_rank + mc.qk_rope_head_dim)
    elif head_major(config):
        shape = (mc.num_layers, 2, mc.num_kv_heads, config.num_blocks, config.block_size, mc.head_dim)
    else:
        shape = (mc.num_layers, 2, config.num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim)
    if config.device == "cpu":  # every step streams the live blocks: huge pages (engine/memory/huge_pages.py)
        return huge_page_zeros(shape, mc.dtype)
    return torch.zeros(shape, dtype=mc.dtype, device=config.device)


def head_major(config: EngineConfig) -> bool:
    return not config.model.is_mla and not config.device.startswith("cuda")


def layer_views(storage: torch.Tensor, config: EngineConfig) -> KVCache:
    if config.model.is_mla:
        return [storage[i] for i in range(storage.shape[0])]
    if head_major(config):  # [Hkv, NB, bs, D] -> the logical [NB, bs, Hkv, D]
        return [(storage[i, 0].permute(1, 2, 0, 3), storage[i, 1].permute(1, 2, 0, 3))
                for i in range(storage.shape[0])]
    return [(storage[i, 0], storage[i, 1]) for i in range(storage.shape[0])]


def block_axis(config: EngineConfig) -> int:
    """The storage dimension that indexes blocks."""
    if config.model.is_mla:
        return 1
    return 3 if head_major(config) else 2


def allocate_kv_cache(config: EngineConfig) -> KVCache:
    return layer_views(allocate_kv_storage(config), config)


def layer_tensors(cache_entry) -> list[torch.Tensor]:
    """The tensors of one layer's cache, whatever its layout."""
    return list(cache_entry) if isinstance(cache_entry, tuple) else [cache_entry]
