"""Grafana's provisioning and the dashboard, statically: the datasource every panel
names is the provisioned one, the dashboard has the panels the README promises, and
every metric it queries is one kvserve exposes (test_prometheus_live.py runs the
queries against a real Prometheus)."""
from __future__ import annotations

import re

import httpx
import yaml

from kvserve.engine.client.async_engine import AsyncEngine
from kvserve.server.entrypoints.app import build_app
from tests.deploy.files import DEPLOY, compose, dashboard, dashboard_targets, provisioning
from tests.support.server import running_server


def test_every_panel_uses_the_provisioned_datasource():
    (source,) = provisioning("datasources")["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090" and "prometheus" in compose()["services"]
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert source["jsonData"]["timeInterval"] == scrape["global"]["scrape_interval"]
    for panel in dashboard()["panels"]:
        for item in [panel, *panel.get("targets", [])]:
            if "datasource" in item:
                assert item["datasource"] == {"type": "prometheus", "uid": source["uid"]}


def test_the_dashboard_has_the_promised_panels():
    titles = {p["title"] for p in dashboard()["panels"]}
    for wanted in ("Time to first token", "Inter-token latency", "End-to-end request latency",
                   "Queue time", "Token throughput", "Requests running and waiting",
                   "KV-cache usage", "Prefix-cache hit rate", "Preemptions", "Finish reasons",
                   "Prompt length", "Generation length"):
        assert wanted in titles
    by_title = {p["title"]: p for p in dashboard()["panels"]}
    for title in ("Time to first token", "Inter-token latency"):
        quantiles = [re.match(r"histogram_quantile\(([\d.]+),", t["expr"]).group(1)
                     for t in by_title[title]["targets"]]
        assert quantiles == ["0.5", "0.9", "0.99"]


def test_every_queried_metric_is_exposed(tiny_engine_factory):
    app = build_app(AsyncEngine(tiny_engine_factory("llama")), ["tiny"])
    with running_server(app) as url:
        text = httpx.get(url + "/metrics").text
    exposed = set(re.findall(r"^(kvserve:\w+)", text, re.M))
    queried = {m for _, expr in dashboard_targets() for m in re.findall(r"kvserve:\w+", expr)}
    assert queried and queried <= exposed, queried - exposed
