"""An image without sources or a compiler (the Dockerfile's runtime stage) loads the
library its build stage compiled into KVSENTRY_EXTENSION_DIR, and the engine uses it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from engine.ops import library as ops_library
from engine.ops import registry

SCRIPT = """
import torch
from engine.ops import cpu_ops, library
assert cpu_ops.available(), "prebuilt library not loaded"
print("loaded", library.loaded().path)
out = torch.empty(1, 2, 4)
q = torch.ones(1, 2, 4)
k = torch.zeros(3, 4, 1, 4)
v = torch.arange(48.0).view(3, 4, 1, 4)
cpu_ops.paged_decode_attention(out, q, k, v, torch.tensor([[2]], dtype=torch.int32), torch.tensor([4]), None, 1, 1.0)
print("mean", out[0, 0].tolist())
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="copies the CPU-only build; a CUDA machine loads the CUDA one")
def test_runtime_loads_the_prebuilt_library(kvsentry_ops, tmp_path):
    library = registry.build(with_cuda=False)  # the session's build (the fixture made it)
    name = os.path.basename(library)
    env = {**os.environ, "KVSENTRY_EXTENSION_DIR": str(tmp_path), "KVSENTRY_CSRC_DIR": str(tmp_path / "absent"),
           "KVSENTRY_REQUIRE_CPU_OPS": "1", "PYTHONPATH": os.getcwd()}
    env.pop("KVSENTRY_DISABLE_CPU_OPS", None)
    probe = subprocess.run([sys.executable, "-c", "from engine.ops import library; "
                            "print(library.default_build_directory(False))"],
                           env=env, capture_output=True, text=True, check=True)
    target = tmp_path / os.path.basename(probe.stdout.strip())
    target.mkdir()
    shutil.copy(library, target / name)
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"loaded {target / name}" in run.stdout
    # Equal scores over block 2's four rows: the mean of its values [32..47] per column.
    assert "mean [38.0, 39.0, 40.0, 41.0]" in run.stdout


def test_missing_sources_and_library_is_a_clear_error(tmp_path):
    env = {**os.environ, "KVSENTRY_EXTENSION_DIR": str(tmp_path), "KVSENTRY_CSRC_DIR": str(tmp_path / "absent"),
           "KVSENTRY_REQUIRE_CPU_OPS": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, "-c", "from engine.ops import cpu_ops; cpu_ops.available()"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "no sources at" in run.stderr and "no prebuilt library at" in run.stderr


def test_cpu_arch_cap(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setenv("KVSENTRY_CPU_ARCH", "avx2")
    assert ops_library.cpu_capability() == "AVX2"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert ops_library.cpu_capability() == "DEFAULT"  # never above what the CPU runs
    monkeypatch.setenv("KVSENTRY_CPU_ARCH", "sse9")
    with pytest.raises(ValueError, match="KVSENTRY_CPU_ARCH"):
        ops_library.cpu_capability()
