"""A model served without a tokenizer (a preset with random weights, as GPU benchmarks
use): token-id prompts work and return their tokens via return_token_ids; anything
that needs text is a clear 400. Also return_token_ids on a normal model."""
from __future__ import annotations

import httpx
import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.server.entrypoints.app import build_app
from tests.support.http import assert_error, parse_sse, wait_idle
from tests.support.server import running_server

MODEL = "tiny-preset"
PROMPT = [5, 17, 42, 9]


def _preset_engine() -> Engine:
    return Engine(EngineConfig(model="preset:llama-tiny", load_format="random",
                               num_kv_blocks=128, device="cpu", seed=0))


@pytest.fixture(scope="module")
def served():
    engine = _preset_engine()
    assert engine.tokenizer is None
    with running_server(build_app(AsyncEngine(engine), [MODEL])) as url, \
            httpx.Client(base_url=url, timeout=60) as http:
        yield http, engine


def test_token_prompts_return_token_ids(served):
    http, _ = served
    # a twin: same preset, same seed, so the same random weights
    expected = _preset_engine().generate([PROMPT], SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True))[0]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 6,
                                           "temperature": 0, "ignore_eos": True,
                                           "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == expected and choice["text"] == ""
    assert choice["prompt_token_ids"] == PROMPT


def test_streaming_sends_every_token(served):
    http, _ = served
    with http.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True,
            "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}) as r:
        chunks = parse_sse(r.read())
    content = [c for c in chunks if c["choices"]]
    assert [len(c["choices"][0]["token_ids"]) for c in content] == [1] * 5
    assert chunks[-1]["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "text needs a tokenizer"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/tokenize", {"prompt": "hi"}),
    ("/detokenize", {"tokens": [1, 2]}),
])
def test_text_needs_a_tokenizer(served, path, body):
    http, engine = served
    err = assert_error(http.post(path, json={"model": MODEL, **body}), 400)
    assert "no tokenizer" in err["message"]
    assert wait_idle(engine)


def test_return_token_ids_with_a_tokenizer(tiny_engine_factory):
    engine = tiny_engine_factory("llama")
    ids = engine.tokenizer.encode("The capital of France is")
    with running_server(build_app(AsyncEngine(engine), ["tiny"])) as url, \
            httpx.Client(base_url=url, timeout=60) as http:
        body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        choice = http.post("/v1/completions", json={**body, "prompt": ids}).json()["choices"][0]
        assert engine.tokenizer.decode(choice["token_ids"]) == choice["text"]
        assert choice["prompt_token_ids"] == ids
        chat = http.post("/v1/chat/completions", json={
            **body, "messages": [{"role": "user", "content": "hi"}]}).json()
        assert len(chat["choices"][0]["token_ids"]) == 8
        assert chat["prompt_token_ids"]
