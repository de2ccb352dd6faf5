"""A token embedding kept as its GGUF blocks (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K), for a GGUF
checkpoint on the int8-activation path (engine/models/int8_linear.py): a lookup dequantizes only
the rows it gathers, to the very values of the dequantized table (d * q, d * q + m, Q4_K's
(d * sc) * q - dmin * m, Q6_K's (d * sc) * q in float32, as ggml's reference and the gguf package
compute them), so the rank holds the file's bytes, not a dense
copy (49152 x 576 float32 is 113 MB for the default model, whose whole file is 98 MB)."""
from __future__ import annotations

import torch
from torch import nn

from engine.gguf.weights import QuantRows
from engine.models.int8_reference import INT8_TYPES, Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0, block_values, weight_blocks
from engine.ops import registry

# The formats csrc/cpu/cpu_int8_rows.cpp gathers from packed blocks (blocks of 32); K-quants take
# packed_blocks, the same values through torch ops.
ROWS_OP_TYPES = frozenset({Q4_0, Q4_1, Q5_0, Q8_0})


def packed_blocks(packed: torch.Tensor,  # [ceil(vocab / 16), K / values, packed block bytes] uint8
                  ids: torch.Tensor,     # [T] int64
                  ggml_type: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows `ids` of a weight in csrc/cpu/cpu_int8_gemm.cpp's packed layout, as weight_blocks
    gives them from GGUF rows: (quants [T, K / B, B], scales [T, K / B], minima or None)."""
    group, lane = ids // 16, (ids % 16)[:, None, None]
    blocks = packed[group]  # [T, K / values, bytes]

    def take(offsets: torch.Tensor, width: int) -> torch.Tensor:
        """The lane's bytes at `offsets` [L] (those of lane 0; lane r's are `width` * r further on),
        from each packed block: [T, K / values, L] int32."""
        index = (offsets + width * lane).expand(-1, blocks.shape[1], -1)
        return blocks.gather(2, index).to(torch.int32)

    def f16(at: int) -> torch.Tensor:  # lane's float16 at byte `at` of each block: [T, K / values]
        index = (at + 2 * lane + torch.arange(2)).expand(-1, blocks.shape[1], -1)
        return blocks.gather(2, index).contiguous().view(torch.float16)[..., 0].float()

    k16 = torch.arange(16)
    nibble_offsets = 64 * (k16 // 4) + k16 % 4  # K and K + 16 of a block of 32: 4 vectors

    def nibbles(at: int) -> torch.Tensor:  # [T, K / values, 32]: K 0-15 low nibbles, 16-31 high
        quants = take(at + nibble_offsets, 4)
        return torch.cat([quants & 0x0F, quants >> 4], dim=-1)

    def high_bits(at: int, width: int) -> torch.Tensor:
        """The bits above the nibble of each K of a block (cpu_int8_gemm.cpp's place_high_bits),
        shifted into place above it: [T, K / values, 32]."""
        c, j = k16 // 4, k16 % 4
        if width == 1:
            h = take(at + torch.arange(4), 4)[..., j]  # [T, nb, 16]: K's byte
            return torch.cat([(h >> c) & 1, (h >> (4 + c)) & 1], dim=-1) << 4
        low, high = take(at + torch.arange(4), 4)[..., j], take(at + 64 + torch.arange(4), 4)[..., j]
        return torch.cat([(low >> (2 * c)) & 3, (high >> (2 * c)) & 3], dim=-1) << 4

    if ggml_type == Q4_K:  # 8 sub-blocks of 32 per super-block
        j = torch.arange(8)
        sc, m = take(64 + 16 * j, 1).float(), take(192 + 16 * j, 1).float()  # [T, nsb, 8]
        quants = torch.stack([nibbles(320 + 256 * sub) for sub in range(8)], dim=2)  # [T, nsb, 8, 32]
        scales, minima = f16(0)[..., None] * sc, -(f16(32)[..., None] * m)
        return quants.flatten(1, 2).float(), scales.flatten(1), minima.flatten(1)
    if ggml_type == Q6_K:  # 8 blocks of 32 per super-block, 16 sub-blocks of 16 with int8 scales
        sc = take(32 + 16 * torch.arange(16), 1).to(torch.int8).float()  # [T, nsb, 16]
        quants = torch.stack([nibbles(288 + 384 * b) | high_bits(288 + 384 * b + 256, 2) for b in range(8)], dim=2)
        scales = f16(0)[..., None] * sc
        return (quants - 32).reshape(quants.shape[0], -1, 16).float(), scales.flatten(1), None
    if ggml_type == Q5_0:
        return (nibbles(32) | high_bits(288, 1)).float() - 16, f16(0), None
    if ggml_type == Q8_0:
        k = torch.arange(32)
        values = (take(32 + 64 * (k // 4) + k % 4, 4).to(torch.uint8) ^ 0x80).view(torch.int8).float()
        return values, f16(0), None
    values = nibbles(64 if ggml_type == Q4_1 else 32).float()
    if ggml_type == Q4_0:
        values = values - 8
    return values, f16(0), f16(32) if ggml_type == Q4_1 else None


class BlockEmbedding(nn.Module):
    """`rows`: the table's GGUF rows; or `packed`: the int8 GEMM's packed blocks of a tied LM head
    (engine/models/int8_linear.py's Int8Blocks.blocks), which then serve both: one copy."""

    def __init__(self, rows: QuantRows, dtype: torch.dtype, packed: torch.Tensor | None = None):
        super().__init__()
        self.ggml_type, self.embedding_dim, self.dtype = rows.ggml_type, rows.k, dtype
        self.num_embeddings = rows.data.shape[0]
        self.packed = packed is not None
        # csrc's gather where it takes the format (packed blocks exist only where the kernels run).
        self._gather = registry.op("int8_gemm_rows") if self.packed and self.ggml_type in ROWS_OP_TYPES else None
        # [vocab, K / 32 * block bytes] uint8, or the packed [ceil(vocab / 16), K / 32, bytes].
        self.register_buffer("blocks", rows.data if packed is None else packed, persistent=False)

    @staticmethod
    def takes(rows: QuantRows | None, embedding: nn.Module) -> bool:
        return (isinstance(embedding, nn.Embedding) and rows is not None and rows.ggml_type in INT8_TYPES
                and tuple(embedding.weight.shape) == (rows.data.shape[0], rows.k))

    @property
    def nbytes(self) -> int:  # 0 where the LM head's blocks serve it (counted there)
        return 0 if self.packed else self.blocks.numel()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., hidden]
        ids = input_ids.reshape(-1)
        if self._gather is not None:
            values = self._gather(self.blocks, ids)  # [tokens, K] float32
            return values.reshape(*input_ids.shape, self.embedding_dim).to(self.dtype)
        if self.packed:
            quants, scales, minima = packed_blocks(self.blocks, ids, self.ggml_type)
        else:
            quants, scales, minima = weight_blocks(self.blocks[ids], self.ggml_type, self.embedding_dim)
        values = block_values(quants, scales, minima)  # [tokens, K / B, B]
        return values.reshape(*input_ids.shape, self.embedding_dim).to(self.dtype)
