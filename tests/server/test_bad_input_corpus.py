"""A corpus of malformed requests against a real server: each gets its 4xx in the
OpenAI error shape, and afterwards the server still serves and no KV block leaks."""
from __future__ import annotations

import json

import pytest

from tests.support.http import assert_error, wait_idle
from tests.support.server import engine_http_client

MODEL = "tiny"
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
HUGE = 10**30
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http(tiny_engine_factory):
    with engine_http_client(tiny_engine_factory("llama"), MODEL, timeout=60) as client:
        yield client


def c(**kw) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 2, **kw}


def ch(**kw) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 2, **kw}


# name -> (path, JSON body, status)
JSON_CASES = {
    "temperature string": (CMPL, c(temperature="hot"), 400),
    "temperature negative": (CMPL, c(temperature=-0.1), 400),
    "temperature huge": (CMPL, c(temperature=1e300), 400),
    "top_p zero": (CMPL, c(top_p=0), 400),
    "top_p above one": (CMPL, c(top_p=1.5), 400),
    "top_k below -1": (CMPL, c(top_k=-2), 400),
    "top_k float": (CMPL, c(top_k=1.5), 400),
    "min_p above one": (CMPL, c(min_p=2), 400),
    "presence_penalty out of range": (CMPL, c(presence_penalty=3), 400),
    "frequency_penalty out of range": (CMPL, c(frequency_penalty=-3), 400),
    "repetition_penalty zero": (CMPL, c(repetition_penalty=0), 400),
    "n zero": (CMPL, c(n=0), 400),
    "n negative": (CMPL, c(n=-1), 400),
    "n huge": (CMPL, c(n=HUGE), 400),
    "n string": (CMPL, c(n="many"), 400),
    "max_tokens negative": (CMPL, c(max_tokens=-5), 400),
    "max_tokens gigantic": (CMPL, c(max_tokens=HUGE), 400),
    "max_tokens beyond context": (CMPL, c(max_tokens=10**6), 400),
    "max_tokens string": (CMPL, c(max_tokens="ten"), 400),
    "max_tokens float": (CMPL, c(max_tokens=2.5), 400),
    "min_tokens negative": (CMPL, c(min_tokens=-1), 400),
    "seed too big": (CMPL, c(seed=2**64), 400),
    "logprobs too many": (CMPL, c(logprobs=21), 400),
    "logprobs negative": (CMPL, c(logprobs=-1), 400),
    "empty prompt": (CMPL, c(prompt=""), 400),
    "empty prompt list": (CMPL, c(prompt=[]), 400),
    "empty token list": (CMPL, c(prompt=[[]]), 400),
    "oversized prompt": (CMPL, c(prompt=[5] * 5000), 400),
    "oversized text prompt": (CMPL, c(prompt="word " * 5000), 400),
    "prompt null": (CMPL, c(prompt=None), 400),
    "prompt number": (CMPL, c(prompt=5), 400),
    "prompt object": (CMPL, c(prompt={"a": 1}), 400),
    "prompt mixed list": (CMPL, c(prompt=["a", 1]), 400),
    "negative token id": (CMPL, c(prompt=[1, -1]), 400),
    "token id out of vocab": (CMPL, c(prompt=[1, 10**9]), 400),
    "token id gigantic": (CMPL, c(prompt=[HUGE]), 400),
    "token id float": (CMPL, c(prompt=[1.5]), 400),
    "missing prompt": (CMPL, {"model": MODEL}, 400),
    "empty object": (CMPL, {}, 400),
    "unknown model": (CMPL, c(model="nope"), 404),
    "model wrong type": (CMPL, c(model=5), 400),
    "stream wrong type": (CMPL, c(stream="yes please"), 400),
    "stop number": (CMPL, c(stop=5), 400),
    "stop list of numbers": (CMPL, c(stop=[1, 2]), 400),
    "stop object": (CMPL, c(stop={"a": "b"}), 400),
    "stop_token_ids negative": (CMPL, c(stop_token_ids=[-3]), 400),
    "stop_token_ids out of vocab": (CMPL, c(stop_token_ids=[10**9]), 400),
    "logit_bias not an object": (CMPL, c(logit_bias=[1, 2]), 400),
    "logit_bias text key": (CMPL, c(logit_bias={"abc": 1}), 400),
    "logit_bias negative key": (CMPL, c(logit_bias={"-5": 1}), 400),
    "logit_bias key out of vocab": (CMPL, c(logit_bias={"99999999": 1}), 400),
    "logit_bias value string": (CMPL, c(logit_bias={"5": "lots"}), 400),
    "stream_options wrong type": (CMPL, c(stream_options=5), 400),
    "chat no messages": (CHAT, {"model": MODEL}, 400),
    "chat empty messages": (CHAT, ch(messages=[]), 400),
    "chat messages not a list": (CHAT, ch(messages="hi"), 400),
    "chat message not an object": (CHAT, ch(messages=["hi"]), 400),
    "chat message without role": (CHAT, ch(messages=[{"content": "hi"}]), 400),
    "chat role wrong type": (CHAT, ch(messages=[{"role": 5, "content": "hi"}]), 400),
    "chat content wrong type": (CHAT, ch(messages=[{"role": "user", "content": 5}]), 400),
    "chat max_tokens zero": (CHAT, ch(max_tokens=0), 400),
    "chat max_completion_tokens huge": (CHAT, ch(max_completion_tokens=HUGE), 400),
    "chat top_logprobs without logprobs": (CHAT, ch(top_logprobs=3), 400),
    "chat top_logprobs too many": (CHAT, ch(logprobs=True, top_logprobs=50), 400),
    "chat unknown model": (CHAT, ch(model="nope"), 404),
    "chat n huge": (CHAT, ch(n=1000), 400),
    "chat bad logit_bias": (CHAT, ch(logit_bias={"x": 1}), 400),
    "chat template kwargs wrong type": (CHAT, ch(chat_template_kwargs=[1]), 400),
}


