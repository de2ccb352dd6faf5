"""Checksums of KV blocks: the op the sealed-block registry (engine/integrity/checksums.py) uses.

A block's checksum is, per layer, two 32-bit lanes of a multilinear hash of its bytes:

    lane_k = sum_j word_j * m_kj  (mod 2^32)   words: the block's bytes as int32, m: odd constants

Flipping any single bit changes the product by an odd multiple of a power of two below
2^32, so every single-bit error changes both lanes; other corruption collides with
probability ~2^-64 over the random multipliers. It is computed where the cache lives:
csrc/cpu/cpu_checksum.cpp on CPU (one pass over memory, no temporaries), the torch reference
below elsewhere (on a GPU that is a few batched device ops, no host sync). The reference
defines the result; tests/csrc/test_checksum.py holds the kernel to it bit for bit.
"""
from __future__ import annotations

import torch

from engine.ops import registry

CHECKSUM_SEED = 0x6B76_7365  # fixed: checksums are compared within one process only


def block_words(storage: torch.Tensor, block_axis: int) -> torch.Tensor:  # [num_blocks, num_layers, chunks, words]
    """The cache storage ([num_layers, ..., num_blocks, ...], contiguous) as int32 words, blocks
    first. The dims between the layer and the block axis become chunks; those after the block
    axis are one contiguous run per (layer, chunk, block)."""
    shape = storage.shape
    chunks = 1
    for size in shape[1:block_axis]:
        chunks *= size
    inner = storage.reshape(shape[0], chunks, shape[block_axis], -1)  # a view: storage is contiguous
    if (inner.shape[-1] * inner.element_size()) % 4:
        raise ValueError(f"a KV block row of {inner.shape[-1]} x {inner.dtype} is not a whole number of 32-bit words")
    return inner.view(torch.uint8).view(torch.int32).permute(2, 0, 1, 3)


def make_multipliers(words: torch.Tensor) -> torch.Tensor:  # [2, chunks, words] int32, odd
    generator = torch.Generator().manual_seed(CHECKSUM_SEED)
    values = torch.randint(0, 2 ** 32, (2, *words.shape[2:]), generator=generator, dtype=torch.int64) | 1
    return values.to(torch.int32).to(words.device)  # int64 -> int32 wraps: the same 32-bit pattern


def block_checksums_reference(words: torch.Tensor,        # [num_blocks, num_layers, chunks, words] int32
                              block_ids: torch.Tensor,    # [n] int64
                              multipliers: torch.Tensor,  # [2, chunks, words] int32
                              ) -> torch.Tensor:          # [n, num_layers, 2] int64, each in [0, 2^32)
    blocks = words.index_select(0, block_ids)  # [n, num_layers, chunks, words]
    # int32 products wrap mod 2^32; summing them in int64 and keeping the low 32 bits is the sum mod 2^32.
    lanes = [(blocks * m).sum(dim=(2, 3), dtype=torch.int64) & 0xFFFF_FFFF for m in multipliers]
    return torch.stack(lanes, dim=-1)


def block_checksums(words: torch.Tensor, block_ids: torch.Tensor, multipliers: torch.Tensor) -> torch.Tensor:
    if registry.available("kv_checksum", words.device):
        return registry.op("kv_block_checksums")(words, block_ids, multipliers)
    return block_checksums_reference(words, block_ids, multipliers)
