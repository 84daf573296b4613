"""A real Prometheus (Debian's `prometheus` package) scrapes a running kvserve every
second through a short load, and every PromQL expression of the Grafana dashboard,
evaluated through Prometheus's HTTP API, returns data: series with finite values.

The scrape config is deploy/prometheus/prometheus.yml with the target and interval
changed, so the shipped config is the one exercised."""
from __future__ import annotations

import contextlib
import math
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.engine.config.engine_config import SpeculativeConfig
from kvserve.server.entrypoints.app import build_app
from tests.deploy.files import DEPLOY, dashboard, dashboard_targets
from tests.support.server import free_port, running_server

MODEL = "tiny"
PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="the prometheus binary is not installed "
    "(apt-get install prometheus; .ci/run does it)")


def _config(path: Path, target: str) -> Path:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    config["scrape_configs"][0]["static_configs"] = [{"targets": [target]}]
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def _prometheus(tmp_path: Path, target: str):
    port = free_port()
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={_config(tmp_path / 'prometheus.yml', target)}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)
    try:
        _until(lambda: _ready(api), "Prometheus is not ready", proc)
        yield api
    finally:
        proc.terminate()
        proc.wait(10)
        api.close()


def _ready(api: httpx.Client) -> bool:
    try:
        return api.get("/-/ready").status_code == 200
    except httpx.TransportError:
        return False


def _until(check, what: str, proc=None, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"prometheus exited: {proc.stderr.read().decode()[-2000:]}")
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _query(api: httpx.Client, expr: str) -> list[dict]:
    body = api.get("/api/v1/query", params={"query": expr}).json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _load(url: str, seconds: float) -> None:
    """A few clients for `seconds`: streamed and whole answers of varied lengths, and
    a shared prompt prefix, so every panel has something to show."""
    shared = list(range(3, 40))

    def client(i: int):
        with httpx.Client(base_url=url, timeout=60) as c:
            deadline, k = time.monotonic() + seconds, 0
            while time.monotonic() < deadline:
                k += 1
                prompt = shared + [i, k] if k % 2 else [i + 5, k % 200 + 3, 7]
                r = c.post("/v1/completions", json={
                    "model": MODEL, "prompt": prompt, "max_tokens": 2 + (i * k) % 9,
                    "ignore_eos": True, "stream": bool(k % 3 == 0)})
                assert r.status_code == 200, r.text

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _promql(expr: str) -> str:
    """The dashboard's Grafana variables, as Grafana would fill them in here."""
    expr = expr.replace("$model_name", MODEL).replace("$__rate_interval", "1m")
    assert "$" not in expr, expr
    return expr


def test_every_dashboard_query_returns_data(tiny_engine_factory, tmp_path):
    # Speculating (early exit drafts for every decode), so the speculative decoding
    # panels have data too.
    spec = SpeculativeConfig("early-exit", num_tokens=2, draft_layers=1, disable_batch_size=0)
    app = build_app(AsyncEngine(tiny_engine_factory("llama", speculative=spec)), [MODEL])
    with running_server(app) as url, _prometheus(tmp_path, url.split("//")[1]) as api:
        _until(lambda: _query(api, 'up{job="kvserve"} == 1'), "no successful scrape")
        time.sleep(1.5)  # a baseline sample before the load, for rate()
        _load(url, seconds=3.0)
        time.sleep(2.5)  # the final counts scraped
        variable = dashboard()["templating"]["list"][0]
        metric, label = re.fullmatch(r"label_values\((\S+), (\w+)\)",
                                     variable["query"]["query"]).groups()
        assert {s["metric"][label] for s in _query(api, metric)} == {MODEL}
        for title, expr in dashboard_targets():
            result = _query(api, _promql(expr))
            assert result, f"{title}: no series for {expr}"
            values = [float(s["value"][1]) for s in result]
            assert all(math.isfinite(v) for v in values), (title, expr, values)
