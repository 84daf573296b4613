"""The operational side of the app: API keys (/v1 needs `Authorization: Bearer
<key>` when any are given), admission (at most `max_waiting_requests` waiting to be
scheduled, or `max_waiting_tokens` prompt tokens, 0: no limit; nothing while
draining), the request body's size limit, /health, /version, /metrics,
/tokenize and /detokenize."""
from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from engine.engine_client import EngineClient
from server.admission import Admission, AdmissionMiddleware
from server.auth import ApiKeyMiddleware
from server.limits import BodyLimitMiddleware
from server.metrics import ServerMetrics
from server.metrics_frontend import ArrivalMiddleware
from server.tokenize_api import tokenize_router


def install_ops(app: FastAPI, engine: EngineClient, model_names: list[str], version: str, *,
                api_keys: Sequence[str] = (), max_waiting_requests: int = 0,
                max_waiting_tokens: int = 0, max_body_bytes: int = 0) -> Admission:
    admission = Admission(engine, max_waiting_requests, max_waiting_tokens)
    app.state.admission = admission  # the shutdown drain finds it here
    app.add_middleware(AdmissionMiddleware, admission=admission)
    if api_keys:  # added after admission, so outside it: no key, never admitted
        app.add_middleware(ApiKeyMiddleware, keys=list(api_keys))
    # Outside auth and admission: an oversized body is refused before anything reads it.
    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes)
    server_metrics = ServerMetrics(engine, model_names[0] if model_names else "")
    # Outermost: a request's latency counts from its arrival, auth and admission included.
    app.add_middleware(ArrivalMiddleware, hist=server_metrics.frontend)
    app.include_router(tokenize_router(engine, model_names))

    @app.get("/health")
    async def health():
        if admission.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if engine.is_alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine is not running"}, status_code=503)

    @app.get("/version")
    async def version_info():
        return {"version": version}

    @app.get("/metrics")
    async def metrics():
        return server_metrics.response()

    return admission
