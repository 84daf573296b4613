"""GET /metrics: Prometheus text with the engine's load gauges and serving counters
(every series labelled with the served model's name; test_metrics_values.py checks
the histograms and the values in depth)."""
from __future__ import annotations

import time

import httpx
import pytest

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.server.entrypoints.app import build_app
from tests.support.prom_text import parse_samples
from tests.support.server import running_server

MODEL = "tiny"


@pytest.fixture(scope="module")
def http(tiny_engine_factory):
    app = build_app(AsyncEngine(tiny_engine_factory("llama")), [MODEL])
    with running_server(app) as url, httpx.Client(base_url=url, timeout=60) as c:
        yield c


def _samples(http: httpx.Client) -> dict[tuple, float]:
    r = http.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return parse_samples(r.text, MODEL)


def _success(samples: dict, reason: str) -> float:
    return samples.get(("kvserve:request_success_total", (("finished_reason", reason),)), 0)


def test_exposes_the_required_series(http):
    samples = _samples(http)
    for name in ("kvserve:num_requests_running", "kvserve:num_requests_waiting",
                 "kvserve:prompt_tokens_total", "kvserve:generation_tokens_total"):
        assert (name, ()) in samples, sorted(samples)
    for reason in ("stop", "length", "abort", "error"):
        assert ("kvserve:request_success_total", (("finished_reason", reason),)) in samples
    text = http.get("/metrics").text
    assert "# TYPE kvserve:num_requests_running gauge" in text
    assert "# TYPE kvserve:request_success_total counter" in text


def test_counters_follow_the_requests(http):
    before = _samples(http)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    for i, ids in enumerate(prompts):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": ids,
                                               "max_tokens": 3 + i, "ignore_eos": True,
                                               "temperature": 0})
        assert r.status_code == 200, r.text
    after = _samples(http)

    def grew(name):
        return after[(name, ())] - before[(name, ())]

    assert grew("kvserve:prompt_tokens_total") == sum(map(len, prompts))
    assert grew("kvserve:generation_tokens_total") == 3 + 4 + 5
    assert _success(after, "length") - _success(before, "length") == len(prompts)
    assert after[("kvserve:num_requests_running", ())] == 0
    assert after[("kvserve:num_requests_waiting", ())] == 0


def test_two_apps_in_one_process_have_their_own_registries(tiny_engine_factory):
    """Building apps never touches prometheus-client's global registry (a second app
    would raise 'Duplicated timeseries' if it did)."""
    apps = [build_app(AsyncEngine(tiny_engine_factory("llama")), [MODEL]) for _ in range(2)]
    assert apps[0] is not apps[1]


def test_a_stop_string_counts_as_stop_not_abort(http):
    common = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 12, "ignore_eos": True,
              "temperature": 0}
    text = http.post("/v1/completions", json=common).json()["choices"][0]["text"]
    stop = text[2:4]
    before = _samples(http)
    r = http.post("/v1/completions", json={**common, "stop": [stop]})
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    for _ in range(50):  # the engine records the finish when it handles the abort
        after = _samples(http)
        if _success(after, "stop") > _success(before, "stop"):
            break
        time.sleep(0.02)
    assert _success(after, "stop") - _success(before, "stop") == 1
    assert _success(after, "abort") == _success(before, "abort")


def test_an_embedding_generates_no_tokens(http):
    """Its step samples one token that nobody gets: not a generated token in the
    counters nor in the per-request histogram."""
    before = _samples(http)
    r = http.post("/v1/embeddings", json={"model": MODEL, "input": [[5, 6, 7], [8, 9]]})
    assert r.status_code == 200, r.text
    after = _samples(http)
    assert after[("kvserve:prompt_tokens_total", ())] - \
        before[("kvserve:prompt_tokens_total", ())] == 5
    for name in ("kvserve:generation_tokens_total", "kvserve:request_generation_tokens_sum"):
        assert after[(name, ())] == before[(name, ())], name
