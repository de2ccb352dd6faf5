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

import re

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
