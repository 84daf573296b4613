"""Errors in the OpenAI wire shape: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("kvserve.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def no_tokenizer(param: str | None = None) -> APIError:
    """A model served without a tokenizer (a preset with random weights) takes and
    returns token ids only."""
    return APIError(400, "this model has no tokenizer: send token ids as the prompt "
                    "(and read `token_ids` with return_token_ids)", param)


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)


def sse_error(status: int, message: str) -> str:
    return sse_data(error_body(status, message))


def sse_data(body: dict) -> str:
    """One server-sent event, compact JSON as vLLM sends it. U+2028, U+2029 and
    U+0085 are legal raw in JSON, but clients that read the stream with a Unicode
    line splitter (Python's str.splitlines, httpx's aiter_lines) would cut the event
    at them: they go out escaped, which every JSON parser reads back as the same
    character. (json.dumps already escapes the other splitlines breaks, all below
    U+0020.)"""
    text = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    for char, escaped in _LINE_BREAKS_IN_JSON:
        text = text.replace(char, escaped)  # the same string back when absent
    return f"data: {text}\n\n"


def sse_event(name: str, body: dict) -> str:
    """A named server-sent event: an `event:` line, then sse_data(body)."""
    return f"event: {name}\n" + sse_data(body)


_PATH_CHARS = 256  # of an unknown route's path, named in its 404
_LINE_BREAKS_IN_JSON = [(c, f"\\u{ord(c):04x}") for c in "\u2028\u2029\x85"]


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        # FastAPI says 422; OpenAI and vLLM say 400 and name the offending field.
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON")
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}",
                              param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":  # the router's: no route
            message = f"no route {request.method} {request.url.path[:_PATH_CHARS]}"
        return error_response(exc.status_code, message)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):
        log.exception("internal error")
        return error_response(500, f"internal error: {type(exc).__name__}")
