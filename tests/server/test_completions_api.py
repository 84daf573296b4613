"""POST /v1/completions and friends, against a real uvicorn server running the tiny
random-weight llama model (its output is gibberish, but deterministic when greedy)."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.engine.core.engine import Engine
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.server.entrypoints.app import VERSION, build_app
from tests.support.http import (CompletionsClient, assert_error, parse_sse,
                                post_completions_concurrently, wait_idle)
from tests.support.server import running_server

MODEL = "tiny"
TIMEOUT = 120.0

PROMPTS = [
    "The capital of France is",
    "Paged attention stores keys and values",
    "def add(a, b):",
    "Héllo wörld — naïve café, 東京",
    "0 1 2 3 4 5 6 7 8 9 10 11 12",
    "Continuous batching keeps the accelerator busy by letting requests join and leave.",
    "x",
    "emoji 🙂 are multi-byte characters.",
]


def plain_usage(usage: dict) -> dict:
    """The three token counts, after checking the cached-token detail's shape."""
    details = usage["prompt_tokens_details"]
    assert 0 <= details["cached_tokens"] <= usage["prompt_tokens"]
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


class Server(CompletionsClient):
    def __init__(self, url: str, engine: Engine, http: httpx.Client):
        super().__init__(http, MODEL)
        self.url, self.engine = url, engine

    def text(self, **body) -> str:
        return self.ok(**body)["choices"][0]["text"]

    def stream_raw(self, **body) -> tuple[httpx.Response, bytes]:
        body.setdefault("model", MODEL)
        body["stream"] = True
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            return r, r.read()


@pytest.fixture(scope="module")
def srv(tiny_engine_factory):
    engine = tiny_engine_factory("llama")
    app = build_app(AsyncEngine(engine), [MODEL])
    with running_server(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        yield Server(url, engine, http)


@pytest.fixture(scope="module")
def offline(tiny_engine_factory):
    """prompt (text or ids) -> the text a separate engine generates for it, greedy."""
    engine = tiny_engine_factory("llama")
    tok = engine.tokenizer

    def generate(prompt, max_tokens: int, ignore_eos: bool = True) -> tuple[str, list[int]]:
        ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
        out = engine.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                    ignore_eos=ignore_eos))[0]
        return tok.decode(out, skip_special_tokens=True), out

    return generate


@pytest.fixture(scope="module")
def client(srv):
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=TIMEOUT,
                       max_retries=0) as c:
        yield c


def content_chunks(chunks: list[dict]) -> list[dict]:
    return [c for c in chunks if c["choices"]]



def first_occurrence_stop(text: str, start: int, length: int = 3) -> tuple[int, str]:
    """A substring of `text` at or after `start` that occurs nowhere earlier and holds
    only plain characters."""
    for i in range(start, len(text) - length - 2):
        s = text[i:i + length]
        if text.find(s) == i and all(c.isprintable() and c != "\ufffd" for c in s):
            return i, s
    pytest.fail(f"no usable stop string in {text!r}")


# ------------------------------------------------------------------ response shape


def test_non_streaming_response_shape(srv):
    prompt = PROMPTS[0]
    n_prompt = len(srv.engine.tokenizer.encode(prompt))
    before = int(time.time())
    body = srv.ok(prompt=prompt, max_tokens=7, temperature=0, ignore_eos=True)
    assert set(body) >= {"id", "object", "created", "model", "choices", "usage"}
    assert body["id"].startswith("cmpl-") and len(body["id"]) > len("cmpl-")
    assert body["object"] == "text_completion"
    assert isinstance(body["created"], int) and abs(body["created"] - before) < 60
    assert body["model"] == MODEL
    assert len(body["choices"]) == 1
    choice = body["choices"][0]
    assert set(choice) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}
    assert choice["index"] == 0
    assert isinstance(choice["text"], str) and choice["text"]
    assert choice["logprobs"] is None
    assert choice["finish_reason"] == "length"
    assert choice["stop_reason"] is None
    assert plain_usage(body["usage"]) == {"prompt_tokens": n_prompt, "completion_tokens": 7,
                             "total_tokens": n_prompt + 7}


def test_ids_are_unique(srv):
    ids = {srv.ok(prompt="x", max_tokens=1)["id"] for _ in range(3)}
    assert len(ids) == 3


