"""POST /v1/chat/completions against a real uvicorn server running the tiny llama
model (ChatML template). The server's text must equal what the engine generates
offline from the same rendered prompt."""
from __future__ import annotations

import httpx
import openai
import pytest

from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.server.chat_template import render_chat
from tests.support.http import assert_error, parse_sse, wait_idle
from tests.support.server import engine_http_client

MODEL = "tiny-chat"
TIMEOUT = 120.0
MESSAGES = [{"role": "system", "content": "Paged attention stores keys"},
            {"role": "user", "content": "The capital of France is"}]


@pytest.fixture(scope="module")
def srv(tiny_engine_factory):
    with engine_http_client(tiny_engine_factory("llama"), MODEL, TIMEOUT) as http:
        yield http


@pytest.fixture(scope="module")
def client(srv):
    with openai.OpenAI(base_url=str(srv.base_url) + "/v1", api_key="x", timeout=TIMEOUT,
                       max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_engine_factory):
    """messages -> (text, token ids) a separate engine generates, greedy, no EOS stop."""
    engine = tiny_engine_factory("llama")
    tok = engine.tokenizer

    def generate(messages, max_tokens: int, **template_args):
        ids = render_chat(tok, messages, **template_args)
        out = engine.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                    ignore_eos=True))[0]
        return tok.decode(out, skip_special_tokens=True), ids

    return generate


def chat(srv, **body) -> httpx.Response:
    body.setdefault("model", MODEL)
    body.setdefault("messages", MESSAGES)
    return srv.post("/v1/chat/completions", json=body)


def test_sdk_response_matches_offline_engine(client, offline):
    expected, ids = offline(MESSAGES, 12)
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert len(resp.choices) == 1
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == 12


def test_max_completion_tokens_wins_over_max_tokens(srv):
    r = chat(srv, max_completion_tokens=3, max_tokens=9, temperature=0, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def test_stream_framing_role_first_then_content(srv, offline):
    expected, ids = offline(MESSAGES, 10)
    with srv.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": MESSAGES, "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = parse_sse(r.read())
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    first, *content, usage = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(set(c["choices"][0]["delta"]) == {"content"} for c in content)
    assert all(c["choices"][0]["delta"]["content"] for c in content[:-1])  # none empty
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == expected
    assert [c["choices"][0]["finish_reason"] for c in content][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    assert usage["usage"]["prompt_tokens"] == len(ids)


def test_sdk_streaming(client, offline):
    expected, _ = offline(MESSAGES, 8)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == expected


def test_continue_final_message_extends_the_assistant_turn(srv, offline):
    messages = MESSAGES + [{"role": "assistant", "content": "Paris"}]
    args = dict(add_generation_prompt=False, continue_final_message=True)
    expected, ids = offline(messages, 6, **args)
    assert srv.engine.tokenizer.decode(ids).endswith("assistant\nParis")
    r = chat(srv, messages=messages, max_tokens=6, temperature=0, ignore_eos=True, **args)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == expected


def test_text_content_parts_are_joined(srv):
    parts = [{"role": "user", "content": [{"type": "text", "text": "The capital"},
                                          {"type": "text", "text": "of France"}]}]
    plain = [{"role": "user", "content": "The capital\nof France"}]
    a = chat(srv, messages=parts, max_tokens=5, temperature=0).json()
    b = chat(srv, messages=plain, max_tokens=5, temperature=0).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]


def test_usage_reports_prefix_cache_hits(srv):
    messages = [{"role": "user", "content": "Continuous batching keeps the accelerator "
                 "busy by letting requests join and leave. " * 3}]
    first = chat(srv, messages=messages, max_tokens=2).json()["usage"]
    again = chat(srv, messages=messages, max_tokens=2).json()["usage"]
    assert first["prompt_tokens"] == again["prompt_tokens"] > 32
    cached = again["prompt_tokens_details"]["cached_tokens"]
    # every full block of the prompt but the one holding its last token
    assert cached == (again["prompt_tokens"] - 1) // 16 * 16


def test_n_with_seed_is_reproducible(srv):
    body = dict(n=3, seed=7, temperature=1.0, max_tokens=8, ignore_eos=True)
    a, b = chat(srv, **body).json(), chat(srv, **body).json()
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert a["choices"] == b["choices"]
    assert len({c["message"]["content"] for c in a["choices"]}) > 1
    assert a["usage"]["completion_tokens"] == 24


def test_stop_string(srv, offline):
    full, _ = offline(MESSAGES, 12)
    stop = full[3:6]
    r = chat(srv, max_tokens=12, temperature=0, ignore_eos=True, stop=[stop])
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == full[:full.index(stop)]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"add_generation_prompt": True, "continue_final_message": True},
     "continue_final_message"),
    ({"continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message"),  # the last message is not the assistant's
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages"),
    ({"top_logprobs": 3}, None),  # needs logprobs: true
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
])
def test_bad_requests_are_400(srv, body, param):
    err = assert_error(chat(srv, max_tokens=2, **body), 400)
    if param is not None:
        assert err["param"] == param, err


def test_context_overflow_is_400_with_vllm_wording(srv):
    err = assert_error(chat(srv, max_tokens=10**6), 400, param="max_tokens")
    assert "maximum context length" in err["message"]
    err = assert_error(chat(srv, max_completion_tokens=10**6), 400,
                       param="max_completion_tokens")


def test_unknown_model_is_404(srv):
    assert_error(chat(srv, model="nope", max_tokens=2), 404, code="model_not_found")


def test_no_blocks_leak(srv):
    for body in ({"max_tokens": 4}, {"max_tokens": 4, "stream": True}, {"n": 2, "seed": 1}):
        chat(srv, **body)
    assert wait_idle(srv.engine)
