"""What this process runs, op by op: each registry row's kernel (engine/ops/registry.py) or its
fallback, plus what the model runner chose at load (the GEMM path of each linear kind, CUDA
graphs on or off; engine/worker/model_runner.py). Each rank sends it in its ready message; the
front end exports it (`kvsentry_op_implementation_info`) and logs it, and warns at start for
every entry on a fallback (`falling_back`).

A fallback gives the same results for the KV writers, checksums, the NaN scan and the fused
elementwise ops (bit for bit, tests/csrc/), and results within a tolerance for attention and
the GEMMs (another summation order): slower, and not always the same bits.
"""
from __future__ import annotations

import torch

from engine.ops import registry

CUDA_GRAPHS = "cuda_graphs"
GRAPHS_ON = "on"


def op_implementations(device: str | torch.device) -> dict[str, str]:
    """{op: implementation} of every registry op on `device`: its row's label where the
    kernel runs there, else the op's fallback."""
    out = {}
    for op in registry.OPS:
        kernel = registry.kernel_for(op, device)
        out[op] = registry.label(kernel) if kernel is not None and registry.runs(kernel) else registry.fallback_of(op)
    return out


def graphs_entry(eager_reason: str | None) -> str:
    """The `cuda_graphs` entry: "on", or "off: <why>"."""
    return GRAPHS_ON if eager_reason is None else f"off: {eager_reason}"


def falling_back(implementations: dict[str, str], device: str | torch.device) -> list[str]:
    """The entries that run a fallback where this device has something faster: a registry row
    for it that does not run, or CUDA graphs off on a CUDA device for any reason but the
    operator's --enforce-eager."""
    device_type = torch.device(device).type
    slow = []
    for name, implementation in implementations.items():
        kernel = registry.kernel_for(name, device_type) if name in registry.OPS else None
        if kernel is not None and implementation != registry.label(kernel):
            slow.append(name)
        elif (name == CUDA_GRAPHS and device_type == "cuda" and implementation != GRAPHS_ON
              and "--enforce-eager" not in implementation):
            slow.append(name)
    return slow


def describe(implementations: dict[str, str]) -> str:
    """One line for a log: "paged_attention=cpu_kernel; kv_writer=torch_reference; ..." (a value,
    such as a linear's GEMM path or why CUDA graphs are off, may hold spaces)."""
    return "; ".join(f"{op}={implementation}" for op, implementation in implementations.items())