@pytest.mark.parametrize("max_tokens", [1, 2, 13, 40])
def test_max_tokens_with_ignore_eos_is_exact(srv, max_tokens):
    body = srv.ok(prompt=PROMPTS[1], max_tokens=max_tokens, temperature=0, ignore_eos=True)
    assert body["usage"]["completion_tokens"] == max_tokens
    assert body["choices"][0]["finish_reason"] == "length"


def test_default_model_when_model_is_omitted(srv):
    r = srv.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL


def test_max_tokens_null_runs_to_eos_or_context(srv):
    max_len = srv.engine.max_model_len
    prompt = (srv.engine.tokenizer.encode(PROMPTS[5]) * max_len)[:max_len - 6]
    body = srv.ok(prompt=prompt, max_tokens=None, temperature=0, ignore_eos=True)
    assert body["choices"][0]["finish_reason"] == "length"
    assert plain_usage(body["usage"]) == {"prompt_tokens": max_len - 6, "completion_tokens": 6,
                             "total_tokens": max_len}


# ------------------------------------------------------- server text == engine text


@pytest.mark.parametrize("prompt", PROMPTS)
def test_text_equals_offline_engine(srv, offline, prompt):
    expected, _ = offline(prompt, 24)
    assert srv.text(prompt=prompt, max_tokens=24, temperature=0, ignore_eos=True) == expected


def test_text_equals_offline_engine_without_ignore_eos(srv, offline):
    for prompt in PROMPTS[:4]:
        expected, ids = offline(prompt, 30, ignore_eos=False)
        body = srv.ok(prompt=prompt, max_tokens=30, temperature=0)
        assert body["choices"][0]["text"] == expected
        assert body["usage"]["completion_tokens"] == len(ids)


def test_token_id_prompt_equals_offline_engine(srv, offline):
    ids = srv.engine.tokenizer.encode(PROMPTS[3])
    expected, _ = offline(ids, 20)
    assert srv.text(prompt=ids, max_tokens=20, temperature=0, ignore_eos=True) == expected


# ----------------------------------------------------------------------- prompt forms


def test_prompt_forms(srv):
    tok = srv.engine.tokenizer
    a, b = PROMPTS[0], PROMPTS[2]
    ids_a, ids_b = tok.encode(a), tok.encode(b)
    common = dict(max_tokens=6, temperature=0, ignore_eos=True)
    text_a = srv.text(prompt=a, **common)
    text_b = srv.text(prompt=b, **common)

    body = srv.ok(prompt=ids_a, **common)
    assert [c["text"] for c in body["choices"]] == [text_a]
    assert body["usage"]["prompt_tokens"] == len(ids_a)

    for prompt in ([a, b], [ids_a, ids_b]):
        body = srv.ok(prompt=prompt, **common)
        choices = sorted(body["choices"], key=lambda c: c["index"])
        assert [c["index"] for c in choices] == [0, 1]
        assert [c["text"] for c in choices] == [text_a, text_b]
        assert all(c["finish_reason"] == "length" for c in choices)
        assert plain_usage(body["usage"]) == {"prompt_tokens": len(ids_a) + len(ids_b),
                                 "completion_tokens": 12,
                                 "total_tokens": len(ids_a) + len(ids_b) + 12}

    body = srv.ok(prompt=[a], **common)  # a list of one string
    assert [c["text"] for c in body["choices"]] == [text_a]


# -------------------------------------------------------------------------- streaming


