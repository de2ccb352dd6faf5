"""csrc/cpu/cpu_checksum.cpp (sealed-block checksums) against its torch reference, bit for bit, over
the cache layouts and dtypes the engine allocates; and the property the sweep relies on: any one
flipped bit changes the checksum."""
from __future__ import annotations

import pytest
import torch

from engine.ops.checksum import block_checksums, block_checksums_reference, block_words, make_multipliers

# (storage shape, block axis): CPU head-major dense, CUDA block-major dense, MLA latent.
LAYOUTS = {
    "head_major": ((3, 2, 2, 12, 4, 8), 3),
    "block_major": ((3, 2, 12, 4, 2, 8), 2),
    "mla": ((2, 12, 4, 20), 1),
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]


def storage(layout: str, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, int]:
    shape, axis = LAYOUTS[layout]
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3
    return values.to(dtype), axis


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_matches_reference_bitwise(kvsentry_ops, layout, dtype):
    cache, axis = storage(layout, dtype)
    words = block_words(cache, axis)
    multipliers = make_multipliers(words)
    ids = torch.tensor([0, 11, 3, 3, 7], dtype=torch.int64)  # repeats allowed
    got = kvsentry_ops.kv_block_checksums(words, ids, multipliers)
    want = block_checksums_reference(words, ids, multipliers)
    assert got.dtype == torch.int64 and got.shape == (5, cache.shape[0], 2)
    assert torch.equal(got, want)
    assert bool(((got >= 0) & (got < 2 ** 32)).all())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_single_bit_flip_changes_the_checksum(kvsentry_ops, layout):
    cache, axis = storage(layout, torch.bfloat16, seed=1)
    words = block_words(cache, axis)
    multipliers = make_multipliers(words)
    block, ids = 5, torch.tensor([5])
    clean = block_checksums(words, ids, multipliers)
    target = words[block]  # [num_layers, chunks, words]
    generator = torch.Generator().manual_seed(2)
    positions = [tuple(int(torch.randint(0, n, (1,), generator=generator)) for n in target.shape) for _ in range(64)]
    for position in positions:
        for bit in (0, 7, 15, 16, 31):
            target[position] ^= torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)
            dirty = block_checksums(words, ids, multipliers)
            assert (dirty[0, position[0]] != clean[0, position[0]]).all(), (position, bit)
            assert torch.equal(dirty[0, :position[0]], clean[0, :position[0]])  # the layer is localised
            target[position] ^= torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)
    assert torch.equal(block_checksums(words, ids, multipliers), clean)


def test_words_are_the_storage_itself():
    cache, axis = storage("head_major", torch.float32)
    words = block_words(cache, axis)
    assert words.data_ptr() == cache.data_ptr() and words.shape == (12, 3, 4, 32)
    words[4, 1, 0, 0] ^= 1
    assert not torch.equal(cache, storage("head_major", torch.float32)[0])


def test_checks_and_meta(kvsentry_ops):
    cache, axis = storage("block_major", torch.float32)
    words = block_words(cache, axis)
    multipliers = make_multipliers(words)
    with pytest.raises(RuntimeError, match="out of range"):
        kvsentry_ops.kv_block_checksums(words, torch.tensor([12]), multipliers)
    with pytest.raises(RuntimeError, match="multipliers"):
        kvsentry_ops.kv_block_checksums(words, torch.tensor([1]), multipliers[:1])
    meta = kvsentry_ops.kv_block_checksums(words.to("meta"), torch.tensor([1, 2], device="meta"),
                                           multipliers.to("meta"))
    assert meta.shape == (2, 3, 2) and meta.dtype == torch.int64
