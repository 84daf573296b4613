"""A tensor-parallel rank or a pipeline stage killed while the server is idle takes
the engine down: within 10 s /health answers 503 (or nothing, once the server has
gone) and the server exits non-zero, so that a supervisor restarts it."""
from __future__ import annotations

import contextlib
import signal
import time

import httpx
import psutil
import pytest

from tests.server.test_ops_shutdown import serving


def _worker_rank(server_pid: int) -> psutil.Process:
    ranks = [p for p in psutil.Process(server_pid).children(recursive=True)
             if "kvserve.engine.ranks.worker" in " ".join(p.cmdline())]
    assert len(ranks) == 1, ranks
    return ranks[0]


@pytest.mark.parametrize("flag, dead", [("--tensor-parallel-size", "tensor-parallel rank 1"),
                                        ("--pipeline-parallel-size", "pipeline rank 1")])
def test_a_killed_rank_ends_the_server(tiny_model_dir, tmp_path, flag, dead):
    log = tmp_path / "server.log"
    with serving(tiny_model_dir("llama"), log, flag, "2") as (proc, url):
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
    assert f"{dead} died" in log.read_text()


def test_a_stage_killed_mid_request_ends_the_request_and_the_server(tiny_model_dir,
                                                                     tmp_path):
    """The first stage killed while a long generation streams (steps in flight, the
    engine waiting for one to come back): the stream ends, the server exits non-zero."""
    log = tmp_path / "server.log"
    with serving(tiny_model_dir("llama"), log, "--pipeline-parallel-size", "2") as (proc, url):
        body = {"prompt": "hello", "ignore_eos": True, "stream": True}  # to the context end
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(5):  # tokens are flowing
                next(lines)
            killed = time.monotonic()
            _worker_rank(proc.pid).send_signal(signal.SIGKILL)
            tail = []
            with contextlib.suppress(httpx.HTTPError):
                tail = list(lines)
            assert time.monotonic() - killed < 10
        assert "[DONE]" not in "".join(tail[-2:]) or "error" in "".join(tail)
        assert proc.wait(10) != 0, log.read_text()
    # The engine's wait for that step fails on the closed socket, or the watcher sees
    # the stage die first; either way the server says why it exits.
    text = log.read_text()
    assert "kvserve: the engine died (" in text, text
    assert "pipeline rank 1 died" in text or "a pipeline stage is gone" in text, text
