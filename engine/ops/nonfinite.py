"""Non-finite values per (block, layer) of the paged KV cache: the NaN sentinel's scan.

csrc/cpu/cpu_nonfinite.cpp on CPU (integer masks on the raw words, one pass, no float copy),
held to the torch reference below (tests/csrc/test_nonfinite.py). Both take the block-first
int32 words view of the cache storage (engine/ops/checksum.py's block_words). Where the kernel
does not take a cache, the sentinel sums floats instead (engine/integrity/sentinel.py).
"""
from __future__ import annotations

import torch

from engine.ops import registry

KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3}


def nonfinite_counts_reference(words: torch.Tensor,      # [num_blocks, num_layers, chunks, words] int32
                               block_ids: torch.Tensor,  # [n] int64
                               dtype: torch.dtype,       # what the words hold
                               ) -> torch.Tensor:        # [n, num_layers] int64
    values = words.index_select(0, block_ids).view(dtype)  # [n, num_layers, chunks, values]
    if dtype == torch.float8_e4m3fn:  # no isfinite for fp8 on CPU: its only non-finite is NaN
        values = values.view(torch.uint8) & 0x7F
        return (values == 0x7F).sum(dim=(2, 3))
    return (~torch.isfinite(values)).sum(dim=(2, 3))


def nonfinite_counts_into(words: torch.Tensor,  # [num_blocks, num_layers, chunks, words] int32, on CPU
                          block_ids: list[int],
                          dtype: torch.dtype,    # what the words hold, one of KINDS
                          out: torch.Tensor,     # [>= len(block_ids), num_layers] int64, contiguous: rows 0..n-1 written
                          ) -> int:              # their sum: 0 on a clean scan
    """The kernel's counts for the sentinel's per step call: one dispatch, no allocation. The
    caller checks that the kernel takes the cache (NaNSentinel.uses_kernel)."""
    return registry.op("kv_block_nonfinite_into")(words, block_ids, KINDS[dtype], out)
