"""Python wrappers of the CPU kernels of csrc/cpu/ (paged attention: decode rows, prefill rows or
tiles; argmax; the fused layer stack), each a row of engine/ops/registry.py.

They live in one library with the CUDA KV writers (engine/ops/library.py builds it: the CPU-only
flavour here, the CUDA one on a machine with a GPU, which carries the CPU code too).
`available()` builds once per process, reusing the build cache across processes; without a
compiler or ninja it warns once and each op runs its registry row's fallback instead (the torch
references in engine.ops.attention and elsewhere), which the rank reports at start.

Environment (engine/envs.py):
  KVSENTRY_DISABLE_CPU_OPS=1   never use the kernels (each op runs its fallback)
  KVSENTRY_REQUIRE_CPU_OPS=1   raise when the build fails instead of falling back
"""
from __future__ import annotations

import torch

from engine.ops import library, registry

cpu_flags = library.cpu_flags  # the CPU's feature flags: callers pick paths by them (amx_bf16, avx512_bf16)


def available() -> bool:
    """True when CPU tensors can use the kernels (builds them on the first call)."""
    return registry.library_ready("cpu")


def paged_decode_attention(out: torch.Tensor,           # [B, Hq, Dv], written
                           query: torch.Tensor,         # [B, Hq, D]
                           key_cache: torch.Tensor,     # [num_blocks, block_size, Hkv, D], any strides
                           value_cache: torch.Tensor,   # [num_blocks, block_size, Hkv, Dv]
                           block_tables: torch.Tensor,  # [>= B, >= num_read_blocks] int32
                           seq_lens: torch.Tensor,      # [>= B] int64
                           read_blocks: torch.Tensor | None,  # [>= B] int32 entries each row reads, or None
                           num_read_blocks: int,        # the most any row reads (all rows, when read_blocks is None)
                           scale: float) -> None:
    registry.op("paged_decode_attention")(out, query, key_cache, value_cache, block_tables, seq_lens,
                                          read_blocks, num_read_blocks, scale)


def paged_prefill_attention_fits(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether csrc/cpu/cpu_prefill_attention.cpp takes these tensors: its AVX-512F tiles (float32 or
    bf16, head_dim and v_dim multiples of 16, at most 16 query heads per KV head) or the AMX ones
    (AMX-BF16, bf16, head_dim a multiple of 32 up to 128, v_dim a multiple of 32, blocks of a
    multiple of 16 tokens)."""
    return registry.op("paged_prefill_attention_fits")(query, key_cache, value_cache)


def paged_prefill_attention(out: torch.Tensor,           # [T, Hq, Dv], rows of the requests written
                            query: torch.Tensor,         # [T, Hq, D]
                            key_cache: torch.Tensor,     # [num_blocks, block_size, Hkv, D], any strides
                            value_cache: torch.Tensor,   # [num_blocks, block_size, Hkv, Dv]
                            block_tables: torch.Tensor,  # [>= R, >= blocks of the longest] int32
                            seq_lens: list[int],         # [R] each request's length after the step
                            query_starts: list[int],     # [R + 1] each request's rows of query/out
                            scale: float) -> None:
    """Each request's new tokens causally over its whole cached sequence, on AMX or AVX-512F tiles."""
    registry.op("paged_prefill_attention")(out, query, key_cache, value_cache, block_tables, seq_lens,
                                           query_starts, scale)


def row_argmax(logits: torch.Tensor,  # [n, vocab] float32 or bf16, a contiguous last dim
               ) -> tuple[torch.Tensor, torch.Tensor]:  # [n] int64 tokens, [n] bool finite
    """torch.argmax(logits, -1) exactly (first maximum; a row's first NaN wins), and whether
    each row holds no NaN and no infinity: one pass in the logits' own dtype (csrc/cpu/cpu_argmax.cpp)."""
    return registry.op("row_argmax")(logits)


def dense_decoder_layers(*args) -> torch.Tensor:
    """A dense decoder's layer stack in one call (csrc/cpu/cpu_decoder_layers.cpp; arguments as
    its schema, built by engine/models/fused_stack.py)."""
    return registry.op("dense_decoder_layers")(*args)
