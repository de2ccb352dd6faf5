"""Which implementation each op runs on a device: a csrc/ kernel (or a maintained one, such
as torch's FlexAttention), or the torch reference.

A kernel that is disabled (KVSENTRY_DISABLE_CPU_OPS, KVSENTRY_DISABLE_CUDA_OPS) or fails
to build leaves its op on the torch reference, with the same results and less speed.
Each rank reports what it runs, so the front end exports it and logs it;
KVSENTRY_REQUIRE_CPU_OPS=1 / KVSENTRY_REQUIRE_CUDA_OPS=1 make a failed build an error
instead (engine/ops/cpu_ops.py, engine/ops/cuda_ops.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.ops import cpu_ops, cuda_ops, flex_attention

TORCH_REFERENCE = "torch_reference"


@dataclass(frozen=True)
class Kernel:
    name: str                      # what the metric and the log call it
    device_type: str               # the only device it runs on; elsewhere the op runs the reference
    available: Callable[[], bool]  # builds or loads it on the first call


KERNELS: dict[str, tuple[Kernel, ...]] = {  # at most one kernel per (op, device type)
    # Paged attention (MHA/GQA, and the MLA decode): csrc/cpu_attention.cpp. On CUDA the decode
    # rows of MHA/GQA models (all of a CUDA-graph step) run FlexAttention (engine/ops/flex_attention.py).
    "paged_attention": (Kernel("cpu_kernel", "cpu", lambda: cpu_ops.available()),
                        Kernel("flex_attention", "cuda", lambda: flex_attention.available())),
    # The cache writers (reshape_and_cache_flash, concat_and_cache_mla): csrc/cache_kernels.cu.
    # On CPU the same kernels' per-token code run on the host (csrc/cache_kernels_host.cpp).
    "kv_writer": (Kernel("cuda_kernel", "cuda", lambda: cuda_ops.available()),
                  Kernel("cpu_kernel", "cpu", lambda: cpu_ops.available())),
    # Sealed-block checksums: csrc/cpu_checksum.cpp (on a GPU the torch reference runs on the device).
    "kv_checksum": (Kernel("cpu_kernel", "cpu", lambda: cpu_ops.available()),),
    # The NaN sentinel's scan of 16- and 8-bit caches: csrc/cpu_nonfinite.cpp.
    "kv_nan_scan": (Kernel("cpu_kernel", "cpu", lambda: cpu_ops.available()),),
}


def kernel_for(op: str, device: str | torch.device) -> Kernel | None:
    """The kernel `op` has on `device`'s type, if any."""
    device_type = torch.device(device).type
    return next((kernel for kernel in KERNELS.get(op, ()) if kernel.device_type == device_type), None)


def op_implementations(device: str | torch.device) -> dict[str, str]:
    """{op: implementation} of the engine's ops on `device`."""
    kernels = {op: kernel_for(op, device) for op in KERNELS}
    return {op: kernel.name if kernel is not None and kernel.available() else TORCH_REFERENCE
            for op, kernel in kernels.items()}


def falling_back(implementations: dict[str, str], device: str | torch.device) -> list[str]:
    """The ops that have a kernel for `device` but run the torch reference."""
    return [op for op, implementation in implementations.items()
            if kernel_for(op, device) is not None and implementation == TORCH_REFERENCE]


def describe(implementations: dict[str, str]) -> str:
    """One line for a log: "paged_attention=cpu_kernel kv_writer=torch_reference"."""
    return " ".join(f"{op}={implementation}" for op, implementation in implementations.items())
