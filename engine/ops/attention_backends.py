"""Attention backends: the paths a paged-attention step can take, as objects chosen once per
model load (for a device and the query and cache dtypes), which the layer loop
(engine/models/llama.py), the fused layer stack (engine/models/fused_stack.py) and the CUDA
graphs (engine/worker/cuda_graphs.py) ask instead of repeating an if/elif:

- `CpuKernelBackend`: csrc/cpu/'s decode kernel for the decode rows; prefill chunks on the tiled
  prefill kernel, or the decode kernel's one row per token, or SDPA (the rules below);
- `FlexAttentionBackend`: FlexAttention for the decode rows on CUDA, and for a CUDA-graph step
  (its fixed-shape metadata goes there whole), SDPA per request for prefill chunks;
- `AttentionBackend`: the torch references of engine/ops/attention.py, anywhere.

Each matches the torch reference within a tolerance (another summation order), not bit for
bit: tests/csrc/test_cpu_attention.py and test_prefill_attention.py pin the bounds.
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch

from engine import envs
from engine.ops import cpu_ops, flex_attention
from engine.ops.attention import AttentionMetadata, decode_attention_reference, prefill_attention_reference


# Prefill chunks run through the decode kernel's one row per token, which rereads the prefix
# for every query row, unless a chunk is at least PREFILL_SDPA_MIN_TOKENS long and a prefill
# request's sequence is longer than PREFILL_KERNEL_MAX_LEN: then the step's chunks run through
# SDPA (torch's flash kernel, each query tile sharing the K/V tiles). On a 1-core Zen 5, default
# model, bf16, whole prefill steps: 8 x 128 tokens 526 ms (kernel) vs 660 ms (SDPA: 0.5 ms per
# 128-token causal call), 1 x 1000 940 vs 1022 ms, 1 x 2000 2949 vs 2699 ms (the prefix's K/V
# outgrow L2); float32 4 x 256 1003 vs 1090 ms. On CPUs with AMX, SDPA wins from the shortest
# chunk it takes: 1-core Xeon, default model, bf16 whole prefill steps 8 x 128 tokens 457 vs 490
# ms, 4 x 512 1221 vs 1648, 1 x 1000 610 vs 1051 (the kernel's rows on AMX tiles); float32
# within 4% up to 512 tokens, 2 x 1000 4134 vs 4957 ms. Both are read when a backend is chosen
# (PrefillLimits.current), once per model load.
PREFILL_SDPA_MIN_TOKENS = 64
PREFILL_KERNEL_MAX_LEN = 0 if "amx_bf16" in cpu_ops.cpu_flags() else 1024


# Prefill chunks of any length run on the tiled prefill kernel (csrc/cpu/cpu_prefill_attention.cpp)
# where the CPU and shapes allow, before the rules above (KVSENTRY_DISABLE_PREFILL_TILES=1:
# never): AMX tiles for a bf16 cache on AMX CPUs, AVX-512F vector tiles for float32 and bf16
# elsewhere. AMX: 1-core Xeon, default model, bf16, 4 x 512-token causal prefill per layer: SDPA
# ~8.5-9.5 ms, AMX tiles ~3.9 ms; the whole 4 x 512 prefill step 1045 -> ~830 ms. Short chunks
# too, whole prefill steps in the fused stack, tiles vs the kernel's rows: 1 x 16 tokens 34 vs
# 35-44 ms, 16 x 8 79 vs 82-87, 8 x 48 132-144 vs 157-185. Vector tiles: 1-core Xeon without AMX,
# default model, per layer, tiles vs the kernel's rows: float32 4 x 512 14.3 vs 36.4 ms, 16 x 128
# 5.0 vs 9.8, 1 x 2048 53 vs 168; bf16 alike.
@functools.cache
def _tiles_fit(dtype: torch.dtype, num_heads: int, head_dim: int, k_dtype: torch.dtype,
               k_shape: tuple[int, ...], v_dtype: torch.dtype, v_dim: int) -> bool:
    """The kernel's own answer for these shapes, asked once (it reads only sizes and dtypes)."""
    return cpu_ops.paged_prefill_attention_fits(torch.empty(0, num_heads, head_dim, dtype=dtype),
                                                torch.empty(0, *k_shape, dtype=k_dtype),
                                                torch.empty(0, *k_shape[:-1], v_dim, dtype=v_dtype))


