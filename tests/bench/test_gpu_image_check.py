"""The GPU machine's image lacks some of kvserve's packages; bench/gpu_wheels.sh carries
them. These tests keep that list whole as dependencies change, and check that the
image's emulation (bench/gpu_image_check.py) refuses what the image lacks, so a GPU
session's minutes are not spent on an ImportError."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

from bench import gpu_image_check

ROOT = Path(__file__).resolve().parents[2]


def wheel_list() -> set[str]:
    """The distributions bench/gpu_wheels.sh downloads (bench/gpu_wheels.txt)."""
    return gpu_image_check.listed_in(str(ROOT / "bench" / "gpu_wheels.txt"))


def test_the_wheels_bring_every_runtime_dependency_the_image_lacks():
    listed = {gpu_image_check._norm(n) for n in gpu_image_check.IMAGE.split()}
    runtime = {gpu_image_check._norm(Requirement(line).name)
               for line in importlib.metadata.requires("kvserve") if "extra" not in line}
    # What the test suite's GPU stage imports beyond them (tests/server/conftest.py,
    # the structured outputs' tests).
    needed = (runtime | {"openai", "jsonschema"}) - listed
    assert needed <= wheel_list(), f"add to bench/gpu_wheels.txt: {sorted(needed - wheel_list())}"


def test_the_emulation_refuses_what_the_image_lacks(tmp_path):
    code = ("import importlib\n"
            "for name in ('xgrammar', 'pydantic', 'torch', 'kvserve.engine.core.engine'):\n"
            "    try:\n"
            "        importlib.import_module(name); print(name, 'ok')\n"
            "    except ImportError as exc:\n"
            "        print(name, 'refused' if 'GPU image' in str(exc) else exc)\n")
    proc = subprocess.run([sys.executable, "bench/gpu_image_check.py", "-c", code], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = set(proc.stdout.split("\n"))
    # torch is on the image; engine needs xgrammar, which is not.
    assert {"xgrammar refused", "pydantic refused", "torch ok",
            "kvserve.engine.core.engine refused"} <= lines


def test_the_wheels_list_taken_as_installed_lets_the_engine_import():
    """--allow-listed bench/gpu_wheels.txt: the image plus the carried wheels, with
    nothing downloaded (the dry run of bench/gpu_session.sh imports so)."""
    code = ("import kvserve.engine.core.engine, kvserve.server.entrypoints.app, bench.gpu_decode\n"
            "try:\n"
            "    import schemathesis\n"
            "except ImportError as exc:\n"
            "    print('refused' if 'GPU image' in str(exc) else exc)\n")
    # The checkout on the path, as bench/gpu_session.sh puts it there (PYTHONPATH=.).
    proc = subprocess.run([sys.executable, "bench/gpu_image_check.py", "--allow-listed",
                           "bench/gpu_wheels.txt", "-c", code], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["refused"]  # a test-only package stays refused