@pytest.mark.parametrize("case", list(JSON_CASES))
def test_bad_json_request(http, case):
    path, body, status = JSON_CASES[case]
    assert_error(http.post(path, json=body), status)


def _nested(depth: int) -> bytes:
    return b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}"


# name -> (path, raw body, content type, status)
RAW_CASES = {
    "invalid utf-8": (CMPL, b'{"prompt": "\xff\xfe\xfa", "max_tokens": 2}',
                      "application/json", 400),
    "invalid utf-8 in key": (CMPL, b'{"\xc3\x28": 1, "prompt": "x"}', "application/json", 400),
    "lone surrogate escape": (CMPL, b'{"prompt": "\\ud800", "max_tokens": 2}',
                              "application/json", 400),
    "lone surrogate in chat": (CHAT, b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
                               "application/json", 400),
    "lone surrogate to tokenize": ("/tokenize", b'{"prompt": "a\\ud800b"}',
                                   "application/json", 400),
    "nested 10000 deep": (CMPL, _nested(10_000), "application/json", 400),
    "nested 10000 deep chat": (CHAT, b'{"messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
                               "application/json", 400),
    "nested objects 10000 deep": (CMPL, b'{"a":' * 10_000 + b"1" + b"}" * 10_000,
                                  "application/json", 400),
    "truncated json": (CMPL, b'{"prompt": "x",', "application/json", 400),
    "empty body": (CMPL, b"", "application/json", 400),
    "json array body": (CMPL, b"[1, 2]", "application/json", 400),
    "json string body": (CMPL, b'"prompt"', "application/json", 400),
    "NaN temperature": (CMPL, b'{"prompt": "x", "temperature": NaN}', "application/json", 400),
    "Infinity max_tokens": (CMPL, b'{"prompt": "x", "max_tokens": Infinity}',
                            "application/json", 400),
    "form body": (CMPL, b"prompt=x", "application/x-www-form-urlencoded", 400),
    "text body": (CMPL, b"hello", "text/plain", 400),
    "chat text body": (CHAT, b"hello", "text/plain", 400),
}


@pytest.mark.parametrize("case", list(RAW_CASES))
def test_bad_raw_body(http, case):
    path, content, ctype, status = RAW_CASES[case]
    assert_error(http.post(path, content=content, headers={"content-type": ctype}), status)


def test_oversized_body_is_413(http):
    # Past the default --max-request-body-bytes (10 MiB), however it is sent.
    big = json.dumps(c(prompt="x" * (11 * 2**20))).encode()
    for path in (CMPL, CHAT, "/tokenize"):
        r = http.post(path, content=big, headers={"content-type": "application/json"})
        assert_error(r, 413)


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/v1/nothing", 404), ("POST", "/v1/chat/completionz", 404),
    ("POST", "/v2/completions", 404), ("GET", CMPL, 405), ("PUT", CHAT, 405),
    ("DELETE", "/v1/models", 405)])
def test_bad_route(http, method, path, status):
    assert_error(http.request(method, path, json={}), status)


def test_still_serves_and_nothing_leaks(http):
    r = http.post(CMPL, json=c(max_tokens=3, ignore_eos=True))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = http.post(CHAT, json=ch(max_tokens=3, ignore_eos=True))
    assert r.status_code == 200, r.text
    assert wait_idle(http.engine)
