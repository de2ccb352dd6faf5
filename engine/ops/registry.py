"""The kernel registry: one row per (op, device) that a csrc/ kernel (or a maintained one,
torch's FlexAttention) implements. Everything else reads this table:

- the build: the library compiles the sources of every row (engine/ops/library.py);
- the dispatch: `op(name)` is the only way to a `torch.ops.kvsentry` op, and `runs(op, device)`
  says whether a row's kernel runs there (built, not switched off, its schemas registered);
- the report: engine/ops/implementations.py turns each row into the `kvsentry_op_implementation_info`
  metric and the rank's start-up line, its `label` where the kernel runs, its `fallback` where not.

A fallback is never silent: a row that should run but does not is logged as a warning at start
(service/state.py). It is not free either: the torch references match the kernels bit for bit
for the KV writers, checksums, NaN scan and fused elementwise ops, and within a tolerance for
attention and the GEMMs (another summation order; tests/csrc/ pins each bound).

Environment (engine/envs.py): KVSENTRY_DISABLE_CPU_OPS / KVSENTRY_DISABLE_CUDA_OPS (the
operator's escape hatch: every row of that device on its fallback), KVSENTRY_REQUIRE_CPU_OPS /
KVSENTRY_REQUIRE_CUDA_OPS (a failed build raises instead of falling back).
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch

from engine import envs
from engine.ops import flex_attention, library

log = logging.getLogger(__name__)

TORCH_REFERENCE = "torch_reference"
ONEDNN = "onednn"
PYTHON_LOOP = "python_loop"


@dataclass(frozen=True, eq=False)  # a row is itself: hashed by identity, cheaply, per call
class Kernel:
    op: str                     # what the metric and the log call it
    device: str                 # the device type it runs on; elsewhere its op runs `fallback`
    sources: tuple[str, ...]    # its files under csrc/ (none: not ours, e.g. FlexAttention)
    schemas: tuple[str, ...]    # the torch.ops.kvsentry ops those sources register
    fallback: str               # the implementation that runs where this kernel does not
    label: str = "cpu_kernel"   # the implementation, where it runs
    probe: str | None = None    # a schema of () -> bool: whether this CPU (and build) runs it
    kernels: str | None = None  # a schema of () -> str[]: the kernels it picks from on this CPU, named in the label


# Every library build carries these: the schemas, checks and CPU/CUDA/Meta dispatch of the writers.
COMMON_SOURCES = ("common/torch_bindings.cpp",)
_WRITER_SCHEMAS = ("reshape_and_cache_flash", "concat_and_cache_mla", "built_with_cuda", "abi_version")

KERNELS: tuple[Kernel, ...] = (
    # Paged attention, decode rows (and the MLA decode, and prefill as one row per token): on
    # CUDA the decode rows (all of a CUDA-graph step) run FlexAttention.
    Kernel("paged_attention", "cpu", ("cpu/cpu_attention.cpp", "cpu/cpu_attention_amx.cpp"),
           ("paged_decode_attention",), TORCH_REFERENCE),
    Kernel("paged_attention", "cuda", (), (), TORCH_REFERENCE, label="flex_attention"),
    # Prefill chunks in tiles (AMX, or AVX-512F vectors); the fallback is SDPA per request.
    Kernel("prefill_attention", "cpu", ("cpu/cpu_prefill_attention.cpp", "cpu/cpu_prefill_attention_amx.cpp"),
           ("paged_prefill_attention", "paged_prefill_attention_fits"), TORCH_REFERENCE),
    # The cache writers: CUDA kernels, and on CPU the same per-token code run on the host.
    Kernel("kv_writer", "cuda", ("cuda/cache_kernels.cu",), _WRITER_SCHEMAS, TORCH_REFERENCE, label="cuda_kernel"),
    Kernel("kv_writer", "cpu", ("cpu/cache_kernels_host.cpp",), _WRITER_SCHEMAS, TORCH_REFERENCE),
    # Sealed-block checksums (on a GPU the torch reference runs on the device).
    Kernel("kv_checksum", "cpu", ("cpu/cpu_checksum.cpp",), ("kv_block_checksums",), TORCH_REFERENCE),
    # The NaN sentinel's scan of 16- and 8-bit caches.
    Kernel("kv_nan_scan", "cpu", ("cpu/cpu_nonfinite.cpp",), ("kv_block_nonfinite", "kv_block_nonfinite_into"),
           TORCH_REFERENCE),
    # RMSNorm, add+RMSNorm, rotary, SiLU-and-multiply (engine/ops/fused_ops.py).
    Kernel("fused_ops", "cpu", ("cpu/cpu_fused_ops.cpp",), ("rms_norm", "add_rms_norm", "rotary", "silu_and_mul"),
           TORCH_REFERENCE),
    # A dense decoder's whole layer stack as one op (engine/models/fused_stack.py).
    Kernel("decoder_layers", "cpu", ("cpu/cpu_decoder_layers.cpp",), ("dense_decoder_layers",), PYTHON_LOOP),
    # Greedy sampling's argmax and finiteness check in one pass (engine/worker/sampler.py).
    Kernel("row_argmax", "cpu", ("cpu/cpu_argmax.cpp",), ("row_argmax",), TORCH_REFERENCE),
    # The linears' panel GEMMs (engine/models/cpu_gemm.py; which path each linear kind takes is
    # reported per model by the runner), and a GGUF checkpoint's blocks as their panels.
    Kernel("bf16_gemm", "cpu", ("cpu/cpu_bf16_gemm.cpp", "cpu/cpu_bf16_gemm_rows.cpp"),
           ("bf16_gemm_pack", "bf16_gemm", "bf16_gemm_supported", "bf16_gemm_kernels"), ONEDNN,
           probe="bf16_gemm_supported"),
    Kernel("f32_gemm", "cpu", ("cpu/cpu_f32_gemm.cpp",), ("f32_gemm_pack", "f32_gemm", "f32_gemm_supported"), ONEDNN,
           probe="f32_gemm_supported"),
    Kernel("quant_panels", "cpu", ("cpu/cpu_quant_panels.cpp",),
           ("quant_panels_pack", "quant_panels_unpack", "quant_panels_supported", "quant_rows_pack",
            "quant_rows_supported"), ONEDNN),
    # GGUF linears with int8 activations against their Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K blocks
    # (AVX512-VNNI, and AMX-INT8 tiles for larger batches of Q4_0/Q4_1/Q8_0; or, on CPUs without
    # AVX-512, AVX-VNNI; engine/models/int8_linear.py); elsewhere engine/models/int8_reference.py,
    # the same bits. Labelled e.g. "cpu_kernel(amx_int8+avx512_vnni)", "cpu_kernel(avx_vnni)".
    Kernel("int8_gemm", "cpu", ("cpu/cpu_int8_gemm.cpp", "cpu/cpu_int8_gemm_amx.cpp", "cpu/cpu_int8_gemm_avx.cpp",
                                "cpu/cpu_int8_rows.cpp"),
           ("int8_gemm_pack", "int8_gemm", "int8_gemm_supported", "int8_gemm_parts", "int8_gemm_kernels",
            "int8_gemm_rows"),
           TORCH_REFERENCE, probe="int8_gemm_supported", kernels="int8_gemm_kernels"),
)
OPS: tuple[str, ...] = tuple(dict.fromkeys(kernel.op for kernel in KERNELS))
SCHEMAS: frozenset[str] = frozenset(name for kernel in KERNELS for name in kernel.schemas)
_ROWS: dict[tuple[str, str], Kernel] = {(kernel.op, kernel.device): kernel for kernel in KERNELS}
assert len(_ROWS) == len(KERNELS), "at most one row per (op, device)"


def _device_type(device: str | torch.device) -> str:
    return device.type if isinstance(device, torch.device) else device.split(":")[0]


def kernel_for(op: str, device: str | torch.device) -> Kernel | None:
    """The row of `op` on `device`'s type, if any."""
    return _ROWS.get((op, _device_type(device)))


