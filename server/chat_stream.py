"""A chat view's streamed deltas told in another API's events: the Responses API's
(server/responses/) and Anthropic's Messages (server/anthropic/) both run the chat
route's generation and differ only in the writer that turns a chat delta into their
events, so the relay loop lives here once."""
from __future__ import annotations

import contextlib

from kvserve.server.errors import APIError, sse_event


def typed_events(events: list[dict]) -> str:
    """Events as both APIs send them: an `event: <its type>` line, then its JSON."""
    return "".join(sse_event(e["type"], e) for e in events)


class DeltaRelay:
    """Relays an engine stream (generation.stream) through `writer.delta`. Once it has
    ended: `last`, the last delta (None if none came); `finish`, the finish reason;
    `error`, the APIError the stream ended with, or None."""

    def __init__(self):
        self.last = self.finish = self.error = None

    async def frames(self, view, writer, events):
        """The SSE text of each batch's events. Closing this generator closes
        `events`, which aborts what still runs: callers hold it in aclosing."""
        async with contextlib.aclosing(events):
            async for batch in events:
                self.error = batch.pop() if isinstance(batch[-1], APIError) else None
                out = []
                for d in batch:
                    self.last = d
                    for choice in view.chunk_choices(d):
                        out += writer.delta(choice["delta"])
                        self.finish = choice["finish_reason"] or self.finish
                if out:
                    yield typed_events(out)
                view.clock.sent(batch)
                if self.error is not None:
                    break
