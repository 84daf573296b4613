"""--max-waiting-requests (429 with Retry-After), draining (503), and /health.

The engine runs one request at a time (max_num_seqs=1), so while a long "head"
request runs, everything admitted after it waits and the waiting count is exact."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.server.config import ServerConfig
from kvserve.server.entrypoints.app import build_app
from tests.support.http import assert_error, parse_sse, wait_idle
from tests.support.server import running_server

MODEL = "tiny"
LIMIT = 2
HEAD_TOKENS, BURST_TOKENS, BURST = 500, 6, 6


class Served:
    def __init__(self, url, app, aengine):
        self.url, self.app, self.aengine = url, app, aengine
        self.engine = aengine.engine


@pytest.fixture(scope="module")
def served(tiny_engine_factory):
    aengine = AsyncEngine(tiny_engine_factory("llama", max_num_seqs=1))
    app = build_app(aengine, [MODEL], config=ServerConfig(max_waiting_requests=LIMIT))
    with running_server(app) as url:
        yield Served(url, app, aengine)


def _body(i: int, max_tokens: int, stream: bool = False) -> dict:
    body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _completion_tokens(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    if r.headers["content-type"].startswith("text/event-stream"):
        return parse_sse(r.content)[-1]["usage"]["completion_tokens"]
    return r.json()["usage"]["completion_tokens"]


async def _stream_head(c: httpx.AsyncClient, running: asyncio.Event) -> int:
    """Streams the head request, setting `running` at its first chunk."""
    async with c.stream("POST", "/v1/completions", json=_body(0, HEAD_TOKENS, True)) as r:
        assert r.status_code == 200
        body = b""
        async for chunk in r.aiter_bytes():
            body += chunk
            running.set()
    return parse_sse(body)[-1]["usage"]["completion_tokens"]


async def _until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def _gauge(metrics_text: str, name: str) -> float:
    line = next(ln for ln in metrics_text.splitlines()
                if ln.startswith((f"kvserve:{name} ", f"kvserve:{name}{{")))
    return float(line.split()[-1])


async def _burst_behind_a_running_head(url: str):
    limits = httpx.Limits(max_connections=BURST + 4)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
        running = asyncio.Event()
        head = asyncio.create_task(_stream_head(c, running))
        await asyncio.wait_for(running.wait(), 30)
        burst = [asyncio.create_task(c.post("/v1/completions",
                                            json=_body(i, BURST_TOKENS, i % 2 == 1)))
                 for i in range(1, BURST + 1)]

        async def overflow_answered():  # the admitted ones wait behind the head
            return sum(t.done() for t in burst) >= BURST - LIMIT

        await _until(overflow_answered)
        # The refusals come back at once; the admitted two are tokenized and reach
        # the engine's queue a moment later (its next report tells /metrics).
        metrics = ""

        async def admitted_are_waiting():
            nonlocal metrics
            metrics = (await c.get("/metrics")).text
            return _gauge(metrics, "num_requests_waiting") == LIMIT or head.done()

        await _until(admitted_are_waiting)
        head_was_running = not head.done()
        return head_was_running, metrics, await head, await asyncio.gather(*burst)


def test_overflow_gets_429_with_retry_after_and_the_rest_complete(served):
    head_was_running, metrics, head_tokens, burst = asyncio.run(
        _burst_behind_a_running_head(served.url))
    assert head_was_running, "the head finished before the burst was judged"
    assert _gauge(metrics, "num_requests_running") == 1
    assert _gauge(metrics, "num_requests_waiting") == LIMIT
    refused = [r for r in burst if r.status_code == 429]
    assert len(refused) == BURST - LIMIT, [r.status_code for r in burst]
    for r in refused:
        err = assert_error(r, 429)
        assert err["type"] == "rate_limit_error"
        assert r.headers["retry-after"] == "1"
    admitted = [r for r in burst if r.status_code != 429]
    assert [_completion_tokens(r) for r in admitted] == [BURST_TOKENS] * LIMIT
    assert head_tokens == HEAD_TOKENS
    assert wait_idle(served.engine)
    # The middleware counts a response done a moment after its last byte reached us.
    deadline = time.monotonic() + 5
    while served.app.state.admission.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (served.aengine.queue_depth, served.app.state.admission.in_flight) == (0, 0)


@pytest.mark.parametrize("body,status", [
    ({"model": "nope", "prompt": "x"}, 404),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**6}, 400),
    ({"model": MODEL, "prompt": [10**9]}, 400),
    ({"model": MODEL}, 400)])
def test_rejected_requests_leave_no_reservation(served, body, status):
    with httpx.Client(base_url=served.url, timeout=60) as c:
        assert_error(c.post("/v1/completions", json=body), status)
        # Twice the limit: a leaked reservation would have turned one of these into 429.
        for _ in range(2 * LIMIT):
            assert_error(c.post("/v1/completions", json=body), status)
        assert c.post("/v1/completions", json=_body(0, 2)).status_code == 200
    assert served.aengine.queue_depth == 0


def test_draining_refuses_generation_and_fails_health(served):
    admission = served.app.state.admission
    admission.draining = True
    try:
        with httpx.Client(base_url=served.url, timeout=60) as c:
            health = c.get("/health")
            assert (health.status_code, health.json()) == (503, {"status": "draining"})
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            for path, body in [("/v1/completions", _body(0, 2)),
                               ("/v1/completions", _body(0, 2, stream=True)),
                               ("/v1/chat/completions", chat)]:
                r = c.post(path, json=body)
                assert assert_error(r, 503)["type"] == "service_unavailable"
                assert r.headers["retry-after"] == "1"
            assert c.get("/v1/models").status_code == 200  # only generation is refused
            assert c.post("/tokenize", json={"prompt": "hi"}).status_code == 200
    finally:
        admission.draining = False
    with httpx.Client(base_url=served.url, timeout=60) as c:
        assert c.get("/health").json() == {"status": "ok"}


def test_health_turns_503_when_the_engine_stops(tiny_engine_factory):
    aengine = AsyncEngine(tiny_engine_factory("llama"))
    with running_server(build_app(aengine, [MODEL])) as url, \
            httpx.Client(base_url=url, timeout=60) as c:
        r = c.get("/health")
        assert (r.status_code, r.json()) == (200, {"status": "ok"})
        aengine.shutdown()
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] != "ok"
