"""Hostile requests for bench/abuse.py: each a coroutine that sends one and returns
the HTTP status the server answered (0 when it answered nothing). What each should
get: a refusal (4xx) found cheaply, never a 5xx, never a stall of anyone else.

Each is what one request could cost the server before issue 50's bounds: a body
the server reads forever, work on the event loop or the tokenizer thread that every
other request waits behind, memory pinned for a day."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import httpx

Attack = Callable[[httpx.AsyncClient, dict], Awaitable[int]]
BIG = 2_000_000  # characters: ~2 MB of text, well inside the 10 MiB body limit


_encoded: dict[tuple, bytes] = {}


def _once(key: tuple, make: Callable[[], object]) -> bytes:
    """A hostile body built and encoded once, then resent: on these 2 cores the
    client's own JSON encoding (50 ms for 20,000 tools) would otherwise delay the
    streams' and /health's readings taken on the same event loop, and take CPU from
    the server; the server is what is measured."""
    if key not in _encoded:
        body = make()
        _encoded[key] = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    return _encoded[key]


async def _post(c: httpx.AsyncClient, path: str, body, headers: dict) -> int:
    if isinstance(body, (bytes, str)):
        r = await c.post(path, content=body, headers={**headers,
                                                     "Content-Type": "application/json"})
    else:
        r = await c.post(path, json=body, headers=headers)
    return r.status_code


def _chat(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, **extra}


async def many_prompts_times_n(c, ctx):
    body = {"model": ctx["model"], "prompt": ["x"] * 1024, "n": 16, "max_tokens": 16}
    return await _post(c, "/v1/completions", body, ctx["auth"])


async def giant_logit_bias(c, ctx):
    body = _once(("logit_bias", ctx["model"]), lambda: {
        "model": ctx["model"], "prompt": "x", "max_tokens": 4,
        "logit_bias": {str(i): 1.0 for i in range(40_000)}})
    return await _post(c, "/v1/completions", body, ctx["auth"])


async def thousands_of_stop_strings(c, ctx):
    body = _once(("stop", ctx["model"]), lambda: {
        "model": ctx["model"], "prompt": "x", "max_tokens": 64, "n": 16,
        "stop": [f"stop{i}" for i in range(100_000)]})
    return await _post(c, "/v1/completions", body, ctx["auth"])


async def deep_json(c, ctx):
    body = ('{"model": %s, "prompt": "x", "max_tokens": 2, "x": ' % json.dumps(ctx["model"])
            + "[" * 200_000 + "]" * 200_000 + "}")
    return await _post(c, "/v1/completions", body, ctx["auth"])


def _deep_schema_body(model: str) -> str:
    schema = '{"type": "string"}'
    for _ in range(2000):
        schema = '{"type": "array", "items": %s}' % schema
    return json.dumps(_chat(model))[:-1] + (
        ', "response_format": {"type": "json_schema", "json_schema": '
        '{"name": "x", "schema": %s}}}' % schema)


async def deep_schema(c, ctx):
    body = _once(("deep_schema", ctx["model"]), lambda: _deep_schema_body(ctx["model"]))
    return await _post(c, "/v1/chat/completions", body, ctx["auth"])


async def thousands_of_tools(c, ctx):
    body = _once(("tools", ctx["model"]), lambda: _chat(ctx["model"], tools=[
        {"type": "function", "function": {
            "name": f"tool_{i}", "description": "d" * 100,
            "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}
        for i in range(20_000)], tool_choice="required"))
    return await _post(c, "/v1/chat/completions", body, ctx["auth"])


async def long_choice_list(c, ctx):
    body = _once(("choice", ctx["model"]), lambda: _chat(
        ctx["model"], structured_outputs={"choice": [f"c{i}" for i in range(100_000)]}))
    return await _post(c, "/v1/chat/completions", body, ctx["auth"])


async def regex_bomb(c, ctx):
    body = _chat(ctx["model"], structured_outputs={"regex": "(a|aa)*" * 200 + "b"})
    return await _post(c, "/v1/chat/completions", body, ctx["auth"])


def _big_tokenize() -> bytes:
    return _once(("tokenize",), lambda: {"prompt": "word " * (BIG // 5)})


async def huge_tokenize(c, ctx):
    return await _post(c, "/tokenize", _big_tokenize(), ctx["auth"])


async def unauthenticated_tokenize(c, ctx):
    return await _post(c, "/tokenize", _big_tokenize(), {})


async def unauthenticated_big_body(c, ctx):
    body = _once(("big", ctx["model"]), lambda: {"model": ctx["model"], "prompt": "x" * BIG})
    return await _post(c, "/v1/completions", body, {})


async def huge_metadata(c, ctx):
    body = _once(("metadata", ctx["model"]), lambda: {
        "model": ctx["model"], "input": "hi", "max_output_tokens": 2,
        "metadata": {f"k{i}": "v" * 512 for i in range(2000)}})
    return await _post(c, "/v1/responses", body, ctx["auth"])


async def foreign_stored_response(c, ctx):
    """Another tenant's response id: GET must be a 404, as for an unknown id."""
    made = await c.post("/v1/responses", json={"model": ctx["model"], "input": "hi",
                                               "max_output_tokens": 2},
                        headers=ctx["other_auth"])
    if made.status_code != 200:
        return made.status_code
    r = await c.get(f"/v1/responses/{made.json()['id']}", headers=ctx["auth"])
    return r.status_code


async def slowloris_body(c, ctx):
    """A body dripped in a byte every few seconds, on a raw connection."""
    where = urlsplit(ctx["url"])
    reader, writer = await asyncio.open_connection(where.hostname, where.port)
    try:
        key = ctx["auth"].get("Authorization", "")
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: "
                     + key.encode() + b"\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n{")
        await writer.drain()
        for _ in range(20):  # up to 60 s: the server should give up long before
            try:  # its answer (a 408 and a close), else a byte 3 s later
                line = await asyncio.wait_for(reader.readline(), 3)
            except asyncio.TimeoutError:
                writer.write(b" ")
                await writer.drain()
                continue
            return int(line.split()[1]) if line.startswith(b"HTTP/") else 0
        return 0
    except (ConnectionError, asyncio.TimeoutError, ValueError, IndexError):
        return 0
    finally:
        writer.close()


CORPUS: dict[str, Attack] = {f.__name__: f for f in (
    many_prompts_times_n, giant_logit_bias, thousands_of_stop_strings, deep_json,
    deep_schema, thousands_of_tools, long_choice_list, regex_bomb, huge_tokenize,
    unauthenticated_tokenize, unauthenticated_big_body, huge_metadata,
    foreign_stored_response, slowloris_body)}
