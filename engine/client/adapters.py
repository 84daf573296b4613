"""The server's view of the engine's LoRA adapters: which are served (name -> path,
changed only once the engine confirms a load or an unload), which running and
waiting requests use (for /metrics), and the loads and unloads still awaiting the
engine's answer."""
from __future__ import annotations

import asyncio
import itertools
import threading

from kvserve.engine.client.messages import AdapterReply, ChangeAdapter, StepReport


class AdapterNotFoundError(LookupError):
    """Unloading an adapter that is not loaded (a 404)."""


class Adapters:
    def __init__(self, served: dict[str, str] | None, max_loras: int = 0):
        """served: the adapters the engine started with; None: LoRA is off."""
        self.enabled = served is not None
        self.served: dict[str, str] = dict(served or {})
        self.max_loras = max_loras
        self.running: tuple[str, ...] = ()  # as of the last report
        self.waiting: tuple[str, ...] = ()
        self._ops = itertools.count(1)
        # op id -> (the waiting caller's loop, its future, what success changes)
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future,
                                       ChangeAdapter]] = {}
        self._lock = threading.Lock()

    def request(self, name: str, path: str | None, replace: bool = False
                ) -> tuple[ChangeAdapter, asyncio.Future]:
        """The command for a load (path) or an unload (None), and the future its
        reply settles."""
        command = ChangeAdapter(next(self._ops), name, path, replace)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._pending[command.op_id] = (loop, future, command)
        return command, future

    def forget(self, op_id: int) -> None:
        """A command that never reached the engine."""
        with self._lock:
            self._pending.pop(op_id, None)

    def on_report(self, rep: StepReport) -> None:
        """On the thread that receives the engine's reports."""
        self.running, self.waiting = rep.lora_running, rep.lora_waiting
        for reply in rep.adapter_replies:
            with self._lock:
                loop, future, command = self._pending.pop(reply.op_id)
                if reply.error is None:  # before the caller can read it
                    served = {n: p for n, p in self.served.items() if n != command.name}
                    if command.path is not None:
                        served[command.name] = command.path
                    # A new dict, never one changed in place: the event loop reads
                    # it without the lock.
                    self.served = served
            loop.call_soon_threadsafe(_settle, future, reply)

    def fail_all(self, exc: BaseException) -> None:
        """The engine died: nobody waits forever."""
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for loop, future, _ in pending:
            loop.call_soon_threadsafe(_fail, future, exc)


def _settle(future: asyncio.Future, reply: AdapterReply) -> None:
    if future.done():  # the caller gave up (cancelled)
        return
    if reply.error is None:
        future.set_result(None)
    elif reply.not_found:
        future.set_exception(AdapterNotFoundError(reply.error))
    else:
        future.set_exception(ValueError(reply.error))


def _fail(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
