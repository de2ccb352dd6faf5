"""Where benchmark results go, and what names them: benchmarks/results/, one JSON per run, named and
stamped with the UTC date, the machine kind and the commit measured (never a run number)."""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"


def commit() -> str:
    """The checked-out commit, short; "+dirty" when tracked files differ from it (what ran is not
    exactly that commit)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short=7", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return f"{head}+dirty" if dirty else head


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    return set(line.partition(":")[2].split())


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_kind() -> str:
    """A short name of the CPU kind a measurement ran on: family, the widest bf16/vector
    feature, cores. "xeon-amx-2c", "epyc-avx512bf16-2c"."""
    model = cpu_model().lower()
    family = next((name for name in ("xeon", "epyc", "ryzen", "core") if name in model),
                  re.sub(r"[^a-z0-9]+", "-", model).strip("-")[:24] or "cpu")
    flags = _cpu_flags()
    isa = next((label for flag, label in (("amx_bf16", "amx"), ("avx512_bf16", "avx512bf16"),
                                          ("avx512f", "avx512"), ("avx2", "avx2"), ("asimd", "neon"))
                if flag in flags), "scalar")
    return f"{family}-{isa}-{os.cpu_count()}c"


def provenance() -> dict:
    """What a result JSON says about where and when it was measured."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "time_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M"),
            "commit": commit(), "machine": machine_kind(), "cpu": cpu_model(), "cores": os.cpu_count()}


def result_path(name: str, stamp: dict, directory: Path = RESULTS_DIR) -> Path:
    """benchmarks/results/NAME_DATE_MACHINE_COMMIT.json; NAME says what ran ("serve-bfloat16")."""
    return directory / f"{name}_{stamp['date']}_{stamp['machine']}_{stamp['commit']}.json"


def write_result(name: str, payload: dict, path: str | Path | None = None, stamp: dict | None = None) -> Path:
    """Write `payload` with its provenance (`stamp`, taken when the run started; else now) under
    benchmarks/results/ (or at `path`); returns the path."""
    stamp = stamp or provenance()
    target = Path(path) if path else result_path(name, stamp)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({"provenance": stamp, **payload}, indent=1) + "\n")
    print(f"results: {target}", flush=True)
    return target
