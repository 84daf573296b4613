"""Big request bodies are parsed and validated on the reader's thread, with the same
answers as small ones (server/json_body.py)."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel, field_validator

from kvserve.server.errors import install_error_handlers
from kvserve.server.json_body import INLINE_JSON_BYTES, OffLoopJSONRoute

PAD = "x" * (INLINE_JSON_BYTES + 1)  # makes a body big


class Body(BaseModel):
    n: int
    pad: str = ""
    bias: dict[str, float] | None = None

    @field_validator("n")
    @classmethod
    def _where(cls, n):
        Body.validated_on = threading.current_thread().name
        return n


def _app() -> FastAPI:
    app = FastAPI()
    app.router.route_class = OffLoopJSONRoute
    install_error_handlers(app)

    @app.post("/m")
    async def modelled(req: Body):
        return {"n": req.n, "bias": len(req.bias or {})}

    return app


def _post(app, content: bytes, content_type: str = "application/json"):
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post("/m", content=content, headers={"content-type": content_type})
    return asyncio.run(go())


@pytest.mark.parametrize("pad", ["", PAD], ids=["small", "big"])
def test_big_and_small_bodies_get_the_same_answers(pad):
    app = _app()
    ok = _post(app, json.dumps({"n": 3, "pad": pad, "bias": {"1": 1.0}}).encode())
    assert ok.status_code == 200 and ok.json() == {"n": 3, "bias": 1}
    assert Body.validated_on.startswith("kvserve-json") == bool(pad)

    bad_field = _post(app, json.dumps({"n": "three", "pad": pad}).encode())
    assert bad_field.status_code == 400
    assert bad_field.json()["error"]["param"] == "n"

    bad_value = _post(app, json.dumps({"n": 1, "pad": pad, "bias": {"7": "no"}}).encode())
    assert bad_value.status_code == 400
    assert bad_value.json()["error"]["param"] == "bias.7"

    not_json = _post(app, b'{"n": 1, "pad": "' + pad.encode() + b'"')
    assert not_json.status_code == 400
    assert "not valid JSON" in not_json.json()["error"]["message"]


def test_json_nested_past_pythons_parser_is_a_400_not_a_500():
    body = b'{"n": 1, "pad": "' + PAD.encode() + b'", "x": ' + b"[" * 200_000 \
        + b"]" * 200_000 + b"}"
    r = _post(_app(), body)
    assert r.status_code == 400
    assert "nests too deeply" in r.json()["error"]["message"]


@pytest.mark.parametrize("pad", ["", PAD], ids=["small", "big"])
@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_declared_json_is_a_400_that_names_the_header(kind, pad):
    r = _post(_app(), json.dumps({"n": 1, "pad": pad}).encode(), kind)
    assert r.status_code == 400
    error = r.json()["error"]
    assert "Content-Type: application/json" in error["message"] and kind in error["message"]
    assert error["param"] == "body"


def test_the_loop_runs_while_a_big_body_is_read(monkeypatch):
    """The reader's thread parses: the loop answers meanwhile (a parse held here
    until the loop has run a callback)."""
    import kvserve.server.json_body as json_body
    loop_ran = threading.Event()
    real_loads = json.loads

    def slow_loads(text, **hooks):
        assert loop_ran.wait(10), "the loop did not run while the body was parsed"
        return real_loads(text, **hooks)

    monkeypatch.setattr(json_body.json, "loads", slow_loads)
    app = _app()

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            post = asyncio.ensure_future(c.post("/m", content=json.dumps(
                {"n": 5, "pad": PAD}).encode(), headers={"content-type": "application/json"}))
            await asyncio.sleep(0.05)
            loop_ran.set()
            return await post

    r = asyncio.run(go())
    assert r.status_code == 200 and r.json()["n"] == 5


def test_a_big_body_past_a_count_cap_is_refused_and_freed_on_the_readers_thread(
        monkeypatch):
    """The check app.state names runs on the reader's thread; a refused request's
    objects are freed there (the loop would take 14-27 ms for 20,000 tools)."""
    from kvserve.server.errors import APIError
    from kvserve.server.json_body import BODY_CHECK

    freed_on = []

    class Tracked(dict):
        def __del__(self):
            freed_on.append(threading.current_thread().name)

    def too_many(req: Body):
        if len(req.bias or {}) > 3:
            raise APIError(400, "at most 3 bias entries", "bias")

    app = _app()
    setattr(app.state, BODY_CHECK, too_many)
    real_validate = Body.model_validate

    def tracking_validate(value, *args, **kwargs):
        value["bias"] = Tracked(value["bias"])  # the parsed object the model keeps
        return real_validate(value, *args, **kwargs)

    monkeypatch.setattr(Body, "model_validate", staticmethod(tracking_validate))
    big = {str(i): 1.0 for i in range(10)}
    r = _post(app, json.dumps({"n": 1, "pad": PAD, "bias": big}).encode())
    assert r.status_code == 400 and r.json()["error"]["param"] == "bias"
    assert freed_on and all(name.startswith("kvserve-json") for name in freed_on)
    ok = _post(app, json.dumps({"n": 1, "pad": PAD, "bias": {"1": 1.0}}).encode())
    assert ok.status_code == 200


def test_the_reader_lets_the_loop_run_during_one_parse():
    """The C decoder alone holds the GIL for a whole parse; the reader's hook hands
    it over between objects, so another thread runs in the middle of one big parse
    (with plain json.loads it runs only before and after)."""
    import time

    from kvserve.server.json_body import _read

    body = json.dumps({"n": 1, "more": [{"k": i} for i in range(300_000)]}).encode()
    ticks, done = [], threading.Event()

    def other():
        while not done.is_set():
            ticks.append(time.perf_counter())

    thread = threading.Thread(target=other)
    thread.start()
    try:
        t0 = time.perf_counter()
        parsed = _read(body, None, None)
        t1 = time.perf_counter()
    finally:
        done.set()
        thread.join()
    assert len(parsed["more"]) == 300_000
    quarter = (t1 - t0) / 4
    assert any(t0 + quarter < t < t1 - quarter for t in ticks)
