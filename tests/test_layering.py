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
