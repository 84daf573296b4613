"""The metrics' parts on their own: vLLM's bucket bounds, the per-token latency
accounting of RequestClock, and the periodic stats line."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from kvserve.engine.client.messages import StepReport
from kvserve.engine.platform.outputs import RequestOutput
from kvserve.server.metrics import buckets as b
from kvserve.server.metrics.frontend import FrontendHistograms, RequestClock, current_clock
from kvserve.server.metrics.log import StatsLogger


def test_bucket_bounds_are_vllms():
    assert (len(b.TTFT_SECONDS), b.TTFT_SECONDS[0], b.TTFT_SECONDS[-1]) == (22, 0.001, 2560.0)
    assert (len(b.ITL_SECONDS), b.ITL_SECONDS[0], b.ITL_SECONDS[-1]) == (19, 0.01, 80.0)
    assert (len(b.REQUEST_SECONDS), b.REQUEST_SECONDS[0], b.REQUEST_SECONDS[-1]) == (
        21, 0.3, 7680.0)
    assert b.ITERATION_TOKENS[-1] == 16384
    assert b.one_two_five(100) == [1, 2, 5, 10, 20, 50, 100]
    assert b.one_two_five(4096) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    for bounds in (b.TTFT_SECONDS, b.ITL_SECONDS, b.REQUEST_SECONDS, b.ITERATION_TOKENS):
        assert list(bounds) == sorted(set(bounds))


def _hist_samples(registry: CollectorRegistry, name: str) -> dict:
    """{(sample suffix, le): value} of one histogram."""
    fam = next(f for f in registry.collect() if f.name == "kvserve:" + name)
    return {(s.name[len(fam.name):], s.labels.get("le")): s.value for s in fam.samples}


def _delta(index, num_tokens, finish=None):
    return SimpleNamespace(index=index, num_tokens=num_tokens, finish_reason=finish)


def test_a_chunk_of_k_tokens_counts_k_latencies_of_its_gap_over_k():
    registry = CollectorRegistry()
    clock = RequestClock(FrontendHistograms(registry, "m"), arrival=10.0)
    clock.sent([_delta(0, 2), _delta(1, 1)], now=10.3)  # first chunks: TTFT 0.3 each
    clock.sent([_delta(0, 5)], now=10.6)  # 3 tokens after 0.3 s: 3 x 0.1
    clock.sent([_delta(1, 2, "length"), _delta(0, 5, "stop")], now=11.0)
    ttft = _hist_samples(registry, "time_to_first_token_seconds")
    assert (ttft[("_count", None)], ttft[("_sum", None)]) == (2, pytest.approx(0.6))
    assert ttft[("_bucket", "0.25")] == 0 and ttft[("_bucket", "0.5")] == 2
    itl = _hist_samples(registry, "inter_token_latency_seconds")
    # choice 0: one 0 (its first chunk had 2 tokens) and three 0.1; choice 1: one 0.7
    assert itl[("_count", None)] == 5
    assert itl[("_sum", None)] == pytest.approx(0.3 + 0.7)
    assert itl[("_bucket", "0.01")] == 1 and itl[("_bucket", "0.1")] == 4
    e2e = _hist_samples(registry, "e2e_request_latency_seconds")
    assert (e2e[("_count", None)], e2e[("_sum", None)]) == (2, pytest.approx(2.0))


def test_outside_a_request_the_clock_records_nothing():
    current_clock().sent([_delta(0, 1, "stop")])  # no error, nothing to record into


def _report(**kw) -> StepReport:
    return StepReport(**kw)


def test_the_stats_line_every_interval_while_busy(caplog):
    now = [100.0]
    logger = StatsLogger(interval=10.0, clock=lambda: now[0])
    outs = [RequestOutput("a", new_token_ids=[1]), RequestOutput("b", new_token_ids=[2])]
    with caplog.at_level(logging.INFO, logger="kvserve.stats"):
        logger(_report(prompt_tokens=300, step_start=100.0, running=2, prefix_queries=300,
                       prefix_hits=75, kv_usage=0.125))
        for _ in range(9):  # 9 more steps, 2 tokens each, one a second
            now[0] += 1
            logger(_report(outputs=outs, step_start=now[0] - 1, running=2, kv_usage=0.125))
        assert caplog.messages == []
        now[0] += 1
        logger(_report(outputs=outs, step_start=now[0] - 1, running=2, waiting=1,
                       kv_usage=0.25))
    assert caplog.messages == [
        "Avg prompt throughput: 30.0 tokens/s, Avg generation throughput: 2.0 tokens/s, "
        "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, "
        "Prefix cache hit rate: 25.0%"]


def test_the_tail_of_a_busy_period_is_logged_then_silence(caplog):
    now = [0.0]
    logger = StatsLogger(interval=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="kvserve.stats"):
        logger(_report(prompt_tokens=8, step_start=0.0, running=1))
        now[0] = 2.0
        logger(_report(outputs=[RequestOutput("a", new_token_ids=[1], finished=True)],
                       step_start=1.0))  # the last step: nothing runs or waits
        assert len(caplog.messages) == 1 and "prompt throughput: 4.0" in caplog.messages[0]
        now[0] = 50.0
        logger(_report())  # an idle iteration (e.g. a stop command): no line
    assert len(caplog.messages) == 1


def test_a_line_written_while_compiling_says_the_steps_are_eager(caplog):
    now = [0.0]
    logger = StatsLogger(interval=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="kvserve.stats"):
        logger(_report(prompt_tokens=8, step_start=0.0, running=1, warming_up=True))
        now[0] = 11.0
        logger(_report(step_start=10.0, running=1, warming_up=True))
        now[0] = 12.0
        logger(_report(outputs=[RequestOutput("a", new_token_ids=[1], finished=True)],
                       step_start=11.0))  # compiled by now
        now[0] = 13.0
        for _ in range(3):  # idle reports while warming up: no line
            logger(_report(warming_up=True))
    first, second = caplog.messages
    assert first.endswith("(eager: compiling)") and "(eager" not in second
