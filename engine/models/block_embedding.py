"""A token embedding kept as its GGUF blocks (Q4_0, Q4_1, Q8_0), for a GGUF checkpoint on the
int8-activation path (engine/models/int8_linear.py): a lookup dequantizes only the rows it
gathers, to the very values of the dequantized table (d * q, d * q + m in float32, as ggml's
reference and the gguf package compute them), so the rank holds the file's bytes, not a dense
copy (49152 x 576 float32 is 113 MB for the default model, whose whole file is 98 MB)."""
from __future__ import annotations

import torch
from torch import nn

from engine.gguf.weights import QuantRows
from engine.models.int8_reference import INT8_TYPES, Q4_0, Q4_1, Q8_0, weight_blocks


def packed_blocks(packed: torch.Tensor,  # [ceil(vocab / 16), K / 32, packed block bytes] uint8
                  ids: torch.Tensor,     # [T] int64
                  ggml_type: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows `ids` of a weight in csrc/cpu/cpu_int8_gemm.cpp's packed layout, as weight_blocks
    gives them from GGUF rows: (quants [T, K / 32, 32], scales [T, K / 32], minima or None)."""
    group, lane = ids // 16, (ids % 16)[:, None, None]
    blocks = packed[group]  # [T, K / 32, bytes]

    def f16(at: int) -> torch.Tensor:  # lane's float16 at byte `at` of each block
        index = (at + 2 * lane + torch.arange(2)).expand(-1, blocks.shape[1], -1)
        return blocks.gather(2, index).contiguous().view(torch.float16)[..., 0].float()

    q4 = ggml_type != Q8_0
    start = 64 if ggml_type == Q4_1 else 32
    k = torch.arange(16 if q4 else 32)
    index = (start + 64 * (k // 4) + k % 4 + 4 * lane).expand(-1, blocks.shape[1], -1)
    quants = blocks.gather(2, index)
    if q4:
        values = torch.cat([quants & 0x0F, quants >> 4], dim=-1).float()
        if ggml_type == Q4_0:
            values = values - 8
    else:
        values = (quants ^ 0x80).view(torch.int8).float()
    return values, f16(0), f16(32) if ggml_type == Q4_1 else None


class BlockEmbedding(nn.Module):
    """`rows`: the table's GGUF rows; or `packed`: the int8 GEMM's packed blocks of a tied LM head
    (engine/models/int8_linear.py's Int8Blocks.blocks), which then serve both: one copy."""

    def __init__(self, rows: QuantRows, dtype: torch.dtype, packed: torch.Tensor | None = None):
        super().__init__()
        self.ggml_type, self.embedding_dim, self.dtype = rows.ggml_type, rows.k, dtype
        self.num_embeddings = rows.data.shape[0]
        self.packed = packed is not None
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
        if self.packed:
            quants, scales, minima = packed_blocks(self.blocks, ids, self.ggml_type)
        else:
            quants, scales, minima = weight_blocks(self.blocks[ids], self.ggml_type, self.embedding_dim)
        values = scales[..., None] * quants  # [tokens, K / 32, 32]
        if minima is not None:
            values = values + minima[..., None]
        return values.reshape(*input_ids.shape, self.embedding_dim).to(self.dtype)
