"""The FastAPI application: routes, error handlers, and the engine's lifetime."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvserve.engine.client.engine_client import EngineClient
from kvserve.server.anthropic.errors import AnthropicErrorMiddleware, document_errors
from kvserve.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from kvserve.server.anthropic.service import MessagesService
from kvserve.server.auth import current_principal
from kvserve.server.batch.routes import install_batch
from kvserve.server.chat import ChatService
from kvserve.server.completions import CompletionService
from kvserve.server.config import ServerConfig
from kvserve.server.embeddings import EmbeddingRequest, EmbeddingService
from kvserve.server.engine_view.history import EngineHistory
from kvserve.server.engine_view.hub import EngineViewHub
from kvserve.server.engine_view.routes import engine_view_router
from kvserve.server.errors import APIError, error_response, install_error_handlers
from kvserve.server.json_body import BODY_CHECK, OffLoopJSONRoute
from kvserve.server.lora_api import lora_router
from kvserve.server.models_api import models_router
from kvserve.server.ops import install_ops
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from kvserve.server.request_caps import refuse_past_counts
from kvserve.server.responses.protocol import ResponsesRequest
from kvserve.server.responses.service import ResponsesService
from kvserve.server.responses.store import ResponseStore
from kvserve.server.tokenization import Tokenization
from kvserve.server.ui.routes import install_ui

log = logging.getLogger("kvserve.server")

VERSION = "0.1.0"


def build_app(engine: EngineClient, model_names: list[str], model_root: str = "",
              config: ServerConfig = ServerConfig(), span_exporter=None) -> FastAPI:
    """`engine` must not be started yet: the app starts it at startup and stops it at
    shutdown, so a test server and a real one live the same way. `config` holds the
    keys, the admission and request limits and the request timeout (server/config.py;
    the host, port and the rest are for the process that serves the app).
    span_exporter: a test hook, an OpenTelemetry SpanExporter the request spans go to
    (as with --otlp-traces-endpoint) instead of OTLP/HTTP (server/tracing.py)."""
    tokenization = Tokenization(engine.tokenizer, engine.max_model_len)
    tokenize_routes = tokenization.copy()  # /tokenize, /detokenize: never ahead of a prompt

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        engine_view.start()
        batches.start()
        try:
            yield
        finally:
            await batches.stop()  # unfinished jobs resume at the next start
            await engine_view.stop()
            tokenization.shutdown()
            tokenize_routes.shutdown()
            engine.shutdown()

    app = FastAPI(title="kvserve", version=VERSION, lifespan=lifespan)
    app.router.route_class = OffLoopJSONRoute  # bodies of megabytes (server/json_body.py)
    setattr(app.state, BODY_CHECK, functools.partial(refuse_past_counts, config=config))
    install_error_handlers(app)
    metrics = install_ops(app, engine, model_names, VERSION, config, tokenize_routes,
                          span_exporter)
    admission = app.state.admission

    def closing() -> str | None:  # the drain is over: nothing left to watch
        return ("the server is shutting down"
                if admission.draining and not admission.in_flight else None)

    engine_view = EngineViewHub(engine, EngineHistory(engine, metrics.frontend),
                                closing=closing)
    app.include_router(engine_view_router(engine_view, model_names))
    install_ui(app)
    chat = _install_generation(app, engine, model_names, tokenization, config)
    _install_responses(app, ResponsesService(chat, ResponseStore.of(config)))

    batches = install_batch(app, config)  # /v1/files, /v1/batches
    app.include_router(models_router(engine, model_names, model_root))
    app.include_router(lora_router(engine, model_names, config.allow_runtime_lora_updating,
                                   config.lora_root))

    return app


def _install_generation(app: FastAPI, engine: EngineClient, model_names: list[str],
                        tokenization: Tokenization, config: ServerConfig) -> ChatService:
    """/v1/completions, /v1/chat/completions, /v1/embeddings and Anthropic's
    /v1/messages; the chat service (Responses and Messages run through it)."""
    completions = CompletionService(engine, model_names, tokenization, config)

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, request: Request):
        return await _cancel_on_disconnect(request, completions.create(req))

    chat = ChatService(engine, model_names, tokenization, config)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, request: Request):
        return await _cancel_on_disconnect(request, chat.create(req))

    embeddings = EmbeddingService(engine, model_names, tokenization, config.pooling,
                                  config.max_prompts_per_request)

    @app.post("/v1/embeddings")
    async def create_embeddings(req: EmbeddingRequest, request: Request):
        return await _cancel_on_disconnect(request, embeddings.create(req))

    _install_anthropic(app, MessagesService(chat))
    return chat


def _install_responses(app: FastAPI, responses: ResponsesService) -> None:
    """Each stored response belongs to the key that made it (server/auth.py)."""
    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, request: Request):
        owner = current_principal().owner
        return await _cancel_on_disconnect(request, responses.create(req, owner))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return responses.retrieve(response_id, current_principal().owner)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return responses.delete(response_id, current_principal().owner)


def _install_anthropic(app: FastAPI, messages: MessagesService) -> None:
    """Anthropic's Messages API (server/anthropic/), its errors in Anthropic's shape."""
    @app.post("/v1/messages")
    async def create_message(req: MessagesRequest, request: Request):
        return await _cancel_on_disconnect(request, messages.create(req))

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(req: CountTokensRequest, request: Request):
        return await _cancel_on_disconnect(request, messages.count_tokens(req))

    app.add_middleware(AnthropicErrorMiddleware)  # after install_ops: outermost
    document_errors(app)


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
