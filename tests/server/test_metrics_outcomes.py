"""/metrics for the outcomes a clean run never has: a client that leaves (abort) and
a KV cache too small for the batch (preemptions, counted as the scheduler counts)."""
from __future__ import annotations

import time

import httpx

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.server.entrypoints.app import build_app
from tests.support.http import post_completions_concurrently
from tests.support.metrics_script import Scrapes
from tests.support.server import running_server

MODEL = "tiny"
P = "kvserve:"


def _until(check, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return result


def _idle(scrapes: Scrapes):
    now = scrapes.now()
    gauges = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    return now if all(now[(P + g, ())] == 0 for g in gauges) else None


def test_a_client_that_leaves_counts_as_abort(tiny_engine_factory):
    app = build_app(AsyncEngine(tiny_engine_factory("llama")), [MODEL])
    with running_server(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        scrapes = Scrapes(http, MODEL)
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as r:
            next(line for line in r.iter_lines() if line.startswith("data: {"))
        after = _until(lambda: _idle(scrapes))
        assert scrapes.delta(after, P + "request_success_total",
                             finished_reason="abort") == 1
        assert scrapes.delta(after, P + "request_success_total",
                             finished_reason="length") == 0
        assert scrapes.delta(after, P + "request_queue_time_seconds_count") == 1
        assert scrapes.delta(after, P + "request_success_total",
                             finished_reason="error") == 0


def test_preemptions_are_the_schedulers(tiny_engine_factory):
    # 4 blocks of 16 tokens: two requests growing to 50 tokens each cannot both fit.
    engine = tiny_engine_factory("llama", num_kv_blocks=4)
    app = build_app(AsyncEngine(engine), [MODEL])
    with running_server(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        scrapes = Scrapes(http, MODEL)
        bodies = [{"model": MODEL, "prompt": [first] + list(range(10, 29)), "max_tokens": 30,
                   "ignore_eos": True, "temperature": 0} for first in (5, 6)]
        post_completions_concurrently(url, bodies, timeout=60)
        after = _until(lambda: _idle(scrapes))
        assert engine.scheduler.num_preemptions > 0
        assert (scrapes.delta(after, P + "num_preemptions_total")
                == engine.scheduler.num_preemptions)
        assert scrapes.delta(after, P + "request_success_total",
                             finished_reason="length") == 2