def fallback_of(op: str) -> str:
    return next(k.fallback for k in KERNELS if k.op == op)


def sources(with_cuda: bool) -> list[str]:
    """What the library compiles: the CPU rows' sources always (a CUDA build carries them too)."""
    files = list(COMMON_SOURCES)
    for kernel in KERNELS:
        if kernel.device == "cpu" or with_cuda:
            files += [s for s in kernel.sources if s not in files]
    return files


def build(with_cuda: bool, build_directory=None, verbose: bool = False, debug: bool | None = None) -> str:
    """Compile (or load from the cache) the library of every row; returns its path. `debug`
    (default: KVSENTRY_DEBUG_OPS) adds the test-only `kvsentry_debug` namespace."""
    debug = envs.debug_ops() if debug is None else debug
    return library.build(sources(with_cuda), with_cuda, debug, build_directory, verbose)


def op(name: str):
    """torch.ops.kvsentry.<name>: the one way to a production op (tests/test_architecture.py)."""
    if name not in SCHEMAS:
        raise KeyError(f"kvsentry op {name!r} is in no registry row (engine/ops/registry.py)")
    return getattr(torch.ops.kvsentry, name)


def has(name: str) -> bool:
    """Whether the loaded library registers `name` (a library prebuilt from older sources may not)."""
    return name in SCHEMAS and hasattr(torch.ops.kvsentry, name)


