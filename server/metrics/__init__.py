"""GET /metrics: Prometheus text exposition under vLLM's metric names with the
`kvserve:` prefix, so a vLLM dashboard translates one to one (vllm: -> kvserve:).
Every series carries `model_name`, the first served model name.

Where each value comes from:
  - gauges and counters (engine.py): read at scrape time from the totals that
    EngineClient sums from the engine's StepReports;
  - per-sequence engine timings and lengths, tokens per step (requests.py): a
    report listener, once per step;
  - TTFT, inter-token and e2e latency (frontend.py): the front end, when
    tokens are sent;
  - the periodic log line (log.py): another report listener.

Each app gets its own CollectorRegistry, so several apps in one process (tests)
never collide in prometheus-client's global registry."""
from __future__ import annotations

from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvserve.engine.client.engine_client import EngineClient
from kvserve.server.metrics.engine import EngineCollector
from kvserve.server.metrics.frontend import FrontendHistograms
from kvserve.server.metrics.log import StatsLogger
from kvserve.server.metrics.requests import EngineHistograms


class ServerMetrics:
    def __init__(self, engine: EngineClient, model_name: str, log_interval: float = 10.0):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name))
        self.frontend = FrontendHistograms(self.registry, model_name)
        self.requests = EngineHistograms(self.registry, model_name, engine.max_model_len)
        self.stats_logger = StatsLogger(log_interval)
        engine.report_listeners.extend([self.requests, self.stats_logger])

    def response(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
