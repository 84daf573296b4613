"""--otlp-traces-endpoint (server/tracing.py): one "llm_request" span per request
under vLLM's attribute names, its token counts the response's usage, a caller's
`traceparent` continued, failures and aborts with status ERROR; one real export
over OTLP/HTTP (protobuf) to a receiver started here; nothing of the SDK loaded
when it is off."""
from __future__ import annotations

import ast
import gzip
import http.server
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.engine.config.lora_config import LoRAConfig
from kvserve.engine.platform import faults
from kvserve.server.config import ServerConfig
from kvserve.server.entrypoints.app import build_app
from kvserve.server.entrypoints.cli import build_parser, server_config_from_args
from tests.engine.lora.test_adapter import make_adapter
from tests.support.http import parse_sse
from tests.support.server import free_port, running_server

MODEL = "tiny"
KEY = "trace-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [5, 6, 7, 8]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def served(tiny_model_dir, tiny_engine_factory, tmp_path_factory):
    """(http client, exporter, app): a keyed server with one LoRA adapter ("sql"),
    its spans going to an InMemorySpanExporter."""
    adapter = tmp_path_factory.mktemp("trace-adapter") / "sql"
    make_adapter(tiny_model_dir("llama"), adapter, seed=3, r=8, lora_alpha=16,
                 target_modules=["q_proj", "v_proj"])
    engine = tiny_engine_factory("llama", lora=LoRAConfig(True, (("sql", str(adapter)),),
                                                          max_loras=1, max_rank=8))
    exporter = InMemorySpanExporter()
    app = build_app(AsyncEngine(engine), [MODEL], config=ServerConfig(api_keys=[KEY]),
                    span_exporter=exporter)
    with running_server(app) as url, httpx.Client(base_url=url, timeout=120,
                                                  headers=AUTH) as http:
        yield http, exporter, app


@pytest.fixture
def traced(served):
    http, exporter, app = served
    exporter.clear()

    def spans(count: int = 1, timeout: float = 10.0):
        """The spans ended since the test began, once there are `count` of them (the
        span ends just after the response's last byte is handed over)."""
        deadline = time.monotonic() + timeout
        while True:
            app.state.tracing.force_flush()
            found = exporter.get_finished_spans()
            if len(found) >= count or time.monotonic() > deadline:
                assert len(found) == count, [s.attributes for s in found]
                return list(found)
            time.sleep(0.02)

    return http, spans


