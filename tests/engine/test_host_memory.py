"""engine/worker/host_memory.py: freed activations stay mapped, so a step stops page-faulting
them back in. Each case runs in a fresh interpreter: malloc settings are per process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The activations of a 2048-token bf16 prefill of the default model's shapes, allocated and
# freed in the order a layer does (norm, q|k|v, attention, gate|up, SiLU, down), 4 layers a
# step. After 5 warm-up steps, prints whether the settings took and the minor page faults of
# 10 more steps.
SCRIPT = """
import resource, torch
from engine.worker import host_memory
took = host_memory.keep_freed_memory()
def step():
    h = torch.empty(2048, 576, dtype=torch.bfloat16).fill_(1)
    for _ in range(4):
        qkv = torch.empty(2048, 960, dtype=torch.bfloat16).fill_(1)
        o = torch.empty(2048, 576, dtype=torch.bfloat16).fill_(1)
        del qkv
        gu = torch.empty(2048, 3072, dtype=torch.bfloat16).fill_(1)
        s = torch.empty(2048, 1536, dtype=torch.bfloat16).fill_(1)
        del gu
        h = torch.empty(2048, 576, dtype=torch.bfloat16).fill_(1)
        del s, o
for _ in range(5):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(**env_extra: str) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if k != "KVSENTRY_DEFAULT_MALLOC"}
    env.update(PYTHONPATH=str(ROOT), **env_extra)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_activations_are_reused_without_faults():
    """Kept in the heap, a step's blocks are the last step's pages: no faults. (What glibc's
    own settings do here varies from run to run, 0 to 130,000 faults for these 10 steps, so
    the contrast is measured on the engine instead: ~50,000 faults per 16 x 128 prefill step
    of the default model by default, 0-600 with these settings.)"""
    took, tuned = faults()
    assert took
    assert tuned < 300, tuned


def test_opt_out_leaves_malloc_alone():
    took, _ = faults(KVSENTRY_DEFAULT_MALLOC="1")
    assert not took
