"""GGUF tensors -> Hugging Face-named float32 tensors.

Three things llama.cpp's converter did are undone here:
- names: `blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight` (tables below);
- experts stacked into one [num_experts, ...] tensor per projection -> one tensor per expert
  (only the experts this rank wants are dequantized);
- for `llama` (and Mixtral, written as `llama`), the rows of q_proj and k_proj permuted from
  the rotate-half rope layout into adjacent pairs; DeepSeek's kv_b_proj split into k_b
  (transposed) and v_b.
Quantized blocks go through `gguf.dequantize` (ggml's own reference numpy code).
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
from tqdm import tqdm

from engine.gguf.reader import GGUFFile, TensorInfo

# blk.N.<key> -> the module under model.layers.N
_LAYER_MODULES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
}
# Where an architecture names a module differently from the table above.
_ARCH_MODULES = {
    "MixtralForCausalLM": {"ffn_gate_inp": "block_sparse_moe.gate"},
    "DeepseekV2ForCausalLM": {f"ffn_{p}_shexp": f"mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down")},
    "DeepseekV3ForCausalLM": {f"ffn_{p}_shexp": f"mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down")},
}
# Stacked experts: blk.N.ffn_<p>_exps -> (module prefix, per-expert projection name).
_EXPERTS = {"ffn_gate_exps": ("mlp.experts", "gate_proj"), "ffn_up_exps": ("mlp.experts", "up_proj"),
            "ffn_down_exps": ("mlp.experts", "down_proj")}
_MIXTRAL_EXPERTS = {"ffn_gate_exps": ("block_sparse_moe.experts", "w1"),
                    "ffn_up_exps": ("block_sparse_moe.experts", "w3"),
                    "ffn_down_exps": ("block_sparse_moe.experts", "w2")}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_DERIVED = {"rope_freqs.weight"}  # read into the config (rope scaling), not a parameter
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

Wants = Callable[[str], bool]
# GGML types (Q4_1, Q8_0) whose blocks the CPU GEMMs multiply by directly (csrc/cpu/cpu_quant_panels.h).
PANEL_TYPES = frozenset({3, 8})
# GGML types (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) the int8-activation GEMM multiplies by
# (engine/models/int8_reference.py, which takes this set; this package imports nothing of the models').
INT8_TYPES = frozenset({2, 3, 6, 8, 12, 14})


@dataclass(frozen=True)
class QuantRows:
    """A 2-D GGUF tensor's rows as stored: `data` [N, K / block values * block bytes] uint8 of
    GGML type `ggml_type` (blocks of 32 values, or a K-quant's super-blocks of 256), in the row
    order of the dequantized HF tensor (q/k unpermuted as it is)."""
    ggml_type: int
    k: int
    data: torch.Tensor
    # Multiply by these blocks with int8 activations (--quantized-activations), not the
    # dequantized weight: set by the loader from the config.
    int8_activations: bool = False


def quant_rows(gguf: GGUFFile, info: TensorInfo) -> QuantRows | None:
    """A 2-D tensor's blocks, copied out of the map, where its type is one of PANEL_TYPES or
    INT8_TYPES and its rows are whole blocks (a K-quant's row of K not a multiple of 256 is not:
    None, and the tensor is used dequantized)."""
    if len(info.shape) != 2 or info.ggml_type not in PANEL_TYPES | INT8_TYPES:
        return None
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info.ggml_type)]
    n, k = info.shape
    if k % block_size:
        return None
    raw = gguf.raw_bytes(info, n * (k // block_size) * type_size).reshape(n, -1)
    return QuantRows(info.ggml_type, k, torch.from_numpy(np.array(raw)))


def dequantize(gguf: GGUFFile, info: TensorInfo, index: int | None = None) -> torch.Tensor:
    """The tensor (or, for a stacked tensor, its slice `index` along dim 0) as float32."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf import dequantize as ggml_dequantize

    try:
        qtype = GGMLQuantizationType(info.ggml_type)
    except ValueError:
        raise ValueError(f"{gguf.path}: tensor {info.name!r} has unknown GGML type {info.ggml_type}") from None
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if info.shape[-1] % block_size:
        raise ValueError(f"{gguf.path}: tensor {info.name!r} rows of {info.shape[-1]} do not fill "
                         f"{qtype.name} blocks of {block_size}")
    row_bytes = info.shape[-1] // block_size * type_size
    num_rows = int(np.prod(info.shape[:-1], dtype=np.int64))
    raw = gguf.raw_bytes(info, num_rows * row_bytes).reshape(*info.shape[:-1], row_bytes)
    if index is not None:
        raw = raw[index]
    try:
        values = ggml_dequantize(np.asarray(raw), qtype)
    except NotImplementedError:
        raise ValueError(f"{gguf.path}: tensor {info.name!r} is {qtype.name}, which the gguf package "
                         "cannot dequantize") from None
    values = values.reshape(raw.shape[:-1] + (info.shape[-1],))
    if not values.flags.writeable:  # F32 comes back as a view of the read-only map
        values = values.copy()
    return torch.from_numpy(values.astype(np.float32, copy=False))


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head it interleaves the two rotate-half
    halves (rows 0, d/2, 1, d/2+1, ...) so ggml can rotate adjacent pairs; HF keeps halves."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


class _Converter:
    def __init__(self, gguf: GGUFFile, hf: dict[str, Any], wants: Wants, quantized: dict[str, QuantRows] | None,
                 blocks_only: Callable[[str, int], bool]):
        self.gguf, self.hf, self.wants, self.quantized = gguf, hf, wants, quantized
        self.blocks_only = blocks_only
        self.architecture = hf["architectures"][0]
        self.modules = {**_LAYER_MODULES, **_ARCH_MODULES.get(self.architecture, {})}
        self.experts = _MIXTRAL_EXPERTS if self.architecture == "MixtralForCausalLM" else _EXPERTS
        # llama.cpp permutes q/k for its `llama` architecture only (Qwen and DeepSeek keep HF's order).
        self.permuted = gguf.architecture == "llama"

    def convert(self, info: TensorInfo) -> Iterator[tuple[str, torch.Tensor]]:
        if info.name in _DERIVED:
            return
        if info.name in _GLOBAL:
            name = _GLOBAL[info.name]
            if self.wants(name) and not self._keep_rows(name, info, lambda rows: rows):
                yield name, dequantize(self.gguf, info)
            return
        match = _BLOCK_NAME.fullmatch(info.name)
        if match is None:
            raise ValueError(f"{self.gguf.path}: GGUF tensor {info.name!r} has no Hugging Face name")
        layer, key, suffix = int(match.group(1)), match.group(2), match.group(3)
        prefix = f"model.layers.{layer}"
        if key in self.experts:
            module, proj = self.experts[key]
            for expert in range(info.shape[0]):
                name = f"{prefix}.{module}.{expert}.{proj}.{suffix}"
                if self.wants(name):
                    yield name, dequantize(self.gguf, info, expert)
        elif key == "exp_probs_b":
            name = f"{prefix}.mlp.gate.e_score_correction_bias"
            if self.wants(name):
                yield name, dequantize(self.gguf, info)
        elif key in ("attn_k_b", "attn_v_b"):
            name = f"{prefix}.self_attn.kv_b_proj.weight"
            if key == "attn_k_b" and f"blk.{layer}.attn_kv_b.weight" not in self.gguf.tensors and self.wants(name):
                yield name, self._kv_b(layer)
        elif key in self.modules:
            name = f"{prefix}.{self.modules[key]}.{suffix}"
            if self.wants(name) and not self._keep_rows(name, info, lambda rows: self._fix_layout(key, rows)):
                yield name, self._fix_layout(key, dequantize(self.gguf, info))
        else:
            raise ValueError(f"{self.gguf.path}: GGUF tensor {info.name!r} has no Hugging Face name "
                             f"for {self.architecture}")

    def _keep_rows(self, name: str, info: TensorInfo, layout: Callable[[torch.Tensor], torch.Tensor]) -> bool:
        """Record the tensor's blocks, rows laid out as its dequantized values are, when asked to.
        True where the blocks are all the model needs (`blocks_only`): then it is not dequantized."""
        rows = quant_rows(self.gguf, info) if self.quantized is not None else None
        if rows is None:
            return False
        data = layout(rows.data)
        if data.shape != rows.data.shape:  # not a row permutation: the dense tensor it is
            return False
        self.quantized[name] = QuantRows(rows.ggml_type, rows.k, data.contiguous())
        return rows.ggml_type in INT8_TYPES and self.blocks_only(name, rows.ggml_type)

    def _fix_layout(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        if self.permuted and key == "attn_q":
            return unpermute_rope_rows(tensor, self.hf["num_attention_heads"])
        if self.permuted and key == "attn_k":
            return unpermute_rope_rows(tensor, self.hf["num_key_value_heads"])
        if key == "ffn_gate_inp_shexp":
            return tensor.reshape(1, -1)  # stored as a vector; HF's gate is a [1, hidden] linear
        return tensor

    def _kv_b(self, layer: int) -> torch.Tensor:
        """kv_b_proj [heads * (nope + v), kv_lora_rank] from k_b [heads, kv_lora_rank, nope]
        and v_b [heads, v, kv_lora_rank]."""
        k_b = dequantize(self.gguf, self.gguf.tensors[f"blk.{layer}.attn_k_b.weight"])
        v_b = dequantize(self.gguf, self.gguf.tensors[f"blk.{layer}.attn_v_b.weight"])
        kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)
        return kv_b.reshape(-1, kv_b.shape[-1]).contiguous()


def gguf_weights(gguf: GGUFFile, hf: dict[str, Any], wants: Wants, progress: bool = False,
                 quantized: dict[str, QuantRows] | None = None,
                 blocks_only: Callable[[str, int], bool] = lambda name, ggml_type: False
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor `wants` accepts, dequantized one at a time;
    a tqdm bar on stderr when `progress`. With `quantized`, also the blocks of each 2-D tensor of
    PANEL_TYPES or INT8_TYPES, by HF name, for the GEMMs that multiply by them
    (engine/models/cpu_gemm.py); a tensor of INT8_TYPES for which `blocks_only(name, GGML type)` holds is then only
    recorded there, never dequantized (the int8 path needs no dense copy: a 4-bit file stays
    about its own size in memory while it loads)."""
    converter = _Converter(gguf, hf, wants, quantized, blocks_only)
    bar = tqdm(total=len(gguf.tensors), desc=f"dequantizing {gguf.path.name}", unit="tensor",
               file=sys.stderr, disable=not progress, leave=False)
    with bar:
        for info in gguf.tensors.values():
            yield from converter.convert(info)
            bar.update(1)
