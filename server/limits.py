"""The request body's limits: its size (`--max-request-body-bytes`: a body past it is
refused with a 413 that names the flag, before anything reads or parses it) and the
time it may take to arrive (`--body-read-timeout`: a body dripped in slower is a 408,
and the connection is closed). An upload (POST /v1/files) streams through unbuffered
instead, under `--max-upload-bytes` and 20 times the time. The key is checked before
either (server/ops.py). (The
other per-request limits, `--max-prompts-per-request` and `--max-n`, are checked
where the request is read: server/completions.py, server/service.py.)"""
from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.server.errors import error_response


def _too_large(limit: int, flag: str = "--max-request-body-bytes"):
    return error_response(413, f"The request body is larger than the server's limit of "
                          f"{limit} bytes ({flag}).", "body")


def _too_slow(seconds: float):
    return error_response(408, f"The request body did not arrive within {seconds:g} s "
                          "(--body-read-timeout).", "body", headers={"Connection": "close"})


# An upload (POST /v1/files) may take this many times --body-read-timeout to arrive
# whole, each of its chunks no longer than that timeout: 10 minutes by default, for
# 200 MiB at a third of a megabyte a second.
UPLOAD_TIME_FACTOR = 20


class BodyLimitMiddleware:
    """Refuses a body over `limit` bytes with 413: at once when Content-Length says
    so, else while reading it (chunked bodies have no Content-Length); and one that
    takes longer than `read_timeout` seconds to arrive with 408 (0: no limit). The body
    is read here, whole, before the app runs, so an over-long one never reaches a
    parser, and a slow one never holds a request's resources."""

    def __init__(self, app: ASGIApp, limit: int, read_timeout: float = 0.0,
                 uploads: dict[str, int] | None = None):
        """uploads: paths (POST) whose bodies stream through to the app, unbuffered,
        under a limit of their own (0: none) and UPLOAD_TIME_FACTOR times the time."""
        self.app, self.limit, self.read_timeout = app, limit, read_timeout
        self.uploads = uploads or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["method"] == "POST" and scope["path"] in self.uploads:
            return await self._stream_through(scope, receive, send,
                                              self.uploads[scope["path"]])
        if not (self.limit or self.read_timeout):
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


    async def _stream_through(self, scope: Scope, receive: Receive, send: Send,
                              limit: int) -> None:
        """An upload: its bytes are counted as the app reads them. Past the limit or
        the time, the app is told the client left (so it stops reading and keeps
        nothing) and the client gets the 413 or 408 instead of the app's answer."""
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if limit and declared.isdigit() and int(declared) > limit:
            return await _too_large(limit, "--max-upload-bytes")(scope, receive, send)
        loop = asyncio.get_running_loop()
        timeout = self.read_timeout
        deadline = loop.time() + timeout * UPLOAD_TIME_FACTOR
        size, refusal = 0, None

        async def counted() -> Message:
            nonlocal size, refusal
            if refusal is not None:
                return {"type": "http.disconnect"}
            try:
                wait = min(timeout, deadline - loop.time()) if timeout else None
                message = await asyncio.wait_for(receive(), wait)
            except asyncio.TimeoutError:
                refusal = _too_slow(timeout * UPLOAD_TIME_FACTOR)
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if limit and size > limit:
                    refusal = _too_large(limit, "--max-upload-bytes")
                    return {"type": "http.disconnect"}
            return message

        async def unless_refused(message: Message) -> None:
            if refusal is None:
                await send(message)

        await self.app(scope, counted, unless_refused)
        if refusal is not None:
            await refusal(scope, receive, send)


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