class Prefill(enum.Enum):
    """How a step's prefill chunks run."""
    TILES = "tiles"  # the tiled prefill kernel, every chunk in one call
    ROWS = "rows"    # the decode kernel, one row per prefill token (PrefillPlan)
    SDPA = "sdpa"    # SDPA per request (attention.prefill_attention_reference)


@dataclass(frozen=True)
class PrefillLimits:
    """The CPU backend's prefill rules, read once when the backend is chosen."""
    sdpa_min_tokens: int = PREFILL_SDPA_MIN_TOKENS
    kernel_max_len: int = PREFILL_KERNEL_MAX_LEN
    tiles: bool = True  # False: KVSENTRY_DISABLE_PREFILL_TILES

    @classmethod
    def current(cls) -> PrefillLimits:
        return cls(PREFILL_SDPA_MIN_TOKENS, PREFILL_KERNEL_MAX_LEN, not envs.disable_prefill_tiles())


class AttentionBackend:
    """The torch references: decode rows grouped by length, prefill chunks through SDPA."""
    name = "torch_reference"
    fixed_shape_decode = False  # runs a CUDA-graph step (AttentionMetadata.fixed_shape)

    def decode(self, out: torch.Tensor,    # [>= decodes, Hq, Dv], rows [0, decodes) written
               query: torch.Tensor,        # [>= decodes, Hq, D]
               key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> None:
        decodes = meta.num_decodes
        plan = meta.decode_plan(key_cache.shape[1], query.device)
        out[:decodes] = decode_attention_reference(query[:decodes], key_cache, value_cache,
                                                   meta.block_tables[:decodes], meta.seq_lens[:decodes], plan, scale)

    def prefill_path(self, meta: AttentionMetadata, dtype: torch.dtype, num_heads: int, head_dim: int,
                     key_cache: torch.Tensor, value_cache: torch.Tensor) -> Prefill:
        """How this step's prefill chunks run: queries of `dtype`, [T, num_heads, head_dim]."""
        return Prefill.SDPA

    def prefill(self, path: Prefill, out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> None:
        prefill_attention_reference(out, query, key_cache, value_cache, meta, scale)


class FlexAttentionBackend(AttentionBackend):
    """CUDA: decode rows through FlexAttention, one group (every row reads plan.num_read
    entries): the op the CUDA graphs replay."""
    name = "flex_attention"
    fixed_shape_decode = True

    def decode(self, out, query, key_cache, value_cache, meta, scale) -> None:
        decodes = meta.num_decodes
        plan = meta.decode_plan(key_cache.shape[1], query.device)
        out[:decodes] = flex_attention.paged_decode_attention(
            query[:decodes], key_cache, value_cache, meta.block_tables[:decodes, :plan.num_read],
            meta.seq_lens[:decodes], scale)


class CpuKernelBackend(AttentionBackend):
    """csrc/cpu/: the decode kernel reads the blocks in place (same semantics as the reference,
    no gather); prefill chunks take the tiles, the kernel's rows or SDPA by `limits`."""
    name = "cpu_kernel"

    def __init__(self, limits: PrefillLimits):
        self.limits = limits

    def decode(self, out, query, key_cache, value_cache, meta, scale) -> None:
        decodes = meta.num_decodes
        plan = meta.decode_plan(key_cache.shape[1], query.device)
        cpu_ops.paged_decode_attention(out[:decodes], query[:decodes], key_cache, value_cache,
                                       meta.block_tables, meta.seq_lens, plan.reads, plan.num_read, scale)

    def tiles_fit(self, dtype: torch.dtype, num_heads: int, head_dim: int,
                  key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
        """Whether prefill chunks of these shapes run on the tiled prefill kernel."""
        return self.limits.tiles and _tiles_fit(dtype, num_heads, head_dim, key_cache.dtype,
                                                tuple(key_cache.shape[1:]), value_cache.dtype, value_cache.shape[-1])

    def prefill_path(self, meta, dtype, num_heads, head_dim, key_cache, value_cache) -> Prefill:
        if self.tiles_fit(dtype, num_heads, head_dim, key_cache, value_cache):
            return Prefill.TILES
        starts, first = meta.query_start_loc_cpu, meta.num_decodes
        longest_chunk = max((starts[i + 1] - starts[i] for i in range(first, meta.num_reqs)), default=0)
        longest_seq = max(meta.seq_lens_cpu[first:meta.num_reqs], default=0)
        if longest_chunk < self.limits.sdpa_min_tokens or longest_seq <= self.limits.kernel_max_len:
            return Prefill.ROWS
        return Prefill.SDPA

    def prefill(self, path, out, query, key_cache, value_cache, meta, scale) -> None:
        decodes, starts = meta.num_decodes, meta.query_start_loc_cpu
        if path is Prefill.TILES:
            cpu_ops.paged_prefill_attention(out, query, key_cache, value_cache,
                                            meta.block_tables[decodes:meta.num_reqs],
                                            list(meta.seq_lens_cpu[decodes:meta.num_reqs]),
                                            list(starts[decodes:meta.num_reqs + 1]), scale)
        elif path is Prefill.ROWS:  # every prefill token of every request in one kernel call
            first, last = starts[decodes], starts[meta.num_reqs]
            plan = meta.prefill_plan(key_cache.shape[1], query.device)
            cpu_ops.paged_decode_attention(out[first:last], query[first:last], key_cache, value_cache,
                                           plan.tables, plan.seq_lens, plan.reads, plan.num_read, scale)
        else:
            prefill_attention_reference(out, query, key_cache, value_cache, meta, scale)


def select(device: str | torch.device, query_dtype: torch.dtype, cache_dtype: torch.dtype) -> AttentionBackend:
    """The backend for a model on `device` (its queries of `query_dtype`, its cache of
    `cache_dtype`): chosen once per model load (engine/worker/model_runner.py), and reading the
    kernels' availability (KVSENTRY_DISABLE_CPU_OPS) and the prefill rules then."""
    device_type = torch.device(device).type
    if device_type == "cpu" and cache_dtype == query_dtype and cpu_ops.available():
        return CpuKernelBackend(PrefillLimits.current())
    if device_type == "cuda" and flex_attention.available():
        return FlexAttentionBackend()
    return AttentionBackend()


def prefill_in_tiles(dtype: torch.dtype, num_heads: int, head_dim: int,
                     key_cache: torch.Tensor,    # [num_blocks, block_size, Hkv, D]
                     value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, Dv]
                     ) -> bool:
    """Whether a model on these caches, chosen now, would run prefill chunks of queries of
    `dtype` [T, num_heads, head_dim] on the tiled prefill kernel."""
    backend = select(key_cache.device, dtype, key_cache.dtype)
    return isinstance(backend, CpuKernelBackend) and backend.tiles_fit(dtype, num_heads, head_dim,
                                                                      key_cache, value_cache)


def paged_attention(query: torch.Tensor,    # [num_padded_tokens, num_heads, head_dim]
                    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
                    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, v_head_dim]
                    meta: AttentionMetadata,
                    scale: float,
                    backend: AttentionBackend | None = None,  # None: select() for these tensors
                    ) -> torch.Tensor:  # [num_padded_tokens, num_heads, v_head_dim]
    """Causal attention of each request's new tokens over its whole cached sequence.

    Must run after this step's K/V were written, so a request's own new tokens
    are in the cache too (prefill with a cached prefix and decode are one case).
    """
    if meta.fixed_shape:  # a CUDA-graph step: every row reads the whole table width; nothing on the host
        return flex_attention.paged_decode_attention(query, key_cache, value_cache, meta.block_tables,
                                                     meta.seq_lens, scale)
    if backend is None:
        backend = select(query.device, query.dtype, key_cache.dtype)
    # Rows [0, starts[num_reqs]) are all written below (decodes, then every prefill chunk);
    # only the padding rows past them are zeroed.
    out = query.new_empty(query.shape[0], query.shape[1], value_cache.shape[-1])
    out[meta.query_start_loc_cpu[meta.num_reqs] if meta.num_reqs else 0:].zero_()
    if meta.num_reqs == 0:
        return out
    if meta.num_decodes:  # one query token each, so their query rows are [0, decodes)
        backend.decode(out, query, key_cache, value_cache, meta, scale)
    if meta.num_reqs > meta.num_decodes:
        path = backend.prefill_path(meta, query.dtype, query.shape[1], query.shape[2], key_cache, value_cache)
        backend.prefill(path, out, query, key_cache, value_cache, meta, scale)
    return out
