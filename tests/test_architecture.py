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
    "worker": {"ops", "models", "gguf", "memory", "integrity", "structured", "spec_decode"},  # execution
    "engine_core": {"core", "worker", "integrity", "memory", "structured", "spec_decode"},   # drives a step
    "dp": {"engine_core", "ops"},                  # DP ranks and their client
    "frontend": {"dp", "engine_core", "core"},     # the offline LLM, detokenizing
    "spec_decode": set(),                          # n-gram proposals, rejection sampling, acceptance
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
    declared = {v.name for v in envs.VARIABLES + envs.TOOLING}
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
              "placement.py", "request.py", "sampling_params.py", "tokenizer.py", "chat_template.py"}
    flat = {p.name for p in (ROOT / "engine").glob("*.py")}
    assert flat <= shared, f"engine/ root holds {sorted(flat - shared)}: put modules in their concern's package"


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
                "plan_reshape_and_cache_flash", "plan_concat_and_cache_mla", "int8_gemm_amx_rows", "int8_amx_tile_peak", "int8_vnni_peak", "silu_table",
                "int8_gemm_isa"}
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
