"""vLLM's allowed_token_ids and bad_words over HTTP, on /v1/completions and
/v1/chat/completions: accepted (whole and streamed), the output what a twin engine
gives with the same token ids (bad words tokenized by the server as vLLM does),
bad values a 400 naming the field, and the engine serving on after them."""
from __future__ import annotations

import json

import httpx
import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.server.entrypoints.app import build_app
from kvserve.server.request_caps import MAX_BAD_WORD_CHARS, MAX_BAD_WORDS
from kvserve.server.validation import bad_words_token_ids
from tests.support.http import assert_error, parse_sse
from tests.support.server import running_server

PROMPT = [5, 17, 42, 9, 88, 130, 7]
ROUTES = ["/v1/completions", "/v1/chat/completions"]


def body(path: str, **extra) -> dict:
    base = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    if path == "/v1/completions":
        return {**base, "prompt": PROMPT, **extra}
    return {**base, "messages": [{"role": "user", "content": "Name a city."}], **extra}


@pytest.fixture(scope="module")
def http(tiny_engine_factory):
    engine = tiny_engine_factory("llama")
    with running_server(build_app(AsyncEngine(engine), ["tiny"])) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        client.vocab = engine.model_config.vocab_size
        client.tokenizer = engine.tokenizer
        yield client


@pytest.fixture(scope="module")
def twin(tiny_engine_factory):
    """The same model in an engine of its own (the server's is busy on its thread)."""
    return tiny_engine_factory("llama")


def tokens_of(r: httpx.Response) -> tuple[list[int], list[int]]:
    """(the prompt's token ids, the choice's), from a return_token_ids answer."""
    assert r.status_code == 200, r.text
    answer = r.json()
    choice = answer["choices"][0]
    return choice.get("prompt_token_ids", answer.get("prompt_token_ids")), choice["token_ids"]


def post(http, path: str, payload: dict) -> httpx.Response:
    """As the client's bytes (a lone surrogate stays an escape)."""
    return http.post(path, content=json.dumps(payload),
                     headers={"content-type": "application/json"})


def streamed_tokens(http, path: str, payload: dict) -> list[int]:
    with http.stream("POST", path, json={**payload, "stream": True}) as r:
        assert r.status_code == 200
        chunks = parse_sse(r.read())
    return [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or ()]


@pytest.mark.parametrize("path", ROUTES)
def test_allowed_token_ids_are_the_only_tokens_sampled(http, twin, path):
    allowed = [11, 23, 57, 101, 202]
    prompt, plain = tokens_of(http.post(path, json=body(path)))
    assert not set(plain) <= set(allowed)
    prompt, got = tokens_of(http.post(path, json=body(path, allowed_token_ids=allowed)))
    assert set(got) <= set(allowed) and len(got) == 8
    assert got == twin.generate([prompt], SamplingParams(
        max_tokens=8, temperature=0.0, ignore_eos=True, allowed_token_ids=allowed))[0]
    assert streamed_tokens(http, path, body(path, allowed_token_ids=allowed)) == got
    # sampled, a seed: still only those
    _, drawn = tokens_of(http.post(path, json=body(path, allowed_token_ids=allowed,
                                                   temperature=1.0, seed=4, max_tokens=30)))
    assert set(drawn) <= set(allowed)


def _a_word_for(tokenizer, token: int) -> tuple[str, list[list[int]]]:
    """A word whose token sequences (as the server reads it) hold `token` alone."""
    word = tokenizer.decode([token]).strip()
    return word, bad_words_token_ids(tokenizer, [word]) if word else []


@pytest.mark.parametrize("path", ROUTES)
def test_bad_words_are_never_generated(http, twin, path):
    n = 24
    prompt, plain = tokens_of(http.post(path, json=body(path, max_tokens=n)))
    tok = http.tokenizer
    # the first generated token that some word's tokenization bans on its own
    found = [(t, *_a_word_for(tok, t)) for t in plain]
    token, word, seqs = next((t, w, s) for t, w, s in found if [t] in s)
    asked = body(path, bad_words=[word, "  Paris"], max_tokens=n)
    prompt, got = tokens_of(http.post(path, json=asked))
    assert token not in got and got != plain
    words = bad_words_token_ids(tok, [word, "Paris"])
    for w in words:
        assert not any(got[i:i + len(w)] == w for i in range(len(got))), (word, w)
    assert got == twin.generate([prompt], SamplingParams(
        max_tokens=n, temperature=0.0, ignore_eos=True, bad_words_token_ids=words))[0]
    assert streamed_tokens(http, path, asked) == got
    # together with allowed_token_ids
    allowed = sorted({token, *plain, 3, 4})
    _, both = tokens_of(http.post(path, json=body(path, bad_words=[word],
                                                  allowed_token_ids=allowed)))
    assert set(both) <= set(allowed) and token not in both


