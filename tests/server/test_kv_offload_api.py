"""The second KV tier through the API, on the default model: a chat whose history
other chats pushed out of a small KV cache gets it back as cached_tokens (and the
external_prefix_cache_hits counter), with the reply a recompute gives."""
from __future__ import annotations

import re

import pytest

from kvserve.engine.config.engine_config import EngineConfig
from kvserve.engine.core.engine import Engine
from tests.support.server import engine_http_client

MODEL = "smol"
TOPICS = ["the history of the printing press", "how tides follow the moon",
          "why bread rises", "the life of honeybees", "how glaciers carve valleys"]


def long_message(topic: str) -> str:
    return (f"Here are my notes on {topic}. " + " ".join(
        f"Point {i}: {topic} matters because of detail number {i}." for i in range(14))
        + " Summarise them.")


def turns(http) -> tuple[str, dict, int]:
    """The second turn's reply, its usage, and the tier's hits from /metrics."""
    def chat(messages, n):
        r = http.post("/v1/chat/completions", json=dict(
            model=MODEL, messages=messages, max_tokens=n, temperature=0))
        assert r.status_code == 200, r.text
        return r.json()

    history = [{"role": "user", "content": long_message(TOPICS[0])}]
    reply = chat(history, 12)["choices"][0]["message"]["content"]
    for topic in TOPICS[1:]:  # other chats take the cache
        chat([{"role": "user", "content": long_message(topic)}], 2)
    second = chat(history + [{"role": "assistant", "content": reply},
                             {"role": "user", "content": "And in one sentence?"}], 12)
    metrics = http.get("/metrics").text
    hits = re.search(r'^kvserve:external_prefix_cache_hits_total\{[^}]*\} (\S+)$',
                     metrics, re.M)
    return second["choices"][0]["message"]["content"], second["usage"], \
        int(float(hits.group(1)))


@pytest.fixture(scope="module")
def replies(default_model_dir):
    def run(**tier):
        engine = Engine(EngineConfig(model=str(default_model_dir), num_kv_blocks=48,
                                     dtype="float32", **tier))
        with engine_http_client(engine, MODEL) as http:
            out = turns(http)
            kv = engine.scheduler.kv
            assert kv.num_free_blocks == kv.num_blocks  # nothing held after
            return out

    return run(), run(kv_offload_bytes=256 << 20)


def test_an_evicted_chat_history_comes_back_as_cached_tokens(replies):
    (plain, plain_usage, plain_hits), (tiered, usage, hits) = replies
    assert tiered == plain
    # Without the tier only the chat template's opening block (every chat's) is found.
    plain_cached = plain_usage["prompt_tokens_details"]["cached_tokens"]
    assert plain_cached <= 32 and plain_hits == 0
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= plain_cached + 160 and cached % 16 == 0  # the first turn's prompt
    assert hits == cached - plain_cached  # loaded back from the tier
