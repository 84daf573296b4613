"""The engine page's data, piece by piece: the block map's coarsening, block tables
as runs, and the history's points worked out from running totals."""
from __future__ import annotations

from prometheus_client import CollectorRegistry

from kvserve.server.engine_view.history import EngineHistory
from kvserve.server.engine_view.snapshot_json import coarsen, runs
from kvserve.server.metrics.frontend import FrontendHistograms
from tests.engine.test_messages import RecordingClient


def test_a_map_that_fits_is_sent_as_it_is():
    assert coarsen(b"0123401234", max_cells=10) == ("0123401234", 1)


def test_a_larger_map_keeps_the_most_telling_state_of_each_group():
    cells, per_cell = coarsen(b"0001" + b"2000" + b"0000" + b"43", max_cells=4)
    assert (cells, per_cell) == ("1204", 4)


def test_block_tables_travel_as_runs():
    assert runs([]) == []
    assert runs([3, 4, 5, 9, 10, 2]) == [[3, 3], [9, 2], [2, 1]]


def test_a_point_is_what_the_interval_added():
    engine = RecordingClient()
    latency = FrontendHistograms(CollectorRegistry(), "m")
    history = EngineHistory(engine, latency, window=3)
    empty = history.sample()
    assert empty["ttft"] is None and empty["itl"] is None  # nothing to average: a gap
    assert empty["prefill_per_step"] is None and empty["tokens_per_s"] == 0
    stats = engine.stats
    latency.ttft.observe(0.2)
    latency.ttft.observe(0.4)
    latency.itl.observe(0.05)
    stats.steps, stats.step_tokens, stats.prompt_tokens_computed = 4, 110, 100
    stats.generation_tokens, stats.prefix_queries, stats.prefix_hits = 10, 100, 25
    stats.spec.num_draft_tokens, stats.spec.num_accepted_tokens = 8, 6
    point = history.sample()
    assert abs(point["ttft"] - 0.3) < 1e-9 and abs(point["itl"] - 0.05) < 1e-9
    assert point["prefill_per_step"] == 25 and point["decode_per_step"] == 2.5
    assert (point["prefix_queries"], point["prefix_hits"]) == (100, 25)
    assert (point["draft_tokens"], point["accepted_tokens"]) == (8, 6)
    assert point["tokens_per_s"] > 0
    again = history.sample()  # nothing new happened
    assert again["ttft"] is None and again["prefix_queries"] == 0
    history.sample()
    assert len(history.points) == 3  # the window keeps the newest
