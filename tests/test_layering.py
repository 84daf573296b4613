"""Imports point one way: server -> engine -> scheduler -> kvcache; scheduler/ and
kvcache/ never import torch (so they stay testable and cheap on any CPU). Every
import names kvserve's packages by their installed names (kvserve.engine, ...): the
folders are named in the checkout as the layers they hold."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["server", "engine", "scheduler", "kvcache"]  # each may import only later ones
# Where each installed package's source lives in the checkout (pyproject's package-dir),
# and the checkout's own scripts (bench/, never installed).
SOURCES = {**{f"kvserve.{name}": ROOT / name for name in [*LAYERS, "modelstore"]},
           "kvserve.benchmarks": ROOT / "kvserve" / "benchmarks", "bench": ROOT / "bench"}


def _unit(module: str) -> str:
    """What a layering rule talks about: kvserve.engine.weights.loader -> engine (the layer),
    torch.nn -> torch, bench.abuse -> bench."""
    parts = module.split(".")
    return parts[1] if parts[0] == "kvserve" and len(parts) > 1 else parts[0]


def _top_levels(nodes) -> set[str]:
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(_unit(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(_unit(node.module))
    return names


def imported_top_levels(path: Path) -> set[str]:
    """Every import in the file, inside functions too."""
    return _top_levels(ast.walk(ast.parse(path.read_text())))


def module_level_imports(path: Path) -> set[str]:
    """Only the imports that run when the module is loaded."""
    return _top_levels(ast.parse(path.read_text()).body)


def test_the_packages_are_imported_by_their_installed_names_only():
    """`import engine` would load a second copy of a module beside kvserve.engine's
    (two registries, two locks), and fail where kvserve is installed from its wheel."""
    bare = {*LAYERS, "modelstore"}
    for path in (p for top in ["kvserve", "tests", *SOURCES.values()]
                 for p in (ROOT / top).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            assert not {n.split(".")[0] for n in names} & bare, (path, names)
            assert not any(n.startswith(("bench.client", "bench.in_process", "bench.provenance"))
                           for n in names), (path, names)


@pytest.mark.parametrize("package", LAYERS)
def test_no_upward_imports(package):
    forbidden = set(LAYERS[:LAYERS.index(package)])
    for path in (ROOT / package).rglob("*.py"):
        assert not imported_top_levels(path) & forbidden, path


@pytest.mark.parametrize("package", ["scheduler", "kvcache"])
def test_pure_python_packages_do_not_import_torch(package):
    for path in (ROOT / package).rglob("*.py"):
        assert "torch" not in imported_top_levels(path), path


def test_modelstore_imports_nothing_of_kvserve():
    """Getting a model directory needs no engine: the server, the engine and the
    bench client use it, and it uses none of them (torch only inside the default
    model's conversion, so the bench client can read the presets without it)."""
    for path in (ROOT / "modelstore").rglob("*.py"):
        assert not imported_top_levels(path) & (set(LAYERS) | {"benchmarks", "bench"}), path
        assert "torch" not in module_level_imports(path), path


def test_the_bench_client_is_a_client_of_the_http_api_only():
    """kvserve/benchmarks/client runs on machines without torch: it talks to servers
    over HTTP (of the rest of the tree it uses only benchmarks/provenance.py, which
    needs nothing)."""
    forbidden = set(LAYERS) | {"torch", "transformers"}
    benchmarks = SOURCES["kvserve.benchmarks"]
    for path in [*(benchmarks / "client").rglob("*.py"), benchmarks / "provenance.py"]:
        assert not imported_top_levels(path) & forbidden, path
        assert "kvserve.benchmarks.in_process" not in path.read_text(), path


@pytest.mark.parametrize("package", LAYERS)
def test_layers_import_the_benchmarks_only_lazily(package):
    """server/entrypoints/cli.py hands `bench`/`estimate` to kvserve/benchmarks from inside a
    function, so `kvserve serve` never loads it; bench/ (not installed) never."""
    for path in (ROOT / package).rglob("*.py"):
        assert "benchmarks" not in module_level_imports(path), path
        assert "bench" not in imported_top_levels(path), path


# The scheduler alone owns the KV cache manager and its queues (as in vLLM v1): above
# it, the engine and the server call its verbs and read stats(). `running` is read
# by the speculator, which proposes drafts for the running requests.
SCHEDULER_VERBS = {"add_request", "abort_request", "has_unfinished", "schedule", "update",
                   "stats", "fail_requests", "withdraw_unwritten", "with_kv_cache",
                   "running", "take_kv_events", "snapshot",
                   # P/D disaggregation's (engine/kv_transfer/): a finished prompt's
                   # blocks pinned for another instance, and looked up by hash
                   "pin_prompt", "unpin", "prompt_hashes", "cached_prefix"}


# engine/ in layers, from the bottom (engine/__init__.py says what each holds): a
# folder imports only itself and the folders before it.
ENGINE_LAYERS = ["platform", "config", "kernels", "models", "weights", "structured",
                 "sampling", "lora", "spec_decode", "ranks", "kv_offload", "runner", "core",
                 "kv_transfer", "client"]


def _engine_folders_imported(path: Path) -> set[str]:
    """The engine folders a file imports from (kvserve.engine.X... -> X)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = ([f"{node.module}.{alias.name}" for alias in node.names]
                     if node.module == "kvserve.engine" else [node.module])
        else:
            continue
        found |= {n.split(".")[2] for n in names
                  if n.startswith("kvserve.engine.") and len(n.split(".")) > 2}
    return found


def test_engine_is_layers_only():
    """No loose modules: every module belongs to a layer."""
    engine = ROOT / "engine"
    assert [p.name for p in engine.glob("*.py")] == ["__init__.py"]
    assert {d.name for d in engine.iterdir() if d.is_dir() and d.name != "__pycache__"} \
        == set(ENGINE_LAYERS)


@pytest.mark.parametrize("layer", ENGINE_LAYERS)
def test_engine_layers_import_only_the_layers_below(layer):
    allowed = set(ENGINE_LAYERS[:ENGINE_LAYERS.index(layer) + 1])
    for path in (ROOT / "engine" / layer).rglob("*.py"):
        upward = _engine_folders_imported(path) - allowed
        assert not upward, f"{path} imports the layer(s) above it: {sorted(upward)}"


def _scheduler_uses(tree) -> set[str]:
    """Attributes read off anything called `scheduler`."""
    def named_scheduler(node) -> bool:
        return (isinstance(node, ast.Name) and node.id == "scheduler"
                or isinstance(node, ast.Attribute) and node.attr == "scheduler")
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and named_scheduler(node.value)}


@pytest.mark.parametrize("package", ["server", "engine"])
def test_only_the_scheduler_touches_the_kv_cache_and_its_queues(package):
    for path in (ROOT / package).rglob("*.py"):
        tree = ast.parse(path.read_text())
        assert "kvcache" not in imported_top_levels(path), path
        assert not any(isinstance(node, ast.Attribute) and node.attr == "kv"
                       for node in ast.walk(tree)), path
        assert _scheduler_uses(tree) <= SCHEDULER_VERBS, (
            path, _scheduler_uses(tree) - SCHEDULER_VERBS)


def _module_name(package: str, path: Path) -> str:
    parts = [*package.split("."), *path.relative_to(SOURCES[package]).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere (lazily too), with the
    packages whose __init__ such an import runs first."""
    modules = {_module_name(pkg, p): p for pkg in SOURCES for p in SOURCES[pkg].rglob("*.py")}

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        return next((".".join(parts[:i]) for i in range(len(parts), 0, -1)
                     if ".".join(parts[:i]) in modules), None)

    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)
        deps = {m for m in map(resolve, targets) if m is not None}
        for dep in list(deps):  # importing a.b.c runs a/__init__ and a/b/__init__
            parts = dep.split(".")
            deps.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts)))
                        if p in modules and not name.startswith(p + "."))
        graph[name] = deps - {name}
    return graph


