"""Stored responses (`store: true`, the default): what GET /v1/responses/{id} answers
and what previous_response_id continues. Held in this process's memory only, at most
--responses-store-max of them, each for --responses-store-ttl seconds: the oldest go
first, and a restart forgets them all (the README says so).

Each belongs to the key that made it (server/auth.py's owner tag): to any other key
it does not exist, for GET, DELETE and previous_response_id alike (404, the same
answer as for an id never made)."""
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
    owner: str  # the owner tag of the key that made it


class ResponseStore:
    def __init__(self, max_entries: int, ttl: float,
                 clock: Callable[[], float] = time.monotonic):
        self.max_entries, self.ttl, self._clock = max_entries, ttl, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, rid: str, body: dict, messages: list[dict], owner: str) -> None:
        if self.max_entries <= 0:
            return
        self._expire()
        self._entries[rid] = StoredResponse(body, messages, self._clock() + self.ttl, owner)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, rid: str, owner: str) -> StoredResponse | None:
        """The response if `owner` made it (else None, as for an unknown id)."""
        self._expire()
        entry = self._entries.get(rid)
        return entry if entry is not None and entry.owner == owner else None

    def delete(self, rid: str, owner: str) -> bool:
        if self.get(rid, owner) is None:
            return False
        del self._entries[rid]
        return True

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def _expire(self) -> None:
        """Entries expire in the order they were put (one TTL for all)."""
        now = self._clock()
        while self._entries and next(iter(self._entries.values())).expires <= now:
            self._entries.popitem(last=False)
