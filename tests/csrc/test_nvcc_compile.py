"""nvcc compiles the CUDA kernels on a machine without a GPU, so the device code cannot rot.

Two targets: sm_90 (H100/H200, where the kernels run) and nvcc's default
target. With -Werror all-warnings, because nvcc only *warns* when device code
calls a host function and then drops the call: a kernel that silently writes
nothing. ptxas's report and the kept PTX then show every kernel instantiation
really copies (stores, the null-block counter's atomic), uses 16-byte vector
accesses, and spills nothing.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch.utils.cpp_extension as cpp_extension

from engine.ops import library
from tests.csrc.conftest import skip_or_fail

pytestmark = pytest.mark.nvcc

CSRC = Path(__file__).resolve().parents[2] / "csrc"
NVCC = shutil.which("nvcc")

# 5 copy widths + 3 input dtypes x {vector, scalar} fp8 groups, for each op.
EXPECTED_KERNELS = 2 * (5 + 6)


def nvcc_command(out_dir: Path, gencode: list[str]) -> list[str]:
    """The exact command CI runs (printed on failure): the flags torch's JIT build gives nvcc
    (engine/ops/library.py's NVCC_FLAGS, torch's defines, includes and -std) plus -Werror."""
    return [NVCC, *library.NVCC_FLAGS, *cpp_extension.COMMON_NVCC_FLAGS, "-std=c++20",
            "-DTORCH_EXTENSION_NAME=kvsentry_ops_cuda", "-DTORCH_API_INCLUDE_EXTENSION_H",
            "-Werror", "all-warnings", "--compiler-options", "-fPIC", f"-I{CSRC / 'common'}",
            *(arg for p in cpp_extension.include_paths() for arg in ("-isystem", p)),
            *gencode, "--resource-usage", "-keep", "-keep-dir", str(out_dir),
            "-c", str(CSRC / "cuda" / "cache_kernels.cu"), "-o", str(out_dir / "cache_kernels.o")]


@pytest.fixture(scope="session")
def compiled(tmp_path_factory):
    """Both compiles, run side by side; {target: (command, returncode, output, out_dir)}."""
    missing = [tool for tool, path in (("nvcc", NVCC), ("c++", shutil.which("c++"))) if path is None]
    if missing:
        skip_or_fail(f"{' and '.join(missing)} not on PATH")
    targets = {"sm_90": ["-gencode", "arch=compute_90,code=[sm_90,compute_90]"], "default": []}
    running = {}
    for name, gencode in targets.items():
        out_dir = tmp_path_factory.mktemp(f"nvcc_{name}")
        command = nvcc_command(out_dir, gencode)
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "LC_ALL": "C"})
        running[name] = (command, proc, out_dir)
    # The host side of the CUDA variant (no stubs), for the link check below.
    host_dir = tmp_path_factory.mktemp("host_cuda")
    host_cmd = [shutil.which("c++"), "-O2", "-std=c++20", "-fPIC", "-DKVSENTRY_WITH_CUDA", f"-I{CSRC / 'common'}",
                "-c", str(CSRC / "cpu" / "cache_kernels_host.cpp"), "-o", str(host_dir / "cache_kernels_host.o")]
    running["host_cuda"] = (host_cmd, subprocess.Popen(host_cmd, stdout=subprocess.PIPE,
                                                       stderr=subprocess.STDOUT, text=True), host_dir)
    results = {}
    for name, (command, proc, out_dir) in running.items():
        output, _ = proc.communicate(timeout=300)
        results[name] = (command, proc.returncode, output, out_dir)
    return results


def ptxas_kernels(output: str) -> dict[str, str]:
    """{mangled kernel name: its ptxas report} for every compiled entry function."""
    reports = {}
    for block in re.split(r"(?=ptxas info\s+: Compiling entry function)", output):
        m = re.match(r"ptxas info\s+: Compiling entry function '(\w+)' for '(sm_\d+a?)'", block)
        if m:
            reports[f"{m.group(1)}@{m.group(2)}"] = block
    return reports


def ptx_entries(out_dir: Path) -> dict[str, str]:
    """{mangled kernel name: PTX body} from the kept .ptx files."""
    entries = {}
    for ptx in out_dir.glob("*.ptx"):
        for m in re.finditer(r"\.entry (\w+)\((.*?)\n}\n", ptx.read_text(), flags=re.S):
            entries[m.group(1)] = m.group(2)
    return entries


@pytest.mark.parametrize("target", ["sm_90", "default"])
def test_nvcc_compiles_kernels(compiled, target):
    command, returncode, output, _ = compiled[target]
    assert returncode == 0, f"nvcc failed ({returncode}):\n{' '.join(command)}\n{output}"
    kernels = ptxas_kernels(output)
    assert len(kernels) == EXPECTED_KERNELS, f"expected {EXPECTED_KERNELS} kernels, ptxas compiled:\n{output}"
    for name, report in kernels.items():
        assert "0 bytes spill stores" in report and "0 bytes spill loads" in report, f"{name} spills:\n{report}"
    if target == "sm_90":
        assert all(name.endswith("@sm_90") for name in kernels), sorted(kernels)


def test_every_kernel_writes_and_counts(compiled):
    """Each instantiation keeps its stores and the null-block atomic (a body dropped by nvcc would not)."""
    _, returncode, output, out_dir = compiled["sm_90"]
    assert returncode == 0, output
    entries = ptx_entries(out_dir)
    assert len(entries) == EXPECTED_KERNELS, sorted(entries)
    for name, body in entries.items():
        assert "atom.global.add.u64" in body, f"{name}: no null-block counter update"
        assert re.search(r"\bst\.global\.", body), f"{name}: stores nothing"
        assert re.search(r"\bld\.global\.", body), f"{name}: loads nothing"


def test_vectorised_paths_use_16_byte_accesses(compiled):
    _, returncode, output, out_dir = compiled["sm_90"]
    assert returncode == 0, output
    entries = ptx_entries(out_dir)
    wide = {name: body for name, body in entries.items() if "CopyILi16E" in name}
    assert len(wide) == 2, sorted(entries)  # KvCopy<16>, MlaCopy<16>
    for name, body in wide.items():
        assert re.search(r"ld\.global(\.nc)?\.v4\.u32", body), f"{name}: no 16-byte loads"
        assert "st.global.v4.u32" in body, f"{name}: no 16-byte stores"
    fp8_vec = {name: body for name, body in entries.items() if re.search(r"Fp8INS_\d+(F16|BF16)InELi8E", name)}
    assert len(fp8_vec) == 4, sorted(entries)  # {Kv,Mla} x {f16, bf16}, 8 elements a group
    for name, body in fp8_vec.items():
        assert re.search(r"ld\.global(\.nc)?\.v4\.u32", body), f"{name}: no 16-byte loads"
        assert "st.global.v2.u32" in body, f"{name}: no 8-byte stores"


def test_cuda_variant_links_every_c_abi_function_once(compiled, tmp_path):
    """The JIT build's kernel half: cache_kernels.cu + cache_kernels_host.cpp built with
    KVSENTRY_WITH_CUDA link with no undefined symbol and define each function of cache_kernels.h."""
    for target in ("sm_90", "host_cuda"):
        command, returncode, output, _ = compiled[target]
        assert returncode == 0, f"{' '.join(command)}\n{output}"
    library = tmp_path / "libkvsentry_kernels.so"
    link = [NVCC, "-shared", "-Xlinker", "--no-undefined", str(compiled["sm_90"][3] / "cache_kernels.o"),
            str(compiled["host_cuda"][3] / "cache_kernels_host.o"), "-o", str(library)]
    proc = subprocess.run(link, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(link)}\n{proc.stdout}{proc.stderr}"
    declared = set(re.findall(r"^\w[\w\s*]*?\b(kvsentry_\w+)\(", (CSRC / "common" / "cache_kernels.h").read_text(), flags=re.M))
    assert len(declared) == 7, declared
    nm = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True)
    defined = re.findall(r" T (kvsentry_\w+)$", nm.stdout, flags=re.M)
    assert sorted(defined) == sorted(declared)
