"""kvcache must stay standard-library only (no torch on the scheduler path)."""

import ast
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "kvcache"


def test_sources_import_only_the_standard_library():
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top == "__future__", (path, name)


def test_importing_kvcache_loads_nothing_else():
    code = (
        "import sys; before = set(sys.modules); import kvserve.kvcache; "
        "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "print(sorted(new - set(sys.stdlib_module_names) - {'kvserve'}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=PACKAGE.parent,  # the checkout: kvserve/ finds kvcache/ beside it
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]"
