"""Speculative decoding behind the HTTP API: the same text with and without it, the
per-request opt-out, the kvserve:spec_decode_* counters on /metrics, and the serve
flags that turn it on."""
from __future__ import annotations

import json
import re

import pytest

from kvserve.engine.config.engine_config import SpeculativeConfig
from kvserve.server.entrypoints.cli import build_parser, engine_config_from_args, main
from tests.support.server import engine_http_client

PROMPT = "0 1 2 3 4 5 6 7 8 9 10 11 12 13 0 1 2 3 4 5 6 7 8 9 10 11 12 13 0 1 2 3"


def counters(text: str) -> dict[str, float]:
    found = re.findall(r'^kvserve:(spec_decode_\w+)_total\{[^}]*\} (\S+)$', text, re.M)
    return {name: float(value) for name, value in found}


def complete(http, **extra) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 32, "temperature": 0,
            "ignore_eos": True, **extra}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_same_text_opt_out_and_metrics(tiny_engine_factory):
    plain = tiny_engine_factory(dtype="float32")
    with engine_http_client(plain, "tiny") as http:
        want = complete(http)["text"]
        assert counters(http.get("/metrics").text)["spec_decode_num_drafts"] == 0
    spec = SpeculativeConfig("ngram", num_tokens=4, ngram_min=1)
    engine = tiny_engine_factory(dtype="float32", speculative=spec)
    with engine_http_client(engine, "tiny") as http:
        assert complete(http, speculative=False)["text"] == want
        assert engine.speculator.stats.num_drafts == 0  # opted out
        assert complete(http)["text"] == want
        stream = http.post("/v1/completions", json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 32, "temperature": 0,
            "ignore_eos": True, "stream": True})
        events = [json.loads(line[6:]) for line in stream.text.splitlines()
                  if line.startswith("data: {")]
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == want
        text = http.get("/metrics").text
    c, s = counters(text), engine.speculator.stats
    assert c["spec_decode_num_drafts"] == s.num_drafts > 0
    assert c["spec_decode_num_draft_tokens"] == s.num_draft_tokens
    assert c["spec_decode_num_accepted_tokens"] == s.num_accepted_tokens > 0
    per_pos = re.findall(r'^kvserve:spec_decode_num_accepted_tokens_per_pos_total'
                         r'\{[^}]*position="(\d+)"\} (\S+)$', text, re.M)
    assert sum(float(v) for _, v in per_pos) == s.num_accepted_tokens
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_serve_flags_build_the_speculative_config():
    args = build_parser().parse_args([
        "serve", "--speculative-method", "early-exit", "--num-speculative-tokens", "3",
        "--draft-layers", "2", "--speculative-disable-batch-size", "16"])
    spec = engine_config_from_args(args, "/m").speculative
    assert spec == SpeculativeConfig("early-exit", num_tokens=3, draft_layers=2,
                                     disable_batch_size=16)
    assert engine_config_from_args(build_parser().parse_args(["serve"]), "/m").speculative \
        is None


def test_contradictory_speculative_flags_stop_the_server_with_a_message():
    with pytest.raises(SystemExit, match="ngram_min <= ngram_max"):
        main(["serve", "--model", "preset:llama-tiny", "--load-format", "random",
              "--speculative-method", "ngram", "--ngram-prompt-lookup-min", "5"])
