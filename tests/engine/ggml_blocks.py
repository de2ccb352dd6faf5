"""GGML block formats decoded from their layout (llama.cpp's ggml-quants.c, written out
here in numpy): the reference the loader's dequantization is held to. It shares no code
with the `gguf` package, which the loader itself calls, so a wrong block size, a swapped
nibble or a misread scale in either shows up as a difference."""
from __future__ import annotations

import numpy as np


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:  # [n, bytes] -> [n, 1] float32
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def q8_0(blocks: np.ndarray) -> np.ndarray:  # [n, 34] uint8 -> [n, 32]
    return _f16(blocks, 0) * blocks[:, 2:].view(np.int8).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:  # [n, 16] -> [n, 32]: low nibbles first, then high
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)


def q4_0(blocks: np.ndarray) -> np.ndarray:  # [n, 18] -> [n, 32]
    return _f16(blocks, 0) * (_nibbles(blocks[:, 2:]) - 8)


def q4_1(blocks: np.ndarray) -> np.ndarray:  # [n, 20] -> [n, 32]: d * q + m
    return _f16(blocks, 0) * _nibbles(blocks[:, 4:]) + _f16(blocks, 2)


def _k4_scale_min(scales: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
    """Sub-block j's 6-bit scale and min, packed 8 + 8 into 12 bytes (get_scale_min_k4)."""
    if j < 4:
        return scales[:, j] & 63, scales[:, j + 4] & 63
    return ((scales[:, j + 4] & 0x0F) | ((scales[:, j - 4] >> 6) << 4),
            (scales[:, j + 4] >> 4) | ((scales[:, j] >> 6) << 4))


def q4_k(blocks: np.ndarray) -> np.ndarray:  # [n, 144] -> [n, 256]
    d, dmin, scales, qs = _f16(blocks, 0), _f16(blocks, 2), blocks[:, 4:16], blocks[:, 16:]
    out = []
    for chunk in range(4):  # 64 values: the low then the high nibbles of 32 bytes
        q = qs[:, 32 * chunk:32 * chunk + 32]
        for half, values in enumerate((q & 0x0F, q >> 4)):
            scale, minimum = _k4_scale_min(scales, 2 * chunk + half)
            out.append(d * scale[:, None] * values - dmin * minimum[:, None])
    return np.concatenate(out, axis=1)


def q5_k(blocks: np.ndarray) -> np.ndarray:  # [n, 176] -> [n, 256]: Q4_K plus a fifth bit in qh
    d, dmin, scales = _f16(blocks, 0), _f16(blocks, 2), blocks[:, 4:16]
    qh, qs = blocks[:, 16:48], blocks[:, 48:]
    out = []
    for chunk in range(4):
        q = qs[:, 32 * chunk:32 * chunk + 32]
        for half, low in enumerate((q & 0x0F, q >> 4)):
            bit = 2 * chunk + half
            values = low + (((qh >> bit) & 1) << 4)
            scale, minimum = _k4_scale_min(scales, bit)
            out.append(d * scale[:, None] * values - dmin * minimum[:, None])
    return np.concatenate(out, axis=1)


def q6_k(blocks: np.ndarray) -> np.ndarray:  # [n, 210] -> [n, 256]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales, d = blocks[:, 192:208].view(np.int8).astype(np.float32), _f16(blocks, 208)
    out = np.empty((blocks.shape[0], 256), dtype=np.float32)
    for n in range(2):  # two halves of 128 values
        low, high, sc = ql[:, 64 * n:64 * n + 64], qh[:, 32 * n:32 * n + 32], scales[:, 8 * n:8 * n + 8]
        quarters = ((low[:, :32] & 0x0F) | (((high >> 0) & 3) << 4),
                    (low[:, 32:] & 0x0F) | (((high >> 2) & 3) << 4),
                    (low[:, :32] >> 4) | (((high >> 4) & 3) << 4),
                    (low[:, 32:] >> 4) | (((high >> 6) & 3) << 4))
        for k, q in enumerate(quarters):
            for l0 in (0, 16):  # each 16 values have their own int8 scale
                s = sc[:, l0 // 16 + 2 * k][:, None]
                out[:, 128 * n + 32 * k + l0:128 * n + 32 * k + l0 + 16] = \
                    d * s * (q[:, l0:l0 + 16].astype(np.float32) - 32)
    return out


DECODERS = {"Q8_0": (q8_0, 32, 34), "Q4_0": (q4_0, 32, 18), "Q4_1": (q4_1, 32, 20),
            "Q4_K": (q4_k, 256, 144), "Q5_K": (q5_k, 256, 176), "Q6_K": (q6_k, 256, 210)}


def decode(name: str, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor of `shape` from its raw bytes in format `name`."""
    decoder, block, size = DECODERS[name]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, size)
    return decoder(blocks).reshape(shape)
