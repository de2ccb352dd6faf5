"""Building blocks shared by every model: the step context, norms, linears, MLPs.

Each mirrors the Hugging Face module of the same name closely enough to match
it bit for bit in float32 (same op order, same upcasts).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
import torch.nn.functional as F

from engine.ops.attention import AttentionMetadata
from engine.ops.attention_backends import AttentionBackend
from engine.integrity.write_guard import WriteGuard
from engine.gguf.weights import QuantRows
from engine.models.cpu_gemm import PackedLinear, fused_linear
from engine.ops import fused_ops


@dataclass
class StepContext:
    """What every layer may read during one forward step (passed in, never global)."""
    meta: AttentionMetadata
    kv_caches: list[Any]               # per layer: (k_cache, v_cache) or an MLA latent cache
    null_block_writes: torch.Tensor    # [1] int64, writes that landed in block 0
    write_guard: WriteGuard | None = None  # the blocks this step may write; counts foreign writes
    # The attention path, chosen once per model load (engine/ops/attention_backends.py); None:
    # chosen per call for the step's tensors.
    attention: AttentionBackend | None = None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype), as transformers'
        LlamaRMSNorm: one fused op on CPU (engine/ops/fused_ops.py), same bits."""
        return fused_ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(residual + x), residual + x): the residual add fused into the norm after it."""
        return fused_ops.add_rms_norm(x, residual, self.weight, self.eps)


class Linear(nn.Linear):
    """nn.Linear (same parameter names, so checkpoints load as usual) that, once `pack`ed
    on CPU, runs through a oneDNN-prepacked weight (see cpu_gemm)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, keep_weight: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.keep_weight = keep_weight  # the weight is also read directly (MLA's absorbed decode)
        self.packed: PackedLinear | None = None
        # The GGUF blocks the weight was dequantized from, until packing (engine/worker/loader.py).
        self.gguf_rows: QuantRows | None = None

    def pack(self) -> None:
        if self.weight.numel() == 0:  # released: a fused layer computes it
            return
        self.packed = PackedLinear(self.weight, self.bias, self.gguf_rows)
        self.gguf_rows = None
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
            return self.down_proj(fused_ops.silu_and_mul(self.gate_up(x)))  # silu(gate) * up, one op on CPU
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
