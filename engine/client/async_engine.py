"""The engine on a thread of the server's process: the event loop never waits on the
model (torch releases the GIL in its kernels), and commands cross over through a
thread-safe queue drained at the start of every step, so an abort lands within one
step. The right choice on CPU; on a GPU, where a step is short next to the front
end's per-token work, see ProcessEngine (docs/architecture.md has the measurement)."""
from __future__ import annotations

import logging
import queue
import threading

from kvserve.engine.client.engine_client import EngineClient
from kvserve.engine.client.engine_loop import EngineLoop
from kvserve.engine.client.messages import EngineCommand, Shutdown
from kvserve.engine.core.engine import Engine

log = logging.getLogger("kvserve.async_engine")


class _QueueSource:
    def __init__(self):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()

    def take(self, wait: float | None) -> list[EngineCommand]:
        commands = []
        try:
            commands.append(self.queue.get(block=wait != 0, timeout=wait or None))
            while True:
                commands.append(self.queue.get_nowait())
        except queue.Empty:
            pass
        return commands


class AsyncEngine(EngineClient):
    def __init__(self, engine: Engine):
        super().__init__(engine.tokenizer, engine.info())
        self.engine = engine
        self._commands = _QueueSource()
        self._loop = EngineLoop(engine, self._commands, self._on_report)
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        engine.on_rank_death(lambda why: self._on_dead(RuntimeError(why)))

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._submit(Shutdown())
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def _submit(self, command: EngineCommand) -> None:
        self._commands.queue.put(command)

    def _run(self) -> None:
        try:
            self._loop.run()
        except BaseException as exc:  # the engine is dead: fail everyone, never hang
            log.exception("engine loop died")
            self._on_dead(exc)
        finally:
            self.engine.close()
