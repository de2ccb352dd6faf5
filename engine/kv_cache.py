"""Allocation of the paged KV cache tensors (all zeros; block 0 stays that way)."""
from __future__ import annotations

import torch

from engine.config import EngineConfig

KVCache = list  # per layer: (k_cache, v_cache) or one MLA latent tensor


def allocate_kv_cache(config: EngineConfig) -> KVCache:
    mc = config.model
    caches = []
    for _ in range(mc.num_layers):
        if mc.is_mla:
            # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
            caches.append(torch.zeros(config.num_blocks, config.block_size,
                                      mc.kv_lora_rank + mc.qk_rope_head_dim,
                                      dtype=mc.dtype, device=config.device))
        else:
            shape = (config.num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim)
            # [num_blocks, block_size, num_kv_heads, head_dim] each
            caches.append((torch.zeros(shape, dtype=mc.dtype, device=config.device),
                           torch.zeros(shape, dtype=mc.dtype, device=config.device)))
    return caches


def layer_tensors(cache_entry) -> list[torch.Tensor]:
    """The tensors of one layer's cache, whatever its layout."""
    return list(cache_entry) if isinstance(cache_entry, tuple) else [cache_entry]
