"""Gauges and counters of /metrics, read at scrape time from the numbers the engine
reports (EngineClient.stats and its queue counts): nothing here runs per token.

Counters are plain families rather than prometheus_client.Counter objects because
their totals already live in ServingStats, summed from the engine's reports."""
from __future__ import annotations

import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvserve.engine.client.engine_client import EngineClient

PREFIX = "kvserve:"
LABEL = "model_name"
# vLLM's finish reasons. Each starts at 0 so that rate() and the dashboard's panels
# have a series before the first one happens.
FINISH_REASONS = ("stop", "length", "abort", "error")


class EngineCollector:
    def __init__(self, engine: EngineClient, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        e, stats = self.engine, self.engine.stats
        yield self._one(GaugeMetricFamily, "num_requests_running",
                        "Requests in the engine's running batch.", e.num_running)
        yield self._one(GaugeMetricFamily, "num_requests_waiting",
                        "Requests waiting to be scheduled.", e.num_waiting)
        yield self._one(GaugeMetricFamily, "kv_cache_usage_perc",
                        "KV-cache usage. 1 means 100 percent usage.", stats.kv_usage)
        yield self._one(GaugeMetricFamily, "warming_up",
                        "1 while the compiled forward pass is being built and steps run "
                        "eagerly (GET /ready answers 503), else 0.", e.warming_up)
        yield self._one(CounterMetricFamily, "prompt_tokens",
                        "Prompt tokens of the requests the engine accepted.",
                        stats.prompt_tokens)
        yield self._one(CounterMetricFamily, "generation_tokens", "Tokens generated.",
                        stats.generation_tokens)
        yield self._one(CounterMetricFamily, "prefix_cache_queries",
                        "Prefix cache queries, in prompt tokens looked up.",
                        stats.prefix_queries)
        yield self._one(CounterMetricFamily, "prefix_cache_hits",
                        "Prefix cache hits, in prompt tokens found cached.",
                        stats.prefix_hits)
        yield self._one(CounterMetricFamily, "external_prefix_cache_hits",
                        "Of the prefix cache hits, prompt tokens loaded back from the "
                        "second KV tier (--kv-offload-bytes) instead of computed.",
                        stats.tier_hits)
        yield self._one(CounterMetricFamily, "num_preemptions",
                        "Requests preempted (their KV freed, to be recomputed).",
                        stats.preemptions)
        yield self._one(CounterMetricFamily, "structured_output_requests",
                        "Requests with a structured output (JSON schema, regex, choice, "
                        "grammar) the engine accepted.", stats.constrained_requests)
        yield self._success()
        yield from self._spec_decode(stats.spec)
        if e.adapters.enabled:
            yield self._lora_info()

    def _one(self, family, name: str, doc: str, value: float):
        metric = family(PREFIX + name, doc, labels=[LABEL])
        metric.add_metric([self.model_name], value)
        return metric

    def _spec_decode(self, spec):
        """Speculative decoding (zeros while it is off), as vLLM names it: mean
        accepted length = 1 + accepted tokens / drafts; acceptance rate = accepted
        tokens / draft tokens; per position, how often the i-th draft stood."""
        yield self._one(CounterMetricFamily, "spec_decode_num_drafts",
                        "Verifications: requests that carried drafts into a step.",
                        spec.num_drafts)
        yield self._one(CounterMetricFamily, "spec_decode_num_draft_tokens",
                        "Draft tokens verified.", spec.num_draft_tokens)
        yield self._one(CounterMetricFamily, "spec_decode_num_accepted_tokens",
                        "Draft tokens accepted.", spec.num_accepted_tokens)
        metric = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in the draft.",
                                     labels=[LABEL, "position"])
        for pos, count in enumerate(spec.accepted_per_position):
            metric.add_metric([self.model_name, str(pos)], count)
        yield metric

    def _lora_info(self) -> GaugeMetricFamily:
        """vLLM's lora_requests_info, what the Gateway API Inference Extension routes
        by (adapter affinity): the adapters of running and of waiting requests as
        comma-separated labels, and as the value when they were read (Unix time)."""
        a = self.engine.adapters
        metric = GaugeMetricFamily(PREFIX + "lora_requests_info",
                                   "Running and waiting LoRA adapters (in the labels).",
                                   labels=["max_lora", "running_lora_adapters",
                                           "waiting_lora_adapters"])
        metric.add_metric([str(a.max_loras), ",".join(a.running), ",".join(a.waiting)],
                          time.time())
        return metric

    def _success(self) -> CounterMetricFamily:
        metric = CounterMetricFamily(PREFIX + "request_success",
                                     "Finished sequences, by finish reason.",
                                     labels=[LABEL, "finished_reason"])
        counts = {**dict.fromkeys(FINISH_REASONS, 0), **self.engine.stats.finished}
        for reason, count in sorted(counts.items()):
            metric.add_metric([self.model_name, reason], count)
        return metric
