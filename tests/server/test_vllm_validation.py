"""vLLM's request checks, one for one, on both generation routes: each row is a check
vLLM makes (vllm/entrypoints/openai/{chat_completion,completion}/protocol.py,
vllm/sampling_params.py, serving's _validate_chat_template), the body that trips it
and the 400 kvserve answers, naming the field as vLLM's VLLMValidationError does.
Checks kvserve made before this list are in test_bad_input_corpus.py and the route
tests; the ones deliberately left out are listed at the bottom with the reason.
After every refusal the server still answers a plain request."""
from __future__ import annotations

import json

import httpx
import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.server.config import ServerConfig
from kvserve.server.entrypoints.app import build_app
from tests.support.http import assert_error
from tests.support.server import running_server

MODEL = "tiny"
CHAT = [{"role": "user", "content": "hi"}]
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def url(tiny_engine_factory):
    with running_server(build_app(AsyncEngine(tiny_engine_factory()), [MODEL])) as base:
        yield base


# (route, body fields, param, what vLLM says, in part)
CHECKS = [
    ("both", {"stream_options": {"include_usage": True}}, "stream_options",
     "Stream options can only be defined when `stream=True`"),
    ("both", {"min_tokens": 9, "max_tokens": 4}, "min_tokens",
     "min_tokens must be less than or equal to max_tokens=4"),
    ("both", {"repetition_penalty": float("inf")}, "repetition_penalty", "finite"),
    ("both", {"cache_salt": ""}, "cache_salt", "non-empty"),
    ("both", {"cache_salt": "a/b"}, "cache_salt", "must not contain"),
    ("both", {"cache_salt": "x" * 129}, "cache_salt", "at most 128"),
    ("both", {"cache_salt": "\ud800"}, "cache_salt", None),
    ("both", {"priority": 2**63}, "priority", None),
    ("both", {"logprob_token_ids": [1, 2]}, "logprob_token_ids", "not supported"),
    ("both", {"thinking_token_budget": 8}, "thinking_token_budget", "not supported"),
    ("both", {"repetition_detection": {"min_count": 2}}, "repetition_detection",
     "not supported"),
    ("both", {"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids",
     "not supported"),
    ("both", {"spaces_between_special_tokens": False}, "spaces_between_special_tokens",
     "not supported"),
    ("both", {"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object"}}}}, "response_format", "needs a `name`"),
    ("completions", {"prompt": ""}, "prompt", "must not be empty"),
    ("chat", {"chat_template": TEMPLATE}, "chat_template",
     "--trust-request-chat-template is not set"),
    ("chat", {"chat_template_kwargs": {"chat_template": TEMPLATE}}, "chat_template",
     "--trust-request-chat-template is not set"),
    ("chat", {"reasoning_effort": "extreme"}, "reasoning_effort", None),
    ("chat", {"include_reasoning": False}, "include_reasoning", "not supported"),
]


def body_for(route: str, fields: dict) -> tuple[str, dict]:
    base = {"model": MODEL, "max_tokens": 4}
    if route == "completions":
        return "/v1/completions", {**base, "prompt": "hello", **fields}
    return "/v1/chat/completions", {**base, "messages": CHAT, **fields}


def cases():
    for route, fields, param, says in CHECKS:
        for r in (("completions", "chat") if route == "both" else (route,)):
            yield pytest.param(r, fields, param, says, id=f"{r}-{param}-{str(fields)[:30]}")


@pytest.mark.parametrize("route,fields,param,says", list(cases()))
def test_each_vllm_check_is_a_400_naming_the_field(url, route, fields, param, says):
    path, body = body_for(route, fields)
    # json.dumps writes Infinity and escapes a lone surrogate, as a careless client does
    r = httpx.post(url + path, content=json.dumps(body),
                   headers={"content-type": "application/json"}, timeout=30)
    err = assert_error(r, 400, param)
    if says:
        assert says in err["message"], err
    path, ok = body_for(route, {})
    assert httpx.post(url + path, json=ok, timeout=30).status_code == 200


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("field", ["stream", "n", "echo", "logprobs", "return_token_ids",
                                   "ignore_eos", "skip_special_tokens", "min_tokens"])
