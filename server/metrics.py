"""GET /metrics: Prometheus text exposition of the engine's load and counters.

Each app gets its own CollectorRegistry, so several apps in one process (tests) never
collide in prometheus-client's global registry. Values are read at scrape time from
numbers the engine reports (see EngineClient), so nothing here runs per token."""
from __future__ import annotations

from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.engine_client import EngineClient

PREFIX = "kvserve:"


class _EngineCollector:
    def __init__(self, engine: EngineClient):
        self.engine = engine

    def collect(self):
        e, stats = self.engine, self.engine.stats
        yield GaugeMetricFamily(PREFIX + "num_requests_running",
                                "Requests running in the engine (scheduled).",
                                value=e.num_running)
        yield GaugeMetricFamily(PREFIX + "num_requests_waiting",
                                "Requests waiting to be scheduled.", value=e.num_waiting)
        success = CounterMetricFamily(PREFIX + "request_success",
                                      "Finished sequences, by finish reason.",
                                      labels=["finished_reason"])
        # The usual reasons start at 0, so rate() works before the first one happens.
        counts = {**dict.fromkeys(("stop", "length", "abort"), 0), **stats.finished}
        for reason, count in sorted(counts.items()):
            success.add_metric([reason], count)
        yield success
        yield CounterMetricFamily(PREFIX + "prompt_tokens", "Prompt tokens accepted.",
                                  value=stats.prompt_tokens)
        yield CounterMetricFamily(PREFIX + "generation_tokens", "Tokens generated.",
                                  value=stats.generation_tokens)


def metrics_registry(engine: EngineClient) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(_EngineCollector(engine))
    return registry


def metrics_response(registry: CollectorRegistry) -> Response:
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
