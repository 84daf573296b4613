"""Where a load test's result came from: this client machine, the commit, the exact
command, and what the server says about itself."""
from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

import httpx

from kvserve.benchmarks.provenance import git_commit


def provenance() -> dict:
    return {"client": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
            "commit": git_commit(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def server_info(http: httpx.Client) -> dict:
    """GET /version and /v1/models; whatever fails is left out (not every server has
    /version)."""
    info = {}
    for key, path in (("version", "/version"), ("models", "/v1/models")):
        try:
            r = http.get(path)
            if r.status_code == 200:
                info[key] = r.json()
        except (httpx.HTTPError, ValueError):
            pass
    return info


def first_model(info: dict) -> str | None:
    data = (info.get("models") or {}).get("data") or []
    return data[0]["id"] if data else None
