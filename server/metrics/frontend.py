"""Latency as the client sees it: time to first token, inter-token latency and
end-to-end latency, from the request's arrival at the server to the moments its
tokens are sent.

ArrivalMiddleware stamps a generation request's arrival before anything else runs
(auth, admission, body parsing, tokenizing all count) and puts a RequestClock in a
context variable, so the code that sends tokens (ResponseView.sse, or collect() for
a whole-body answer) finds it without it being passed through every service.

Per-token accounting: a chunk that carries k tokens after a gap g since the
previous chunk of the same choice counts as k inter-token latencies of g / k. A
choice's first chunk gives its TTFT, and its other k - 1 tokens latencies of 0. So
for every choice the ITL histogram gets (tokens - 1) samples summing to the time
from its first token to its last, whether it was streamed token by token or in
bursts (the detokenizer holds back incomplete characters and stop-string prefixes).
A sequence of n > 1 is a choice of its own, as in vLLM (one engine request each)."""
from __future__ import annotations

import contextvars
import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.server.metrics.buckets import ITL_SECONDS, REQUEST_SECONDS, TTFT_SECONDS
from kvserve.server.metrics.requests import histogram


class FrontendHistograms:
    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.ttft = histogram(registry, "time_to_first_token_seconds",
                              "Time from arrival at the server to the first token sent.",
                              TTFT_SECONDS, model_name)
        self.itl = histogram(registry, "inter_token_latency_seconds",
                             "Time between consecutive tokens sent (per token).",
                             ITL_SECONDS, model_name)
        self.e2e = histogram(registry, "e2e_request_latency_seconds",
                             "Time from arrival at the server to the last token sent.",
                             REQUEST_SECONDS, model_name)


class RequestClock:
    """One HTTP request: when each of its choices' tokens went out."""

    def __init__(self, hist: FrontendHistograms, arrival: float):
        self.hist = hist
        self.arrival = arrival
        self._sent: dict[int, tuple[int, float]] = {}  # choice -> (tokens, last sent)

    def sent(self, deltas: Iterable, now: float | None = None) -> None:
        """`deltas` (ChoiceDeltas) have just been sent to the client."""
        now = time.monotonic() if now is None else now
        for d in deltas:
            self._record(d.index, d.num_tokens, d.finish_reason is not None, now)

    def _record(self, choice: int, tokens: int, finished: bool, now: float) -> None:
        before, last = self._sent.get(choice, (0, None))
        new = tokens - before
        if new > 0:
            if last is None:
                self.hist.ttft.observe(now - self.arrival)
                gaps = [0.0] * (new - 1)
            else:
                gaps = [(now - last) / new] * new
            for gap in gaps:
                self.hist.itl.observe(gap)
            self._sent[choice] = (tokens, now)
        if finished:
            self.hist.e2e.observe(now - self.arrival)


class _NoClock:
    """Outside a timed request (a direct call in a test): records nothing."""

    def sent(self, deltas: Iterable, now: float | None = None) -> None:
        pass


_clock: contextvars.ContextVar[RequestClock | None] = contextvars.ContextVar(
    "kvserve_request_clock", default=None)
_NO_CLOCK = _NoClock()


def current_clock() -> RequestClock | _NoClock:
    return _clock.get() or _NO_CLOCK


class ArrivalMiddleware:
    """Pure ASGI (a BaseHTTPMiddleware would run the route in another context).
    paths: the generation routes, whose POSTs are timed."""

    def __init__(self, app: ASGIApp, hist: FrontendHistograms, paths: frozenset[str]):
        self.app = app
        self.hist = hist
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not (scope["type"] == "http" and scope["method"] == "POST"
                and scope["path"].rstrip("/") in self.paths):
            return await self.app(scope, receive, send)
        token = _clock.set(RequestClock(self.hist, time.monotonic()))
        try:
            await self.app(scope, receive, send)
        finally:
            _clock.reset(token)

