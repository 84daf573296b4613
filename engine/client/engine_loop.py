"""The engine's busy loop, the same in a thread and in a separate process: take the
commands that arrived (add, abort, stop), run one step, and report what happened in
one StepReport, made from the engine's own stats() snapshots (the differences since
the last one). Where the commands come from and where the report goes is up to the
caller (a queue and a callback in a thread; a pipe in a process).

With --kv-transfer-config a connector (engine/kv_transfer/) sees requests and
outputs on their way: a decode instance's request waits in it while its KV is read
from the prefill instance, and is added from the first loop turn after.

A LoRA adapter is read from disk on a thread of its own (seconds for a large one)
while steps go on, and served from the first loop turn after it is read."""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Protocol

from kvserve.engine.client.messages import (AbortRequest, AdapterReply, AddRequest, ChangeAdapter,
                                            EngineCommand, Shutdown, StepReport, TakeSnapshot)
from kvserve.engine.core.engine import Engine


class CommandSource(Protocol):
    def take(self, wait: float | None) -> list[EngineCommand]:
        """Every command waiting; if there is none, waits up to `wait` seconds (None:
        as long as it takes) for the first."""


# How often an idle engine reports while its compiled graphs are being built, so the
# front end's readiness (/ready) turns within this of their being done.
WARMING_REPORT_S = 0.5