def _folder_graph() -> dict[str, set[str]]:
    """Package -> the other packages its modules import (a module's package is the
    folder it lies in)."""
    package_of = {}
    for pkg in SOURCES:
        for path in SOURCES[pkg].rglob("*.py"):
            name = _module_name(pkg, path)
            package_of[name] = name if path.name == "__init__.py" else name.rpartition(".")[0]
    graph: dict[str, set[str]] = {}
    for name, deps in _import_graph().items():
        graph.setdefault(package_of[name], set()).update(
            package_of[d] for d in deps if package_of[d] != package_of[name])
    return graph


def test_no_folder_level_import_cycles():
    import graphlib

    try:
        list(graphlib.TopologicalSorter(_folder_graph()).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"folder-level import cycle: {' -> '.join(exc.args[1])}")


def test_no_import_cycles_anywhere():
    import graphlib

    try:
        list(graphlib.TopologicalSorter(_import_graph()).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"import cycle: {' -> '.join(exc.args[1])}")


@pytest.mark.parametrize("package", [*LAYERS, "modelstore"])
def test_small_files_and_functions(package):
    """No file over 350 lines and no function over 50 in the serving packages: a
    file is one job, a function one step of it."""
    for path in (ROOT / package).rglob("*.py"):
        text = path.read_text()
        assert text.count("\n") <= 350, f"{path}: {text.count(chr(10))} lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                assert length <= 50, f"{path}:{node.lineno} {node.name} has {length} lines"
