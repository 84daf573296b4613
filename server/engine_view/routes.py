"""GET /v1/engine/stream: the engine page's one live feed, as Server-Sent Events.

First a `hello` event (the served models, the snapshot and point intervals, and the
history so far), then `snapshot` events a few times a second and a `point` event
every second, until the client goes away; `engine_dead` (the engine is gone) and
`closing` (the server has drained for shutdown) end it. It is under
/v1, so with --api-key it needs the key (as /metrics does with --protect-metrics);
request ids are shown to an admin key, and to another key for its own requests
only (server/engine_view/hub.py)."""
from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from kvserve.server.auth import current_principal
from kvserve.server.engine_view.hub import EngineViewHub
from kvserve.server.errors import sse_event


ENDING_EVENTS = ("engine_dead", "closing")


def engine_view_router(hub: EngineViewHub, model_names: list[str]) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/engine/stream", include_in_schema=False)
    async def engine_stream():
        principal = current_principal()

        async def events() -> AsyncIterator[str]:
            watcher = hub.watch(principal)  # the first snapshot is asked for now
            try:
                yield sse_event("hello", {
                    "models": model_names, "snapshot_seconds": hub.interval,
                    "point_seconds": hub.history.interval,
                    "window_points": hub.history.points.maxlen,
                    "history": list(hub.history.points)})
                while True:
                    for name, text in await watcher.next_events():
                        yield text
                        if name in ENDING_EVENTS:
                            return
            finally:
                hub.leave(watcher)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})

    return router
