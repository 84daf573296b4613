"""API keys (`--api-key`): every /v1 route needs `Authorization: Bearer <key>`.

As in vLLM, only /v1 is guarded: /health, /version, /metrics, /tokenize and
/detokenize stay open for probes and scrapers, unless `--protect-metrics` guards
/health, /version and /metrics too. No key is ever logged."""
from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import error_response


def _digest(key: str) -> bytes:
    # Comparing fixed-size digests keeps the time independent of the key's length too.
    return hashlib.sha256(key.encode()).digest()


class ApiKeyMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware): it must not buffer or re-task streaming
    responses, and it answers 401 before the body is read."""

    def __init__(self, app: ASGIApp, keys: Iterable[str], protect_metrics: bool = False):
        self.app = app
        self._digests = [_digest(k) for k in keys]
        if not self._digests:
            raise ValueError("ApiKeyMiddleware needs at least one key")
        self.protect_metrics = protect_metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] == "OPTIONS"  # CORS preflight
                or not guarded(scope["path"], self.protect_metrics)):
            return await self.app(scope, receive, send)
        problem = self._problem(Headers(scope=scope).get("authorization"))
        if problem is None:
            return await self.app(scope, receive, send)
        message, code = problem
        response = error_response(401, message, code=code,
                                  headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _problem(self, header: str | None) -> tuple[str, str] | None:
        """None when the header carries a valid key, else (message, code)."""
        scheme, _, token = (header or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return ("Missing API key: send it as `Authorization: Bearer <key>`.",
                    "missing_api_key")
        given = _digest(token.strip())
        # Compare against every key, without stopping at a match, in constant time.
        ok = False
        for digest in self._digests:
            ok |= hmac.compare_digest(given, digest)
        return None if ok else ("Incorrect API key provided.", "invalid_api_key")


PROBE_PATHS = frozenset({"/health", "/version", "/metrics"})


def guarded(path: str, protect_metrics: bool = False) -> bool:
    """Whether a request to `path` needs a key (when keys are configured)."""
    if protect_metrics and path.rstrip("/") in PROBE_PATHS:
        return True
    return path == "/v1" or path.startswith("/v1/")