class EngineLoop:
    def __init__(self, engine: Engine, commands: CommandSource,
                 report: Callable[[StepReport], None]):
        self.engine, self.commands, self.report = engine, commands, report
        self.stopped = False
        self._snapshot_asked = False  # a TakeSnapshot came in since the last report
        self._last = engine.stats()  # counters are reported as differences
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvserve-lora-read")
        self._reads: list[tuple[ChangeAdapter, Future]] = []  # adapters being read
        self.kv_transfer = None
        if engine.config.kv_transfer_config is not None:
            from kvserve.engine.kv_transfer.connector import KVTransferConnector
            self.kv_transfer = KVTransferConnector(engine)

    def run(self) -> None:
        """Until a stop command; exceptions propagate (the engine is then dead)."""
        engine = self.engine
        try:
            while not self.stopped:
                rep = StepReport()
                for command in self.commands.take(self._wait()):
                    self._handle(command, rep)
                if self.kv_transfer is not None:
                    self._add_transferred(rep)
                if engine.has_unfinished_requests() and not self.stopped:
                    self._step(rep)
                elif self._reads:  # nothing to run: wait a little for a read to end
                    wait([f for _, f in self._reads], timeout=0.05,
                         return_when=FIRST_COMPLETED)
                self._serve_read_adapters(rep)
                self._counts(rep)
                self.report(rep)
        finally:
            self._reader.shutdown(wait=False, cancel_futures=True)
            if self.kv_transfer is not None:
                self.kv_transfer.close()

    def _wait(self) -> float | None:
        """How long to wait for a command: not at all with work to do, a little while
        warming up (a report then says when that ends), else until one comes. The
        last report's state counts too: graphs done after it was made but before this
        call must still be reported, or the front end would wait for them forever."""
        if self.engine.has_unfinished_requests() or self._reads:
            return 0.0
        warming = self._last.warming_up or self.engine.runner.warming_up
        limits = [WARMING_REPORT_S if warming else None,
                  self.kv_transfer.wait_hint() if self.kv_transfer is not None else None]
        return min((s for s in limits if s is not None), default=None)

    def _step(self, rep: StepReport) -> None:
        rep.step_start = time.monotonic()
        outputs = self.engine.step()
        if self.kv_transfer is not None:
            self.kv_transfer.on_outputs(outputs)
        rep.outputs.extend(outputs)
        rep.step_seconds = time.monotonic() - rep.step_start

    def _counts(self, rep: StepReport) -> None:
        """Queue lengths and KV usage as they are now; counters since the last report
        (only a step computes prompt tokens or samples: they are the step's)."""
        self.engine.publish_kv_events()
        now = self.engine.stats()
        last, self._last = self._last, now
        rep.waiting, rep.running, rep.kv_usage = now.num_waiting, now.num_running, now.kv_usage
        rep.prompt_tokens_computed = now.prompt_tokens_computed - last.prompt_tokens_computed
        rep.step_tokens = (rep.prompt_tokens_computed
                           + now.generated_tokens - last.generated_tokens)
        rep.prefix_queries = now.prefix_queries - last.prefix_queries
        rep.prefix_hits = now.prefix_hits - last.prefix_hits
        rep.tier_hits = now.tier_hits - last.tier_hits
        rep.preemptions = now.num_preemptions - last.num_preemptions
        rep.grammar_compile_seconds = list(now.grammar_compile_seconds)
        rep.warming_up = now.warming_up
        if now.spec is not None:
            rep.spec = now.spec.since(last.spec)
        rep.lora_running, rep.lora_waiting = now.lora_running, now.lora_waiting
        if self._snapshot_asked:
            self._snapshot_asked = False
            rep.snapshot = self.engine.snapshot()

    def _handle(self, command: EngineCommand, rep: StepReport) -> None:
        if isinstance(command, AddRequest):
            rep.added += 1
            if self.kv_transfer is None or not self.kv_transfer.defer(command):
                self._add(command, rep)
        elif isinstance(command, AbortRequest):
            waiting = (self.kv_transfer.abort(command.request_id, command.index)
                       if self.kv_transfer is not None else None)
            rep.outputs.extend(waiting if waiting is not None else self.engine.abort_request(
                command.request_id, command.index, command.reason))
        elif isinstance(command, ChangeAdapter):
            reply = self._change_adapter(command)
            if reply is not None:
                rep.adapter_replies.append(reply)
        elif isinstance(command, TakeSnapshot):
            self._snapshot_asked = True
        elif isinstance(command, Shutdown):
            self.stopped = True
        else:
            raise TypeError(f"not an engine command: {command!r}")

    def _add(self, command: AddRequest, rep: StepReport) -> bool:
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids,
                                    command.params, cache_salt=command.cache_salt,
                                    priority=command.priority, lora_name=command.lora_name,
                                    background=command.background)
        except ValueError as exc:
            rep.rejected.append((command.request_id, str(exc)))
            return False
        rep.prompt_tokens += len(command.prompt_token_ids)
        rep.constrained += command.params.structured is not None
        if self.kv_transfer is not None:
            self.kv_transfer.added(command)
        return True

    def _add_transferred(self, rep: StepReport) -> None:
        """Requests whose KV came (or failed to), and sequences aborted meanwhile."""
        for command, aborted in self.kv_transfer.ready():
            if self._add(command, rep):
                for index in sorted(aborted):
                    rep.outputs.extend(self.engine.abort_request(command.request_id, index))

    def _change_adapter(self, command: ChangeAdapter) -> AdapterReply | None:
        """An unload at once; a load is read on the reader's thread (None: replied to
        once it is read, by _serve_read_adapters)."""
        if command.path is not None:
            self._reads.append((command, self._reader.submit(
                self.engine.read_lora, command.name, command.path, command.replace)))
            return None
        try:
            self.engine.unload_lora(command.name)
        except KeyError:
            return AdapterReply(command.op_id, f"The lora adapter '{command.name}' cannot "
                                "be found.", not_found=True)
        return AdapterReply(command.op_id)

    def _serve_read_adapters(self, rep: StepReport) -> None:
        """Registers the adapters read since the last turn (between steps), and
        replies to their loads."""
        pending = []
        for command, read in self._reads:
            if not read.done():
                pending.append((command, read))
                continue
            try:
                self.engine.register_lora(command.name, read.result(), command.replace)
            except ValueError as exc:  # unreadable, unservable, or no room now
                rep.adapter_replies.append(AdapterReply(command.op_id, str(exc)))
            else:
                rep.adapter_replies.append(AdapterReply(command.op_id))
        self._reads = pending
