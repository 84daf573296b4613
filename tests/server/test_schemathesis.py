"""The OpenAPI schema at /openapi.json is FastAPI's, built from the real request models
(server/protocol.py) with the error responses the server really gives (server/ops.py),
and Schemathesis, generating requests from it against a live server, finds no 5xx, no
hang, no undocumented status or content type and no error outside OpenAI's shape.

Generation is kept short by the server's limits (a 64-token context, n <= 2, at
most 4 prompts a request), so the 1,200 or so requests take about a minute on 2 cores."""
from __future__ import annotations

import collections
import time

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode, checks

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.server.config import ServerConfig
from kvserve.server.entrypoints.app import build_app
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.support.http import wait_idle
from tests.support.server import running_server

MODEL = "tiny"
TIMEOUT_S = 20.0  # a hang, for a request the tiny model answers in well under a second
MIN_REQUESTS = 1000
# Examples per operation and mode; operations without inputs run once.
EXAMPLES = {("POST /v1/completions", GenerationMode.POSITIVE): 400,
            ("POST /v1/completions", GenerationMode.NEGATIVE): 200,
            ("POST /v1/chat/completions", GenerationMode.POSITIVE): 300,
            ("POST /v1/chat/completions", GenerationMode.NEGATIVE): 200}
OTHER_EXAMPLES = 60
# "Schema-valid request rejected" is left out: the schema cannot say which model names
# exist, how long the context is or which token ids are in the vocabulary. "Schema-
# violating request accepted" too: pydantic's lax mode takes true for 1 and "1" for 1.
CHECKS = [checks.not_a_server_error, checks.status_code_conformance,
          checks.content_type_conformance, checks.response_schema_conformance]


class Served:
    def __init__(self, url: str, engine, aengine):
        self.url, self.engine, self.aengine = url, engine, aengine


@pytest.fixture(scope="module")
def served(tiny_engine_factory):
    engine = tiny_engine_factory("llama", max_model_len=64)
    aengine = AsyncEngine(engine)
    app = build_app(aengine, [MODEL],
                    config=ServerConfig(max_prompts_per_request=4, max_n=2))
    with running_server(app) as url:
        yield Served(url, engine, aengine)


def _plain(schema):
    """JSON schema with null defaults dropped (FastAPI leaves them out) and numbers as
    floats (FastAPI writes integer bounds as floats)."""
    if isinstance(schema, dict):
        return {k: _plain(v) for k, v in schema.items() if not (k == "default" and v is None)}
    if isinstance(schema, list):
        return [_plain(v) for v in schema]
    if isinstance(schema, int) and not isinstance(schema, bool):
        return float(schema)
    return schema


@pytest.mark.parametrize("path,model", [("/v1/completions", CompletionRequest),
                                        ("/v1/chat/completions", ChatCompletionRequest)])
def test_openapi_describes_the_real_request_models(served, path, model):
    schema = httpx.get(served.url + "/openapi.json", timeout=30).json()
    op = schema["paths"][path]["post"]
    name = model.__name__
    assert op["requestBody"] == {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{name}"}}}}
    expected = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components = schema["components"]["schemas"]
    for sub, sub_schema in expected.pop("$defs", {}).items():
        assert _plain(components[sub]) == _plain(sub_schema), sub
    assert _plain(components[name]) == _plain(expected)
    # Errors as the server sends them: 400 (not FastAPI's 422) in OpenAI's shape.
    assert "422" not in op["responses"] and "HTTPValidationError" not in components
    for code in ("400", "404", "413", "500", "503"):
        assert op["responses"][code]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}, code
    assert "401" not in op["responses"] and "429" not in op["responses"]  # not configured
    assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert components["ErrorResponse"]["properties"]["error"]["required"] == [
        "message", "type", "param", "code"]


def _has_body(raw: dict, label: str) -> bool:
    method, path = label.split(" ", 1)
    return "requestBody" in raw["paths"][path][method.lower()]


def _run(served: Served, op, mode: GenerationMode, examples: int, stats: dict) -> None:
    session = requests.Session()

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case):
        start = time.monotonic()
        try:
            response = case.call(base_url=served.url, session=session, timeout=TIMEOUT_S)
        except requests.RequestException as exc:  # a timeout is a hang
            stats["failures"].append(f"{op.label} {mode.value}: {exc!r}\n{case.body!r:.500}")
            return
        stats["latency"] = max(stats["latency"], time.monotonic() - start)
        stats["status"][response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except BaseExceptionGroup as group:  # schemathesis's FailureGroup
            stats["failures"].append(f"{op.label} {mode.value}: {group}")

    run()


@pytest.mark.slow
def test_schemathesis_finds_no_5xx_and_no_hang(served):
    schema = schemathesis.openapi.from_url(served.url + "/openapi.json")
    raw = httpx.get(served.url + "/openapi.json", timeout=30).json()
    stats = {"status": collections.Counter(), "failures": [], "latency": 0.0}
    start = time.monotonic()
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        for result in schema.get_all_operations():
            op = result.ok()
            if mode is GenerationMode.NEGATIVE and not _has_body(raw, op.label):
                continue  # nothing to get wrong
            _run(served, op, mode, EXAMPLES.get((op.label, mode), OTHER_EXAMPLES), stats)
    total = sum(stats["status"].values())
    print(f"schemathesis: {total} requests in {time.monotonic() - start:.0f} s, "
          f"statuses {dict(sorted(stats['status'].items()))}, "
          f"slowest {stats['latency'] * 1000:.0f} ms, failures {len(stats['failures'])}")
    assert not stats["failures"], "\n\n".join(stats["failures"][:10])
    assert total >= MIN_REQUESTS
    assert not any(code >= 500 for code in stats["status"])
    # Many requests were generated and served, not all refused.
    assert stats["status"][200] > 100 and stats["status"][400] > 100
    assert wait_idle(served.engine)
    ok = httpx.post(served.url + "/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "hello", "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    assert served.aengine.queue_depth == 0
