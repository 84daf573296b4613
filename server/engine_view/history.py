"""The engine page's sparklines: every `interval` seconds, one point of what the last
interval did, from the running totals the server keeps anyway (EngineClient.stats and
the front end's TTFT and ITL histograms). Sampling reads a few numbers on a timer:
nothing is added per step or per token, and the last minutes are there the moment a
page opens."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from kvserve.engine.client.engine_client import EngineClient
from kvserve.server.metrics.frontend import FrontendHistograms

POINT_SECONDS = 1.0
WINDOW_POINTS = 300  # five minutes of points


@dataclass(frozen=True, slots=True)
class Totals:
    """Running totals at one moment; a point is the difference of two."""
    at: float  # time.monotonic()
    ttft_sum: float
    ttft_count: float
    itl_sum: float
    itl_count: float
    steps: int
    step_tokens: int
    prompt_tokens_computed: int
    generation_tokens: int
    prefix_queries: int
    prefix_hits: int
    draft_tokens: int
    accepted_tokens: int


def _sum_and_count(histogram) -> tuple[float, float]:
    values = {sample.name.rpartition("_")[2]: sample.value
              for family in histogram.collect() for sample in family.samples}
    return values["sum"], values["count"]


def _ratio(part: float, whole: float) -> float | None:  # None: nothing to divide
    return part / whole if whole else None


class EngineHistory:
    def __init__(self, engine: EngineClient, latency: FrontendHistograms,
                 interval: float = POINT_SECONDS, window: int = WINDOW_POINTS):
        self.engine, self.latency, self.interval = engine, latency, interval
        self.points: deque[dict] = deque(maxlen=window)
        self._last = self._totals()

    def _totals(self) -> Totals:
        s = self.engine.stats
        return Totals(time.monotonic(), *_sum_and_count(self.latency.ttft),
                      *_sum_and_count(self.latency.itl), s.steps, s.step_tokens,
                      s.prompt_tokens_computed, s.generation_tokens, s.prefix_queries,
                      s.prefix_hits, s.spec.num_draft_tokens, s.spec.num_accepted_tokens)

    def sample(self) -> dict:
        """Appends and returns the point for the time since the last sample. Means
        are None (a gap in the line) where the interval had nothing to average;
        rates of counts (prefix hits, accepted drafts) the page works out itself."""
        now, last = self._totals(), self._last
        self._last = now
        seconds = max(now.at - last.at, 1e-9)
        steps = now.steps - last.steps
        prefill = now.prompt_tokens_computed - last.prompt_tokens_computed
        decode = now.step_tokens - last.step_tokens - prefill
        point = {
            "t": time.time() * 1000,  # what the page's clock reads (ms)
            "ttft": _ratio(now.ttft_sum - last.ttft_sum, now.ttft_count - last.ttft_count),
            "itl": _ratio(now.itl_sum - last.itl_sum, now.itl_count - last.itl_count),
            "tokens_per_s": (now.generation_tokens - last.generation_tokens) / seconds,
            "steps_per_s": steps / seconds,
            "prefill_per_step": _ratio(prefill, steps),
            "decode_per_step": _ratio(decode, steps),
            # Raw counts too, so the page can pool a window's rates.
            "prefix_queries": now.prefix_queries - last.prefix_queries,
            "prefix_hits": now.prefix_hits - last.prefix_hits,
            "draft_tokens": now.draft_tokens - last.draft_tokens,
            "accepted_tokens": now.accepted_tokens - last.accepted_tokens,
            "running": self.engine.num_running,
            "waiting": self.engine.num_waiting,
            "kv_usage": self.engine.stats.kv_usage,
        }
        self.points.append(point)
        return point
