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
