"""OpenTelemetry request traces (--otlp-traces-endpoint): one span per request to a
route that puts work on the engine (completions, chat, responses, embeddings), under
vLLM's name and attribute names (vllm/tracing.py SpanAttributes), exported over
OTLP/HTTP (protobuf).

The span is "llm_request", kind SERVER. It starts at the request's arrival (the
moment ArrivalMiddleware stamped it, server/metrics/frontend.py, as the TTFT
histogram counts) and ends once the response is sent, whole or streamed. A W3C
`traceparent` (and `tracestate`) header continues the caller's trace: the span's
parent is the caller's span, read by OpenTelemetry's propagator.

Every request past the API key check gets its span, whatever its answer: one
refused before the engine (a 400, 404, 413, 429) is a span with status ERROR and
its HTTP status, without the engine's figures; one the engine failed, a stream
that ended in an error, or one aborted (the client left, --request-timeout)
is ERROR too. A request without a valid key leaves no span.

The figures (seconds; a request of several prompts or n > 1 choices runs several
engine sequences: each engine figure is the longest of its sequences):
  gen_ai.latency.time_in_queue      arrival in the engine -> first scheduled
  gen_ai.latency.time_in_model_prefill   first scheduled -> first token
  gen_ai.latency.time_in_model_decode    first token -> last token
  gen_ai.latency.time_in_model_inference first scheduled -> last token
  gen_ai.latency.time_to_first_token   arrival at the server -> first token's text final
  gen_ai.latency.e2e                arrival at the server -> response sent
  gen_ai.usage.prompt_tokens / completion_tokens: the response's usage
vLLM's time_in_scheduler, time_in_model_forward and time_in_model_execute are not
measured per request here and are left out.

Off (the default) nothing of OpenTelemetry is imported and no middleware is
installed; the hooks in generation.py and service.py read one context variable.
The packages are the `otel` extra: pip install 'kvserve[otel]'."""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import time

from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.server.metrics.frontend import current_clock

log = logging.getLogger("kvserve.server")

SPAN_NAME = "llm_request"  # vLLM's
# kvserve's own (vLLM has none): the LoRA adapter the request's `model` named.
LORA_NAME = "gen_ai.request.lora_name"
TRACE_HEADERS = (b"traceparent", b"tracestate")


