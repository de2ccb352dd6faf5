"""Paged decode attention through torch's FlexAttention, with metadata that lives entirely
in fixed-shape device tensors: the attention a CUDA graph can capture (engine/worker/cuda_graphs.py)
and the decode attention on CUDA.

Every row is one query token and reads as many block-table entries as the table has columns:
its own blocks, then the null block wherever the row has no more. Their K/V are gathered by
block id, as the torch reference gathers them (engine/ops/attention.py), and FlexAttention
scores them with a score_mod that sets every position at or past the row's length to -inf --
after the read, as the reference masks. So a NaN in the null block's values spreads
(0 x NaN = NaN) to every row that reads it, exactly as in the reference; a row of length 0
(a padded row) has every position masked and comes out zero (FlexAttention's defined output
for a fully masked row, and what the eager path leaves in rows it does not compute).

Nothing here reads a host value: shapes come from the tensors and lengths stay on the device.
FlexAttention runs unfused here (torch.compile(flex_attention) would fuse it; not done): it
materialises the scores, [B, Hq, 1, L], which is small for one query per row.
"""
from __future__ import annotations

import warnings

import torch

try:
    from torch.nn.attention.flex_attention import flex_attention as _flex_attention
except ImportError:  # a torch without FlexAttention (< 2.5): the callers keep the torch reference
    _flex_attention = None

# Eager FlexAttention warns that it is unfused; that is the intended use here (see above).
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


def available() -> bool:
    return _flex_attention is not None and torch._dynamo.is_dynamo_supported()


def paged_decode_attention(query: torch.Tensor,         # [B, Hq, D]
                           key_cache: torch.Tensor,     # [num_blocks, block_size, Hkv, D]
                           value_cache: torch.Tensor,   # [num_blocks, block_size, Hkv, Dv]
                           block_tables: torch.Tensor,  # [B, num_read] int32, NULL_BLOCK_ID past a row's blocks
                           seq_lens: torch.Tensor,      # [B] int64, 0 for a padded row
                           scale: float) -> torch.Tensor:  # [B, Hq, Dv]
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[-1] != head_dim or value_cache.shape[:3] != key_cache.shape[:3]:
        raise ValueError(f"flex paged attention: query {tuple(query.shape)} does not fit the caches "
                         f"{tuple(key_cache.shape)} / {tuple(value_cache.shape)}")
    if block_tables.shape[0] != batch or seq_lens.shape != (batch,) or num_heads % num_kv_heads:
        raise ValueError(f"flex paged attention: {batch} rows, {num_heads} query heads, but tables "
                         f"{tuple(block_tables.shape)}, lengths {tuple(seq_lens.shape)}, {num_kv_heads} KV heads")
    keys = _gather(key_cache, block_tables).to(query.dtype)      # [B, Hkv, L, D]
    values = _gather(value_cache, block_tables).to(query.dtype)  # [B, Hkv, L, Dv]

    def mask_past_length(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx < seq_lens[b], score, float("-inf"))

    out = _flex_attention(query.unsqueeze(2), keys, values, score_mod=mask_past_length, scale=scale,
                          enable_gqa=num_heads != num_kv_heads)  # [B, Hq, 1, Dv]
    return out.squeeze(2)


def _gather(cache: torch.Tensor,         # [num_blocks, block_size, Hkv, D], any layout
            block_tables: torch.Tensor,  # [B, num_read]
            ) -> torch.Tensor:           # [B, Hkv, num_read * block_size, D]
    batch, num_read = block_tables.shape
    blocks = cache.index_select(0, block_tables.reshape(-1).long())  # [B * num_read, block_size, Hkv, D]
    return blocks.view(batch, num_read * cache.shape[1], *cache.shape[2:]).transpose(1, 2)
