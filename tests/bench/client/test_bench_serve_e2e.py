"""`kvserve bench serve` against a real kvserve server with the tiny random model."""
from __future__ import annotations

import argparse
import json

import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.server.entrypoints import cli
from kvserve.server.entrypoints.app import build_app
from tests.support.server import running_server


@pytest.fixture(scope="module")
def url(tiny_engine_factory):
    with running_server(build_app(AsyncEngine(tiny_engine_factory("llama")), ["tiny"])) as u:
        yield u


def bench(url: str, *flags: str) -> int:
    return cli.main(["bench", "serve", "--base-url", url, "--disable-tqdm", *flags])


def test_random_completions_8_requests(url, tmp_path, capsys):
    path = tmp_path / "r.json"
    assert bench(url, "--num-prompts", "8", "--input-len", "16", "--output-len", "8",
                 "--range-ratio", "0.5", "--percentiles", "50,90,99",
                 "--goodput", "ttft:60000", "tpot:60000", "--save-result", str(path)) == 0
    doc = json.loads(path.read_text())
    assert doc["completed"] == 8 and doc["failed"] == 0 and doc["errors"] == []
    assert doc["model"] == "tiny" and doc["label"] == "tiny"  # found via /v1/models
    assert doc["request_goodput"] == pytest.approx(doc["request_throughput"])
    assert doc["total_output_tokens"] == sum(  # ignore_eos: every request runs its length
        s.turns[0].output_len for s in _sessions(doc))
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert doc[f"{stat}_{metric}_ms"] is not None and doc[f"{stat}_{metric}_ms"] >= 0
    assert doc["config"]["num_prompts"] == 8 and doc["config"]["request_rate"] == "inf"
    assert {"commit", "command", "python"} <= doc["provenance"].keys()
    assert doc["server"]["models"]["data"][0]["id"] == "tiny"
    assert "Serving Benchmark Result" in capsys.readouterr().out


def _sessions(doc):
    """The workload the run sent, rebuilt from its saved flags (same seed)."""
    from kvserve.benchmarks.client.datasets import make_sessions
    from kvserve.benchmarks.client.serve_cmd import dataset_spec

    return make_sessions(dataset_spec(argparse.Namespace(**doc["config"])))


def test_prefix_token_ids_reach_the_server_exactly(url, tmp_path):
    path = tmp_path / "p.json"
    assert bench(url, "--dataset", "prefix", "--token-ids", "--vocab-size", "300",
                 "--num-prompts", "4", "--num-prefixes", "2", "--prefix-len", "32",
                 "--input-len", "8", "--output-len", "4", "--request-rate", "50",
                 "--save-result", str(path)) == 0
    doc = json.loads(path.read_text())
    assert doc["completed"] == 4 and doc["total_input_tokens"] == 4 * (32 + 8)
    assert doc["total_output_tokens"] == 16


def test_chat_conversation_sweep_and_plots(url, tmp_path):
    sweep = tmp_path / "sweep.json"
    assert bench(url, "--endpoint", "/v1/chat/completions", "--dataset", "conversation",
                 "--num-prompts", "2", "--turns", "2", "--input-len", "6",
                 "--output-len", "4", "--sweep-concurrency", "1,2", "--label", "chat",
                 "--save-result", str(sweep)) == 0
    doc = json.loads(sweep.read_text())
    assert [r["max_concurrency"] for r in doc["runs"]] == [1, 2]
    assert all(r["completed"] == 4 and r["total_output_tokens"] == 16 for r in doc["runs"])
    pytest.importorskip("matplotlib")
    out = tmp_path / "plot.png"
    single = tmp_path / "single.json"
    single.write_text(json.dumps({**doc["runs"][0], "label": "one"}))
    assert cli.main(["bench", "plot", str(sweep), str(single), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
