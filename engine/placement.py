"""Which device a DP rank runs on, and which torch.distributed backend its group uses.

Pure functions of strings and counts, so every combination is unit-tested without a GPU:

- `--device cpu`: every rank on the CPU, gloo.
- `--device cuda`: the rank with local index l (rank - --data-parallel-start-rank) on `cuda:l`
  of the devices this process sees (CUDA_VISIBLE_DEVICES renumbers them from 0), NCCL.
- `--device cuda:N`: only when this node runs one rank (--data-parallel-size-local 1).

`check_placement` refuses, before any rank starts, a configuration that would put two
local ranks on one GPU or more local ranks than there are visible GPUs.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

_CUDA = re.compile(r"cuda(?::(\d+))?")


def _cuda_index(config_device: str) -> int | None:
    """None for plain "cuda", N for "cuda:N"; ValueError for anything but cpu/cuda/cuda:N."""
    match = _CUDA.fullmatch(config_device)
    if match is None:
        raise ValueError(f"--device: must be cpu, cuda or cuda:N, got {config_device!r}")
    return None if match.group(1) is None else int(match.group(1))


def check_device_name(config_device: str) -> None:
    """The spelling alone (no device is looked at): cpu, cuda or cuda:N."""
    if config_device != "cpu":
        _cuda_index(config_device)


def check_placement(config_device: str, local_ranks: int, visible_devices: int) -> None:
    """Refuse a placement that shares or lacks GPUs; nothing to check on the CPU."""
    if local_ranks < 1:
        raise ValueError(f"--data-parallel-size-local: must be >= 1, got {local_ranks}")
    if config_device == "cpu":
        return
    index = _cuda_index(config_device)
    if visible_devices < 1:
        raise ValueError(f"--device {config_device}: no CUDA device is visible to this process "
                         "(check CUDA_VISIBLE_DEVICES and the driver), or use --device cpu")
    if index is not None:
        if local_ranks > 1:
            raise ValueError(f"--device {config_device} would put all {local_ranks} local ranks "
                             f"(--data-parallel-size-local {local_ranks}) on one GPU; use --device cuda "
                             "to give local rank l the device cuda:l")
        if index >= visible_devices:
            raise ValueError(f"--device {config_device}: only {visible_devices} CUDA device(s) are visible "
                             f"(cuda:0..cuda:{visible_devices - 1}; CUDA_VISIBLE_DEVICES renumbers them)")
        return
    if local_ranks > visible_devices:
        raise ValueError(f"--device cuda with --data-parallel-size-local {local_ranks} needs one GPU per "
                         f"local rank, but only {visible_devices} CUDA device(s) are visible "
                         "(CUDA_VISIBLE_DEVICES); lower --data-parallel-size-local or expose more GPUs")


def rank_device(config_device: str, local_rank: int, local_ranks: int, visible_devices: int) -> str:
    """The device of the rank with local index `local_rank` of `local_ranks` on this node."""
    if not 0 <= local_rank < local_ranks:
        raise ValueError(f"local rank {local_rank} out of range for --data-parallel-size-local {local_ranks}")
    check_placement(config_device, local_ranks, visible_devices)
    if config_device == "cpu":
        return "cpu"
    index = _cuda_index(config_device)
    return f"cuda:{local_rank if index is None else index}"


def process_group_backend(device: str) -> str:
    """NCCL for a rank on a GPU (collectives on device tensors), gloo on the CPU."""
    check_device_name(device)
    return "gloo" if device == "cpu" else "nccl"


def visible_cuda_devices() -> int:
    """GPUs this process may use (after CUDA_VISIBLE_DEVICES); 0 without CUDA. Creates no context."""
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# -- --dtype auto ---------------------------------------------------------------------------------
# What it picks and why, as vLLM's CPU backend does: bfloat16 where the CPU multiplies bf16 natively
# (AVX512-BF16's vdpbf16ps or AMX-BF16 tiles), float32 elsewhere (and on CUDA, whose ranks keep the
# exact float32 path unless told otherwise). A bf16 GEMM without native support is emulated through
# float32 and is slower than float32 itself. `--dtype float32` stays the exact path.

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo names


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    return frozenset(line.partition(":")[2].split())


def resolve_dtype(name: str, device: str, flags: frozenset[str] | None = None) -> tuple[str, str]:
    """(the dtype name to run, why): `name` itself unless it is "auto"."""
    if name != "auto":
        return name, "asked for"
    if device != "cpu":
        return "float32", f"auto: float32 on {device}"
    native = [flag for flag in NATIVE_BF16_FLAGS if flag in (cpu_flags() if flags is None else flags)]
    if native:
        return "bfloat16", f"auto: the CPU has native bf16 ({', '.join(native)})"
    return "float32", "auto: the CPU has no native bf16 (no amx_bf16 or avx512_bf16)"
