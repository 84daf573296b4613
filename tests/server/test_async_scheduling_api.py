"""Async scheduling behind the HTTP API: the same text as the synchronous engine for
plain, streamed, n > 1 and logprobs requests served together, the serve flag that
turns it on, and the message when it is combined with speculative decoding."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvserve.server.entrypoints.cli import build_parser, engine_config_from_args, main
from tests.support.server import engine_http_client

BODIES = [
    {"prompt": "one two three four", "max_tokens": 24},
    {"prompt": "a b c d e f g h i j", "max_tokens": 17, "temperature": 0.9, "seed": 3},
    {"prompt": "the quick brown fox", "max_tokens": 12, "n": 2, "temperature": 1.0,
     "seed": 5},
    {"prompt": "hello there", "max_tokens": 9, "logprobs": 2},
    {"prompt": "stream me along please", "max_tokens": 20, "stream": True},
]


def texts(http) -> list:
    """Every body's choices' texts, the requests sent at once."""
    def send(body):
        body = {"model": "tiny", "ignore_eos": True, "temperature": 0, **body}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        if body.get("stream"):
            events = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            return ["".join(e["choices"][0]["text"] for e in events if e["choices"])]
        return [(c["index"], c["text"], c["finish_reason"]) for c in r.json()["choices"]]
    with ThreadPoolExecutor(len(BODIES)) as pool:
        return list(pool.map(send, BODIES))


def test_same_text_as_the_synchronous_engine(tiny_engine_factory):
    with engine_http_client(tiny_engine_factory(dtype="float32"), "tiny") as http:
        want = texts(http)
    engine = tiny_engine_factory(dtype="float32", async_scheduling=True)
    with engine_http_client(engine, "tiny") as http:
        assert texts(http) == want
        assert texts(http) == want  # and again, on a warm prefix cache
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_serve_flag_turns_it_on():
    assert engine_config_from_args(build_parser().parse_args(
        ["serve", "--async-scheduling", "true"]), "/m").async_scheduling is True
    assert engine_config_from_args(build_parser().parse_args(["serve"]),
                                   "/m").async_scheduling is False


def test_not_with_speculative_decoding_stops_the_server_with_a_message():
    with pytest.raises(SystemExit, match="async scheduling does not work with speculative"):
        main(["serve", "--model", "preset:llama-tiny", "--load-format", "random",
              "--async-scheduling", "true", "--speculative-method", "ngram"])
