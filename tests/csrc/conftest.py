"""csrc/ on CPU: the ops built against the installed torch (CPU-only build unless CUDA is present),
in the test flavour (tests/conftest.py sets KVSENTRY_DEBUG_OPS=1): the production ops, reached
through the kernel registry, plus the `kvsentry_debug` namespace.

A missing toolchain (nvcc, a C++ compiler, ninja) skips these tests, unless
KVSENTRY_REQUIRE_CSRC_BUILD=1 (set in CI), which turns the skip into a failure. That switch is
CI's, not the engine's: it is read here only, and declared with the repository's tooling
variables in engine/envs.py.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from engine import envs

REQUIRE_BUILD = envs.require_csrc_build()


def pytest_configure(config):
    config.addinivalue_line("markers", "nvcc: compiles csrc/ with nvcc (skipped when nvcc is not on PATH)")


def skip_or_fail(reason: str) -> None:
    if REQUIRE_BUILD:
        pytest.fail(f"{reason} (KVSENTRY_REQUIRE_CSRC_BUILD=1)")
    pytest.skip(reason)


class Ops:
    """The library's ops by name: a production op through the registry (registry.op), anything
    else from the test build's `kvsentry_debug` namespace (switches, plans, one GEMM kernel by name)."""

    def __getattr__(self, name: str):
        from engine.ops import registry
        if name in registry.SCHEMAS:
            return registry.op(name)
        return getattr(registry.debug_ops(), name)


@pytest.fixture(scope="session")
def kvsentry_ops(tmp_path_factory) -> Ops:
    """The ops, built once per session (the session start usually loaded them already)."""
    from engine.ops import registry
    with_cuda = torch.cuda.is_available()
    missing = [tool for tool in ("ninja", "c++") if shutil.which(tool) is None]
    if missing:
        skip_or_fail(f"cannot build the kvsentry ops: {', '.join(missing)} not on PATH")
    registry.build(with_cuda=with_cuda, debug=True,
                   build_directory=None if with_cuda else tmp_path_factory.mktemp("kvsentry_ops"))
    return Ops()
