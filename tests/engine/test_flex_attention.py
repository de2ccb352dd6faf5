"""FlexAttention paged decode (engine/ops/flex_attention.py) against the torch reference
(engine/ops/attention.py's decode_attention_reference), on CPU: random caches in both layouts,
GQA, ragged lengths, block tables with null entries, and a NaN planted in the null block
spreading to exactly the rows the reference spreads it to."""
from __future__ import annotations

import pytest
import torch

from engine.ops import flex_attention
from engine.ops.attention import AttentionMetadata, DecodePlan, decode_attention_reference
from engine.ops.attention_backends import paged_attention
from engine.paging import NULL_BLOCK_ID, PAD_SLOT_ID

pytestmark = pytest.mark.skipif(not flex_attention.available(), reason="torch has no FlexAttention")

BLOCK_SIZE = 4
NUM_BLOCKS = 40


def make_cache(num_kv_heads: int, head_dim: int, head_major: bool, generator: torch.Generator) -> torch.Tensor:
    """[NUM_BLOCKS, BLOCK_SIZE, Hkv, D] random, block 0 zero; head-major storage as on CPU, else block-major."""
    if head_major:
        storage = torch.randn(num_kv_heads, NUM_BLOCKS, BLOCK_SIZE, head_dim, generator=generator)
        cache = storage.permute(1, 2, 0, 3)
    else:
        cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim, generator=generator)
    cache[NULL_BLOCK_ID].zero_()
    return cache


def make_tables(seq_lens: list[int], num_read: int) -> torch.Tensor:  # [B, num_read] int32
    """Each row's own blocks (distinct, never the null block), then the null block."""
    tables = torch.full((len(seq_lens), num_read), NULL_BLOCK_ID, dtype=torch.int32)
    next_block = 1
    for row, length in enumerate(seq_lens):
        blocks = -(-length // BLOCK_SIZE)
        tables[row, :blocks] = torch.arange(next_block, next_block + blocks, dtype=torch.int32)
        next_block += blocks
    assert next_block <= NUM_BLOCKS
    return tables


def one_group(batch: int, num_read: int) -> DecodePlan:
    """The reference plan in which every row reads `num_read` entries, as the flex op does."""
    return DecodePlan(reads=torch.full((batch,), num_read, dtype=torch.int32), num_read=num_read,
                      groups=[(list(range(batch)), num_read)])


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("head_major", [False, True])
def test_matches_the_reference(num_heads, num_kv_heads, head_major):
    generator = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads + head_major)
    head_dim, num_read = 16, 8
    seq_lens = [1, 5, 32, 17, 3, 8]  # 1 token, partial blocks, a full table, exact block multiples
    key_cache = make_cache(num_kv_heads, head_dim, head_major, generator)
    value_cache = make_cache(num_kv_heads, head_dim, head_major, generator)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=generator)
    tables = make_tables(seq_lens, num_read)
    lengths = torch.tensor(seq_lens)
    expected = decode_attention_reference(query, key_cache, value_cache, tables, lengths,
                                          one_group(len(seq_lens), num_read), 0.25)
    got = flex_attention.paged_decode_attention(query, key_cache, value_cache, tables, lengths, 0.25)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_padded_row_comes_out_zero():
    generator = torch.Generator().manual_seed(1)
    key_cache = make_cache(2, 8, False, generator)
    value_cache = make_cache(2, 8, False, generator)
    tables = make_tables([6, 0, 0], 4)
    out = flex_attention.paged_decode_attention(torch.randn(3, 4, 8, generator=generator), key_cache, value_cache,
                                                tables, torch.tensor([6, 0, 0]), 0.5)
    assert out[1:].eq(0).all() and out[0].ne(0).any()


def test_a_nan_in_the_null_block_spreads_as_in_the_reference():
    """Rows shorter than the table width read the null block (and mask it after the read): a NaN
    planted there ruins them; the rows whose tables hold no null entry (a full table, or a
    last block only partly filled) are untouched. The same rows go NaN in the reference."""
    generator = torch.Generator().manual_seed(2)
    num_read, seq_lens = 4, [16, 5, 13, 1]  # rows 0 and 2 need all 4 table entries
    key_cache = make_cache(2, 8, False, generator)
    value_cache = make_cache(2, 8, False, generator)
    key_cache[NULL_BLOCK_ID] = float("nan")
    value_cache[NULL_BLOCK_ID] = float("nan")
    query = torch.randn(len(seq_lens), 4, 8, generator=generator)
    tables, lengths = make_tables(seq_lens, num_read), torch.tensor(seq_lens)
    got = flex_attention.paged_decode_attention(query, key_cache, value_cache, tables, lengths, 0.3)
    expected = decode_attention_reference(query, key_cache, value_cache, tables, lengths,
                                          one_group(len(seq_lens), num_read), 0.3)
    rows_nan = got.isnan().flatten(1).any(1).tolist()
    assert rows_nan == expected.isnan().flatten(1).any(1).tolist() == [False, True, False, True]
    torch.testing.assert_close(got[0::2], expected[0::2], rtol=1e-5, atol=1e-5)


def test_paged_attention_sends_fixed_shape_metadata_to_flex():
    """AttentionMetadata.fixed_decode (a CUDA-graph step) goes to the flex op whole: real rows as
    the reference computes them, padded rows (length 0, null table, PAD_SLOT_ID) zero."""
    generator = torch.Generator().manual_seed(3)
    num_read, seq_lens = 6, [9, 24, 2]
    key_cache = make_cache(2, 8, True, generator)
    value_cache = make_cache(2, 8, True, generator)
    size = 5  # 3 requests padded to 5 rows
    tables = torch.zeros(size, num_read, dtype=torch.int32)
    tables[:3] = make_tables(seq_lens, num_read)
    lengths = torch.tensor(seq_lens + [0, 0])
    slots = torch.tensor([1, 2, 3, PAD_SLOT_ID, PAD_SLOT_ID])
    meta = AttentionMetadata.fixed_decode(slots, torch.arange(size + 1), lengths, tables)
    assert meta.fixed_shape and meta.num_decodes == size
    query = torch.randn(size, 4, 8, generator=generator)
    got = paged_attention(query, key_cache, value_cache, meta, 0.35)
    expected = decode_attention_reference(query[:3], key_cache, value_cache, tables[:3], lengths[:3],
                                          one_group(3, num_read), 0.35)
    torch.testing.assert_close(got[:3], expected, rtol=1e-5, atol=1e-5)
    assert got[3:].eq(0).all()
