"""csrc/cpu/cpu_nonfinite.cpp (the NaN sentinel's scan) against its torch reference, exactly, over the
cache layouts and dtypes: NaN, +-Inf, the largest finite values and subnormals placed at random."""
from __future__ import annotations

import pytest
import torch

from engine.ops.checksum import block_words
from engine.ops.nonfinite import nonfinite_counts_reference
from tests.csrc.test_checksum import LAYOUTS, storage

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_counts_what_the_reference_counts(kvsentry_ops, layout, dtype):
    cache, axis = storage(layout, dtype)
    flat = cache.view(-1)
    generator = torch.Generator().manual_seed(3)
    specials = [float("nan"), float("inf"), float("-inf"), torch.finfo(dtype).max, torch.finfo(dtype).tiny]
    for value in specials:
        where = torch.randint(0, flat.numel(), (7,), generator=generator)
        flat[where] = torch.tensor(value).to(dtype)
    words = block_words(cache, axis)
    ids = torch.tensor([0, 11, 3, 3, 7, 5], dtype=torch.int64)
    got = kvsentry_ops.kv_block_nonfinite(words, ids, KINDS[dtype])
    want = nonfinite_counts_reference(words, ids, dtype)
    assert torch.equal(got, want)
    every = torch.arange(cache.shape[axis])
    planted = int(kvsentry_ops.kv_block_nonfinite(words, every, KINDS[dtype]).sum())
    expected = int((~torch.isfinite(cache.float())).sum())  # fp8 saturates inf to NaN at the cast
    assert planted == expected > 0


def test_checks(kvsentry_ops):
    cache, axis = storage("mla", torch.float32)
    words = block_words(cache, axis)
    with pytest.raises(RuntimeError, match="kind"):
        kvsentry_ops.kv_block_nonfinite(words, torch.tensor([1]), 4)
    with pytest.raises(RuntimeError, match="out of range"):
        kvsentry_ops.kv_block_nonfinite(words, torch.tensor([-1]), 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_runs_of_consecutive_blocks_into_a_reused_output(kvsentry_ops, layout, dtype):
    """The sentinel's form: runs of adjacent ids are read one stream per chunk (the null block
    and a sweep window); the counts must be the reference's, row for row, whatever the runs, and
    stale rows of the reused output must not leak into them or into the total."""
    cache, axis = storage(layout, dtype, seed=4)
    flat = cache.view(-1)
    where = torch.randint(0, flat.numel(), (40,), generator=torch.Generator().manual_seed(5))
    flat[where] = float("nan")
    words = block_words(cache, axis)
    out = torch.full((16, cache.shape[0]), 999, dtype=torch.int64)  # stale values from "earlier steps"
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):  # threads split the (run, layer) units
            torch.set_num_threads(num_threads)
            for ids in ([0, 1, 2, 3, 4], [0, 5, 6, 7, 8, 2], [11, 10, 9, 3, 4, 0, 1], [6], list(range(12))):
                want = nonfinite_counts_reference(words, torch.tensor(ids), dtype)
                total = kvsentry_ops.kv_block_nonfinite_into(words, ids, KINDS[dtype], out)
                assert torch.equal(out[:len(ids)], want), (num_threads, ids)
                assert total == int(want.sum())
    finally:
        torch.set_num_threads(threads)
    assert total == int((~torch.isfinite(cache.float())).sum()) > 0
    with pytest.raises(RuntimeError, match="out must be"):
        kvsentry_ops.kv_block_nonfinite_into(words, list(range(12)), KINDS[dtype], out[:5])
