"""A dense decoder's layer stack as one csrc op on CPU (csrc/cpu/cpu_decoder_layers.cpp).

The Python layer loop (engine/models/llama.py) issues ~15 ops per layer; for a 30-layer
model at batch 1 that was ~2.4 ms of interpreter and dispatch in a 12.4 ms bf16 decode step
(1-core Zen 5). The op runs the same loop in C++, op for op through the dispatcher (the same
linears -- panels or oneDNN, cpu_gemm.py -- and the same kvsentry kernels), so its results
are the loop's bits (tests/csrc/test_decoder_layers.py).

A step takes the loop instead whenever it needs what the op does not do: prefill chunks for
SDPA (the attention backend's choice, engine/ops/attention_backends.py), a non-CPU or
fixed-shape (CUDA-graph) step, a cache in another dtype, forward hooks on a layer, or
`--enforce-eager` (every op from Python, as vLLM's flag means on CPU too). Models whose layers are not the plain Llama/Qwen2/Qwen3 shape
never build one.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.ops import cpu_ops, registry
from engine.ops.attention_backends import CpuKernelBackend, Prefill, select
from engine.models.layers import StepContext

_DTYPES = (torch.float32, torch.bfloat16)


def _linears(layer: nn.Module) -> tuple:
    """A dense layer's four packed linears (cpu_gemm.PackedLinear, None where not packed), in
    the op's order: q|k|v, o, gate|up, down."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv, attn.o_proj.packed, mlp.gate_up, mlp.down_proj.packed


def _int8_kernel(linear) -> bool:
    """Whether a packed linear runs csrc/cpu/cpu_int8_gemm.cpp on GGUF blocks (engine/models/int8_linear.py),
    which the op calls too (not the torch reference: the loop runs that)."""
    return linear.int8 is not None and linear.int8.kernel


