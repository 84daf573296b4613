"""Errors in Anthropic's shape on the /v1/messages routes only:
{"type": "error", "error": {"type": ..., "message": ...}}, with Anthropic's status
codes (529 overloaded where kvserve says 503). Every other route keeps OpenAI's.

Whatever answers a request with an error (the key check, the body's size and time
limits, admission, a route's 400s, FastAPI's 404 and 405, a 500) writes it in
OpenAI's shape (server/errors.py); AnthropicErrorMiddleware, outermost, rewrites
those of the /v1/messages paths as they leave. One place, so that no error of these
routes can come out in the other shape, and no other layer needs to know Anthropic's.
Only error responses are held (they are small and whole); streams pass untouched."""
from __future__ import annotations

import json
from http import HTTPStatus

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.server.errors import sse_event

PREFIX = "/v1/messages"
_PHRASES = {s.value: s.phrase for s in HTTPStatus}
# kvserve's status -> Anthropic's for the same condition (the engine down or the
# server draining: Anthropic's clients retry a 529 as they do a 429).
STATUS = {503: 529}
TYPES = {400: "invalid_request_error", 401: "authentication_error",
         403: "permission_error", 404: "not_found_error", 408: "timeout_error",
         413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
         529: "overloaded_error"}
# The chat route's field names (which its errors name) as Anthropic's.
PARAMS = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens",
          "reasoning_effort": "output_config.effort",
          "parallel_tool_calls": "tool_choice.disable_parallel_tool_use"}


def is_anthropic(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def error_type(status: int) -> str:
    if status in TYPES:
        return TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def sse_error(status: int, message: str) -> str:
    """A failure after the stream began (its 200 already sent), as Anthropic sends it."""
    return sse_event("error", error_body(STATUS.get(status, status), message))


def reshaped(status: int, raw: bytes) -> tuple[int, dict]:
    """An OpenAI-shaped error body as Anthropic's: the field it names goes in front of
    the message, by Anthropic's name (Anthropic's errors have no `param`)."""
    status = STATUS.get(status, status)
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("type") == "error":
        return status, body  # already Anthropic's
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return status, error_body(status, _PHRASES.get(status, "error"))
    message, param = error["message"], error.get("param")
    param = PARAMS.get(param, param)
    if param and param not in message:
        message = f"{param}: {message}"
    return status, error_body(status, message)


class AnthropicErrorMiddleware:
    """Pure ASGI: a response under /v1/messages whose status is an error is held
    until its body is whole, then sent again in Anthropic's shape."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_anthropic(scope["path"]):
            return await self.app(scope, receive, send)
        held: dict = {}

        async def send_reshaped(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held["start"], held["body"] = message, []
                return
            if "start" not in held or message["type"] != "http.response.body":
                return await send(message)
            held["body"].append(message.get("body", b""))
            if message.get("more_body", False):
                return
            start = held.pop("start")
            status, body = reshaped(start["status"], b"".join(held.pop("body")))
            payload = json.dumps(body, ensure_ascii=False).encode()
            headers = [(k, v) for k, v in start.get("headers", ())
                       if k.lower() not in (b"content-length", b"content-type")]
            headers += [(b"content-type", b"application/json"),
                        (b"content-length", str(len(payload)).encode())]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": payload})

        await self.app(scope, receive, send_reshaped)


_SCHEMA = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"},
    "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}
_ERROR = {"description": "Error", "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/AnthropicErrorResponse"}}}}


def document_errors(app: FastAPI) -> None:
    """The OpenAPI schema says so too: the /v1/messages operations' errors are
    Anthropic's, 529 in place of 503 (and a 500 or 529 may come from any of them).
    Wraps the schema server/ops.py made; idempotent, as that one is."""
    generate = app.openapi

    def openapi() -> dict:
        schema = generate()
        schema.setdefault("components", {}).setdefault("schemas", {})[
            "AnthropicErrorResponse"] = _SCHEMA
        for path, operations in schema.get("paths", {}).items():
            if not is_anthropic(path):
                continue
            for op in operations.values():
                responses = op.setdefault("responses", {})
                codes = {int(c) for c in responses if c.isdigit() and int(c) >= 400}
                for code in codes:
                    responses.pop(str(code))
                for code in {STATUS.get(c, c) for c in codes} | {500, 529}:
                    responses[str(code)] = _ERROR
        return schema

    app.openapi = openapi
