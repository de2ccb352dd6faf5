"""The CUDA KV-cache writers of csrc/cuda/ (engine/ops/registry.py's "kv_writer" row on cuda).

`available()` is what engine.ops.kv_writer and the CUDA graphs ask before dispatching a CUDA
cache to the kernels; everything else (CPU, no CUDA toolkit, a failed build,
KVSENTRY_DISABLE_CUDA_OPS) falls back to the torch reference there, and that fallback is
reported at start (engine/ops/implementations.py). KVSENTRY_REQUIRE_CUDA_OPS=1 makes a
failed build an error instead.
"""
from __future__ import annotations

import torch

from engine.ops import registry


# Evaluated eagerly and baked in as a constant when torch.compile traces a caller: tracing
# into the cached build would be an unsupported graph break.
@torch.compiler.assume_constant_result
def available() -> bool:
    """True when CUDA caches can use the kernels (builds them on the first call)."""
    return registry.available("kv_writer", "cuda")


def _cuda_only(name: str, *tensors: torch.Tensor | None) -> None:
    for t in tensors:
        if t is not None and not t.is_cuda:
            raise ValueError(f"cuda_ops.{name}: every tensor must be on a CUDA device, got one on {t.device} "
                             "(CPU caches go through engine.ops.kv_writer: the op's host code, or its torch reference)")


def contiguous_rows(x: torch.Tensor) -> torch.Tensor:
    # The kernels read each row as one contiguous run; any other stride is fine.
    return x if x.stride(-1) == 1 else x.contiguous()


def scale_tensor(scale: torch.Tensor | float | None, like: torch.Tensor) -> torch.Tensor | None:
    if scale is None or isinstance(scale, torch.Tensor):
        return scale
    return torch.tensor([scale], dtype=torch.float32, device=like.device)


def reshape_and_cache_flash(key: torch.Tensor,           # [num_tokens, num_kv_heads, head_size]
                            value: torch.Tensor,         # [num_tokens, num_kv_heads, head_size]
                            k_cache: torch.Tensor,       # [num_blocks, block_size, num_kv_heads, head_size]
                            v_cache: torch.Tensor,       # [num_blocks, block_size, num_kv_heads, head_size]
                            slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
                            null_block_writes: torch.Tensor | None = None,  # [1] int64, += writes into block 0
                            scale: torch.Tensor | float | None = None,  # [1] float32, fp8 cache: stored = x / scale
                            ) -> None:
    _cuda_only("reshape_and_cache_flash", key, value, k_cache, v_cache, slot_mapping, null_block_writes)
    # Shapes, dtypes, devices and strides are checked by the op (csrc/common/torch_bindings.cpp),
    # also under torch.compile.
    registry.op("reshape_and_cache_flash")(contiguous_rows(key), contiguous_rows(value), k_cache, v_cache,
                                           slot_mapping, null_block_writes, scale_tensor(scale, k_cache))


def concat_and_cache_mla(kv_c: torch.Tensor,          # [num_tokens, kv_lora_rank]
                         k_pe: torch.Tensor,          # [num_tokens, rope_dim]
                         kv_cache: torch.Tensor,      # [num_blocks, block_size, kv_lora_rank + rope_dim]
                         slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
                         null_block_writes: torch.Tensor | None = None,
                         scale: torch.Tensor | float | None = None,
                         ) -> None:
    _cuda_only("concat_and_cache_mla", kv_c, k_pe, kv_cache, slot_mapping, null_block_writes)
    registry.op("concat_and_cache_mla")(contiguous_rows(kv_c), contiguous_rows(k_pe), kv_cache, slot_mapping,
                                        null_block_writes, scale_tensor(scale, kv_cache))
