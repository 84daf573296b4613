"""GET /v1/engine/stream, the engine page's live feed (server/engine_view), on a tiny
model served in this process: what it sends, that it costs nothing while nobody
watches, and that it obeys --api-key."""
from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import pytest
from httpx_sse import connect_sse

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.engine.client.messages import TakeSnapshot
from kvserve.server.config import ServerConfig
from kvserve.server.entrypoints.app import build_app
from tests.support.http import assert_error
from tests.support.server import running_server

MODEL = "tiny"
PREFIX = "The capital of France is Paris. The capital of Italy is Rome. " * 2


class CountingEngine(AsyncEngine):
    """Counts the snapshots the server asks the engine for."""

    asked = 0

    def _submit(self, command) -> None:
        if isinstance(command, TakeSnapshot):
            self.asked += 1
        super()._submit(command)


class PausedSteps:
    """Wraps the engine's step so each one waits `seconds` first: a request then lasts
    a known least time however fast the machine runs the tiny model (one took under
    0.5 s, a snapshot's interval, on CI's machine), and a client's leaving beats a
    prompt's last chunk."""

    def __init__(self, engine, seconds: float):
        self.seconds = seconds
        self._step = engine.step
        engine.step = self

    def __call__(self):
        time.sleep(self.seconds)
        return self._step()


