"""The CPU kernels of csrc/ (paged attention: decode rows, prefill rows or tiles;
the fused layer stack, GEMMs), JIT-built on first use.

They live in the same library as the CUDA KV writers (engine.ops.cuda_ops builds it:
the CPU-only flavour here, the CUDA one on a machine with a GPU, which carries
the CPU code too). `available()` builds once per process, reusing the build
cache across processes; without a compiler or ninja it warns once and the torch
reference in engine.ops.attention runs instead, with the same results.

Environment (engine/envs.py):
  KVSENTRY_DISABLE_CPU_OPS=1   never use the kernels (the torch reference runs)
  KVSENTRY_REQUIRE_CPU_OPS=1   raise when the build fails instead of falling back
"""
from __future__ import annotations

import functools
import logging
import time

import torch

from engine import envs
from engine.ops import cuda_ops

log = logging.getLogger(__name__)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where that is not readable: the kernels
    and their callers pick paths by them (amx_bf16, avx512_bf16)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def _build_ok() -> bool:
    started = time.monotonic()
    try:
        if torch.cuda.is_available():
            if not cuda_ops.available():
                return False
        else:
            # A first start compiles csrc/ (seconds to a minute); later ones load the cache.
            log.info("kvsentry CPU kernels: building or loading from %s", cuda_ops.default_build_directory(False))
            cuda_ops.build(with_cuda=False)
        log.info("kvsentry CPU kernels ready in %.1f s", time.monotonic() - started)
        return hasattr(torch.ops.kvsentry, "paged_decode_attention")
    except Exception as exc:  # no compiler, no ninja, a compile error...
        if envs.require_cpu_ops():
            raise
        log.warning("kvsentry CPU attention kernel unavailable, using the torch reference: %s", exc)
        return False


def available() -> bool:
    """True when CPU caches can use the kernels (builds them on the first call)."""
    if envs.disable_cpu_ops():
        return False
    return _build_ok()


def paged_decode_attention(out: torch.Tensor,           # [B, Hq, Dv], written
                           query: torch.Tensor,         # [B, Hq, D]
                           key_cache: torch.Tensor,     # [num_blocks, block_size, Hkv, D], any strides
                           value_cache: torch.Tensor,   # [num_blocks, block_size, Hkv, Dv]
                           block_tables: torch.Tensor,  # [>= B, >= num_read_blocks] int32
                           seq_lens: torch.Tensor,      # [>= B] int64
                           read_blocks: torch.Tensor | None,  # [>= B] int32 entries each row reads, or None
                           num_read_blocks: int,        # the most any row reads (all rows, when read_blocks is None)
                           scale: float) -> None:
    torch.ops.kvsentry.paged_decode_attention(out, query, key_cache, value_cache, block_tables, seq_lens,
                                              read_blocks, num_read_blocks, scale)


def paged_prefill_attention_fits(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether csrc/cpu_prefill_attention.cpp takes these tensors: its AVX-512F tiles (float32 or
    bf16, head_dim and v_dim multiples of 16, at most 16 query heads per KV head) or the AMX ones
    (AMX-BF16, bf16, head_dim a multiple of 32 up to 128, v_dim a multiple of 32, blocks of a
    multiple of 16 tokens)."""
    return torch.ops.kvsentry.paged_prefill_attention_fits(query, key_cache, value_cache)


def paged_prefill_attention(out: torch.Tensor,           # [T, Hq, Dv], rows of the requests written
                            query: torch.Tensor,         # [T, Hq, D]
                            key_cache: torch.Tensor,     # [num_blocks, block_size, Hkv, D], any strides
                            value_cache: torch.Tensor,   # [num_blocks, block_size, Hkv, Dv]
                            block_tables: torch.Tensor,  # [>= R, >= blocks of the longest] int32
                            seq_lens: list[int],         # [R] each request's length after the step
                            query_starts: list[int],     # [R + 1] each request's rows of query/out
                            scale: float) -> None:
    """Each request's new tokens causally over its whole cached sequence, on AMX or AVX-512F tiles."""
    torch.ops.kvsentry.paged_prefill_attention(out, query, key_cache, value_cache, block_tables, seq_lens,
                                               query_starts, scale)


def row_argmax(logits: torch.Tensor,  # [n, vocab] float32 or bf16, a contiguous last dim
               ) -> tuple[torch.Tensor, torch.Tensor]:  # [n] int64 tokens, [n] bool finite
    """torch.argmax(logits, -1) exactly (first maximum; a row's first NaN wins), and whether
    each row holds no NaN and no infinity: one pass in the logits' own dtype (csrc/cpu_argmax.cpp)."""
    return torch.ops.kvsentry.row_argmax(logits)


def dense_decoder_layers(*args) -> torch.Tensor:
    """A dense decoder's layer stack in one call (csrc/cpu_decoder_layers.cpp; arguments as
    its schema, built by engine/models/fused_stack.py)."""
    return torch.ops.kvsentry.dense_decoder_layers(*args)
