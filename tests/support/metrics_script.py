"""Scripted requests for the metrics tests: each one's prompt length, the tokens each
choice got, its finish reasons, and the client's own timestamps (time.monotonic, the
server's clock too: both run on this machine)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

from tests.support.prom_text import buckets, parse_samples


@dataclass
class Sent:
    prompt_len: int
    ids: list[list[int]]  # generated token ids, per choice
    reasons: list[str]
    t0: float  # before the request was sent
    first: float  # the first token received (non-streaming: the body)
    end: float  # the whole response received

    @property
    def tokens(self) -> list[int]:
        return [len(ids) for ids in self.ids]


def complete(http: httpx.Client, model: str, prompt: list[int], max_tokens: int,
             stream: bool = False, **extra) -> Sent:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream, **extra}
    t0 = time.monotonic()
    if stream:
        return _streamed(http, body, t0)
    r = http.post("/v1/completions", json=body)
    end = time.monotonic()
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    return Sent(len(prompt), [c["token_ids"] for c in choices],
                [c["finish_reason"] for c in choices], t0, end, end)


def _streamed(http: httpx.Client, body: dict, t0: float) -> Sent:
    ids: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    first = None
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                if c["token_ids"] and first is None:
                    first = time.monotonic()
                ids.setdefault(c["index"], []).extend(c["token_ids"])
                if c["finish_reason"]:
                    reasons[c["index"]] = c["finish_reason"]
    end = time.monotonic()
    return Sent(len(body["prompt"]), [ids[i] for i in sorted(ids)],
                [reasons[i] for i in sorted(reasons)], t0, first, end)


class Scrapes:
    """/metrics before and after: deltas of samples and of histogram buckets."""

    def __init__(self, http: httpx.Client, model: str):
        self.http, self.model = http, model
        self.before = self.now()

    def now(self) -> dict:
        return parse_samples(self.http.get("/metrics").text, self.model)

    def delta(self, after: dict, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[key] - self.before.get(key, 0.0)

    def bucket_deltas(self, after: dict, name: str) -> dict[float, float]:
        old = buckets(self.before, name)
        return {le: v - old.get(le, 0.0) for le, v in buckets(after, name).items()}


def assert_in_buckets(grew: dict[float, float], spans: list[tuple[float, float]]) -> None:
    """Each observation i lies in [lo_i, hi_i]: a cumulative bucket `le` then holds
    at least those with hi_i <= le and at most those with lo_i <= le."""
    for le, count in grew.items():
        must = sum(hi <= le for _, hi in spans)
        may = sum(lo <= le for lo, _ in spans)
        assert must <= count <= may, (le, count, spans)
    assert grew[float("inf")] == len(spans)
