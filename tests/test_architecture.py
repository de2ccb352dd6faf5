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
    declared = {v.name for v in envs.VARIABLES}
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