def debug_ops():
    """torch.ops.kvsentry_debug, the test build's switches and introspection: loads the debug
    flavour (tests and benchmarks only; raises where the production library is loaded)."""
    build(with_cuda=torch.cuda.is_available(), debug=True)
    return torch.ops.kvsentry_debug


@functools.cache
def _cuda_library_ok() -> bool:
    try:
        build(with_cuda=True)
        return bool(op("built_with_cuda")())
    except Exception as exc:  # no toolkit, compiler error, version mismatch...
        if envs.require_cuda_ops():
            raise
        log.warning("kvsentry CUDA kernels unavailable, their ops run the torch reference: %s", exc)
        return False


@functools.cache
def _cpu_library_ok() -> bool:
    started = time.monotonic()
    try:
        if torch.cuda.is_available():
            # One library per process: the CUDA flavour carries the CPU kernels.
            if envs.disable_cuda_ops() or not _cuda_library_ok():
                return False
        else:
            # A first start compiles csrc/ (a minute or more); later ones load the cache.
            log.info("kvsentry CPU kernels: building or loading from %s", library.default_build_directory(False))
            build(with_cuda=False)
        log.info("kvsentry CPU kernels ready in %.1f s", time.monotonic() - started)
        return has("paged_decode_attention")
    except Exception as exc:  # no compiler, no ninja, a compile error...
        if envs.require_cpu_ops():
            raise
        log.warning("kvsentry CPU kernels unavailable, their ops run the torch reference: %s", exc)
        return False


def library_ready(device_type: str) -> bool:
    """Whether `device_type`'s kernels can run: built (on the first call) and not switched off."""
    if device_type == "cpu":
        return not envs.disable_cpu_ops() and _cpu_library_ok()
    if device_type == "cuda":
        return not envs.disable_cuda_ops() and torch.cuda.is_available() and _cuda_library_ok()
    return False


def runs(kernel: Kernel) -> bool:
    """Whether this row's kernel runs in this process (builds the library on the first call)."""
    if kernel.label == "flex_attention":
        return flex_attention.available()
    return library_ready(kernel.device) and _registered(kernel)


@functools.cache
def _registered(kernel: Kernel) -> bool:  # asked once the library is loaded: it cannot change after
    return all(has(name) for name in kernel.schemas) and (kernel.probe is None or bool(op(kernel.probe)()))


def label(kernel: Kernel) -> str:
    """What the metric and the log call a row that runs: its label, followed by the kernels it
    picks from on this CPU where it names them ("cpu_kernel(amx_int8+avx512_vnni)")."""
    if kernel.kernels is None or not runs(kernel):
        return kernel.label
    return f"{kernel.label}({'+'.join(op(kernel.kernels)())})"


def available(op_name: str, device: str | torch.device) -> bool:
    """Whether `op_name` runs its kernel on `device` (False where it has no row there)."""
    kernel = kernel_for(op_name, device)
    return kernel is not None and runs(kernel)
