"""The engine page's data, piece by piece: the block map's coarsening, block tables
as runs, the history's points worked out from running totals, a request's progress
and how a sequence that ended is told (an embedding, a Stop)."""
from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from kvserve.engine.client.engine_client import FinishedSequence
from kvserve.engine.client.messages import AbortRequest, StepReport
from kvserve.engine.core.reports import EngineSnapshot
from kvserve.engine.platform.outputs import RequestOutput, RequestTimes
from kvserve.scheduler.sampling_params import SamplingParams
from kvserve.scheduler.snapshot import RequestView, SchedulerSnapshot
from kvserve.server.engine_view.endings import Endings
from kvserve.server.engine_view.history import EngineHistory
from kvserve.server.engine_view.snapshot_json import (coarsen, max_output_tokens, runs,
                                                      snapshot_json)
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


# -- a request's progress and how a sequence ended (snapshot_json, endings.py) -----

def view(phase: str, prompt: int, tokens: int, computed: int, **extra) -> RequestView:
    return RequestView("req-a-0", 0, phase, prompt, tokens, computed, 0, 0, (), **extra)


def snapshot_of(*views: RequestView) -> EngineSnapshot:
    return EngineSnapshot(SchedulerSnapshot(views, 0, 4, b"0000"), False, time.monotonic())


def test_a_prefill_counts_computed_tokens_and_a_decode_its_output_against_max_tokens():
    prefill = view("prefill", prompt=100, tokens=100, computed=40)
    decode = view("decode", prompt=100, tokens=130, computed=129)
    rows = snapshot_json(snapshot_of(prefill, decode), [], max_model_len=1000)["requests"]
    assert [(r["computed_tokens"], r["tokens"]) for r in rows] == [(40, 100), (129, 130)]
    assert [r["output_tokens"] for r in rows] == [0, 30]
    # Without a max_tokens the bound is the room the prompt leaves (what a request
    # sent without max_tokens is given).
    assert [r["max_tokens"] for r in rows] == [900, 900]


def test_max_tokens_is_the_requests_own_within_the_context():
    asked = RequestView("req-a-0", 0, "decode", 100, 130, 129, 0, 0, (), max_tokens=64)
    too_many = RequestView("req-b-0", 0, "decode", 100, 130, 129, 0, 0, (), max_tokens=5000)
    assert max_output_tokens(asked, 1000) == 64
    assert max_output_tokens(too_many, 1000) == 900


async def _leaves_after(engine: RecordingClient, request_id: str, tokens_first: int) -> None:
    """A client that takes `tokens_first` one-token outputs, then goes away (a Stop)."""
    stream = engine.generate(request_id, [1, 2, 3], SamplingParams(max_tokens=50))
    for i in range(tokens_first):
        got = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        engine._on_report(StepReport(outputs=[RequestOutput(request_id, 0, [10 + i])]))
        assert (await got).new_token_ids == [10 + i]
    waiting = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)  # registered, and its add sent, when no token came yet
    waiting.cancel()  # the client is gone: generate() asks the engine to abort
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert isinstance(engine.sent[-1], AbortRequest)


def aborted(engine: RecordingClient, request_id: str, generated: int) -> None:
    """The engine's report of the abort: the tokens it had sampled, as it counts them."""
    engine._on_report(StepReport(outputs=[RequestOutput(
        request_id, 0, [], True, "abort", num_prompt_tokens=3,
        times=RequestTimes(num_generation_tokens=generated))]))


def finished_json(engine: RecordingClient, endings: Endings) -> list[dict]:
    return snapshot_json(snapshot_of(), engine.recent_finished(), max_model_len=64,
                         endings=endings)["finished"]


def test_a_stop_counts_the_tokens_the_client_got_not_those_sampled_after_it_left():
    engine = RecordingClient()
    endings = Endings(engine)
    engine.report_listeners.append(endings)

    async def run():
        # Stopped before any token came; the engine's first token, sampled as the
        # abort was on its way, reaches nobody.
        await _leaves_after(engine, "req-none-0", 0)
        engine._on_report(StepReport(outputs=[RequestOutput("req-none-0", 0, [7])]))
        aborted(engine, "req-none-0", generated=1)
        # Stopped after two tokens; two more sampled before the abort came.
        await _leaves_after(engine, "req-two-0", 2)
        engine._on_report(StepReport(outputs=[RequestOutput("req-two-0", 0, [7])]))
        engine._on_report(StepReport(outputs=[RequestOutput("req-two-0", 0, [8])]))
        aborted(engine, "req-two-0", generated=4)

    asyncio.run(run())
    got = finished_json(engine, endings)
    assert [(f["reason"], f["output_tokens"], f["embedding"]) for f in got] == [
        ("abort", 0, False), ("abort", 2, False)]


def test_an_embedding_ends_as_one_with_its_prompt_and_no_output():
    engine = RecordingClient()
    endings = Endings(engine)
    engine.report_listeners.append(endings)

    async def run():
        stream = engine.generate("req-e-0", [1, 2, 3], SamplingParams(
            max_tokens=1, temperature=0.0, pooling="mean"))
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        # Its one step samples a token (max_tokens 1: finish reason "length").
        engine._on_report(StepReport(outputs=[RequestOutput(
            "req-e-0", 0, [9], True, "length", num_prompt_tokens=3,
            times=RequestTimes(num_generation_tokens=1), embedding=[0.6, 0.8])]))
        assert (await first).embedding == [0.6, 0.8]
        # A generation that ends by length, for contrast.
        stream = engine.generate("req-g-0", [1, 2, 3], SamplingParams(max_tokens=1))
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        engine._on_report(StepReport(outputs=[RequestOutput(
            "req-g-0", 0, [9], True, "length", num_prompt_tokens=3,
            times=RequestTimes(num_generation_tokens=1))]))
        await first

    asyncio.run(run())
    embedding, generation = finished_json(engine, endings)
    assert embedding["embedding"] is True and embedding["reason"] == "length"
    assert (embedding["prompt_tokens"], embedding["output_tokens"]) == (3, 0)
    assert generation["embedding"] is False and generation["output_tokens"] == 1


def test_endings_keep_only_the_last_ones():
    engine = RecordingClient()
    endings = Endings(engine, keep=2)
    for i in range(3):
        endings(StepReport(outputs=[RequestOutput(f"req-{i}-0", 0, [], True, "abort")]))
    assert endings.get("req-0-0", 0) is None
    assert endings.get("req-2-0", 0) is not None
    # Without a note (a page's list older than the notes), the engine's count is told.
    got = snapshot_json(snapshot_of(), [FinishedSequence("req-x-0", 0, "stop", 5, 0.0)],
                        max_model_len=64, endings=endings)["finished"]
    assert got[0]["output_tokens"] == 5 and got[0]["embedding"] is False
