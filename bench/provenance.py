"""Where a benchmark result came from: machine, commit and the exact command."""
from __future__ import annotations

import os
import platform
import subprocess
import sys


def provenance(device: str | None = None) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return {"device": device or f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
            "commit": commit, "command": " ".join(["python"] + sys.argv),
            "python": platform.python_version()}
