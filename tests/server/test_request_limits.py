"""Per-request limits (body size 413, prompts per request, n, waiting prompt tokens
429) and --request-timeout (choices end with finish reason "abort")."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.server.config import ServerConfig
from kvserve.server.entrypoints.app import build_app
from tests.support.http import assert_error, parse_sse, wait_idle
from tests.support.server import running_server

MODEL = "tiny"
BODY_LIMIT, MAX_PROMPTS, MAX_N, MAX_WAITING_TOKENS = 2000, 3, 2, 40


def _serve(aengine: AsyncEngine, **kw):
    app = build_app(aengine, [MODEL], config=ServerConfig(**kw))
    return running_server(app)


@pytest.fixture(scope="module")
def limited(tiny_engine_factory):
    # One request runs at a time, so what comes after a long one waits.
    aengine = AsyncEngine(tiny_engine_factory("llama", max_num_seqs=1))
    with _serve(aengine, max_request_body_bytes=BODY_LIMIT,
                max_prompts_per_request=MAX_PROMPTS, max_n=MAX_N,
                max_waiting_tokens=MAX_WAITING_TOKENS) as url, \
            httpx.Client(base_url=url, timeout=60) as http:
        http.aengine = aengine
        yield http
    assert wait_idle(aengine.engine)


def body(**kw) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 2, **kw}


def test_body_over_the_limit_by_content_length(limited):
    err = assert_error(limited.post("/v1/completions", json=body(prompt="x" * BODY_LIMIT)),
                       413)
    assert "--max-request-body-bytes" in err["message"]


def test_chunked_body_over_the_limit(limited):
    def chunks():  # no Content-Length: the limit is found while reading
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(BODY_LIMIT // 100):
            yield b"x" * 100
        yield b'"}'

    r = limited.post("/v1/completions", content=chunks(),
                     headers={"content-type": "application/json"})
    assert_error(r, 413)


def test_body_under_the_limit_is_served(limited):
    assert limited.post("/v1/completions", json=body()).status_code == 200


def test_too_many_prompts(limited):
    err = assert_error(limited.post("/v1/completions", json=body(prompt=["a"] * 4)), 400,
                       "prompt")
    assert "--max-prompts-per-request" in err["message"]
    r = limited.post("/v1/completions", json=body(prompt=["a"] * MAX_PROMPTS))
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_PROMPTS


@pytest.mark.parametrize("path,extra", [("/v1/completions", {"prompt": "x"}),
                                        ("/v1/chat/completions",
                                         {"messages": [{"role": "user", "content": "x"}]})])
def test_n_over_max_n(limited, path, extra):
    req = {"model": MODEL, "max_tokens": 2, **extra}
    err = assert_error(limited.post(path, json={**req, "n": MAX_N + 1}), 400, "n")
    assert "--max-n" in err["message"]
    assert limited.post(path, json={**req, "n": MAX_N}).status_code == 200


async def _until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _waiting_tokens_refusal(url: str, aengine: AsyncEngine) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        head = asyncio.create_task(c.post("/v1/completions", json=body(
            prompt=[5] * 4, max_tokens=1500, ignore_eos=True)))
        await _until(lambda: aengine.num_running > 0)
        queued = asyncio.create_task(c.post("/v1/completions", json=body(
            prompt=[6] * MAX_WAITING_TOKENS)))
        await _until(lambda: aengine.waiting_prompt_tokens >= MAX_WAITING_TOKENS)
        refused = await c.post("/v1/completions", json=body())
        assert (await head).status_code == 200 and (await queued).status_code == 200
    return refused


def test_waiting_prompt_tokens_limit(limited):
    refused = asyncio.run(_waiting_tokens_refusal(str(limited.base_url), limited.aengine))
    err = assert_error(refused, 429)
    assert "--max-waiting-tokens" in err["message"] and refused.headers["retry-after"]
    assert limited.aengine.waiting_prompt_tokens == 0
    assert limited.post("/v1/completions", json=body()).status_code == 200


@pytest.fixture(scope="module")
def timed(tiny_engine_factory):
    aengine = AsyncEngine(tiny_engine_factory("llama"))
    with _serve(aengine, request_timeout=0.5) as url, \
            httpx.Client(base_url=url, timeout=60) as http:
        http.engine = aengine.engine
        yield http


LONG = dict(prompt="hello", max_tokens=3000, ignore_eos=True)


def test_timeout_non_streaming_returns_partial_text(timed):
    start = time.monotonic()
    r = timed.post("/v1/completions", json=body(n=2, **LONG))
    assert r.status_code == 200, r.text
    assert time.monotonic() - start < 10
    choices = r.json()["choices"]
    assert [ch["finish_reason"] for ch in choices] == ["abort", "abort"]
    assert 0 < r.json()["usage"]["completion_tokens"] < 2 * 3000
    assert wait_idle(timed.engine)


def test_timeout_streaming_ends_with_abort_and_done(timed):
    with timed.stream("POST", "/v1/completions", json=body(stream=True, **LONG)) as r:
        assert r.status_code == 200
        chunks = parse_sse(r.read())  # also checks the final data: [DONE]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert wait_idle(timed.engine)


def test_short_requests_are_untouched_by_the_timeout(timed):
    r = timed.post("/v1/completions", json=body(max_tokens=3, ignore_eos=True))
    assert r.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path,extra", [("/v1/completions", {"prompt": "x"}),
                                        ("/v1/chat/completions",
                                         {"messages": [{"role": "user", "content": "x"}]}),
                                        ("/v1/responses", {"input": "x"})])
def test_stop_strings_are_capped(limited, path, extra):
    """At most --max-stop-strings (64) stop strings of at most 256 characters: each
    token's text is searched for them on the event loop (a 10 MiB body held ~1.7M,
    0.33 s a token a sequence)."""
    req = {"model": MODEL, **extra}
    err = assert_error(limited.post(path, json={**req, "stop": [f"s{i}" for i in range(65)]}),
                       400, "stop")
    assert "--max-stop-strings" in err["message"]
    assert_error(limited.post(path, json={**req, "stop": ["x" * 257]}), 400, "stop")
    ok = limited.post(path, json={**req, "stop": [f"s{i}" for i in range(63)] + ["y" * 256]})
    assert ok.status_code == 200, ok.text


def _raw(url: str, head: bytes, body: bytes = b"", wait: float = 0.0) -> tuple[bytes, float]:
    """Sends `head` (and `body` after `wait` s) on a socket of its own; (the start
    of the answer, seconds until it came)."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=30) as sock:
        start = time.monotonic()
        sock.sendall(head)
        if wait:
            time.sleep(wait)
        if body:
            try:
                sock.sendall(body)
            except OSError:
                pass  # the server already answered and closed
        return _read_answer(sock), time.monotonic() - start


