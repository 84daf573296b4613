"""The FastAPI application: routes, error handlers, and the engine's lifetime."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import Response

from engine.engine_client import EngineClient
from server.chat import ChatService
from server.completions import CompletionService
from server.errors import APIError, error_response, install_error_handlers
from server.limits import RequestLimits
from server.ops import install_ops
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.tokenization import Tokenization
from server.validation import check_model

log = logging.getLogger("kvserve.server")

VERSION = "0.1.0"


def build_app(engine: EngineClient, model_names: list[str], model_root: str = "", *,
              api_keys: Sequence[str] = (), max_waiting_requests: int = 0,
              max_waiting_tokens: int = 0, limits: RequestLimits = RequestLimits(),
              request_timeout: float = 0.0, protect_metrics: bool = False) -> FastAPI:
    """`engine` must not be started yet: the app starts it at startup and stops it at
    shutdown, so a test server and a real one live the same way. For `api_keys`,
    `max_waiting_requests` and `max_waiting_tokens` (0: no limit) see server/ops.py,
    for `limits` server/limits.py; `protect_metrics`: /health, /version and /metrics
    need a key too (with `api_keys`); `request_timeout` (seconds, 0: none) aborts a
    generation that runs longer (its choices end with finish reason "abort")."""

    tokenization = Tokenization(engine.tokenizer, engine.max_model_len)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        try:
            yield
        finally:
            tokenization.shutdown()
            engine.shutdown()

    app = FastAPI(title="kvserve", version=VERSION, lifespan=lifespan)
    install_error_handlers(app)
    install_ops(app, engine, model_names, VERSION, api_keys=api_keys,
                max_waiting_requests=max_waiting_requests,
                max_waiting_tokens=max_waiting_tokens, max_body_bytes=limits.max_body_bytes,
                protect_metrics=protect_metrics, tokenization=tokenization)
    completions = CompletionService(engine, model_names, tokenization, limits,
                                    request_timeout)
    created = int(time.time())

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, request: Request):
        return await _cancel_on_disconnect(request, completions.create(req))

    chat = ChatService(engine, model_names, tokenization, limits, request_timeout)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, request: Request):
        return await _cancel_on_disconnect(request, chat.create(req))

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "kvserve",
                "root": model_root or name, "parent": None,
                "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(name) for name in model_names]}

    # `:path`: served names often hold a slash ("meta-llama/Llama-3.2-1B")
    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str):
        return model_card(check_model(model, model_names))

    return app


async def _cancel_on_disconnect(request: Request, coro):
    """Awaits `coro`, but cancels it (which aborts its engine requests) when the client
    disconnects first, so an abandoned non-streaming request stops generating. A
    streaming response watches for the disconnect itself once it is returned."""
    work = asyncio.ensure_future(coro)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if work in done:
        return _result_or_500(work)
    await asyncio.wait({work})  # let it finish aborting its engine requests
    if not work.cancelled():
        work.exception()  # mark it retrieved: there is nobody left to tell
    return Response(status_code=499)  # the client is gone; nobody reads this


def _result_or_500(work: asyncio.Future):
    """A bug while serving one request answers it with a 500 here rather than in
    Starlette's last-resort handler, which re-raises and makes uvicorn drop the
    keep-alive connection the client would reuse."""
    try:
        return work.result()
    except APIError:
        raise
    except Exception as exc:
        log.exception("internal error while serving a request")
        return error_response(500, f"internal error: {type(exc).__name__}")