class RequestTrace:
    """What one traced request did, filled in as it runs; the span is made from it
    when the response is done (as vLLM makes its span when the request finishes)."""

    def __init__(self, route: str, parent):
        arrival = getattr(current_clock(), "arrival", None)
        now = time.monotonic()
        self.arrival = now if arrival is None else arrival
        self.start_ns = time.time_ns() - int((now - self.arrival) * 1e9)
        self.route, self.parent = route, parent  # parent: the caller's OTel context
        self.status_code: int | None = None
        self.request_id: str | None = None
        self.model: str | None = None
        self.lora: str | None = None
        self.params = None  # prompt 0's SamplingParams
        self.prompt_tokens = 0
        self.completion: dict[int, int] = {}  # counted choice -> tokens generated
        self.finish: dict[int, str] = {}  # choice -> finish reason
        self.first_token: float | None = None
        self.times: list = []  # the engine's RequestTimes of finished sequences
        self.error: str | None = None
        self.unfinished = False  # a sequence was left running (client gone, a failure)

    def delta(self, d, counted: bool) -> None:
        """A ChoiceDelta about to be sent (generation.py's emit)."""
        if d.num_tokens and self.first_token is None:
            self.first_token = time.monotonic()
        if counted:
            self.completion[d.index] = d.num_tokens
        if d.finish_reason is not None:
            self.finish[d.index] = d.finish_reason

    def failed(self, message: str) -> None:
        if self.error is None:
            self.error = message

    async def outputs(self, gen, n: int):
        """`gen` (an engine request's outputs), passed on as they come; the finished
        sequences' timings and failures kept."""
        unfinished = set(range(n))
        try:
            async with contextlib.aclosing(gen):
                async for out in gen:
                    if out.finished:
                        unfinished.discard(out.index)
                        if out.times is not None:
                            self.times.append(out.times)
                        if out.finish_reason == "error":
                            self.failed(out.error or "the engine failed this request")
                    yield out
        except Exception as exc:  # the engine refused or died (ValueError, EngineDeadError)
            self.failed(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self.unfinished |= bool(unfinished)

    def attributes(self, end: float) -> dict:
        attrs = {"http.route": self.route, "gen_ai.latency.e2e": end - self.arrival}
        if self.status_code is not None:
            attrs["http.response.status_code"] = self.status_code
        for key, value in (("gen_ai.request.id", self.request_id),
                           ("gen_ai.response.model", self.model), (LORA_NAME, self.lora)):
            if value is not None:
                attrs[key] = value
        if self.params is not None:
            p = self.params
            attrs.update({"gen_ai.request.temperature": p.temperature,
                          "gen_ai.request.top_p": p.top_p,
                          "gen_ai.request.max_tokens": p.max_tokens,
                          "gen_ai.request.n": p.n,
                          "gen_ai.usage.completion_tokens": sum(self.completion.values())})
        if self.prompt_tokens:
            attrs["gen_ai.usage.prompt_tokens"] = self.prompt_tokens
        if self.first_token is not None:
            attrs["gen_ai.latency.time_to_first_token"] = self.first_token - self.arrival
        if self.finish:
            attrs["gen_ai.response.finish_reasons"] = [self.finish[i] for i in sorted(self.finish)]
        attrs.update(_engine_latencies(self.times))
        return attrs

    def error_description(self) -> str | None:
        """Why the span's status is ERROR; None: it is OK (left unset)."""
        if self.error is not None:
            return self.error
        if self.status_code == 499:
            return "aborted: the client disconnected"
        if self.status_code is not None and self.status_code >= 400:
            return f"HTTP {self.status_code}"
        if self.unfinished or "abort" in self.finish.values():
            return "aborted"
        return None


def _engine_latencies(times: list) -> dict:
    def longest(values):
        values = [v for v in values if v is not None]
        return max(values) if values else None

    inference = [t.prefill + t.decode for t in times
                 if t.prefill is not None and t.decode is not None]
    found = {"gen_ai.latency.time_in_queue": longest(t.queue for t in times),
             "gen_ai.latency.time_in_model_prefill": longest(t.prefill for t in times),
             "gen_ai.latency.time_in_model_decode": longest(t.decode for t in times),
             "gen_ai.latency.time_in_model_inference": longest(inference)}
    return {k: v for k, v in found.items() if v is not None}


_current: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar(
    "kvserve_request_trace", default=None)


def watch_group(base_id: str, group, opts, gen, emit):
    """run_group's hook (generation.py): the engine stream and the emit of one prompt
    group, observed by the current request's trace; both unchanged when untraced."""
    trace = _current.get()
    if trace is None:
        return gen, emit
    trace.request_id, trace.lora = base_id, opts.lora_name
    if trace.params is None or group.index == 0:
        trace.params = group.params
    trace.prompt_tokens += len(group.prompt_ids)

    async def emitting(d):
        trace.delta(d, group.count_output)
        await emit(d)

    return trace.outputs(gen, group.params.n), emitting


def note(model: str | None = None, request_id: str | None = None, lora: str | None = None,
         prompt_tokens: int = 0) -> None:
    """What a service knows of the current request (the served model; for
    embeddings, which do not run through watch_group, the rest); nothing untraced."""
    trace = _current.get()
    if trace is None:
        return
    trace.model = model if model is not None else trace.model
    trace.request_id = request_id if request_id is not None else trace.request_id
    trace.lora = lora if lora is not None else trace.lora
    trace.prompt_tokens += prompt_tokens


class Tracing:
    """The app's tracer: its own TracerProvider (never the process's global one, so
    several apps in one process, as in the tests, keep their spans apart).
    exporter: a test hook (the SDK's InMemorySpanExporter) in place of OTLP/HTTP."""

    def __init__(self, endpoint: str | None, exporter=None):
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint)
        service = os.environ.get("OTEL_SERVICE_NAME") or "kvserve"
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}))
        # Batched: ending a span on the event loop only queues it; the SDK's own
        # thread exports (OTEL_BSP_* tune it), so a slow or unreachable collector
        # never blocks the loop. Past the queue's 2048 spans new ones are dropped.
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("kvserve.server")
        self.propagator = TraceContextTextMapPropagator()
        self._kind, self._status, self._error = SpanKind.SERVER, Status, StatusCode.ERROR

    def parent_of(self, scope: Scope):
        """The caller's trace context from the request's headers (empty: a new trace)."""
        carrier: dict[str, str] = {}
        for name, value in scope.get("headers", ()):
            if name in TRACE_HEADERS:
                key = name.decode("latin-1")
                text = value.decode("latin-1")
                carrier[key] = f"{carrier[key]},{text}" if key in carrier else text
        return self.propagator.extract(carrier)

    def end(self, trace: RequestTrace) -> None:
        end, end_ns = time.monotonic(), time.time_ns()
        span = self.tracer.start_span(SPAN_NAME, context=trace.parent, kind=self._kind,
                                      start_time=trace.start_ns,
                                      attributes=trace.attributes(end))
        why = trace.error_description()
        if why is not None:
            span.set_status(self._status(self._error, why))
        span.end(end_time=end_ns)

    def force_flush(self) -> bool:
        return self.provider.force_flush()

    def shutdown(self) -> None:
        """Exports what is still queued, then stops the exporter."""
        self.provider.shutdown()


class TracingMiddleware:
    """Pure ASGI (the route must run in this context to find its trace). Installed
    inside the API key check (server/ops.py). paths: the traced routes' POSTs."""

    def __init__(self, app: ASGIApp, tracing: Tracing, paths: frozenset[str]):
        self.app, self.tracing, self.paths = app, tracing, paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, self._flushing(send))
        route = scope.get("path", "").rstrip("/")
        if not (scope["type"] == "http" and scope["method"] == "POST" and route in self.paths):
            return await self.app(scope, receive, send)
        trace = RequestTrace(route, self.tracing.parent_of(scope))

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                trace.status_code = message["status"]
            await send(message)

        token = _current.set(trace)
        try:
            await self.app(scope, receive, sending)
        except BaseException as exc:  # answered by Starlette's last resort (a 500)
            trace.failed(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            _current.reset(token)
            try:
                self.tracing.end(trace)
            except Exception:  # a trace never costs the request its answer
                log.exception("could not record the request's span")

    def _flushing(self, send: Send) -> Send:
        """At the app's shutdown, the spans still queued are exported (off the loop)."""
        async def sending(message) -> None:
            if message["type"].startswith("lifespan.shutdown."):
                await asyncio.to_thread(self.tracing.shutdown)
            await send(message)

        return sending