def test_stream_framing_and_chunks(srv):
    r, raw = srv.stream_raw(prompt=PROMPTS[0], max_tokens=12, temperature=0, ignore_eos=True)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    chunks = parse_sse(raw)
    assert chunks, raw
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    for c in chunks:
        assert c["object"] == "text_completion"
        assert c["model"] == MODEL
        assert isinstance(c["created"], int)
        assert "usage" not in c or c["usage"] is None
        assert len(c["choices"]) == 1
        ch = c["choices"][0]
        assert set(ch) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}
        assert ch["index"] == 0 and ch["logprobs"] is None
    # no empty chunks: every chunk but the last carries text and no finish_reason
    for c in chunks[:-1]:
        assert c["choices"][0]["text"] != ""
        assert c["choices"][0]["finish_reason"] is None
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_stream_text_equals_non_streaming_text(srv, prompt):
    common = dict(prompt=prompt, max_tokens=20, temperature=0, ignore_eos=True)
    expected = srv.text(**common)
    _, raw = srv.stream_raw(**common)
    chunks = content_chunks(parse_sse(raw))
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_multibyte_output_streams_whole_characters(srv, offline):
    """The tiny model's byte-level output splits characters like é across tokens; the
    stream must carry exactly the text a whole decode gives, character for character."""
    seen_multibyte = False
    for prompt in (PROMPTS[3], PROMPTS[7]):
        expected, ids = offline(prompt, 40)
        seen_multibyte |= any(ord(c) > 127 and c != "\ufffd" for c in expected)
        _, raw = srv.stream_raw(prompt=prompt, max_tokens=40, temperature=0, ignore_eos=True)
        texts = [c["choices"][0]["text"] for c in content_chunks(parse_sse(raw))]
        assert "".join(texts) == expected
        assert len(texts) < len(ids)  # some tokens waited for the rest of a character
    assert seen_multibyte


def test_stream_include_usage(srv):
    prompt = PROMPTS[2]
    n_prompt = len(srv.engine.tokenizer.encode(prompt))
    _, raw = srv.stream_raw(prompt=prompt, max_tokens=9, temperature=0, ignore_eos=True,
                            stream_options={"include_usage": True})
    chunks = parse_sse(raw)
    last = chunks[-1]
    assert last["choices"] == []
    assert plain_usage(last["usage"]) == {"prompt_tokens": n_prompt, "completion_tokens": 9,
                             "total_tokens": n_prompt + 9}
    assert last["id"] == chunks[0]["id"]
    assert all(c["choices"] for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_stream_two_prompts(srv):
    a, b = PROMPTS[0], PROMPTS[4]
    common = dict(max_tokens=8, temperature=0, ignore_eos=True)
    text_a, text_b = srv.text(prompt=a, **common), srv.text(prompt=b, **common)
    _, raw = srv.stream_raw(prompt=[a, b], stream_options={"include_usage": True}, **common)
    chunks = parse_sse(raw)
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for c in content_chunks(chunks):
        ch = c["choices"][0]
        texts[ch["index"]] += ch["text"]
        finishes[ch["index"]].append(ch["finish_reason"])
    assert texts == {0: text_a, 1: text_b}
    for i in (0, 1):
        assert finishes[i][-1] == "length" and set(finishes[i][:-1]) <= {None}
    assert chunks[-1]["usage"]["completion_tokens"] == 16


# ------------------------------------------------------------------------- openai SDK


def test_openai_sdk_completion(srv, client):
    expected = srv.ok(prompt=PROMPTS[0], max_tokens=10, temperature=0)
    resp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10,
                                     temperature=0)
    assert resp.object == "text_completion"
    assert resp.id.startswith("cmpl-")
    assert resp.model == MODEL
    assert resp.choices[0].text == expected["choices"][0]["text"]
    assert resp.choices[0].finish_reason == expected["choices"][0]["finish_reason"]
    assert resp.usage.completion_tokens == expected["usage"]["completion_tokens"]
    assert resp.usage.total_tokens == (resp.usage.prompt_tokens
                                       + resp.usage.completion_tokens)


def test_openai_sdk_streaming(srv, client):
    expected = srv.text(prompt=PROMPTS[3], max_tokens=15, temperature=0, ignore_eos=True)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=15,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == expected
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 15


