"""--grammar-compile-timeout through the API: a grammar compiling past it is the
client's 400 naming the field (a stream's error event says 400), while another
structured request is served meanwhile; a client that leaves while its grammar
compiles frees the engine at once, and the next structured request does not wait for
that compile. A compile is made slow by holding one spec's build
(tests/support/held_compile.py), on a tiny model."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.server.entrypoints.app import build_app
from tests.support.held_compile import held_compile  # noqa: F401 - a fixture
from tests.support.http import assert_error, parse_sse, wait_idle
from tests.support.server import running_server

MODEL = "tiny"
TIMEOUT = 0.5


def serve(tiny_engine_factory, timeout: float):
    engine = tiny_engine_factory("llama", grammar_compile_timeout=timeout)
    return engine, running_server(build_app(AsyncEngine(engine), [MODEL]))


@pytest.fixture(scope="module")
def deadline(tiny_engine_factory):
    engine, server = serve(tiny_engine_factory, TIMEOUT)
    with server as url, httpx.Client(base_url=url, timeout=30) as http:
        http.engine = engine
        yield http


@pytest.fixture(scope="module")
def patient(tiny_engine_factory):
    engine, server = serve(tiny_engine_factory, 0)  # no deadline: only leaving ends a wait
    with server as url:
        yield url, engine


def slow_body(held, stream: bool = False) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "stream": stream, "structured_outputs": {"regex": held.spec.spec}}


FAST_BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 3,
             "guided_choice": ["yes", "no"]}


def test_a_compile_past_the_deadline_is_a_400_while_another_is_served(deadline,
                                                                      held_compile):  # noqa: F811
    with ThreadPoolExecutor(2) as pool:
        t0 = time.monotonic()
        slow = pool.submit(deadline.post, "/v1/chat/completions", json=slow_body(held_compile))
        while not held_compile.threads:
            time.sleep(0.01)
        fast = deadline.post("/v1/completions", json=FAST_BODY)
        assert fast.status_code == 200 and fast.json()["choices"][0]["text"] in ("yes", "no")
        err = assert_error(slow.result(), 400, "structured_outputs")
    assert "--grammar-compile-timeout" in err["message"]
    assert time.monotonic() - t0 < TIMEOUT + 3 and not held_compile.is_set()
    assert wait_idle(deadline.engine)


def test_a_streamed_request_past_the_deadline_ends_with_a_400_event(deadline,
                                                                    held_compile):  # noqa: F811
    r = deadline.post("/v1/chat/completions", json=slow_body(held_compile, stream=True))
    assert r.status_code == 200  # sent before the engine had the grammar
    error = parse_sse(r.content)[-1]["error"]
    assert "--grammar-compile-timeout" in error["message"]
    assert error["type"] == "invalid_request_error"  # a 400's
    assert wait_idle(deadline.engine)


def test_leaving_during_a_compile_frees_the_engine_and_the_compiler(patient,
                                                                    held_compile):  # noqa: F811
    url, engine = patient
    with httpx.Client(base_url=url, timeout=0.5) as leaver:
        with pytest.raises(httpx.ReadTimeout):
            leaver.post("/v1/chat/completions", json=slow_body(held_compile))
    assert held_compile.threads and not held_compile.is_set()  # still compiling
    assert wait_idle(engine, timeout=3)  # the request is gone, and held no block
    with httpx.Client(base_url=url, timeout=30) as http:
        t0 = time.monotonic()
        r = http.post("/v1/completions", json=FAST_BODY)
        assert r.status_code == 200 and time.monotonic() - t0 < 3
    assert engine.grammars.compiler._abandoned == 1
    held_compile.set()
    held_compile.threads[0].join(10)
    assert engine.grammars.compiler._abandoned == 0
