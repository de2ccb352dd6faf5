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
every size goes through csrc/cpu/cpu_bf16_gemm.cpp instead, with the weight packed in its panels
(and not for oneDNN: one copy). It streams the weight at memory speed for decode-sized inputs
where oneDNN's avx512_core_bf16 kernels do not, and matches them on prefill sizes: over the
default model's 30 layers on one Zen 5 core (benchmarks/bf16_gemm.py), 1.36x oneDNN at 1 row,
1.35x at 8, 1.17x at 32, 1.10x at 64, 1.0x at 128 and 1024 rows.

bfloat16 on CPUs with AVX-512F but neither AVX512-BF16 nor AMX (Intel Skylake-SP to Ice Lake, and
virtual machines that hide those flags): oneDNN's bf16 kernels there emulate the bf16 products
(~30 GFLOP/s on one Xeon core at every size), so every size goes through the panels, whose
"avx512f" kernel widens each bf16 to float32 and multiplies with FMAs (benchmarks/bf16_gemm.py,
30 layers, one Xeon core with the flags hidden: 1.58x oneDNN at 1 row, 3.6x at 8, 4.2x at 32,
4.4x at 64 and 256 rows, ~136 GFLOP/s); GGUF blocks go through the float32 GEMM, on their values
rounded to bf16 (--quant: 1.68x, 3.5x, 4.2x, 4.8x, 4.7x; 4.1x at 1024 rows).

bfloat16 on CPUs with AMX (Intel Sapphire Rapids and later): the same panels through AMX tiles
for steps of up to AMX_PANEL_MAX_ROWS rows, oneDNN's AMX kernels beyond, so both copies are
kept (the linears' bf16 weights twice; KVSENTRY_DISABLE_AMX_PANELS=1 keeps oneDNN's alone). On
one Xeon core, the default model's 30 layers: 1.43x oneDNN at 1 row, 1.37x at 8, 1.19x at 32,
1.12x at 64, but 0.88x at 128 and 0.55x at 1024 rows, where oneDNN's blocking reaches 1.1-1.2
TFLOP/s.

From a GGUF checkpoint (the default model), a Q4_1 or Q8_0 linear's panels are its own blocks
(csrc/cpu/cpu_quant_panels.h), which the same GEMMs dequantize block by block as they go: the
products of the very values the dequantized weight holds (checked bit for bit when packing),
from 0.625 (Q4_1) or 1.06 (Q8_0) bytes a weight instead of 2 (bf16) or 4 (float32). A decode
step streams its weights, so on one Xeon core the default model's 30 layers at 1 row take
9.0 instead of 17.3 ms in bf16 (its Q8_0 LM head 2.9 instead of 4.4), 12.9 instead of 20.7 ms
at 32 rows, 18.7 instead of 24.6 ms at 64; float32 8.0 instead of 27.2 ms at 1 row (a row
tile of up to 6 rows dequantizes each block into L1 right before its multiply-adds), 11.1
instead of 40.4 ms at 4 rows, 14.9 instead of 39.7 ms at 8 (up to 32 rows, each block once for
all the row tiles).

On AMX CPUs (which all have AVX512-VBMI) a bf16 linear's Q4_1 blocks take the rows layout instead
(rows_layout; csrc/cpu/cpu_quant_panels.h): the weight as the tiles' A operand, each output's block
looked up from its 16 values, ~5 vector instructions per 32 weights where the panel layout takes ~9.
The same bits; the default model's 30 layers 7.99 instead of 10.15 ms at 1 row, 9.61 instead of
11.03 at 8, 23.6 instead of 26.7 at 64 (docs/kernels.md).

On CPUs with AVX512-BF16 but no AMX, a bf16 GGUF linear keeps its dense bf16 panels beside
the blocks instead of oneDNN's copy (the same bytes): the blocks run steps of up to
QUANT_ROWS_BESIDE_DENSE rows, where the weight's bytes decide, and the dense panels every larger
step, where dequantizing each block again costs more than the bytes it saves and where the
panels are at least as fast as oneDNN. One Zen 4 core, the default model's 30 layers
(benchmarks/bf16_gemm.py, with and without --quant, before the 7-row tiles of
csrc/cpu/cpu_bf16_gemm.cpp, which both kinds of panels use; dense panels / blocks / oneDNN ms): 1 row
8.8 / 8.1 / 16.3, 2 rows 9.1 / 8.4 / 17.6, 3 rows 8.8 / 10.6 / 14.5, 8 rows 11.6 / 13.9 / 18.0,
32 rows 35.1 / 37.7 / 40.6, 128 rows 129 / 137 / 135, 1024 rows 1015 / - / 1024; its Q8_0 LM
head (49152 x 576) 2.34 / 2.28 ms at 1 row, 3.10 / 3.85 at 8, 17.8 / 18.5 at 64. The two give
the same bits (the same products of the same values, summed in the same order).

