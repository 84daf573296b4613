"""Metric arithmetic on hand-made timelines, against vLLM's definitions."""
from __future__ import annotations

import random

import pytest

from kvserve.benchmarks.client.metrics import percentile, summarize
from kvserve.benchmarks.client.records import RequestRecord


def rec(times, tokens=None, e2el=None, output=None, prompt=10):
    tokens = tokens or [1] * len(times)
    return RequestRecord(success=True, ttft=times[0], e2el=e2el or times[-1],
                         chunk_times=list(times), chunk_tokens=tokens,
                         output_tokens=output or sum(tokens), prompt_tokens=prompt)


A = rec([0.1, 0.15, 0.25, 0.30], tokens=[1, 1, 2, 1], e2el=0.32)  # 5 tokens
B = rec([0.2, 0.5])  # 2 tokens
C = rec([0.05], e2el=0.06)  # 1 token: no TPOT, no ITL
FAILED = RequestRecord(success=False, ttft=9.0, e2el=9.0, chunk_times=[9.0],
                       chunk_tokens=[1], output_tokens=7, prompt_tokens=100, error="HTTP 500")


def test_itl_splits_a_multi_token_chunk_per_token():
    assert A.itls() == pytest.approx([0.05, 0.05, 0.05, 0.05])
    assert sum(A.itls()) == pytest.approx(A.chunk_times[-1] - A.ttft)
    assert B.itls() == pytest.approx([0.3]) and C.itls() == []


def test_tpot_is_time_after_the_first_token_over_the_rest():
    assert A.tpot() == pytest.approx((0.32 - 0.1) / 4)
    assert B.tpot() == pytest.approx(0.3)
    assert C.tpot() is None


def test_summary_counts_throughputs_and_excludes_failures():
    s = summarize([A, B, C, FAILED], duration=2.0)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["total_output_tokens"] == 8 and s["total_input_tokens"] == 30
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(19.0)
    assert s["errors"] == ["HTTP 500"]


def test_distributions_in_ms():
    s = summarize([A, B, C, FAILED], duration=1.0, percentiles=(50, 99))
    assert s["mean_ttft_ms"] == pytest.approx((100 + 200 + 50) / 3)
    assert s["median_ttft_ms"] == pytest.approx(100)
    assert s["p99_ttft_ms"] == pytest.approx(100 + 100 * 0.98)  # between 100 and 200
    assert s["p50_ttft_ms"] == pytest.approx(100)
    assert s["mean_tpot_ms"] == pytest.approx((55 + 300) / 2)  # C has no TPOT
    assert s["mean_itl_ms"] == pytest.approx((4 * 50 + 300) / 5)
    assert s["median_itl_ms"] == pytest.approx(50)
    assert s["mean_e2el_ms"] == pytest.approx((320 + 500 + 60) / 3)
    assert s["p99_e2el_ms"] == pytest.approx(320 + 180 * 0.98)


def test_nothing_measured_is_none_not_zero():
    s = summarize([C], duration=1.0)
    assert s["mean_tpot_ms"] is None and s["p99_itl_ms"] is None
    assert s["mean_ttft_ms"] == pytest.approx(50)
    assert summarize([], duration=0.0)["request_throughput"] == 0.0


@pytest.mark.parametrize("slos,good", [
    ({"ttft": 150}, 2),  # A, C
    ({"ttft": 150, "tpot": 100}, 2),  # A's TPOT 55; C's one token counts as TPOT 0
    ({"ttft": 150, "tpot": 50}, 1),  # A's 55 fails: only C
    ({"ttft": 1000, "e2el": 400}, 2),  # B's 500 fails
    ({"ttft": 150, "tpot": 100, "e2el": 100}, 1),  # all three: only C
])
def test_goodput_needs_every_slo(slos, good):
    s = summarize([A, B, C, FAILED], duration=2.0, slos_ms=slos)
    assert s["request_goodput"] == pytest.approx(good / 2.0)


def test_no_goodput_key_without_slos():
    assert "request_goodput" not in summarize([A], duration=1.0)


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    for n in (1, 2, 7, 100):
        values = [rng.random() for _ in range(n)]
        for p in (0, 1, 50, 90, 99, 99.9, 100):
            assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)))


def test_tokens_in_chunks_of_unknown_size_are_counted():
    lumpy = rec([0.1, 0.2], output=6)  # usage says 6, the chunks said 1 each
    s = summarize([A, lumpy], duration=1.0)
    assert s["tokens_in_unsized_chunks"] == 4
    assert summarize([A, B], duration=1.0)["tokens_in_unsized_chunks"] == 0
