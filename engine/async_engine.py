"""The async front of the engine: the engine steps on its own thread, so the event
loop never waits on the model; each request gets an asyncio queue of outputs.

Commands (add, abort) cross to the engine thread through a thread-safe queue that
is drained at the start of every step, so an abort lands within one step."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from engine.engine import Engine
from engine.outputs import RequestOutput
from scheduler.sampling_params import SamplingParams

log = logging.getLogger("kvserve.async_engine")


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
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
        self._commands.put(("add", (request_id, prompt_token_ids, params, cache_salt, priority)))
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

    def validate(self, prompt_token_ids: list[int]) -> None:
        """Raises ValueError for a prompt the engine can never run."""
        self.engine.validate(prompt_token_ids)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    # -- the engine thread --------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                block = not self.engine.has_unfinished_requests()
                self._drain_commands(block)
                if self.engine.has_unfinished_requests():
                    self._publish(self.engine.step())
        except BaseException as exc:  # the engine is dead: fail everyone, never hang
            log.exception("engine loop died")
            self.error = exc
            self._fail_all(EngineDeadError(f"engine loop died: {exc!r}"))

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
                self._publish(self.engine.abort_request(arg))

    def _add(self, request_id, prompt, params, cache_salt, priority) -> None:
        try:
            self.engine.add_request(request_id, prompt, params, cache_salt=cache_salt,
                                    priority=priority)
        except ValueError as exc:
            self._deliver(request_id, exc)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._deliver(out.request_id, out)

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
