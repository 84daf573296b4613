"""The request body's size limit (`--max-request-body-bytes`): a body past it is
refused with a 413 that names the flag, before anything reads or parses it. (The
other per-request limits, `--max-prompts-per-request` and `--max-n`, are checked
where the request is read: server/completions.py, server/service.py.)"""
from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import error_response


def _too_large(limit: int):
    return error_response(413, f"The request body is larger than the server's limit of "
                          f"{limit} bytes (--max-request-body-bytes).", "body")


class BodyLimitMiddleware:
    """Refuses a body over `limit` bytes with 413: at once when Content-Length says
    so, else while reading it (chunked bodies have no Content-Length). The body is read
    here, whole, before the app runs, so an over-long one never reaches a parser."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.limit:
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await _too_large(self.limit)(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await _too_large(self.limit)(scope, receive, send)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)


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
