"""`kvserve serve` as a subprocess on a free port, for the benchmarks that load a
running server (bench/abuse.py, bench/batch_interference.py)."""
from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra: list[str], ready: str = "/health",
                 timeout: float = 900) -> tuple[subprocess.Popen, str]:
    """Starts it with `extra` flags; (process, base URL) once `ready` answers 200
    (/ready also waits for the compiled forward pass)."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvserve.server.entrypoints.cli", "serve", "--port",
           str(port), *extra]
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + ready, timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode})")
        time.sleep(1)
    proc.kill()
    raise SystemExit("the server did not become ready")


def metric_value(text: str, name: str) -> float | None:
    """One sample of a /metrics page (its first label set), kvserve: or vllm: named."""
    found = re.search(rf"^(?:vllm|kvserve):{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(found[1]) if found else None

