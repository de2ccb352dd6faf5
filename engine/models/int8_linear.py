"""GGUF linears with int8 activations: the weight stays in its Q4_0 / Q4_1 / Q8_0 blocks (repacked
once for csrc/cpu/cpu_int8_gemm.cpp, no dense copy), and each call quantizes its activations per
block of 32 to int8 and multiplies them with `vpdpbusd` (AVX512-VNNI). That is llama.cpp's
arithmetic, not the dequantized weight's: the outputs differ from the exact path in the last
bits of each block's activations, and greedy tokens may diverge (docs/kernels.md).

Selected by --quantized-activations (EngineConfig.quantized_activations): "auto" takes it where
the kernel runs (a CPU with AVX512-VNNI), "int8" everywhere (the torch reference,
engine/models/int8_reference.py, where the kernel does not run: the same bits, slowly), "none"
keeps the exact dequantized weights.
"""
from __future__ import annotations

import torch

from engine.gguf.weights import QuantRows
from engine.memory.huge_pages import to_huge_pages
from engine.models.int8_reference import INT8_TYPES, TYPE_NAMES, int8_gemm_reference
from engine.ops import registry
from engine.ops.registry import TORCH_REFERENCE

OP = "int8_gemm"


def kernel_runs() -> bool:
    """Whether csrc/cpu/cpu_int8_gemm.cpp runs here (built, AVX512-VNNI, CPU kernels on)."""
    return registry.available(OP, "cpu")


def int8_activations(setting: str, device: str) -> bool:
    """Whether a GGUF checkpoint's quantized linears take this path, for --quantized-activations
    `setting` on `device`."""
    if device != "cpu" or setting == "none":
        return False
    return setting == "int8" or kernel_runs()


def takes(rows: QuantRows | None, out_features: int, in_features: int) -> bool:
    """Whether a linear of these blocks runs on this path."""
    return (rows is not None and rows.int8_activations and rows.ggml_type in INT8_TYPES
            and tuple(rows.data.shape[:1]) == (out_features,) and rows.k == in_features)


class Int8Blocks:
    """A linear's weight as its GGUF blocks: y = int8(x) . blocks + b. Immutable after construction."""

    def __init__(self, rows: QuantRows, bias: torch.Tensor | None):
        self.ggml_type, self.k = rows.ggml_type, rows.k
        self.out_features = rows.data.shape[0]
        self.bias = bias
        self.kernel = kernel_runs()
        # Kernel: [ceil(N / 16), K / 32, packed block bytes] uint8 (cpu_int8_gemm.cpp's layout);
        # reference: the GGUF rows [N, K / 32 * block bytes] uint8 as stored.
        if self.kernel:
            self.blocks = to_huge_pages(registry.op("int8_gemm_pack")(rows.data, rows.ggml_type, rows.k))
            self._gemm = registry.op(OP)
        else:
            self.blocks = rows.data
        implementation = registry.label(registry.kernel_for(OP, "cpu")) if self.kernel else TORCH_REFERENCE
        self.path = f"int8_gemm({implementation}) on {TYPE_NAMES[self.ggml_type]} blocks"

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        if self.kernel:
            return self._gemm(x, self.blocks, self.bias, self.out_features)
        return int8_gemm_reference(x, self.blocks, self.ggml_type, self.bias)
