"""A server nobody talks to logs no traffic: no step runs before the first request
(no warm-up or verification step is counted), so the periodic stats line, which
only engine reports feed, stays silent; the first request's tokens are the first
counted."""
from __future__ import annotations

import time

import httpx
import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.engine.client.process_engine import ProcessEngine
from kvserve.engine.config.engine_config import EngineConfig
from tests.server.test_ops_shutdown import serving

STATS_LINE = "Avg prompt throughput"


def test_an_idle_server_logs_no_stats_line(tiny_model_dir, tmp_path):
    log = tmp_path / "server.log"
    with serving(tiny_model_dir("llama"), log) as (_, url):
        time.sleep(3)  # the report said: a line ~2 s after start, with no client
        assert STATS_LINE not in log.read_text(), log.read_text()
        body = {"prompt": "1 2 3", "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        deadline = time.monotonic() + 10
        while STATS_LINE not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
    lines = [line for line in log.read_text().splitlines() if STATS_LINE in line]
    assert len(lines) == 1, lines  # the tail of the one busy period
    assert "Avg generation throughput: 0.0" not in lines[0]


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_an_idle_engine_sends_no_reports(tiny_model_dir, tiny_engine_factory, mode):
    if mode == "thread":
        client = AsyncEngine(tiny_engine_factory("llama"))
    else:
        client = ProcessEngine(EngineConfig(model=str(tiny_model_dir("llama")),
                                            num_kv_blocks=64), tokenizer=None)
    reports = []
    client.report_listeners.append(reports.append)
    client.start()
    try:
        time.sleep(1.5)
        # No step runs; only while the forward pass compiles in the background (the
        # process's default on CPU) does an idle engine report, to say when that ends.
        assert all(r.step_start is None and not r.outputs and not r.step_tokens
                   for r in reports)
        assert all(r.warming_up for r in reports[:-1])
    finally:
        client.shutdown()
