"""Q4_K and Q6_K blocks written from a float weight, for test checkpoints: the `gguf` package
dequantizes the K-quants but cannot quantize to them. A plain round-to-nearest quantizer (not
llama.cpp's search for the best scales), laid out as ggml's block_q4_K and block_q6_K, so that
`gguf.dequantize` (and tests/engine/ggml_blocks.py) read the blocks back near the weight."""
from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


def _f16(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # [n] -> (float16 bytes [n, 2], float32 [n])
    half = values.astype(np.float16)
    return half.reshape(-1, 1).view(np.uint8), half.astype(np.float32)


def _steps(values: np.ndarray, unit: np.ndarray, top: int) -> np.ndarray:
    """round(values / unit) in [0, top], 0 where unit is 0: [n, s] / [n, 1] -> [n, s] int."""
    safe = np.where(unit > 0, unit, 1)
    return np.where(unit > 0, np.clip(np.round(values / safe), 0, top), 0).astype(np.int64)


def q4_k(weight: np.ndarray) -> np.ndarray:
    """[rows, k] float32, k a multiple of 256 -> [rows, k / 256 * 144] uint8.
    value = (d * sc[j]) * q - dmin * m[j], q in 0-15, per sub-block j of 32."""
    rows, k = weight.shape
    x = weight.reshape(-1, 8, 32).astype(np.float32)  # [super-blocks, sub-block, 32]
    low = np.minimum(x.min(-1), 0)
    scale, minimum = (x.max(-1) - low) / 15, -low  # [n, 8], both >= 0
    d_bytes, d = _f16(scale.max(-1) / 63)
    dmin_bytes, dmin = _f16(minimum.max(-1) / 63)
    sc, m = _steps(scale, d[:, None], 63), _steps(minimum, dmin[:, None], 63)
    step, offset = (d[:, None] * sc)[..., None], (dmin[:, None] * m)[..., None]
    q = np.where(step > 0, np.clip(np.round((x + offset) / np.where(step > 0, step, 1)), 0, 15), 0).astype(np.uint8)
    # get_scale_min_k4's packing: bytes 0-3 sc[0-3] | top bits of sc[4-7], 4-7 m[0-3] | top bits
    # of m[4-7], 8-11 the low nibbles of sc[4-7] and m[4-7].
    scales = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
                             (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)], axis=1).astype(np.uint8)
    # Bytes 32c..32c+31: sub-block 2c in the low nibbles, 2c + 1 in the high ones.
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d_bytes, dmin_bytes, scales, qs], axis=1)
    return blocks.reshape(rows, k // 256 * 144)


def q6_k(weight: np.ndarray) -> np.ndarray:
    """[rows, k] float32, k a multiple of 256 -> [rows, k / 256 * 210] uint8.
    value = (d * sc[s]) * (q - 32), q in 0-63, per sub-block s of 16."""
    rows, k = weight.shape
    x = weight.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(x).max(-1) / 31  # [n, 16]
    d_bytes, d = _f16(scale.max(-1) / 127)
    sc = _steps(scale, d[:, None], 127)
    step = (d[:, None] * sc)[..., None]
    q = (np.where(step > 0, np.clip(np.round(x / np.where(step > 0, step, 1)), -32, 31), 0) + 32).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # [n, half of 128, quarter, l]
    ql = np.concatenate([q[:, :, 0] & 0x0F | (q[:, :, 2] & 0x0F) << 4,
                         q[:, :, 1] & 0x0F | (q[:, :, 3] & 0x0F) << 4], axis=2).reshape(-1, 128)
    qh = (q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), d_bytes], axis=1)
    return blocks.reshape(rows, k // 256 * 210)


QUANTIZERS = {Q.Q4_K: q4_k, Q.Q6_K: q6_k}
