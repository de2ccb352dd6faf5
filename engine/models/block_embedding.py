"""A token embedding kept as its GGUF blocks (Q4_0, Q4_1, Q8_0), for a GGUF checkpoint on the
int8-activation path (engine/models/int8_linear.py): a lookup dequantizes only the rows it
gathers, to the very values of the dequantized table (d * q, d * q + m in float32, as ggml's
reference and the gguf package compute them), so the rank holds the file's bytes, not a dense
copy (49152 x 576 float32 is 113 MB for the default model, whose whole file is 98 MB)."""
from __future__ import annotations

import torch
from torch import nn

from engine.gguf.weights import QuantRows
from engine.models.int8_reference import INT8_TYPES, weight_blocks


class BlockEmbedding(nn.Module):
    def __init__(self, rows: QuantRows, dtype: torch.dtype):
        super().__init__()
        self.ggml_type, self.embedding_dim, self.dtype = rows.ggml_type, rows.k, dtype
        self.num_embeddings = rows.data.shape[0]
        self.register_buffer("blocks", rows.data, persistent=False)  # [vocab, K / 32 * block bytes] uint8

    @staticmethod
    def takes(rows: QuantRows | None, embedding: nn.Module) -> bool:
        return (isinstance(embedding, nn.Embedding) and rows is not None and rows.ggml_type in INT8_TYPES
                and tuple(embedding.weight.shape) == (rows.data.shape[0], rows.k))

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., hidden]
        quants, scales, minima = weight_blocks(self.blocks[input_ids.reshape(-1)], self.ggml_type, self.embedding_dim)
        values = scales[..., None] * quants  # [tokens, K / 32, 32]
        if minima is not None:
            values = values + minima[..., None]
        return values.reshape(*input_ids.shape, self.embedding_dim).to(self.dtype)
