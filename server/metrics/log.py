"""The periodic stats line, in vLLM's shape:

  Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.1 tokens/s,
  Running: 12 reqs, Waiting: 3 reqs, KV cache usage: 41.2%, Prefix cache hit rate: 37.5%

A report listener: a line every `interval` seconds while the engine has work, one
more for the tail of a busy period when it goes idle, and silence while idle (an
idle engine sends no reports but while warming up). A line written while the compiled
forward pass is still being built ends "(eager: compiling)". Throughputs count what kvserve:prompt_tokens_total
and kvserve:generation_tokens_total count, over the window; the hit rate is the
window's prefix-cache hits over its queries (0 when it had none)."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvserve.engine.client.messages import StepReport

log = logging.getLogger("kvserve.stats")


class StatsLogger:
    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger = log):
        self.interval, self.clock, self.log = interval, clock, logger
        self._start: float | None = None  # the window's start; None while idle
        self._reset()

    def _reset(self) -> None:
        self.prompt = self.generation = self.queries = self.hits = 0

    def __call__(self, rep: StepReport) -> None:
        now = self.clock()
        if self._start is None:  # work starts: the window opens with its first step
            self._start = rep.step_start if rep.step_start is not None else now
            self._reset()
        self.prompt += rep.prompt_tokens
        self.generation += sum(len(out.new_token_ids) for out in rep.outputs)
        self.queries += rep.prefix_queries
        self.hits += rep.prefix_hits
        busy = rep.running or rep.waiting
        if now - self._start >= self.interval or (not busy and self.generation + self.prompt):
            self.log.info(self.line(rep, now - self._start))
            self._start = now
            self._reset()
        if not busy:
            self._start = None

    def line(self, rep: StepReport, seconds: float) -> str:
        seconds = max(seconds, 1e-9)
        hit_rate = self.hits / self.queries if self.queries else 0.0
        return (f"Avg prompt throughput: {self.prompt / seconds:.1f} tokens/s, "
                f"Avg generation throughput: {self.generation / seconds:.1f} tokens/s, "
                f"Running: {rep.running} reqs, Waiting: {rep.waiting} reqs, "
                f"KV cache usage: {rep.kv_usage * 100:.1f}%, "
                f"Prefix cache hit rate: {hit_rate * 100:.1f}%"
                + (" (eager: compiling)" if rep.warming_up else ""))