class FusedLayerStack:
    """The packed weights of every layer, flattened in the op's order; immutable once built."""

    def __init__(self, layers: nn.ModuleList):
        first = layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.scale = first.scale
        self.eps = layers[0].input_layernorm.eps
        self.cos, self.sin = first.rotary.cos, first.rotary.sin
        # Norms and the linears' weights for steps of more than `panel_rows` tokens
        # (PackedLinear.large_weight: dense panels beside GGUF blocks, oneDNN's, else the
        # panels), and for steps of up to `panel_rows` tokens (the panels where there are any):
        # PackedLinear.uses_panels' choice, made per step.
        self.weights: list[torch.Tensor] = []
        self.panel_weights: list[torch.Tensor] = []
        # One limit for all: the least of the linears' (cpu_gemm.panel_max_rows), which each
        # holding both copies may take; None: no linear holds both copies.
        limits = {linear.panel_max_rows for layer in layers for linear in _linears(layer)
                  if linear.panels is not None and (linear.onednn or linear.wide_panels is not None)}
        self.panel_rows: int | None = min(limits) if limits else None
        self.biases: list[torch.Tensor | None] = []
        self.out_features: list[int] = []
        self.qk_norms: list[torch.Tensor] = []
        for layer in layers:
            attn, linears = layer.self_attn, _linears(layer)
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            large = [linear.int8.blocks if linear.int8 is not None else linear.large_weight for linear in linears]
            small = [linear.int8.blocks if linear.int8 is not None else
                     linear.panels if linear.panels is not None else linear.weight for linear in linears]
            self.weights += [norms[0], large[0], large[1], norms[1], large[2], large[3]]
            self.panel_weights += [norms[0], small[0], small[1], norms[1], small[2], small[3]]
            self.biases += [linear.bias for linear in linears]
            self.out_features += [linear.out_features for linear in linears]
            if attn.qk_norm:
                self.qk_norms += [attn.q_norm.weight, attn.k_norm.weight]
        # The hook dicts of every module whose forward the op skips: with any hook set, the step
        # runs the loop. Registering a hook fills these dicts in place, so one `any` per step
        # sees it (~5 us for the default model's 390 modules, where walking them took ~19 us).
        self._hook_dicts = [d for layer in layers for m in layer.modules()
                            for d in (m._forward_hooks, m._forward_pre_hooks)]

    @classmethod
    def build(cls, layers: nn.ModuleList) -> FusedLayerStack | None:
        """A stack over `layers` (llama.py's DecoderLayer with its Attention and a SiluMLP: the
        caller checks the kinds) when every linear is packed (cpu_gemm.py) and the op is built."""
        if len(layers) == 0 or not registry.available("decoder_layers", "cpu"):
            return None
        eps, first = layers[0].input_layernorm.eps, layers[0].self_attn
        for layer in layers:
            attn = layer.self_attn
            if any(linear is None or (linear.panels is None and not linear.onednn and not _int8_kernel(linear))
                   for linear in _linears(layer)):
                return None
            # The op takes one eps, scale and rotary table for every layer.
            same = (layer.input_layernorm.eps == layer.post_attention_layernorm.eps == eps
                    and attn.qk_norm == first.qk_norm and attn.scale == first.scale
                    and (not attn.qk_norm or attn.q_norm.eps == attn.k_norm.eps == eps)
                    and torch.equal(attn.rotary.cos, first.rotary.cos)
                    and torch.equal(attn.rotary.sin, first.rotary.sin))
            if not same:
                return None
        return cls(layers)

    def _hooked(self) -> bool:
        if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
            return True
        return any(self._hook_dicts)

    def run(self, positions: torch.Tensor,  # [T] int64
            hidden: torch.Tensor,           # [T, N] the embeddings
            ctx: StepContext) -> torch.Tensor | None:  # [T, N] after the last layer; None: run the loop
        meta = ctx.meta
        k0 = ctx.kv_caches[0][0]
        if (meta.fixed_shape or hidden.device.type != "cpu" or hidden.dtype not in _DTYPES
                or k0.dtype != hidden.dtype or torch.is_grad_enabled() or not hidden.is_contiguous()
                or self._hooked()):
            return None
        backend = ctx.attention if ctx.attention is not None else select(hidden.device, hidden.dtype, k0.dtype)
        if not isinstance(backend, CpuKernelBackend):  # the kernels are off (KVSENTRY_DISABLE_CPU_OPS)
            return None
        decodes, starts = meta.num_decodes, meta.query_start_loc_cpu
        block_size = k0.shape[1]
        # The prefill rows' arguments: the kernel's rows (a PrefillPlan), or on AMX one table row,
        # length and query start per request.
        prefill, prefill_tables, tile_lens, tile_starts = None, None, None, None
        if meta.num_reqs > decodes:  # the path the backend gives the loop's attention too
            path = backend.prefill_path(meta, hidden.dtype, self.num_heads, self.head_dim, *ctx.kv_caches[0])
            if path is Prefill.TILES:
                prefill_tables = meta.block_tables[decodes:meta.num_reqs]
                tile_lens = list(meta.seq_lens_cpu[decodes:meta.num_reqs])
                tile_starts = list(starts[decodes:meta.num_reqs + 1])
            elif path is Prefill.ROWS:
                prefill = meta.prefill_plan(block_size, hidden.device)
                prefill_tables = prefill.tables
            else:
                return None  # those chunks go through SDPA, in the loop
        decode = meta.decode_plan(block_size, hidden.device) if decodes else None
        slots = ctx.write_guard.check(meta.slot_mapping) if ctx.write_guard is not None else meta.slot_mapping
        first, last = (starts[decodes], starts[meta.num_reqs]) if prefill_tables is not None else (decodes, decodes)
        small = self.panel_rows is None or hidden.shape[0] <= self.panel_rows  # the step's tokens
        return cpu_ops.dense_decoder_layers(
            hidden, positions, self.panel_weights if small else self.weights, self.biases, self.out_features,
            self.qk_norms,
            [kv[0] for kv in ctx.kv_caches], [kv[1] for kv in ctx.kv_caches], self.cos, self.sin,
            slots, ctx.null_block_writes,
            meta.block_tables if decode is not None else None, meta.seq_lens if decode is not None else None,
            decode.reads if decode is not None else None, decode.num_read if decode is not None else 0, decodes,
            prefill_tables, prefill.seq_lens if prefill is not None else None,
            prefill.reads if prefill is not None else None, prefill.num_read if prefill is not None else 0,
            first, last,
            self.num_heads, self.num_kv_heads, self.head_dim, self.eps, self.scale,
            tile_lens, tile_starts)