def _read_answer(sock) -> bytes:
    """One whole HTTP answer (head, then Content-Length bytes of body): the two may
    arrive in separate reads."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(rest) < length:
        chunk = sock.recv(4096)
        if not chunk:
            break
        rest += chunk
    return head + b"\r\n\r\n" + rest


def test_a_body_that_drips_in_is_a_408(tiny_engine_factory):
    """A body slower than --body-read-timeout is refused, and its connection closed,
    while the server keeps serving (slowloris)."""
    aengine = AsyncEngine(tiny_engine_factory("llama"))
    with _serve(aengine, body_read_timeout=1.0) as url:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: 400\r\n\r\n{\"model\": ")
        answer, took = _raw(url, head)
        assert answer.startswith(b"HTTP/1.1 408") and b"--body-read-timeout" in answer
        assert 0.9 < took < 5
        assert httpx.post(url + "/v1/completions", json=body(), timeout=30).status_code == 200


@pytest.fixture(scope="module")
def roomy(tiny_engine_factory):
    """The default body limit (10 MiB) and a small --max-choices-per-request."""
    aengine = AsyncEngine(tiny_engine_factory("llama"))
    with _serve(aengine, max_choices_per_request=4) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        http.aengine = aengine
        yield http


def test_choices_and_logit_bias_are_capped(roomy):
    """prompts x n (--max-choices-per-request) and logit_bias entries
    (--max-logit-bias, 300 as OpenAI): a request past either is a 400 naming it."""
    assert ServerConfig().max_choices_per_request == 1024
    http, aengine = roomy, roomy.aengine
    err = assert_error(http.post("/v1/completions",
                                 json=body(prompt=["a", "b", "c"], n=2)), 400, "n")
    assert "--max-choices-per-request" in err["message"]
    r = http.post("/v1/completions", json=body(prompt=["a", "b"], n=2))
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    bias = {str(i): 1.0 for i in range(301)}
    err = assert_error(http.post("/v1/completions", json=body(logit_bias=bias)), 400,
                       "logit_bias")
    assert "--max-logit-bias" in err["message"]
    fits = {str(i): 1.0 for i in range(min(300, aengine.vocab_size))}
    assert http.post("/v1/completions", json=body(logit_bias=fits)).status_code == 200


@pytest.mark.parametrize("metadata", [{f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"},
                                      {"k": "v" * 513}])
def test_responses_metadata_within_openai_limits(roomy, metadata):
    """16 pairs, 64-character keys, 512-character values: it is kept with a stored
    response (a 10 MiB `metadata` would be pinned for a day)."""
    req = {"model": MODEL, "input": "x", "max_output_tokens": 2}
    assert_error(roomy.post("/v1/responses", json={**req, "metadata": metadata}), 400,
                 "metadata")
    fits = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    assert roomy.post("/v1/responses", json={**req, "metadata": fits}).status_code == 200
