"""Shared fixtures: tiny HF checkpoints written once per session by the demo writer."""
from __future__ import annotations

import os

import pytest
import torch

# Tiny models gain nothing from intra-op threads, and on a shared 2-core machine a second
# thread mostly waits; rank subprocesses choose their own count.
torch.set_num_threads(1)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The csrc/ library's test build: the production ops plus the kvsentry_debug namespace (switches
# that reach each kernel path on one CPU). Set before anything loads it, subprocesses inherit it.
os.environ.setdefault("KVSENTRY_DEBUG_OPS", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Random weights at std 0.02 give near-uniform logits whose top two tokens can tie
# to 1e-6; a larger init scale makes greedy comparisons meaningful.
TEST_INIT_SCALE = 0.3


def pytest_sessionstart(session):
    """Build (or load) csrc/'s CPU kernels once, before any test: otherwise the first
    server or rank subprocess pays the ~15-40 s compile inside its readiness timeout."""
    from engine.ops import cpu_ops
    cpu_ops.available()


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint("tiny-llama", **overrides) -> path of a cached tiny checkpoint."""
    from service.demo.checkpoint import write_preset
    made: dict[tuple, str] = {}

    def make(preset: str, **overrides) -> str:
        key = (preset, tuple(sorted(overrides.items())))
        if key not in made:
            path = tmp_path_factory.mktemp(preset)
            write_preset(path, preset, init_scale=overrides.pop("init_scale", TEST_INIT_SCALE), **overrides)
            made[key] = str(path)
        return made[key]

    return make
