"""Request bodies of more than a few kilobytes are parsed from JSON, and validated into
the route's request model, off the event loop.

FastAPI parses and validates a route's JSON body on the event loop: 50-200 ms to
parse a 5 MB body of 20,000 tool definitions on one of our 2 cores (engine/platform/heap.py
says why it varies), 26 ms to validate 40,000 `logit_bias` entries. A body can be up
to --max-request-body-bytes (10 MiB) whatever our checks later make of it, so this is
what one request costs before any of them can run, and every stream's next token and
/health waited behind it (bench/abuse.py).

On a thread of its own the work still holds the GIL, but the interpreter hands it to
a waiting thread every switch interval, between bytecodes, so the loop keeps serving
between slices (which is why each JSON object is made by a Python hook). One
thread, not a pool: with several parsers waiting for the GIL as well, the loop is
handed it after any of them. Big bodies are read one after another, as they would be
on one core anyway. The model instance made there is what FastAPI's own validation
then gets, and a model instance passes it as it is (pydantic does not revalidate
instances); a body that fails is the same 400 the loop would have given (the first
error, server/errors.py), and one past a count cap (server/request_caps.py) is refused
there too, its objects freed on that thread. Small bodies, nearly all of them, stay
inline: a thread hop costs more than reading 64 KiB. (Not lowered in priority: a
reader descheduled while holding the GIL held the loop for seconds.)"""
from __future__ import annotations

import asyncio
import email.message
import json
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from kvserve.server.errors import APIError

INLINE_JSON_BYTES = 64 << 10  # read on the loop up to here (~1 ms)
# app.state's attribute naming a check of the request model, run here for big bodies
BODY_CHECK = "body_check"
# The process's, for its life; its thread starts at the first big body.
_reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-json")


class OffLoopJSONRoute(APIRoute):
    """A route whose JSON body, when large, is parsed and validated on the reader's
    thread before FastAPI looks at it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()
        model = _body_model(self)

        async def handle_off_loop(request: Request) -> Response:
            if model is not None and not _is_json(request):
                # FastAPI would hand the model the raw bytes and say "Input should be a
                # valid dictionary", which names neither the header nor the fix (curl's
                # -d alone sends application/x-www-form-urlencoded).
                kind = request.headers.get("content-type", "")[:100]
                raise APIError(400, f"the body must be JSON: send `Content-Type: "
                               f"application/json` (this request sent `{kind}`)", "body")
            if _is_json(request):
                body = await request.body()
                if len(body) > INLINE_JSON_BYTES:
                    check = getattr(request.app.state, BODY_CHECK, None)
                    # Request.json() returns what it finds here (starlette caches it).
                    request._json = await asyncio.get_running_loop().run_in_executor(
                        _reader, _read, body, model, check)
            return await handle(request)

        return handle_off_loop


def _body_model(route: APIRoute) -> type[BaseModel] | None:
    """The request model of a route whose body is one model (not embedded), else None
    (the body is then only parsed here, and FastAPI validates it)."""
    params = route.dependant.body_params
    if len(params) != 1 or getattr(params[0].field_info, "embed", False):
        return None
    annotation = params[0].field_info.annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) \
        else None


def _is_json(request: Request) -> bool:
    """Whether FastAPI would parse this body as JSON (no content type, or a JSON one)."""
    kind = request.headers.get("content-type")
    if not kind:
        return True
    header = email.message.Message()
    header["content-type"] = kind
    sub = header.get_content_subtype()
    return header.get_content_maintype() == "application" and (
        sub == "json" or sub.endswith("+json"))


def _json_object(pairs: list[tuple[str, Any]]) -> dict:
    """Each JSON object, made by Python code: the C decoder alone holds the GIL for a
    whole parse (the loop waited 230 ms beside a 5 MB one), whereas the interpreter
    hands the GIL over between bytecodes, so with this hook the loop's longest wait
    was 35 ms, at the same parse time (0.19 s). Duplicate keys: the last one wins,
    as without it."""
    return dict(pairs)


def _read(body: bytes, model: type[BaseModel] | None,
          check: Callable[[BaseModel], None] | None) -> Any:
    """On the reader's thread: the body as the route's model (or as JSON where the
    route has none); RequestValidationError, raised on the loop, where it is neither;
    what `check` raises for the model (the request's count caps), with the body's
    objects freed here first (the error carries no frame that holds them)."""
    try:
        value = json.loads(body, object_pairs_hook=_json_object)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",),
                                       "msg": "JSON decode error",
                                       "ctx": {"error": str(exc)}}]) from None
    except RecursionError:  # Python's parser recurses: nested past its own limit
        raise RequestValidationError([{"type": "value_error", "loc": ("body",),
                                       "msg": "the JSON nests too deeply"}]) from None
    if model is None:
        return value
    try:
        request = model.model_validate(value)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[:1]
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in first]) from None
    if check is None:
        return request
    try:
        check(request)
        return request
    except APIError as exc:
        refusal = exc
    del value, request  # freed on this thread, before the loop sees the refusal
    raise refusal.with_traceback(None)
