"""The CUDA KV-cache writers of csrc/, JIT-built on first use.

`available()` is what engine.ops.kv_writer asks before dispatching a CUDA cache to
the kernels; everything else (CPU, no CUDA toolkit, a failed build) falls back
to the torch reference there. The build goes through
`torch.utils.cpp_extension.load` into a cache directory, so only the first
process on a machine pays for it (torch's file lock serialises DP ranks).

Environment (engine/envs.py):
  KVSENTRY_EXTENSION_DIR    build cache root (default ~/.cache/kvsentry/torch_extensions)
  KVSENTRY_CSRC_DIR         the sources (default: the checkout's csrc/); where there are
                            none, a library prebuilt into the build cache is loaded
  KVSENTRY_CPU_ARCH         cap the CPU kernels' vector ISA: DEFAULT, AVX2 or AVX512
  KVSENTRY_DISABLE_CUDA_OPS=1  never use the kernels (the reference runs instead)
  KVSENTRY_REQUIRE_CUDA_OPS=1  raise when CUDA is present but the build fails,
                               instead of warning and falling back
  TORCH_CUDA_ARCH_LIST      target GPUs (torch's default: the visible devices)
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
from pathlib import Path
from typing import Iterator

import torch

from engine import envs

log = logging.getLogger(__name__)

# The sources: the checkout's csrc/, or KVSENTRY_CSRC_DIR (an image builds from its copy).
CSRC = envs.csrc_dir()
HOST_SOURCES = ("torch_bindings.cpp", "cache_kernels_host.cpp", "cpu_attention.cpp", "cpu_attention_amx.cpp",
                "cpu_prefill_attention.cpp", "cpu_prefill_attention_amx.cpp", "cpu_checksum.cpp", "cpu_nonfinite.cpp",
                "cpu_fused_ops.cpp",
                "cpu_decoder_layers.cpp", "cpu_bf16_gemm.cpp", "cpu_f32_gemm.cpp", "cpu_argmax.cpp",
                "cpu_quant_panels.cpp")
CUDA_SOURCES = HOST_SOURCES + ("cache_kernels.cu",)
# nvcc only *warns* when device code calls a host function (#20011-#20015),
# then drops the call: a kernel that silently writes nothing. Those are
# errors here; CI compiles csrc/ with -Werror all-warnings besides.
NVCC_FLAGS = ["-O3", "-lineinfo", "--diag-error", "20011,20012,20013,20014,20015"]
# torch picks the C++ standard its headers need. -fopenmp: at::parallel_for runs on torch's
# own OpenMP pool (the library links the libgomp.so.1 torch already loaded, by soname).
CXX_FLAGS = ["-O3", "-fopenmp"]
LD_FLAGS = ["-fopenmp"]
# Vector ISA for the CPU kernels: what torch itself found this CPU runs, capped by
# KVSENTRY_CPU_ARCH (an image prebuilt for AVX2 runs on any x86-64-v3 node).
ARCH_FLAGS = {"AVX512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
              "AVX2": ["-mavx2", "-mfma"]}
_X86_LEVELS = ["DEFAULT", "AVX2", "AVX512"]


def cpu_capability() -> str:
    found = torch.backends.cpu.get_cpu_capability()
    cap = envs.cpu_arch_cap()
    if not cap:
        return found
    if cap not in _X86_LEVELS:
        raise ValueError(f"KVSENTRY_CPU_ARCH={cap!r}: choose one of {', '.join(_X86_LEVELS)}")
    if found not in _X86_LEVELS:
        return found  # not x86: the cap does not apply
    return _X86_LEVELS[min(_X86_LEVELS.index(cap), _X86_LEVELS.index(found))]

# (flavour, library path) once loaded: a process can hold one TORCH_LIBRARY(kvsentry).
_loaded: tuple[str, str] | None = None


def default_build_directory(with_cuda: bool) -> Path:
    root = envs.extension_dir()
    flavour = f"cu{torch.version.cuda}" if with_cuda else "cpu"
    return root / f"torch{torch.__version__.split('+')[0]}-{flavour}-{cpu_capability().lower()}"


def build(with_cuda: bool, build_directory: str | os.PathLike | None = None, verbose: bool = False) -> str:
    """Compile and load the ops; returns the library path. with_cuda=False builds the
    CPU-only variant (CPU + Meta implementations) that the CPU tests use."""
    global _loaded
    flavour = "cuda" if with_cuda else "cpu"
    if _loaded is not None and _loaded[0] in (flavour, "cuda"):
        return _loaded[1]  # the CUDA build carries the CPU and Meta implementations too
    if _loaded is not None:
        raise RuntimeError("kvsentry ops: the CPU-only build is already loaded in this process; "
                           "the CUDA build cannot be loaded next to it")
    directory = Path(build_directory) if build_directory else default_build_directory(with_cuda)
    name = f"kvsentry_ops_{flavour}"
    if not CSRC.is_dir():  # an installed image: load what its build stage compiled
        prebuilt = directory / f"{name}.so"
        if not prebuilt.is_file():
            raise FileNotFoundError(f"kvsentry ops: no sources at {CSRC} (set KVSENTRY_CSRC_DIR) "
                                    f"and no prebuilt library at {prebuilt}")
        torch.ops.load_library(str(prebuilt))
        _loaded = (flavour, str(prebuilt))
        return str(prebuilt)
    from torch.utils.cpp_extension import load
    directory.mkdir(parents=True, exist_ok=True)
    sources = CUDA_SOURCES if with_cuda else HOST_SOURCES
    with _sole_builder(directory):
        path = load(name=name, sources=[str(CSRC / s) for s in sources],
                    extra_cflags=CXX_FLAGS + ARCH_FLAGS.get(cpu_capability(), [])
                    + (["-DKVSENTRY_WITH_CUDA"] if with_cuda else []),
                    extra_ldflags=LD_FLAGS,
                    extra_cuda_cflags=NVCC_FLAGS, extra_include_paths=[str(CSRC)],
                    build_directory=str(directory), with_cuda=with_cuda,
                    is_python_module=False, verbose=verbose)
    _loaded = (flavour, path)
    return path


@contextlib.contextmanager
def _sole_builder(directory: Path) -> Iterator[None]:
    """Hold an flock on the build directory while building. torch's own guard is a `lock` file
    that a builder deletes when done: one killed mid-build (a server stopped during its first
    start) leaves it behind, and every later build waited on it forever. The kernel releases an
    flock with its holder, so whoever holds this one is the only live builder here, and a
    `lock` file it finds is such a leftover: removed."""
    with open(directory / ".kvsentry-build", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                log.warning("kvsentry ops: removing %s, left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def _cuda_build_ok() -> bool:
    try:
        build(with_cuda=True)
        return bool(torch.ops.kvsentry.built_with_cuda())
    except Exception as exc:  # no toolkit, compiler error, version mismatch...
        if envs.require_cuda_ops():
            raise
        log.warning("kvsentry CUDA KV writers unavailable, using the torch reference: %s", exc)
        return False


# Evaluated eagerly and baked in as a constant when torch.compile traces a caller: tracing
# into the cached build would be an unsupported graph break.
@torch.compiler.assume_constant_result
def available() -> bool:
    """True when CUDA caches can use the kernels (builds them on the first call)."""
    if envs.disable_cuda_ops() or not torch.cuda.is_available():
        return False
    return _cuda_build_ok()


def _cuda_only(name: str, *tensors: torch.Tensor | None) -> None:
    for t in tensors:
        if t is not None and not t.is_cuda:
            raise ValueError(f"cuda_ops.{name}: every tensor must be on a CUDA device, got one on {t.device} "
                             "(CPU caches go through engine.ops.kv_writer: the op's host code, or its torch reference)")


def contiguous_rows(x: torch.Tensor) -> torch.Tensor:
    # The kernels read each row as one contiguous run; any other stride is fine.
    return x if x.stride(-1) == 1 else x.contiguous()


def scale_tensor(scale: torch.Tensor | float | None, like: torch.Tensor) -> torch.Tensor | None:
    if scale is None or isinstance(scale, torch.Tensor):
        return scale
    return torch.tensor([scale], dtype=torch.float32, device=like.device)


def reshape_and_cache_flash(key: torch.Tensor,           # [num_tokens, num_kv_heads, head_size]
                            value: torch.Tensor,         # [num_tokens, num_kv_heads, head_size]
                            k_cache: torch.Tensor,       # [num_blocks, block_size, num_kv_heads, head_size]
                            v_cache: torch.Tensor,       # [num_blocks, block_size, num_kv_heads, head_size]
                            slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
                            null_block_writes: torch.Tensor | None = None,  # [1] int64, += writes into block 0
                            scale: torch.Tensor | float | None = None,  # [1] float32, fp8 cache: stored = x / scale
                            ) -> None:
    _cuda_only("reshape_and_cache_flash", key, value, k_cache, v_cache, slot_mapping, null_block_writes)
    # Shapes, dtypes, devices and strides are checked by the op (torch_bindings.cpp), also under torch.compile.
    torch.ops.kvsentry.reshape_and_cache_flash(contiguous_rows(key), contiguous_rows(value), k_cache, v_cache,
                                               slot_mapping, null_block_writes, scale_tensor(scale, k_cache))


def concat_and_cache_mla(kv_c: torch.Tensor,          # [num_tokens, kv_lora_rank]
                         k_pe: torch.Tensor,          # [num_tokens, rope_dim]
                         kv_cache: torch.Tensor,      # [num_blocks, block_size, kv_lora_rank + rope_dim]
                         slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
                         null_block_writes: torch.Tensor | None = None,
                         scale: torch.Tensor | float | None = None,
                         ) -> None:
    _cuda_only("concat_and_cache_mla", kv_c, k_pe, kv_cache, slot_mapping, null_block_writes)
    torch.ops.kvsentry.concat_and_cache_mla(contiguous_rows(kv_c), contiguous_rows(k_pe), kv_cache, slot_mapping,
                                            null_block_writes, scale_tensor(scale, kv_cache))
