"""The int8-activation GEMM of GGUF blocks, in torch: the arithmetic csrc/cpu/cpu_int8_gemm.cpp
runs, written out so that the kernel is held to it bit for bit (tests/csrc/test_int8_gemm.py),
and what runs where that kernel does not (neither AVX512-VNNI nor AVX-VNNI).

y[m, n] = sum over blocks b of K (32 values each), in order b = 0, 1, ...:
    Q4_0, Q5_0, Q8_0: (dw[n, b] * dx[m, b]) * isum[m, n, b]
    Q4_1:             (dw[n, b] * dx[m, b]) * isum[m, n, b] + mw[n, b] * sx[m, b]
    Q4_K:             (dw[n, b] * dx[m, b]) * isum[m, n, b] - mw[n, b] * sx[m, b]
    Q6_K:             (dw[n, b] * dx[m, b]) * isum[m, n, b]
where the activations are quantized per block as llama.cpp's Q8_0 / Q8_1 do it:
    dx = max |x| / 127, q = round_half_even(x * (1 / dx)) (0 where dx is 0), sx = dx * sum(q),
isum is the exact integer dot product of the block's weight quants with q, and the weight's
scales are float32:
    Q4_0: nibble - 8; Q4_1: nibble; Q5_0: (nibble | fifth bit << 4) - 16; Q8_0: int8;
          dw, mw the block's float16 scale and minimum widened to float32.
    Q4_K: nibble; block b is sub-block j = b % 8 of super-block b / 8, whose float16 d, dmin and
          6-bit sc[j], m[j] give dw = d * sc[j], mw = dmin * m[j] (one rounding each, as ggml's
          dequantization computes them).
    Q6_K: (6-bit value) - 32; block b holds two of the super-block's sub-blocks of 16 values,
          with int8 scales sa (values 0-15) and sb (16-31): isum = sa * isum_a + sb * isum_b,
          exact in integers (|isum| < 2 * 16 * 32 * 127 * 128 < 2^24, so exact in float32 too);
          dw the super-block's float16 d.
Every product and sum is one float32 rounding (no fused multiply-add), and the sum over blocks
runs in order, so a row's result depends on nothing but that row: not on the batch it is in.
A bias is added to the sum; the result is rounded to the input's dtype.
"""
from __future__ import annotations

import torch

from engine.gguf.weights import INT8_TYPES  # the set the loader keeps blocks of: one list

# GGML type ids of the formats this path multiplies by (gguf.GGMLQuantizationType).
Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K = 2, 3, 6, 8, 12, 14
assert INT8_TYPES == {Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K}
BLOCK_K = 32
# Values of one GGUF block: 32, or a K-quant's super-block of 256.
GGUF_BLOCK_VALUES = {Q4_0: 32, Q4_1: 32, Q5_0: 32, Q8_0: 32, Q4_K: 256, Q6_K: 256}
# Bytes of one GGUF block of GGUF_BLOCK_VALUES values.
GGUF_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q8_0: 34, Q4_K: 144, Q6_K: 210}
TYPE_NAMES = {Q4_0: "q4_0", Q4_1: "q4_1", Q5_0: "q5_0", Q8_0: "q8_0", Q4_K: "q4_k", Q6_K: "q6_k"}


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (q [M, K / 32, 32] float32 holding int8 values, dx [M, K / 32], sx [M, K / 32])."""
    blocks = x.reshape(x.shape[0], -1, BLOCK_K)
    dx = blocks.abs().amax(-1) / 127
    inverse = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
    q = torch.round(blocks * inverse[..., None])  # half to even, as vcvtps2dq rounds
    return q, dx, dx * q.sum(-1)


def _f16(raw: torch.Tensor, at: int) -> torch.Tensor:  # [N, nb, bytes] -> [N, nb] float32
    return raw[..., at:at + 2].contiguous().view(torch.float16)[..., 0].float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:  # [..., 16] uint8 -> [..., 32] int32: low, then high
    packed = packed.to(torch.int32)
    return torch.cat([packed & 0x0F, packed >> 4], dim=-1)


def q4_k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_K super-block's 12 scale bytes [..., 12] -> its 6-bit (sc, m) [..., 8] int32 each
    (ggml's get_scale_min_k4): bytes 0-3 / 4-7 hold sc / m of sub-blocks 0-3 in their low 6 bits
    and the top 2 bits of sub-blocks 4-7's; bytes 8-11 the low 4 bits of sub-blocks 4-7's."""
    s = scales.to(torch.int32)
    low, mid, top = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([low & 63, (top & 0x0F) | ((low >> 6) << 4)], dim=-1)
    m = torch.cat([mid & 63, (top >> 4) | ((mid >> 6) << 4)], dim=-1)
    return sc, m


