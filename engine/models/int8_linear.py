"""GGUF linears with int8 activations: the weight stays in its Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K /
Q6_K blocks (repacked once for csrc/cpu/cpu_int8_gemm.cpp, no dense copy), and each call quantizes its activations per
block of 32 to int8 and multiplies them with `vpdpbusd` (AVX512-VNNI, or the 256-bit AVX-VNNI on
CPUs without AVX-512: the same bits). That is llama.cpp's arithmetic, not the dequantized
weight's: the outputs differ from the exact path in the last bits of each block's activations,
and greedy tokens may diverge (docs/kernels.md).

Selected by --quantized-activations (EngineConfig.quantized_activations): "auto" takes it where
the kernel runs (a CPU with AVX512-VNNI or AVX-VNNI), "int8" everywhere (the torch reference,
engine/models/int8_reference.py, where the kernel does not run: the same bits, slowly), "none"
keeps the exact dequantized weights.
"""
from __future__ import annotations

import torch

from engine.gguf.weights import PANEL_TYPES, QuantRows
from engine.memory.huge_pages import to_huge_pages
from collections.abc import Sequence

from engine.models.int8_reference import INT8_TYPES, TYPE_NAMES, int8_gemm_reference
from engine.ops import registry
from engine.ops.registry import TORCH_REFERENCE

OP = "int8_gemm"


def kernel_runs() -> bool:
    """Whether csrc/cpu/cpu_int8_gemm.cpp runs here (built, AVX512-VNNI or AVX-VNNI, CPU kernels on)."""
    return registry.available(OP, "cpu")


def bf16_tiles_run(dtype: torch.dtype) -> bool:
    """Whether the exact path's bf16 linears run on AMX tiles here (bf16_gemm's "amx" kernel)."""
    return (dtype == torch.bfloat16 and registry.available("bf16_gemm", "cpu")
            and "amx" in registry.op("bf16_gemm_kernels")())


def int8_formats(setting: str, device: str, dtype: torch.dtype = torch.float32,
                 layer_types: frozenset[int] = frozenset()) -> frozenset[int]:
    """The GGML types whose linears take this path, for --quantized-activations `setting` on
    `device` in `dtype`; `layer_types`: the types of the file's decoder-layer matrices
    (GGUFFile.layer_matrix_types). "auto": all
    of them where the kernel runs, except, where the exact path's bf16 linears run on AMX tiles
    and every layer is of a type those tiles multiply from its blocks (Q4_1, Q8_0: PANEL_TYPES):
    there the exact weights beat int8 from 16 rows up (per-block scaling bounds the int8 tiles,
    docs/kernels.md) at a third of bf16's bytes. Layers of another type (Q4_0, Q5_0, the
    K-quants) would run there on dense bf16, 3-4x the file's bytes and half int8's speed at one
    request, so they take int8, and the LM head and embedding take it with them whatever their
    own type (a Q4_0 file's Q8_0 head): one path for the model, and a head multiplies one row
    per sequence, where int8 is the faster (SmolLM2's Q8_0 head on an AMX Xeon: 1.3 ms a call
    against 2.4 at 1-4 rows, 7.6 against 8.2 at 64, 18.6 against 15.8 at 128)."""
    if device != "cpu" or setting == "none":
        return frozenset()
    if setting == "int8":
        return INT8_TYPES
    if not kernel_runs():
        return frozenset()
    if bf16_tiles_run(dtype) and not layer_types & (INT8_TYPES - PANEL_TYPES):
        return INT8_TYPES - PANEL_TYPES
    return INT8_TYPES


def takes(rows: QuantRows | Sequence[QuantRows] | None, out_features: int, in_features: int) -> bool:
    """Whether a linear of these blocks (or of these parts' blocks, its outputs in order) runs on this path."""
    if rows is None:
        return False
    parts = [rows] if isinstance(rows, QuantRows) else list(rows)
    return (len(parts) > 0 and all(p.int8_activations and p.ggml_type in INT8_TYPES and p.k == in_features
                                   for p in parts)
            and sum(p.data.shape[0] for p in parts) == out_features)


def blocks_of(rows: QuantRows | Sequence[QuantRows], bias: torch.Tensor | None) -> "Int8Blocks | Int8Parts":
    """The linear of `takes`' blocks: one type's, or parts of several (a fused q|k|v whose v is
    another type, as in llama.cpp's Q4_K_M files)."""
    if isinstance(rows, QuantRows):
        return Int8Blocks(rows, bias)
    rows = list(rows)
    if len({p.ggml_type for p in rows}) == 1:
        data = torch.cat([p.data for p in rows])
        return Int8Blocks(QuantRows(rows[0].ggml_type, rows[0].k, data, True), bias)
    return Int8Parts(rows, bias)


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


class Int8Parts:
    """A linear whose outputs are the concatenated outputs of parts of different GGML types:
    y = [part(x) for part], in order. On the kernel, the parts' packed blocks lie in one uint8
    vector behind a header (csrc/cpu/cpu_int8_gemm.cpp's int8_gemm_parts), which the fused layer
    stack takes as it takes one part's blocks; on the reference, one call per part and the layers
    run the Python loop (`blocks` None). Immutable after construction."""

    def __init__(self, parts: Sequence[QuantRows], bias: torch.Tensor | None):
        sizes = [p.data.shape[0] for p in parts]
        biases = [None] * len(parts) if bias is None else list(bias.split(sizes))
        blocks = [Int8Blocks(p, b) for p, b in zip(parts, biases)]
        self.k, self.out_features, self.bias = parts[0].k, sum(sizes), bias
        self.ggml_type = None  # several
        self.kernel = all(b.kernel for b in blocks)
        names = "+".join(dict.fromkeys(TYPE_NAMES[p.ggml_type] for p in parts))
        self.path = blocks[0].path.replace(f"on {TYPE_NAMES[parts[0].ggml_type]} blocks", f"on {names} blocks")
        # Kernel: uint8 [header + the parts' packed blocks] (int8_gemm_parts'), the parts' only copy.
        self.parts: list[Int8Blocks] = []
        self.blocks: torch.Tensor | None = None
        if self.kernel:
            count = len(blocks)
            header = torch.zeros(-(-8 * (1 + 4 * count) // 64) * 8, dtype=torch.int64)
            header[0] = count
            for i, (part, n) in enumerate(zip(blocks, sizes)):
                header[1 + 4 * i:5 + 4 * i] = torch.tensor([n, *part.blocks.shape])
            self.blocks = to_huge_pages(torch.cat([header.view(torch.uint8)] + [b.blocks.reshape(-1) for b in blocks]))
            self._gemm = registry.op("int8_gemm_parts")
        else:
            self.parts = blocks

    @property
    def nbytes(self) -> int:
        if self.blocks is not None:
            return self.blocks.numel()
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        if self.blocks is not None:
            return self._gemm(x, self.blocks, self.bias, self.out_features)
        return torch.cat([part(x) for part in self.parts], dim=-1)
