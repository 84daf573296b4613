"""API keys (`--api-key`, `--admin-api-key`): every /v1 route, /tokenize and
/detokenize need `Authorization: Bearer <key>` (or `x-api-key: <key>`, as Anthropic's
clients send it) when any key is set.

/health, /ready, /version and /metrics stay open for probes and scrapers, unless
`--protect-metrics` guards them too. /tokenize and /detokenize are behind the key
(as in recent vLLM): they run the tokenizer, which costs the server CPU time.

Each request that passed the check runs with its Principal (current_principal()):
`owner`, the SHA-256 of its key (stored responses record it, and another key's
requests find them absent; the engine page shows a key the ids of its own
requests), and whether it sees every request's engine id on /v1/engine/stream
(admin keys only). Without any key there is one tenant, the anonymous one, and it
sees them all. No key is ever logged or stored."""
from __future__ import annotations

import contextlib
import hashlib
import hmac
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.server.errors import error_response


def _digest(key: str) -> bytes:
    # Comparing fixed-size digests keeps the time independent of the key's length too.
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class Principal:
    """Who sent a request: its key's owner tag and what it may see."""
    owner: str  # the SHA-256 of its key (hex), or "anonymous" when no key is set
    sees_request_ids: bool  # the engine stream shows it request ids


ANONYMOUS = Principal("anonymous", sees_request_ids=True)
# Set by ApiKeyMiddleware for the whole of a request (its response streamed
# included): the tasks a request starts copy it. A context variable, like the
# request's latency clock (server/metrics/frontend.py), so that what the request
# runs need not hand it down.
_CURRENT: ContextVar[Principal] = ContextVar("kvserve_principal", default=ANONYMOUS)


# True while this process itself makes a request through the app on someone's behalf
# (a batch job's line, as the key that created the job): never set by a client.
_ON_BEHALF: ContextVar[bool] = ContextVar("kvserve_on_behalf", default=False)


def current_principal() -> Principal:
    """Who sent the request being served; ANONYMOUS without keys."""
    return _CURRENT.get()


@contextlib.contextmanager
def acting_for(principal: Principal) -> Iterator[None]:
    """Requests made through the app inside this block run as `principal`, without a
    key (the job's owner sent theirs when creating it; no key is ever stored)."""
    tokens = _CURRENT.set(principal), _ON_BEHALF.set(True)
    try:
        yield
    finally:
        _ON_BEHALF.reset(tokens[1])
        _CURRENT.reset(tokens[0])


class ApiKeyMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware): it must not buffer or re-task streaming
    responses, and it answers 401 before the body is read. `admin_keys` are keys
    too, whose holders also see the engine's request ids."""

    def __init__(self, app: ASGIApp, keys: Iterable[str], admin_keys: Iterable[str] = (),
                 protect_metrics: bool = False):
        self.app = app
        self._digests = [(_digest(k), False) for k in keys]
        self._digests += [(_digest(k), True) for k in admin_keys]
        if not self._digests:
            raise ValueError("ApiKeyMiddleware needs at least one key")
        self.protect_metrics = protect_metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] == "OPTIONS"  # CORS preflight
                or not guarded(scope["path"], self.protect_metrics)
                or _ON_BEHALF.get()):  # as the principal acting_for set
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        found = self._principal(headers.get("authorization"), headers.get("x-api-key"))
        if isinstance(found, Principal):
            token = _CURRENT.set(found)
            try:
                return await self.app(scope, receive, send)
            finally:
                _CURRENT.reset(token)
        message, code = found
        response = error_response(401, message, code=code,
                                  headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _principal(self, header: str | None, api_key: str | None = None
                   ) -> Principal | tuple[str, str]:
        """The Principal of the request's key if it is valid, else (message, code).
        The key comes as `Authorization: Bearer <key>` (OpenAI's clients) or as
        `x-api-key: <key>` (Anthropic's): one key, the same rules either way; both
        headers naming two different keys is no key at all."""
        scheme, _, token = (header or "").strip().partition(" ")
        bearer = token.strip() if scheme.lower() == "bearer" else ""
        keys = {k for k in (bearer, (api_key or "").strip()) if k}
        if not keys:
            return ("Missing API key: send it as `Authorization: Bearer <key>` (or "
                    "`x-api-key: <key>`).", "missing_api_key")
        if len(keys) > 1:
            return ("Authorization and x-api-key name two different keys: send one.",
                    "invalid_api_key")
        given = _digest(keys.pop())
        # Compare against every key, without stopping at a match, in constant time.
        ok = admin = False
        for digest, is_admin in self._digests:
            match = hmac.compare_digest(given, digest)
            ok |= match
            admin |= match and is_admin
        if not ok:
            return ("Incorrect API key provided.", "invalid_api_key")
        return Principal(given.hex(), sees_request_ids=admin)


PROBE_PATHS = frozenset({"/health", "/ready", "/version", "/metrics"})
TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize"})


def guarded(path: str, protect_metrics: bool = False) -> bool:
    """Whether a request to `path` needs a key (when keys are configured)."""
    if protect_metrics and path.rstrip("/") in PROBE_PATHS:
        return True
    return path == "/v1" or path.startswith("/v1/") or path.rstrip("/") in TOKENIZER_PATHS
