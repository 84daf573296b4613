"""Who may start generating: nobody while the server drains for shutdown (503), and
nobody once `--max-waiting-requests` requests, or `--max-waiting-tokens` prompt
tokens, wait to be scheduled (429). Refused
requests get `Retry-After` and cost the engine nothing.

It also counts generation requests in flight, so a drain knows when it is done."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.engine.client.engine_client import EngineClient
from kvserve.server.background import in_background
from kvserve.server.errors import error_response

# Routes that generate (they may stream), and all that put work on the engine.
# Everything else (models, tokenize, health, metrics) stays cheap and is served even
# while draining or full.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses",
                              "/v1/messages"})
ENGINE_PATHS = GENERATION_PATHS | {"/v1/embeddings"}
RETRY_AFTER_S = 1


class Admission:
    def __init__(self, engine: EngineClient, max_waiting_requests: int = 0,
                 max_waiting_tokens: int = 0):
        if max_waiting_requests < 0 or max_waiting_tokens < 0:
            raise ValueError("admission limits must be >= 0 (0: no limit)")
        self.engine = engine
        self.max_waiting = max_waiting_requests
        self.max_waiting_tokens = max_waiting_tokens
        self.draining = False
        self.in_flight = 0  # generation requests admitted whose response is not done

    def refusal(self) -> JSONResponse | None:
        """The response that turns a new generation request away, or None."""
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        if self.draining:
            return error_response(503, "The server is shutting down and accepts no new "
                                  "requests.", headers=headers)
        if self.max_waiting and self.engine.queue_depth >= self.max_waiting:
            return error_response(429, f"Too many requests waiting to be scheduled "
                                  f"(limit {self.max_waiting}); retry later.",
                                  headers=headers)
        if (self.max_waiting_tokens
                and self.engine.waiting_prompt_tokens >= self.max_waiting_tokens):
            return error_response(429, f"Too many prompt tokens waiting to be scheduled "
                                  f"(limit {self.max_waiting_tokens}, "
                                  "--max-waiting-tokens); retry later.", headers=headers)
        return None

    async def wait_idle(self, timeout: float, give_up: Callable[[], bool] = lambda: False
                        ) -> bool:
        """Waits until no generation request is in flight; False on timeout or when
        give_up() turns true first."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline and not give_up():
            await asyncio.sleep(0.05)
        return self.in_flight == 0


class AdmissionMiddleware:
    """Pure ASGI, so it sees a streaming response through to its last byte: the
    request stays in flight until then."""

    def __init__(self, app: ASGIApp, admission: Admission):
        self.app = app
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not _is_generation(scope) or in_background():  # a batch job's line
            return await self.app(scope, receive, send)
        adm = self.admission
        refusal = adm.refusal()
        if refusal is not None:
            return await refusal(scope, receive, send)
        adm.in_flight += 1
        try:
            with adm.engine.reserve():
                await self.app(scope, receive, send)
        finally:
            adm.in_flight -= 1


def _is_generation(scope: Scope) -> bool:
    return (scope["type"] == "http" and scope["method"] == "POST"
            and scope["path"].rstrip("/") in ENGINE_PATHS)
