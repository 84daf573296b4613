"""Imports point one way: server -> engine -> scheduler -> kvcache; scheduler/ and
kvcache/ never import torch (so they stay testable and cheap on any CPU)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["server", "engine", "scheduler", "kvcache"]  # each may import only later ones


def imported_top_levels(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


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


def module_level_imports(path: Path) -> set[str]:
    names = set()
    for stmt in ast.parse(path.read_text()).body:
        if isinstance(stmt, ast.Import):
            names.update(alias.name.split(".")[0] for alias in stmt.names)
        elif isinstance(stmt, ast.ImportFrom) and stmt.level == 0 and stmt.module:
            names.add(stmt.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", LAYERS)
def test_layers_import_kvbench_only_lazily(package):
    """server/cli.py hands `bench`/`estimate` to kvbench from inside a function, so
    `kvserve serve` never loads it."""
    for path in (ROOT / package).rglob("*.py"):
        assert "kvbench" not in module_level_imports(path), path
