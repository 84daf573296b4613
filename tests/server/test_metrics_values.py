"""/metrics values after a scripted load (engine on a thread): counters equal the
known totals, every histogram counts each finished sequence once, TTFT and e2e fall
in the buckets implied by the test's own timestamps, and the gauges return to 0.

Every model step is slowed by STEP_S, so latencies have known lower bounds."""
from __future__ import annotations

import time

import httpx
import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.server.entrypoints.app import build_app
from tests.support.metrics_script import Scrapes, assert_in_buckets, complete
from tests.support.server import running_server

MODEL = "tiny"
STEP_S = 0.11  # above TTFT's 0.1 bucket: no TTFT can land in it or below
P = "kvserve:"


def _slow_steps(engine, seconds: float):
    run = engine.runner.launch

    def launch(*args, **kwargs):  # between scheduling and the sampled tokens
        time.sleep(seconds)
        return run(*args, **kwargs)

    engine.runner.launch = launch
    return engine


@pytest.fixture(scope="module")
def http(tiny_engine_factory):
    engine = _slow_steps(tiny_engine_factory("llama"), STEP_S)
    with running_server(build_app(AsyncEngine(engine), [MODEL])) as url, \
            httpx.Client(base_url=url, timeout=60) as c:
        yield c


def _prompt(first: int, length: int) -> list[int]:
    """Distinct first tokens keep prompts from sharing cached blocks by chance."""
    return [first] + [(first * 7 + i) % 300 + 3 for i in range(length - 1)]


def _wait_idle(scrapes: Scrapes) -> dict:
    """Running, waiting and KV usage reach 0 once the last report is in."""
    deadline = time.monotonic() + 10
    while True:
        now = scrapes.now()
        gauges = [now[(P + g, ())] for g in ("num_requests_running",
                                              "num_requests_waiting", "kv_cache_usage_perc")]
        if gauges == [0, 0, 0]:
            return now
        assert time.monotonic() < deadline, gauges
        time.sleep(0.05)


def _script(http) -> tuple[list, int]:
    """(requests sent, prefix-cache hits they must have had, in tokens)."""
    probe = complete(http, MODEL, _prompt(40, 5), 6)
    stop_id = probe.ids[0][2]
    long = _prompt(41, 40)  # two full 16-token blocks cached for the second one
    sent = [
        probe,
        complete(http, MODEL, _prompt(42, 5), 4),
        complete(http, MODEL, _prompt(43, 6), 5, stream=True),
        complete(http, MODEL, _prompt(44, 4), 3, n=2),
        complete(http, MODEL, _prompt(45, 3), 3, stream=True, n=2),
        complete(http, MODEL, long, 2),
        complete(http, MODEL, long, 2, stream=True),
        # Greedy repeats the probe, up to the first time it meets the stop token.
        complete(http, MODEL, _prompt(40, 5), 6, stop_token_ids=[stop_id]),
    ]
    assert sent[-1].reasons == ["stop"]
    assert sent[-1].ids == [probe.ids[0][:probe.ids[0].index(stop_id) + 1]]
    return sent, 32


def test_values_after_a_scripted_load(http):
    scrapes = Scrapes(http, MODEL)
    sent, hits = _script(http)
    after = _wait_idle(scrapes)
    seqs = sum(len(s.tokens) for s in sent)
    generated = sum(sum(s.tokens) for s in sent)
    prompts = sum(s.prompt_len for s in sent)

    def grew(name, **labels):
        return scrapes.delta(after, P + name, **labels)

    assert grew("prompt_tokens_total") == prompts
    assert grew("generation_tokens_total") == generated
    assert grew("request_success_total", finished_reason="length") == seqs - 1
    assert grew("request_success_total", finished_reason="stop") == 1
    assert grew("request_success_total", finished_reason="abort") == 0
    assert grew("prefix_cache_queries_total") == prompts
    assert grew("prefix_cache_hits_total") == hits
    assert grew("num_preemptions_total") == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):
        assert grew(name + "_count") == seqs, name
    assert grew("request_generation_tokens_sum") == generated
    assert grew("request_prompt_tokens_sum") == sum(s.prompt_len * len(s.tokens)
                                                    for s in sent)
    # Every step computed its prompt tokens (cache hits excepted) or sampled one token.
    assert grew("iteration_tokens_total_sum") == prompts - hits + generated
    # One wall time a step, each at least the STEP_S every step sleeps.
    steps = grew("engine_step_seconds_count")
    assert steps == grew("iteration_tokens_total_count") > 0
    assert_in_buckets(scrapes.bucket_deltas(after, P + "engine_step_seconds"),
                      [(STEP_S, float("inf"))] * int(steps))
    _check_latencies(scrapes, after, sent, grew)


def _check_latencies(scrapes, after, sent, grew):
    """Spans from the client's timestamps bound each sequence's observations: every
    token takes a step of at least STEP_S, and the server's clock starts after t0 and
    stops before the client has the token."""
    ttft = [(STEP_S, s.first - s.t0) for s in sent for _ in s.tokens]
    e2e = [(n * STEP_S, s.end - s.t0) for s in sent for n in s.tokens]
    assert_in_buckets(scrapes.bucket_deltas(after, P + "time_to_first_token_seconds"), ttft)
    assert_in_buckets(scrapes.bucket_deltas(after, P + "e2e_request_latency_seconds"), e2e)
    tokens = [n for s in sent for n in s.tokens]
    assert grew("inter_token_latency_seconds_count") == sum(n - 1 for n in tokens)
    # Per choice, the ITL samples add up to the time from its first token to its last.
    assert grew("inter_token_latency_seconds_sum") == pytest.approx(
        grew("e2e_request_latency_seconds_sum") - grew("time_to_first_token_seconds_sum"),
        abs=1e-6)
    assert grew("request_prefill_time_seconds_sum") >= len(tokens) * STEP_S
    assert grew("request_decode_time_seconds_sum") >= sum(n - 1 for n in tokens) * STEP_S
    engine_side = sum(grew(f"request_{p}_time_seconds_sum")
                      for p in ("queue", "prefill", "decode"))
    assert engine_side <= grew("e2e_request_latency_seconds_sum")
