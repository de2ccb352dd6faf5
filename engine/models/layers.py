"""Building blocks shared by every model: norms, rotary embeddings, MLPs.

Each mirrors the Hugging Face module of the same name closely enough to match
it bit for bit in float32 (same op order, same upcasts).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
import torch.nn.functional as F

from engine.attention import AttentionMetadata
from engine.models.cpu_gemm import PackedLinear, fused_linear


@dataclass
class StepContext:
    """What every layer may read during one forward step (passed in, never global)."""
    meta: AttentionMetadata
    kv_caches: list[Any]               # per layer: (k_cache, v_cache) or an MLA latent cache
    null_block_writes: torch.Tensor    # [1] int64, writes that landed in block 0


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Linear(nn.Linear):
    """nn.Linear (same parameter names, so checkpoints load as usual) that, once `pack`ed
    on CPU, runs through a oneDNN-prepacked weight (see cpu_gemm)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, keep_weight: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.keep_weight = keep_weight  # the weight is also read directly (MLA's absorbed decode)
        self.packed: PackedLinear | None = None

    def pack(self) -> None:
        if self.weight.numel() == 0:  # released: a fused layer computes it
            return
        self.packed = PackedLinear(self.weight, self.bias)
        if not self.keep_weight:
            self.release()

    def release(self) -> None:
        """Drop the plain weight once a packed (or fused) copy computes this layer."""
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        return super().forward(x)


def pack_linears(model: nn.Module) -> None:
    """CPU only (the caller checks): fuse what can be fused (modules with a `fuse` method), then pack every
    remaining Linear and stacked experts (modules with a `pack` method). Run once, after
    the weights are loaded."""
    for module in model.modules():
        if module is not model and hasattr(module, "fuse"):
            module.fuse()
    for module in model.modules():
        if module is not model and callable(getattr(module, "pack", None)):
            module.pack()


class SiluMLP(nn.Module):
    """gate_proj / up_proj / down_proj with SiLU, as Llama, Qwen and DeepSeek name them."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.gate_up: PackedLinear | None = None  # [hidden] -> [2 * intermediate], see fuse()

    def fuse(self) -> None:
        """One gate|up matmul instead of two: one pass over the activations."""
        self.gate_up = fused_linear(self.gate_proj, self.up_proj)
        self.gate_proj.release()
        self.up_proj.release()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
        from engine.models.deepseek import yarn_inverse_frequencies
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
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
