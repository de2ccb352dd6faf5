"""The int8-activation GEMM of GGUF blocks, in torch: the arithmetic csrc/cpu/cpu_int8_gemm.cpp
runs, written out so that the kernel is held to it bit for bit (tests/csrc/test_int8_gemm.py),
and what runs where that kernel does not (no AVX512-VNNI).

y[m, n] = sum over blocks b of K (32 values each), in order b = 0, 1, ...:
    Q4_0, Q8_0: (dw[n, b] * dx[m, b]) * isum[m, n, b]
    Q4_1:       (dw[n, b] * dx[m, b]) * isum[m, n, b] + mw[n, b] * sx[m, b]
where the activations are quantized per block as llama.cpp's Q8_0 / Q8_1 do it:
    dx = max |x| / 127, q = round_half_even(x * (1 / dx)) (0 where dx is 0), sx = dx * sum(q),
isum is the exact integer dot product of the block's weight quants (Q4_0: nibble - 8; Q4_1:
nibble; Q8_0: int8) with q, dw and mw the block's float16 scale and minimum widened to float32.
Every product and sum is one float32 rounding (no fused multiply-add), and the sum over blocks
runs in order, so a row's result depends on nothing but that row: not on the batch it is in.
A bias is added to the sum; the result is rounded to the input's dtype.
"""
from __future__ import annotations

import torch

# GGML type ids of the formats this path multiplies by (gguf.GGMLQuantizationType).
Q4_0, Q4_1, Q8_0 = 2, 3, 8
INT8_TYPES = frozenset({Q4_0, Q4_1, Q8_0})
BLOCK_K = 32
# Bytes of one GGUF block of 32 values.
GGUF_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
TYPE_NAMES = {Q4_0: "q4_0", Q4_1: "q4_1", Q8_0: "q8_0"}


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (q [M, K / 32, 32] float32 holding int8 values, dx [M, K / 32], sx [M, K / 32])."""
    blocks = x.reshape(x.shape[0], -1, BLOCK_K)
    dx = blocks.abs().amax(-1) / 127
    inverse = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
    q = torch.round(blocks * inverse[..., None])  # half to even, as vcvtps2dq rounds
    return q, dx, dx * q.sum(-1)


def _f16(raw: torch.Tensor, at: int) -> torch.Tensor:  # [N, nb, bytes] -> [N, nb] float32
    return raw[..., at:at + 2].contiguous().view(torch.float16)[..., 0].float()


def weight_blocks(raw: torch.Tensor, ggml_type: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """raw [N, K / 32 * block bytes] uint8 -> (quants [N, K / 32, 32] float32 holding integers,
    dw [N, K / 32], mw [N, K / 32] for Q4_1 else None)."""
    n = raw.shape[0]
    blocks = raw.reshape(n, k // BLOCK_K, GGUF_BLOCK_BYTES[ggml_type])
    if ggml_type == Q8_0:
        return blocks[..., 2:].contiguous().view(torch.int8).float(), _f16(blocks, 0), None
    start = 2 if ggml_type == Q4_0 else 4
    packed = blocks[..., start:].to(torch.int32)
    nibbles = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()  # K 0-15 low, 16-31 high
    if ggml_type == Q4_0:
        return nibbles - 8, _f16(blocks, 0), None
    return nibbles, _f16(blocks, 0), _f16(blocks, 2)


def int8_gemm_reference(x: torch.Tensor,                  # [M, K] float32 or bf16
                        raw: torch.Tensor,                # [N, K / 32 * block bytes] uint8
                        ggml_type: int,
                        bias: torch.Tensor | None = None  # [N]
                        ) -> torch.Tensor:                # [M, N] in x's dtype
    m, k = x.shape
    if ggml_type not in INT8_TYPES or k % BLOCK_K:
        raise ValueError(f"int8 GEMM: GGML type {ggml_type} with K = {k} is not one of {sorted(INT8_TYPES)} "
                         "in whole blocks of 32")
    qx, dx, sx = quantize_activations(x.float())
    qw, dw, mw = weight_blocks(raw, ggml_type, k)
    # Exact: |products| <= 128 * 127 * 32 < 2^24, so float64 holds every integer sum.
    isum = torch.einsum("mbi,nbi->mnb", qx.double(), qw.double()).float()  # [M, N, nb]
    out = torch.zeros(m, raw.shape[0], dtype=torch.float32)
    for b in range(k // BLOCK_K):
        term = (dw[None, :, b] * dx[:, b, None]) * isum[:, :, b]
        if mw is not None:
            term = term + mw[None, :, b] * sx[:, b, None]
        out = out + term
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
