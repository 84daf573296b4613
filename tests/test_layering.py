"""Imports point one way: server -> engine -> scheduler -> kvcache; scheduler/ and
kvcache/ never import torch (so they stay testable and cheap on any CPU)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["server", "engine", "scheduler", "kvcache"]  # each may import only later ones


def _top_levels(nodes) -> set[str]:
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def imported_top_levels(path: Path) -> set[str]:
    """Every import in the file, inside functions too."""
    return _top_levels(ast.walk(ast.parse(path.read_text())))


def module_level_imports(path: Path) -> set[str]:
    """Only the imports that run when the module is loaded."""
    return _top_levels(ast.parse(path.read_text()).body)


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
        assert not imported_top_levels(path) & (set(LAYERS) | {"kvbench", "bench"}), path
        assert "torch" not in module_level_imports(path), path


def test_kvbench_is_a_client_of_the_http_api_only():
    """kvbench runs on machines without torch: it talks to servers over HTTP."""
    forbidden = set(LAYERS) | {"torch", "transformers"}
    for path in (ROOT / "kvbench").rglob("*.py"):
        assert not imported_top_levels(path) & forbidden, path


@pytest.mark.parametrize("package", LAYERS)
def test_layers_import_kvbench_only_lazily(package):
    """server/cli.py hands `bench`/`estimate` to kvbench from inside a function, so
    `kvserve serve` never loads it."""
    for path in (ROOT / package).rglob("*.py"):
        assert "kvbench" not in module_level_imports(path), path


# The scheduler alone owns the KV cache manager and its queues (as in vLLM v1): above
# it, the engine and the server call its verbs and read stats(). `running` is read
# by the speculator, which proposes drafts for the running requests.
SCHEDULER_VERBS = {"add_request", "abort_request", "has_unfinished", "schedule", "update",
                   "stats", "fail_requests", "withdraw_unwritten", "with_kv_cache",
                   "running"}


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
