"""Processes that start together build kvserve's CPU kernel library once (build.py):
a server's early build and its engine, test workers, tensor-parallel ranks. A build
is marked by a file named after its builder's pid, removed when it ends; the others
wait while a live process's mark is there. A killed builder's mark stays behind but
its pid is gone, so nothing waits on it; no wait is longer than BUILD_WAIT_S."""
from __future__ import annotations

import os
import time
from pathlib import Path

BUILD_WAIT_S = 300.0  # the longest another process's build of the library is waited for


def build_mark(path: Path) -> Path:
    """This process's mark of its build of the library at `path`."""
    return path.with_name(f".{path.name}.{os.getpid()}.building")


def wait_for_other_builds(path: Path) -> None:
    """While another live process builds the library at `path`, wait (up to
    BUILD_WAIT_S; the caller then builds it itself)."""
    deadline = time.monotonic() + BUILD_WAIT_S
    while not path.exists() and _builders(path) and time.monotonic() < deadline:
        time.sleep(0.1)


def _builders(path: Path) -> list[int]:
    """The live processes building this library: each marks its build with a file
    named after its pid (removed when it ends; a killed one's pid is gone)."""
    pids = []
    for marker in path.parent.glob(f".{path.name}.*.building"):
        pid = marker.name[len(path.name) + 2:-len(".building")]
        if pid.isdigit() and _alive(int(pid)):
            pids.append(int(pid))
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
