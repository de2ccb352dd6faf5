"""tests/gpu: need a CUDA device; every test here is marked `gpu` and skipped without one.

Run on a GPU machine with `pytest -m gpu tests/gpu` (scripts/gpu_check.sh does it). The CUDA
ops must build there: KVSENTRY_REQUIRE_CUDA_OPS=1 turns a failed build into an error instead of
the silent fallback to the torch reference that the engine uses.
"""
from __future__ import annotations

import os

import pytest
import torch

from engine.ops import registry


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped when torch.cuda.is_available() is False")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="CUDA is not available")
    for item in items:
        # The marker itself, not the keyword: a parametrization id like "gpu" (the gpu
        # Kubernetes overlay) must not skip a CPU test. The hook sees the whole session.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cuda_kernels():
    """engine.ops.cuda_ops with the kernels built and loaded (a failed build fails, never falls back)."""
    from engine.ops import cuda_ops
    os.environ["KVSENTRY_REQUIRE_CUDA_OPS"] = "1"
    assert cuda_ops.available(), "torch.cuda is available but the kvsentry CUDA ops are not"
    assert registry.op("built_with_cuda")()
    return cuda_ops
