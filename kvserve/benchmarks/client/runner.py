"""One benchmark run: sessions start on the arrival schedule, a session's turns run
one after another, and at most --max-concurrency requests are in flight."""
from __future__ import annotations

import asyncio
import contextlib
import math
import time
from dataclasses import dataclass
from typing import Callable

import httpx

from kvserve.benchmarks.client.arrivals import start_offsets
from kvserve.benchmarks.client.client import Target, send
from kvserve.benchmarks.client.datasets import Session
from kvserve.benchmarks.client.history import approx_len, first_prompt, next_prompt
from kvserve.benchmarks.client.records import RequestRecord

SKIPPED = "not sent: an earlier turn of its session failed"


@dataclass(frozen=True)
class Traffic:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0


class Run:
    def __init__(self, http: httpx.AsyncClient, target: Target, traffic: Traffic,
                 on_done: Callable[[int], None] = lambda n: None):
        self.http, self.target, self.traffic, self.on_done = http, target, traffic, on_done
        limit = traffic.max_concurrency
        self.gate = asyncio.Semaphore(limit) if limit else contextlib.nullcontext()
        self.records: list[RequestRecord] = []

    async def all(self, sessions: list[Session]) -> float:
        """Runs every session; returns the duration in seconds, first send to last end."""
        t = self.traffic
        offsets = start_offsets(len(sessions), t.request_rate, t.burstiness, t.seed)
        t0 = time.perf_counter()
        await asyncio.gather(*(self.session(s, t0 + at) for s, at in zip(sessions, offsets)))
        return time.perf_counter() - t0

    async def session(self, session: Session, start_at: float) -> None:
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        prompt, answer, chat = None, "", self.target.chat
        for i, turn in enumerate(session.turns):
            prompt = (first_prompt(turn.message, chat) if prompt is None
                      else next_prompt(prompt, answer, turn.message, chat))
            async with self.gate:
                rec = await send(self.http, self.target, prompt, turn.output_len,
                                 approx_len(prompt))
            self.records.append(rec)
            self.on_done(1)
            answer = rec.answer
            if not rec.success:
                rest = len(session.turns) - i - 1
                self.records.extend(RequestRecord(error=SKIPPED) for _ in range(rest))
                self.on_done(rest)
                return
