"""kvserve installs one top-level name, `kvserve`, with the design's folders inside it
(pyproject's package-dir): nothing named `server` or `engine` lands in site-packages
beside other people's packages. Checked on the built wheel."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _source(package: str) -> Path:
    """The checkout folder a package is built from, by the longest package-dir prefix."""
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in SETUPTOOLS["package-dir"]:
            return ROOT / SETUPTOOLS["package-dir"][prefix] / Path(*parts[i:])
    raise AssertionError(f"{package} has no package-dir entry")


def test_every_folder_of_modules_is_listed_and_every_listed_one_is_a_package():
    """The packages are listed by hand (setuptools cannot find them under another
    name): a new folder left out would be missing from the wheel, silently."""
    listed = set(SETUPTOOLS["packages"])
    for package in listed:
        assert (_source(package) / "__init__.py").is_file(), package
    for top, folder in SETUPTOOLS["package-dir"].items():
        for sub in [ROOT / folder, *(ROOT / folder).rglob("*")]:
            if (sub.is_dir() and "__pycache__" not in sub.parts and any(sub.glob("*.py"))):
                name = ".".join([top, *sub.relative_to(ROOT / folder).parts])
                assert name in listed, f"{sub} holds modules: add {name} to pyproject's packages"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    # From a copy: setuptools builds in the source tree (build/, *.egg-info).
    source = out / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", "results", ".hypothesis"))
    # The environment's setuptools (the build-system's >= 77): nothing downloaded.
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(out), str(source)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("kvserve-*.whl")
    return zipfile.ZipFile(path)


def test_the_wheel_installs_kvserve_only(wheel):
    names = wheel.namelist()
    (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert wheel.read(top_level).decode().split() == ["kvserve"]
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"kvserve"}, tops


def test_the_wheel_holds_every_module_and_data_file_of_the_packages(wheel):
    names = set(wheel.namelist())
    for package in SETUPTOOLS["packages"]:
        folder = _source(package)
        for module in folder.glob("*.py"):
            assert f"{package.replace('.', '/')}/{module.name}" in names, module
    for package, globs in SETUPTOOLS["package-data"].items():
        for pattern in globs:
            for data in _source(package).glob(pattern):
                rel = data.relative_to(_source(package)).as_posix()
                assert f"{package.replace('.', '/')}/{rel}" in names, data
    assert not any(n.startswith(("kvserve/bench/", "kvserve/tests/")) for n in names)


def test_the_console_script_names_the_installed_cli(wheel):
    (entry,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    assert "kvserve = kvserve.server.entrypoints.cli:main" in wheel.read(entry).decode()
