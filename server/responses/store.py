"""Stored responses (`store: true`, the default): what GET /v1/responses/{id} answers
and what previous_response_id continues. Held in this process's memory only, at most
--responses-store-max of them, each for --responses-store-ttl seconds: the oldest go
first, and a restart forgets them all (the README says so)."""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    body: dict  # the response object as last sent
    messages: list[dict]  # the conversation it ends, as chat messages, its output included
    expires: float


class ResponseStore:
    def __init__(self, max_entries: int, ttl: float,
                 clock: Callable[[], float] = time.monotonic):
        self.max_entries, self.ttl, self._clock = max_entries, ttl, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, rid: str, body: dict, messages: list[dict]) -> None:
        if self.max_entries <= 0:
            return
        self._expire()
        self._entries[rid] = StoredResponse(body, messages, self._clock() + self.ttl)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, rid: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(rid)

    def delete(self, rid: str) -> bool:
        self._expire()
        return self._entries.pop(rid, None) is not None

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def _expire(self) -> None:
        """Entries expire in the order they were put (one TTL for all)."""
        now = self._clock()
        while self._entries and next(iter(self._entries.values())).expires <= now:
            self._entries.popitem(last=False)
