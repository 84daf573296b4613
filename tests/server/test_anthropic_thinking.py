"""`thinking` on /v1/messages: the reasoning split (--reasoning-parser qwen3) as
thinking content blocks, whole and streamed (thinking_delta before text_delta), the
same split /v1/chat/completions gives as reasoning_content; thinking disabled turns
the template's enable_thinking off. On a tiny random Qwen3-architecture model whose
vocabulary has <think> and </think> as tokens (tests/server/test_reasoning_api.py's),
a logit bias making </think> likely."""
from __future__ import annotations

import anthropic
import httpx
import pytest
from transformers import AutoTokenizer

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from kvserve.server.config import ServerConfig
from kvserve.server.entrypoints.app import build_app
from tests.server.test_reasoning_api import MESSAGES, QWEN3_SHAPED
from tests.support.anthropic_sse import message, typed_events
from tests.support.server import running_server
from tests.support.tiny_models import make_tiny_model

MODEL = "tiny-qwen3-thinking"
THINK = {"type": "enabled", "budget_tokens": 1024}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-thinking"), arch="qwen3",
                           extra_tokens=("<think>", "</think>"))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.chat_template = QWEN3_SHAPED
    tokenizer.save_pretrained(str(path))
    engine = Engine(EngineConfig(model=str(path), num_kv_blocks=256))
    app = build_app(AsyncEngine(engine), [MODEL],
                    config=ServerConfig(reasoning_parser="qwen3"))
    with running_server(app) as url:
        yield url, tokenizer


def biased(tokenizer, seed: int) -> dict:
    end = tokenizer.convert_tokens_to_ids("</think>")
    return {"model": MODEL, "max_tokens": 40, "temperature": 1.0, "seed": seed,
            "ignore_eos": True, "logit_bias": {str(end): 4}, "messages": MESSAGES}


def chat_message(url: str, body: dict, **extra) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", json={**body, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]


@pytest.mark.parametrize("seed", [0, 2])  # seeds whose output thinks first
def test_thinking_blocks_are_the_reasoning_split_whole_and_streamed(served, seed):
    url, tokenizer = served
    body = biased(tokenizer, seed)
    expected = chat_message(url, body)
    assert expected["reasoning_content"] and expected["content"]  # the case under test
    whole = message(httpx.post(f"{url}/v1/messages", json={**body, "thinking": THINK},
                               timeout=60))
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == expected["reasoning_content"]
    assert whole.content[1].text == expected["content"]
    raw = httpx.post(f"{url}/v1/messages", json={**body, "thinking": THINK, "stream": True},
                     timeout=60)
    events = [e for e in typed_events(raw.content) if not isinstance(e, dict)]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    kinds = [d.type for d in deltas]
    assert kinds == sorted(kinds, reverse=True)  # every thinking_delta before any text
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == (
        expected["reasoning_content"])
    assert "".join(d.text for d in deltas if d.type == "text_delta") == expected["content"]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text"]


def test_the_sdks_stream_helper_reads_thinking(served):
    url, tokenizer = served
    body = biased(tokenizer, 0)
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=60)
    extra = {k: body[k] for k in ("temperature", "seed", "ignore_eos", "logit_bias")}
    with client.messages.stream(model=MODEL, messages=MESSAGES, max_tokens=40,
                                thinking=THINK, extra_body=extra) as stream:
        thoughts = [e.thinking for e in stream if e.type == "thinking"]
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == "".join(
        thoughts)
    assert final.content[0].signature == ""  # nothing signed: sent back, it is plain text


def test_thinking_disabled_reaches_the_template(served):
    url, tokenizer = served
    body = {**biased(tokenizer, 0), "temperature": 0}
    expected = chat_message(url, body, chat_template_kwargs={"enable_thinking": False})
    assert expected["reasoning_content"] is None
    off = message(httpx.post(f"{url}/v1/messages",
                             json={**body, "thinking": {"type": "disabled"}}, timeout=60))
    assert [b.type for b in off.content] == ["text"]
    assert off.content[0].text == expected["content"]
    on = httpx.post(f"{url}/v1/messages/count_tokens", timeout=60, json={
        "model": MODEL, "messages": MESSAGES, "thinking": THINK}).json()["input_tokens"]
    assert off.usage.input_tokens + off.usage.cache_read_input_tokens > on  # the empty thought


def test_omitted_thinking_keeps_the_block_but_not_its_text(served):
    url, tokenizer = served
    body = biased(tokenizer, 0)
    shown = message(httpx.post(f"{url}/v1/messages", json={**body, "thinking": THINK},
                               timeout=60))
    omitted = message(httpx.post(f"{url}/v1/messages", json={
        **body, "thinking": {**THINK, "display": "omitted"}}, timeout=60))
    assert [b.type for b in omitted.content] == ["thinking", "text"]
    assert omitted.content[0].thinking == "" and omitted.content[1].text == (
        shown.content[1].text)
