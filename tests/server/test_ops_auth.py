"""--api-key: /v1, /tokenize and /detokenize need `Authorization: Bearer <key>`;
probes stay open. Two keys are two tenants: each sees only its own stored
responses; the engine stream shows request ids to the admin key only."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.server.config import ServerConfig
from kvserve.server.entrypoints.app import build_app
from tests.support.http import assert_error
from tests.support.server import running_server

MODEL = "tiny"
KEYS = ["key-one", "key-two"]
ADMIN = "admin-key"
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def url(tiny_engine_factory):
    app = build_app(AsyncEngine(tiny_engine_factory("llama")), [MODEL],
                    config=ServerConfig(api_keys=KEYS, admin_api_keys=[ADMIN]))
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


@pytest.mark.parametrize("method,path", [("GET", "/health"), ("GET", "/version"),
                                         ("GET", "/metrics")])
def test_probes_stay_open(http, method, path):
    assert http.request(method, path).status_code == 200


@pytest.mark.parametrize("path,body", [("/tokenize", {"prompt": "hi"}),
                                       ("/detokenize", {"tokens": [1, 2]})])
def test_tokenizers_need_a_key(http, path, body):
    """They run the tokenizer: open, a few posts (a web page can send them) would
    queue CPU work ahead of everyone's prompts."""
    assert_error(http.post(path, json=body), 401, param=None, code="missing_api_key")
    # text/plain, as a cross-site form would send it: refused before it is read
    assert http.post(path, content=b'{"prompt": "hi"}',
                     headers={"Content-Type": "text/plain"}).status_code == 401
    assert http.post(path, json=body, headers=_auth(KEYS[0])).status_code == 200


def test_stored_responses_belong_to_their_key(http):
    """Another key's stored response does not exist for this one: GET, DELETE and
    previous_response_id all answer 404, as for an id never made."""
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "temperature": 0}
    made = http.post("/v1/responses", json=body, headers=_auth(KEYS[0]))
    assert made.status_code == 200, made.text
    rid = made.json()["id"]
    other = _auth(KEYS[1])
    assert_error(http.get(f"/v1/responses/{rid}", headers=other), 404, param="response_id")
    assert_error(http.delete(f"/v1/responses/{rid}", headers=other), 404,
                 param="response_id")
    assert_error(http.post("/v1/responses", json={**body, "previous_response_id": rid},
                           headers=other), 404, param="previous_response_id")
    assert_error(http.get(f"/v1/responses/{rid}", headers=_auth(ADMIN)), 404,
                 param="response_id")  # the admin key is a tenant too
    mine = _auth(KEYS[0])
    assert http.get(f"/v1/responses/{rid}", headers=mine).json()["id"] == rid
    follow = http.post("/v1/responses", json={**body, "previous_response_id": rid},
                       headers=mine)
    assert follow.status_code == 200, follow.text
    assert http.delete(f"/v1/responses/{rid}", headers=mine).json()["deleted"] is True


def test_openai_sdk_with_and_without_the_key(url):
    with openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    with openai.OpenAI(base_url=url + "/v1", api_key=KEYS[1], max_retries=0) as c:
        assert [m.id for m in c.models.list().data] == [MODEL]


def test_the_engine_stream_shows_ids_to_the_admin_and_to_their_own_key(http):
    """Two keys' requests running at once: the admin key's watcher sees both ids,
    each other key its own request's only (the other's row keeps its shape and a
    ref, no id). Engine ids come from the response header, and are unrelated to
    the public ids the bodies carry."""
    from tests.server.test_engine_view import engine_events, first

    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3000, "ignore_eos": True,
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body, headers=_auth(KEYS[0])) as one, \
            http.stream("POST", "/v1/completions", json=body, headers=_auth(KEYS[1])) as two:
        ids = {KEYS[0]: one.headers["x-kvserve-request-id"],
               KEYS[1]: two.headers["x-kvserve-request-id"]}
        lines = one.iter_lines()  # kept: a dropped iterator closes the stream
        public = json.loads(next(line for line in lines if line.startswith("data: {"))[6:])["id"]
        assert ids[KEYS[0]] not in public and public not in ids[KEYS[0]]
        seen = {}
        for key in (ADMIN, *KEYS):
            with engine_events(http, _auth(key)) as events:
                snap = first(events, lambda n, d: n == "snapshot" and len(d["requests"]) == 2)
            assert all(r["ref"] and r["phase"] for r in snap["requests"])
            seen[key] = {r["id"].rsplit("-", 1)[0] for r in snap["requests"] if r["id"]}
    assert seen == {ADMIN: set(ids.values()), KEYS[0]: {ids[KEYS[0]]},
                    KEYS[1]: {ids[KEYS[1]]}}


def test_no_key_is_a_401_before_the_body_is_read(url):
    """The key is checked from the headers: a client without one is answered at once,
    with nothing of its (here never-sent) 5 MB body read."""
    from tests.server.test_request_limits import _raw

    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nContent-Length: 5000000\r\n\r\n")
    answer, took = _raw(url, head)
    assert answer.startswith(b"HTTP/1.1 401") and took < 2
