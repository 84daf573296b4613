"""--protect-metrics: with API keys, /health, /ready, /version and /metrics need the key too
(/tokenize and /detokenize need it with or without the flag). Without a key the
flag refuses to start rather than protect nothing."""
from __future__ import annotations

import httpx
import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.server.config import ServerConfig
from kvserve.server.entrypoints import cli
from kvserve.server.entrypoints.app import build_app
from tests.support.http import assert_error
from tests.support.server import running_server

MODEL = "tiny"
KEY = "probe-key"
PROBES = ["/health", "/ready", "/version", "/metrics"]


@pytest.fixture(scope="module")
def http(tiny_engine_factory):
    app = build_app(AsyncEngine(tiny_engine_factory("llama")), [MODEL],
                    config=ServerConfig(api_keys=[KEY], protect_metrics=True))
    with running_server(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        yield c


@pytest.mark.parametrize("path", PROBES + ["/v1/models"])
@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic probe-key"])
def test_probes_need_the_key(http, path, header):
    r = http.get(path, headers={"Authorization": header} if header else {})
    err = assert_error(r, 401)
    assert err["type"] == "authentication_error"
    assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("path", PROBES)
def test_probes_answer_with_the_key(http, path):
    r = http.get(path, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    if path == "/metrics":
        assert "kvserve:num_requests_running" in r.text


def test_trailing_slash_is_guarded_too(http):
    assert http.get("/health/").status_code == 401


def test_tokenizers_need_the_key_too(http):
    assert http.post("/tokenize", json={"prompt": "hi"}).status_code == 401
    key = {"Authorization": f"Bearer {KEY}"}
    assert http.post("/detokenize", json={"tokens": [1, 2]}, headers=key).status_code == 200


def test_openapi_marks_the_probes_as_secured(http):
    schema = http.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"] == {
        "apiKey": {"type": "http", "scheme": "bearer"}}
    for path in PROBES + ["/v1/models"]:
        op = schema["paths"][path]["get"]
        assert op["security"] == [{"apiKey": []}] and "401" in op["responses"], path
    assert schema["paths"]["/tokenize"]["post"]["security"] == [{"apiKey": []}]


def test_without_the_flag_probes_stay_open(tiny_engine_factory):
    app = build_app(AsyncEngine(tiny_engine_factory("llama")), [MODEL],
                    config=ServerConfig(api_keys=[KEY]))
    with running_server(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        for path in PROBES:
            assert c.get(path).status_code == 200, path
        assert c.get("/v1/models").status_code == 401
        assert "security" not in c.get("/openapi.json").json()["paths"]["/health"]["get"]


def test_the_flag_without_a_key_refuses_to_start(monkeypatch, tmp_path):
    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    args = cli.build_parser().parse_args(["serve", "--model", str(tmp_path),
                                          "--protect-metrics", "true"])
    with pytest.raises(SystemExit, match="--protect-metrics needs --api-key"):
        cli.serve(args)


def test_the_flag_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVSERVE_PROTECT_METRICS", "1")
    assert cli.build_parser().parse_args(["serve"]).protect_metrics is True
    monkeypatch.delenv("KVSERVE_PROTECT_METRICS")
    assert cli.build_parser().parse_args(["serve"]).protect_metrics is False
