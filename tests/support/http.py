"""HTTP helpers shared by the server tests."""
from __future__ import annotations

import asyncio
import json
import time

import httpx

ANY = "__any__"


def assert_error(r: httpx.Response, status: int, param: str | None = ANY,
                 code: str | None = ANY) -> dict:
    """The response is an OpenAI-shaped error with this status; returns its body."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param != ANY:
        assert err["param"] == param, err
    if code != ANY:
        assert err["code"] == code, err
    return err


def post_completions_concurrently(url: str, bodies: list[dict], timeout: float) -> list[dict]:
    """POSTs every body to /v1/completions at once; all must succeed."""
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=timeout) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))

    responses = asyncio.run(run())
    for r in responses:
        assert r.status_code == 200, r.text
    return [r.json() for r in responses]


class CompletionsClient:
    """POST /v1/completions with a default model name filled in."""

    def __init__(self, http: httpx.Client, model: str):
        self.http, self.model = http, model

    def complete(self, **body) -> httpx.Response:
        body.setdefault("model", self.model)
        return self.http.post("/v1/completions", json=body)

    def ok(self, **body) -> dict:
        r = self.complete(**body)
        assert r.status_code == 200, r.text
        return r.json()


def parse_sse(body: bytes) -> list[dict]:
    """Checks the framing byte for byte: `data: <json>\\n\\n` events, then
    `data: [DONE]\\n\\n` and nothing after it. Returns the JSON events."""
    assert body.endswith(b"data: [DONE]\n\n"), body[-200:]
    events = body.split(b"\n\n")
    assert events[-1] == b""
    assert events[-2] == b"data: [DONE]"
    assert body.count(b"data: [DONE]") == 1
    chunks = []
    for ev in events[:-2]:
        assert ev.startswith(b"data: "), ev
        assert b"\n" not in ev and b"\r" not in ev, ev
        chunks.append(json.loads(ev[len(b"data: "):].decode("utf-8")))
    return chunks


class Idle:
    """Truthy when the engine has no unfinished requests and all KV blocks are free;
    its repr tells what was left over."""

    def __init__(self, engine, ok: bool):
        self.ok = ok
        sched = engine.scheduler
        self.state = (f"unfinished={engine.has_unfinished_requests()} "
                      f"free={engine.scheduler.kv.num_free_blocks}/{engine.scheduler.kv.num_blocks} "
                      f"waiting={[r.request_id for r in sched.waiting]} "
                      f"running={[r.request_id for r in sched.running]}")

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return f"Idle({self.ok}: {self.state})"


def wait_idle(engine, timeout: float = 5.0) -> Idle:
    deadline = time.monotonic() + timeout
    while True:
        if (not engine.has_unfinished_requests()
                and engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks):
            return Idle(engine, True)
        if time.monotonic() > deadline:
            return Idle(engine, False)
        time.sleep(0.05)
