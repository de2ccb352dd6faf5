"""Compiling and loading csrc/ as one torch op library (JIT, or prebuilt in an image).

What goes into the library (the sources) is the kernel registry's (engine/ops/registry.py);
this module only knows how to compile a list of sources and load the result. The build goes
through `torch.utils.cpp_extension.load` into a cache directory, so only the first process on
a machine pays for it (an flock serialises DP ranks and concurrent starts).

Flavours: "cpu" (the CPU and Meta implementations), "cuda" (those and the CUDA writers), and
either with `debug`: the same kernels plus the `kvsentry_debug` op namespace (test switches
and introspection, csrc/common/debug_switch.h), which only the test suite and
benchmarks/bf16_gemm.py, int8_gemm.py and limits.py load. A process holds one library: one
TORCH_LIBRARY(kvsentry).

Environment (engine/envs.py):
  KVSENTRY_EXTENSION_DIR    build cache root (default ~/.cache/kvsentry/torch_extensions)
  KVSENTRY_CSRC_DIR         the sources (default: the checkout's csrc/); where there are
                            none, a library prebuilt into the build cache is loaded
  KVSENTRY_CPU_ARCH         cap the CPU kernels' vector ISA: DEFAULT, AVX2 or AVX512
  KVSENTRY_DEBUG_OPS=1      load the debug flavour (the test suite sets it)
  TORCH_CUDA_ARCH_LIST      target GPUs (torch's default: the visible devices)
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from engine import envs

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class Loaded:
    with_cuda: bool
    debug: bool
    path: str


# The library this process loaded, if any.
_loaded: Loaded | None = None


def loaded() -> Loaded | None:
    return _loaded


def csrc() -> Path:
    """The sources: the checkout's csrc/, or KVSENTRY_CSRC_DIR (an image builds from its copy)."""
    return envs.csrc_dir()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where that is not readable: the kernels
    and their callers pick paths by them (amx_bf16, avx512_bf16)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


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


def default_build_directory(with_cuda: bool, debug: bool | None = None) -> Path:
    debug = envs.debug_ops() if debug is None else debug
    flavour = f"cu{torch.version.cuda}" if with_cuda else "cpu"
    suffix = "-debug" if debug else ""
    return envs.extension_dir() / f"torch{torch.__version__.split('+')[0]}-{flavour}-{cpu_capability().lower()}{suffix}"


def build(sources: Sequence[str], with_cuda: bool, debug: bool, build_directory: str | os.PathLike | None = None,
          verbose: bool = False) -> str:
    """Compile `sources` (paths under csrc/) and load the library; returns its path. A library
    already loaded that carries what is asked (the CUDA flavour carries the CPU one, a debug
    flavour the production ops) is returned as is."""
    global _loaded
    if _loaded is not None:
        if (_loaded.with_cuda or not with_cuda) and (_loaded.debug or not debug):
            return _loaded.path
        raise RuntimeError(f"kvsentry ops: {_describe(_loaded.with_cuda, _loaded.debug)} is already loaded in "
                           f"this process; the {_describe(with_cuda, debug)} cannot be loaded next to it")
    directory = Path(build_directory) if build_directory else default_build_directory(with_cuda, debug)
    name = f"kvsentry_ops_{'cuda' if with_cuda else 'cpu'}{'_debug' if debug else ''}"
    root = csrc()
    if not root.is_dir():  # an installed image: load what its build stage compiled
        prebuilt = directory / f"{name}.so"
        if not prebuilt.is_file():
            raise FileNotFoundError(f"kvsentry ops: no sources at {root} (set KVSENTRY_CSRC_DIR) "
                                    f"and no prebuilt library at {prebuilt}")
        torch.ops.load_library(str(prebuilt))
        _loaded = Loaded(with_cuda, debug, str(prebuilt))
        return str(prebuilt)
    from torch.utils.cpp_extension import load
    directory.mkdir(parents=True, exist_ok=True)
    defines = (["-DKVSENTRY_WITH_CUDA"] if with_cuda else []) + (["-DKVSENTRY_DEBUG_OPS"] if debug else [])
    with _sole_builder(directory):
        path = load(name=name, sources=[str(root / s) for s in sources],
                    extra_cflags=CXX_FLAGS + ARCH_FLAGS.get(cpu_capability(), []) + defines,
                    extra_ldflags=LD_FLAGS,
                    extra_cuda_cflags=NVCC_FLAGS + defines, extra_include_paths=[str(root / "common")],
                    build_directory=str(directory), with_cuda=with_cuda,
                    is_python_module=False, verbose=verbose)
    _loaded = Loaded(with_cuda, debug, path)
    return path


def _describe(with_cuda: bool, debug: bool) -> str:
    return f"{'CUDA' if with_cuda else 'CPU-only'}{' debug' if debug else ''} build"


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
