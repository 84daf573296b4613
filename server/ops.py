"""The operational side of the app: API keys (/v1, /tokenize and /detokenize need
`Authorization: Bearer <key>` when any are given; /health, /ready, /version and
/metrics too with `protect_metrics`), admission (at most `max_waiting_requests`
waiting to be scheduled, or `max_waiting_tokens` prompt tokens, 0: no limit; nothing
while draining), the request body's size limit, /health (alive), /ready (alive and
at compiled speed), /version, /metrics,
/tokenize and /detokenize; and the error responses all of these give, in the OpenAPI
schema."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from kvserve.engine.client.engine_client import EngineClient
from kvserve.server.admission import ENGINE_PATHS, GENERATION_PATHS, Admission, AdmissionMiddleware
from kvserve.server.auth import ApiKeyMiddleware, guarded
from kvserve.server.config import ServerConfig
from kvserve.server.limits import BodyLimitMiddleware
from kvserve.server.metrics import ServerMetrics
from kvserve.server.metrics.frontend import ArrivalMiddleware
from kvserve.server.tokenization import Tokenization
from kvserve.server.tokenize_api import tokenize_router
from kvserve.server.tracing import Tracing, TracingMiddleware


def install_ops(app: FastAPI, engine: EngineClient, model_names: list[str], version: str,
                config: ServerConfig, tokenization: Tokenization,
                span_exporter=None) -> ServerMetrics:
    """tokenization: the thread and tokenizer of /tokenize and /detokenize (their own,
    not generation's). span_exporter: see build_app."""
    admission = Admission(engine, config.max_waiting_requests, config.max_waiting_tokens)
    app.state.admission = admission  # the shutdown drain finds it here
    # Middlewares run outermost (added last) first: arrival, key, trace, body, admission.
    app.add_middleware(AdmissionMiddleware, admission=admission)
    # Outside admission: an oversized or slow body is refused before anything parses it.
    app.add_middleware(BodyLimitMiddleware, limit=config.max_request_body_bytes,
                       read_timeout=config.body_read_timeout,
                       uploads={"/v1/files": config.max_upload_bytes})
    if config.otlp_traces_endpoint or span_exporter is not None:
        # Inside the key check: a request without a valid key leaves no span.
        app.state.tracing = Tracing(config.otlp_traces_endpoint, span_exporter)
        app.add_middleware(TracingMiddleware, tracing=app.state.tracing, paths=ENGINE_PATHS)
    if config.any_keys:  # outside the body's read: no key, no byte of it read
        app.add_middleware(ApiKeyMiddleware, keys=list(config.api_keys),
                           admin_keys=list(config.admin_api_keys),
                           protect_metrics=config.protect_metrics)
    server_metrics = ServerMetrics(engine, model_names[0] if model_names else "")
    # Outermost: a request's latency counts from its arrival, auth and admission included.
    app.add_middleware(ArrivalMiddleware, hist=server_metrics.frontend,
                       paths=GENERATION_PATHS)
    app.include_router(tokenize_router(engine, model_names, tokenization,
                                       config.trust_request_chat_template))

    _install_probes(app, engine, admission)

    @app.get("/version")
    async def version_info():
        return {"version": version}

    @app.get("/metrics")
    async def metrics():
        return server_metrics.response()

    _document_errors(app, keys=config.any_keys, protect_metrics=config.protect_metrics,
                     queue_limit=bool(config.max_waiting_requests
                                      or config.max_waiting_tokens),
                     body_limit=bool(config.max_request_body_bytes))
    return server_metrics


def _install_probes(app: FastAPI, engine: EngineClient, admission: Admission) -> None:
    """/health (liveness) and /ready (readiness: alive, and at compiled speed)."""

    def unavailable(warming_counts: bool) -> str | None:
        """Why the server should get no traffic now, or None."""
        if admission.draining:
            return "draining"
        if not engine.is_alive:
            return "engine is not running"
        if warming_counts and engine.warming_up:
            # Steps run eagerly at a fraction of the compiled speed (a 16-token answer
            # took 20-40 s on 2 cores): no traffic should be sent here yet.
            return "warming up: compiling the forward pass"
        return None

    @app.get("/health")
    async def health():
        why = unavailable(warming_counts=False)
        return JSONResponse({"status": why or "ok"}, status_code=503 if why else 200)

    @app.get("/ready")
    async def ready():
        why = unavailable(warming_counts=True)
        return JSONResponse({"status": why or "ready"}, status_code=503 if why else 200)


_ERROR = {"description": "Error", "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def _document_errors(app: FastAPI, *, keys: bool, protect_metrics: bool, queue_limit: bool,
                     body_limit: bool) -> None:
    """FastAPI's schema says 422 for a body that fails validation; the server answers
    400 in OpenAI's error shape (server/errors.py), and the middlewares add 401, 413,
    429 and 503. Streams are text/event-stream, /metrics is Prometheus text."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        schema = generate()  # FastAPI's, cached; the edits below are idempotent
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        schemas["ErrorResponse"] = _ERROR_SCHEMA
        if keys:
            components["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
        for path, operations in schema.get("paths", {}).items():
            for method, op in operations.items():
                codes = _error_codes(path, method.upper(), keys, protect_metrics,
                                     queue_limit, body_limit)
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                for code in codes:
                    responses.setdefault(str(code), _ERROR)
                if 401 in codes:
                    op["security"] = [{"apiKey": []}]
                ok = responses.get("200", {}).setdefault("content", {})
                if path in GENERATION_PATHS:
                    ok.setdefault("text/event-stream", {})  # server-sent events
                if path == "/metrics":
                    ok.clear()
                    ok["text/plain"] = {"schema": {"type": "string"}}
                if path == "/v1/files/{file_id}/content":
                    ok.clear()
                    ok["application/octet-stream"] = {"schema": {"type": "string",
                                                                 "format": "binary"}}
        return schema

    app.openapi = openapi


# server/batch/routes.py: a full file store (507), a key's unfinished batches (429),
# a batch cancelled after it ended (409).
_BATCH_CODES = {("POST", "/v1/files"): [507], ("POST", "/v1/batches"): [429],
                ("POST", "/v1/batches/{batch_id}/cancel"): [409]}


def _error_codes(path: str, method: str, keys: bool, protect_metrics: bool,
                 queue_limit: bool, body_limit: bool) -> list[int]:
    codes = []
    if method == "POST":  # every POST reads a JSON body naming a model
        codes += [400, 404] + [413] * body_limit
    if any(name in path for name in ("{model}", "{response_id}", "{file_id}",
                                     "{batch_id}")):  # what the path names may be gone
        codes.append(404)
    codes += _BATCH_CODES.get((method, path), [])
    if keys and guarded(path, protect_metrics):
        codes.append(401)
    if path in ENGINE_PATHS:
        codes += [429] * queue_limit + [500, 503]
    if path in ("/health", "/ready"):
        codes.append(503)
    return codes
