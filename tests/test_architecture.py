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


# -- packages: engine/'s sub-packages (and its root modules) point one way ---------------------

# Each sub-package of engine/ with the packages it may import (root modules -- config, messages,
# the step data in request.py -- are shared by all). A package missing here fails the test:
# a new concern states its place.
ALLOWED_PACKAGE_IMPORTS = {
    "memory": set(),                               # host allocation: huge pages, the heap
    "gguf": set(),                                 # the GGUF file format
    "structured": set(),                           # grammars of constrained outputs
    "ops": set(),                                  # kernels and their torch references
    "integrity": {"ops"},                          # sentinel, checksums, write guard, policy
    "models": {"ops", "gguf", "memory", "integrity"},
    "core": set(),                                 # scheduling: it hands down engine/request.py
    "worker": {"ops", "models", "gguf", "memory", "integrity", "structured"},  # execution
    "engine_core": {"core", "worker", "integrity", "memory", "structured"},   # drives a step
    "dp": {"engine_core", "ops"},                  # DP ranks and their client
    "frontend": {"dp", "engine_core", "core"},     # the offline LLM, detokenizing
}


def _package_of(module: str) -> str | None:
    """engine.X.* -> X for a sub-package or a root module of engine/ (None: engine itself)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "engine" and len(parts) > 1 else None


def _runtime_imports(path: Path) -> list[str]:
    """Modules imported at run time (imports under `if TYPE_CHECKING:` are types only)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(block.test) for stmt in block.body for n in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def _package_graph() -> dict[str, dict[str, set[str]]]:
    """package -> {imported package: the modules that import it}."""
    graph: dict[str, dict[str, set[str]]] = {}
    for name, path in _modules().items():
        source = _package_of(name)
        if source is None:
            continue
        edges = graph.setdefault(source, {})
        for imported in _runtime_imports(path):
            target = _package_of(imported)
            if target in (None, source):
                continue
            if (ROOT / "engine" / target).is_dir() or (ROOT / "engine" / f"{target}.py").is_file():
                edges.setdefault(target, set()).add(name)
    return graph


def test_no_package_cycles():
    graph = _package_graph()
    cycles = _cycles({node: set(edges) for node, edges in graph.items()})
    assert not cycles, "package import cycles:\n" + "\n".join(
        " -> ".join(c) + f"  ({', '.join(sorted(graph[c[0]][c[1]]))} ...)" for c in cycles)


def test_packages_import_one_way():
    """core schedules and imports no worker module; the worker executes what core hands down
    (engine/request.py) and imports no scheduling; only engine_core joins them."""
    graph = _package_graph()
    packages = {p.parent.name for p in (ROOT / "engine").glob("*/__init__.py")}
    assert packages == set(ALLOWED_PACKAGE_IMPORTS), "state the place of every engine/ package"
    wrong = [f"{module} imports engine.{target}" for source, edges in graph.items() if source in packages
             for target, importers in edges.items()
             if target in packages and target not in ALLOWED_PACKAGE_IMPORTS[source] for module in sorted(importers)]
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_package_check_finds_a_wrong_way_import(tmp_path, monkeypatch):
    """The layering test can fail: core importing worker is reported, also through a cycle."""
    for package, source in (("core", "from engine.worker.runner import Runner\n"),
                            ("worker", "from engine.core.scheduler import Scheduler\n")):
        (tmp_path / "engine" / package).mkdir(parents=True)
        (tmp_path / "engine" / package / "__init__.py").write_text("")
        (tmp_path / "engine" / package / "m.py").write_text(source)
    (tmp_path / "engine" / "__init__.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ("engine",))
    graph = _package_graph()
    assert graph["core"] == {"worker": {"engine.core.m"}}
    assert ["core", "worker", "core"] in _cycles({node: set(edges) for node, edges in graph.items()})


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
    for package in ("core", "worker", "engine_core", "integrity", "ops", "dp", "frontend", "models"):
        assert (ROOT / "engine" / package / "__init__.py").is_file(), package
    # The root holds the vocabulary every package shares, nothing that belongs to one concern.
    shared = {"__init__.py", "config.py", "engine_args.py", "envs.py", "messages.py", "paging.py",
              "placement.py", "request.py", "sampling_params.py", "tokenizer.py"}
    flat = {p.name for p in (ROOT / "engine").glob("*.py")}
    assert flat <= shared, f"engine/ root holds {sorted(flat - shared)}: put modules in their concern's package"