def test_openai_sdk_models_list(srv, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "kvserve"


def test_openai_sdk_raises_on_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert exc.value.body["param"] == "max_tokens"


# ------------------------------------------------------------------- other endpoints


def test_models_endpoint(srv):
    r = srv.http.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    assert len(body["data"]) == 1
    m = body["data"][0]
    assert m["id"] == MODEL
    assert m["object"] == "model"
    assert isinstance(m["created"], int)
    assert m["owned_by"] == "kvserve"
    assert m["root"] == MODEL
    assert m["max_model_len"] == srv.engine.max_model_len


def test_health(srv):
    r = srv.http.get("/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}


def test_version(srv):
    r = srv.http.get("/version")
    assert r.status_code == 200
    assert r.json() == {"version": VERSION}


# ------------------------------------------------------------------------------ errors


def _long_prompt(srv) -> list[int]:
    return [5] * (srv.engine.max_model_len + 10)


ERROR_CASES = {
    "unknown model": (lambda s: dict(model="nope", prompt="x"), 404, "model",
                      "model_not_found"),
    "prompt too long": (lambda s: dict(prompt=_long_prompt(s)), 400, "prompt", None),
    "prompt exactly the context": (lambda s: dict(prompt=[5] * s.engine.max_model_len,
                                                  max_tokens=1), 400, "__any__", None),
    "prompt + max_tokens too long": (lambda s: dict(prompt=[5] * 10,
                                                    max_tokens=s.engine.max_model_len - 5),
                                     400, "max_tokens", None),
    "negative max_tokens": (lambda s: dict(prompt="x", max_tokens=-1), 400, "max_tokens",
                            None),
    "zero max_tokens": (lambda s: dict(prompt="x", max_tokens=0), 400, "max_tokens", None),
    "temperature wrong type": (lambda s: dict(prompt="x", temperature="hot"), 400,
                               "temperature", None),
    "temperature out of range": (lambda s: dict(prompt="x", temperature=5), 400,
                                 "temperature", None),
    "top_p zero": (lambda s: dict(prompt="x", top_p=0), 400, "top_p", None),
    "n zero": (lambda s: dict(prompt="x", n=0), 400, "n", None),
    "seed too big for torch": (lambda s: dict(prompt="x", seed=2**70, temperature=1), 400,
                               "seed", None),
    "seed too small for torch": (lambda s: dict(prompt="x", seed=-(2**64), temperature=1),
                                 400, "seed", None),
    "token id out of vocab": (lambda s: dict(prompt=[5, s.engine.model_config.vocab_size]),
                              400, "prompt", None),
    "negative token id": (lambda s: dict(prompt=[5, -1]), 400, "__any__", None),
    "empty prompt": (lambda s: dict(prompt=""), 400, "prompt", None),
    "empty token list": (lambda s: dict(prompt=[[]]), 400, "prompt", None),
    "empty prompt list": (lambda s: dict(prompt=[]), 400, "prompt", None),
    "empty string in list": (lambda s: dict(prompt=["x", ""]), 400, "prompt", None),
    "missing prompt": (lambda s: dict(max_tokens=3), 400, "prompt", None),
    "prompt wrong type": (lambda s: dict(prompt={"a": 1}), 400, "__any__", None),
    "stop wrong type": (lambda s: dict(prompt="x", stop=5), 400, "__any__", None),
    "unknown model, streaming": (lambda s: dict(model="nope", prompt="x", stream=True), 404,
                                 "model", "model_not_found"),
    "prompt too long, streaming": (lambda s: dict(prompt=_long_prompt(s), stream=True), 400,
                                   "prompt", None),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_bad_request_gets_openai_error_and_server_keeps_serving(srv, case):
    make, status, param, code = ERROR_CASES[case]
    body = make(srv)
    body.setdefault("model", MODEL)
    r = srv.http.post("/v1/completions", json=body)
    err = assert_error(r, status, param, code)
    if case == "prompt + max_tokens too long":
        assert "max_tokens" in err["message"] or "completion" in err["message"]
    after = srv.ok(prompt="x", max_tokens=2, temperature=0, ignore_eos=True)
    assert after["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("content,ctype", [(b"{not json", "application/json"),
                                           (b"", "application/json"),
                                           (b'{"prompt": "x",', "application/json"),
                                           (b"prompt=x", "application/x-www-form-urlencoded"),
                                           (b"hello", "text/plain"),
                                           (b"[1, 2]", "application/json")])
def test_non_json_body(srv, content, ctype):
    r = srv.http.post("/v1/completions", content=content, headers={"content-type": ctype})
    assert_error(r, 400)
    assert srv.ok(prompt="x", max_tokens=1)["choices"]


def test_unknown_endpoint(srv):
    r = srv.http.get("/v1/nothing-here")
    assert_error(r, 404)
    r = srv.http.post("/v1/chat/completionz", json={})
    assert_error(r, 404)
    assert srv.ok(prompt="x", max_tokens=1)["choices"]


def test_wrong_method(srv):
    assert_error(srv.http.get("/v1/completions"), 405)


def test_unknown_fields_are_ignored(srv):
    expected = srv.text(prompt=PROMPTS[0], max_tokens=5, temperature=0, ignore_eos=True)
    body = srv.ok(prompt=PROMPTS[0], max_tokens=5, temperature=0, ignore_eos=True,
                  frobnicate=True, echo=False, suffix=None, best_of=1,
                  nested={"a": [1, 2]})
    assert body["choices"][0]["text"] == expected


def test_engine_idle_after_errors(srv):
    assert wait_idle(srv.engine)


# ------------------------------------------------------------------------ stop strings


@pytest.fixture(scope="module")
def greedy_run(srv):
    common = dict(prompt=PROMPTS[0], max_tokens=40, temperature=0, ignore_eos=True)
    full = srv.text(**common)
    i, stop = first_occurrence_stop(full, 8)
    return common, full, i, stop


def test_stop_string(srv, greedy_run):
    common, full, i, stop = greedy_run
    body = srv.ok(stop=stop, **common)
    choice = body["choices"][0]
    assert choice["text"] == full[:i]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop
    assert 1 <= body["usage"]["completion_tokens"] < 40


def test_stop_string_in_a_list(srv, greedy_run):
    common, full, i, stop = greedy_run
    choice = srv.ok(stop=["never-in-gibberish", stop], **common)["choices"][0]
    assert choice["text"] == full[:i]
    assert choice["stop_reason"] == stop


def test_earliest_stop_string_wins(srv, greedy_run):
    common, full, i, stop = greedy_run
    j, later = first_occurrence_stop(full, i + len(stop) + 2)
    choice = srv.ok(stop=[later, stop], **common)["choices"][0]
    assert choice["text"] == full[:i]
    assert choice["stop_reason"] == stop


def test_include_stop_str_in_output(srv, greedy_run):
    common, full, i, stop = greedy_run
    choice = srv.ok(stop=stop, include_stop_str_in_output=True, **common)["choices"][0]
    assert choice["text"] == full[:i + len(stop)]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop


def test_stop_string_not_generated(srv, greedy_run):
    common, full, _, _ = greedy_run
    choice = srv.ok(stop=["never-in-gibberish"], **common)["choices"][0]
    assert choice["text"] == full
    assert choice["finish_reason"] == "length"
    assert choice["stop_reason"] is None


def test_empty_stop_strings_are_ignored(srv, greedy_run):
    common, full, _, _ = greedy_run
    for stop in ("", [""], []):
        choice = srv.ok(stop=stop, **common)["choices"][0]
        assert choice["text"] == full, stop
        assert choice["finish_reason"] == "length"


@pytest.mark.parametrize("include", [False, True])
def test_streaming_never_sends_the_stop_string(srv, greedy_run, include):
    common, full, i, stop = greedy_run
    _, raw = srv.stream_raw(stop=stop, include_stop_str_in_output=include, **common)
    chunks = content_chunks(parse_sse(raw))
    expected = full[:i + len(stop)] if include else full[:i]
    sent = ""
    for c in chunks:
        sent += c["choices"][0]["text"]
        assert expected.startswith(sent)  # never anything past the cut, even in part
    assert sent == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] == stop
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    if not include:
        assert stop not in sent and not any(sent.endswith(stop[:k])
                                            for k in range(1, len(stop)))


def test_engine_idle_after_stop_strings(srv):
    # a stop string ends the request early: the engine must have freed it
    assert wait_idle(srv.engine)


# ------------------------------------------------------------------------- concurrency



def test_concurrent_requests_match_sequential(srv):
    bodies = [dict(model=MODEL, prompt=(PROMPTS[i % len(PROMPTS)] + " ") * (1 + i // 4),
                   max_tokens=3 + 3 * i, temperature=0, ignore_eos=True)
              for i in range(16)]
    alone = [srv.ok(**b) for b in bodies]
    together = post_completions_concurrently(srv.url, bodies, TIMEOUT)
    for b, a, t in zip(bodies, alone, together):
        assert t["usage"]["completion_tokens"] == b["max_tokens"]
        assert t["choices"][0]["finish_reason"] == "length"
        assert t["choices"][0]["text"] == a["choices"][0]["text"]
        assert plain_usage(t["usage"]) == plain_usage(a["usage"])
    assert wait_idle(srv.engine)


def test_concurrent_streaming_requests(srv):
    bodies = [dict(model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=4 + 2 * i,
                   temperature=0, ignore_eos=True) for i in range(8)]
    alone = [srv.text(**b) for b in bodies]

    async def one(c: httpx.AsyncClient, body: dict) -> str:
        async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            raw = await r.aread()
        return "".join(ch["choices"][0]["text"] for ch in content_chunks(parse_sse(raw)))

    async def run_all():
        async with httpx.AsyncClient(base_url=srv.url, timeout=TIMEOUT) as c:
            return await asyncio.gather(*(one(c, b) for b in bodies))

    assert asyncio.run(run_all()) == alone


# -------------------------------------------------------------------------- sampling


def test_seeded_sampling_is_reproducible(srv):
    common = dict(prompt=PROMPTS[1], max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    first = srv.text(**common)
    assert srv.text(**common) == first
    # other requests (seeded and not) running alongside change nothing
    others = [dict(model=MODEL, prompt=PROMPTS[i], max_tokens=20, temperature=1.0,
                   seed=None if i % 2 else 100 + i, ignore_eos=True) for i in range(6)]
    results = post_completions_concurrently(
        srv.url, [dict(model=MODEL, **common)] + others + [dict(model=MODEL, **common)],
        TIMEOUT)
    assert results[0]["choices"][0]["text"] == first
    assert results[-1]["choices"][0]["text"] == first


def test_extreme_seeds_work(srv):
    for seed in (0, -1, 2**63 - 1, -(2**63)):
        body = srv.ok(prompt="x", max_tokens=3, temperature=1.0, seed=seed, n=2,
                      ignore_eos=True)
        assert body["usage"]["completion_tokens"] == 6
    assert srv.http.get("/health").status_code == 200


def test_different_seeds_differ(srv):
    common = dict(prompt=PROMPTS[1], max_tokens=24, temperature=1.0, ignore_eos=True)
    texts = {srv.text(seed=s, **common) for s in (1, 2, 3)}
    assert len(texts) > 1


def test_seeded_streaming_equals_non_streaming(srv):
    common = dict(prompt=PROMPTS[2], max_tokens=16, temperature=0.8, top_p=0.9, top_k=50,
                  seed=11, ignore_eos=True)
    expected = srv.text(**common)
    _, raw = srv.stream_raw(**common)
    assert "".join(c["choices"][0]["text"] for c in content_chunks(parse_sse(raw))) == expected


def test_n_choices(srv):
    prompt = PROMPTS[0]
    n_prompt = len(srv.engine.tokenizer.encode(prompt))
    common = dict(prompt=prompt, max_tokens=10, temperature=1.0, seed=7, n=2,
                  ignore_eos=True)
    body = srv.ok(**common)
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    assert all(c["finish_reason"] == "length" and c["text"] for c in choices)
    assert plain_usage(body["usage"]) == {"prompt_tokens": n_prompt, "completion_tokens": 20,
                             "total_tokens": n_prompt + 20}
    again = sorted(srv.ok(**common)["choices"], key=lambda c: c["index"])
    assert [c["text"] for c in again] == [c["text"] for c in choices]


def test_n_choices_greedy_are_identical(srv):
    body = srv.ok(prompt=PROMPTS[2], max_tokens=8, temperature=0, n=3, ignore_eos=True)
    assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2]
    assert len({c["text"] for c in body["choices"]}) == 1


def test_n_with_two_prompts(srv):
    body = srv.ok(prompt=[PROMPTS[0], PROMPTS[2]], max_tokens=4, temperature=0, n=2,
                  ignore_eos=True)
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    a = srv.text(prompt=PROMPTS[0], max_tokens=4, temperature=0, ignore_eos=True)
    b = srv.text(prompt=PROMPTS[2], max_tokens=4, temperature=0, ignore_eos=True)
    assert [c["text"] for c in choices] == [a, a, b, b]
    tok = srv.engine.tokenizer
    assert body["usage"]["prompt_tokens"] == len(tok.encode(PROMPTS[0])) + len(
        tok.encode(PROMPTS[2]))
    assert body["usage"]["completion_tokens"] == 16


# ------------------------------------------------------------------ client disconnects


def test_client_disconnect_mid_stream_aborts_the_request(srv):
    assert wait_idle(srv.engine)
    max_tokens = 2000
    generated_before = srv.engine.stats().generated_tokens
    body = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=max_tokens, temperature=0,
                ignore_eos=True, stream=True)
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            got = b""
            for part in r.iter_bytes():
                got += part
                if got.count(b"\n\n") >= 3:
                    break
    # the connection is closed now, long before max_tokens
    assert wait_idle(srv.engine, timeout=5.0), "the aborted request is still running"
    assert srv.engine.scheduler.kv.num_free_blocks == srv.engine.scheduler.kv.num_blocks
    assert not srv.engine.has_unfinished_requests()
    assert srv.engine.stats().generated_tokens - generated_before < max_tokens
    # and the server still serves, streaming or not
    assert srv.ok(prompt="x", max_tokens=3, ignore_eos=True)["usage"]["completion_tokens"] == 3
    _, raw = srv.stream_raw(prompt="x", max_tokens=3, ignore_eos=True)
    assert len(content_chunks(parse_sse(raw))) >= 1


def test_client_timeout_on_non_streaming_request_aborts_it(srv):
    assert wait_idle(srv.engine)
    max_tokens = 2000
    generated_before = srv.engine.stats().generated_tokens
    with httpx.Client(base_url=srv.url, timeout=0.3) as c:
        with pytest.raises(httpx.TimeoutException):
            c.post("/v1/completions", json=dict(model=MODEL, prompt=PROMPTS[0],
                                                max_tokens=max_tokens, ignore_eos=True))
    assert wait_idle(srv.engine, timeout=5.0), "the abandoned request is still running"
    assert srv.engine.stats().generated_tokens - generated_before < max_tokens
    assert srv.ok(prompt="x", max_tokens=2)["choices"]


def test_health_after_everything(srv):
    assert srv.http.get("/health").json() == {"status": "ok"}
    assert wait_idle(srv.engine)


# ---------------------------------------------------------------------- stop tokens


def test_stop_token_ids(srv, offline):
    tok = srv.engine.tokenizer
    _, out = offline(PROMPTS[0], 30)
    k = next((i for i in range(3, len(out)) if out[i] not in out[:i]
              and tok.decode(out[:i]) and tok.decode([out[i]]).strip()), None)
    if k is None:
        pytest.fail(f"no usable stop token in {out}")
    stop_id = out[k]
    common = dict(prompt=PROMPTS[0], max_tokens=30, temperature=0, ignore_eos=True,
                  stop_token_ids=[stop_id])
    body = srv.ok(**common)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop_id
    assert body["usage"]["completion_tokens"] == k + 1  # the stop token counts
    # as in vLLM, the stop token's text is left out unless asked for
    assert choice["text"] == tok.decode(out[:k])
    kept = srv.ok(include_stop_str_in_output=True, **common)["choices"][0]
    assert kept["text"] == tok.decode(out[:k + 1])
    _, raw = srv.stream_raw(**common)
    chunks = content_chunks(parse_sse(raw))
    assert "".join(c["choices"][0]["text"] for c in chunks) == tok.decode(out[:k])
    assert chunks[-1]["choices"][0]["stop_reason"] == stop_id


# ------------------------------------------------------------------- a dead engine


def test_engine_death_gives_503_and_unhealthy(tiny_engine_factory):
    engine = tiny_engine_factory("llama")
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) > 4:
            raise RuntimeError("boom")
        return real_step()

    engine.step = failing_step
    app = build_app(AsyncEngine(engine), [MODEL])
    with running_server(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        assert http.get("/health").status_code == 200
        # a stream that is running when the engine dies ends with an error event
        with http.stream("POST", "/v1/completions",
                         json=dict(prompt="x", max_tokens=50, ignore_eos=True,
                                   stream=True)) as r:
            assert r.status_code == 200
            raw = r.read()
        assert raw.endswith(b"data: [DONE]\n\n")
        events = [json.loads(e[6:]) for e in raw.split(b"\n\n")[:-2]]
        assert all(e.get("choices") for e in events[:-1])
        err = events[-1]["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert "engine" in err["message"]
        # afterwards: unhealthy, and requests fail fast with an OpenAI error
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["status"] != "ok"
        assert_error(http.post("/v1/completions", json=dict(prompt="x", max_tokens=3)), 503)
        # a stream asked of a dead engine fails before it starts, with a status code
        assert_error(http.post("/v1/completions",
                               json=dict(prompt="x", max_tokens=3, stream=True)), 503)