def q6_k_values(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K super-blocks [..., 210] uint8 -> their 256 6-bit values [..., 256] int32 (0-63, before
    the - 32): per half of 128, ql's 64 bytes give the low 4 bits (32 values from the low nibbles
    of bytes 0-31, 32 from 32-63, then the high nibbles of both), qh's 32 bytes the top 2 bits
    (bit pairs 0-1, 2-3, 4-5, 6-7 for those four quarters)."""
    ql = blocks[..., :128].to(torch.int32).unflatten(-1, (2, 2, 32))   # [..., half, 32-byte run, l]
    qh = blocks[..., 128:192].to(torch.int32).unflatten(-1, (2, 1, 32))  # [..., half, 1, l]
    low = torch.cat([ql & 0x0F, ql >> 4], dim=-2)  # [..., half, quarter, l]
    high = (qh >> (2 * torch.arange(4)[:, None])) & 3
    return (low | (high << 4)).flatten(-3)


def weight_blocks(raw: torch.Tensor, ggml_type: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """raw [N, K / values * block bytes] uint8 -> the weight's values as ggml dequantizes them,
    scales[..., None] * quants + minima[..., None]: (quants [N, K / B, B] float32 holding
    integers, scales [N, K / B], minima [N, K / B] for Q4_1 and Q4_K (there -dmin * m) else
    None), B = 16 for Q6_K (the scale of a sub-block: d * sc in float32, as ggml), else 32."""
    n = raw.shape[0]
    blocks = raw.reshape(n, k // GGUF_BLOCK_VALUES[ggml_type], GGUF_BLOCK_BYTES[ggml_type])
    if ggml_type == Q8_0:
        return blocks[..., 2:].contiguous().view(torch.int8).float(), _f16(blocks, 0), None
    if ggml_type == Q5_0:
        fifth = (blocks[..., 2:6].contiguous().view(torch.int32) >> torch.arange(32)) & 1  # [N, nb, 32]
        return (_nibbles(blocks[..., 6:]) | (fifth << 4)).float() - 16, _f16(blocks, 0), None
    if ggml_type == Q4_K:
        sc, m = q4_k_scales(blocks[..., 4:16])  # [N, nsb, 8]
        # Sub-block 2c: the low nibbles of bytes 32c..32c+31; 2c + 1: their high nibbles.
        qs = blocks[..., 16:].to(torch.int32).unflatten(-1, (4, 1, 32))
        quants = (qs >> torch.tensor([0, 4])[:, None]) & 0x0F  # [N, nsb, 4, 2, 32]
        scales = _f16(blocks, 0)[..., None] * sc.float()
        minima = -(_f16(blocks, 2)[..., None] * m.float())
        return quants.reshape(n, -1, 32).float(), scales.reshape(n, -1), minima.reshape(n, -1)
    if ggml_type == Q6_K:
        quants = (q6_k_values(blocks) - 32).float().reshape(n, -1, 16)
        scales = _f16(blocks, 208)[..., None] * blocks[..., 192:208].contiguous().view(torch.int8).float()
        return quants, scales.reshape(n, -1), None
    start = 2 if ggml_type == Q4_0 else 4
    nibbles = _nibbles(blocks[..., start:]).float()  # K 0-15 low, 16-31 high
    if ggml_type == Q4_0:
        return nibbles - 8, _f16(blocks, 0), None
    return nibbles, _f16(blocks, 0), _f16(blocks, 2)


def _gemm_blocks(raw: torch.Tensor, ggml_type: int, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The weight per block of 32 as the GEMM multiplies it: (quants [N, K / 32, 32], dw [N, K / 32],
    mw [N, K / 32] (Q4_1: + mw * sx; Q4_K: - mw * sx) or None, Q6_K's integer scales
    [N, K / 32, 2] of the block's two halves or None)."""
    if ggml_type == Q4_K:
        quants, scales, minima = weight_blocks(raw, ggml_type, k)
        return quants, scales, -minima, None
    if ggml_type == Q6_K:
        n = raw.shape[0]
        blocks = raw.reshape(n, k // 256, 210)
        quants = (q6_k_values(blocks) - 32).float().reshape(n, -1, 32)
        halves = blocks[..., 192:208].contiguous().view(torch.int8).float().reshape(n, -1, 2)
        dw = _f16(blocks, 208).repeat_interleave(8, dim=1)  # one d per 8 blocks of 32
        return quants, dw, None, halves
    quants, dw, mw = weight_blocks(raw, ggml_type, k)
    return quants, dw, mw, None



def block_values(quants: torch.Tensor, scales: torch.Tensor, minima: torch.Tensor | None) -> torch.Tensor:
    """weight_blocks' parts -> the values ggml dequantizes them to, [N, K / B, B] float32:
    scales * quants (+ minima), each product and sum one float32 rounding."""
    values = scales[..., None] * quants
    return values if minima is None else values + minima[..., None]

def int8_gemm_reference(x: torch.Tensor,                  # [M, K] float32 or bf16
                        raw: torch.Tensor,                # [N, K / values * block bytes] uint8
                        ggml_type: int,
                        bias: torch.Tensor | None = None  # [N]
                        ) -> torch.Tensor:                # [M, N] in x's dtype
    m, k = x.shape
    if ggml_type not in INT8_TYPES or k % GGUF_BLOCK_VALUES[ggml_type]:
        raise ValueError(f"int8 GEMM: GGML type {ggml_type} with K = {k} is not one of {sorted(INT8_TYPES)} "
                         "in whole blocks (32 values; 256 for K-quants)")
    qx, dx, sx = quantize_activations(x.float())
    qw, dw, mw, halves = _gemm_blocks(raw, ggml_type, k)
    # Exact: every partial sum is an integer below 2^24, so float64 holds each one.
    if halves is None:
        isum = torch.einsum("mbi,nbi->mnb", qx.double(), qw.double()).float()  # [M, N, nb]
    else:
        qx2, qw2 = qx.double().unflatten(-1, (2, 16)), qw.double().unflatten(-1, (2, 16))
        isum = torch.einsum("mbhi,nbhi,nbh->mnb", qx2, qw2, halves.double()).float()
    out = torch.zeros(m, raw.shape[0], dtype=torch.float32)
    for b in range(k // BLOCK_K):
        term = (dw[None, :, b] * dx[:, b, None]) * isum[:, :, b]
        if ggml_type == Q4_1:
            term = term + mw[None, :, b] * sx[:, b, None]
        elif ggml_type == Q4_K:
            term = term - mw[None, :, b] * sx[:, b, None]
        out = out + term
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
