"""Arrival processes: all at once, Poisson, gamma with burstiness."""
from __future__ import annotations

import math
import statistics

import pytest

from kvserve.benchmarks.client.arrivals import intervals, start_offsets


def test_infinite_rate_sends_everything_at_once():
    assert start_offsets(5, math.inf) == [0.0] * 5


def test_poisson_mean_interval_is_one_over_rate():
    gaps = intervals(20000, rate=4.0, seed=1)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    # exponential: the standard deviation equals the mean
    assert statistics.pstdev(gaps) == pytest.approx(0.25, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_keeps_the_rate_and_changes_the_spread(burstiness):
    gaps = intervals(20000, rate=2.0, burstiness=burstiness, seed=2)
    assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.05)
    # gamma(k, theta): coefficient of variation 1/sqrt(k); burstier is more uneven
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_offsets_start_at_zero_and_accumulate():
    gaps = intervals(3, rate=1.0, seed=5)
    assert start_offsets(4, rate=1.0, seed=5) == pytest.approx(
        [0.0, gaps[0], gaps[0] + gaps[1], sum(gaps)])


def test_seeded():
    assert intervals(10, 3.0, 0.5, seed=9) == intervals(10, 3.0, 0.5, seed=9)
    assert intervals(10, 3.0, 0.5, seed=9) != intervals(10, 3.0, 0.5, seed=10)


@pytest.mark.parametrize("rate,burstiness", [(0, 1), (-1, 1), (1, 0)])
def test_rejects_non_positive(rate, burstiness):
    with pytest.raises(ValueError):
        intervals(3, rate, burstiness)