def _check_request_span(span, body: dict, response: httpx.Response, model: str):
    a = span.attributes
    assert span.name == "llm_request" and span.kind is SpanKind.SERVER
    assert span.status.status_code is StatusCode.UNSET
    assert a["gen_ai.request.id"] == response.headers["x-kvserve-request-id"]
    assert a["gen_ai.response.model"] == model == body["model"]
    assert a["gen_ai.usage.prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == body["usage"]["completion_tokens"]
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.n"] == 1
    assert a["gen_ai.request.temperature"] == 0.0 and a["gen_ai.request.top_p"] == 1.0
    assert a["gen_ai.latency.time_in_queue"] >= 0
    assert a["gen_ai.latency.time_in_model_prefill"] >= 0
    assert a["gen_ai.latency.time_in_model_decode"] >= 0
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert a["gen_ai.latency.e2e"] * 1e9 == pytest.approx(span.end_time - span.start_time,
                                                          abs=5e6)
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["http.response.status_code"] == 200
    assert span.parent is None  # no traceparent: a trace of its own


def test_a_completion_is_one_span_with_vllms_attributes(traced):
    http, spans = traced
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 6,
                                           "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    [span] = spans()
    _check_request_span(span, r.json(), r, MODEL)
    assert span.attributes["http.route"] == "/v1/completions"
    assert span.attributes["gen_ai.usage.prompt_tokens"] == len(PROMPT)
    assert "gen_ai.request.lora_name" not in span.attributes


def test_a_chat_on_a_lora_adapter_names_it(traced):
    http, spans = traced
    r = http.post("/v1/chat/completions", json={
        "model": "sql", "messages": [{"role": "user", "content": "The capital of"}],
        "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    [span] = spans()
    _check_request_span(span, r.json(), r, "sql")
    assert span.attributes["gen_ai.request.lora_name"] == "sql"  # kvserve's own name
    assert span.attributes["http.route"] == "/v1/chat/completions"


def test_a_stream_of_two_prompts_and_n_2_counts_what_its_usage_says(traced):
    http, spans = traced
    r = http.post("/v1/completions", json={
        "model": MODEL, "prompt": [PROMPT, [9, 10]], "max_tokens": 5, "n": 2,
        "temperature": 0.8, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    usage = parse_sse(r.content)[-1]["usage"]
    [span] = spans()
    a = span.attributes
    assert (a["gen_ai.usage.prompt_tokens"], a["gen_ai.usage.completion_tokens"]) == (
        usage["prompt_tokens"], usage["completion_tokens"]) == (6, 20)
    assert a["gen_ai.request.n"] == 2 and a["gen_ai.request.temperature"] == 0.8
    assert a["gen_ai.response.finish_reasons"] == ("length",) * 4
    assert span.status.status_code is StatusCode.UNSET


def test_a_response_is_traced_with_its_usage(traced):
    http, spans = traced
    r = http.post("/v1/responses", json={"model": MODEL, "input": "The capital of",
                                         "max_output_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    [span] = spans()
    a = span.attributes
    assert (a["gen_ai.usage.prompt_tokens"], a["gen_ai.usage.completion_tokens"]) == (
        usage["input_tokens"], usage["output_tokens"])
    assert a["http.route"] == "/v1/responses" and a["gen_ai.response.model"] == MODEL
    assert a["gen_ai.request.id"] == r.headers["x-kvserve-request-id"]


def test_a_traceparent_header_continues_the_callers_trace(traced):
    http, spans = traced
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "tracestate": "k=v"}
    r = http.post("/v1/completions", headers=headers, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    [span] = spans()
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert format(span.parent.span_id, "016x") == PARENT_ID
    assert span.parent.is_remote and span.context.span_id != span.parent.span_id
    assert span.context.trace_state.get("k") == "v"


def test_a_bad_request_is_a_span_with_status_error(traced):
    """Refused before the engine (400): traced, ERROR, its HTTP status, no engine
    figures. Without a valid key (401): no span at all."""
    http, spans = traced
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "n": 0})
    assert r.status_code == 400
    r = http.post("/v1/completions", json={"model": "nope", "prompt": PROMPT})
    assert r.status_code == 404
    bad, missing = spans(2)
    for span, code in ((bad, 400), (missing, 404)):
        assert span.status.status_code is StatusCode.ERROR
        assert span.status.description == f"HTTP {code}"
        assert span.attributes["http.response.status_code"] == code
        assert "gen_ai.latency.time_in_queue" not in span.attributes
        assert "gen_ai.usage.prompt_tokens" not in span.attributes
    r = http.post("/v1/completions", headers={"Authorization": "Bearer wrong"},
                  json={"model": MODEL, "prompt": PROMPT})
    assert r.status_code == 401
    time.sleep(0.3)
    assert len(spans(2)) == 2  # the two above, none more


def test_a_client_that_leaves_mid_stream_is_an_aborted_span(traced):
    http, spans = traced
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        next(line for line in r.iter_lines() if line.startswith("data: {"))
    [span] = spans(timeout=30)
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "aborted"
    assert span.attributes["http.response.status_code"] == 200
    assert 0 < span.attributes["gen_ai.usage.completion_tokens"] < 400


def test_a_client_that_leaves_before_a_whole_body_is_an_aborted_span(traced):
    http, spans = traced
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", timeout=0.5, json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True})
    [span] = spans(timeout=30)
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "aborted: the client disconnected"
    assert span.attributes["http.response.status_code"] == 499


def test_a_request_the_engine_fails_is_a_span_with_its_error(traced):
    """A 500, and an error event inside a 200 stream: both ERROR, with the engine's
    message."""
    http, spans = traced
    body = {"model": MODEL, "prompt": [77, 78, 79], "max_tokens": 4, "ignore_eos": True}
    with faults.armed(faults.prompt_is([77, 78, 79]), "sample", message="sampling bug"):
        assert http.post("/v1/completions", json=body).status_code == 500
        r = http.post("/v1/completions", json={**body, "stream": True})
        assert r.status_code == 200 and "error" in parse_sse(r.content)[-1]
    whole, streamed = sorted(spans(2), key=lambda s: s.attributes["http.response.status_code"],
                             reverse=True)
    for span, code in ((whole, 500), (streamed, 200)):
        assert span.status.status_code is StatusCode.ERROR
        assert "sampling bug" in span.status.description
        assert span.attributes["http.response.status_code"] == code


def test_an_embedding_request_is_traced(traced):
    http, spans = traced
    r = http.post("/v1/embeddings", json={"model": MODEL, "input": [PROMPT, [9, 10]]})
    assert r.status_code == 200, r.text
    [span] = spans()
    a = span.attributes
    assert a["gen_ai.usage.prompt_tokens"] == r.json()["usage"]["prompt_tokens"] == 6
    assert a["gen_ai.response.model"] == MODEL and a["http.route"] == "/v1/embeddings"
    assert span.status.status_code is StatusCode.UNSET


class _Receiver(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP collector of one route: POST /v1/traces, protobuf."""
    bodies: list[tuple[str, str, bytes]] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceResponse)

        data = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            data = gzip.decompress(data)
        self.bodies.append((self.path, self.headers.get("Content-Type"), data))
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


def test_one_export_over_otlp_http(tiny_engine_factory, monkeypatch):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest)

    receiver = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms: export at once
    endpoint = f"http://127.0.0.1:{receiver.server_address[1]}/v1/traces"
    args = build_parser().parse_args(["serve", "--otlp-traces-endpoint", endpoint])
    app = build_app(AsyncEngine(tiny_engine_factory("llama")), [MODEL],
                    config=server_config_from_args(args))
    try:
        with running_server(app) as url:
            r = httpx.post(f"{url}/v1/completions", timeout=60, headers={
                "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}, json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200, r.text
            deadline = time.monotonic() + 20
            while not _Receiver.bodies and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        receiver.shutdown()
    [(path, content_type, data)] = _Receiver.bodies
    assert (path, content_type) == ("/v1/traces", "application/x-protobuf")
    request = ExportTraceServiceRequest.FromString(data)
    [resource_spans] = request.resource_spans
    service = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
    assert service["service.name"] == "kvserve"
    [span] = [s for scope in resource_spans.scope_spans for s in scope.spans]
    attrs = {kv.key: kv.value for kv in span.attributes}
    assert span.name == "llm_request" and span.kind == span.SPAN_KIND_SERVER
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    assert attrs["gen_ai.usage.completion_tokens"].int_value == 3
    assert attrs["gen_ai.usage.prompt_tokens"].int_value == len(PROMPT)
    assert attrs["gen_ai.request.id"].string_value == r.headers["x-kvserve-request-id"]
    assert attrs["gen_ai.latency.time_in_queue"].double_value >= 0


def test_the_flag_is_a_url_and_needs_the_packages(monkeypatch):
    assert server_config_from_args(build_parser().parse_args(["serve"])) \
        .otlp_traces_endpoint is None
    with pytest.raises(ValueError, match="http"):
        ServerConfig(otlp_traces_endpoint="localhost:4318")
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None
                        if name.startswith("opentelemetry.exporter") else found(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'kvserve\[otel\]'"):
        ServerConfig(otlp_traces_endpoint="http://localhost:4318/v1/traces")


def test_off_it_loads_nothing_of_the_sdk():
    """server/tracing.py imports OpenTelemetry only where a tracer is made; an app
    without --otlp-traces-endpoint makes none (FastAPI itself loads the API)."""
    tree = ast.parse((ROOT / "server" / "tracing.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not any("opentelemetry" in ast.unparse(n) for n in top)
    code = ("import sys, kvserve.server.entrypoints.app, kvserve.server.tracing\n"
            "print([m for m in sys.modules if m.startswith(('opentelemetry.sdk', "
            "'opentelemetry.exporter'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_an_app_without_the_flag_has_no_tracing(tiny_engine_factory):
    app = build_app(AsyncEngine(tiny_engine_factory("llama")), [MODEL])
    assert not hasattr(app.state, "tracing")
    assert "TracingMiddleware" not in [m.cls.__name__ for m in app.user_middleware]
