"""Allocation of the paged KV cache (all zeros; block 0 stays that way).

All layers live in one tensor so the sentinel can reduce over every layer in a
single op; each layer gets views into it:
  dense: storage [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim],
         layer i -> (storage[i, 0], storage[i, 1])
  MLA:   storage [num_layers, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim],
         layer i -> storage[i]
"""
from __future__ import annotations

import torch

from engine.config import EngineConfig

KVCache = list  # per layer: (k_cache, v_cache) or one MLA latent tensor


def allocate_kv_storage(config: EngineConfig) -> torch.Tensor:
    mc = config.model
    if mc.is_mla:
        shape = (mc.num_layers, config.num_blocks, config.block_size, mc.kv_lora_rank + mc.qk_rope_head_dim)
    else:
        shape = (mc.num_layers, 2, config.num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim)
    return torch.zeros(shape, dtype=mc.dtype, device=config.device)


def layer_views(storage: torch.Tensor, is_mla: bool) -> KVCache:
    if is_mla:
        return [storage[i] for i in range(storage.shape[0])]
    return [(storage[i, 0], storage[i, 1]) for i in range(storage.shape[0])]


def block_axis(is_mla: bool) -> int:
    return 1 if is_mla else 2


def allocate_kv_cache(config: EngineConfig) -> KVCache:
    return layer_views(allocate_kv_storage(config), config.model.is_mla)


def layer_tensors(cache_entry) -> list[torch.Tensor]:
    """The tensors of one layer's cache, whatever its layout."""
    return list(cache_entry) if isinstance(cache_entry, tuple) else [cache_entry]
