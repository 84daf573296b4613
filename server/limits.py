"""The request body's limits: its size (`--max-request-body-bytes`: a body past it is
refused with a 413 that names the flag, before anything reads or parses it) and the
time it may take to arrive (`--body-read-timeout`: a body dripped in slower is a 408,
and the connection is closed). The key is checked before either (server/ops.py). (The
other per-request limits, `--max-prompts-per-request` and `--max-n`, are checked
where the request is read: server/completions.py, server/service.py.)"""
from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.server.errors import error_response


def _too_large(limit: int):
    return error_response(413, f"The request body is larger than the server's limit of "
                          f"{limit} bytes (--max-request-body-bytes).", "body")


def _too_slow(seconds: float):
    return error_response(408, f"The request body did not arrive within {seconds:g} s "
                          "(--body-read-timeout).", "body", headers={"Connection": "close"})


class BodyLimitMiddleware:
    """Refuses a body over `limit` bytes with 413: at once when Content-Length says
    so, else while reading it (chunked bodies have no Content-Length); and one that
    takes longer than `read_timeout` seconds to arrive with 408 (0: no limit). The body
    is read here, whole, before the app runs, so an over-long one never reaches a
    parser, and a slow one never holds a request's resources."""

    def __init__(self, app: ASGIApp, limit: int, read_timeout: float = 0.0):
        self.app, self.limit, self.read_timeout = app, limit, read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not (self.limit or self.read_timeout):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if self.limit and declared.isdigit() and int(declared) > self.limit:
            return await _too_large(self.limit)(scope, receive, send)
        try:
            body = await asyncio.wait_for(self._read(receive), self.read_timeout or None)
        except asyncio.TimeoutError:
            return await _too_slow(self.read_timeout)(scope, receive, send)
        if body is None:  # the client left before sending it
            return
        if isinstance(body, int):
            return await _too_large(self.limit)(scope, receive, send)
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes | int | None:
        """The whole body; its size so far once past the limit; None if the client
        left first."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if self.limit and size > self.limit:
                return size
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body as one message, then the real receive (a disconnect watch needs it)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
