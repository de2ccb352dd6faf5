"""The tree reads as the architecture: no import cycles, no private names imported across
modules, no KVSENTRY_* environment read outside engine/envs.py, files small enough to read."""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "service")
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _imports(path: Path, name: str, modules: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(imported module, imported names) for every import of a project module, anywhere in the file."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names if alias.name.split(".")[0] in PACKAGES]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] not in PACKAGES:
                continue
            names = [alias.name for alias in node.names]
            submodules = [f"{base}.{n}" for n in names if f"{base}.{n}" in modules]
            found += [(m, []) for m in submodules]
            others = [n for n in names if f"{base}.{n}" not in modules]
            if others or not submodules:  # `from pkg import submodule` does not depend on pkg's own names
                found.append((base, others))
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        graph[name] = {target for target, _ in _imports(path, name, modules)
                       if target in modules and target != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_detector_finds_a_cycle(tmp_path, monkeypatch):
    """The cycle test can fail: a planted two-module cycle is reported."""
    pkg = tmp_path / "engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from engine import b\n")
    (pkg / "b.py").write_text("def f():\n    from engine.a import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ("engine",))
    assert ["engine.a", "engine.b", "engine.a"] in _cycles(_graph())


def test_no_private_names_imported_across_modules():
    modules = _modules()
    bad = []
    for name, path in modules.items():
        for target, names in _imports(path, name, modules):
            bad += [f"{name} imports {target}.{n}" for n in names if n.startswith("_") and n != "__version__"]
    assert not bad, "\n".join(bad)


def test_environment_read_in_one_module():
    """Every KVSENTRY_* variable is read by engine/envs.py and nowhere else."""
    pattern = re.compile(r"""(os\.environ(\.get)?|os\.getenv|environ)\s*[\[(]\s*["']KVSENTRY_""")
    offenders = [str(path.relative_to(ROOT)) for path in _modules().values()
                 if path.name != "envs.py" and pattern.search(path.read_text())]
    assert not offenders, f"KVSENTRY_* read outside engine/envs.py: {offenders}"
    from engine import envs
    mentioned = set(re.findall(r"(?<!-D)KVSENTRY_[A-Z0-9_]+", "".join(p.read_text() for p in _modules().values())))
    declared = {v.name for v in envs.VARIABLES + envs.TOOLING}
    assert mentioned <= declared, f"undeclared in engine/envs.py: {sorted(mentioned - declared)}"


def test_files_fit_in_one_sitting():
    long = {str(p.relative_to(ROOT)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_engine_tree_has_a_package_per_concern():
    for package in ("core", "worker", "ops", "dp", "frontend", "models"):
        assert (ROOT / "engine" / package / "__init__.py").is_file(), package
    flat = sorted(p.name for p in (ROOT / "engine").glob("*.py"))
    assert len(flat) <= 8, f"engine/ root holds {flat}: put modules in their concern's package"


# --- the kernel registry (engine/ops/registry.py) ---

REGISTRY_MODULE = ROOT / "engine" / "ops" / "registry.py"
# torch.ops.kvsentry, by attribute or by getattr; the test build's kvsentry_debug namespace is another name.
PRODUCTION_OP = re.compile(r"torch\.ops\.kvsentry\b(?!_debug)")


def _code_files(*folders: str) -> list[Path]:
    files = []
    for folder in folders:
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in (".py", ".sh", "")]
    return files


def test_production_ops_are_reached_through_the_registry_only():
    """Only the registry's module names torch.ops.kvsentry: the dispatch, the build and the report
    come from its table, so a kernel is one row there."""
    offenders = [str(p.relative_to(ROOT)) for p in _code_files("engine", "service", "benchmarks", "scripts")
                 if p != REGISTRY_MODULE and PRODUCTION_OP.search(p.read_text(errors="ignore"))]
    assert not offenders, f"torch.ops.kvsentry outside engine/ops/registry.py: {offenders}"


def test_the_detector_finds_a_direct_op_call():
    assert PRODUCTION_OP.search("y = torch.ops.kvsentry.bf16_gemm(x, w, None, n)")
    assert PRODUCTION_OP.search('getattr(torch.ops.kvsentry, "rms_norm")')
    assert not PRODUCTION_OP.search("torch.ops.kvsentry_debug.cpu_bf16_dot(False)")


def test_every_source_under_csrc_is_in_one_registry_row():
    from engine.ops import registry
    on_disk = {str(p.relative_to(ROOT / "csrc")) for p in (ROOT / "csrc").rglob("*") if p.suffix in (".cpp", ".cu")}
    listed = set(registry.COMMON_SOURCES) | {s for k in registry.KERNELS for s in k.sources}
    assert on_disk == listed, f"on disk only: {sorted(on_disk - listed)}; listed only: {sorted(listed - on_disk)}"
    assert set(registry.sources(with_cuda=True)) == listed
    assert "cuda/cache_kernels.cu" not in registry.sources(with_cuda=False)


def test_every_registered_op_is_in_the_registry_or_the_debug_namespace():
    """Load the library (the test build) and read what it registers from torch's dispatcher."""
    import torch
    from engine.ops import cpu_ops, registry
    if not cpu_ops.available():
        import pytest
        pytest.fail("the csrc/ library did not build or load (see the warning in the log)")
    registered = [name.split("::") for name in torch._C._dispatch_get_all_op_names()
                  if name.split("::")[0] in ("kvsentry", "kvsentry_debug")]
    production = {op.split(".")[0] for namespace, op in registered if namespace == "kvsentry"}
    debug = {op.split(".")[0] for namespace, op in registered if namespace == "kvsentry_debug"}
    assert production <= registry.SCHEMAS, f"registered but in no registry row: {sorted(production - registry.SCHEMAS)}"
    assert registry.SCHEMAS <= production, f"in the registry but not registered: {sorted(registry.SCHEMAS - production)}"
    # The test switches live in the debug namespace, never in the production one.
    switches = {"cpu_bf16_dot", "cpu_attention_amx", "bf16_gemm_with", "norm_sum_lanes",
                "plan_reshape_and_cache_flash", "plan_concat_and_cache_mla"}
    assert switches <= debug and not switches & production


def test_every_kvsentry_variable_in_the_repository_is_declared():
    """The engine's variables and the tooling's (scripts, CI) are all in engine/envs.py; C
    preprocessor names (-DKVSENTRY_*, header guards) are the compiler's, not the environment's."""
    from engine import envs
    files = _code_files("engine", "service", "benchmarks", "scripts", "tests", ".ci") + [ROOT / "Dockerfile"]
    files += list((ROOT / "deploy").rglob("*.yaml"))
    found = {}
    for path in files:
        for name in re.findall(r"(?<!-D)\bKVSENTRY_[A-Z0-9_]+", path.read_text(errors="ignore")):
            found.setdefault(name, str(path.relative_to(ROOT)))
    compiler = {"KVSENTRY_WITH_CUDA", "KVSENTRY_DEBUG_OPS"}  # also declared, for the build flavour
    # Kubernetes injects <SERVICE>_PORT for a Service named kvsentry; the deployment turns that off.
    injected = {"KVSENTRY_PORT"}
    declared = {v.name for v in envs.VARIABLES + envs.TOOLING} | compiler | injected
    undeclared = {name: where for name, where in found.items() if name not in declared}
    assert not undeclared, f"KVSENTRY_* names declared nowhere in engine/envs.py: {undeclared}"
