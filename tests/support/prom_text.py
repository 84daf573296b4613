"""Reading /metrics in tests: samples keyed by (name, labels other than model_name),
after checking that every kvserve series carries the served model's name."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Key = tuple[str, tuple[tuple[str, str], ...]]


def parse_samples(text: str, model: str) -> dict[Key, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = dict(s.labels)
            if s.name.startswith("kvserve:"):
                assert labels.pop("model_name", None) == model, s
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def value(text: str, name: str, model: str, **labels: str) -> float:
    """One sample, e.g. value(text, "kvserve:num_requests_running", "tiny")."""
    return parse_samples(text, model)[(name, tuple(sorted(labels.items())))]


def buckets(samples: dict[Key, float], name: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts by upper bound (+Inf included)."""
    return {float(dict(labels)["le"]): v for (n, labels), v in samples.items()
            if n == f"{name}_bucket"}
