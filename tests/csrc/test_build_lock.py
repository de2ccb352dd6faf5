"""A build killed midway (a server stopped during its first start) leaves torch's `lock` file in
the build directory; the next start must not wait on it forever (engine/ops/library.py's
_sole_builder removes it while it holds the directory's flock)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.ops import registry

SCRIPT = """
from engine.ops import cpu_ops, library
assert cpu_ops.available(), "ops not built"
print("loaded", library.loaded().path)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="copies the CPU-only build")
def test_a_lock_left_by_a_killed_build_does_not_hang_the_next(kvsentry_ops, tmp_path):
    library = Path(registry.build(with_cuda=False))  # the session's build (the fixture made it)
    built = library.parent
    env = {**os.environ, "KVSENTRY_EXTENSION_DIR": str(tmp_path), "KVSENTRY_REQUIRE_CPU_OPS": "1",
           "PYTHONPATH": os.getcwd()}
    env.pop("KVSENTRY_DISABLE_CPU_OPS", None)
    probe = subprocess.run([sys.executable, "-c", "from engine.ops import library; "
                            "print(library.default_build_directory(False))"],
                           env=env, capture_output=True, text=True, check=True)
    target = tmp_path / os.path.basename(probe.stdout.strip())
    shutil.copytree(built, target)  # objects and all: ninja finds them up to date
    (target / "lock").touch()  # what a builder killed midway leaves
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert f"loaded {target / library.name}" in run.stdout
    assert not (target / "lock").exists()
