"""benchmarks/kv_write_bandwidth.py and scripts/gpu_check.sh on a machine without a GPU."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "kv_write_bandwidth.py"
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


def load_benchmark():
    spec = importlib.util.spec_from_file_location("kv_write_bandwidth", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


@no_cuda
def test_benchmark_without_cuda_says_so_and_exits_0():
    proc = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert "CUDA is not available" in proc.stdout


@no_cuda
def test_benchmark_cpu_reference_is_labelled(capsys):
    assert load_benchmark().main(["--cpu-reference", "--tokens", "1", "64", "--iters", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "torch reference only, no kernel measured" in out
    assert "reshape_and_cache_flash" in out and "concat_and_cache_mla" in out


def test_benchmark_kernel_path_runs(kvsentry_ops, tmp_path, capsys):
    """The GPU code path, driven through the ops' CPU implementation: every op, fp8, the JSON."""
    out_json = tmp_path / "bw.json"
    code = load_benchmark().main(["--smoke-cpu", "--fp8", "--tokens", "1", "40", "--iters", "1", "--repeats", "1",
                                  "--target-from", "1", "--json", str(out_json)])
    assert code == 0
    rows = json.loads(out_json.read_text())["rows"]
    assert [(r["op"], r["tokens"]) for r in rows] == [
        (op, n) for op in ("reshape_and_cache_flash", "concat_and_cache_mla",
                           "reshape_and_cache_flash fp8", "concat_and_cache_mla fp8") for n in (1, 40)]
    assert all(r["kernel_gbs"] > 0 and r["copy_gbs"] > 0 and r["reference_gbs"] > 0 for r in rows)
    assert "target: kernel >= 80% of d2d copy bandwidth at >= 1 tokens" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert os.access(SCRIPT, os.X_OK), "scripts/gpu_check.sh must be executable"


@no_cuda
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_without_a_gpu_checks_nothing_and_says_so(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    proc = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Nothing checked" in proc.stdout


def write_probe_wheel(directory: Path) -> Path:
    """A minimal pure-Python wheel (the format pip installs), standing in for a carried one."""
    import zipfile
    files = {
        "kvs_probe/__init__.py": "CARRIED = True\n",
        "kvs_probe-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: kvs_probe\nVersion: 0.1\n",
        "kvs_probe-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: kvsentry-tests\nRoot-Is-Purelib: true\n"
                                         "Tag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + "kvs_probe-0.1.dist-info/RECORD,,\n"
    path = directory / "kvs_probe-0.1-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in {**files, "kvs_probe-0.1.dist-info/RECORD": record}.items():
            wheel.writestr(name, text)
    return path


@no_cuda
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_installs_carried_wheels_into_a_private_site(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    write_probe_wheel(wheels)
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
           "KVSENTRY_WHEELS": str(wheels), "KVSENTRY_WHEEL_SITE": str(site)}
    proc = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"carried wheels installed into {site}: kvs_probe-0.1-py3-none-any.whl" in proc.stdout
    assert (site / "kvs_probe" / "__init__.py").is_file()
    assert "python modules: all of" in proc.stdout and "Nothing checked" in proc.stdout


@no_cuda
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_names_a_missing_module_before_building(tmp_path):
    # A package on PYTHONPATH whose import fails stands in for one the GPU machine lacks.
    shadow = tmp_path / "shadow" / "msgspec"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('not on this machine')\n")
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
           "KVSENTRY_WHEELS": str(tmp_path / "no-wheels"), "PYTHONPATH": str(tmp_path / "shadow")}
    proc = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "missing python modules: msgspec. Nothing checked." in proc.stdout
    assert "scripts/gpu_wheels.sh msgspec" in proc.stdout
    assert not (tmp_path / "out" / "build.log").exists()
