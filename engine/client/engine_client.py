"""What the server holds: an async client of an engine that runs elsewhere (a thread,
AsyncEngine, or a process, ProcessEngine). Each request gets an asyncio queue of
outputs; commands (add, abort) go to the engine through the subclass's transport;
the engine answers with one StepReport per loop iteration.

Load counts (waiting, running) and serving counters come from those reports, so the
event loop reads plain numbers and never walks the scheduler's structures."""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from kvserve.engine.client.adapters import Adapters
from kvserve.engine.client.messages import (AbortRequest, AddRequest, EngineCommand, StepReport,
                                            TakeSnapshot)
from kvserve.engine.core.reports import EngineInfo, EngineSnapshot
from kvserve.engine.core.request_checks import check_request
from kvserve.engine.platform.outputs import RequestOutput
from kvserve.engine.spec_decode.speculator import SpecDecodeStats
from kvserve.scheduler.sampling_params import SamplingParams

log = logging.getLogger("kvserve.engine_client")


class EngineDeadError(RuntimeError):
    pass


RECENT_FINISHED = 32  # sequences the engine page lists as just ended


@dataclass(frozen=True, slots=True)
class FinishedSequence:
    request_id: str
    index: int
    reason: str
    num_generated: int  # tokens it generated (0 when unknown)
    at: float  # time.monotonic() when its end was reported


@dataclass
class ServingStats:
    """Counters for /metrics and the engine page, updated from the engine's reports."""
    prompt_tokens: int = 0  # prompt tokens of requests the engine accepted
    generation_tokens: int = 0
    # Sequences that ended, by finish reason (a stop string found by the front end
    # counts as "stop").
    finished: dict[str, int] = field(default_factory=dict)
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found cached
    tier_hits: int = 0  # of those, tokens loaded back from the second KV tier
    preemptions: int = 0
    kv_usage: float = 0.0  # as of the last report (0..1)
    spec: SpecDecodeStats = field(default_factory=SpecDecodeStats)  # speculative decoding
    constrained_requests: int = 0  # accepted with a structured output
    steps: int = 0  # engine steps run
    step_tokens: int = 0  # tokens those steps computed: prompt tokens plus sampled ones
    prompt_tokens_computed: int = 0  # of those, prompt (or recomputed) tokens
    # The last sequences that ended, newest last, for the engine page.
    recent_finished: deque[FinishedSequence] = field(
        default_factory=lambda: deque(maxlen=RECENT_FINISHED))


class _Reservation:
    """A request admitted by the server but not yet handed to the engine."""
    __slots__ = ("held",)

    def __init__(self):
        self.held = True


# The reservation of the HTTP request whose context this is: generate() turns it into
# a queued add, so the request is counted once, without a gap, all the way from
# admission to its first scheduling.
_reservation: contextvars.ContextVar[_Reservation | None] = contextvars.ContextVar(
    "kvserve_reservation", default=None)


