"""The async front of the engine: the engine steps on its own thread, so the event
loop never waits on the model; each request gets an asyncio queue of outputs.

Commands (add, abort) cross to the engine thread through a thread-safe queue that
is drained at the start of every step, so an abort lands within one step.

Load counts (waiting, running) and serving counters are written by the engine thread
after each command and step, so the event loop reads plain numbers and never walks
the scheduler's structures while the engine thread changes them."""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from engine.engine import Engine
from engine.outputs import RequestOutput
from scheduler.sampling_params import SamplingParams

log = logging.getLogger("kvserve.async_engine")


class EngineDeadError(RuntimeError):
    pass


@dataclass
class ServingStats:
    """Counters for /metrics. Only the engine thread writes them; a reader may see
    them one step stale, which is fine for counters."""
    prompt_tokens: int = 0  # prompt tokens of requests the engine accepted
    generation_tokens: int = 0
    # Sequences that ended, by finish reason (a stop string found by the front end
    # counts as "stop").
    finished: dict[str, int] = field(default_factory=dict)


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


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.stats = ServingStats()
        # Guarded by _lock: reservations, adds not yet drained, and the scheduler's
        # queue lengths as of the engine thread's last command or step.
        self._reserved = self._queued_adds = self._sched_waiting = self._sched_running = 0
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # -- load ----------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return self._sched_running if self.error is None else 0

    @property
    def num_waiting(self) -> int:
        """Requests not yet scheduled: queued adds plus the scheduler's waiting queue."""
        with self._lock:
            return self._engine_waiting()

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
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yields one output per step in which a sequence got tokens (for n > 1 the
        n sequences interleave; `index` tells them apart), until all n finished.
        Leaving the iteration early aborts whatever is unfinished."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        self.engine.validate(prompt_token_ids)  # ValueError before anything is queued
        ids = [request_id] + [f"{request_id}#{i}" for i in range(1, params.n)]
        stream: asyncio.Queue = asyncio.Queue()
        self._register(ids, stream)
        self._queue_add((request_id, prompt_token_ids, params, cache_salt, priority))
        unfinished = set(ids)
        try:
            while unfinished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    unfinished.discard(item.request_id)
                yield item
        finally:
            for rid in unfinished:
                self.abort(rid)
            with self._lock:
                for rid in ids:
                    self._streams.pop(rid, None)

    def _register(self, ids: list[str], stream: asyncio.Queue) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if any(rid in self._streams for rid in ids):
                raise ValueError(f"duplicate request id {ids[0]!r}")
            for rid in ids:
                self._streams[rid] = (loop, stream)
        if self.error is not None:  # died after the first check: _fail_all missed us
            with self._lock:
                for rid in ids:
                    self._streams.pop(rid, None)
            raise EngineDeadError("the engine is not running")

    def _queue_add(self, args: tuple) -> None:
        with self._lock:  # one step from reserved to queued: never counted twice
            self._queued_adds += 1
            slot = _reservation.get()
            if slot is not None and slot.held:
                slot.held = False
                self._reserved -= 1
        self._commands.put(("add", args))

    def validate(self, prompt_token_ids: list[int]) -> None:
        """Raises ValueError for a prompt the engine can never run."""
        self.engine.validate(prompt_token_ids)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """reason "stop": the front end found a stop string (counted as a stop)."""
        self._commands.put(("abort", (request_id, reason)))

    def abort_all(self) -> int:
        """Aborts every request a generate() is waiting on (they end with finish
        reason "abort"); returns how many."""
        with self._lock:
            ids = list(self._streams)
        for rid in ids:
            self.abort(rid)
        return len(ids)

    # -- the engine thread --------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                block = not self.engine.has_unfinished_requests()
                self._drain_commands(block)
                if self.engine.has_unfinished_requests():
                    self._publish(self.engine.step())
                    self._snapshot()
        except BaseException as exc:  # the engine is dead: fail everyone, never hang
            log.exception("engine loop died")
            self.error = exc
            self._fail_all(EngineDeadError(f"engine loop died: {exc!r}"))

    def _snapshot(self, added: int = 0) -> None:
        """Publishes the scheduler's queue lengths (engine thread only). `added` adds
        just moved from the command queue into the scheduler: both counts change
        under one lock, so a reader never sees the request in neither place."""
        sched = self.engine.scheduler
        waiting, running = len(sched.waiting), len(sched.running)
        with self._lock:
            self._queued_adds -= added
            self._sched_waiting, self._sched_running = waiting, running

    def _drain_commands(self, block: bool) -> None:
        while True:
            try:
                kind, arg = self._commands.get(block=block)
            except queue.Empty:
                return
            block = False
            if kind == "add":
                self._add(*arg)
            elif kind == "abort":
                self._publish(self.engine.abort_request(*arg))
                self._snapshot()

    def _add(self, request_id, prompt, params, cache_salt, priority) -> None:
        try:
            self.engine.add_request(request_id, prompt, params, cache_salt=cache_salt,
                                    priority=priority)
            self.stats.prompt_tokens += len(prompt)
        except ValueError as exc:
            self._deliver(request_id, exc)
        finally:
            self._snapshot(added=1)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        stats = self.stats
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for out in outputs:
                stats.generation_tokens += len(out.new_token_ids)
                if out.finished:
                    reason = out.finish_reason or "unknown"
                    stats.finished[reason] = stats.finished.get(reason, 0) + 1
                target = self._streams.get(out.request_id)
                if target is not None:
                    batches.setdefault(target[0], []).append((target[1], out))
        # One wake-up of each event loop per step, not one per output: at hundreds
        # of streams, per-output wake-ups cost the loop (and the GIL) a lot.
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            targets = list(self._streams.values())
        for loop, stream in targets:
            loop.call_soon_threadsafe(stream.put_nowait, exc)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for stream, item in items:
        stream.put_nowait(item)
