"""--api-key: /v1 needs `Authorization: Bearer <key>`; probes and tokenizers stay open."""
from __future__ import annotations

import httpx
import openai
import pytest

from engine.client.async_engine import AsyncEngine
from server.app import build_app
from server.config import ServerConfig
from tests.support.http import assert_error
from tests.support.server import running_server

MODEL = "tiny"
KEYS = ["key-one", "key-two"]
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def url(tiny_engine_factory):
    app = build_app(AsyncEngine(tiny_engine_factory("llama")), [MODEL],
                    config=ServerConfig(api_keys=KEYS))
    with running_server(app) as base:
        yield base


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=60) as c:
        yield c


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("method,path,body", [
    ("GET", "/v1/models", None), ("POST", "/v1/completions", COMPLETION),
    ("POST", "/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                      "messages": [{"role": "user", "content": "hi"}]}),
    ("GET", "/v1/no-such-route", None)])
def test_v1_routes_need_a_key(http, method, path, body):
    r = http.request(method, path, json=body)
    err = assert_error(r, 401, param=None, code="missing_api_key")
    assert err["type"] == "authentication_error"
    assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("header", ["Bearer nope", "Bearer key-one-and-more", "Bearer key-on",
                                    "Basic key-one", "key-one", "Bearer", ""])
def test_wrong_or_malformed_key_is_401(http, header):
    r = http.get("/v1/models", headers={"Authorization": header})
    err = assert_error(r, 401, param=None)
    assert err["type"] == "authentication_error"
    assert err["code"] in ("invalid_api_key", "missing_api_key")


@pytest.mark.parametrize("key", KEYS)
def test_every_key_works(http, key):
    assert http.get("/v1/models", headers=_auth(key)).status_code == 200
    r = http.post("/v1/completions", json=COMPLETION, headers=_auth(key))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_bearer_scheme_is_case_insensitive(http):
    r = http.get("/v1/models", headers={"Authorization": "bearer key-two"})
    assert r.status_code == 200


@pytest.mark.parametrize("method,path,body", [
    ("GET", "/health", None), ("GET", "/version", None), ("GET", "/metrics", None),
    ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1, 2]})])
def test_probes_and_tokenizers_stay_open(http, method, path, body):
    assert http.request(method, path, json=body).status_code == 200


def test_openai_sdk_with_and_without_the_key(url):
    with openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    with openai.OpenAI(base_url=url + "/v1", api_key=KEYS[1], max_retries=0) as c:
        assert [m.id for m in c.models.list().data] == [MODEL]
