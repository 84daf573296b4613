"""A bug that hits one request (here: its detokenizer raises) answers that request
with a 500 in OpenAI's shape, or an error event mid-stream, frees its blocks, and
leaves the engine serving everyone else."""
from __future__ import annotations

import httpx
import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.server.detokenizer import IncrementalDetokenizer
from kvserve.server.entrypoints.app import build_app
import kvserve.server.generation
from tests.support.http import assert_error, parse_sse, wait_idle
from tests.support.server import running_server

MODEL = "tiny"
POISON = 77  # a prompt made of this token trips the broken detokenizer


class BrokenDetokenizer(IncrementalDetokenizer):
    def add_tokens(self, token_ids):
        if self.ids and self.ids[-1] == POISON and len(self.ids) == 1:
            raise RuntimeError("detokenizer bug")
        super().add_tokens(token_ids)


@pytest.fixture(scope="module")
def srv(tiny_engine_factory):
    patch = pytest.MonkeyPatch()
    patch.setattr(kvserve.server.generation, "IncrementalDetokenizer", BrokenDetokenizer)
    engine = tiny_engine_factory("llama")
    with running_server(build_app(AsyncEngine(engine), [MODEL])) as url, \
            httpx.Client(base_url=url, timeout=60) as http:
        http.engine = engine
        yield http
    patch.undo()


def body(prompt, **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 20, "ignore_eos": True, **kw}


def test_non_streaming_gets_500(srv):
    err = assert_error(srv.post("/v1/completions", json=body([POISON])), 500)
    assert err["type"] == "server_error"
    assert wait_idle(srv.engine)


def test_streaming_gets_an_error_event_then_done(srv):
    with srv.stream("POST", "/v1/completions", json=body([POISON], stream=True)) as r:
        assert r.status_code == 200
        events = parse_sse(r.read())
    assert events[-1]["error"]["code"] is None and "internal" in events[-1]["error"]["message"]
    assert wait_idle(srv.engine)


def test_others_are_served_meanwhile_and_after(srv):
    ok = srv.post("/v1/completions", json=body([5, 6, 7]))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 20
    assert srv.get("/health").status_code == 200
    assert wait_idle(srv.engine)
