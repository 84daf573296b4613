"""HTTP helpers shared by the server tests."""
from __future__ import annotations

import asyncio

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