float32 on CPUs with AVX-512: steps of up to F32_PANEL_MAX_ROWS rows go through
csrc/cpu/cpu_f32_gemm.cpp's 64-output panels, oneDNN beyond, both copies kept
(KVSENTRY_DISABLE_F32_PANELS=1 keeps oneDNN's alone, half the memory). On one Xeon core, the
default model's 30 layers: 1.31x oneDNN at 1 row (12.6 vs 9.7 GB/s of the weights), 1.16x at
8, 1.13x at 32, 1.08x at 64, 0.94x at 128 and 0.97x at 1024 rows.
"""
from __future__ import annotations

import torch

import logging

from engine import envs
from engine.gguf.weights import PANEL_TYPES, QuantRows
from engine.models.int8_linear import Int8Blocks, Int8Parts, blocks_of as int8_blocks_of, takes as int8_takes
from engine.models.int8_reference import Q4_1, block_values, weight_blocks
from engine.ops import cpu_ops, registry
from engine.ops.registry import ONEDNN
from engine.memory.huge_pages import to_huge_pages

log = logging.getLogger(__name__)

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
# Rows up to which the AMX panels run a bf16 linear where oneDNN is there too (see above).
AMX_PANEL_MAX_ROWS = 64
# Rows up to which the float32 panels run a float32 linear (oneDNN beyond; see above).
F32_PANEL_MAX_ROWS = 64
# The same for GGUF-quantized panels, which read a third (bf16) or a sixth (float32) of the
# bytes: on one Xeon core, the default model's 30 layers against oneDNN's bf16 AMX kernels
# 1.53x at 64 rows, 1.29x at 96, 1.10x at 128, 0.88x at 192; float32 1.44x at 64, 1.14x at
# 128, 1.11x at 192, 1.02x at 256. A continuous batch of 64 decodes and a prompt's chunk (and
# its LM head on 65 rows) lies past 64.
QUANT_PANEL_MAX_ROWS = {torch.bfloat16: 128, torch.float32: 256}
# Rows up to which a bf16 GGUF linear runs from its blocks where dense panels serve larger
# steps (dense_panels_beside_quant; measured above).
QUANT_ROWS_BESIDE_DENSE = 2


# The panel GEMM of each dtype (a registry row): its ops <name>_pack / <name> / <name>_supported.
_PANEL_OPS = {torch.bfloat16: "bf16_gemm", torch.float32: "f32_gemm"}
# GGML types whose blocks serve as panels (engine/gguf/weights.py's PANEL_TYPES), by name.
_GGML_NAMES = {3: "q4_1", 8: "q8_0"}


def panels_supported(weight: torch.Tensor) -> bool:
    """Whether a linear of `weight` can run through panels: csrc/cpu/cpu_bf16_gemm.cpp for bf16
    (AMX, AVX512-BF16, or AVX-512F alone), csrc/cpu/cpu_f32_gemm.cpp for float32 (AVX-512F)."""
    name = _PANEL_OPS.get(weight.dtype)
    if name is None or weight.device.type != "cpu" or weight.dim() != 2 or not cpu_ops.available():
        return False
    return registry.has(name) and bool(registry.op(f"{name}_supported")())


def panel_max_rows(dtype: torch.dtype, quantized: bool = False) -> int | None:
    """The most rows a linear of `dtype` sends to its panels when oneDNN holds a copy too.
    bf16: AMX_PANEL_MAX_ROWS where the panels run on AMX, None (every size, one copy) elsewhere,
    0 where KVSENTRY_DISABLE_AMX_PANELS keeps oneDNN alone. float32: F32_PANEL_MAX_ROWS, or 0
    where KVSENTRY_DISABLE_F32_PANELS keeps oneDNN alone. `quantized` panels (GGUF blocks):
    QUANT_PANEL_MAX_ROWS in place of either limit, so that prefill keeps oneDNN's dense copy;
    bf16 on CPUs with AVX512-BF16 and no AMX: QUANT_ROWS_BESIDE_DENSE, with dense panels
    instead of oneDNN beyond (dense_panels_beside_quant)."""
    if dtype == torch.float32:
        dense = 0 if envs.disable_f32_panels() else F32_PANEL_MAX_ROWS
    elif not bf16_panels_on_amx():
        dense = None
    else:
        dense = 0 if envs.disable_amx_panels() else AMX_PANEL_MAX_ROWS
    if quantized and bf16_float32_fmas(dtype):  # no AMX there: dense is None
        return None  # oneDNN's bf16 here is an emulation: the panels serve every size (see above)
    if quantized and dense_panels_beside_quant(dtype):
        return QUANT_ROWS_BESIDE_DENSE  # dense panels beyond, not oneDNN (see above)
    return QUANT_PANEL_MAX_ROWS[dtype] if quantized and dense != 0 else dense


def bf16_float32_fmas(dtype: torch.dtype) -> bool:
    """Whether this CPU's bf16 linears multiply in float32 FMAs: AVX-512F without AVX512-BF16,
    where bf16_gemm's best kernel is "avx512f" (widened panels, or for GGUF blocks the float32
    GEMM on the values rounded to bf16)."""
    if dtype != torch.bfloat16 or not cpu_ops.available() or not registry.has("bf16_gemm_kernels"):
        return False
    kernels = registry.op("bf16_gemm_kernels")()
    return bool(kernels) and kernels[0] == "avx512f"


def dense_panels_beside_quant(dtype: torch.dtype) -> bool:
    """Whether a GGUF-quantized linear of `dtype` keeps dense panels for steps of more than
    QUANT_ROWS_BESIDE_DENSE rows, in place of oneDNN's copy: bf16 on CPUs with AVX512-BF16
    (vdpbf16ps panels) and no AMX (whose oneDNN kernels win at prefill sizes)."""
    return (dtype == torch.bfloat16 and "amx_bf16" not in cpu_ops.cpu_flags()
            and "avx512_bf16" in cpu_ops.cpu_flags() and not bf16_float32_fmas(dtype))


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


def bf16_panels_on_amx() -> bool:
    """Whether bf16_gemm runs its panels on AMX tiles here (the CPU's flags, as cpu_ops reads them,
    and the kernel's own check)."""
    return "amx_bf16" in cpu_ops.cpu_flags() and "amx" in registry.op("bf16_gemm_kernels")()


def rows_layout(dtype: torch.dtype, ggml_type: int) -> bool:
    """Whether GGUF blocks of `ggml_type` pack into the rows layout (csrc/cpu/cpu_quant_panels.h's
    quant_rows_pack) for a linear of `dtype`: Q4_1 in bf16 where bf16_gemm runs on AMX tiles and
    the CPU has AVX512-VBMI. The tiles then take the weight as their A operand, each output's
    block looked up from its 16 values: the panels' bits, at ~1.3x their speed on a decode step
    of a few rows, where dequantizing bounds it (docs/kernels.md)."""
    return (dtype == torch.bfloat16 and ggml_type == Q4_1 and not envs.disable_quant_rows()
            and registry.has("quant_rows_pack") and bool(registry.op("quant_rows_supported")())
            and bf16_panels_on_amx())


def quant_panels(weight: torch.Tensor, rows: QuantRows | None) -> torch.Tensor | None:
    """The GGUF blocks `weight` was dequantized from, packed for the panel GEMMs
    (csrc/cpu/cpu_quant_panels.h), where this CPU's GEMM of the weight's dtype takes them and they
    dequantize to exactly `weight` (checked here, once); else None."""
    if rows is None or envs.disable_quant_panels() or tuple(weight.shape) != (rows.data.shape[0], rows.k):
        return None
    if rows.ggml_type not in PANEL_TYPES:
        return None
    if not registry.has("quant_panels_pack") or not registry.op("quant_panels_supported")(weight.dtype):
        return None
    pack = "quant_rows_pack" if rows_layout(weight.dtype, rows.ggml_type) else "quant_panels_pack"
    packed = registry.op(pack)(rows.data, rows.ggml_type, rows.k)
    if not torch.equal(registry.op("quant_panels_unpack")(packed, weight.shape[0], weight.dtype), weight):
        log.warning("GGUF blocks of a %s weight do not dequantize to it; using its %s panels",
                    list(weight.shape), weight.dtype)
        return None
    return packed


class PackedLinear:
    """y = x @ W^T + b with W [out, in] packed once: in panels (panels_supported), for
    oneDNN, or both (AMX bf16, float32: panels up to `panel_max_rows` rows, oneDNN beyond; a
    bf16 GGUF linear without AMX: its blocks up to `panel_max_rows`, dense panels beyond);
    falls back to a contiguous W^T and addmm/matmul where neither is usable. Where W came
    from a GGUF checkpoint's Q4_1 or Q8_0 blocks (`rows`), the panels are those blocks, which
    the GEMMs dequantize as they go: the same products of the same values, from a third to a
    sixth of the bytes. Immutable after construction."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 rows: QuantRows | tuple[QuantRows, ...] | None = None):
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().contiguous()
        # GGUF blocks multiplied with int8 activations (engine/models/int8_linear.py): the only
        # copy of the weight, every size.
        self.int8: Int8Blocks | Int8Parts | None = None
        if int8_takes(rows, self.out_features, self.in_features):
            self.int8 = int8_blocks_of(rows, self.bias)
            self.panels = self.wide_panels = None
            self.onednn, self.panel_max_rows, self.path = False, None, self.int8.path
            return
        if not isinstance(rows, QuantRows):
            rows = None  # parts of several types serve the int8 path only
        panels = panels_supported(weight)
        # The GGUF blocks as panels, unless no panels run here (switched off: panel_max_rows 0).
        quant = quant_panels(weight, rows) if panels and panel_max_rows(weight.dtype) != 0 else None
        limit = panel_max_rows(weight.dtype, quant is not None) if panels else 0
        # Dense panels for steps past `limit`, beside the GGUF blocks (dense_panels_beside_quant).
        # bf16: [ceil(out / 64), 16 ceil(in / 32), 64, 2]; or None.
        self.wide_panels = None
        if quant is not None and dense_panels_beside_quant(weight.dtype):
            self.wide_panels = to_huge_pages(registry.op("bf16_gemm_pack")(weight))
        self.onednn = onednn_supports(weight) and limit is not None and self.wide_panels is None
        if panels and not self.onednn and self.wide_panels is None:
            limit = None  # no oneDNN copy: the panels run every size
        # Rows up to which a call runs through the panels (None: every size).
        self.panel_max_rows: int | None = limit
        # bf16: [ceil(out / 64), 16 ceil(in / 32), 64, 2]; float32: [ceil(out / 64), in, 64];
        # GGUF blocks: [ceil(out / 64), in / 32, block bytes] uint8; or None: see panels_supported.
        self.panels = None
        if panels and limit != 0:
            name = _PANEL_OPS[weight.dtype]
            packed = quant if quant is not None else registry.op(f"{name}_pack")(weight)
            # On huge pages: a decode step streams every panel from memory (engine/memory/huge_pages.py).
            self.panels = to_huge_pages(packed)
            self._panel_gemm = registry.op(name)
        if self.onednn:  # (not with wide_panels: they run those steps)
            # None: no batch-size hint; measured no slower than a hint for decode and prefill.
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        elif self.panels is None:
            self.weight_t = weight.t().contiguous()  # [in, out]: x @ W^T without a transpose per call
        # Which GEMM runs, for the start-up line and the metric (implementations.py).
        self.path = self._describe(weight.dtype, rows if quant is not None else None)

    def _describe(self, dtype: torch.dtype, rows: QuantRows | None) -> str:
        """E.g. "bf16_gemm(amx) on q4_1 blocks (rows) up to 128 rows, onednn beyond", "onednn",
        "torch_matmul" (neither panels nor oneDNN here)."""
        if self.panels is None:
            return ONEDNN if self.onednn else "torch_matmul"
        name = _PANEL_OPS[dtype]
        if dtype == torch.bfloat16:
            name += f"({registry.op('bf16_gemm_kernels')()[0]})"
        layout = " (rows)" if self.panels.dim() == 4 else ""
        small = (f"{name} on {_GGML_NAMES.get(rows.ggml_type, rows.ggml_type)} blocks{layout}" if rows
                 else f"{name} panels")
        if self.panel_max_rows is None:
            return small
        large = f"{_PANEL_OPS[dtype]} panels" if self.wide_panels is not None else ONEDNN
        return f"{small} up to {self.panel_max_rows} rows, {large} beyond"

    def uses_panels(self, rows: int) -> bool:
        """Whether a call on `rows` rows runs through the panels (else oneDNN or the fallback)."""
        return self.panels is not None and (self.panel_max_rows is None or rows <= self.panel_max_rows)

    @property
    def large_weight(self) -> torch.Tensor:
        """What a step of more than `panel_max_rows` rows runs on: the dense panels beside the
        GGUF blocks, oneDNN's weight, else the panels (or the fallback's W^T)."""
        if self.wide_panels is not None:
            return self.wide_panels
        if self.onednn:
            return self.weight
        return self.panels if self.panels is not None else self.weight_t

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if self.int8 is not None:
            return self.int8(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        panels = self.panels if self.uses_panels(x.numel() // self.in_features) else self.wide_panels
        if panels is not None:
            out = self._panel_gemm(x.reshape(-1, self.in_features), panels, self.bias, self.out_features)
            return out.view(*x.shape[:-1], self.out_features)
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [None], "")
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x.reshape(-1, self.in_features), self.weight_t).view(
            *x.shape[:-1], self.out_features)


def dense_weight(layer: torch.nn.Linear, rows: QuantRows | None) -> torch.Tensor:
    """The layer's weight [out, in]; where the loader left it shape-only (its blocks were to be
    the weight, engine/worker/loader.py) but it is fused with a part that has no blocks, the
    blocks' dequantized values (ggml's, bit for bit: engine/models/int8_reference.py)."""
    weight = layer.weight
    if rows is None or weight.numel() == 0 or weight.stride() != (0, 0):
        return weight
    values = block_values(*weight_blocks(rows.data, rows.ggml_type, rows.k))
    return values.reshape(weight.shape).to(weight.dtype)


def fused_linear(*layers: torch.nn.Linear) -> PackedLinear:
    """One PackedLinear computing the concatenated outputs of `layers` (same input):
    one pass over the activations for q|k|v or gate|up (their GGUF blocks too, where all have
    blocks of one type)."""
    quant = [getattr(layer, "gguf_rows", None) for layer in layers]
    rows = None
    if all(q is not None for q in quant) and len({(q.ggml_type, q.k) for q in quant}) == 1:
        rows = QuantRows(quant[0].ggml_type, quant[0].k, torch.cat([q.data for q in quant]),
                         all(q.int8_activations for q in quant))
    elif all(q is not None and q.int8_activations for q in quant):
        rows = tuple(quant)  # blocks of several types: parts on the int8 path (int8_linear.Int8Parts), if it takes them
    out_features = sum(layer.out_features for layer in layers)
    if int8_takes(rows, out_features, layers[0].in_features):  # the blocks are the weight: its shape will do
        weight = layers[0].weight.new_zeros(()).expand(out_features, layers[0].in_features)
    else:
        weight = torch.cat([dense_weight(layer, q) for layer, q in zip(layers, quant)])
    for layer in layers:
        layer.gguf_rows = None
    biases = [layer.bias for layer in layers]
    if all(b is None for b in biases):
        bias = None
    else:
        bias = torch.cat([b if b is not None else layer.weight.new_zeros(layer.out_features)
                          for layer, b in zip(layers, biases)])
    return PackedLinear(weight, bias, rows)



def linear_paths(model: torch.nn.Module) -> dict[str, str]:
    """{"linear.<kind>": the GEMM path} of every packed linear kind in `model` (kind: the
    attribute or module name, e.g. qkv, o_proj, gate_up, down_proj, lm_head, experts): which
    path each takes is decided at load, so it is reported once (engine/ops/implementations.py)."""
    found: dict[str, set[str]] = {}
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, PackedLinear):
                kind = name.rsplit(".", 1)[-1] if attr == "packed" else attr
                found.setdefault(f"linear.{kind}", set()).add(value.path)
            elif attr == "packed" and isinstance(value, list):  # stacked experts: (gate|up, down) each
                for linear in (x for pair in value for x in pair):
                    found.setdefault("linear.experts", set()).add(linear.path)
    return {kind: " | ".join(sorted(paths)) for kind, paths in sorted(found.items())}
