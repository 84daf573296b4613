"""Graceful shutdown on SIGTERM / SIGINT.

uvicorn on its own stops listening at once and, after serving, re-raises the signal
(so the process dies of it rather than exiting 0). Here the first signal starts a
drain instead: new generation requests get 503 (the listener stays open so clients
are told, not refused), /health turns 503, and requests in flight run to the end for
up to `timeout` seconds. Then the rest are aborted (they end with finish reason
"abort") and uvicorn's normal shutdown closes connections and stops the engine.
A second signal skips the wait; a third exits without waiting for anything.

When the engine dies the server exits too (non-zero, see server/entrypoints/cli.py serve), after
answering its open requests with errors, so that a supervisor restarts it."""
from __future__ import annotations

import asyncio
import logging
from types import FrameType

import uvicorn

from kvserve.server.admission import Admission

log = logging.getLogger("kvserve.server")

ABORT_GRACE_S = 5.0  # after aborting: time for the aborted responses to be sent
# After the engine died: how long /health and new requests are answered 503 before
# the exit, so probes and retrying clients are told why rather than refused.
DEAD_ENGINE_LINGER_S = 1.0


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, admission: Admission, timeout: float = 30.0):
        super().__init__(config)
        self.admission = admission
        self.timeout = timeout
        self.signals = 0
        self.engine_died = False  # seen while serving; serve() then exits non-zero
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler may run between any two bytecodes of the event loop, so it
        # only sets flags; on_tick (on the loop, every 0.1 s) does the work. The signal is
        # deliberately not recorded in _captured_signals: uvicorn would re-raise it.
        self.signals += 1
        if self.signals > 2:  # someone really wants out: uvicorn's force exit
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        # Checked only while serving: the engine's normal stop comes after the last tick.
        self.engine_died = self.engine_died or self.admission.engine.error is not None
        if self._drain_task is None:
            if self.signals:
                self._drain_task = asyncio.create_task(self._drain())
            elif self.engine_died:
                self._drain_task = asyncio.create_task(self._engine_died())
        return await super().on_tick(counter)

    async def _engine_died(self) -> None:
        """A server whose engine is gone can serve nothing: its open requests have
        already been failed (503); once they are answered it exits, and serve()
        makes the exit code non-zero."""
        log.error("the engine died (%r): exiting once %d open request(s) are answered",
                  self.admission.engine.error, self.admission.in_flight)
        await asyncio.gather(self.admission.wait_idle(ABORT_GRACE_S),
                             asyncio.sleep(DEAD_ENGINE_LINGER_S))
        self.should_exit = True

    async def _drain(self) -> None:
        adm = self.admission
        adm.draining = True
        log.info("draining: %d request(s) in flight; waiting up to %gs", adm.in_flight,
                 self.timeout)
        if not await adm.wait_idle(self.timeout, give_up=lambda: self.signals > 1):
            n = adm.engine.abort_all()
            log.warning("shutdown: aborting %d request(s) still running", n)
            await adm.wait_idle(ABORT_GRACE_S)
        self.should_exit = True
