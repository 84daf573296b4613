"""GET /ready and kvserve:warming_up: while the compiled forward pass is being built
(steps eager, several times slower), /ready answers 503 and the gauge is 1, /health
stays 200 and requests are still served; once the graphs are ready an idle engine
says so within a report period (it polls instead of sleeping on its queue), and
/ready turns 200. The command sources wait as long as they are told."""
from __future__ import annotations

import multiprocessing
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from kvserve.engine.client import engine_loop
from kvserve.engine.client.async_engine import AsyncEngine, _QueueSource
from kvserve.engine.client.engine_loop import EngineLoop
from kvserve.engine.client.messages import Shutdown
from kvserve.engine.client.process_engine import _PipeSource
from kvserve.server.entrypoints.app import build_app
from tests.support.server import running_server

MODEL = "tiny"


@pytest.fixture()
def warming(tiny_engine_factory):
    """(an engine whose compiled graphs are 'being built', the Event that ends it)."""
    engine = tiny_engine_factory("llama")
    built = threading.Event()
    engine.runner.paths.compiling = SimpleNamespace(ready=built)  # as CompiledModel.build
    return engine, built


def _until(predicate, seconds: float) -> float:
    """Seconds until predicate() held (fails past `seconds`)."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < seconds
        time.sleep(0.02)
    return time.monotonic() - start


def _gauge(text: str) -> float:
    (line,) = [x for x in text.splitlines() if x.startswith("kvserve:warming_up{")]
    return float(line.rsplit(" ", 1)[1])


def test_ready_waits_for_the_compiled_graphs(warming):
    engine, built = warming
    client = AsyncEngine(engine)
    assert client.warming_up  # from the engine's info, before any report
    app = build_app(client, [MODEL])
    with running_server(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        r = http.get("/ready")
        assert r.status_code == 503 and r.json()["status"].startswith("warming up")
        assert http.get("/health").status_code == 200  # alive: no restart
        assert _gauge(http.get("/metrics").text) == 1
        done = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                  "max_tokens": 3, "temperature": 0})
        assert done.status_code == 200  # served meanwhile, eagerly
        assert http.get("/ready").status_code == 503
        built.set()  # the graphs are ready; the engine is idle
        # With no step to run, only the idle engine's reports (every
        # WARMING_REPORT_S) can carry it; the bound leaves room for CI's load.
        _until(lambda: http.get("/ready").status_code == 200,
               20 * engine_loop.WARMING_REPORT_S)
        assert http.get("/ready").json() == {"status": "ready"}
        assert _gauge(http.get("/metrics").text) == 0


def test_graphs_done_just_after_a_report_are_still_reported(warming):
    """The graphs end between a report that says 'warming' and the loop's next wait:
    that wait must stay bounded, so the next report says they are done (a wait for
    a command with no end here left /ready at 503 for good)."""
    engine, built = warming
    waits, reports = [], []

    class Source:
        def take(self, wait):
            waits.append(wait)
            return [Shutdown()] if len(waits) == 3 else []

    def report(rep):
        reports.append(rep.warming_up)
        built.set()  # done right after the first report was made

    EngineLoop(engine, Source(), report).run()
    assert reports == [True, False, False]
    assert waits == [engine_loop.WARMING_REPORT_S, engine_loop.WARMING_REPORT_S, None]


def test_without_compiling_ready_at_once(tiny_engine_factory):
    client = AsyncEngine(tiny_engine_factory("llama"))  # tests' engines: no compile
    assert not client.warming_up
    with running_server(build_app(client, [MODEL])) as url:
        assert httpx.get(f"{url}/ready", timeout=30).json() == {"status": "ready"}


@pytest.mark.parametrize("make", ["queue", "pipe"])
def test_command_sources_wait_as_told(make):
    if make == "queue":
        source = _QueueSource()
        send = source.queue.put
    else:
        ours, theirs = multiprocessing.Pipe()
        source, send = _PipeSource(ours), theirs.send
    start = time.monotonic()
    assert source.take(0) == []
    assert source.take(0.2) == [] and time.monotonic() - start >= 0.2
    threading.Timer(0.1, send, args=(Shutdown(),)).start()
    assert source.take(None) == [Shutdown()]  # until one comes
    send(Shutdown())
    send(Shutdown())
    assert source.take(5) == [Shutdown(), Shutdown()]  # at once, all of them
