"""Sending one streamed request to an OpenAI-compatible server."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx
from httpx_sse import EventSource

from kvserve.benchmarks.client.records import RequestRecord
from kvserve.benchmarks.client.stream import StreamReader


@dataclass(frozen=True)
class Target:
    endpoint: str  # /v1/completions or /v1/chat/completions
    model: str
    sampling: dict = field(default_factory=dict)  # e.g. temperature, extra fields
    continuous_usage: bool = False  # ask vLLM for usage in every chunk

    @property
    def chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")


def request_body(target: Target, prompt, max_tokens: int) -> dict:
    """As vllm bench serve does: a fixed output length (max_tokens + ignore_eos)."""
    body = {"model": target.model, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **target.sampling}
    if target.continuous_usage:
        body["stream_options"]["continuous_usage_stats"] = True
    body["messages" if target.chat else "prompt"] = prompt
    return body


async def send(http: httpx.AsyncClient, target: Target, prompt, max_tokens: int,
               input_len: int) -> RequestRecord:
    """Never raises for a server or network failure: that is a failed record."""
    reader = StreamReader(target.chat)
    t0 = time.perf_counter()
    try:
        async with http.stream("POST", target.endpoint,
                               json=request_body(target, prompt, max_tokens)) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                reader.record.error = f"HTTP {r.status_code}: {text[:300]}"
            else:
                await _read_events(r, reader, t0)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        reader.record.error = f"{type(exc).__name__}: {exc}"
    return reader.finish(time.perf_counter() - t0, input_len)


async def _read_events(r: httpx.Response, reader: StreamReader, t0: float) -> None:
    """Events as the SSE spec frames them: lines end at CR or LF only. (httpx's
    aiter_lines also splits at U+2028, U+2029 and other Unicode line breaks, which
    JSON may carry raw inside a string, and would cut such a chunk in two.)"""
    async for event in EventSource(r).aiter_sse():
        if event.data == "[DONE]":
            return
        if event.data:
            reader.feed(json.loads(event.data), time.perf_counter() - t0)
