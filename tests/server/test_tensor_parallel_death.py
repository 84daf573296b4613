"""A tensor-parallel rank killed while the server is idle takes the engine down: within
10 s /health answers 503 (or nothing, once the server has gone) and the server exits
non-zero, so that a supervisor restarts it."""
from __future__ import annotations

import signal
import time

import httpx
import psutil

from tests.server.test_ops_shutdown import serving


def _worker_rank(server_pid: int) -> psutil.Process:
    ranks = [p for p in psutil.Process(server_pid).children(recursive=True)
             if "kvserve.engine.ranks.worker" in " ".join(p.cmdline())]
    assert len(ranks) == 1, ranks
    return ranks[0]


def test_a_killed_rank_ends_the_server(tiny_model_dir, tmp_path):
    log = tmp_path / "server.log"
    with serving(tiny_model_dir("llama"), log, "--tensor-parallel-size", "2") as (proc, url):
        r = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4},
                       timeout=30)
        assert r.status_code == 200, r.text
        _worker_rank(proc.pid).send_signal(signal.SIGKILL)
        killed, health = time.monotonic(), 200
        while health == 200 and time.monotonic() - killed < 10:
            try:
                health = httpx.get(url + "/health", timeout=1).status_code
            except httpx.HTTPError:  # already gone
                health = None
            time.sleep(0.1)
        unhealthy = time.monotonic() - killed
        assert health in (503, None), log.read_text()
        assert proc.wait(10 - unhealthy + 0.5) != 0, log.read_text()
        exited = time.monotonic() - killed
        assert exited < 10.5
        print(f"rank killed: /health {health} after {unhealthy:.2f} s, exit after {exited:.2f} s")
    assert "tensor-parallel rank 1 died" in log.read_text()