class EngineClient:
    """Subclasses provide start(), shutdown(), is_alive and _submit(command), and
    call _on_report / _on_dead as the engine answers."""

    def __init__(self, tokenizer, info: EngineInfo):
        self.tokenizer = tokenizer
        self.info = info  # what the engine said of itself when it was ready
        self.max_model_len, self.vocab_size = info.max_model_len, info.vocab_size
        # An embedding's length, and the shorter ones it may be cut to (ModelConfig).
        self.hidden_size, self.shorter_embeddings = info.hidden_size, info.shorter_embeddings
        self.structured_backend = info.structured_backend  # the front end checks specs
        self.adapters = Adapters(info.adapters, info.max_loras)  # LoRA's served names
        self.stats = ServingStats()
        # Steps still eager while the compiled forward pass is built (/ready says so).
        self.warming_up = info.warming_up
        # Guarded by _lock: reservations, adds not yet taken by the engine, and the
        # scheduler's queue lengths as of its last report.
        self._reserved = self._queued_adds = self._sched_waiting = self._sched_running = 0
        # Prompt tokens of requests queued but not yet answered once (the first output
        # comes after the prefill): what --max-waiting-tokens counts. Event loop only.
        self.waiting_prompt_tokens = 0
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        # Called with every report, on the thread that receives it (benchmarks and
        # step-level metrics listen here); they must be quick.
        self.report_listeners: list[Callable[[StepReport], None]] = []
        # Called, on that thread too, with each snapshot take_snapshot() asked for.
        self.snapshot_listener: Callable[[EngineSnapshot], None] | None = None

    # -- the transport (subclasses) --------------------------------------------------
    def start(self) -> None:
        raise NotImplementedError

    def shutdown(self, timeout: float = 5.0) -> None:
        raise NotImplementedError

    @property
    def is_alive(self) -> bool:
        raise NotImplementedError

    def _submit(self, command: EngineCommand) -> None:
        raise NotImplementedError

    # -- load ----------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return self._sched_running if self.error is None else 0

    @property
    def num_waiting(self) -> int:
        """Requests not yet scheduled: queued adds plus the scheduler's waiting queue."""
        with self._lock:
            return self._engine_waiting()

    def has_caller(self, request_id: str) -> bool:
        """Whether someone still reads this request's outputs: generate() drops its
        stream the moment its caller leaves, and an output then reaches nobody."""
        return request_id in self._streams

    @property
    def queue_depth(self) -> int:
        """num_waiting plus requests reserved by the server but not yet added: what an
        admission limit must count, or a burst would all pass before any is added."""
        with self._lock:
            return self._reserved + self._engine_waiting()

    def _engine_waiting(self) -> int:
        # A dead engine schedules nothing more: its last counts would hold a queue
        # that can never drain.
        return self._queued_adds + self._sched_waiting if self.error is None else 0

    @contextlib.contextmanager
    def reserve(self) -> Iterator[None]:
        """Counts the request run inside this block as waiting from now on; the first
        generate() in this context takes the reservation over."""
        slot = _Reservation()
        with self._lock:
            self._reserved += 1
        token = _reservation.set(slot)
        try:
            yield
        finally:
            _reservation.reset(token)
            with self._lock:
                if slot.held:
                    slot.held = False
                    self._reserved -= 1

    # -- the API used by the server ---------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, cache_salt: str | None = None,
                       priority: int = 0, lora_name: str | None = None,
                       background: bool = False) -> AsyncIterator[RequestOutput]:
        """Yields one output per step in which a sequence got tokens (for n > 1 the
        n sequences interleave; `index` tells them apart), until all n finished.
        Leaving the iteration early aborts whatever is unfinished. Check the request
        with validate() first (the server does, while it can still answer 400): one
        that the engine refuses raises ValueError here, a step later."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        stream: asyncio.Queue = asyncio.Queue()
        self._register(request_id, stream)
        self._queue_add(AddRequest(request_id, prompt_token_ids, params, cache_salt,
                                   priority, lora_name, background))
        unfinished = set(range(params.n))
        waiting = len(prompt_token_ids)  # counted until the first output
        self.waiting_prompt_tokens += waiting
        try:
            while unfinished:
                item = await stream.get()
                self.waiting_prompt_tokens -= waiting
                waiting = 0
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    unfinished.discard(item.index)
                yield item
        finally:
            self.waiting_prompt_tokens -= waiting
            if unfinished:
                self.abort(request_id)
            with self._lock:
                self._streams.pop(request_id, None)

    def _register(self, request_id: str, stream: asyncio.Queue) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = (loop, stream)
        if self.error is not None:  # died after the first check: _on_dead missed us
            with self._lock:
                self._streams.pop(request_id, None)
            raise EngineDeadError("the engine is not running")

    def _queue_add(self, add: AddRequest) -> None:
        with self._lock:  # one step from reserved to queued: never counted twice
            self._queued_adds += 1
            slot = _reservation.get()
            if slot is not None and slot.held:
                slot.held = False
                self._reserved -= 1
        self._submit(add)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams | None = None
                 ) -> None:
        """Raises ValueError for a request the engine can never run: the one check at
        this boundary (the engine itself keeps a guard, for offline use)."""
        check_request(prompt_token_ids, params, self.max_model_len, self.vocab_size)

    def abort(self, request_id: str, index: int | None = None,
              reason: str = "abort") -> None:
        """Ends the request's sequences, or only the one at `index`; reason "stop":
        the front end found a stop string (counted as a stop)."""
        if self.error is not None:
            return  # nothing runs any more; the request already got EngineDeadError
        try:
            self._submit(AbortRequest(request_id, index, reason))
        except EngineDeadError:
            # Called from cleanup (a generate() that ends): raising here would hide
            # the engine's death behind this error. The reader reports the death.
            pass

    async def change_adapter(self, name: str, path: str | None, replace: bool = False
                             ) -> None:
        """Loads (path) or unloads (None) a LoRA adapter once the engine has: raises
        ValueError for one it cannot serve, AdapterNotFoundError for an unload of
        one not loaded. replace: a load may take the name of a loaded adapter."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        command, done = self.adapters.request(name, path, replace)
        try:
            self._submit(command)
        except EngineDeadError:
            self.adapters.forget(command.op_id)
            raise
        await done

    def recent_finished(self) -> list[FinishedSequence]:
        with self._lock:  # the reports' thread appends under it
            return list(self.stats.recent_finished)

    def take_snapshot(self) -> None:
        """Asks the engine for a snapshot of its queues and KV cache, which comes to
        snapshot_listener with the engine's next report (the engine page's view)."""
        if self.error is None:
            self._submit(TakeSnapshot())

    def abort_all(self) -> int:
        """Aborts every request a generate() is waiting on (they end with finish
        reason "abort"); returns how many."""
        with self._lock:
            ids = list(self._streams)
        for rid in ids:
            self.abort(rid)
        return len(ids)

    # -- what the engine reports ------------------------------------------------------
    def _on_report(self, rep: StepReport) -> None:
        for listener in self.report_listeners:
            listener(rep)
        if rep.snapshot is not None and self.snapshot_listener is not None:
            self.snapshot_listener(rep.snapshot)
        self.adapters.on_report(rep)
        self.warming_up = rep.warming_up
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            self._queued_adds -= rep.added
            self._sched_waiting, self._sched_running = rep.waiting, rep.running
            self._count(rep)
            for rid, why in rep.rejected:
                self._route(batches, rid, ValueError(why))
            for out in rep.outputs:
                self._route(batches, out.request_id, out)
        # One wake-up of each event loop per step, not one per output: at hundreds
        # of streams, per-output wake-ups cost the loop (and the GIL) a lot.
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _count(self, rep: StepReport) -> None:
        stats = self.stats
        stats.prompt_tokens += rep.prompt_tokens
        stats.prefix_queries += rep.prefix_queries
        stats.prefix_hits += rep.prefix_hits
        stats.tier_hits += rep.tier_hits
        stats.preemptions += rep.preemptions
        stats.constrained_requests += rep.constrained
        stats.kv_usage = rep.kv_usage
        stats.steps += rep.step_start is not None
        stats.step_tokens += rep.step_tokens
        stats.prompt_tokens_computed += rep.prompt_tokens_computed
        if rep.spec is not None:
            stats.spec.add(rep.spec)
        for out in rep.outputs:
            # An embedding's step samples one token nobody gets: it generated nothing.
            pooled = out.embedding is not None
            stats.generation_tokens += 0 if pooled else len(out.new_token_ids)
            if out.finished:
                reason = out.finish_reason or "unknown"
                stats.finished[reason] = stats.finished.get(reason, 0) + 1
                generated = (out.times.num_generation_tokens
                             if out.times is not None and not pooled else 0)
                stats.recent_finished.append(FinishedSequence(
                    out.request_id, out.index, reason, generated, time.monotonic()))

    def _route(self, batches: dict, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            batches.setdefault(target[0], []).append((target[1], item))

    def _on_dead(self, exc: BaseException) -> None:
        """The engine is gone: fail every open request, never let one hang."""
        self.error = exc
        with self._lock:
            targets = list(self._streams.values())
        dead = EngineDeadError(f"engine loop died: {exc!r}")
        self.adapters.fail_all(dead)
        for loop, stream in targets:
            loop.call_soon_threadsafe(stream.put_nowait, dead)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for stream, item in items:
        stream.put_nowait(item)