def test_bad_words_are_tokenized_as_vllm_does(http):
    tok = http.tokenizer
    for word in ["Paris", "capital of", "  Rome", "東京"]:
        seqs = bad_words_token_ids(tok, [word])
        stripped = word.lstrip()
        plain = tok.encode(stripped, add_special_tokens=False)
        spaced = tok.encode(" " + stripped, add_special_tokens=False)
        assert seqs[0] == plain
        assert seqs[1:] == ([spaced] if spaced[0] != plain[0] and len(spaced) == len(plain)
                            else [])


@pytest.mark.parametrize("path", ROUTES)
def test_empty_values_change_nothing(http, path):
    _, plain = tokens_of(http.post(path, json=body(path)))
    for extra in ({"bad_words": []}, {"bad_words": None}, {"allowed_token_ids": None}):
        assert tokens_of(http.post(path, json=body(path, **extra)))[1] == plain, extra


@pytest.mark.parametrize("path", ROUTES)
def test_bad_values_are_a_400_naming_the_field(http, path):
    vocab = http.vocab
    cases = [
        ("allowed_token_ids", []),
        ("allowed_token_ids", [1, -1]),
        ("allowed_token_ids", [1, vocab]),
        ("allowed_token_ids", [1] * (vocab + 1)),
        ("allowed_token_ids", "1, 2"),
        ("bad_words", ["x"] * (MAX_BAD_WORDS + 1)),
        ("bad_words", ["x" * (MAX_BAD_WORD_CHARS + 1)]),
        ("bad_words", [""]),
        ("bad_words", ["   "]),
        ("bad_words", "Paris"),
        ("bad_words", ["\ud800"]),  # no UTF-8: the tokenizer cannot take it
    ]
    for field, value in cases:
        for stream in (False, True):
            r = post(http, path, body(path, **{field: value, "stream": stream}))
            assert_error(r, 400, field)
    # every allowed token a one-token bad word: nothing could be generated
    word, ids = next((w, i) for w, i in (_a_word_for(http.tokenizer, t)
                                         for t in range(100, vocab)) if [len(x) for x in i] == [1])
    assert_error(post(http, path, body(path, bad_words=[word], allowed_token_ids=ids[0])),
                 400, "allowed_token_ids")
    # at the caps: served
    tokens_of(http.post(path, json=body(path, bad_words=["x" * MAX_BAD_WORD_CHARS]
                                        + ["y"] * (MAX_BAD_WORDS - 1))))
    tokens_of(http.post(path, json=body(path, allowed_token_ids=list(range(vocab)))))
    # and the engine serves on
    assert len(tokens_of(http.post(path, json=body(path)))[1]) == 8


@pytest.mark.parametrize("path", ROUTES)
def test_the_fields_are_no_longer_refused_as_unsupported(http, path):
    r = http.post(path, json=body(path, bad_words=["Paris"], allowed_token_ids=[1, 2]))
    assert r.status_code == 200, r.text
    assert set(r.json()["choices"][0]["token_ids"]) <= {1, 2}


def test_bad_words_need_a_tokenizer_and_allowed_ids_do_not():
    engine = Engine(EngineConfig(model="preset:llama-tiny", load_format="random",
                                 num_kv_blocks=128, device="cpu", seed=0))
    assert engine.tokenizer is None
    with running_server(build_app(AsyncEngine(engine), ["tiny"])) as url, \
            httpx.Client(base_url=url, timeout=60) as http:
        r = http.post("/v1/completions", json=body("/v1/completions", bad_words=["a"]))
        assert_error(r, 400, "bad_words")
        _, got = tokens_of(http.post("/v1/completions", json=body(
            "/v1/completions", allowed_token_ids=[3, 4])))
        assert set(got) <= {3, 4}
