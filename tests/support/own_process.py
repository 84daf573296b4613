"""A test's script run in a Python process of its own, from the repository's root, with
environment variables the kernels read once a process (KVSERVE_CPU_ISA,
KVSERVE_NO_VNNI): the way to reach a CPU path the test's own process has passed by."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_script_ok(script: str, env: dict[str, str], timeout: float = 600) -> None:
    """Runs `script` (which prints "ok" last when its checks pass) with `env` added to
    this process's environment; fails the test with the script's stderr otherwise."""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **env})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
