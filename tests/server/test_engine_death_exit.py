"""When the engine dies (here: its process is SIGKILLed), the server answers its open
requests with errors at once, reports 503 on /health, and exits non-zero, so that a
supervisor restarts it."""
from __future__ import annotations

import asyncio
import signal
import time

import httpx
import psutil

from tests.server.test_ops_shutdown import serving
from tests.support.http import parse_sse

IN_FLIGHT = 4


def _engine_process(server_pid: int) -> psutil.Process:
    """The spawned engine core (not multiprocessing's resource tracker)."""
    kids = [p for p in psutil.Process(server_pid).children()
            if "spawn_main" in " ".join(p.cmdline())]
    assert len(kids) == 1, kids
    return kids[0]


async def _one(c: httpx.AsyncClient, i: int) -> str:
    """How request i ended: "503", or "error event" for a stream."""
    body = {"prompt": f"request {i}", "max_tokens": 3000, "ignore_eos": True,
            "stream": i % 2 == 0}
    r = await c.post("/v1/completions", json=body)
    if not body["stream"]:
        return str(r.status_code)
    events = parse_sse(r.content)
    return "error event" if "error" in events[-1] else "finished"


async def _kill_while_busy(url: str, engine: psutil.Process):
    """(how each in-flight request ended, seconds they took after the kill, /health)"""
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        tasks = [asyncio.create_task(_one(c, i)) for i in range(IN_FLIGHT)]
        await asyncio.sleep(1.0)  # all admitted and generating
        assert not any(t.done() for t in tasks)
        engine.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        ends = await asyncio.gather(*tasks)
        answered = time.monotonic() - killed
        health = (await c.get("/health")).status_code
    return ends, answered, health


def test_engine_death_exits_non_zero(tiny_model_dir, tmp_path):
    log = tmp_path / "server.log"
    with serving(tiny_model_dir("llama"), log, "--engine-mode", "process") as (proc, url):
        engine = _engine_process(proc.pid)
        ends, answered, health = asyncio.run(_kill_while_busy(url, engine))
        assert ends == ["error event", "503"] * (IN_FLIGHT // 2), log.read_text()
        assert answered < 5
        assert health == 503
        assert proc.wait(15) != 0, log.read_text()
    assert "engine died" in log.read_text()