def test_an_explicit_null_is_the_default_as_in_vllm(url, route, field):
    if route == "chat" and field == "echo":
        pytest.skip("chat has no echo")
    path, body = body_for(route, {field: None})
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_what_vllm_accepts_kvserve_accepts(url):
    # stream_options sent empty, a named tool_choice without "type", reasoning_effort
    # (handed to the template), and a trusted request template
    path, body = body_for("completions", {"stream_options": {}})
    assert httpx.post(url + path, json=body, timeout=30).status_code == 200
    path, body = body_for("chat", {"reasoning_effort": "low", "min_tokens": 4})
    assert httpx.post(url + path, json=body, timeout=30).status_code == 200
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"],
        "additionalProperties": False}}}]
    path, body = body_for("chat", {"tools": tools, "max_tokens": 40,
                                   "tool_choice": {"function": {"name": "f"}}})
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["name"] == "f"


def test_a_trusted_request_template_is_rendered(tiny_engine_factory):
    app = build_app(AsyncEngine(tiny_engine_factory()), [MODEL],
                    config=ServerConfig(trust_request_chat_template=True))
    with running_server(app) as base:
        path, body = body_for("chat", {"chat_template": TEMPLATE})
        r = httpx.post(base + path, json=body, timeout=30)
        assert r.status_code == 200, r.text
        tokens = httpx.post(base + "/tokenize", json={
            "model": MODEL, "messages": CHAT, "chat_template": TEMPLATE}, timeout=30).json()
        assert tokens["count"] == r.json()["usage"]["prompt_tokens"]


def test_tokenize_refuses_an_untrusted_template_too(url):
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": CHAT,
                                            "chat_template": TEMPLATE}, timeout=30)
    assert_error(r, 400, "chat_template")


# vLLM checks deliberately not copied, and why:
# - `stop` holding more than 4 strings (newest vLLM, VLLM_MAX_STOP_STRINGS): older vLLM
#   and many clients send more; kvserve's stop matching costs little per string.
# - `stop` containing "": vLLM refuses it, kvserve drops it (it would match at once).
# - `n` > 1 with temperature 0: OpenAI accepts it and n identical choices are right.
# - `tools: []`: accepted as "no tools", as `functions: []` is.
# - prompt embeddings, multimodal inputs, LoRA, truncation: features kvserve does not
#   have; their fields are refused as unsupported (server/unsupported_fields.py)
#   rather than checked. Beam search (use_beam_search, length_penalty,
#   early_stopping) is supported and its fields checked: tests/server/test_beam_search.py.
#   bad_words and allowed_token_ids are checked as vLLM does:
#   tests/server/test_sampling_extras_api.py.


@pytest.mark.parametrize("calls", [{"a": 1}, [{"id": "c1"}], [{"function": {"arguments": "{}"}}],
                                   ["f"]])
def test_a_malformed_tool_call_in_the_history_is_a_400(url, calls):
    """An assistant message's tool_calls (the schema fuzzer sent a dict: a 500 before)."""
    messages = [*CHAT, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "user", "content": "and?"}]
    path, body = body_for("chat", {"messages": messages})
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("messages"), r.text
    good = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    path, body = body_for("chat", {"messages": [*messages[:1], {**messages[1], "tool_calls": good},
                                                messages[2]]})
    assert httpx.post(url + path, json=body, timeout=30).status_code == 200
    parts = {**messages[1], "tool_calls": good, "content": [{"type": "text", "text": "so"}]}
    path, body = body_for("chat", {"messages": [messages[0], parts, messages[2]]})
    assert httpx.post(url + path, json=body, timeout=30).status_code == 200  # a 500 before
