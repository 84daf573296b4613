"""Graceful shutdown of a real `python -m kvserve.server.entrypoints.cli serve`
process: on SIGTERM (or SIGINT) it answers new requests 503 while the ones in flight
finish, then exits 0; past --shutdown-timeout it aborts what still runs."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from httpx_sse import connect_sse

from tests.support.http import assert_error, parse_sse
from tests.support.server import free_port

ROOT = Path(__file__).resolve().parents[2]
IN_FLIGHT, TOKENS = 20, 200


@contextlib.contextmanager
def serving(model_dir: Path, log_path: Path, *flags: str):
    """Yields (process, base URL) once /health answers 200."""
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVSERVE_") or k == "KVSERVE_CACHE"}
    cmd = [sys.executable, "-m", "kvserve.server.entrypoints.cli", "serve",
           "--model", str(model_dir), "--port", str(port), "--device", "cpu", "--num-kv-blocks", "1024",
           "--max-num-batched-tokens", "256", "--log-level", "info",
           # eager, as the suite's engines: a tiny model's background compile is a
           # minute of both cores, which would skew every timing these servers measure
           "--compile", "off", *flags]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, log_path)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait_healthy(proc: subprocess.Popen, url: str, log_path: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log_path.read_text()
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError("server did not come up:\n" + log_path.read_text())


def _body(i: int, max_tokens: int, stream: bool) -> dict:
    body = {"prompt": f"request {i}: 1 2 3", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _complete(c: httpx.AsyncClient, i: int, max_tokens: int) -> tuple[str, int]:
    """(finish reason, completion tokens); even requests stream."""
    r = await c.post("/v1/completions", json=_body(i, max_tokens, stream=i % 2 == 0))
    assert r.status_code == 200, r.text
    if i % 2:
        body = r.json()
        return body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]
    chunks = parse_sse(r.content)  # also checks it ends with data: [DONE]
    reasons = [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]]
    return reasons[-1], chunks[-1]["usage"]["completion_tokens"]


async def _poll(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _running(c: httpx.AsyncClient) -> int:
    text = (await c.get("/metrics")).text
    names = ("kvserve:num_requests_running ", "kvserve:num_requests_running{")
    line = next(ln for ln in text.splitlines() if ln.startswith(names))
    return int(float(line.split()[-1]))


async def _draining(c: httpx.AsyncClient) -> bool:
    r = await c.get("/health")
    return r.status_code == 503 and r.json() == {"status": "draining"}


async def _signal_while_busy(proc, url: str, sig: int, n: int, max_tokens: int):
    """Starts n requests, signals once all run, sends one more while draining.
    Returns (results, the late response, whether any ran when it was answered)."""
    limits = httpx.Limits(max_connections=n + 5)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
        tasks = [asyncio.create_task(_complete(c, i, max_tokens)) for i in range(n)]

        async def all_running():
            return await _running(c) == n

        # A deadline, not a speed check: under the suite's load (the other worker's
        # compiles) a process-mode engine took over 30 s to admit them all once.
        await _poll(all_running, timeout=90)
        proc.send_signal(sig)
        await _poll(lambda: _draining(c), timeout=10)
        late = await c.post("/v1/completions", json=_body(99, 4, stream=False))
        busy = not all(t.done() for t in tasks)
        return await asyncio.gather(*tasks), late, busy


def _exit_code(proc: subprocess.Popen, timeout: float, log_path: Path) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError("did not exit:\n" + log_path.read_text()) from None


@pytest.mark.parametrize("engine_mode", ["thread", "process"])
def test_sigterm_lets_in_flight_requests_finish_and_exits_0(tiny_model_dir, tmp_path,
                                                            engine_mode):
    log = tmp_path / "server.log"
    with serving(tiny_model_dir("llama"), log, "--engine-mode", engine_mode) as (proc, url):
        results, late, busy = asyncio.run(
            _signal_while_busy(proc, url, signal.SIGTERM, IN_FLIGHT, TOKENS))
        assert busy, "every request ended before the late one was answered"
        assert assert_error(late, 503)["type"] == "service_unavailable"
        assert late.headers["retry-after"] == "1"
        assert results == [("length", TOKENS)] * IN_FLIGHT
        done = time.monotonic()
        assert _exit_code(proc, 30, log) == 0, log.read_text()
        assert time.monotonic() - done < 10  # nothing left to wait for
    if engine_mode == "process":
        assert "[engine]" in log.read_text()  # the engine process logged its own start


def test_past_the_shutdown_timeout_the_rest_is_aborted(tiny_model_dir, tmp_path):
    log = tmp_path / "server.log"
    with serving(tiny_model_dir("llama"), log, "--shutdown-timeout", "1") as (proc, url):
        start = time.monotonic()
        # Far more tokens than 1 s allows; SIGINT takes the same path as SIGTERM.
        results, late, _ = asyncio.run(_signal_while_busy(proc, url, signal.SIGINT, 4, 3000))
        assert late.status_code == 503
        assert [reason for reason, _ in results] == ["abort"] * 4
        assert all(0 < tokens < 3000 for _, tokens in results)
        assert _exit_code(proc, 20, log) == 0, log.read_text()
        assert time.monotonic() - start < 20
    assert "aborting 4 request(s)" in log.read_text()


def test_an_open_engine_page_does_not_hold_up_the_exit(tiny_model_dir, tmp_path):
    """The engine page's stream never ends by itself; once the drain is over the server
    ends it (`closing`) instead of waiting out uvicorn's grace period for it."""
    log = tmp_path / "server.log"
    with serving(tiny_model_dir("llama"), log) as (proc, url):
        with httpx.Client(timeout=30) as http, \
                connect_sse(http, "GET", url + "/v1/engine/stream") as source:
            events = (event.event for event in source.iter_sse())
            assert next(events) == "hello"
            proc.send_signal(signal.SIGTERM)
            names = list(events)  # to the end of the stream
        assert names[-1] == "closing"
        assert _exit_code(proc, 20, log) == 0, log.read_text()
    assert "timeout graceful shutdown exceeded" not in log.read_text()

