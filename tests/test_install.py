"""The README's two commands install what each needs, and installing kvserve is
quiet: `make serve` installs no test tools, `make test` adds them, and building
the package (editable, as the Makefile does) prints no setuptools warning."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _kvserve_install(target: str, tmp_path: Path, *make_args: str) -> str:
    """The pip line with which `make -n <target>` would install kvserve."""
    out = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}", *make_args],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    lines = [line for line in out.splitlines() if re.search(r"pip install .*-e '\.", line)]
    assert len(lines) == 1, out
    return lines[0]


def test_make_serve_installs_no_test_extra(tmp_path):
    assert _kvserve_install("serve", tmp_path).endswith("-e '.'")
    assert _kvserve_install("serve", tmp_path, "EXTRAS=gpu").endswith("-e '.[gpu]'")


def test_make_test_installs_the_test_extra(tmp_path):
    assert _kvserve_install("test", tmp_path).endswith("-e '.[test]'")
    assert _kvserve_install("test", tmp_path, "EXTRAS=gpu").endswith("-e '.[test,gpu]'")


def test_serving_needs_nothing_from_the_test_extra():
    """What the server imports at run time is a core dependency (the test extra
    holds pytest, hypothesis, schemathesis, hadolint and triton)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    for name in ("fastapi", "uvicorn", "httpx-sse", "transformers", "prometheus-client"):
        assert name in core
    for name in ("pytest", "hypothesis", "schemathesis"):
        assert name not in core


def test_an_editable_install_prints_no_warning(tmp_path):
    """setuptools warned about the license table (deprecated) and the editable
    finder (pip shows the build's output with -v, as it did for a user's first
    `make`); the build runs in pip's isolated environment, from the registry. Into a
    throwaway venv: pip would uninstall the running environment's kvserve even when
    told to install elsewhere (--prefix)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-v", "--no-deps",
         "--disable-pip-version-check", "-e", str(ROOT)],
        capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0 and re.search(r"No matching distribution|NewConnectionError",
                                          output):
        pytest.skip(f"no package registry to build with: {output[-300:]}")
    assert proc.returncode == 0, output
    # setuptools installs a package-dir mapping (kvserve.engine from engine/) through
    # a meta path finder and always adds this note to it: information about that
    # strategy, not a warning about kvserve's configuration.
    output = re.sub(r"(BuildBackendWarning|InformationOnly): Editable installation\.", "", output)
    for warning in ("BuildBackendWarning", "SetuptoolsDeprecationWarning",
                    "Editable installation", "deprecated"):
        assert warning not in output, output
