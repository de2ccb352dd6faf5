"""Fused elementwise ops of a decoder layer: RMSNorm (optionally after the residual add),
rotary embedding and SiLU-and-multiply. csrc/cpu/cpu_fused_ops.cpp on CPU (the registry's
"fused_ops" row) -- one op where torch runs eight to sixteen
small ones per call, most of a small model's decode step at small batches -- and the torch
references below elsewhere.

The references define the results and mirror Hugging Face's modules op for op (LlamaRMSNorm:
float32 statistics, rounded to the input dtype, then times the weight; apply_rotary_pos_emb:
cos/sin rounded to the input dtype, every product and sum in it). The kernels give the same
bits (tests/csrc/test_fused_ops.py), so turning them off (KVSENTRY_DISABLE_CPU_OPS=1) changes
speed only. Where they do not run (not built, switched off), the rank reports `fused_ops` on the
torch reference at start (engine/ops/implementations.py); a single call whose tensors the
kernels do not take (another dtype or layout, autograd on) runs the reference by design.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from engine.ops import registry

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotary_reference(q: torch.Tensor, k: torch.Tensor,  # [T, Hq, D], [T, Hk, D]
                     cos: torch.Tensor, sin: torch.Tensor,  # [P, D] tables, float32 or q's dtype
                     positions: torch.Tensor,  # [T] int64
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2 I] -> [T, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


_KERNEL = registry.kernel_for("fused_ops", "cpu")


def _kernels(x: torch.Tensor) -> SimpleNamespace | None:
    """The fused ops when the kernels apply to x: a CPU float32/bf16 tensor, no autograd
    (the engine runs under inference_mode), a library that has them; else None. Kept lean:
    it runs three times per layer per step."""
    if x.device.type != "cpu" or x.dtype not in _KERNEL_DTYPES or torch.is_grad_enabled():
        return None
    if not registry.runs(_KERNEL):
        return None
    return _ops()


@functools.cache
def _ops() -> SimpleNamespace:  # the row's ops, looked up once
    return SimpleNamespace(**{name: registry.op(name) for name in _KERNEL.schemas})


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., N]
    ops = _kernels(x)
    if ops is not None and x.dim() == 2 and x.is_contiguous() and weight.dtype == x.dtype:
        return ops.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): a residual add and the next norm in one op."""
    ops = _kernels(x)
    if (ops is not None and x.dim() == 2 and x.is_contiguous() and residual.is_contiguous()
            and residual.dtype == weight.dtype == x.dtype and residual.shape == x.shape):
        return ops.add_rms_norm(x, residual, weight, eps)
    hidden = residual + x
    return rms_norm_reference(hidden, weight, eps), hidden


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """q * cos + rotate_half(q) * sin (and k alike), cos/sin rows picked by position."""
    ops = _kernels(q)
    if (ops is not None and q.dim() == 3 and k.dim() == 3 and q.stride(-1) == 1 and k.stride(-1) == 1
            and k.dtype == q.dtype and (cos.dtype == torch.float32 or cos.dtype == q.dtype)
            and sin.dtype == cos.dtype and cos.is_contiguous() and sin.is_contiguous()
            and positions.dtype == torch.int64 and positions.device.type == "cpu"):
        return ops.rotary(q, k, cos, sin, positions)
    return rotary_reference(q, k, cos, sin, positions)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused gate|up projection's output [T, 2 I]."""
    ops = _kernels(gate_up)
    if ops is not None and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        return ops.silu_and_mul(gate_up)
    return silu_and_mul_reference(gate_up)
