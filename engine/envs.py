"""Every KVSENTRY_* environment variable. The engine's and the server's (VARIABLES) are read
here and nowhere else; the repository's tooling variables (TOOLING: the test runner, CI, the GPU
check and image scripts) are declared here too, and read by the script that owns each (a shell
script cannot ask this module). tests/test_architecture.py holds every KVSENTRY_* name in the
repository to these two lists. What each operator switch is for: docs/kernels.md.

Each is read when asked for (not at import), so a process sees its own environment and a
test may set one for a single call. The CLI and the config never read the environment
themselves; they ask this module.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class EnvVar:
    name: str
    help: str


VARIABLES = (
    EnvVar("KVSENTRY_API_KEY", "default of --api-key: the bearer key every /v1 request must carry"),
    EnvVar("KVSENTRY_CACHE_DIR", "where the built-in demo checkpoints are written (default ~/.cache/kvsentry)"),
    EnvVar("KVSENTRY_EXTENSION_DIR", "build cache of the csrc/ ops (default ~/.cache/kvsentry/torch_extensions)"),
    EnvVar("KVSENTRY_CSRC_DIR", "the csrc/ sources (default: the checkout's); with none, a prebuilt library loads"),
    EnvVar("KVSENTRY_CPU_ARCH", "cap the CPU kernels' vector ISA: DEFAULT, AVX2 or AVX512"),
    EnvVar("KVSENTRY_DISABLE_CPU_OPS", "=1: never use the CPU kernels (the torch reference runs)"),
    EnvVar("KVSENTRY_DISABLE_AMX_PANELS", "=1: on AMX CPUs, bf16 linears keep oneDNN's weight alone "
           "(no second, panel copy for decode-sized steps)"),
    EnvVar("KVSENTRY_DISABLE_F32_PANELS", "=1: float32 linears keep oneDNN's weight alone "
           "(no second, panel copy for decode-sized steps)"),
    EnvVar("KVSENTRY_DISABLE_QUANT_PANELS", "=1: a GGUF checkpoint's Q4_1/Q8_0 linears run from bf16 or float32 "
           "panels instead of their own blocks (engine/models/cpu_gemm.py)"),
    EnvVar("KVSENTRY_DISABLE_QUANT_ROWS", "=1: on AMX CPUs, Q4_1 blocks keep the panel layout instead of the rows "
           "layout (csrc/cpu/cpu_quant_panels.h; the same bits)"),
    EnvVar("KVSENTRY_DISABLE_PREFILL_TILES", "=1: prefill attention skips the tiled prefill kernel (AMX or "
           "AVX-512F tiles; the decode kernel's rows or SDPA instead)"),
    EnvVar("KVSENTRY_DISABLE_HUGE_PAGES", "=1: packed CPU weights and the CPU KV cache on torch's allocator, "
           "not on transparent huge pages (engine/memory/huge_pages.py)"),
    EnvVar("KVSENTRY_DEFAULT_MALLOC", "=1: leave glibc's malloc settings alone (engine/memory/host_memory.py)"),
    EnvVar("KVSENTRY_REQUIRE_CPU_OPS", "=1: a failed CPU kernel build is an error, never a fallback"),
    EnvVar("KVSENTRY_DISABLE_CUDA_OPS", "=1: never use the CUDA kernels (the torch reference runs)"),
    EnvVar("KVSENTRY_REQUIRE_CUDA_OPS", "=1: a failed CUDA kernel build is an error, never a fallback"),
    EnvVar("KVSENTRY_DEBUG_OPS", "=1: load the test build of the csrc/ library, with its kvsentry_debug op "
           "namespace (the test suite sets it; a server never needs it)"),
)
TOOLING = (
    EnvVar("KVSENTRY_REQUIRE_CSRC_BUILD", "=1 (CI): a missing C++/CUDA toolchain fails tests/csrc/ instead of "
           "skipping it (tests/csrc/conftest.py, through require_csrc_build)"),
    EnvVar("KVSENTRY_TEST_WORKERS", "pytest-xdist workers of scripts/test (default 2; 0: one process)"),
    EnvVar("KVSENTRY_WHEELS", "where scripts/gpu_wheels.sh writes, and scripts/gpu_check.sh reads, the "
           "wheels carried to a GPU machine (default .whl)"),
    EnvVar("KVSENTRY_WHEEL_SITE", "the private site directory scripts/gpu_check.sh installs those wheels into"),
    EnvVar("KVSENTRY_IMAGE_CACHE", "where scripts/image_base.sh keeps saved base images (default ~/.cache/kvsentry)"),
)
_NAMES = {v.name for v in VARIABLES} | {"KVSENTRY_REQUIRE_CSRC_BUILD"}


def _get(name: str) -> str | None:
    assert name in _NAMES, f"{name} is not declared in engine/envs.py"
    return os.environ.get(name) or None


def _flag(name: str) -> bool:
    return _get(name) == "1"


def disable_amx_panels() -> bool:
    return _flag("KVSENTRY_DISABLE_AMX_PANELS")


def disable_f32_panels() -> bool:
    return _flag("KVSENTRY_DISABLE_F32_PANELS")


def disable_quant_panels() -> bool:
    return _flag("KVSENTRY_DISABLE_QUANT_PANELS")


def disable_quant_rows() -> bool:
    return _flag("KVSENTRY_DISABLE_QUANT_ROWS")


def disable_huge_pages() -> bool:
    return _flag("KVSENTRY_DISABLE_HUGE_PAGES")


def disable_prefill_tiles() -> bool:
    return _flag("KVSENTRY_DISABLE_PREFILL_TILES")


def default_malloc() -> bool:
    return _flag("KVSENTRY_DEFAULT_MALLOC")


def api_key() -> str | None:
    return _get("KVSENTRY_API_KEY")


def cache_dir() -> Path:
    root = _get("KVSENTRY_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "kvsentry"


def extension_dir() -> Path:
    root = _get("KVSENTRY_EXTENSION_DIR")
    return Path(root) if root else Path.home() / ".cache" / "kvsentry" / "torch_extensions"


def csrc_dir() -> Path:
    root = _get("KVSENTRY_CSRC_DIR")
    return Path(root) if root else _REPO_ROOT / "csrc"


def cpu_arch_cap() -> str:
    """'' (no cap) or the requested ISA, upper-cased."""
    return (_get("KVSENTRY_CPU_ARCH") or "").upper()


def disable_cpu_ops() -> bool:
    return _flag("KVSENTRY_DISABLE_CPU_OPS")


def require_cpu_ops() -> bool:
    return _flag("KVSENTRY_REQUIRE_CPU_OPS")


def disable_cuda_ops() -> bool:
    return _flag("KVSENTRY_DISABLE_CUDA_OPS")


def require_cuda_ops() -> bool:
    return _flag("KVSENTRY_REQUIRE_CUDA_OPS")


def debug_ops() -> bool:
    return _flag("KVSENTRY_DEBUG_OPS")


def require_csrc_build() -> bool:
    return _flag("KVSENTRY_REQUIRE_CSRC_BUILD")
