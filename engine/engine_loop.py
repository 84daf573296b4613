"""The engine's busy loop, the same in a thread and in a separate process: take the
commands that arrived (add, abort, stop), run one step, and report what happened in
one StepReport. Where the commands come from and where the report goes is up to the
caller (a queue and a callback in a thread; a pipe in a process)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from engine.engine import Engine
from engine.outputs import RequestOutput
from engine.spec_decode.speculator import SpecDecodeStats

# Commands: ("add", (request_id, prompt_ids, params, cache_salt, priority)),
#           ("abort", (request_id, reason)), ("stop", None).
Command = tuple[str, object]


class CommandSource(Protocol):
    def take(self, block: bool) -> list[Command]:
        """Every command waiting; with block, waits for at least one."""


@dataclass
class StepReport:
    """What one loop iteration did, for the front end. Picklable."""
    outputs: list[RequestOutput] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (request id, why)
    added: int = 0  # adds taken off the command queue (accepted or rejected)
    prompt_tokens: int = 0  # prompt tokens of the accepted adds
    waiting: int = 0  # the scheduler's queue lengths after the iteration
    running: int = 0
    # The step, if one ran: when it started (time.monotonic, comparable across
    # processes), how long it took, and how many prompt tokens it computed.
    step_start: float | None = None
    step_seconds: float = 0.0
    prompt_tokens_computed: int = 0
    step_tokens: int = 0  # prompt tokens computed plus tokens sampled in the step
    # Engine counters since the previous report: deltas, so the receiver only adds
    # them up and no report is counted twice or lost between steps.
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found cached
    preemptions: int = 0
    kv_usage: float = 0.0  # fraction of the KV cache's blocks in use, after it (0..1)
    spec: SpecDecodeStats | None = None  # speculative decoding's counts (deltas), if on


class EngineLoop:
    def __init__(self, engine: Engine, commands: CommandSource,
                 report: Callable[[StepReport], None]):
        self.engine, self.commands, self.report = engine, commands, report
        self.stopped = False
        self._last = engine.scheduler.stats()  # counters are reported as differences
        spec = engine.speculator
        self._spec = spec.stats.copy() if spec is not None else None

    def run(self) -> None:
        """Until a stop command; exceptions propagate (the engine is then dead)."""
        engine = self.engine
        while not self.stopped:
            rep = StepReport()
            for kind, arg in self.commands.take(block=not engine.has_unfinished_requests()):
                self._handle(kind, arg, rep)
            if engine.has_unfinished_requests() and not self.stopped:
                self._step(rep)
            self._snapshot(rep)
            self.report(rep)

    def _step(self, rep: StepReport) -> None:
        stats = self.engine.stats
        computed, sampled = stats.prompt_tokens_computed, stats.generated_tokens
        rep.step_start = time.monotonic()
        rep.outputs.extend(self.engine.step())
        rep.step_seconds = time.monotonic() - rep.step_start
        rep.prompt_tokens_computed = stats.prompt_tokens_computed - computed
        rep.step_tokens = rep.prompt_tokens_computed + stats.generated_tokens - sampled

    def _snapshot(self, rep: StepReport) -> None:
        """Queue lengths and KV usage as they are now; counters since the last report."""
        stats = self.engine.scheduler.stats()
        rep.waiting, rep.running, rep.kv_usage = (stats.num_waiting, stats.num_running,
                                                  stats.kv_usage)
        rep.prefix_queries = stats.prefix_queries - self._last.prefix_queries
        rep.prefix_hits = stats.prefix_hits - self._last.prefix_hits
        rep.preemptions = stats.num_preemptions - self._last.num_preemptions
        self._last = stats
        if self._spec is not None:
            spec = self.engine.speculator.stats
            rep.spec, self._spec = spec.since(self._spec), spec.copy()

    def _handle(self, kind: str, arg, rep: StepReport) -> None:
        if kind == "add":
            rep.added += 1
            request_id, prompt, params, cache_salt, priority = arg
            try:
                self.engine.add_request(request_id, prompt, params, cache_salt=cache_salt,
                                        priority=priority)
                rep.prompt_tokens += len(prompt)
            except ValueError as exc:
                rep.rejected.append((request_id, str(exc)))
        elif kind == "abort":
            rep.outputs.extend(self.engine.abort_request(*arg))
        elif kind == "stop":
            self.stopped = True