@pytest.fixture(scope="module")
def served(tiny_engine_factory):
    engine = CountingEngine(tiny_engine_factory("llama", block_size=4, num_kv_blocks=1024))
    app = build_app(engine, [MODEL])
    with running_server(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        http.engine = engine
        http.pause = PausedSteps(engine.engine, 0.005)  # 400 tokens: 2 s at least
        yield http


@contextlib.contextmanager
def engine_events(http: httpx.Client, headers: dict | None = None):
    """Yields an iterator of (event name, data) from the engine stream."""
    with connect_sse(http, "GET", "/v1/engine/stream", headers=dict(headers or {})) as source:
        source.response.raise_for_status()
        yield ((e.event, json.loads(e.data)) for e in source.iter_sse())


def first(events, want, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    for name, data in events:
        if want(name, data):
            return data
        assert time.monotonic() < deadline, "the stream never showed it"


@contextlib.contextmanager
def streaming(http: httpx.Client, body: dict):
    """A streamed completion read in the background until the block ends, when the
    client leaves and the server aborts it: it runs as long as the test watches."""
    leave = threading.Event()

    def read():
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for _ in r.iter_lines():
                if leave.is_set():
                    return

    thread = threading.Thread(target=read)
    thread.start()
    try:
        yield
    finally:
        leave.set()
        thread.join()


def test_the_stream_shows_running_requests_their_blocks_and_a_fork_sharing_them(served):
    # As long as the KV cache allows, so that a snapshot finds both decoding however
    # fast the model runs.
    body = {"model": MODEL, "prompt": PREFIX, "max_tokens": 400, "ignore_eos": True,
            "n": 2, "temperature": 1.0}
    with engine_events(served) as events:
        name, hello = next(events)
        assert name == "hello" and hello["models"] == [MODEL]
        assert hello["snapshot_seconds"] == 0.5 and isinstance(hello["history"], list)
        with streaming(served, body):
            snap = first(events, lambda n, d: n == "snapshot" and len(d["requests"]) == 2
                         and all(r["phase"] == "decode" for r in d["requests"]))
    seqs = sorted(snap["requests"], key=lambda r: r["index"])
    assert [r["index"] for r in seqs] == [0, 1] and seqs[0]["id"] == seqs[1]["id"]
    counts = snap["block_counts"]
    assert sum(counts.values()) == snap["num_blocks"] == len(snap["cells"]) == 1024
    # The prompt's full blocks are shared by the two sequences, and each holds blocks
    # of its own past the fork.
    prompt_blocks = seqs[0]["prompt_tokens"] // 4
    assert counts["shared"] >= prompt_blocks > 0 and counts["used"] >= 2
    table0 = [b for first_id, n in seqs[0]["blocks"] for b in range(first_id, first_id + n)]
    table1 = [b for first_id, n in seqs[1]["blocks"] for b in range(first_id, first_id + n)]
    assert table0[:prompt_blocks] == table1[:prompt_blocks]
    for block in table0[:prompt_blocks]:
        assert snap["cells"][block] == "3"
    assert snap["num_running"] == 2 and snap["num_waiting"] == 0
    # A decoding sequence's progress: its output tokens against its max_tokens
    # (within the room its prompt leaves).
    room = served.engine.max_model_len - seqs[0]["prompt_tokens"]
    want = min(400, room)
    for seq in seqs:
        assert seq["output_tokens"] == seq["tokens"] - seq["prompt_tokens"] > 0
        assert seq["max_tokens"] == want


def test_a_stopped_request_is_listed_as_aborted(served):
    body = {"model": MODEL, "prompt": "abort me", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with engine_events(served) as events:
        with served.stream("POST", "/v1/completions", json=body) as r:
            rid = r.headers["x-kvserve-request-id"]  # the request's engine id
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    assert rid not in line  # unrelated to the public id
                    break
        # The client left: the server aborted the request in the engine.
        done = first(events, lambda n, d: n == "snapshot" and any(
            f["id"].startswith(rid) for f in d["finished"]))
    ended = [f for f in done["finished"] if f["id"].startswith(rid)]
    assert [f["reason"] for f in ended] == ["abort"]
    assert ended[0]["output_tokens"] >= 1 and ended[0]["embedding"] is False
    assert not any(r["id"].startswith(rid) for r in done["requests"])


def test_a_request_left_before_its_first_token_got_none(served):
    # Three prompt chunks (256 tokens a step) of a second each: the first token comes
    # seconds after the client has left, however long the server takes to notice.
    body = {"model": MODEL, "prompt": PREFIX * 16, "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    served.pause.seconds = 1.0
    try:
        with engine_events(served) as events:
            with served.stream("POST", "/v1/completions", json=body) as r:
                rid = r.headers["x-kvserve-request-id"]  # and gone, before any chunk
            done = first(events, lambda n, d: n == "snapshot" and any(
                f["id"].startswith(rid) for f in d["finished"]))
    finally:
        served.pause.seconds = 0.005
    [ended] = [f for f in done["finished"] if f["id"].startswith(rid)]
    assert ended["reason"] == "abort" and ended["output_tokens"] == 0


def test_an_embedding_is_listed_as_one(served):
    with engine_events(served) as events:
        r = served.post("/v1/embeddings", json={"model": MODEL, "input": "embed me, please"})
        assert r.status_code == 200, r.text
        done = first(events, lambda n, d: n == "snapshot" and any(
            f["embedding"] for f in d["finished"]))
    [ended] = [f for f in done["finished"] if f["embedding"]]
    assert ended["prompt_tokens"] == r.json()["usage"]["prompt_tokens"] > 0
    assert ended["output_tokens"] == 0 and ended["reason"] == "length"


def test_nobody_watching_means_no_snapshot_and_a_watcher_gets_a_few_a_second(served):
    engine = served.engine
    asked = engine.asked
    served.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 30,
                                         "ignore_eos": True})
    assert engine.asked == asked  # a whole request, not one snapshot
    with engine_events(served) as events:
        start = time.monotonic()
        got = 0
        for name, _ in events:
            got += name == "snapshot"
            if time.monotonic() - start > 1.5:
                break
        seconds = time.monotonic() - start
    assert got >= 2
    assert engine.asked - asked <= seconds / 0.5 + 2  # never more than asked for
    time.sleep(0.8)  # the server notices the watcher left
    after = engine.asked
    time.sleep(0.8)
    assert engine.asked == after and engine.snapshot_listener is None


def test_the_stream_needs_the_api_key_and_the_page_does_not(tiny_engine_factory):
    app = build_app(AsyncEngine(tiny_engine_factory()), [MODEL],
                    config=ServerConfig(api_keys=("secret",), protect_metrics=True))
    with running_server(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        assert_error(http.get("/v1/engine/stream"), 401, code="missing_api_key")
        assert_error(http.get("/v1/engine/stream", headers={"Authorization": "Bearer no"}),
                     401, code="invalid_api_key")
        with engine_events(http, {"Authorization": "Bearer secret"}) as events:
            assert next(events)[0] == "hello"
            assert first(events, lambda n, d: n == "snapshot")["num_running"] == 0
        page = http.get("/")  # a browser cannot send a key when it opens a page
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]


def test_history_points_reach_a_watcher(tiny_engine_factory):
    engine = AsyncEngine(tiny_engine_factory())
    app = build_app(engine, [MODEL])
    with running_server(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        http.post("/v1/completions", json={"model": MODEL, "prompt": "hello there",
                                           "max_tokens": 20, "ignore_eos": True})
        with engine_events(http) as events:
            point = first(events, lambda n, d: n == "point", timeout=10)
    assert point["running"] == 0 and point["kv_usage"] == 0
    assert set(point) >= {"t", "ttft", "itl", "tokens_per_s", "prefill_per_step",
                          "decode_per_step", "prefix_queries", "prefix_hits",
                          "draft_tokens", "accepted_tokens", "waiting"}


def test_speculative_decoding_shows_its_drafts_to_the_page(tiny_engine_factory):
    from kvserve.engine.config.engine_config import SpeculativeConfig

    spec = SpeculativeConfig("ngram", num_tokens=4, ngram_min=1)
    engine = AsyncEngine(tiny_engine_factory(dtype="float32", speculative=spec))
    with running_server(build_app(engine, [MODEL])) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        with engine_events(http) as events:
            assert first(events, lambda n, d: n == "snapshot")["speculative"] is True
            http.post("/v1/completions", json={
                "model": MODEL, "prompt": "0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2",
                "max_tokens": 32, "temperature": 0, "ignore_eos": True})
            point = first(events, lambda n, d: n == "point" and d["draft_tokens"] > 0,
                          timeout=10)
    assert 0 < point["accepted_tokens"] <= point["draft_tokens"]
