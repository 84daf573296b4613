"""Where a benchmark result came from: machine, commit and the exact command (every
benchmark of the tree records it; no torch, so bench/client can use it too)."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path


def git_commit() -> str:
    """Short commit of the source tree this file is in; '' without git or a .git. A
    copy of the tree sent to another machine may have neither: KVSERVE_COMMIT then
    names the commit."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, cwd=Path(__file__).resolve().parent)
        commit = out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return commit or os.environ.get("KVSERVE_COMMIT", "")


def provenance(device: str | None = None, command: str | None = None) -> dict:
    """`device`: a name for it (default: this CPU); `command`: how the run was started
    (default: python and sys.argv)."""
    return {"device": device or f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
            "commit": git_commit(),
            "command": command or " ".join(["python"] + sys.argv),
            "python": platform.python_version()}


def simd_flags(flags: set[str]) -> list[str]:
    """The CPU flags a CPU figure depends on (vector widths, FMA, half floats, AMX),
    out of all of them (engine/platform/device.py: cpu_flags)."""
    return sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c")))
