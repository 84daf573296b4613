"""Fields kvserve does not support yet are refused with a 400 naming them when they
would change the output (LangChain's bind_tools / with_structured_output used to get
plain text back and a silent 200); sent with a value that changes nothing, or when
they never change the output, they pass."""
from __future__ import annotations

import httpx
import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.server.entrypoints.app import build_app
from kvserve.server.unsupported_fields import CHAT_FIELDS, COMPLETION_FIELDS
from tests.support.http import assert_error, parse_sse
from tests.support.server import running_server

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}}}}}
# A value of each field that would change the output, per route (structured
# outputs are supported: tests/server/test_structured_outputs.py).
SHARED = {
    "truncate_prompt_tokens": 4, "logits_processors": ["my.proc"],
    "logprob_token_ids": [1, 2], "thinking_token_budget": 16,
    "repetition_detection": {"min_count": 2}, "return_tokens_as_token_ids": True,
    "spaces_between_special_tokens": False,
}
CHANGING = {
    "/v1/completions": {**SHARED, "best_of": 3, "suffix": "the end"},
    "/v1/chat/completions": {
        **SHARED, "functions": [TOOL["function"]], "function_call": {"name": "get_weather"},
        "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"},
        "web_search_options": {"search_context_size": "low"}, "echo": True,
        "add_special_tokens": True, "documents": [{"title": "a", "text": "b"}],
        "include_reasoning": False,
    },
}
# Values that leave the output as it is: clients send such defaults.
UNCHANGING = {
    "/v1/completions": {"best_of": 1, "suffix": "", "response_format": {"type": "text"},
                        "use_beam_search": False, "bad_words": [], "prompt_logprobs": None,
                        "spaces_between_special_tokens": True},
    "/v1/chat/completions": {"tools": [], "tool_choice": "none", "functions": [],
                             "function_call": "auto", "modalities": ["text"], "audio": None,
                             "response_format": {"type": "text"}, "echo": False,
                             "add_special_tokens": False, "include_reasoning": True},
}
# Never change the output (as vLLM ignores `user`): accepted and ignored.
IGNORED = {"user": "u-1", "service_tier": "auto", "store": False, "metadata": {"k": "v"},
           "parallel_tool_calls": True, "prediction": {"type": "content", "content": "x"},
           "some_future_field": 1}


def base(path: str) -> dict:
    body = {"model": "tiny", "max_tokens": 3, "temperature": 0}
    if path == "/v1/completions":
        return {**body, "prompt": "The capital of France is"}
    return {**body, "messages": [{"role": "user", "content": "What is the capital?"}]}


@pytest.fixture(scope="module")
def http(tiny_engine_factory):
    engine = tiny_engine_factory("llama")
    with running_server(build_app(AsyncEngine(engine), ["tiny"])) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        client.engine = engine
        yield client


def test_every_refused_field_is_tested():
    assert set(CHANGING["/v1/completions"]) == set(COMPLETION_FIELDS)
    assert set(CHANGING["/v1/chat/completions"]) == set(CHAT_FIELDS)


@pytest.mark.parametrize("path, field", [(p, f) for p, fields in CHANGING.items()
                                         for f in fields])
@pytest.mark.parametrize("stream", [False, True])
def test_a_field_that_would_change_the_output_is_refused(http, path, field, stream):
    body = {**base(path), field: CHANGING[path][field], "stream": stream}
    err = assert_error(http.post(path, json=body), 400, field, "unsupported_parameter")
    assert f"`{field}`" in err["message"] and "not supported" in err["message"]


@pytest.mark.parametrize("path, field", [(p, f) for p, fields in UNCHANGING.items()
                                         for f in fields])
def test_a_value_that_changes_nothing_passes(http, path, field):
    plain = http.post(path, json=base(path)).json()
    r = http.post(path, json={**base(path), field: UNCHANGING[path][field]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"] == plain["choices"]


@pytest.mark.parametrize("path", list(CHANGING))
def test_fields_that_never_change_the_output_are_ignored(http, path):
    plain = http.post(path, json=base(path)).json()
    r = http.post(path, json={**base(path), **IGNORED})
    assert r.status_code == 200, r.text
    assert r.json()["choices"] == plain["choices"]


def test_best_of_equal_to_n_passes(http):
    r = http.post("/v1/completions", json={**base("/v1/completions"), "n": 2, "best_of": 2})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


def test_langchain_bind_tools_is_served(http):
    """What LangChain's ChatOpenAI(...).bind_tools([...]) sends: tools, no tool_choice
    ("auto"); the tiny model's template knows no tools, so it is told the Hermes
    format (tests/server/test_tools.py checks what comes back)."""
    body = {**base("/v1/chat/completions"), "tools": [TOOL], "stream": False, "n": 1}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("path", list(CHANGING))
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(http, path):
    """vLLM's stream_options.continuous_usage_stats, which kvserve bench serve can ask
    for: supported, not ignored."""
    body = {**base(path), "max_tokens": 5, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = parse_sse(http.post(path, json=body).content)
    assert all("usage" in c for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1]["usage"]["completion_tokens"] == 5 and not chunks[-1]["choices"]
    plain = parse_sse(http.post(path, json={**body, "stream_options": {
        "include_usage": True}}).content)
    assert not any("usage" in c for c in plain[:-1])
