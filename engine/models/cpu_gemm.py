"""CPU linear layers through oneDNN with the weight prepacked once at load time.

torch's F.linear on CPU calls MKL's sgemm, which re-lays-out the weight on every
call and, on AMD CPUs, does not take its AVX-512 kernels. oneDNN (bundled with
torch as MKL-DNN) picks its kernel from the CPU's feature flags and, given a
weight reordered into its blocked layout once, skips that work per call. This is
what torch.compile's CPU backend and vLLM's CPU backend do too. Measured on this
project's 2-core AMD EPYC dev machine, 1 thread, float32:
LM head 32x256 @ 256x32000 16 ms -> 7 ms; prefill MLP 4096x256 @ 256x1376 34 ms -> 29 ms.

Results differ from MKL's in the last bits (another summation order, ~1e-6 of a
float32 logit), like any two BLAS libraries do.

bfloat16 on CPUs with AVX512-BF16 but no AMX (AMD Zen 4/5, Intel before Sapphire Rapids):
every size goes through csrc/cpu_bf16_gemm.cpp instead, with the weight packed in its panels
(and not for oneDNN: one copy). It streams the weight at memory speed for decode-sized inputs
where oneDNN's avx512_core_bf16 kernels do not, and matches them on prefill sizes: over the
default model's 30 layers on one Zen 5 core (benchmarks/bf16_gemm.py), 1.36x oneDNN at 1 row,
1.35x at 8, 1.17x at 32, 1.10x at 64, 1.0x at 128 and 1024 rows. Where the CPU has AMX,
oneDNN's AMX kernels run every size.
"""
from __future__ import annotations

import functools

import torch

from engine.ops import cpu_ops

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def panels_supported(weight: torch.Tensor) -> bool:
    """Whether a linear of `weight` runs through the bf16 panel GEMM (csrc/cpu_bf16_gemm.cpp)."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if "amx_bf16" in _cpu_flags() or not cpu_ops.available():
        return False
    return hasattr(torch.ops.kvsentry, "bf16_gemm") and bool(torch.ops.kvsentry.bf16_gemm_supported())


def onednn_supports(weight: torch.Tensor) -> bool:
    """Whether `weight` can be prepacked here: a CPU float32 (or bf16, where the CPU has
    bf16 instructions) matrix and a torch built with MKL-DNN."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in _ONEDNN_DTYPES:
        return False
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return True


class PackedLinear:
    """y = x @ W^T + b with W [out, in] packed once: in bf16 panels (panels_supported), else for
    oneDNN; falls back to a contiguous W^T and addmm/matmul where neither is usable. One copy of
    the weight either way. Immutable after construction."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().contiguous()
        # [ceil(out / 64), ceil(in / 2), 64, 2] bf16, or None: see panels_supported.
        self.panels = torch.ops.kvsentry.bf16_gemm_pack(weight) if panels_supported(weight) else None
        self.onednn = self.panels is None and onednn_supports(weight)
        if self.onednn:
            # None: no batch-size hint; measured no slower than a hint for decode and prefill.
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        elif self.panels is None:
            self.weight_t = weight.t().contiguous()  # [in, out]: x @ W^T without a transpose per call

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.panels is not None:
            out = torch.ops.kvsentry.bf16_gemm(x.reshape(-1, self.in_features), self.panels, self.bias,
                                               self.out_features)
            return out.view(*x.shape[:-1], self.out_features)
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [None], "")
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x.reshape(-1, self.in_features), self.weight_t).view(
            *x.shape[:-1], self.out_features)


def fused_linear(*layers: torch.nn.Linear) -> PackedLinear:
    """One PackedLinear computing the concatenated outputs of `layers` (same input):
    one pass over the activations for q|k|v or gate|up."""
    weight = torch.cat([layer.weight for layer in layers])
    biases = [layer.bias for layer in layers]
    if all(b is None for b in biases):
        bias = None
    else:
        bias = torch.cat([b if b is not None else layer.weight.new_zeros(layer.out_features)
                          for layer, b in zip(layers, biases)])
    return PackedLinear(weight, bias)

