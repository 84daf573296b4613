"""Who watches the engine, and what they are sent.

While at least one watcher is connected, the hub asks the engine for a snapshot
every `interval` seconds (never a second one before the first has come back, so a
long step delays snapshots instead of queueing them), turns each into JSON once and
offers it to every watcher; the history's points go out as they are sampled. With
nobody connected the engine is asked nothing and no snapshot is built: the cost of
the engine page is next to nothing until it is opened (one look at each step's
outputs, for how each sequence ended: server/engine_view/endings.py, so the list of
those just finished is right the moment a page opens). Streams end with
`engine_dead` when the engine is gone and with `closing` once the server has
drained for shutdown.

A watcher that reads slowly never holds anyone up: it keeps only the newest
snapshot (older ones are dropped unread) and the points it has not read yet.

Each watcher is sent request ids as its key allows (server/auth.py): an admin key
(or anyone, without keys) sees every request's, another key its own requests' only
(server/request_owners.py); the snapshot is encoded once per kind of watcher."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from kvserve.engine.client.engine_client import EngineClient, EngineDeadError
from kvserve.engine.core.reports import EngineSnapshot
from kvserve.server.auth import ANONYMOUS, Principal
from kvserve.server.engine_view.endings import Endings
from kvserve.server.engine_view.history import EngineHistory
from kvserve.server.engine_view.snapshot_json import snapshot_json
from kvserve.server.errors import sse_event
from kvserve.server.request_owners import owner_of

log = logging.getLogger("kvserve.engine_view")

# At most two snapshots a second (htop redraws every 1.5 s): live to the eye, and
# cheap for a browser that shares the server's machine (bench/engine_page_overhead.py).
SNAPSHOT_SECONDS = 0.5
# A snapshot asked for and not back after this long (the request was lost with an
# engine that died, say) is asked for again.
SNAPSHOT_PATIENCE = 5.0


class Watcher:
    """One open stream: events waiting to be sent, as (event name, SSE text)."""

    def __init__(self, principal: Principal = ANONYMOUS):
        self.principal = principal
        self._snapshot: str | None = None
        self._others: list[tuple[str, str]] = []
        self._ready = asyncio.Event()

    def offer(self, event: str, text: str) -> None:
        if event == "snapshot":
            self._snapshot = text  # the newest replaces one not sent yet
        else:
            self._others.append((event, text))
        self._ready.set()

    async def next_events(self) -> list[tuple[str, str]]:
        await self._ready.wait()
        self._ready.clear()
        events, self._others = self._others, []
        if self._snapshot is not None:
            events.append(("snapshot", self._snapshot))
            self._snapshot = None
        return events


class EngineViewHub:
    def __init__(self, engine: EngineClient, history: EngineHistory,
                 interval: float = SNAPSHOT_SECONDS,
                 closing: Callable[[], str | None] = lambda: None):
        self.engine, self.history, self.interval = engine, history, interval
        # Why the streams should end now (the server has drained for shutdown), or
        # None. Checked with each history point: an open page must not hold up the
        # server's exit, which waits for every open response.
        self.closing = closing
        self.watchers: set[Watcher] = set()
        self.endings = Endings(engine)
        self.snapshots_taken = 0  # asked for and received (tests count them)
        self._poller: asyncio.Task | None = None
        self._sampler: asyncio.Task | None = None
        self._asked_at: float | None = None  # a snapshot asked for, not yet back
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- the app's lifetime ----------------------------------------------------
    def start(self) -> None:
        """On the server's event loop: the history's sampling starts."""
        self._loop = asyncio.get_running_loop()
        self._sampler = asyncio.ensure_future(self._sample_history())
        self.engine.report_listeners.append(self.endings)

    async def stop(self) -> None:
        if self.endings in self.engine.report_listeners:
            self.engine.report_listeners.remove(self.endings)
        for task in (self._sampler, self._poller):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    # -- watchers --------------------------------------------------------------
    def watch(self, principal: Principal = ANONYMOUS) -> Watcher:
        watcher = Watcher(principal)
        self.watchers.add(watcher)
        if self._poller is None:
            self.engine.snapshot_listener = self._on_snapshot
            self._poller = asyncio.ensure_future(self._ask_for_snapshots())
        return watcher

    def leave(self, watcher: Watcher) -> None:
        self.watchers.discard(watcher)
        if not self.watchers and self._poller is not None:
            self._poller.cancel()
            self._poller = None
            self.engine.snapshot_listener = None
            self._asked_at = None

    def _offer(self, event: str, payload: dict) -> None:
        data = sse_event(event, payload)  # encoded once, for every watcher
        for watcher in self.watchers:
            watcher.offer(event, data)

    # -- snapshots ---------------------------------------------------------------
    async def _ask_for_snapshots(self) -> None:
        while True:
            if not self.engine.is_alive:
                self._offer("engine_dead", {"error": "the engine is not running"})
                return
            now = time.monotonic()
            if self._asked_at is None or now - self._asked_at > SNAPSHOT_PATIENCE:
                self._asked_at = now
                try:
                    self.engine.take_snapshot()
                except EngineDeadError:
                    pass  # seen as not alive on the next round
            await asyncio.sleep(self.interval)

    def _on_snapshot(self, snapshot: EngineSnapshot) -> None:
        """On the thread that receives the engine's reports."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._publish, snapshot)

    def _publish(self, snapshot: EngineSnapshot) -> None:
        self._asked_at = None
        if not self.watchers:
            return
        self.snapshots_taken += 1
        finished, max_model_len = self.engine.recent_finished(), self.engine.max_model_len
        for principal in {w.principal for w in self.watchers}:
            data = sse_event("snapshot", snapshot_json(
                snapshot, finished, max_model_len, _shows(principal), self.endings))
            for watcher in [w for w in self.watchers if w.principal == principal]:
                watcher.offer("snapshot", data)

    # -- history -----------------------------------------------------------------
    async def _sample_history(self) -> None:
        while True:
            await asyncio.sleep(self.history.interval)
            point = self.history.sample()
            if self.watchers:
                self._offer("point", point)
                reason = self.closing()
                if reason is not None:
                    self._offer("closing", {"reason": reason})


def _shows(principal: Principal) -> Callable[[str], bool]:
    """Which engine ids a watcher of this key is shown."""
    if principal.sees_request_ids:
        return lambda request_id: True
    return lambda request_id: owner_of(request_id) == principal.owner
