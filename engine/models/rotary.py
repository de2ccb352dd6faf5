"""Rotary position embeddings: the rope settings of a config.json, the inverse frequencies
of every scaling type transformers implements here (default, linear, llama3, yarn), and the
rotate-half (GPT-NeoX) application. Matches transformers' `ROPE_INIT_FUNCTIONS` in float32."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.ops import fused_ops


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """Rope settings from either the classic (rope_theta + rope_scaling) or the
    transformers-5 (rope_parameters) form of config.json."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    params.update({k: v for k, v in scaling.items() if k not in params})
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    params.setdefault("max_position_embeddings", hf.get("max_position_embeddings", 2048))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    return params


def inverse_frequencies(dim: int, params: dict[str, Any], max_positions: int = 2048) -> tuple[torch.Tensor, float]:
    """[dim // 2] float32 inverse frequencies and the attention scaling factor."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(params["factor"])
        low_freq_factor = float(params["low_freq_factor"])
        high_freq_factor = float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return yarn_inverse_frequencies(dim, params, max_positions)
    raise ValueError(f"rope_scaling: unsupported rope type {rope_type!r} "
                     "(supported: default, linear, llama3, yarn)")


class RotaryEmbedding(nn.Module):
    """cos/sin tables indexed by position; applied in the rotate-half (GPT-NeoX) layout."""

    def __init__(self, dim: int, max_positions: int, params: dict[str, Any]):
        super().__init__()
        inv_freq, scaling = inverse_frequencies(dim, params, params.get("max_position_embeddings", max_positions))
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)          # [max_positions, dim // 2]
        emb = torch.cat([freqs, freqs], dim=-1)           # [max_positions, dim]
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor,  # [num_tokens]
                q: torch.Tensor,                # [num_tokens, num_heads, dim]
                k: torch.Tensor,                # [num_tokens, num_kv_heads, dim]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q * cos + rotate_half(q) * sin (k alike), cos/sin rounded to q's dtype: one fused op on
        CPU (engine/ops/fused_ops.py), the same bits as transformers' apply_rotary_pos_emb."""
        return fused_ops.rotary(q, k, self.cos, self.sin, positions)


rotate_half = fused_ops.rotate_half  # [-x2, x1]: DeepSeek's rope applies it too


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inverse_frequencies(dim: int, params: dict[str, Any], max_position_embeddings: int,
                             ) -> tuple[torch.Tensor, float]:
    """transformers' `_compute_yarn_parameters`: [dim // 2] inverse frequencies, cos/sin scale."""
    base = float(params["rope_theta"])
    original = params.get("original_max_position_embeddings") or max_position_embeddings
    factor = params.get("factor") or max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor
